"""gemm under jax transformations: jit, vmap, grad (weight-only), jax.export."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_blockscale as jbs
import oracle

F32 = jnp.float32


def rand(seed, shape):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def rel(x, y):
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    return np.linalg.norm(x - y) / np.linalg.norm(y)


def test_vmap_over_activations_weights_and_both():
    xs = rand(0, (5, 9, 64))
    ws = rand(1, (5, 12, 64))
    w0 = jbs.quantize(ws[0], "nvfp4", layout="blocked")
    # activations mapped (each example quantized with its own global scale: mapped alpha)
    y = jax.vmap(lambda x: jbs.gemm(jbs.quantize(x, "nvfp4"), w0, out_dtype=F32))(xs)
    loop = np.stack([jbs.gemm(jbs.quantize(x, "nvfp4"), w0, out_dtype=F32) for x in xs])
    np.testing.assert_allclose(y, loop, rtol=1e-6, atol=1e-6)
    # weights mapped, activation shared
    wq = jax.vmap(lambda w: jbs.quantize(w, "mxfp8_e4m3", layout="blocked"))(ws)
    xq = jbs.quantize(xs[0], "mxfp8_e4m3")
    y = jax.vmap(lambda w: jbs.gemm(xq, w, out_dtype=F32))(wq)
    loop = np.stack([jbs.gemm(xq, jax.tree.map(lambda t: t[i], wq), out_dtype=F32)
                     for i in range(5)])
    np.testing.assert_allclose(y, loop, rtol=1e-6, atol=1e-6)
    # both mapped, on a non-leading axis, in weight-only mode, nested in another vmap
    xb = jnp.asarray(rand(2, (3, 9, 5, 64)), jnp.bfloat16)
    f = jax.vmap(jax.vmap(lambda x, w: jbs.gemm(x, w, out_dtype=F32), (1, 0)), (0, None))
    y = f(xb, wq)
    assert y.shape == (3, 5, 9, 12)
    want = oracle.gemm(np.moveaxis(np.asarray(xb, np.float64), 2, 1),
                       np.stack([oracle.dequantize(wq.data[i], wq.scales[i], "mxfp8_e4m3",
                                                   layout="blocked") for i in range(5)]))
    assert rel(y, want) < 1e-5


def test_vmap_over_scales_only():
    x = jbs.quantize(rand(3, (7, 64)), "mxfp4")
    w = jbs.quantize(rand(4, (10, 64)), "mxfp4")
    scales = jnp.stack([x.scales, x.scales])  # same data, two sets of scales
    y = jax.vmap(lambda s: jbs.gemm(jbs.BlockScaled(x.data, s, None, "mxfp4"), w,
                                    out_dtype=F32))(scales)
    np.testing.assert_allclose(y[1], jbs.gemm(x, w, out_dtype=F32), rtol=1e-6)


def test_grad_weight_only_and_policy():
    x = jnp.asarray(rand(5, (6, 64)))
    w = jbs.quantize(rand(6, (8, 64)), "nvfp4", layout="blocked")
    wv = jbs.dequantize(w)
    g = jax.grad(lambda x: jnp.sum(jnp.sin(jbs.gemm(x, w, out_dtype=F32))))(x)
    g_ref = jax.grad(lambda x: jnp.sum(jnp.sin(x @ wv.T)))(x)
    assert rel(g, g_ref) < 1e-5
    # jvp and linear transpose agree (forward and reverse mode)
    t = jnp.asarray(rand(7, (6, 64)))
    _, jt = jax.jvp(lambda x: jbs.gemm(x, w, out_dtype=F32), (x,), (t,))
    assert rel(jt, t @ wv.T) < 1e-5
    with pytest.raises(TypeError, match="not differentiable with respect to quantized"):
        jax.grad(lambda w: jnp.sum(jbs.gemm(x, w, out_dtype=F32)), allow_int=True)(w)


def test_jit_and_export_roundtrip():
    a = jbs.quantize(rand(8, (2, 33, 64)), "nvfp4")
    b = jbs.quantize(rand(9, (40, 64)), "nvfp4", layout="blocked")
    f = jax.jit(lambda a, b: jbs.gemm(a, b, out_dtype=F32))
    exported = jax.export.export(f)(a, b)
    restored = jax.export.deserialize(exported.serialize())
    y = restored.call(a, b)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(f(a, b)))
    want = oracle.gemm(oracle.dequantize(a.data, a.scales, "nvfp4", a.global_scale),
                       oracle.dequantize(b.data, b.scales, "nvfp4", b.global_scale, "blocked"))
    assert rel(y, want) < 1e-5
