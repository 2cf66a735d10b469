"""Operand preparation shared by the FFI backends (sm90, sm100): how a gemm problem's batch dims
map onto the kernels' (M, L), and how elements and scales become the uint8 bytes the kernels
read."""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

from ..core import layout as _layout
from ..core.formats import get_format
from .specs import GemmSpec


def folds_batch(spec: GemmSpec) -> bool:
    """An unbatched B (weights shared by every batch element) folds A's batch into M."""
    return not spec.b_batch


def kernel_rows_and_batch(spec: GemmSpec) -> tuple[int, int]:
    """(M, L) of the kernel's problem."""
    if folds_batch(spec):
        return spec.m * math.prod(spec.a_batch), 1
    return spec.m, math.prod(spec.batch_shape)


def kernel_batch_layout(x: jax.Array, rows: int, *, spec: GemmSpec) -> jax.Array:
    """One operand's (..., MN, last) elements or plain scales as (L, rows, last): A's batch folded
    into its rows when B is unbatched (rows: the operand's rows in the kernel problem), else
    broadcast to the batch and flattened."""
    if folds_batch(spec):
        return x.reshape((1, rows, x.shape[-1]))
    _, L = kernel_rows_and_batch(spec)
    return jnp.broadcast_to(x, spec.batch_shape + x.shape[-2:]).reshape((L,) + x.shape[-2:])


def take_layer(x: jax.Array, index) -> jax.Array:
    """x[index] along the leading (layer) axis as XLA slices a scanned layer: in place at a loop
    counter. XLA's dynamic slice clamps the index into [0, L) as the kernels do (-1 reads layer
    0); a separate clip would be a kernel per call, and JAX's wrap of negative indices would make
    the offset more than a function of the loop counter (XLA would copy the slice)."""
    return lax.dynamic_index_in_dim(x, index, 0, keepdims=False, allow_negative_indices=False)


def element_bytes(x: jax.Array) -> jax.Array:
    """Quantized elements as the uint8 the kernels read: fp4 two per byte (element 2i in the low
    nibble), 8-bit kinds bit for bit."""
    if x.dtype == jnp.float4_e2m1fn:
        return lax.bitcast_convert_type(x.reshape(x.shape[:-1] + (x.shape[-1] // 2, 2)), jnp.uint8)
    return lax.bitcast_convert_type(x, jnp.uint8)


def kernel_scale_bytes(s: jax.Array, fmt: str, layout: str, rows: int, mn: int, *,
                       spec: GemmSpec) -> jax.Array:
    """Scales of one operand as flat uint8 in the blocked layout, batch folded or flattened to L.

    rows: the operand's rows in the kernel problem (folded M for A, N for B); mn: its rows per
    batch element. Blocked scales of a folded A are re-tiled, since its 128-row tiles change.
    """
    sk = spec.k // get_format(fmt).block
    _, L = kernel_rows_and_batch(spec)
    fold = folds_batch(spec)
    if fold and layout == "blocked" and s.ndim > 5:
        s = _layout.from_blocked_scales(s, mn, sk)
        layout = "plain"
    if layout == "plain":
        s = _layout.to_blocked_scales(kernel_batch_layout(s, rows, spec=spec))
    else:
        s = s.reshape((1,) + s.shape[-5:]) if fold else jnp.broadcast_to(
            s, spec.batch_shape + s.shape[-5:]).reshape((L,) + s.shape[-5:])
    return lax.bitcast_convert_type(s, jnp.uint8).reshape(-1)


def kernel_plain_scale_bytes(s: jax.Array, rows: int, pad_blocks: int, *,
                             spec: GemmSpec) -> jax.Array:
    """Plain scales of the activation as flat uint8 [L, rows, SK + pad_blocks] (zero blocks for a
    K the kernel pads): the layout the sm90 decode kernel can read directly, so a quantized
    activation needs no conversion kernel before the call."""
    bits = lax.bitcast_convert_type(kernel_batch_layout(s, rows, spec=spec), jnp.uint8)
    if pad_blocks:
        bits = jnp.pad(bits, [(0, 0), (0, 0), (0, pad_blocks)])
    return bits.reshape(-1)


def blocked_scale_bytes(s: jax.Array, layout: str) -> jax.Array:
    """Scales (..., rows, K/block), plain or already blocked -> flat uint8 in the blocked
    layout (the grouped kernels' experts)."""
    if layout == "plain":
        s = _layout.to_blocked_scales(s)
    return lax.bitcast_convert_type(s, jnp.uint8).reshape(-1)
