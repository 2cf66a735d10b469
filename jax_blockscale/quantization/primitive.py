"""`quantize_nvfp4_p`: NVFP4 quantization of one matrix with one global scale, a primitive whose
lowering the planner chooses (the sm90 quantizer kernels, or the same computation in XLA).

`quantize_nvfp4_p` (x, [decode], [b_alpha]) -> (elements, scales, alpha) is `_quantize_nvfp4` of
core/quantize.py for one (M, K) matrix: x quantized to NVFP4 with one global scale, calibrated from
x's amax (``global_scale="auto"``) or the given decode factor (an f32 scalar, present when the
param ``given_scale`` is set); the elements float4_e2m1fn (M, K), the plain e4m3 scales
(M, K // 16) and the stored decode factor, or, with b_alpha (the (L,) global scales of a stacked
weight, present when ``times_b_alpha`` is set), its products with them: gemm's alpha for each
layer, which `gemm(x, w_stack, quantize_a="nvfp4", layer=i)` hands the layer target (XLA would
multiply them in a kernel of its own on every call). Where the planner puts it on the sm90
quantizer kernels (lowering/plan.py: `plan_quantize_nvfp4`: a bf16 x, K a multiple of 16, a
Hopper GPU) and no partitioner will split the call, it lowers to the target
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
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from ..core.formats import get_format
from ..lowering.registry import ALL_PLATFORMS
from ..lowering.ffi_sm90 import quantize_nvfp4_call
from ..lowering.plan import plan_quantize_nvfp4
from ..lowering.partitioning import needs_partitioning
from ..core.quantize import _quantize_nvfp4

quantize_nvfp4_p = Primitive("blockscale_quantize_nvfp4")
quantize_nvfp4_p.multiple_results = True


def _split(args, given_scale, times_b_alpha):
    """(x, decode or None, b_alpha or None) of the primitive's operands."""
    x, rest = args[0], list(args[1:])
    decode = rest.pop(0) if given_scale else None
    b_alpha = rest.pop(0) if times_b_alpha else None
    return x, decode, b_alpha


def _reference(*args, given_scale, times_b_alpha):
    """quantize.py's XLA computation (one matrix: one amax, or the given decode factor), and
    alpha = decode * b_alpha as gemm computes it."""
    x, decode, b_alpha = _split(args, given_scale, times_b_alpha)
    data, scales, g = _quantize_nvfp4(x, get_format("nvfp4"),
                                      decode if given_scale else "auto")
    g = jnp.asarray(g, jnp.float32)
    return data, scales, g if b_alpha is None else g * b_alpha.astype(jnp.float32)


def _abstract_eval(*args, given_scale, times_b_alpha):
    x, _, b_alpha = _split(args, given_scale, times_b_alpha)
    m, k = x.shape
    return (jax.core.ShapedArray((m, k), jnp.float4_e2m1fn),
            jax.core.ShapedArray((m, k // 16), jnp.float8_e4m3fn),
            jax.core.ShapedArray(() if b_alpha is None else b_alpha.shape, jnp.float32))


quantize_nvfp4_p.def_abstract_eval(_abstract_eval)
quantize_nvfp4_p.def_impl(lambda *args, **params: jax.jit(
    functools.partial(quantize_nvfp4_p.bind, **params))(*args))


def _lowering(ctx, *args, platform, given_scale, times_b_alpha):
    if plan_quantize_nvfp4(ctx.avals_in[0], platform) == "sm90" and not needs_partitioning(
            ctx, "quantize"):
        def kernels(*args):
            x, decode, b_alpha = _split(args, given_scale, times_b_alpha)
            return quantize_nvfp4_call(x, decode, b_alpha)
        return mlir.lower_fun(kernels, multiple_results=True)(ctx, *args)
    return mlir.lower_fun(functools.partial(_reference, given_scale=given_scale,
                                            times_b_alpha=times_b_alpha),
                          multiple_results=True)(ctx, *args)


for _platform in ALL_PLATFORMS:
    mlir.register_lowering(quantize_nvfp4_p, functools.partial(_lowering, platform=_platform),
                           platform=_platform)


def _batch_rule(args, dims, **params):
    # each mapped matrix quantized on its own, as vmap of quantize.py's computation does
    return jax.vmap(functools.partial(_reference, **params), in_axes=dims)(*args), (0, 0, 0)


def _jvp(primals, tangents, **params):
    tangents = tuple(ad.instantiate_zeros(t) for t in tangents)
    return jax.jvp(functools.partial(_reference, **params), primals, tangents)


batching.primitive_batchers[quantize_nvfp4_p] = _batch_rule
ad.primitive_jvps[quantize_nvfp4_p] = _jvp


def quantize_nvfp4(x: jax.Array, global_scale, b_alpha=None):
    """(elements, plain scales, decode factor) of x (..., K) quantized to NVFP4 with one global
    scale for all of it ("auto", or a given decode factor of shape ()), as _quantize_nvfp4
    computes them; through `quantize_nvfp4_p` (the kernels where they run). With b_alpha (the
    (L,) global scales of a stacked weight) the last result is decode * b_alpha instead."""
    given = not isinstance(global_scale, str)
    x2 = x.reshape((-1, x.shape[-1]))  # one global scale: folding the rows changes nothing
    extra = (jnp.asarray(global_scale, jnp.float32),) if given else ()
    if b_alpha is not None:
        extra += (jnp.asarray(b_alpha, jnp.float32),)
    data, scales, g = quantize_nvfp4_p.bind(x2, *extra, given_scale=given,
                                            times_b_alpha=b_alpha is not None)
    return data.reshape(x.shape), scales.reshape(x.shape[:-1] + (x.shape[-1] // 16,)), g
