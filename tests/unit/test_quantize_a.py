"""`jbs.gemm(x, w, quantize_a=fmt)` on the CPU: it is gemm(quantize(x, fmt), w) (bit for bit on
the reference backend), with the composition's transforms, and bad arguments are refused at trace
time naming quantize_a or a. The fused sm90 lowering is checked in
tests/build/test_quantized_activation_lowering.py and on the GPU in
tests/gpu/test_quantized_activation.py."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_blockscale as jbs


def _data(m, n, k, seed, w_fmt="nvfp4"):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((m, k)) * 10.0 ** rng.uniform(-1, 1, (m, 1))).astype(np.float32)
    w = rng.standard_normal((n, k)).astype(np.float32) / np.sqrt(k)
    kw = dict(global_scale="per_matrix") if w_fmt == "nvfp4" else {}
    return jnp.asarray(x, jnp.bfloat16), jbs.quantize(w, w_fmt, layout="blocked", **kw)


@pytest.mark.parametrize("fmt,w_fmt,m,n,k", [("nvfp4", "nvfp4", 1, 48, 64),
                                             ("nvfp4", "nvfp4", 5, 33, 256),
                                             ("mxfp4", "mxfp4", 3, 40, 128),
                                             ("mxfp8_e4m3", "mxfp4", 2, 24, 96)])
def test_equals_the_composition(fmt, w_fmt, m, n, k):
    x, w = _data(m, n, k, m * 1000 + n, w_fmt)
    got = jax.jit(lambda x, w: jbs.gemm(x, w, quantize_a=fmt, out_dtype=jnp.float32))(x, w)
    want = jax.jit(lambda x, w: jbs.gemm(jbs.quantize(x, fmt), w, out_dtype=jnp.float32))(x, w)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    # and it is a GEMM of the quantized values (a float64 check of the composition)
    q = jbs.quantize(x, fmt)
    xv = np.asarray(jbs.dequantize(q, jnp.float32), np.float64)
    wv = np.asarray(jbs.dequantize(w, jnp.float32), np.float64)
    ref = xv @ wv.T
    assert np.linalg.norm(np.asarray(got) - ref) <= 1e-5 * np.linalg.norm(ref)


def test_leading_dims_share_one_amax():
    """(B, T, K) activations are one tensor: one global scale over every row, as quantize does."""
    x, w = _data(6, 32, 64, 7)
    x3 = x.reshape(2, 3, 64)
    got = jbs.gemm(x3, w, quantize_a="nvfp4", out_dtype=jnp.float32)
    want = jbs.gemm(jbs.quantize(x3, "nvfp4"), w, out_dtype=jnp.float32)
    assert got.shape == (2, 3, 32)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_vmap_quantizes_each_slice_on_its_own():
    x, w = _data(8, 32, 64, 11)
    xs = x.reshape(4, 2, 64) * jnp.asarray([1, 10, 100, 1000], jnp.bfloat16)[:, None, None]
    got = jax.vmap(lambda x: jbs.gemm(x, w, quantize_a="nvfp4", out_dtype=jnp.float32))(xs)
    want = jnp.stack([jbs.gemm(jbs.quantize(xi, "nvfp4"), w, out_dtype=jnp.float32) for xi in xs])
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_differentiation_is_the_compositions():
    """gemm is not differentiable through a quantized A, so neither is the composition: both
    refuse the same way (quantize has no straight-through gradient)."""
    x, w = _data(3, 16, 64, 13)
    fused = lambda x: jbs.gemm(x, w, quantize_a="nvfp4", out_dtype=jnp.float32).sum()  # noqa: E731
    composed = lambda x: jbs.gemm(jbs.quantize(x, "nvfp4"), w,  # noqa: E731
                                  out_dtype=jnp.float32).sum()
    for f in (fused, composed):
        with pytest.raises(TypeError, match="not differentiable with respect to quantized"):
            jax.grad(f)(x.astype(jnp.float32).astype(jnp.bfloat16))


def test_bad_arguments_name_themselves():
    x, w = _data(2, 16, 64, 17)
    with pytest.raises(ValueError, match="quantize_a"):
        jbs.gemm(x, w, quantize_a="fp4")
    with pytest.raises(ValueError, match="quantize_a"):
        jbs.gemm(x, w, quantize_a=4)
    with pytest.raises(TypeError, match="quantize_a"):
        jbs.gemm(jbs.quantize(x, "nvfp4"), w, quantize_a="nvfp4")
    with pytest.raises(TypeError, match="floating-point"):
        jbs.gemm(jnp.ones((2, 64), jnp.int32), w, quantize_a="nvfp4")
    with pytest.raises(ValueError, match="cannot multiply"):
        jbs.gemm(x, w, quantize_a="mxfp8_e4m3")  # mxfp8 x nvfp4 is not a supported pair
    with pytest.raises(TypeError, match="out_dtype"):
        jbs.gemm(x, w, quantize_a="nvfp4", out_dtype=jnp.int8)


# ---- a given activation scale (static W4A4: a_global_scale) ----

@pytest.mark.parametrize("m,n,k", [(1, 48, 64), (5, 33, 256), (70, 24, 128)])
def test_given_scale_equals_the_composition(m, n, k):
    """gemm(x, w, quantize_a="nvfp4", a_global_scale=g) is gemm(quantize(x, "nvfp4",
    global_scale=g), w) bit for bit, traced or constant g, one that saturates the largest blocks
    too; and a GEMM of those quantized values (float64)."""
    x, w = _data(m, n, k, m * 100 + n)
    amax = float(jnp.max(jnp.abs(x.astype(jnp.float32))))
    for g in (amax / 2688, amax / 2688 / 8):
        fused = jax.jit(lambda x, w, g: jbs.gemm(x, w, quantize_a="nvfp4", a_global_scale=g,
                                                 out_dtype=jnp.float32))
        composed = jax.jit(lambda x, w, g: jbs.gemm(jbs.quantize(x, "nvfp4", global_scale=g), w,
                                                    out_dtype=jnp.float32))
        got = np.asarray(fused(x, w, jnp.float32(g)))
        np.testing.assert_array_equal(got, np.asarray(composed(x, w, jnp.float32(g))))
        const = jax.jit(lambda x, w: jbs.gemm(x, w, quantize_a="nvfp4", a_global_scale=g,
                                              out_dtype=jnp.float32))
        np.testing.assert_array_equal(np.asarray(const(x, w)), got)
        q = jbs.quantize(x, "nvfp4", global_scale=g)
        ref = (np.asarray(jbs.dequantize(q, jnp.float32), np.float64)
               @ np.asarray(jbs.dequantize(w, jnp.float32), np.float64).T)
        assert np.linalg.norm(got - ref) <= 1e-5 * np.linalg.norm(ref)


def test_given_scale_saturates_instead_of_calibrating():
    """A scale too small for the tensor clips its largest blocks (what a static scale does),
    where the calibrated one would not: the results differ, and the given one's values never
    pass 6 * 448 * g."""
    x, w = _data(4, 16, 64, 19)
    amax = float(jnp.max(jnp.abs(x.astype(jnp.float32))))
    g = amax / 2688 / 16
    q = jbs.quantize(x, "nvfp4", global_scale=g)
    assert float(jnp.max(jnp.abs(jbs.dequantize(q)))) <= 6 * 448 * g * (1 + 1e-6)
    given = jbs.gemm(x, w, quantize_a="nvfp4", a_global_scale=g, out_dtype=jnp.float32)
    calibrated = jbs.gemm(x, w, quantize_a="nvfp4", out_dtype=jnp.float32)
    assert not np.array_equal(np.asarray(given), np.asarray(calibrated))


def test_given_scale_per_matrix_and_under_vmap():
    x, w = _data(6, 32, 64, 23)
    x3 = x.reshape(2, 3, 64)
    gs = jnp.asarray([0.01, 0.002], jnp.float32)
    got = jbs.gemm(x3, w, quantize_a="nvfp4", a_global_scale=gs, out_dtype=jnp.float32)
    want = jbs.gemm(jbs.quantize(x3, "nvfp4", global_scale=gs), w, out_dtype=jnp.float32)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    mapped = jax.vmap(lambda x, g: jbs.gemm(x, w, quantize_a="nvfp4", a_global_scale=g,
                                            out_dtype=jnp.float32))(x3, gs)
    np.testing.assert_array_equal(np.asarray(mapped), np.asarray(want))


def test_given_scale_with_layer_and_in_dense():
    x, w = _data(3, 16, 64, 29)
    g = jnp.float32(0.003)
    stack = jax.tree.map(lambda a, b: jnp.stack([a, b]), w, w)
    got = jbs.gemm(x, stack, layer=1, quantize_a="nvfp4", a_global_scale=g, out_dtype=jnp.float32)
    want = jbs.gemm(jbs.quantize(x, "nvfp4", global_scale=g), w, out_dtype=jnp.float32)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    from jax_blockscale import nn as jnn
    y = jnn.dense(x, w, act_fmt="nvfp4", act_global_scale=g, dtype=jnp.float32)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(want))


def test_given_scale_bad_arguments_name_themselves():
    x, w = _data(2, 16, 64, 31)
    with pytest.raises(ValueError, match="a_global_scale.*quantize_a"):
        jbs.gemm(x, w, a_global_scale=0.01)
    with pytest.raises(ValueError, match="a_global_scale.*no global scale"):
        jbs.gemm(x, jbs.quantize(np.ones((16, 64), np.float32), "mxfp4", layout="blocked"),
                 quantize_a="mxfp4", a_global_scale=0.01)
    with pytest.raises(ValueError, match="a_global_scale has shape"):
        jbs.gemm(x, w, quantize_a="nvfp4", a_global_scale=jnp.ones(3))
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="a_global_scale must be finite and positive"):
            jbs.gemm(x, w, quantize_a="nvfp4", a_global_scale=bad)
    with pytest.raises(TypeError, match="a_global_scale must be a floating-point"):
        jbs.gemm(x, w, quantize_a="nvfp4", a_global_scale=jnp.int32(1))


@pytest.mark.parametrize("given", [False, True])
@pytest.mark.parametrize("weight_scale", ["per_matrix", None])
def test_layer_of_a_stack_in_a_scan_equals_the_composition(given, weight_scale):
    """gemm(x, w_stack, quantize_a="nvfp4", layer=i) in a scan over the layers (the quantizer
    then also writes each layer's alpha: a's decode factor times the stack's global scales, or
    the decode factor alone for a stack without them) == the composition with the layer's own
    weight, bit for bit, for a (2, 3, K) activation too."""
    rng = np.random.default_rng(7 + given)
    k, n, layers = 128, 40, 3
    w = rng.standard_normal((layers, n, k)).astype(np.float32) / np.sqrt(k)
    stack = jbs.quantize(w, "nvfp4", global_scale=weight_scale, layout="blocked")
    x = jnp.asarray(rng.standard_normal((2, 3, k)) * 3.0, jnp.bfloat16)
    g = jnp.float32(0.004) if given else None

    def body(acc, i):
        return acc, jbs.gemm(x, stack, quantize_a="nvfp4", a_global_scale=g, layer=i,
                             out_dtype=jnp.float32)

    _, ys = jax.jit(lambda: jax.lax.scan(body, 0.0, jnp.arange(layers)))()
    q = jbs.quantize(x, "nvfp4", global_scale="auto" if g is None else g)
    for i in range(layers):
        w_i = jax.tree.map(lambda a: a[i], stack)
        want = jbs.gemm(q, w_i, out_dtype=jnp.float32)
        np.testing.assert_array_equal(np.asarray(ys[i]), np.asarray(want))


def test_indexed_gemm_checks_a_given_alpha():
    from jax_blockscale.ragged import indexed_gemm

    x, w = _data(2, 16, 64, 31)
    stack = jax.tree.map(lambda a: jnp.stack([a, a]), w)
    with pytest.raises(ValueError, match=r"alpha must hold one f32 per group, shape \(2,\)"):
        indexed_gemm(x, stack, jnp.int32(0), alpha=jnp.ones((3,)))
