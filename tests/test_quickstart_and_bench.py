"""The README's demo and the benchmark script run end to end (tiny sizes, CPU)."""
import json
import os
import pathlib
import subprocess
import sys

import jax_blockscale as jbs

ROOT = pathlib.Path(__file__).resolve().parents[1]


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
