"""The Flax example runs end to end in smoke mode and prints its figures."""
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_flax_mlp_smoke():
    pytest.importorskip("flax")
    pytest.importorskip("optax")
    env = dict(os.environ, JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS", "cpu"),
               PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    run = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "flax_mlp.py"),
                          "--smoke"], capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    out = run.stdout
    names = ["bf16", "nvfp4 W4A4 static", "nvfp4 W4A4", "nvfp4 W4A16", "mxfp8 W8A8",
             "mxfp8 W8A16"]
    rows = dict(re.findall(rf"^({'|'.join(names)})\s+([0-9.]+\s+[0-9.]+\s+[0-9.]+)$", out,
                           re.M))
    assert set(rows) == set(names), out
    figures = {k: [float(v) for v in row.split()] for k, row in rows.items()}
    bf16_acc = figures["bf16"][0]
    assert bf16_acc > 0.3, out  # it learned something (10 classes: chance is 0.1)
    for name, (acc, agree, err) in figures.items():
        if name == "bf16":
            continue
        assert acc > bf16_acc - 0.1 and agree > 0.8 and 0 < err < 0.3, (name, out)
    # finer formats are closer to bf16
    assert figures["mxfp8 W8A8"][2] < figures["nvfp4 W4A4"][2], out
    assert "on disk:" in out
