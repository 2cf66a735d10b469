"""The user-facing entry points: `gemm` and `scaled_matmul` (a drop-in for jax.nn.scaled_matmul)."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from ..core.formats import FORMATS, can_multiply, check_out_dtype, format_for, supported_pairs
from ..core.quantize import BlockScaled, check_blockscaled, check_global_scale
from ..lowering.registry import forced_backend
from ..quantization.api import quantize_for_layers
from ..ragged.api import indexed_gemm
from .primitive import bind_gemm
from .quantized_activation import quantized_activation_gemm_call


def gemm(a, b: BlockScaled, *, out_dtype=jnp.bfloat16, backend: str | None = None,
         layer=None, quantize_a: str | None = None, a_global_scale=None) -> jax.Array:
    """y[..., m, n] = sum_k A[..., m, k] * B[..., n, k]  (both operands K-major, "TN").

    a: a `BlockScaled` (..., M, K), or a plain bf16/f16/f32 array for weight-only mode.
    b: a `BlockScaled` (..., N, K), typically a weight stored with ``layout="blocked"``.
    out_dtype: bf16 (default), f16 or f32; accumulation is always f32.
    backend: force one ("reference", "sm90", ...); default: the fastest that can run it
      (also settable with the JAX_BLOCKSCALE_BACKEND environment variable).
    Leading batch dims of a and b broadcast against each other. An NVFP4 operand may carry one
    global scale per matrix (shape = its batch dims, ``global_scale="per_matrix"``); the
    product of the global scales is then applied per output matrix.
    layer: with b a stack of L layers' weights (L, N, K), an integer scalar (traced or not):
      multiply by b[layer] (clamped to [0, L), as indexing does) where it lies in memory. Inside
      `lax.scan` / `fori_loop` over layers, pass the stack (not a scanned slice of it) and the
      loop index (best carried as a counter, not scanned out of an arange): a scanned slice of
      FP4 elements is copied before every call, this is not.
      Leading dims of a fold into M; `backend` then names a `ragged_gemm` backend. On Hopper,
      with the stack passed to jit and the index a loop counter, the layer runs on gemm's own
      plan for it, bit for bit as gemm(a, b[layer]); where XLA copies instead, the grouped
      decode kernel reads the index on the device (docs/design/scanned_layers.md).
    quantize_a: a format name: `a` is a plain activation to quantize to it on every call
      (W4A4 / W8A8 with the activation's global scale calibrated per call). The result is
      ``gemm(jbs.quantize(a, quantize_a), b)``; on Hopper, where that runs on the decode
      kernel (NVFP4, a bf16 `a` of up to 262,144 elements, one 2-D weight), the quantization
      runs inside the GEMM's call, bit for bit the same (docs/design/quantized_activation.md).
    a_global_scale: with ``quantize_a="nvfp4"``, the activation's decode factor given instead of
      calibrated per call (static W4A4: a checkpoint's ``input_scale`` through
      `interop.modelopt_input_scale`): a positive f32 scalar (or one per matrix of `a`, shape
      ``a.shape[:-2]``). The result is ``gemm(jbs.quantize(a, "nvfp4", global_scale=
      a_global_scale), b)``; blocks whose amax exceeds ``448 * 6 * a_global_scale`` saturate.
      On Hopper the fused call then takes any decode-kernel shape (no amax to reduce).
    """
    if not isinstance(b, BlockScaled):
        raise TypeError(f"b must be a jbs.BlockScaled (got {type(b).__name__}); quantize the "
                        "weight with jbs.quantize(w, fmt, layout='blocked')")
    if quantize_a is not None:
        return _quantized_activation_gemm(a, b, quantize_a, out_dtype, backend, layer,
                                          a_global_scale)
    if a_global_scale is not None:
        raise ValueError("a_global_scale is the decode factor to quantize a with; it needs "
                         "quantize_a='nvfp4' (to multiply an already quantized a, give it its "
                         "global scale in jbs.quantize)")
    if layer is not None:
        return _layer_gemm(a, b, layer, out_dtype, backend)
    forced_backend(backend)  # an unknown name fails here, at trace time
    check_out_dtype(out_dtype)
    check_blockscaled(b, "b")
    if isinstance(a, BlockScaled):
        check_blockscaled(a, "a")
    return bind_gemm(a, b, out_dtype, backend)


def _quantized_activation_gemm(a, b, fmt, out_dtype, backend, layer,
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
        return _layer_gemm(q, b, layer, out_dtype, backend, alpha=alpha)
    return quantized_activation_gemm_call(a, b, fmt, out_dtype, backend, a_global_scale)


def _layer_gemm(a, b: BlockScaled, layer, out_dtype, backend, alpha=None) -> jax.Array:
    """gemm(a, b[layer]) with b (L, N, K) read in place: ragged_gemm's index mode. alpha: each
    layer's product of the global scales where the caller has it (a's quantizer)."""
    if b.ndim != 3:
        raise ValueError(f"layer= needs b stacked as (L, N, K) (one matrix per layer), got b of "
                         f"shape {b.shape}")
    layer = jnp.asarray(layer)
    if layer.shape != () or not jnp.issubdtype(layer.dtype, jnp.integer):
        raise TypeError(f"layer must be an integer scalar (the index into b's {b.shape[0]} "
                        f"layers), got {layer.dtype}{list(layer.shape)}")
    lead = tuple(a.shape[:-1])  # the rows of y, whatever their dims
    if isinstance(a, BlockScaled):
        check_blockscaled(a, "a")
        if a.ndim > 2:
            if a.layout == "blocked":
                raise ValueError(f"with layer=, a BlockScaled a of shape {a.shape} must be 2-D "
                                 "when its scales are blocked (quantize it with "
                                 "layout='plain', or fold its leading dims before quantizing)")
            if a.global_scale is not None and jnp.ndim(a.global_scale):
                raise ValueError("with layer=, a's global scale must be one scalar (got shape "
                                 f"{jnp.shape(a.global_scale)})")
            a = BlockScaled(a.data.reshape((-1,) + a.shape[-1:]),
                            a.scales.reshape((-1,) + a.scales.shape[-1:]), a.global_scale,
                            a.fmt, a.layout)
    else:
        a = jnp.asarray(a)
        a = a.reshape((-1,) + a.shape[-1:])
    y = indexed_gemm(a, b, layer.astype(jnp.int32), out_dtype=out_dtype, backend=backend,
                     alpha=alpha)
    return y.reshape(lead + y.shape[-1:])


def scaled_matmul(lhs, rhs, lhs_scales, rhs_scales, preferred_element_type=jnp.float32):
    """Same contract as `jax.nn.scaled_matmul`: (B, M, K) x (B, N, K) -> (B, M, N).

    The format is inferred from the element dtype, the scale dtype and the block size
    K // scales.shape[-1] (e2m1 + e4m3 scales + 16 is nvfp4, e2m1 + e8m0 + 32 is mxfp4, ...).
    Errors name the argument (lhs, rhs, lhs_scales, rhs_scales).
    """
    def wrap(x, s, name):
        x, s = jnp.asarray(x), jnp.asarray(s)
        if x.ndim != 3:
            raise ValueError(f"{name} must be rank 3 (B, MN, K), got shape {x.shape}")
        if s.ndim != 3:
            raise ValueError(f"{name}_scales must be rank 3 (B, MN, K/block), got shape "
                             f"{s.shape}")
        if s.shape[:2] != x.shape[:2]:
            raise ValueError(f"{name}_scales has shape {s.shape}; for {name} of shape {x.shape} "
                             f"it must be {x.shape[:2] + ('K/block',)}")
        if s.shape[-1] == 0 or x.shape[-1] % s.shape[-1]:
            raise ValueError(f"{name} has K={x.shape[-1]}, which the last axis of {name}_scales "
                             f"({s.shape[-1]}) does not divide into blocks")
        try:
            f = format_for(x.dtype, s.dtype, x.shape[-1] // s.shape[-1])
        except ValueError as e:
            raise ValueError(f"{name} / {name}_scales: {e}") from None
        return BlockScaled(x, s, None, f.name, "plain")

    a, b = wrap(lhs, lhs_scales, "lhs"), wrap(rhs, rhs_scales, "rhs")
    if a.shape[-1] != b.shape[-1]:
        raise ValueError(f"lhs and rhs must agree on K (their last axis): lhs is {a.shape}, "
                         f"rhs is {b.shape}")
    if a.shape[0] != b.shape[0]:
        raise ValueError(f"lhs and rhs must have the same batch size B: lhs is {a.shape}, "
                         f"rhs is {b.shape}")
    if not can_multiply(a.fmt, b.fmt):
        raise ValueError(f"lhs ({a.fmt}) and rhs ({b.fmt}) cannot be multiplied; supported "
                         f"pairs: {supported_pairs()}")
    return gemm(a, b, out_dtype=preferred_element_type)
