"""A grouped kernel's work item, made on the device from the raw group sizes.

The device twin of the lowering's work table (`lowering/ragged_sm90.py: work_items`) for calls
whose groups start at row 0: where a CTA would read its (expert, first row, end row) entry from
a table that small XLA kernels built before the call, it reads the G group sizes and derives
its own entry. At decode sizes those small kernels are a visible part of a grouped call; this
makes the call one kernel.

The sizes are made safe exactly as `ragged_backends.clamp_group_sizes` does (a negative size
counts as 0; a group running past row M is cut at M, later ones get no rows), with additions
that saturate at M so that no input can overflow. Items are cut as `work_items` cuts them:
expert g's rows in ceil(size_g / rows_per_item) items of at most rows_per_item rows, in
expert order; of the `num_items` entries (a bound the planner made), the last one is the zero
item (rows past the last group, expert ZERO_ITEM) and the one before it the empty lead (rows
before row 0); the rest past the real items have expert NO_ITEM.

One warp computes the entry and the lane that finds it stores it for the CTA. The entry is on
every CTA's critical path (the weights' copies wait for its expert, the activation loads for its
rows), so the chain is kept short. The experts go in chunks of 128, four consecutive ones per
lane, held in registers. Up to 128 experts and with no group cut at M (the common case), one
warp scan of the lanes' item counts places the item while a second one, beside it, places the
rows. Otherwise a first pass over the chunks counts the rows and the experts with rows (an upper
bound on the real items, so that the entries past it stop there) and a second one scans rows,
then items, chunk by chunk.
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute

from jax_blockscale.kernels.sm90_ptx import ldg_bytes, ldg_keep_v4

ZERO_ITEM = -1  # rows no group owns: the kernel writes zeros
NO_ITEM = -2  # an entry past the real items: the kernel writes nothing
PER_LANE = 4  # experts per lane in a chunk
CHUNK = 32 * PER_LANE


@cute.jit
def _scan(v, lane, cap):
    """Inclusive scan of v over the warp's lanes, additions saturating at cap (v >= 0)."""
    for d in cutlass.range_constexpr(5):
        up = cute.arch.shuffle_sync_up(v, 1 << d)
        v = cutlass.min(v + up * cutlass.Int32(lane >= (1 << d)), cap)
    return v


@cute.jit
def _exclusive(incl, lane):
    """The exclusive scan from an inclusive one: lane l gets lane l - 1's value (lane 0: 0)."""
    return cute.arch.shuffle_sync_up(incl, 1) * cutlass.Int32(lane > 0)


@cute.jit
def _lane_sizes(sizes_addr, chunk, groups, m, lane):
    """The lane's PER_LANE sizes of `chunk`, each clipped to [0, M] (0 past G): one 16-byte
    load where they are aligned and all below G, else one load each."""
    e0 = chunk * CHUNK + lane * PER_LANE
    addr = sizes_addr + cutlass.Int64(e0) * 4
    whole = cutlass.Int32((sizes_addr % 16 == 0) & (e0 + PER_LANE <= groups))
    vec = ldg_keep_v4(addr, whole)
    sizes = []
    for i in cutlass.range_constexpr(PER_LANE):
        one = ldg_bytes(addr + 4 * i, (1 - whole) * cutlass.Int32(e0 + i < groups), 4)
        s = cutlass.Int32(vec[i]) + cutlass.Int32(one)  # one of the two is zero
        sizes.append(cutlass.min(cutlass.max(s, 0), m))
    return sizes


@cute.jit
def _owner(item, i0, counts, bounds, base, h):
    """(found, expert, first, end) of `item` among the lane's experts base, base + 1, ...: their
    items start at item i0 (counts[i] each), their rows at bounds[i] (bounds[i + 1] one past)."""
    found = cutlass.Int32(0)
    owner = cutlass.Int32(0)
    first = cutlass.Int32(0)
    end = cutlass.Int32(0)
    for i in cutlass.range_constexpr(PER_LANE):
        if (item >= i0) & (item < i0 + counts[i]):
            found = cutlass.Int32(1)
            owner = base + i
            first = bounds[i] + (item - i0) * h
            end = cutlass.min(first + h, bounds[i + 1])
        i0 = i0 + counts[i]
    return found, owner, first, end


@cute.jit
def _lane_items(sizes, t, m, h):
    """The lane's experts' row bounds from row t (each cut at M) and their item counts."""
    bounds = [t]
    counts = []
    for s in sizes:
        t = cutlass.min(t + s, m)
        counts.append((t - bounds[-1] + h - 1) // h)
        bounds.append(t)
    return bounds, counts


@cute.jit
def item_from_sizes(sizes_addr, groups, m, rows_per_item: int, item, num_items, lane):
    """(expert, first row, end row, writes) of work item `item` from the int32 group sizes at
    sizes_addr (G of them, raw: any int32). Called by every lane of a warp (lane = its lane);
    the entry is right in the one lane with `writes` set (the lane that found the item, else
    lane 0), which stores it for the CTA."""
    h = rows_per_item
    found = cutlass.Int32(0)
    owner = cutlass.Int32(0)
    first = cutlass.Int32(0)
    end = cutlass.Int32(0)
    last_row = cutlass.Int32(0)
    done = cutlass.Int32(0)
    if groups <= CHUNK:
        # The common case, on a short chain: one chunk and no group cut at M. The item counts
        # then need no row prefix, so the rows' and the items' scans run side by side.
        sizes = _lane_sizes(sizes_addr, 0, groups, m, lane)
        rows = cutlass.Int32(0)
        items = cutlass.Int32(0)
        for s in sizes:
            rows = rows + s  # at most 4 M: no overflow (M * K < 2^31)
            items = items + (s + h - 1) // h
        rows_incl = _scan(cutlass.min(rows, m + 1), lane, m + 1)
        items_incl = _scan(items, lane, cutlass.Int32(0x7FFFFFFF))
        last_row = cute.arch.shuffle_sync(rows_incl, 31)
        bounds, counts = _lane_items(sizes, _exclusive(rows_incl, lane), m, h)
        found, owner, first, end = _owner(item, _exclusive(items_incl, lane), counts, bounds,
                                          lane * PER_LANE, h)
        done = cutlass.Int32(last_row <= m)
    if done == 0:
        found, owner, first, end, last_row = _any_sizes(sizes_addr, groups, m, h, item, lane)
    nobody = cutlass.Int32(cute.arch.vote_ballot_sync(found == 1) == 0)
    expert = found * owner + (1 - found) * NO_ITEM
    writes = found | (nobody * cutlass.Int32(lane == 0))
    # the zero item: rows [last_row, M); the lead (rows before row 0): nothing
    if item == num_items - 1:
        expert = cutlass.Int32(ZERO_ITEM)
        first = last_row
        end = m
        writes = cutlass.Int32(lane == 0)
    if item == num_items - 2:
        expert = cutlass.Int32(NO_ITEM)
        first = cutlass.Int32(0)
        end = cutlass.Int32(0)
        writes = cutlass.Int32(lane == 0)
    return expert, first, end, writes


@cute.jit
def _any_sizes(sizes_addr, groups, m, h, item, lane):
    """item_from_sizes for any G and sizes (groups cut at M): the lane's (found, expert, first,
    end) and last_row."""
    chunks = (groups + CHUNK - 1) // CHUNK
    # pass 1: rows (cut at M) and experts with rows: the real items are at most
    # (rows + experts * (h - 1)) // h, since each expert's last item may be short
    lane_rows = cutlass.Int32(0)
    lane_nonzero = cutlass.Int32(0)
    for c in range(chunks):
        for s in _lane_sizes(sizes_addr, c, groups, m, lane):
            lane_rows = cutlass.min(lane_rows + s, m)
            lane_nonzero = lane_nonzero + cutlass.Int32(s > 0)
    # each lane's rows are at most M, so the sum fits (the kernel's M * K is below 2^31)
    last_row = cutlass.min(cute.arch.warp_redux_sync(lane_rows, "add"), m)
    nonzero = cute.arch.warp_redux_sync(lane_nonzero, "add")
    found = cutlass.Int32(0)
    owner = cutlass.Int32(0)
    first = cutlass.Int32(0)
    end = cutlass.Int32(0)
    if item < (last_row + nonzero * (h - 1)) // h:
        # pass 2: the lane that owns `item` (one in the warp) makes its entry
        row_carry = cutlass.Int32(0)
        item_carry = cutlass.Int32(0)
        for c in range(chunks):
            sizes = _lane_sizes(sizes_addr, c, groups, m, lane)
            rows = cutlass.Int32(0)
            for s in sizes:
                rows = cutlass.min(rows + s, m)
            rows_incl = _scan(rows, lane, m)
            bounds, counts = _lane_items(
                sizes, cutlass.min(row_carry + _exclusive(rows_incl, lane), m), m, h)
            items = cutlass.Int32(0)
            for cnt in counts:
                items = items + cnt
            items_incl = _scan(items, lane, cutlass.Int32(0x7FFFFFFF))
            f, o, a, b = _owner(item, item_carry + _exclusive(items_incl, lane), counts, bounds,
                                c * CHUNK + lane * PER_LANE, h)
            if f == 1:
                found, owner, first, end = f, o, a, b
            row_carry = cutlass.min(row_carry + cute.arch.shuffle_sync(rows_incl, 31), m)
            item_carry = item_carry + cute.arch.shuffle_sync(items_incl, 31)
    return found, owner, first, end, last_row
