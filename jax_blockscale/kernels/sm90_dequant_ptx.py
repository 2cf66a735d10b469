"""PTX that dequantizes 8 block-scaled elements to 8 exact bf16 values (the sm90 kernel's inner
loop). Plain strings, no DSL import, so tests can run them on the CPU (tests/support/ptx_emu.py).

Operands of the generated asm: outputs $0..$3 (four bf16x2 words), inputs $4, $5 (the chunk:
one 32-bit word of eight e2m1 nibbles, low nibble first, or two words of four fp8 bytes), $6 (the
scale byte), $7 / $8 / $9 (fp8 only: shift, mask and the 2^bias fix, chosen at run time for e4m3
or e5m2).

The bit tricks put the element's exponent/mantissa bits into the low bits of a bf16
exponent/mantissa, which is the exact value times a fixed power of two (2^-126 for e2m1, 2^-120
for e4m3, 2^-112 for e5m2; subnormal elements land on bf16 subnormals, which bf16 arithmetic
keeps). One exact bf16x2 multiply undoes the power, one applies the block scale (exact: at most
6 significant bits, bf16 has 8). Limits: products past bf16's range overflow to inf (as in f32),
products below 2^-133 round; NaN/inf element codes (never produced by quantize) are not data:
e5m2 inf decodes to +-65536 * scale.

NVFP4 with `fold=True`: the e4m3 block scale is turned into s * 2^119 (exact and finite: s <= 448
< 2^9), so ONE multiply undoes the 2^-126 and applies the scale; the outputs are the values
times 2^-7 (FOLD_FACTOR), which the kernel's epilogue takes back through alpha. (An e8m0 scale
times 2^119 can overflow, so MX formats are not folded.)

fp4 pairs use a multiply to place bits: the pair's two nibbles sit alone in the low nibble of
each 16-bit half, and one `mul.lo` by 2^6 + 2^12 writes a copy whose magnitude bits land on bf16
bits 6-8 and one whose sign bit lands on bit 15 (the copies do not overlap: no carries); one
mask keeps those bits.

Element order of the output: natural (words = elements (0,1), (2,3), (4,5), (6,7)), or with
`perm=True` the pairs (0,4), (1,5), (2,6), (3,7). A dot product does not care in which order K
runs as long as both operands use the same one, and the permuted order is cheaper for e2m1 (one
shift serves both halves of a word); the kernel uses it when both operands are dequantized.
"""
from __future__ import annotations

from jax_blockscale.catalog.sm90 import KINDS  # noqa: E402  (the kinds' bits and blocks)

# bf16x2 constants (both halves equal)
BF16X2_2P120 = 0x7B807B80  # 2^120: undoes the e4m3 bit trick
BF16X2_2P112 = 0x77807780  # 2^112: undoes the e5m2 bit trick
BF16X2_2P126 = 0x7E807E80  # 2^126: undoes the e2m1 bit trick
BF16X2_2P119 = 0x7B007B00  # 2^119: what a folded NVFP4 scale carries
FOLD_FACTOR = 2.0 ** -7  # folded NVFP4 outputs: value * 2^-126 * s * 2^119
# run-time fp8 flavour: (shift, mask, fix)
FP8_E4M3 = (4, 0x07F007F0, BF16X2_2P120)
FP8_E5M2 = (5, 0x0FE00FE0, BF16X2_2P112)

# Scale byte ($6) -> bf16x2 `sp` (both halves the scale). A NaN scale (e4m3 0x7F, e8m0 0xFF)
# becomes a bf16 NaN: the whole block decodes to NaN (docs/formats.md, "NaN and Inf").
_SCALE_E8M0 = """
    setp.eq.u32 pn, $6, 0xFF;
    shl.b32 sp, $6, 7;
    setp.eq.u32 p, $6, 0;
    selp.b32 sp, 0x40, sp, p;            // e8m0 0 is 2^-127: a bf16 subnormal
    selp.b32 sp, 0x7FC0, sp, pn;
    prmt.b32 sp, sp, sp, 0x1010;
"""
_SCALE_E4M3 = f"""
    and.b32 sp, $6, 0x7F;
    setp.eq.u32 pn, sp, 0x7F;
    shl.b32 sp, sp, 4;
    and.b32 t, $6, 0x80;
    shl.b32 t, t, 8;
    lop3.b32 sp, sp, t, 0, 0xFC;         // sp | t
    prmt.b32 sp, sp, sp, 0x1010;
    mov.b32 t, {BF16X2_2P120:#x};
    mul.rn.bf16x2 sp, sp, t;
"""
_SCALE_E4M3_FOLDED = _SCALE_E4M3 + f"""
    mov.b32 t, {BF16X2_2P119:#x};
    mul.rn.bf16x2 sp, sp, t;
"""
_SCALE_E4M3_NAN = """
    selp.b32 sp, 0x7FC07FC0, sp, pn;
"""


def _fp8_pair(lo_word, lo_byte, hi_word, hi_byte, out):
    """bf16x2 of two fp8 bytes: low half from byte `lo_byte` of `lo_word` ($4 or $5)."""
    src = {"$4": 0, "$5": 4}
    lo, hi = src[lo_word] + lo_byte, src[hi_word] + hi_byte
    # magnitude bytes to bits 0-7 / 16-23 (bytes 1 and 3: anything, the mask drops them) and
    # their sign bits replicated into bytes 1 / 3 (prmt sign mode), masked to bits 15 / 31
    sel_mag = (hi << 8) | lo
    sel_sign = ((8 | hi) << 12) | ((8 | lo) << 4)
    return f"""
    prmt.b32 t, $4, $5, {sel_mag:#x};
    shl.b32 t, t, $7;
    and.b32 t, t, $8;
    prmt.b32 g, $4, $5, {sel_sign:#x};
    lop3.b32 t, t, g, 0x80008000, 0xF8;   // t | (g & 0x80008000)
    mul.rn.bf16x2 t, t, $9;
    mul.rn.bf16x2 {out}, t, sp;
"""


def _fp4_place(t, out, fold, mult=0x1040, scale="sp", k126="k126"):
    """`t` holds one nibble alone in each 16-bit half (bits 0-3: mult 2^6 + 2^12; bits 4-7:
    2^2 + 2^8) -> bf16x2 (exact) times the bf16x2 `scale`: one copy puts the magnitude on bits
    6-8, the other the sign on bit 15; register `k126` holds 2^126 unless `fold`."""
    fix = "" if fold else f"mul.rn.bf16x2 {t}, {t}, {k126};\n"
    return f"""
    mul.lo.u32 {t}, {t}, {mult:#x};
    and.b32 {t}, {t}, 0x81C081C0;
    {fix}mul.rn.bf16x2 {out}, {t}, {scale};
"""


def _fp4_pair_natural(j, out, fold):
    # nibbles 2j (low half) and 2j+1 (high half): split nibbles into bytes, then one prmt each
    sel = 0x8080 | ((4 + j) << 8) | j  # 0x8_: sign mode on a byte with bit 7 clear -> 0x00
    return f"""
    prmt.b32 t, xl, xh, {sel:#x};""" + _fp4_place("t", out, fold)


def fp4_perm_pairs_ptx(w, scale, outs, t, y, k126, fold=False):
    """8 e2m1 nibbles of register `w` -> outs[j] = bf16x2 (nibble j, nibble j+4) times the bf16x2
    `scale` (the permuted order; also the decode kernel's). t, y, k126: scratch registers."""
    code = "" if fold else f"mov.b32 {k126}, {BF16X2_2P126:#x};\n"
    code += f"prmt.b32 {y}, {w}, 0, 0x4341;\n"  # bytes 1, 3 -> 0, 2: nibbles 2,3,6,7 down
    for j, out in enumerate(outs):
        # nibbles j (low half) and j+4 (high half): y holds nibbles (2, 3, 6, 7) where w has
        # (0, 1, 4, 5); odd j keeps its nibbles at bits 4-7 and uses the other multiplier
        src = w if j < 2 else y
        mask, mult = (0x000F000F, 0x1040) if j % 2 == 0 else (0x00F000F0, 0x104)
        code += f"and.b32 {t}, {src}, {mask:#x};" + _fp4_place(t, out, fold, mult, scale, k126)
    return code


def cvt_asm(kind: str, perm: bool = False, fold: bool = False) -> str:
    """PTX: ($4, $5) = chunk words, $6 = scale byte -> ($0..$3) = 8 bf16 (see module doc);
    fold (NVFP4 only): the outputs are the values times FOLD_FACTOR."""
    assert not fold or kind == "nvfp4", "only NVFP4 (e4m3 scales) is folded"
    if KINDS[kind]["scale"] == "e4m3":
        scale = (_SCALE_E4M3_FOLDED if fold else _SCALE_E4M3) + _SCALE_E4M3_NAN
    else:
        scale = _SCALE_E8M0
    if KINDS[kind]["bits"] == 8:
        if perm:
            pairs = [("$4", j, "$5", j) for j in range(4)]
        else:
            pairs = [("$4", 0, "$4", 1), ("$4", 2, "$4", 3), ("$5", 0, "$5", 1), ("$5", 2, "$5", 3)]
        body = scale + "".join(_fp8_pair(*p, f"${i}") for i, p in enumerate(pairs))
        regs = ".reg .b32 sp, t, g;"
    elif perm:
        body = scale + fp4_perm_pairs_ptx("$4", "sp", [f"${j}" for j in range(4)], "t", "y",
                                          "k126", fold)
        regs = ".reg .b32 sp, t, g, y, k126;"
    else:
        body = ("and.b32 xl, $4, 0x0F0F0F0F;\nshr.b32 xh, $4, 4;\nand.b32 xh, xh, 0x0F0F0F0F;\n"
                f"mov.b32 k126, {BF16X2_2P126:#x};\n" + scale
                + "".join(_fp4_pair_natural(j, f"${j}", fold) for j in range(4)))
        regs = ".reg .b32 sp, t, g, xl, xh, k126;"
    return "{\n" + regs + "\n.reg .pred p, pn;\n" + body + "}"


def element_order(perm: bool) -> list[int]:
    """K order of the 8 bf16 the asm writes (as stored: word i holds output halves 2i, 2i+1)."""
    return [0, 4, 1, 5, 2, 6, 3, 7] if perm else list(range(8))


# --- the register-weight kernel's natural K order (fp8 weights) ---------------------------------
# wgmma's A fragment gives lane (g, t) the K slots (2t, 2t + 1) and (2t + 8, 2t + 9) of each k16
# MMA. With the activation in natural K order those are bytes 2t and 2t + 1 of each 8-byte pair of
# words of the row's fp8 k-tile (16 words; pair 2b + h holds MMA b's slots 8h .. 8h + 7).
def fp8_natural_sel(t):
    """fp8_natural_pairs_ptx's prmt selector for the lane's `t` (lane % 4; an int or a traced
    integer): bytes 2t and 2t + 1 of a word pair to bytes 0 and 2, each one's sign bit
    replicated into the byte above it (prmt's sign mode: nibble 8 | index)."""
    return t * 0x2222 + 0x9180  # (8|2t+1) << 12 | (2t+1) << 8 | (8|2t) << 4 | 2t


def fp8_natural_pairs_ptx(words, sel, scales, outs, shift, fix):
    """16 words of e4m3/e5m2 bytes (a row's k-tile; fewer for part of it) -> outs[i] = bf16x2
    of bytes 2t, 2t + 1 of the word pair (2i, 2i + 1), times the bf16x2 scales[i]. sel: a
    register holding fp8_natural_sel; shift, fix: the run-time flavour's (FP8_E4M3 /
    FP8_E5M2). One prmt gives [byte, its sign x 8, byte, its sign x 8]: masked to the two
    magnitudes and shifted, they sit on the bf16 exponent / mantissa bits; the unmasked word
    holds the two signs on bits 15 and 31. Scratch registers: t, g."""
    code = ""
    for i, out in enumerate(outs):
        a, b = words[2 * i], words[2 * i + 1]
        code += f"""
    prmt.b32 g, {a}, {b}, {sel};
    and.b32 t, g, 0x007F007F;
    shl.b32 t, t, {shift};
    lop3.b32 t, t, g, 0x80008000, 0xF8;
    mul.rn.bf16x2 t, t, {fix};
    mul.rn.bf16x2 {out}, t, {scales[i]};
"""
    return code


def fp8_natural_quarter_ptx(half: int) -> str:
    """PTX of the register-weight kernel's conversion of a quarter of a row's fp8 k-tile
    (natural K order): $0, $1 = MMA b's A-register pairs of the row (K slots 2t, 2t + 1, then
    2t + 8, 2t + 9), from $2..$5 (the quarter's 4 words), $6 (the row's two block scales packed
    in one bf16x2, sm90_ptx.scale_pair_packed_ptx; `half` 0 / 1 picks the low / high one,
    broadcast by a 16-bit move ptxas folds into the multiplies), $7 (fp8_natural_sel), $8, $9
    (the flavour's shift and fix)."""
    pick = "{slo, slo}" if half == 0 else "{shi, shi}"
    return ("{\n.reg .b32 t, g, s;\n.reg .b16 slo, shi;\n"
            f"mov.b32 {{slo, shi}}, $6;\nmov.b32 s, {pick};\n"
            + fp8_natural_pairs_ptx([f"${2 + j}" for j in range(4)], "$7", ["s"] * 2,
                                    ["$0", "$1"], "$8", "$9") + "}")
