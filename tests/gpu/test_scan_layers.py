"""Scanned layers on the sm90 backend: `lax.scan` over a stacked weight gives each layer's result
bit for bit as a per-layer call does; an 8-bit weight's slice reaches the kernel in place (XLA's
dynamic-slice fusion of the custom call). FP4 slices are still copied first (XLA does not fuse
sub-byte dynamic slices; docs/design/scanned_layers.md), which the test records; a scan that
passes the stack and the index to `gemm(..., layer=i)` makes no slice at all
(tests/gpu/test_layer_gemm_sm90.py).
"""
from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_blockscale as jbs
from hopper import needs_sm90  # tests/support/hopper.py

pytestmark = [pytest.mark.gpu, needs_sm90]

LAYERS, N = 4, 1024


def _stack(fmt, seed):
    w = np.random.default_rng(seed).standard_normal((LAYERS, N, N)).astype(np.float32) * 0.05
    kw = dict(global_scale="per_matrix") if fmt == "nvfp4" else {}
    return jbs.quantize(jnp.asarray(w), fmt, layout="blocked", **kw)


def _layer(x, w):
    return jnp.tanh(jbs.gemm(x, w, out_dtype=jnp.float32)).astype(jnp.bfloat16)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4", "mxfp8_e4m3"])
@pytest.mark.parametrize("rows", [1, 16, 128])
def test_scan_matches_per_layer_calls(fmt, rows):
    w = _stack(fmt, seed=rows)
    x = jnp.asarray(np.random.default_rng(7).standard_normal((rows, N)), jnp.bfloat16)
    scanned = jax.jit(lambda x, w: jax.lax.scan(lambda x, wl: (_layer(x, wl), None), x, w)[0])
    want = x
    for i in range(LAYERS):
        want = jax.jit(_layer)(want, w[i])
    np.testing.assert_array_equal(np.asarray(scanned(x, w), np.float32),
                                  np.asarray(want, np.float32))


@pytest.mark.parametrize("fmt", [
    "mxfp8_e4m3",
    pytest.param("nvfp4", marks=pytest.mark.xfail(strict=True, reason="XLA copies sub-byte "
                                                  "dynamic slices (docs/design/scanned_layers.md)")),
    pytest.param("mxfp4", marks=pytest.mark.xfail(strict=True, reason="as nvfp4")),
])
def test_scan_hands_the_weight_slice_over_in_place(fmt):
    """The element slice of the stacked weight is taken inside the custom call's dynamic-slice
    fusion (an address offset), not materialized by a separate copy."""
    w = _stack(fmt, seed=1)
    x = jnp.ones((1, N), jnp.bfloat16)
    f = jax.jit(lambda x, w: jax.lax.scan(lambda x, wl: (_layer(x, wl), None), x, w)[0])
    hlo = f.lower(x, w).compile().as_text()
    element = "f4e2m1fn" if "fp4" in fmt else "f8e4m3fn"
    # computations whose body slices the stacked elements
    blocks = re.split(r"\n(?=%|ENTRY)", hlo)
    slicing = [b for b in blocks if re.search(rf"{element}\[1,{N},\d+\][^\n]*dynamic-slice\(", b)]
    assert slicing, "no dynamic slice of the stacked elements found"
    for b in slicing:
        assert "jax_blockscale_gemm_sm90" in b, (
            "the weight slice is materialized outside the kernel's fusion:\n" + b[:2000])
