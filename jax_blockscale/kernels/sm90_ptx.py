"""Device-side helpers of the Hopper (sm_90a) kernels: inline-PTX loads, stores, cp.async and
mbarrier operations, the block-scale -> bf16x2 conversion and the dequantize + mma.sync groups.

Shared by kernels/sm90_decode.py and kernels/sm90_blockscaled.py (kernels import helpers from
here, never from each other). Each helper returns DSL scalars; has_side_effects keeps their
order. The PTX text generators are plain strings (tests run them on the CPU through
tests/support/ptx_emu.py). Build time only: needs nvidia-cutlass-dsl.
"""
from __future__ import annotations

import cutlass
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

from jax_blockscale.catalog.sm90 import KINDS
from jax_blockscale.kernels.sm90_dequant_ptx import BF16X2_2P119 as _K119
from jax_blockscale.kernels.sm90_dequant_ptx import BF16X2_2P120 as _K120
from jax_blockscale.kernels.sm90_dequant_ptx import FOLD_FACTOR, fp4_perm_pairs_ptx

OUT_DTYPES = {"bf16": cutlass.BFloat16, "f16": cutlass.Float16, "f32": cutlass.Float32}
FOLD_ALPHA = 1.0 / FOLD_FACTOR  # (w * 2^-126) * (s * 2^119) = w * s * 2^-7: alpha takes 2^7 back


def _asm(n_out, out_kind, ins, body, in_cons, loc=None, ip=None, side_effects=True):
    """Run `body` with n_out results of out_kind ("r" i32 / "f" f32) and inputs `ins`."""
    ty = T.i32() if out_kind == "r" else T.f32()
    cons = ",".join([f"={out_kind}"] * n_out + in_cons)
    vals = [x.ir_value(loc=loc, ip=ip) if hasattr(x, "ir_value") else x for x in ins]
    if n_out == 1:
        res = llvm.inline_asm(ty, vals, body, cons, has_side_effects=side_effects,
                              is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT)
        outs = [res]
    elif n_out == 0:
        llvm.inline_asm(None, vals, body, cons, has_side_effects=True,
                        is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT)
        return []
    else:
        st = llvm.StructType.get_literal([ty] * n_out)
        res = llvm.inline_asm(st, vals, body, cons, has_side_effects=side_effects,
                              is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT)
        outs = [llvm.extractvalue(ty, res, [i]) for i in range(n_out)]
    wrap = cutlass.Int32 if out_kind == "r" else cutlass.Float32
    return [wrap(o) for o in outs]


@dsl_user_op
def opaque_i32(x, *, loc=None, ip=None):
    """x, through a register move the compiler cannot see into: a loop whose trip count comes
    from it stays a loop (LLVM does not turn a trip count it cannot bound into an `if`, and
    ptxas does not predicate a loop's body as it does an `if`'s)."""
    return _asm(1, "r", [x], "mov.b32 $0, $1;", ["r"], loc, ip, side_effects=False)[0]


def _ldg_v4_ptx(qualifiers):
    """16 bytes into 4 registers, zeros if !pred ($5), with the load's cache qualifiers."""
    return ("{\n.reg .pred p;\nsetp.ne.b32 p, $5, 0;\n"
            "mov.b32 $0, 0;\nmov.b32 $1, 0;\nmov.b32 $2, 0;\nmov.b32 $3, 0;\n"
            f"@p ld.global{qualifiers}.v4.b32 {{$0, $1, $2, $3}}, [$4];\n}}")


def _space(coherent: bool) -> str:
    """The load's state space: `.nc` (read-only data path) unless `coherent`. ptxas treats .nc
    data as constant for the kernel's life and moves such loads freely, even above a
    griddepcontrol.wait: data another grid writes while this one runs (programmatic dependent
    launch) must be loaded coherently."""
    return "" if coherent else ".nc"


@dsl_user_op
def ldg_stream_v4(addr, pred, *, loc=None, ip=None):
    """16 bytes of streamed weights (not kept in L1; 256-byte L2 prefetch); zeros if !pred."""
    return _asm(4, "r", [cutlass.Int64(addr), cutlass.Int32(pred)],
                _ldg_v4_ptx(".nc.L1::no_allocate.L2::256B"), ["l", "r"], loc, ip)


@dsl_user_op
def ldg_keep_v4(addr, pred, *, loc=None, ip=None):
    """16 bytes that every CTA of the grid reads (a grouped kernel's group sizes), kept in L1
    for the SM's later CTAs; zeros if !pred."""
    return _asm(4, "r", [cutlass.Int64(addr), cutlass.Int32(pred)],
                _ldg_v4_ptx(".nc.L1::evict_last"), ["l", "r"], loc, ip)


@dsl_user_op
def ldg_v4(addr, pred, coherent=False, *, loc=None, ip=None):
    """16 bytes through L1 (activations: read by every CTA of a K range); zeros if !pred."""
    return _asm(4, "r", [cutlass.Int64(addr), cutlass.Int32(pred)],
                _ldg_v4_ptx(_space(coherent)), ["l", "r"], loc, ip)


@dsl_user_op
def ldg_bytes(addr, pred, nbytes, coherent=False, *, loc=None, ip=None):
    """1, 2, 4 or 8 bytes (zero-extended into 1 or 2 i32) through L1; zeros if !pred."""
    if nbytes == 8:
        body = ("{\n.reg .pred p;\nsetp.ne.b32 p, $3, 0;\nmov.b32 $0, 0;\nmov.b32 $1, 0;\n"
                f"@p ld.global{_space(coherent)}.v2.b32 {{$0, $1}}, [$2];\n}}")
        return _asm(2, "r", [cutlass.Int64(addr), cutlass.Int32(pred)], body, ["l", "r"], loc, ip)
    ty = {1: "u8", 2: "u16", 4: "b32"}[nbytes]
    body = ("{\n.reg .pred p;\nsetp.ne.b32 p, $2, 0;\nmov.b32 $0, 0;\n"
            f"@p ld.global{_space(coherent)}.{ty} $0, [$1];\n}}")
    return _asm(1, "r", [cutlass.Int64(addr), cutlass.Int32(pred)], body, ["l", "r"], loc, ip)[0]


@dsl_user_op
def lds_v4(addr, *, loc=None, ip=None):
    return _asm(4, "r", [cutlass.Int32(addr)], "ld.shared.v4.b32 {$0, $1, $2, $3}, [$4];",
                ["r"], loc, ip)


@dsl_user_op
def lds_v2(addr, *, loc=None, ip=None):
    return _asm(2, "r", [cutlass.Int32(addr)], "ld.shared.v2.b32 {$0, $1}, [$2];", ["r"], loc,
                ip)


# The largest e8m0 code the MXFP4 fold carries (a scale of 2; _SCALE_PAIR_E8M0_FOLDED says why)
MX_FOLD_MAX_CODE = 0x80


def bytes_above_ptx(n_words: int) -> str:
    """PTX of bytes_above_mx_fold: $1..$n = words -> $0 nonzero iff a byte is above
    MX_FOLD_MAX_CODE (the bit test below works for 0x80 only)."""
    assert MX_FOLD_MAX_CODE == 0x80
    code = ["{", ".reg .b32 t, acc;", "mov.b32 acc, 0;"]
    for i in range(1, n_words + 1):
        code += [f"and.b32 t, ${i}, 0x7F7F7F7F;",
                 "add.u32 t, t, 0x7F7F7F7F;",  # bit 7 of a byte: its low 7 bits are not all 0
                 f"lop3.b32 t, t, ${i}, 0x80808080, 0x80;",  # ... and its own bit 7 is set
                 "or.b32 acc, acc, t;"]
    return "\n".join(code + ["mov.b32 $0, acc;", "}"])


@dsl_user_op
def bytes_above_mx_fold(words, *, loc=None, ip=None):
    """Nonzero iff a byte of `words` (block-scale codes) is above MX_FOLD_MAX_CODE (0x80)."""
    return _asm(1, "r", [cutlass.Int32(w) for w in words], bytes_above_ptx(len(words)),
                ["r"] * len(words), loc, ip, side_effects=False)[0]


# the answer leaves as a warp ballot: ptxas then knows it is the same in every lane (a uniform
# register), so a branch on it needs no divergence handling around the MMAs it selects
SYNC_THREADS_OR_PTX = ("{\n.reg .pred p, q;\nsetp.ne.b32 p, $1, 0;\n"
                       "barrier.cta.red.or.pred q, 0, p;\n"
                       "vote.sync.ballot.b32 $0, q, 0xffffffff;\n}")


@dsl_user_op
def sync_threads_or(flag, *, loc=None, ip=None):
    """The CTA barrier (barrier 0, as sync_threads, with its memory ordering) that also ORs
    `flag` over the CTA's threads: every thread gets the same nonzero value where any thread's
    flag is nonzero, else 0."""
    return _asm(1, "r", [cutlass.Int32(flag)], SYNC_THREADS_OR_PTX, ["r"], loc, ip)[0]


@dsl_user_op
def sts_v4(addr, v, *, loc=None, ip=None):
    _asm(0, "r", [cutlass.Int32(addr)] + [cutlass.Int32(x) for x in v],
         "st.shared.v4.b32 [$0], {$1, $2, $3, $4};", ["r", "r", "r", "r", "r"], loc, ip)


@dsl_user_op
def pack_f32x2(out, lo, hi, *, loc=None, ip=None):
    """lo and hi rounded to nearest-even into one word of two `out` halves ("bf16" / "f16"),
    lo in the low half (the lower address once stored)."""
    return _asm(1, "r", [cutlass.Float32(lo), cutlass.Float32(hi)],
                f"cvt.rn.{out}x2.f32 $0, $2, $1;", ["f", "f"], loc, ip, side_effects=False)[0]


@dsl_user_op
def stmatrix_x4_trans(addr, regs, *, loc=None, ip=None):
    """Four 8 x 8 matrices of 16-bit values, stored transposed: register q of lane 4 r + c holds
    row r, columns 2 c and 2 c + 1 of matrix q, and lane 8 q + i gives the shared address of
    the 16 bytes that receive column i of matrix q (its 8 rows in order)."""
    _asm(0, "r", [cutlass.Int32(addr)] + [cutlass.Int32(x) for x in regs],
         "stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [$0], {$1, $2, $3, $4};",
         ["r"] * 5, loc, ip)


@dsl_user_op
def stg_v4(addr, v, pred, *, loc=None, ip=None):
    """16 bytes (four words) to global memory at addr (16-byte aligned) if pred."""
    body = ("{\n.reg .pred p;\nsetp.ne.b32 p, $5, 0;\n"
            "@p st.global.v4.b32 [$0], {$1, $2, $3, $4};\n}")
    _asm(0, "r", [cutlass.Int64(addr)] + [cutlass.Int32(x) for x in v] + [cutlass.Int32(pred)],
         body, ["l", "r", "r", "r", "r", "r"], loc, ip)


@dsl_user_op
def stg_f32(addr, val, pred, *, loc=None, ip=None):
    body = "{\n.reg .pred p;\nsetp.ne.b32 p, $2, 0;\n@p st.global.f32 [$0], $1;\n}"
    _asm(0, "r", [cutlass.Int64(addr), cutlass.Float32(val), cutlass.Int32(pred)], body,
         ["l", "f", "r"], loc, ip)


@dsl_user_op
def ldg_f32(addr, *, loc=None, ip=None):
    return _asm(1, "f", [cutlass.Int64(addr)], "ld.global.f32 $0, [$1];", ["l"], loc, ip)[0]


def _predicated_ptx(pre, vector_op, scalar_ops):
    """PTX that runs `vector_op` when $vec != 0, else scalar_ops[e] for e < $valid (the operand
    numbers of $vec / $valid are in `pre`'s setp lines)."""
    return ("{\n.reg .pred pv, p0, p1, p2, p3;\n" + pre + "@pv " + vector_op + "\n"
            + "".join(f"@p{e} {op}\n" for e, op in enumerate(scalar_ops)) + "}")


def _lane_preds(vec, valid):
    return (f"setp.ne.b32 pv, {vec}, 0;\n"
            + "".join(f"setp.gt.and.s32 p{e}, {valid}, {e}, !pv;\n" for e in range(4)))


@dsl_user_op
def ldg4_f32(addr, vec, valid, *, loc=None, ip=None):
    """Four consecutive floats at addr: one 16-byte load when vec != 0 (addr 16-byte aligned),
    else the first `valid` (0..4) one by one; the others are +0.0."""
    body = _predicated_ptx(
        "".join(f"mov.b32 ${e}, 0f00000000;\n" for e in range(4)) + _lane_preds("$5", "$6"),
        "ld.global.v4.f32 {$0, $1, $2, $3}, [$4];",
        [f"ld.global.f32 ${e}, [$4+{4 * e}];" for e in range(4)])
    return _asm(4, "f", [cutlass.Int64(addr), cutlass.Int32(vec), cutlass.Int32(valid)], body,
                ["l", "r", "r"], loc, ip)


FIN_FOUR_FROM = 1 << 17  # finalize: four outputs per thread from this many outputs on


@dsl_user_op
def stg4_out(out, addr, vals, vec, valid, *, loc=None, ip=None):
    """Four consecutive outputs (f32 values, rounded to nearest-even into `out`) at addr: one
    vector store when vec != 0 (addr 16-byte aligned), else the first `valid` one by one."""
    ins = [cutlass.Int64(addr)] + [cutlass.Float32(v) for v in vals] + [
        cutlass.Int32(vec), cutlass.Int32(valid)]
    preds = _lane_preds("$5", "$6")
    if out == "f32":
        body = _predicated_ptx(preds, "st.global.v4.f32 [$0], {$1, $2, $3, $4};",
                               [f"st.global.f32 [$0+{4 * e}], ${e + 1};" for e in range(4)])
    else:  # two halves per 32-bit word, element e at the lower address first
        cvt = f"cvt.rn.{out}x2.f32"
        pack = (".reg .b32 h01, h23;\n.reg .b16 e0, e1, e2, e3;\n"
                f"{cvt} h01, $2, $1;\n{cvt} h23, $4, $3;\n"
                "mov.b32 {e0, e1}, h01;\nmov.b32 {e2, e3}, h23;\n")
        body = _predicated_ptx(pack + preds, "st.global.v2.b32 [$0], {h01, h23};",
                               [f"st.global.b16 [$0+{2 * e}], e{e};" for e in range(4)])
    _asm(0, "r", ins, body, ["l", "f", "f", "f", "f", "r", "r"], loc, ip)


@dsl_user_op
def cp_async(dst, src, nbytes, pred, *, loc=None, ip=None):
    """Asynchronous global -> shared copy of 16 bytes (L1 bypass, 256-byte L2 prefetch) or 4
    bytes; zero-filled when !pred (no global read then)."""
    qual = "cg.shared.global.L2::256B" if nbytes == 16 else "ca.shared.global"
    body = ("{\n.reg .pred p;\n.reg .b32 sz;\nsetp.ne.b32 p, $2, 0;\n"
            f"selp.b32 sz, {nbytes}, 0, p;\ncp.async.{qual} [$0], [$1], {nbytes}, sz;\n}}")
    _asm(0, "r", [cutlass.Int32(dst), cutlass.Int64(src), cutlass.Int32(pred)], body,
         ["r", "l", "r"], loc, ip)


@dsl_user_op
def cp_async_commit(*, loc=None, ip=None):
    _asm(0, "r", [], "cp.async.commit_group;", [], loc, ip)


@dsl_user_op
def cp_async_wait(n, *, loc=None, ip=None):
    """Wait until at most n of this thread's committed copy groups are still in flight."""
    _asm(0, "r", [], f"cp.async.wait_group {n};", [], loc, ip)


# --- mbarriers (Tuning "tma") ------------------------------------------------------------------
@dsl_user_op
def mbar_init(bar, count, *, loc=None, ip=None):
    _asm(0, "r", [cutlass.Int32(bar), cutlass.Int32(count)],
         "mbarrier.init.shared::cta.b64 [$0], $1;", ["r", "r"], loc, ip)


@dsl_user_op
def mbar_init_fence(*, loc=None, ip=None):
    """Make the mbarrier inits visible to the async proxy (the TMA copies) before first use."""
    _asm(0, "r", [], "fence.mbarrier_init.release.cluster;", [], loc, ip)


@dsl_user_op
def mbar_arrive_expect_tx(bar, nbytes, *, loc=None, ip=None):
    """One arrival on `bar` that also announces `nbytes` of TMA copies for this phase."""
    body = ("{\n.reg .b64 st;\n"
            "mbarrier.arrive.expect_tx.shared::cta.b64 st, [$0], $1;\n}")
    _asm(0, "r", [cutlass.Int32(bar), cutlass.Int32(nbytes)], body, ["r", "r"], loc, ip)


@dsl_user_op
def mbar_wait(bar, parity, *, loc=None, ip=None):
    """Spin until phase `parity` of `bar` has completed (labels are local to the braces)."""
    body = ("{\n.reg .pred p;\nWAIT:\n"
            "mbarrier.try_wait.parity.shared::cta.b64 p, [$0], $1;\n"
            "@!p bra WAIT;\n}")
    _asm(0, "r", [cutlass.Int32(bar), cutlass.Int32(parity)], body, ["r", "r"], loc, ip)


# --- scales -> bf16x2 (both halves equal) -----------------------------------------------------
# One byte of a 32-bit word, picked by a prmt selector `sel` = SCALE_BYTE_SEL + 0x101 * i (byte i
# into both halves, zeros above): no shift/mask per scale, one shift for both halves. A NaN scale
# (e4m3 0x7F, e8m0 0xFF: what quantize writes for a block holding a NaN or Inf) becomes a bf16
# NaN, so the whole block decodes to NaN (docs/formats.md, "NaN and Inf"); the bit tricks alone
# would read it as 480 (e4m3) or Inf (e8m0).
SCALE_BYTE_SEL = 0x4040
BF16X2_NAN = 0x7FC07FC0
_SCALE_E4M3 = f"""{{
.reg .b32 t, k;
.reg .pred pn;
prmt.b32 t, $1, 0, $2;
and.b32 k, t, 0x7F;
setp.eq.u32 pn, k, 0x7F;         // e4m3 NaN
shl.b32 t, t, 4;                 // e4m3 (non-negative) bits -> bf16 bits: value * 2^-120
mov.b32 k, {_K120:#x};
mul.rn.bf16x2 t, t, k;
selp.b32 $0, {BF16X2_NAN:#x}, t, pn;
}}"""
# NVFP4 with the fold: the scale also carries 2^119 (the weights' 2^-126 is then undone by it)
_SCALE_E4M3_FOLDED = _SCALE_E4M3.replace(
    "mul.rn.bf16x2 t, t, k;", f"mul.rn.bf16x2 t, t, k;\nmov.b32 k, {_K119:#x};\n"
    "mul.rn.bf16x2 t, t, k;")
_SCALE_E8M0 = f"""{{
.reg .b32 t;
.reg .pred p, pn;
prmt.b32 t, $1, 0, $2;
setp.eq.u32 p, t, 0;
setp.eq.u32 pn, t, 0x00FF00FF;   // e8m0 NaN
shl.b32 t, t, 7;                 // e8m0 = the bf16 exponent field
selp.b32 t, 0x00400040, t, p;    // 2^-127 is a bf16 subnormal
selp.b32 $0, {BF16X2_NAN:#x}, t, pn;
}}"""


# Two scale bytes at once (the decode kernel: an NVFP4 thread's two blocks of a row, or an MX
# thread's block of two rows). `prmt` puts byte A in the low byte of the low half and byte B in
# the low byte of the high half (what lands in bytes 1 and 3 is masked off), both halves are
# converted by the same instructions, and each half leaves broadcast to both halves of its own
# register ({lo, lo}, {hi, hi}): ptxas reads such a broadcast straight from the packed register
# (an HMUL2 operand selector), so no instruction is spent on it. A NaN code is found by one packed
# compare of the converted halves and OR-ed to 0xFFFF (a bf16 NaN).
_PAIR_SPLIT = """
mov.b32 {lo, hi}, t;
mov.b32 $0, {lo, lo};
mov.b32 $1, {hi, hi};
}"""
_SCALE_PAIR_E4M3 = f"""{{
.reg .b32 t, k, n;
.reg .b16 lo, hi;
prmt.b32 t, $2, $3, $4;
and.b32 t, t, 0x007F007F;        // the magnitude: 0xFF is a NaN code too, as 0x7F
shl.b32 t, t, 4;                 // e4m3 bits -> bf16 bits: value * 2^-120
mov.b32 k, {_K120:#x};
mul.rn.bf16x2 t, t, k;
mov.b32 k, NAN_CODE;             // where the NaN code 0x7F landed: 480 (times the fold)
set.eq.u32.bf16x2 n, t, k;
or.b32 t, t, n;""" + _PAIR_SPLIT
_SCALE_PAIR_E4M3_FOLDED = _SCALE_PAIR_E4M3.replace(
    "mul.rn.bf16x2 t, t, k;", f"mul.rn.bf16x2 t, t, k;\nmov.b32 k, {_K119:#x};\n"
    "mul.rn.bf16x2 t, t, k;").replace("NAN_CODE", "0x7F707F70")  # 480 * 2^119
_SCALE_PAIR_E4M3 = _SCALE_PAIR_E4M3.replace("NAN_CODE", "0x43F043F0")  # 480
_SCALE_PAIR_E8M0 = """{
.reg .b32 t, k, n;
.reg .b16 lo, hi;
prmt.b32 t, $2, $3, $4;
shl.b32 t, t, 7;                 // e8m0 = the bf16 exponent field
and.b32 t, t, 0x7F807F80;
mov.b32 k, 0x00400040;
max.bf16x2 t, t, k;              // e8m0 0 is 2^-127: a bf16 subnormal (every other code is larger)
mov.b32 k, 0x7F807F80;
set.eq.u32.bf16x2 n, t, k;       // e8m0 0xFF (NaN) landed on inf
or.b32 t, t, n;""" + _PAIR_SPLIT


# MXFP4 weights with the fold (the decode kernel's CTAs whose block scales are all at most
# MX_FOLD_MAX_CODE, Sm90DecodeGemm.mx_fold): the scale carries the bit trick's 2^126 too, as
# 2^126 * 2^(code - 127) = 2^(code - 1), the bf16 of exponent field code + 126. That is a finite
# bf16 only up to code 128 (scale 2), so the kernel takes this form only for CTAs it has
# checked; a NaN code (0xFF) is above it and never reaches this form. One multiply per pair then
# applies scale and offset, as the NVFP4 fold does, and the products are the exact values.
_SCALE_PAIR_E8M0_FOLDED = """{
.reg .b32 t;
.reg .b16 lo, hi;
prmt.b32 t, $2, $3, $4;
and.b32 t, t, 0x00FF00FF;
shl.b32 t, t, 7;
add.u32 t, t, 0x3F003F00;        // exponent field code + 126: 2^(code - 1)""" + _PAIR_SPLIT


def scale_pair_sel(byte_a: int, byte_b: int) -> int:
    """prmt selector of scale_pair_bf16x2: byte `byte_a` (0-3 of word A, 4-7 of word B) to the
    low half, `byte_b` to the high half."""
    return byte_a | (byte_b << 8)


def scale_pair_ptx(kind: str, fold: bool = False) -> str:
    """PTX of scale_pair_bf16x2: $2, $3 = scale words, $4 = scale_pair_sel -> $0, $1 = bf16x2
    scales (both halves equal). fold: an e4m3 scale times 2^119; an e8m0 one times 2^126 (codes
    up to MX_FOLD_MAX_CODE only: the caller has checked them)."""
    if KINDS[kind]["scale"] == "e4m3":
        return _SCALE_PAIR_E4M3_FOLDED if fold else _SCALE_PAIR_E4M3
    return _SCALE_PAIR_E8M0_FOLDED if fold else _SCALE_PAIR_E8M0


@dsl_user_op
def scale_pair_bf16x2(kind, word_a, word_b, sel, fold=False, *, loc=None, ip=None):
    """Two block-scale bytes (picked by `sel` = scale_pair_sel(...) from words A and B) -> two
    bf16x2, each with its scale in both halves (when `fold`, times 2^119 for e4m3 and 2^126 for
    e8m0: scale_pair_ptx), as scale_bf16x2 gives for each alone."""
    return _asm(2, "r", [cutlass.Int32(word_a), cutlass.Int32(word_b), cutlass.Int32(sel)],
                scale_pair_ptx(kind, fold), ["r", "r", "r"], loc, ip, side_effects=False)


def scale_pair_packed_ptx(kind: str) -> str:
    """PTX of scale_pair_packed_bf16x2, operands as scale_pair_ptx's (unfolded), without the
    split: $0 = one bf16x2 holding scale A in its low half and scale B in its high half ($1 the
    same, unused)."""
    body = scale_pair_ptx(kind)
    assert body.endswith(_PAIR_SPLIT)
    return body[: -len(_PAIR_SPLIT)] + "\nmov.b32 $0, t;\nmov.b32 $1, t;\n}"


@dsl_user_op
def scale_pair_packed_bf16x2(kind, word_a, word_b, sel, *, loc=None, ip=None):
    """Two block-scale bytes (as scale_pair_bf16x2 picks them) -> ONE bf16x2 holding both, scale
    A low and scale B high: half the registers of the broadcast pair. Each half is broadcast
    where it is used (`mov.b32 {lo, hi}, s; mov.b32 x, {lo, lo}`), which ptxas folds into the
    multiply's operand selector."""
    return _asm(2, "r", [cutlass.Int32(word_a), cutlass.Int32(word_b), cutlass.Int32(sel)],
                scale_pair_packed_ptx(kind), ["r", "r", "r"], loc, ip, side_effects=False)[0]


def scale_ptx(kind: str, fold: bool = False) -> str:
    """PTX of scale_bf16x2: $1 = scale word, $2 = byte selector -> $0 = bf16x2 scale."""
    if KINDS[kind]["scale"] == "e4m3":
        return _SCALE_E4M3_FOLDED if fold else _SCALE_E4M3
    assert not fold, "only e4m3 scales are folded"
    return _SCALE_E8M0


@dsl_user_op
def scale_bf16x2(kind, word, sel=SCALE_BYTE_SEL, fold=False, *, loc=None, ip=None):
    """Block-scale byte `sel` picks of a scale word (default: the low byte) -> bf16x2 with the
    scale in both halves (times 2^119 when `fold`: NVFP4 weights converted with fold=True)."""
    return _asm(1, "r", [cutlass.Int32(word), cutlass.Int32(sel)], scale_ptx(kind, fold),
                ["r", "r"], loc, ip, side_effects=False)[0]


# --- element conversion (PTX text generators) --------------------------------------------------
def _fp4_pairs_ptx(w, s, outs, tmp="cv", fold=False):
    """8 e2m1 nibbles of register `w` -> 4 bf16x2 in `outs`: outs[j] = (nibble j, nibble j+4),
    times the bf16x2 scale `s` (the fused kernel's permuted-order conversion, shared). fold: `s`
    already carries the 2^126 (times 2^-7, see Tuning.fold_scale)."""
    return fp4_perm_pairs_ptx(w, s, outs, f"{tmp}0", f"{tmp}1", f"{tmp}k", fold)


def _fp8_pairs_ptx(w, s, outs, shift, mask, fix, tmp="cv"):
    """4 e4m3/e5m2 bytes of `w` -> 2 bf16x2: outs[0] = (byte0, byte1), outs[1] = (byte2, byte3).
    Bytes go to the high byte of each half (sign in place), the magnitude shifts right by
    `shift` (4: e4m3, 3: e5m2) into the bf16 exponent/mantissa; `fix` undoes the power of two."""
    code = []
    for j, sel in enumerate((0x1404, 0x3424)):
        o = outs[j]
        code.append(f"prmt.b32 {tmp}1, {w}, 0, {sel:#x};")
        code.append(f"shr.b32 {tmp}0, {tmp}1, {shift};")
        code.append(f"and.b32 {tmp}0, {tmp}0, {mask};")
        code.append(f"lop3.b32 {o}, {tmp}0, {tmp}1, 0x80008000, 0xF8;")
        code.append(f"mul.rn.bf16x2 {o}, {o}, {fix};")
        code.append(f"mul.rn.bf16x2 {o}, {o}, {s};")
    return "\n".join(code)


_MMA = ("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{{{d0}, {d1}, {d2}, {d3}}}, {{{a0}, {a1}, {a2}, {a3}}}, {{{b0}, {b1}}}, "
        "{{{d0}, {d1}, {d2}, {d3}}};")


def dequant_mma_ptx(b_kind: str, nt: int, fold: bool = False) -> str:
    """PTX of dequant_mma. Operands: $0..$(4nt-1) accumulators (outputs), the same again as tied
    inputs, then the weight words of row g and of row g+8 (1 each for fp4, 2 each for fp8), the
    two bf16x2 scales, 4 activation words per n8 tile, and for fp8 (shift, mask, fix)."""
    n_acc = 4 * nt
    nw = 1 if KINDS[b_kind]["bits"] == 4 else 2
    base = 2 * n_acc  # operands: outputs 0..n_acc-1, then the tied accumulator inputs
    wreg = [f"${base + i}" for i in range(2 * nw)]
    base += 2 * nw
    s_g, s_h = f"${base}", f"${base + 1}"
    base += 2
    act_reg = [[f"${base + 4 * i + j}" for j in range(4)] for i in range(nt)]
    base += 4 * nt
    code = ["{", ".reg .b32 cv0, cv1, cvk, pg<4>, ph<4>;"]
    if nw == 2:
        shift, mask, fix = f"${base}", f"${base + 1}", f"${base + 2}"
        code.append(_fp8_pairs_ptx(wreg[0], s_g, ["pg0", "pg1"], shift, mask, fix))
        code.append(_fp8_pairs_ptx(wreg[1], s_g, ["pg2", "pg3"], shift, mask, fix))
        code.append(_fp8_pairs_ptx(wreg[2], s_h, ["ph0", "ph1"], shift, mask, fix))
        code.append(_fp8_pairs_ptx(wreg[3], s_h, ["ph2", "ph3"], shift, mask, fix))
    else:
        code.append(_fp4_pairs_ptx(wreg[0], s_g, ["pg0", "pg1", "pg2", "pg3"], fold=fold))
        code.append(_fp4_pairs_ptx(wreg[1], s_h, ["ph0", "ph1", "ph2", "ph3"], fold=fold))
    # MMA h of the group takes pairs (2h, 2h+1) of each row: A = [pg, ph, pg', ph'] is rows
    # g / g+8 at K slots (2t, 2t+1) and (2t+8, 2t+9); B = activation words 2h, 2h+1.
    for h in range(2):
        for i in range(nt):
            d = [f"${4 * i + c}" for c in range(4)]
            code.append(_MMA.format(
                d0=d[0], d1=d[1], d2=d[2], d3=d[3],
                a0=f"pg{2 * h}", a1=f"ph{2 * h}", a2=f"pg{2 * h + 1}", a3=f"ph{2 * h + 1}",
                b0=act_reg[i][2 * h], b1=act_reg[i][2 * h + 1]))
    code.append("}")
    return "\n".join(code)


@dsl_user_op
def dequant_mma(b_kind, nt, wg, wh, sg, sh, act, acc, fp8_params, fold=False, *, loc=None,
                ip=None):
    """Two k16 MMAs per n8 tile for one 8-element (fp4) / 2x4-element (fp8) group of rows g and
    g+8 of a row tile: convert the weights, then acc[nt] += W (16 x 16) @ act[nt] (16 x 8).

    wg, wh: the group's weight words of rows g / g+8 (1 word fp4, 2 words fp8); sg, sh: their
    bf16x2 scales; act[nt]: 4 words (B registers of the two MMAs); acc[nt]: 4 f32 each."""
    n_acc = 4 * nt
    ins = list(acc)  # tied to the outputs 0..n_acc-1
    cons = [str(i) for i in range(n_acc)]
    ins += [cutlass.Int32(x) for x in wg] + [cutlass.Int32(x) for x in wh]
    cons += ["r"] * (len(wg) + len(wh))
    ins += [cutlass.Int32(sg), cutlass.Int32(sh)]
    cons += ["r", "r"]
    for x in act:
        ins += [cutlass.Int32(v) for v in x]
        cons += ["r"] * 4
    if b_kind == "mxfp8":
        ins += [cutlass.Int32(x) for x in fp8_params]
        cons += ["r"] * 3
    return _asm(n_acc, "f", ins, dequant_mma_ptx(b_kind, nt, fold), cons, loc, ip,
                side_effects=False)


# outputs $0..$3, inputs $4..$7 = (x0x1, x2x3, x4x5, x6x7)
PERMUTE_FP4_PTX = ("prmt.b32 $0, $4, $6, 0x5410;\nprmt.b32 $1, $4, $6, 0x7632;\n"
                   "prmt.b32 $2, $5, $7, 0x5410;\nprmt.b32 $3, $5, $7, 0x7632;")


@dsl_user_op
def permute_fp4_order(v, *, loc=None, ip=None):
    """8 bf16 (x0x1, x2x3, x4x5, x6x7) -> (x0x4, x1x5, x2x6, x3x7): the fp4 weight pair order."""
    return _asm(4, "r", [cutlass.Int32(x) for x in v], PERMUTE_FP4_PTX, ["r"] * 4, loc, ip,
                side_effects=False)


def dequant_group_ptx(kind: str) -> str:
    """PTX of dequant_group: outputs $0..$3; inputs: the word(s), the bf16x2 scale, for fp8
    (shift, mask, fix)."""
    code = ["{", ".reg .b32 cv0, cv1, cvk;"]
    if KINDS[kind]["bits"] == 8:
        code.append(_fp8_pairs_ptx("$4", "$6", ["$0", "$1"], "$7", "$8", "$9"))
        code.append(_fp8_pairs_ptx("$5", "$6", ["$2", "$3"], "$7", "$8", "$9"))
    else:
        code.append(_fp4_pairs_ptx("$4", "$5", ["$0", "$1", "$2", "$3"]))
    code.append("}")
    return "\n".join(code)


@dsl_user_op
def dequant_group(kind, words, s, fp8_params, *, loc=None, ip=None):
    """Quantized activations: 8 elements (1 word fp4, 2 words fp8) -> 4 bf16x2 in the weight pair
    order of `kind` (fp4: nibbles (j, j+4); fp8: natural), times the bf16x2 scale s."""
    ins = [cutlass.Int32(x) for x in words] + [cutlass.Int32(s)]
    cons = ["r"] * (len(words) + 1)
    if KINDS[kind]["bits"] == 8:
        ins += [cutlass.Int32(x) for x in fp8_params]
        cons += ["r"] * 3
    return _asm(4, "r", ins, dequant_group_ptx(kind), cons, loc, ip, side_effects=False)
