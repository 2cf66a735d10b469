"""Blackwell (sm_100a / sm_103a) block-scaled GEMM written in CuTeDSL.

Build-time only: `aot.py` imports this module to compile and export every
variant; the runtime never imports CuTeDSL.

What one launch computes (the FFI contract, see docs/design/sm100.md):

    out[l, m, n] = alpha * sum_k A[l, m, k] * sfa(l, m, k) * B[l, n, k] * sfb(l, n, k)

* a (L, M, K) and b (L, N, K), K-major.  fp4 is packed two per byte (low nibble
  first), fp8 is one per byte, fp6 is packed four per three bytes (the tensor
  map's packed-6-bit format; the TMA unpacks it into byte containers in SMEM).
* sfa / sfb in the *blocked* layout (L, ceil(MN/128), ceil(SK/4), 32, 4, 4), where
  plain s[mn, sk] lives at [mn//128, sk//4, mn%32, (mn%128)//32, sk%4], zero padded.
  That is exactly the layout the tensor core reads from TMEM, so the kernel
  copies whole 512-byte scale atoms GMEM -> SMEM (TMA) -> TMEM (tcgen05.cp).
* out (L, M, N) row-major, f32 / bf16 / f16.
* alpha: f32[1] in device memory (the product of the operands' global scales,
  1.0 for MX formats), read by the epilogue.  Same as the Hopper kernel.

Kernel shape: one persistent, warp-specialized CTA per SM (or a cluster of
them), walking output tiles with the DSL's static persistent tile scheduler.

    warp 5 (load)      TMA A, B, SFA, SFB tiles into an N-stage SMEM ring
    warp 4 (mma)       tcgen05.cp scales SMEM -> TMEM, tcgen05.mma block-scaled
                       into a TMEM accumulator (two accumulator buffers, so the
                       epilogue of tile i overlaps the mainloop of tile i+1)
    warps 0-3 (epi)    tcgen05.ld accumulator -> registers, * alpha, convert,
                       registers -> SMEM -> TMA store

M = 256 tiles use the 2-CTA ("pair") MMA: two CTAs of a cluster each hold half
of A and SFA and the leader issues the MMA for both.

The layout and pipeline helpers come from the DSL (`cutlass.utils.*`); the
kernel's structure follows the public CuTeDSL Blackwell block-scaled example,
re-written here for pointer arguments, runtime M/N/K/L, runtime
`max_active_clusters` and an alpha epilogue.
"""

# No `from __future__ import annotations`: cute.struct reads real annotation objects.
import os
from typing import Iterable, Sequence, Tuple

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.memory
import cutlass.tensor_utils
import cutlass.pipeline as pipeline
import cutlass.utils as utils
import cutlass.utils.blackwell_helpers as bw
import cutlass.utils.blockscaled_layout as bsl
from cutlass.cute.nvgpu import OperandMajorMode, cpasync, tcgen05
from cutlass.cute.runtime import make_ptr

from jax_blockscale.kernels.export import export_compiled

# formats, variants and the tile heuristic: the pure-Python catalogue
from jax_blockscale.catalog.sm100 import (  # noqa: F401  (re-exported for the tests)
    FORMATS, OUT_DTYPES, PAIRS, SM100_ARCHS, VARIANTS, Sm100Variant, check_format_pair,
    choose_sm100_variant, default_function_prefix, k_alignment, mma_kind, variants_for)

# ---------------------------------------------------------------------------
# The kernel
# ---------------------------------------------------------------------------


def blocked_scale_layout(operand_shape, sf_vec: int):
    """CuTe layout of a scale buffer in our blocked format, indexed like its operand.

    `operand_shape` is the operand's (MN, K, L) (K in elements).  The DSL tiles
    the tensor core's 512-byte scale atom ((32, 4) rows x (sf_vec, 4) K) over
    it, K-tiles fastest, then MN-tiles, then L; the stride-0 `sf_vec` mode makes
    all K elements of one block read the same scale.  Flattened, that is the
    C-order (L, ceil(MN/128), ceil(SK/4), 32, 4, 4) array of docs/design/sm100.md,
    which tests/test_sm100_layout.py checks against `layout.to_blocked_scales`.
    """
    return bsl.tile_atom_to_shape_SF(operand_shape, sf_vec)


class Sm100BlockScaledGemm:
    """Persistent, warp-specialized block-scaled GEMM for one `Sm100Variant`.

    Calling the object inside `cute.compile` traces the host launcher
    (`__call__`), which builds the TMA descriptors from the runtime problem
    size and launches `kernel`.
    """

    # Warp roles inside a CTA.  The four epilogue warps must be warps 0-3: a
    # warp can only read the 32 TMEM lanes of its own quarter of the SM.
    EPI_WARPS = (0, 1, 2, 3)
    MMA_WARP = 4
    LOAD_WARP = 5
    THREADS = 32 * 6
    # Four MMA atoms along K per pipeline stage = one 128-byte row of A/B per
    # stage, and one 4-wide column group of a 512-byte scale atom.
    MMA_ATOMS_PER_K_TILE = 4

    def __init__(self, variant: Sm100Variant):
        fa, fb = FORMATS[variant.fmt_a], FORMATS[variant.fmt_b]
        self.variant = variant
        self.a_dtype = getattr(cutlass, fa.element)
        self.b_dtype = getattr(cutlass, fb.element)
        self.sf_dtype = getattr(cutlass, fa.scale)
        self.c_dtype = getattr(cutlass, OUT_DTYPES[variant.out_dtype])
        self.acc_dtype = cutlass.Float32
        self.sf_vec = fa.block
        self.use_2cta = variant.two_cta
        self.cluster_mn = (variant.cluster_m, variant.cluster_n)
        self.cta_group = tcgen05.CtaGroup.TWO if self.use_2cta else tcgen05.CtaGroup.ONE
        # kind::mxf8f6f4 reads every element from a byte container, so a 4- or
        # 6-bit operand is unpacked by the TMA into Int8 slots in SMEM.  A
        # same-width fp4 pair (mxf4 / mxf4nvf4) stays packed.
        self.unpack = fa.bits != fb.bits or 6 in (fa.bits, fb.bits)
        self.a_smem_dtype = cutlass.Int8 if self.unpack and fa.bits < 8 else self.a_dtype
        self.b_smem_dtype = cutlass.Int8 if self.unpack and fb.bits < 8 else self.b_dtype
        # Our FFI contract: A, B K-major, out row-major.
        self.a_major = OperandMajorMode.K
        self.b_major = OperandMajorMode.K
        self.c_layout = cutlass.tensor_utils.LayoutEnum.ROW_MAJOR
        self.k_align = variant.k_align
        self.n_align = variant.n_align
        # ragged_gemm's contiguous grouped form (Sm100GroupedBlockScaledGemm)
        self.grouped = variant.grouped

        self.epi_barrier = pipeline.NamedBarrier(
            barrier_id=1, num_threads=32 * len(self.EPI_WARPS))
        self.tmem_ptr_barrier = pipeline.NamedBarrier(
            barrier_id=2, num_threads=32 * (1 + len(self.EPI_WARPS)))
        self.smem_capacity = cutlass.memory.get_smem_capacity_in_bytes("sm_100")
        self.tmem_alloc_cols = cute.arch.get_max_tmem_alloc_cols("sm_100")

    # -- static configuration (runs at trace time) ---------------------------

    def _tiled_mmas(self):
        """The MMA used for the math, and one used only to lay out SFB.

        SFB is moved in whole 128-row scale atoms, so for N = 64 / 192 its
        layouts come from an MMA whose N is rounded up to a multiple of 128
        (and which is always 1-CTA: each CTA of a pair holds all of SFB).
        """
        mn = (self.variant.tile_m, self.variant.tile_n)
        mn_sfb = (mn[0] // (2 if self.use_2cta else 1), cute.round_up(mn[1], 128))
        self.mma_inst_mn, self.mma_inst_mn_sfb = mn, mn_sfb
        make = bw.make_blockscaled_trivial_tiled_mma
        mma = make(self.a_dtype, self.b_dtype, self.a_major, self.b_major,
                   self.sf_dtype, self.sf_vec, self.cta_group, mn)
        mma_sfb = make(self.a_dtype, self.b_dtype, self.a_major, self.b_major,
                       self.sf_dtype, self.sf_vec, tcgen05.CtaGroup.ONE, mn_sfb)
        return mma, mma_sfb

    def _configure(self, mma, mma_sfb):
        """Tile shapes, cluster layouts, stage counts, SMEM and TMEM plans."""
        inst_k = cute.size(mma.shape_mnk, mode=[2])
        tile_k = inst_k * self.MMA_ATOMS_PER_K_TILE
        self.mma_tiler = (*self.mma_inst_mn, tile_k)
        self.mma_tiler_sfb = (*self.mma_inst_mn_sfb, tile_k)
        cta_per_mma = cute.size(mma.thr_id.shape)
        self.cta_tile = (self.mma_tiler[0] // cta_per_mma, self.mma_tiler[1], tile_k)
        self.cta_tile_sfb = (self.mma_tiler_sfb[0] // cta_per_mma, self.mma_tiler_sfb[1], tile_k)

        # Cluster as (V, M, N, K): V = the CTAs of one pair MMA.
        cluster = cute.make_layout((*self.cluster_mn, 1))
        self.cluster_vmnk = cute.tiled_divide(cluster, (mma.thr_id.shape,))
        self.cluster_sfb_vmnk = cute.tiled_divide(cluster, (mma_sfb.thr_id.shape,))
        # A (and SFA) are shared by the CTAs of a cluster row, B by a column.
        self.mcast_a = cute.size(self.cluster_vmnk.shape[2])
        self.mcast_b = cute.size(self.cluster_vmnk.shape[1])

        self.epi_tile = bw.compute_epilogue_tile_shape(
            self.cta_tile, self.use_2cta, self.c_layout, self.c_dtype)
        self.epi_tile_n = cute.size(self.epi_tile[1])

        self.acc_stages, self.ab_stages, self.c_stages = self._stage_counts(mma)

        self.a_smem_staged = bw.make_smem_layout_a(
            mma, self.mma_tiler, self.a_smem_dtype, self.ab_stages)
        self.b_smem_staged = bw.make_smem_layout_b(
            mma, self.mma_tiler, self.b_smem_dtype, self.ab_stages)
        self.sfa_smem_staged = bsl.make_smem_layout_sfa(
            mma, self.mma_tiler, self.sf_vec, self.ab_stages)
        self.sfb_smem_staged = bsl.make_smem_layout_sfb(
            mma, self.mma_tiler, self.sf_vec, self.ab_stages)
        self.c_smem_staged = bw.make_smem_layout_epi(
            self.c_dtype, self.c_layout, self.epi_tile, self.c_stages)

        # TMEM plan (512 columns of 32-bit cells):
        #   [accumulator buffer(s) | SFA | SFB]
        # With N = 256 two full accumulators plus the scales do not fit, so the
        # two accumulator "buffers" overlap: buffer 1 starts where the scale
        # columns end and the epilogue frees the overlapping columns first.
        sf_atom_mn = 32
        self.sfa_tmem_cols = (self.cta_tile[0] // sf_atom_mn) * self.MMA_ATOMS_PER_K_TILE
        self.sfb_tmem_cols = (self.cta_tile_sfb[1] // sf_atom_mn) * self.MMA_ATOMS_PER_K_TILE
        self.sf_tmem_cols = self.sfa_tmem_cols + self.sfb_tmem_cols
        self.overlap_acc = self.acc_stages == 1
        if self.overlap_acc:
            self.acc_tmem_cols = self.cta_tile[1] * 2 - self.sf_tmem_cols
        else:
            self.acc_tmem_cols = self.cta_tile[1] * self.acc_stages
        # Subtile after which the epilogue has drained the overlapped columns.
        self.acc_early_release_subtile = self.sf_tmem_cols // self.epi_tile_n

    def _stage_counts(self, mma):
        """(accumulator, A/B/scale, output) pipeline depths.

        Fill SMEM with as many A/B/SFA/SFB stages as fit next to two output
        staging buffers, then give the remainder to the output buffers.
        """
        acc_stages = 1 if self.mma_tiler[1] == 256 else 2
        one = dict(
            a=bw.make_smem_layout_a(mma, self.mma_tiler, self.a_smem_dtype, 1),
            b=bw.make_smem_layout_b(mma, self.mma_tiler, self.b_smem_dtype, 1),
            sfa=bsl.make_smem_layout_sfa(mma, self.mma_tiler, self.sf_vec, 1),
            sfb=bsl.make_smem_layout_sfb(mma, self.mma_tiler, self.sf_vec, 1),
            c=bw.make_smem_layout_epi(self.c_dtype, self.c_layout, self.epi_tile, 1),
        )
        ab_bytes = (cute.size_in_bytes(self.a_smem_dtype, one["a"])
                    + cute.size_in_bytes(self.b_smem_dtype, one["b"])
                    + cute.size_in_bytes(self.sf_dtype, one["sfa"])
                    + cute.size_in_bytes(self.sf_dtype, one["sfb"]))
        c_bytes = cute.size_in_bytes(self.c_dtype, one["c"])
        reserved = 1024  # mbarriers and the TMEM address slot
        c_stages = 2
        ab_stages = (self.smem_capacity - reserved - c_stages * c_bytes) // ab_bytes
        c_stages += (self.smem_capacity - reserved - c_stages * c_bytes
                     - ab_stages * ab_bytes) // c_bytes
        return acc_stages, ab_stages, c_stages

    # -- host side: descriptors and launch -----------------------------------

    @cute.jit
    def __call__(
        self,
        a_ptr: cute.Pointer,
        b_ptr: cute.Pointer,
        sfa_ptr: cute.Pointer,
        sfb_ptr: cute.Pointer,
        out_ptr: cute.Pointer,
        alpha_ptr: cute.Pointer,
        m: cutlass.Int32,
        n: cutlass.Int32,
        k: cutlass.Int32,
        l: cutlass.Int32,
        max_active_clusters: cutlass.Int32,
        stream: cuda.CUstream,
    ):
        # the dense kernel has no tile table: alpha stands in for it, unread
        self._launch(a_ptr, b_ptr, sfa_ptr, sfb_ptr, out_ptr, alpha_ptr, alpha_ptr, m, n, k, l,
                     max_active_clusters, stream)

    @cute.jit
    def _launch(self, a_ptr, b_ptr, sfa_ptr, sfb_ptr, out_ptr, alpha_ptr, table_ptr, m, n, k, l,
                max_active_clusters, stream):
        """Build the TMA descriptors for the runtime problem and launch `kernel`. Grouped:
        A and C are one (M, K) / (M, N) matrix (M the padded rows), B holds l = G groups,
        alpha one float per group and table_ptr the group of each M tile."""
        mma, mma_sfb = self._tiled_mmas()
        self._configure(mma, mma_sfb)

        # Global tensors as (rows, K, L) / (M, N, L) with the contiguous mode
        # second; the divisibility hints let the TMA descriptor and the
        # vectorized address math trust the 16-byte row alignment that the
        # FFI handler checks before launching.
        k_hint = cute.assume(k, divby=self.k_align)
        n_hint = cute.assume(n, divby=self.n_align)
        la = l  # batch of A and C: one matrix when grouped (B's L counts the groups)
        if cutlass.const_expr(self.grouped):
            la = 1
        mA = cute.make_tensor(a_ptr, cute.make_ordered_layout((m, k_hint, la), order=(1, 0, 2)))
        mB = cute.make_tensor(b_ptr, cute.make_ordered_layout((n, k_hint, l), order=(1, 0, 2)))
        mC = cute.make_tensor(out_ptr, cute.make_ordered_layout((m, n_hint, la), order=(1, 0, 2)))
        # Scales: the blocked (L, MN/128, SK/4, 32, 4, 4) buffer is exactly the
        # DSL's scale atom tiled over (MN, K, L), K-tiles fastest.
        mSFA = cute.make_tensor(sfa_ptr, blocked_scale_layout(mA.shape, self.sf_vec))
        mSFB = cute.make_tensor(sfb_ptr, blocked_scale_layout(mB.shape, self.sf_vec))
        # alpha is an XLA operand (f32[1] in device memory): the epilogue reads
        # it, so launching never waits on the host.
        mAlpha = cute.make_tensor(alpha_ptr, cute.make_layout(1))
        mTable = mAlpha  # dense: unread
        if cutlass.const_expr(self.grouped):
            # one alpha per group; the group of each M tile (-1: no group's rows)
            mAlpha = cute.make_tensor(alpha_ptr, cute.make_layout(l))
            mTable = cute.make_tensor(table_ptr, cute.make_layout(m // self.variant.tile_m))

        a_smem = cute.slice_(self.a_smem_staged, (None, None, None, 0))
        b_smem = cute.slice_(self.b_smem_staged, (None, None, None, 0))
        sfa_smem = cute.slice_(self.sfa_smem_staged, (None, None, None, 0))
        sfb_smem = cute.slice_(self.sfb_smem_staged, (None, None, None, 0))
        cluster_shape = self.cluster_vmnk.shape

        tma_a, tma_mA = cute.nvgpu.make_tiled_tma_atom_A(
            bw.cluster_shape_to_tma_atom_A(self.cluster_mn, mma.thr_id),
            mA, a_smem, self.mma_tiler, mma, cluster_shape,
            internal_type=self.a_smem_dtype if self.a_smem_dtype is not self.a_dtype else None,
        )
        tma_b, tma_mB = cute.nvgpu.make_tiled_tma_atom_B(
            bw.cluster_shape_to_tma_atom_B(self.cluster_mn, mma.thr_id),
            mB, b_smem, self.mma_tiler, mma, cluster_shape,
            internal_type=self.b_smem_dtype if self.b_smem_dtype is not self.b_dtype else None,
        )
        # Scales travel as 16-bit TMA elements (pairs of scale bytes).
        tma_sfa, tma_mSFA = cute.nvgpu.make_tiled_tma_atom_A(
            bw.cluster_shape_to_tma_atom_A(self.cluster_mn, mma.thr_id),
            mSFA, sfa_smem, self.mma_tiler, mma, cluster_shape,
            internal_type=cutlass.Int16,
        )
        tma_sfb, tma_mSFB = cute.nvgpu.make_tiled_tma_atom_B(
            bw.cluster_shape_to_tma_atom_SFB(self.cluster_mn, mma.thr_id),
            mSFB, sfb_smem, self.mma_tiler_sfb, mma_sfb, self.cluster_sfb_vmnk.shape,
            internal_type=cutlass.Int16,
        )
        if cutlass.const_expr(self.cta_tile[1] == 192):
            tma_mSFB = self._sfb_view_for_n192(tma_mSFB)

        cta_per_mma = cute.size(mma.thr_id.shape)
        self.tma_bytes_per_stage = cta_per_mma * (
            cute.size_in_bytes(self.a_dtype, a_smem)
            + cute.size_in_bytes(self.b_dtype, b_smem)
            + cute.size_in_bytes(self.sf_dtype, sfa_smem)
            + cute.size_in_bytes(self.sf_dtype, sfb_smem))

        c_smem = cute.slice_(self.c_smem_staged, (None, None, 0))
        tma_c, tma_mC = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileS2GOp(), mC, c_smem, self.epi_tile)

        # Persistent grid: (cluster_m, cluster_n, clusters that fit at once).
        tiles_mnl = cute.zipped_divide(
            mC, tiler=cute.slice_(self.cta_tile, (None, None, 0)))[(0, (None, None, None))].shape
        sched_params = utils.PersistentTileSchedulerParams(
            tiles_mnl, (*self.cluster_mn, 1), 1, True)
        grid = utils.StaticPersistentTileScheduler.get_grid_shape(
            sched_params, max_active_clusters)

        self.storage_type = self._shared_storage_type()

        self.kernel(
            mma, mma_sfb,
            tma_a, tma_mA, tma_b, tma_mB,
            tma_sfa, tma_mSFA, tma_sfb, tma_mSFB,
            tma_c, tma_mC,
            self.cluster_vmnk, self.cluster_sfb_vmnk,
            self.a_smem_staged, self.b_smem_staged,
            self.sfa_smem_staged, self.sfb_smem_staged, self.c_smem_staged,
            self.epi_tile, sched_params, mAlpha, mTable,
        ).launch(
            grid=grid,
            block=[self.THREADS, 1, 1],
            cluster=(*self.cluster_mn, 1),
            stream=stream,
            min_blocks_per_mp=1,
        )

    def _sfb_view_for_n192(self, tma_mSFB):
        """N = 192: consecutive N tiles start 1.5 scale atoms apart.

        SFB is fetched as two whole 128-row atoms per tile.  Re-stride the
        tile-N mode as (2, rest) : (1 atom, 3 atoms) so that even tiles fetch
        atoms (3j, 3j+1) and odd tiles (3j+1, 3j+2); the MMA warp then skips
        the first 64 rows of an odd tile's scales (a 2-column TMEM shift).
        """
        atom_stride = tma_mSFB.stride[0][1]
        rest = cute.ceil_div(tma_mSFB.shape[0][1], 4)
        shape = ((tma_mSFB.shape[0][0], ((2, 2), rest)), tma_mSFB.shape[1], tma_mSFB.shape[2])
        # ScaledBasis strides only multiply from the left.
        stride = ((tma_mSFB.stride[0][0], ((atom_stride, atom_stride), 3 * atom_stride)),
                  tma_mSFB.stride[1], tma_mSFB.stride[2])
        return cute.make_tensor(tma_mSFB.iterator, cute.make_layout(shape, stride=stride))

    def _shared_storage_type(self):
        align = 1024  # swizzled operand tiles and TMA destinations

        @cute.struct
        class SharedStorage:
            ab_full: cute.struct.MemRange[cutlass.Int64, self.ab_stages]
            ab_empty: cute.struct.MemRange[cutlass.Int64, self.ab_stages]
            acc_full: cute.struct.MemRange[cutlass.Int64, self.acc_stages]
            acc_empty: cute.struct.MemRange[cutlass.Int64, self.acc_stages]
            tmem_dealloc: cutlass.Int64
            tmem_base: cutlass.Int32
            sC: cute.struct.Align[
                cute.struct.MemRange[self.c_dtype, cute.cosize(self.c_smem_staged.outer)], align]
            sA: cute.struct.Align[
                cute.struct.MemRange[self.a_smem_dtype, cute.cosize(self.a_smem_staged.outer)], align]
            sB: cute.struct.Align[
                cute.struct.MemRange[self.b_smem_dtype, cute.cosize(self.b_smem_staged.outer)], align]
            sSFA: cute.struct.Align[
                cute.struct.MemRange[self.sf_dtype, cute.cosize(self.sfa_smem_staged)], align]
            sSFB: cute.struct.Align[
                cute.struct.MemRange[self.sf_dtype, cute.cosize(self.sfb_smem_staged)], align]

        return SharedStorage

    # -- device side ----------------------------------------------------------

    @cute.kernel
    def kernel(
        self,
        mma: cute.TiledMma,
        mma_sfb: cute.TiledMma,
        tma_a: cute.CopyAtom,
        mA: cute.Tensor,
        tma_b: cute.CopyAtom,
        mB: cute.Tensor,
        tma_sfa: cute.CopyAtom,
        mSFA: cute.Tensor,
        tma_sfb: cute.CopyAtom,
        mSFB: cute.Tensor,
        tma_c: cute.CopyAtom,
        mC: cute.Tensor,
        cluster_vmnk: cute.Layout,
        cluster_sfb_vmnk: cute.Layout,
        a_smem_staged: cute.ComposedLayout,
        b_smem_staged: cute.ComposedLayout,
        sfa_smem_staged: cute.Layout,
        sfb_smem_staged: cute.Layout,
        c_smem_staged: cute.ComposedLayout,
        epi_tile: cute.Tile,
        sched_params: utils.PersistentTileSchedulerParams,
        mAlpha: cute.Tensor,
        mTable: cute.Tensor,
    ):
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        tidx, _, _ = cute.arch.thread_idx()
        cta_per_mma = cute.size(mma.thr_id.shape)
        use_2cta = cta_per_mma == 2

        if warp == self.LOAD_WARP:
            for atom in (tma_a, tma_b, tma_sfa, tma_sfb, tma_c):
                cpasync.prefetch_descriptor(atom)

        # Where this CTA sits: its half of a pair MMA (v) and its cluster coords.
        bidx, _, _ = cute.arch.block_idx()
        mma_v = bidx % cta_per_mma
        is_leader = mma_v == 0
        rank = cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster())
        coord_vmnk = cluster_vmnk.get_flat_coord(rank)
        coord_sfb_vmnk = cluster_sfb_vmnk.get_flat_coord(rank)

        # ---- shared memory, barriers, TMEM allocator ----
        storage = cutlass.memory.SmemAllocator().allocate(self.storage_type)
        # Producers: the TMA of every CTA that multicasts into this one.
        ab_pipe = pipeline.PipelineTmaUmma.create(
            barrier_storage=storage.ab_full.data_ptr(),
            num_stages=self.ab_stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(
                pipeline.Agent.Thread, self.mcast_a + self.mcast_b - 1),
            tx_count=self.tma_bytes_per_stage,
            cta_layout_vmnk=cluster_vmnk,
            defer_sync=True,
        )
        acc_pipe = pipeline.PipelineUmmaAsync.create(
            barrier_storage=storage.acc_full.data_ptr(),
            num_stages=self.acc_stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(
                pipeline.Agent.Thread,
                32 * len(self.EPI_WARPS) * (2 if use_2cta else 1)),
            cta_layout_vmnk=cluster_vmnk,
            defer_sync=True,
        )
        tmem = cutlass.memory.TmemAllocator(
            storage.tmem_base.ptr,
            barrier_for_retrieve=self.tmem_ptr_barrier,
            allocator_warp_id=self.EPI_WARPS[0],
            is_two_cta=use_2cta,
            two_cta_tmem_dealloc_mbar_ptr=storage.tmem_dealloc.ptr,
        )
        # Barrier inits must be visible cluster-wide before any remote arrive.
        pipeline.pipeline_init_arrive(cluster_shape_mn=self.cluster_mn, is_relaxed=True)

        sA = storage.sA.get_tensor(a_smem_staged.outer, swizzle=a_smem_staged.inner)
        sB = storage.sB.get_tensor(b_smem_staged.outer, swizzle=b_smem_staged.inner)
        sSFA = storage.sSFA.get_tensor(sfa_smem_staged)
        sSFB = storage.sSFB.get_tensor(sfb_smem_staged)
        sC = storage.sC.get_tensor(c_smem_staged.outer, swizzle=c_smem_staged.inner)

        # ---- tile the global tensors: (tile, tile_K, RestMN, RestK, L) ----
        gA = cute.local_tile(mA, cute.slice_(self.mma_tiler, (None, 0, None)), (None, None, None))
        gB = cute.local_tile(mB, cute.slice_(self.mma_tiler, (0, None, None)), (None, None, None))
        gSFA = cute.local_tile(mSFA, cute.slice_(self.mma_tiler, (None, 0, None)), (None, None, None))
        gSFB = cute.local_tile(mSFB, cute.slice_(self.mma_tiler_sfb, (0, None, None)), (None, None, None))
        gC = cute.local_tile(mC, cute.slice_(self.mma_tiler, (None, None, 0)), (None, None, None))
        k_tiles = cute.size(gA, mode=[3])

        thr_mma = mma.get_slice(mma_v)
        thr_mma_sfb = mma_sfb.get_slice(mma_v)
        tCgA = thr_mma.partition_A(gA)
        tCgB = thr_mma.partition_B(gB)
        tCgSFA = thr_mma.partition_A(gSFA)
        tCgSFB = thr_mma_sfb.partition_B(gSFB)
        tCgC = thr_mma.partition_C(gC)

        # ---- TMA partitions (which bytes this CTA fetches / receives) ----
        a_ctas = cute.make_layout(cute.slice_(cluster_vmnk, (0, 0, None, 0)).shape)
        b_ctas = cute.make_layout(cute.slice_(cluster_vmnk, (0, None, 0, 0)).shape)
        sfb_ctas = cute.make_layout(cute.slice_(cluster_sfb_vmnk, (0, None, 0, 0)).shape)
        tAsA, tAgA = cpasync.tma_partition(
            tma_a, coord_vmnk[2], a_ctas,
            cute.group_modes(sA, 0, 3), cute.group_modes(tCgA, 0, 3))
        tBsB, tBgB = cpasync.tma_partition(
            tma_b, coord_vmnk[1], b_ctas,
            cute.group_modes(sB, 0, 3), cute.group_modes(tCgB, 0, 3))
        tAsSFA, tAgSFA = cpasync.tma_partition(
            tma_sfa, coord_vmnk[2], a_ctas,
            cute.group_modes(sSFA, 0, 3), cute.group_modes(tCgSFA, 0, 3))
        tBsSFB, tBgSFB = cpasync.tma_partition(
            tma_sfb, coord_sfb_vmnk[1], sfb_ctas,
            cute.group_modes(sSFB, 0, 3), cute.group_modes(tCgSFB, 0, 3))
        # Drop the broadcast (stride-0) "vector" mode of the scale layouts.
        tAsSFA, tAgSFA = cute.filter_zeros(tAsSFA), cute.filter_zeros(tAgSFA)
        tBsSFB, tBgSFB = cute.filter_zeros(tBsSFB), cute.filter_zeros(tBgSFB)

        # Multicast masks: which CTAs of the cluster receive each TMA load.
        mask_a = mask_b = mask_sfa = mask_sfb = None
        if cutlass.const_expr(self.mcast_a > 1 or self.mcast_b > 1 or use_2cta):
            mask_a = cpasync.create_tma_multicast_mask(cluster_vmnk, coord_vmnk, mcast_mode=2)
            mask_b = cpasync.create_tma_multicast_mask(cluster_vmnk, coord_vmnk, mcast_mode=1)
            mask_sfa = cpasync.create_tma_multicast_mask(cluster_vmnk, coord_vmnk, mcast_mode=2)
            mask_sfb = cpasync.create_tma_multicast_mask(
                cluster_sfb_vmnk, coord_sfb_vmnk, mcast_mode=1)

        # ---- MMA operand views and the TMEM accumulator layout ----
        tCrA = mma.make_fragment_A(sA)
        tCrB = mma.make_fragment_B(sB)
        acc_shape = mma.partition_shape_C(self.mma_tiler[:2])
        if cutlass.const_expr(self.overlap_acc):
            # Two accumulators whose second one starts after (256 - scale
            # columns): they share columns, see _configure.
            acc2 = mma.make_fragment_C(cute.append(acc_shape, 2))
            tCtAcc_layout = cute.make_layout(
                acc2.shape,
                stride=(acc2.stride[0], acc2.stride[1], acc2.stride[2],
                        (256 - self.sf_tmem_cols) * acc2.stride[0][1]))
        else:
            tCtAcc_layout = mma.make_fragment_C(cute.append(acc_shape, self.acc_stages)).layout

        pipeline.pipeline_init_wait(cluster_shape_mn=self.cluster_mn)

        # =================== load warp ===================
        if warp == self.LOAD_WARP:
            sched = utils.StaticPersistentTileScheduler.create(
                sched_params, cute.arch.block_idx(), cute.arch.grid_dim())
            work = sched.initial_work_tile_info()
            prod = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.ab_stages)
            while work.is_valid_tile:
                tm = work.tile_idx[0] // cta_per_mma
                tn = work.tile_idx[1]
                tl = work.tile_idx[2]
                tl_b = tl  # B's batch index: the tile's group when grouped
                k_trips = k_tiles
                if cutlass.const_expr(self.grouped):
                    group = self._tile_group(mTable, mAlpha, tm)
                    tl_b = cutlass.max(group, 0)
                    k_trips = k_tiles * cutlass.Int32(group >= 0)  # no group: nothing to load
                gA_t = tAgA[(None, tm, None, tl)]
                gB_t = tBgB[(None, tn, None, tl_b)]
                gSFA_t = tAgSFA[(None, tm, None, tl)]
                sfb_n = tn
                if cutlass.const_expr(self.cta_tile[1] == 64):
                    # Two 64-wide tiles share one 128-row SFB atom.
                    sfb_n = tn // 2
                gSFB_t = tBgSFB[(None, sfb_n, None, tl_b)]

                prod.reset_count()
                ready = cutlass.Boolean(1)
                if prod.count < k_trips:
                    ready = ab_pipe.producer_try_acquire(prod)
                for _kt in cutlass.range(0, k_trips, 1, unroll=1):
                    ab_pipe.producer_acquire(prod, ready)
                    bar = ab_pipe.producer_get_barrier(prod)
                    kt, st = prod.count, prod.index
                    cute.copy(tma_a, gA_t[(None, kt)], tAsA[(None, st)], tma_bar_ptr=bar, mcast_mask=mask_a)
                    cute.copy(tma_b, gB_t[(None, kt)], tBsB[(None, st)], tma_bar_ptr=bar, mcast_mask=mask_b)
                    cute.copy(tma_sfa, gSFA_t[(None, kt)], tAsSFA[(None, st)], tma_bar_ptr=bar, mcast_mask=mask_sfa)
                    cute.copy(tma_sfb, gSFB_t[(None, kt)], tBsSFB[(None, st)], tma_bar_ptr=bar, mcast_mask=mask_sfb)
                    prod.advance()
                    ready = cutlass.Boolean(1)
                    if prod.count < k_trips:
                        ready = ab_pipe.producer_try_acquire(prod)
                sched.advance_to_next_work()
                work = sched.get_current_work()
            ab_pipe.producer_tail(prod)

        # =================== MMA warp ===================
        if warp == self.MMA_WARP:
            tmem.wait_for_alloc()
            acc_base = tmem.retrieve_ptr(self.acc_dtype)
            tCtAcc_all = cute.make_tensor(acc_base, tCtAcc_layout)

            # Scale tensors in TMEM, right after the accumulator columns.
            sfa_tmem_layout = bsl.make_tmem_layout_sfa(
                mma, self.mma_tiler, self.sf_vec, cute.slice_(sfa_smem_staged, (None, None, None, 0)))
            sfb_tmem_layout = bsl.make_tmem_layout_sfb(
                mma, self.mma_tiler, self.sf_vec, cute.slice_(sfb_smem_staged, (None, None, None, 0)))
            tCtSFA = cute.make_tensor(
                cute.recast_ptr(acc_base + self.acc_tmem_cols, dtype=self.sf_dtype), sfa_tmem_layout)
            tCtSFB = cute.make_tensor(
                cute.recast_ptr(acc_base + self.acc_tmem_cols + self.sfa_tmem_cols, dtype=self.sf_dtype),
                sfb_tmem_layout)
            s2t_sfa, s2t_sSFA, s2t_tSFA = self._scale_s2t_copy(sSFA, tCtSFA)
            s2t_sfb, s2t_sSFB, s2t_tSFB = self._scale_s2t_copy(sSFB, tCtSFB)

            sched = utils.StaticPersistentTileScheduler.create(
                sched_params, cute.arch.block_idx(), cute.arch.grid_dim())
            work = sched.initial_work_tile_info()
            cons = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.ab_stages)
            acc_prod = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.acc_stages)
            while work.is_valid_tile:
                tn = work.tile_idx[1]
                k_trips = k_tiles
                if cutlass.const_expr(self.grouped):
                    # a tile no group owns: no MMAs (its accumulator is committed as it is and
                    # its output rows are never read)
                    group = self._tile_group(mTable, mAlpha, work.tile_idx[0] // cta_per_mma)
                    k_trips = k_tiles * cutlass.Int32(group >= 0)
                if cutlass.const_expr(self.overlap_acc):
                    acc_buf = acc_prod.phase ^ 1
                else:
                    acc_buf = acc_prod.index
                tCtAcc = tCtAcc_all[(None, None, None, acc_buf)]

                cons.reset_count()
                full = cutlass.Boolean(1)
                if cons.count < k_trips and is_leader:
                    full = ab_pipe.consumer_try_wait(cons)
                if is_leader:
                    acc_pipe.producer_acquire(acc_prod)

                # N = 64 / 192: odd tiles use the second half of their first
                # SFB atom; skip 64 rows = 2 TMEM columns.
                tCtSFB_use = tCtSFB
                if cutlass.const_expr(self.cta_tile[1] in (64, 192)):
                    shift = cutlass.Int32((tn % 2) * 2)
                    tCtSFB_use = cute.make_tensor(
                        cute.recast_ptr(acc_base + self.acc_tmem_cols + self.sfa_tmem_cols + shift,
                                        dtype=self.sf_dtype),
                        sfb_tmem_layout)

                for kt in range(k_trips):
                    if is_leader:
                        ab_pipe.consumer_wait(cons, full)
                        # tcgen05.cp and tcgen05.mma execute in issue order,
                        # so the scales are in TMEM before the MMAs read them.
                        st = (None, None, None, None, cons.index)
                        cute.copy(s2t_sfa, s2t_sSFA[st], s2t_tSFA)
                        cute.copy(s2t_sfb, s2t_sSFB[st], s2t_tSFB)
                        mma.set(tcgen05.Field.ACCUMULATE, kt != 0)
                        stage = (None, None, None, cons.index)
                        cute.gemm(mma, tCtAcc, [tCrA[stage], tCtSFA],
                                  [tCrB[stage], tCtSFB_use], tCtAcc)
                        ab_pipe.consumer_release(cons)
                    cons.advance()
                    full = cutlass.Boolean(1)
                    if cons.count < k_trips:
                        if is_leader:
                            full = ab_pipe.consumer_try_wait(cons)

                if is_leader:
                    acc_pipe.producer_commit(acc_prod)
                acc_prod.advance()
                sched.advance_to_next_work()
                work = sched.get_current_work()
            acc_pipe.producer_tail(acc_prod)

        # =================== epilogue warps ===================
        if warp < self.MMA_WARP:
            tmem.allocate(self.tmem_alloc_cols)
            tmem.wait_for_alloc()
            acc_base = tmem.retrieve_ptr(self.acc_dtype)
            tCtAcc_all = cute.make_tensor(acc_base, tCtAcc_layout)

            t2r, tTR_tAcc_all, tTR_rAcc = self._epi_tmem_to_regs(tidx, tCtAcc_all, tCgC, epi_tile, use_2cta)
            tTR_rC = cute.make_rmem_tensor(tTR_rAcc.shape, self.c_dtype)
            r2s, tRS_rC, tRS_sC = self._epi_regs_to_smem(t2r, tTR_rC, tidx, sC)
            bSG_sC, bSG_gC_all = self._epi_smem_to_gmem(tma_c, tCgC, epi_tile, sC)
            alpha = mAlpha[0]

            sched = utils.StaticPersistentTileScheduler.create(
                sched_params, cute.arch.block_idx(), cute.arch.grid_dim())
            work = sched.initial_work_tile_info()
            acc_cons = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.acc_stages)
            c_pipe = pipeline.PipelineTmaStore.create(
                num_stages=self.c_stages,
                producer_group=pipeline.CooperativeGroup(
                    pipeline.Agent.Thread, 32 * len(self.EPI_WARPS)),
            )
            while work.is_valid_tile:
                tile_mnl = (work.tile_idx[0] // cta_per_mma, work.tile_idx[1], work.tile_idx[2])
                bSG_gC = bSG_gC_all[(None, None, None, *tile_mnl)]
                owned = cutlass.Boolean(1)
                if cutlass.const_expr(self.grouped):
                    group = self._tile_group(mTable, mAlpha, tile_mnl[0])
                    alpha = mAlpha[cutlass.max(group, 0)]  # the group's global scales
                    owned = group >= 0  # else: nothing computed, nothing stored
                reverse = False
                if cutlass.const_expr(self.overlap_acc):
                    acc_buf = acc_cons.phase
                    # Buffer 0's last columns are buffer 1's first ones.
                    # Drain buffer 0 back to front and buffer 1 front to back
                    # so the shared columns are read, and released, first.
                    reverse = acc_buf == 0
                else:
                    acc_buf = acc_cons.index
                tTR_tAcc = tTR_tAcc_all[(None, None, None, None, None, acc_buf)]
                acc_pipe.consumer_wait(acc_cons)

                tTR_tAcc = cute.group_modes(tTR_tAcc, 3, cute.rank(tTR_tAcc))
                bSG_gC = cute.group_modes(bSG_gC, 1, cute.rank(bSG_gC))
                subtiles = cute.size(tTR_tAcc.shape, mode=[3])
                done_before = sched.num_tiles_executed * subtiles
                for sub in cutlass.range(subtiles):
                    real_sub = sub
                    if cutlass.const_expr(self.overlap_acc):
                        if reverse:
                            real_sub = self.cta_tile[1] // self.epi_tile_n - 1 - sub
                    cute.copy(t2r, tTR_tAcc[(None, None, None, real_sub)], tTR_rAcc)
                    if cutlass.const_expr(self.overlap_acc):
                        if sub == self.acc_early_release_subtile:
                            cute.arch.fence_view_async_tmem_load()
                            acc_pipe.consumer_release(acc_cons)
                            acc_cons.advance()

                    # alpha = product of the global scales; applied in f32
                    # before the one rounding to the output type.
                    acc = r2s.retile(tTR_rAcc).load()
                    tRS_rC.store((acc * alpha).to(self.c_dtype))
                    buf = (done_before + sub) % self.c_stages
                    cute.copy(r2s, tRS_rC, tRS_sC[(None, None, None, buf)])
                    # Make the SMEM writes visible to the TMA (async proxy).
                    cute.arch.fence_proxy("async.shared", space="cta")
                    self.epi_barrier.arrive_and_wait()
                    if warp == self.EPI_WARPS[0]:
                        if owned:
                            cute.copy(tma_c, bSG_sC[(None, buf)], bSG_gC[(None, real_sub)])
                        c_pipe.producer_commit()
                        c_pipe.producer_acquire()
                    self.epi_barrier.arrive_and_wait()

                if cutlass.const_expr(not self.overlap_acc):
                    acc_pipe.consumer_release(acc_cons)
                    acc_cons.advance()
                sched.advance_to_next_work()
                work = sched.get_current_work()

            tmem.relinquish_alloc_permit()
            self.epi_barrier.arrive_and_wait()
            tmem.free(acc_base)
            c_pipe.producer_tail()

    @cute.jit
    def _tile_group(self, mTable, mAlpha, tm):
        """Grouped: the group whose rows M tile `tm` holds, from the table; -1 for a tile no
        group owns, and for an entry past the groups (G = alpha's length): such a table can
        make the kernel skip work, never read or write out of bounds."""
        group = mTable[tm]
        return group - (group + 1) * cutlass.Int32(group >= cute.size(mAlpha))

    # -- partition helpers (trace-time only, no control flow) -----------------

    def _scale_s2t_copy(self, sSF, tSF):
        """tcgen05.cp (32 lanes x 128 bit, replicated to the 4 lane quarters)
        from the SMEM scale stages to the TMEM scale columns."""
        sSF_c = cute.filter_zeros(sSF)
        tSF_c = cute.filter_zeros(tSF)
        atom = cute.make_copy_atom(tcgen05.Cp4x32x128bOp(self.cta_group), self.sf_dtype)
        copy = tcgen05.make_s2t_copy(atom, tSF_c)
        thr = copy.get_slice(0)
        src = tcgen05.get_s2t_smem_desc_tensor(copy, thr.partition_S(sSF_c))
        dst = thr.partition_D(tSF_c)
        return copy, src, dst

    def _epi_tmem_to_regs(self, tidx, tAcc, tCgC, epi_tile, use_2cta):
        atom = bw.get_tmem_load_op(self.cta_tile, self.c_layout, self.c_dtype,
                                   self.acc_dtype, epi_tile, use_2cta)
        # (EPI_M, EPI_N, n_epi_m, n_epi_n, ACC_STAGE)
        tAcc_epi = cute.flat_divide(tAcc[((None, None), 0, 0, None)], epi_tile)
        copy = tcgen05.make_tmem_copy(atom, tAcc_epi[(None, None, 0, 0, 0)])
        thr = copy.get_slice(tidx)
        tTR_tAcc = thr.partition_S(tAcc_epi)
        gC_epi = cute.flat_divide(tCgC[((None, None), 0, 0, None, None, None)], epi_tile)
        tTR_gC = thr.partition_D(gC_epi)
        tTR_rAcc = cute.make_rmem_tensor(tTR_gC[(None, None, None, 0, 0, 0, 0, 0)].shape, self.acc_dtype)
        return copy, tTR_tAcc, tTR_rAcc

    def _epi_regs_to_smem(self, t2r, tTR_rC, tidx, sC):
        atom = bw.get_smem_store_op(self.c_layout, self.c_dtype, self.acc_dtype, t2r)
        copy = cute.make_tiled_copy_D(atom, t2r)
        tRS_sC = copy.get_slice(tidx).partition_D(sC)
        return copy, copy.retile(tTR_rC), tRS_sC

    def _epi_smem_to_gmem(self, tma_c, tCgC, epi_tile, sC):
        gC_epi = cute.flat_divide(tCgC[((None, None), 0, 0, None, None, None)], epi_tile)
        bSG_sC, bSG_gC = cpasync.tma_partition(
            tma_c, 0, cute.make_layout(1),
            cute.group_modes(sC, 0, 2), cute.group_modes(gC_epi, 0, 2))
        return bSG_sC, bSG_gC


class Sm100GroupedBlockScaledGemm(Sm100BlockScaledGemm):
    """ragged_gemm's contiguous grouped GEMM (a `grouped` Sm100Variant): the dense kernel with
    A (M, K) and C (M, N) one matrix whose rows each group fills in whole tile_m tiles (the
    lowering pads them: lowering/ragged_sm100.py), B (G, N, K) with the groups as its L, and
    per M tile the group from an int32 table (-1: skipped). Its load warp reads the tile's
    group's B and SFB, the epilogue applies the group's alpha.

        out[m, n] = alpha[g] * sum_k A[m, k] * sfa(m, k) * B[g, n, k] * sfb(g, n, k),
        g = table[m // tile_m] (tiles with g = -1: output rows left unwritten)
    """

    @cute.jit
    def __call__(
        self,
        a_ptr: cute.Pointer,
        b_ptr: cute.Pointer,
        sfa_ptr: cute.Pointer,
        sfb_ptr: cute.Pointer,
        out_ptr: cute.Pointer,
        alpha_ptr: cute.Pointer,
        table_ptr: cute.Pointer,
        m: cutlass.Int32,
        n: cutlass.Int32,
        k: cutlass.Int32,
        g: cutlass.Int32,
        max_active_clusters: cutlass.Int32,
        stream: cuda.CUstream,
    ):
        self._launch(a_ptr, b_ptr, sfa_ptr, sfb_ptr, out_ptr, alpha_ptr, table_ptr, m, n, k, g,
                     max_active_clusters, stream)


def compile_variant(variant: Sm100Variant, arch: str = "sm_100a"):
    """cute.compile one variant for `arch` on any machine (no GPU needed)."""
    return compile_variant_with_plan(variant, arch)[0]


def compile_variant_with_plan(variant: Sm100Variant, arch: str = "sm_100a"):
    """(compiled, kernel object): the object carries the static plan that
    tracing computed (stage counts, TMEM columns, shared-storage type)."""
    if arch not in ("sm_100a", "sm_103a", "sm_100f", "sm_103f"):
        raise ValueError(f"unsupported Blackwell arch {arch!r}")
    gemm = (Sm100GroupedBlockScaledGemm if variant.grouped else Sm100BlockScaledGemm)(variant)
    fa, fb = FORMATS[variant.fmt_a], FORMATS[variant.fmt_b]
    gmem = cute.AddressSpace.gmem
    # Placeholder pointers: only their element type and alignment are traced;
    # the exported launcher takes the real device addresses.
    a = make_ptr(getattr(cutlass, fa.element), 0, gmem, assumed_align=16)
    b = make_ptr(getattr(cutlass, fb.element), 0, gmem, assumed_align=16)
    sfa = make_ptr(getattr(cutlass, fa.scale), 0, gmem, assumed_align=16)
    sfb = make_ptr(getattr(cutlass, fb.scale), 0, gmem, assumed_align=16)
    out = make_ptr(getattr(cutlass, OUT_DTYPES[variant.out_dtype]), 0, gmem, assumed_align=16)
    alpha = make_ptr(cutlass.Float32, 0, gmem, assumed_align=4)
    # grouped: + the int32 table of each M tile's group
    table = [make_ptr(cutlass.Int32, 0, gmem, assumed_align=4)] if variant.grouped else []
    i32 = cutlass.Int32
    compiled = cute.compile(
        gemm, a, b, sfa, sfb, out, alpha, *table,
        i32(1), i32(1), i32(1), i32(1), i32(1), cuda.CUstream(0),
        options=f"--gpu-arch {arch}",
    )
    return compiled, gemm


def export_variant(variant: Sm100Variant, out_dir: str, function_prefix: str,
                   arch: str = "sm_100a") -> Tuple[str, str]:
    """Compile `variant` for `arch` and write `<prefix>.h` + `<prefix>.o`.

    The generated launcher (see docs/design/sm100.md for the exact prototype) is

        <prefix>_wrapper(<prefix>_Kernel_Module_t *module, void *a, void *b,
                         void *sfa, void *sfb, void *out, void *alpha,
                         int32_t m, int32_t n, int32_t k, int32_t l,
                         int32_t max_active_clusters, cudaStream_t stream)

    Returns the (header, object) paths.
    """
    return export_compiled(compile_variant(variant, arch), out_dir, function_prefix)


def _export_job(job):
    v, arch, out_dir = job
    return (v, arch, *export_variant(v, out_dir, default_function_prefix(v, arch), arch))


def export_all(out_dir: str, archs: Iterable[str] = SM100_ARCHS,
               variants: Sequence[Sm100Variant] = VARIANTS, jobs: int = 1) -> list:
    """Export the whole matrix; returns [(variant, arch, header, object)].

    `jobs` > 1 compiles in that many fresh processes (each compile is
    single-threaded; spawn, not fork, so no MLIR state is shared)."""
    work = [(v, arch, out_dir) for arch in archs for v in variants]
    if jobs <= 1:
        return [_export_job(w) for w in work]
    import concurrent.futures
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(jobs, mp_context=ctx) as pool:
        return list(pool.map(_export_job, work))


def _main(argv=None):
    """`python -m jax_blockscale.kernels.sm100_blockscaled --out DIR` exports the
    whole matrix (what aot.py will do) and prints one line per object."""
    import argparse
    import time

    p = argparse.ArgumentParser(description=_main.__doc__)
    p.add_argument("--out", required=True, help="directory for the .h/.o pairs")
    p.add_argument("--arch", action="append", choices=("sm_100a", "sm_103a", "sm_100f"),
                   help="repeatable; default: " + " ".join(SM100_ARCHS))
    p.add_argument("--list", action="store_true", help="only list the variants")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1,
                   help="parallel compile processes (default: all cores)")
    args = p.parse_args(argv)
    if args.list:
        for v in VARIANTS:
            print(v.name, v.kind)
        return
    t0 = time.time()
    for v, arch, _h, o in export_all(args.out, args.arch or SM100_ARCHS, jobs=args.jobs):
        print(f"{arch} {v.name} -> {o}", flush=True)
    print(f"exported {len(VARIANTS) * len(args.arch or SM100_ARCHS)} objects "
          f"in {time.time() - t0:.1f} s")


if __name__ == "__main__":
    _main()
