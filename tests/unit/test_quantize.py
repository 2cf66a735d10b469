"""quantize / dequantize against the float64 oracle, bit for bit, on fresh random data."""
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jax_blockscale as jbs
import oracle

FORMATS = list(oracle.SPEC)


def _random(seed, shape, kind="normal"):
    rng = np.random.default_rng(seed)
    if kind == "normal":
        return rng.standard_normal(shape).astype(np.float32)
    if kind == "heavy":  # student-t: outliers stress the shared exponent
        return (rng.standard_t(2, shape) * 10.0 ** rng.integers(-3, 3)).astype(np.float32)
    if kind == "wide":  # blocks of wildly different magnitudes
        x = rng.standard_normal(shape)
        return (x * 2.0 ** rng.integers(-40, 40, shape[:-1] + (1,))).astype(np.float32)
    raise ValueError(kind)


def mx_round_up_oracle(x, fmt):
    """MX with the round-up scale rule, in float64: shared = ceil(log2(amax / elem_max))."""
    elem, block, scale_dt, _, elem_max = oracle.SPEC[fmt]
    x = np.asarray(x, np.float32)
    xb = x.reshape(*x.shape[:-1], x.shape[-1] // block, block).astype(np.float64)
    amax = np.abs(xb).max(axis=-1)
    with np.errstate(divide="ignore"):
        shared = np.where(amax > 0, np.ceil(np.log2(amax / elem_max)), -127).clip(-127, 127)
    scales = np.ldexp(1.0, shared.astype(int)).astype(scale_dt)
    q = np.clip(xb / np.ldexp(1.0, shared.astype(int))[..., None], -elem_max, elem_max)
    return q.astype(np.float32).astype(elem).astype(np.float64).reshape(x.shape), scales, None


def _oracle(x, fmt, rounding):
    if rounding == "ocp" or fmt == "nvfp4":
        return oracle.quantize(x, fmt)
    return mx_round_up_oracle(x, fmt)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("kind", ["normal", "heavy", "wide"])
@pytest.mark.parametrize("rounding", ["round_up", "ocp"])
def test_quantize_matches_oracle(fmt, kind, rounding):
    if fmt == "nvfp4" and rounding == "ocp":
        pytest.skip("the rule selects MX power-of-two scales; nvfp4 is covered once")
    block = jbs.get_format(fmt).block
    x = _random(hash((fmt, kind)) % 2**32, (3, 37, 4 * block), kind)
    q = jax.jit(lambda x: jbs.quantize(x, fmt, scale_rounding=rounding))(x)
    want_vals, want_scales, want_g = _oracle(x, fmt, rounding)
    got_elems = oracle.decode_elements(q.data, fmt)
    np.testing.assert_array_equal(np.asarray(q.scales).view(np.uint8),
                                  want_scales.view(np.uint8))
    np.testing.assert_array_equal(got_elems, want_vals)
    if want_g is None:
        assert q.global_scale is None
    else:
        np.testing.assert_allclose(float(q.global_scale), float(want_g), rtol=1e-7)


@pytest.mark.parametrize("fmt", FORMATS)
def test_dequantize_matches_oracle(fmt):
    block = jbs.get_format(fmt).block
    x = _random(7, (2, 50, 3 * block), "heavy")
    for layout in ("plain", "blocked"):
        q = jbs.quantize(x, fmt, layout=layout)
        want = oracle.dequantize(q.data, q.scales, fmt, q.global_scale, layout)
        got = np.asarray(jax.jit(jbs.dequantize)(q), np.float64)
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=0)


@pytest.mark.parametrize("fmt,expected", [("nvfp4", 0.1), ("mxfp4", 0.12), ("mxfp6_e2m3", 0.03),
                                          ("mxfp8_e4m3", 0.03), ("mxfp8_e5m2", 0.06)])
def test_quantization_error_is_that_of_the_format(fmt, expected):
    x = _random(11, (64, 512))
    rel = np.linalg.norm(np.asarray(jbs.dequantize(jbs.quantize(x, fmt))) - x) / np.linalg.norm(x)
    assert expected / 3 < rel < expected * 1.5


def test_all_zero_block_gets_a_finite_scale():
    x = _random(3, (4, 64))
    x[1, :32] = 0.0
    for fmt in FORMATS:
        q = jbs.quantize(x, fmt)
        s = np.asarray(q.scales).astype(np.float32)
        assert np.all(np.isfinite(s))
        np.testing.assert_array_equal(np.asarray(jbs.dequantize(q))[1, :32], 0.0)


def test_mx_saturates_and_rounds_to_nearest_even():
    # One block of 32: amax 6 -> shared exponent floor(log2 6) - 2 = 0, so elements are x itself.
    x = np.zeros((1, 32), np.float32)
    x[0, :6] = [6.0, 2.5, 0.75, -5.0, 0.25, 3.5]  # ties go to even codes: 2.5->2, .75->1, -5->-4
    x[0, 6:] = 0.5
    q = jbs.quantize(x, "mxfp4")
    assert float(np.asarray(q.scales).astype(np.float32)[0, 0]) == 1.0
    np.testing.assert_array_equal(np.asarray(q.data.astype(jnp.float32))[0, :6],
                                  [6.0, 2.0, 1.0, -4.0, 0.0, 4.0])


def test_nvfp4_global_scale_options():
    x = _random(5, (8, 64)) * 1e-3
    auto = jbs.quantize(x, "nvfp4")
    amax = np.abs(x).max()
    np.testing.assert_allclose(float(auto.global_scale), amax / (6 * 448), rtol=1e-6)
    # the largest block scale lands at the top of e4m3's range
    assert np.asarray(auto.scales).astype(np.float32).max() == 448.0
    off = jbs.quantize(x, "nvfp4", global_scale=None)
    assert off.global_scale is None
    fixed = jbs.quantize(x, "nvfp4", global_scale=2.0 ** -10)
    assert float(fixed.global_scale) == 2.0 ** -10
    for q in (auto, fixed):
        err = np.linalg.norm(np.asarray(jbs.dequantize(q)) - x) / np.linalg.norm(x)
        assert err < 0.15


def test_fp4_pack_roundtrip_and_nibble_order():
    x = _random(9, (3, 5, 64))
    q = jbs.quantize(x, "mxfp4")
    packed = jbs.pack_fp4(q.data)
    assert packed.shape == (3, 5, 32) and packed.dtype == jnp.uint8
    np.testing.assert_array_equal(np.asarray(jbs.unpack_fp4(packed)).view(np.uint8),
                                  np.asarray(q.data).view(np.uint8))
    codes = np.asarray(q.data).view(np.uint8) & 0xF  # ml_dtypes keeps one code per byte
    np.testing.assert_array_equal(np.asarray(packed), codes[..., 0::2] | (codes[..., 1::2] << 4))
    np.testing.assert_array_equal(np.asarray(q.packed_data()), np.asarray(packed))


def test_quantize_rejects_bad_input():
    with pytest.raises(ValueError, match="multiple of the block"):
        jbs.quantize(np.ones((4, 40), np.float32), "mxfp8_e4m3")
    with pytest.raises(ValueError, match="unknown block-scaled format"):
        jbs.quantize(np.ones((4, 32), np.float32), "fp3")
    with pytest.raises(TypeError, match="floating-point"):
        jbs.quantize(np.ones((4, 32), np.int32), "mxfp4")
    with pytest.raises(ValueError, match="no global scale"):
        jbs.quantize(np.ones((4, 32), np.float32), "mxfp4", global_scale=1.0)
    with pytest.raises(ValueError, match="layout"):
        jbs.quantize(np.ones((4, 32), np.float32), "mxfp4", layout="swizzled")


def test_formats_table():
    for name, (elem, block, scale, emax, elem_max) in oracle.SPEC.items():
        f = jbs.get_format(name)
        assert (f.block, f.scale_dtype, f.emax, f.elem_max) == (block, np.dtype(scale), emax,
                                                                 elem_max)
        assert f.element_dtype == np.dtype(elem)
        assert ml_dtypes.finfo(elem).max == elem_max
        assert f.has_global_scale == (name == "nvfp4")
    assert jbs.can_multiply("nvfp4", "nvfp4") and not jbs.can_multiply("nvfp4", "mxfp4")
    assert jbs.can_multiply("mxfp8_e4m3", "mxfp4") and jbs.can_multiply("mxfp6_e3m2", "mxfp8_e5m2")
    assert jbs.can_multiply(None, "nvfp4")
    assert len(jbs.supported_pairs()) == 1 + 5 * 5


@pytest.mark.parametrize("fmt", FORMATS)
def test_decode_elements_every_code(fmt):
    """Every storable element (all 16 fp4 codes incl. -0, all 64 fp6 codes, all 256 fp8 bit
    patterns but NaN) decodes to the value ml_dtypes gives it, sign of zero included."""
    from jax_blockscale.core.quantize import decode_elements

    f = jbs.get_format(fmt)
    if f.element_bits == 4:
        data = np.arange(16, dtype=np.uint8).view(ml_dtypes.uint4).view(f.storage_dtype)
    elif f.is_code_stored:
        data = np.arange(64, dtype=np.uint8)
    else:
        data = np.arange(256, dtype=np.uint8).view(f.storage_dtype)
        data = data[~np.isnan(data.astype(np.float32))]
    want = (data.view(np.uint8).view(f.element_dtype) if f.is_code_stored else data)
    want = np.asarray(want, np.float32)
    got = np.asarray(jax.jit(lambda d: decode_elements(d, fmt))(jnp.asarray(data)))
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(np.signbit(got), np.signbit(want))


# ---- NVFP4 of a bf16 activation: through quantize_nvfp4_p (the quantizer kernels on Hopper) ----

def _primitives(f, *args):
    return {str(e.primitive) for e in jax.make_jaxpr(f)(*args).jaxpr.eqns}


@pytest.mark.parametrize("shape", [(1, 64), (3, 37, 64), (5, 16)])
def test_bf16_nvfp4_through_the_quantizer_primitive_matches_the_oracle(shape):
    """One primitive call for all rows (one global scale), the oracle's values: on this CPU it
    lowers to quantize.py's XLA computation."""
    x = jnp.asarray(_random(len(shape), shape, "wide"), jnp.bfloat16)
    assert "blockscale_quantize_nvfp4" in _primitives(lambda x: jbs.quantize(x, "nvfp4"), x)
    q = jax.jit(lambda x: jbs.quantize(x, "nvfp4"))(x)
    want_vals, want_scales, want_g = oracle.quantize(np.asarray(x, np.float32), "nvfp4")
    np.testing.assert_array_equal(np.asarray(q.scales).view(np.uint8),
                                  want_scales.view(np.uint8))
    np.testing.assert_array_equal(oracle.decode_elements(q.data, "nvfp4"), want_vals)
    np.testing.assert_allclose(float(q.global_scale), float(want_g), rtol=1e-7)


@pytest.mark.parametrize("shape", [(1, 64), (3, 37, 64)])
def test_bf16_nvfp4_with_a_given_scale_through_the_primitive(shape):
    """A given decode factor (traced): the primitive's folded call equals quantize.py's
    computation on the unfolded array, and the stored factor is the given one."""
    from jax_blockscale.core.formats import get_format
    from jax_blockscale.core.quantize import _quantize_nvfp4

    x = jnp.asarray(_random(7, shape, "normal"), jnp.bfloat16)
    g = jnp.float32(float(np.abs(np.asarray(x, np.float32)).max()) / 2688 / 2)
    f = lambda x, g: jbs.quantize(x, "nvfp4", global_scale=g)  # noqa: E731
    assert "blockscale_quantize_nvfp4" in _primitives(f, x, g)
    q = jax.jit(f)(x, g)
    d, s, _ = jax.jit(lambda x, g: _quantize_nvfp4(x, get_format("nvfp4"), g))(x, g)
    np.testing.assert_array_equal(np.asarray(q.scales).view(np.uint8), np.asarray(s).view(np.uint8))
    np.testing.assert_array_equal(np.asarray(q.data, np.float32), np.asarray(d, np.float32))
    assert float(q.global_scale) == float(g)


@pytest.mark.parametrize("case", ["f32", "per_matrix", "None", "per-matrix given", "mxfp4"])
def test_other_quantizations_are_plain_jax(case):
    x = jnp.ones((2, 4, 64), jnp.float32 if case == "f32" else jnp.bfloat16)
    fmt = "mxfp4" if case == "mxfp4" else "nvfp4"
    kw = {"per_matrix": dict(global_scale="per_matrix"), "None": dict(global_scale=None),
          "per-matrix given": dict(global_scale=jnp.full((2,), 0.01))}.get(case, {})
    assert "blockscale_quantize_nvfp4" not in _primitives(
        lambda x: jbs.quantize(x, fmt, **kw), x)


def test_bf16_nvfp4_under_vmap_quantizes_each_slice_on_its_own():
    x = jnp.asarray(_random(9, (3, 4, 64), "wide"), jnp.bfloat16)
    qs = jax.jit(jax.vmap(lambda x: jbs.quantize(x, "nvfp4")))(x)
    for i in range(3):
        q = jbs.quantize(x[i], "nvfp4")
        assert float(qs.global_scale[i]) == float(q.global_scale)
        np.testing.assert_array_equal(np.asarray(qs.scales[i]).view(np.uint8),
                                      np.asarray(q.scales).view(np.uint8))
        np.testing.assert_array_equal(np.asarray(qs.data[i], np.float32),
                                      np.asarray(q.data, np.float32))


def test_bf16_nvfp4_differentiates_as_plain_jax():
    """jvp and grad through quantize-dequantize are quantize.py's own (the primitive's jvp is
    that computation's)."""
    from jax_blockscale.core.formats import get_format
    from jax_blockscale.core.quantize import _quantize_nvfp4

    x = jnp.asarray(_random(11, (4, 64), "normal"), jnp.bfloat16)

    def through_primitive(x):
        return jnp.sum(jbs.dequantize(jbs.quantize(x, "nvfp4")) * x.astype(jnp.float32))

    def plain(x):
        d, s, g = _quantize_nvfp4(x, get_format("nvfp4"), "auto")
        q = jbs.BlockScaled(d, s, g, "nvfp4", "plain")
        return jnp.sum(jbs.dequantize(q) * x.astype(jnp.float32))

    np.testing.assert_array_equal(np.asarray(jax.grad(through_primitive)(x), np.float32),
                                  np.asarray(jax.grad(plain)(x), np.float32))
