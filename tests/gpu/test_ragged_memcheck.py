"""Both sm90 grouped kernels of ragged_gemm (tests/support/ragged_calls_for_memcheck.py) under
compute-sanitizer's memcheck: no out-of-bounds read or write and no launch error for group sizes
that are negative, run past M or leave rows to no group, and for a shifted first row. Skipped
without a Hopper GPU or without compute-sanitizer."""
from __future__ import annotations

import pytest

from hopper import needs_sm90  # tests/support/hopper.py
from sanitizer import run_under_memcheck  # tests/support/sanitizer.py

pytestmark = [pytest.mark.gpu, pytest.mark.memcheck, needs_sm90]


def test_ragged_calls_pass_memcheck():
    out = run_under_memcheck("ragged_calls_for_memcheck.py")
    for mode in ("decode", "prefill", "decode3", "prefill32", "prefill8"):
        assert sum(ln.startswith(mode + " ") for ln in out.splitlines()) == 5, out[-3000:]
