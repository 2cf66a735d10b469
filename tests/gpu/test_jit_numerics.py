"""Quantizing and multiplying inside one jit gives the same numbers as doing it step by step.

XLA may rewrite what it fuses: on GPUs (allow_excess_precision) it removes an f32 -> fp8 -> f32
pair of converts, which would let a jit that quantizes and then dequantizes compute with the
unrounded values. The check runs on the default device (the CPU in CI) and, marked gpu, on a GPU.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_blockscale as jbs
from configure import set_env  # tests/support/configure.py

FORMATS = ["nvfp4", "mxfp4", "mxfp8_e4m3", "mxfp8_e5m2", "mxfp6_e2m3"]


def _check_jit_matches_eager(fmt, backend):
    rng = np.random.default_rng(hash(fmt) % 2**32)
    x = rng.standard_normal((48, 512)).astype(np.float32)
    w = jbs.quantize(rng.standard_normal((40, 512)).astype(np.float32), fmt, layout="blocked")
    roundtrip = jax.jit(lambda x: jbs.dequantize(jbs.quantize(x, fmt)))
    np.testing.assert_array_equal(np.asarray(roundtrip(x)),
                                  np.asarray(jbs.dequantize(jbs.quantize(x, fmt))))
    fused = jax.jit(lambda x, w: jbs.gemm(jbs.quantize(x, fmt), w, out_dtype=jnp.float32,
                                          backend=backend))
    step = jbs.gemm(jbs.quantize(x, fmt), w, out_dtype=jnp.float32, backend=backend)
    y, want = np.asarray(fused(x, w)), np.asarray(step)
    assert np.abs(y - want).max() <= 1e-6 * np.abs(want).max()


@pytest.mark.parametrize("fmt", FORMATS)
def test_quantize_in_jit_matches_eager(fmt):
    _check_jit_matches_eager(fmt, "reference")


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["reference", None])
@pytest.mark.parametrize("fmt", FORMATS)
def test_quantize_in_jit_matches_eager_on_gpu(monkeypatch, fmt, backend):
    # default backend with a small row limit: the sm90 lowering's dequantize + dot path
    set_env(monkeypatch, JAX_BLOCKSCALE_SM90_MAX_ROWS="16")
    with jax.default_device(jax.devices("gpu")[0]):
        _check_jit_matches_eager(fmt, backend)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FORMATS)
def test_quantize_on_gpu_matches_cpu(fmt):
    """The same stored bits on both devices: NVFP4 divides by its rounded e4m3 scales, a
    round trip of converts that XLA may remove on GPUs (as it did in dequantize)."""
    x = np.random.default_rng(7).standard_normal((3, 37, 256)).astype(np.float32)
    x[1] *= 1e-3  # other binades, incl. e4m3 scale subnormals
    x[2] *= 300.0

    def stored(device):
        with jax.default_device(device):
            q = jax.jit(lambda x: jbs.quantize(x, fmt))(x)
            return (np.asarray(q.data).view(np.uint8), np.asarray(q.scales).view(np.uint8),
                    None if q.global_scale is None else float(q.global_scale))

    on_gpu, on_cpu = stored(jax.devices("gpu")[0]), stored(jax.devices("cpu")[0])
    np.testing.assert_array_equal(on_gpu[0], on_cpu[0])
    np.testing.assert_array_equal(on_gpu[1], on_cpu[1])
    assert (on_gpu[2] is None) == (on_cpu[2] is None)
    if on_gpu[2] is not None:
        np.testing.assert_allclose(on_gpu[2], on_cpu[2], rtol=1e-7)
