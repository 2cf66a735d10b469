"""The types the planner and the backends share: each operation's problem description (its
spec) and the plans made for it. Pure data: no JAX tracing, no backend.

    GemmSpec, Plan          one dense GEMM problem (`gemm_p`) and how it runs
    RaggedSpec, RaggedPlan  one grouped GEMM problem (`ragged_gemm_p`) and how it runs
    Device                  what the planner needs of the device a lowering targets
"""
from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class GemmSpec:
    """The static description of one gemm problem, as a backend sees it."""
    fmt_a: str | None  # None: weight-only mode, A is a plain activation
    fmt_b: str
    layout_a: str | None
    layout_b: str
    a_dtype: np.dtype  # storage dtype of A (the activation dtype in weight-only mode)
    out_dtype: np.dtype
    batch_shape: tuple[int, ...]  # broadcast batch shape of the output
    a_batch: tuple[int, ...]
    b_batch: tuple[int, ...]
    m: int
    n: int
    k: int
    # True when the caller promises alpha == 1.0 (no global scales): a backend may then let its
    # GEMM round straight to out_dtype instead of scaling an f32 result first (same value).
    alpha_is_one: bool = False
    # A shard of a sharded call: (a_batch, b_batch, m, n) of the unsharded problem, whose plan
    # (backend, kernel, variant, tile, split count) the shard runs so that its results equal the
    # unsharded call's bit for bit; None: the problem is its own (sharding.py sets it where K is
    # whole; lowering/plan.py: plan).
    plan_shape: tuple | None = None


@dataclasses.dataclass(frozen=True)
class Plan:
    """How one gemm problem runs. `kernel` names the path:

      "reference"         the pure-JAX reference (dequantize exactly, one f32-accumulating dot)
      "xla_dot"           dequantize to bf16 + XLA's GEMM (sm90 past the kernels' rows)
      "dot_alpha"         dequantize to bf16 + the cuBLASLt GEMM with alpha in its epilogue
      "fused"             the sm90 fused kernel (shared-memory weights)
      "register_weights"  the sm90 fused kernel with the weights in wgmma's registers
      "decode"            the sm90 split-K decode kernel
      "sm100"             the Blackwell kernel
    Operand transforms: `dequantize_a` (a quantized activation becomes bf16 first), `permute_k`
    (the activation's K in the register-weight order), `a_scales_plain` (the decode kernel reads
    the activation's plain scales as they are), `k` (K after padding to the kernel's multiple).
    """
    backend: str
    kernel: str
    spec: GemmSpec
    platform: str = ""
    variant: str | None = None
    a_kind: str | None = None  # the kernel's operand kinds (catalogue names)
    b_kind: str | None = None
    tile: tuple[int, int] = (0, 0)
    cluster: tuple[int, int] = (0, 0)
    nt: int = 0  # decode: n8 tiles of M per CTA
    splits: int = 0  # decode, register_weights: K ranges per output tile (0: no split)
    workspace: int = 0  # f32 elements of the split-K workspace (splits * L * M * N)
    dequantize_a: bool = False
    permute_k: bool = False
    a_scales_plain: bool = False
    m: int = 0  # the kernel's rows (batch folded in) and batch
    l: int = 0
    k: int = 0
    sm_count: int = 0


@dataclasses.dataclass(frozen=True)
class RaggedSpec:
    """The static description of one grouped GEMM problem, as a backend sees it."""
    fmt_lhs: str | None  # None: weight-only mode, lhs is a plain activation
    fmt_rhs: str
    layout_lhs: str | None
    layout_rhs: str
    lhs_dtype: np.dtype  # storage dtype of lhs (the activation dtype in weight-only mode)
    out_dtype: np.dtype
    m: int
    n: int
    k: int
    groups: int  # G
    alpha_is_one: bool = False  # no global scales: alpha is all ones
    shifted: bool = False  # row_start may be nonzero (expert-parallel shards)
    group_index: bool = False  # group_sizes is one index: every row belongs to that group
    # A shard of a sharded call: (M, N, G) of the unsharded problem, whose kernel choice
    # (variant, split count) the shard keeps so that its results equal the unsharded call's bit
    # for bit; None: the problem is its own (ragged_sharding.py sets it where K is whole).
    plan_shape: tuple[int, int, int] | None = None


@dataclasses.dataclass(frozen=True)
class RaggedPlan:
    """How one grouped problem runs: the backend, its kernel (or method) and the spec; for a
    kernel (lowering/plan.py: plan_ragged_sm90) the compiled variant, its operand kinds, n8
    tiles of M per work item (`nt`), tile, split-K count, work-table entries (`items`) and
    whether the activation's plain scales are read as they are."""
    backend: str
    kernel: str
    spec: RaggedSpec
    platform: str
    variant: str | None = None
    a_kind: str | None = None
    b_kind: str | None = None
    nt: int = 0
    tile: tuple[int, int] = (0, 0)
    splits: int = 0
    items: int = 0
    a_scales_plain: bool = False
    # the grouped register-weight kernel reads the activation in activation_k_order (FP4
    # weights; catalog/sm90.py: register_weights_permute_k), as Plan.permute_k for gemm
    permute_k: bool = False
    # the kernel makes its work items from the raw group sizes (groups from row 0): the lowering
    # hands the backend the sizes as they are (no clamping kernels before the call) and the
    # kernel applies `clamp_group_sizes`'s semantics itself (kernels/grouped_work.py)
    raw_sizes: bool = False
    # the grouped decode kernel: adjacent tiles of N each CTA streams one after the other (the
    # catalogue's ragged_decode_tiles_per_cta)
    tiles_per_cta: int = 1
    # index mode on sm90 (`gemm(..., layer=i)`): gemm's plan for one layer (lowering/plan.py:
    # Plan), run when the handler finds the layer in place; the fields above are then index
    # mode's, run when XLA copied the layer's probe (lowering/ragged_sm90.py)
    layer: object = None


@dataclasses.dataclass(frozen=True)
class Device:
    """What the planner needs of the device a lowering targets."""
    platform: str
    arch: str | None  # "sm90", "sm100" or None (no kernel architecture; `reason` says why)
    sm_count: int
    reason: str | None = None
    # the GPU model where a catalogue rule depends on it ("h100", "h200"; catalog/sm90.py:
    # card_of), else None (the rules' default)
    card: str | None = None
