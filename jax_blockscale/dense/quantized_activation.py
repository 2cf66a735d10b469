"""`jbs.gemm(x, w, quantize_a=fmt)`: the activation quantized per call, inside the GEMM's call.

The result is defined as ``gemm(quantize(x, fmt), w)``: x quantized to `fmt` with its global
scale calibrated on this call (``global_scale="auto"``, MX formats with the default rounding),
then multiplied. What changes is where the quantization runs. Written out in JAX it is three or
four small XLA kernels per GEMM (the tensor's amax, the block scales and elements, the product
of the global scales): at decode sizes, as long as the GEMM itself. Where gemm runs the
quantized problem on the sm90 decode kernel or register-weight kernel, `qact_gemm_p` lowers
instead to one FFI call whose quantizer kernels quantize x exactly as `jbs.quantize` does and
whose last kernel is that same plan: bit for bit the composed result
(docs/design/quantized_activation.md).

With ``a_global_scale=g`` (static W4A4: a checkpoint's calibrated activation scale) the result
is ``gemm(quantize(x, fmt, global_scale=g), w)`` instead, and the quantizer has no amax to
reduce.

`qact_gemm_p` (x, b, sb, b_alpha[, a_decode]) -> (M, N), x a bf16 (M, K), b a 2-D weight,
b_alpha its global scale (1.0 when it has none) and a_decode x's given decode factor (an f32
scalar; present when the param ``given_scale`` is set). Everything but that fused lowering is
the composition's:
other platforms, plans, formats and shapes lower to it; under a partitioner that will split
the call it is lowered to it too (the tensor's amax then spans every shard, and gemm's sharding
rules apply); vmap quantizes each mapped slice on its own, as ``vmap`` of the composition does;
differentiation is the composition's.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from ..core.formats import FORMATS, can_multiply, check_out_dtype, get_format, supported_pairs
from ..core.quantize import BlockScaled, check_blockscaled, check_global_scale, one_global_scale
from ..lowering.ffi_sm90 import quantized_activation_gemm
from ..lowering.partitioning import needs_partitioning
from ..lowering.plan import plan_quantized_activation
from ..lowering.registry import ALL_PLATFORMS
from ..lowering.registry import forced_backend
from ..quantization.api import quantize, quantize_for_layers
from ..ragged.api import layer_gemm
from .primitive import bind_gemm, gemm_spec

qact_gemm_p = Primitive("blockscale_quantized_act_gemm")


def composed(x, b, sb, b_alpha, a_decode=None, *, fmt, fmt_b, layout_b, b_global, given_scale,
             out_dtype, backend):
    """The definition: quantize x (with its given decode factor, else one calibrated now), then
    gemm (api.gemm validated the arguments)."""
    w = BlockScaled(b, sb, b_alpha if b_global else None, fmt_b, layout_b)
    q = quantize(x, fmt, global_scale=a_decode if given_scale else "auto")
    return bind_gemm(q, w, out_dtype, backend)


def _abstract_eval(x, b, *_, out_dtype, **__):
    return jax.core.ShapedArray((x.shape[0], b.shape[0]), np.dtype(out_dtype))


qact_gemm_p.def_abstract_eval(_abstract_eval)
qact_gemm_p.def_impl(lambda *args, **params: jax.jit(
    functools.partial(qact_gemm_p.bind, **params))(*args))


def quantized_spec(x_aval, b_aval, sb_aval, *, fmt, fmt_b, layout_b, out_dtype, backend):
    """The GemmSpec of the composed problem: x's quantized elements and plain scales times b."""
    m, k = x_aval.shape
    f_elems = jax.core.ShapedArray((m, k), jnp.float4_e2m1fn)
    f_scales = jax.core.ShapedArray((m, k // 16), jnp.float8_e4m3fn)
    alpha = jax.core.ShapedArray((), jnp.float32)
    return gemm_spec((f_elems, b_aval, f_scales, sb_aval, alpha), fmt_a=fmt, fmt_b=fmt_b,
                     layout_a="plain", layout_b=layout_b, out_dtype=out_dtype, backend=backend)


def _lowering(ctx, *args, platform, **params):
    plan = None
    if (np.dtype(ctx.avals_in[0].dtype) == np.dtype(jnp.bfloat16)
            and not needs_partitioning(ctx, "gemm")):
        spec = quantized_spec(*ctx.avals_in[:3], fmt=params["fmt"], fmt_b=params["fmt_b"],
                              layout_b=params["layout_b"], out_dtype=params["out_dtype"],
                              backend=params["backend"])
        plan = plan_quantized_activation(spec, platform, params["backend"])
    if plan is None:
        return mlir.lower_fun(functools.partial(composed, **params), multiple_results=False)(
            ctx, *args)

    def fused(x, b, sb, b_alpha, a_decode=None):
        return quantized_activation_gemm(x, b, sb, b_alpha, a_decode, plan=plan)

    return mlir.lower_fun(fused, multiple_results=False)(ctx, *args)


for _platform in ALL_PLATFORMS:
    mlir.register_lowering(qact_gemm_p, functools.partial(_lowering, platform=_platform),
                           platform=_platform)


def _batch_rule(args, dims, **params):
    # each mapped slice is quantized on its own (its own amax, or its own given scale), as vmap
    # of the composition does
    return jax.vmap(functools.partial(composed, **params), in_axes=dims)(*args), 0


def _jvp(primals, tangents, **params):
    tangents = tuple(ad.instantiate_zeros(t) for t in tangents)
    return jax.jvp(functools.partial(composed, **params), primals, tangents)


batching.primitive_batchers[qact_gemm_p] = _batch_rule
ad.primitive_jvps[qact_gemm_p] = _jvp


def quantized_activation_gemm_call(a, b: BlockScaled, fmt: str, out_dtype, backend,
                                   a_global_scale=None):
    """gemm(quantize(a, fmt, global_scale=a_global_scale or "auto"), b) for a plain `a`
    (..., M, K) and a 2-D `b`: through `qact_gemm_p` where `a` is quantized as one matrix with
    one global scale (NVFP4, a bf16 activation; the planner then decides whether the fused target
    runs it), else the composition itself."""
    given = a_global_scale is not None
    params = dict(fmt=fmt, fmt_b=b.fmt, layout_b=b.layout, b_global=b.global_scale is not None,
                  given_scale=given, out_dtype=np.dtype(out_dtype), backend=backend)
    b_alpha = jnp.float32(1.0) if b.global_scale is None else jnp.asarray(b.global_scale,
                                                                          jnp.float32)
    extra = (jnp.asarray(a_global_scale, jnp.float32),) if given else ()
    if (not get_format(fmt).has_global_scale or b.ndim != 2 or b_alpha.shape != ()
            or not one_global_scale(a, a_global_scale if given else "auto")):
        return composed(a, b.data, b.scales, b_alpha, *extra, **params)
    lead = a.shape[:-1]
    x = a.reshape((-1, a.shape[-1]))  # one tensor, one global scale: folding rows changes nothing
    y = qact_gemm_p.bind(x, b.data, b.scales, b_alpha, *extra, **params)
    return y.reshape(lead + (y.shape[-1],))


def gemm_with_quantized_activation(a, b: BlockScaled, fmt, *, out_dtype, backend, layer=None,
                                   a_global_scale=None) -> jax.Array:
    """gemm(quantize(a, fmt, global_scale=a_global_scale or "auto"), b), the quantization in
    the GEMM's call where it can be."""
    if isinstance(a, BlockScaled):
        raise TypeError(f"with quantize_a={fmt!r}, a must be the plain activation to quantize "
                        f"(got a BlockScaled of {a.fmt}); pass quantize_a=None to multiply it "
                        "as it is")
    if not isinstance(fmt, str) or fmt not in FORMATS:
        raise ValueError(f"quantize_a must be a format name, one of {sorted(FORMATS)}; got "
                         f"{fmt!r}")
    a = jnp.asarray(a)
    if not jnp.issubdtype(a.dtype, jnp.floating):
        raise TypeError(f"with quantize_a, a must be a floating-point activation, got {a.dtype}")
    check_blockscaled(b, "b")
    if not can_multiply(fmt, b.fmt):
        raise ValueError(f"quantize_a={fmt!r} cannot multiply b in {b.fmt}; supported pairs: "
                         f"{supported_pairs()}")
    forced_backend(backend)
    check_out_dtype(out_dtype)
    if a_global_scale is not None:
        if not FORMATS[fmt].has_global_scale:
            raise ValueError(f"a_global_scale is an NVFP4 decode factor; quantize_a={fmt!r} has "
                             "no global scale (pass a_global_scale=None)")
        check_global_scale(a_global_scale, tuple(a.shape[:-2]), "a_global_scale")
    gs = "auto" if a_global_scale is None else a_global_scale
    if layer is not None:
        q, alpha = quantize_for_layers(a, fmt, gs, b)
        return layer_gemm(q, b, layer, out_dtype=out_dtype, backend=backend, alpha=alpha)
    return quantized_activation_gemm_call(a, b, fmt, out_dtype, backend, a_global_scale)
