"""Quantize / dequantize along the last axis (pure JAX, jit-able), and the `BlockScaled` pytree.

MX formats (OCP Microscaling v1.0 layout: e8m0 power-of-two scales, blocks of 32). The shared
exponent of a block comes from its largest finite magnitude `amax` by one of two rules
(``scale_rounding=``):

  "round_up" (default)  ``ceil(log2(amax / elem_max))``: the smallest power of two that keeps the
                        block's largest value at or below the largest element, so nothing
                        saturates (JAX's own MX quantizer, qwix, NVIDIA's MXFP8 recipe);
  "ocp"                 ``floor(log2(amax)) - emax_elem``, the rule written in OCP MX v1.0: a block
                        whose amax mantissa lies above the element's (1.5 for e2m1, 1.75 for e4m3)
                        saturates its largest values.

Both are clamped to e8m0's range [-127, 127]; an all-zero block gets the smallest scale (2^-127).
Elements are ``x / 2**shared`` rounded to nearest-even and saturated at the largest element.

NVFP4 uses the two-level recipe: an fp32 global *encode* scale ``enc = 6 * 448 / amax(x)``,
block scales ``e4m3(amax_block / 6 * enc)`` and elements ``e2m1(x * (enc / scale))``. The stored
`global_scale` is the *decode* factor ``1 / enc``: one scalar (``global_scale="auto"``), one per
trailing (MN, K) matrix (``"per_matrix"``, shape = the leading dims), none (``None``, enc = 1),
or a caller's decode factor.

Non-finite input stays in its block (docs/formats.md, "NaN and Inf"): the tensor-level amax
ignores NaN and Inf; an element type with a NaN (e4m3) or Inf (e5m2) keeps the value itself,
otherwise (e2m1, e2m3, e3m2, and NVFP4) the block's scale becomes NaN so the whole block
decodes to NaN.
"""
from __future__ import annotations

import dataclasses
import json
import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax import lax

from . import layout as _layout
from .formats import PLAIN_DTYPES, Format, can_multiply, get_format, supported_pairs

_E4M3_MAX = 448.0
_E8M0_BIAS = 127
# The largest NVFP4 encode factor "auto" / "per_matrix" use: its decode factor 2^-126 is the
# smallest normal f32, so it survives CPUs and GPUs that flush subnormals to zero. Only tensors
# with amax below 6 * 448 * 2^-126 (3.2e-35) reach it.
_MAX_ENCODE = 2.0 ** 126

GLOBAL_SCALE_MODES = ("auto", "per_matrix")
SCALE_ROUNDINGS = ("round_up", "ocp")


@dataclasses.dataclass(frozen=True)
class BlockScaled:
    """A block-scaled tensor: ``value[..., i, k] = data[..., i, k] * scale(i, k // block) * g``.

    data:          (..., MN, K) elements in the format's storage dtype (FP6: uint8 codes).
    scales:        (..., MN, K // block) in `plain` layout, or
                   (..., ceil(MN/128), ceil(SK/4), 32, 4, 4) in `blocked` layout.
    global_scale:  NVFP4 only: an fp32 decode factor, a scalar or one per trailing (MN, K)
                   matrix (shape = data.shape[:-2]); or None.
    fmt, layout:   static metadata; a blocked tensor is never swizzled again.

    Leading (batch) axes behave like an array's: ``q[i]`` (or vmap / scan over them) gives the
    i-th matrix, with its own global scale when there is one per matrix, and the stack's when
    there is one for the whole stack (`jbs.quantize`'s default "auto"). `check_blockscaled`
    validates a hand-built one; `gemm` and `dequantize` call it.

    As a pytree its leaves are data, scales and the global scale. A stack's single (scalar)
    global scale is handed over broadcast to the batch shape, so that `lax.scan`, `vmap` and
    `nnx.scan` can slice it with the matrices; rebuilt, it is one scalar again.
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

    def __getitem__(self, index) -> "BlockScaled":
        """Index the leading (batch) axes only: ``w[3]`` is the 4th matrix of a stack."""
        nbatch = self.ndim - 2
        idx = index if isinstance(index, tuple) else (index,)
        if any(i is Ellipsis or i is None for i in idx) or len(idx) > nbatch:
            raise IndexError(f"a BlockScaled of shape {self.shape} indexes its {nbatch} leading "
                             f"(batch) axes only, with ints and slices; got {index!r}")
        gs = self.global_scale
        if gs is not None and jnp.ndim(gs) > 0:
            gs = gs[idx]
        return BlockScaled(self.data[idx], self.scales[idx], gs, self.fmt, self.layout)

    def __iter__(self):
        """The matrices of a stack, one by one (a single matrix is not iterable)."""
        if self.ndim <= 2:
            raise TypeError(f"a single {self.fmt} matrix {self.shape} is not iterable; only "
                            "the leading (batch) axes of a stack are")
        return (self[i] for i in range(self.shape[0]))


# What a global scale or elements array may be when its value is known (not an aval, sharding
# or spec that JAX rebuilds the pytree around)
_ARRAYS = (jax.Array, np.ndarray)
_SCALARS = _ARRAYS + (np.generic, float, int)


def _shares_global_scale(q: BlockScaled) -> bool:
    """A stack (batch dims, none empty) with one scalar global scale for all of it.

    Decided once, from the arrays, and kept by the pytree's rebuilds: JAX also rebuilds a
    BlockScaled around other leaves (avals, shardings, specs) and must flatten those to the same
    tree structure."""
    known = q.__dict__.get("_shared_global_scale")
    if known is not None:
        return known
    gs, data = q.global_scale, q.data
    shared = (isinstance(gs, _SCALARS) and isinstance(data, _ARRAYS) and np.ndim(gs) == 0
              and data.ndim > 2 and math.prod(data.shape[:-2]) > 0)
    object.__setattr__(q, "_shared_global_scale", shared)
    return shared


def _global_scale_leaf(q: BlockScaled):
    """The global scale as the pytree hands it over: a stack's shared scalar broadcast to the
    batch shape (made once per BlockScaled), else as it is."""
    gs = q.global_scale
    if not (_shares_global_scale(q) and isinstance(gs, _SCALARS) and np.ndim(gs) == 0):
        return gs
    cached = q.__dict__.get("_global_scale_leaf")
    if cached is None:
        cached = jnp.broadcast_to(jnp.asarray(gs, jnp.float32), q.data.shape[:-2])
        object.__setattr__(q, "_global_scale_leaf", cached)
    return cached


_KEYS = tuple(jax.tree_util.GetAttrKey(name) for name in ("data", "scales", "global_scale"))


def _flatten(q: BlockScaled):
    return (q.data, q.scales, _global_scale_leaf(q)), (q.fmt, q.layout, _shares_global_scale(q))


def _flatten_with_keys(q: BlockScaled):
    leaves, aux = _flatten(q)
    return tuple(zip(_KEYS, leaves)), aux


def _unflatten(aux, leaves):
    fmt, layout, shared = aux
    data, scales, gs = leaves
    if shared and isinstance(gs, _ARRAYS) and gs.ndim > 0:
        gs = gs[(0,) * gs.ndim]  # every element is the stack's one scale
    q = BlockScaled(data, scales, gs, fmt, layout)
    # a slice of the stack (lax.scan, vmap) is one matrix: its scale is its own again
    one_matrix = isinstance(data, _ARRAYS) and data.ndim <= 2
    object.__setattr__(q, "_shared_global_scale", bool(shared) and not one_matrix)
    return q


jax.tree_util.register_pytree_with_keys(BlockScaled, _flatten_with_keys, _unflatten,
                                        flatten_func=_flatten)


# Let jax.export serialize functions that take or return BlockScaled (aux data: fmt, layout,
# whether a stack's global scale is shared).
jax.export.register_pytree_node_serialization(
    BlockScaled, serialized_name="jax_blockscale.BlockScaled",
    serialize_auxdata=lambda aux: json.dumps(list(aux)).encode(),
    deserialize_auxdata=lambda raw: _auxdata(json.loads(raw.decode())))


def _auxdata(aux: list) -> tuple:
    """Aux data read back from a serialized export (older ones have no shared flag)."""
    return tuple(aux) + (False,) * (3 - len(aux))


def to_blocked(q: BlockScaled) -> BlockScaled:
    """Swizzle the scales once into the tensor cores' 128x4 layout (a no-op if already so)."""
    if q.layout == "blocked":
        return q
    if q.ndim < 2:
        raise ValueError(f"the blocked scale layout needs (..., MN, K) elements (at least 2 "
                         f"axes); this {q.fmt} tensor has shape {q.shape}")
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
        # Codes 64..255 are not FP6 codes (a hand-built or corrupted tensor): they decode to NaN
        # rather than to whatever their low 6 bits would say.
        table = np.full(256, np.nan, np.float32)
        table[:64] = _f6_value_table(fmt)
        return jnp.asarray(table)[data]
    if data.dtype == jnp.float4_e2m1fn:
        return _e2m1_values(data)
    return data.astype(jnp.float32)


def _pow2(exponent: jax.Array) -> jax.Array:
    """2**exponent in f32 for exponent in [-126, 127], built from bits (exact, no FTZ issues)."""
    return lax.bitcast_convert_type((exponent + 127).astype(jnp.int32) << 23, jnp.float32)


# ---------------------------------------------------------------------------------------------
# Validation of hand-built tensors and of arguments


def _is_concrete(x) -> bool:
    """An array whose values can be read now (not a tracer inside jit / vmap / grad)."""
    if isinstance(x, jax.core.Tracer):
        return False
    if isinstance(x, jax.Array):
        return x.is_fully_addressable  # (a multi-process array cannot be read here)
    return isinstance(x, (np.ndarray, np.generic, float, int))


def check_global_scale(gs, batch_shape: tuple, name: str = "global_scale", *,
                       values: bool = True) -> None:
    """A decode factor must be floating-point, a scalar or one per matrix (shape `batch_shape`),
    and, where its values are known now (and ``values``), finite and positive."""
    shape = tuple(np.shape(gs))  # np: also a list, which jnp.shape will refuse
    if shape not in ((), tuple(batch_shape)):
        raise ValueError(f"{name} has shape {shape}; it must be a scalar or hold one decode "
                         f"factor per (MN, K) matrix, shape {tuple(batch_shape)}")
    dtype = getattr(gs, "dtype", None)
    if dtype is not None and not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(f"{name} must be a floating-point decode factor, got {dtype}")
    if values and _is_concrete(gs):
        v = np.asarray(jax.device_get(gs), np.float32).ravel()
        bad = v[~(np.isfinite(v) & (v > 0))]
        if bad.size:
            raise ValueError(f"{name} must be finite and positive (a decode factor); it holds "
                             f"{', '.join(map(str, bad[:4]))}")


def check_elements(name, x, fmt):
    """Raise, naming `name`, unless x (an array or aval, (..., MN, K)) holds `fmt`'s elements
    (fmt None: a plain bf16/f16/f32 activation)."""
    if x.ndim < 2:
        raise ValueError(f"{name} must have shape (..., MN, K), got {x.shape}")
    if fmt is None:
        if np.dtype(x.dtype) not in PLAIN_DTYPES:
            raise TypeError(f"{name} is a plain array of dtype {x.dtype}; weight-only mode takes "
                            f"{[d.name for d in PLAIN_DTYPES]}, or pass a jbs.quantize(...) result")
        return
    f = get_format(fmt)
    if np.dtype(x.dtype) != f.storage_dtype:
        raise TypeError(f"{name} holds {x.dtype} elements but format {fmt} stores "
                        f"{f.storage_dtype.name}; quantize with jbs.quantize(x, {fmt!r})")
    if x.shape[-1] % f.block:
        raise ValueError(f"{name} has K={x.shape[-1]}, not a multiple of the {fmt} block size "
                         f"{f.block}; pad K with zeros to a multiple of {f.block}")


def check_scales(name, s, x, fmt, layout):
    """Raise, naming `name`, unless s is the scales of elements x in `fmt` and `layout`."""
    f = get_format(fmt)
    if layout not in _layout.LAYOUTS:
        raise ValueError(f"{name} layout must be one of {_layout.LAYOUTS}, got {layout!r}")
    if np.dtype(s.dtype) != f.scale_dtype:
        raise TypeError(f"{name} has dtype {s.dtype} but format {fmt} uses "
                        f"{f.scale_dtype.name} scales")
    *batch, mn, k = x.shape
    sk = k // f.block
    want = (tuple(batch) + (mn, sk) if layout == "plain"
            else tuple(batch) + _layout.blocked_shape(mn, sk))
    if tuple(s.shape) != want:
        raise ValueError(f"{name} has shape {tuple(s.shape)}; {layout} scales for elements of "
                         f"shape {tuple(x.shape)} ({fmt}, block {f.block}) must have shape "
                         f"{want}" + ("; convert with jbs.to_blocked" if layout == "blocked"
                                      else ""))


def check_operand_pair(names, x, w, sx, sw, fmt_x, fmt_w, layout_x, layout_w, *,
                       plain_name: str):
    """Raise, naming the operand, unless x (the activation: quantized or, fmt_x None, plain)
    and w (quantized) are elements that multiply: each holds its format's elements, they agree
    on K (their last axis), the formats pair, and each quantized one's scales fit it in its
    layout. names: (x's name, w's name); plain_name: how the error calls a plain x."""
    nx, nw = names
    check_elements(nx, x, fmt_x)
    check_elements(nw, w, fmt_w)
    if x.shape[-1] != w.shape[-1]:
        raise ValueError(f"{nx} and {nw} must agree on K (their last axis): {nx} is "
                         f"{tuple(x.shape)}, {nw} is {tuple(w.shape)}")
    if not can_multiply(fmt_x, fmt_w):
        raise ValueError(f"formats {fmt_x} x {fmt_w} cannot be multiplied; supported pairs: "
                         f"{supported_pairs()} and weight-only ({plain_name} x any format)")
    if fmt_x is not None:
        check_scales(f"{nx} scales", sx, x, fmt_x, layout_x)
    check_scales(f"{nw} scales", sw, w, fmt_w, layout_w)


def check_blockscaled(q: BlockScaled, name: str = "q", *, values: bool = True) -> None:
    """Raise a ValueError/TypeError naming `name` unless `q` is a consistent BlockScaled.

    Checks the format, layout, element and scale dtypes and shapes and the global scale's
    presence and shape (all static, so also inside jit). With ``values=True`` and concrete
    arrays (outside jit) it also reads FP6 codes (< 64) and the global scale (finite, > 0).
    """
    if not isinstance(q, BlockScaled):
        raise TypeError(f"{name} must be a jbs.BlockScaled, got {type(q).__name__}")
    try:
        f = get_format(q.fmt)
    except ValueError as e:
        raise ValueError(f"{name}: {e}") from None
    if q.layout not in _layout.LAYOUTS:
        raise ValueError(f"{name} layout must be one of {_layout.LAYOUTS}, got {q.layout!r}")
    data, scales = q.data, q.scales
    if np.dtype(data.dtype) != f.storage_dtype:
        raise TypeError(f"{name} holds {np.dtype(data.dtype).name} elements but format {f.name} "
                        f"stores {f.storage_dtype.name}; quantize with jbs.quantize(x, {f.name!r})")
    if np.dtype(scales.dtype) != f.scale_dtype:
        raise TypeError(f"{name} scales has dtype {np.dtype(scales.dtype).name} but format "
                        f"{f.name} uses {f.scale_dtype.name} scales")
    if data.ndim < (2 if q.layout == "blocked" else 1):
        raise ValueError(f"{name} has elements of shape {tuple(data.shape)}; {q.layout} scales "
                         "need (..., MN, K) elements")
    *batch, k = data.shape
    if k % f.block:
        raise ValueError(f"{name} has K={k}, not a multiple of the {f.name} block size "
                         f"{f.block}; pad K with zeros to a multiple of {f.block}")
    sk = k // f.block
    want = (tuple(batch) + (sk,) if q.layout == "plain"
            else tuple(batch[:-1]) + _layout.blocked_shape(batch[-1], sk))
    if tuple(scales.shape) != want:
        raise ValueError(f"{name} scales has shape {tuple(scales.shape)}; {q.layout} scales for "
                         f"elements of shape {tuple(data.shape)} ({f.name}, block {f.block}) "
                         f"must have shape {want}")
    gs = q.global_scale
    if gs is not None:
        if not f.has_global_scale:
            raise ValueError(f"{name} is {f.name}, which has no global scale (only nvfp4 does), "
                             "but its global_scale is set; use global_scale=None")
        check_global_scale(gs, tuple(data.shape[:-2]), f"{name}.global_scale", values=values)
    if values and f.is_code_stored and _is_concrete(data) and data.size:
        top = int(np.max(np.asarray(data)))  # NumPy: inside a jit trace jnp would stage it
        if top >= 64:
            raise ValueError(f"{name} holds FP6 codes up to {top}; {f.name} codes are 6 bits "
                             "(0..63)")


# ---------------------------------------------------------------------------------------------
# quantize / dequantize


def _blocks(x: jax.Array, block: int) -> jax.Array:
    k = x.shape[-1]
    if k % block:
        raise ValueError(f"the last (K) axis has length {k}, not a multiple of the block size "
                         f"{block}; pad K with zeros to a multiple of {block}")
    return x.astype(jnp.float32).reshape(*x.shape[:-1], k // block, block)


def _finite_abs(xb: jax.Array) -> jax.Array:
    """|x| with NaN and Inf replaced by 0, so they do not set any scale."""
    return jnp.where(jnp.isfinite(xb), jnp.abs(xb), 0.0)


def _mx_shared_exponent(amax: jax.Array, fmt: Format, rounding: str) -> jax.Array:
    """The e8m0 exponent per block (int32, clamped to [-127, 127]), computed exactly."""
    frac, exp = jnp.frexp(amax)  # amax = frac * 2**exp, frac in [0.5, 1): floor(log2) = exp - 1
    shared = exp - 1 - fmt.emax
    if rounding == "round_up":
        # ceil(log2(amax / elem_max)): one more than the OCP exponent exactly when amax's
        # mantissa (2 * frac) exceeds that of elem_max (elem_max / 2**emax).
        elem_mant = fmt.elem_max / 2.0 ** fmt.emax
        shared = shared + (2.0 * frac > elem_mant).astype(shared.dtype)
    shared = jnp.where(amax > 0, shared, -_E8M0_BIAS)
    return jnp.clip(shared, -_E8M0_BIAS, _E8M0_BIAS)


def _special_elements(xb: jax.Array, fmt: Format) -> jax.Array:
    """NaN / Inf in an element type that has them: e5m2 keeps both, e4m3fn turns Inf into NaN."""
    if fmt.storage_dtype == np.dtype(jnp.float8_e5m2):
        return xb.astype(fmt.storage_dtype)
    return jnp.full(xb.shape, jnp.nan, fmt.storage_dtype)


def _has_nan(dtype) -> bool:
    return np.dtype(dtype) in (np.dtype(jnp.float8_e4m3fn), np.dtype(jnp.float8_e5m2))


def _quantize_mx(x: jax.Array, fmt: Format, rounding: str):
    xb = _blocks(x, fmt.block)
    finite = jnp.isfinite(xb)
    amax = jnp.max(_finite_abs(xb), axis=-1)
    shared = _mx_shared_exponent(amax, fmt, rounding)
    codes = (shared + _E8M0_BIAS).astype(jnp.uint8)
    # Dividing by 2**shared is multiplying by 2**-shared: exact, and -shared <= 127 stays normal
    # while the clamp at -127 only applies to blocks with amax < 2**-125 (treated as tiny).
    inv = _pow2(jnp.minimum(-shared, 127))[..., None]
    data = encode_elements(jnp.where(finite, xb, 0.0) * inv, fmt)
    if _has_nan(fmt.storage_dtype):  # the element carries NaN / Inf itself
        data = jnp.where(finite, data, _special_elements(xb, fmt))
    else:  # e2m1 / e2m3 / e3m2 have neither: the block's scale becomes e8m0's NaN (0xFF)
        codes = jnp.where(jnp.all(finite, axis=-1), codes, jnp.uint8(0xFF))
    scales = lax.bitcast_convert_type(codes, fmt.scale_dtype)
    return data.reshape(x.shape), scales, None


def _encode_factor(amax: jax.Array) -> jax.Array:
    """NVFP4's global encode factor 6 * 448 / amax, for an all-zero (or all non-finite) tensor 1,
    and at most _MAX_ENCODE so that tiny tensors keep a finite, normal decode factor."""
    enc = jnp.minimum(jnp.float32(6.0 * _E4M3_MAX) / jnp.where(amax > 0, amax, 1.0),
                      _MAX_ENCODE)
    return jnp.where(amax > 0, enc, 1.0).astype(jnp.float32)


def _decode_factor(enc: jax.Array) -> jax.Array:
    """The stored decode factor 1 / enc, behind an optimization barrier.

    Without it XLA folds the quotient into whatever consumes the factor inside the same jit
    (gemm's alpha = a.global_scale * b.global_scale became (b * amax) / 2688), a value one ulp
    away from the product of the stored factors that depends on the graph around it. With it,
    every consumer sees the stored factor, and a kernel that quantizes the activation itself
    (gemm's quantize_a) reproduces alpha bit for bit.
    """
    return lax.optimization_barrier((1.0 / enc).astype(jnp.float32))


def _quantize_nvfp4(x: jax.Array, fmt: Format, global_scale):
    xb = _blocks(x, fmt.block)  # (..., MN, SK, 16)
    finite = jnp.isfinite(xb)
    fabs = _finite_abs(xb)
    if global_scale is None:
        enc = jnp.float32(1.0)
        decode = None
    elif isinstance(global_scale, str) and global_scale == "auto":  # one for the whole tensor
        enc = _encode_factor(jnp.max(fabs, initial=0.0))
        decode = _decode_factor(enc)
    elif isinstance(global_scale, str):  # "per_matrix": one per trailing (MN, K) matrix
        enc = _encode_factor(jnp.max(fabs, axis=(-3, -2, -1), initial=0.0))
        decode = _decode_factor(enc)
    else:  # a caller-chosen decode factor (checked by quantize)
        decode = jnp.asarray(global_scale, jnp.float32)
        # the barrier keeps XLA from folding 1 / decode on the host when decode is a constant
        # of the program: the quotient is then always the device's (the fused quantizer of
        # gemm(x, w, quantize_a="nvfp4", a_global_scale=decode) computes the same one)
        enc = 1.0 / lax.optimization_barrier(decode)
    enc_b = jnp.reshape(enc, jnp.shape(enc) + (1, 1))  # against (..., MN, SK)
    block_amax = jnp.max(fabs, axis=-1)
    # amax_block / 6 * enc, written as XLA evaluates it (it rewrites the division by the
    # constant into a product with the f32 1/6 and multiplies the scalars first), so that
    # what runs is what is written here and in ffi/quantize_activation.cu
    enc_per_elem_max = enc_b * jnp.float32(1.0 / fmt.elem_max)
    scales = jnp.minimum(block_amax * enc_per_elem_max, _E4M3_MAX).astype(fmt.scale_dtype)
    # the stored (rounded) scales divide the elements; the barrier keeps XLA from removing the
    # f32 -> e4m3 -> f32 round trip, as it does in dequantize on GPUs (not seen here: defensive)
    scales_f32 = lax.optimization_barrier(scales).astype(jnp.float32)[..., None]
    safe = jnp.where(scales_f32 > 0, scales_f32, 1.0)
    ratio = enc_b[..., None] / safe
    # enc / scale overflows only for a huge encode factor and a block of f32 subnormals; then
    # divide in the other order.
    scaled = jnp.where(jnp.isfinite(ratio), xb * ratio, (xb * enc_b[..., None]) / safe)
    elems = jnp.where((scales_f32 > 0) & finite, scaled, 0.0)
    data = encode_elements(elems, fmt)
    # e2m1 has no NaN or Inf: a block holding one gets e4m3's NaN scale and decodes to NaN.
    nan_scale = jnp.full(scales.shape, jnp.nan, fmt.scale_dtype)
    scales = jnp.where(jnp.all(finite, axis=-1), scales, nan_scale)
    return data.reshape(x.shape), scales, decode


def check_quantize_args(x, fmt: str, global_scale, layout: str, scale_rounding: str):
    """`jbs.quantize`'s arguments checked, naming the bad one: (the Format, x as an array)."""
    f = get_format(fmt)
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"quantize expects a floating-point array, got {x.dtype}")
    if x.ndim < 1:
        raise ValueError("quantize needs at least one axis (the K axis)")
    if layout not in _layout.LAYOUTS:
        raise ValueError(f"layout must be one of {_layout.LAYOUTS}, got {layout!r}")
    if layout == "blocked" and x.ndim < 2:
        raise ValueError(f"layout='blocked' needs (..., MN, K) input (at least 2 axes), got "
                         f"shape {x.shape}; use layout='plain' for a 1-D tensor")
    if not (isinstance(scale_rounding, str) and scale_rounding in SCALE_ROUNDINGS):
        raise ValueError(f"scale_rounding must be one of {SCALE_ROUNDINGS}, got "
                         f"{scale_rounding!r}")
    if isinstance(global_scale, str):
        if global_scale not in GLOBAL_SCALE_MODES:
            raise ValueError(f"global_scale must be one of {GLOBAL_SCALE_MODES}, None or a "
                             f"decode factor; got {global_scale!r}")
        if global_scale == "per_matrix" and x.ndim < 2:
            raise ValueError(f"global_scale='per_matrix' needs (..., MN, K) input (at least 2 "
                             f"axes), got shape {x.shape}")
    elif global_scale is not None:
        if not f.has_global_scale:
            raise ValueError(f"{f.name} has no global scale (only nvfp4 does); pass "
                             "global_scale=None or leave it at 'auto'")
        check_global_scale(global_scale, tuple(x.shape[:-2]))
    return f, x


def quantize_values(x: jax.Array, f: Format, global_scale, scale_rounding: str):
    """(elements, plain scales, decode factor or None) of x quantized to `f` along its last axis:
    the pure-JAX quantizer (arguments as `jbs.quantize` checked them)."""
    if f.has_global_scale:
        return _quantize_nvfp4(x, f, global_scale)
    return _quantize_mx(x, f, scale_rounding)


def one_global_scale(x: jax.Array, global_scale) -> bool:
    """Whether NVFP4's quantization of x is one bf16 matrix's (rows folded) with one global
    scale, calibrated or given: what the quantizer primitive (jax_blockscale/quantization) takes."""
    if x.dtype != jnp.bfloat16 or x.shape[-1] % 16 or x.size == 0:
        return False
    if isinstance(global_scale, str):
        return global_scale == "auto"
    return global_scale is not None and jnp.shape(global_scale) == ()


def _scale_factors(scales: jax.Array, f: Format):
    """f32 factors whose product is each scale, none of them subnormal.

    e8m0's smallest code (2^-127) is an f32 subnormal, which XLA's CPU code (and a GPU's
    flush-to-zero mode) reads as 0; it is applied as 2^-126 * 0.5 instead, so an element times
    it comes out right whenever the product is a normal number.
    """
    s = scales.astype(jnp.float32)
    if f.scale_dtype != np.dtype(jnp.float8_e8m0fnu):
        return s, None
    smallest = lax.bitcast_convert_type(scales, jnp.uint8) == 0
    return jnp.where(smallest, jnp.float32(2.0 ** -126), s), jnp.where(smallest, 0.5, 1.0)


def dequantize(q: BlockScaled, dtype=jnp.float32) -> jax.Array:
    """The values `q` stands for, in `dtype` (f32 is exact for every format)."""
    if not jnp.issubdtype(np.dtype(dtype), jnp.floating):
        raise TypeError(f"dequantize returns floating-point values; dtype {np.dtype(dtype).name} "
                        "would truncate them (use float32, bfloat16 or float16)")
    check_blockscaled(q, "q")
    f = q.format
    # The barrier keeps the stored elements and scales opaque. Without it, in a jit that also
    # quantizes, XLA's GPU pipeline (allow_excess_precision) removes an f32 -> fp8 -> f32 pair of
    # converts and computes with the unrounded values: not what was stored, not what a kernel
    # reads (seen on the H100: 3-7 % off for nvfp4 and mxfp8 activations quantized in the jit).
    data, scales = lax.optimization_barrier((q.data, q.plain_scales()))
    vals = decode_elements(data, f)
    *lead, k = vals.shape
    hi, lo = _scale_factors(scales, f)
    vals = vals.reshape(*lead, k // f.block, f.block) * hi[..., None]
    if lo is not None:
        vals = vals * lo[..., None]
    vals = vals.reshape(data.shape)
    if q.global_scale is not None:
        g = jnp.asarray(q.global_scale, jnp.float32)
        vals = vals * jnp.reshape(g, g.shape + (1, 1))
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
