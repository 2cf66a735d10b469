"""The README's demo and the benchmark script run end to end (tiny sizes, CPU)."""
import json
import os
import pathlib
import subprocess
import sys

import pytest

import jax_blockscale as jbs

ROOT = pathlib.Path(__file__).resolve().parents[2]


def run(script, *args):
    # Run against the same jax_blockscale this test imported (installed or source tree).
    env = dict(os.environ, PYTHONPATH=str(pathlib.Path(jbs.__file__).parents[1]))
    out = subprocess.run([sys.executable, str(ROOT / script), *args], env=env, text=True,
                         capture_output=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def test_quickstart_prints_errors_in_line_with_the_format():
    out = run("examples/quickstart.py", "--m", "64", "--n", "128", "--k", "256",
              "--formats", "nvfp4,mxfp8_e4m3")
    rows = {tuple(line.split()[:2]): line.split()[2:] for line in out.splitlines()
            if line.startswith(("nvfp4", "mxfp8"))}
    quant_err = {key: float(v[0]) for key, v in rows.items()}
    gemm_err = {key: float(v[1]) for key, v in rows.items()}
    assert 0.05 < quant_err[("nvfp4", "weight-only")] < 0.2
    assert 0.01 < quant_err[("mxfp8_e4m3", "weight-only")] < 0.05
    assert max(gemm_err.values()) < 1e-5


def test_bench_writes_table_json_and_plot(tmp_path):
    out = run("benchmarks/bench_gemm.py", "--shapes", "16x256x256", "--formats", "mxfp4",
              "--out", str(tmp_path), "--tag", "t")
    data = json.loads((tmp_path / "t.json").read_text())
    row = data["rows"][0]
    assert row["M"] == 16 and row["reference_us"] > 0 and row["deq_dot_us"] > 0
    assert (tmp_path / "t.png").stat().st_size > 1000
    assert "reference" in out


def test_sweep_writes_both_tables_json_and_plot(tmp_path):
    out = run("benchmarks/sweep.py", "--quick", "--shapes", "16x256x256", "--formats", "nvfp4",
              "--out", str(tmp_path), "--tag", "s")
    row = json.loads((tmp_path / "s.json").read_text())["rows"][0]
    assert row["gemm_us"] > 0 and row["gemm_weight_only_us"] > 0 and row["bf16_dot_us"] > 0
    assert row.get("gemm_rel_err", 0.0) < 1e-2  # checked against the reference off CPU
    assert "PYTHON LOOP" in out  # the device-time table needs a GPU in the profiler trace
    assert (tmp_path / "s.png").stat().st_size > 1000


def _timing_module():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import timing
    finally:
        sys.path.pop(0)
    return timing


def test_device_time_counts_overlapping_kernels_once():
    union_length = _timing_module().union_length
    assert union_length([]) == 0
    assert union_length([(0, 10)]) == 10
    assert union_length([(5, 8), (0, 10), (20, 25)]) == 15  # nested, then a gap
    assert union_length([(0, 10), (10, 12), (11, 30)]) == 30  # touching and overlapping
    assert union_length([(3, 4), (0, 1)]) == 2  # unsorted input


def test_device_time_is_none_without_a_gpu_in_the_trace():
    import jax
    import jax.numpy as jnp
    if any(d.platform == "gpu" for d in jax.devices()):
        return  # covered by the GPU sweep runs
    timing = _timing_module()
    assert timing.device_time_us(jax.jit(lambda x: x * 2), jnp.ones(8), calls=2) is None


def test_device_time_on_a_gpu_with_an_empty_trace_says_why(monkeypatch):
    """On a GPU a trace without kernels (a process under ncu or nsys, which hold the profiling
    interface) raises, naming the likely cause, instead of a None the caller would divide by or
    drop silently."""
    timing = _timing_module()

    class Gpu:
        platform = "gpu"
    monkeypatch.setattr(timing, "gpu_kernel_events", lambda *args, **kw: [])
    monkeypatch.setattr(timing.jax, "devices", lambda *args: [Gpu()])
    with pytest.raises(RuntimeError, match=r"another profiler \(ncu, nsys\)"):
        timing.device_time_us(lambda x: x, 1.0)


def test_bench_sm90_runs_and_says_why_a_forced_path_cannot(tmp_path):
    out = run("benchmarks/bench_sm90.py", "--shapes", "16x128x256", "--formats", "w:nvfp4",
              "--paths", "default,registers", "--rounds", "1", "--json", str(tmp_path / "p.json"))
    row = json.loads((tmp_path / "p.json").read_text())["rows"][0]
    assert row["us"]["default"] > 0 and row["us"]["bf16_dot"] > 0
    assert row["rel_err_vs_reference"]["default"] < 1e-2
    import jax
    if not any(d.platform == "gpu" for d in jax.devices()):
        assert "registers" in row["errors"]  # sm90 does not run on the CPU: the row says why
    assert "default" in out


def test_bench_sm90_states_each_shape_s_crossover():
    """bench_sm90.crossovers: per format and weight shape, the faster path at each M and the
    last M up to which the kernels won without a loss before it (a later win does not count)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import bench_sm90
    finally:
        sys.path.pop(0)

    def row(fmt, m, n, kernels, dequant, default=None):
        r = dict(format=fmt, M=m, N=n, K=n, us=dict(kernels=kernels, dequant_dot=dequant),
                 plans={})
        if default:
            r["plans"]["default"] = default + " some_variant"
        return r

    rows = [row("w:mxfp8", 1536, 64, 14.0, 13.0, "sm90/dot_alpha"),
            row("w:mxfp8", 1024, 64, 9.0, 9.5, "sm90/register_weights"),
            row("w:mxfp8", 2048, 64, 17.0, 18.0),  # a win past a loss: not counted
            row("w:nvfp4", 1024, 64, 8.0, 9.0),
            dict(format="w:nvfp4", M=512, N=64, K=64, us=dict(kernels=5.0), plans={})]
    got = {(c["format"], c["N"]): c for c in bench_sm90.crossovers(rows)}
    assert set(got) == {("w:mxfp8", 64), ("w:nvfp4", 64)}
    mx = got[("w:mxfp8", 64)]
    assert mx["last_m_faster"] == 1024
    assert mx["per_m"] == ["1024: kernels (default: sm90/register_weights)",
                           "1536: dequant_dot (default: sm90/dot_alpha)", "2048: kernels"]
    assert got[("w:nvfp4", 64)]["last_m_faster"] == 1024  # the row without both paths: left out
    assert bench_sm90.crossovers([row("w:nvfp4", 64, 64, 2.0, 1.0)])[0]["last_m_faster"] is None


def test_e2e_decode_writes_steps_gemms_json_and_plot(tmp_path):
    """benchmarks/e2e_decode.py (tiny shapes, CPU): every variant's step, unrolled and scanned
    with layer=, one row per GEMM shape, rows and variant; the outputs agree in shape."""
    out = run("benchmarks/e2e_decode.py", "--tiny", "--scan", "--out", str(tmp_path))
    assert "| variant | layers | batch |" in out and "| GEMM | rows | variant |" in out
    data = json.loads((tmp_path / "e2e_decode_cpu.json").read_text())
    steps = {(r["variant"], r["mode"], r["batch"]) for r in data["steps"]}
    variants = ("bf16", "nvfp4", "nvfp4_w4a4", "nvfp4_w4a4_static", "mxfp4", "mxfp8")
    assert {(v, "unrolled", b) for v in variants for b in (1, 2)} <= steps
    assert {(v, "scan", b) for v in variants[1:] for b in (1, 2)} <= steps
    assert len(data["gemms"]) == 4 * 2 * len(variants)
    assert all(r["us"] > 0 and r["bytes"] > 0 for r in data["gemms"])
    assert (tmp_path / "e2e_decode_cpu.png").exists()


def test_e2e_decode_bound_from_a_saved_run(tmp_path):
    """--from-json recomputes the bound of a saved GPU run: the step with every GEMM kernel
    replaced by its read floor (layers x the four floors) and every other kernel kept."""
    kernels = [dict(kernel="kernel_cutlass_decode", us_per_step=600.0),
               dict(kernel="jbs_quantize_nvfp4_activation_cta", us_per_step=30.0),
               dict(kernel="loop_add_fusion", us_per_step=100.0)]
    steps = [dict(variant="bf16", mode="unrolled", batch=1, layers=2, us=2000.0, kernels=[]),
             dict(variant="nvfp4", mode="unrolled", batch=1, layers=2, us=800.0,
                  kernels=kernels),
             dict(variant="nvfp4", mode="scan", batch=1, layers=2, us=900.0, kernels=kernels),
             dict(variant="nvfp4_w4a4", mode="unrolled", batch=1, layers=2, us=900.0,
                  kernels=kernels)]
    floors = {"qkv": 10.0, "o": 20.0, "gate_up": 30.0, "down": 40.0}
    gemms = [dict(gemm=g, rows=1, variant="nvfp4", us=2 * f, read_floor_us=f, n=1, k=1,
                  bytes=1, over_floor=2.0, speedup_vs_bf16=1.0) for g, f in floors.items()]
    for r in steps:
        r.update(weight_TBps=1.0, pct_copy_bw=50.0, speedup_vs_bf16=2000.0 / r["us"])
    saved = tmp_path / "run.json"
    saved.write_text(json.dumps(dict(steps=steps, gemms=gemms)))
    out = run("benchmarks/e2e_decode.py", "--from-json", str(saved))
    # GEMM kernels 600 of 800 us; the other 200 (the quantizer counts as other) stay; the floors
    # give 2 layers x 100 us: bound 400 us, 5.00x bf16 against 2.50x now; one row (unrolled,
    # weight-only, with floors at its batch)
    rows = [line for line in out.splitlines() if line.startswith("| nvfp4 | 1 | 800 |")]
    assert rows == ["| nvfp4 | 1 | 800 | 600 | 200 | 200 | 400 | 2.50x | 5.00x | >= 3.2x |"]
