"""`gemm(a, b, layer=i)`: one layer of a stacked weight (L, N, K), on every platform.

Where no kernel reads the stack in place (here: the CPU) the layer is sliced and gemm's own
backends run it, so the result must equal `gemm(a, b[i])` exactly; the in-place kernel is
checked against that on the GPU (tests/gpu/test_layer_gemm_sm90.py). Fresh random data per test.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_blockscale as jbs

FORMATS = ["nvfp4", "mxfp4", "mxfp6_e3m2", "mxfp8_e4m3"]


def _stack(fmt, layers, n, k, seed):
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((layers, n, k)).astype(np.float32)
    w *= rng.uniform(0.1, 10.0, (layers, 1, 1)).astype(np.float32)  # layers differ in scale
    kw = dict(global_scale="per_matrix") if fmt == "nvfp4" else {}
    return jbs.quantize(jnp.asarray(w), fmt, layout="blocked", **kw)


def _layer_of(w, i):
    return jax.tree.map(lambda t: t[i], w)


def _x(shape, seed):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.bfloat16)


@pytest.mark.parametrize("fmt", FORMATS)
def test_equals_gemm_on_the_sliced_layer(fmt):
    w = _stack(fmt, 5, 40, 96, seed=1)
    x = _x((3, 7, 96), seed=2)  # leading dims fold into the rows
    f = jax.jit(lambda x, i: jbs.gemm(x, w, layer=i, out_dtype=jnp.float32))
    for i in range(5):
        want = jbs.gemm(x, _layer_of(w, i), out_dtype=jnp.float32)
        got = f(x, i)
        assert got.shape == (3, 7, 40)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_quantized_activation_and_python_int_layer():
    w = _stack("nvfp4", 3, 64, 128, seed=3)
    a = jbs.quantize(np.random.default_rng(4).standard_normal((5, 128)).astype(np.float32),
                     "nvfp4")
    want = jbs.gemm(a, _layer_of(w, 2))
    np.testing.assert_array_equal(np.asarray(jbs.gemm(a, w, layer=2)), np.asarray(want))


def test_layer_index_is_clamped_like_indexing():
    w = _stack("mxfp4", 4, 32, 64, seed=5)
    x = _x((2, 64), seed=6)
    f = jax.jit(lambda i: jbs.gemm(x, w, layer=i))
    for i, j in [(-5, 0), (-1, 0), (4, 3), (99, 3)]:
        np.testing.assert_array_equal(np.asarray(f(i)), np.asarray(jbs.gemm(x, _layer_of(w, j))))


def test_scan_vmap_and_grad():
    w = _stack("nvfp4", 4, 64, 64, seed=7)
    x = _x((2, 64), seed=8)

    def step(h, i):
        return jnp.tanh(jbs.gemm(h, w, layer=i, out_dtype=jnp.float32)).astype(h.dtype), None

    got = jax.jit(lambda x: jax.lax.scan(step, x, jnp.arange(4))[0])(x)
    want = x
    for i in range(4):
        want = jnp.tanh(jbs.gemm(want, _layer_of(w, i), out_dtype=jnp.float32)).astype(x.dtype)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))

    # vmap over the layer index (each example its own layer) and over examples sharing one
    per_layer = jax.vmap(lambda i: jbs.gemm(x, w, layer=i))(jnp.arange(4))
    for i in range(4):
        np.testing.assert_array_equal(np.asarray(per_layer[i]),
                                      np.asarray(jbs.gemm(x, _layer_of(w, i))))
    xs = _x((3, 2, 64), seed=9)
    shared = jax.vmap(lambda xi: jbs.gemm(xi, w, layer=1))(xs)
    np.testing.assert_array_equal(np.asarray(shared), np.asarray(jbs.gemm(xs, _layer_of(w, 1))))

    # weight-only gradient with respect to the activation
    xf = x.astype(jnp.float32)
    g = jax.grad(lambda x: jnp.sum(jbs.gemm(x, w, layer=3, out_dtype=jnp.float32) ** 2))(xf)
    g_want = jax.grad(lambda x: jnp.sum(
        jbs.gemm(x, _layer_of(w, 3), out_dtype=jnp.float32) ** 2))(xf)
    # the same products summed in another f32 order (per-group alpha applied before the sum)
    assert np.linalg.norm(g - g_want) / np.linalg.norm(g_want) < 1e-5


def test_bad_arguments_name_themselves():
    w = _stack("mxfp4", 2, 32, 64, seed=10)
    x = _x((2, 64), seed=11)
    with pytest.raises(ValueError, match=r"layer= needs b stacked as \(L, N, K\)"):
        jbs.gemm(x, _layer_of(w, 0), layer=0)
    with pytest.raises(TypeError, match="layer must be an integer scalar"):
        jbs.gemm(x, w, layer=1.0)
    with pytest.raises(TypeError, match="layer must be an integer scalar"):
        jbs.gemm(x, w, layer=jnp.arange(2))
    a = jbs.quantize(np.ones((2, 4, 64), np.float32), "mxfp4", layout="blocked")
    with pytest.raises(ValueError, match="must be 2-D when its scales are blocked"):
        jbs.gemm(a, w, layer=0)
    with pytest.raises(ValueError, match="unknown ragged_gemm backend"):
        jbs.gemm(x, w, layer=0, backend="nope")


def test_example_runs():
    """examples/scanned_layers.py: a scanned stack with layer= agrees with the unrolled one."""
    import importlib.util
    import os
    path = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "scanned_layers.py")
    spec = importlib.util.spec_from_file_location("scanned_layers_example", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    mod.main(["--layers", "3", "--hidden", "128", "--ffn", "256", "--fmt", "mxfp4"])
