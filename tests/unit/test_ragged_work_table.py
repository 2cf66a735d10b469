"""The grouped sm90 kernels' work table (lowering/ragged_sm90.py: work_items) and the clamped
group sizes it is built from (lowering/ragged_reference.py: clamp_group_sizes), against plain Python loops on
random sizes: empty groups, one group holding every row, sizes past M, negative sizes and a
shifted first row (an expert-parallel shard). The grouped decode kernel makes the same entries
from the raw sizes on the device (kernels/grouped_work.py); tests/gpu/test_ragged_sm90.py checks
its results against the reference on such sizes."""
from __future__ import annotations

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from jax_blockscale.catalog import sm90 as cat
from jax_blockscale.lowering.ragged_sm90 import ZERO_ITEM, work_items
from jax_blockscale.lowering.ragged_reference import clamp_group_sizes, prefix_sum


def _clamped(sizes, m, row_start):
    out, at = [], min(max(row_start, 0), m)
    for s in sizes:
        take = min(max(s, 0), m - at)
        out.append(take)
        at += take
    return out


def _table(sizes, row_start, m, rows, num_items):
    """What the kernels expect: each expert's rows in items of at most `rows`, in order, then
    the rows no expert owns ([0, row_start), then [row_start + sum, M)) as zero items of at most
    `rows` rows, then entries with no rows (expert -2)."""
    entries, at = [], row_start
    for g, s in enumerate(sizes):
        for r0 in range(at, at + s, rows):
            entries.append((g, r0, min(r0 + rows, at + s)))
        at += s
    for lo, hi in ((0, row_start), (at, m)):
        entries += [(ZERO_ITEM, r0, min(r0 + rows, hi)) for r0 in range(lo, hi, rows)]
    assert len(entries) <= num_items
    return entries + [(-2, 0, 0)] * (num_items - len(entries))


@pytest.mark.parametrize("seed", range(20))
def test_work_table_matches_a_loop(seed):
    rng = np.random.default_rng(seed)
    groups = int(rng.choice([1, 3, 8, 32, 128]))
    m = int(rng.integers(1, 700))
    rows = int(rng.choice([8, 16, 32, 64, 128]))
    kind = seed % 5
    if kind == 0:  # random routing, some rows past the sum
        sizes = np.bincount(rng.integers(0, groups, max(m - 5, 0)), minlength=groups)
    elif kind == 4:  # a dispatched shard's receive buffer: about half its rows routed
        sizes = np.bincount(rng.integers(0, groups, m // 2), minlength=groups)
    elif kind == 1:  # one group holds every row
        sizes = np.zeros(groups, np.int64)
        sizes[rng.integers(groups)] = m
    elif kind == 2:  # out of range: negative, past M
        sizes = rng.integers(-m, 2 * m, groups)
    else:  # empty
        sizes = np.zeros(groups, np.int64)
    row_start = int(rng.integers(0, m)) if seed % 3 == 0 else 0
    safe = _clamped(sizes.tolist(), m, row_start)
    got_safe = clamp_group_sizes(jnp.asarray(sizes, jnp.int32), m, row_start)
    np.testing.assert_array_equal(np.asarray(got_safe), safe)
    num_items = cat.ragged_items(m, groups, rows)
    got = jax.jit(work_items, static_argnums=(2, 3, 4))(
        got_safe, jnp.int32(row_start), m, rows, num_items)
    assert got.dtype == jnp.int32 and got.shape == (num_items, 3)
    np.testing.assert_array_equal(np.asarray(got), _table(safe, row_start, m, rows, num_items))


def test_prefix_sum():
    x = jnp.asarray(np.random.default_rng(0).integers(-5, 50, 300), jnp.int32)
    np.testing.assert_array_equal(np.asarray(prefix_sum(x)), np.cumsum(np.asarray(x)))
    big = jnp.ones((3000,), jnp.int32)  # the long form
    np.testing.assert_array_equal(np.asarray(prefix_sum(big)), np.arange(1, 3001))
