"""The Hopper (sm_90a) kernel catalogue: what each kernel takes, the codes shared with the C++
handler, the compiled variants, and the measured thresholds and heuristics that choose among
them. Pure Python: the runtime, the AOT build and the tests all read it; the design notes
(docs/design/sm90_fused.md, docs/design/sm90_decode.md) say where each number comes from.

Three kernels share one FFI target (`jax_blockscale_gemm_sm90`):

  * **fused**: kernels/sm90_blockscaled.py, TMA + in-register dequantize + wgmma, a persistent
    grid of 128-row tiles; any pair in FUSED_PAIRS.
  * **register_weights**: the same kernel with the weight tile converted straight into wgmma's
    register operand (`weights_in_registers`); a bf16 activation (operand kind "bf16_kperm")
    stored in the K order of `activation_k_order` for fp4 weights, in natural K order for fp8
    ones (REGISTER_WEIGHT_NATURAL_K_KINDS), weight kinds REGISTER_WEIGHT_KINDS.
  * **decode**: kernels/sm90_decode.py, split-K weight streaming for M <= DECODE_MAX_ROWS, an f32
    workspace of one L*M*N slice per split; pairs DECODE_PAIRS.

and two more have their own targets:

  * **ragged_decode** (`jax_blockscale_ragged_gemm_sm90`, `ragged_gemm`): the decode kernel over
    a mixture's experts (Sm90RaggedDecodeGemm), rows from a work table of (expert, first row,
    end row); the same pairs, tiles and tunings.
  * **ragged_prefill** (the same target, `ragged_gemm` at prefill sizes): the register-weight
    kernel over a mixture's experts (Sm90RaggedRegisterWeightGemm), one expert's rows per tile
    from a work table like the decode kernel's; RAGGED_PREFILL_VARIANTS.
  * **chained decode** (`jax_blockscale_quantized_act_gemm_sm90`, `gemm(..., quantize_a=)`):
    the decode kernel launched behind the activation quantizer, CHAINED_DECODE_VARIANTS
    (docs/design/quantized_activation.md).
"""
from __future__ import annotations

import dataclasses

# ----------------------------------------------------------------------------------------------
# Operand kinds and codes (the C++ enums in the generated jbs_codes_sm90.h come from here)

# The kernels' operand kinds: bits per element, elements per scale, scale type.
KINDS = {
    "nvfp4": dict(block=16, bits=4, scale="e4m3"),
    "mxfp4": dict(block=32, bits=4, scale="e8m0"),
    "mxfp8": dict(block=32, bits=8, scale="e8m0"),  # e4m3 or e5m2 chosen at run time
    "bf16": dict(block=None, bits=16, scale=None),  # weight-only activation, no scales
}
# "bf16_kperm": a bf16 activation as the register-weight variants read it (for fp4 weights in
# their K order, activation_k_order; for fp8 weights in natural order), which only they read.
KIND_CODES = {"nvfp4": 1, "mxfp4": 2, "mxfp8": 3, "bf16": 4, "bf16_kperm": 5}
OUT_CODES = {"bf16": 1, "f16": 2, "f32": 3}
OUTS = ("bf16", "f16", "f32")
# numpy dtype names of the outputs -> the kernels' names
OUT_OF_DTYPE = {"bfloat16": "bf16", "float16": "f16", "float32": "f32"}
# the package's format names (None: a plain activation, weight-only) -> operand kind
KIND_OF_FORMAT = {None: "bf16", "nvfp4": "nvfp4", "mxfp4": "mxfp4", "mxfp8_e4m3": "mxfp8",
                  "mxfp8_e5m2": "mxfp8"}

# Multiprocessors the planner assumes when no GPU is visible (lowering on a CPU host, e.g. for
# jax.export): an H100 SXM / H200.
DEFAULT_SM_COUNT = 132


def card_of(device_kind: str) -> str | None:
    """The GPU model a catalogue rule may depend on, from a JAX device's `device_kind` ("NVIDIA
    H200", "NVIDIA H100 80GB HBM3"): "h200", "h100", or None for any other."""
    kind = device_kind.upper().split()
    return next((c.lower() for c in ("H200", "H100") if c in kind), None)


# ----------------------------------------------------------------------------------------------
# The fused GEMM and its register-weight variants

# (a_kind, b_kind) pairs the fused kernel implements
FUSED_PAIRS = (("nvfp4", "nvfp4"), ("mxfp4", "mxfp4"), ("mxfp8", "mxfp8"), ("mxfp8", "mxfp4"),
               ("bf16", "nvfp4"), ("bf16", "mxfp4"), ("bf16", "mxfp8"))
# (tile_m, tile_n): 128x64 keeps small-M problems spread over all SMs; 128x256 halves B re-reads
# at large M
FUSED_TILES = ((128, 64), (128, 128), (128, 256))

REGISTER_WEIGHT_KINDS = ("nvfp4", "mxfp4", "mxfp8")
# Weight kinds whose register-weight variants read the activation in natural K order, so no
# pass permutes it. A lane's K slots (2t, 2t + 1) of an MMA are two adjacent weight bytes: for
# fp8 one prmt with the lane's selector picks them, at the permuted order's cost. For fp4 they
# are the two nibbles of byte t of every word, and gathering those costs the FP4 kernels more
# conversion time than the pass saves (measured: docs/design/sm90_fused.md, "What was tried"):
# FP4 weights keep the permuted order below.
REGISTER_WEIGHT_NATURAL_K_KINDS = ("mxfp8",)
# (activation rows, weight rows) per tile
REGISTER_WEIGHT_TILES = ((16, 64), (16, 128), (32, 64), (32, 128), (64, 64), (64, 128),
                         (128, 64), (128, 128))

# The K order of the activations the FP4 register-weight variants read. In those variants a thread
# converts the 16 contiguous weight elements 16t .. 16t + 15 (t = lane % 4) of each 64-element
# k-tile straight into the A registers of four k16 wgmmas. The fp4 bit trick yields pairs of
# elements (j, j + 4) of each 8-element chunk s, and an A register pair must hold K slots
# (2t, 2t + 1) or (2t + 8, 2t + 9) of its MMA, so MMA b = 2s + h takes pairs 2h (slots 2t, 2t+1)
# and 2h + 1 (slots 2t + 8, 2t + 9). Written as digits, element k = 16t + 8s + 4q + 2h + hi of a
# k-tile lands in slot 16 (2s + h) + 8 hi + 2t + q. The activations (wgmma's shared-memory
# operand, read in slot order) are stored in that order: slot p holds activation_k_order()[p].
K_TILE = 64
# element k of a k-tile = digits (t, s, q, h, hi), most significant first
K_DIGITS = (4, 2, 2, 2, 2)
SLOT_ORDER = (1, 3, 4, 0, 2)  # slot = digits (s, h, hi, t, q): a transpose of K_DIGITS' axes


# How the lowering writes that order (lowering/ffi_sm90.py: permute_activation_k): activations
# of at least this many elements as a gather along K with a constant index, which XLA fuses into
# an elementwise producer's loop (the MoE layer's SwiGLU before the grouped down projection),
# where a transpose fusion runs at about half the copy bandwidth; smaller ones (a decoder step's
# 64 rows) as a transpose of K's digits, whose fusions were the faster there. The threshold lies
# between those measured sizes (docs/design/sm90_ragged_prefill.md, "Limits").
K_PERMUTE_GATHER_MIN_ELEMENTS = 1 << 21


def register_weights_permute_k(b_kind: str) -> bool:
    """Whether the register-weight variants of weight kind `b_kind` read the activation in
    activation_k_order (else in natural K order: REGISTER_WEIGHT_NATURAL_K_KINDS)."""
    return b_kind not in REGISTER_WEIGHT_NATURAL_K_KINDS


def activation_k_order() -> list[int]:
    """Slot p of a 64-element k-tile holds activation element order[p]."""
    import numpy as np

    return np.arange(K_TILE).reshape(K_DIGITS).transpose(SLOT_ORDER).reshape(K_TILE).tolist()


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def fused_tile_n(m: int, n: int, l: int, sm_count: int) -> int:
    """Tile N of the fused kernel: 128x64 while 128x128 tiles would leave SMs idle; 128x256 once
    it still gives every SM a tile (A is re-read and dequantized half as often); 128 between."""
    if _ceil_div(m, 128) * _ceil_div(n, 128) * l < sm_count:
        return 64
    if _ceil_div(m, 128) * _ceil_div(n, 256) * l >= sm_count:
        return 256
    return 128


def register_weight_tile(m: int, n: int, k: int, l: int, sm_count: int) -> tuple[int, int]:
    """(activation rows, weight rows) of the register-weight variants: the smallest of 16, 32, 64
    activation rows that covers M, else 128; 128 weight rows (two consumer warp groups) while that
    gives at least half the SMs a tile, or where K splits with them (register_weight_splits:
    their tiles split to fill the SMs, and two warp groups per SM convert and multiply faster
    than one; docs/design/sm90_fused.md); else 64 (one warp group per SM, twice the SMs)."""
    tile_m = 16 if m <= 16 else 32 if m <= 32 else 64 if m <= 64 else 128
    if (2 * _ceil_div(m, tile_m) * _ceil_div(n, 128) * l >= sm_count
            or register_weight_splits(m, n, k, l, (tile_m, 128), sm_count) > 1):
        return tile_m, 128
    return tile_m, 64


# Split-K of the dense register-weight variants: where a call's tiles are fewer than the SMs
# (N / 128 small beside the SM count, as a decoder's QKV, O and down projections at 33-64 rows),
# each tile's k-tiles are split into K ranges that run on their own SMs; the splits' partial sums
# go to an f32 workspace that the lowering adds (lowering/ffi_sm90.py: add_split_partials). A
# persistent CTA's time is about waves x (k-tiles per unit + REGISTER_WEIGHT_UNIT_K_TILES): each
# (tile, split) unit it runs costs a pipeline fill and an epilogue besides its k-tiles, about
# as long as 5 k-tiles (fitted to the measurements in docs/design/sm90_fused.md).
REGISTER_WEIGHT_UNIT_K_TILES = 5
REGISTER_WEIGHT_MIN_SPLIT_K_TILES = 4  # 64-element k-tiles per split, at least
# ... and with 128 activation rows, whose partials are twice as many per weight byte: shorter
# splits lost there, longer ones gained (docs/design/sm90_fused.md)
REGISTER_WEIGHT_MIN_SPLIT_K_TILES_M128 = 48
REGISTER_WEIGHT_MAX_SPLITS = 16
REGISTER_WEIGHT_SPLIT_GAIN = 1.1  # split only where the model saves 10 %
REGISTER_WEIGHT_SPLIT_SLACK = 1.05  # then the fewest splits within 5 % of the best


def register_weight_splits(m: int, n: int, k: int, l: int, tile: tuple[int, int],
                           sm_count: int) -> int:
    """K ranges per tile of a dense register-weight call (1: no split): only when its tiles are
    fewer than the SMs, each split at least the shortest K range for its tile's rows, and only
    where the cost model above gains REGISTER_WEIGHT_SPLIT_GAIN; then the fewest splits within
    REGISTER_WEIGHT_SPLIT_SLACK of the model's best."""
    tiles = _ceil_div(m, tile[0]) * _ceil_div(n, tile[1]) * l
    k_tiles = _ceil_div(k, K_TILE)
    shortest = (REGISTER_WEIGHT_MIN_SPLIT_K_TILES if tile[0] <= 64
                else REGISTER_WEIGHT_MIN_SPLIT_K_TILES_M128)
    most = min(REGISTER_WEIGHT_MAX_SPLITS, k_tiles // shortest)
    if tiles >= sm_count or most < 2:
        return 1
    cost = {s: _ceil_div(tiles * s, sm_count)
            * (_ceil_div(k_tiles, s) + REGISTER_WEIGHT_UNIT_K_TILES) for s in range(1, most + 1)}
    best = min(cost.values())
    if best * REGISTER_WEIGHT_SPLIT_GAIN > cost[1]:
        return 1
    return min(s for s, c in cost.items() if c <= best * REGISTER_WEIGHT_SPLIT_SLACK)


# From this many rows the register-weight variants beat the decode kernel's wide variants, when
# the weights' 64-row tiles give ~every SM one (WEIGHT_TILE_SM_FRACTION); with fewer tiles the
# decode kernel's split-K keeps more SMs busy, and they take over from the larger count. MXFP8
# weights (twice an FP4 tile's bytes, converted at the same cost) never do with few tiles: the
# split-K decode kernel stays ahead up to its 64 rows (docs/design/sm90_decode.md; measured on
# the H100 before the MXFP8 variants read the activation in natural K order). On the H200 those
# variants now beat the decode kernel at 40-64 rows of few-tile weights as well (every weight
# kind takes FP4's rule there: DECODE_KEEPS_FEW_TILES_BY_CARD; docs/design/sm90_decode.md).
REGISTER_WEIGHT_MIN_ROWS = 17
REGISTER_WEIGHT_MIN_ROWS_FEW_TILES = 33
WEIGHT_TILE_SM_FRACTION = 0.9
DECODE_KEEPS_FEW_TILES = frozenset({"mxfp8"})  # weight kinds the decode kernel keeps to 64 rows
DECODE_KEEPS_FEW_TILES_BY_CARD = {"h200": frozenset()}  # per GPU model (Device.card)


def register_weight_min_rows(n: int, l: int, sm_count: int, b_kind: str | None,
                             card: str | None = None) -> int:
    """Rows from which a call in the decode kernel's rows runs a register-weight variant
    instead (past DECODE_MAX_ROWS: never the decode kernel); b_kind: the weight's kind, card:
    the GPU model (Device.card)."""
    weight_tiles = _ceil_div(n, 64) * l
    if weight_tiles >= WEIGHT_TILE_SM_FRACTION * sm_count:
        return REGISTER_WEIGHT_MIN_ROWS
    if b_kind in DECODE_KEEPS_FEW_TILES_BY_CARD.get(card, DECODE_KEEPS_FEW_TILES):
        return DECODE_MAX_ROWS + 1
    return REGISTER_WEIGHT_MIN_ROWS_FEW_TILES


# Rows up to which the register-weight variants beat dequantize + a library GEMM (measured
# crossovers), by the weights' size class c (N K at least 2^c, the largest class that holds;
# smaller weights keep the shared-memory variants' limits below), as (weight-only, quantized
# activation) rows. 2^26 and 2^28 were measured on the H100 with NVFP4 weights, 2^24 (Llama-3-8B's
# QKV, O and down projections) on the H200 with every weight kind, where from 384 to 1024 rows the
# kernels beat dequantize + cuBLASLt or tie with it (docs/design/sm90_fused.md, "Row limits";
# dequantizing costs an H100 more, the kernels the same).
REGISTER_WEIGHT_MAX_ROWS = {28: (2048, 2048), 26: (1024, 2048), 24: (1024, 1024)}
# Per GPU model and weight kind, the size classes whose crossovers that card measured apart
# (Device.card; the other classes keep the limits above): on the H200 dequantize + GEMM (memory
# passes and cuBLAS) gains on the kernels, which are bound by their issue rate on both cards,
# and MXFP8 weights (the slowest to convert) lose from 1280 rows at 2^28 and from 1536 at 2^26
# (docs/design/sm90_fused.md says by how much)
REGISTER_WEIGHT_MAX_ROWS_BY_CARD = {"h200": {
    "nvfp4": {28: (1536, 2048), 26: (1536, 2048)},
    "mxfp4": {28: (1536, 2048), 26: (1536, 1536)},
    "mxfp8": {28: (1024, 1024), 26: (1024, 1024)},
}}


def fused_max_rows(n: int, k: int, *, weight_only: bool, register_weights: bool,
                   two_operand: bool, b_kind: str | None = None, card: str | None = None) -> int:
    """Rows up to which the fused kernel beats dequantize + a bf16 GEMM (measured crossovers).

    weight_only: the activation is plain (else quantized, dequantized first unless two_operand);
    register_weights: the call runs a register-weight variant; two_operand: a quantized
    activation stays quantized (the two-operand fused kernel); b_kind: the weights' kind and
    card: the GPU model (Device.card), for the register-weight limits measured per card."""
    classes = [c for c in REGISTER_WEIGHT_MAX_ROWS if n * k >= 2**c]
    if register_weights and classes:
        limits = {**REGISTER_WEIGHT_MAX_ROWS,
                  **REGISTER_WEIGHT_MAX_ROWS_BY_CARD.get(card, {}).get(b_kind, {})}
        return limits[max(classes)][0 if weight_only else 1]
    if n * k >= 2**28:  # large weights amortize better
        return 512
    if weight_only:
        return 512 if n * k >= 2**26 else 256
    return 128 if two_operand else 256


# ----------------------------------------------------------------------------------------------
# The decode kernel

DECODE_B_KINDS = ("nvfp4", "mxfp4", "mxfp8")
# (a_kind, b_kind): weight-only first (the common decode case), then quantized activations
DECODE_PAIRS = tuple([("bf16", b) for b in DECODE_B_KINDS] + [(b, b) for b in DECODE_B_KINDS])
DECODE_WARPS = 8  # warps per CTA
DECODE_THREADS = 32 * DECODE_WARPS
DECODE_STEP_BYTES = 64  # bytes of one weight row per step
# Past this the fused tensor-core GEMM wins (two 64-row chunks lose to it).
DECODE_MAX_ROWS = 64
DECODE_NTS = (1, 2, 4, 8)  # n8 tiles of M per CTA: M <= 8, 16, 32, 64 rows per pass
# In the decode kernel's rows only an mxfp8 activation past this many rows (the wide variants)
# gains from being dequantized to bf16 first; fp4 activations convert cheaply in the kernel.
DECODE_DEQUANT_MXFP8_FROM = 17


@dataclasses.dataclass(frozen=True)
class Tuning:
    """How the decode kernel's weights reach the registers.

    pipeline "tma": warp 0 brings each sub-chunk in with TMA into a shared-memory ring `stages`
        sub-chunks deep (what the library ships); "regs": 16-byte loads straight into registers,
        one sub-chunk ahead; "cpasync": per-thread cp.async copies into a shared-memory ring.
    sub_steps: 64-byte row steps per sub-chunk (one activation staging + one barrier each).
    min_blocks: CTAs per SM the register allocation must allow (__launch_bounds__).
    ctas_per_sm: what the split heuristic sizes the grid for.
    fold_scale: NVFP4 weights fold the bit trick's 2^126 into the block scale (s * 2^119, an exact
        bf16) and 2^7 into alpha: one bf16x2 multiply per pair instead of two.
    rows_per_thread: 4 (two m16 row tiles per warp, 256 rows of N per CTA) or 2 (128 rows).
    act_window: "cpasync" only: bytes of each of the two activation windows (0: staged by all
        threads behind one barrier per sub-chunk).
    box_steps: "tma" only: 64-byte steps per TMA box.
    probe: measurement only, never shipped ("noload", "nocompute", "nosync", "tmaw", "tmas",
        "nowait", "notma"): the kernel with one part of its work taken away; wrong by design."""

    pipeline: str = "regs"
    stages: int = 2
    sub_steps: int = 2
    min_blocks: int = 1
    ctas_per_sm: int = 1
    fold_scale: bool = False
    rows_per_thread: int = 4
    act_window: int = 0
    box_steps: int = 1
    probe: str = ""

    @property
    def tag(self) -> str:
        tag = f"{self.pipeline}_s{self.stages}_k{self.sub_steps}_b{self.min_blocks}"
        if self.rows_per_thread != 4:
            tag += f"_r{self.rows_per_thread}"
        if self.act_window:
            tag += f"_w{self.act_window // 1024}k"
        if self.box_steps != 1:
            tag += f"_x{self.box_steps}"
        if self.probe:
            tag += f"_p{self.probe}"
        return tag + ("_fold" if self.fold_scale else "")

    @property
    def bn(self) -> int:
        """Rows of N per CTA."""
        return DECODE_WARPS * 8 * self.rows_per_thread


# nt = 2 (M <= 16): a TMA ring of 2 sub-chunks of 4 steps, each sub-chunk one box of 256 rows x
# 256 bytes, 1 CTA per SM, the NVFP4 scale fold.
DEFAULT_TUNING = Tuning("tma", stages=2, sub_steps=4, min_blocks=1, ctas_per_sm=1,
                        fold_scale=True, box_steps=4)
# nt = 1 (M <= 8), and nt = 2 for the weight kinds in NARROW_16_ROW_KINDS: the same ring with 128
# rows per CTA (2 rows per thread) and 2 CTAs per SM.
NARROW_TUNING = Tuning("tma", stages=2, sub_steps=4, min_blocks=2, ctas_per_sm=2,
                       fold_scale=True, rows_per_thread=2, box_steps=4)
# nt = 4 / 8 (M <= 32 / 64): one row tile per warp (128 rows of N per CTA), so that 4-8 n8 tiles
# of accumulators fit beside the pipeline; 2 CTAs per SM, 2-step sub-chunks, 64-byte boxes.
WIDE_TUNING = Tuning("tma", stages=2, sub_steps=2, min_blocks=2, ctas_per_sm=2,
                     fold_scale=True, rows_per_thread=2)


# Weight kinds whose 9-16-row variants (nt = 2) take NARROW_TUNING too: MXFP8 weights (one byte
# an element, twice the MMA work per weight byte of FP4) stream faster with twice the warps per SM
# at every shape measured, FP4 weights slower in the dense kernel (docs/design/sm90_decode.md,
# "What was tried"). The grouped kernel gives every weight kind's 16-row items NARROW_TUNING:
# an expert's GEMM is many short CTAs, whose ring fills and epilogues a second CTA per SM hides
# (docs/design/sm90_ragged_decode.md, "The CTA shape at 9-16-row items").
NARROW_16_ROW_KINDS = frozenset({"mxfp8"})


# The dense decode kernel's 1-8-row calls (nt = 1: NARROW_TUNING, 2 CTAs per SM) give every K
# range at least this many sub-chunks: a CTA of one sub-chunk spends about as long filling its
# ring and staging its first activation as computing, and half as many CTAs of two sub-chunks
# each were faster. At 9-16 rows (DEFAULT_TUNING, 1 CTA per SM) and in the grouped kernel
# ranges of one sub-chunk were as fast or faster (docs/design/sm90_decode.md, "What was tried").
DECODE_MIN_CHUNKS_NT1 = 2


# MXFP4 weights: the decode kernel folds the bit trick's 2^126 into the block scales of a CTA
# whose scales are all at most 2 (every real checkpoint's), one bf16x2 multiply per pair instead of
# two, and keeps the unfolded loop for any other CTA (Sm90DecodeGemm.mx_fold). Not at nt = 8:
# there the second loop spills registers (docs/design/sm90_decode.md).
MX_FOLD_NTS = (1, 2, 4)


def decode_mx_fold(b_kind: str, nt: int) -> bool:
    """Whether the decode variant of weight kind `b_kind` and `nt` n8 tiles carries the MXFP4
    fold's second loop."""
    return b_kind == "mxfp4" and nt in MX_FOLD_NTS


# The grouped decode kernel's items seldom fill their n8 tiles: with the rows spread over the
# experts, most experts of a call planned for 16-row items hold 8 rows or fewer, and an n8 tile of
# zero rows costs its MMAs and activation reads all the same. So a grouped variant of nt n8
# tiles also carries the main loop of each narrower item height here, on the same CTA and ring,
# and each CTA runs the narrowest one that holds its item's rows (a comparison or two per CTA,
# as the MXFP4 fold's loops; docs/design/sm90_ragged_decode.md, "Narrow loops"). 32-row items
# carry a 24-row loop too: where they are planned (14-26 rows per expert on average) the experts
# past 16 rows mostly hold 17-24, whose fourth n8 tile is empty.
GROUPED_ITEM_NTS = {2: (1, 2), 4: (2, 3, 4)}


def grouped_item_nts(nt: int) -> tuple[int, ...]:
    """The item heights (n8 tiles, ascending; the last is `nt`) whose main loops the grouped
    decode variant of `nt` n8 tiles carries."""
    return GROUPED_ITEM_NTS.get(nt, (nt,))


# The dense decode variants of 32-row passes carry the 24-row loop too, which a call of 17-24
# rows runs (its fourth n8 tile would hold no row; one comparison per CTA picks the loop).
DENSE_PASS_NTS = {4: (3, 4)}


def decode_loop_nts(nt: int, grouped: bool) -> tuple[int, ...]:
    """The row heights (n8 tiles, ascending; the last is `nt`) whose main loops the decode
    variant of `nt` n8 tiles carries: an item's (grouped) or a pass's of the call's rows."""
    return grouped_item_nts(nt) if grouped else DENSE_PASS_NTS.get(nt, (nt,))


def tuning_for(nt: int, b_kind: str, grouped: bool = False) -> Tuning:
    """The tuning the library builds a decode variant with n8-tile count `nt` and weight kind
    `b_kind` with, for the dense decode kernel or (`grouped`) the grouped one."""
    if nt == 1 or (nt == 2 and (grouped or b_kind in NARROW_16_ROW_KINDS)):
        return NARROW_TUNING
    return DEFAULT_TUNING if nt == 2 else WIDE_TUNING


def nt_for(m: int) -> int:
    """n8 tiles of M per CTA for a call with m rows (larger m runs chunks of 64 rows)."""
    return next((nt for nt in DECODE_NTS if m <= 8 * nt), DECODE_NTS[-1])


def steps_elems(b_kind: str) -> int:
    """K elements one step covers (64 bytes of a weight row)."""
    return DECODE_STEP_BYTES * 8 // KINDS[b_kind]["bits"]


def decode_chunk_elems(b_kind: str, tuning: Tuning) -> int:
    """K elements of one sub-chunk of `tuning` (the unit a split covers a whole number of)."""
    return tuning.sub_steps * steps_elems(b_kind)


def decode_splits(k: int, b_kind: str, tuning: Tuning, ctas: int, sm_count: int,
                  min_chunks: int = 1, want: int | None = None) -> int:
    """K ranges for a decode call of `ctas` CTAs per range (tiles of N x chunks or items of M)
    over K elements: about `tuning.ctas_per_sm` CTAs per SM in all (one wave, no tail), each
    range a whole number of sub-chunks, at least `min_chunks` of them, every range the same
    length but the last. `want`: that many ranges instead of the wave's (a forced count; at
    most one per sub-chunk), evened out the same way."""
    k_chunks = _ceil_div(k, decode_chunk_elems(b_kind, tuning))
    if want is None:
        want = min(k_chunks // min_chunks, tuning.ctas_per_sm * sm_count // max(1, ctas))
    splits = max(1, min(want, k_chunks))
    per = _ceil_div(k_chunks, splits)  # equalize: every split the same number of sub-chunks
    return _ceil_div(k_chunks, per)


@dataclasses.dataclass(frozen=True)
class DecodeVariant:
    """One compiled decode kernel. `nt` = n8 tiles of M per CTA (1: M <= 8, 2: M <= 16, 4: M <= 32,
    8: M <= 64; larger M runs ceil(M / (8*nt)) chunks side by side, sharing the weights in L2)."""

    a_kind: str  # "bf16" (weight-only) or the quantized kind of A
    b_kind: str  # "nvfp4" | "mxfp4" | "mxfp8"
    out: str  # "bf16" | "f16" | "f32"
    nt: int
    # chained: launched as a programmatic dependent of the kernel before it (the activation
    # quantizer of `gemm(..., quantize_a=)`): its CTAs start while that kernel runs, issue their
    # first weight copies, and wait for it (griddepcontrol.wait) before reading the activation,
    # its scales or alpha. Only for a producer that writes nothing but those.
    chained: bool = False
    # grouped: the grouped decode kernel (Sm90RaggedDecodeGemm: `ragged_gemm`'s experts, and
    # `gemm(..., layer=)`'s index mode), whose tuning may differ from the dense kernel's
    grouped: bool = False

    def __post_init__(self):
        assert not (self.chained and self.grouped), "the grouped kernel is never chained"

    @property
    def tuning(self) -> Tuning:
        """The tuning it is built with (its rows of N per CTA: tuning.bn)."""
        return tuning_for(self.nt, self.b_kind, self.grouped)

    @property
    def name(self) -> str:
        kind = ("ragged_decode" if self.grouped else "decode_chained" if self.chained
                else "decode")
        return f"jbs_sm90_{kind}_{self.a_kind}_{self.b_kind}_{self.out}_m{8 * self.nt}"


DECODE_VARIANTS = tuple(DecodeVariant(a, b, out, nt) for (a, b) in DECODE_PAIRS for out in OUTS
                        for nt in DECODE_NTS)
RAGGED_DECODE_VARIANTS = tuple(dataclasses.replace(v, grouped=True) for v in DECODE_VARIANTS)


def choose_decode_variant(m, n, k, fmt_a, fmt_b, sm_count, out="bf16", tuning=None,
                          splits=None):
    """(variant, splits) for a decode-shaped call, or None if the decode kernel does not run it.

    fmt_a is None/"bf16" for weight-only. splits: K ranges per output tile (decode_splits; a
    given `splits` is taken as the count wanted, at most one range per sub-chunk, every range
    the same length but the last). `tuning` defaults to tuning_for(nt, b) (what the library
    ships)."""
    a_kind = KIND_OF_FORMAT.get(fmt_a, fmt_a if fmt_a in KINDS else None)
    b_kind = KIND_OF_FORMAT.get(fmt_b, fmt_b if fmt_b in KINDS else None)
    if a_kind is None or b_kind not in DECODE_B_KINDS:
        return None
    if (a_kind, b_kind) not in DECODE_PAIRS or out not in OUTS:
        return None
    if m < 1 or n < 1 or k < 32 or k % 32 or k % KINDS[b_kind]["block"]:
        return None
    if m > DECODE_MAX_ROWS:
        return None
    nt = nt_for(m)
    tuning = tuning or tuning_for(nt, b_kind)
    ctas = _ceil_div(n, tuning.bn) * _ceil_div(m, 8 * nt)
    return DecodeVariant(a_kind, b_kind, out, nt), decode_splits(
        k, b_kind, tuning, ctas, sm_count, min_chunks=DECODE_MIN_CHUNKS_NT1 if nt == 1 else 1,
        want=splits)


# ----------------------------------------------------------------------------------------------
# The grouped decode kernel (kernels/sm90_decode.py: Sm90RaggedDecodeGemm): `ragged_gemm`'s
# experts, rows of each expert in work items of at most 8 nt rows (the item table is built by
# the lowering from the group sizes), every decode pair, tile and tuning as above.

# `gemm(x, stack, layer=i)` (docs/design/scanned_layers.md): where XLA hands the layer's scales
# in place (the index a loop counter), the layer runs gemm's own plan for it on one of these
# kernels; where it copied them, index mode (the grouped decode kernel reading the index on the
# device) runs instead, up to this many rows (one item height of the decode kernel). Past it, and
# for gemm's other paths, the lowering slices the layer and gemm runs the slice.
LAYER_KERNELS = ("decode", "fused", "register_weights")
INDEX_MODE_MAX_ROWS = 64

# `gemm(x, w, quantize_a=fmt)` (docs/design/quantized_activation.md): where gemm would run the
# quantized activation on the decode kernel (or, from 33 rows, the register-weight kernel), the
# quantizer kernels (ffi/quantize_activation.cu) quantize it in the same call, at any size. Its
# formats; the most elements one CTA calibrates alone (512 threads, each holding 4 blocks of 16
# in registers); past it an amax kernel writes one partial amax per QUANTIZE_A_AMAX_CTA_BLOCKS
# blocks and a one-block-per-thread kernel reduces them and quantizes. ffi/
# quantize_activation_launch.h holds the kernels' side of these numbers.
QUANTIZE_A_FORMATS = ("nvfp4",)
QUANTIZE_A_CTA_ELEMENTS = 512 * 4 * 16
QUANTIZE_A_AMAX_CTA_BLOCKS = 256 * 1


def quantize_a_amax_partials(blocks: int) -> int:
    """The partial amaxes the amax kernel writes for `blocks` blocks (one per CTA; the launch
    header's AmaxPartials)."""
    return -(-blocks // QUANTIZE_A_AMAX_CTA_BLOCKS)


# The decode kernels the quantizer hands its result to: the chained twins (DecodeVariant.chained)
# of the decode variants of each quantized pair, every output dtype and M tile.
CHAINED_DECODE_VARIANTS = tuple(DecodeVariant(a, a, out, nt, chained=True)
                                for a in QUANTIZE_A_FORMATS for out in OUTS for nt in DECODE_NTS)


def ragged_decode_items(m: int, groups: int, nt: int) -> int:
    """Entries of the grouped decode kernel's work table (items of at most 8 nt rows)."""
    return ragged_items(m, groups, 8 * nt)


# A CTA of the grouped decode kernel may run several adjacent tiles of N of its item as one
# stream (the ring runs on from one tile's weights to the next): the entry, the activation's
# first loads and the ring's fill are then paid once per CTA, not once per tile. Short tiles gain
# (Qwen3-30B-A3B's 128 x 2048 MXFP4 tile is 128 KB, its down projection's 48 KB); tiles of
# RAGGED_DECODE_SHORT_TILE_BYTES and more do not (gpt-oss-20b's 180 KB ones lose with two).
# A CTA takes short tiles until it streams RAGGED_DECODE_CTA_BYTES, as long as the CTAs of the
# experts expected to be hit still fill RAGGED_DECODE_MIN_WAVES waves (a last wave of few long
# CTAs leaves most SMs idle). The tiles per CTA compared: docs/design/sm90_ragged_decode.md.
RAGGED_DECODE_SHORT_TILE_BYTES = 160 * 1024
RAGGED_DECODE_CTA_BYTES = 320 * 1024
RAGGED_DECODE_MIN_WAVES = 1.5
RAGGED_DECODE_MAX_TILES_PER_CTA = 4  # the most measured (the kernel takes up to 16)
# A grouped call splits K only into ranges of at least this many sub-chunks: a shorter range
# does not pay for its CTAs' ring fill and epilogue and the partials' sum (on the H100 and the
# H200, 1-token calls of 2 and 4 sub-chunks ran faster unsplit, 6 faster in two ranges on the
# H100: docs/design/sm90_ragged_decode.md).
RAGGED_DECODE_MIN_SPLIT_CHUNKS = 3
# Per GPU model where it differs (Device.card): on the H200 a 1-token call of 6 sub-chunks
# (gpt-oss's down projection, K = 2880) ran faster unsplit, the same kernel time without the
# partials' sum, where the H100 gained from two ranges (docs/design/sm90_ragged_decode.md).
RAGGED_DECODE_MIN_SPLIT_CHUNKS_BY_CARD = {"h200": 4}
# Items hold twice the average rows per expert (below). Per GPU model where it differs: on the
# H200 16-row items run up to this many rows per expert on average, where twice the average
# would take 32-row items: to 12 rows those were slower there on every expert shape measured
# but one, even counting the second item the busiest experts need with 16-row items; from 14
# rows they were faster (the threshold sits between the two; numbers:
# docs/design/sm90_ragged_decode.md). MXFP8 weights keep 16-row items to 15 rows there: at 14
# rows per expert their 32-row items were the slower ones.
RAGGED_DECODE_16_ROW_MAX_AVG_BY_CARD = {"h200": 13}
RAGGED_DECODE_16_ROW_MAX_AVG_MXFP8_BY_CARD = {"h200": 15}


def ragged_decode_16_row_max_avg(card, b_kind: str) -> int:
    """Rows per expert on average up to which the grouped decode kernel runs 16-row items where
    twice the average would give 32-row ones, on `card` for weights of kind `b_kind` (0: none)."""
    if b_kind == "mxfp8":
        return RAGGED_DECODE_16_ROW_MAX_AVG_MXFP8_BY_CARD.get(card, 0)
    return RAGGED_DECODE_16_ROW_MAX_AVG_BY_CARD.get(card, 0)


# Per GPU model where it was measured (Device.card): at 8-row items (nt = 1), where the
# tiles-per-CTA rule (RAGGED_DECODE_CTA_BYTES, RAGGED_DECODE_MIN_WAVES) leaves the CTAs of the
# experts expected to be hit between one and two waves (a wave: 2 CTAs per SM), their second
# wave runs on few SMs. There a CTA takes more short tiles (up to
# RAGGED_DECODE_ONE_WAVE_MAX_TILES) if that puts all its item's CTAs in one wave filled to
# RAGGED_DECODE_ONE_WAVE_FILL at least: on the H200 faster on every call measured (1-64 tokens of
# Qwen3-30B-A3B, Qwen3-235B-A22B and DeepSeek-V3, FP4 and MXFP8 weights; at items of 16 and 32
# rows it tied or lost; numbers: docs/design/sm90_ragged_decode.md, "Tiles per CTA: one wave").
RAGGED_DECODE_ONE_WAVE_CARDS = frozenset({"h200"})
RAGGED_DECODE_ONE_WAVE_NTS = (1,)
RAGGED_DECODE_ONE_WAVE_FILL = 0.8
RAGGED_DECODE_ONE_WAVE_MAX_TILES = 8  # the most measured

# Long tiles run one per CTA: every grouped tuning runs 2 CTAs per SM, whose second CTA hides a
# tile's ring fill and tail, and there several long tiles per CTA lose (with 1 CTA per SM, the
# dense kernel's 256-row CTAs the grouped kernel once took at 16-row items, they gained:
# docs/design/sm90_ragged_decode.md).


def expected_hit_groups(m: int, groups: int) -> float:
    """Groups expected to own rows when M rows are routed uniformly at random over `groups`."""
    return groups * (1.0 - (1.0 - 1.0 / groups) ** m)


def ragged_decode_tiles_per_cta(m: int, n: int, k: int, groups: int, b_kind: str, nt: int,
                                splits: int, sm_count: int, card=None) -> int:
    """Adjacent tiles of N per CTA for a grouped decode call of M rows over `groups` experts
    of (N, K) weights of `b_kind` on `splits` K ranges (1: a CTA per tile), on `card`
    (Device.card; its one-wave rule where RAGGED_DECODE_ONE_WAVE_CARDS has it)."""
    tuning = tuning_for(nt, b_kind, grouped=True)
    tiles = _ceil_div(n, tuning.bn)
    chunk = decode_chunk_elems(b_kind, tuning)
    k_range = min(k, _ceil_div(_ceil_div(k, chunk), splits) * chunk)  # a split's K elements
    tile_bytes = tuning.bn * k_range * KINDS[b_kind]["bits"] // 8
    if tile_bytes >= RAGGED_DECODE_SHORT_TILE_BYTES:  # long tiles
        return 1
    work = expected_hit_groups(m, groups) * splits  # items with rows, about, x K ranges
    min_ctas = RAGGED_DECODE_MIN_WAVES * tuning.ctas_per_sm * sm_count
    per = 1
    while (per * tile_bytes < RAGGED_DECODE_CTA_BYTES
           and per < min(tiles, RAGGED_DECODE_MAX_TILES_PER_CTA)
           and work * _ceil_div(tiles, per + 1) >= min_ctas):
        per += 1
    if card in RAGGED_DECODE_ONE_WAVE_CARDS and nt in RAGGED_DECODE_ONE_WAVE_NTS:
        # a second wave the rule's CTAs only start: the fewest more tiles that fit one wave
        wave = tuning.ctas_per_sm * sm_count
        if wave < work * _ceil_div(tiles, per) < 2 * wave:
            for more in range(per + 1, min(tiles, RAGGED_DECODE_ONE_WAVE_MAX_TILES) + 1):
                if RAGGED_DECODE_ONE_WAVE_FILL * wave <= work * _ceil_div(tiles, more) <= wave:
                    return more
    return per


def choose_ragged_decode_variant(m, n, k, groups, fmt_a, fmt_b, sm_count, out="bf16",
                                card=None):
    """(variant, splits, items) for a grouped call of M rows (all groups together) over
    `groups` experts of (N, K), or None if the grouped decode kernel cannot run it.

    The item height follows twice the average rows per expert (the card's
    ragged_decode_16_row_max_avg keeps 16-row items longer); splits fill about one wave
    with the CTAs of the experts that can be hit (at most min(G, M) of them), as for the dense
    kernel, in ranges of the card's RAGGED_DECODE_MIN_SPLIT_CHUNKS at least (card:
    Device.card)."""
    a_kind = KIND_OF_FORMAT.get(fmt_a, fmt_a if fmt_a in KINDS else None)
    b_kind = KIND_OF_FORMAT.get(fmt_b, fmt_b if fmt_b in KINDS else None)
    if (a_kind, b_kind) not in DECODE_PAIRS or out not in OUTS:
        return None
    if m < 1 or n < 1 or groups < 1 or k < 32 or k % 32 or k % KINDS[b_kind]["block"]:
        return None
    # No row limit: past 64 rows an expert's rows run as several 64-row items that stream its
    # weights again (mostly from L2); that still beats dequantize + XLA's grouped GEMM at every
    # size measured (docs/design/sm90_ragged_decode.md).
    avg = _ceil_div(m, groups)
    # Routing is uneven: items of twice the average keep most experts to one item (one pass over
    # their weights), but 64-row items only past 32 rows per expert (their wide tiles cost more
    # than a second pass); the item heights compared: docs/design/sm90_ragged_decode.md.
    rows = max(avg, min(2 * avg, 32))
    if avg <= ragged_decode_16_row_max_avg(card, b_kind):
        rows = min(rows, 16)
    v = DecodeVariant(a_kind, b_kind, out, nt_for(rows), grouped=True)
    min_chunks = RAGGED_DECODE_MIN_SPLIT_CHUNKS_BY_CARD.get(card, RAGGED_DECODE_MIN_SPLIT_CHUNKS)
    return (v, _ragged_decode_splits(v, m, n, k, groups, sm_count, min_chunks=min_chunks),
            ragged_decode_items(m, groups, v.nt))


def _ragged_decode_splits(v, m, n, k, groups, sm_count, min_chunks=1):
    """decode_splits for grouped variant v: its CTAs per K range are the tiles of N of the
    experts that can be hit (at most min(G, M) of them)."""
    ctas = _ceil_div(n, v.tuning.bn) * min(groups, m)
    return decode_splits(k, v.b_kind, v.tuning, ctas, sm_count, min_chunks=min_chunks)


# ----------------------------------------------------------------------------------------------
# The grouped register-weight kernel (kernels/sm90_blockscaled.py: Sm90RaggedRegisterWeightGemm):
# `ragged_gemm` at prefill sizes, where an expert's rows are many enough for the tensor cores.
# Each work item is at most tile_m rows of one expert; a quantized activation is dequantized to
# bf16 first (exact), as gemm does past the decode kernel's rows.

# (activation rows, weight rows) per tile: 64-row items while experts average fewer than
# RAGGED_PREFILL_WIDE_ROWS rows, 128-row items from there, 256-row items from
# RAGGED_PREFILL_WIDEST_ROWS (each step's wgmmas are twice as wide per converted weight). 128-row
# items win once most experts fill more than half of one; 256-row items tie them at 256 rows per
# expert (about half the experts then need a second, nearly empty 256-row item) and win at 512
# (docs/design/sm90_ragged_prefill.md); the threshold sits between the two measured points.
RAGGED_PREFILL_TILES = ((32, 128), (64, 128), (128, 128), (256, 128))
RAGGED_PREFILL_WIDE_ROWS = 64
RAGGED_PREFILL_WIDEST_ROWS = 384
# rows per expert on average from which this kernel takes over from the grouped decode kernel
# (docs/design/sm90_ragged_prefill.md)
RAGGED_PREFILL_MIN_ROWS = 32
# FP4 experts (RAGGED_PREFILL_FP4_KINDS) with a bf16 or an FP4 activation (dequantized to bf16
# first) come here earlier: in 64-row items from RAGGED_PREFILL_FP4_MIN_ROWS rows per expert, and in
# 32-row items (two k-groups of warp groups, as the dense 32-row tile) from
# RAGGED_PREFILL_NARROW_MIN_ROWS where the decode kernel would stream each tile of N in a CTA of
# its own over all of K (long tiles: gpt-oss's, Mixtral's and Qwen3-235B-A22B's gate+up
# experts). Where the decode kernel runs several short tiles per CTA (Qwen3-30B-A3B's experts)
# or splits K it stays faster below RAGGED_PREFILL_FP4_MIN_ROWS, at 8 rows per expert its 16-row
# items win, and MXFP8 weights stay with it (they gain on some shapes and lose on others)
# (docs/design/sm90_ragged_prefill.md).
RAGGED_PREFILL_FP4_MIN_ROWS = 26  # between two measured points (the design note's table)
RAGGED_PREFILL_NARROW_TILE_M = 32
RAGGED_PREFILL_NARROW_MIN_ROWS = 12
# Per GPU model where it differs (Device.card): (rows per expert from which, rows per item) for
# those long-tile experts. On the H200 the 64-row items beat the 32-row ones on every long-tile
# shape measured from 16 rows per expert, and the decode kernel below that (16-row items, then
# 32-row ones, each CTA on the loop of its item's height: GROUPED_ITEM_NTS); with a quantized
# activation from 16 rows. Weight-only FP4 experts stay on the decode kernel longer there
# (RAGGED_PREFILL_WEIGHT_ONLY_LONG_TILES_MIN_ROWS_BY_CARD, per weight kind): since the decode
# kernel's 32-row items run 17-24-row experts on a 24-row loop, its calls at 16 rows per expert
# tied or beat this kernel's 64-row items on the three shapes measured with NVFP4 weights, and
# at 20 rows on all three with MXFP4 ones (this kernel converts an MX weight pair with two
# multiplies where NVFP4 takes one; the decode kernel folds MX scales), while at 20 (NVFP4) and
# 24 rows (MXFP4) this kernel won two of three; each edge sits between those measured points
# (docs/design/sm90_ragged_prefill.md, "The H200").
RAGGED_PREFILL_LONG_TILES_BY_CARD = {"h200": (16, 64)}
RAGGED_PREFILL_WEIGHT_ONLY_LONG_TILES_MIN_ROWS_BY_CARD = {"h200": {"nvfp4": 18, "mxfp4": 22}}
RAGGED_PREFILL_FP4_KINDS = ("mxfp4", "nvfp4")


def ragged_prefill_narrow_widths(tile_m: int) -> tuple[int, ...]:
    """The narrower wgmma widths (activation rows, widest first) on which a grouped
    register-weight tile of `tile_m` rows runs an item of fewer rows, chosen per tile at run
    time: half and a quarter of the 64- and 128-row tiles. An expert's rows seldom fill its last
    item: with the rows spread over the experts it holds about half a tile on average
    (docs/design/sm90_ragged_prefill.md counts them), and a full-width wgmma costs its whole
    width however few of its rows are real. The weights
    are converted once per k-tile either way; the MMAs narrow, and the producer loads only that
    width's activation rows. The 32- and 256-row tiles keep one width: with a loop per width
    ptxas runs their wgmmas one at a time (not enough registers to keep a group in flight;
    tests/build/test_sm90_register_weights_build.py)."""
    return (tile_m // 2, tile_m // 4) if tile_m in (64, 128) else ()


# The grouped decode kernel makes its own work items from the raw group sizes (one kernel, no
# XLA table) except for a shard's buffer of more rows than this (lowering/plan.py): the zero
# rows past its groups then go to XLA's table, as items of their own.
SIZES_MODE_MAX_SHARD_ROWS = 512


def ragged_items(m: int, groups: int, rows_per_item: int) -> int:
    """Entries of a work table for M rows over G groups in items of at most `rows_per_item`
    rows: an upper bound on the items the groups need (at most min(G, M) groups have rows, and
    sum over them of ceil(size / rows) <= M / rows + their count), plus the two zero items (the
    rows before the first group and after the last). Every entry costs a tile per tile of N, so
    the bound is kept tight."""
    return _ceil_div(m, rows_per_item) + min(groups, m) + 2


def ragged_prefill_long_tiles(card=None, fmt_a=None, fmt_b=None) -> tuple[int, int]:
    """(rows per expert on average from which, rows per item) of this kernel for FP4 experts
    whose tiles the decode kernel would stream one per CTA over all of K, on `card`, for an
    activation of format fmt_a (None: bf16) times weights of fmt_b."""
    rows, tile_m = RAGGED_PREFILL_LONG_TILES_BY_CARD.get(
        card, (RAGGED_PREFILL_NARROW_MIN_ROWS, RAGGED_PREFILL_NARROW_TILE_M))
    if KIND_OF_FORMAT.get(fmt_a, fmt_a) == "bf16":
        by_kind = RAGGED_PREFILL_WEIGHT_ONLY_LONG_TILES_MIN_ROWS_BY_CARD.get(card, {})
        rows = by_kind.get(KIND_OF_FORMAT.get(fmt_b, fmt_b), rows)
    return rows, tile_m


def choose_ragged_prefill_variant(m, n, k, groups, fmt_a, fmt_b, sm_count, out="bf16",
                                  force=False, tile_m=None, card=None):
    """(variant, items) of the grouped register-weight kernel for a grouped call of M rows over
    `groups` experts of (N, K), or None where it cannot run it or (unless `force`) the grouped
    decode kernel is faster: fewer than RAGGED_PREFILL_MIN_ROWS rows per expert on average, but
    for register_weights_win_early's calls. tile_m: force the rows per item (a tile of
    RAGGED_PREFILL_TILES); card: Device.card."""
    a_kind = KIND_OF_FORMAT.get(fmt_a, fmt_a if fmt_a in KINDS else None)
    b_kind = KIND_OF_FORMAT.get(fmt_b, fmt_b if fmt_b in KINDS else None)
    if a_kind is None or b_kind not in REGISTER_WEIGHT_KINDS or out not in OUTS:
        return None
    if m < 1 or n < 1 or groups < 1 or k < K_TILE or k % K_TILE:
        return None
    avg = _ceil_div(m, groups)
    early = avg < RAGGED_PREFILL_MIN_ROWS
    if early and not force and not register_weights_win_early(m, n, k, groups, fmt_a, fmt_b,
                                                              sm_count, out, card):
        return None
    tiles = dict(RAGGED_PREFILL_TILES)
    if tile_m is None:
        long_tiles = early and not force and avg < RAGGED_PREFILL_FP4_MIN_ROWS
        tile_m = (ragged_prefill_long_tiles(card, fmt_a, fmt_b)[1] if long_tiles
                  else 64 if avg < RAGGED_PREFILL_WIDE_ROWS
                  else 128 if avg < RAGGED_PREFILL_WIDEST_ROWS else 256)
    tile_n = tiles[tile_m]
    return (Variant("ragged_prefill", "bf16_kperm", b_kind, out, tile_m, tile_n),
            ragged_items(m, groups, tile_m))


def register_weights_win_early(m, n, k, groups, fmt_a, fmt_b, sm_count, out="bf16",
                               card=None) -> bool:
    """Whether the register-weight kernel beats the grouped decode kernel on a call of fewer
    than RAGGED_PREFILL_MIN_ROWS rows per expert: RAGGED_PREFILL_FP4_KINDS weights with a
    bf16 activation or one of those kinds, from RAGGED_PREFILL_FP4_MIN_ROWS rows per expert, and
    from the card's ragged_prefill_long_tiles rows where the decode kernel would run one tile
    of N per CTA over all of K (the measurements: docs/design/sm90_ragged_prefill.md)."""
    if (KIND_OF_FORMAT.get(fmt_a, fmt_a) not in ("bf16",) + RAGGED_PREFILL_FP4_KINDS
            or KIND_OF_FORMAT.get(fmt_b, fmt_b) not in RAGGED_PREFILL_FP4_KINDS):
        return False
    avg = _ceil_div(m, groups)
    if avg >= RAGGED_PREFILL_FP4_MIN_ROWS:
        return True
    if avg < ragged_prefill_long_tiles(card, fmt_a, fmt_b)[0]:
        return False
    decode = choose_ragged_decode_variant(m, n, k, groups, fmt_a, fmt_b, sm_count, out, card)
    if decode is None:
        return True
    v = decode[0]
    # the split count of the wave rule alone, without RAGGED_DECODE_MIN_SPLIT_CHUNKS: the rule
    # was measured on it (long weight tiles), and short K ranges left whole are not long tiles
    splits = _ragged_decode_splits(v, m, n, k, groups, sm_count)
    return splits == 1 and ragged_decode_tiles_per_cta(m, n, k, groups, v.b_kind, v.nt, splits,
                                                       sm_count) == 1


# ----------------------------------------------------------------------------------------------
# The library's variant table (what the AOT build compiles and the C++ table lists)


@dataclasses.dataclass(frozen=True)
class Variant:
    """One compiled sm90 kernel as the FFI handler's table knows it.

    kernel: "fused" | "register_weights" | "decode" | "ragged_decode" (the grouped decode
    kernel) | "ragged_prefill" (the grouped register-weight kernel); nt: 0 for the fused
    kernels, else the decode kernel's n8 tiles of M per CTA (tile_m = 8 nt); tile_n: rows of N
    per CTA (decode: its tuning's bn); k_chunk: decode only, K elements per sub-chunk (a split's
    unit)."""

    kernel: str
    a_kind: str
    b_kind: str
    out: str
    tile_m: int
    tile_n: int
    nt: int = 0
    k_chunk: int = 0
    chained: bool = False  # decode only: DecodeVariant.chained

    @property
    def grouped(self) -> bool:
        """A kernel of `ragged_gemm`'s target (a work table of experts' rows)."""
        return self.kernel in ("ragged_decode", "ragged_prefill")

    @property
    def decode_variant(self) -> DecodeVariant:
        return DecodeVariant(self.a_kind, self.b_kind, self.out, self.nt, self.chained,
                             grouped=self.kernel == "ragged_decode")

    @property
    def name(self) -> str:
        if self.kernel in ("decode", "ragged_decode"):
            return self.decode_variant.name
        if self.kernel == "ragged_prefill":
            return f"jbs_sm90_ragged_{self.b_kind}_{self.out}_{self.tile_m}x{self.tile_n}"
        return f"jbs_sm90_{self.a_kind}_{self.b_kind}_{self.out}_{self.tile_m}x{self.tile_n}"


def fused_variant(a_kind: str, b_kind: str, out: str, tile_m: int, tile_n: int) -> Variant:
    kernel = "register_weights" if a_kind == "bf16_kperm" else "fused"
    return Variant(kernel, a_kind, b_kind, out, tile_m, tile_n)


def decode_variant(v: DecodeVariant) -> Variant:
    t = v.tuning
    return Variant("ragged_decode" if v.grouped else "decode", v.a_kind, v.b_kind, v.out,
                   8 * v.nt, t.bn, v.nt, decode_chunk_elems(v.b_kind, t), v.chained)


VARIANTS = tuple(
    [fused_variant(a, b, out, tm, tn) for (a, b) in FUSED_PAIRS for out in OUTS
     for (tm, tn) in FUSED_TILES]
    + [fused_variant("bf16_kperm", b, out, tm, tn) for b in REGISTER_WEIGHT_KINDS for out in OUTS
       for (tm, tn) in REGISTER_WEIGHT_TILES]
    + [decode_variant(v) for v in DECODE_VARIANTS]
    + [decode_variant(v) for v in RAGGED_DECODE_VARIANTS]
    + [decode_variant(v) for v in CHAINED_DECODE_VARIANTS]
    + [Variant("ragged_prefill", "bf16_kperm", b, out, tm, tn) for b in REGISTER_WEIGHT_KINDS
       for out in OUTS for (tm, tn) in RAGGED_PREFILL_TILES])
