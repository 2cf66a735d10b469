"""Sharding rules for `ragged_gemm_p`: expert, tensor, data and K parallel grouped GEMM.

`ragged_gemm_p`'s lowering (its only one) wraps the per-device primitive `ragged_gemm_local_p`
in `jax.experimental.custom_partitioning` where an SPMD partitioner will split it, exactly as
sharding.py does for `gemm_p` (read its docstring for the why and the skipped cases: one device,
fully manual code, pmap, jax.export). Operands: lhs (M, K), rhs (G, N, K), scales, group_sizes
(G,), alpha (G,); output (M, N).

| sharded                       | per device                                  | communication        |
|-------------------------------|---------------------------------------------|----------------------|
| N of rhs (tensor parallel)    | its N columns of every expert               | none                 |
| M of lhs (data parallel)      | its rows; group sizes cut to those rows     | none                 |
| G of rhs (expert parallel)    | its experts' rows (group offsets shifted)   | psum over G's axes   |
| K of lhs / rhs                | partial products in f32                     | psum over K's axes   |

In index mode (`jbs.gemm(..., layer=i)`: one group, the layer, owns every row) G is never split
(each device needs the layer it runs); M, N and K split as above.

Expert parallel: each device holds G/d experts, the full lhs (replicated, or its M shard) and
the full group_sizes (G ints, always replicated: a device needs the sizes of the experts before
its own to know where its rows start). It computes the rows of its experts, which form one
contiguous range (group offsets shifted by `row_start`), and writes zeros elsewhere; since the
devices' row ranges are disjoint, the combine is a psum over the expert axes that adds one
nonzero value to zeros, exact even in bf16 (so it is done in out_dtype: half the bytes of f32).
With K also sharded, the partial sums are reduced in f32 over both and rounded once.
(A token-sharded expert-parallel layer that dispatches tokens with all-to-all is a different
program: write it with shard_map around `ragged_gemm`, which inside is the local primitive.)

Where K is whole, every shard runs the kernel variant and split count that the unsharded call
would (`plan_shape`, RaggedSpec): each output element is then summed in the same order on its
device as on one device, so expert-, tensor- and data-parallel results equal the unsharded call
bit for bit (a kernel planned for the smaller shard could split K differently and round
differently). Where K is split, the partial sums differ from one device's anyway and each shard
plans for itself.

Placements the local computation cannot take are changed (XLA reshards), logged once on the
"jax_blockscale" logger, as for `gemm`: a dim must split evenly; blocked scales split only in
whole 128-row (M, N) and 4-column (K) tiles; K only in whole blocks; one mesh axis shards one
of M, G, N, K (on a conflict the later is dropped); group_sizes is replicated.
"""
from __future__ import annotations

import dataclasses
import functools
import logging

import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental.custom_partitioning import ArrayMapping, custom_partitioning
from jax.sharding import NamedSharding, PartitionSpec as P

from ..core.formats import get_format
from ..lowering.partitioning import (Axes, MeshAxes, ShardyFactors,
                                     register_partitioned_lowering, spec_of)
from ..core.layout import COLS_PER_TILE, ROWS_PER_TILE
from .primitive import bind_local, join_operands, ragged_gemm_p, split_operands
from ..lowering.ragged_reference import clamp_group_sizes

log = logging.getLogger("jax_blockscale")


@dataclasses.dataclass(frozen=True)
class _Geometry:
    fmt_lhs: str | None
    lhs_blocked: bool
    rhs_blocked: bool
    m: int
    n: int
    k: int
    groups: int
    block: int
    group_index: bool  # index mode: one group owns every row (a layer of a stack)

    @property
    def sk(self) -> int:
        return self.k // self.block


def _geometry(params, shapes) -> _Geometry:
    fmt_lhs = params["fmt_lhs"]
    lhs, rhs = shapes[0], shapes[1]
    return _Geometry(fmt_lhs=fmt_lhs,
                     lhs_blocked=fmt_lhs is not None and params["layout_lhs"] == "blocked",
                     rhs_blocked=params["layout_rhs"] == "blocked",
                     m=lhs[0], n=rhs[1], k=lhs[1], groups=rhs[0],
                     block=get_format(params["fmt_rhs"]).block,
                     group_index=bool(params.get("group_index")))


@dataclasses.dataclass(frozen=True)
class _Plan:
    m: Axes
    g: Axes
    n: Axes
    k: Axes
    scatter_dim: int | None  # output dim the reduction scatters along, if any

    @property
    def reduce(self) -> Axes:
        return self.k + self.g


def _plan(geo: _Geometry, mesh, lhs_spec, rhs_spec, out_spec=None) -> _Plan:
    axes = MeshAxes(mesh, "ragged_gemm")
    size, take = axes.size, axes.take

    tile_why = " into whole 128-row scale tiles (blocked layout)"
    m = take("M", lhs_spec[0], geo.m, ROWS_PER_TILE if geo.lhs_blocked else 1,
             tile_why if geo.lhs_blocked else "")
    # index mode reads one group (layer) of the stack: every device needs it, so G is whole
    g = () if geo.group_index else take("G", rhs_spec[0], geo.groups)
    n = take("N", rhs_spec[1], geo.n, ROWS_PER_TILE if geo.rhs_blocked else 1,
             tile_why if geo.rhs_blocked else "")
    blocked = geo.lhs_blocked or geo.rhs_blocked
    k_multiple = geo.block * (COLS_PER_TILE if blocked else 1)
    k = take("K", lhs_spec[1] or rhs_spec[2], geo.k, k_multiple,
             f" into whole {COLS_PER_TILE}-column scale tiles of {geo.block}-element blocks"
             if blocked else f" into whole {geo.block}-element blocks")
    scatter_dim = None
    red = k + g
    if red and out_spec is not None:
        # The output is wanted sharded over the reduction's axes: reduce-scatter along it.
        if out_spec[0] == red and not m and geo.m % size(red) == 0:
            scatter_dim = 0
        elif out_spec[1] == red and not n and geo.n % size(red) == 0:
            scatter_dim = 1
    return _Plan(m, g, n, k, scatter_dim)


def _entry(axes):
    return None if not axes else (axes[0] if len(axes) == 1 else axes)


def _placement(geo: _Geometry, plan: _Plan, mesh, n_operands: int):
    e = _entry
    rest = [None, None, None]
    lhs = P(e(plan.m), e(plan.k))
    rhs = P(e(plan.g), e(plan.n), e(plan.k))
    sl = None
    if geo.fmt_lhs is not None:
        sl = P(e(plan.m), e(plan.k), *(rest if geo.lhs_blocked else []))
    sr = P(e(plan.g), e(plan.n), e(plan.k), *(rest if geo.rhs_blocked else []))
    specs = join_operands(lhs, rhs, sl, sr, P(), P(e(plan.g)))
    assert len(specs) == n_operands
    out = [e(plan.m), e(plan.n)]
    if plan.scatter_dim is not None:
        out[plan.scatter_dim] = e(plan.reduce)
    named = lambda s: NamedSharding(mesh, s)
    return tuple(map(named, specs)), named(P(*out))


def _infer_sharding_from_operands(pt, mesh, arg_shapes, result_shape):
    params = dict(pt)
    geo = _geometry(params, [x.shape for x in arg_shapes])
    specs = [spec_of(x.sharding, len(x.shape)) for x in arg_shapes]
    plan = _plan(geo, mesh, specs[0], specs[1])
    return _placement(geo, plan, mesh, len(arg_shapes))[1]


def _local_rows(safe, geo: _Geometry, plan: _Plan, m_local: int, g_local: int):
    """(row_start, local group sizes) of this device: its experts' rows within its M shard."""
    ends = jnp.cumsum(safe)
    starts = ends - safe
    if plan.g:
        first = lax.axis_index(plan.g) * g_local
        starts = lax.dynamic_slice(starts, (first,), (g_local,))
        ends = lax.dynamic_slice(ends, (first,), (g_local,))
    lo = lax.axis_index(plan.m) * m_local if plan.m else jnp.int32(0)
    s = jnp.clip(starts, lo, lo + m_local) - lo
    e = jnp.clip(ends, lo, lo + m_local) - lo
    return s[0].astype(jnp.int32), (e - s).astype(jnp.int32)


def _partition(pt, mesh, arg_shapes, result_shape):
    params = dict(pt)
    geo = _geometry(params, [x.shape for x in arg_shapes])
    specs = [spec_of(x.sharding, len(x.shape)) for x in arg_shapes]
    out_spec = spec_of(result_shape.sharding, len(result_shape.shape))
    plan = _plan(geo, mesh, specs[0], specs[1], out_spec)
    arg_shardings, out_sharding = _placement(geo, plan, mesh, len(arg_shapes))
    log.debug("jax_blockscale ragged_gemm partitioned: M=%s G=%s N=%s K=%s scatter=%s",
              plan.m, plan.g, plan.n, plan.k, plan.scatter_dim)
    out_dtype = params["out_dtype"]

    def local_ragged(*operands):
        lhs, rhs, sl, sr, gs, alpha = split_operands(operands, params["fmt_lhs"])
        if (plan.m or plan.g) and not geo.group_index:  # index mode: every row is the layer's
            safe = clamp_group_sizes(gs, geo.m)  # the global semantics, on the full sizes
            row_start, gs = _local_rows(safe, geo, plan, lhs.shape[0], rhs.shape[0])
        else:
            row_start = None
        local_params, plan_shape = params, (geo.m, geo.n, geo.groups)
        if plan.k:  # partial sums: reduce in f32, round once (the shard plans for itself)
            local_params = dict(params, out_dtype=np.dtype(np.float32))
            plan_shape = None
        y = bind_local(join_operands(lhs, rhs, sl, sr, gs, alpha), local_params, row_start,
                       plan_shape)
        if plan.reduce:
            if plan.scatter_dim is not None:
                y = lax.psum_scatter(y, plan.reduce, scatter_dimension=plan.scatter_dim,
                                     tiled=True)
            else:
                y = lax.psum(y, plan.reduce)
        return y.astype(out_dtype)

    return mesh, local_ragged, out_sharding, arg_shardings


def _sdy_rule(pt, mesh, operand_types, result_types):
    """The Shardy rule: factors M, G, N, K shared by elements and scales (as sharding.py's
    rule for gemm_p, with G in place of batch); K and G are reduction factors; group_sizes has
    its own factor that needs replication."""
    del mesh, result_types
    params = dict(pt)
    from jax._src.lib.mlir import ir  # noqa: PLC0415
    shapes = [tuple(ir.RankedTensorType(t).shape) for t in operand_types]
    geo = _geometry(params, shapes)
    f = ShardyFactors(blocked_any=geo.lhs_blocked or geo.rhs_blocked, k=geo.k, sk=geo.sk,
                      block=geo.block)
    m_dim, m_tiles = f.mn("m", geo.m, geo.lhs_blocked)
    g = f.factor("g", geo.groups)
    n_dim, n_tiles = f.mn("n", geo.n, geo.rhs_blocked)
    gsz = None if geo.group_index else f.factor("gs", geo.groups, True)
    lhs = ArrayMapping(m_dim, f.k_dim)
    rhs = ArrayMapping(g, n_dim, f.k_dim)
    sl = f.scales("l", (), m_dim, m_tiles) if geo.fmt_lhs is not None else None
    sr = f.scales("r", (g,), n_dim, n_tiles)
    gs = ArrayMapping() if gsz is None else ArrayMapping(gsz)  # index mode: a scalar
    operands = join_operands(lhs, rhs, sl, sr, gs, ArrayMapping(g))
    out = ArrayMapping(m_dim, n_dim)
    return f.rule(operands, out, (f.reduction, g))


@functools.partial(custom_partitioning, static_argnums=(0,))
def _partitioned_ragged(pt, *operands):
    return bind_local(operands, dict(pt))


_partitioned_ragged.def_partition(
    partition=_partition,
    infer_sharding_from_operands=_infer_sharding_from_operands,
    sharding_rule=_sdy_rule,
)


# ragged_gemm_p's only lowering: partitioned where an SPMD partitioner will split it, local
# otherwise (the same decision as sharding.py's for gemm_p).
register_partitioned_lowering(ragged_gemm_p, "ragged_gemm", lambda xs, params: bind_local(xs, params),
                              _partitioned_ragged)
