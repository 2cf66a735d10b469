"""OpenAI gpt-oss MXFP4 checkpoints -> BlockScaled, bit-exact; and gpt-oss's interleaved
gate/up rows.

The convention (``openai/gpt-oss``'s ``weights.py``, and the Hugging Face ``transformers``
checkpoints of gpt-oss-20b / -120b), per MoE weight:

  ``*.blocks`` / ``*_blocks``  uint8 (..., N, K/32, 16): 32 e2m1 codes per block in 16 bytes,
                               element 2i in the low nibble, 2i+1 in the high nibble
  ``*.scales`` / ``*_scales``  uint8 (..., N, K/32): a biased power-of-two exponent per block;
                               value = e2m1 * 2 ** (scale - 127)

with ``...`` the experts axis, N the output features and K the input features (``mlp1_weight``
/ ``gate_up_proj``: (experts, 2 * intermediate, hidden); ``mlp2_weight`` / ``down_proj``:
(experts, hidden, intermediate)). A biased exponent with bias 127 *is* an OCP e8m0 scale
(``float8_e8m0fnu``), so the bits are kept as they are (255, e8m0's NaN, would be 2 ** 128 in
gpt-oss: non-finite either way).

gpt-oss interleaves the SwiGLU halves along N of ``mlp1``: row 2j is the gate (the
``x_glu`` of its ``swiglu``, ``x[..., ::2]``) and row 2j+1 the linear ("up") projection of the
same hidden unit j; the ``mlp1`` bias is interleaved the same way. `deinterleave_gate_up`
splits them (whole rows move, so this is bit-exact too).
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from ..core.quantize import BlockScaled
from . import _arrays as A

__all__ = ["deinterleave_gate_up", "from_gpt_oss_mxfp4"]

_BYTES_PER_BLOCK = 16  # 32 fp4 codes


def from_gpt_oss_mxfp4(blocks, scales, *, layout: str = "plain", gate_up: str | None = None,
                       _host: bool = False):
    """A gpt-oss MXFP4 weight as an ``mxfp4`` BlockScaled of logical shape (..., N, K).

    blocks:  uint8 (..., N, K/32, 16).
    scales:  uint8 (..., N, K/32) biased exponents (or float8_e8m0fnu).
    layout:  "plain" or "blocked" (swizzled once, for `gemm`).
    gate_up: None (rows as stored); "split": return ``(gate, up)``, two BlockScaled of N/2 rows
             each; "concat": one BlockScaled with the gate rows first, then the up rows (so a
             fused matmul's output splits in halves). For ``mlp1`` / ``gate_up_proj`` only.
    """
    blocks = A.as_array(blocks, "blocks")
    A.require_uint8(blocks, "blocks", "32 fp4 codes packed in 16 bytes per block")
    if blocks.ndim < 3 or blocks.shape[-1] != _BYTES_PER_BLOCK:
        raise ValueError(f"blocks must be (..., N, K/32, {_BYTES_PER_BLOCK}) uint8, got shape "
                         f"{tuple(blocks.shape)}")
    s = A.reinterpret(A.as_array(scales, "scales"), A.E8M0, "scales")
    if tuple(s.shape) != tuple(blocks.shape[:-1]):
        raise ValueError(f"scales has shape {tuple(s.shape)}; blocks of shape "
                         f"{tuple(blocks.shape)} need one scale per block: "
                         f"{tuple(blocks.shape[:-1])}")
    *lead, n, g, _ = blocks.shape
    packed = blocks.reshape(*lead, n, g * _BYTES_PER_BLOCK)  # blocks are contiguous along K
    data = A.unpack_nibbles(packed)
    if gate_up is None:
        return A.finish(data, s, None, "mxfp4", layout, host=_host)
    halves = _split_rows(data, s, gate_up)
    out = tuple(A.finish(d, sc, None, "mxfp4", layout, host=_host) for d, sc in halves)
    return out if gate_up == "split" else out[0]


def _split_rows(data, scales, gate_up):
    if gate_up not in ("split", "concat"):
        raise ValueError(f"gate_up must be None, 'split' or 'concat', got {gate_up!r}")
    n = data.shape[-2]
    if n % 2:
        raise ValueError(f"interleaved gate/up weights have an even number of rows, got {n}")
    gate = (data[..., 0::2, :], scales[..., 0::2, :])
    up = (data[..., 1::2, :], scales[..., 1::2, :])
    if gate_up == "split":
        return [gate, up]
    xp = jnp if A.is_jax(data) else np
    return [(xp.concatenate([gate[0], up[0]], axis=-2),
             xp.concatenate([gate[1], up[1]], axis=-2))]


def deinterleave_gate_up(x, *, axis: int | None = None):
    """Split gpt-oss's interleaved SwiGLU halves: returns ``(gate, up)``.

    x: a BlockScaled (..., 2I, K) weight (rows 2j: gate, 2j+1: up; plain or blocked scales, the
       result keeps the layout) or an array; for an array `axis` says which axis is interleaved
       (default -1, the ``mlp1_bias`` of shape (experts, 2I); use -2 for a dequantized weight).
    """
    if isinstance(x, BlockScaled):
        if axis not in (None, -2, x.ndim - 2):
            raise ValueError("a BlockScaled weight is de-interleaved along its rows (axis -2)")
        if x.global_scale is not None:
            raise ValueError("deinterleave_gate_up is for gpt-oss's mxfp4 weights (no global "
                             f"scale); got a {x.fmt} weight with one")
        halves = _split_rows(x.data, x.plain_scales(), "split")
        return tuple(A.finish(d, s, None, x.fmt, x.layout) for d, s in halves)
    arr = A.as_array(x, "x")
    ax = -1 if axis is None else axis
    if arr.shape[ax] % 2:
        raise ValueError(f"axis {ax} of x has odd length {arr.shape[ax]}; interleaved gate/up "
                         "rows come in pairs")
    idx = [slice(None)] * arr.ndim
    gate_idx, up_idx = list(idx), list(idx)
    gate_idx[ax], up_idx[ax] = slice(0, None, 2), slice(1, None, 2)
    return arr[tuple(gate_idx)], arr[tuple(up_idx)]
