"""sm90 decode kernel, no GPU needed: the PTX bit tricks and fragment bookkeeping (emulated on the
CPU for every code), the variant heuristic, and that the variants compile and export for sm_90a.

The export tests need nvidia-cutlass-dsl (the [test] extra); without it they fail, or skip where
the package was installed without its native library on purpose (tests/support/native.py).
"""
from __future__ import annotations

import dataclasses
import os
import re

import ml_dtypes
import numpy as np
import pytest

import native  # tests/support/native.py
import ptx_emu as emu

from jax_blockscale.catalog import sm90 as cat  # pure Python: always importable
from jax_blockscale.kernels import sm90_dequant_ptx as dq  # plain strings: always importable

# the kernel module (PTX text generators, export) needs nvidia-cutlass-dsl
try:
    from jax_blockscale.kernels import sm90_decode as dec
    from jax_blockscale.kernels import sm90_ptx  # the device helpers (PTX text generators)
except ImportError:  # no DSL here: only the pure-Python tests run
    dec = sm90_ptx = None
needs_dsl = pytest.mark.usefixtures("_dsl")


@pytest.fixture
def _dsl():
    native.need_dsl()
    assert dec is not None, "nvidia-cutlass-dsl imports but jax_blockscale.kernels.sm90_decode not"

FP4 = np.array([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6])
E4M3 = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float64)
E5M2 = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e5m2).astype(np.float64)
FP8_PARAMS = {  # (shift, mask, fix) the kernel passes for each fp8 flavour
    "e4m3": (4, 0x07F007F0, dq.BF16X2_2P120), "e5m2": (3, 0x0FE00FE0, dq.BF16X2_2P112)}


def lanes(x):
    return np.broadcast_to(np.asarray(x, np.uint32), (32,)).copy()


def halves(r):
    return (emu.bf16_to_f64((r & 0xFFFF).astype(np.uint16)),
            emu.bf16_to_f64((r >> 16).astype(np.uint16)))


def scale_reg(kind, byte):
    """A scale byte in the low byte of its register (the activation path)."""
    return scale_word_reg(kind, byte, 0)


def scale_value(kind, byte):
    if kind == "nvfp4":
        return E4M3[byte]  # NaN at 0x7F
    return np.nan if byte == 0xFF else 2.0 ** (int(byte) - 127)


def scale_word_reg(kind, words, col, fold=False):
    """The kernel's path: byte `col` of each scale word -> bf16x2 (times 2^119 when folded)."""
    return emu.run(sm90_ptx.scale_ptx(kind, fold), {
        "$1": lanes(words), "$2": lanes(sm90_ptx.SCALE_BYTE_SEL + 0x101 * col)})["$0"]


FOLD = 2.0 ** 119  # what a folded NVFP4 scale register carries beside the scale
MX_FOLD = 2.0 ** 126  # what a folded e8m0 scale carries (codes up to MX_FOLD_MAX_CODE only)


@needs_dsl
# ---- bit tricks, every code ---------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["nvfp4", "mxfp4"])
def test_scale_to_bf16x2_every_code(kind):
    codes = range(128) if kind == "nvfp4" else range(256)  # non-negative e4m3, and the NaNs
    for byte in codes:
        lo, hi = halves(scale_reg(kind, byte))
        np.testing.assert_array_equal([lo[0], hi[0]], [scale_value(kind, byte)] * 2, str(byte))


@needs_dsl
@pytest.mark.parametrize("kind,fold", [("nvfp4", False), ("nvfp4", True), ("mxfp4", False)])
def test_scale_word_every_code_every_column(kind, fold):
    """The scale word path (one prmt picks the byte) on every code, in each of the 4 columns, with
    random neighbours; folded NVFP4 scales carry exactly 2^119 and stay finite; a NaN scale
    (e4m3 0x7F, e8m0 0xFF) reads as NaN, so its block decodes to NaN."""
    rng = np.random.default_rng(3)
    codes = np.arange(128) if kind == "nvfp4" else np.arange(256)  # the NaN code last
    for col in range(4):
        for start in range(0, len(codes), 32):
            b = codes[np.arange(start, start + 32) % len(codes)].astype(np.uint32)
            words = rng.integers(0, 2**32, 32, dtype=np.uint64).astype(np.uint32)
            words = (words & ~np.uint32(0xFF << (8 * col))) | (b << (8 * col))
            lo, hi = halves(scale_word_reg(kind, words, col, fold))
            want = np.array([scale_value(kind, x) for x in b]) * (FOLD if fold else 1.0)
            np.testing.assert_array_equal(lo, want)
            np.testing.assert_array_equal(hi, want)


def scale_pair_regs(kind, word_a, word_b, byte_a, byte_b, fold=False):
    """The decode kernel's path: two scale bytes at once (byte_a of word A, 0-3, or of word B,
    4-7; likewise byte_b) -> two bf16x2, each with its scale in both halves."""
    out = emu.run(sm90_ptx.scale_pair_ptx(kind, fold), {
        "$2": lanes(word_a), "$3": lanes(word_b),
        "$4": lanes(sm90_ptx.scale_pair_sel(byte_a, byte_b))})
    return out["$0"], out["$1"]


@needs_dsl
@pytest.mark.parametrize("kind,fold", [("nvfp4", False), ("nvfp4", True), ("mxfp4", False),
                                       ("mxfp4", True)])
def test_scale_pair_every_code_matches_one_at_a_time(kind, fold):
    """Two scale bytes converted together (an NVFP4 thread's two blocks of one word; an MX
    thread's block of two rows, one byte of each of two words) equal each converted alone, on
    every code in both halves and every column, with random bytes around them: a NaN code (e4m3
    0x7F and 0xFF, e8m0 0xFF) reads as NaN, e8m0 0 as 2^-127, folded scales carry 2^119 (e4m3)
    or 2^126 (e8m0, whose folded form takes the codes up to MX_FOLD_MAX_CODE: scales to 2)."""
    rng = np.random.default_rng(5)
    codes = np.append(np.arange(128), 0xFF) if kind == "nvfp4" else np.arange(256)
    if kind == "mxfp4" and fold:
        codes = np.arange(sm90_ptx.MX_FOLD_MAX_CODE + 1)
    fold_factor = (FOLD if kind == "nvfp4" else MX_FOLD) if fold else 1.0
    for col in range(4):
        for start in range(0, len(codes), 32):
            lo_b = codes[np.arange(start, start + 32) % len(codes)].astype(np.uint32)
            hi_b = codes[np.arange(start + 7, start + 39) % len(codes)].astype(np.uint32)
            a, b = (rng.integers(0, 2**32, 32, dtype=np.uint64).astype(np.uint32)
                    for _ in range(2))
            nxt = (col + 1) % 4
            if kind == "nvfp4":  # two columns of one word
                a = (a & ~np.uint32((0xFF << (8 * col)) | (0xFF << (8 * nxt)))
                     | (lo_b << (8 * col)) | (hi_b << (8 * nxt)))
                regs = scale_pair_regs(kind, a, 0, col, nxt, fold)
            else:  # one column of two words
                a = (a & ~np.uint32(0xFF << (8 * col))) | (lo_b << (8 * col))
                b = (b & ~np.uint32(0xFF << (8 * col))) | (hi_b << (8 * col))
                regs = scale_pair_regs(kind, a, b, col, 4 + col, fold)
            for reg, byte in zip(regs, (lo_b, hi_b)):
                want = np.array([scale_value(kind, x & (0x7F if kind == "nvfp4" else 0xFF))
                                 for x in byte]) * fold_factor
                for half in halves(reg):
                    np.testing.assert_array_equal(half, want)


@needs_dsl
@pytest.mark.parametrize("n_words", [1, 2, 4])
def test_bytes_above_mx_fold_every_byte(n_words):
    """The MXFP4 fold's check of a thread's scale words: nonzero exactly where a byte is above
    MX_FOLD_MAX_CODE, for every byte value in every byte of every word, the other bytes random
    codes at or below it (the common case: a single large code among folding ones)."""
    rng = np.random.default_rng(7)
    limit = sm90_ptx.MX_FOLD_MAX_CODE
    ptx = sm90_ptx.bytes_above_ptx(n_words)
    for word in range(n_words):
        for byte in range(4):
            for start in range(0, 256, 32):
                vals = np.arange(start, start + 32, dtype=np.uint32)
                words = [rng.integers(0, limit + 1, (32, 4)).astype(np.uint32) for _ in
                         range(n_words)]
                words = [w[:, 0] | (w[:, 1] << 8) | (w[:, 2] << 16) | (w[:, 3] << 24)
                         for w in words]
                words[word] = (words[word] & ~np.uint32(0xFF << (8 * byte))) | (vals << (8 * byte))
                out = emu.run(ptx, {f"${i + 1}": words[i] for i in range(n_words)})["$0"]
                np.testing.assert_array_equal(out != 0, vals > limit)


@needs_dsl
@pytest.mark.parametrize("fold", [False, True])
def test_fp4_pairs_every_nibble_every_position(fold):
    rng = np.random.default_rng(0)
    s = scale_word_reg("nvfp4", 0x3A, 0, fold)  # 1.25 (times 2^119 when folded)
    ptx = ("{\n.reg .b32 cv0, cv1, cvk;\n"
           + sm90_ptx._fp4_pairs_ptx("$4", "$5", ["$0", "$1", "$2", "$3"], fold=fold) + "\n}")
    unit = 1.25 * (2.0 ** -7 if fold else 1.0)  # folded: w * s * 2^-7 (alpha takes 2^7 back)
    for rep in range(8):
        words = rng.integers(0, 2**32, 32, dtype=np.uint64).astype(np.uint32)
        if rep == 0:  # every nibble value at every position
            words = np.array([sum(((n + p) % 16) << (4 * p) for p in range(8)) for n in range(16)] * 2,
                             np.uint32)
        out = emu.run(ptx, {"$4": words, "$5": s})
        for j in range(4):
            lo, hi = halves(out[f"${j}"])
            np.testing.assert_array_equal(lo, FP4[(words >> (4 * j)) & 0xF] * unit)
            np.testing.assert_array_equal(hi, FP4[(words >> (4 * (j + 4))) & 0xF] * unit)


@needs_dsl
@pytest.mark.parametrize("elem", ["e4m3", "e5m2"])
def test_fp8_pairs_every_byte(elem):
    table = E4M3 if elem == "e4m3" else E5M2
    finite = np.flatnonzero(np.isfinite(table))
    shift, mask, fix = FP8_PARAMS[elem]
    s = scale_reg("mxfp8", 127 + 3)  # 8
    ptx = "{\n.reg .b32 cv0, cv1, cvk;\n" + sm90_ptx._fp8_pairs_ptx("$2", "$3", ["$0", "$1"], "$4", "$5", "$6") + "\n}"
    for start in range(0, len(finite), 32):
        b = finite[np.arange(start, start + 32) % len(finite)].astype(np.uint32)
        words = b | (np.roll(b, 1) << 8) | (np.roll(b, 2) << 16) | (np.roll(b, 3) << 24)
        out = emu.run(ptx, {"$2": words, "$3": s, "$4": lanes(shift), "$5": lanes(mask),
                            "$6": lanes(fix)})
        got = [*halves(out["$0"]), *halves(out["$1"])]
        for i in range(4):
            np.testing.assert_array_equal(got[i], table[(words >> (8 * i)) & 0xFF] * 8)


# ---- one step of a row tile, end to end (staging order + conversion + mma fragments) -----------
def _emulate_step(b_kind, elem, nt, a_fmt=None, seed=0, tuning=None, mx_fold=False):
    """One k-step of one 16-row tile: weights W (16 x se), activations X (8nt x se), as the kernel
    lays them out (thread 4g+t: bytes [16t, 16t+16) of rows g and g+8; activations staged in
    fragment order). Returns (kernel result (16, 8nt) with alpha's fold factor applied, float64
    reference). mx_fold: MXFP4 weights on the folded path (scales up to 2, as the kernel checks)."""
    tuning = tuning or cat.DEFAULT_TUNING
    fold = (tuning.fold_scale and b_kind == "nvfp4") or mx_fold
    rng = np.random.default_rng(seed)
    bits, block = dec.KINDS[b_kind]["bits"], dec.KINDS[b_kind]["block"]
    se = dec.steps_elems(b_kind)
    e, Q = se // 4, se // 32
    table = FP4 if bits == 4 else (E4M3 if elem == "e4m3" else E5M2)
    # weights: 16 rows x 64 bytes
    wbytes = rng.integers(0, 256, (16, 64), dtype=np.uint8)
    if bits == 8:
        wbytes = np.where(np.isfinite(table[wbytes]), wbytes, 0x38).astype(np.uint8)
        W = table[wbytes]
    else:
        W = np.stack([FP4[wbytes & 0xF], FP4[wbytes >> 4]], -1).reshape(16, se)
    nblk = se // block
    sbytes = (rng.integers(0, 120, (16, nblk)) if b_kind == "nvfp4"
              else 127 + rng.integers(-5, 6, (16, nblk))).astype(np.uint32)
    if mx_fold:  # the folded path's whole range, 2^-127 to 2: the MMA sees the exact values
        sbytes = rng.integers(0, sm90_ptx.MX_FOLD_MAX_CODE + 1, (16, nblk)).astype(np.uint32)
    svals = np.vectorize(lambda b: scale_value(b_kind, b))(sbytes)
    W = W * np.repeat(svals, block, axis=1)
    # activations (bf16) and their staged fragment-order words, as _stage_activations writes them
    X = rng.standard_normal((8 * nt, se)).astype(ml_dtypes.bfloat16)
    Xbits = X.view(np.uint16).astype(np.uint32)
    X = X.astype(np.float64)
    smem = {}
    for i in range(nt):
        for q in range(Q):
            words = []
            for w in range(4):
                lane = np.arange(32)
                row = i * 8 + lane // 4
                k = (lane % 4) * e + q * 8 + 2 * w
                words.append(Xbits[row, k] | (Xbits[row, k + 1] << 16))
            if bits == 4:
                res = emu.run(sm90_ptx.PERMUTE_FP4_PTX, {f"${4 + w}": words[w] for w in range(4)})
                words = [res[f"${w}"] for w in range(4)]
            smem[(i, q)] = words
    # per-thread registers: 4 words of row g and of row g+8
    lane = np.arange(32)
    g, t = lane // 4, lane % 4
    wr = wbytes.view(np.uint32)  # (16, 16): 16 words per row, thread t owns words 4t..4t+3
    acc = {f"${x}": np.zeros(32) for x in range(4 * nt)}
    ptx = sm90_ptx.dequant_mma_ptx(b_kind, nt, fold)
    wpg = 1 if bits == 4 else 2
    for q in range(Q):
        ops = dict(acc)
        n_acc = 4 * nt
        for x in range(n_acc):
            ops[f"${n_acc + x}"] = acc[f"${x}"]
        base = 2 * n_acc
        for r2, rows in enumerate((g, g + 8)):
            for x in range(wpg):
                ops[f"${base + r2 * wpg + x}"] = wr[rows, 4 * t + q * wpg + x]
        base += 2 * wpg
        kb = (t * e + q * 8) // block
        if b_kind == "nvfp4":  # the thread's two blocks of each row, one pair each
            first = kb - (kb % 2)
            for r2, rows in enumerate((g, g + 8)):
                word = sbytes[rows, first] | (sbytes[rows, first + 1] << 8)
                even, odd = scale_pair_regs(b_kind, word, 0, 0, 1, fold)
                ops[f"${base + r2}"] = np.where(kb % 2 == 0, even, odd)
        else:  # the block of rows g and g + 8 as one pair
            pair = scale_pair_regs(b_kind, sbytes[g, kb], sbytes[g + 8, kb], 0, 4, fold)
            for r2 in range(2):
                ops[f"${base + r2}"] = pair[r2]
        base += 2
        for i in range(nt):
            for w in range(4):
                ops[f"${base + 4 * i + w}"] = smem[(i, q)][w]
        base += 4 * nt
        if bits == 8:
            for x, val in enumerate(FP8_PARAMS[elem]):
                ops[f"${base + x}"] = lanes(val)
        res = emu.run(ptx, ops)
        acc = {f"${x}": res[f"${x}"] for x in range(4 * nt)}
    D = np.zeros((16, 8 * nt))
    for i in range(nt):
        for x, (roff, coff) in enumerate([(0, 0), (0, 1), (8, 0), (8, 1)]):
            D[g + roff, i * 8 + 2 * t + coff] = acc[f"${4 * i + x}"]
    return D * ((1.0 / dq.FOLD_FACTOR) if fold and b_kind == "nvfp4" else 1.0), W @ X.T


@needs_dsl
@pytest.mark.parametrize("b_kind,elem", [("nvfp4", "e2m1"), ("mxfp4", "e2m1"),
                                         ("mxfp8", "e4m3"), ("mxfp8", "e5m2")])
@pytest.mark.parametrize("nt", [1, 2, 4, 8])
@pytest.mark.parametrize("tuning", [cat.DEFAULT_TUNING, cat.Tuning("cpasync", 2, 2, 2, 2)],
                         ids=["default", "nofold"])
def test_warp_step_matches_reference(b_kind, elem, nt, tuning):
    D, ref = _emulate_step(b_kind, elem, nt, tuning=tuning)
    np.testing.assert_allclose(D, ref, rtol=1e-12, atol=1e-12 * np.abs(ref).max())


@needs_dsl
@pytest.mark.parametrize("nt", [1, 2, 4])
def test_warp_step_mx_fold_matches_reference(nt):
    """MXFP4 weights on the folded path (one multiply per pair by 2^(code - 1)), scale codes
    0..MX_FOLD_MAX_CODE: the same exact products as the unfolded path."""
    D, ref = _emulate_step("mxfp4", "e2m1", nt, mx_fold=True, seed=nt)
    np.testing.assert_allclose(D, ref, rtol=1e-12, atol=1e-12 * np.abs(ref).max())


@needs_dsl
@pytest.mark.parametrize("kind,elem", [("nvfp4", "e2m1"), ("mxfp8", "e4m3"), ("mxfp8", "e5m2")])
def test_activation_dequant_group(kind, elem):
    """Quantized activations: dequant_group gives the same pair order the weights use."""
    rng = np.random.default_rng(1)
    bits = dec.KINDS[kind]["bits"]
    nbytes = 4 if bits == 4 else 8
    b = rng.integers(0, 256, (32, nbytes), dtype=np.uint8)
    table = FP4 if bits == 4 else (E4M3 if elem == "e4m3" else E5M2)
    if bits == 8:
        b = np.where(np.isfinite(table[b]), b, 0x38).astype(np.uint8)
        vals = table[b]
        order = list(range(8))
    else:
        vals = np.stack([FP4[b & 0xF], FP4[b >> 4]], -1).reshape(32, 8)
        order = [0, 4, 1, 5, 2, 6, 3, 7]
    words = b.view(np.uint32)
    sbyte = 0x30 if kind == "nvfp4" else 125  # 0.5 / 0.25
    ops = {"$4": words[:, 0].copy()}
    if bits == 8:
        ops["$5"] = words[:, 1].copy()
        ops["$6"] = scale_reg(kind, sbyte)
        for x, val in enumerate(FP8_PARAMS[elem]):
            ops[f"${7 + x}"] = lanes(val)
    else:
        ops["$5"] = scale_reg(kind, sbyte)
    out = emu.run(sm90_ptx.dequant_group_ptx(kind), ops)
    got = np.stack([h for j in range(4) for h in halves(out[f"${j}"])], -1)
    np.testing.assert_array_equal(got, vals[:, order] * scale_value(kind, sbyte))


# ---- heuristic ---------------------------------------------------------------------------------
def test_choose_decode_variant():
    v, s = cat.choose_decode_variant(1, 16384, 16384, None, "nvfp4", 132)
    assert (v.a_kind, v.b_kind, v.nt, v.out) == ("bf16", "nvfp4", 1, "bf16")
    tun = v.tuning
    assert 1 <= s and -(-16384 // tun.bn) * s <= 132 * tun.ctas_per_sm
    v, s = cat.choose_decode_variant(16, 8192, 8192, "bf16", "mxfp8_e5m2", 132, "f32")
    assert (v.b_kind, v.nt, v.out) == ("mxfp8", 2, "f32")
    tun = v.tuning
    tiles = 8192 // tun.bn  # CTAs over N: split K to fill the GPU
    assert tiles * s <= 132 * tun.ctas_per_sm and s >= 132 * tun.ctas_per_sm // tiles // 2
    v, s = cat.choose_decode_variant(12, 1000, 4192, "nvfp4", "nvfp4", 132)
    assert v.a_kind == "nvfp4" and v.nt == 2
    # every split gets whole sub-chunks, none is empty
    for (m, n, k) in [(1, 256, 512), (3, 1000, 4192), (16, 300, 32 * 7), (8, 100000, 8192)]:
        for fmt in ("nvfp4", "mxfp4", "mxfp8_e4m3"):
            v, s = cat.choose_decode_variant(m, n, k, None, fmt, 132)
            chunk = v.tuning.sub_steps * cat.steps_elems(v.b_kind)
            k_chunks = -(-k // chunk)
            per = -(-k_chunks // s)
            assert (s - 1) * per < k_chunks, (m, n, k, fmt, s)
    # a forced split count (JAX_BLOCKSCALE_SM90_DECODE_SPLITS): at most one range per sub-chunk
    # (K = 14336 NVFP4: 28), the ranges evened out (5 wanted: 6 sub-chunks each, 5 ranges)
    for want, got in [(1, 1), (4, 4), (5, 5), (8, 7), (28, 28), (255, 28)]:
        v, s = cat.choose_decode_variant(1, 4096, 14336, None, "nvfp4", 132, splits=want)
        assert s == got, (want, s)
    # M = 17..64: the wide variants (one row tile per warp, 128 rows of N per CTA)
    for m, nt in [(17, 4), (32, 4), (33, 8), (64, 8)]:
        v, s = cat.choose_decode_variant(m, 16384, 16384, None, "nvfp4", 132)
        assert v.nt == nt and v.tuning == cat.WIDE_TUNING and cat.WIDE_TUNING.bn == 128
        assert 1 <= s and -(-16384 // 128) * s <= 132 * cat.WIDE_TUNING.ctas_per_sm
    # not this kernel's job
    assert cat.choose_decode_variant(65, 4096, 4096, None, "nvfp4", 132) is None
    assert cat.choose_decode_variant(128, 4096, 4096, None, "nvfp4", 132) is None
    assert cat.choose_decode_variant(4, 4096, 4100, None, "nvfp4", 132) is None  # K % 32
    assert cat.choose_decode_variant(4, 4096, 4096, "mxfp4", "nvfp4", 132) is None  # pair
    assert cat.choose_decode_variant(4, 4096, 4096, None, "mxfp6_e2m3", 132) is None
    assert cat.choose_decode_variant(4, 4096, 4096, "f16", "nvfp4", 132) is None  # bf16 MMAs only


def test_variant_list():
    names = [v.name for v in cat.DECODE_VARIANTS]
    assert len(names) == len(set(names)) == len(cat.DECODE_PAIRS) * 3 * len(cat.DECODE_NTS)
    for (a, b) in cat.DECODE_PAIRS:
        assert b in cat.DECODE_B_KINDS and a in ("bf16", b)


# ---- compile + export for sm_90a ---------------------------------------------------------------


def _sass_of(obj, tmp):
    import cubins as _cubins

    native.need_sass_tools()
    cubins = _cubins.find_cubins_in_file(obj)
    assert cubins and all(c.sm == 90 for c in cubins), [c.sm for c in cubins]
    return _cubins.dump_sass(cubins[0].write(os.path.join(tmp, "k.cubin")))


def _main_kernel_sass(obj, tmp):
    """The SASS of the decode main kernel alone (not the finalize kernel beside it)."""
    sass = _sass_of(obj, tmp)
    main = sass[sass.index("Function : kernel_cutlass_kernel"):]
    return main[:main.index("Function", 10)] if "Function" in main[10:] else main


FAST = [cat.DecodeVariant("bf16", "nvfp4", "bf16", 1), cat.DecodeVariant("bf16", "mxfp8", "f32", 2),
        cat.DecodeVariant("mxfp4", "mxfp4", "f16", 2), cat.DecodeVariant("bf16", "nvfp4", "bf16", 4)]


@needs_dsl
@pytest.mark.parametrize("variant", FAST, ids=lambda v: v.name)
def test_export_sm90a(variant, tmp_path):
    h, o = dec.export_variant(variant, str(tmp_path), variant.name)
    text = open(h).read()
    proto = re.search(r"static inline int32_t cute_dsl_(\w+)_wrapper\(([^)]*)\)", text)
    assert proto and proto.group(1) == variant.name
    params = [p.strip().split()[-1].lstrip("*") for p in proto.group(2).split(",")]
    assert params == ["module", "a_ptr", "b_ptr", "sa_ptr", "sb_ptr", "c_ptr", "alpha_ptr",
                      "ws_ptr", "m", "n", "k", "l", "a_e5m2", "b_e5m2", "splits", "stream"]
    main = _main_kernel_sass(o, str(tmp_path))
    assert "HMMA.16816.F32.BF16" in main  # tensor cores, bf16 in / f32 accumulate
    pipeline = variant.tuning.pipeline
    if pipeline == "tma":  # weights and scales by TMA boxes, completing on mbarriers
        assert "UTMALDG.3D" in main and "UTMALDG.3D" in main.replace("UTMALDG.3D", "", 1)
        assert "SYNCS.PHASECHK.TRANS64" in main and "SYNCS.ARRIVE.TRANS64" in main
        assert "LDGSTS" not in main
    elif pipeline == "cpasync":  # 16-byte weight copies, L1 bypassed
        assert "LDGSTS.E.BYPASS.LTC256B.128" in main and "DEPBAR" in main
    else:  # 16-byte streaming weight loads into registers
        assert "LDG.E.NA.LTC256B.128" in main
    assert "LDS.128" in main and "STG.E" in main  # partial sums: plain stores
    assert "REDG" not in main and "RED.E" not in main  # no atomics (bitwise reproducible)
    assert "LDL" not in main and "STL" not in main  # no spills to local memory


def _finalize_kernel_sass(obj, tmp):
    sass = _sass_of(obj, tmp)
    fin = sass[sass.index("Function : kernel_cutlass_finalize_kernel"):]
    return fin[:fin.index("Function", 10)] if "Function" in fin[10:] else fin


def test_chained_variants_are_the_quantized_pairs_decode_variants():
    """Every decode variant the quantizer can hand its activation to has a chained twin."""
    chained = {v.name for v in cat.CHAINED_DECODE_VARIANTS}
    assert len(chained) == len(cat.QUANTIZE_A_FORMATS) * 3 * len(cat.DECODE_NTS)
    for v in cat.CHAINED_DECODE_VARIANTS:
        twin = dataclasses.replace(v, chained=False)
        assert twin in cat.DECODE_VARIANTS and twin.name != v.name and "chained" in v.name
        assert v.tuning.pipeline == "tma"  # the wait sits in the TMA main loop


@needs_dsl
@pytest.mark.parametrize("nt", [1, 8])
def test_chained_variant_waits_after_its_first_weight_copies(nt, tmp_path):
    """The chained main kernel (launched by programmatic dependent launch behind the activation
    quantizer) issues its first weight TMA copies, then waits for the quantizer (griddepcontrol
    .wait: ACQBULK) before any global load of the activation, its scales or alpha. It has no
    finalize kernel (its caller adds the split partials); the plain twin has one, and never
    waits in its main kernel."""
    chained = cat.DecodeVariant("nvfp4", "nvfp4", "bf16", nt, chained=True)
    plain = dataclasses.replace(chained, chained=False)
    _, o = dec.export_variant(chained, str(tmp_path), chained.name)
    main = _main_kernel_sass(o, str(tmp_path))
    wait = main.index("ACQBULK")
    assert main.count("ACQBULK") == 1 and main.index("UTMALDG") < wait
    global_load = re.compile(r"\sLDG\.")  # not UTMALDG (the weights' TMA copies)
    assert not global_load.search(main[:wait]) and global_load.search(main[wait:])
    assert ".CONSTANT" not in main[wait:main.index("HMMA")]  # the activation: coherent loads
    assert "Function : kernel_cutlass_finalize_kernel" not in _sass_of(o, str(tmp_path))
    _, o = dec.export_variant(plain, str(tmp_path), plain.name)
    assert "ACQBULK" not in _main_kernel_sass(o, str(tmp_path))
    assert "Function : kernel_cutlass_finalize_kernel" in _sass_of(o, str(tmp_path))


@needs_dsl
@pytest.mark.parametrize("variant", FAST[:2], ids=lambda v: v.name)
def test_export_act_window_tuning(variant, tmp_path):
    """The measured-but-not-shipped activation-window pipeline (Tuning.act_window,
    docs/design/sm90_decode.md) still builds: activations by cp.async too, no spills."""
    tuning = dataclasses.replace(cat.DEFAULT_TUNING, pipeline="cpasync", act_window=16384)
    h, o = dec.export_variant(variant, str(tmp_path), variant.name, tuning=tuning)
    main = _main_kernel_sass(o, str(tmp_path))
    assert "HMMA.16816.F32.BF16" in main and "BAR.SYNC" in main
    assert "LDGSTS.E.BYPASS.LTC256B.128" in main
    assert "LDL" not in main and "STL" not in main


@needs_dsl
@pytest.mark.parametrize("variant", [
    cat.DecodeVariant("bf16", "mxfp4", "bf16", 1), cat.DecodeVariant("bf16", "mxfp4", "bf16", 8),
    cat.DecodeVariant("bf16", "mxfp4", "f32", 2, grouped=True),
    cat.DecodeVariant("mxfp4", "mxfp4", "bf16", 4, grouped=True)], ids=lambda v: v.name)
def test_mx_fold_loops(variant, tmp_path):
    """MXFP4 weights: the variants the catalogue gives the fold (decode_mx_fold) hold both
    loops, the folded one with one HMUL2 per weight pair and the unfolded with two, chosen once
    per CTA (a barrier that ORs every thread's scale check); the MMAs stay unpredicated (as one
    if / else per sub-chunk, ptxas merged both paths into one predicated block) and nothing
    spills. nt = 8 keeps the one unfolded loop."""
    h, o = dec.export_variant(variant, str(tmp_path), variant.name)
    main = _main_kernel_sass(o, str(tmp_path))
    assert not re.search(r"@!?P\d+ HMMA", main)
    assert "LDL" not in main and "STL" not in main or variant.nt == 8
    # HMUL2 per pair in the sub-chunk loops' bodies (x nt per HMMA: 4 folded, 8 unfolded); the
    # skipping last sub-chunks' steps (_sub_chunk_compute) are blocks of their own
    per_hmma = {hmul2 * variant.nt / hmma for hmma, hmul2 in _sub_chunk_blocks(main)}
    if cat.decode_mx_fold(variant.b_kind, variant.nt):
        assert "BAR.RED.OR" in main
        if variant.a_kind == "bf16":  # a quantized activation adds its own HMUL2s
            assert per_hmma == {4, 8}, per_hmma
    else:
        assert "BAR.RED.OR" not in main and per_hmma == {8}, per_hmma


@needs_dsl
@pytest.mark.parametrize("variant", [
    cat.DecodeVariant("bf16", "nvfp4", "bf16", 2, grouped=True),
    cat.DecodeVariant("bf16", "mxfp4", "bf16", 2, grouped=True),
    cat.DecodeVariant("mxfp4", "mxfp4", "bf16", 4, grouped=True),
    cat.DecodeVariant("bf16", "mxfp8", "f32", 2, grouped=True),
    cat.DecodeVariant("bf16", "nvfp4", "bf16", 2),
    cat.DecodeVariant("bf16", "mxfp4", "bf16", 4),
    cat.DecodeVariant("nvfp4", "nvfp4", "f32", 4)], ids=lambda v: v.name)
def test_variants_carry_a_loop_per_row_height(variant, tmp_path):
    """A decode variant holds one main loop per row height of decode_loop_nts (a grouped one's
    item heights, a dense 32-row one's 24-row pass): whole sub-chunks (no branch or barrier
    inside) with the same weight conversion (HMUL2s) and MMAs in proportion to the height, the
    MMAs unpredicated (one branch per CTA picks the loop, not one per step). A dense 16-row
    variant keeps its one height (a call of 9-16 rows fills both n8 tiles)."""
    h, o = dec.export_variant(variant, str(tmp_path), variant.name)
    main = _main_kernel_sass(o, str(tmp_path))
    assert not re.search(r"@!?P\d+ HMMA", main)
    blocks = _mma_blocks(main)
    most = max(hmma for hmma, _ in blocks)
    widest = {hmul2 for hmma, hmul2 in blocks if hmma == most}
    nts = cat.decode_loop_nts(variant.nt, variant.grouped)
    assert len(nts) > 1 or (not variant.grouped and variant.nt == 2)
    for nt in nts:
        assert {hmul2 for hmma, hmul2 in blocks if hmma == most * nt // variant.nt} == widest
    if not variant.grouped:
        assert not [hmma for hmma, _ in blocks if hmma == most // 2]


def _mma_blocks(sass):
    """(HMMA, HMUL2) counts of the SASS blocks (runs without a branch or barrier) that hold
    MMAs."""
    blocks, hmma, hmul2 = [], 0, 0
    for line in sass.splitlines():
        hmma += "HMMA.16816" in line
        hmul2 += "HMUL2" in line
        if re.search(r"\bBRA\b|BAR\.", line):
            if hmma:
                blocks.append((hmma, hmul2))
            hmma = hmul2 = 0
    return blocks


def _sub_chunk_blocks(sass):
    """(HMMA, HMUL2) counts of the SASS blocks (runs without a branch or barrier) that hold a
    whole sub-chunk's MMAs: the most HMMAs of any block."""
    blocks = _mma_blocks(sass)
    most = max(b[0] for b in blocks)
    return [b for b in blocks if b[0] == most]


@needs_dsl
@pytest.mark.slow
def test_export_every_variant(tmp_path):
    for v in cat.DECODE_VARIANTS:
        h, o = dec.export_variant(v, str(tmp_path), v.name)
        assert os.path.getsize(o) > 0 and os.path.exists(h)
