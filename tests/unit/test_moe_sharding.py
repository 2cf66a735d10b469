"""MoE on a 2-device mesh (8 forced CPU devices): ragged_gemm with its experts, N or K split and
the QuantizedMoE layer expert parallel, tensor parallel (N of both weights) and Megatron-style
(gate_up on N, down on K), under jax.jit, equal the unsharded call (bit for bit where no partial
sums are added), with exactly the expected collectives and no expert weight moved. The checks
live in tests/support/moe_multi_device.py; tests/gpu/test_moe_multi_gpu.py runs them on 2 GPUs.

As tests/unit/test_sharding.py: other test modules import jax with one device and XLA reads the
device count once per process, so the checks run in child pytests (`JBS_MOE_SHARDING_CHILD=1`,
8 host devices), one with Shardy and one with GSPMD, beside a smoke run of
examples/moe_sharded.py; the parent's tests start the children and report their output.
"""
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CHILD = os.environ.get("JBS_MOE_SHARDING_CHILD") == "1"
FORMATS = ("nvfp4", "mxfp4")  # NVFP4 (per-expert global scales) and one MX format


if not CHILD:
    def _start(argv, env_extra):
        env = dict(os.environ, JAX_PLATFORMS="cpu",
                   PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
                   **env_extra)
        return subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)

    CHILD_PYTEST = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                    str(Path(__file__).relative_to(ROOT))]
    CHILD_ENV = {"JBS_MOE_SHARDING_CHILD": "1",
                 "XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
    JOBS = {
        "shardy": (CHILD_PYTEST, dict(CHILD_ENV, JBS_PARTITIONER="shardy")),
        "gspmd": (CHILD_PYTEST, dict(CHILD_ENV, JBS_PARTITIONER="gspmd")),
        # the example forces its own 2 host devices
        "example": ([sys.executable, "examples/moe_sharded.py", "--smoke"], {"XLA_FLAGS": ""}),
    }

    @pytest.fixture(scope="module")
    def children():
        # Start every child at once: each is mostly single-threaded compilation.
        procs = {name: _start(argv, env) for name, (argv, env) in JOBS.items()}
        yield procs
        for p in procs.values():
            if p.poll() is None:
                p.kill()

    def _finish(proc, timeout=600):
        try:
            out, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
            pytest.fail(f"timed out after {timeout} s:\n{out[-6000:]}")
        return proc.returncode, out

    @pytest.mark.parametrize("partitioner", ["shardy", "gspmd"])
    def test_moe_sharding_on_cpu_devices(children, partitioner):
        rc, out = _finish(children[partitioner])
        assert rc == 0, f"child pytest ({partitioner}) failed:\n{out[-12000:]}"
        assert " passed" in out and "skipped" not in out, out[-3000:]

    def test_moe_sharded_example_smoke(children):
        rc, out = _finish(children["example"])
        assert rc == 0, out[-6000:]
        assert "2 cpu devices" in out, out
        lines = {line.split(":")[0].strip(): line for line in out.splitlines() if ":" in line}
        # expert and N-split placements are bit for bit; each prints its collectives
        for placement in ("expert parallel", "tensor parallel"):
            assert "bitwise equal: yes" in lines[placement], out
        assert "all-reduce" in lines["expert parallel collectives"], out
        assert "all-gather" not in lines["expert parallel collectives"], out
        assert "all-reduce" in lines["tensor parallel, down on K collectives"], out
        assert out.count("expert weights moved: none") == 3, out  # one per placement

else:
    import jax

    import moe_multi_device as mmd  # tests/support (conftest puts it on sys.path)

    SHARDY = os.environ.get("JBS_PARTITIONER", "shardy") == "shardy"
    if hasattr(jax.config, "jax_use_shardy_partitioner"):
        jax.config.update("jax_use_shardy_partitioner", SHARDY)
    elif not SHARDY:
        pytest.skip("this JAX has no GSPMD switch", allow_module_level=True)
    DEVICES = jax.devices("cpu")
    assert len(DEVICES) == 8, DEVICES

    @pytest.mark.parametrize("fmt", FORMATS)
    @pytest.mark.parametrize("case", list(mmd.RAGGED_CASES))
    def test_ragged_gemm_split(case, fmt):
        found = mmd.check_ragged(DEVICES, case, fmt)
        print(f"ragged {case} {fmt}: {mmd.summary(found)}")

    @pytest.mark.parametrize("fmt", FORMATS)
    @pytest.mark.parametrize("case", list(mmd.LAYER_CASES))
    def test_moe_layer_parallel(case, fmt):
        found = mmd.check_layer(DEVICES, case, fmt)
        print(f"layer {case} {fmt}: {mmd.summary(found)}")

    def test_moe_layer_w4a4_megatron():
        """NVFP4 activations calibrate one global scale per call: with the activation split on
        K its amax is one scalar all-reduce; the elements stay split."""
        found = mmd.check_layer(DEVICES, "tensor_k", "nvfp4", act_fmt="nvfp4")
        assert [r for c in found if c.name == "all-reduce" for r in c.results
                if r[1] == ()], mmd.summary(found)

    def test_hlo_check_catches_a_gathered_weight():
        msg = mmd.check_catches_weight_gather(DEVICES)
        assert "expert weight" in msg or "more than any activation" in msg, msg
