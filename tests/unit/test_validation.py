"""Bad input raises a clear TypeError/ValueError at trace time, naming the argument."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_blockscale as jbs
from configure import set_env  # tests/support/configure.py


def q(shape, fmt, layout="plain", seed=0):
    x = np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
    return jbs.quantize(x, fmt, layout=layout)


A = q((16, 64), "nvfp4")
B = q((24, 64), "nvfp4", "blocked")


def trace(a, b, **kw):
    # Errors must come at trace time: eval_shape never runs anything.
    return jax.eval_shape(lambda a, b: jbs.gemm(a, b, **kw), a, b)


@pytest.mark.parametrize("make,err,match", [
    (lambda: (A, jnp.ones((24, 64), jnp.bfloat16)), TypeError, "b must be a jbs.BlockScaled"),
    (lambda: (A, q((24, 96), "nvfp4")), ValueError, "agree on K"),
    (lambda: (A, q((24, 64), "mxfp4")), ValueError, "cannot be multiplied"),
    (lambda: (jnp.ones((16, 64), jnp.int8), B), TypeError, "weight-only mode takes"),
    (lambda: (jnp.ones((64,), jnp.bfloat16), B), ValueError, r"shape \(\.\.\., MN, K\)"),
    (lambda: (dataclasses.replace(A, data=A.data.astype(jnp.float8_e4m3fn)), B), TypeError,
     "a holds float8_e4m3fn elements"),
    (lambda: (dataclasses.replace(A, scales=A.scales.astype(jnp.float8_e8m0fnu)), B), TypeError,
     "a scales has dtype"),
    (lambda: (dataclasses.replace(A, scales=A.scales[:, :2]), B), ValueError,
     "a scales has shape"),
    (lambda: (A, dataclasses.replace(B, layout="plain")), ValueError, "b scales has shape"),
    (lambda: (A, dataclasses.replace(B, layout="tiled")), ValueError, "layout must be one of"),
    (lambda: (q((2, 16, 64), "nvfp4"), q((3, 24, 64), "nvfp4")), ValueError, "do not broadcast"),
    (lambda: (dataclasses.replace(q((16, 48), "nvfp4"), data=jnp.ones((16, 40), jnp.float4_e2m1fn),
                                  scales=jnp.ones((16, 2), jnp.float8_e4m3fn)),
              q((24, 48), "nvfp4")), ValueError, "not a multiple of the nvfp4 block size"),
])
def test_bad_operands_raise(make, err, match):
    a, b = make()
    with pytest.raises(err, match=match):
        trace(a, b)


def test_bad_out_dtype_and_backend():
    with pytest.raises(TypeError, match="out_dtype"):
        trace(A, B, out_dtype=jnp.int8)
    with pytest.raises(ValueError, match="unknown gemm backend"):
        trace(A, B, backend="cublas")


def test_bad_alpha_via_primitive():
    with pytest.raises(TypeError, match="alpha must be an f32 scalar"):
        jax.eval_shape(lambda: jbs.gemm_p.bind(
            A.data, B.data, A.scales, B.scales, jnp.ones((2,), jnp.float32), fmt_a="nvfp4",
            fmt_b="nvfp4", layout_a="plain", layout_b="blocked", out_dtype=np.dtype(np.float32),
            backend=None))


def test_forced_backend_that_cannot_run_fails_clearly(monkeypatch):
    class Never:
        name, platforms, priority = "never", ("cpu",), 100

        def plan(self, spec, device):
            return "this test backend runs nothing"

        def __call__(self, a, b, sa, sb, alpha, *, plan):
            raise AssertionError("must not be called")

    jbs.register_backend(Never())
    try:
        # chosen automatically: skipped (reason logged), the reference runs
        y = jax.jit(lambda a, b: jbs.gemm(a, b))(A, B)
        assert y.shape == (16, 24)
        # forced through the environment: a clear error, not a crash
        set_env(monkeypatch, JAX_BLOCKSCALE_BACKEND="never")
        with pytest.raises(ValueError, match="cannot run this problem: this test backend"):
            jax.jit(lambda a, b: jbs.gemm(a, b)).lower(A, B)
    finally:
        from jax_blockscale.lowering.registry import _BACKENDS
        _BACKENDS.pop("never")


@pytest.mark.parametrize("value", ["0", "256", "-3"])
def test_bad_register_weight_split_count_is_refused(monkeypatch, value):
    """JAX_BLOCKSCALE_SM90_REGISTER_WEIGHT_SPLITS outside [1, 255] fails when the configuration
    is read, naming the variable; a valid one is taken."""
    with pytest.raises(ValueError, match="JAX_BLOCKSCALE_SM90_REGISTER_WEIGHT_SPLITS"):
        set_env(monkeypatch, JAX_BLOCKSCALE_SM90_REGISTER_WEIGHT_SPLITS=value)
    assert set_env(monkeypatch, JAX_BLOCKSCALE_SM90_REGISTER_WEIGHT_SPLITS="3") \
        .sm90_register_weight_splits == 3
    set_env(monkeypatch, JAX_BLOCKSCALE_SM90_REGISTER_WEIGHT_SPLITS=None)


@pytest.mark.parametrize("value", ["0", "256", "-1"])
def test_bad_decode_split_count_is_refused(monkeypatch, value):
    """JAX_BLOCKSCALE_SM90_DECODE_SPLITS outside [1, 255] fails when the configuration is read,
    naming the variable; a valid one is taken."""
    with pytest.raises(ValueError, match="JAX_BLOCKSCALE_SM90_DECODE_SPLITS"):
        set_env(monkeypatch, JAX_BLOCKSCALE_SM90_DECODE_SPLITS=value)
    assert set_env(monkeypatch, JAX_BLOCKSCALE_SM90_DECODE_SPLITS="5").sm90_decode_splits == 5
    set_env(monkeypatch, JAX_BLOCKSCALE_SM90_DECODE_SPLITS=None)
