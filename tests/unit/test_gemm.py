"""gemm (reference backend) against the float64 oracle of the dequantized operands."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import jax_blockscale as jbs
import oracle

PAIRS = jbs.supported_pairs()
TOL = 1e-5  # relative Frobenius error, f32 output


def rel_err(got, want):
    got = np.asarray(got, np.float64)
    return np.linalg.norm(got - want) / np.linalg.norm(want)


def quantized(seed, shape, fmt, layout="plain"):
    x = np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
    return jbs.quantize(x, fmt, layout=layout)


def oracle_values(q):
    if not isinstance(q, jbs.BlockScaled):
        return np.asarray(q, np.float64)
    return oracle.dequantize(q.data, q.scales, q.fmt, q.global_scale, q.layout)


def oracle_gemm(a, b):
    return oracle.gemm(oracle_values(a), oracle_values(b))


jit_gemm = jax.jit(jbs.gemm, static_argnames=("out_dtype", "backend"))


@pytest.mark.parametrize("fmt_a,fmt_b", PAIRS)
def test_every_pair_matches_oracle(fmt_a, fmt_b):
    k = 4 * max(jbs.get_format(fmt_a).block, jbs.get_format(fmt_b).block)
    a = quantized(1, (33, k), fmt_a)
    b = quantized(2, (47, k), fmt_b, "blocked")
    y = jit_gemm(a, b, out_dtype=jnp.float32)
    assert y.shape == (33, 47) and y.dtype == jnp.float32
    assert rel_err(y, oracle_gemm(a, b)) < TOL


@pytest.mark.parametrize("fmt_b", list(jbs.FORMATS))
@pytest.mark.parametrize("act_dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
def test_weight_only_matches_oracle(fmt_b, act_dtype):
    x = jnp.asarray(np.random.default_rng(3).standard_normal((17, 64)), act_dtype)
    w = quantized(4, (40, 64), fmt_b, "blocked")
    y = jit_gemm(x, w, out_dtype=jnp.float32)
    assert rel_err(y, oracle_gemm(x, w)) < TOL


@pytest.mark.parametrize("out_dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
def test_out_dtypes(out_dtype):
    a, b = quantized(5, (20, 64), "nvfp4"), quantized(6, (24, 64), "nvfp4", "blocked")
    y = jit_gemm(a, b, out_dtype=out_dtype)
    assert y.dtype == out_dtype
    eps = float(jnp.finfo(out_dtype).eps)
    assert rel_err(y.astype(jnp.float32), oracle_gemm(a, b)) < max(TOL, eps)


def test_default_out_dtype_is_bf16_and_global_scales_apply_once():
    a, b = quantized(7, (8, 32), "nvfp4"), quantized(8, (8, 32), "nvfp4")
    assert a.global_scale is not None and b.global_scale is not None
    assert jbs.gemm(a, b).dtype == jnp.bfloat16
    assert rel_err(jbs.gemm(a, b, out_dtype=jnp.float32), oracle_gemm(a, b)) < TOL


@st.composite
def problems(draw):
    fmt_a, fmt_b = draw(st.sampled_from(PAIRS + [(None, f) for f in jbs.FORMATS]))
    block = max(jbs.get_format(f).block for f in (fmt_a, fmt_b) if f)
    m, n = draw(st.integers(1, 70)), draw(st.integers(1, 70))
    k = block * draw(st.integers(1, 6))
    batch_a, batch_b = draw(st.sampled_from([((), ()), ((2,), (2,)), ((3,), ()), ((), (2,)),
                                             ((2, 1), (3,)), ((2, 3), (2, 3))]))
    layouts = draw(st.sampled_from(["plain", "blocked"])), draw(st.sampled_from(["plain",
                                                                                 "blocked"]))
    return fmt_a, fmt_b, batch_a + (m, k), batch_b + (n, k), layouts, draw(st.integers(0, 2**31))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems())
def test_random_problems_match_oracle(problem):
    fmt_a, fmt_b, shape_a, shape_b, (layout_a, layout_b), seed = problem
    a = (quantized(seed, shape_a, fmt_a, layout_a) if fmt_a else
         jnp.asarray(np.random.default_rng(seed).standard_normal(shape_a), jnp.bfloat16))
    b = quantized(seed + 1, shape_b, fmt_b, layout_b)
    y = jit_gemm(a, b, out_dtype=jnp.float32)
    want = oracle_gemm(a, b)
    assert y.shape == want.shape
    assert rel_err(y, want) < TOL


def test_scaled_matmul_matches_gemm_semantics():
    rng = np.random.default_rng(9)
    for fmt in ("nvfp4", "mxfp4", "mxfp8_e4m3", "mxfp8_e5m2"):
        a = jbs.quantize(rng.standard_normal((2, 16, 64)).astype(np.float32), fmt,
                         global_scale=None)
        b = jbs.quantize(rng.standard_normal((2, 24, 64)).astype(np.float32), fmt,
                         global_scale=None)
        y = jbs.scaled_matmul(a.data, b.data, a.scales, b.scales,
                              preferred_element_type=jnp.float32)
        assert y.shape == (2, 16, 24)
        assert rel_err(y, oracle_gemm(a, b)) < TOL
    with pytest.raises(ValueError, match="rank 3"):
        jbs.scaled_matmul(a.data[0], b.data[0], a.scales[0], b.scales[0])
    with pytest.raises(ValueError, match="no block-scaled format"):
        jbs.scaled_matmul(a.data, b.data, a.scales[..., :1], b.scales[..., :1])


def _gemm_params(a, b, **kw):
    (eqn,) = [e for e in jax.make_jaxpr(lambda a, b: jbs.gemm(a, b, **kw))(a, b).eqns
              if e.primitive is jbs.gemm_p]
    return eqn.params


def _dot_types(f, *args):
    """Result element types of the dot_generals in f's CUDA lowering."""
    text = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    return [line.rsplit("x", 1)[-1].rstrip(">") for line in text.splitlines()
            if "stablehlo.dot_general" in line]


def _reference_dot_types(a, b, out_dtype):
    """... of the reference backend."""
    return _dot_types(lambda a, b: jbs.gemm(a, b, out_dtype=out_dtype, backend="reference"), a, b)


def _large_m_dot_types(a, b, out_dtype):
    """... of the dequantize + dot that the sm90 backend lowers large M to (`reference_gemm`
    with allow_direct_output), with bf16 operands as there."""
    from jax_blockscale.lowering.reference import reference_gemm
    from jax_blockscale.dense.primitive import gemm_spec

    def f(a, b):
        a_elems, sa = (a.data, a.scales) if isinstance(a, jbs.BlockScaled) else (a, None)
        args = (a_elems, b.data) + (() if sa is None else (sa,)) + (b.scales, jnp.float32(1))
        no_global_scale = all(not isinstance(q, jbs.BlockScaled) or q.global_scale is None
                              for q in (a, b))
        spec = gemm_spec([jax.typeof(x) for x in args],
                         fmt_a=getattr(a, "fmt", None), fmt_b=b.fmt,
                         layout_a=getattr(a, "layout", None), layout_b=b.layout,
                         out_dtype=np.dtype(out_dtype), alpha_is_one=no_global_scale)
        return reference_gemm(a_elems, b.data, sa, b.scales, jnp.float32(1), spec=spec,
                              compute_dtype=jnp.bfloat16, allow_direct_output=True)
    return _dot_types(f, a, b)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4", "mxfp8_e4m3"])
def test_gemm_rounds_in_the_dot_only_without_global_scales(fmt):
    """With no global scale (alpha == 1) the sm90 backend's large-M lowering lets the bf16 GEMM
    round its f32 accumulators itself (no f32 M x N round trip); with one, alpha must scale the
    f32 result before the one rounding, so reference_gemm's dot stays f32 (the sm90 backend runs
    the dot_alpha target there when it can: tests/test_dot_alpha.py). So do small outputs (the
    GEMM may add bf16 partials there) and the reference backend, always."""
    from jax_blockscale.lowering.reference import DIRECT_OUTPUT_MIN_OUTPUTS

    rng = np.random.default_rng(10)
    x = rng.standard_normal((2048, 64)).astype(np.float32)
    w = rng.standard_normal((2048, 64)).astype(np.float32)
    assert 2048 * 2048 >= DIRECT_OUTPUT_MIN_OUTPUTS
    a, b = jbs.quantize(x, fmt, global_scale=None), jbs.quantize(w, fmt, global_scale=None)
    act = jnp.asarray(x, jnp.bfloat16)
    assert _gemm_params(a, b)["alpha_is_one"] and _gemm_params(act, b)["alpha_is_one"]
    assert _large_m_dot_types(a, b, jnp.bfloat16) == ["bf16"]
    assert _large_m_dot_types(act, b, jnp.bfloat16) == ["bf16"]
    assert _large_m_dot_types(a, b, jnp.float32) == ["f32"]
    assert _large_m_dot_types(a, b, jnp.float16) == ["f32"]  # bf16 operands, f16 out: f32 dot
    small_a = jbs.quantize(x[:24], fmt, global_scale=None)
    assert _large_m_dot_types(small_a, b, jnp.bfloat16) == ["f32"]  # 24 x 2048 outputs
    assert _reference_dot_types(a, b, jnp.bfloat16) == ["f32"]
    assert _reference_dot_types(act, b, jnp.bfloat16) == ["f32"]
    if fmt == "nvfp4":
        scaled = jbs.quantize(w, fmt)  # "auto" global scale
        assert not _gemm_params(a, scaled)["alpha_is_one"]
        assert _large_m_dot_types(a, scaled, jnp.bfloat16) == ["f32"]
        assert _large_m_dot_types(act, scaled, jnp.bfloat16) == ["f32"]


def test_alpha_tangent_drops_the_unit_alpha_promise():
    """d/d(global scale) binds gemm with the tangent as alpha: it must not claim alpha == 1."""
    x = jnp.asarray(np.random.default_rng(12).standard_normal((8, 32)), jnp.float32)
    q = jbs.quantize(np.random.default_rng(13).standard_normal((16, 32)).astype(np.float32),
                     "nvfp4")

    def f(g):
        w = jbs.BlockScaled(q.data, q.scales, g, q.fmt, q.layout)
        return jbs.gemm(x, w, out_dtype=jnp.float32).sum()

    g0 = jnp.float32(q.global_scale)
    jaxpr = jax.make_jaxpr(jax.jvp, static_argnums=0)(f, (g0,), (jnp.float32(1.0),))
    params = [e.params for e in jaxpr.eqns if e.primitive is jbs.gemm_p]
    assert params and not any(p["alpha_is_one"] for p in params)
    _, tangent = jax.jvp(f, (g0,), (jnp.float32(1.0),))
    np.testing.assert_allclose(float(tangent), float(f(g0)) / float(g0), rtol=1e-5)
