"""When a primitive's lowering should wrap itself in `custom_partitioning`: shared by the dense
(sharding.py) and grouped (ragged_sharding.py) GEMMs.

A custom-partitioning call is only useful where an SPMD partitioner will split the op and can
hand its callbacks shardings with mesh axis names; elsewhere (one device, fully manual code inside
`shard_map` and the per-device functions themselves, pmap, `jax.export`, whose artifacts cannot
refer to Python callbacks) the op lowers locally. Each skipped case is logged once.
"""
from __future__ import annotations

import logging
import math

import jax

# No public names: the lowering's axis contexts (they say whether an SPMD partitioner will split
# the op).
from jax._src.sharding_impls import ShardingContext, SPMDAxisContext

from .lowering import log_once  # (partitioning callbacks run several times per compilation)


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
