"""Variants and dispatch heuristic of the sm90 decode kernel (pure Python, no DSL needed).

The kernel itself is in sm90_decode.py (build time only). This module is what the runtime, the
FFI variant table and the tests need: the frozen `DecodeVariant`, the list `VARIANTS` that the
AOT step compiles, and `choose_decode_variant(m, n, k, fmt_a, fmt_b, sm_count)`.
"""
from __future__ import annotations

import dataclasses

# The kinds and the bf16x2 powers of two of the bit tricks are the fused kernel's (pure Python
# there too): one definition. _K<e> = 2^e in both halves; FOLD_ALPHA takes back the NVFP4 fold.
from .sm90_dequant_ptx import BF16X2_2P112 as _K112  # noqa: F401  (sm90_decode, tests)
from .sm90_dequant_ptx import BF16X2_2P119 as _K119  # noqa: F401  (sm90_decode, tests)
from .sm90_dequant_ptx import BF16X2_2P120 as _K120  # noqa: F401  (sm90_decode, tests)
from .sm90_dequant_ptx import BF16X2_2P126 as _K126  # noqa: F401  (sm90_decode, tests)
from .sm90_dequant_ptx import FOLD_FACTOR, KINDS

FOLD_ALPHA = 1.0 / FOLD_FACTOR  # (w * 2^-126) * (s * 2^119) = w * s * 2^-7: alpha takes 2^7 back

# ----------------------------------------------------------------------------------------------
# Formats
# ----------------------------------------------------------------------------------------------
B_KINDS = ("nvfp4", "mxfp4", "mxfp8")
# (a_kind, b_kind) pairs: weight-only first (the common decode case), then quantized activations.
PAIRS = [("bf16", b) for b in B_KINDS] + [(b, b) for b in B_KINDS]
OUTS = ("bf16", "f16", "f32")

WARPS = 8  # warps per CTA
THREADS = 32 * WARPS
STEP_BYTES = 64  # bytes of one weight row per step (4 lanes x 16 B)


@dataclasses.dataclass(frozen=True)
class Tuning:
    """How the weights reach the registers (measured choices; see docs/sm90_decode_notes.md).

    pipeline "regs": 16-byte loads straight into registers, one sub-chunk ahead.
    pipeline "cpasync": cp.async 16-byte copies into a per-thread shared-memory ring `stages`
        sub-chunks deep (no registers held by loads in flight, so more CTAs per SM fit).
    sub_steps: 64-byte row steps per sub-chunk (one activation staging + one barrier each).
    min_blocks: CTAs per SM the register allocation must allow (__launch_bounds__)."""

    pipeline: str = "regs"
    stages: int = 2
    sub_steps: int = 2
    min_blocks: int = 1
    ctas_per_sm: int = 1  # what the heuristic sizes the grid for (registers/shared memory)
    # NVFP4 weights: fold the bit trick's 2^126 into the block scale (s * 2^119, an exact bf16)
    # and 2^7 into alpha: one bf16x2 multiply per pair instead of two
    fold_scale: bool = False
    # weight rows per thread: 4 (two m16 row tiles per warp, 256 rows of N per CTA) or 2 (one
    # row tile, 128 rows per CTA: registers for 4-8 n8 tiles of M, the wide variants)
    rows_per_thread: int = 4
    # bf16 activations, "cpasync" pipeline: bytes of each of the two activation windows. 0: the
    # activations of every sub-chunk are staged by all threads behind one CTA barrier each. >0:
    # cp.async copies the real rows (< M) of as many sub-chunks as fit in one window, one barrier
    # per window, so the warps run apart for the rest (sm90_decode._mainloop_window).
    act_window: int = 0
    # "tma" pipeline: 64-byte steps per TMA box (1: one box of the CTA's rows x 64 bytes per
    # step; 2 / 4: rows of 128 / 256 bytes, fewer and longer row segments per request)
    box_steps: int = 1
    # Measurement only (decode harness, never shipped): "noload" skips the weight copies (the
    # ring holds garbage), "nocompute" skips the dequantize + MMA work (the ring is still read),
    # "nosync" drops the per-sub-chunk CTA barrier (racy activations): the kernel's time with one
    # part of its work taken away. Results are wrong by design. Pipeline "tma" (debugging the
    # mbarrier protocol): "tmaw" / "tmas" copy only the weights / only the scales, "nowait" never
    # waits on the stage's mbarrier (a CTA may exit with copies in flight: launch failure, the
    # hang test only), "notma" issues no copy at all.
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
        return WARPS * 8 * self.rows_per_thread


# Measured on the H100 (docs/sm90_decode_notes.md, session 5): a TMA ring of 2 sub-chunks of 4
# steps, each sub-chunk one box of 256 rows x 256 bytes, 1 CTA per SM; the multiply-based fp4
# conversion and the NVFP4 scale fold. Runs 25-28, M=16 N=K=16384 bf16 x nvfp4: cp.async ring
# (2 x 2 steps, 2 CTAs/SM) 69.9 us -> TMA with 64-byte boxes 64.6 -> 256-byte boxes 61.9.
DEFAULT_TUNING = Tuning("tma", stages=2, sub_steps=4, min_blocks=1, ctas_per_sm=1,
                        fold_scale=True, box_steps=4)
# nt = 1 (M <= 8): the same ring with 128 rows per CTA (2 rows per thread) and 2 CTAs/SM: run 32,
# bf16 x nvfp4 M=1 N=K=16384 58.0 -> 56.3 us, 8192^2 19.4 -> 18.1, mxfp8 99.5 -> 96.8 (M=16 is
# 1-4 us slower this way, run 31: nt = 2 keeps DEFAULT_TUNING).
NARROW_TUNING = Tuning("tma", stages=2, sub_steps=4, min_blocks=2, ctas_per_sm=2,
                       fold_scale=True, rows_per_thread=2, box_steps=4)
# nt = 4 / 8 (M up to 32 / 64 per pass): one row tile per warp (128 rows of N per CTA), so that
# 4-8 n8 tiles of accumulators fit beside the pipeline; 2 CTAs/SM, a TMA ring of 2 sub-chunks of
# 2 steps with 64-byte boxes (run 30: M=32 / 64, N=K=16384, bf16 x nvfp4 92.7 / 161.5 us with the
# cp.async ring of 1-step sub-chunks -> 85.8 / 156.1; mxfp8 M=64 167.5 -> 149.9).
WIDE_TUNING = Tuning("tma", stages=2, sub_steps=2, min_blocks=2, ctas_per_sm=2,
                     fold_scale=True, rows_per_thread=2)
NTS = (1, 2, 4, 8)  # n8 tiles of M per CTA: M <= 8, 16, 32, 64 rows per pass


def tuning_for(nt: int) -> Tuning:
    """The tuning the library builds a variant with n8-tile count `nt` with."""
    return NARROW_TUNING if nt == 1 else DEFAULT_TUNING if nt == 2 else WIDE_TUNING


def nt_for(m: int) -> int:
    """n8 tiles of M per CTA for a call with m rows (larger m runs chunks of 64 rows)."""
    return next((nt for nt in NTS if m <= 8 * nt), NTS[-1])


@dataclasses.dataclass(frozen=True)
class DecodeVariant:
    """One compiled decode kernel. `nt` = n8 tiles of M per CTA (1: M <= 8, 2: M <= 16, 4: M <= 32,
    8: M <= 64; larger M runs ceil(M / (8*nt)) chunks side by side, sharing the weights in L2)."""

    a_kind: str  # "bf16" (weight-only) or the quantized kind of A
    b_kind: str  # "nvfp4" | "mxfp4" | "mxfp8"
    out: str  # "bf16" | "f16" | "f32"
    nt: int

    @property
    def name(self) -> str:
        return f"jbs_sm90_decode_{self.a_kind}_{self.b_kind}_{self.out}_m{8 * self.nt}"


VARIANTS = [
    DecodeVariant(a, b, out, nt) for (a, b) in PAIRS for out in OUTS for nt in NTS
]
# Past this the fused tensor-core GEMM wins: M = 96 / 128 (two 64-row chunks) measured 299 / 301
# us at N=K=16384 against ~240 for the fused kernel (docs/sm90_decode_notes.md, run 9).
MAX_M = 64

# fmt names as the rest of the package spells them -> kernel kind
_FMT_TO_KIND = {
    None: "bf16", "bf16": "bf16", "nvfp4": "nvfp4", "mxfp4": "mxfp4",
    "mxfp8": "mxfp8", "mxfp8_e4m3": "mxfp8", "mxfp8_e5m2": "mxfp8",
}


def steps_elems(b_kind: str) -> int:
    """K elements one step covers (64 bytes of a weight row)."""
    return STEP_BYTES * 8 // KINDS[b_kind]["bits"]


def choose_decode_variant(m, n, k, fmt_a, fmt_b, sm_count, out="bf16", tuning=None):
    """Pick (variant, splits) for a decode-shaped call, or None if this kernel should not run it.

    Pure Python (the FFI handler mirrors it in C++). fmt_a is None/"bf16" for weight-only.
    splits: K ranges per output tile, so that the grid has about `tuning.ctas_per_sm` CTAs per
    SM (as many as registers and shared memory let run at once: one wave, no tail), each range
    a whole number of sub-chunks. `tuning` defaults to tuning_for(nt) (what the library ships).
    """
    a_kind = _FMT_TO_KIND.get(fmt_a)
    b_kind = _FMT_TO_KIND.get(fmt_b)
    if a_kind is None or b_kind not in B_KINDS:
        return None
    if (a_kind, b_kind) not in PAIRS or out not in OUTS:
        return None
    if m < 1 or n < 1 or k < 32 or k % 32 or k % KINDS[b_kind]["block"]:
        return None
    if m > MAX_M:
        return None
    nt = nt_for(m)
    variant = DecodeVariant(a_kind, b_kind, out, nt)
    tuning = tuning or tuning_for(nt)
    chunk = tuning.sub_steps * steps_elems(b_kind)
    k_chunks = -(-k // chunk)
    ctas = -(-n // tuning.bn) * -(-m // (8 * nt))
    splits = max(1, min(k_chunks, tuning.ctas_per_sm * sm_count // max(1, ctas)))
    # equalize: every split gets the same number of sub-chunks (the last one may be short)
    per = -(-k_chunks // splits)
    splits = -(-k_chunks // per)
    return variant, splits
