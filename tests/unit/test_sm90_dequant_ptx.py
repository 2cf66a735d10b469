"""The sm90 kernel's dequantization PTX, run on the CPU (tests/support/ptx_emu.py): every element code
times a spread of scales gives the exact bf16 value, in the element order the kernel assumes.
No GPU, no DSL needed."""
from __future__ import annotations

import zlib

import ml_dtypes
import numpy as np
import pytest

import ptx_emu as emu
from jax_blockscale.kernels import sm90_dequant_ptx as ptx

LANES = emu.LANES


ELEM = {"e2m1": ml_dtypes.float4_e2m1fn, "e4m3": ml_dtypes.float8_e4m3fn,
        "e5m2": ml_dtypes.float8_e5m2}


def _codes(elem, rng):
    """(LANES, 8) element codes: every code appears, the rest random."""
    n = 16 if elem == "e2m1" else 256
    codes = np.concatenate([np.arange(n), rng.integers(0, n, LANES * 8 - n % (LANES * 8))])
    codes = codes[: LANES * 8]
    rng.shuffle(codes)
    codes = codes.reshape(LANES, 8).astype(np.uint32)
    if elem != "e2m1":  # NaN/inf codes are not data (quantize saturates); the bit trick maps
        # e5m2 inf to +-65536 * scale, documented in sm90_dequant_ptx
        bad = ~np.isfinite(codes.astype(np.uint8).view(ELEM[elem]).astype(np.float64))
        codes[bad] = 0x01
    return codes


def _scales(scale_kind, rng):
    if scale_kind == "e8m0":
        s = rng.integers(1, 255, LANES).astype(np.uint32)
        s[:4] = [0, 127, 254, 255]  # 2^-127 (a bf16 subnormal), 1, 2^127, NaN
        return s, np.where(s == 255, np.nan, 2.0 ** (s.astype(np.float64) - 127))
    s = rng.integers(0, 0x7F, LANES).astype(np.uint32)  # non-negative e4m3
    s[:4] = [0x01, 0x38, 0x7E, 0x7F]  # smallest subnormal, 1.0, 448, NaN
    return s, s.astype(np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float64)


def _decode(codes, elem):
    if elem == "e2m1":
        return codes.astype(np.uint8).view(ml_dtypes.float4_e2m1fn).astype(np.float64)
    return codes.astype(np.uint8).view(ELEM[elem]).astype(np.float64)


@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")
@pytest.mark.parametrize("perm", [False, True])
@pytest.mark.parametrize("kind,elem,fold", [("nvfp4", "e2m1", False), ("nvfp4", "e2m1", True),
                                            ("mxfp4", "e2m1", False), ("mxfp8", "e4m3", False),
                                            ("mxfp8", "e5m2", False)])
def test_dequant_chunk_is_exact(kind, elem, fold, perm):
    """fold: the NVFP4 outputs are the values times FOLD_FACTOR (the kernel's alpha undoes it)."""
    # a seed per case that is the same in every process (hash() of strings is salted per
    # process): the exactness share checked below is a property of the data drawn, and ~1 draw
    # in 300 of mxfp8 e5m2 falls under 0.9
    rng = np.random.default_rng(zlib.crc32(repr((kind, elem, fold, perm)).encode()))
    for _ in range(4):
        codes = _codes(elem, rng)
        sbits, scale = _scales(ptx.KINDS[kind]["scale"], rng)
        if elem == "e2m1":  # one word, element i in nibble i
            w0 = np.zeros(LANES, np.uint32)
            for i in range(8):
                w0 |= codes[:, i] << (4 * i)
            w1 = np.zeros(LANES, np.uint32)
        else:  # two words, element i in byte i
            w0 = sum(codes[:, i] << (8 * i) for i in range(4)).astype(np.uint32)
            w1 = sum(codes[:, 4 + i] << (8 * i) for i in range(4)).astype(np.uint32)
        shift, mask, fix = ptx.FP8_E5M2 if elem == "e5m2" else ptx.FP8_E4M3
        full = lambda v: np.full(LANES, v, np.uint32)  # noqa: E731
        regs = emu.run(ptx.cvt_asm(kind, perm, fold), {
            "$4": w0, "$5": w1, "$6": sbits, "$7": full(shift), "$8": full(mask), "$9": full(fix)})
        got = np.stack([(regs[f"${i // 2}"] >> (16 * (i % 2))) & 0xFFFF for i in range(8)], 1)
        got = emu.bf16_to_f64(got.astype(np.uint16))
        want = _decode(codes, elem) * scale[:, None] * (ptx.FOLD_FACTOR if fold else 1.0)
        want = want[:, ptx.element_order(perm)]
        # exact wherever bf16 can hold the product; only products below bf16's smallest
        # subnormal (2^-133, e.g. an e4m3 subnormal times 2^-127) round, to within 2^-133
        nan = np.isnan(want)  # a NaN scale: the whole block is NaN, whatever its codes
        assert np.isnan(got[nan]).all() and nan[3].all()
        exact = want.astype(ml_dtypes.bfloat16).astype(np.float64) == want
        assert exact[~nan].mean() > 0.9
        np.testing.assert_array_equal(got[exact], want[exact])
        big = np.abs(want) > float(ml_dtypes.finfo(ml_dtypes.bfloat16).max)  # past bf16 (and
        assert np.all(np.isinf(got[big]) & (np.sign(got[big]) == np.sign(want[big])))  # f32)
        tiny = ~exact & ~big & ~nan
        assert np.all(np.abs(got[tiny] - want[tiny]) <= 2.0**-133)


def test_element_orders():
    assert ptx.element_order(False) == list(range(8))
    assert sorted(ptx.element_order(True)) == list(range(8))


@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")
@pytest.mark.parametrize("elem", ["e4m3", "e5m2"])
def test_register_weight_fp8_natural_order(elem):
    """The register-weight kernel's natural-K-order conversion of one row's 64-element fp8
    k-tile: lane t's output i is (element 8i + 2t, element 8i + 2t + 1) times scale i // 4 (the
    row's two MX blocks), i.e. MMA i // 2's K slots (2t, 2t + 1) or (2t + 8, 2t + 9), exactly,
    for every code."""
    rng = np.random.default_rng(zlib.crc32(repr(("natural", elem)).encode()))
    lane = np.arange(LANES, dtype=np.uint32)
    t = lane % 4
    shift, mask, fix = ptx.FP8_E5M2 if elem == "e5m2" else ptx.FP8_E4M3
    sel = ptx.fp8_natural_sel(t).astype(np.uint32)
    for _ in range(4):
        codes = np.concatenate([_codes(elem, rng) for _ in range(8)], 1)  # (LANES, 64)
        codes = codes[lane // 4 * 4]  # a quad's lanes read one row: the same bytes
        ops = {f"$w{j}": sum(codes[:, 4 * j + i] << (8 * i) for i in range(4)).astype(np.uint32)
               for j in range(16)}
        blocks = [_scales("e8m0", rng) for _ in range(2)]  # (codes, values) of the two blocks
        for b, (sbits, _) in enumerate(blocks):  # as the kernel's scale_pair_bf16x2 gives it
            ops[f"$s{b}"] = _bf16x2_of(np.where(sbits == 255, np.nan,
                                                2.0 ** (sbits.astype(np.float64) - 127)))
        ops["$sel"] = sel
        outs = [f"$o{i}" for i in range(8)]
        regs = emu.run(ptx.fp8_natural_pairs_ptx(
            [f"$w{j}" for j in range(16)], "$sel", [f"$s{i // 4}" for i in range(8)],
            outs, shift, fix), ops)
        for i in range(8):
            got = np.stack([(regs[outs[i]] >> (16 * h)) & 0xFFFF for h in (0, 1)], 1)
            got = emu.bf16_to_f64(got.astype(np.uint16))
            el = (8 * i + 2 * t[:, None] + np.arange(2)[None, :]).astype(np.int64)
            want = _decode(np.take_along_axis(codes, el, 1), elem) * blocks[i // 4][1][:, None]
            nan = np.isnan(want)
            assert np.isnan(got[nan]).all()
            exact = want.astype(ml_dtypes.bfloat16).astype(np.float64) == want
            assert exact[~nan].mean() > 0.9
            np.testing.assert_array_equal(got[exact & ~nan], want[exact & ~nan])


@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")
@pytest.mark.parametrize("elem", ["e4m3", "e5m2"])
def test_register_weight_fp8_quarter_with_packed_scales(elem):
    """What the kernel runs per quarter k-tile: scale_pair_packed_ptx converts the row's two
    e8m0 codes (0, 127, 254 and the NaN code among them) into one bf16x2, and
    fp8_natural_quarter_ptx picks its half and converts MMA b's bytes: exact, NaN for a NaN
    scale."""
    from jax_blockscale.kernels.sm90_ptx import scale_pair_packed_ptx, scale_pair_sel

    rng = np.random.default_rng(zlib.crc32(repr(("quarter", elem)).encode()))
    lane = np.arange(LANES, dtype=np.uint32)
    t = lane % 4
    shift, _, fix = ptx.FP8_E5M2 if elem == "e5m2" else ptx.FP8_E4M3
    full = lambda v: np.full(LANES, v, np.uint32)  # noqa: E731
    for b0 in (0, 2):  # the k-tile's two blocks: bytes b0, b0 + 1 of the scale word
        codes = np.concatenate([_codes(elem, rng) for _ in range(8)], 1)[lane // 4 * 4]
        sbits = [_scales("e8m0", rng)[0] for _ in range(4)]  # the word's four scale bytes
        word = sum(sbits[i] << (8 * i) for i in range(4)).astype(np.uint32)
        packed = emu.run(scale_pair_packed_ptx("mxfp8"), {
            "$2": word, "$3": word, "$4": full(scale_pair_sel(b0, b0 + 1))})["$0"]
        for b in range(4):  # MMA b of the k-tile: its block is b // 2
            q = codes[:, 16 * b: 16 * b + 16]
            ops = {f"${2 + j}": sum(q[:, 4 * j + i] << (8 * i) for i in range(4)).astype(
                np.uint32) for j in range(4)}
            ops.update({"$6": packed, "$7": ptx.fp8_natural_sel(t).astype(np.uint32),
                        "$8": full(shift), "$9": full(fix)})
            regs = emu.run(ptx.fp8_natural_quarter_ptx(b // 2), ops)
            code = sbits[b0 + b // 2]
            sv = np.where(code == 255, np.nan, 2.0 ** (code.astype(np.float64) - 127))
            for h, out in enumerate(("$0", "$1")):
                got = np.stack([(regs[out] >> (16 * x)) & 0xFFFF for x in (0, 1)], 1)
                got = emu.bf16_to_f64(got.astype(np.uint16))
                el = (8 * h + 2 * t[:, None] + np.arange(2)[None, :]).astype(np.int64)
                want = _decode(np.take_along_axis(q, el, 1), elem) * sv[:, None]
                nan = np.isnan(want)
                assert np.isnan(got[nan]).all() and nan.any()
                exact = want.astype(ml_dtypes.bfloat16).astype(np.float64) == want
                np.testing.assert_array_equal(got[exact & ~nan], want[exact & ~nan])


def _bf16x2_of(v):
    """bf16x2 words with the float64 value `v` (per lane) in both halves."""
    b = emu.f64_to_bf16_exact(v).astype(np.uint32)
    return b | (b << 16)
