"""`jbs.quantize(x, "nvfp4")` of a bf16 activation on the quantizer kernels.

`quantize_nvfp4_p` (x, [decode]) -> (elements, scales, decode) is `_quantize_nvfp4` of quantize.py
for one (M, K) matrix: x quantized to NVFP4 with one global scale, calibrated from x's amax
(``global_scale="auto"``) or the given decode factor (an f32 scalar, present when the param
``given_scale`` is set); the elements float4_e2m1fn (M, K), the plain e4m3 scales (M, K // 16)
and the stored decode factor. Where the sm90 quantizer kernels can run (a bf16 x, K a multiple
of 16, a Hopper GPU, a call no partitioner will split) it lowers to the target
`jax_blockscale_quantize_nvfp4_sm90`: one launch up to 2,048 blocks, an amax kernel and a
one-block-per-thread kernel past that (docs/design/quantized_activation.md), instead of XLA's
four kernels. Its results are XLA's bit for bit (the kernels perform the same f32 operations,
tests/gpu/test_quantized_activation.py); everywhere else it lowers to `_quantize_nvfp4` itself.
vmap and differentiation are `_quantize_nvfp4`'s.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from . import config as _config
from .formats import get_format
from .lowering import ALL_PLATFORMS
from .lowering.ffi_sm90 import quantize_nvfp4_call
from .lowering.plan import LIBRARY, device_for
from .partitioning import needs_partitioning
from .quantize import _quantize_nvfp4

quantize_nvfp4_p = Primitive("blockscale_quantize_nvfp4")
quantize_nvfp4_p.multiple_results = True


def _reference(x, decode=None, *, given_scale):
    """quantize.py's XLA computation (one matrix: one amax, or the given decode factor)."""
    data, scales, g = _quantize_nvfp4(x, get_format("nvfp4"),
                                      decode if given_scale else "auto")
    return data, scales, jnp.asarray(g, jnp.float32)


def _abstract_eval(x, *_, given_scale):
    del given_scale
    m, k = x.shape
    return (jax.core.ShapedArray((m, k), jnp.float4_e2m1fn),
            jax.core.ShapedArray((m, k // 16), jnp.float8_e4m3fn),
            jax.core.ShapedArray((), jnp.float32))


quantize_nvfp4_p.def_abstract_eval(_abstract_eval)
quantize_nvfp4_p.def_impl(lambda *args, **params: jax.jit(
    functools.partial(quantize_nvfp4_p.bind, **params))(*args))


def runs_on_kernels(x_aval, platform: str, library=LIBRARY) -> bool:
    """Whether the quantizer kernels take x (bf16 (M, K), K % 16 == 0) on `platform`."""
    return (platform == "cuda" and np.dtype(x_aval.dtype) == np.dtype(jnp.bfloat16)
            and x_aval.ndim == 2 and x_aval.shape[0] >= 1 and x_aval.shape[1] >= 16
            and x_aval.shape[1] % 16 == 0 and _config.get().backend in (None, "sm90")
            and device_for(platform).arch == "sm90"
            and library.unavailable_reason() is None and library.has_quantize_nvfp4())


def _lowering(ctx, *args, platform, given_scale):
    if runs_on_kernels(ctx.avals_in[0], platform) and not needs_partitioning(ctx, "quantize"):
        return mlir.lower_fun(quantize_nvfp4_call, multiple_results=True)(ctx, *args)
    return mlir.lower_fun(functools.partial(_reference, given_scale=given_scale),
                          multiple_results=True)(ctx, *args)


for _platform in ALL_PLATFORMS:
    mlir.register_lowering(quantize_nvfp4_p, functools.partial(_lowering, platform=_platform),
                           platform=_platform)


def _batch_rule(args, dims, *, given_scale):
    # each mapped matrix quantized on its own, as vmap of quantize.py's computation does
    f = functools.partial(_reference, given_scale=given_scale)
    return jax.vmap(f, in_axes=dims)(*args), (0, 0, 0)


def _jvp(primals, tangents, *, given_scale):
    tangents = tuple(ad.instantiate_zeros(t) for t in tangents)
    return jax.jvp(functools.partial(_reference, given_scale=given_scale), primals, tangents)


batching.primitive_batchers[quantize_nvfp4_p] = _batch_rule
ad.primitive_jvps[quantize_nvfp4_p] = _jvp


def quantize_nvfp4(x: jax.Array, global_scale):
    """(elements, plain scales, decode factor) of x (..., K) quantized to NVFP4 with one global
    scale for all of it ("auto", or a given decode factor of shape ()), as _quantize_nvfp4
    computes them; through `quantize_nvfp4_p` (the kernels where they run)."""
    given = not isinstance(global_scale, str)
    x2 = x.reshape((-1, x.shape[-1]))  # one global scale: folding the rows changes nothing
    extra = (jnp.asarray(global_scale, jnp.float32),) if given else ()
    data, scales, g = quantize_nvfp4_p.bind(x2, *extra, given_scale=given)
    return data.reshape(x.shape), scales.reshape(x.shape[:-1] + (x.shape[-1] // 16,)), g
