"""The layer target's every path (tests/support/layer_calls_for_memcheck.py) under
compute-sanitizer's memcheck: no out-of-bounds read or write, no launch error, for indices past
both ends, the layer found in place, index mode and slice mode's gathered alpha. Skipped
without a Hopper GPU or without compute-sanitizer."""
from __future__ import annotations

import pytest

from hopper import needs_sm90  # tests/support/hopper.py
from sanitizer import run_under_memcheck  # tests/support/sanitizer.py

pytestmark = [pytest.mark.gpu, pytest.mark.memcheck, needs_sm90]


def test_layer_calls_pass_memcheck():
    out = run_under_memcheck("layer_calls_for_memcheck.py")
    counts = [ln for ln in out.splitlines() if ln.startswith("layer target counts")]
    assert counts, out[-2000:]
    in_place, other = eval(counts[0].split(":")[1])  # noqa: S307 (our own printed tuple)
    assert in_place > 0 and other > 0, counts
