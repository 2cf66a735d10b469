"""NVIDIA TensorRT Model Optimizer (ModelOpt) NVFP4 checkpoints -> BlockScaled, bit-exact.

The convention (ModelOpt's ``NVFP4QTensor`` and its Hugging Face export, which TensorRT-LLM,
vLLM and SGLang read), per quantized ``Linear`` named ``<module>``:

  ``<module>.weight``          uint8 (N, K/2): two e2m1 codes per byte, element 2i in the low
                               nibble, element 2i+1 in the high one (``q[1::2] << 4 | q[0::2]``)
  ``<module>.weight_scale``    float8_e4m3fn (N, K/16): one scale per 16 elements along K
  ``<module>.weight_scale_2``  float32, shape () or (1,): the per-tensor *decode* factor
                               ``amax(W) / (6 * 448)``; value = e2m1 * weight_scale * weight_scale_2
  ``<module>.input_scale``     float32 (): the activation's per-tensor decode factor
                               ``amax(x) / (6 * 448)``, for static W4A4 (absent for weight-only)

This is exactly jax_blockscale's NVFP4 (``global_scale`` is the decode factor), so every bit is
kept: the codes become float4_e2m1fn elements, the scales stay e4m3, ``weight_scale_2`` becomes
``global_scale`` unchanged.
"""
from __future__ import annotations

import numpy as np

from ..core.quantize import BlockScaled
from . import _arrays as A

__all__ = ["from_modelopt_nvfp4", "modelopt_input_scale"]


def from_modelopt_nvfp4(weight, weight_scale, weight_scale_2, *, layout: str = "plain",
                        _host: bool = False) -> BlockScaled:
    """A ModelOpt NVFP4 weight as an ``nvfp4`` BlockScaled of logical shape (..., N, K).

    weight:         uint8 (..., N, K/2), two e2m1 codes per byte, low nibble first.
    weight_scale:   float8_e4m3fn (..., N, K/16) (or its bits as uint8).
    weight_scale_2: float32 decode factor: shape () or (1,), or the leading dims (...) for a
                    stack of matrices with one factor each (a ``per_matrix`` global scale).
    layout:         "plain" (as stored) or "blocked" (swizzled once by `jbs.to_blocked`, what a
                    weight passed to `gemm` should use).

    NumPy or JAX arrays (JAX: also under `jit`). Bit-exact: nothing is re-quantized.
    """
    weight = A.as_array(weight, "weight")
    A.require_uint8(weight, "weight", "ModelOpt packs two fp4 codes per byte")
    if weight.ndim < 2:
        raise ValueError(f"weight must be (..., N, K/2), got shape {tuple(weight.shape)}")
    scales = A.reinterpret(A.as_array(weight_scale, "weight_scale"), A.E4M3, "weight_scale")
    logical = (*weight.shape[:-1], 2 * weight.shape[-1])
    A.check_scales_shape(scales, logical, 16, "weight_scale", "weight")
    g = A.decode_factor(weight_scale_2, "weight_scale_2", tuple(weight.shape[:-2]), invert=False)
    return A.finish(A.unpack_nibbles(weight), scales, g, "nvfp4", layout, host=_host)


def modelopt_input_scale(input_scale):
    """ModelOpt's activation ``input_scale`` as the NVFP4 global (decode) factor for
    ``jbs.quantize(x, "nvfp4", global_scale=...)``: it already is one (``amax / (6 * 448)``),
    so this only checks it and returns it as an f32 scalar."""
    g = A.decode_factor(input_scale, "input_scale", (), invert=False)
    return g if A.is_jax(g) else np.float32(g)
