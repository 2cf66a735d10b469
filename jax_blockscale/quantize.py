"""Quantize / dequantize along the last axis (pure JAX, jit-able), and the `BlockScaled` pytree.

MX formats follow the OCP Microscaling spec v1.0: per block, the shared exponent is
``floor(log2(amax)) - emax_elem`` (clamped to e8m0's range; an all-zero block gets the smallest
scale, which is finite), and elements are ``x / 2**shared_exp`` rounded to nearest-even and
saturated to the element's largest finite value.

NVFP4 uses the two-level recipe: an fp32 global *encode* scale ``enc = 6 * 448 / amax(x)``,
block scales ``e4m3(amax_block / 6 * enc)`` and elements ``e2m1(x * (enc / scale))``. The stored
`global_scale` is the *decode* factor ``1 / enc``; ``global_scale=None`` drops the tier (enc = 1).
"""
from __future__ import annotations

import dataclasses
import json
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax import lax

from . import layout as _layout
from .formats import Format, get_format

_E4M3_MAX = 448.0
_E8M0_BIAS = 127


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class BlockScaled:
    """A block-scaled tensor: ``value[..., i, k] = data[..., i, k] * scale(i, k // block) * g``.

    data:          (..., MN, K) elements in the format's storage dtype (FP6: uint8 codes).
    scales:        (..., MN, K // block) in `plain` layout, or
                   (..., ceil(MN/128), ceil(SK/4), 32, 4, 4) in `blocked` layout.
    global_scale:  fp32 scalar decode factor (NVFP4 only) or None.
    fmt, layout:   static metadata; a blocked tensor is never swizzled again.
    """
    data: jax.Array
    scales: jax.Array
    global_scale: jax.Array | None
    fmt: str = dataclasses.field(metadata=dict(static=True))
    layout: str = dataclasses.field(default="plain", metadata=dict(static=True))

    @property
    def format(self) -> Format:
        return get_format(self.fmt)

    @property
    def shape(self) -> tuple[int, ...]:
        """The logical shape (..., MN, K) of the tensor this stands for."""
        return tuple(self.data.shape)

    @property
    def ndim(self) -> int:
        return len(self.data.shape)

    def plain_scales(self) -> jax.Array:
        """Scales in the plain (..., MN, K // block) layout, whatever the stored layout."""
        if self.layout == "plain":
            return self.scales
        *_, mn, k = self.data.shape
        return _layout.from_blocked_scales(self.scales, mn, k // self.format.block)

    def packed_data(self) -> jax.Array:
        """FP4 elements packed two per byte (low nibble first), as uint8 (..., MN, K // 2)."""
        if self.format.element_bits != 4:
            raise ValueError(f"packed_data() is for fp4 formats; {self.fmt} is not one")
        return pack_fp4(self.data)


# Let jax.export serialize functions that take or return BlockScaled (aux data: fmt, layout).
jax.export.register_pytree_node_serialization(
    BlockScaled, serialized_name="jax_blockscale.BlockScaled",
    serialize_auxdata=lambda aux: json.dumps(list(aux)).encode(),
    deserialize_auxdata=lambda raw: tuple(json.loads(raw.decode())))


def to_blocked(q: BlockScaled) -> BlockScaled:
    """Swizzle the scales once into the tensor cores' 128x4 layout (a no-op if already so)."""
    if q.layout == "blocked":
        return q
    return dataclasses.replace(q, scales=_layout.to_blocked_scales(q.scales), layout="blocked")


def to_plain(q: BlockScaled) -> BlockScaled:
    """Undo `to_blocked` (a no-op for plain scales)."""
    if q.layout == "plain":
        return q
    return dataclasses.replace(q, scales=q.plain_scales(), layout="plain")


# ---------------------------------------------------------------------------------------------
# Element rounding and decoding


def _f6_value_table(fmt: Format) -> np.ndarray:
    """Every 6-bit code's value, code order (0..31 positive increasing, 32..63 negated)."""
    return np.arange(64, dtype=np.uint8).view(fmt.element_dtype).astype(np.float32)


def _round_to_f6_codes(x: jax.Array, fmt: Format) -> jax.Array:
    """Round f32 values (already saturated) to nearest-even FP6 and return their uint8 codes."""
    info = ml_dtypes.finfo(fmt.element_dtype)
    mag = jnp.abs(x)
    _, exp = jnp.frexp(mag)  # mag = m * 2**exp with m in [0.5, 1): floor(log2 mag) = exp - 1
    exp = jnp.maximum(exp - 1, info.minexp)  # subnormals share the smallest normal exponent
    quantum = jnp.ldexp(jnp.float32(1.0), exp - info.nmant)
    rounded = jnp.minimum(jnp.round(mag / quantum) * quantum, fmt.elem_max)  # half-to-even
    positive = jnp.asarray(_f6_value_table(fmt)[:32])
    code = jnp.searchsorted(positive, rounded).astype(jnp.uint8)
    return jnp.where(jnp.signbit(x), code | jnp.uint8(32), code)


def encode_elements(x: jax.Array, fmt: str | Format) -> jax.Array:
    """Round f32 values to the format's elements (nearest-even, saturating) in its storage dtype."""
    fmt = get_format(fmt)
    x = jnp.clip(x.astype(jnp.float32), -fmt.elem_max, fmt.elem_max)
    if fmt.is_code_stored:
        return _round_to_f6_codes(x, fmt)
    return x.astype(fmt.storage_dtype)


def e2m1_bf16_bits(code: jax.Array) -> jax.Array:
    """The bf16 bit pattern (u32, low 16 bits) of e2m1 codes (u32 in 0..15), by integer ops."""
    mag = code & 7  # 0, .5, 1, 1.5, 2, 3, 4, 6: from 2 on, 1.0 (0x3F80) plus 0x40 per step
    normal = jnp.uint32(0x3F80) + (mag - 2) * jnp.uint32(0x40)
    bits = jnp.where(mag >= 2, normal, jnp.where(mag == 1, jnp.uint32(0x3F00), jnp.uint32(0)))
    return ((code & 8) << 12) | bits  # the sign: bit 3 -> bit 15


def _e2m1_values(data: jax.Array) -> jax.Array:
    """FP4 (e2m1) elements to f32 through their bf16 bit patterns (`e2m1_bf16_bits`).

    Exact, and on GPUs XLA's fusion runs it ~20 % faster than its own float4 conversion (the
    dequantize pass of a large-M gemm: 398 -> 319 us at 16384^2 on an H100, docs/sm90_notes.md).
    """
    code = lax.bitcast_convert_type(data, jnp.uint4).astype(jnp.uint32)
    bits = e2m1_bf16_bits(code).astype(jnp.uint16)
    return lax.bitcast_convert_type(bits, jnp.bfloat16).astype(jnp.float32)


def decode_elements(data: jax.Array, fmt: str | Format) -> jax.Array:
    """The f32 value of each stored element."""
    fmt = get_format(fmt)
    if fmt.is_code_stored:
        return jnp.asarray(_f6_value_table(fmt))[data & jnp.uint8(63)]
    if data.dtype == jnp.float4_e2m1fn:
        return _e2m1_values(data)
    return data.astype(jnp.float32)


def _pow2(exponent: jax.Array) -> jax.Array:
    """2**exponent in f32 for exponent in [-126, 127], built from bits (exact, no FTZ issues)."""
    return lax.bitcast_convert_type((exponent + 127).astype(jnp.int32) << 23, jnp.float32)


# ---------------------------------------------------------------------------------------------
# quantize / dequantize


def _blocks(x: jax.Array, block: int) -> jax.Array:
    k = x.shape[-1]
    if k % block:
        raise ValueError(f"the last (K) axis has length {k}, not a multiple of the block size "
                         f"{block}; pad K with zeros to a multiple of {block}")
    return x.astype(jnp.float32).reshape(*x.shape[:-1], k // block, block)


def _quantize_mx(x: jax.Array, fmt: Format):
    xb = _blocks(x, fmt.block)
    amax = jnp.max(jnp.abs(xb), axis=-1)
    _, exp = jnp.frexp(amax)
    shared = jnp.where(amax > 0, exp - 1 - fmt.emax, -_E8M0_BIAS)
    shared = jnp.clip(shared, -_E8M0_BIAS, _E8M0_BIAS)
    scales = lax.bitcast_convert_type((shared + _E8M0_BIAS).astype(jnp.uint8), fmt.scale_dtype)
    # Dividing by 2**shared is multiplying by 2**-shared: exact, and -shared <= 127 stays normal
    # while the clamp at -127 only applies to blocks with amax < 2**-125 (treated as tiny).
    inv = _pow2(jnp.minimum(-shared, 127))[..., None]
    data = encode_elements(xb * inv, fmt)
    return data.reshape(x.shape), scales, None


def _quantize_nvfp4(x: jax.Array, fmt: Format, global_scale):
    xb = _blocks(x, fmt.block)
    if global_scale is None:
        enc = jnp.float32(1.0)
        decode = None
    elif isinstance(global_scale, str):  # "auto": calibrate on this tensor
        amax = jnp.max(jnp.abs(xb))
        enc = jnp.where(amax > 0, fmt.elem_max * _E4M3_MAX / amax, 1.0).astype(jnp.float32)
        decode = (1.0 / enc).astype(jnp.float32)
    else:  # a caller-chosen decode factor
        decode = jnp.asarray(global_scale, jnp.float32)
        if decode.shape != ():
            raise ValueError(f"global_scale must be a scalar, got shape {decode.shape}")
        enc = 1.0 / decode
    block_amax = jnp.max(jnp.abs(xb), axis=-1)
    scales = jnp.minimum(block_amax / fmt.elem_max * enc, _E4M3_MAX).astype(fmt.scale_dtype)
    # the stored (rounded) scales divide the elements; the barrier keeps XLA from removing the
    # f32 -> e4m3 -> f32 round trip, as it does in dequantize on GPUs (not seen here: defensive)
    scales_f32 = lax.optimization_barrier(scales).astype(jnp.float32)[..., None]
    safe = jnp.where(scales_f32 > 0, scales_f32, 1.0)
    elems = jnp.where(scales_f32 > 0, xb * (enc / safe), 0.0)
    data = encode_elements(elems, fmt)
    return data.reshape(x.shape), scales, decode


def quantize(x: jax.Array, fmt: str, *, global_scale: Any = "auto",
             layout: str = "plain") -> BlockScaled:
    """Quantize `x` (..., MN, K) along its last axis into `fmt`.

    global_scale (NVFP4 only): "auto" calibrates ``1 / (6 * 448 / amax(x))`` on `x`; None drops
    the fp32 tier; a scalar uses that decode factor. MX formats take no global scale.
    layout: "plain" or "blocked" (swizzled for the tensor cores; what weights should use).
    """
    f = get_format(fmt)
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"quantize expects a floating-point array, got {x.dtype}")
    if x.ndim < 1:
        raise ValueError("quantize needs at least one axis (the K axis)")
    if layout not in _layout.LAYOUTS:
        raise ValueError(f"layout must be one of {_layout.LAYOUTS}, got {layout!r}")
    if f.has_global_scale:
        data, scales, g = _quantize_nvfp4(x, f, global_scale)
    else:
        if not (global_scale is None or (isinstance(global_scale, str) and global_scale == "auto")):
            raise ValueError(f"{f.name} has no global scale (only nvfp4 does); pass "
                             "global_scale=None or leave it at 'auto'")
        data, scales, g = _quantize_mx(x, f)
    q = BlockScaled(data, scales, g, f.name, "plain")
    return to_blocked(q) if layout == "blocked" else q


def dequantize(q: BlockScaled, dtype=jnp.float32) -> jax.Array:
    """The values `q` stands for, in `dtype` (f32 is exact for every format)."""
    f = q.format
    # The barrier keeps the stored elements and scales opaque. Without it, in a jit that also
    # quantizes, XLA's GPU pipeline (allow_excess_precision) removes an f32 -> fp8 -> f32 pair of
    # converts and computes with the unrounded values: not what was stored, not what a kernel
    # reads (seen on the H100: 3-7 % off for nvfp4 and mxfp8 activations quantized in the jit).
    data, scales = lax.optimization_barrier((q.data, q.plain_scales()))
    vals = decode_elements(data, f)
    *lead, k = vals.shape
    scales = scales.astype(jnp.float32)
    vals = (vals.reshape(*lead, k // f.block, f.block) * scales[..., None]).reshape(vals.shape)
    if q.global_scale is not None:
        vals = vals * q.global_scale
    return vals.astype(dtype)


# ---------------------------------------------------------------------------------------------
# Packed-uint8 interop for fp4 (two elements per byte, low nibble first, as torch and Triton)


def pack_fp4(data: jax.Array) -> jax.Array:
    """float4_e2m1fn (..., K) -> uint8 (..., K // 2); element 2i in the low nibble."""
    if data.dtype != jnp.float4_e2m1fn:
        raise TypeError(f"pack_fp4 expects float4_e2m1fn elements, got {data.dtype}")
    if data.shape[-1] % 2:
        raise ValueError(f"pack_fp4 needs an even last axis, got {data.shape[-1]}")
    codes = lax.bitcast_convert_type(data, jnp.uint4).astype(jnp.uint8)
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_fp4(packed: jax.Array) -> jax.Array:
    """uint8 (..., K // 2) -> float4_e2m1fn (..., K); the inverse of `pack_fp4`."""
    if packed.dtype != jnp.uint8:
        raise TypeError(f"unpack_fp4 expects uint8, got {packed.dtype}")
    codes = jnp.stack([packed & 0xF, packed >> 4], axis=-1).reshape(*packed.shape[:-1], -1)
    return lax.bitcast_convert_type(codes.astype(jnp.uint4), jnp.float4_e2m1fn)
