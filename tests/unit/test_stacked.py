"""Stacked weights (layers, experts): one NVFP4 global scale per matrix, and vmap / scan over the
stack give what per-layer quantization gives, for every format."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_blockscale as jbs
import oracle

FORMATS = list(oracle.SPEC)
L, N, K, M = 3, 40, 64, 5


def _stack(seed):
    """Layers of very different magnitudes, so one shared global scale would hurt."""
    rng = np.random.default_rng(seed)
    mags = np.array([3e-3, 1.0, 40.0], np.float32)[:, None, None]
    return (rng.standard_normal((L, N, K)) * mags).astype(np.float32)


def _per_layer(w, fmt, layout="blocked"):
    return [jbs.quantize(w[i], fmt, layout=layout) for i in range(w.shape[0])]


def _bits(x):
    return np.asarray(x).view(np.uint8)


@pytest.mark.parametrize("layout", ["plain", "blocked"])
def test_per_matrix_global_scale_is_per_layer_quantization(layout):
    w = _stack(1)
    q = jbs.quantize(w, "nvfp4", global_scale="per_matrix", layout=layout)
    assert q.global_scale.shape == (L,) and q.global_scale.dtype == jnp.float32
    for i, qi in enumerate(_per_layer(w, "nvfp4", layout)):
        np.testing.assert_array_equal(_bits(q.data[i]), _bits(qi.data))
        np.testing.assert_array_equal(_bits(q.scales[i]), _bits(qi.scales))
        assert float(q.global_scale[i]) == float(qi.global_scale)
        # indexing a stack gives the layer, with a scalar global scale
        assert q[i].global_scale.shape == () and q[i].shape == (N, K)
        np.testing.assert_array_equal(np.asarray(jbs.dequantize(q[i])),
                                      np.asarray(jbs.dequantize(qi)))
    # the value is element * scale * the matrix's own decode factor (float64 oracle)
    want = np.stack([oracle.dequantize(q.data[i], q.scales[i], "nvfp4", q.global_scale[i],
                                       layout) for i in range(L)])
    np.testing.assert_allclose(np.asarray(jbs.dequantize(q), np.float64), want, rtol=1e-6)


def test_per_matrix_two_leading_axes_and_2d():
    rng = np.random.default_rng(2)
    w = rng.standard_normal((2, 3, 16, 32)).astype(np.float32)
    q = jbs.quantize(w, "nvfp4", global_scale="per_matrix")
    assert q.global_scale.shape == (2, 3)
    np.testing.assert_allclose(np.asarray(q.global_scale),
                               np.abs(w).max(axis=(-2, -1)) / (6 * 448), rtol=1e-6)
    q2 = jbs.quantize(w[0, 0], "nvfp4", global_scale="per_matrix")  # one matrix: a scalar
    assert q2.global_scale.shape == ()
    assert float(q2.global_scale) == float(jbs.quantize(w[0, 0], "nvfp4").global_scale)
    with pytest.raises(ValueError, match="per_matrix.*at least 2 axes"):
        jbs.quantize(w[0, 0, 0], "nvfp4", global_scale="per_matrix")
    # MX formats have no global scale: per_matrix is accepted and means none
    assert jbs.quantize(w, "mxfp4", global_scale="per_matrix").global_scale is None


def test_given_per_matrix_decode_factors():
    w = _stack(3)
    g = np.array([2.0 ** -12, 2.0 ** -3, 2.0 ** 2], np.float32)
    q = jbs.quantize(w, "nvfp4", global_scale=g)
    np.testing.assert_array_equal(np.asarray(q.global_scale), g)
    for i in range(L):
        qi = jbs.quantize(w[i], "nvfp4", global_scale=float(g[i]))
        np.testing.assert_array_equal(_bits(q.scales[i]), _bits(qi.scales))
    with pytest.raises(ValueError, match=r"global_scale has shape \(2,\)"):
        jbs.quantize(w, "nvfp4", global_scale=g[:2])


def _act(seed, shape=(M, K)):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def _want(a_q, layers, fmt_a):
    """float64 oracle: the activation's values times each layer's values."""
    av = (np.asarray(a_q, np.float64) if fmt_a is None
          else oracle.dequantize(a_q.data, a_q.scales, fmt_a, a_q.global_scale, a_q.layout))
    return np.stack([oracle.gemm(av, oracle.dequantize(qi.data, qi.scales, qi.fmt,
                                                        qi.global_scale, qi.layout))
                     for qi in layers])


def _act_fmt(fmt):
    return fmt if fmt == "nvfp4" else "mxfp8_e4m3"


@pytest.mark.parametrize("fmt", FORMATS)
def test_vmap_and_scan_over_a_stacked_weight_match_per_layer(fmt):
    w = _stack(10 + FORMATS.index(fmt))
    stacked = jbs.quantize(w, fmt, global_scale="per_matrix", layout="blocked")
    layers = _per_layer(w, fmt)
    for fmt_a in (None, _act_fmt(fmt)):
        x = _act(20 + FORMATS.index(fmt))
        a = x if fmt_a is None else jbs.quantize(x, fmt_a)
        want = _want(a, layers, fmt_a)
        per_layer = np.stack([np.asarray(jbs.gemm(a, qi, out_dtype=jnp.float32))
                              for qi in layers])
        np.testing.assert_allclose(per_layer, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())

        gemm = jax.jit(lambda a, w: jbs.gemm(a, w, out_dtype=jnp.float32))
        vmapped = jax.jit(jax.vmap(lambda wi: jbs.gemm(a, wi, out_dtype=jnp.float32)))(stacked)

        def body(carry, wi):
            return carry, jbs.gemm(a, wi, out_dtype=jnp.float32)
        scanned = jax.jit(lambda ws: jax.lax.scan(body, 0, ws)[1])(stacked)
        batched = gemm(a, stacked)  # the batched gemm broadcasts a over the stack
        for got in (vmapped, scanned, batched):
            assert got.shape == (L, M, N)
            np.testing.assert_array_equal(np.asarray(got), per_layer)


def test_scan_over_layers_as_a_model_does():
    """A residual stack under lax.scan (the carry flows through every layer), bf16 output."""
    w = _stack(30) * np.float32(0.05)
    w = np.concatenate([w, w[:, :K - N]], axis=1) if N < K else w[:, :K]  # square (L, K, K)
    stacked = jbs.quantize(w, "nvfp4", global_scale="per_matrix", layout="blocked")
    x = _act(31)

    def layer(h, wi):
        return h + jbs.gemm(h, wi, out_dtype=jnp.float32), None

    got = jax.jit(lambda h, ws: jax.lax.scan(layer, h, ws)[0])(x, stacked)
    h = x
    for qi in _per_layer(w, "nvfp4"):
        h = h + np.asarray(jbs.gemm(h, qi, out_dtype=jnp.float32))
    # f32 accumulation order differs between the scanned and the unrolled program
    np.testing.assert_allclose(np.asarray(got), h, rtol=1e-5, atol=1e-5 * np.abs(h).max())


def test_per_matrix_activation_and_weight_broadcast():
    """Both operands per-matrix: alpha varies over the batch and multiplies the right matrix."""
    w, x = _stack(40), _act(41, (L, M, K)) * np.float32([1e-2, 1, 1e2])[:, None, None]
    qa = jbs.quantize(x, "nvfp4", global_scale="per_matrix")
    qb = jbs.quantize(w, "nvfp4", global_scale="per_matrix", layout="blocked")
    got = jax.jit(lambda a, b: jbs.gemm(a, b, out_dtype=jnp.bfloat16))(qa, qb)
    assert got.dtype == jnp.bfloat16 and got.shape == (L, M, N)
    want = np.stack([oracle.gemm(oracle.dequantize(qa.data[i], qa.scales[i], "nvfp4",
                                                   qa.global_scale[i]),
                                 oracle.dequantize(qb.data[i], qb.scales[i], "nvfp4",
                                                   qb.global_scale[i], "blocked"))
                     for i in range(L)])
    for i in range(L):  # bf16 output: one rounding, relative to each matrix's own size
        np.testing.assert_allclose(np.asarray(got[i], np.float64), want[i], rtol=1e-2,
                                   atol=1e-2 * np.abs(want[i]).max())
    # a 2-D activation with one scalar global scale against the stack
    a2 = jbs.quantize(x[1], "nvfp4")
    got2 = jbs.gemm(a2, qb, out_dtype=jnp.float32)
    want2 = np.stack([np.asarray(jbs.gemm(a2, qb[i], out_dtype=jnp.float32)) for i in range(L)])
    np.testing.assert_allclose(np.asarray(got2), want2, rtol=1e-6)


def test_per_matrix_weight_grad_in_weight_only_mode():
    w = _stack(50)
    qb = jbs.quantize(w, "nvfp4", global_scale="per_matrix", layout="blocked")
    x = jnp.asarray(_act(51))
    g = jax.grad(lambda x: jnp.sum(jbs.gemm(x, qb, out_dtype=jnp.float32) ** 2))(x)
    wv = np.asarray(jbs.dequantize(qb), np.float64)
    y = np.einsum("mk,lnk->lmn", np.asarray(x, np.float64), wv)
    want = np.einsum("lmn,lnk->mk", 2 * y, wv)
    np.testing.assert_allclose(np.asarray(g), want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


def test_quantize_params_stacked_kernels_get_per_matrix_scales():
    pytest.importorskip("flax")
    from jax_blockscale import nn as jnn

    rng = np.random.default_rng(60)
    stacked = (rng.standard_normal((L, K, N)) * np.float32([1e-3, 1, 1e3])[:, None, None])
    params = {"layers": {"kernel": stacked.astype(np.float32),
                         "bias": np.ones((L, N), np.float32)},
              "head": {"kernel": rng.standard_normal((K, 8)).astype(np.float32)}}
    for fmt in ("nvfp4", "mxfp4"):
        q = jnn.quantize_params(params, fmt, filter="kernel")
        k = q["layers"]["kernel"]
        assert isinstance(k, jbs.BlockScaled) and k.shape == (L, N, K) and k.layout == "blocked"
        assert isinstance(q["head"]["kernel"], jbs.BlockScaled)
        assert isinstance(q["layers"]["bias"], np.ndarray)
        for i in range(L):
            qi = jbs.quantize(stacked[i].T.astype(np.float32), fmt, layout="blocked")
            np.testing.assert_array_equal(np.asarray(jbs.dequantize(k[i])),
                                          np.asarray(jbs.dequantize(qi)))
        if fmt == "nvfp4":
            assert k.global_scale.shape == (L,)
        # a given decode factor is copied per matrix, so the stack still scans
        if fmt == "nvfp4":
            q2 = jnn.quantize_params(params, fmt, filter="layers/kernel", global_scale=0.5)
            assert q2["layers"]["kernel"].global_scale.shape == (L,)


def test_indexing_and_iterating_a_stack():
    w = _stack(70)
    q = jbs.quantize(w, "nvfp4", global_scale="per_matrix", layout="blocked")
    layers = list(q)
    assert len(layers) == L and all(x.global_scale.shape == () for x in layers)
    sub = q[1:]
    assert sub.shape == (L - 1, N, K) and sub.global_scale.shape == (L - 1,)
    np.testing.assert_array_equal(np.asarray(jbs.dequantize(sub[0])),
                                  np.asarray(jbs.dequantize(layers[1])))
    with pytest.raises(IndexError, match="leading"):
        q[0, 1]
    with pytest.raises(TypeError, match="not iterable"):
        iter(q[0])


@pytest.mark.parametrize("layout", ["plain", "blocked"])
def test_a_stack_with_one_global_scale_scans_and_vmaps_as_its_slices(layout):
    """jbs.quantize's default ("auto": one global scale for the whole stack) gives a pytree that
    lax.scan and vmap slice: each slice carries the stack's scale, and the results equal the
    per-slice ones (q[i]) bit for bit."""
    w = _stack(7)
    q = jbs.quantize(w, "nvfp4", layout=layout)
    assert q.global_scale.shape == ()
    x = jnp.asarray(np.random.default_rng(8).standard_normal((M, K)), jnp.bfloat16)
    want = np.stack([np.asarray(jbs.gemm(x, q[i], out_dtype=jnp.float32)) for i in range(L)])

    def step(carry, wl):
        assert wl.global_scale.shape == ()
        return carry, jbs.gemm(x, wl, out_dtype=jnp.float32)

    _, scanned = jax.lax.scan(step, 0, q)
    mapped = jax.vmap(lambda wl: jbs.gemm(x, wl, out_dtype=jnp.float32))(q)
    np.testing.assert_array_equal(np.asarray(scanned), want)
    np.testing.assert_array_equal(np.asarray(mapped), want)
    deq = jax.vmap(jbs.dequantize)(q)
    np.testing.assert_array_equal(np.asarray(deq), np.asarray(jbs.dequantize(q)))


def test_a_shared_global_scale_stays_one_scalar_through_jit_and_tree_maps():
    q = jbs.quantize(_stack(9).reshape(1, L, N, K), "nvfp4")
    back = jax.jit(lambda q: q)(q)
    assert back.global_scale.shape == () and float(back.global_scale) == float(q.global_scale)
    leaves = jax.tree.leaves(q)
    assert leaves[2].shape == (1, L)  # handed over broadcast, so scan and vmap can slice it
    assert jax.tree.map(lambda a: a, q).global_scale.shape == ()
    # scanning the outer axis leaves (L, N, K) stacks that still share the scale
    _, gs = jax.lax.scan(lambda c, wl: (c, wl.global_scale), 0, q)
    np.testing.assert_array_equal(np.asarray(gs), np.full((1,), float(q.global_scale)))
    # shardings and other non-array leaves pass through a tree map untouched
    specs = jax.tree.map(lambda a: "spec", q)
    assert specs.global_scale == "spec"
