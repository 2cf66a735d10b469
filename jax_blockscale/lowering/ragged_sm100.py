"""The `sm100` backend of `ragged_gemm`: the contiguous grouped block-scaled kernel on Blackwell
(lowering/plan.py: plan_ragged_sm100 decides; this module prepares its operands and emits the
call to the FFI target `jax_blockscale_ragged_gemm_sm100`; docs/design/sm100.md, "Grouped").

tcgen05 MMAs work on 128-row tiles of A whose block scales are whole 128-row atoms, so a tile
must hold one group's rows only. The lowering therefore pads each group's rows to whole tiles:

  * `padded_layout`: for every row of the (M, K) activation, its row in the padded activation
    (M_pad = `grouped_padded_rows` rows, a static bound; rows no group owns go nowhere), and for
    every M tile of the padded activation its group (-1: a tile no group reached);
  * the activation's elements and plain scales are scattered into zero-filled padded arrays,
    the scales then tiled into the blocked layout; the experts (G, N, K) and their blocked
    scales go as they are, G being the kernel's L; alpha is one f32 per group;
  * the kernel writes the padded (M_pad, N) output (tiles of group -1 are skipped and left
    unwritten); `gather_rows` takes each row's result back, zeros for rows no group owns.

Shapes are static (the bound), the contents depend on the group sizes on the device; nothing
reads or writes outside the arrays whatever the sizes (they are clamped before this runs,
ragged_backends.clamp_group_sizes, and the kernel clamps the table again).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from .. import _plugin
from ..core import layout as _layout
from ..catalog.sm100 import FMT_CODES
from ..core.formats import get_format
from .registry import register_ragged_backend
from .kernel_operands import blocked_scale_bytes, element_bytes
from .plan import device_for, plan_ragged_sm100
from .specs import RaggedPlan

NO_GROUP = -1  # the table entry of an M tile no group owns (the kernel skips it)


def padded_layout(group_sizes, row_start, m: int, tile_m: int, tiles: int):
    """(dest, table): dest int32 (M,), the padded row of each activation row (`tiles * tile_m`
    for a row no group owns: dropped by a scatter, clipped away by a gather); table int32
    (tiles,), the group of each padded M tile or NO_GROUP. Group g's rows keep their order and
    start at a tile boundary; its tiles follow group g - 1's. group_sizes must be safe (>= 0,
    row_start + sum <= M)."""
    gs = group_sizes.astype(jnp.int32)
    ends = row_start + jnp.cumsum(gs)
    starts = ends - gs
    group_tiles = (gs + tile_m - 1) // tile_m
    tile_ends = jnp.cumsum(group_tiles)
    tile_starts = tile_ends - group_tiles
    rows = jnp.arange(m, dtype=jnp.int32)
    group = jnp.minimum(jnp.sum(ends[None, :] <= rows[:, None], axis=1, dtype=jnp.int32),
                        gs.shape[0] - 1)
    owned = (rows >= row_start) & (rows < ends[-1])
    dest = jnp.where(owned, tile_starts[group] * tile_m + rows - starts[group], tiles * tile_m)
    t = jnp.arange(tiles, dtype=jnp.int32)
    tile_group = jnp.sum(tile_ends[None, :] <= t[:, None], axis=1, dtype=jnp.int32)
    table = jnp.where(t < tile_ends[-1], tile_group, NO_GROUP)
    return dest.astype(jnp.int32), table.astype(jnp.int32)


def scatter_rows(x, dest, rows: int):
    """x (M, ...) -> (rows, ...) zeros with x[i] at row dest[i] (rows past the end dropped)."""
    return jnp.zeros((rows,) + x.shape[1:], x.dtype).at[dest].set(x, mode="drop")


def gather_rows(y, dest):
    """The padded result y (M_pad, N) -> (M, N): row i is y[dest[i]], zero where dest[i] names
    no row (a row no group owns)."""
    owned = dest < y.shape[0]
    return jnp.where(owned[:, None], y[jnp.minimum(dest, y.shape[0] - 1)], 0).astype(y.dtype)


def plain_scales(s, layout: str, rows: int, sk: int):
    """The activation's scales (rows, K/block) in the plain layout."""
    return s if layout == "plain" else _layout.from_blocked_scales(s, rows, sk)


class Sm100RaggedBackend:
    name = "sm100"
    platforms = ("cuda",)
    priority = 20  # above sm90 (10): each declines the other's devices

    def plan(self, spec, platform: str):
        return plan_ragged_sm100(spec, device_for(platform))

    def __call__(self, lhs, rhs, sl, sr, group_sizes, alpha, row_start, *, plan: RaggedPlan):
        if not _plugin.register_targets() or not _plugin.has_ragged_sm100():
            raise RuntimeError(f"jax_blockscale sm100 ragged_gemm: "
                               f"{_plugin.sm100_unavailable_reason()}")
        spec = plan.spec
        m, n, k, groups = spec.m, spec.n, spec.k, spec.groups
        tile_m, tile_n = plan.tile
        rows = plan.items * tile_m
        dest, table = padded_layout(group_sizes, row_start, m, tile_m, plan.items)
        a8 = scatter_rows(element_bytes(lhs), dest, rows)
        sk = k // get_format(spec.fmt_lhs).block
        sa = scatter_rows(plain_scales(sl, spec.layout_lhs, m, sk), dest, rows)
        sa8 = blocked_scale_bytes(sa, "plain")
        b8 = element_bytes(rhs)
        sb8 = blocked_scale_bytes(sr, spec.layout_rhs)
        if spec.alpha_is_one:
            alpha = np.ones((groups,), np.float32)  # a constant, not a kernel per call
        call = jax.ffi.ffi_call(_plugin.RAGGED_SM100_TARGET,
                                jax.ShapeDtypeStruct((rows, n), spec.out_dtype))
        y = call(a8, b8, sa8, sb8, jnp.asarray(alpha, jnp.float32), table,
                 fmt_a=np.int32(FMT_CODES[spec.fmt_lhs]), fmt_b=np.int32(FMT_CODES[spec.fmt_rhs]),
                 m=np.int64(rows), n=np.int64(n), k=np.int64(k), g=np.int64(groups),
                 tile_m=np.int32(tile_m), tile_n=np.int32(tile_n))
        return gather_rows(y, dest)


register_ragged_backend(Sm100RaggedBackend())
