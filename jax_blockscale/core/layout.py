"""Scale-factor layouts: `plain` (MN, K/block) and `blocked` (the tensor cores' 128x4 tiles).

The blocked layout pads MN to a multiple of 128 and K/block (SK) to a multiple of 4, then
``reshape(MN/128, 4, 32, SK/4, 4).transpose(0, 3, 2, 1, 4)``, so plain ``s[m, k]`` lives at
``[m // 128, k // 4, m % 32, (m % 128) // 32, k % 4]``. Every 128x4 tile of scales becomes one
contiguous 512-byte chunk, which is what a TMA load of one MMA tile's scales wants.
Leading batch dimensions pass through untouched. Padding is filled with zero bits.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

ROWS_PER_TILE = 128  # MN rows of one scale tile
COLS_PER_TILE = 4  # scale columns (K blocks) of one scale tile
BLOCKED_TILE = (32, 4, 4)  # the trailing dims of a blocked-layout scale array

LAYOUTS = ("plain", "blocked")


def blocked_shape(mn: int, sk: int) -> tuple[int, ...]:
    """Trailing shape of the blocked layout for `mn` rows and `sk` scale columns."""
    return (math.ceil(mn / ROWS_PER_TILE), math.ceil(sk / COLS_PER_TILE)) + BLOCKED_TILE


def _as_bits(s: jax.Array) -> jax.Array:
    # Pad and move raw bits: e8m0 has no zero and f8 padding should not depend on rounding.
    return lax.bitcast_convert_type(s, jnp.uint8)


def to_blocked_scales(s: jax.Array) -> jax.Array:
    """Plain (..., MN, SK) scales -> blocked (..., ceil(MN/128), ceil(SK/4), 32, 4, 4)."""
    if s.ndim < 2:
        raise ValueError(f"to_blocked_scales needs plain (..., MN, K/block) scales (at least 2 "
                         f"axes), got shape {tuple(s.shape)}")
    *batch, mn, sk = s.shape
    n_row_tiles, n_col_tiles = blocked_shape(mn, sk)[:2]
    bits = _as_bits(s)
    pad = [(0, 0)] * len(batch) + [(0, n_row_tiles * ROWS_PER_TILE - mn),
                                   (0, n_col_tiles * COLS_PER_TILE - sk)]
    bits = jnp.pad(bits, pad)
    bits = bits.reshape(*batch, n_row_tiles, 4, 32, n_col_tiles, 4)
    nb = len(batch)
    bits = jnp.moveaxis(bits, (nb + 1, nb + 3), (nb + 3, nb + 1))  # swap the 4-row and SK/4 axes
    return lax.bitcast_convert_type(bits, s.dtype)


def from_blocked_scales(b: jax.Array, mn: int, sk: int) -> jax.Array:
    """Blocked (..., MN/128, SK/4, 32, 4, 4) scales -> plain (..., mn, sk), padding dropped."""
    if b.ndim < 5 or tuple(b.shape[-5:]) != blocked_shape(mn, sk):
        raise ValueError(f"blocked scales of shape {b.shape} do not hold a ({mn}, {sk}) plain "
                         f"scale array; expected trailing shape {blocked_shape(mn, sk)}")
    *batch, n_row_tiles, n_col_tiles = b.shape[:-3]
    nb = len(batch)
    bits = jnp.moveaxis(_as_bits(b), (nb + 1, nb + 3), (nb + 3, nb + 1))
    bits = bits.reshape(*batch, n_row_tiles * ROWS_PER_TILE, n_col_tiles * COLS_PER_TILE)
    return lax.bitcast_convert_type(bits[..., :mn, :sk], b.dtype)
