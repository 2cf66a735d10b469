"""The pure-JAX reference backend: dequantize exactly, then one `dot_general` (f32 accumulation).

Runs on every platform. Every element format times its scale is exact in f32, and in bf16 too
(at most 6 significant bits: e2m1 x e4m3); on GPUs the operands are dequantized to bf16 so the dot runs on the
tensor cores, elsewhere to f32. The global scales (alpha) are applied once, after the dot; with
none (alpha == 1) and a bf16 output on GPUs, the bf16 GEMM rounds its f32 accumulators itself.
"""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from ..quantize import BlockScaled, dequantize
from . import ALL_PLATFORMS, GemmSpec, register_backend


def operand_values(x, s, fmt, layout, dtype):
    """The exact values of one operand (plain activations pass through)."""
    if fmt is None:
        return x.astype(dtype)
    return dequantize(BlockScaled(x, s, None, fmt, layout), dtype)


def reference_gemm(a, b, sa, sb, alpha, *, spec: GemmSpec, compute_dtype=jnp.float32):
    """y[..., m, n] = alpha * sum_k A[..., m, k] * B[..., n, k], computed in f32."""
    av = operand_values(a, sa, spec.fmt_a, spec.layout_a, compute_dtype)
    bv = operand_values(b, sb, spec.fmt_b, spec.layout_b, compute_dtype)
    av = jnp.broadcast_to(av, spec.batch_shape + av.shape[-2:])
    bv = jnp.broadcast_to(bv, spec.batch_shape + bv.shape[-2:])
    nb = len(spec.batch_shape)
    batch = tuple(range(nb))
    dims = (((nb + 1,), (nb + 1,)), (batch, batch))
    if direct_output(spec, compute_dtype):
        # The GEMM accumulates in f32 and rounds once to bf16 itself: the same value as the
        # f32 result rounded below, without writing M*N f32 and reading them back (8 % of
        # an 8192^3 call on an H100, docs/sm90_notes.md).
        return lax.dot_general(av, bv, dims, precision=lax.Precision.HIGHEST,
                               preferred_element_type=spec.out_dtype)
    y = lax.dot_general(av, bv, dims, precision=lax.Precision.HIGHEST,
                        preferred_element_type=jnp.float32)
    return (y * alpha).astype(spec.out_dtype)


def direct_output(spec: GemmSpec, compute_dtype) -> bool:
    """Whether the dot may produce out_dtype itself: bf16 operands and output (the GPUs'
    bf16 GEMMs accumulate in f32) and no alpha to apply before the one rounding."""
    bf16 = jnp.dtype(jnp.bfloat16)
    return (spec.alpha_is_one and jnp.dtype(compute_dtype) == bf16
            and jnp.dtype(spec.out_dtype) == bf16)


class ReferenceBackend:
    name = "reference"
    platforms = ALL_PLATFORMS
    priority = 0

    def unsupported_reason(self, spec: GemmSpec) -> str | None:
        return None

    def __call__(self, a, b, sa, sb, alpha, *, spec: GemmSpec, platform: str):
        # On GPUs use bf16 operands (tensor cores): exact for every quantized operand, since
        # bf16 has f32's exponent range. A plain f16/f32 activation keeps f32.
        exact_in_bf16 = spec.fmt_a is not None or jnp.dtype(spec.a_dtype) == jnp.bfloat16
        gpu = platform in ("cuda", "rocm")
        dtype = jnp.bfloat16 if gpu and exact_in_bf16 else jnp.float32
        return reference_gemm(a, b, sa, sb, alpha, spec=spec, compute_dtype=dtype)


register_backend(ReferenceBackend())
