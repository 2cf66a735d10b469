"""What the dense (sharding.py) and grouped (ragged_sharding.py) GEMMs' sharding share: when a
primitive's lowering wraps itself in `custom_partitioning` (and that lowering,
`register_partitioned_lowering`), and the factor bookkeeping of their Shardy rules
(`ShardyFactors`).

A custom-partitioning call is only useful where an SPMD partitioner will split the op and can
hand its callbacks shardings with mesh axis names; elsewhere (one device, fully manual code inside
`shard_map` and the per-device functions themselves, pmap, `jax.export`, whose artifacts cannot
refer to Python callbacks) the op lowers locally. Each skipped case is logged once.
"""
from __future__ import annotations

import logging
import math

import jax
from jax.experimental.custom_partitioning import ArrayMapping, CompoundFactor, SdyShardingRule
from jax.interpreters import mlir

# No public names: the lowering's axis contexts (they say whether an SPMD partitioner will split
# the op) and the registry of primitives that need the devices at lowering time.
from jax._src import dispatch
from jax._src.sharding_impls import ShardingContext, SPMDAxisContext

from ..core.layout import COLS_PER_TILE, ROWS_PER_TILE
from .registry import log_once  # (partitioning callbacks run several times per compilation)


def _thread_mesh():
    from jax._src import mesh as mesh_lib  # noqa: PLC0415
    return mesh_lib.thread_resources.env.physical_mesh


def partitioned_devices(axis_context, op: str) -> int:
    """Devices the SPMD partitioner will split `op` over (1: nothing to partition)."""
    if isinstance(axis_context, ShardingContext):
        n = len(axis_context.device_assignment or ())
        if n > 1 and axis_context.abstract_mesh is None and _thread_mesh().empty:
            # No NamedSharding anywhere and no `with mesh`: the callbacks would get shardings
            # without mesh axis names, so leave the op to XLA (correct, maybe gathered).
            log_once(logging.INFO, f"jax_blockscale {op}: no mesh in scope (no NamedSharding "
                     f"inputs/outputs); the {op} is not custom-partitioned")
            return 1
        return n
    if isinstance(axis_context, SPMDAxisContext):
        auto = set(axis_context.mesh.axis_names) - set(axis_context.manual_axes)
        # Fully manual (shard_map, and our own per-device functions): the op is already local.
        if not auto:
            return 1
        if not getattr(jax.config, "jax_use_shardy_partitioner", False):
            # Partially manual shard_map: GSPMD cannot hand these shardings to a
            # custom-partitioning callback (XLA aborts), so leave the op to XLA.
            log_once(logging.INFO, f"jax_blockscale {op}: inside a partially manual shard_map "
                     f"under GSPMD the {op} is not custom-partitioned; XLA places it")
            return 1
        return math.prod(axis_context.mesh.shape[x] for x in auto)
    return 1  # pmap's replica context and anything else: per-device code


Axes = tuple[str, ...]  # the mesh axes one dim of an operand is split over


def _spec_axes(entry) -> Axes:
    """A PartitionSpec entry (None, a name, or a tuple of names) as a tuple of names."""
    if entry is None:
        return ()
    return tuple(entry) if isinstance(entry, (tuple, list)) else (entry,)


def spec_of(sharding, ndim: int) -> list[Axes]:
    """Per-dim mesh axes of an operand's sharding; anything not a NamedSharding counts as
    replicated (XLA then reshards it to the placement the rule returns)."""
    if not isinstance(sharding, jax.sharding.NamedSharding):
        return [()] * ndim
    spec = list(sharding.spec) + [None] * (ndim - len(sharding.spec))
    return [_spec_axes(e) for e in spec[:ndim]]


class MeshAxes:
    """Mesh axes handed out to one op's dims, each axis at most once (a partition rule's choice
    of placement): `take` keeps a dim's axes where they are free and split it into whole
    multiples, and otherwise says once, on the package's logger, why the dim is resharded."""

    def __init__(self, mesh, op: str):
        self.mesh, self.op = mesh, op
        self.used: set[str] = set()

    def size(self, axes) -> int:
        return math.prod(self.mesh.shape[x] for x in axes)

    def take(self, what: str, axes, extent: int, multiple: int = 1, why: str = ""):
        """`axes` for a dim of `extent` if they are free and split it into multiples of
        `multiple`, else () (the dim is replicated)."""
        if not axes:
            return ()
        if self.used & set(axes):
            log_once(logging.INFO, f"jax_blockscale {self.op}: {what} not sharded over {axes}: "
                     "the axes already shard another dim; resharding")
            return ()
        d = self.size(axes)
        if extent % (d * multiple):
            log_once(logging.WARNING, f"jax_blockscale {self.op}: {what}={extent} cannot be split "
                     f"over mesh axes {axes} ({d} shards){why}; resharding it to replicated")
            return ()
        self.used.update(axes)
        return axes


def register_partitioned_lowering(prim, op: str, local, partitioned) -> None:
    """The only lowering of `prim` (every platform): `partitioned(params_tuple, *operands)` (a
    custom_partitioning function) where an SPMD partitioner will split the op, else
    `local(operands, params)`, the per-device computation itself. The partitioning callbacks need
    the mesh; JAX hands a lowering rule the devices and the mesh only for primitives in
    `prim_requires_devices_during_lowering` (jax.nn.scaled_matmul does the same)."""

    def lowering(ctx, *args, **params):
        if not needs_partitioning(ctx, op):
            fn = lambda *xs: local(xs, params)  # noqa: E731
        else:
            pt = tuple(sorted(params.items()))
            fn = lambda *xs: partitioned(pt, *xs)  # noqa: E731
        return mlir.lower_fun(fn, multiple_results=False)(ctx, *args)

    dispatch.prim_requires_devices_during_lowering.add(prim)
    mlir.register_lowering(prim, lowering)


def needs_partitioning(ctx, op: str) -> bool:
    """Whether the lowering context `ctx` will be split by an SPMD partitioner."""
    mc = ctx.module_context
    if getattr(mc.lowering_parameters, "for_export", False):
        # A custom-partitioning call holds a key into this process's Python callbacks; it
        # cannot be serialized. Exported code keeps the plain local lowering.
        if partitioned_devices(mc.axis_context, op) > 1:
            log_once(logging.INFO, f"jax_blockscale {op}: jax.export lowers {op} without its "
                     "custom partitioning rule; XLA partitions the backend's ops itself")
        return False
    return partitioned_devices(mc.axis_context, op) > 1


class ShardyFactors:
    """The factors of a Shardy rule over block-scaled operands, shared by gemm's and
    ragged_gemm's rules: named factors with their sizes (some needing replication), compounds,
    and the K and MN factors that elements and their plain or blocked scales share.

    Blocked scales tile MN by 128 rows (t x 4 x 32) and K by 4 scale columns (kt x 4 x block),
    so MN and K can only be sharded in whole tiles; kt (or ks, without blocked scales) is the
    reduction factor. Where a dim is not a whole number of tiles no factor can express the
    padding, and the dim needs replication."""

    def __init__(self, *, blocked_any: bool, k: int, sk: int, block: int):
        self.sizes: dict[str, int] = {}
        self.replicated: list[str] = []
        self.sk = sk
        self.k_tiled = blocked_any and sk % COLS_PER_TILE == 0
        if self.k_tiled:
            self._k_tiles = (self.factor("kt", sk // COLS_PER_TILE),
                             self.factor("k4", COLS_PER_TILE, True))
            kb = self.factor("kb", block, True)
            self.k_dim = self.compound(*self._k_tiles, kb)
            self.plain_sk, self.reduction = self.compound(*self._k_tiles), self._k_tiles[0]
        elif not blocked_any:
            ks, kb = self.factor("ks", sk), self.factor("kb", block, True)
            self.k_dim, self.plain_sk, self.reduction = self.compound(ks, kb), ks, ks
        else:  # blocked scales with padded K columns: K cannot be split at all
            self.k_dim = self.factor("k", k, True)
            self.plain_sk, self.reduction = self.factor("sk", sk, True), None

    def factor(self, name: str, n: int, replicate: bool = False) -> str:
        self.sizes[name] = n
        if replicate:
            self.replicated.append(name)
        return name

    def compound(self, *names):
        # Shardy rejects size-1 factors inside a compound; such a factor cannot be split anyway.
        names = [f for f in names if self.sizes[f] > 1] or [names[-1]]
        return names[0] if len(names) == 1 else CompoundFactor(*names)

    def mn(self, p: str, mn: int, blocked: bool):
        """(elements' MN dim, the blocked scales' (tile, r32, r4) dims, or None if plain)."""
        if not blocked:
            return self.factor(p, mn), None
        if mn % ROWS_PER_TILE == 0:
            t, r4, r32 = (self.factor(p + "t", mn // ROWS_PER_TILE), self.factor(p + "4", 4, True),
                          self.factor(p + "32", 32, True))
            return self.compound(t, r4, r32), (t, r32, r4)
        return self.factor(p, mn, True), (self.factor(p + "t", -(-mn // ROWS_PER_TILE), True),
                                          self.factor(p + "32", 32, True),
                                          self.factor(p + "4", 4, True))

    def scales(self, tag: str, lead, mn_dim, tiles) -> ArrayMapping:
        """One operand's scales: plain (lead, MN, SK) when `tiles` is None, else blocked
        (lead, t, kt, 32, 4, 4); blocked scales with padded K columns get their own replicated
        K factors (tagged)."""
        if tiles is None:
            return ArrayMapping(*lead, mn_dim, self.plain_sk)
        t, r32, r4 = tiles
        if self.k_tiled:
            skt, sk4 = self._k_tiles
        else:
            skt, sk4 = (self.factor(tag + "kt", -(-self.sk // COLS_PER_TILE), True),
                        self.factor(tag + "k4", COLS_PER_TILE, True))
        return ArrayMapping(*lead, t, skt, r32, r4, sk4)

    def rule(self, operands, out, reductions) -> SdyShardingRule:
        """The rule: factors used only inside compounds get their sizes; `reductions` (those in
        use) are reduction factors, the replicated ones need replication."""
        whole = {d for mapping in operands + (out,) for d in mapping if isinstance(d, str)}
        # Shardy numbers factors in order of first use and wants special factors in that order.
        order = list(dict.fromkeys(f for mapping in operands + (out,) for d in mapping
                                   for f in ((d,) if isinstance(d, str) else d)))
        compound_only = {f: self.sizes[f] for f in order if f not in whole}
        reductions = tuple(f for f in order if f in reductions)
        need_rep = tuple(sorted(set(self.replicated) & set(order) - set(reductions),
                                key=order.index))
        return SdyShardingRule(operands, (out,), reduction_factors=reductions,
                               need_replication_factors=need_rep, **compound_only)
