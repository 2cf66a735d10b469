"""A tiny warp-level emulator for the straight-line PTX that sm90_decode.py generates.

Enough PTX to run the dequantization / MMA blocks on the CPU: mov (also to and from 16-bit halves),
shl, shr, mul.lo, add, and, or, lop3, prmt, setp.eq, selp, mul.rn.bf16x2, max.bf16x2,
set.eq.u32.bf16x2 and mma.sync.m16n8k16 (bf16 in, f32 out). Every register holds one
value per lane (a numpy array of 32). Used by tests/test_sm90_decode_build.py to check the bit
tricks on every code and the fragment/permutation bookkeeping end to end, with no GPU.
"""
from __future__ import annotations

import re

import ml_dtypes
import numpy as np

LANES = 32


def bf16_to_f64(u16):
    return (u16.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


def f64_to_bf16(x):
    return np.asarray(x, np.float64).astype(np.float32).astype(ml_dtypes.bfloat16).view(np.uint16)


def f64_to_bf16_exact(x):
    """Round float64 -> bf16 with one rounding (products here are exact, so any rounding that is
    correct for representable values will do); checks the value survived."""
    b = np.asarray(x, np.float64).astype(ml_dtypes.bfloat16)
    return b.view(np.uint16)


def _halfwise(a, b, f):
    """f(x, y) -> uint16 bits on the float64 values of each bf16 half of a and b."""
    out = np.zeros_like(a)
    for sh in (0, 16):
        x = bf16_to_f64(((a >> sh) & 0xFFFF).astype(np.uint16))
        y = bf16_to_f64(((b >> sh) & 0xFFFF).astype(np.uint16))
        out |= np.asarray(f(x, y)).astype(np.uint32) << sh
    return out


def _mul_bf16x2(a, b):
    return _halfwise(a, b, lambda x, y: f64_to_bf16_exact(x * y))


def _prmt(a, b, sel):
    """prmt.b32's default mode, per lane (`sel` may differ across lanes), with the
    sign-replicate selectors (msb set: the byte's bit 7 copied to all 8 bits)."""
    src = [(a >> (8 * i)) & 0xFF for i in range(4)] + [(b >> (8 * i)) & 0xFF for i in range(4)]
    out = np.zeros_like(a)
    for i in range(4):
        s = (sel >> (4 * i)) & 0xF
        byte = np.choose(s & 7, src)
        byte = np.where(s & 8, np.where(byte & 0x80, 0xFF, 0x00), byte).astype(a.dtype)
        out |= byte << (8 * i)
    return out


def _lop3(a, b, c, lut):
    out = np.zeros_like(a)
    for bit in range(32):
        ia = (a >> bit) & 1
        ib = (b >> bit) & 1
        ic = (c >> bit) & 1
        idx = (ia << 2) | (ib << 1) | ic
        out |= ((lut >> idx) & 1) << bit
    return out


def _mma_m16n8k16(a_regs, b_regs, c_regs):
    """a_regs: 4 lane-arrays of bf16x2, b_regs: 2, c_regs: 4 lane-arrays of f32 (float64 here)."""
    A = np.zeros((16, 16))
    B = np.zeros((16, 8))
    lane = np.arange(LANES)
    g, t = lane // 4, lane % 4

    def halves(r):
        return bf16_to_f64((r & 0xFFFF).astype(np.uint16)), bf16_to_f64((r >> 16).astype(np.uint16))

    for reg, (roff, koff) in zip(a_regs, [(0, 0), (8, 0), (0, 8), (8, 8)]):
        lo, hi = halves(reg)
        A[g + roff, 2 * t + koff] = lo
        A[g + roff, 2 * t + koff + 1] = hi
    for reg, koff in zip(b_regs, [0, 8]):
        lo, hi = halves(reg)
        B[2 * t + koff, g] = lo
        B[2 * t + koff + 1, g] = hi
    C = np.zeros((16, 8))
    for reg, (roff, coff) in zip(c_regs, [(0, 0), (0, 1), (8, 0), (8, 1)]):
        C[g + roff, 2 * t + coff] = reg
    D = C + A @ B
    return [D[g + roff, 2 * t + coff] for (roff, coff) in [(0, 0), (0, 1), (8, 0), (8, 1)]]


def _imm(tok):
    tok = tok.strip()
    return int(tok, 16) if tok.startswith("0x") else int(tok)


def run(ptx: str, operands: dict):
    """Execute `ptx` (the asm body with $N operands) for a warp. operands: {"$N": lane array}
    (uint32 for .b32, float64 for f32 accumulators). Returns the operand dict afterwards."""
    regs = dict(operands)

    def val(tok):
        tok = tok.strip()
        if tok in regs:
            return regs[tok]
        return np.full(LANES, _imm(tok), np.uint32)

    # scope braces stand on lines of their own; braces inside a statement (register lists) stay
    lines = (re.sub(r"//.*", "", line) for line in ptx.split("\n"))
    body = " ".join(x for x in lines if x.strip() not in ("{", "}"))
    for stmt in body.split(";"):
        stmt = stmt.strip()
        if not stmt or stmt.startswith(".reg"):
            continue
        if stmt.startswith("mma.sync"):
            toks = re.findall(r"\$\d+|[A-Za-z_][A-Za-z_0-9]*\d*", stmt.split(None, 1)[1])
            d, a, b, c = toks[0:4], toks[4:8], toks[8:10], toks[10:14]
            res = _mma_m16n8k16([regs[x] for x in a], [regs[x] for x in b],
                                [regs[x] for x in c])
            for x, r in zip(d, res):
                regs[x] = r
            continue
        op, rest = stmt.split(None, 1)
        u = np.uint32
        if op == "mov.b32" and "{" in rest:  # a 32-bit register to or from two 16-bit halves
            dst, src = [x.strip() for x in rest.split("}" if rest.startswith("{") else ",", 1)]
            if dst.startswith("{"):  # mov.b32 {lo, hi}, r
                lo, hi = [x.strip() for x in dst[1:].split(",")]
                r = val(src.lstrip(", "))
                regs[lo], regs[hi] = (r & 0xFFFF).astype(u), (r >> 16).astype(u)
            else:  # mov.b32 r, {lo, hi}
                lo, hi = [x.strip() for x in src.strip("{} ").split(",")]
                regs[dst] = ((val(lo) & 0xFFFF) | ((val(hi) & 0xFFFF) << 16)).astype(u)
            continue
        args = [x.strip() for x in rest.split(",")]
        if op == "mov.b32":
            regs[args[0]] = val(args[1]).astype(u)
        elif op == "shl.b32":
            regs[args[0]] = (val(args[1]) << val(args[2])).astype(u)
        elif op == "shr.b32":
            regs[args[0]] = (val(args[1]) >> val(args[2])).astype(u)
        elif op == "mul.lo.u32":  # low 32 bits of the product
            regs[args[0]] = ((val(args[1]).astype(np.uint64) * val(args[2]).astype(np.uint64))
                             & 0xFFFFFFFF).astype(u)
        elif op == "add.u32":  # modulo 2^32
            regs[args[0]] = ((val(args[1]).astype(np.uint64) + val(args[2]).astype(np.uint64))
                             & 0xFFFFFFFF).astype(u)
        elif op == "and.b32":
            regs[args[0]] = (val(args[1]) & val(args[2])).astype(u)
        elif op == "or.b32":
            regs[args[0]] = (val(args[1]) | val(args[2])).astype(u)
        elif op == "set.eq.u32.bf16x2":  # per half: 0xFFFF where equal (NaN never is), else 0
            regs[args[0]] = _halfwise(val(args[1]), val(args[2]),
                                      lambda x, y: np.where(x == y, 0xFFFF, 0))
        elif op == "max.bf16x2":  # per half (this emulator's inputs hold no NaN)
            regs[args[0]] = _halfwise(val(args[1]), val(args[2]),
                                      lambda x, y: f64_to_bf16_exact(np.maximum(x, y)))
        elif op == "lop3.b32":
            regs[args[0]] = _lop3(val(args[1]), val(args[2]), val(args[3]), _imm(args[4])).astype(u)
        elif op == "prmt.b32":
            regs[args[0]] = _prmt(val(args[1]), val(args[2]), val(args[3])).astype(u)
        elif op == "mul.rn.bf16x2":
            regs[args[0]] = _mul_bf16x2(val(args[1]), val(args[2])).astype(u)
        elif op == "setp.eq.u32":
            regs[args[0]] = val(args[1]) == val(args[2])
        elif op == "selp.b32":
            regs[args[0]] = np.where(regs[args[3]], val(args[1]), val(args[2])).astype(u)
        else:
            raise NotImplementedError(op)
    return regs
