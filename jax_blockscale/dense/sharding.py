"""Sharding rules for `gemm_p`: how a block-scaled GEMM is split across devices.

Without a rule, XLA treats a GPU kernel's custom call as opaque and gathers every operand onto
every device. Here `gemm_p`'s lowering (its only one) wraps the per-device primitive
`gemm_local_p` in `jax.experimental.custom_partitioning`, which gives the SPMD partitioner

  * a Shardy sharding rule (`_sdy_rule`): factors for batch, M, N and K, shared by each operand's
    elements and scales in both scale layouts, K a reduction factor;
  * the GSPMD callbacks: `_infer_sharding_from_operands` (the output's sharding) and `_partition`
    (the placement the local kernel takes, and the per-device function).

The per-device function is `gemm_local_p.bind` on the local shards, so every backend (reference,
sm90, sm100) runs unchanged; when K is whole it runs the unsharded call's plan (`plan_shape`:
the same kernel and split count, so the same bits); when K is sharded it computes a partial
product in f32, reduces it with `psum` (or `psum_scatter` when the output is wanted sharded
along M or N), then applies alpha and casts, once, after the reduction.

Why at lowering time and not in `jbs.gemm`: `custom_partitioning` has no batching or JVP rules,
so wrapping the public function would break `vmap` and `grad`. `gemm_p` keeps its own rules and
only its lowering changes. The wrapper is skipped where there is nothing to partition: one device,
fully manual code (inside `shard_map`, and the per-device function itself), pmap, and
`jax.export` (a custom-partitioning call refers to Python callbacks and cannot be serialized;
there the reference backend's plain JAX ops are partitioned by XLA itself).

Placements the kernel cannot take locally are changed (and XLA reshards to match), with a log
line on the "jax_blockscale" logger:
  * blocked scales: an M (N) shard must be a whole number of 128-row tiles, i.e. M % (128 * d)
    == 0, and a K shard a whole number of 4-column tiles, i.e. K % (4 * block * d) == 0;
  * any quantized operand: a K shard must be a whole number of blocks, K % (block * d) == 0;
  * every sharded dim must divide evenly (uneven shards are padded with undefined values, which
    would be summed into the result when K is sharded);
  * one mesh axis can shard only one of batch/M/N/K; on a conflict the later of those is dropped.
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
from ..core.layout import COLS_PER_TILE, ROWS_PER_TILE
from ..lowering.partitioning import (Axes, MeshAxes, ShardyFactors,
                                     register_partitioned_lowering, spec_of)
from .primitive import gemm_local_p, gemm_p, join_operands, split_operands

log = logging.getLogger("jax_blockscale")


# ---------------------------------------------------------------------------------------------
# The problem's geometry, from the operand shapes and gemm_p's params.


@dataclasses.dataclass(frozen=True)
class _Geometry:
    fmt_a: str | None
    a_blocked: bool
    b_blocked: bool
    a_batch: tuple[int, ...]
    b_batch: tuple[int, ...]
    batch: tuple[int, ...]  # the output's (broadcast) batch shape
    m: int
    n: int
    k: int
    block: int  # elements per scale along K (A and B share it whenever both are quantized)

    @property
    def sk(self) -> int:
        return self.k // self.block

    @property
    def nb(self) -> int:
        return len(self.batch)

    def batch_dim(self, own: tuple[int, ...], i: int) -> int | None:
        """The operand's dim that carries output batch dim i, or None (absent or broadcast 1)."""
        j = i - (self.nb - len(own))
        if j < 0 or own[j] != self.batch[i]:
            return None
        return j


def _geometry(params, shapes) -> _Geometry:
    fmt_a = params["fmt_a"]
    a_shape, b_shape = shapes[0], shapes[1]
    a_batch, b_batch = tuple(a_shape[:-2]), tuple(b_shape[:-2])
    return _Geometry(
        fmt_a=fmt_a,
        a_blocked=fmt_a is not None and params["layout_a"] == "blocked",
        b_blocked=params["layout_b"] == "blocked",
        a_batch=a_batch, b_batch=b_batch,
        batch=tuple(np.broadcast_shapes(a_batch, b_batch)),
        m=a_shape[-2], n=b_shape[-2], k=a_shape[-1],
        block=get_format(params["fmt_b"]).block)


# ---------------------------------------------------------------------------------------------
# The placement plan: which mesh axes shard batch, M, N and K, and how the output is reduced.

@dataclasses.dataclass(frozen=True)
class _Plan:
    batch: tuple[Axes, ...]
    m: Axes
    n: Axes
    k: Axes
    scatter_dim: int | None  # output dim the K reduction scatters along (psum_scatter), if any


def _plan(g: _Geometry, mesh, a_spec, b_spec, out_spec=None) -> _Plan:
    """Choose the placement: keep the operands' shardings where the kernel can take them."""
    axes = MeshAxes(mesh, "gemm")
    size, take = axes.size, axes.take

    batch = []
    for i in range(g.nb):
        ja, jb = g.batch_dim(g.a_batch, i), g.batch_dim(g.b_batch, i)
        cand = (a_spec[ja] if ja is not None else ()) or (b_spec[jb] if jb is not None else ())
        batch.append(take(f"batch dim {i}", cand, g.batch[i]))
    tile_why = " into whole 128-row scale tiles (blocked layout)"
    m = take("M", a_spec[-2], g.m, ROWS_PER_TILE if g.a_blocked else 1,
             tile_why if g.a_blocked else "")
    n = take("N", b_spec[-2], g.n, ROWS_PER_TILE if g.b_blocked else 1,
             tile_why if g.b_blocked else "")
    # K: follow A, or B when A is not K-sharded (slicing the other operand is free; gathering
    # a K-sharded weight is not). Shards must hold whole blocks, and whole 4-column scale tiles
    # when a scale is blocked.
    blocked = g.a_blocked or g.b_blocked
    k_multiple = g.block * (COLS_PER_TILE if blocked else 1)
    k = take("K", a_spec[-1] or b_spec[-1], g.k, k_multiple,
             f" into whole {COLS_PER_TILE}-column scale tiles of {g.block}-element blocks"
             if blocked else f" into whole {g.block}-element blocks")
    scatter_dim = None
    if k and out_spec is not None:
        # The output is wanted sharded over K's axes along M or N: reduce-scatter along it.
        if out_spec[-2] == k and not m and g.m % size(k) == 0:
            scatter_dim = g.nb
        elif out_spec[-1] == k and not n and g.n % size(k) == 0:
            scatter_dim = g.nb + 1
    return _Plan(tuple(batch), m, n, k, scatter_dim)


def _placement(g: _Geometry, plan: _Plan, mesh, n_operands: int):
    """NamedShardings for the operands (a, b, [sa], sb, alpha) and the output under `plan`."""
    def entry(axes):
        return None if not axes else (axes[0] if len(axes) == 1 else axes)

    def batch_entries(own):
        return [entry(plan.batch[i]) if g.batch_dim(own, i) is not None else None
                for i in range(g.nb) if i >= g.nb - len(own)]

    def scale_spec(own, mn_axes, blocked):
        # The scales share their operand's batch, MN and K placement; in the blocked layout
        # MN and K are the tile dims and the 32x4x4 inside a tile stays whole.
        rest = [None, None, None] if blocked else []
        return P(*batch_entries(own), entry(mn_axes), entry(plan.k), *rest)

    a = P(*batch_entries(g.a_batch), entry(plan.m), entry(plan.k))
    b = P(*batch_entries(g.b_batch), entry(plan.n), entry(plan.k))
    sa = scale_spec(g.a_batch, plan.m, g.a_blocked) if g.fmt_a is not None else None
    sb = scale_spec(g.b_batch, plan.n, g.b_blocked)
    specs = join_operands(a, b, sa, sb, P())
    assert len(specs) == n_operands
    out = [entry(x) for x in plan.batch] + [entry(plan.m), entry(plan.n)]
    if plan.scatter_dim is not None:
        out[plan.scatter_dim] = entry(plan.k)
    named = lambda s: NamedSharding(mesh, s)
    return tuple(map(named, specs)), named(P(*out))


# ---------------------------------------------------------------------------------------------
# The custom_partitioning callbacks. `pt` is gemm_p's params as a hashable tuple of items.


def _operand_specs(arg_shapes):
    return [spec_of(x.sharding, len(x.shape)) for x in arg_shapes]


def _infer_sharding_from_operands(pt, mesh, arg_shapes, result_shape):
    params = dict(pt)
    g = _geometry(params, [x.shape for x in arg_shapes])
    specs = _operand_specs(arg_shapes)
    plan = _plan(g, mesh, specs[0], specs[1])
    return _placement(g, plan, mesh, len(arg_shapes))[1]


def _partition(pt, mesh, arg_shapes, result_shape):
    params = dict(pt)
    g = _geometry(params, [x.shape for x in arg_shapes])
    specs = _operand_specs(arg_shapes)
    out_spec = spec_of(result_shape.sharding, len(result_shape.shape))
    plan = _plan(g, mesh, specs[0], specs[1], out_spec)
    arg_shardings, out_sharding = _placement(g, plan, mesh, len(arg_shapes))
    log.debug("jax_blockscale gemm partitioned: batch=%s M=%s N=%s K=%s scatter=%s",
              plan.batch, plan.m, plan.n, plan.k, plan.scatter_dim)

    def local_gemm(*operands):
        if not plan.k:  # every device owns whole dot products: no communication
            # each shard runs the unsharded call's plan: the same sums, bit for bit
            whole = (g.a_batch, g.b_batch, g.m, g.n)
            return gemm_local_p.bind(*operands, **params, plan_shape=whole)
        # K is split: each device holds a partial sum. Reduce it in f32, then apply alpha and
        # round to the output dtype once, so the result equals the unsharded one.
        a, b, sa, sb, alpha = split_operands(operands, params["fmt_a"])
        partial = gemm_local_p.bind(*join_operands(a, b, sa, sb, jnp.float32(1.0)),
                              **dict(params, out_dtype=np.dtype(np.float32)))
        if plan.scatter_dim is not None:
            total = lax.psum_scatter(partial, plan.k, scatter_dimension=plan.scatter_dim,
                                     tiled=True)
        else:
            total = lax.psum(partial, plan.k)
        return (total * alpha).astype(params["out_dtype"])

    return mesh, local_gemm, out_sharding, arg_shardings


def _sdy_rule(pt, mesh, operand_types, result_types):
    """The Shardy rule: one factor per batch dim, M, N and K, shared by elements and scales.

    In the blocked layout a scale array is (..., MN/128, SK/4, 32, 4, 4) and row m of the
    elements is tile m // 128, sub-rows (m % 128) // 32 and m % 32; so the elements' MN dim is
    the compound factor (t, r4, r32) and the scales' dims are t, kt, r32, r4, k4. K is likewise
    (kt, k4, kb): tile, column in tile, element in block. The sub-tile factors need replication,
    so MN and K can only be sharded in whole tiles; kt (or ks, without blocked scales) is the
    reduction factor. Where a dim is not a whole number of tiles, no factor can express the
    padding, and the dim needs replication (`_plan` logs why).
    """
    del mesh, result_types
    params = dict(pt)
    from jax._src.lib.mlir import ir  # noqa: PLC0415  (MLIR types arrive from the lowering)
    shapes = [tuple(ir.RankedTensorType(t).shape) for t in operand_types]
    g = _geometry(params, shapes)
    f = ShardyFactors(blocked_any=g.a_blocked or g.b_blocked, k=g.k, sk=g.sk, block=g.block)

    def batch_dims(tag, own):
        dims = []
        for j, d in enumerate(own):
            i = j + g.nb - len(own)
            dims.append(f"b{i}" if g.batch_dim(own, i) is not None
                        else f.factor(f"{tag}one{j}", d))
        return dims

    for i, d in enumerate(g.batch):
        f.factor(f"b{i}", d)
    m_dim, m_tiles = f.mn("m", g.m, g.a_blocked)
    n_dim, n_tiles = f.mn("n", g.n, g.b_blocked)
    a = ArrayMapping(*batch_dims("a", g.a_batch), m_dim, f.k_dim)
    b = ArrayMapping(*batch_dims("b", g.b_batch), n_dim, f.k_dim)
    sa = (f.scales("a", batch_dims("a", g.a_batch), m_dim, m_tiles)
          if g.fmt_a is not None else None)
    sb = f.scales("b", batch_dims("b", g.b_batch), n_dim, n_tiles)
    operands = join_operands(a, b, sa, sb, ArrayMapping())
    out = ArrayMapping(*[f"b{i}" for i in range(g.nb)], m_dim, n_dim)
    return f.rule(operands, out, (f.reduction,))


@functools.partial(custom_partitioning, static_argnums=(0,))
def _partitioned_gemm(pt, *operands):
    return gemm_local_p.bind(*operands, **dict(pt))


_partitioned_gemm.def_partition(
    partition=_partition,
    infer_sharding_from_operands=_infer_sharding_from_operands,
    sharding_rule=_sdy_rule,
)


# gemm_p's only lowering (every platform): partitioned where an SPMD partitioner will split it,
# otherwise the local computation itself.
register_partitioned_lowering(gemm_p, "gemm", lambda xs, params: gemm_local_p.bind(*xs, **params),
                              _partitioned_gemm)
