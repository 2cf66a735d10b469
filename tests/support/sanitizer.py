"""Run one of the support scripts under compute-sanitizer (the GPU memory checker) and return
its output; the test is skipped where the tool is not installed."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

SUPPORT = os.path.dirname(os.path.abspath(__file__))


def run_under_memcheck(script: str, timeout: int = 1200) -> str:
    """`compute-sanitizer --tool memcheck python support/<script>`: asserts a clean exit and
    "0 errors" (no out-of-bounds or misaligned access, no launch error) and returns the output."""
    tool = shutil.which("compute-sanitizer") or next(
        (p for p in ("/usr/local/cuda/bin/compute-sanitizer",) if os.path.exists(p)), None)
    if tool is None:
        pytest.skip("compute-sanitizer not installed")
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false",
               XLA_FLAGS=os.environ.get("XLA_FLAGS", "") + " --xla_gpu_autotune_level=0")
    r = subprocess.run([tool, "--tool", "memcheck", "--error-exitcode", "3", sys.executable,
                        os.path.join(SUPPORT, script)], capture_output=True, text=True, env=env,
                       timeout=timeout)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    assert "ERROR SUMMARY: 0 errors" in out, out[-4000:]
    return out
