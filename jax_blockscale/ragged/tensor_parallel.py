"""Tensor parallelism for a mixture-of-experts SwiGLU layer: every device holds a slice of every
expert's intermediate features, runs all routed rows through them and the devices sum their
combined outputs once.

    gate_up_tp, down_tp = split_intermediate(gate_up, down, d)        # once, at load time
    y = tensor_parallel_moe(x, router, gate_up_tp, down_tp, route=..., activation=...,
                            mesh=mesh, axis="model")

Megatron's pairing for one expert's MLP, ``down(silu(gate(x)) * up(x))``: device j holds the
gate and up rows of its range of about I/d features (column parallel) and the same columns of
down (row parallel, K split). Then SwiGLU pairs gate column i with up column i on the device
that holds both, and down's partial products over a device's columns are summed across devices
once, after the router weights combine them per token: one (T, H) f32 sum per layer
(`dispatch.sum_shares`: one all-reduce, or from 4 MiB an all-to-all of f32 shares and an
all-gather), against the (rows, H) outputs of the sharding rule's placements (T x k rows) and
the activations they move (docs/sharding.md).

The fused gate_up weight (E, 2I, H) stores every gate row before every up row, so an N split of
it would give one device the gates and the other the ups. `split_intermediate` re-lays both
weights once: gate_up as (E, d x 2 Ip, H), device j's block its gate rows then its up rows, and
down as (E, H, d x Ip), device j's block its K columns. The ranges are whole blocks of the
format (down's K scales split with them), as even as whole blocks allow (`feature_ranges`), and
each is padded with zeros to Ip, the widest rounded up to a multiple of 128 (whole
blocked-scale tiles, so N splits of gate_up and K splits of down over d devices are whole
tiles): gpt-oss's 2880 features take 1536 per device over 2 devices, 736 / 736 / 704 / 704
padded to 768 over 4. A zero gate and up row gives SwiGLU 0, and a zero K column of down adds
nothing: the padding costs its bytes and MMAs (7 % at gpt-oss-120b over 2 or 4 devices, none at
Qwen3-30B-A3B's 768 / 2).

Per device (`tensor_parallel_moe`, under `shard_map`, x replicated): route all T tokens and sort
the T x k rows as one device does; gate_up on all rows (its 2 Ip columns; planned as the
one-device call, so each h element is one device's bit for bit), SwiGLU, down on its Ip
columns in f32 (partial sums), the combine of its partial rows into (T, H) f32, then the sum
across devices. The output is replicated. It equals the same layer on one device to f32
rounding (down's K sums are added in another order: a few bf16 outputs one step apart), and the
one-device `QuantizedMoE` to the bf16 rounding of its expert outputs (that layer rounds down's
rows to bf16 before the combine; this one combines the f32 partial sums). NVFP4 activations
calibrate their global scale on the amax of every device's columns, as one device does.
"""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from ..core.layout import ROWS_PER_TILE
from ..core.quantize import BlockScaled, to_blocked, to_plain
from .dispatch import combine, expert_gemm, expert_order, quantize_as_one_device, sum_shares
from .primitive import unsort_rows

__all__ = ["feature_ranges", "padded_features", "split_intermediate", "tensor_parallel_moe",
           "unsplit_intermediate"]


def _check_pair(gate_up, down, d):
    for name, w in (("gate_up", gate_up), ("down", down)):
        if not isinstance(w, BlockScaled) or w.ndim != 3:
            raise TypeError(f"{name} must be a BlockScaled (experts, out, in), got "
                            f"{type(w).__name__} {getattr(w, 'shape', '')}")
    if not isinstance(d, (int, np.integer)) or d < 1:
        raise ValueError(f"the device count must be a positive int, got {d!r}")
    experts, two_i, hidden = gate_up.shape
    if down.shape[0] != experts or down.shape[1] != hidden:
        raise ValueError(f"down {down.shape} does not pair with gate_up {gate_up.shape}: "
                         "expected (experts, hidden, intermediate)")
    if gate_up.fmt != down.fmt:
        raise ValueError(f"gate_up is {gate_up.fmt} but down is {down.fmt}")
    return experts, two_i, hidden


def feature_ranges(intermediate: int, d: int, block: int) -> list[tuple[int, int]]:
    """(first feature, features) of each of d devices: the intermediate features in whole
    `block`-element blocks (down's K of a device must be whole blocks of its scales), as even as
    whole blocks allow; the first intermediate/block mod d devices take one block more
    (gpt-oss's 2880 features over 4 devices of 32-element blocks: 736, 736, 704, 704)."""
    if intermediate % block:
        raise ValueError(f"intermediate={intermediate} is not whole {block}-element blocks")
    blocks = intermediate // block
    if blocks < d:
        raise ValueError(f"intermediate={intermediate} has {blocks} blocks of {block}: fewer "
                         f"than the {d} devices")
    widths = [block * (blocks // d + (j < blocks % d)) for j in range(d)]
    return [(sum(widths[:j]), w) for j, w in enumerate(widths)]


def padded_features(intermediate: int, d: int, block: int) -> int:
    """Ip: every device's features padded to the widest device's, in whole 128-row
    blocked-scale tiles."""
    widest = max(w for _, w in feature_ranges(intermediate, d, block))
    return -(-widest // ROWS_PER_TILE) * ROWS_PER_TILE


def split_intermediate(gate_up: BlockScaled, down: BlockScaled, d: int):
    """gate_up (E, 2I, H) and down (E, H, I) re-laid for tensor parallelism over d devices (see
    the module docstring): gate_up (E, d * 2 * Ip, H) and down (E, H, d * Ip) with blocked
    scales; device j holds the features `feature_ranges(I, d, block)[j]` (whole blocks of the
    format, as even as they allow), padded with zeros to Ip (`padded_features`, a multiple of
    128). Global scales (NVFP4, per expert) are kept as they are. Runs once, at load time (jit
    it for big weights); `unsplit_intermediate` undoes it."""
    experts, two_i, hidden = _check_pair(gate_up, down, d)
    if two_i % 2 or down.shape[2] != two_i // 2:
        raise ValueError(f"gate_up {gate_up.shape} must hold 2 x intermediate rows, and down "
                         f"{down.shape} intermediate columns")
    inter = two_i // 2
    block = gate_up.format.block
    ranges = feature_ranges(inter, d, block)
    ip = padded_features(inter, d, block)
    gu, dn = to_plain(gate_up), to_plain(down)
    # scales move as bits (e8m0 has no zero to pad with); padding is zero bits, zero elements
    gu_bits, dn_bits = _bits(gu.scales), _bits(dn.scales)
    gu_data = jnp.concatenate([_part(a, 1, first, width, ip - width)
                               for first, width in ranges
                               for a in (gu.data, gu.data[:, inter:])], axis=1)
    gu_scales = jnp.concatenate([_part(a, 1, first, width, ip - width)
                                 for first, width in ranges
                                 for a in (gu_bits, gu_bits[:, inter:])], axis=1)
    dn_data = jnp.concatenate([_part(dn.data, 2, first, width, ip - width)
                               for first, width in ranges], axis=2)
    # down's K in scale columns
    dn_scales = jnp.concatenate([_part(dn_bits, 2, first // block, width // block,
                                       (ip - width) // block)
                                 for first, width in ranges], axis=2)
    return (to_blocked(BlockScaled(gu_data, _unbits(gu_scales, gu.scales), gu.global_scale,
                                   gu.fmt, "plain")),
            to_blocked(BlockScaled(dn_data, _unbits(dn_scales, dn.scales), dn.global_scale,
                                   dn.fmt, "plain")))


def _part(a, axis, first, width, padding):
    """a[first:first + width] along `axis`, then `padding` zeros along it."""
    part = lax.slice_in_dim(a, first, first + width, axis=axis)
    if not padding:
        return part
    pads = [(0, 0)] * a.ndim
    pads[axis] = (0, padding)
    return jnp.pad(part, pads)


def _bits(s):
    return lax.bitcast_convert_type(s, jnp.uint8)


def _unbits(b, like):
    return lax.bitcast_convert_type(b, like.dtype)


def unsplit_intermediate(gate_up_tp: BlockScaled, down_tp: BlockScaled, d: int,
                         intermediate: int):
    """The inverse of `split_intermediate`: (gate_up (E, 2I, H), down (E, H, I)), blocked."""
    experts, rows_tp, hidden = _check_pair(gate_up_tp, down_tp, d)
    block = gate_up_tp.format.block
    ranges = feature_ranges(intermediate, d, block)
    ip = padded_features(intermediate, d, block)
    if rows_tp != d * 2 * ip or down_tp.shape[2] != d * ip:
        raise ValueError(f"gate_up {gate_up_tp.shape} and down {down_tp.shape} are not "
                         f"split_intermediate's layout of intermediate={intermediate} over {d} "
                         "devices")
    gu, dn = to_plain(gate_up_tp), to_plain(down_tp)
    gate = [slice(j * 2 * ip, j * 2 * ip + w) for j, (_, w) in enumerate(ranges)]
    up = [slice(j * 2 * ip + ip, j * 2 * ip + ip + w) for j, (_, w) in enumerate(ranges)]
    gu_data = jnp.concatenate([gu.data[:, s] for s in gate + up], axis=1)
    gu_scales = jnp.concatenate([gu.scales[:, s] for s in gate + up], axis=1)
    dn_data = jnp.concatenate([dn.data[:, :, j * ip:j * ip + w]
                               for j, (_, w) in enumerate(ranges)], axis=2)
    dn_scales = jnp.concatenate([dn.scales[:, :, j * ip // block:(j * ip + w) // block]
                                 for j, (_, w) in enumerate(ranges)], axis=2)
    return (to_blocked(BlockScaled(gu_data, gu_scales, gu.global_scale, gu.fmt, "plain")),
            to_blocked(BlockScaled(dn_data, dn_scales, dn.global_scale, dn.fmt, "plain")))


def _specs(w: BlockScaled, dim: int, axis):
    """In-specs of a BlockScaled (E, N, K) split on `dim` (1: N, 2: K); its blocked scales
    (E, N/128, SK/4, 32, 4, 4) on the same tile dim; a per-expert global scale replicated."""
    spec = P(*([None] * dim), axis)
    gs = w.global_scale
    return BlockScaled(spec, spec, None if gs is None else P(), w.fmt, w.layout)


def tensor_parallel_moe(x, router, gate_up: BlockScaled, down: BlockScaled, *,
                        route: Callable, activation: Callable, mesh, axis: str,
                        intermediate: int | None = None, quantize: Callable | None = None,
                        dtype=jnp.bfloat16, backend: str | None = None):
    """A mixture-of-experts SwiGLU layer, tensor parallel over mesh axis `axis` (see the module
    docstring).

    x: (T, H) tokens (replicated over `axis`; any placement is resharded to that).
    router: whatever `route` needs, replicated.
    gate_up, down: what `split_intermediate` returns for the axis' d devices (blocked scales;
      where I/d is a multiple of 128, nothing is padded and its shapes are the original
      layout's, so shapes cannot catch an unsplit pair: pass only its output); best placed
      split on gate_up's N and down's K over `axis`.
    intermediate: the layer's I before the split (default: d x Ip, right when nothing was
      padded); gate_up is planned as the unsharded (rows, 2I) call.
    route(x, router) -> (experts (T, k) int32, weights (T, k) f32).
    activation(h) -> a: h (rows, 2 Ip) (the device's gate columns, then its up columns), a
      (rows, Ip); must compute column i from gate i and up i only (SwiGLU).
    quantize: rows (m, K) -> BlockScaled before each GEMM, or None (weight-only, `dtype`).
    dtype: activation and output dtype. backend: ragged backend to force.
    Returns (T, H) in `dtype`, replicated.
    """
    x = jnp.asarray(x)
    if axis not in mesh.axis_names:
        raise ValueError(f"axis={axis!r} is not an axis of the mesh {dict(mesh.shape)}")
    d = mesh.shape[axis]
    experts, rows_tp, hidden = _check_pair(gate_up, down, d)
    if rows_tp % (2 * d) or down.shape[2] * 2 != rows_tp or (rows_tp // (2 * d)) % ROWS_PER_TILE:
        raise ValueError(f"gate_up {gate_up.shape} and down {down.shape} are not laid out for "
                         f"{d} devices: re-lay them with split_intermediate(gate_up, down, {d})")
    if x.ndim != 2 or x.shape[1] != hidden:
        raise ValueError(f"x must have shape (tokens, hidden={hidden}), got {x.shape}")
    tokens = x.shape[0]
    dt = np.dtype(dtype)
    n_unsharded = 2 * (intermediate if intermediate is not None else down.shape[2])

    def act(a, split):
        """An activation as the one-device layer quantizes it; `split`: its columns are this
        device's (the global scale is calibrated on every device's amax)."""
        if quantize is None:
            return a.astype(dt)
        return quantize_as_one_device(quantize, a, axis) if split else quantize(a)

    def body(x, router, gate_up, down):
        ids, weights = route(x, router)  # every token, as the one-device layer routes them
        k = ids.shape[-1]
        flat = ids.reshape(-1).astype(jnp.int32)
        order, group_sizes = expert_order(flat, experts)
        rows = x[order // k]
        # the first GEMM's K (hidden) is whole: planned as the unsharded call, its h are one
        # device's; down's K is split, so it plans for its own shape
        h = expert_gemm(act(rows, False), gate_up, group_sizes, out_dtype=dt, backend=backend,
                        plan_shape=(tokens * k, n_unsharded, experts))
        y = expert_gemm(act(activation(h), True), down, group_sizes, out_dtype=jnp.float32,
                        backend=backend)
        share = combine(unsort_rows(y, order).reshape(tokens, k, -1), weights)
        return sum_shares(share, axis, d, dt)

    run = jax.shard_map(body, mesh=mesh,
                        in_specs=(P(), P(), _specs(gate_up, 1, axis), _specs(down, 2, axis)),
                        out_specs=P(), check_vma=False)
    return run(x, router, gate_up, down)
