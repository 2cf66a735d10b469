"""How a BlockScaled weight's arrays follow a sharding of the weight it stands for.

    blockscaled_shardings(sharding, q)   per-array shardings for q from one of its logical
                                         (..., N, K) weight

The elements take the weight's spec; plain scales the same rows with K blocks; blocked scales
the weight's N and K mesh axes on their row and K-block tiles (where the tile counts divide);
a per-matrix global scale the leading dims. Checkpoint loading (interop) and the MoE layer's
placement (nn) both read it from here.
"""
from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from . import layout as _layout
from .quantize import BlockScaled

__all__ = ["blockscaled_shardings"]


def blockscaled_shardings(sharding, q) -> BlockScaled | Any:
    """Per-array shardings for a BlockScaled `q` from a sharding of its logical (..., N, K)
    weight: a NamedSharding's spec is carried over to the data, to the plain scales (the same
    rows, K blocks instead of elements), to blocked scales (row tiles, K-block tiles) and to a
    per-matrix global scale (the leading dims). A fully replicated or single-device sharding
    applies to every array as it is."""
    if not isinstance(sharding, NamedSharding):
        if getattr(sharding, "is_fully_replicated", False):
            return jax.tree.map(lambda _: sharding, q)
        raise TypeError("sharding must be a NamedSharding (its spec is mapped onto the scales) "
                        f"or a fully replicated sharding, got {sharding!r}")
    nd = q.ndim
    spec = tuple(sharding.spec) + (None,) * (nd - len(sharding.spec))
    if len(spec) != nd:
        raise ValueError(f"sharding spec {sharding.spec} has more axes than the {nd}-d weight")
    named = lambda s: NamedSharding(sharding.mesh, PartitionSpec(*s))  # noqa: E731
    lead, rows, cols = spec[:-2], spec[-2], spec[-1]
    if q.layout == "plain":
        scales = named(spec)
    else:
        # blocked scales are (..., N/128, SK/4, 32, 4, 4): the row and K-block tiles take the
        # weight's N and K mesh axes where the tile counts divide evenly (a small weight has
        # fewer tiles than devices: that axis is replicated instead)
        *_, n, k = q.shape
        tiles = _layout.blocked_shape(n, k // q.format.block)[:2]
        fit = [ax if tiles[i] % _mesh_size(sharding.mesh, ax) == 0 else None
               for i, ax in enumerate((rows, cols))]
        scales = named((*lead, *fit, None, None, None))
    gs = None
    if q.global_scale is not None:
        gs = named(lead[:np.ndim(q.global_scale)] if np.ndim(q.global_scale) else ())
    return BlockScaled(named(spec), scales, gs, q.fmt, q.layout)


def _mesh_size(mesh, axes) -> int:
    """Devices along a spec entry (None, a mesh axis name, or a tuple of them)."""
    if axes is None:
        return 1
    names = axes if isinstance(axes, tuple) else (axes,)
    return int(np.prod([mesh.shape[a] for a in names]))
