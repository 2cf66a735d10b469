"""Expert parallelism that dispatches tokens: each routed (token, expert) row goes only to the
device that owns its expert, runs there, and comes back; or, where every device holds every
token anyway, that keeps them (exchange="reduce", below) and sums the devices' shares.

    y = dispatch_moe(x, router, gate_up, down, route=..., activation=..., mesh=mesh,
                     axis="expert")

Under `jax.shard_map` over the mesh axis `axis` (d devices), tokens are split over the axis
(each device takes T/d of them) and so are the experts (each device holds E/d of them,
contiguous: device j owns experts j*E/d ... (j+1)*E/d - 1). Per device:

  1. route its tokens (`route(x, router)` -> expert ids (T/d, k), combine weights (T/d, k)),
     sort its T/d * k (token, slot) rows by expert. The router runs on all T tokens, on every
     device, and each keeps its own T/d: a GPU's dot picks its algorithm, so the order of its
     f32 additions, by shape, and logits computed for T/d tokens could differ from the one-device
     layer's in the last bit (moving a combine weight, now and then a bf16 output);
  2. gather every device's per-expert row counts (one small all-gather of d x E int32, from
     which each device works out every offset of both exchanges), then exchange the rows
     themselves: each row goes to its expert's owner only, landing in the owner's buffer sorted
     by expert (one slice per (device, expert): no local sort afterwards);
  3. run `ragged_gemm` gate_up, `activation`, `ragged_gemm` down on the rows it received, with
     its own E/d experts only;
  4. send every result row back to the device its token lives on, put the rows back in
     (token, slot) order and sum each token's k rows with its router weights (`combine`).

Nothing is dropped: the receive buffer holds the most rows a device can get (every token's
min(k, E/d) experts on it), so no routing overflows it ("capacity-free"). Nothing is reduced
across devices: each output element is computed on one device, by the same kernel plan as the
unsharded layer (the GEMMs are planned for the unsharded problem, `plan_shape`; each row's
products do not depend on the other rows), so the result equals one device's bit for bit when
the rest of the layer (routing, activation, combine) computes per token as on one device.

The exchange (`exchange=`):
  "ragged"  `jax.lax.ragged_all_to_all`: exactly the routed rows cross the interconnect
            (GPUs; XLA's CPU backend does not implement it);
  "padded"  the same exchange written with `jax.lax.all_to_all` on per-device buffers sized
            for the worst case (d * T/d * min(k, E/d) rows each way): correct everywhere,
            d times the bytes of the ragged exchange at best; for CPUs and tests;
  "auto"    "ragged" on GPUs, "padded" elsewhere (decided by the mesh's devices);
  "reduce"  no rows cross: every device keeps every token (x replicated, as tensor-parallel
            attention leaves it), routes and sorts all of them as one device does, and runs
            only the rows of its own experts (one contiguous run of the sorted rows) through
            both GEMMs; each device then sums its share of every token's combine (the slots it
            owns, the others 0); the (T, H) shares are summed across devices in f32 and every
            device gets the output (replicated): one all-reduce, or from
            REDUCE_SCATTER_MIN_BYTES of shares an f32 reduce-scatter (an all-to-all of the
            f32 shares, each device summing its T/d tokens in device order) and an all-gather
            in the output dtype. The interconnect carries T x H values once, against
            2 x T x k x H x (d - 1) / d rows for the dispatching exchanges; the shares are
            added in another order than one device's slot-by-slot sum, so the output equals
            one device's to f32 rounding (a few bf16 outputs one step apart), not bit for bit.
"""
from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from ..core.quantize import BlockScaled
from .api import _operands_and_params
from .primitive import (bind_local, inverse_permutation, stable_order_and_counts,
                        unsort_rows)

__all__ = ["EXCHANGES", "combine", "dispatch_moe", "expert_gemm", "expert_order",
           "quantize_as_one_device", "ragged_exchange", "sum_shares"]

EXCHANGES = ("auto", "ragged", "padded", "reduce")


# ---------------------------------------------------------------------------------------------
# Pieces shared with the one-device layer


def expert_order(flat, num_experts: int):
    """(order, counts) of the routed rows `flat` ((n,) int32 expert ids in [0, num_experts)):
    the stable permutation sorting them by expert (`stable_order`) and each expert's row count
    ((num_experts,) int32): the sorted rows and group sizes of every MoE layer here. Where the
    order counts the rows per expert itself, the counts are those (no second count)."""
    return stable_order_and_counts(flat, num_experts)


def combine(rows, weights):
    """Each token's k rows summed with its router weights, in f32: rows (T, k, N), weights
    (T, k) -> (T, N). An explicit sum over the k slots, in slot order, elementwise: every output
    element is computed by the same operations whatever the shape around it (a dot over k would
    let XLA pick its algorithm, and with it the summation order, from the shape)."""
    rows = rows.astype(jnp.float32)
    weights = weights.astype(jnp.float32)
    out = rows[:, 0] * weights[:, 0:1]
    for s in range(1, rows.shape[1]):
        out = out + rows[:, s] * weights[:, s:s + 1]
    return out


def expert_gemm(lhs, rhs: BlockScaled, group_sizes, *, out_dtype, backend=None,
                plan_shape=None):
    """`ragged_gemm` on one device (inside `shard_map`), planned as the problem `plan_shape`
    (M, N, G) would be on one device (None: as itself). A shard that runs the unsharded call's
    plan sums every output element in the same order as the unsharded call."""
    operands, params = _operands_and_params(lhs, rhs, group_sizes, out_dtype, backend)
    return bind_local(operands, params, None, plan_shape)


# ---------------------------------------------------------------------------------------------
# The exchange


def _exclusive_cumsum(x, axis=0):
    return jnp.cumsum(x, axis=axis, dtype=x.dtype) - x


def _padded_ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets,
                              recv_sizes, *, axis_name, axis_size, peer_rows):
    """`lax.ragged_all_to_all`'s semantics with `lax.all_to_all`: the rows this device sends
    each peer are packed into a (peer_rows, ...) slot per peer, with each row's place on the
    receiver beside it; the receiver writes them there. `peer_rows` must bound the rows sent to
    one peer (the caller's worst case). Slices must not overlap."""
    del recv_sizes  # implied by what arrives
    d, n = axis_size, operand.shape[0]
    slices = input_offsets.shape[0]
    per_peer = slices // d
    p = jnp.arange(n, dtype=jnp.int32)
    # the slice each operand row lies in: the last slice starting at or before it (ties: the
    # non-empty one, sorted last)
    key = input_offsets * 2 + (send_sizes > 0)
    by_start = jnp.argsort(key, stable=True)
    starts = input_offsets[by_start]
    pos = jnp.searchsorted(starts, p, side="right") - 1
    s = by_start[jnp.clip(pos, 0, slices - 1)]
    rank = p - input_offsets[s]
    sent = (pos >= 0) & (rank < send_sizes[s])
    peer = jnp.where(sent, s // per_peer, d)
    target = output_offsets[s] + rank
    # each sent row's place among the rows to its peer
    counts = jnp.zeros((d + 1,), jnp.int32).at[peer].add(1)
    first = _exclusive_cumsum(counts)
    order = jnp.argsort(peer, stable=True)
    place = jnp.zeros((n,), jnp.int32).at[order].set(p - first[peer[order]])
    slot = jnp.where(sent, peer * peer_rows + place, d * peer_rows)  # past the end: dropped
    trailing = operand.shape[1:]
    buf = jnp.zeros((d * peer_rows,) + trailing, operand.dtype).at[slot].set(operand,
                                                                             mode="drop")
    where = jnp.full((d * peer_rows,), output.shape[0], jnp.int32).at[slot].set(
        target.astype(jnp.int32), mode="drop")
    buf = lax.all_to_all(buf.reshape((d, peer_rows) + trailing), axis_name, 0, 0, tiled=True)
    where = lax.all_to_all(where.reshape(d, peer_rows), axis_name, 0, 0, tiled=True)
    return output.at[where.reshape(-1)].set(buf.reshape((-1,) + trailing), mode="drop")


def ragged_exchange(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *,
                    axis_name, axis_size, exchange, peer_rows):
    """`lax.ragged_all_to_all(operand, output, ...)` by the chosen method ("ragged" or
    "padded", see the module docstring; `peer_rows` bounds the rows sent to one peer)."""
    if exchange == "ragged":
        return lax.ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets,
                                     recv_sizes, axis_name=axis_name)
    return _padded_ragged_all_to_all(operand, output, input_offsets, send_sizes,
                                     output_offsets, recv_sizes, axis_name=axis_name,
                                     axis_size=axis_size, peer_rows=peer_rows)


def _exchange_plan(all_counts, me, d, local_experts):
    """Every size and offset of both exchanges, from every device's per-expert row counts
    `all_counts` (d, E): all_counts[src, e] rows of expert e sorted on device src. Device j owns
    experts j*E/d ... (j+1)*E/d - 1 and stores the rows it receives sorted by expert, then by
    source device. Returns, for device `me` (each (d * E/d,) int32, indexed [peer * E/d + e]
    for the peer's or my e-th local expert):
      recv      rows of my expert e that peer sends me;
      group     (E/d,) my experts' row counts (the grouped GEMM's group sizes);
      recv_off  where peer's rows of my expert e start in my buffer;
      out_off   where my rows of peer's expert e start in peer's buffer;
      back_off  where peer's rows of my expert e sat in peer's sorted rows (their way back).
    One all-gather of the counts replaces the three all-to-alls that would pass these around."""
    per = all_counts.astype(jnp.int32).reshape(d, d, local_experts)  # [src, owner, e]
    groups = jnp.sum(per, axis=0, dtype=jnp.int32)            # [owner, e]
    starts = _exclusive_cumsum(groups, axis=1)                # owner's buffer, by expert
    before = _exclusive_cumsum(per, axis=0)                   # earlier sources' rows
    sorted_off = _exclusive_cumsum(per.reshape(d, -1), axis=1).reshape(d, d, local_experts)
    recv = per[:, me].reshape(-1)
    recv_off = (starts[me][None, :] + before[:, me]).reshape(-1)
    out_off = (starts + before[me]).reshape(-1)
    back_off = sorted_off[:, me].reshape(-1)
    return recv, groups[me], recv_off, out_off, back_off


def _exchange_for(mesh, exchange):
    if exchange not in EXCHANGES:
        raise ValueError(f"exchange must be one of {EXCHANGES}, got {exchange!r}")
    if exchange != "auto":
        return exchange
    platform = np.asarray(mesh.devices).flat[0].platform
    return "ragged" if platform in ("gpu", "cuda", "rocm") else "padded"


# ---------------------------------------------------------------------------------------------
# The layer


def _weight_specs(w: BlockScaled, axis):
    gs = w.global_scale
    gs_spec = None if gs is None else (P(axis) if jnp.ndim(gs) == 1 else P())
    return BlockScaled(P(axis), P(axis), gs_spec, w.fmt, w.layout)


def _check(x, router, gate_up, down, mesh, axis):
    if mesh is None:
        mesh = jax.sharding.get_abstract_mesh()
        if mesh is None or mesh.empty:
            raise ValueError("dispatch_moe needs mesh= (a jax.sharding.Mesh with the expert axis), "
                             "or a mesh set with jax.set_mesh")
    if axis not in mesh.axis_names:
        raise ValueError(f"axis={axis!r} is not an axis of the mesh {dict(mesh.shape)}")
    for name, w in (("gate_up", gate_up), ("down", down)):
        if not isinstance(w, BlockScaled) or w.ndim != 3:
            raise TypeError(f"{name} must be a BlockScaled (experts, out, in), got "
                            f"{type(w).__name__} {getattr(w, 'shape', '')}")
    experts = gate_up.shape[0]
    d = mesh.shape[axis]
    if down.shape[0] != experts:
        raise ValueError(f"gate_up has {experts} experts but down has {down.shape[0]}")
    if experts % d:
        raise ValueError(f"the {experts} experts cannot be split evenly over mesh axis "
                         f"{axis!r} of {d} devices")
    if x.ndim != 2 or x.shape[1] != gate_up.shape[2]:
        raise ValueError(f"x must have shape (tokens, hidden={gate_up.shape[2]}), got {x.shape}")
    return mesh, d, experts


# exchange="reduce": the rows a device's buffer holds. The most its experts can get is
# T * min(k, E/d), d times what routing spread evenly gives it; buffer-sized work (the row gather,
# the activation between the GEMMs, the zeros the GEMMs write past the groups) is then mostly
# waste. Where that bound has at least REDUCE_LIKELY_MIN_ROWS rows, the layer also compiles a
# buffer of each REDUCE_LIKELY_SLACKS x the even share (in whole REDUCE_ROWS_ALIGN) and runs the
# smallest that every device's rows fit (a lax.switch that every device decides alike from the
# routing, which each holds whole); otherwise the worst-case buffer. Nothing is dropped either
# way. (The slacks: docs/design/moe_expert_parallel.md.)
REDUCE_LIKELY_MIN_ROWS = 2048
REDUCE_LIKELY_SLACKS = (1.0625, 1.25)
REDUCE_ROWS_ALIGN = 128
# Shares of at least this many bytes (f32) are summed per token range on its device (an
# all-to-all of f32 shares, then an all-gather in the output dtype: each output element summed
# once and rounded once, as by an f32 all-reduce and a cast, in 3/4 of the bytes); smaller ones
# by one all-reduce (one collective's latency instead of two).
REDUCE_SCATTER_MIN_BYTES = 4 << 20


def _row_buffers(rows: int, d: int, most: int) -> tuple[int, ...]:
    """The buffers exchange="reduce" compiles for `rows` routed rows over d devices whose worst
    case is `most` rows: ascending, the last `most` (alone where no smaller one is compiled)."""
    if most < REDUCE_LIKELY_MIN_ROWS:
        return (most,)
    sizes = set()
    for slack in REDUCE_LIKELY_SLACKS:
        units = -(-int(np.ceil(rows / d * slack)) // REDUCE_ROWS_ALIGN)
        sizes.add(min(most, units * REDUCE_ROWS_ALIGN))
    return tuple(sorted(sizes | {most}))


def _buffer_index(busiest, buffers):
    """Index of the smallest of `buffers` (ascending, the last the worst case) that holds
    `busiest` rows: the number of smaller buffers it overflows."""
    index = jnp.int32(0)
    for size in buffers[:-1]:
        index = index + (busiest > size).astype(jnp.int32)
    return index


def sum_shares(share, axis, d, dt):
    """Every device's (T, H) f32 share summed across `axis` (d devices), in `dt`, on every
    device. Below REDUCE_SCATTER_MIN_BYTES one f32 all-reduce. From it each device takes T/d of
    the tokens: an all-to-all hands it every device's f32 share of them, it adds them in device
    order (0, 1, ..., d - 1: the same sums on every device and in every run) and rounds once,
    and an all-gather of the rounded sums gives every device all T (the bytes of a
    reduce-scatter and an all-gather, by NCCL's point-to-point path, which moved them faster
    than its reduce-scatter: docs/design/moe_expert_parallel.md)."""
    if share.nbytes < REDUCE_SCATTER_MIN_BYTES:
        return lax.psum(share, axis).astype(dt)
    tokens = share.shape[0]
    pad = -tokens % d
    mine = jnp.pad(share, ((0, pad), (0, 0))).reshape(d, (tokens + pad) // d, -1)
    parts = lax.all_to_all(mine, axis, 0, 0)  # parts[j]: device j's share of my tokens
    total = parts[0]
    for j in range(1, d):
        total = total + parts[j]
    return lax.all_gather(total.astype(dt), axis, axis=0, tiled=True)[:tokens]


def _local_experts_moe(x, router, gate_up, down, *, route, activation, mesh, axis, quantize,
                       dtype, backend, d, experts):
    """exchange="reduce" (module docstring): every device holds every token, runs the rows of
    its own experts only and sums its share of each token's combine; the shares are summed
    across devices in f32 and every device gets the output."""
    tokens, hidden = x.shape
    local_experts = experts // d
    dt = np.dtype(dtype)

    def act(a):
        if quantize is None:
            return a.astype(dt)
        return quantize_as_one_device(quantize, a, axis)

    def share_of(cap, x, weights, order, place, start, group_sizes, gate_up, down):
        """This device's share (T, H) f32 of every token's combine, its rows in a buffer of
        `cap` rows (which must hold them); place: each (token, slot) row's place among them."""
        k = weights.shape[-1]
        take = jnp.minimum(start + jnp.arange(cap, dtype=jnp.int32), tokens * k - 1)
        # rows past my groups are other experts' rows: the grouped GEMMs write zeros there
        mine = x[order[take] // k]
        h = expert_gemm(act(mine), gate_up, group_sizes, out_dtype=dt, backend=backend,
                        plan_shape=(tokens * k, gate_up.shape[1], experts))
        y = expert_gemm(act(activation(h)), down, group_sizes, out_dtype=dt, backend=backend,
                        plan_shape=(tokens * k, down.shape[1], experts))
        # rows placed outside my rows are other devices' to add
        owned = (place >= 0) & (place < jnp.sum(group_sizes))
        rows = jnp.where(owned[:, None], y[jnp.clip(place, 0, cap - 1)], jnp.zeros((), y.dtype))
        return combine(rows.reshape(tokens, k, -1), weights)

    def body(x, router, gate_up, down):
        ids, weights = route(x, router)  # every token, as the one-device layer routes them
        k = ids.shape[-1]
        flat = ids.reshape(-1).astype(jnp.int32)
        order, counts = expert_order(flat, experts)  # the one-device layer's sorted rows
        first_expert = lax.axis_index(axis) * local_experts
        group_sizes = lax.dynamic_slice_in_dim(counts, first_expert, local_experts)
        # my experts' rows are one contiguous run of the sorted rows, from `start`
        start = _exclusive_cumsum(counts)[first_expert]
        place = inverse_permutation(order) - start  # each (token, slot) row's, among mine
        args = (x, weights, order, place, start, group_sizes, gate_up, down)
        most = tokens * min(k, local_experts)  # the most rows my experts can get
        buffers = _row_buffers(tokens * k, d, most)
        if len(buffers) > 1:
            # every device's rows, from the routing each holds whole: all decide alike
            busiest = jnp.max(jnp.sum(counts.reshape(d, local_experts), axis=1))
            share = lax.switch(_buffer_index(busiest, buffers),
                               [functools.partial(share_of, cap) for cap in buffers], *args)
        else:
            share = share_of(most, *args)
        return sum_shares(share, axis, d, dt)

    wspec = lambda w: _weight_specs(w, axis)  # noqa: E731
    run = jax.shard_map(body, mesh=mesh, in_specs=(P(), P(), wspec(gate_up), wspec(down)),
                        out_specs=P(), check_vma=False)
    return run(x, router, gate_up, down)


def dispatch_moe(x, router, gate_up: BlockScaled, down: BlockScaled, *,
                 route: Callable, activation: Callable, mesh=None, axis: str,
                 quantize: Callable | None = None, dtype=jnp.bfloat16,
                 backend: str | None = None, exchange: str = "auto"):
    """A mixture-of-experts feed-forward layer, expert parallel over mesh axis `axis`, tokens
    dispatched to their experts' devices (see the module docstring).

    x: (T, H) tokens (any placement; the computation splits them over `axis`; T need not be a
      multiple of the axis size: padding tokens are routed nowhere).
    router: whatever `route` needs, replicated on every device.
    gate_up: BlockScaled (E, N1, H); down: BlockScaled (E, H, N2), with blocked scales, E a
      multiple of the axis size; best placed split on E over `axis` (otherwise XLA moves them).
    route(x, router) -> (experts (t, k) int32, weights (t, k) f32) for t tokens (called with
      all T tokens on every device; each keeps the rows of its own share).
    activation(h) -> a: h (rows, N1) in `dtype`, a (rows, N2) (e.g. SwiGLU); must compute each
      row from that row only.
    quantize: rows (m, K) -> BlockScaled, applied before each GEMM (e.g.
      ``lambda a: jbs.quantize(a, "nvfp4")``), or None for weight-only (rows cast to `dtype`). A
      global scale it calibrates on its input ("auto") sees the amax of every device's rows,
      as on one device.
    dtype: activation and output dtype. backend: ragged backend to force.
    exchange: "auto", "ragged", "padded" or "reduce" (module docstring).
    Returns (T, H) in `dtype`: split over `axis` along T, or replicated with "reduce".
    """
    x = jnp.asarray(x)
    mesh, d, experts = _check(x, router, gate_up, down, mesh, axis)
    method = _exchange_for(mesh, exchange)
    if method == "reduce":
        return _local_experts_moe(x, router, gate_up, down, route=route, activation=activation,
                                  mesh=mesh, axis=axis, quantize=quantize, dtype=dtype,
                                  backend=backend, d=d, experts=experts)
    tokens, hidden = x.shape
    local_tokens = -(-tokens // d)
    padded = local_tokens * d
    valid = jnp.arange(padded) < tokens
    x_all = x  # routed unpadded: the router's dot sees the one-device layer's shape
    if padded != tokens:
        x = jnp.pad(x, ((0, padded - tokens), (0, 0)))
    local_experts = experts // d
    dt = np.dtype(dtype)

    def body(x, x_all, valid, router, gate_up, down):
        # routed as the one-device layer routes: all tokens (unpadded: a GPU's dot picks its
        # algorithm, and with it the order of its sums, by shape), then this device's share
        ids, weights = route(x_all, router)
        if padded != tokens:  # padding tokens: routed nowhere below
            ids = jnp.pad(ids, ((0, padded - tokens), (0, 0)))
            weights = jnp.pad(weights, ((0, padded - tokens), (0, 0)))
        first = lax.axis_index(axis) * local_tokens
        ids = lax.dynamic_slice_in_dim(ids, first, local_tokens)
        weights = lax.dynamic_slice_in_dim(weights, first, local_tokens)
        k = ids.shape[-1]
        ids = jnp.where(valid[:, None], ids.astype(jnp.int32), experts)  # padding: nowhere
        rows_n = x.shape[0] * k
        per_peer = x.shape[0] * min(k, local_experts)  # most rows one device sends one peer
        cap = d * per_peer  # most rows a device receives
        flat = ids.reshape(-1)
        order, counts = expert_order(flat, experts + 1)  # padding rows: key `experts`
        rows = x[order // k]
        counts = counts[:experts]  # (E,)
        in_off = _exclusive_cumsum(counts)
        recv, group_sizes, recv_off, out_off, back_off = _exchange_plan(
            lax.all_gather(counts, axis), lax.axis_index(axis), d, local_experts)
        exchange_ = functools.partial(ragged_exchange, axis_name=axis, axis_size=d,
                                      exchange=method, peer_rows=per_peer)
        mine = exchange_(rows, jnp.zeros((cap, hidden), rows.dtype), in_off, counts, out_off,
                         recv)

        def act(a):
            if quantize is None:
                return a.astype(dt)
            return quantize_as_one_device(quantize, a, axis)

        h = expert_gemm(act(mine), gate_up, group_sizes, out_dtype=dt, backend=backend,
                        plan_shape=(tokens * k, gate_up.shape[1], experts))
        y = expert_gemm(act(activation(h)), down, group_sizes, out_dtype=dt, backend=backend,
                        plan_shape=(tokens * k, down.shape[1], experts))
        # back to where each row came from: my slice (src, e) to src, at src's input offset
        back = exchange_(y, jnp.zeros((rows_n, y.shape[1]), y.dtype), recv_off, recv,
                         back_off, counts)
        out = combine(unsort_rows(back, order).reshape(x.shape[0], k, -1), weights)
        return out.astype(dt)

    wspec = lambda w: _weight_specs(w, axis)  # noqa: E731
    run = jax.shard_map(body, mesh=mesh,
                        in_specs=(P(axis), P(), P(axis), P(), wspec(gate_up), wspec(down)),
                        out_specs=P(axis), check_vma=False)
    y = run(x, x_all, valid, router, gate_up, down)
    return y[:tokens] if padded != tokens else y


def quantize_as_one_device(quantize, a, axis):
    """`quantize(a)` of this device's part of an activation as the one-device layer quantizes
    all of it: its rows (expert parallel), or its columns where K is split in whole blocks
    (tensor parallel, ragged/tensor_parallel.py). A row holding the amax of every device's part
    is appended for the calibration of a global scale, then dropped (each block's scale and
    elements depend on that block only)."""
    probe = jax.eval_shape(quantize, jax.ShapeDtypeStruct((1, a.shape[1]), a.dtype))
    if not isinstance(probe, BlockScaled):
        raise TypeError(f"quantize must map rows (m, K) to a BlockScaled, got {type(probe)}")
    if probe.global_scale is None:  # nothing calibrated on the whole tensor
        return quantize(a)
    a32 = a.astype(jnp.float32)
    amax = lax.pmax(jnp.max(jnp.where(jnp.isfinite(a32), jnp.abs(a32), 0.0), initial=0.0),
                    axis)
    extra = jnp.zeros((1, a.shape[1]), a.dtype).at[0, 0].set(amax.astype(a.dtype))
    q = quantize(jnp.concatenate([a, extra]))
    if not isinstance(q, BlockScaled) or q.shape != (a.shape[0] + 1, a.shape[1]):
        raise TypeError("quantize must map rows (m, K) to a BlockScaled (m, K)")
    return BlockScaled(q.data[:-1], q.scales[:-1], q.global_scale, q.fmt, q.layout)
