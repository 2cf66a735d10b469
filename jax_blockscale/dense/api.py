"""The user-facing entry points: `gemm` and `scaled_matmul` (a drop-in for jax.nn.scaled_matmul)."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from ..core.formats import can_multiply, check_out_dtype, format_for, supported_pairs
from ..core.quantize import BlockScaled, check_blockscaled
from ..lowering.registry import forced_backend
from ..ragged.api import layer_gemm
from .primitive import bind_gemm
from .quantized_activation import gemm_with_quantized_activation


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
        return gemm_with_quantized_activation(a, b, quantize_a, out_dtype=out_dtype,
                                              backend=backend, layer=layer,
                                              a_global_scale=a_global_scale)
    if a_global_scale is not None:
        raise ValueError("a_global_scale is the decode factor to quantize a with; it needs "
                         "quantize_a='nvfp4' (to multiply an already quantized a, give it its "
                         "global scale in jbs.quantize)")
    if layer is not None:
        return layer_gemm(a, b, layer, out_dtype=out_dtype, backend=backend)
    forced_backend(backend)  # an unknown name fails here, at trace time
    check_out_dtype(out_dtype)
    check_blockscaled(b, "b")
    if isinstance(a, BlockScaled):
        check_blockscaled(a, "a")
    return bind_gemm(a, b, out_dtype, backend)


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
