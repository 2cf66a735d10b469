"""Hopper (sm_90a) decode kernel: block-scaled GEMM for small M (1..16), weight streaming.

    y[l, m, n] = alpha * sum_k A[l, m, k] * B[l, n, k]

At decode shapes (M <= 16) the GEMM is a matrix-vector product in disguise: every weight byte is
read once and used M times, so the time floor is "bytes of B and its scales / HBM bandwidth"
(N = K = 16384 NVFP4: 151 MB with the scales, ~50 us at the H100's measured ~3.0 TB/s). The
tensor-core GEMM of sm90_blockscaled.py tiles M by 128 and wastes most of its work here; this
kernel is built for the bandwidth instead.

How it works (one CTA = 8 warps = Tuning.bn rows of N (256 or 128) x one K range):

* Swap A/B: the weights are the MMA's "A" operand (16 rows of N per mma.sync.m16n8k16) and the
  activations its "B" operand (8 rows of M per n8 tile; NT = 1 tile for M <= 8, 2 for M <= 16).
  Each warp owns 32 rows of N (two m16 row tiles): rows i0 + g + 32 j of a 128-row group
  (i0 = 8 (warp % 4), j = 0..3), so a thread's four rows share one 16-byte entry of the blocked
  scale layout (one 16-byte scale load per step, whole 128-byte lines per warp).
* Weights: lane = 4*g + t uses bytes [16t, 16t+16) of the step's 64-byte slice of its rows.
  Default pipeline for M <= 16 (Tuning "tma", see catalog/sm90.py: DEFAULT_TUNING): warp 0
  brings each sub-chunk in with TMA (boxes of the CTA's 256 rows x box_steps * 64 bytes: one
  256-byte segment per row and sub-chunk by default, plus the sub-chunk's blocked-scale tiles)
  into a shared-memory ring two sub-chunks deep, completing on one mbarrier per slot; everyone
  reads its 16-byte pieces from there. M <= 8, and MXFP8 weights up to M = 16 (NARROW_TUNING,
  catalog/sm90.py: tuning_for; the grouped kernel: every weight kind up to M = 16): the same
  with 128 rows per CTA and 2 CTAs/SM. M <= 32 / 64
  (WIDE_TUNING): the same ring, 128 rows per CTA, 64-byte boxes.
  Measured alternatives, still buildable as tunings (docs/design/sm90_decode.md): "cpasync"
  (each thread cp.async-copies its own pieces into a per-thread ring) and "regs" (loads into
  registers one sub-chunk ahead).
  Activations are loaded one sub-chunk ahead into registers and stored into a double-buffered
  shared tile; one CTA barrier per sub-chunk.
* The K index inside an MMA may be any permutation, as long as weights and activations use the
  same one. Each thread feeds its own 16 contiguous weight bytes to consecutive MMAs, so no weight
  shuffle is needed. The fp4 -> bf16 bit trick gives nibbles (j, j+4) of a 32-bit word as one
  bf16x2 pair (the same shift serves both halves); the activations are staged into shared memory
  in exactly that order, in "fragment order" (each lane's two MMA B registers for two consecutive
  MMAs are one 16-byte word: conflict-free `ld.shared.v4`).
* Dequantization: the element's exponent/mantissa bits are placed into a bf16 (value times a fixed
  power of two), multiplied back (exact) and by the block scale (exact: e2m1/e4m3/e5m2 times a
  power of two or an e4m3 scale has at most 7 significant bits, bf16 holds 8). So the MMA sees
  the exact dequantized weights; only the f32 accumulation order differs from a float64 reference.
* Split-K: grid = (ceil(N/BN) * ceil(M / (8*NT)), splits, L) with BN = Tuning.bn rows of N, M
  chunks fastest (the chunks that share a weight tile run together: later chunks read it from
  L2). Each CTA stores its partial sums (plain stores, no atomics; in the weights' true scale,
  before alpha) into its split's slice of an f32 workspace [splits, L, M, N]. Who adds them
  (bit 5 of a_e5m2): the caller (gemm's lowering adds the slices in split order in XLA, which
  fuses the sum into the ops around the call), or a small kernel the exported launcher runs
  after the main one (same order, times alpha, converted; launched by programmatic dependent
  launch, so its start overlaps the main kernel's end). Either way bitwise the same result and
  reproducible; no zeroing. One split: the main kernel converts and writes the output itself.
  (Adding the splits in the main kernel's last CTA per tile or in a thread-block cluster was no
  faster: docs/design/sm90_decode.md.) The workspace (splits*L*M*N f32) is the caller's (FFI
  scratch); `splits` is a run-time argument chosen by `choose_decode_variant` (one wave of
  CTAs).

What it reaches on an H100, and what was tried: docs/design/sm90_decode.md.

Operands (device pointers; the contract shared with sm90_blockscaled.py and the FFI handler):
  a   : bf16 [L, M, K] (weight-only) | uint8 [L, M, K/2] (fp4) | uint8 [L, M, K] (fp8)
  b   : uint8 [L, N, K/2] (fp4, two per byte, low nibble first) | uint8 [L, N, K] (fp8)
  sa, sb : uint8 blocked scales [L, ceil(MN/128), ceil(SK/4), 32, 4, 4] (sa unused for bf16 A;
        plain [L, M, SK] instead when bit 1 of a_e5m2 is set)
  c   : out dtype [L, M, N];  alpha : f32 [1] in device memory;  ws : f32 [splits, L, M, N]
  a_e5m2, b_e5m2 : bit 0 = e5m2 fp8 elements (else e4m3); a_e5m2 bit 1 = plain A scales;
        a_e5m2 bit 2 (grouped kernel only) = index mode: the work table is one int32;
        bit 3 (grouped kernel only) = sizes mode: the work table is the G raw group sizes;
        bit 4 (grouped kernel only) = alpha is one float for every expert;
        bit 5 = with splits > 1 the partials stay in ws for the caller to add (no finalize
        kernel; c is not written); the grouped kernel's partials carry each expert's alpha,
        except in index mode (true scale, as the dense kernel's: the caller applies the layer's
        alpha);
        bits 8-11 (grouped kernel only) = adjacent tiles of N per CTA, minus 1
Requirements (the caller checks them): K a multiple of 32 and of the block; a, b 16-byte aligned
with row pitches (K*bits/8 bytes) multiples of 16; M, N, L >= 1; element*scale finite in bf16.
"""
from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute

# variants and tunings: the pure-Python catalogue
from jax_blockscale.catalog.sm90 import (  # noqa: F401  (re-exported for the tests)
    DECODE_B_KINDS as B_KINDS, DECODE_PAIRS as PAIRS, DECODE_STEP_BYTES as STEP_BYTES,
    DECODE_THREADS as THREADS, DECODE_VARIANTS as VARIANTS, DECODE_WARPS as WARPS,
    DEFAULT_TUNING, KINDS, OUTS, WIDE_TUNING, DecodeVariant, Tuning, choose_decode_variant,
    decode_loop_nts, decode_mx_fold, steps_elems)
from jax_blockscale.kernels.export import compile_for_arch, export_compiled, placeholder_ptr
from jax_blockscale.kernels.grouped_work import item_from_sizes
from jax_blockscale.kernels.sm90_dequant_ptx import BF16X2_2P120 as _K120
from jax_blockscale.kernels.sm90_ptx import (
    FIN_FOUR_FROM, FOLD_ALPHA, OUT_DTYPES, cp_async, cp_async_commit,
    cp_async_wait, dequant_group, dequant_mma, ldg4_f32, ldg_bytes, ldg_f32, ldg_stream_v4, ldg_v4,
    bytes_above_mx_fold, lds_v2, lds_v4, mbar_arrive_expect_tx, mbar_init, mbar_init_fence,
    mbar_wait, opaque_i32, permute_fp4_order, scale_bf16x2, scale_pair_bf16x2, scale_pair_sel,
    stg4_out, stg_f32, sts_v4, sync_threads_or)

# mx_fold's check of a CTA's block scales: 16-byte loads each thread keeps in flight at a time
MX_FOLD_LOADS = 4


# ----------------------------------------------------------------------------------------------
# The kernel
# ----------------------------------------------------------------------------------------------
class Sm90DecodeGemm:
    grouped = False  # Sm90RaggedDecodeGemm: rows of M come from a work table, one expert each

    def __init__(self, variant: DecodeVariant, tuning: Tuning | None = None):
        assert variant.grouped == self.grouped, variant  # its tuning is the grouped kernel's
        tuning = tuning or variant.tuning
        assert tuning.pipeline == "tma" or not self.grouped, tuning
        self.tuning = tuning
        self.sub = tuning.sub_steps
        v = variant
        assert (v.a_kind, v.b_kind) in PAIRS and v.out in OUT_DTYPES and v.nt in (1, 2, 4, 8), v
        self.R = tuning.rows_per_thread  # weight rows per thread (2 per m16 row tile)
        self.RT = self.R // 2  # m16 row tiles per warp
        self.BN = tuning.bn  # rows of N per CTA
        assert self.R in (2, 4) and (self.R == 4 or tuning.pipeline != "regs"), tuning
        self.v = v
        self.a_quant = v.a_kind != "bf16"
        self.b_bits = KINDS[v.b_kind]["bits"]
        self.b_block = KINDS[v.b_kind]["block"]
        self.se = steps_elems(v.b_kind)  # K elements per step
        self.e = self.se // 4  # K elements per thread per step (32 fp4 / 16 fp8)
        self.q = self.e // 8  # 8-element groups per thread per step
        self.c_dtype = OUT_DTYPES[v.out]
        self.fold = tuning.fold_scale and v.b_kind == "nvfp4"
        # MXFP4 weights: a CTA whose block scales are all at most 2 (e8m0 codes up to
        # MX_FOLD_MAX_CODE: real weights' scales) folds the bit trick's 2^126 into them, one
        # multiply per pair instead of two; every thread checks its share of the scales the CTA
        # streams before the first sub-chunk, one barrier ORs the answers (_mainloop_tma), and a
        # CTA holding a larger (or NaN) code runs the unfolded loop. Exact either way: the
        # products are the values.
        self.mx_fold = (tuning.fold_scale and decode_mx_fold(v.b_kind, v.nt)
                        and tuning.pipeline == "tma" and not tuning.probe)
        # A K range's last sub-chunk, where it holds fewer steps of K than the others, runs
        # apart and skips the steps past K (_sub_chunk_compute); with 2-step sub-chunks (the wide
        # tuning) there is one step at most to skip, and the second path spilled registers
        self.skip_steps = tuning.pipeline == "tma" and self.sub >= 4 and not tuning.probe
        # the main loops of the narrower row heights too, each CTA running the narrowest that
        # holds its rows: a grouped item's, or the call's in a pass (catalog/sm90.py:
        # GROUPED_ITEM_NTS, DENSE_PASS_NTS)
        self.item_nts = (decode_loop_nts(v.nt, self.grouped)
                         if tuning.pipeline == "tma" and not tuning.probe else (v.nt,))
        # chained (DecodeVariant.chained): launched with programmatic dependent launch behind the
        # activation's producer; waits for it after the first weight copies are issued
        self.chained = v.chained
        assert not self.chained or (tuning.pipeline == "tma" and not self.grouped), tuning
        # activation buffer: per step, per n8 tile, per group, 32 lanes x 16 bytes
        self.step_act_bytes = v.nt * self.q * 32 * 16
        self.buf_bytes = self.sub * self.step_act_bytes
        self.items = self.sub * v.nt * self.q * 32  # 16-byte staging items per sub-chunk
        # cp.async ring: per stage, per step, per row, per thread 16 weight bytes; per stage, per
        # step, per thread one 16-byte blocked-scale entry (the scales of its rows)
        self.ring_w = tuning.stages * self.sub * self.R * THREADS * 16
        self.ring_s = tuning.stages * self.sub * THREADS * 16
        # "tma" ring: per stage, per step, the CTA's BN rows x 64 bytes (one TMA box each; rows
        # past N and bytes past K arrive as zeros); per stage, per 128-row group, the sub-chunk's
        # blocked-scale tiles (one box of 4 x 128 bytes per tile)
        self.scale_tiles = self.sub * self.se // self.b_block // 4
        assert self.sub * self.se % (4 * self.b_block) == 0, "whole scale tiles per sub-chunk"
        if tuning.pipeline == "tma":
            assert tuning.stages >= 2, tuning
            self.groups = self.BN // 128  # 128-row scale groups per CTA (R = 4: 2, R = 2: 1)
            assert self.sub % tuning.box_steps == 0, tuning
            self.box_bytes = tuning.box_steps * STEP_BYTES  # bytes of each row per TMA box
            self.boxes = self.sub // tuning.box_steps  # weight boxes per sub-chunk
            self.ring_s = tuning.stages * self.groups * self.scale_tiles * 512
            w_tx = 0 if tuning.probe == "tmas" else self.sub * self.BN * STEP_BYTES
            s_tx = 0 if tuning.probe == "tmaw" else self.groups * self.scale_tiles * 512
            self.stage_tx = w_tx + s_tx
        # activation windows (bf16 activations only: quantized ones are converted while staged)
        self.win_bytes = tuning.act_window if not self.a_quant else 0
        assert not self.win_bytes or tuning.pipeline == "cpasync", tuning

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
        ws_ptr: cute.Pointer,
        m: cutlass.Int32,
        n: cutlass.Int32,
        k: cutlass.Int32,
        l: cutlass.Int32,
        a_e5m2: cutlass.Int32,
        b_e5m2: cutlass.Int32,
        splits: cutlass.Int32,
        stream: cuda.CUstream,
    ):
        total = l * m * n
        # finalize: 256 threads per CTA, one output per thread, or four from 128K outputs on
        # (fewer, fuller CTAs win there; small calls want every thread's loads in flight)
        per_thread = cutlass.Int32(1) + 3 * cutlass.Int32(total >= FIN_FOUR_FROM)
        ew_grid = cutlass.min((total + 256 * per_thread - 1) // (256 * per_thread), 2048)
        mchunks = (m + 8 * self.v.nt - 1) // (8 * self.v.nt)
        args = (a_ptr, b_ptr, sa_ptr, sb_ptr, c_ptr, alpha_ptr, ws_ptr, m, n, k, a_e5m2, b_e5m2,
                splits, mchunks)
        if cutlass.const_expr(self.tuning.pipeline == "tma"):
            kern = self.kernel_tma(*args, *self._tma_atoms(b_ptr, sb_ptr, n, k, l))
        else:
            kern = self.kernel(*args)
        kern.launch(
            # M chunks vary fastest: the CTAs that share a weight tile start together, so the
            # second and later chunks read the tile from L2 instead of HBM
            grid=[((n + self.BN - 1) // self.BN) * mchunks, splits, l],
            block=[THREADS, 1, 1],
            min_blocks_per_mp=self.tuning.min_blocks,
            # with min_blocks > 1 the DSL wants the carveout (else it probes a GPU at build time)
            preferred_smem_carveout=100 if self.tuning.pipeline != "regs" else None,
            stream=stream,
            use_pdl=self.chained,
        )
        self._launch_finalize(ws_ptr, c_ptr, alpha_ptr, total, splits, per_thread, ew_grid,
                              a_e5m2, stream)

    @cute.jit
    def _launch_finalize(self, ws_ptr, c_ptr, alpha_ptr, total, splits, per_thread, ew_grid,
                         a_e5m2, stream):
        """The finalize kernel after the main one, unless there is one K range (the main
        kernel wrote the output itself) or the caller adds the partials (bit 5). A chained
        variant has none: its caller always adds them (the handler refuses partials = 0 with
        several splits for it)."""
        if cutlass.const_expr(self.chained):
            return
        if (splits > 1) & (self._caller_adds_partials(a_e5m2) == 0):
            self.finalize_kernel(ws_ptr, c_ptr, alpha_ptr, total, splits, per_thread).launch(
                grid=[ew_grid, 1, 1], block=[256, 1, 1], stream=stream,
                # programmatic dependent launch: its CTAs are launched while the main kernel
                # runs and wait (griddepcontrol.wait) for it to finish and flush
                use_pdl=True)

    def _tma_atoms(self, b_ptr, sb_ptr, n, k, l):
        """TMA atoms (host side) for the weights, as (N, K bytes, L) in boxes of BN rows x one
        64-byte step, and for the blocked scales, as rows of 128 bytes in boxes of one tile."""
        g2s = cute.nvgpu.cpasync.CopyBulkTensorTileG2SOp()
        kb = cute.assume(k * self.b_bits // 8, divby=16)
        mB = cute.make_tensor(b_ptr, cute.make_layout((n, kb, l), stride=(kb, 1, n * kb)))
        tma_w, tW = cute.nvgpu.cpasync.make_tiled_tma_atom(
            g2s, mB, self._w_box_layout(), (self.BN, self.box_bytes))
        # scales as (128-byte rows of one group's K tiles, 128, groups x L): a tile past the
        # group's last one is out of bounds (zeros), never the next group's first tile
        sk4 = (k // self.b_block + 3) // 4
        mSB = cute.make_tensor(sb_ptr, cute.make_layout(
            (4 * sk4, 128, ((n + 127) // 128) * l), stride=(128, 1, sk4 * 512)))
        tma_s, tS = cute.nvgpu.cpasync.make_tiled_tma_atom(g2s, mSB, self._s_box_layout(),
                                                           (4, 128))
        return tma_w, tW, tma_s, tS

    def _w_box_layout(self):
        return cute.make_layout((self.BN, self.box_bytes), stride=(self.box_bytes, 1))

    def _s_box_layout(self):
        return cute.make_layout((4, 128), stride=(128, 1))

    @cute.kernel
    def finalize_kernel(self, ws_ptr: cute.Pointer, c_ptr: cute.Pointer,
                        alpha_ptr: cute.Pointer, total: cutlass.Int32, splits: cutlass.Int32,
                        per_thread: cutlass.Int32):
        """c = alpha * (sum of the split partials, in split order from +0.0: bitwise
        reproducible). Each thread owns `per_thread` (1 or 4) consecutive outputs (four: 16-byte
        loads and one vector store when total % 4 == 0 and c is 16-byte aligned, else element by
        element) and loads four splits' partials before adding them: this kernel is a few L2
        round trips long, so the loads must not wait for each other. A split past the last
        reads as +0.0, which leaves a sum from +0.0 bitwise unchanged (it never is -0.0)."""
        tid, _, _ = cute.arch.thread_idx()
        bid, _, _ = cute.arch.block_idx()
        nb, _, _ = cute.arch.grid_dim()
        if cutlass.const_expr(self.grouped):
            alpha = cutlass.Float32(1.0)  # the main kernel applied each expert's alpha
        else:
            # loaded early: its latency overlaps the wait; the partials are in true scale
            alpha = self._alpha(alpha_ptr, folded=False)
        cute.arch.griddepcontrol_wait()  # the main kernel's partials are complete and visible
        ws = ws_ptr.toint()
        c = c_ptr.toint()
        vec = cutlass.Int32((total % 4 == 0) & (c % 16 == 0) & (per_thread == 4))
        esize = self.c_dtype.width // 8
        for i in range((bid * 256 + tid) * per_thread, total, nb * 256 * per_thread):
            valid = cutlass.min(total - i, per_thread)
            sums = cute.make_rmem_tensor((4,), cutlass.Float32)
            sums.fill(0.0)
            for sp in range(0, splits, 4):
                parts = []
                for q in cutlass.range_constexpr(4):
                    here = cutlass.Int32(sp + q < splits)
                    parts.append(ldg4_f32(ws + (cutlass.Int64(sp + q) * total + i) * 4,
                                          vec * here, valid * here))
                for e in cutlass.range_constexpr(4):
                    sums[e] = (((sums[e] + parts[0][e]) + parts[1][e]) + parts[2][e]) + parts[3][e]
            stg4_out(self.v.out, c + cutlass.Int64(i) * esize, [sums[e] * alpha for e in range(4)],
                     vec, valid)

    # ------------------------------------------------------------------------------------------
    @cute.kernel
    def kernel(
        self,
        a_ptr: cute.Pointer,
        b_ptr: cute.Pointer,
        sa_ptr: cute.Pointer,
        sb_ptr: cute.Pointer,
        c_ptr: cute.Pointer,
        alpha_ptr: cute.Pointer,
        ws_ptr: cute.Pointer,
        m: cutlass.Int32,
        n: cutlass.Int32,
        k: cutlass.Int32,
        a_e5m2: cutlass.Int32,
        b_e5m2: cutlass.Int32,
        splits: cutlass.Int32,
        mchunks: cutlass.Int32,
    ):
        self._body(a_ptr, b_ptr, sa_ptr, sb_ptr, c_ptr, alpha_ptr, ws_ptr, m, n, k, a_e5m2,
                   b_e5m2, splits, mchunks, None)

    @cute.kernel
    def kernel_tma(
        self,
        a_ptr: cute.Pointer,
        b_ptr: cute.Pointer,
        sa_ptr: cute.Pointer,
        sb_ptr: cute.Pointer,
        c_ptr: cute.Pointer,
        alpha_ptr: cute.Pointer,
        ws_ptr: cute.Pointer,
        m: cutlass.Int32,
        n: cutlass.Int32,
        k: cutlass.Int32,
        a_e5m2: cutlass.Int32,
        b_e5m2: cutlass.Int32,
        splits: cutlass.Int32,
        mchunks: cutlass.Int32,
        tma_w: cute.CopyAtom,
        tW: cute.Tensor,
        tma_s: cute.CopyAtom,
        tS: cute.Tensor,
    ):
        self._body(a_ptr, b_ptr, sa_ptr, sb_ptr, c_ptr, alpha_ptr, ws_ptr, m, n, k, a_e5m2,
                   b_e5m2, splits, mchunks, (tma_w, tW, tma_s, tS))

    @cute.jit
    def _body(self, a_ptr, b_ptr, sa_ptr, sb_ptr, c_ptr, alpha_ptr, ws_ptr, m, n, k, a_e5m2,
              b_e5m2, splits, mchunks, tma, work=None):
        v = self.v
        nt, se, e = v.nt, self.se, self.e
        tid, _, _ = cute.arch.thread_idx()
        bxm, by, bz = cute.arch.block_idx()
        # the finalize kernel (launched with PDL) may start now: it waits for this grid's end
        cute.arch.griddepcontrol_launch_dependents()
        bx = bxm // mchunks  # row group of N
        warp = tid // 32
        lane = tid % 32
        g = lane // 4
        t = lane % 4
        li = bz
        m0 = (bxm % mchunks) * (8 * nt)
        rows = None  # grouped: (the activation's batch entry, end row) of the CTA's rows
        smem = cutlass.memory.SmemAllocator()
        if cutlass.const_expr(self.grouped):
            # work item (expert, first row, end row) of the table: rows of the (M, K) activation
            # and of the (M, N) output; expert -1: rows no group owns, written as zeros. The
            # entry is clamped so that no table can make the kernel read or write out of
            # bounds: rows to [0, M), a computed item to 8 nt rows, an expert past G computes
            # nothing.
            # Index mode (bit 2 of a_e5m2): the table is one int32, the expert every row
            # belongs to (a layer of a stack), clamped to [0, G); item i is rows
            # [8 nt i, 8 nt (i + 1)). Selected arithmetically: no branch, no read past the
            # one-int32 buffer.
            # Sizes mode (bit 3): the table is the G raw group sizes (groups from row 0); warp 0
            # makes the CTA's entry from them (kernels/grouped_work.py) and hands it over in
            # shared memory: every CTA of the grid reads the same few lines of the sizes, and
            # one warp's reads per CTA instead of eight keep those lines' L2 slices free.
            # Index mode keeps an item's CTAs of N adjacent (items fastest: the items of a
            # layer share its weight tiles, read from L2 by the second); the other modes put
            # N tiles fastest, so that the entries past the real items, which exit at once,
            # run last instead of between real ones.
            # A CTA runs `per_cta` adjacent tiles of N of its item (bits 8-11 of a_e5m2: per_cta
            # - 1) as one stream: the ring runs on from one tile's weights to the next, and the
            # entry, the alpha and the ring's set-up are paid once per CTA, not once per tile.
            items_ptr, groups = work
            indexed = (a_e5m2 >> 2) & 1
            per_cta = self._tiles_per_cta(a_e5m2)
            tiles = (n + self.BN - 1) // self.BN
            cta_tiles = tiles
            if per_cta > 1:  # a division less on the way to the entry of a one-tile CTA
                cta_tiles = (tiles + per_cta - 1) // per_cta
            item = bxm // cta_tiles
            bx = (bxm % cta_tiles) * per_cta
            if indexed == 1:
                item = bxm % mchunks
                bx = (bxm // mchunks) * per_cta
            n_tiles = cutlass.min(per_cta, tiles - bx)
            entry = items_ptr.toint() + cutlass.Int64(item * (1 - indexed)) * 12
            expert = cutlass.Int32(0)
            first = cutlass.Int32(0)
            end = cutlass.Int32(0)
            entry_slot = smem.allocate_array(cutlass.Int32, 4, byte_alignment=16).toint()
            if ((a_e5m2 >> 3) & 1) == 1:
                if warp == 0:
                    e, f, en, writes = item_from_sizes(items_ptr.toint(), groups, m, 8 * nt,
                                                       item, mchunks, lane)
                    if writes == 1:
                        sts_v4(entry_slot, [e, f, en, cutlass.Int32(0)])
                cute.arch.sync_threads()
                expert, first, end, _ = lds_v4(entry_slot)
            else:
                expert = ldg_bytes(entry, 1, 4)
                expert = expert + indexed * (
                    cutlass.min(cutlass.max(expert, 0), groups - 1) - expert)
                first = ldg_bytes(entry + 4, 1 - indexed, 4) + indexed * (item * (8 * nt))
                end = ldg_bytes(entry + 8, 1 - indexed, 4) + indexed * ((item + 1) * (8 * nt))
            m0 = cutlass.min(cutlass.max(first, 0), m)
            m_end = cutlass.min(cutlass.max(end, m0), m)
            m_end = m_end - cutlass.Int32(expert >= 0) * cutlass.max(0, m_end - m0 - 8 * nt)
            expert = expert - cutlass.Int32(expert >= groups) * (expert + 2)  # past G: -2
            li = cutlass.max(expert, 0)
            rows = (cutlass.Int32(0), m_end)
            # the expert's alpha (bit 4: one alpha for every expert), loaded now: its latency
            # hides behind the main loop instead of adding to the epilogue
            expert_alpha = self._alpha(alpha_ptr, li * (1 - ((a_e5m2 >> 4) & 1)))
            if (indexed & self._caller_adds_partials(a_e5m2) & cutlass.Int32(splits > 1)) == 1:
                # index mode leaving its split partials (bit 5): in true scale, as the dense
                # kernel's, so that the caller applies the layer's alpha to either the same way
                expert_alpha = cutlass.Float32(FOLD_ALPHA if self.fold else 1.0)

        act_base = smem.allocate(2 * (self.win_bytes or self.buf_bytes),
                                 byte_alignment=128).toint()

        a_addr = a_ptr.toint()
        b_addr = b_ptr.toint()
        sa_addr = sa_ptr.toint()
        sb_addr = sb_ptr.toint()
        ws_addr = ws_ptr.toint()

        # ---- K range of this CTA (whole sub-chunks; only the last range may be short) -------
        chunk = self.sub * se
        k_chunks = (k + chunk - 1) // chunk
        per = (k_chunks + splits - 1) // splits
        k_begin = by * per * chunk
        k_end = cutlass.min(k, k_begin + per * chunk)
        n_sub = cutlass.max(0, (k_end - k_begin + chunk - 1) // chunk)
        if cutlass.const_expr(self.grouped):
            # empty item: no K loop. Index mode's items are never empty of an expert, and its
            # activation loads (predicated on n_sub) need not wait for the index to arrive.
            if indexed == 0:
                n_sub = n_sub * cutlass.Int32((m_end > m0) & (expert >= 0))
            else:
                n_sub = n_sub * cutlass.Int32(m_end > m0)

        # ---- per-row constants (R rows per thread: R/2 row tiles x {g, g+8}) ------------------
        b_pitch = cutlass.Int64(k * self.b_bits // 8)
        sk4_b = (k // self.b_block + 3) // 4
        nb128 = (n + 127) // 128
        # Row mapping (R = 4): warp w owns, in the 128-row group G = w // 4 of the CTA, the rows
        # i0 + g + 32 j (i0 = 8 (w % 4), g = lane // 4, j = 0..3 = 2 rt + r2). So a thread's four
        # rows share one 16-byte entry of the blocked scale layout ([n % 32] holds the four
        # 32-row quarters x 4 scale columns): one 16-byte load per step brings all its scales,
        # and a warp's scale loads cover whole 128-byte lines. R = 2: one 128-row group per CTA,
        # warps w and w + 4 split its quarters (quarters 2h + j, h = (w // 4) % 2).
        row_addr = []  # byte address of the row start (+16 t)
        for j in cutlass.range_constexpr(self.R):
            row = self._row(bx, warp, g, j)
            row = cutlass.min(row, n - 1)  # rows past N: read row N-1, never stored
            row_addr.append(b_addr + (cutlass.Int64(li) * n + row) * b_pitch + t * 16)
        n128 = cutlass.min(bx * (self.BN // 128) + self._group_of(warp), nb128 - 1)  # past N: any
        sent_addr = sb_addr + cutlass.Int64(
            ((li * nb128 + n128) * sk4_b) * 512 + ((warp % 4) * 8 + g) * 16)

        # ---- run-time fp8 flavour: (shift, mask, power-of-two fix) of the bit trick ------------
        b_fp8 = self._fp8_params(b_e5m2)
        # a_e5m2: bit 0 = A's fp8 flavour, bit 1 = A's scales in the plain layout
        a_fp8 = self._fp8_params(a_e5m2 & 1)
        a_scales = (sa_addr, (a_e5m2 >> 1) & 1)

        acc = cute.make_rmem_tensor((self.RT * nt * 4,), cutlass.Float32)
        acc.fill(0.0)
        if cutlass.const_expr(self.grouped):
            # the tiles of N after the first are the ring's sub-chunks n_sub, n_sub + 1, ...; each
            # tile's outputs are written after its last sub-chunk (zeros or nothing for an item
            # with no K loop)
            epilogue = (c_ptr, expert_alpha, ws_ptr, expert, m, n, m0, m_end, by, splits, tid,
                        warp, g, t)
            self._mainloop_tma(acc, act_base, smem, tma, nb128, bx, li, m, m0, k, a_addr,
                               a_scales, k_begin, k_end, n_sub, tid, lane, warp, g, t, a_fp8,
                               b_fp8, rows=rows, tiles=(n_tiles, epilogue), sb_addr=sb_addr)
        elif cutlass.const_expr(self.tuning.pipeline == "tma"):
            self._mainloop_tma(acc, act_base, smem, tma, nb128, bx, li, m, m0, k, a_addr,
                               a_scales, k_begin, k_end, n_sub, tid, lane, warp, g, t, a_fp8,
                               b_fp8, rows=rows, sb_addr=sb_addr)
        elif cutlass.const_expr(self.tuning.pipeline == "regs"):
            self._mainloop_regs(acc, act_base, row_addr, sent_addr, a_addr, a_scales, li, m, m0,
                                k, k_begin, k_end, n_sub, tid, lane, t, a_fp8, b_fp8)
        else:
            ring_w = smem.allocate(self.ring_w, byte_alignment=128).toint()
            ring_s = smem.allocate(self.ring_s, byte_alignment=128).toint()
            if cutlass.const_expr(self.win_bytes > 0):
                self._mainloop_window(acc, act_base, ring_w, ring_s, row_addr, sent_addr, a_addr,
                                      li, m, m0, k, k_begin, k_end, n_sub, tid, lane, g, t,
                                      b_fp8)
            else:
                self._mainloop_cpasync(acc, act_base, ring_w, ring_s, row_addr, sent_addr,
                                       a_addr, a_scales, li, m, m0, k, k_begin, k_end, n_sub, tid,
                                       lane, t, a_fp8, b_fp8)

        # ---- epilogue: this split's partial -> ws[split, l, m, n] (plain stores, in true scale:
        # times FOLD_ALPHA where the nvfp4 scales carry the fold, an exact power of two; every
        # split writes its slice, an empty K range writes zeros; the caller or finalize_kernel
        # adds the splits in split order and applies alpha).
        # One split: c[l, m, n] = alpha * acc here (what finalize would compute from one
        # partial, bitwise except that finalize's sum from +0.0 turns a -0.0 into +0.0) and the
        # launcher skips finalize_kernel. The grouped kernel wrote its tiles' outputs in
        # _mainloop_tma (_grouped_epilogue) ----
        if cutlass.const_expr(not self.grouped):
            _, _, nl = cute.arch.grid_dim()  # L
            outputs = self._outputs(bx, warp, g, t, m0)
            if splits == 1:
                alpha = self._alpha(alpha_ptr)
                mC = cute.make_tensor(c_ptr, cute.make_layout(nl * m * n))
                for row, mm, j in outputs:
                    if (row < n) & (mm < m):
                        mC[(li * m + mm) * n + row] = self.c_dtype(acc[j] * alpha)
            else:
                split_base = cutlass.Int64(by) * nl * m * n
                for row, mm, j in outputs:
                    addr = ws_addr + (split_base + (cutlass.Int64(li) * m + mm) * n + row) * 4
                    part = acc[j]
                    if cutlass.const_expr(self.fold):
                        part = part * cutlass.Float32(FOLD_ALPHA)
                    stg_f32(addr, part, cutlass.Int32((row < n) & (mm < m)))

    @cute.jit
    def _grouped_epilogue(self, acc, bx, c_ptr, alpha, ws_ptr, expert, m, n, m0, m_end, by,
                          splits, tid, warp, g, t):
        """Grouped calls, tile bx of N: the item's rows [m0, m_end) of the (M, N) output (one
        split) or of the split's (M, N) workspace slice, times the expert's alpha (alpha[expert],
        loaded at the start: the finalize kernel then only adds). A zero item (expert -1) writes
        zeros to its rows in the tile's columns, so that every row no group owns reads as zero;
        an invalid one (-2) writes nothing."""
        outputs = self._outputs(bx, warp, g, t, m0)
        mC = cute.make_tensor(c_ptr, cute.make_layout(m * n))
        split_base = cutlass.Int64(by) * m * n
        ws_addr = ws_ptr.toint()
        for row, mm, j in outputs:
            ok = (row < n) & (mm < m_end)
            if splits == 1:
                if ok:
                    mC[mm * n + row] = self.c_dtype(acc[j] * alpha)
            else:
                stg_f32(ws_addr + (split_base + cutlass.Int64(mm) * n + row) * 4,
                        acc[j] * alpha, cutlass.Int32(ok))
        if expert == -1:
            for idx in range(tid, (m_end - m0) * self.BN, THREADS):
                mm = m0 + idx // self.BN
                row = bx * self.BN + idx % self.BN
                if row < n:
                    if splits == 1:
                        mC[mm * n + row] = self.c_dtype(0.0)
                    else:
                        stg_f32(ws_addr + (split_base + cutlass.Int64(mm) * n + row) * 4,
                                cutlass.Float32(0.0), cutlass.Int32(1))

    def _alpha(self, alpha_ptr, index=None, folded=True):
        """alpha (alpha[index] of a per-expert table) from device memory, times FOLD_ALPHA when
        the nvfp4 scales carry the fold (`folded`: for the accumulators, not for partials
        already stored in true scale)."""
        if cutlass.const_expr(index is None):
            alpha = ldg_f32(alpha_ptr.toint())
        else:
            alpha = ldg_f32(alpha_ptr.toint() + cutlass.Int64(index) * 4)
        if cutlass.const_expr(self.fold and folded):
            alpha = alpha * cutlass.Float32(FOLD_ALPHA)
        return alpha

    def _outputs(self, bx, warp, g, t, m0):
        """(row of N, row of M, accumulator index) of each output this thread holds: the m16n8
        accumulator fragment (rows g, g + 8; columns 2t, 2t + 1) of each row tile and n8 tile."""
        nt = self.v.nt
        return [(self._row(bx, warp, g, 2 * rt + x // 2), m0 + i * 8 + 2 * t + (x % 2),
                 (rt * nt + i) * 4 + x)
                for rt in range(self.RT) for i in range(nt) for x in range(4)]

    @cute.jit
    def _mainloop_regs(self, acc, act_base, row_addr, sent_addr, a_addr, a_scales, li, m, m0, k,
                       k_begin, k_end, n_sub, tid, lane, t, a_fp8, b_fp8):
        """Tuning "regs": weights straight into registers, one sub-chunk ahead."""
        se = self.se
        chunk = self.sub * se
        # registers: weights and raw scale bytes of the current and the next sub-chunk
        n_w = self.sub * 4 * 4  # steps x rows x 4 words
        n_s = self.sub * 4
        w_cur = cute.make_rmem_tensor((n_w,), cutlass.Int32)
        w_nxt = cute.make_rmem_tensor((n_w,), cutlass.Int32)
        s_cur = cute.make_rmem_tensor((n_s,), cutlass.Int32)
        s_nxt = cute.make_rmem_tensor((n_s,), cutlass.Int32)
        act_raw = cute.make_rmem_tensor((self._act_per_thread * self._act_words,), cutlass.Int32)

        # ---- prefetch sub-chunk 0 ------------------------------------------------------------
        self._load_weights(w_nxt, s_nxt, row_addr, sent_addr, k_begin, k_end, t, n_sub > 0)
        self._load_act(act_raw, a_addr, a_scales, li, m, m0, k, k_begin, k_end, tid, n_sub > 0)

        for it in range(n_sub):
            for i in cutlass.range_constexpr(n_w):
                w_cur[i] = w_nxt[i]
            for i in cutlass.range_constexpr(n_s):
                s_cur[i] = s_nxt[i]
            kc = k_begin + it * chunk
            # issue the next sub-chunk's loads before this one's work (their latency overlaps it)
            self._load_weights(w_nxt, s_nxt, row_addr, sent_addr, kc + chunk, k_end, t,
                               it + 1 < n_sub)
            buf = act_base + (it % 2) * self.buf_bytes
            self._store_act(buf, act_raw, tid, a_fp8)  # loaded one iteration ago
            self._load_act(act_raw, a_addr, a_scales, li, m, m0, k, kc + chunk, k_end, tid,
                           it + 1 < n_sub)
            cute.arch.sync_threads()
            # ---- compute: per step: dequantize + MMAs for both row tiles
            for c in cutlass.range_constexpr(self.sub):
                w = [[w_cur[(c * 4 + r) * 4 + x] for x in range(4)] for r in range(4)]
                sw = [s_cur[c * 4 + x] for x in range(4)]
                self._step_compute(w, sw, t, buf, c, lane, acc, b_fp8)

    @cute.jit
    def _mainloop_cpasync(self, acc, act_base, ring_w, ring_s, row_addr, sent_addr, a_addr,
                          a_scales, li, m, m0, k, k_begin, k_end, n_sub, tid, lane, t, a_fp8,
                          b_fp8):
        """Tuning "cpasync": weights and scale entries by cp.async into a per-thread shared-memory
        ring `stages` sub-chunks deep. Each thread reads back only what it copied itself, so
        cp.async.wait_group alone orders it; the barrier is for the shared activations."""
        se = self.se
        S = self.tuning.stages
        chunk = self.sub * se
        act_raw = cute.make_rmem_tensor((self._act_per_thread * self._act_words,), cutlass.Int32)
        self._load_act(act_raw, a_addr, a_scales, li, m, m0, k, k_begin, k_end, tid, n_sub > 0)
        for j in cutlass.range_constexpr(S - 1):  # prologue: sub-chunks 0 .. S-2
            self._issue_copies(ring_w, ring_s, j, row_addr, sent_addr, k_begin + j * chunk,
                               k_end, t, tid, j < n_sub)
        for it in range(n_sub):
            j = it + S - 1
            self._issue_copies(ring_w, ring_s, j % S, row_addr, sent_addr, k_begin + j * chunk,
                               k_end, t, tid, j < n_sub)
            kc = k_begin + it * chunk
            buf = act_base + (it % 2) * self.buf_bytes
            self._store_act(buf, act_raw, tid, a_fp8)  # loaded one iteration ago
            self._load_act(act_raw, a_addr, a_scales, li, m, m0, k, kc + chunk, k_end, tid,
                           it + 1 < n_sub)
            cp_async_wait(S - 1)  # this thread's copies of sub-chunk `it` have landed
            cute.arch.sync_threads()  # everyone's activations are staged
            stage = it % S
            for c in cutlass.range_constexpr(self.sub):
                w, sw = self._ring_words(ring_w, ring_s, stage, c, tid)
                self._step_compute(w, sw, t, buf, c, lane, acc, b_fp8)
        cp_async_wait(0)

    @cute.jit
    def _mainloop_tma(self, acc, act_base, smem, tma, nb128, bx, li, m, m0, k, a_addr,
                      a_scales, k_begin, k_end, n_sub, tid, lane, warp, g, t, a_fp8, b_fp8,
                      rows=None, tiles=None, sb_addr=None):
        """Tuning "tma": warp 0 loads each sub-chunk's weights (TMA boxes of the CTA's rows x
        box_steps 64-byte steps) and scale tiles into a ring `stages` deep, completing on the
        stage's mbarrier: a few instructions per sub-chunk instead of five 16-byte copies per
        thread and step. The CTA barrier that stages the activations also tells that the slot
        being refilled has been read by everyone. (Rows of 128 / 256 bytes cost a 2-way bank
        conflict in the 16-byte reads; the longer row segments more than pay for it.)
        rows = (the activation's batch entry, end row) when they are not (li, m): grouped.
        tiles = (n_tiles, epilogue arguments) when the CTA runs tiles bx .. bx + n_tiles - 1 of
        N (grouped): one stream of n_tiles x n_sub sub-chunks, the activation's sub-chunks
        read again for each tile, and each tile's outputs written (_grouped_epilogue) as its
        last sub-chunk is done. sb_addr: the weights' block scales in global memory (mx_fold's
        check)."""
        tma_w, tW, tma_s, tS = tma
        li_a, m_end = rows if rows is not None else (li, None)
        total = n_sub  # sub-chunks streamed
        at = None  # grouped: (sub-chunk in its tile, tile) of sub-chunk 0, then counted on
        if cutlass.const_expr(tiles is not None):
            total = n_sub * tiles[0]
            at = (cutlass.Int32(0), cutlass.Int32(0))
        S = self.tuning.stages
        T = self.scale_tiles
        chunk = self.sub * self.se
        if warp == 0:
            cute.nvgpu.cpasync.prefetch_descriptor(tma_w)
            cute.nvgpu.cpasync.prefetch_descriptor(tma_s)
        ring_w = smem.allocate_array(cutlass.Uint8, self.ring_w, byte_alignment=1024)
        ring_s = smem.allocate_array(cutlass.Uint8, self.ring_s, byte_alignment=128)
        bars = smem.allocate_array(cutlass.Int64, S, byte_alignment=8)
        if tid == 0:
            for j in cutlass.range_constexpr(S):
                mbar_init(bars.toint() + 8 * j, 1)  # thread 0's arrival + the bytes
            mbar_init_fence()
        cute.arch.sync_threads()
        # TMA views: (box, tiles of N, steps of K, L) and (box, scale tiles)
        one = cute.make_layout(1)
        sW = cute.make_tensor(ring_w, cute.make_layout(
            (self.BN, self.box_bytes, S * self.boxes),
            stride=(self.box_bytes, 1, self.BN * self.box_bytes)))
        gW = cute.local_tile(tW, (self.BN, self.box_bytes), (None, None, None))
        tWs, tWg = cute.nvgpu.cpasync.tma_partition(
            tma_w, 0, one, cute.group_modes(sW, 0, 2), cute.group_modes(gW, 0, 2))
        sS = cute.make_tensor(ring_s, cute.make_layout((4, 128, S * self.groups * T),
                                                        stride=(128, 1, 512)))
        gS = cute.local_tile(tS, (4, 128), (None, 0, None))
        tSs, tSg = cute.nvgpu.cpasync.tma_partition(
            tma_s, 0, one, cute.group_modes(sS, 0, 2), cute.group_modes(gS, 0, 2))
        groups = self._scale_groups(bx, nb128)

        views = (tma_w, tWg, tWs, tma_s, tSg, tSs, bars, groups)
        act_raw = cute.make_rmem_tensor((self._act_per_thread * self._act_words,), cutlass.Int32)
        if cutlass.const_expr(not self.chained):
            self._load_act(act_raw, a_addr, a_scales, li_a, m, m0, k, k_begin, k_end, tid,
                           n_sub > 0, m_end)
        if warp == 0:  # the DSL's TMA copy elects one lane itself: the whole warp issues it
            ahead = at
            for j in cutlass.range_constexpr(S - 1):  # prologue: sub-chunks 0 .. S-2
                if j < total:
                    self._issue_tma(views, j, k_begin, bx, li, nb128, lane, ahead)
                if cutlass.const_expr(tiles is not None):
                    ahead = self._next_sub_chunk(ahead, n_sub)
        if cutlass.const_expr(self.chained):
            # the weights are already on their way; the activation, its scales (and alpha, read
            # in the epilogue) are the producer's: wait until it is complete and its writes
            # are visible
            cute.arch.griddepcontrol_wait()
            self._load_act(act_raw, a_addr, a_scales, li_a, m, m0, k, k_begin, k_end, tid,
                           n_sub > 0, m_end)
        run = (views, ring_w.toint(), ring_s.toint(), bars, act_raw, act_base, acc, a_addr,
               a_scales, li_a, m, m0, k, k_begin, k_end, m_end, bx, li, nb128, n_sub, total,
               tid, lane, warp, g, t, a_fp8, b_fp8)
        rows_end = m_end  # the CTA's rows are [m0, rows_end): a grouped item's, or the call's
        if cutlass.const_expr(m_end is None):
            rows_end = m
        if cutlass.const_expr(self.mx_fold):
            # the whole stream on one of two loops, the same for every thread of the CTA (one
            # check of its block scales, their loads in flight beside the ring's first copies;
            # a branch per sub-chunk instead made ptxas merge both paths into one predicated
            # block, every MMA issued twice)
            past = self._scales_past_fold(sb_addr, bx, tiles[0] if tiles is not None else 1, li,
                                          nb128, k, k_begin, k_end, n_sub, tid)
            if sync_threads_or(past) == 0:
                self._tma_stream_rows(run, acc, bx, n_sub, total, tiles, k_begin, k_end, chunk,
                                      True, m0, rows_end)
            else:
                self._tma_stream_rows(run, acc, bx, n_sub, total, tiles, k_begin, k_end, chunk,
                                      False, m0, rows_end)
        else:
            self._tma_stream_rows(run, acc, bx, n_sub, total, tiles, k_begin, k_end, chunk,
                                  self.fold, m0, rows_end)

    @cute.jit
    def _tma_stream_rows(self, run, acc, bx, n_sub, total, tiles, k_begin, k_end, chunk, fold,
                         m0, m_end, nts=None):
        """_tma_stream on the main loop of the narrowest row height of `nts` (default
        self.item_nts; ascending, the last the variant's own) that holds the CTA's rows
        [m0, m_end): the same for every thread, one comparison per narrower height, each path
        its own loop."""
        if cutlass.const_expr(nts is None):
            nts = self.item_nts
        if cutlass.const_expr(len(nts) == 1):
            self._tma_stream(run, acc, bx, n_sub, total, tiles, k_begin, k_end, chunk, fold)
        else:
            if m_end - m0 <= 8 * nts[0]:
                self._tma_stream(run, acc, bx, n_sub, total, tiles, k_begin, k_end, chunk,
                                 fold, nts[0])
            else:
                self._tma_stream_rows(run, acc, bx, n_sub, total, tiles, k_begin, k_end, chunk,
                                      fold, m0, m_end, nts[1:])

    @cute.jit
    def _tma_stream(self, run, acc, bx, n_sub, total, tiles, k_begin, k_end, chunk, fold,
                    nt=None):
        """_mainloop_tma's `total` sub-chunks (run: its state), converted with `fold`
        (_step_compute) and multiplied into the first `nt` n8 tiles (default all): one tile's,
        or (tiles) each tile's n_sub followed by its outputs."""
        if cutlass.const_expr(tiles is None):
            self._tma_sub_chunks(run, total, k_begin, k_end, chunk, fold, nt)
        elif tiles[0] == 1:  # one tile: the dense kernel's loop, then the tile's outputs
            self._tma_sub_chunks(run, total, k_begin, k_end, chunk, fold, nt)
            self._grouped_epilogue(acc, bx, *tiles[1])
        else:
            # tile by tile: each tile's outputs are written between its last sub-chunk and the
            # next tile's first, outside the sub-chunk loop (whose body stays the dense one's)
            partial = self._partial_last(k_begin, k_end, n_sub, chunk)
            for tile in range(tiles[0]):
                for sub in range(n_sub - partial):
                    nxt = self._next_sub_chunk((sub, tile), n_sub)
                    self._tma_sub_chunk(run, tile * n_sub + sub, k_begin + sub * chunk,
                                        k_begin + nxt[0] * chunk, nxt, fold, nt=nt)
                if cutlass.const_expr(self.skip_steps):
                    if partial > 0:  # the tile's last sub-chunk holds fewer steps of K
                        sub = n_sub - 1
                        nxt = self._next_sub_chunk((sub, tile), n_sub)
                        self._tma_sub_chunk(run, tile * n_sub + sub, k_begin + sub * chunk,
                                            k_begin + nxt[0] * chunk, nxt, fold, last=True,
                                            nt=nt)
                self._grouped_epilogue(acc, bx + tile, *tiles[1])
                acc.fill(0.0)

    @cute.jit
    def _tma_sub_chunks(self, run, total, k_begin, k_end, chunk, fold, nt=None):
        """Sub-chunks 0 .. total - 1 of one tile of N, one after the other (_tma_sub_chunk); a
        last one that holds fewer steps of K than a sub-chunk runs apart, skipping the rest."""
        partial = self._partial_last(k_begin, k_end, total, chunk)
        for it in range(total - partial):
            kc = k_begin + it * chunk
            self._tma_sub_chunk(run, it, kc, kc + chunk, fold=fold, nt=nt)
        if cutlass.const_expr(self.skip_steps):
            if partial > 0:
                kc = k_begin + (total - 1) * chunk
                self._tma_sub_chunk(run, total - 1, kc, kc + chunk, fold=fold, last=True, nt=nt)

    def _partial_last(self, k_begin, k_end, n_sub, chunk):
        """1 when there are sub-chunks (n_sub > 0) and the last of them from k_begin ends past
        k_end (it holds fewer steps of K than a sub-chunk) and the kernel skips steps
        (self.skip_steps), else 0. Only such a sub-chunk takes the path that skips steps: a
        whole one keeps the main loop's schedule, whose steps overlap. (An empty K range, a
        split past the end of a K that is not a whole number of sub-chunks, begins past k_end:
        it has no last sub-chunk.)"""
        if cutlass.const_expr(not self.skip_steps):
            return 0
        return cutlass.Int32(k_begin + n_sub * chunk > k_end) * cutlass.Int32(n_sub > 0)

    @cute.jit
    def _tma_sub_chunk(self, run, it, kc, kn, nxt=None, fold=None, last=False, nt=None):
        """Sub-chunk `it` of the TMA main loop (_mainloop_tma's state in `run`): stage its
        activation (loaded one sub-chunk ago) and load the next one's (K offset kn), wait for its
        weights, refill the slot the sub-chunk before it used with sub-chunk it + S - 1, and
        compute. nxt = the position (sub-chunk in its tile, tile) of sub-chunk it + 1 when the
        CTA runs several tiles of N. fold: _step_compute's (default self.fold). last: the last
        sub-chunk of a tile's K range, whose steps past the range's end (TMA zeros) are
        skipped. nt: the n8 tiles multiplied (_step_compute)."""
        (views, ring_w, ring_s, bars, act_raw, act_base, acc, a_addr, a_scales, li_a, m, m0, k,
         k_begin, k_end, m_end, bx, li, nb128, n_sub, total, tid, lane, warp, g, t, a_fp8,
         b_fp8) = run
        S = self.tuning.stages
        buf = act_base + (it % 2) * self.buf_bytes
        self._store_act(buf, act_raw, tid, a_fp8)  # loaded one iteration ago
        self._load_act(act_raw, a_addr, a_scales, li_a, m, m0, k, kn, k_end, tid,
                       it + 1 < total, m_end)
        stage = it % S
        if cutlass.const_expr(self.tuning.probe not in ("nowait", "notma")):
            mbar_wait(bars.toint() + 8 * stage, (it // S) % 2)  # sub-chunk `it` has landed
        # everyone's activations are staged, and everyone is done with sub-chunk it - 1,
        # whose slot the next copies refill
        cute.arch.sync_threads()
        if warp == 0:
            if it + S - 1 < total:
                ahead = nxt
                for _ in cutlass.range_constexpr(S - 2 if nxt is not None else 0):
                    ahead = self._next_sub_chunk(ahead, n_sub)
                self._issue_tma(views, it + S - 1, k_begin, bx, li, nb128, lane, ahead)
        steps = None
        if cutlass.const_expr(last):  # steps holding elements of the K range (1 .. self.sub)
            steps = (k_end - kc + self.se - 1) // self.se
        self._sub_chunk_compute(ring_w, ring_s, stage, buf, warp, g, t, lane, acc, b_fp8, fold,
                                steps, nt)

    @cute.jit
    def _sub_chunk_compute(self, ring_w, ring_s, stage, buf, warp, g, t, lane, acc, b_fp8, fold,
                           steps=None, nt=None):
        """The steps of the sub-chunk in ring stage `stage` (fold: the scales carry the bit
        trick's offset, _step_compute). steps: how many hold elements of K (None: all); each
        later one runs as a loop of zero or one pass whose count the compiler cannot see, so it
        is branched over, not issued predicated off (ptxas predicates an `if` of this size)."""
        for c in cutlass.range_constexpr(self.sub):
            if cutlass.const_expr(steps is None or c == 0):
                self._sub_chunk_step(ring_w, ring_s, stage, buf, warp, g, t, lane, acc, b_fp8,
                                     fold, c, nt)
            else:
                for _ in cutlass.range(opaque_i32(cutlass.Int32(c < steps)), unroll=1):
                    self._sub_chunk_step(ring_w, ring_s, stage, buf, warp, g, t, lane, acc,
                                         b_fp8, fold, c, nt)

    @cute.jit
    def _sub_chunk_step(self, ring_w, ring_s, stage, buf, warp, g, t, lane, acc, b_fp8, fold, c,
                        nt=None):
        """Step c of the sub-chunk in ring stage `stage` (_sub_chunk_compute)."""
        w, sw = self._tma_words(ring_w, ring_s, stage, c, warp, g, t)
        if cutlass.const_expr(self.tuning.probe != "nocompute"):
            self._step_compute(w, sw, t, buf, c, lane, acc, b_fp8, fold=fold, nt=nt)
        else:  # keep the shared-memory reads: fold them into one accumulator
            acc[0] += cutlass.Float32(w[0][0] ^ w[1][1] ^ w[2][2] ^ w[3][3] ^ sw[0])

    @cute.jit
    def _scales_past_fold(self, sb_addr, bx, n_tiles, li, nb128, k, k_begin, k_end, n_sub, tid):
        """Nonzero iff a block scale the CTA streams is above MX_FOLD_MAX_CODE: the scale tiles
        of its tiles' 128-row groups over its K range (each group's a contiguous run of 16-byte
        entries, a thread's share of them), MX_FOLD_LOADS loads in flight per thread at a time."""
        sk4_b = (k // self.b_block + 3) // 4
        kt0 = k_begin // (4 * self.b_block)
        kt1 = (k_end + 4 * self.b_block - 1) // (4 * self.b_block)
        per_group = (kt1 - kt0) * 32  # 16-byte entries of a group's K range
        total = per_group * (n_tiles * self.groups) * cutlass.Int32(n_sub > 0)
        past = cutlass.Int32(0)
        for j0 in range(tid, total, MX_FOLD_LOADS * THREADS):
            words = []
            for u in cutlass.range_constexpr(MX_FOLD_LOADS):
                j = j0 + u * THREADS
                grp = j // per_group
                n128 = cutlass.min(bx * self.groups + grp, nb128 - 1)
                addr = sb_addr + (cutlass.Int64(li * nb128 + n128) * sk4_b + kt0) * 512 + (
                    j - grp * per_group) * 16
                words += ldg_v4(addr, cutlass.Int32(j < total))
            past = past | bytes_above_mx_fold(words)
        return past

    @staticmethod
    def _caller_adds_partials(a_e5m2):
        """1 when the caller adds the split partials (bit 5 of a_e5m2), else 0."""
        return (a_e5m2 >> 5) & 1

    @staticmethod
    def _tiles_per_cta(a_e5m2):
        """Adjacent tiles of N per CTA of the grouped kernel: bits 8-11 of a_e5m2, plus 1."""
        return ((a_e5m2 >> 8) & 15) + 1

    def _scale_groups(self, bx, nb128):
        """The 128-row scale groups of tile bx of N (clamped to the last one past N)."""
        return [cutlass.min(bx * self.groups + x, nb128 - 1) for x in range(self.groups)]

    @staticmethod
    def _next_sub_chunk(at, n_sub):
        """(sub-chunk in its tile, tile) of the sub-chunk after `at`, for n_sub per tile."""
        sub, tile = at
        wrap = cutlass.Int32(sub + 1 == n_sub)
        return sub + 1 - wrap * n_sub, tile + wrap

    @cute.jit
    def _issue_tma(self, views, j, k_begin, bx, li, nb128, lane, at=None):
        """Warp 0: TMA sub-chunk j (its weight steps and scale tiles) into ring slot j % S. Lane
        0 announces the bytes first (its copies follow in program order). at = (sub, tile) for a
        CTA over several tiles of N: sub-chunk j is sub-chunk `sub` of tile bx + tile."""
        tma_w, tWg, tWs, tma_s, tSg, tSs, bars, groups = views
        S = self.tuning.stages
        T = self.scale_tiles
        slot = j % S
        if cutlass.const_expr(at is not None):
            bx = bx + at[1]
            j = at[0]
            groups = self._scale_groups(bx, nb128)
        kc = k_begin + j * self.sub * self.se
        bar = bars + slot
        probe = self.tuning.probe
        if cutlass.const_expr(probe != "notma"):
            if lane == 0:
                mbar_arrive_expect_tx(bars.toint() + 8 * slot, self.stage_tx)
            if cutlass.const_expr(probe != "tmas"):
                bs = self.tuning.box_steps
                for c in cutlass.range_constexpr(self.boxes):
                    box = (kc + c * bs * self.se) // (bs * self.se)  # K index in boxes
                    cute.copy(tma_w, tWg[(None, bx, box, li)],
                              tWs[(None, slot * self.boxes + c)], tma_bar_ptr=bar)
            if cutlass.const_expr(probe != "tmaw"):
                tile0 = (kc // self.b_block) // 4
                for x in cutlass.range_constexpr(self.groups):
                    for y in cutlass.range_constexpr(T):
                        cute.copy(tma_s, tSg[(None, tile0 + y, li * nb128 + groups[x])],
                                  tSs[(None, (slot * self.groups + x) * T + y)],
                                  tma_bar_ptr=bar)

    @cute.jit
    def _tma_words(self, ring_w, ring_s, stage, c, warp, g, t):
        """Step c of TMA ring stage `stage`: w[j] = the 4 weight words of the thread's row j,
        sw[j] = the scale word of row j (its 16-byte entry of the step's scale tile)."""
        w = []
        bs = self.tuning.box_steps
        box = ring_w + (stage * self.boxes + c // bs) * self.BN * self.box_bytes
        for r in cutlass.range_constexpr(self.R):
            local = self._row(0, warp, g, r)
            w.append(lds_v4(box + local * self.box_bytes + (c % bs) * STEP_BYTES + t * 16))
        tile = self._scale_block(c, t) >> 2
        group = self._group_of(warp)
        sw = self._scale_words(ring_s + ((stage * self.groups + group) * self.scale_tiles + tile)
                               * 512 + ((warp % 4) * 8 + g) * 16, warp)
        return w, sw

    def _scale_block(self, c, t):
        """Block of K, counted from the sub-chunk's start, of the first element of thread t's
        bytes in step c. Sub-chunks start on whole scale tiles (4 blocks: asserted in __init__),
        so this block's scale column is its index % 4 and its tile in the stage its index // 4,
        with no run-time division."""
        per_step = self.se // self.b_block
        if cutlass.const_expr(self.e >= self.b_block):
            return c * per_step + t * (self.e // self.b_block)
        return c * per_step + (t >> (self.b_block // self.e).bit_length() - 1)

    @cute.jit
    def _scale_words(self, entry, warp):
        """The scale words of the thread's rows in the 16-byte scale entry at shared address
        `entry` (one word per 32-row quarter): all four with 4 rows per thread; with 2, those of
        the two quarters its warp's rows are in, 2h and 2h + 1, h = (warp // 4) % 2 (8 bytes)."""
        if cutlass.const_expr(self.R == 2):
            return lds_v2(entry + ((warp // 4) % 2) * 8)
        return lds_v4(entry)

    @cute.jit
    def _ring_words(self, ring_w, ring_s, stage, c, tid):
        """Step c of ring stage `stage`, as this thread copied it: w[j] = the 4 weight words of
        its row j (= 2 rt + r2), sw[j] = the scale word of row j."""
        w = []
        for r in cutlass.range_constexpr(self.R):
            slot = ((stage * self.sub + c) * self.R + r) * THREADS + tid
            w.append(lds_v4(ring_w + slot * 16))
        sw = self._scale_words(ring_s + ((stage * self.sub + c) * THREADS + tid) * 16, tid // 32)
        return w, sw

    @cute.jit
    def _mainloop_window(self, acc, act_base, ring_w, ring_s, row_addr, sent_addr, a_addr, li, m,
                         m0, k, k_begin, k_end, n_sub, tid, lane, g, t, b_fp8):
        """Tuning.act_window > 0 (bf16 activations): the weight ring of _mainloop_cpasync, but the
        activations come in windows of W sub-chunks: cp.async copies the window's real rows
        (m0 .. m0 + mc - 1) as they are in memory into one of two buffers, a window ahead, and the
        CTA meets at one barrier per window instead of one per sub-chunk. Window layout, 16-byte
        items: ((s * Q + q) * mc + r) * 4 + t = row r, K elements s*se + t*e + 8q .. +8 of the
        window (s = step in the window): the lanes of a warp read consecutive items (no bank
        conflicts); rows past mc read row mc - 1 (their MMA columns are never stored). For fp4
        weights each thread puts the items it copied into the weights' pair order (in place)
        before the window's barrier: once per item, not once per warp that reads it."""
        v = self.v
        nt, se, Q = v.nt, self.se, self.q
        S = self.tuning.stages
        chunk = self.sub * se
        mc = cutlass.min(m - m0, 8 * nt)  # rows of M this CTA computes
        sub_bytes = chunk * 2 * mc  # one sub-chunk of activations
        # sub-chunks per window (no more than the CTA's K range has)
        W = cutlass.max(1, cutlass.min(self.win_bytes // sub_bytes, n_sub))
        items = W * self.sub * Q * mc * 4  # 16-byte items per window
        # A thread copies items tid, tid + THREADS, ...: item j = blk * 4mc + rt (blk = s*Q + q,
        # rt = 4r + t). Its (blk, rt) start and step, divided once here, not once per item.
        a_rows = a_addr + (cutlass.Int64(li) * m + m0) * k * 2  # row m0 of this batch entry
        cursor = (tid // (4 * mc), tid % (4 * mc), THREADS // (4 * mc), THREADS % (4 * mc))
        self._issue_act_window(act_base, a_rows, mc, k, k_begin, k_end, items, tid, cursor)
        for j in cutlass.range_constexpr(S - 1):  # prologue: sub-chunks 0 .. S-2
            self._issue_copies(ring_w, ring_s, j, row_addr, sent_addr, k_begin + j * chunk,
                               k_end, t, tid, j < n_sub)
        # this lane's item offsets (n8 tile i: row min(8i + g, mc - 1)) and the stride of q
        lane_off = [(cutlass.min(8 * i + g, mc - 1) * 4 + t) * 16 for i in range(nt)]
        q_stride = mc * 64
        # the window position, carried from sub-chunk to sub-chunk (no division per sub-chunk)
        wpos = cutlass.Int32(0)  # sub-chunk within the window
        wsel = cutlass.Int32(0)  # buffer of the current window (0 / 1)
        k_next = k_begin + W * chunk  # first K of the next window
        for it in range(n_sub):
            j = it + S - 1  # the weights first: they stay S - 1 sub-chunks ahead
            self._issue_copies(ring_w, ring_s, j % S, row_addr, sent_addr, k_begin + j * chunk,
                               k_end, t, tid, j < n_sub)
            if wpos == 0:
                # This window's copies are a group at least W older than the newest (they were
                # committed at the last window's start), so waiting for all but the newest S-1
                # groups covers them when W >= S - 1. Then everyone's are in; the barrier also
                # says every warp is past the last window, whose buffer the next one takes.
                if W >= S - 1:
                    cp_async_wait(S - 1)
                else:
                    cp_async_wait(0)
                if cutlass.const_expr(self.b_bits == 4):
                    self._permute_act_window(act_base + wsel * self.win_bytes, items, tid)
                cute.arch.sync_threads()
                if k_next < k_end:
                    self._issue_act_window(act_base + (1 - wsel) * self.win_bytes, a_rows, mc, k,
                                           k_next, k_end, items, tid, cursor)
                    cp_async_commit()
            else:
                cp_async_wait(S - 1)  # this thread's copies of sub-chunk `it` have landed
            buf = act_base + wsel * self.win_bytes + wpos * sub_bytes
            stage = it % S
            for c in cutlass.range_constexpr(self.sub):
                w, sw = self._ring_words(ring_w, ring_s, stage, c, tid)
                self._step_compute(w, sw, t, buf, c, lane, acc, b_fp8,
                                   win=(lane_off, q_stride))
            wrap = cutlass.Int32(wpos + 1 == W)  # the window ends with this sub-chunk
            wpos = (wpos + 1) * (1 - wrap)
            wsel = wsel ^ wrap
            k_next = k_next + wrap * (W * chunk)
        cp_async_wait(0)

    @cute.jit
    def _issue_act_window(self, buf, a_rows, mc, k, kw, k_end, items, tid, cursor):
        """cp.async one window of bf16 activations (the mc rows from a_rows, K from kw, `items`
        16-byte items) into `buf` in the window layout; K past k_end is zero-filled.
        cursor = (blk, rt) of item tid and their step per THREADS items."""
        se, Q = self.se, self.q
        qbits = Q.bit_length() - 1  # Q is 2 or 4
        blk, rt, d_blk, d_rt = cursor
        for j in range(tid, items, THREADS):
            t = rt & 3
            r = rt >> 2
            kk = kw + (blk >> qbits) * se + t * self.e + 8 * (blk & (Q - 1))
            src = a_rows + (cutlass.Int64(r) * k + kk) * 2
            cp_async(buf + j * 16, src, 16, cutlass.Int32(kk < k_end))
            rt = rt + d_rt
            wrap = cutlass.Int32(rt >= 4 * mc)
            rt = rt - wrap * (4 * mc)
            blk = blk + d_blk + wrap

    @cute.jit
    def _permute_act_window(self, buf, items, tid):
        """The items this thread copied (_issue_act_window's j), in place, into the fp4 weights'
        pair order (x0x4, x1x5, x2x6, x3x7)."""
        for j in range(tid, items, THREADS):
            sts_v4(buf + j * 16, permute_fp4_order(lds_v4(buf + j * 16)))

    @cute.jit
    def _step_compute(self, w, sw, t, buf, c, lane, acc, b_fp8, win=None, fold=None, nt=None):
        """Step c of a sub-chunk for the thread's rows: w[j] = 4 weight words of row j, sw[j] = the
        scale word of row j (4 scale columns); t = the thread's quarter of the step. fold: the
        scales carry the bit trick's offset (default self.fold, NVFP4's; MXFP4's where the CTA's
        scales allow it, _mainloop_tma).
        Activations: staged in fragment order in `buf`, or with `win` = (the lane's item offset
        per n8 tile, the stride of q) in the window layout of _mainloop_window (`buf` = the
        sub-chunk's first item).
        nt: multiply into the first nt n8 tiles only (default all v.nt): rows of at most 8 nt
        (a grouped item's, a dense pass's: decode_loop_nts) leave the others zero; the staging
        and accumulator layouts stay the variant's."""
        v = self.v
        NT, Q = v.nt, self.q
        if cutlass.const_expr(nt is None):
            nt = NT
        if cutlass.const_expr(fold is None):
            fold = self.fold
        col = self._scale_block(c, t) & 3  # the thread's first scale column (byte) in the word
        nblk = 2 if v.b_kind == "nvfp4" else 1  # blocks per thread per step (32 elems / 16)
        # bf16x2 scale per row and block, converted once and used by every group: two at a time
        # (NVFP4: the thread's two blocks of a row; MX: its block of rows 2i and 2i + 1)
        sc = [[None] * nblk for _ in range(self.R)]
        if cutlass.const_expr(nblk == 2):
            for j in cutlass.range_constexpr(self.R):
                sc[j] = scale_pair_bf16x2(v.b_kind, sw[j], 0, scale_pair_sel(col, col + 1),
                                          fold)
        else:
            for jp in cutlass.range_constexpr(self.R // 2):
                sc[2 * jp][0], sc[2 * jp + 1][0] = scale_pair_bf16x2(
                    v.b_kind, sw[2 * jp], sw[2 * jp + 1], scale_pair_sel(col, 4 + col), fold)
        wpg = 1 if self.b_bits == 4 else 2  # weight words per 8-element group
        for q in cutlass.range_constexpr(Q):
            act = []
            for i in cutlass.range_constexpr(nt):
                if cutlass.const_expr(win is None):
                    act.append(lds_v4(buf + (((c * NT + i) * Q + q) * 32 + lane) * 16))
                else:
                    lane_off, q_stride = win
                    act.append(lds_v4(buf + (c * Q + q) * q_stride + lane_off[i]))
            blk = q // 2 if nblk == 2 else 0
            for rt in cutlass.range_constexpr(self.RT):
                wg = [w[2 * rt][q * wpg + x] for x in range(wpg)]
                wh = [w[2 * rt + 1][q * wpg + x] for x in range(wpg)]
                a_in = [acc[(rt * NT) * 4 + x] for x in range(4 * nt)]
                res = dequant_mma(v.b_kind, nt, wg, wh, sc[2 * rt][blk], sc[2 * rt + 1][blk], act,
                                  a_in, b_fp8, fold)
                for x in cutlass.range_constexpr(4 * nt):
                    acc[(rt * NT) * 4 + x] = res[x]

    def _group_of(self, warp):
        """The warp's 128-row group in the CTA: a warp holds 8 R rows, so 16 / R warps fill a
        group (R = 4: two groups of 4 warps; R = 2: one group of all 8)."""
        return warp // (16 // self.R)

    def _row(self, bx, warp, g, j):
        """Row of N of a thread's row j (= 2 rt + r2; MMA row g + 8 r2 of row tile rt): quarter
        jj of the warp's 128-row group, 8 (w % 4) + g within the quarter."""
        group = self._group_of(warp)
        jj = ((warp // 4) % (4 // self.R)) * self.R + j
        return bx * self.BN + group * 128 + jj * 32 + (warp % 4) * 8 + g

    @cute.jit
    def _issue_copies(self, ring_w, ring_s, stage, row_addr, sent_addr, kc, k_end, t, tid,
                      active):
        """cp.async one sub-chunk (16 weight bytes per row per step + the thread's 16-byte scale
        entry per step) into ring stage `stage`, then commit it as one group (empty groups keep
        the count)."""
        for c in cutlass.range_constexpr(self.sub):
            k0 = kc + c * self.se
            kt = k0 + t * self.e
            ok = cutlass.Int32(active & (kt < k_end))
            boff = cutlass.Int64(k0 * self.b_bits // 8)
            kb = kt // self.b_block
            soff = cutlass.Int64((kb // 4) * 512)
            for r in cutlass.range_constexpr(self.R):
                slot = ((stage * self.sub + c) * self.R + r) * THREADS + tid
                cp_async(ring_w + slot * 16, row_addr[r] + boff, 16, ok)
            slot = (stage * self.sub + c) * THREADS + tid
            cp_async(ring_s + slot * 16, sent_addr + soff, 16, ok)
        cp_async_commit()

    # ------------------------------------------------------------------------------------------
    @cute.jit
    def _fp8_params(self, e5m2: cutlass.Int32):
        """e4m3: (4, 0x07F007F0, 2^120); e5m2: (3, 0x0FE00FE0, 2^112), without a branch."""
        f = cutlass.Int32(e5m2 != 0)
        return [4 - f, cutlass.Int32(0x07F007F0) << f, cutlass.Int32(_K120) - f * 0x04000400]

    @cute.jit
    def _load_weights(self, w, s, row_addr, sent_addr, kc, k_end, t, active):
        """Issue one sub-chunk's weight (16 B per row per step) and scale-entry (16 B) loads."""
        for c in cutlass.range_constexpr(self.sub):
            k0 = kc + c * self.se  # first K element of the step
            kt = k0 + t * self.e  # first K element of this thread's 16 bytes
            ok = cutlass.Int32(active & (kt < k_end))
            boff = cutlass.Int64(k0 * self.b_bits // 8)
            kb = kt // self.b_block
            soff = cutlass.Int64((kb // 4) * 512)
            for r in cutlass.range_constexpr(4):  # rows j = 2 rt + r2
                vals = ldg_stream_v4(row_addr[r] + boff, ok)
                for x in cutlass.range_constexpr(4):
                    w[(c * 4 + r) * 4 + x] = vals[x]
            svals = ldg_v4(sent_addr + soff, ok)
            for x in cutlass.range_constexpr(4):
                s[c * 4 + x] = svals[x]

    # ---- activations: loaded one sub-chunk ahead into registers, stored in fragment order ----
    @property
    def _act_words(self):
        """Raw words per staging item: 4 (bf16: 16 bytes), fp4: 1 + scale, fp8: 2 + scale."""
        if not self.a_quant:
            return 4
        return 2 if KINDS[self.v.a_kind]["bits"] == 4 else 3

    @property
    def _act_per_thread(self):
        return (self.items + THREADS - 1) // THREADS

    @cute.jit
    def _load_act(self, raw, a_addr, a_scales, li, m, m0, k, kc, k_end, tid, active, m_end=None):
        """Issue the loads of one sub-chunk's activations into `raw` (registers).
        Item (c, nt, q, lane=4g+t) = 8 elements of row m0 + 8nt + g at K kc + c*se + t*e + 8q;
        rows >= M, K >= k_end and items past the count load zeros. a_scales = (address of A's
        scales, 1 if they are in the plain layout [L, M, K / block] else 0: blocked).
        m_end: rows from here on load zeros too (default M; a grouped item's end row)."""
        sa_addr, sa_plain = a_scales
        v = self.v
        nt, Q, W = v.nt, self.q, self._act_words
        for j in cutlass.range_constexpr(self._act_per_thread):
            idx = tid + j * THREADS
            lane = idx % 32
            q = (idx // 32) % Q
            i = (idx // (32 * Q)) % nt
            c = idx // (32 * Q * nt)
            row = m0 + i * 8 + lane // 4
            kk = kc + c * self.se + (lane % 4) * self.e + q * 8
            if cutlass.const_expr(m_end is None):
                ok = cutlass.Int32(active & (idx < self.items) & (row < m) & (kk < k_end))
                rowc = cutlass.min(row, m - 1)
            else:
                ok = cutlass.Int32(active & (idx < self.items) & (row < m_end) & (kk < k_end))
                rowc = cutlass.max(cutlass.min(row, m_end - 1), 0)
            if cutlass.const_expr(not self.a_quant):
                addr = a_addr + (cutlass.Int64(li) * m + rowc) * k * 2 + cutlass.Int64(kk) * 2
                x = ldg_v4(addr, ok, self.chained)  # chained: written by the producer grid
            else:
                a_bits = KINDS[v.a_kind]["bits"]
                a_blk = KINDS[v.a_kind]["block"]
                pitch = cutlass.Int64(k * a_bits // 8)
                addr = a_addr + (cutlass.Int64(li) * m + rowc) * pitch + cutlass.Int64(
                    kk * a_bits // 8)
                x = ([ldg_bytes(addr, ok, 4, self.chained)] if a_bits == 4
                     else ldg_bytes(addr, ok, 8, self.chained))
                sk4 = (k // a_blk + 3) // 4
                mb128 = (m + 127) // 128
                kb = kk // a_blk
                soff = ((li * mb128 + rowc // 128) * sk4 + kb // 4) * 512 + (rowc % 32) * 16 + (
                    (rowc % 128) // 32) * 4 + kb % 4
                if sa_plain != 0:  # uniform across the grid: no divergence
                    soff = (li * m + rowc) * (k // a_blk) + kb
                x = x + [ldg_bytes(sa_addr + cutlass.Int64(soff), ok, 1, self.chained)]
            for w in cutlass.range_constexpr(W):
                raw[j * W + w] = x[w]

    @cute.jit
    def _store_act(self, buf, raw, tid, a_fp8):
        """Write the loaded activations (bf16, fragment order: item idx at buf + 16 idx) into
        shared memory, converting quantized ones and permuting for fp4 weights."""
        v = self.v
        W = self._act_words
        for j in cutlass.range_constexpr(self._act_per_thread):
            idx = tid + j * THREADS
            x = [raw[j * W + w] for w in range(W)]
            if cutlass.const_expr(not self.a_quant):
                if cutlass.const_expr(self.b_bits == 4):
                    x = permute_fp4_order(x)
            else:
                x = dequant_group(v.a_kind, x[:-1], scale_bf16x2(v.a_kind, x[-1]), a_fp8)
            if idx < self.items:
                sts_v4(buf + idx * 16, x)


class Sm90RaggedDecodeGemm(Sm90DecodeGemm):
    """The decode kernel for grouped GEMMs (`jbs.ragged_gemm`, experts of a mixture):

        y[m, n] = alpha[e] * sum_k A[m, k] * B[e, n, k]   for the rows m of expert e

    A is one (M, K) activation whose rows are sorted by expert; B holds G experts' weights
    (G, N, K) with blocked scales (G, ceil(N/128), ceil(SK/4), 32, 4, 4); alpha one f32 per
    expert. The rows come as a work table built by the caller (`items`, int32 [num_items, 3]):
    (expert, first row, end row), at most 8 nt rows per item, an expert's items adjacent.
    Expert -1 marks rows no expert owns (before the first group, after the last): those items
    write zeros. Items with no rows exit after reading their entry. Sizes mode (bit 3 of
    a_e5m2): `items` is the G raw group sizes (groups from row 0) and warp 0 makes its CTA's
    entry from them (kernels/grouped_work.py): no table is built before the call. Index mode
    (bit 2): `items` is a single int32, the expert that owns every row (clamped to [0, G)),
    and item i is rows [8 nt i, 8 nt (i + 1)): a dense GEMM against one layer of a stacked
    weight, read in place, with no table to build (`jbs.gemm(..., layer=i)`).

    Grid (ceil(ceil(N / BN) / T) * num_items, splits, 1), each CTA running T adjacent tiles of N
    of its item (bits 8-11 of a_e5m2) as one stream of sub-chunks. CTAs of N fastest, so the
    entries past the real items (which exit at once) run last; an expert's items are then a
    row of CTAs apart, close enough to share its weight tiles in L2. Index mode puts items
    fastest (a layer's items all share its weight tiles). Everything else is the dense decode
    kernel (same main loop, dequantization and MMAs): only the rows an item reads
    and writes, the weights' batch index (its expert) and the alpha it applies differ. With
    splits > 1 each split stores alpha[e] times its partial sums and the finalize kernel (or, bit
    5 of a_e5m2, the caller) adds them with alpha 1."""

    grouped = True

    @cute.jit
    def __call__(
        self,
        a_ptr: cute.Pointer,
        b_ptr: cute.Pointer,
        sa_ptr: cute.Pointer,
        sb_ptr: cute.Pointer,
        c_ptr: cute.Pointer,
        alpha_ptr: cute.Pointer,
        ws_ptr: cute.Pointer,
        items_ptr: cute.Pointer,
        m: cutlass.Int32,
        n: cutlass.Int32,
        k: cutlass.Int32,
        g: cutlass.Int32,
        num_items: cutlass.Int32,
        a_e5m2: cutlass.Int32,
        b_e5m2: cutlass.Int32,
        splits: cutlass.Int32,
        stream: cuda.CUstream,
    ):
        total = m * n
        per_thread = cutlass.Int32(1) + 3 * cutlass.Int32(total >= FIN_FOUR_FROM)
        ew_grid = cutlass.min((total + 256 * per_thread - 1) // (256 * per_thread), 2048)
        kern = self.kernel_grouped(a_ptr, b_ptr, sa_ptr, sb_ptr, c_ptr, alpha_ptr, ws_ptr,
                                   items_ptr, m, n, k, a_e5m2, b_e5m2, splits, num_items, g,
                                   *self._tma_atoms(b_ptr, sb_ptr, n, k, g))
        per_cta = self._tiles_per_cta(a_e5m2)
        cta_tiles = ((n + self.BN - 1) // self.BN + per_cta - 1) // per_cta
        kern.launch(grid=[cta_tiles * num_items, splits, 1],
                    block=[THREADS, 1, 1], min_blocks_per_mp=self.tuning.min_blocks,
                    preferred_smem_carveout=100, stream=stream)
        self._launch_finalize(ws_ptr, c_ptr, alpha_ptr, total, splits, per_thread, ew_grid,
                              a_e5m2, stream)

    @cute.kernel
    def kernel_grouped(
        self,
        a_ptr: cute.Pointer,
        b_ptr: cute.Pointer,
        sa_ptr: cute.Pointer,
        sb_ptr: cute.Pointer,
        c_ptr: cute.Pointer,
        alpha_ptr: cute.Pointer,
        ws_ptr: cute.Pointer,
        items_ptr: cute.Pointer,
        m: cutlass.Int32,
        n: cutlass.Int32,
        k: cutlass.Int32,
        a_e5m2: cutlass.Int32,
        b_e5m2: cutlass.Int32,
        splits: cutlass.Int32,
        num_items: cutlass.Int32,
        groups: cutlass.Int32,
        tma_w: cute.CopyAtom,
        tW: cute.Tensor,
        tma_s: cute.CopyAtom,
        tS: cute.Tensor,
    ):
        self._body(a_ptr, b_ptr, sa_ptr, sb_ptr, c_ptr, alpha_ptr, ws_ptr, m, n, k, a_e5m2,
                   b_e5m2, splits, num_items, (tma_w, tW, tma_s, tS), (items_ptr, groups))


# ----------------------------------------------------------------------------------------------
# Build / export
# ----------------------------------------------------------------------------------------------
def compile_variant(variant: DecodeVariant, arch: str = "sm_90a", tuning: Tuning | None = None):
    """cute.compile one variant (variant.grouped: an Sm90RaggedDecodeGemm) for `arch` (no GPU
    needed) with placeholder pointers."""
    grouped = variant.grouped
    gemm = (Sm90RaggedDecodeGemm if grouped else Sm90DecodeGemm)(variant, tuning)
    a_t = cutlass.BFloat16 if variant.a_kind == "bf16" else cutlass.Uint8
    pointers = [
        placeholder_ptr(a_t),
        placeholder_ptr(cutlass.Uint8),
        placeholder_ptr(cutlass.Uint8),
        placeholder_ptr(cutlass.Uint8),
        placeholder_ptr(OUT_DTYPES[variant.out]),
        placeholder_ptr(cutlass.Float32, align=4),
        placeholder_ptr(cutlass.Float32),
    ]
    if grouped:  # + items; m, n, k, g, num_items
        pointers.append(placeholder_ptr(cutlass.Int32, align=4))
    sizes = [cutlass.Int32(1) for _ in range(5 if grouped else 4)]
    args = (*pointers, *sizes, cutlass.Int32(0), cutlass.Int32(0), cutlass.Int32(1),
            cuda.CUstream(0))
    return compile_for_arch(gemm, args, arch)


def export_variant(variant: DecodeVariant, out_dir: str, function_prefix: str | None = None,
                   arch: str = "sm_90a", tuning: Tuning | None = None):
    """Compile `variant` for `arch` and write <prefix>.h and <prefix>.o into out_dir.

    The header declares `cute_dsl_<prefix>_wrapper(module, a, b, sa, sb, c, alpha, ws, m, n, k,
    l, a_e5m2, b_e5m2, splits, stream)` (grouped: `..., ws, items, m, n, k, g, num_items,
    a_e5m2, b_e5m2, splits, stream`); returns (header path, object path)."""
    return export_compiled(compile_variant(variant, arch, tuning), out_dir,
                           function_prefix or variant.name)
