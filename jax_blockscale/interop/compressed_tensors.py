"""compressed-tensors (llm-compressor) NVFP4 checkpoints -> BlockScaled, bit-exact elements
and block scales.

The convention (``compressed_tensors``' ``nvfp4-pack-quantized`` format, written by
llm-compressor and read by vLLM), per quantized ``Linear`` named ``<module>``:

  ``<module>.weight_packed``        uint8 (N, K/2): two e2m1 codes per byte, element 2i in the
                                    low nibble (``pack_fp4_to_uint8``)
  ``<module>.weight_scale``         float8_e4m3fn (N, K/16)
  ``<module>.weight_global_scale``  float32 (1,): the *encode* factor ``6 * 448 / amax(W)``;
                                    dequantization is ``q * (weight_scale / weight_global_scale)``
  ``<module>.input_global_scale``   float32 (1,): the activation's encode factor (W4A4)

jax_blockscale stores the decode factor, so ``global_scale = 1 / weight_global_scale`` (an f32
division, the f32 nearest to the reciprocal; the only value not carried over bit for bit: a
product with it can differ from compressed-tensors' ``scale / global`` in the last bit of f32).
Elements and block scales are kept bit for bit.
"""
from __future__ import annotations

import numpy as np

from ..core.quantize import BlockScaled
from . import _arrays as A

__all__ = ["compressed_tensors_input_scale", "from_compressed_tensors_nvfp4"]


def from_compressed_tensors_nvfp4(weight_packed, weight_scale, weight_global_scale, *,
                                  layout: str = "plain", _host: bool = False) -> BlockScaled:
    """A compressed-tensors NVFP4 weight as an ``nvfp4`` BlockScaled of logical shape (..., N, K).

    weight_packed:       uint8 (..., N, K/2), two e2m1 codes per byte, low nibble first.
    weight_scale:        float8_e4m3fn (..., N, K/16) (or its bits as uint8).
    weight_global_scale: float32 *encode* factor, shape () or (1,) (or the leading dims for a
                         stack); stored here as its reciprocal, the decode factor.
    layout:              "plain" or "blocked" (swizzled once, for `gemm`).
    """
    packed = A.as_array(weight_packed, "weight_packed")
    A.require_uint8(packed, "weight_packed", "two fp4 codes per byte")
    if packed.ndim < 2:
        raise ValueError(f"weight_packed must be (..., N, K/2), got shape {tuple(packed.shape)}")
    scales = A.reinterpret(A.as_array(weight_scale, "weight_scale"), A.E4M3, "weight_scale")
    logical = (*packed.shape[:-1], 2 * packed.shape[-1])
    A.check_scales_shape(scales, logical, 16, "weight_scale", "weight_packed")
    g = A.decode_factor(weight_global_scale, "weight_global_scale", tuple(packed.shape[:-2]),
                        invert=True)
    return A.finish(A.unpack_nibbles(packed), scales, g, "nvfp4", layout, host=_host)


def compressed_tensors_input_scale(input_global_scale):
    """compressed-tensors' activation ``input_global_scale`` (an encode factor) as the NVFP4
    global decode factor for ``jbs.quantize(x, "nvfp4", global_scale=...)``: its reciprocal."""
    g = A.decode_factor(input_global_scale, "input_global_scale", (), invert=True)
    return g if A.is_jax(g) else np.float32(g)
