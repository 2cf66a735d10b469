"""jax_blockscale.interop converters: arrays built by hand in each published layout (ModelOpt
NVFP4, compressed-tensors NVFP4, gpt-oss MXFP4) convert bit for bit, and their values match a
float64 oracle computed from the hand-chosen codes and scales (not from the package)."""
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jax_blockscale as jbs
import oracle
from jax_blockscale import interop

# e2m1 code -> value (sign bit 3, then 0, .5, 1, 1.5, 2, 3, 4, 6), written out from the spec
E2M1 = np.array([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6], np.float64)


def rng(seed):
    return np.random.default_rng(seed)


def random_codes(r, shape):
    return r.integers(0, 16, size=shape, dtype=np.uint8)


def pack_low_first(codes):
    """Two codes per byte, element 2i in the low nibble: how ModelOpt, compressed-tensors and
    gpt-oss all pack (written here independently of jbs.pack_fp4)."""
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)


def random_e4m3(r, shape):
    """Positive finite e4m3 scales from random bits (0x08..0x7e: normal numbers up to 448)."""
    return r.integers(0x08, 0x7F, size=shape, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn)


def codes_of(data):
    """The e2m1 codes a float4_e2m1fn array holds."""
    return np.asarray(data).view(np.uint8) & 0xF


def per_matrix(q, i):
    return jax.tree.map(lambda a: a[i], q)


# ---------------------------------------------------------------------------------------------
# Nibble order on literal bytes


def test_nibble_order_literal_bytes():
    # elements [1.0, -0.5] -> codes 2 and 9 -> byte 0x92 (low nibble first); [6, 0] -> 0x07
    row = np.array([[0x92, 0x07] * 4], np.uint8)  # 16 elements
    q = interop.from_modelopt_nvfp4(row, np.array([[1.0]], ml_dtypes.float8_e4m3fn),
                                    np.float32(1.0))
    np.testing.assert_array_equal(np.asarray(jbs.dequantize(q))[0, :4], [1.0, -0.5, 6.0, 0.0])
    blocks = np.array([[[0x92, 0x07] * 8]], np.uint8)  # (N=1, K/32=1, 16)
    g = interop.from_gpt_oss_mxfp4(blocks, np.array([[127 + 3]], np.uint8))
    np.testing.assert_array_equal(np.asarray(jbs.dequantize(g))[0, :4], [8.0, -4.0, 48.0, 0.0])


# ---------------------------------------------------------------------------------------------
# ModelOpt NVFP4


def modelopt_arrays(r, lead, n, k):
    codes = random_codes(r, (*lead, n, k))
    scales = random_e4m3(r, (*lead, n, k // 16))
    g = (r.uniform(0.5, 2.0, size=lead) * 2.0 ** -10).astype(np.float32)
    return codes, scales, g


def oracle_nvfp4(codes, scales, g, invert=False):
    s = np.repeat(scales.astype(np.float64), 16, axis=-1)
    g = np.asarray(g, np.float64)[..., None, None]
    return E2M1[codes] * s / g if invert else E2M1[codes] * s * g


@pytest.mark.parametrize("layout", ["plain", "blocked"])
def test_modelopt_bit_exact(layout):
    r = rng(1)
    codes, scales, g = modelopt_arrays(r, (), 40, 96)
    q = interop.from_modelopt_nvfp4(pack_low_first(codes), scales, g.reshape(1), layout=layout)
    assert (q.fmt, q.layout, q.shape) == ("nvfp4", layout, (40, 96))
    np.testing.assert_array_equal(codes_of(q.data), codes)
    plain = jbs.to_plain(q).scales
    np.testing.assert_array_equal(np.asarray(plain).view(np.uint8), scales.view(np.uint8))
    assert q.global_scale.shape == () and np.float32(q.global_scale) == g
    want = oracle_nvfp4(codes, scales, g)
    np.testing.assert_array_equal(oracle.dequantize(q.data, q.scales, "nvfp4", q.global_scale,
                                                    layout=layout), want)
    # e2m1 * e4m3 is exact in f32 and one multiply by g rounds once: equal to f32(oracle)
    np.testing.assert_array_equal(np.asarray(jbs.dequantize(q)), want.astype(np.float32))


def test_modelopt_uint8_scale_bits_and_stack():
    r = rng(2)
    codes, scales, g = modelopt_arrays(r, (3,), 16, 64)
    q = interop.from_modelopt_nvfp4(pack_low_first(codes), scales.view(np.uint8), g)
    assert q.shape == (3, 16, 64) and q.global_scale.shape == (3,)
    want = oracle_nvfp4(codes, scales, g)
    for i in range(3):  # one global scale per matrix of the stack
        np.testing.assert_array_equal(np.asarray(jbs.dequantize(per_matrix(q, i))),
                                      want[i].astype(np.float32))


def test_modelopt_under_jit_matches_numpy():
    r = rng(3)
    codes, scales, g = modelopt_arrays(r, (), 8, 32)
    args = (pack_low_first(codes), scales, g)
    host = interop.from_modelopt_nvfp4(*args, layout="blocked")
    traced = jax.jit(lambda *a: interop.from_modelopt_nvfp4(*a, layout="blocked"))(
        *map(jnp.asarray, args))
    for a, b in zip(jax.tree.leaves(host), jax.tree.leaves(traced)):
        np.testing.assert_array_equal(np.asarray(a).view(np.uint8) if a.dtype.itemsize == 1
                                      else np.asarray(a), np.asarray(b).view(np.uint8)
                                      if b.dtype.itemsize == 1 else np.asarray(b))


def test_modelopt_input_scale():
    assert interop.modelopt_input_scale(np.array([0.25], np.float32)) == np.float32(0.25)
    with pytest.raises(ValueError, match="input_scale"):
        interop.modelopt_input_scale(np.ones(3, np.float32))


def test_converted_weight_in_gemm():
    r = rng(4)
    codes, scales, g = modelopt_arrays(r, (), 24, 64)
    w = interop.from_modelopt_nvfp4(pack_low_first(codes), scales, g, layout="blocked")
    x = r.standard_normal((5, 64)).astype(np.float32)
    y = jax.jit(lambda x, w: jbs.gemm(x, w, out_dtype=jnp.float32))(x, w)
    want = x.astype(np.float64) @ oracle_nvfp4(codes, scales, g).T
    np.testing.assert_allclose(np.asarray(y), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


# ---------------------------------------------------------------------------------------------
# compressed-tensors NVFP4


def test_compressed_tensors_bit_exact():
    r = rng(5)
    codes, scales, _ = modelopt_arrays(r, (), 32, 48)
    enc = np.float32(6 * 448 / 3.7)  # an encode factor, as llm-compressor stores it
    q = interop.from_compressed_tensors_nvfp4(pack_low_first(codes), scales,
                                              np.array([enc], np.float32), layout="blocked")
    np.testing.assert_array_equal(codes_of(q.data), codes)
    np.testing.assert_array_equal(np.asarray(jbs.to_plain(q).scales).view(np.uint8),
                                  scales.view(np.uint8))
    assert np.float32(q.global_scale) == np.float32(1.0) / enc  # the decode factor
    want = oracle_nvfp4(codes, scales, enc, invert=True)  # q * (scale / global)
    got = np.asarray(jbs.dequantize(q), np.float64)
    np.testing.assert_allclose(got, want, rtol=2 ** -22, atol=0)  # 1/g rounded once to f32


def test_compressed_tensors_stack_and_input_scale():
    r = rng(6)
    codes, scales, _ = modelopt_arrays(r, (2,), 16, 32)
    enc = np.array([100.0, 300.0], np.float32)
    q = interop.from_compressed_tensors_nvfp4(pack_low_first(codes), scales, enc)
    np.testing.assert_array_equal(np.asarray(q.global_scale), np.float32(1) / enc)
    assert interop.compressed_tensors_input_scale(np.array([4.0], np.float32)) == 0.25


# ---------------------------------------------------------------------------------------------
# gpt-oss MXFP4


def gpt_oss_arrays(r, lead, n, k):
    codes = random_codes(r, (*lead, n, k))
    exps = r.integers(127 - 20, 127 + 20, size=(*lead, n, k // 32), dtype=np.uint8)
    blocks = pack_low_first(codes).reshape(*lead, n, k // 32, 16)
    return codes, exps, blocks


def oracle_gpt_oss(codes, exps):
    # gpt-oss: lut[nibble] then ldexp(., scale - 127)
    return np.ldexp(E2M1[codes], np.repeat(exps.astype(np.int64) - 127, 32, axis=-1))


@pytest.mark.parametrize("layout", ["plain", "blocked"])
def test_gpt_oss_bit_exact(layout):
    r = rng(7)
    codes, exps, blocks = gpt_oss_arrays(r, (3,), 20, 96)
    q = interop.from_gpt_oss_mxfp4(blocks, exps, layout=layout)
    assert (q.fmt, q.layout, q.shape, q.global_scale) == ("mxfp4", layout, (3, 20, 96), None)
    np.testing.assert_array_equal(codes_of(q.data), codes)
    np.testing.assert_array_equal(np.asarray(jbs.to_plain(q).scales).view(np.uint8), exps)
    want = oracle_gpt_oss(codes, exps)
    np.testing.assert_array_equal(oracle.dequantize(q.data, q.scales, "mxfp4", layout=layout),
                                  want)
    np.testing.assert_array_equal(np.asarray(jbs.dequantize(q)), want.astype(np.float32))


def test_gpt_oss_gate_up():
    r = rng(8)
    codes, exps, blocks = gpt_oss_arrays(r, (2,), 12, 64)  # 12 rows: 6 gate/up pairs
    want = oracle_gpt_oss(codes, exps)
    gate, up = interop.from_gpt_oss_mxfp4(blocks, exps, gate_up="split")
    np.testing.assert_array_equal(np.asarray(jbs.dequantize(gate)), want[:, 0::2])
    np.testing.assert_array_equal(np.asarray(jbs.dequantize(up)), want[:, 1::2])
    fused = interop.from_gpt_oss_mxfp4(blocks, exps, gate_up="concat", layout="blocked")
    assert fused.layout == "blocked"
    np.testing.assert_array_equal(np.asarray(jbs.dequantize(fused)),
                                  np.concatenate([want[:, 0::2], want[:, 1::2]], axis=1))
    # the same split afterwards, on a blocked weight, and on the interleaved bias
    g2, u2 = interop.deinterleave_gate_up(interop.from_gpt_oss_mxfp4(blocks, exps,
                                                                     layout="blocked"))
    assert g2.layout == u2.layout == "blocked"
    np.testing.assert_array_equal(np.asarray(jbs.dequantize(u2)), want[:, 1::2])
    bias = r.standard_normal((2, 12)).astype(np.float32)
    bg, bu = interop.deinterleave_gate_up(bias)
    np.testing.assert_array_equal(bg, bias[:, 0::2])
    np.testing.assert_array_equal(bu, bias[:, 1::2])


# ---------------------------------------------------------------------------------------------
# Errors name the argument


def test_errors_name_the_argument():
    r = rng(9)
    codes, scales, g = modelopt_arrays(r, (), 8, 32)
    packed = pack_low_first(codes)
    with pytest.raises(TypeError, match="weight must be uint8"):
        interop.from_modelopt_nvfp4(packed.astype(np.float32), scales, g)
    with pytest.raises(TypeError, match="weight_scale must be float8_e4m3fn"):
        interop.from_modelopt_nvfp4(packed, scales.astype(np.float32), g)
    with pytest.raises(ValueError, match=r"weight_scale has shape \(8, 1\)"):
        interop.from_modelopt_nvfp4(packed, scales[:, :1], g)
    with pytest.raises(ValueError, match="weight_scale_2 has shape"):
        interop.from_modelopt_nvfp4(packed, scales, np.ones(2, np.float32))
    with pytest.raises(TypeError, match="weight_scale_2 must be float32"):
        interop.from_modelopt_nvfp4(packed, scales, np.float64(1.0))
    with pytest.raises(ValueError, match="layout"):
        interop.from_modelopt_nvfp4(packed, scales, g, layout="swizzled")
    with pytest.raises(TypeError, match="weight_packed must be uint8"):
        interop.from_compressed_tensors_nvfp4(codes.astype(np.int8), scales, g)
    _, exps, blocks = gpt_oss_arrays(r, (), 6, 64)
    with pytest.raises(ValueError, match=r"blocks must be \(\.\.\., N, K/32, 16\)"):
        interop.from_gpt_oss_mxfp4(blocks[..., :15], exps)
    with pytest.raises(ValueError, match="scales has shape"):
        interop.from_gpt_oss_mxfp4(blocks, exps[:, :1])
    with pytest.raises(ValueError, match="even number of rows"):
        interop.from_gpt_oss_mxfp4(blocks[:5], exps[:5], gate_up="split")
    with pytest.raises(ValueError, match="gate_up"):
        interop.from_gpt_oss_mxfp4(blocks, exps, gate_up="halves")
