"""The decode kernel's split partials added by gemm's lowering (lowering/ffi_sm90.py:
add_split_partials): in split order from +0.0, times alpha, then converted. That is the finalize
kernel's arithmetic, so a call that leaves its partials to the lowering and one whose kernel adds
them (the layer target) give the same bits; the GPU tests compare the two paths themselves."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_blockscale.lowering.ffi_sm90 import add_split_partials, leaves_partials


def _sequential(parts, alpha):
    total = np.zeros(parts.shape[1:], np.float32)
    for p in parts:
        total = (total + p).astype(np.float32)
    return (total * np.float32(alpha)).astype(np.float32)


@pytest.mark.parametrize("splits", [2, 3, 8, 33])
def test_partials_are_added_in_split_order(splits):
    rng = np.random.default_rng(splits)
    shape = (2, 3, 50)
    # magnitudes 1e-3 .. 1e7: every other order of the additions rounds differently somewhere
    parts = (rng.standard_normal((splits,) + shape)
             * 10.0 ** rng.integers(-3, 8, (splits,) + shape)).astype(np.float32)
    alpha = np.float32(0.3)
    ws = np.concatenate([parts.ravel(), rng.standard_normal(7).astype(np.float32)])  # + slack
    want = _sequential(parts, alpha)
    if splits > 2:  # the data tells the orders apart (two addends commute)
        assert not np.array_equal(want, _sequential(parts[::-1], alpha))
    f = jax.jit(lambda ws, a: add_split_partials(ws, splits, shape, a, jnp.float32))
    got = np.asarray(f(jnp.asarray(ws), jnp.asarray(alpha)))
    np.testing.assert_array_equal(got, want)


def test_alpha_is_applied_before_the_conversion():
    parts = np.array([[1.0 + 2.0 ** -9], [2.0 ** -9]], np.float32)  # sum 1 + 2^-8
    got = add_split_partials(jnp.asarray(parts.ravel()), 2, (1,), jnp.float32(3.0), jnp.bfloat16)
    # (1 + 2^-8) * 3 = 3.01171875 rounds to bf16 3.015625; 3 * bf16(1 + 2^-8) would give 3.0
    assert got.dtype == jnp.bfloat16 and float(got[0]) == 3.015625


def test_only_split_plans_leave_their_partials():
    class Plan:
        def __init__(self, kernel, splits):
            self.kernel, self.splits = kernel, splits
    assert leaves_partials(Plan("decode", 2)) and leaves_partials(Plan("ragged_decode", 3))
    assert leaves_partials(Plan("register_weights", 2))
    assert not leaves_partials(Plan("decode", 1)) and not leaves_partials(Plan("ragged_decode", 1))
    assert not leaves_partials(Plan("register_weights", 0))
    assert not leaves_partials(Plan("ragged_prefill", 0))
    assert not leaves_partials(Plan("fused", 0))
