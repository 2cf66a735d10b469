"""`gemm(x, w, quantize_a="nvfp4")` on a Hopper GPU (skipped without one): where gemm runs the
quantized problem on the decode kernel, the activation is quantized in the GEMM's own call
(target jax_blockscale_quantized_act_gemm_sm90), and the result equals
``gemm(jbs.quantize(x, "nvfp4"), w)`` bit for bit: the kernel's amax, block scales, elements and
alpha are those of jbs.quantize, and the same decode plan multiplies them.

Fresh random data every check (never zeros), the allocator filled with NaN first (an unwritten
output shows up); values spread over many magnitudes so that block scales, ties and the e2m1
rounding all vary; NaN, Inf, zero blocks, tiny and huge tensors.
"""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import jax
import jax.numpy as jnp
from jax import lax

import jax_blockscale as jbs
from jax_blockscale.catalog import sm90 as cat
from hopper import needs_sm90, poison  # tests/support/hopper.py

pytestmark = [pytest.mark.gpu, needs_sm90]

FUSED = "jax_blockscale_quantized_act_gemm_sm90"
_seed = [7000]


def _rng():
    _seed[0] += 1
    return np.random.default_rng(_seed[0])


def _activation(m, k, rng, spread=3.0):
    """bf16 values whose magnitudes vary per block (log-uniform over `spread` decades)."""
    base = rng.standard_normal((m, k))
    block_mag = 10.0 ** rng.uniform(-spread / 2, spread / 2, size=(m, k // 16, 1))
    return (base.reshape(m, k // 16, 16) * block_mag).reshape(m, k).astype(np.float32)


def _weight(n, k, rng, global_scale="per_matrix"):
    w = rng.standard_normal((n, k)).astype(np.float32) / np.sqrt(k)
    return jbs.quantize(w, "nvfp4", global_scale=global_scale, layout="blocked")


def _fused(out_dtype=jnp.bfloat16):
    return jax.jit(lambda x, w: jbs.gemm(x, w, quantize_a="nvfp4", out_dtype=out_dtype))


def _composed(out_dtype=jnp.bfloat16):
    return jax.jit(lambda x, w: jbs.gemm(jbs.quantize(x, "nvfp4"), w, out_dtype=out_dtype))


def _targets(f, *args):
    return {t for t in (FUSED, "jax_blockscale_gemm_sm90")
            if t in f.lower(*args).compile().as_text()}


def _check(x, w, out_dtype=jnp.bfloat16, fused=True):
    x = jnp.asarray(x, jnp.bfloat16)
    f = _fused(out_dtype)
    assert (FUSED in _targets(f, x, w)) == fused
    poison()
    got = np.asarray(f(x, w).astype(jnp.float32))
    want = np.asarray(_composed(out_dtype)(x, w).astype(jnp.float32))
    np.testing.assert_array_equal(got, want)  # NaN where NaN, every other bit equal
    return got


# the quantizer on one CTA up to 2,048 blocks (8 x 4096 would be its limit); past it the amax
# kernel and the one-block-per-thread kernel (16 x 4096, 1 x 65536, 3 x 21856 with a partial
# last amax CTA, 16 x 16384, 32 x 8192, 32 x 16384; 20 x 4096 on the 32-row variant's 24-row
# loop, 32 x 8192 on its whole one); from 33 rows the register-weight kernel
# reading the activation dequantized in its K order (64 x 4096 x 14336 with split K, 64 x 28672
# x 4096, 40 x 1000 x 2048 a partial tile, 128 x 512 x 8192)
@pytest.mark.parametrize("m,n,k", [(1, 6144, 4096), (1, 4096, 14336), (2, 512, 2048),
                                   (7, 1000, 1024), (16, 3072, 4096), (16, 4096, 16384),
                                   (5, 256, 64), (32, 512, 8192), (1, 256, 65536),
                                   (3, 256, 21856), (32, 4096, 16384), (64, 4096, 14336),
                                   (64, 28672, 4096), (40, 1000, 2048), (128, 512, 8192),
                                   (20, 3072, 4096)])
def test_equals_quantize_then_gemm(m, n, k):
    rng = _rng()
    x, w = _activation(m, k, rng), _weight(n, k, rng)
    got = _check(x, w, jnp.float32)
    ref = np.asarray(jbs.gemm(jbs.quantize(jnp.asarray(x, jnp.bfloat16), "nvfp4"), w,
                              out_dtype=jnp.float32, backend="reference"))
    err = np.linalg.norm(got - ref) / np.linalg.norm(ref)
    assert err < 1e-5, err  # the same quantized values; only the f32 summation order differs


def test_bf16_output_and_weights_without_global_scale():
    rng = _rng()
    x = _activation(3, 2048, rng)
    _check(x, _weight(768, 2048, rng), jnp.bfloat16)
    _check(x, _weight(768, 2048, rng, global_scale=None), jnp.bfloat16)


@pytest.mark.parametrize("m,k", [(4, 1024), (16, 4096), (48, 1024)])
def test_non_finite_values_stay_in_their_block(m, k):
    rng = _rng()
    x = _activation(m, k, rng)
    x[0, 5] = np.nan  # block 0 of row 0
    x[1, 40] = np.inf  # block 2 of row 1
    x[2, 100] = -np.inf
    x[3:, 16:32] = 0.0  # a zero block
    got = _check(x, _weight(256, k, rng), jnp.float32)
    assert np.isnan(got[:3]).all() and np.isfinite(got[3:]).all()


@pytest.mark.parametrize("m,k", [(2, 512), (16, 4096), (64, 1024)])
@pytest.mark.parametrize("scale", [0.0, 1e-30, 1e-38, 3e38])
def test_extreme_tensors(scale, m, k):
    """All zeros (enc = 1), tiny tensors (enc clamped to 2^126, scales underflow, the dividing
    path) and huge ones: the kernel's arithmetic follows jbs.quantize's in every case, on one
    CTA (2 x 512), behind the amax kernel (16 x 4096) and K-ordered (64 x 1024)."""
    rng = _rng()
    x = _activation(m, k, rng, spread=1.0) * scale
    if scale == 0.0:
        x[:] = 0.0
    _check(x, _weight(384, k, rng), jnp.float32)


def test_mixed_magnitudes_reach_every_scale_and_tie():
    """Blocks whose values sit exactly on e2m1 midpoints after scaling (ties to even), blocks
    with scales that round, and blocks across 12 decades."""
    rng = _rng()
    m, k = 8, 2048
    x = _activation(m, k, rng, spread=12.0)
    ties = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0] * 2, np.float32)
    x[0, :16] = ties * rng.choice([-1, 1], 16)  # amax 6: scale e4m3(1 * enc)
    x[1, :16] = ties / 6.0 * 448.0
    _check(x, _weight(640, k, rng), jnp.float32)


def test_every_e2m1_midpoint_and_its_bf16_neighbours():
    """The tensor's amax and each block's are 6, so enc = 448, every scale is 448 and the
    elements are quantized unscaled: each block holds one e2m1 midpoint and the two bf16 values
    on either side of it, both signs, so every rounding boundary of the kernel's e2m1
    conversion is crossed."""
    rng = _rng()
    m, k = 2, 512
    x = rng.uniform(-6.0, 6.0, (m, k)).astype(np.float32)
    x[0, 0] = 6.0
    for b, mid in enumerate([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]):
        bits = np.array(mid, ml_dtypes.bfloat16).view(np.uint16)
        near = (bits + np.arange(-2, 3, dtype=np.int16).view(np.uint16)).view(ml_dtypes.bfloat16)
        near = near.astype(np.float32)
        x[1, 16 * b:16 * b + 16] = np.concatenate([[6.0], near, -near, [-6.0] * 5])
    _check(x, _weight(512, k, rng), jnp.float32)


@pytest.mark.parametrize("m,k", [(16, 4096), (3, 21856), (64, 4096)])
@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_the_amax_from_any_partial(m, k, where):
    """Past one CTA the tensor's amax is reduced from one partial per 256 blocks: put the
    largest value in the first, a middle or the last partial's blocks (3 x 21856: a last one
    of 2 blocks), each time the only value that sets the global scale."""
    rng = _rng()
    x = _activation(m, k, rng, spread=1.0)
    blocks = m * k // 16
    assert blocks > cat.QUANTIZE_A_CTA_ELEMENTS // 16
    block = {"first": 3, "middle": blocks // 2 + 5, "last": blocks - 1}[where]
    x.reshape(-1)[16 * block + 7] = 100.0 * np.abs(x).max()
    _check(x, _weight(512, k, rng), jnp.float32)


@pytest.mark.parametrize("m", [1, 16, 64])
def test_in_a_loop_with_changing_activations(m):
    """Repeated calls in one program (as in a decoder step) each see their own activation (and
    their own partial amaxes: 16 and 64 rows)."""
    rng = _rng()
    xs = jnp.asarray(_activation(6 * m, 4096, rng).reshape(6, m, 4096), jnp.bfloat16)
    w = _weight(1024, 4096, rng)

    def run(quantized_in_call):
        def body(acc, x):
            a = x + (0 * acc.sum()).astype(x.dtype)  # depends on the carry
            y = (jbs.gemm(a, w, quantize_a="nvfp4", out_dtype=jnp.float32) if quantized_in_call
                 else jbs.gemm(jbs.quantize(a, "nvfp4"), w, out_dtype=jnp.float32))
            return acc + y[:, :1024], y
        return jax.jit(lambda xs: lax.scan(body, jnp.zeros((m, 1024), jnp.float32), xs))(xs)

    (acc1, ys1), (acc2, ys2) = run(True), run(False)
    np.testing.assert_array_equal(np.asarray(ys1), np.asarray(ys2))
    np.testing.assert_array_equal(np.asarray(acc1), np.asarray(acc2))


# ---- a given global scale (static W4A4: gemm(x, w, quantize_a="nvfp4", a_global_scale=g)) ----

def _check_given(x, w, g, out_dtype=jnp.float32, traced=True, fused=True):
    """The fused call against gemm(quantize(x, "nvfp4", global_scale=g), w), bit for bit; g an
    argument of the jitted function (traced) or a constant in it (jbs.quantize keeps XLA from
    folding 1 / g on the host then)."""
    x = jnp.asarray(x, jnp.bfloat16)
    g32 = jnp.float32(g)

    def fused_fn(x, w, g):
        return jbs.gemm(x, w, quantize_a="nvfp4", a_global_scale=g, out_dtype=out_dtype)

    def composed_fn(x, w, g):
        return jbs.gemm(jbs.quantize(x, "nvfp4", global_scale=g), w, out_dtype=out_dtype)

    if traced:
        f, c, args = jax.jit(fused_fn), jax.jit(composed_fn), (x, w, g32)
    else:
        f = jax.jit(lambda x, w: fused_fn(x, w, g32))
        c = jax.jit(lambda x, w: composed_fn(x, w, g32))
        args = (x, w)
    assert (FUSED in _targets(f, *args)) == fused
    poison()
    got = np.asarray(f(*args).astype(jnp.float32))
    np.testing.assert_array_equal(got, np.asarray(c(*args).astype(jnp.float32)))
    return got


# small and large (32 x 16384, 24 x 12288); from 33 rows the register-weight kernel reads the
# activation dequantized in its K order (64 x 4096 x 14336 with split K, 40 x 1000 x 2048 a
# partial tile, 128 x 512 x 8192)
@pytest.mark.parametrize("m,n,k", [(1, 6144, 4096), (16, 4096, 14336), (7, 1000, 1024),
                                   (5, 256, 64), (32, 4096, 16384), (24, 768, 12288),
                                   (3, 256, 21856), (64, 4096, 14336), (64, 28672, 4096),
                                   (40, 1000, 2048), (128, 512, 8192)])
def test_given_scale_equals_quantize_then_gemm(m, n, k):
    rng = _rng()
    x, w = _activation(m, k, rng), _weight(n, k, rng)
    amax = float(np.abs(x).max())
    # the calibrated scale, one 4x too small (the largest blocks saturate) and one 8x too large
    for g in (amax / 2688, amax / 2688 / 4, amax / 2688 * 8):
        got = _check_given(x, w, g)
        ref = np.asarray(jbs.gemm(jbs.quantize(jnp.asarray(x, jnp.bfloat16), "nvfp4",
                                               global_scale=g), w, out_dtype=jnp.float32,
                                  backend="reference"))
        err = np.linalg.norm(got - ref) / np.linalg.norm(ref)
        assert err < 1e-5, (g, err)


@pytest.mark.parametrize("m", [3, 64])
@pytest.mark.parametrize("g", [1.0, 3e-4, 1e-30, 2.5e34])
def test_given_scale_as_a_constant_and_extreme(g, m):
    """A decode factor written into the program (a constant XLA could fold), and ones that
    make every scale saturate or underflow (the dividing path), bf16 output; decode kernel (3
    rows) and register-weight kernel (64)."""
    rng = _rng()
    x, w = _activation(m, 2048, rng), _weight(768, 2048, rng)
    _check_given(x, w, g, jnp.bfloat16, traced=False)
    _check_given(x, w, g, jnp.bfloat16, traced=True)


@pytest.mark.parametrize("m", [4, 48])
def test_given_scale_non_finite_values_stay_in_their_block(m):
    rng = _rng()
    x = _activation(m, 1024, rng)
    x[0, 5], x[1, 40], x[2, 100] = np.nan, np.inf, -np.inf
    x[3:, 16:32] = 0.0
    x[3:, 33] = -0.0
    w = _weight(256, 1024, rng, global_scale=None)
    got = _check_given(x, w, float(np.nanmax(np.abs(x[3]))) / 2688)
    assert np.isnan(got[:3]).all() and np.isfinite(got[3:]).all()


def test_given_scale_k_order_against_the_float64_oracle():
    """The register-weight path's activation order checked independently of the composition:
    the fused call against a float64 NumPy product of the dequantized operands."""
    rng = _rng()
    m, n, k = 64, 256, 1024
    x, w = _activation(m, k, rng, spread=1.0), _weight(n, k, rng)
    g = float(np.abs(x).max()) / 2688
    got = _check_given(x, w, g)
    xq = jbs.quantize(jnp.asarray(x, jnp.bfloat16), "nvfp4", global_scale=g)
    a64 = np.asarray(jbs.dequantize(xq, jnp.float32), np.float64)
    w64 = np.asarray(jbs.dequantize(w, jnp.float32), np.float64)
    want = a64 @ w64.T
    err = np.linalg.norm(got - want) / np.linalg.norm(want)
    assert err < 1e-5, err


def test_given_scale_per_layer_in_a_loop():
    """A decoder-like loop: each step's activation quantized with that step's own scale."""
    rng = _rng()
    xs = jnp.asarray(_activation(4 * 2, 4096, rng).reshape(4, 2, 4096), jnp.bfloat16)
    gs = jnp.asarray(rng.uniform(1e-4, 1e-2, 4), jnp.float32)
    w = _weight(1024, 4096, rng)

    def run(fused):
        def body(acc, xg):
            x, g = xg
            a = x + (0 * acc.sum()).astype(x.dtype)
            y = (jbs.gemm(a, w, quantize_a="nvfp4", a_global_scale=g, out_dtype=jnp.float32)
                 if fused else jbs.gemm(jbs.quantize(a, "nvfp4", global_scale=g), w,
                                        out_dtype=jnp.float32))
            return acc + y[:, :1024], y
        return jax.jit(lambda xs, gs: lax.scan(body, jnp.zeros((2, 1024), jnp.float32),
                                               (xs, gs)))(xs, gs)

    (acc1, ys1), (acc2, ys2) = run(True), run(False)
    np.testing.assert_array_equal(np.asarray(ys1), np.asarray(ys2))
    np.testing.assert_array_equal(np.asarray(acc1), np.asarray(acc2))


@pytest.mark.memcheck
def test_fused_calls_pass_memcheck():
    """The quantizer (one CTA, the amax kernel and the one-block-per-thread kernel, a given
    scale, K-ordered), jbs.quantize's own target and the chained decode kernel (one K range
    and split K) under compute-sanitizer's memcheck: no out-of-bounds access or launch error,
    and each call still equals the XLA composition
    (tests/support/quantized_activation_calls_for_memcheck.py)."""
    from sanitizer import run_under_memcheck  # tests/support/sanitizer.py

    out = run_under_memcheck("quantized_activation_calls_for_memcheck.py")
    calls = [ln for ln in out.splitlines() if ln.startswith("call ")]
    assert len(calls) == 12, out[-2000:]
    assert all("fused=True equal=True" in ln for ln in calls), calls


# ---- jbs.quantize(x, "nvfp4") of a bf16 activation on the quantizer kernels alone ----

QUANTIZE = "jax_blockscale_quantize_nvfp4_sm90"


def _check_quantize(x, global_scale="auto"):
    """jbs.quantize on the quantizer target against quantize.py's XLA computation
    (_quantize_nvfp4, jitted on this GPU), bit for bit: elements, scales, decode factor."""
    from jax_blockscale.core.formats import get_format
    from jax_blockscale.core.quantize import _quantize_nvfp4

    x = jnp.asarray(x, jnp.bfloat16)
    f = jax.jit(lambda x: jbs.quantize(x, "nvfp4", global_scale=global_scale))
    assert QUANTIZE in f.lower(x).compile().as_text()
    xla = jax.jit(lambda x: _quantize_nvfp4(x, get_format("nvfp4"), global_scale))
    poison()
    q = f(x)
    data, scales, g = xla(x)
    bits = lambda a: np.asarray(jax.lax.bitcast_convert_type(a, jnp.uint8))  # noqa: E731
    np.testing.assert_array_equal(bits(q.scales), bits(scales))
    np.testing.assert_array_equal(np.asarray(q.data.astype(jnp.float32)),
                                  np.asarray(data.astype(jnp.float32)))
    assert np.float32(q.global_scale).tobytes() == np.float32(g).tobytes()
    return q


# one CTA (1 x 4096, 2 x 3 x 64 folded), the amax kernel and one block per thread past it
# (16 x 14336, 3 x 21856 with a partial last amax CTA, 64 x 4096, 256 x 4096)
@pytest.mark.parametrize("shape", [(1, 4096), (2, 3, 64), (16, 14336), (3, 21856), (64, 4096),
                                   (256, 4096), (1, 16)])
def test_quantize_on_the_kernels_equals_xla(shape):
    rng = _rng()
    x = _activation(int(np.prod(shape[:-1])), shape[-1], rng).reshape(shape)
    q = _check_quantize(x)
    amax = float(np.abs(np.asarray(jnp.asarray(x, jnp.bfloat16), np.float32)).max())
    _check_quantize(x, amax / 2688 / 4)  # a given scale, the largest blocks saturating
    # and against the float64 oracle: within NVFP4's rounding of x. Each value: half the e2m1
    # spacing (at most one block scale, amax / 6 rounded to e4m3) plus the saturation the scale's
    # rounding can cause, together under a quarter of its block's largest magnitude
    back = np.asarray(jbs.dequantize(q, jnp.float32), np.float64).reshape(-1, 16)
    xs = np.asarray(jnp.asarray(x, jnp.bfloat16), np.float64).reshape(-1, 16)
    assert np.all(np.abs(back - xs) <= 0.25 * np.abs(xs).max(axis=1, keepdims=True))
    if len(xs) >= 64:  # over many blocks, the error's norm too (one block's varies too much)
        assert np.linalg.norm(back - xs) / np.linalg.norm(xs) < 0.12


@pytest.mark.parametrize("m,k", [(2, 512), (16, 4096)])
def test_quantize_on_the_kernels_extremes_and_non_finite(m, k):
    rng = _rng()
    for scale in (0.0, 1e-30, 3e38):
        x = _activation(m, k, rng, spread=1.0) * scale
        _check_quantize(x)
    x = _activation(m, k, rng)
    x[0, 5], x[1, 40] = np.nan, -np.inf
    q = _check_quantize(x)
    assert np.isnan(np.asarray(jbs.dequantize(q))[:2]).any()


@pytest.mark.parametrize("m", [1, 16, 64])
@pytest.mark.parametrize("given", [False, True])
def test_scanned_layers_alpha_from_the_quantizer(m, given):
    """gemm(x, w_stack, quantize_a="nvfp4", layer=i) in a scan over the layers: the quantizer
    target writes each layer's alpha (a's decode factor times the stack's global scales) that
    the layer target reads; equal bit for bit to the written-out composition
    gemm(jbs.quantize(x), w_stack, layer=i), whose alpha XLA multiplies."""
    rng = _rng()
    layers, n, k = 3, 1024, 4096
    w = rng.standard_normal((layers, n, k)).astype(np.float32) / np.sqrt(k)
    stack = jbs.quantize(w, "nvfp4", global_scale="per_matrix", layout="blocked")
    xs = jnp.asarray(_activation(layers * m, k, rng).reshape(layers, m, k), jnp.bfloat16)
    g = jnp.float32(float(np.abs(np.asarray(xs, np.float32)).max()) / 2688) if given else None

    def run(fused):
        def body(i, x):
            gs = "auto" if g is None else g
            y = (jbs.gemm(x, stack, quantize_a="nvfp4", a_global_scale=g, layer=i,
                          out_dtype=jnp.float32) if fused else
                 jbs.gemm(jbs.quantize(x, "nvfp4", global_scale=gs), stack, layer=i,
                          out_dtype=jnp.float32))
            return i + 1, y
        return jax.jit(lambda xs: lax.scan(body, jnp.int32(0), xs)[1])

    fused, composed = run(True), run(False)
    assert QUANTIZE in fused.lower(xs).compile().as_text()
    poison()
    np.testing.assert_array_equal(np.asarray(fused(xs)), np.asarray(composed(xs)))
