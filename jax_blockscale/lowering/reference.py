"""The pure-JAX reference backend: dequantize exactly, then one `dot_general` (f32 accumulation).

Runs on every platform. Every element format times its scale is exact in f32, and in bf16 too
(at most 6 significant bits: e2m1 x e4m3); on GPUs the operands are dequantized to bf16 so the dot runs on the
tensor cores, elsewhere to f32. The global scales (alpha) are applied once, after the dot, to its
f32 result. (The sm90 backend's large-M lowering may let the GEMM round to bf16 itself instead:
`allow_direct_output`.)
"""
from __future__ import annotations

import math

import jax.numpy as jnp
from jax import lax

from ..core.quantize import BlockScaled, dequantize
from .registry import ALL_PLATFORMS, register_backend
from .specs import GemmSpec, Plan


def operand_values(x, s, fmt, layout, dtype):
    """The exact values of one operand (plain activations pass through)."""
    if fmt is None:
        return x.astype(dtype)
    return dequantize(BlockScaled(x, s, None, fmt, layout), dtype)


def reference_gemm(a, b, sa, sb, alpha, *, spec: GemmSpec, compute_dtype=jnp.float32,
                   allow_direct_output=False):
    """y[..., m, n] = alpha * sum_k A[..., m, k] * B[..., n, k], computed in f32.

    allow_direct_output: a bf16 result may come straight from the GEMM where `direct_output`
    says so (for speed at large M; the reference backend itself never asks)."""
    av = operand_values(a, sa, spec.fmt_a, spec.layout_a, compute_dtype)
    bv = operand_values(b, sb, spec.fmt_b, spec.layout_b, compute_dtype)
    av = jnp.broadcast_to(av, spec.batch_shape + av.shape[-2:])
    bv = jnp.broadcast_to(bv, spec.batch_shape + bv.shape[-2:])
    nb = len(spec.batch_shape)
    batch = tuple(range(nb))
    dims = (((nb + 1,), (nb + 1,)), (batch, batch))
    if allow_direct_output and direct_output(spec, compute_dtype):
        # The GEMM accumulates in f32 and rounds once to bf16 itself: the same value as the
        # f32 result rounded below, without writing M*N f32 and reading them back (8 % of
        # an 8192^3 call on an H100, docs/design/large_m.md).
        return lax.dot_general(av, bv, dims, precision=lax.Precision.HIGHEST,
                               preferred_element_type=spec.out_dtype)
    y = lax.dot_general(av, bv, dims, precision=lax.Precision.HIGHEST,
                        preferred_element_type=jnp.float32)
    return (y * alpha).astype(spec.out_dtype)


# Outputs from which a bf16-output dot rounds only once. Below, XLA may pick a GEMM that adds
# bf16 partials (split K): on the H100, at 1 x 16384 x 16384 the bf16-output dot was 2.3e-3 off
# the decode kernel where the f32 dot had been 8.7e-6 off; from 512 x 16384 (2^23 outputs) up it
# matched the f32 dot rounded once bitwise (docs/design/large_m.md).
DIRECT_OUTPUT_MIN_OUTPUTS = 1 << 22


def direct_output(spec: GemmSpec, compute_dtype) -> bool:
    """Whether the dot may produce out_dtype itself: bf16 operands and output (the GPUs'
    bf16 GEMMs accumulate in f32), no alpha to apply before the one rounding, and enough
    outputs that the GEMM does not split K."""
    bf16 = jnp.dtype(jnp.bfloat16)
    return (spec.alpha_is_one and jnp.dtype(compute_dtype) == bf16
            and jnp.dtype(spec.out_dtype) == bf16
            and gemm_outputs(spec) >= DIRECT_OUTPUT_MIN_OUTPUTS)


def gemm_outputs(spec: GemmSpec) -> int:
    """Output elements of the whole (batched) problem."""
    return math.prod(spec.batch_shape) * spec.m * spec.n


class ReferenceBackend:
    name = "reference"
    platforms = ALL_PLATFORMS
    priority = 0

    def plan(self, spec: GemmSpec, device):
        return Plan("reference", "reference", spec)

    def __call__(self, a, b, sa, sb, alpha, *, plan):
        spec, platform = plan.spec, plan.platform
        # On GPUs use bf16 operands (tensor cores): exact for every quantized operand, since
        # bf16 has f32's exponent range. A plain f16/f32 activation keeps f32.
        exact_in_bf16 = spec.fmt_a is not None or jnp.dtype(spec.a_dtype) == jnp.bfloat16
        gpu = platform in ("cuda", "rocm")
        dtype = jnp.bfloat16 if gpu and exact_in_bf16 else jnp.float32
        return reference_gemm(a, b, sa, sb, alpha, spec=spec, compute_dtype=dtype)


register_backend(ReferenceBackend())
