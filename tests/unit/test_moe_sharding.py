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
import json
import os
import re
import sys
import tempfile

import pytest

from child_runs import finish, pytest_argv, start_all, use_partitioner  # tests/support

CHILD = os.environ.get("JBS_MOE_SHARDING_CHILD") == "1"
FORMATS = ("nvfp4", "mxfp4")  # NVFP4 (per-expert global scales) and one MX format


if not CHILD:
    CHILD_PYTEST = pytest_argv(__file__)
    CHILD_ENV = {"JBS_MOE_SHARDING_CHILD": "1"}
    BENCH_OUT = tempfile.mkdtemp(prefix="jbs_moe_sharded_")
    JOBS = {
        "shardy": (CHILD_PYTEST, dict(CHILD_ENV, JBS_PARTITIONER="shardy")),
        "gspmd": (CHILD_PYTEST, dict(CHILD_ENV, JBS_PARTITIONER="gspmd")),
        # the example forces its own 2 host devices
        "example": ([sys.executable, "examples/moe_sharded.py", "--smoke"], {"XLA_FLAGS": ""}),
        "bench": ([sys.executable, "benchmarks/bench_moe_sharded.py", "--smoke", "--devices",
                   "2", "--out", BENCH_OUT],
                  {"XLA_FLAGS": "--xla_force_host_platform_device_count=2"}),
    }

    @pytest.fixture(scope="module")
    def children():
        yield from start_all(JOBS)

    @pytest.mark.parametrize("partitioner", ["shardy", "gspmd"])
    def test_moe_sharding_on_cpu_devices(children, partitioner):
        rc, out = finish(children[partitioner])
        assert rc == 0, f"child pytest ({partitioner}) failed:\n{out[-12000:]}"
        assert " passed" in out and "skipped" not in out, out[-3000:]

    def test_moe_sharded_example_smoke(children):
        rc, out = finish(children["example"])
        assert rc == 0, out[-6000:]
        assert "2 cpu devices" in out, out
        lines = {line.split(":")[0].strip(): line for line in out.splitlines() if ":" in line}
        # expert, dispatched and N-split placements are bit for bit; each prints its collectives
        for placement in ("expert parallel", "tensor parallel", "expert parallel, dispatched"):
            assert "bitwise equal: yes" in lines[placement], out
        assert "all-reduce" in lines["expert parallel collectives"], out
        assert "all-gather" not in lines["expert parallel collectives"], out
        assert "all-reduce" in lines["tensor parallel, down on K collectives"], out
        dispatched = lines["expert parallel, dispatched collectives"]
        assert "all-to-all" in dispatched and "all-reduce" not in dispatched, out
        # its one all-gather is of the (devices, experts) int32 row counts; no rows gathered
        assert re.findall(r"all-gather (\w+\[[\d,]*\])", dispatched) == ["s32[2,8]"], out
        # the reduce layer: one f32 all-reduce of the (tokens, hidden) shares, nothing else
        reduced = lines["expert parallel, reduce collectives"]
        assert re.findall(r"(all-\w+|reduce-scatter|collective-permute) (\w+\[[\d,]*\])",
                          reduced) == [("all-reduce", "f32[16,256]")], out
        # the paired tensor-parallel layer: the same one all-reduce, within a bf16 step
        paired = lines["tensor parallel, paired collectives"]
        assert re.findall(r"(all-\w+|reduce-scatter|collective-permute) (\w+\[[\d,]*\])",
                          paired) == [("all-reduce", "f32[16,256]")], out
        diff = float(re.search(r"max \|sharded - unsharded\| ([\d.e+-]+) \(output max ([\d.e+-]+)",
                               lines["tensor parallel, paired"]).group(1))
        assert diff <= 2.0 ** -6, out
        assert out.count("expert weights moved: none") == 6, out  # one per placement

    def test_moe_sharded_benchmark_smoke(children):
        """benchmarks/bench_moe_sharded.py on 2 CPU devices: every placement's row with its
        difference to one device (0 for expert, dispatch and tensor parallel), collectives,
        and a plot."""
        rc, out = finish(children["bench"])
        assert rc == 0, out[-6000:]
        with open(os.path.join(BENCH_OUT, "bench_moe_sharded_cpu.json")) as f:
            rows = json.load(f)["rows"]
        assert os.path.getsize(os.path.join(BENCH_OUT, "bench_moe_sharded_cpu.png")) > 0
        placed = {(r["fmt"], r["tokens"], r["placement"], r["devices"]): r for r in rows}
        assert len(placed) == 2 * 2 * 7, sorted(placed)  # formats x tokens x placements
        for (fmt, tokens, placement, n), r in placed.items():
            assert "error" not in r and "skipped" not in r, r
            assert r["loop_us"] > 0
            if placement in ("expert", "tensor"):
                assert r["max_abs_diff_vs_1_device"] == 0, r
                assert r["differing_outputs"] == dict(layer=0, gate_up=0, down=0), r
            if placement == "dispatch":
                assert r["differing_outputs"] == dict(layer=0), r
                assert "all-to-all" in r["collectives"], r
                assert "all-reduce" not in r["collectives"], r
            elif placement in ("reduce", "tensor_layer"):  # the shares: one f32 all-reduce
                assert r["collectives"] == f"all-reduce f32[{tokens},256] x1", r
                assert r["max_abs_diff_vs_1_device"] <= 2.0 ** -6, r
            elif placement != "1 device":
                assert "all-reduce" in r["collectives"] or "all-gather" in r["collectives"], r

else:
    import jax

    import moe_multi_device as mmd  # tests/support (conftest puts it on sys.path)

    use_partitioner()
    DEVICES = jax.devices("cpu")
    assert len(DEVICES) == 8, DEVICES

    @pytest.mark.parametrize("fmt", FORMATS)
    @pytest.mark.parametrize("case", list(mmd.RAGGED_CASES))
    def test_ragged_gemm_split(case, fmt):
        found = mmd.check_ragged(DEVICES, case, fmt)
        print(f"ragged {case} {fmt}: {mmd.summary(found)}")

    def test_shards_plan_as_the_unsharded_call():
        print(mmd.check_shards_plan_as_unsharded(DEVICES))

    @pytest.mark.parametrize("fmt", FORMATS)
    @pytest.mark.parametrize("case", list(mmd.LAYER_INDEX_CASES))
    def test_layer_index_split(case, fmt):
        mmd.check_layer_index(DEVICES, case, fmt)

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

    @pytest.mark.parametrize("fmt", FORMATS)
    def test_expert_shardings_follow_each_weights_spec(fmt):
        """jnn.expert_shardings on a 2-device mesh, for the placements the layer tests use and
        one whose tiles do not divide: elements on the given spec, blocked scales on their row
        and K-block tiles (replicated where the tiles do not split evenly), a per-expert
        global scale on the expert axis, the router replicated; a float weight is refused."""
        from jax.sharding import Mesh, PartitionSpec as P
        from jax_blockscale import nn as jnn
        from flax import nnx

        mesh = Mesh(DEVICES[:2], ("d",))
        layer = mmd.moe_layer(fmt)
        state = nnx.state(layer)
        nvfp4 = fmt == "nvfp4"
        gs = (lambda spec: spec) if nvfp4 else (lambda spec: None)  # NVFP4: per-expert scales
        cases = {  # gate_up spec, down spec -> want (data, scales, global scale) per weight
            "experts": ((P("d"), P("d")),
                        [(P("d", None, None), P("d", None, None, None, None, None), gs(P("d")))]
                        * 2),
            "tensor_k": ((P(None, "d"), P(None, None, "d")),
                         [(P(None, "d", None), P(None, "d", None, None, None, None), gs(P(None))),
                          (P(None, None, "d"), P(None, None, "d", None, None, None),
                           gs(P(None)))]),
        }
        for name, ((gu_spec, down_spec), want) in cases.items():
            shardings = jnn.expert_shardings(state, mesh, gate_up=gu_spec, down=down_spec)
            for weight, (data, scales, global_scale) in zip(("gate_up", "down"), want):
                got = shardings[weight].get_value()
                assert got.data.spec == data, (name, weight, got.data.spec)
                assert got.scales.spec == scales, (name, weight, got.scales.spec)
                if global_scale is None:
                    assert got.global_scale is None, (name, weight)
                else:
                    assert got.global_scale.spec == global_scale, (name, weight,
                                                                   got.global_scale.spec)
            assert shardings["router"].get_value().spec == P(), name
            placed = jax.device_put(state, shardings)
            assert placed["gate_up"].get_value().data.sharding.spec == want[0][0], name
        # down's K = 256: split over 2 devices in whole 4-block scale tiles, but not over 8
        mesh8 = Mesh(DEVICES, ("d",))
        down = jnn.expert_shardings(state, mesh8, gate_up=P(), down=P(None, None, "d"))["down"]
        k_tiles = 256 // (16 if nvfp4 else 32) // 4
        want_k = "d" if k_tiles % 8 == 0 else None
        assert down.get_value().scales.spec == P(None, None, want_k, None, None, None)
        with pytest.raises(TypeError, match="gate_up holds"):
            jnn.expert_shardings({"gate_up": jax.numpy.ones((2, 4, 4)), "router": 0}, mesh,
                                 gate_up=P("d"), down=P("d"))
