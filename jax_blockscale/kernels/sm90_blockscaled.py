"""Hopper (sm_90a) block-scaled GEMM in CuTeDSL: TMA -> dequantize to bf16 in smem -> wgmma.

    C[m, n, l] = alpha * sum_k A[m, k, l] * B[n, k, l]        (TN: both operands K-major)

Hopper's tensor cores have no block-scaled or fp4 MMA, so the kernel rebuilds each operand tile
in bf16 before the MMA. Every supported element (e2m1, e4m3, e5m2) times its block scale
(power of two for MX, e4m3 for NVFP4) is exactly representable in bf16, so the only difference
from a float64 reference is the f32 accumulation order.

Structure (one CTA per SM, persistent over output tiles):

  warp group 0 (producer, one elected thread): TMA loads of the packed A/B tiles and their
      512-byte blocked scale chunks into an S-stage smem ring (mbarrier pipeline).
  warp groups 1-2 (consumers, 256 threads): for every k-tile
      1. wait for the stage, 2. dequantize A and B into a bf16 tile in the wgmma
      128B-swizzled layout (triple-buffered), 3. fence + named barrier,
      4. issue wgmma (each warp group owns 64 rows of the 128-row tile),
      5. wait for the previous wgmma, release the previous raw stage.
      Epilogue: alpha * acc, converted to the output dtype, predicated stores (M/N tails).

Weight-only mode (a_kind == "bf16"): A is TMA-loaded straight into the swizzled bf16 layout and
read by wgmma from the raw stage; only B is dequantized.

Operands (all device pointers; the host launcher built by export_to_c takes them raw):
  a   : uint8 [L, M, K/2] (fp4, two elements a byte, low nibble first) | [L, M, K] (fp8) |
        bf16 [L, M, K]
  b   : uint8 [L, N, K/2] | [L, N, K]
  sa, sb : uint8 scales in the blocked layout [L, ceil(MN/128), ceil(SK/4), 32, 4, 4]
  c   : out dtype [L, M, N]; a dense register-weight variant given a split count S > 1 (bits
        8-15 of a_e5m2; the f32 variant) writes the true-scale partials [S, L, M, N] there
alpha: f32 [1] in device memory.
Requirements (checked by the FFI handler before any launch, never here): 16-byte aligned
pointers; K a multiple of the block and of 32 (fp4: row pitch K/2 bytes must be a multiple of
16 for TMA); M, N, L >= 1.
"""
from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils as utils
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

from .sm90_dequant_ptx import BF16X2_2P112 as _BF16X2_2P112
from .sm90_dequant_ptx import BF16X2_2P120 as _BF16X2_2P120
from .sm90_dequant_ptx import (FOLD_FACTOR, FP8_E4M3, FP8_E5M2, cvt_asm, fp4_perm_pairs_ptx,
                               fp8_natural_quarter_ptx, fp8_natural_sel)
from .export import compile_for_arch, placeholder_ptr
from .sm90_ptx import (OUT_DTYPES, SCALE_BYTE_SEL, lds_v4, pack_f32x2, scale_bf16x2,
                       scale_pair_packed_bf16x2, stg_v4, stmatrix_x4_trans)
from ..catalog.sm90 import (  # noqa: F401  (re-exported for the tests)
    FUSED_PAIRS as PAIRS, KINDS, OUTS, RAGGED_PREFILL_TILES, REGISTER_WEIGHT_KINDS,
    REGISTER_WEIGHT_TILES, ragged_prefill_narrow_widths, register_weights_permute_k)

# most raw stages of the register-weight ring by activation rows: small tiles stream the weights
# (more bytes in flight), 128-row tiles are bound by the MMAs
REGISTER_WEIGHT_MAX_STAGES = {16: 12, 32: 12, 64: 12, 128: 6, 256: 6}
# activation rows of the register-weight tiles that split each tile's k-tiles between two groups
# of consumer warp groups (even / odd k-tiles, summed at the tile's end): twice the warps to hide
# the conversion's latency where the accumulators are few enough for the smaller register share
REGISTER_WEIGHT_K_SPLIT_ROWS = (16, 32)
PRODUCER_REGS = 40
# The register-weight tiles' staged epilogue (16-bit outputs, one k-group): activation rows per
# pass through each consumer warp group's shared-memory buffer of EPILOGUE_ROWS x 64 outputs
EPILOGUE_ROWS = 128
EPILOGUE_BARRIER = 3  # named barrier id of the consumers' staged epilogue (1, 2: k-groups)

BK = 64  # K elements per k-tile: one 128-byte bf16 row, the 128B-swizzle atom width
# The dense register-weight variants take a run-time split-K count in bits 8-15 of a_e5m2 (their
# activation is bf16, so the word carries no fp8 flavour); 0 or 1: no split
SPLITS_SHIFT = 8
MAX_SPLITS = 255
SCALE_CHUNK = 512  # bytes of one blocked scale tile: 128 rows x 4 scale columns
# The swizzle (bits, base, shift) of the fp8 weight tile the natural-K-order register-weight
# variants read: 16-byte chunk (bits 4-5 of the byte offset) ^= bits 7-8 (TMA's 64-byte mode)
B_NATURAL_SWIZZLE = (2, 4, 3)


def _i32(x, loc, ip):
    return cutlass.Int32(x).ir_value(loc=loc, ip=ip)


@dsl_user_op
def _load_chunk(kind: str, src, scale, ok, *, loc=None, ip=None):
    """Load one chunk (4 bytes of fp4 or 8 bytes of fp8) and its scale byte from smem, if `ok`.
    Volatile: stays ordered after the pipeline wait that made the stage valid."""
    fp8 = KINDS[kind]["bits"] == 8
    asm = ("{\n.reg .pred p;\nsetp.ne.u32 p, $5, 0;\n"
           + ("@p ld.shared.v2.b32 {$0, $1}, [$3];\n" if fp8 else "@p ld.shared.b32 $0, [$3];\n")
           + "@p ld.shared.u8 $2, [$4];\n}")
    res = llvm.inline_asm(
        llvm.StructType.get_literal([T.i32()] * 3),
        [_i32(x, loc, ip) for x in (src, scale, ok)],
        asm, "=r,=r,=r,r,r,r", has_side_effects=True, is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT)
    return [llvm.extractvalue(T.i32(), res, [i], loc=loc, ip=ip) for i in range(3)]


@dsl_user_op
def _convert_chunk(kind: str, perm: bool, words, shift, mask, fix, *, loc=None, ip=None):
    """Pure arithmetic: 8 elements (`words`: two words, then the scale byte) and their scale ->
    4 bf16x2 words (exact); see
    sm90_dequant_ptx for the element order `perm` selects. NVFP4 is folded: its values come out
    times FOLD_FACTOR (one multiply less per pair), which the epilogue's alpha undoes."""
    res = llvm.inline_asm(
        llvm.StructType.get_literal([T.i32()] * 4),
        [_i32(x, loc, ip) for x in (*words, shift, mask, fix)],
        cvt_asm(kind, perm, fold=kind == "nvfp4"), "=r,=r,=r,=r,r,r,r,r,r,r", has_side_effects=False,
        is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT)
    return [llvm.extractvalue(T.i32(), res, [i], loc=loc, ip=ip) for i in range(4)]


@dsl_user_op
def _store_chunk(dst, vals, ok, *, loc=None, ip=None):
    """16-byte st.shared of 8 bf16 at `dst`, if `ok`."""
    llvm.inline_asm(
        None, [_i32(dst, loc, ip)] + list(vals) + [_i32(ok, loc, ip)],
        "{\n.reg .pred p;\nsetp.ne.u32 p, $5, 0;\n@p st.shared.v4.b32 [$0], {$1, $2, $3, $4};\n}",
        "r,r,r,r,r,r,~{memory}", has_side_effects=True, is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT)


# --- register-weight mode (weights_in_registers) -------------------------------------------------
# The MMA runs transposed, C^T = W @ A^T: the weight tile is wgmma's A operand, converted from the
# TMA'd packed bytes straight into registers, and the bf16 activation tile (TMA, 128B swizzle) is
# its B operand read from shared memory. No bf16 weight tile is written to shared memory and no
# barrier sits between the conversion and the MMA. For fp4 weights the activations arrive with K
# permuted inside each 64-element k-tile (catalog/sm90.py: activation_k_order says which order
# and why); for fp8 weights in natural K order (REGISTER_WEIGHT_NATURAL_K_KINDS).

# shared-memory descriptor of a K-major, 128B-swizzled bf16 tile (wgmma B operand): high word =
# stride between 8-row groups (1024 bytes, >> 4) | swizzle mode 1 (128B) << 62; low word =
# start address >> 4 | leading byte offset 1 (unused with swizzling) << 16
RW_DESC_HI = (1024 >> 4) | (1 << 30)


def rw_wgmma_ptx(an: int) -> str:
    """PTX of one k-tile's four m64n{an}k16 wgmmas: $0..$(an/2-1) accumulators (tied inputs
    follow), then 16 A registers (four per MMA), then the descriptor words (lo of the stage's
    first 32-byte K column, hi). It returns once at most one committed group (this k-tile's) is
    still running."""
    n_acc = an // 2
    a0 = 2 * n_acc
    d_lo, d_hi = f"${a0 + 16}", f"${a0 + 17}"
    acc = ", ".join(f"${i}" for i in range(n_acc))
    code = ["{", ".reg .b32 dl;", ".reg .b64 d;", ".reg .pred p;", "setp.ne.b32 p, 1, 0;",
            "wgmma.fence.sync.aligned;"]
    for b in range(4):
        a = ", ".join(f"${a0 + 4 * b + i}" for i in range(4))
        code.append(f"add.u32 dl, {d_lo}, {2 * b};")  # + 32 bytes per k16 column
        code.append(f"mov.b64 d, {{dl, {d_hi}}};")
        code.append(f"wgmma.mma_async.sync.aligned.m64n{an}k16.f32.bf16.bf16 {{{acc}}}, {{{a}}}, "
                    "d, p, 1, 1, 0;")
    code += ["wgmma.commit_group.sync.aligned;",
             "wgmma.wait_group.sync.aligned 1;", "}"]
    return "\n".join(code)


@dsl_user_op
def _rw_wgmma(acc, a_regs, d_lo, an, *, loc=None, ip=None):
    """acc += W (64 x 64, the four k16 MMAs' A registers) @ A^T (the stage's activation tile).
    The MMAs may still run when this returns: the caller must not touch acc (other than through
    the next _rw_wgmma) or the stage before _rw_wait_all / the next call."""
    n_acc = an // 2
    ins = [x.ir_value(loc=loc, ip=ip) for x in acc] + [_i32(x, loc, ip) for x in a_regs]
    ins += [_i32(d_lo, loc, ip), _i32(RW_DESC_HI, loc, ip)]
    cons = ",".join(["=f"] * n_acc + [str(i) for i in range(n_acc)] + ["r"] * 18)
    res = llvm.inline_asm(
        llvm.StructType.get_literal([T.f32()] * n_acc), ins, rw_wgmma_ptx(an), cons,
        has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT)
    return [cutlass.Float32(llvm.extractvalue(T.f32(), res, [i], loc=loc, ip=ip))
            for i in range(n_acc)]


@dsl_user_op
def _rw_wait_all(acc, *, loc=None, ip=None):
    """Wait for every wgmma of this warp group; returns acc (tied through the asm, so reads of
    the sums stay behind the wait)."""
    n_acc = len(acc)
    res = llvm.inline_asm(
        llvm.StructType.get_literal([T.f32()] * n_acc),
        [x.ir_value(loc=loc, ip=ip) for x in acc], "wgmma.wait_group.sync.aligned 0;",
        ",".join(["=f"] * n_acc + [str(i) for i in range(n_acc)]),
        has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT)
    return [cutlass.Float32(llvm.extractvalue(T.f32(), res, [i], loc=loc, ip=ip))
            for i in range(n_acc)]


@dsl_user_op
def _rw_load_row(words, addr, scale_addr=None, *, loc=None, ip=None):
    """`words` weight words of one row from `addr` (one vector load), then the row's scale word
    unless `scale_addr` is None: the thread's 16 fp4 elements (2 words), or in natural K order a
    quarter of the row's fp8 k-tile (4 words)."""
    assert words in (2, 4), words
    outs = words + (scale_addr is not None)
    loads = [f"ld.shared.v{words}.b32 {{{', '.join(f'${i}' for i in range(words))}}}, [${outs}];"]
    ins = [_i32(addr, loc, ip)]
    if scale_addr is not None:
        loads.append(f"ld.shared.b32 ${words}, [${outs + 1}];")
        ins.append(_i32(scale_addr, loc, ip))
    res = llvm.inline_asm(
        llvm.StructType.get_literal([T.i32()] * outs), ins, "\n".join(loads),
        ",".join(["=r"] * outs + ["r"] * len(ins)),
        has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT)
    return [llvm.extractvalue(T.i32(), res, [i], loc=loc, ip=ip) for i in range(outs)]


def rw_fp4_pairs_ptx(fold: bool) -> str:
    """PTX: $8, $9 = a row's two fp4 words, $10 = its bf16x2 block scale -> $0..$7 = pairs
    (j, j+4) of word 0, then of word 1, times the scale (fold: NVFP4, the scale carries 2^126)."""
    body = "".join(fp4_perm_pairs_ptx(f"${8 + w}", "$10", [f"${4 * w + j}" for j in range(4)],
                                      "t", "y", "k", fold) for w in range(2))
    return "{\n.reg .b32 t, y, k;\n" + body + "}"


@dsl_user_op
def _rw_convert(kind, w0, w1, sword, sel, *, loc=None, ip=None):
    """A row's 16 fp4 elements (two words) and byte `sel` of its scale word -> 8 bf16x2 words."""
    fold = kind == "nvfp4"
    scale = scale_bf16x2(kind, sword, sel, fold, loc=loc, ip=ip)
    res = llvm.inline_asm(
        llvm.StructType.get_literal([T.i32()] * 8),
        [_i32(x, loc, ip) for x in (w0, w1, scale)], rw_fp4_pairs_ptx(fold),
        ",".join(["=r"] * 8 + ["r"] * 3), has_side_effects=False, is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT)
    return [llvm.extractvalue(T.i32(), res, [i], loc=loc, ip=ip) for i in range(8)]


@dsl_user_op
def _rw_convert_fp8_natural(words, scales, half, sel, fp8, *, loc=None, ip=None):
    """A quarter of a row's fp8 k-tile in natural K order (4 words: 16 elements, MMA b's), the
    row's two block scales packed in one bf16x2 (scale_pair_packed_bf16x2) of which `half`
    (0: low, 1: high) is this quarter's, the lane's prmt selector (fp8_natural_sel) and the
    run-time (shift, mask, fix) (the mask unused: an immediate here) -> 2 bf16x2 words: MMA b's
    K slots (2t, 2t + 1), then (2t + 8, 2t + 9) (fp8_natural_quarter_ptx)."""
    shift, _, fix = fp8
    ins = [_i32(x, loc, ip) for x in (*words, scales, sel, shift, fix)]
    res = llvm.inline_asm(
        llvm.StructType.get_literal([T.i32()] * 2), ins, fp8_natural_quarter_ptx(half),
        ",".join(["=r"] * 2 + ["r"] * len(ins)), has_side_effects=False, is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT)
    return [llvm.extractvalue(T.i32(), res, [i], loc=loc, ip=ip) for i in range(2)]


def split_count(a_e5m2):
    """The dense register-weight variants' split-K count, from bits 8-15 of a_e5m2 (0 means 1;
    plain Python, traced inline)."""
    return cutlass.max((a_e5m2 >> SPLITS_SHIFT) & MAX_SPLITS, 1)


class _Slot:
    """A pipeline position as PipelineTmaAsync's calls read it (.index, .phase): the position of
    `state` in a ring of stages that starts at stage `base` of the shared barrier arrays."""

    def __init__(self, state, base):
        self.index = state.index + base
        self.phase = state.phase


def _produce(pipe, slot, copies, tx=None):
    """One k-tile's TMA copies into stage slot.index, counted by its full barrier. copies:
    (atom, global tile, shared tensor, tiles per stage, which of them). tx: the bytes the copies
    bring where that is not the pipeline's full stage (a narrow item's activation rows)."""
    if tx is None:
        pipe.producer_acquire(slot)
    else:  # producer_acquire with the stage's bytes of this k-tile
        pipe.sync_object_empty.wait(slot.index, slot.phase)
        pipe.sync_object_full.arrive_and_expect_tx(slot.index, tx)
    bar = pipe.producer_get_barrier(slot)
    for atom, src, dst, per_stage, j in copies:
        at = slot.index if per_stage == 1 else slot.index * per_stage + j
        cute.copy(atom, src, dst[(None, at)], tma_bar_ptr=bar)
    pipe.producer_commit(slot)


class Sm90BlockScaledGemm:
    """One compiled variant: operand kinds, output dtype and tile shape are compile time."""

    grouped = False  # Sm90RaggedRegisterWeightGemm: tiles of rows come from a work table

    def __init__(self, a_kind: str, b_kind: str, out: str, tile_mn=(128, 128),
                 weights_in_registers: bool = False):
        assert (a_kind, b_kind) in PAIRS, (a_kind, b_kind)
        assert out in OUT_DTYPES
        self.a_kind, self.b_kind, self.out = a_kind, b_kind, out
        self.a_quant = a_kind != "bf16"
        # register-weight mode: bf16 activations x quantized weights (REGISTER_WEIGHT_KINDS),
        # the activations K-permuted (activation_k_order) for fp4 weights, in natural K order
        # for fp8 (catalog.sm90.REGISTER_WEIGHT_NATURAL_K_KINDS)
        self.reg_w = weights_in_registers
        self.natural_k = self.reg_w and not register_weights_permute_k(b_kind)
        assert not self.reg_w or self.natural_k or KINDS[b_kind]["bits"] == 4, (
            "the permuted-order register-weight path converts fp4 weights only")
        # dense register-weight variants split K at run time (split_count): each split stores its
        # partial sums in the weights' true scale to C[split, l] (an f32 workspace); the caller
        # adds them in split order and applies alpha
        self.splittable = self.reg_w and not self.grouped
        # tile: (activation rows = the wgmma N, weight rows = 64 per consumer warp group)
        # (the grouped kernel's are RAGGED_PREFILL_TILES, 256-row tiles among them)
        tiles = RAGGED_PREFILL_TILES if self.grouped else REGISTER_WEIGHT_TILES
        assert not self.reg_w or (a_kind == "bf16" and b_kind in REGISTER_WEIGHT_KINDS
                                  and tile_mn in tiles), (a_kind, b_kind, tile_mn)
        # NVFP4 operands are dequantized times FOLD_FACTOR (sm90_dequant_ptx): alpha undoes it
        self.alpha_fix = 1.0 / FOLD_FACTOR ** ((a_kind == "nvfp4") + (b_kind == "nvfp4"))
        self.bm, self.bn = tile_mn
        assert self.reg_w or (self.bm == 128 and self.bn in (64, 128, 256)), tile_mn
        self.nsb = max(1, self.bn // 128)  # 128-row scale tiles of B per stage
        self.c_dtype = OUT_DTYPES[out]
        self.acc_dtype = cutlass.Float32
        # raw (packed) bytes per row of one k-tile
        self.a_row_bytes = BK * KINDS[a_kind]["bits"] // 8
        self.b_row_bytes = BK * KINDS[b_kind]["bits"] // 8
        # register-weight mode: warp groups per k-group (64 weight rows each) x k-groups
        self.k_groups = 2 if self.reg_w and self.bm in REGISTER_WEIGHT_K_SPLIT_ROWS else 1
        self.num_consumer_wg = (self.bn // 64) * self.k_groups if self.reg_w else 2
        self.threads = 128 * (1 + self.num_consumer_wg)
        self.num_consumer_threads = 128 * self.num_consumer_wg
        # registers: what a CTA of this size is launched with (8-register steps), the producer
        # warp group's share handed to the consumers with setmaxnreg (232 for three warp groups);
        # asking for more than the CTA holds would block forever
        launch_regs = 65536 // self.threads // 8 * 8
        self.consumer_regs = min(232, (launch_regs * self.threads - PRODUCER_REGS * 128)
                                 // self.num_consumer_threads // 8 * 8)
        self.bf16_buffers = 0 if self.reg_w else 3  # see the consumer loop for why three
        # chunks dequantized per load/convert/store group (registers vs latency hiding)
        self.group = 8 if self.bn <= 128 else 6
        # shared memory budget -> number of raw stages
        raw_stage = self.bm * self.a_row_bytes + self.bn * self.b_row_bytes + SCALE_CHUNK * (
            self.nsb + (1 if self.a_quant else 0)
        )
        bufs = self.bf16_buffers * ((self.bm * BK * 2 if self.a_quant else 0) + self.bn * BK * 2)
        smem_cap = 227 * 1024 - 4096  # leave room for barriers and alignment padding
        max_stages = REGISTER_WEIGHT_MAX_STAGES[self.bm] if self.reg_w else 8
        if self.k_groups > 1:
            bufs += 4 * self.bm * self.bn  # the second k-group's sums, added at a tile's end
        # register-weight tiles with 16-bit outputs and one k-group store a tile through shared
        # memory (_staged_epilogue): each consumer warp group's EPILOGUE_ROWS x 64 outputs
        self.staged_epilogue = self.reg_w and out != "f32" and self.k_groups == 1
        self.epi_rows = min(self.bm, EPILOGUE_ROWS)
        self.epi_bytes = (self.num_consumer_wg * self.epi_rows * 64 * 2 if self.staged_epilogue
                          else 0)
        bufs += self.epi_bytes
        self.stages = max(2, min(max_stages, (smem_cap - bufs) // raw_stage))
        self.stages -= self.stages % self.k_groups  # one ring of stages per k-group
        self.tx_bytes = raw_stage
        # grouped: narrower wgmma widths for items of fewer rows (an expert's last item), chosen
        # per tile at run time (catalog.sm90.ragged_prefill_narrow_widths says why)
        self.narrow = ragged_prefill_narrow_widths(self.bm) if self.grouped else ()
        assert len(self.narrow) <= 2, "kernel_grouped takes two narrow activation boxes"

    # ------------------------------------------------------------------------------------------
    @cute.jit
    def __call__(
        self,
        a_ptr: cute.Pointer,
        b_ptr: cute.Pointer,
        sa_ptr: cute.Pointer,
        sb_ptr: cute.Pointer,
        c_ptr: cute.Pointer,
        alpha_ptr: cute.Pointer,
        m: cutlass.Int32,
        n: cutlass.Int32,
        k: cutlass.Int32,
        l: cutlass.Int32,
        a_e5m2: cutlass.Int32,
        b_e5m2: cutlass.Int32,
        max_ctas: cutlass.Int32,
        stream: cuda.CUstream,
    ):
        self._launch(a_ptr, b_ptr, sa_ptr, sb_ptr, c_ptr, alpha_ptr, m, n, k, l, a_e5m2, b_e5m2,
                     max_ctas, stream)

    @cute.jit
    def _launch(self, a_ptr, b_ptr, sa_ptr, sb_ptr, c_ptr, alpha_ptr, m, n, k, l, a_e5m2,
                b_e5m2, max_ctas, stream, work=None):
        """Host side of a launch (traced inline into the calling jit function): global tensors,
        TMA atoms, the persistent schedule. work = (items pointer, num_items) for the
        grouped kernel, whose L counts B's experts while A and C are one (M, K) / (M, N)."""
        bm, bn = self.bm, self.bn
        la = 1 if self.grouped else l  # batch of A and C
        # --- global tensors -------------------------------------------------------------------
        if cutlass.const_expr(self.a_quant):
            a_cols = k * KINDS[self.a_kind]["bits"] // 8
        else:
            a_cols = k
        b_cols = k * KINDS[self.b_kind]["bits"] // 8
        a_cols = cute.assume(a_cols, divby=16)
        b_cols = cute.assume(b_cols, divby=16)
        mA = cute.make_tensor(
            a_ptr, cute.make_layout((m, a_cols, la), stride=(a_cols, 1, m * a_cols))
        )
        mB = cute.make_tensor(
            b_ptr, cute.make_layout((n, b_cols, l), stride=(b_cols, 1, n * b_cols))
        )
        c_batch = la
        if cutlass.const_expr(self.splittable):  # C is the workspace [splits, L, M, N]
            c_batch = la * split_count(a_e5m2)
        mC = cute.make_tensor(c_ptr, cute.make_layout((m, n, c_batch), stride=(n, 1, m * n)))
        # alpha lives in device memory (an XLA operand): read it in the epilogue, no host sync;
        # grouped: one per expert
        mAlpha = cute.make_tensor(alpha_ptr, cute.make_layout(l if self.grouped else 1))
        # blocked scales viewed as rows of 128 bytes; one (4 x 128) box is one 128x4 scale tile
        sb_rows = 4 * ((n + 127) // 128) * ((k // KINDS[self.b_kind]["block"] + 3) // 4) * l
        mSB = cute.make_tensor(sb_ptr, cute.make_layout((sb_rows, 128), stride=(128, 1)))
        if cutlass.const_expr(self.a_quant):
            sa_rows = 4 * ((m + 127) // 128) * ((k // KINDS[self.a_kind]["block"] + 3) // 4) * la
        else:
            sa_rows = 4
        mSA = cute.make_tensor(sa_ptr, cute.make_layout((sa_rows, 128), stride=(128, 1)))

        # --- shared memory layouts ------------------------------------------------------------
        self.tiled_mma = sm90_utils.make_trivial_tiled_mma(
            cutlass.BFloat16,
            cutlass.BFloat16,
            cute.nvgpu.warpgroup.OperandMajorMode.K,
            cute.nvgpu.warpgroup.OperandMajorMode.K,
            self.acc_dtype,
            (2, 1, 1),
            tiler_mn=(64, bn),
        )
        self._make_smem_layouts()

        # --- TMA atoms ------------------------------------------------------------------------
        g2s = cute.nvgpu.cpasync.CopyBulkTensorTileG2SOp()
        tma_a, tA = cute.nvgpu.cpasync.make_tiled_tma_atom(
            g2s,
            mA,
            cute.slice_(self.a_raw_layout, (None, None, 0)),
            (bm, self.a_row_bytes if self.a_quant else BK),
        )
        tma_b, tB = cute.nvgpu.cpasync.make_tiled_tma_atom(
            g2s, mB, cute.slice_(self.b_raw_layout, (None, None, 0)), (bn, self.b_row_bytes)
        )
        # grouped: one activation box per narrower width, so that an item of few rows loads only
        # those rows (placeholders, the full box, where the tile has no narrower width)
        narrow_a = [cute.nvgpu.cpasync.make_tiled_tma_atom(
            g2s, mA, cute.slice_(lay, (None, None, 0)), (w, BK))
            for w, lay in zip(self.narrow, self.a_narrow_layouts)]
        narrow_a += [(tma_a, tA)] * (2 - len(narrow_a))
        s_stage = cute.slice_(self.s_layout, (None, None, 0))
        tma_sb, tSB = cute.nvgpu.cpasync.make_tiled_tma_atom(g2s, mSB, s_stage, (4, 128))
        if cutlass.const_expr(self.a_quant):
            tma_sa, tSA = cute.nvgpu.cpasync.make_tiled_tma_atom(g2s, mSA, s_stage, (4, 128))
        else:  # no A scales: pass B's atom as an unused placeholder
            tma_sa, tSA = tma_sb, tSB

        # --- persistent schedule ---------------------------------------------------------------
        tiles_mnl = ((m + bm - 1) // bm, (n + bn - 1) // bn, c_batch)  # split slowest
        if cutlass.const_expr(self.grouped):
            # (tiles of N, work items): N fastest, so the CTAs that run at once share an item's
            # activation rows and its expert's weights (both from L2 after the first)
            tiles_mnl = ((n + bn - 1) // bn, work[1], 1)
        sched = utils.PersistentTileSchedulerParams(tiles_mnl, (1, 1, 1))
        grid = utils.StaticPersistentTileScheduler.get_grid_shape(sched, max_ctas)

        a_raw_elem = cutlass.Uint8 if self.a_quant else cutlass.BFloat16
        a16_cosize = bm * BK * self.bf16_buffers if self.a_quant else 8
        b16_cosize = max(8, bn * BK * self.bf16_buffers)
        a_raw_cosize = bm * (self.a_row_bytes if self.a_quant else BK) * self.stages
        b_raw_cosize = bn * self.b_row_bytes * self.stages

        @cute.struct
        class Storage:
            bars: cute.struct.MemRange[cutlass.Int64, self.stages * 2]
            a16: cute.struct.Align[cute.struct.MemRange[cutlass.BFloat16, a16_cosize], 1024]
            b16: cute.struct.Align[
                cute.struct.MemRange[cutlass.BFloat16, b16_cosize], 1024
            ]
            a_raw: cute.struct.Align[
                cute.struct.MemRange[a_raw_elem, a_raw_cosize], 1024
            ]
            b_raw: cute.struct.Align[
                cute.struct.MemRange[cutlass.Uint8, b_raw_cosize], 1024
            ]
            sa: cute.struct.Align[cute.struct.MemRange[cutlass.Uint8, SCALE_CHUNK * self.stages], 128]
            sb: cute.struct.Align[
                cute.struct.MemRange[cutlass.Uint8, SCALE_CHUNK * self.stages * self.nsb], 128
            ]
            red: cute.struct.Align[
                cute.struct.MemRange[cutlass.Float32, bm * bn if self.k_groups > 1 else 4], 16
            ]
            epi: cute.struct.Align[
                cute.struct.MemRange[cutlass.Uint8, max(16, self.epi_bytes)], 128
            ]

        self.storage = Storage

        if cutlass.const_expr(self.grouped):
            mItems = cute.make_tensor(work[0], cute.make_layout((work[1], 3), stride=(3, 1)))
            kern = self.kernel_grouped(
                tma_a, tA, tma_b, tB, tma_sa, tSA, tma_sb, tSB, mC, mAlpha, m, n, k, a_e5m2,
                b_e5m2, self.tiled_mma, sched, mItems, l, narrow_a[0][0], narrow_a[0][1],
                narrow_a[1][0], narrow_a[1][1])
        else:
            kern = self.kernel(
                tma_a, tA, tma_b, tB, tma_sa, tSA, tma_sb, tSB, mC, mAlpha, m, n, k, a_e5m2,
                b_e5m2, self.tiled_mma, sched)
        kern.launch(grid=grid, block=[self.threads, 1, 1], min_blocks_per_mp=1, stream=stream)

    def _make_smem_layouts(self):
        """Shared-memory layouts; built where they are used (host for TMA atoms, kernel for
        partitioning), since a layout value cannot cross from the host function into the kernel."""
        sw128 = cute.nvgpu.warpgroup.make_smem_layout_atom(
            cute.nvgpu.warpgroup.SmemLayoutAtomKind.K_SW128, cutlass.BFloat16
        )
        bm, bn = self.bm, self.bn
        bufs = max(1, self.bf16_buffers)  # the register-weight mode has none (unused layouts)
        self.a16_layout = cute.tile_to_shape(sw128, (bm, BK, bufs), order=(0, 1, 2))
        self.b16_layout = cute.tile_to_shape(sw128, (bn, BK, bufs), order=(0, 1, 2))
        if cutlass.const_expr(self.a_quant):
            self.a_raw_layout = cute.make_layout(
                (bm, self.a_row_bytes, self.stages),
                stride=(self.a_row_bytes, 1, bm * self.a_row_bytes),
            )
        else:
            self.a_raw_layout = cute.tile_to_shape(sw128, (bm, BK, self.stages), order=(0, 1, 2))
        # a narrow item's activation box: its first rows of a stage (grouped: self.narrow)
        self.a_narrow_layouts = [cute.tile_to_shape(sw128, (w, BK, self.stages), order=(0, 1, 2))
                                 for w in self.narrow]
        self.b_raw_layout = cute.make_layout(
            (bn, self.b_row_bytes, self.stages),
            stride=(self.b_row_bytes, 1, bn * self.b_row_bytes),
        )
        if cutlass.const_expr(self.natural_k):
            # a warp reads one 16-byte quarter of 8 rows' 64-byte k-tiles at a time: TMA's
            # 64-byte swizzle (16-byte chunk ^= bits 7-8 of the offset, i.e. (row >> 1) & 3)
            # spreads them over all banks (unswizzled, rows r, r + 2, r + 4, r + 6 collide)
            self.b_raw_layout = cute.make_composed_layout(
                cute.make_swizzle(*B_NATURAL_SWIZZLE), 0, self.b_raw_layout)
        self.s_layout = cute.make_layout((4, 128, self.stages), stride=(128, 1, SCALE_CHUNK))
        self.sb_layout = cute.make_layout(
            (4, 128, self.stages * self.nsb), stride=(128, 1, SCALE_CHUNK))

    # ------------------------------------------------------------------------------------------
    @cute.kernel
    def kernel(
        self,
        tma_a: cute.CopyAtom,
        tA: cute.Tensor,
        tma_b: cute.CopyAtom,
        tB: cute.Tensor,
        tma_sa: cute.CopyAtom,
        tSA: cute.Tensor,
        tma_sb: cute.CopyAtom,
        tSB: cute.Tensor,
        mC: cute.Tensor,
        mAlpha: cute.Tensor,
        m: cutlass.Int32,
        n: cutlass.Int32,
        k: cutlass.Int32,
        a_e5m2: cutlass.Int32,
        b_e5m2: cutlass.Int32,
        tiled_mma: cute.TiledMma,
        sched: utils.PersistentTileSchedulerParams,
    ):
        self._body(tma_a, tA, tma_b, tB, tma_sa, tSA, tma_sb, tSB, mC, mAlpha, m, n, k, a_e5m2,
                   b_e5m2, tiled_mma, sched)

    @cute.jit
    def _body(self, tma_a, tA, tma_b, tB, tma_sa, tSA, tma_sb, tSB, mC, mAlpha, m, n, k, a_e5m2,
              b_e5m2, tiled_mma, sched, table=None, narrow_a=()):
        """The kernel (traced inline). table = (the work table, G) for the grouped kernel;
        narrow_a: its (TMA atom, tensor) of the activation box of each narrower width."""
        bm, bn = self.bm, self.bn
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        wg_idx = cute.arch.make_warp_uniform(tidx // 128)

        if warp_idx == 0:
            cute.nvgpu.cpasync.prefetch_descriptor(tma_a)
            cute.nvgpu.cpasync.prefetch_descriptor(tma_b)
            cute.nvgpu.cpasync.prefetch_descriptor(tma_sb)
            if cutlass.const_expr(self.a_quant):
                cute.nvgpu.cpasync.prefetch_descriptor(tma_sa)

        self._make_smem_layouts()
        smem = cutlass.utils.SmemAllocator()
        st = smem.allocate(self.storage)

        # full/empty mbarrier ring between the TMA producer and the 8 consumer warps
        pipe = pipeline.PipelineTmaAsync.create(
            barrier_storage=st.bars.data_ptr(),
            num_stages=self.stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(  # the warps that release each stage
                pipeline.Agent.Thread, self.num_consumer_wg // self.k_groups * 4
            ),
            tx_count=self.tx_bytes,
            cta_layout_vmnk=cute.make_layout((1, 1, 1, 1)),
        )

        if cutlass.const_expr(self.a_quant):
            sA_raw = st.a_raw.get_tensor(self.a_raw_layout)
        else:
            sA_raw = st.a_raw.get_tensor(self.a_raw_layout.outer, swizzle=self.a_raw_layout.inner)
        if cutlass.const_expr(self.natural_k):
            sB_raw = st.b_raw.get_tensor(self.b_raw_layout.outer, swizzle=self.b_raw_layout.inner)
        else:
            sB_raw = st.b_raw.get_tensor(self.b_raw_layout)
        sSA = st.sa.get_tensor(self.s_layout)
        sSB = st.sb.get_tensor(self.sb_layout)
        sB16 = st.b16.get_tensor(self.b16_layout.outer, swizzle=self.b16_layout.inner)
        sA16 = sA_raw
        if cutlass.const_expr(self.a_quant):
            sA16 = st.a16.get_tensor(self.a16_layout.outer, swizzle=self.a16_layout.inner)

        # tiles of the global tensors: (bm, bk, tiles_m, tiles_k, L) etc.
        a_tile_k = self.a_row_bytes if self.a_quant else BK
        gA = cute.local_tile(tA, (bm, a_tile_k), (None, None, None))
        gB = cute.local_tile(tB, (bn, self.b_row_bytes), (None, None, None))
        gSA = cute.local_tile(tSA, (4, 128), (None, 0))
        gSB = cute.local_tile(tSB, (4, 128), (None, 0))
        one = cute.make_layout(1)
        tAs, tAg = cute.nvgpu.cpasync.tma_partition(
            tma_a, 0, one, cute.group_modes(sA_raw, 0, 2), cute.group_modes(gA, 0, 2)
        )
        tBs, tBg = cute.nvgpu.cpasync.tma_partition(
            tma_b, 0, one, cute.group_modes(sB_raw, 0, 2), cute.group_modes(gB, 0, 2)
        )
        tSAs, tSAg = cute.nvgpu.cpasync.tma_partition(
            tma_sa, 0, one, cute.group_modes(sSA, 0, 2), cute.group_modes(gSA, 0, 2)
        )
        tSBs, tSBg = cute.nvgpu.cpasync.tma_partition(
            tma_sb, 0, one, cute.group_modes(sSB, 0, 2), cute.group_modes(gSB, 0, 2)
        )

        k_tiles = (k + BK - 1) // BK
        # scale tiles: one 128x4 tile covers 4 blocks of K
        a_blk = KINDS[self.a_kind]["block"] if self.a_quant else 32
        b_blk = KINDS[self.b_kind]["block"]
        sk4_a = (k // a_blk + 3) // 4
        sk4_b = (k // b_blk + 3) // 4
        tiles_m = (m + bm - 1) // bm  # 128-row tiles: also the blocked scale layout's tiles
        scale_tiles_n = (n + 127) // 128
        splits = cutlass.Int32(1)
        if cutlass.const_expr(self.splittable):
            splits = split_count(a_e5m2)

        if wg_idx == 0:
            # ============================ producer ============================================
            cute.arch.setmaxregister_decrease(PRODUCER_REGS)
            if warp_idx == 0:
                sch = utils.StaticPersistentTileScheduler.create(
                    sched, cute.arch.block_idx(), cute.arch.grid_dim()
                )
                work = sch.initial_work_tile_info()
                ring = self.stages // self.k_groups
                ps = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, ring)
                # with two k-groups: the odd k-tiles' ring (stages ring .. 2 ring - 1)
                ps1 = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, ring)
                while work.is_valid_tile:
                    tm, tn, tl = work.tile_idx
                    tile_k_tiles = k_tiles
                    kt0 = 0  # the tile's first k-tile
                    if cutlass.const_expr(self.splittable):
                        tl, kt0, tile_k_tiles = self._split_range(tl, splits, mC, k_tiles)
                    a_tiles, a_l = tAg, tl
                    level = cutlass.Int32(0)  # the activation box: full, or narrow_a[level - 1]
                    narrow_tiles = []
                    if cutlass.const_expr(self.grouped):
                        # tile (N tile, item): B's batch is the item's expert; A's bm rows from
                        # the item's first row (rows past M arrive as zeros)
                        tl, first, end, tile_k_tiles = self._work_item(table, tn, m, k_tiles)
                        tn, tm, a_l = tm, 0, 0
                        g_item = cute.local_tile(cute.domain_offset((first, 0, 0), tA),
                                                 (bm, a_tile_k), (None, None, None))
                        _, a_tiles = cute.nvgpu.cpasync.tma_partition(
                            tma_a, 0, one, cute.group_modes(sA_raw, 0, 2),
                            cute.group_modes(g_item, 0, 2))
                        # an item of few rows: only its rows' box (the consumers' wgmma width)
                        level = self._width_level(end - first)
                        for i in cutlass.range_constexpr(len(self.narrow)):
                            w = self.narrow[i]
                            atom_w, t_w = narrow_a[i]
                            g_w = cute.local_tile(cute.domain_offset((first, 0, 0), t_w),
                                                  (w, a_tile_k), (None, None, None))
                            s_w = cute.local_tile(sA_raw, (w, a_tile_k), (0, 0, None))
                            dst_w, src_w = cute.nvgpu.cpasync.tma_partition(
                                atom_w, 0, one, cute.group_modes(s_w, 0, 2),
                                cute.group_modes(g_w, 0, 2))
                            narrow_tiles.append((atom_w, src_w, dst_w,
                                                 self.tx_bytes - (bm - w) * a_tile_k * 2))
                    for kr in range(tile_k_tiles):
                        kt = kt0 + kr
                        # the 128x4 scale tile(s) of B holding this k-tile's blocks (one per
                        # 128 rows of the tile) and, for a quantized A, A's
                        row_b = (tl * scale_tiles_n + (tn * bn) // 128) * sk4_b + (
                            kt * BK // b_blk) // 4
                        copies = [(tma_b, tBg[(None, tn, kt, tl)], tBs, 1, 0)]
                        for j in cutlass.range_constexpr(self.nsb):
                            copies.append((tma_sb, tSBg[(None, row_b + j * sk4_b)], tSBs,
                                           self.nsb, j))
                        if cutlass.const_expr(self.a_quant):
                            row_a = (tl * tiles_m + tm) * sk4_a + (kt * BK // a_blk) // 4
                            copies.append((tma_sa, tSAg[(None, row_a)], tSAs, 1, 0))
                        full_a = [(tma_a, a_tiles[(None, tm, kt, a_l)], tAs, 1, 0)]
                        if cutlass.const_expr(self.k_groups == 1):
                            if cutlass.const_expr(len(narrow_tiles) == 0):
                                _produce(pipe, ps, full_a + copies)
                            else:
                                if level == 0:
                                    _produce(pipe, ps, full_a + copies)
                                for i in cutlass.range_constexpr(len(narrow_tiles)):
                                    atom_w, src_w, dst_w, tx_w = narrow_tiles[i]
                                    if level == i + 1:
                                        _produce(pipe, ps, [(atom_w, src_w[(None, 0, kt, 0)],
                                                             dst_w, 1, 0)] + copies, tx_w)
                            ps.advance()
                        else:  # register-weight mode, the tile's k-tile kr to k-group kr % 2
                            if kr % 2 == 0:
                                _produce(pipe, _Slot(ps, 0), full_a + copies)
                                ps.advance()
                            else:
                                _produce(pipe, _Slot(ps1, ring), full_a + copies)
                                ps1.advance()
                    sch.advance_to_next_work()
                    work = sch.get_current_work()
                if cutlass.const_expr(self.k_groups == 1):
                    pipe.producer_tail(ps)
                else:  # every stage of both rings released before the CTA exits
                    for _ in cutlass.range_constexpr(ring):
                        pipe.sync_object_empty.wait(ps.index, ps.phase)
                        ps.advance()
                        pipe.sync_object_empty.wait(ps1.index + ring, ps1.phase)
                        ps1.advance()
        elif cutlass.const_expr(self.reg_w):
            cute.arch.setmaxregister_increase(self.consumer_regs)
            self._register_weight_consumer(pipe, st, mC, mAlpha, m, n, k, b_e5m2, tidx, sched,
                                           splits, table=table)
        else:
            # ============================ consumers ===========================================
            cute.arch.setmaxregister_increase(232)
            ctid = tidx - 128  # 0..255 across both consumer warp groups
            thr_mma = tiled_mma.get_slice(ctid)
            tCsA = thr_mma.partition_A(sA16)
            tCsB = thr_mma.partition_B(sB16)
            tCrA = tiled_mma.make_fragment_A(tCsA)
            tCrB = tiled_mma.make_fragment_B(tCsB)
            # output coordinates of this thread's accumulator elements
            tCcC = thr_mma.partition_C(cute.make_identity_tensor((bm, bn)))
            acc = cute.make_rmem_tensor(tCcC.shape, self.acc_dtype)
            num_kb = cute.size(tCrA, mode=[2])

            sync_consumers = pipeline.NamedBarrier(barrier_id=1, num_threads=self.num_consumer_threads)

            # run-time fp8 flavour: shift / mask / power-of-two fix of the bit trick
            a_shift = cutlass.Int32(4)
            a_mask = cutlass.Int32(0x07F007F0)
            a_fix = cutlass.Int32(_BF16X2_2P120)
            if a_e5m2 != 0:
                a_shift = cutlass.Int32(5)
                a_mask = cutlass.Int32(0x0FE00FE0)
                a_fix = cutlass.Int32(_BF16X2_2P112)
            b_shift = cutlass.Int32(4)
            b_mask = cutlass.Int32(0x07F007F0)
            b_fix = cutlass.Int32(_BF16X2_2P120)
            if b_e5m2 != 0:
                b_shift = cutlass.Int32(5)
                b_mask = cutlass.Int32(0x0FE00FE0)
                b_fix = cutlass.Int32(_BF16X2_2P112)

            a_raw_base = st.a_raw.data_ptr().toint()
            b_raw_base = st.b_raw.data_ptr().toint()
            a16_base = st.a16.data_ptr().toint()
            b16_base = st.b16.data_ptr().toint()
            sa_base = st.sa.data_ptr().toint()
            sb_base = st.sb.data_ptr().toint()

            sch = utils.StaticPersistentTileScheduler.create(
                sched, cute.arch.block_idx(), cute.arch.grid_dim()
            )
            work = sch.initial_work_tile_info()
            rs = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
            rel = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
            it = cutlass.Int32(0)  # k-tiles consumed by this CTA so far: picks the bf16 buffer
            while work.is_valid_tile:
                tm, tn, tl = work.tile_idx
                rows_a = m - tm * bm  # valid rows of this tile (may exceed the tile)
                rows_b = n - tn * bn
                b_row0 = (tn * bn) % 128  # first B row's offset inside its 128-row scale tile
                acc.fill(0.0)
                tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, True)
                cute.nvgpu.warpgroup.fence()
                for kt in range(k_tiles):
                    pipe.consumer_wait(rs)
                    buf = it % self.bf16_buffers
                    stage = rs.index
                    # -- dequantize the stage into bf16 buffer `buf`: rows x 8 chunks of 8
                    # elements per operand, spread over the 256 consumer threads. Rows past M/N
                    # are skipped: they only feed output rows/columns that are never stored.
                    jobs = []
                    if cutlass.const_expr(self.a_quant):
                        for i in cutlass.range_constexpr(bm * 8 // self.num_consumer_threads):
                            c = ctid + i * self.num_consumer_threads
                            row = c // 8
                            kc = c % 8
                            kblk = (kt * BK + kc * 8) // a_blk
                            jobs.append((
                                self.a_kind,
                                a_raw_base + stage * (bm * self.a_row_bytes)
                                + row * self.a_row_bytes + kc * (self.a_row_bytes // 8),
                                sa_base + stage * SCALE_CHUNK + (row % 32) * 16
                                + (row // 32) * 4 + kblk % 4,
                                a16_base + buf * (bm * BK * 2) + row * 128
                                + ((kc ^ (row % 8)) * 16),
                                cutlass.Int32(row < rows_a),
                                a_shift, a_mask, a_fix,
                            ))
                    for i in cutlass.range_constexpr(bn * 8 // self.num_consumer_threads):
                        c = ctid + i * self.num_consumer_threads
                        row = c // 8
                        kc = c % 8
                        kblk = (kt * BK + kc * 8) // b_blk
                        rg = b_row0 + row  # row inside the stage's scale tiles
                        jobs.append((
                            self.b_kind,
                            b_raw_base + stage * (bn * self.b_row_bytes)
                            + row * self.b_row_bytes + kc * (self.b_row_bytes // 8),
                            sb_base + (stage * self.nsb + rg // 128) * SCALE_CHUNK
                            + (rg % 32) * 16 + ((rg % 128) // 32) * 4 + kblk % 4,
                            b16_base + buf * (bn * BK * 2) + row * 128 + ((kc ^ (row % 8)) * 16),
                            cutlass.Int32(row < rows_b),
                            b_shift, b_mask, b_fix,
                        ))
                    # In groups: all loads, then the arithmetic, then all stores, so the shared
                    # memory latency overlaps (a store may alias a later load, so ptxas keeps
                    # loads behind earlier stores).
                    for g0 in cutlass.range_constexpr(0, len(jobs), self.group):
                        grp = jobs[g0:g0 + self.group]
                        loaded = [_load_chunk(j[0], j[1], j[2], j[4]) for j in grp]
                        vals = [_convert_chunk(j[0], self.a_quant, w, j[5], j[6], j[7])
                                for j, w in zip(grp, loaded)]
                        for j, v in zip(grp, vals):
                            _store_chunk(j[3], v, j[4])
                    # generic-proxy smem writes must be visible to the wgmma (async proxy)
                    cute.arch.fence_proxy("async.shared", space="cta")
                    sync_consumers.arrive_and_wait()
                    a_idx = buf
                    if cutlass.const_expr(not self.a_quant):
                        a_idx = stage
                    for kb in cutlass.range_constexpr(num_kb):
                        cute.gemm(
                            tiled_mma,
                            acc,
                            tCrA[(None, None, kb, a_idx)],
                            tCrB[(None, None, kb, buf)],
                            acc,
                        )
                    cute.nvgpu.warpgroup.commit_group()
                    # Wait for the previous k-tile's wgmma: its raw stage can go back to the
                    # producer, and (with the barrier above) no warp group still reads the bf16
                    # buffer the next-but-one k-tile overwrites -> three buffers suffice.
                    cute.nvgpu.warpgroup.wait_group(1)
                    if kt > 0:
                        pipe.consumer_release(rel)
                        rel.advance()
                    rs.advance()
                    it = it + 1
                cute.nvgpu.warpgroup.wait_group(0)
                if k_tiles > 0:
                    pipe.consumer_release(rel)
                    rel.advance()

                # -- epilogue: alpha * acc -> out dtype, predicated for M/N tails
                m0 = tm * bm
                n0 = tn * bn
                alpha = self._epilogue_alpha(mAlpha)
                for i in cutlass.range_constexpr(cute.size(acc)):
                    r, cc = tCcC[i]
                    if m0 + r < m and n0 + cc < n:
                        mC[m0 + r, n0 + cc, tl] = self.c_dtype(acc[i] * alpha)
                sch.advance_to_next_work()
                work = sch.get_current_work()

    def _epilogue_alpha(self, mAlpha, expert=0):
        """alpha from device memory (grouped: the expert's), times the NVFP4 fold's correction
        (plain Python, traced inline into the kernel)."""
        alpha = mAlpha[expert if self.grouped else 0]
        if self.alpha_fix != 1.0:
            alpha = alpha * cutlass.Float32(self.alpha_fix)
        return alpha

    def _split_range(self, tl, splits, mC, k_tiles):
        """(batch, first k-tile, k-tiles) of a dense register-weight tile whose third index
        `tl` = split * L + batch counts the splits too (plain Python, traced inline; the producer
        and the consumers read it alike). Split s takes k-tiles [s * per, (s + 1) * per), per =
        ceil(k_tiles / splits); a split past the end has none (its partials are zeros)."""
        l_ab = cute.size(mC, mode=[2]) // splits  # C holds splits x L batches
        per = (k_tiles + splits - 1) // splits
        kt0 = (tl // l_ab) * per
        count = cutlass.max(cutlass.min(k_tiles - kt0, per), 0)
        return tl % l_ab, kt0, count

    def _width_level(self, rows):
        """The narrowest wgmma width that holds an item of `rows` rows: 0 for the whole tile, i
        for self.narrow[i - 1] (plain Python, traced inline; the producer's activation box and
        the consumers' wgmmas take it alike)."""
        level = cutlass.Int32(0)
        for w in self.narrow:
            level = level + cutlass.Int32(rows <= w)
        return level

    def _work_item(self, table, item, m, k_tiles):
        """(expert, first row, end row, k-tiles) of entry `item` of the grouped kernel's work
        table (plain Python, traced inline; the producer and the consumers read it alike).
        Clamped so that no table can make the kernel read or write out of bounds: rows to
        [0, M), an expert's item to bm rows. Expert -1: rows no group owns, written as zeros
        (no k-tiles; any number of rows); any other expert outside [0, G): no rows. The expert
        returned is clamped into [0, G) (a valid batch index for B and alpha)."""
        items, groups = table
        expert = items[item, 0]
        first = cutlass.min(cutlass.max(items[item, 1], 0), m)
        end = cutlass.min(cutlass.max(items[item, 2], first), m)
        real = cutlass.Int32(expert >= 0) * cutlass.Int32(expert < groups)
        end = end - real * cutlass.max(end - first - self.bm, 0)
        end = first + (end - first) * (real + cutlass.Int32(expert == -1))
        tiles = k_tiles * real * cutlass.Int32(end > first)
        return cutlass.max(cutlass.min(expert, groups - 1), 0), first, end, tiles

    @cute.jit
    def _register_weight_consumer(self, pipe, st, mC, mAlpha, m, n, k, b_e5m2, tidx, sched,
                                  splits, table=None):
        """Consumers of the register-weight mode. Thread (k-group kg, warp group wg of it, warp
        wq, lane = 4 g + t) owns weight rows r0 = 64 wg + 16 wq + g and r0 + 8 of the CTA's bn
        and the accumulator of the transposed tile: acc[4 j + x] = C^T[row r0 + 8 (x // 2),
        column 8 j + 2 t + x % 2], summed over k-tiles kg, kg + k_groups, ... With two k-groups
        each has its own ring of stages; the second adds its sums into the first's through
        shared memory at a tile's end, and the first stores the tile. With several splits
        (`splits`, dense variants) a tile covers its split's k-tiles and stores its sums in the
        weights' true scale (alpha is the caller's) to C[split * L + l]."""
        bm, bn = self.bm, self.bn
        kgs = self.k_groups
        group_threads = self.num_consumer_threads // kgs
        ctid = tidx - 128
        kg, gtid = 0, ctid  # k-group, thread index inside it
        if cutlass.const_expr(kgs > 1):
            kg, gtid = ctid // group_threads, ctid % group_threads
        wg = gtid // 128
        wq = (gtid // 32) % 4
        lane = gtid % 32
        g = lane // 4
        t = lane % 4
        r0 = wg * 64 + wq * 16 + g
        ring = self.stages // kgs
        ring_base = kg * ring  # the k-group's ring of stages
        n_acc = bm // 2
        widths = (bm,) + self.narrow  # the wgmma widths, widest first
        k_tiles = (k + BK - 1) // BK
        a_raw_base = st.a_raw.data_ptr().toint()
        b_raw_base = st.b_raw.data_ptr().toint()
        sb_base = st.sb.data_ptr().toint()
        # fp8 flavour of the weights (run time): shift, mask and power-of-two fix
        fp8_params = [cutlass.Int32(x) for x in FP8_E4M3]
        if b_e5m2 != 0:
            fp8_params = [cutlass.Int32(x) for x in FP8_E5M2]
        # this thread's weight bytes inside a stage (rows r0, r0 + 8): its quarter of the rows'
        # k-tiles, or in natural K order the whole k-tiles
        own = 0 if cutlass.const_expr(self.natural_k) else t * (self.b_row_bytes // 4)
        w_off = [r * self.b_row_bytes + own for r in (r0, r0 + 8)]
        acc = cute.make_rmem_tensor((n_acc,), self.acc_dtype)
        kw = dict(t=t, a_raw_base=a_raw_base, b_raw_base=b_raw_base, sb_base=sb_base,
                  w_off=w_off, fp8=fp8_params)
        if cutlass.const_expr(self.natural_k):  # the lane's byte selector and swizzle
            kw["sel"] = fp8_natural_sel(cutlass.Int32(t))
            kw["chunk0"] = ((r0 >> 1) & 3) * 16  # B_NATURAL_SWIZZLE of rows r0, r0 + 8
        sums_ready = pipeline.NamedBarrier(barrier_id=1, num_threads=self.num_consumer_threads)
        sums_read = pipeline.NamedBarrier(barrier_id=2, num_threads=self.num_consumer_threads)
        epi_bar = pipeline.NamedBarrier(barrier_id=EPILOGUE_BARRIER,
                                        num_threads=self.num_consumer_threads)
        epi_base = st.epi.data_ptr().toint()
        c_addr = mC.iterator.toint()
        sch = utils.StaticPersistentTileScheduler.create(
            sched, cute.arch.block_idx(), cute.arch.grid_dim()
        )
        work = sch.initial_work_tile_info()
        rs = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, ring)
        # a k-tile's MMAs run while the next k-tile is converted, so its stage goes back to the
        # producer one k-tile later: rel trails rs
        rel = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, ring)
        # the k-group's own k-tiles of every tile
        own_k_tiles = (k_tiles - kg + kgs - 1) // kgs
        while work.is_valid_tile:
            tm, tn, tl = work.tile_idx
            tile_k_tiles = own_k_tiles
            m0, m_end, c_l = tm * bm, m, tl  # the tile's first row, rows end, C's batch
            kt0 = 0  # the tile's first k-tile
            level = cutlass.Int32(0)  # the wgmma width: widths[level]
            if cutlass.const_expr(self.splittable):
                tl, kt0, split_k_tiles = self._split_range(tl, splits, mC, k_tiles)
                tile_k_tiles = (split_k_tiles - kg + kgs - 1) // kgs
            if cutlass.const_expr(self.grouped):  # tile (N tile, item), see _work_item
                tl, m0, m_end, item_k_tiles = self._work_item(table, tn, m, k_tiles)
                tn, c_l = tm, 0
                tile_k_tiles = (item_k_tiles - kg + kgs - 1) // kgs
                level = self._width_level(m_end - m0)
            acc.fill(0.0)
            # the rows' scale words inside the stage's 128-row scale tile (a 64-row tile may
            # be its second half)
            rg = [(tn * bn) % 128 + r for r in (r0, r0 + 8)]
            s_off = [(r % 32) * 16 + (r // 32) * 4 for r in rg]
            # k-tiles in pairs, then an odd last one: consecutive k-tiles convert into different
            # registers, so the registers a k-tile's MMAs still read are never the ones the next
            # k-tile is converted into. (A loop over single k-tiles rewrites one set each pass;
            # ptxas keeps distinct values apart, tests/test_sm90_register_weights_build.py.)
            # One copy of the loop per wgmma width (grouped: an item of few rows runs on a
            # narrower one, self.narrow), each waiting for its last MMAs before the copies join.
            for wi in cutlass.range_constexpr(len(widths)):
                if level == wi:
                    an = widths[wi]
                    for kp in range(tile_k_tiles // 2):
                        self._register_weight_k_tile(pipe, self._slot(rs, ring_base), acc, kw,
                                                     s_off, kt0 + kg + kgs * (2 * kp), an)
                        rs.advance()
                        if kp > 0:  # the previous pair's second k-tile's MMAs are done
                            pipe.consumer_release(self._slot(rel, ring_base))
                            rel.advance()
                        self._register_weight_k_tile(pipe, self._slot(rs, ring_base), acc, kw,
                                                     s_off, kt0 + kg + kgs * (2 * kp + 1), an)
                        rs.advance()
                        pipe.consumer_release(self._slot(rel, ring_base))  # the pair's first
                        rel.advance()
                    if tile_k_tiles % 2 == 1:
                        self._register_weight_k_tile(pipe, self._slot(rs, ring_base), acc, kw,
                                                     s_off, kt0 + kg + kgs * (tile_k_tiles - 1),
                                                     an)
                        rs.advance()
                        if tile_k_tiles > 1:
                            pipe.consumer_release(self._slot(rel, ring_base))
                            rel.advance()
                    res = _rw_wait_all([acc[i] for i in range(an // 2)])
                    for i in cutlass.range_constexpr(an // 2):
                        acc[i] = res[i]
            if tile_k_tiles > 0:  # the last k-tile
                pipe.consumer_release(self._slot(rel, ring_base))
                rel.advance()
            if cutlass.const_expr(kgs > 1):
                # the second k-group's sums into the first's (slot i of thread x at i T + x: no
                # bank conflicts); the second barrier keeps the buffer until they are read
                red = st.red.get_tensor(cute.make_layout((n_acc, group_threads),
                                                         stride=(group_threads, 1)))
                if kg == 1:
                    for i in cutlass.range_constexpr(n_acc):
                        red[i, gtid] = acc[i]
                sums_ready.arrive_and_wait()
                if kg == 0:
                    for i in cutlass.range_constexpr(n_acc):
                        acc[i] = acc[i] + red[i, gtid]
                sums_read.arrive_and_wait()
            # epilogue (k-group 0): C[l, m, n] = alpha * C^T[n, m], predicated for the M / N tails
            n0 = tn * bn
            alpha = self._epilogue_alpha(mAlpha, tl)
            if cutlass.const_expr(self.grouped):
                if item_k_tiles == 0:  # a zero item (or none): zeros, whatever alpha holds
                    alpha = cutlass.Float32(0.0)
            if cutlass.const_expr(self.splittable):
                if splits > 1:  # partials in true scale: only the NVFP4 fold's correction
                    alpha = cutlass.Float32(self.alpha_fix)
            if cutlass.const_expr(self.staged_epilogue):
                if n % 8 == 0:  # whole 16-byte runs of N (else the outputs one by one)
                    self._staged_epilogue(acc, alpha, epi_base + wg * (self.epi_rows * 128),
                                          epi_bar, c_addr, n0 + 64 * wg, m0, m_end, m, n, c_l,
                                          wq, gtid % 128)
                else:
                    self._element_epilogue(acc, alpha, mC, n0 + r0, m0, m_end, n, t, kg, c_l)
            else:
                self._element_epilogue(acc, alpha, mC, n0 + r0, m0, m_end, n, t, kg, c_l)
            if cutlass.const_expr(self.grouped):
                # a zero item's rows past the tile's first bm (only zero items have more)
                for base in range(m0 + bm, m_end, bm):
                    for i in cutlass.range_constexpr(n_acc):
                        row = n0 + r0 + 8 * ((i % 4) // 2)
                        col = base + 8 * (i // 4) + 2 * t + i % 2
                        if col < m_end and row < n and kg == 0:
                            mC[col, row, 0] = self.c_dtype(0.0)
            sch.advance_to_next_work()
            work = sch.get_current_work()


    @cute.jit
    def _element_epilogue(self, acc, alpha, mC, row0, m0, m_end, n, t, kg, c_l):
        """A tile's outputs one by one: C[l, m, n] = alpha * C^T[n, m] for the thread's
        accumulators (weight rows row0 and row0 + 8, activation rows m0 + 8 j + 2 t + {0, 1}),
        predicated for the M / N tails; k-group 0 stores."""
        for i in cutlass.range_constexpr(self.bm // 2):
            row = row0 + 8 * ((i % 4) // 2)
            col = m0 + 8 * (i // 4) + 2 * t + i % 2
            if col < m_end and row < n and kg == 0:
                mC[col, row, c_l] = self.c_dtype(acc[i] * alpha)

    @cute.jit
    def _staged_epilogue(self, acc, alpha, buf, bar, c_addr, n_wg, m0, m_end, m, n, c_l, wq,
                         wtid):
        """A tile's 16-bit outputs through shared memory (one k-group): the warp group's 64
        weight rows from n_wg, in passes of epi_rows activation rows. Each warp stores its
        accumulators as 8 x 8 blocks transposed (stmatrix .trans: a block's column, one
        activation row's 8 outputs of N, becomes 16 contiguous bytes), into buf's rows of 128
        bytes (64 outputs of N per activation row) with 16-byte chunk c of row r at c ^ (r % 8)
        (no bank conflicts either side); then each thread stores whole 16-byte runs of output
        rows, a warp four rows of 128 bytes at a time. Instead of one 2-byte store per
        accumulator, which kept the tensor cores idle behind the store queue at every tile's
        end. The bar (all consumers) before a pass keeps the buffer until the last pass (or
        tile) is read; the one after makes the blocks visible. Rounding as _element_epilogue."""
        lane = wtid % 32
        q, i = lane // 8, lane % 8  # the stmatrix block and row this lane addresses
        for p in cutlass.range_constexpr(self.bm // self.epi_rows):
            bar.arrive_and_wait()
            for jj in cutlass.range_constexpr(self.epi_rows // 16):
                j = p * (self.epi_rows // 8) + 2 * jj  # accumulator blocks j, j + 1 (8 rows each)
                regs = []
                for dj, h in ((0, 0), (0, 1), (1, 0), (1, 1)):  # block q = 2 dj + h
                    a = 4 * (j + dj) + 2 * h  # weight rows + 8 h, activation rows 2 t, 2 t + 1
                    regs.append(pack_f32x2(self.out, acc[a] * alpha, acc[a + 1] * alpha))
                row = 16 * jj + 8 * (q // 2) + i
                stmatrix_x4_trans(buf + row * 128 + (((2 * wq + q % 2) ^ i) * 16), regs)
            bar.arrive_and_wait()
            for sweep in cutlass.range_constexpr(self.epi_rows // 16):
                idx = wtid + 128 * sweep
                row, c = idx // 8, idx % 8
                v = lds_v4(buf + row * 128 + ((c ^ (row % 8)) * 16))
                out_m = m0 + p * self.epi_rows + row
                out_n = n_wg + 8 * c
                addr = c_addr + ((cutlass.Int64(c_l) * m + out_m) * n + out_n) * 2
                stg_v4(addr, v, cutlass.Int32((out_m < m_end) & (out_n < n)))

    def _slot(self, state, ring_base):
        """The pipeline position of `state` in its k-group's ring (the state itself when there is
        one ring)."""
        return state if self.k_groups == 1 else _Slot(state, ring_base)

    def _register_weight_k_tile(self, pipe, slot, acc, kw, s_off, kt, an):
        """One k-tile of the register-weight consumer (plain Python, traced inline): wait for the
        stage at `slot`, convert the thread's 16 weight elements of each of its two rows into the
        four k16 MMAs' A registers and issue them (acc += W A^T) over the tile's first `an`
        columns (acc[:an // 2]). Returns once the previous k-tile's MMAs are done; this one's
        may still run. The caller advances rs (the tracer only sees state rebound in the loop
        body itself) and releases the stages."""
        pipe.consumer_wait(slot)
        stage = slot.index
        if cutlass.const_expr(self.natural_k):
            self._register_weight_natural_mmas(stage, acc, kw, s_off, kt, an)
        else:
            b_blk = KINDS[self.b_kind]["block"]
            t = kw["t"]
            # fp4 weights (fp8 ones read natural K order): the thread's 16 elements share one
            # block (NVFP4: block t of the k-tile; MX: block 2 kt + t // 2), a byte of the row's
            # scale word
            if cutlass.const_expr(b_blk == 16):
                byte = t
            else:
                byte = (kt * (BK // b_blk) + t // 2) % 4
            sel = SCALE_BYTE_SEL + 0x101 * byte
            pairs = []
            for r in range(2):
                ws = _rw_load_row(
                    2, kw["b_raw_base"] + stage * (self.bn * self.b_row_bytes) + kw["w_off"][r],
                    kw["sb_base"] + stage * SCALE_CHUNK + s_off[r])
                pairs.append(_rw_convert(self.b_kind, ws[0], ws[1], ws[2], sel))
            # k16 MMA b = 2 s + h takes pairs (2h, 2h+1) of word s of both rows
            a_regs = []
            for b in range(4):
                s_, h = b // 2, b % 2
                a_regs += [pairs[0][4 * s_ + 2 * h], pairs[1][4 * s_ + 2 * h],
                           pairs[0][4 * s_ + 2 * h + 1], pairs[1][4 * s_ + 2 * h + 1]]
            self._rw_issue(stage, acc, a_regs, kw, an)

    def _rw_issue(self, stage, acc, a_regs, kw, an):
        """The k-tile's four k16 wgmmas on A registers `a_regs` against the stage's activation
        tile, over its first `an` columns (acc[:an // 2])."""
        d_lo = ((kw["a_raw_base"] + stage * (self.bm * BK * 2)) >> 4) | (1 << 16)
        n_acc = an // 2
        res = _rw_wgmma([acc[i] for i in range(n_acc)], a_regs, d_lo, an)
        for i in range(n_acc):
            acc[i] = res[i]

    def _register_weight_natural_mmas(self, stage, acc, kw, s_off, kt, an):
        """_register_weight_k_tile's conversion and MMAs for fp8 weights with the activation in
        natural K order: each row's whole k-tile is read, a quarter at a time (the quad's four
        lanes read the same bytes; the tile's 64-byte swizzle puts a warp's 8 rows on distinct
        banks), its two block scales converted together, and _rw_convert_fp8_natural picks the
        lane's K slots."""
        # the k-tile's two blocks: bytes 2 kt and 2 kt + 1 (mod 4) of the row's scale word
        b0 = (kt * 2) % 4
        pairs = []
        for r in range(2):
            # the row's first 16-byte chunk where the swizzle put it (rows r0 and r0 + 8 share
            # bits 7-8); chunk b is at that address ^ 16 b (a row's offset has bits 4-5 clear)
            row = (kw["b_raw_base"] + stage * (self.bn * self.b_row_bytes) + kw["w_off"][r]
                   + kw["chunk0"])
            # a quarter k-tile (one MMA's 16 bytes) at a time: 4 words live, not 16 (the 16-
            # and 32-row tiles have 104 registers)
            pairs.append([])
            for b in range(4):
                if b == 0:  # with the row's scale word
                    ws = _rw_load_row(4, row, kw["sb_base"] + stage * SCALE_CHUNK + s_off[r])
                    scales = scale_pair_packed_bf16x2(self.b_kind, ws[4], ws[4],
                                                      b0 + (b0 + 1) * 256)
                else:
                    ws = _rw_load_row(4, row ^ (16 * b))
                pairs[r] += _rw_convert_fp8_natural(ws[:4], scales, b // 2, kw["sel"], kw["fp8"])
        # k16 MMA b takes words 2b (K slots 2t, 2t + 1) and 2b + 1 (2t + 8, 2t + 9) of both rows
        a_regs = []
        for b in range(4):
            a_regs += [pairs[0][2 * b], pairs[1][2 * b], pairs[0][2 * b + 1],
                       pairs[1][2 * b + 1]]
        self._rw_issue(stage, acc, a_regs, kw, an)


class Sm90RaggedRegisterWeightGemm(Sm90BlockScaledGemm):
    """The register-weight kernel for grouped GEMMs at prefill sizes (`jbs.ragged_gemm`):

        y[m, n] = alpha[e] * sum_k A[m, k] * B[e, n, k]   for the rows m of expert e

    A is one bf16 (M, K) activation (for fp4 weights in the K order of activation_k_order, for
    fp8 weights in natural order), rows sorted by expert; B holds G experts' weights (G, N, K)
    with blocked scales; alpha one f32 per expert; C is (M, N). The rows come as a work table
    (`items`, int32 [num_items, 3]: expert, first row, end row; at most bm rows per item, built
    by the caller; see _work_item for how every entry is clamped). The persistent tiles are
    (tile of N, item), N fastest. A tile loads the bm activation rows from the item's first row
    with TMA (rows of the next expert compute values that are not stored; rows past M arrive as
    zeros), or, for an item of at most a narrower width's rows, that width's rows and wgmma
    (ragged_prefill_narrow_widths), streams its expert's weight tile and scales, and stores the
    item's rows only. Expert -1 items write zeros. Everything else (ring, conversion, MMAs, and
    the 32-row tile's two k-groups, each taking its share of the item's k-tiles) is the dense
    register-weight kernel's."""

    grouped = True

    def __init__(self, b_kind: str, out: str, tile_mn=(128, 128)):
        super().__init__("bf16", b_kind, out, tile_mn, weights_in_registers=True)

    @cute.jit
    def __call__(
        self,
        a_ptr: cute.Pointer,
        b_ptr: cute.Pointer,
        sa_ptr: cute.Pointer,
        sb_ptr: cute.Pointer,
        c_ptr: cute.Pointer,
        alpha_ptr: cute.Pointer,
        items_ptr: cute.Pointer,
        m: cutlass.Int32,
        n: cutlass.Int32,
        k: cutlass.Int32,
        g: cutlass.Int32,
        num_items: cutlass.Int32,
        a_e5m2: cutlass.Int32,
        b_e5m2: cutlass.Int32,
        max_ctas: cutlass.Int32,
        stream: cuda.CUstream,
    ):
        self._launch(a_ptr, b_ptr, sa_ptr, sb_ptr, c_ptr, alpha_ptr, m, n, k, g, a_e5m2, b_e5m2,
                     max_ctas, stream, work=(items_ptr, num_items))

    @cute.kernel
    def kernel_grouped(
        self,
        tma_a: cute.CopyAtom,
        tA: cute.Tensor,
        tma_b: cute.CopyAtom,
        tB: cute.Tensor,
        tma_sa: cute.CopyAtom,
        tSA: cute.Tensor,
        tma_sb: cute.CopyAtom,
        tSB: cute.Tensor,
        mC: cute.Tensor,
        mAlpha: cute.Tensor,
        m: cutlass.Int32,
        n: cutlass.Int32,
        k: cutlass.Int32,
        a_e5m2: cutlass.Int32,
        b_e5m2: cutlass.Int32,
        tiled_mma: cute.TiledMma,
        sched: utils.PersistentTileSchedulerParams,
        mItems: cute.Tensor,
        groups: cutlass.Int32,
        tma_a1: cute.CopyAtom,
        tA1: cute.Tensor,
        tma_a2: cute.CopyAtom,
        tA2: cute.Tensor,
    ):
        self._body(tma_a, tA, tma_b, tB, tma_sa, tSA, tma_sb, tSB, mC, mAlpha, m, n, k, a_e5m2,
                   b_e5m2, tiled_mma, sched, table=(mItems, groups),
                   narrow_a=((tma_a1, tA1), (tma_a2, tA2)))


def compile_variant(a_kind: str, b_kind: str, out: str, tile_mn=(128, 128),
                    weights_in_registers: bool = False, arch: str = "sm_90a",
                    grouped: bool = False):
    """cute.compile one variant for `arch` with placeholder pointers (`grouped`: the
    register-weight kernel's Sm90RaggedRegisterWeightGemm, bf16 activations)."""
    a_t = cutlass.BFloat16 if a_kind == "bf16" else cutlass.Uint8
    ptrs = [placeholder_ptr(a_t), placeholder_ptr(cutlass.Uint8), placeholder_ptr(cutlass.Uint8),
            placeholder_ptr(cutlass.Uint8), placeholder_ptr(OUT_DTYPES[out]),
            placeholder_ptr(cutlass.Float32, align=4)]
    if grouped:  # + items; m, n, k, g, num_items
        gemm = Sm90RaggedRegisterWeightGemm(b_kind, out, tile_mn)
        ptrs.append(placeholder_ptr(cutlass.Int32, align=4))
        sizes = [cutlass.Int32(1) for _ in range(5)]
    else:
        gemm = Sm90BlockScaledGemm(a_kind, b_kind, out, tile_mn, weights_in_registers)
        sizes = [cutlass.Int32(1) for _ in range(4)]
    args = (*ptrs, *sizes, cutlass.Int32(0), cutlass.Int32(0), cutlass.Int32(132),
            cuda.CUstream(0))
    return compile_for_arch(gemm, args, arch)
