"""Bit-level helpers the converters share: NumPy or JAX in, the package's dtypes out.

Every helper here moves bits, never rounds: packed fp4 bytes become e2m1 codes, uint8 scale
bytes are reinterpreted as e4m3 / e8m0. NumPy inputs stay on the host (what the safetensors
loader feeds in: nothing goes to a device until the whole weight is assembled); JAX inputs
(including tracers, so a converter works under `jit`) use the same operations in `jnp`.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax import lax

from ..core import layout as _layout
from ..core.formats import get_format
from ..core.quantize import BlockScaled, to_blocked, unpack_fp4

FP4 = np.dtype(ml_dtypes.float4_e2m1fn)
E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
E8M0 = np.dtype(ml_dtypes.float8_e8m0fnu)


def is_jax(x) -> bool:
    """A JAX array or tracer (converted with jnp ops); anything else is read as NumPy."""
    return isinstance(x, jax.Array)


def as_array(x, name: str):
    """`x` as a NumPy array, or as is when it is a JAX array."""
    if is_jax(x):
        return x
    try:
        return np.asarray(x)
    except Exception as e:  # e.g. a torch tensor on a GPU
        raise TypeError(f"{name}: expected a NumPy or JAX array, got {type(x).__name__}") from e


def dtype_name(x) -> str:
    return np.dtype(x.dtype).name


def reinterpret(x, dtype: np.dtype, name: str, *, allow_uint8: bool = True):
    """`x` as `dtype` (1-byte): itself if it already is, its bits if it is uint8 (how a checkpoint
    reader without that dtype hands it over); anything else is a TypeError naming `name`."""
    if np.dtype(x.dtype) == dtype:
        return x
    if allow_uint8 and np.dtype(x.dtype) == np.uint8:
        return lax.bitcast_convert_type(x, dtype) if is_jax(x) else x.view(dtype)
    want = f"{dtype.name} (or its bits as uint8)" if allow_uint8 else dtype.name
    raise TypeError(f"{name} must be {want}, got {dtype_name(x)}")


def require_uint8(x, name: str, what: str):
    if np.dtype(x.dtype) != np.uint8:
        raise TypeError(f"{name} must be uint8 ({what}), got {dtype_name(x)}")


def unpack_nibbles(packed):
    """uint8 (..., K/2) -> e2m1 (..., K): the low nibble is element 2i, the high nibble 2i + 1.

    This is the order ModelOpt, compressed-tensors and gpt-oss all write (and `jbs.pack_fp4`)."""
    if is_jax(packed):
        return unpack_fp4(packed)
    codes = np.empty(packed.shape[:-1] + (2 * packed.shape[-1],), np.uint8)
    np.bitwise_and(packed, 0xF, out=codes[..., 0::2])
    np.right_shift(packed, 4, out=codes[..., 1::2])
    return codes.view(FP4)


def decode_factor(value, name: str, lead: tuple[int, ...], *, invert: bool):
    """A per-tensor fp32 factor (or one per matrix of a stack) as the f32 *decode* factor.

    Accepted shapes: () or (1,) (one factor for everything) or `lead`, the weight's leading
    dims (one per matrix). `invert`: the stored value is an encode factor g; the decode factor
    is the f32 division 1 / g (IEEE division: the f32 nearest to 1/g)."""
    v = as_array(value, name)
    if not jnp.issubdtype(v.dtype, jnp.floating):
        raise TypeError(f"{name} must be a floating-point array, got {dtype_name(v)}")
    if np.dtype(v.dtype).itemsize > 4:
        raise TypeError(f"{name} must be float32 (or narrower); a {dtype_name(v)} factor would be "
                        "rounded, so the result would not be bit-exact")
    if v.shape == (1,) or (v.size == 1 and not lead):
        v = v.reshape(())
    elif tuple(v.shape) not in ((), tuple(lead)):
        raise ValueError(f"{name} has shape {tuple(v.shape)}; expected () or (1,) (one factor "
                         f"per tensor) or {tuple(lead)} (one per matrix of the stack)")
    if is_jax(v):
        v = v.astype(jnp.float32)
        return jnp.float32(1.0) / v if invert else v
    v = np.asarray(v, np.float32)
    if invert:
        with np.errstate(divide="ignore"):
            v = np.float32(1.0) / v
    return np.asarray(v, np.float32)


def check_scales_shape(scales, data_shape, block: int, name: str, data_name: str):
    *lead, mn, k = data_shape
    want = (*lead, mn, k // block)
    if tuple(scales.shape) != want:
        raise ValueError(f"{name} has shape {tuple(scales.shape)}; for {data_name} of logical "
                         f"shape {tuple(data_shape)} (one scale per {block} elements along the "
                         f"last axis) it must be {want}")


def finish(data, scales, global_scale, fmt: str, layout: str, *, host: bool = False):
    """Assemble the BlockScaled. host=True keeps NumPy arrays in the plain layout (the loader
    stacks and places them itself); otherwise JAX arrays, swizzled when layout="blocked"."""
    if layout not in _layout.LAYOUTS:
        raise ValueError(f"layout must be one of {_layout.LAYOUTS}, got {layout!r}")
    f = get_format(fmt)
    assert np.dtype(data.dtype) == f.storage_dtype and np.dtype(scales.dtype) == f.scale_dtype
    if host:
        return BlockScaled(data, scales, global_scale, f.name, "plain")
    to_jax = (lambda a: a if a is None or is_jax(a) else jnp.asarray(a))
    q = BlockScaled(to_jax(data), to_jax(scales), to_jax(global_scale), f.name, "plain")
    return to_blocked(q) if layout == "blocked" else q
