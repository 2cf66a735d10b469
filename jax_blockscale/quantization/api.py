"""`jbs.quantize`: check the arguments, then quantize with the pure-JAX quantizer
(core/quantize.py) or, for NVFP4 with one global scale, bind `quantize_nvfp4_p`, whose lowering
the planner chooses.

    quantize(x, fmt, ...)                 the public function
    quantize_for_layers(x, fmt, gs, b)    x quantized for `gemm(x, b_stack, quantize_a=fmt,
                                          layer=i)`: the quantized x and every layer's alpha
"""
from __future__ import annotations

from typing import Any

import jax
import numpy as np

from ..core.quantize import (BlockScaled, check_quantize_args, one_global_scale, quantize_values,
                             to_blocked)
from .primitive import quantize_nvfp4


def quantize(x: jax.Array, fmt: str, *, global_scale: Any = "auto", layout: str = "plain",
             scale_rounding: str = "round_up") -> BlockScaled:
    """Quantize `x` (..., MN, K) along its last axis into `fmt`.

    global_scale (NVFP4's fp32 tier; MX formats have none and take "auto", "per_matrix" or
      None):
        "auto"        one decode factor ``amax(x) / (6 * 448)`` for the whole tensor (activations);
        "per_matrix"  one per trailing (MN, K) matrix, shape ``x.shape[:-2]`` (stacked layers and
                      experts: each matrix keeps its own, as published checkpoints store them);
        None          no global tier (block scales must fit e4m3 on their own);
        a number or array of shape () or ``x.shape[:-2]``: that decode factor (finite, > 0).
      "auto" and "per_matrix" ignore NaN and Inf (they stay in their own block).
    layout: "plain" or "blocked" (swizzled for the tensor cores; what weights should use).
    scale_rounding (MX formats): "round_up" (default, ``2^ceil(log2(amax / elem_max))``, no
      saturation, less error) or "ocp" (``2^(floor(log2 amax) - emax)``, OCP MX v1.0 as
      written). NVFP4's e4m3 block scales are always rounded to nearest. See docs/formats.md.
    """
    f, x = check_quantize_args(x, fmt, global_scale, layout, scale_rounding)
    if f.has_global_scale and one_global_scale(x, global_scale):
        data, scales, g = quantize_nvfp4(x, global_scale)
    else:
        data, scales, g = quantize_values(x, f, global_scale, scale_rounding)
    q = BlockScaled(data, scales, g, f.name, "plain")
    return to_blocked(q) if layout == "blocked" else q


def quantize_for_layers(x: jax.Array, fmt: str, global_scale, b: BlockScaled):
    """x quantized to `fmt` for a product with one layer of the stack b (L, N, K) at a time:
    (the quantized x, every layer's alpha (L,) or None).

    With one global scale for x (NVFP4, "auto" or a scalar), the quantizer also multiplies its
    decode factor into each layer's global scale, the alpha the layer GEMM reads (else XLA
    multiplies them in a kernel of its own on every call); the returned x then carries no global
    scale of its own. Otherwise x keeps its global scale and the alpha is left to the GEMM."""
    if (fmt == "nvfp4" and one_global_scale(x, global_scale) and b.ndim == 3
            and (b.global_scale is None or np.ndim(b.global_scale) == 1)):
        b_alpha = (np.ones((b.shape[0],), np.float32) if b.global_scale is None
                   else b.global_scale)
        data, scales, alpha = quantize_nvfp4(x, global_scale, b_alpha)
        return BlockScaled(data, scales, None, fmt, "plain"), alpha
    return quantize(x, fmt, global_scale=global_scale), None
