"""The layer target's every path (tests/support/layer_calls_for_memcheck.py) under
compute-sanitizer's memcheck: no out-of-bounds read or write, no launch error, for indices past
both ends, the layer found in place, index mode and slice mode's gathered alpha. Skipped
without a Hopper GPU or without compute-sanitizer."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from hopper import needs_sm90  # tests/support/hopper.py

pytestmark = [pytest.mark.gpu, needs_sm90]

SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "support",
                      "layer_calls_for_memcheck.py")


def test_layer_calls_pass_memcheck():
    tool = shutil.which("compute-sanitizer") or next(
        (p for p in ("/usr/local/cuda/bin/compute-sanitizer",) if os.path.exists(p)), None)
    if tool is None:
        pytest.skip("compute-sanitizer not installed")
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false",
               XLA_FLAGS=os.environ.get("XLA_FLAGS", "") + " --xla_gpu_autotune_level=0")
    r = subprocess.run([tool, "--tool", "memcheck", "--error-exitcode", "3", sys.executable,
                        SCRIPT], capture_output=True, text=True, env=env, timeout=1200)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    assert "ERROR SUMMARY: 0 errors" in out, out[-4000:]
    counts = [ln for ln in out.splitlines() if ln.startswith("layer target counts")]
    assert counts, out[-2000:]
    in_place, other = eval(counts[0].split(":")[1])  # noqa: S307 (our own printed tuple)
    assert in_place > 0 and other > 0, counts
