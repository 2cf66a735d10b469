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
  c   : out dtype [L, M, N]
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

# ----------------------------------------------------------------------------------------------
# Operand kinds.  (block size along K, bits per element, scale kind)
# ----------------------------------------------------------------------------------------------
KINDS = {
    "nvfp4": dict(block=16, bits=4, scale="e4m3"),
    "mxfp4": dict(block=32, bits=4, scale="e8m0"),
    "mxfp8": dict(block=32, bits=8, scale="e8m0"),  # e4m3 or e5m2 chosen at run time
    "bf16": dict(block=None, bits=16, scale=None),  # weight-only activation, no scales
}
# (a_kind, b_kind) pairs the kernel implements.
PAIRS = [
    ("nvfp4", "nvfp4"),
    ("mxfp4", "mxfp4"),
    ("mxfp8", "mxfp8"),
    ("mxfp8", "mxfp4"),
    ("bf16", "nvfp4"),
    ("bf16", "mxfp4"),
    ("bf16", "mxfp8"),
]
OUT_DTYPES = {"bf16": cutlass.BFloat16, "f16": cutlass.Float16, "f32": cutlass.Float32}

BK = 64  # K elements per k-tile: one 128-byte bf16 row, the 128B-swizzle atom width
SCALE_CHUNK = 512  # bytes of one blocked scale tile: 128 rows x 4 scale columns

# bf16x2 constants (both halves equal)
_BF16X2_2P120 = 0x7B807B80  # 2^120: undoes the e4m3 bit trick
_BF16X2_2P112 = 0x77807780  # 2^112: undoes the e5m2 bit trick
_BF16X2_2P126 = 0x7E807E80  # 2^126: undoes the e2m1 bit trick

# ----------------------------------------------------------------------------------------------
# Dequantization of one 8-element chunk, smem -> smem, in PTX.
#
# The bit tricks place the element's exponent/mantissa bits into the low bits of a bf16
# exponent/mantissa, which gives the exact value times a fixed power of two (2^-126 for e2m1,
# 2^-120 for e4m3, 2^-112 for e5m2; subnormal elements land on bf16 subnormals, which bf16
# arithmetic keeps). One exact multiply by the inverse power and one by the block scale
# (bf16x2) give the dequantized value. Products stay exact: at most 6 significant bits.
# ----------------------------------------------------------------------------------------------
_SCALE_E8M0 = """
    ld.shared.u8 s, [$1];
    shl.b32 sp, s, 7;
    setp.eq.u32 p, s, 0;
    selp.b32 sp, 0x40, sp, p;            // e8m0 0 is 2^-127: a bf16 subnormal
    prmt.b32 sp, sp, sp, 0x1010;
"""
_SCALE_E4M3 = f"""
    ld.shared.u8 s, [$1];
    and.b32 sp, s, 0x7F;
    shl.b32 sp, sp, 4;
    and.b32 t, s, 0x80;
    shl.b32 t, t, 8;
    or.b32 sp, sp, t;
    prmt.b32 sp, sp, sp, 0x1010;
    mov.b32 t, {_BF16X2_2P120:#x};
    mul.rn.bf16x2 sp, sp, t;
"""


def _fp8_pair(word, sel_lo, sel_sign, out):
    # out = bf16x2 of two e4m3/e5m2 bytes of `word`; $3 = shift, $4 = mask, $5 = 2^-bias fix
    return f"""
    prmt.b32 t, {word}, 0, {sel_lo:#x};
    shl.b32 t, t, $3;
    and.b32 t, t, $4;
    prmt.b32 g, {word}, 0, {sel_sign:#x};
    lop3.b32 t, t, g, 0x80008000, 0xF8;   // t | (g & 0x80008000)
    mul.rn.bf16x2 t, t, $5;
    mul.rn.bf16x2 {out}, t, sp;
"""


def _fp4_pair(j, out):
    # nibbles 2j (low half) and 2j+1 (high half) of the chunk word
    sel = 0x8080 | ((4 + j) << 8) | j
    return f"""
    prmt.b32 t, xl, xh, {sel:#x};
    shl.b32 g, t, 6;
    and.b32 g, g, 0x01C001C0;
    shl.b32 t, t, 12;
    lop3.b32 t, g, t, 0x80008000, 0xF8;   // magnitude | sign
    mul.rn.bf16x2 t, t, k126;
    mul.rn.bf16x2 {out}, t, sp;
"""


def _asm_fp8(scale_asm):
    body = (
        "{\n.reg .b32 w0, w1, s, sp, t, g, r0, r1, r2, r3;\n.reg .pred p;\n"
        "ld.shared.v2.b32 {w0, w1}, [$0];\n"
        + scale_asm
        + _fp8_pair("w0", 0x4140, 0x9484, "r0")
        + _fp8_pair("w0", 0x4342, 0xB4A4, "r1")
        + _fp8_pair("w1", 0x4140, 0x9484, "r2")
        + _fp8_pair("w1", 0x4342, 0xB4A4, "r3")
        + "st.shared.v4.b32 [$2], {r0, r1, r2, r3};\n}"
    )
    return body


def _asm_fp4(scale_asm):
    body = (
        "{\n.reg .b32 w, xl, xh, s, sp, t, g, k126, r0, r1, r2, r3;\n.reg .pred p;\n"
        f"mov.b32 k126, {_BF16X2_2P126:#x};\n"
        "ld.shared.b32 w, [$0];\n"
        "and.b32 xl, w, 0x0F0F0F0F;\n"
        "shr.b32 xh, w, 4;\n"
        "and.b32 xh, xh, 0x0F0F0F0F;\n"
        + scale_asm
        + _fp4_pair(0, "r0")
        + _fp4_pair(1, "r1")
        + _fp4_pair(2, "r2")
        + _fp4_pair(3, "r3")
        + "st.shared.v4.b32 [$2], {r0, r1, r2, r3};\n}"
    )
    return body


@dsl_user_op
def _dequant_chunk(kind: str, src, scale, dst, shift, mask, fix, *, loc=None, ip=None):
    """Dequantize 8 elements at smem address `src` with the scale byte at `scale` into 8 bf16 at
    `dst` (16-byte aligned). Addresses are 32-bit shared-window addresses."""
    scale_asm = _SCALE_E4M3 if KINDS[kind]["scale"] == "e4m3" else _SCALE_E8M0
    if KINDS[kind]["bits"] == 4:
        asm = _asm_fp4(scale_asm)
    else:
        asm = _asm_fp8(scale_asm)
    ops = [cutlass.Int32(x).ir_value(loc=loc, ip=ip) for x in (src, scale, dst, shift, mask, fix)]
    llvm.inline_asm(
        None,
        ops,
        asm,
        "r,r,r,r,r,r,~{memory}",
        has_side_effects=True,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    )


class Sm90BlockScaledGemm:
    """One compiled variant: operand kinds, output dtype and tile shape are compile time."""

    def __init__(self, a_kind: str, b_kind: str, out: str, tile_mn=(128, 128)):
        assert (a_kind, b_kind) in PAIRS, (a_kind, b_kind)
        assert out in OUT_DTYPES
        self.a_kind, self.b_kind, self.out = a_kind, b_kind, out
        self.a_quant = a_kind != "bf16"
        self.bm, self.bn = tile_mn
        assert self.bm == 128 and self.bn == 128, "v1 implements the 128x128 tile only"
        self.c_dtype = OUT_DTYPES[out]
        self.acc_dtype = cutlass.Float32
        # raw (packed) bytes per row of one k-tile
        self.a_row_bytes = BK * KINDS[a_kind]["bits"] // 8
        self.b_row_bytes = BK * KINDS[b_kind]["bits"] // 8
        self.num_consumer_wg = 2
        self.threads = 128 * (1 + self.num_consumer_wg)
        self.num_consumer_threads = 128 * self.num_consumer_wg
        self.bf16_buffers = 3  # see the consumer loop for why three
        # shared memory budget -> number of raw stages
        raw_stage = self.bm * self.a_row_bytes + self.bn * self.b_row_bytes + SCALE_CHUNK * (
            2 if self.a_quant else 1
        )
        bufs = self.bf16_buffers * ((self.bm * BK * 2 if self.a_quant else 0) + self.bn * BK * 2)
        smem_cap = 227 * 1024 - 4096  # leave room for barriers and alignment padding
        self.stages = max(2, min(8, (smem_cap - bufs) // raw_stage))
        self.tx_bytes = raw_stage

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
        bm, bn = self.bm, self.bn
        # --- global tensors -------------------------------------------------------------------
        if cutlass.const_expr(self.a_quant):
            a_cols = k * KINDS[self.a_kind]["bits"] // 8
        else:
            a_cols = k
        b_cols = k * KINDS[self.b_kind]["bits"] // 8
        a_cols = cute.assume(a_cols, divby=16)
        b_cols = cute.assume(b_cols, divby=16)
        mA = cute.make_tensor(
            a_ptr, cute.make_layout((m, a_cols, l), stride=(a_cols, 1, m * a_cols))
        )
        mB = cute.make_tensor(
            b_ptr, cute.make_layout((n, b_cols, l), stride=(b_cols, 1, n * b_cols))
        )
        mC = cute.make_tensor(c_ptr, cute.make_layout((m, n, l), stride=(n, 1, m * n)))
        # alpha lives in device memory (an XLA operand): read it in the epilogue, no host sync
        mAlpha = cute.make_tensor(alpha_ptr, cute.make_layout(1))
        # blocked scales viewed as rows of 128 bytes; one (4 x 128) box is one 128x4 scale tile
        sb_rows = 4 * ((n + 127) // 128) * ((k // KINDS[self.b_kind]["block"] + 3) // 4) * l
        mSB = cute.make_tensor(sb_ptr, cute.make_layout((sb_rows, 128), stride=(128, 1)))
        if cutlass.const_expr(self.a_quant):
            sa_rows = 4 * ((m + 127) // 128) * ((k // KINDS[self.a_kind]["block"] + 3) // 4) * l
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
        s_stage = cute.slice_(self.s_layout, (None, None, 0))
        tma_sb, tSB = cute.nvgpu.cpasync.make_tiled_tma_atom(g2s, mSB, s_stage, (4, 128))
        if cutlass.const_expr(self.a_quant):
            tma_sa, tSA = cute.nvgpu.cpasync.make_tiled_tma_atom(g2s, mSA, s_stage, (4, 128))
        else:  # no A scales: pass B's atom as an unused placeholder
            tma_sa, tSA = tma_sb, tSB

        # --- persistent schedule ---------------------------------------------------------------
        tiles_mnl = ((m + bm - 1) // bm, (n + bn - 1) // bn, l)
        sched = utils.PersistentTileSchedulerParams(tiles_mnl, (1, 1, 1))
        grid = utils.StaticPersistentTileScheduler.get_grid_shape(sched, max_ctas)

        a_raw_elem = cutlass.Uint8 if self.a_quant else cutlass.BFloat16
        a16_cosize = bm * BK * self.bf16_buffers if self.a_quant else 8
        b16_cosize = bn * BK * self.bf16_buffers
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
            sb: cute.struct.Align[cute.struct.MemRange[cutlass.Uint8, SCALE_CHUNK * self.stages], 128]

        self.storage = Storage

        self.kernel(
            tma_a, tA, tma_b, tB, tma_sa, tSA, tma_sb, tSB, mC, mAlpha, m, n, k, a_e5m2, b_e5m2,
            self.tiled_mma, sched,
        ).launch(grid=grid, block=[self.threads, 1, 1], min_blocks_per_mp=1, stream=stream)

    def _make_smem_layouts(self):
        """Shared-memory layouts; built where they are used (host for TMA atoms, kernel for
        partitioning), since a layout value cannot cross from the host function into the kernel."""
        sw128 = cute.nvgpu.warpgroup.make_smem_layout_atom(
            cute.nvgpu.warpgroup.SmemLayoutAtomKind.K_SW128, cutlass.BFloat16
        )
        bm, bn = self.bm, self.bn
        self.a16_layout = cute.tile_to_shape(sw128, (bm, BK, self.bf16_buffers), order=(0, 1, 2))
        self.b16_layout = cute.tile_to_shape(sw128, (bn, BK, self.bf16_buffers), order=(0, 1, 2))
        if cutlass.const_expr(self.a_quant):
            self.a_raw_layout = cute.make_layout(
                (bm, self.a_row_bytes, self.stages),
                stride=(self.a_row_bytes, 1, bm * self.a_row_bytes),
            )
        else:
            self.a_raw_layout = cute.tile_to_shape(sw128, (bm, BK, self.stages), order=(0, 1, 2))
        self.b_raw_layout = cute.make_layout(
            (bn, self.b_row_bytes, self.stages),
            stride=(self.b_row_bytes, 1, bn * self.b_row_bytes),
        )
        self.s_layout = cute.make_layout((4, 128, self.stages), stride=(128, 1, SCALE_CHUNK))

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
            consumer_group=pipeline.CooperativeGroup(
                pipeline.Agent.Thread, self.num_consumer_wg * 4
            ),
            tx_count=self.tx_bytes,
            cta_layout_vmnk=cute.make_layout((1, 1, 1, 1)),
        )

        if cutlass.const_expr(self.a_quant):
            sA_raw = st.a_raw.get_tensor(self.a_raw_layout)
        else:
            sA_raw = st.a_raw.get_tensor(self.a_raw_layout.outer, swizzle=self.a_raw_layout.inner)
        sB_raw = st.b_raw.get_tensor(self.b_raw_layout)
        sSA = st.sa.get_tensor(self.s_layout)
        sSB = st.sb.get_tensor(self.s_layout)
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
        tiles_m = (m + bm - 1) // bm
        tiles_n = (n + bn - 1) // bn

        if wg_idx == 0:
            # ============================ producer ============================================
            cute.arch.setmaxregister_decrease(40)
            if warp_idx == 0:
                sch = utils.StaticPersistentTileScheduler.create(
                    sched, cute.arch.block_idx(), cute.arch.grid_dim()
                )
                work = sch.initial_work_tile_info()
                ps = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages)
                while work.is_valid_tile:
                    tm, tn, tl = work.tile_idx
                    for kt in range(k_tiles):
                        pipe.producer_acquire(ps)
                        bar = pipe.producer_get_barrier(ps)
                        cute.copy(tma_a, tAg[(None, tm, kt, tl)], tAs[(None, ps.index)], tma_bar_ptr=bar)
                        cute.copy(tma_b, tBg[(None, tn, kt, tl)], tBs[(None, ps.index)], tma_bar_ptr=bar)
                        # the 128x4 scale tile holding this k-tile's blocks
                        row_b = (tl * tiles_n + tn) * sk4_b + (kt * BK // b_blk) // 4
                        cute.copy(tma_sb, tSBg[(None, row_b)], tSBs[(None, ps.index)], tma_bar_ptr=bar)
                        if cutlass.const_expr(self.a_quant):
                            row_a = (tl * tiles_m + tm) * sk4_a + (kt * BK // a_blk) // 4
                            cute.copy(tma_sa, tSAg[(None, row_a)], tSAs[(None, ps.index)], tma_bar_ptr=bar)
                        pipe.producer_commit(ps)
                        ps.advance()
                    sch.advance_to_next_work()
                    work = sch.get_current_work()
                pipe.producer_tail(ps)
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
                acc.fill(0.0)
                tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, True)
                cute.nvgpu.warpgroup.fence()
                for kt in range(k_tiles):
                    pipe.consumer_wait(rs)
                    buf = it % self.bf16_buffers
                    stage = rs.index
                    # -- dequantize: 128 rows x 8 chunks of 8 elements per operand, 4 per thread
                    for i in cutlass.range_constexpr(bm * (BK // 8) // self.num_consumer_threads):
                        c = ctid + i * self.num_consumer_threads
                        row = c // 8
                        kc = c % 8
                        soff = (row % 32) * 16 + (row // 32) * 4
                        dst = row * 128 + ((kc ^ (row % 8)) * 16)
                        if cutlass.const_expr(self.a_quant):
                            kblk = (kt * BK + kc * 8) // a_blk
                            _dequant_chunk(
                                self.a_kind,
                                a_raw_base + stage * (bm * self.a_row_bytes)
                                + row * self.a_row_bytes + kc * (self.a_row_bytes // 8),
                                sa_base + stage * SCALE_CHUNK + soff + kblk % 4,
                                a16_base + buf * (bm * BK * 2) + dst,
                                a_shift, a_mask, a_fix,
                            )
                        kblk_b = (kt * BK + kc * 8) // b_blk
                        _dequant_chunk(
                            self.b_kind,
                            b_raw_base + stage * (bn * self.b_row_bytes)
                            + row * self.b_row_bytes + kc * (self.b_row_bytes // 8),
                            sb_base + stage * SCALE_CHUNK + soff + kblk_b % 4,
                            b16_base + buf * (bn * BK * 2) + dst,
                            b_shift, b_mask, b_fix,
                        )
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
                alpha = mAlpha[0]
                for i in cutlass.range_constexpr(cute.size(acc)):
                    r, cc = tCcC[i]
                    if m0 + r < m and n0 + cc < n:
                        mC[m0 + r, n0 + cc, tl] = self.c_dtype(acc[i] * alpha)
                sch.advance_to_next_work()
                work = sch.get_current_work()


def compile_variant(a_kind: str, b_kind: str, out: str, tile_mn=(128, 128)):
    """cute.compile one variant for the current CUTE_DSL_ARCH with placeholder pointers."""
    from cutlass.cute.runtime import make_ptr

    gemm = Sm90BlockScaledGemm(a_kind, b_kind, out, tile_mn)
    gmem = cute.AddressSpace.gmem
    a_t = cutlass.BFloat16 if a_kind == "bf16" else cutlass.Uint8
    args = (
        make_ptr(a_t, 16, gmem, assumed_align=16),
        make_ptr(cutlass.Uint8, 16, gmem, assumed_align=16),
        make_ptr(cutlass.Uint8, 16, gmem, assumed_align=16),
        make_ptr(cutlass.Uint8, 16, gmem, assumed_align=16),
        make_ptr(OUT_DTYPES[out], 16, gmem, assumed_align=16),
        make_ptr(cutlass.Float32, 16, gmem, assumed_align=4),
        *(cutlass.Int32(1) for _ in range(4)),
        cutlass.Int32(0),
        cutlass.Int32(0),
        cutlass.Int32(132),
        cuda.CUstream(0),
    )
    return cute.compile(gemm, *args)
