"""Bad values and bad arguments: NaN / Inf / huge / tiny input stays in its block, invalid global
scales and hand-built tensors are refused with errors that name the argument, subnormal scales
are not flushed. The policy per format is written down in docs/formats.md ("NaN and Inf")."""
import dataclasses

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import jax_blockscale as jbs
import oracle

FORMATS = list(oracle.SPEC)
MX = [f for f in FORMATS if f != "nvfp4"]
NAN_ELEMENTS = ("mxfp8_e4m3", "mxfp8_e5m2")  # element types that can hold NaN themselves


def _normal(seed, shape, scale=1.0):
    return (np.random.default_rng(seed).standard_normal(shape) * scale).astype(np.float32)


def _values(q):
    return np.asarray(jax.jit(jbs.dequantize)(q), np.float64)


def _block_view(v, block):
    return v.reshape(*v.shape[:-1], v.shape[-1] // block, block)


# ---------------------------------------------------------------------------------------------
# 1, 2: NVFP4 "auto" calibration


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("mode", ["auto", "per_matrix"])
def test_nvfp4_one_non_finite_value_stays_in_its_block(bad, mode):
    x = _normal(1, (4, 64), 1e-3)
    clean = x.copy()
    clean[0, 0] = 0.0
    x[0, 0] = bad
    q, ref = jbs.quantize(x, "nvfp4", global_scale=mode), jbs.quantize(clean, "nvfp4",
                                                                     global_scale=mode)
    assert np.isfinite(float(q.global_scale)) and float(q.global_scale) > 0
    assert float(q.global_scale) == float(ref.global_scale)  # NaN / Inf do not set it
    got, want = _block_view(_values(q), 16), _block_view(_values(ref), 16)
    assert np.all(np.isnan(got[0, 0]))  # e2m1 has no NaN/Inf: the whole block is NaN
    got[0, 0] = want[0, 0] = 0.0
    np.testing.assert_array_equal(got, want)  # every other block as without the bad value
    np.testing.assert_allclose(got.reshape(4, 64)[1:], x[1:], rtol=0.3, atol=2e-4)


@pytest.mark.parametrize("scale", [2e-37, 1e-36, 3e-35])
def test_nvfp4_tiny_tensor_keeps_a_finite_global_scale(scale):
    # (values and results below 1.2e-38 are f32 subnormals, which XLA on the CPU flushes)
    x = _normal(2, (8, 32), scale)
    x = np.where(np.abs(x) < np.finfo(np.float32).tiny * 8, np.float32(scale), x)
    q = jbs.quantize(x, "nvfp4")
    g = float(q.global_scale)
    assert np.isfinite(g) and g >= np.finfo(np.float32).tiny  # a normal decode factor
    got = _values(q)
    assert np.all(np.isfinite(got))
    x = x.astype(np.float64)  # (squares of 1e-38 underflow in f32)
    rel = np.linalg.norm(got - x) / np.linalg.norm(x)
    assert rel < 0.2, rel


def test_nvfp4_all_zero_or_all_non_finite_tensor():
    for x in (np.zeros((2, 16), np.float32), np.full((2, 16), np.nan, np.float32)):
        q = jbs.quantize(x, "nvfp4")
        assert float(q.global_scale) == 1.0 / (6 * 448) * (6 * 448)  # enc = 1: decode 1
    np.testing.assert_array_equal(_values(jbs.quantize(np.zeros((2, 16), np.float32), "nvfp4")),
                                  0.0)


# ---------------------------------------------------------------------------------------------
# 3: MX non-finite policy, per format


@pytest.mark.parametrize("fmt", MX)
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_mx_non_finite_policy(fmt, bad):
    x = _normal(3, (2, 64))
    clean = x.copy()
    clean[1, 5] = 0.0
    x[1, 5] = bad
    got = _block_view(_values(jbs.quantize(x, fmt)), 32)
    want = _block_view(_values(jbs.quantize(clean, fmt)), 32)
    held = got[1, 0].copy()
    got[1, 0] = want[1, 0] = 0.0
    np.testing.assert_array_equal(got, want)  # other blocks untouched
    if fmt in NAN_ELEMENTS:  # the element keeps the bad value; its neighbours are unaffected
        others = np.delete(held, 5)
        np.testing.assert_array_equal(others, np.delete(_block_view(
            _values(jbs.quantize(clean, fmt)), 32)[1, 0], 5))
        if fmt == "mxfp8_e5m2" or np.isnan(bad):
            np.testing.assert_array_equal(held[5], bad)  # e5m2 has +-Inf, both have NaN
        else:
            assert np.isnan(held[5])  # e4m3fn has no Inf: Inf becomes NaN, never finite
    else:  # e2m1 / e2m3 / e3m2: no NaN, no Inf: the block's scale is e8m0 NaN (0xFF)
        assert np.all(np.isnan(held))
        q = jbs.quantize(x, fmt)
        assert np.asarray(q.scales).view(np.uint8)[1, 0] == 0xFF


def test_mx_inf_never_becomes_a_small_finite_value():
    x = _normal(4, (1, 32))
    x[0, 0] = np.inf
    for fmt in MX:
        v = _values(jbs.quantize(x, fmt))[0, 0]
        assert not np.isfinite(v), (fmt, v)


# ---------------------------------------------------------------------------------------------
# The property: bad values at random positions change only their own blocks, as documented

KINDS = ("nan", "inf", "-inf", "huge", "tiny")
VARIANTS = [(f, None) for f in MX] + [("nvfp4", None), ("nvfp4", "auto")]
ROWS, COLS_BLOCKS = 3, 3
_TOL = {"nvfp4": 0.3, "mxfp4": 0.3, "mxfp6_e2m3": 0.1, "mxfp6_e3m2": 0.15,
        "mxfp8_e4m3": 0.1, "mxfp8_e5m2": 0.15}  # worst |error| / block amax


@jax.jit
def _identity(x):
    return x


def _quantize_values(x, fmt, gs):
    q = jax.jit(lambda v: jbs.quantize(v, fmt, global_scale=gs))(x)
    return q, np.asarray(jax.jit(jbs.dequantize)(q), np.float64)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(variant=st.sampled_from(VARIANTS), seed=st.integers(0, 2 ** 32 - 1),
       injections=st.lists(st.tuples(st.integers(0, 10 ** 6), st.sampled_from(KINDS),
                                     st.floats(1.0, 2.0)), min_size=1, max_size=4))
def test_property_bad_values_stay_in_their_blocks(variant, seed, injections):
    fmt, gs = variant
    block = jbs.get_format(fmt).block
    shape = (ROWS, COLS_BLOCKS * block)
    if gs == "auto":  # a huge finite value legitimately sets the one global scale
        injections = [(p, k, m) for p, k, m in injections if k != "huge"] or [(0, "nan", 1.0)]
    x = _normal(seed, shape)
    bad = x.copy()
    kinds = {}
    for pos, kind, mag in injections:
        r, c = divmod(pos % x.size, shape[1])
        v = {"nan": np.nan, "inf": np.inf, "-inf": -np.inf, "huge": 1e30 * mag,
             "tiny": 1e-30 * mag}[kind]
        bad[r, c] = -v if (kind in ("huge", "tiny") and pos % 2) else v
        kinds[r, c] = kind
    nonfinite = ~np.isfinite(bad)
    injected = np.zeros(shape, bool)
    for rc in kinds:
        injected[rc] = True
    _, got = _quantize_values(bad, fmt, gs)
    _, zeroed = _quantize_values(np.where(injected, 0, bad).astype(np.float32), fmt, gs)
    _, finite_ref = _quantize_values(np.where(nonfinite, 0, bad).astype(np.float32), fmt, gs)
    gb, zb, fb = (_block_view(v, block) for v in (got, zeroed, finite_ref))
    held = _block_view(injected, block).any(-1)
    held_nonfinite = _block_view(nonfinite, block).any(-1)
    # 1. blocks holding nothing bad are exactly what they are without the bad values
    np.testing.assert_array_equal(gb[~held], zb[~held])
    # 2. blocks with a NaN / Inf, per format
    xb, nb = _block_view(bad, block), _block_view(nonfinite, block)
    for r, b in zip(*np.nonzero(held_nonfinite)):
        if fmt in NAN_ELEMENTS:
            np.testing.assert_array_equal(gb[r, b][~nb[r, b]], fb[r, b][~nb[r, b]])
            special = xb[r, b][nb[r, b]]
            want = special if fmt == "mxfp8_e5m2" else np.full_like(special, np.nan)
            np.testing.assert_array_equal(gb[r, b][nb[r, b]], want)
        else:
            assert np.all(np.isnan(gb[r, b]))
    # 3. blocks with only huge / tiny finite values: represented as well as the format allows
    for r, b in zip(*np.nonzero(held & ~held_nonfinite)):
        vals, want = gb[r, b], xb[r, b].astype(np.float64)
        assert np.all(np.isfinite(vals))
        if fmt == "nvfp4" and gs is None and np.abs(want).max() / 6 > 448:
            # no global tier: a block scale saturates at 448, values at 6 * 448 (documented)
            assert np.abs(vals).max() == 6 * 448
            np.testing.assert_array_equal(np.sign(vals[np.abs(want) > 6 * 448]),
                                          np.sign(want[np.abs(want) > 6 * 448]))
        else:
            amax = np.abs(want).max()
            assert np.abs(vals - want).max() <= _TOL[fmt] * amax


# ---------------------------------------------------------------------------------------------
# 4: invalid global scales


@pytest.mark.parametrize("gs,err,match", [
    (0.0, ValueError, "finite and positive"),
    (-1.0, ValueError, "finite and positive"),
    (np.nan, ValueError, "finite and positive"),
    (np.inf, ValueError, "finite and positive"),
    ("manual", ValueError, r"global_scale must be one of \('auto', 'per_matrix'\)"),
    ("Auto", ValueError, "global_scale must be one of"),
    (np.ones((2,), np.float32), ValueError, r"global_scale has shape \(2,\)"),
    (np.int32(3), TypeError, "floating-point"),
])
def test_invalid_global_scale_is_refused(gs, err, match):
    x = _normal(5, (4, 32))
    with pytest.raises(err, match=match):
        jbs.quantize(x, "nvfp4", global_scale=gs)


def test_traced_global_scale_is_accepted_and_mx_refuses_strings():
    x = _normal(6, (4, 32))
    q = jax.jit(lambda x, g: jbs.quantize(x, "nvfp4", global_scale=g))(x, jnp.float32(0.25))
    assert float(q.global_scale) == 0.25
    with pytest.raises(ValueError, match="global_scale must be one of"):
        jbs.quantize(x, "mxfp4", global_scale="manual")
    with pytest.raises(ValueError, match="scale_rounding must be one of"):
        jbs.quantize(x, "mxfp4", scale_rounding="floor")


# ---------------------------------------------------------------------------------------------
# 6: readable errors


@pytest.mark.parametrize("fmt", FORMATS)
def test_empty_tensors_quantize(fmt):
    block = jbs.get_format(fmt).block
    q = jbs.quantize(np.zeros((0, 2 * block), np.float32), fmt)
    assert q.shape == (0, 2 * block) and q.scales.shape == (0, 2)
    assert _values(q).shape == (0, 2 * block)
    qb = jbs.quantize(np.zeros((2, 0, block), np.float32), fmt, global_scale="per_matrix",
                      layout="blocked")
    assert qb.shape == (2, 0, block)


def test_one_dimensional_blocked_is_a_clear_error():
    x = _normal(7, (64,))
    with pytest.raises(ValueError, match=r"layout='blocked' needs .* \(at least 2 axes\)"):
        jbs.quantize(x, "mxfp4", layout="blocked")
    q = jbs.quantize(x, "mxfp4")  # plain works on one axis
    with pytest.raises(ValueError, match="blocked scale layout needs"):
        jbs.to_blocked(q)
    with pytest.raises(ValueError, match="to_blocked_scales needs plain"):
        jbs.to_blocked_scales(q.scales)


def test_global_scale_of_the_wrong_shape_names_the_operand():
    a = jbs.quantize(_normal(8, (16, 64)), "nvfp4")
    b = jbs.quantize(_normal(9, (24, 64)), "nvfp4", layout="blocked")
    bad_b = dataclasses.replace(b, global_scale=jnp.reshape(b.global_scale, (1,)))
    with pytest.raises(ValueError, match=r"b\.global_scale has shape \(1,\)"):
        jax.eval_shape(jbs.gemm, a, bad_b)
    bad_a = dataclasses.replace(a, global_scale=jnp.ones((3,), jnp.float32))
    with pytest.raises(ValueError, match=r"a\.global_scale has shape \(3,\)"):
        jax.eval_shape(jbs.gemm, bad_a, b)


def _sm_operands(fmt="mxfp8_e4m3", b=2, m=8, n=16, k=64):
    a = jbs.quantize(_normal(10, (b, m, k)), fmt)
    w = jbs.quantize(_normal(11, (b, n, k)), fmt)
    return a.data, w.data, a.scales, w.scales


@pytest.mark.parametrize("edit,match", [
    (lambda l, r, ls, rs: (l, r, ls, rs[:, :8]), r"rhs_scales has shape \(2, 8, 2\)"),
    (lambda l, r, ls, rs: (l, r, ls[:, :, jnp.array([0, 1, 1])], rs),
     r"lhs has K=64, which the last axis of lhs_scales \(3\)"),
    (lambda l, r, ls, rs: (l, r, ls, rs.astype(jnp.float8_e4m3fn)), "rhs / rhs_scales: no "
                                                                    "block-scaled format"),
    (lambda l, r, ls, rs: (l, r[:, :, :32], ls, rs[:, :, :1]), "lhs and rhs must agree on K"),
    (lambda l, r, ls, rs: (l, r[:1], ls, rs[:1]), "same batch size"),
    (lambda l, r, ls, rs: (l, r, ls, rs[0]), "rhs_scales must be rank 3"),
])
def test_scaled_matmul_errors_name_its_arguments(edit, match):
    args = edit(*_sm_operands())
    with pytest.raises(ValueError, match=match):
        jax.eval_shape(jbs.scaled_matmul, *args)


# ---------------------------------------------------------------------------------------------
# 7: hand-built BlockScaled values are validated


def test_fp6_codes_above_63_are_refused_or_nan():
    q = jbs.quantize(_normal(12, (4, 64)), "mxfp6_e2m3")
    bad = dataclasses.replace(q, data=q.data.at[1, 3].set(64 + 5))
    with pytest.raises(ValueError, match="q holds FP6 codes up to 69"):
        jbs.dequantize(bad)
    with pytest.raises(ValueError, match="b holds FP6 codes"):
        jbs.gemm(jnp.ones((2, 64), jnp.bfloat16), bad)
    # inside jit the values cannot be read: the bad code decodes to NaN, not to code 5
    got = np.asarray(jax.jit(jbs.dequantize)(bad))
    assert np.isnan(got[1, 3]) and np.isfinite(np.delete(got.ravel(), 1 * 64 + 3)).all()


def test_global_scale_on_an_mx_tensor_is_refused():
    q = jbs.quantize(_normal(13, (4, 32)), "mxfp4")
    bad = dataclasses.replace(q, global_scale=jnp.float32(2.0))
    with pytest.raises(ValueError, match="q is mxfp4, which has no global scale"):
        jbs.dequantize(bad)
    with pytest.raises(ValueError, match="b is mxfp4, which has no global scale"):
        jax.eval_shape(jbs.gemm, jnp.ones((2, 32), jnp.bfloat16), bad)


@pytest.mark.parametrize("dtype", [jnp.int32, jnp.int8, jnp.uint8, jnp.bool_])
def test_dequantize_to_an_integer_dtype_is_refused(dtype):
    q = jbs.quantize(_normal(14, (4, 32)), "mxfp8_e4m3")
    with pytest.raises(TypeError, match="would truncate"):
        jbs.dequantize(q, dtype)


def test_hand_built_inconsistent_tensors():
    q = jbs.quantize(_normal(15, (40, 64)), "nvfp4", layout="blocked")
    with pytest.raises(ValueError, match=r"q scales has shape .* must have shape \(1, 1, 32"):
        jbs.dequantize(dataclasses.replace(q, scales=q.scales[:, :, :16]))
    with pytest.raises(ValueError, match="q layout must be one of"):
        jbs.dequantize(dataclasses.replace(q, layout="swizzled"))
    with pytest.raises(ValueError, match="q: unknown block-scaled format"):
        jbs.dequantize(dataclasses.replace(q, fmt="nvfp5"))
    with pytest.raises(TypeError, match="q holds uint8 elements"):
        jbs.dequantize(dataclasses.replace(q, data=q.packed_data()))
    with pytest.raises(ValueError, match="q.global_scale must be finite and positive"):
        jbs.dequantize(dataclasses.replace(q, global_scale=jnp.float32(-1.0)))


# ---------------------------------------------------------------------------------------------
# 8: subnormal scales


@pytest.mark.parametrize("fmt", MX)
def test_smallest_e8m0_scale_is_not_flushed(fmt):
    """Scale code 0 is 2^-127, an f32 subnormal that XLA's CPU code reads as 0; an element times
    it is still right wherever the product is a normal number."""
    f = jbs.get_format(fmt)
    x = _normal(16, (2, 64))
    q = jbs.quantize(x, fmt)
    zero_code = np.zeros(q.scales.shape, np.uint8).view(ml_dtypes.float8_e8m0fnu)
    q0 = dataclasses.replace(q, scales=jnp.asarray(zero_code))
    elems = oracle.decode_elements(q0.data, fmt)
    want = elems * 2.0 ** -127
    normal = np.abs(want) >= np.finfo(np.float32).tiny  # a subnormal result still flushes
    assert normal.any() or f.elem_max < 2  # fp4 / fp6 elements reach 2 and above
    got = _values(q0)
    np.testing.assert_array_equal(got[normal], want[normal])
    np.testing.assert_array_equal(got[~normal & (want == 0)], 0.0)
    # and the same through gemm (weight-only), against the float64 oracle; activations of 1e20
    # keep the products and partial sums normal numbers
    a = _normal(17, (3, 64), 1e20)
    y = np.asarray(jbs.gemm(jnp.asarray(a), q0, out_dtype=jnp.float32), np.float64)
    ref = oracle.gemm(a.astype(np.float64), np.where(normal, want, 0.0))
    np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())


@pytest.mark.parametrize("fmt", MX)
def test_tiny_blocks_quantize_to_the_smallest_scale(fmt):
    """Blocks with amax near 2^-120 land on e8m0's smallest code and come back right."""
    x = (_normal(18, (2, 32)) * 2.0 ** -120).astype(np.float32)
    got = _values(jbs.quantize(x, fmt))
    x = x.astype(np.float64)  # (squares of 2^-120 underflow in f32)
    rel = np.linalg.norm(got - x) / np.linalg.norm(x)
    assert rel < {"mxfp4": 0.3, "mxfp6_e2m3": 0.1, "mxfp6_e3m2": 0.15, "mxfp8_e4m3": 0.1,
                  "mxfp8_e5m2": 0.15}[fmt], rel
