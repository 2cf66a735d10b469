"""The `sm90` backend of `ragged_gemm`: carries out a RaggedPlan of the grouped decode kernel or,
at prefill sizes, of the grouped register-weight kernel (lowering/plan.py: plan_ragged_sm90
decides; this module prepares what the kernel reads and emits the call to the FFI target
`jax_blockscale_ragged_gemm_sm90`).

  * elements -> uint8 bytes (fp4 two per byte, low nibble first; fp8 bitcast); a bf16
    activation passes through; the experts' weights (G, N, K) keep G as the kernel's L;
  * scales -> raw bytes: the experts' in the blocked layout (plain ones are tiled here), the
    activation's as they are (plain: the kernel reads them directly; blocked: one (M, K) tile set);
  * the grouped register-weight kernel ("ragged_prefill") reads a bf16 activation, for fp4
    weights in the K order of catalog/sm90.py: activation_k_order (a quantized one dequantized
    first: exact, its global scale is in alpha); no split-K workspace;
  * the work table (`work_items`): int32 (items, 3) rows of (expert, first row, end row), at most
    8 nt rows (prefill: tile_m rows) each, an expert's items adjacent, built on the device from the group sizes, so
    only the experts that own rows cost weight traffic; entries with expert -1, of as many rows
    each, cover the rows no expert owns (before `row_start`, after the last group), which the
    kernel writes as zeros.
    The decode kernel's sizes mode (`plan.raw_sizes`: groups from row 0) needs no table: it
    reads the raw group sizes and makes the same entries itself (kernels/grouped_work.py);
  * index mode (`spec.group_index`, `jbs.gemm(..., layer=i)`): the call goes to the layer
    target `jax_blockscale_layer_gemm_sm90` with the whole stacks, the index and a probe (the
    first bytes of layer i's scales, sliced by XLA). Where XLA hands the probe in place (the index a
    loop counter) its address names the layer and the handler runs gemm's own plan for it
    (`plan.layer`); where XLA copied it, the grouped kernel runs with the index as its table
    (one int32; the kernel makes the items and clamps the index). Nothing runs before the kernel
    either way;
  * alpha: one f32 per expert (the product of the global scales), applied in the epilogue;
  * the split-K workspace (splits * M * N f32) is a second result of the call, as for `gemm`;
    the decode kernel leaves its split partials there (each expert's alpha applied) and they are
    added here in XLA (`add_split_partials`), fused into what follows (the routing weights'
    combine). The layer target does the same where its two plans split K alike
    (`layer_leaves_partials`; true-scale partials, times the layer's alpha).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .. import _plugin
from ..catalog import sm90 as cat
from .ragged_reference import prefix_sum
from .registry import register_ragged_backend
from . import ffi_sm90
from .ffi_sm90 import activation_operands, add_split_partials, permute_activation_k
from .kernel_operands import blocked_scale_bytes, element_bytes, take_layer
from .plan import device_for, plan_ragged_sm90
from .reference import operand_values
from .specs import RaggedPlan

ZERO_ITEM = -1  # the expert of an item whose rows the kernel writes as zeros


def work_items(group_sizes, row_start, m: int, rows_per_item: int, num_items: int):
    """int32 (num_items, 3): (expert, first row, end row) of each work item.

    group_sizes must be safe (>= 0, row_start + sum <= M: `clamp_group_sizes`). Expert g's rows
    [start_g, end_g) are cut into ceil(size_g / rows_per_item) items, in expert order; then the
    rows no expert owns, [0, row_start) and [row_start + sum, M), as zero items (expert -1, the
    kernel writes zeros) of at most rows_per_item rows each, so that many CTAs share them (an
    expert-parallel shard's receive buffer is mostly such rows, and one CTA writing them all
    was its call's tail); entries past those have no rows (expert -2: the kernel writes
    nothing). Everything fits: the groups' items number at most sum / R + (groups with rows)
    (R = rows_per_item) and the zero items (M - sum) / R + 2, which `ragged_items` bounds.
    Built from comparisons and sums only (no sort, search loop or concatenation), so XLA makes
    few small fusions of it: at decode sizes each is a visible part of the call.
    """
    gs = group_sizes.astype(jnp.int32)
    groups = gs.shape[0]
    rows = rows_per_item
    row_start = jnp.asarray(row_start, jnp.int32)
    ends = row_start + prefix_sum(gs)
    per_group = (gs + rows - 1) // rows
    last_item = prefix_sum(per_group)  # one past each expert's last item
    i = jnp.arange(num_items, dtype=jnp.int32)
    # the expert of item i: how many experts end at or before it
    g = jnp.minimum(jnp.sum(last_item[None, :] <= i[:, None], axis=1, dtype=jnp.int32),
                    groups - 1)
    first = ends[g] - gs[g] + (i - (last_item[g] - per_group[g])) * rows
    valid = i < last_item[-1]
    # the zero items after the groups' items: the lead's chunks, then the tail's
    j = i - last_item[-1]
    lead_items = (row_start + rows - 1) // rows
    tail_items = (m - ends[-1] + rows - 1) // rows
    lead = (j >= 0) & (j < lead_items)
    tail = (j >= lead_items) & (j < lead_items + tail_items)
    z0 = jnp.where(lead, j * rows, ends[-1] + (j - lead_items) * rows)
    z1 = jnp.minimum(z0 + rows, jnp.where(lead, row_start, m))
    expert = jnp.where(valid, g, jnp.where(lead | tail, ZERO_ITEM, -2))
    r0 = jnp.where(valid, first, jnp.where(lead | tail, z0, 0))
    r1 = jnp.where(valid, jnp.minimum(first + rows, ends[g]), jnp.where(lead | tail, z1, 0))
    return jnp.stack([expert, r0, r1], axis=1).astype(jnp.int32)


class Sm90RaggedBackend:
    name = "sm90"
    platforms = ("cuda",)
    priority = 10

    def plan(self, spec, platform: str):
        return plan_ragged_sm90(spec, device_for(platform))

    def __call__(self, lhs, rhs, sl, sr, group_sizes, alpha, row_start, *, plan: RaggedPlan):
        if not _plugin.register_targets():
            raise RuntimeError(f"jax_blockscale sm90 ragged_gemm: {_plugin.unavailable_reason()}")
        spec = plan.spec
        m, n, k, groups = spec.m, spec.n, spec.k, spec.groups
        b8 = element_bytes(rhs)
        sb8 = blocked_scale_bytes(sr, spec.layout_rhs)
        a8, sa8, a_e5m2 = _activation(lhs, sl, sb8, plan)
        if spec.alpha_is_one:
            # a constant in the program: the ones of an operand are a broadcast that XLA may
            # run as a kernel on every call (every step of a scan), and so is a constant (G,)
            # of ones (XLA turns a splat constant into a broadcast). The grouped decode kernel
            # takes one alpha for every expert: a scalar constant, which stays a constant.
            one = plan.kernel == "ragged_decode" and not spec.group_index
            alpha = np.ones(() if one else (groups,), np.float32)
        alpha = jnp.asarray(alpha, jnp.float32)
        if spec.group_index:
            return _layer_call(lhs, sl, sr, b8, sb8, a8, group_sizes, alpha, plan)
        # the raw sizes (the kernel makes its items: sizes mode) or XLA's work table
        items = group_sizes if plan.raw_sizes else work_items(group_sizes, row_start, m,
                                                              plan.tile[0], plan.items)
        call = jax.ffi.ffi_call(
            _plugin.RAGGED_SM90_TARGET,
            (jax.ShapeDtypeStruct((m, n), spec.out_dtype),
             jax.ShapeDtypeStruct((plan.splits * m * n,), jnp.float32)))
        partials = ffi_sm90.leaves_partials(plan)
        y, ws = call(a8, b8, sa8, sb8, alpha, items,
                    a_kind=np.int32(cat.KIND_CODES[plan.a_kind]),
                    b_kind=np.int32(cat.KIND_CODES[plan.b_kind]),
                    a_e5m2=np.int32(a_e5m2),
                    b_e5m2=np.int32(spec.fmt_rhs == "mxfp8_e5m2"),
                    m=np.int64(m), n=np.int64(n), k=np.int64(k), g=np.int64(groups),
                    a_scales_plain=np.int32(plan.a_scales_plain), nt=np.int32(plan.nt),
                    tile_m=np.int32(plan.tile[0]), tile_n=np.int32(plan.tile[1]),
                    splits=np.int32(plan.splits),
                    sizes_items=np.int64(plan.items if plan.raw_sizes else 0),
                    tiles_per_cta=np.int32(plan.tiles_per_cta), partials=np.int32(partials))
        if partials:  # each split's partial already carries its expert's alpha
            y = add_split_partials(ws, plan.splits, (m, n), jnp.float32(1.0), spec.out_dtype)
        return y


def _activation(lhs, sl, sb8, plan: RaggedPlan):
    """(elements, scales, e5m2 flag) of the activation as plan's kernel reads them. The grouped
    register-weight kernel reads a bf16 activation, for FP4 weights in its K order: a quantized
    one is dequantized first (exact; its global scale is in alpha) and the permutation fuses into
    that pass. The decode kernel reads a quantized activation's bytes and scales (plain or blocked)
    as they are. A plain activation has no scales: B's (sb8, a buffer that exists already)
    stand in for them."""
    spec = plan.spec
    if plan.kernel == "ragged_prefill":
        x = operand_values(lhs, sl, spec.fmt_lhs, spec.layout_lhs, jnp.bfloat16)
        if plan.permute_k:
            x = permute_activation_k(x)
        return x, sb8, False
    if spec.fmt_lhs is None:
        return lhs, sb8, False
    return (element_bytes(lhs), lax.bitcast_convert_type(sl, jnp.uint8).reshape(-1),
            spec.fmt_lhs == "mxfp8_e5m2")


# Bytes of the probe: one row of the blocked scales' 128 x 4 tiles. XLA hands a kernel a slice
# of that size in place at a loop counter, as it does whole layers; a 16-byte slice it copies.
PROBE_BYTES = 512


def layer_probe(sr, sb8, layout: str, index):
    """The first PROBE_BYTES of layer `index`'s scales, sliced from the stack as XLA slices a
    scanned layer (in place at a loop counter): the layer's first tile row of the blocked
    scales, or the same bytes of their blocked form if the lowering converted plain ones. XLA
    clamps the index into [0, G) as index mode does; JAX's wrap of negative indices would make
    the offset more than a function of the loop counter, and XLA would copy the slice."""
    if layout == "blocked":  # (G, N / 128, SK / 4, 32, 4, 4): one tile is 32 x 4 x 4 bytes
        row = lax.dynamic_slice(sr, (index,) + (0,) * 5, (1, 1, 1) + sr.shape[3:],
                                allow_negative_indices=False)
        return lax.bitcast_convert_type(row, jnp.uint8).reshape(-1)
    return lax.dynamic_slice(sb8.reshape(sr.shape[0], -1), (index, 0), (1, PROBE_BYTES),
                             allow_negative_indices=False).reshape(-1)


def _layer_call(lhs, sl, sr, b8, sb8, a_index, index, alpha, plan: RaggedPlan):
    """`gemm(x, stack, layer=index)` through the layer target. Index mode's plan (kernel
    "ragged_decode"): the whole stacks, the layer's own plan (`plan.layer`) run where the handler
    finds the probe in place and index mode's (`plan`'s fields) where XLA copied it; both read
    the same stacks, alpha and activation. Slice mode ("layer_slice"): XLA's slices of the
    layer with the whole stack of scales as the probe, the layer's alpha read from the stack
    (gathered on the device where XLA copied the slices)."""
    spec, layer = plan.spec, plan.layer
    m, n = spec.m, spec.n
    a_layer, sa8 = activation_operands(lhs, sl, layer, layer.spec, sb8)
    index = index.astype(jnp.int32)
    workspace = max(layer.workspace, plan.splits * m * n)
    if plan.kernel == "layer_slice":
        # sliced as _sliced_gemm (ragged.py) slices, so that XLA hands them over in place
        take = lambda x: take_layer(x, index)  # noqa: E731
        if spec.layout_rhs == "blocked":
            sb_layer = lax.bitcast_convert_type(take(sr), jnp.uint8).reshape(-1)
        else:
            sb_layer = take(sb8.reshape(spec.groups, -1))
        b8, probe, sb8, a_index = take(b8), sb8, sb_layer, a_layer
        workspace = layer.workspace + 4  # + slice mode's gathered alpha, the last float
    else:
        probe = layer_probe(sr, sb8, spec.layout_rhs, index)
    partials = layer_leaves_partials(plan)
    call = jax.ffi.ffi_call(
        _plugin.LAYER_SM90_TARGET,
        (jax.ShapeDtypeStruct((m, n), spec.out_dtype),
         jax.ShapeDtypeStruct((workspace,), jnp.float32)))
    y, ws = call(a_layer, a_index, b8, sa8, sb8, alpha, index.reshape(1), probe,
                a_kind=np.int32(cat.KIND_CODES[layer.a_kind]),
                b_kind=np.int32(cat.KIND_CODES[layer.b_kind]),
                a_e5m2=np.int32(spec.fmt_lhs == "mxfp8_e5m2"),
                b_e5m2=np.int32(spec.fmt_rhs == "mxfp8_e5m2"),
                m=np.int64(m), n=np.int64(n), k=np.int64(layer.k), l=np.int64(1),
                a_scales_plain=np.int32(layer.a_scales_plain), nt=np.int32(layer.nt),
                tile_m=np.int32(layer.tile[0]), tile_n=np.int32(layer.tile[1]),
                splits=np.int32(layer.splits), g=np.int64(spec.groups),
                index_a_kind=np.int32(cat.KIND_CODES[plan.a_kind]),
                index_nt=np.int32(plan.nt), index_tile_m=np.int32(plan.tile[0]),
                index_tile_n=np.int32(plan.tile[1]), index_splits=np.int32(plan.splits),
                index_items=np.int64(plan.items), partials=np.int32(partials))
    if partials:  # the partials in true scale (either plan's): times the layer's alpha
        layer_alpha = alpha[jnp.clip(index, 0, spec.groups - 1)]
        y = add_split_partials(ws, layer.splits, (m, n), layer_alpha, spec.out_dtype)
    return y


def layer_leaves_partials(plan: RaggedPlan) -> bool:
    """Whether the layer target leaves the split partials for the lowering to add (true scale,
    [splits, M, N]): in slice mode wherever the layer's plan leaves them (one plan runs); in
    index mode where the layer's own plan and index mode both run the decode kernel with the
    same (several) splits, so that whichever the handler picks at run time leaves them alike.
    A layer plan of another kernel keeps the decode kernel's finalize."""
    layer = plan.layer
    if plan.kernel == "layer_slice":
        return ffi_sm90.leaves_partials(layer)
    return (plan.kernel == "ragged_decode" and ffi_sm90.leaves_partials(layer)
            and layer.splits == plan.splits)


register_ragged_backend(Sm90RaggedBackend())
