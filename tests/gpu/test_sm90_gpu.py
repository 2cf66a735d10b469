"""The sm90 backend on a Hopper GPU equals the reference backend (skipped without one).

Every check draws fresh random data (never zeros), fills the allocator with NaN first so an
unwritten output cannot pass by reusing an earlier result, and compares the relative Frobenius
error against the reference backend: < 1e-5 for f32 output (only the accumulation order
differs: dequantization to bf16 is exact), output rounding only for bf16/f16.
"""
from __future__ import annotations

import functools
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import jax
import jax.numpy as jnp

import jax_blockscale as jbs
from jax_blockscale import _plugin
from jax_blockscale.catalog import sm90 as cat
from jax_blockscale.lowering import ffi_sm90  # noqa: F401  (registers "sm90")
from jax_blockscale.lowering import plan as planner
from configure import set_env  # tests/support/configure.py
from hopper import needs_sm90, poison as _poison  # tests/support/hopper.py

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _always_the_kernel(monkeypatch):
    # exercise the custom call at every size (large M would otherwise use dequantize + dot), and
    # the two-operand fused kernel itself (by default a quantized A is dequantized first past the
    # decode kernel's rows: test_dequantized_activation covers that path)
    set_env(monkeypatch, JAX_BLOCKSCALE_SM90_MAX_ROWS="0", JAX_BLOCKSCALE_SM90_DEQUANT_A="0")


PAIRS = [
    ("nvfp4", "nvfp4"), ("mxfp4", "mxfp4"), ("mxfp8_e4m3", "mxfp8_e4m3"),
    ("mxfp8_e5m2", "mxfp8_e5m2"), ("mxfp8_e4m3", "mxfp8_e5m2"), ("mxfp8_e5m2", "mxfp8_e4m3"),
    ("mxfp8_e4m3", "mxfp4"), ("mxfp8_e5m2", "mxfp4"),
    (None, "nvfp4"), (None, "mxfp4"), (None, "mxfp8_e4m3"), (None, "mxfp8_e5m2"),
]
OUTS = {"f32": (jnp.float32, 1e-5), "bf16": (jnp.bfloat16, 8e-3), "f16": (jnp.float16, 1e-3)}
KPERM = cat.KIND_CODES["bf16_kperm"]  # a bf16 activation in the register-weight variants' K order
_seed = [1000]


def _key():
    _seed[0] += 1
    return jax.random.PRNGKey(_seed[0])


def _operands(fmt_a, fmt_b, batch_a, batch_b, m, n, k, layout="plain"):
    ka, kb, kw = jax.random.split(_key(), 3)
    x = jax.random.normal(ka, batch_a + (m, k), jnp.float32)
    w = jax.random.normal(kb, batch_b + (n, k), jnp.float32) * 0.5
    a = x.astype(jnp.bfloat16) if fmt_a is None else jbs.quantize(x, fmt_a, layout=layout)
    b = jbs.quantize(w, fmt_b, layout=layout)
    return a, b


def _rel(y, ref):
    y = np.asarray(y, np.float64)
    ref = np.asarray(ref, np.float64)
    assert np.isfinite(y).all(), "non-finite output (unwritten element?)"
    return float(np.linalg.norm(y - ref) / max(np.linalg.norm(ref), 1e-30))


def _check(a, b, out, fn=None):
    dtype, tol = OUTS[out]
    f = fn or (lambda a, b: jbs.gemm(a, b, out_dtype=dtype, backend="sm90"))
    _poison()
    y = jax.block_until_ready(f(a, b))
    ref = jbs.gemm(a, b, out_dtype=jnp.float32, backend="reference")
    assert y.dtype == dtype and y.shape == ref.shape
    err = _rel(y, ref)
    assert err < tol, f"rel err {err:.3e} >= {tol}"
    return err


@needs_sm90
@pytest.mark.parametrize("fmt_a,fmt_b", PAIRS)
@pytest.mark.parametrize("out", list(OUTS))
def test_pairs_and_outputs(fmt_a, fmt_b, out):
    a, b = _operands(fmt_a, fmt_b, (), (), 200, 136, 320)
    _check(a, b, out, jax.jit(lambda a, b: jbs.gemm(a, b, out_dtype=OUTS[out][0], backend="sm90")))


@needs_sm90
@pytest.mark.parametrize("fmt_a,fmt_b", [p for p in PAIRS if p[0] is not None])
@pytest.mark.parametrize("batch_a,m,n,k", [((), 65, 136, 320), ((), 200, 264, 96),
                                           ((2, 3), 45, 131, 160), ((), 40, 264, 512)])
def test_dequantized_activation(monkeypatch, fmt_a, fmt_b, batch_a, m, n, k):
    """The default past the decode kernel's rows, for an mxfp8 activation in its wide rows, and
    from 33 rows when K is whole 64-element k-tiles (the register-weight variants): A dequantized
    to bf16 by XLA, then a weight-only kernel (alpha, the global scales, in its epilogue)."""
    set_env(monkeypatch, JAX_BLOCKSCALE_SM90_DEQUANT_A=None)
    a, b = _operands(fmt_a, fmt_b, batch_a, (), m, n, k)
    f = jax.jit(lambda a, b: jbs.gemm(a, b, out_dtype=jnp.float32, backend="sm90"))
    calls = [ln for ln in f.lower(a, b).as_text().splitlines()
             if "custom_call @" + _plugin.SM90_TARGET in ln]
    rows = m * int(np.prod(batch_a))
    # past the decode kernel's rows; an mxfp8 activation in its wide rows; a register-weight
    # variant's rows when K is whole 64-element k-tiles (the weights' tiles here are few: 33 rows)
    device = planner.device_for("cuda")
    bf16_activation = (rows > cat.DECODE_MAX_ROWS
                       or (fmt_a.startswith("mxfp8") and rows >= cat.DECODE_DEQUANT_MXFP8_FROM)
                       or (rows >= cat.register_weight_min_rows(n, 1, device.sm_count,
                                                                cat.KIND_OF_FORMAT.get(fmt_b),
                                                                card=device.card)
                           and k % cat.K_TILE == 0))
    bf16_kinds = [str(cat.KIND_CODES[kind]) for kind in ("bf16", "bf16_kperm")]
    a_kind = next(c for c in "12345" if f"a_kind = {c} : i32" in calls[0])
    assert len(calls) == 1 and (a_kind in bf16_kinds) == bf16_activation, calls
    _check(a, b, "f32", f)
    _check(a, b, "bf16")


@needs_sm90
@pytest.mark.parametrize("fmt_a,fmt_b", [(None, "nvfp4"), (None, "mxfp8_e4m3"),
                                         ("mxfp8_e4m3", "mxfp8_e4m3"), ("mxfp4", "mxfp4")])
@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 14336)])
def test_default_plan_edges_on_this_card(monkeypatch, fmt_a, fmt_b, n, k):
    """The default plan on the GPU that runs this (its card's catalogue rules) on both sides of
    each hand-over: the decode kernel to the register-weight variants
    (register_weight_min_rows), and those to dequantize + a library GEMM (fused_max_rows), each
    call against the reference backend and lowered to the path the rules name."""
    set_env(monkeypatch, JAX_BLOCKSCALE_SM90_MAX_ROWS=None, JAX_BLOCKSCALE_SM90_DEQUANT_A=None)
    device = planner.device_for("cuda")
    kind = cat.KIND_OF_FORMAT[fmt_b]
    first = cat.register_weight_min_rows(n, 1, device.sm_count, kind, card=device.card)
    limit = cat.fused_max_rows(n, k, weight_only=fmt_a is None, register_weights=True,
                               two_operand=False, b_kind=kind, card=device.card)
    f = jax.jit(lambda a, b: jbs.gemm(a, b, out_dtype=jnp.bfloat16, backend="sm90"))
    for m in sorted({min(first, cat.DECODE_MAX_ROWS + 1) - 1, first, limit, limit + 1}):
        a, b = _operands(fmt_a, fmt_b, (), (), m, n, k)
        calls = [ln for ln in f.lower(a, b).as_text().splitlines()
                 if "custom_call @" + _plugin.SM90_TARGET in ln]
        if m > limit:  # dequantize + cuBLASLt / XLA's dot: no block-scaled kernel
            assert not calls, (m, calls)
        else:
            register_weights = f"a_kind = {KPERM} : i32" in calls[0]
            assert len(calls) == 1 and register_weights == (m >= first), (m, first, calls)
        _check(a, b, "bf16", f)


@needs_sm90
@pytest.mark.parametrize("fmt_b", ["nvfp4", "mxfp4", "mxfp8_e4m3", "mxfp8_e5m2"])
@pytest.mark.parametrize("batch_a,batch_b,m,n,k", [
    ((), (), 65, 128, 64), ((), (), 128, 128, 128), ((), (), 200, 300, 192),
    ((), (), 129, 1000, 1024), ((), (), 517, 257, 256), ((), (), 96, 8, 4096),
    ((2, 3), (), 45, 131, 320), ((3,), (3,), 70, 90, 128),
    # more tiles than SMs: CTAs run several tiles, so a k-tile's MMAs still in flight at a
    # tile's end would corrupt the next tile (128 x 128 and 64 x 128 tiles)
    ((), (), 256, 17920, 256), ((), (), 64, 40000, 128),
    # the 16- and 32-row activation tiles (the decode kernel turned off), whose two k-groups
    # take alternate k-tiles: an odd count, one k-tile (the second group has none), several
    # tiles per CTA
    ((), (), 1, 300, 256), ((), (), 13, 40000, 192), ((), (), 32, 1000, 1024),
    ((2,), (), 12, 264, 128), ((), (), 5, 264, 64), ((), (), 30, 20000, 320)])
def test_register_weights(monkeypatch, fmt_b, batch_a, batch_b, m, n, k):
    """The register-weight variants (weights converted straight into wgmma's register operand,
    the activations K-permuted by the lowering): which call runs, and the numerics for odd M / N
    tails, several k-tiles, CTAs that run several tiles, folded and L batches, every output
    dtype."""
    set_env(monkeypatch, JAX_BLOCKSCALE_SM90_DECODE_MAX_ROWS="0")
    a, b = _operands(None, fmt_b, batch_a, batch_b, m, n, k)
    f = jax.jit(lambda a, b: jbs.gemm(a, b, out_dtype=jnp.float32, backend="sm90"))
    calls = [ln for ln in f.lower(a, b).as_text().splitlines()
             if "custom_call @" + _plugin.SM90_TARGET in ln]
    assert len(calls) == 1 and f"a_kind = {KPERM} : i32" in calls[0], calls
    _check(a, b, "f32", f)
    _check(a, b, "bf16")
    _check(a, b, "f16")


@needs_sm90
@pytest.mark.parametrize("fmt_b", ["nvfp4", "mxfp4", "mxfp8_e4m3", "mxfp8_e5m2"])
@pytest.mark.parametrize("batch_a,batch_b,m,n,k,splits", [
    ((), (), 64, 4096, 14336, None),  # a decoder's down projection: the catalogue's 4 splits
                                       # of 64 x 128 tiles
    ((), (), 45, 200, 1024, "3"),      # 16 k-tiles in 6 / 6 / 4
    ((), (), 20, 300, 640, "7"),       # 10 k-tiles in 2s: splits 5 and 6 have none (zeros);
                                       # 32-row tiles, two k-groups
    ((), (), 64, 40000, 192, "2"),     # more work than SMs: CTAs run several (tile, split)s
    ((2, 3), (), 7, 136, 512, "4"),    # a folded batch
    ((3,), (3,), 40, 200, 512, "4"),   # an L batch: partials [split, L, M, N]
])
def test_register_weights_split_k(monkeypatch, fmt_b, batch_a, batch_b, m, n, k, splits):
    """The register-weight variants with K split (splits forced where the catalogue would not):
    the f32 variant leaves each split's partial sums in true scale, the lowering adds them and
    applies alpha. Equal to the reference in every output dtype, equal to the unsplit kernel
    within f32 rounding, and bitwise reproducible."""
    set_env(monkeypatch, JAX_BLOCKSCALE_SM90_DECODE_MAX_ROWS="0",
            JAX_BLOCKSCALE_SM90_REGISTER_WEIGHT_SPLITS=splits)
    a, b = _operands(None, fmt_b, batch_a, batch_b, m, n, k)  # NVFP4: alpha after the sum
    f = jax.jit(lambda a, b: jbs.gemm(a, b, out_dtype=jnp.float32, backend="sm90"))
    calls = [ln for ln in f.lower(a, b).as_text().splitlines()
             if "custom_call @" + _plugin.SM90_TARGET in ln]
    want_splits = int(splits or 4)
    assert len(calls) == 1 and f"a_kind = {KPERM} : i32" in calls[0], calls
    assert f"splits = {want_splits} : i32" in calls[0] and "partials = 1 : i32" in calls[0], calls
    _check(a, b, "f32", f)
    _check(a, b, "bf16")
    _check(a, b, "f16")
    y = np.asarray(f(a, b))
    np.testing.assert_array_equal(y, np.asarray(f(a, b)))  # bitwise reproducible
    set_env(monkeypatch, JAX_BLOCKSCALE_SM90_REGISTER_WEIGHT_SPLITS="1")
    whole = jax.jit(lambda a, b: jbs.gemm(a, b, out_dtype=jnp.float32, backend="sm90"))
    assert "splits = 0 : i32" in whole.lower(a, b).as_text()
    unsplit = np.asarray(whole(a, b), np.float64)
    assert _rel(y, unsplit) < 2e-5  # f32 sums in another order (K up to 14336)


@needs_sm90
@pytest.mark.parametrize("m,splits", [(13, None), (45, None), (45, "3"), (200, None),
                                      (64, "2")])
def test_register_weights_mxfp4_large_block_scales(monkeypatch, m, splits):
    """MXFP4 weights some of whose blocks are scaled up by 2^5 to 2^20 (e8m0 codes far over
    128, beside ordinary blocks of the same tiles) on the register-weight variants: equal to the
    reference. The blocks sit in the first N tile's second k-tile, across the last two k-tiles
    of a middle tile, in a whole row, and alone in the last row's last block; 17 k-tiles, so
    split ranges share a scale tile. 16-row tiles (two k-groups), 64-row tiles (split),
    128-row tiles. (A kernel that folds the scales where they allow it, as the decode kernel
    does, must keep these exact: docs/design/sm90_fused.md, "What was tried".)"""
    set_env(monkeypatch, JAX_BLOCKSCALE_SM90_DECODE_MAX_ROWS="0",
            JAX_BLOCKSCALE_SM90_REGISTER_WEIGHT_SPLITS=splits)
    n, k = 777, 17 * 64
    ka, kb = jax.random.split(_key())
    x = jax.random.normal(ka, (m, k), jnp.float32)
    w = np.array(jax.random.normal(kb, (n, k), jnp.float32)) * 0.5
    w[3:40:7, 64:128] *= 2.0 ** 12
    w[300:303, 960:1088] *= 2.0 ** 5
    w[600, :] *= 2.0 ** 20
    w[n - 1, k - 32:] *= 2.0 ** 9
    a, b = x.astype(jnp.bfloat16), jbs.quantize(jnp.asarray(w), "mxfp4")
    assert int(np.max(np.asarray(b.scales).view(np.uint8))) > 128
    f = jax.jit(lambda a, b: jbs.gemm(a, b, out_dtype=jnp.float32, backend="sm90"))
    (call,) = [ln for ln in f.lower(a, b).as_text().splitlines()
               if "custom_call @" + _plugin.SM90_TARGET in ln]
    assert f"a_kind = {KPERM} : i32" in call, call
    if splits is not None:
        assert f"splits = {splits} : i32" in call, call
    _check(a, b, "f32", f)
    _check(a, b, "bf16")


@needs_sm90
@pytest.mark.parametrize("fmt_b", ["nvfp4", "mxfp4"])
def test_register_weights_split_k_keeps_non_finite_blocks_in_place(monkeypatch, fmt_b):
    """A NaN / Inf block in one split's K range: its row (activation) or column (weight) is
    NaN / Inf after the splits are added, every other output equals the reference's (NVFP4's
    e4m3 NaN scale and MXFP4's e8m0 one)."""
    set_env(monkeypatch, JAX_BLOCKSCALE_SM90_DECODE_MAX_ROWS="0",
            JAX_BLOCKSCALE_SM90_REGISTER_WEIGHT_SPLITS="4")
    ka, kb = jax.random.split(_key())
    x = np.array(jax.random.normal(ka, (40, 1024), jnp.float32))
    w = np.array(jax.random.normal(kb, (136, 1024), jnp.float32)) * 0.5
    x[1, 5], x[2, 700] = np.nan, np.inf    # splits 0 and 2
    w[3, 300], w[7, 1000] = np.nan, -np.inf  # splits 1 and 3
    a, b = jnp.asarray(x, jnp.bfloat16), jbs.quantize(w, fmt_b)
    f = jax.jit(lambda a, b: jbs.gemm(a, b, out_dtype=jnp.float32, backend="sm90"))
    assert "splits = 4 : i32" in f.lower(a, b).as_text()
    _poison()
    _check_non_finite_rows_1_2_and_columns_3_7(np.asarray(f(a, b)), a, b)


@needs_sm90
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_register_weights_two_operand(monkeypatch, fmt):
    """W4A4 past the decode kernel's rows: A dequantized by XLA, K-permuted, then the
    register-weight variant (alpha, the global scales, in its epilogue)."""
    set_env(monkeypatch, JAX_BLOCKSCALE_SM90_DEQUANT_A=None)
    a, b = _operands(fmt, fmt, (), (), 130, 264, 640)
    f = jax.jit(lambda a, b: jbs.gemm(a, b, out_dtype=jnp.float32, backend="sm90"))
    assert f"a_kind = {KPERM} : i32" in f.lower(a, b).as_text()
    _check(a, b, "f32", f)
    _check(a, b, "bf16")


@needs_sm90
@pytest.mark.parametrize("fmt_b", ["nvfp4", "mxfp8_e4m3"])
@pytest.mark.parametrize("m,n,k", [(300, 1024, 512), (77, 264, 256), (128, 40000, 128),
                                   (200, 300, 192)])
@pytest.mark.parametrize("out", ["bf16", "f16"])
def test_register_weights_16_bit_outputs_are_their_f32_outputs_rounded(monkeypatch, fmt_b, m, n,
                                                                      k, out):
    """One split (so that f32 is not the split partials' workspace): a bf16 / f16 call of the
    register-weight variants writes, bit for bit, the same call's f32 result rounded to
    nearest-even. Only the epilogue differs: 16-bit outputs go through shared memory in whole
    16-byte runs of N where N % 8 == 0 (the first three shapes; M tails, CTAs that run several
    tiles), one by one otherwise (N = 300)."""
    set_env(monkeypatch, JAX_BLOCKSCALE_SM90_DECODE_MAX_ROWS="0", JAX_BLOCKSCALE_SM90_MAX_ROWS="0",
            JAX_BLOCKSCALE_SM90_REGISTER_WEIGHT_SPLITS="1")
    a, b = _operands(None, fmt_b, (), (), m, n, k)
    dtype = OUTS[out][0]
    f = jax.jit(lambda a, b, d: jbs.gemm(a, b, out_dtype=d, backend="sm90"), static_argnums=2)
    calls = [ln for ln in f.lower(a, b, dtype).as_text().splitlines()
             if "custom_call @" + _plugin.SM90_TARGET in ln]
    assert len(calls) == 1 and f"a_kind = {KPERM} : i32" in calls[0], calls  # register weights
    _check(a, b, out, functools.partial(f, d=dtype))
    _poison()
    got = np.asarray(f(a, b, dtype))
    want = np.asarray(f(a, b, jnp.float32).astype(dtype))
    assert np.array_equal(got.view(np.uint16), want.view(np.uint16))


@needs_sm90
@pytest.mark.parametrize("fmt_b", ["nvfp4", "mxfp4"])
def test_shared_memory_weights(monkeypatch, fmt_b):
    """JAX_BLOCKSCALE_SM90_REGISTER_WEIGHTS=0 keeps the shared-memory weight-only variants."""
    set_env(monkeypatch, JAX_BLOCKSCALE_SM90_REGISTER_WEIGHTS="0")
    a, b = _operands(None, fmt_b, (), (), 200, 300, 192)
    f = jax.jit(lambda a, b: jbs.gemm(a, b, out_dtype=jnp.float32, backend="sm90"))
    assert f"a_kind = {cat.KIND_CODES['bf16']} : i32" in f.lower(a, b).as_text()
    _check(a, b, "f32", f)


SHAPES = [(1, 1, 32), (1, 7, 64), (7, 1, 96), (33, 65, 32), (129, 257, 160), (128, 128, 64),
          (255, 129, 1024), (3, 300, 2048), (517, 3, 128)]


@needs_sm90
@pytest.mark.parametrize("m,n,k", SHAPES)
@pytest.mark.parametrize("fmt_a,fmt_b", [("nvfp4", "nvfp4"), ("mxfp8_e4m3", "mxfp4"),
                                         (None, "mxfp4"), ("mxfp8_e5m2", "mxfp8_e4m3")])
def test_shapes(m, n, k, fmt_a, fmt_b):
    a, b = _operands(fmt_a, fmt_b, (), (), m, n, k)
    _check(a, b, "f32")


@needs_sm90
@pytest.mark.parametrize("k", [16, 48, 80])  # NVFP4 K % 32 == 16: padded by the lowering
def test_nvfp4_odd_k(k):
    a, b = _operands("nvfp4", "nvfp4", (), (), 37, 45, k)
    _check(a, b, "f32")
    a, b = _operands(None, "nvfp4", (), (), 37, 45, k)
    _check(a, b, "f32")
    a, b = _operands("nvfp4", "nvfp4", (), (), 5, 45, k)  # decode: plain A scales, a zero block
    _assert_decode_lowering(a, b)
    _check(a, b, "f32")


@needs_sm90
@pytest.mark.parametrize("layout", ["plain", "blocked"])
@pytest.mark.parametrize("fmt_a,fmt_b", [("nvfp4", "nvfp4"), ("mxfp8_e4m3", "mxfp8_e4m3"),
                                         (None, "nvfp4")])
def test_batched(layout, fmt_a, fmt_b):
    # batched A and B (L axis), and a batched A times a shared weight (folded into M)
    a, b = _operands(fmt_a, fmt_b, (3,), (3,), 70, 90, 128, layout)
    _check(a, b, "f32")
    a, b = _operands(fmt_a, fmt_b, (2, 3), (), 45, 131, 96, layout)
    _check(a, b, "f32")
    a, b = _operands(fmt_a, fmt_b, (1,), (4,), 33, 20, 64, layout)
    _check(a, b, "f32")


@needs_sm90
def test_vmap():
    a, b = _operands("mxfp8_e4m3", "mxfp4", (4,), (4,), 65, 130, 256)
    f = jax.jit(jax.vmap(lambda a, b: jbs.gemm(a, b, out_dtype=jnp.float32, backend="sm90")))
    _check(a, b, "f32", f)
    a, b = _operands(None, "nvfp4", (5,), (), 17, 64, 64)
    f = jax.jit(jax.vmap(lambda a: jbs.gemm(a, b, out_dtype=jnp.float32, backend="sm90")))
    _check(a, b, "f32", lambda a, b: f(a))


@needs_sm90
@pytest.mark.parametrize("m", [3, 200])  # the decode kernel; the fused / register-weight ones
@pytest.mark.parametrize("fmt_a,fmt_b", [("nvfp4", "nvfp4"), ("mxfp4", "mxfp4"),
                                         (None, "nvfp4"), (None, "mxfp4")])
def test_non_finite_blocks_stay_in_their_rows_and_columns(fmt_a, fmt_b, m):
    """A NaN or Inf in a block of A turns that block's scale into NaN (docs/formats.md): its
    output row is NaN, as is the column of a weight block holding one; every other output
    equals the reference's. The kernels read a NaN scale as NaN, not as a large number."""
    ka, kb = jax.random.split(_key())
    x = np.array(jax.random.normal(ka, (m, 256), jnp.float32))  # writable copies
    w = np.array(jax.random.normal(kb, (136, 256), jnp.float32)) * 0.5
    x[1, 5], x[2, 70] = np.nan, np.inf
    w[3, 40], w[7, 200] = np.nan, -np.inf
    a = jnp.asarray(x, jnp.bfloat16) if fmt_a is None else jbs.quantize(x, fmt_a)
    b = jbs.quantize(w, fmt_b, layout="blocked")
    f = jax.jit(lambda a, b: jbs.gemm(a, b, out_dtype=jnp.float32, backend="sm90"))
    assert "custom_call @" + _plugin.SM90_TARGET in f.lower(a, b).as_text()
    _poison()
    _check_non_finite_rows_1_2_and_columns_3_7(np.asarray(f(a, b)), a, b)


def _check_non_finite_rows_1_2_and_columns_3_7(y, a, b):
    """y (the kernel's f32 output for a, b whose activation rows 1, 2 and weight rows 3, 7 hold
    a NaN or an Inf) against the reference: exactly those output rows and columns are not
    finite, NaN where the reference's are, its Infs bit for bit, and every other output within
    1e-5."""
    ref = np.asarray(jbs.gemm(a, b, out_dtype=jnp.float32, backend="reference"))
    bad = np.zeros(y.shape, bool)
    bad[[1, 2], :] = True
    bad[:, [3, 7]] = True
    # the reference follows the docs (a bf16 activation keeps its Inf: row 2 is then +-Inf
    # where the weights' column is not NaN)
    np.testing.assert_array_equal(~np.isfinite(ref), bad)
    np.testing.assert_array_equal(np.isnan(y), np.isnan(ref))
    np.testing.assert_array_equal(y[np.isinf(ref)], ref[np.isinf(ref)])
    assert np.isfinite(y[~bad]).all()
    assert _rel(y[~bad], ref[~bad]) < 1e-5


@needs_sm90
def test_float64_oracle():
    """One check straight against float64 NumPy, independent of the reference backend."""
    from oracle import dequantize as np_dequantize  # tests/support/oracle.py

    a, b = _operands("nvfp4", "nvfp4", (), (), 77, 91, 256)
    y = jbs.gemm(a, b, out_dtype=jnp.float32, backend="sm90")
    av = np_dequantize(a.data, a.scales, "nvfp4", a.global_scale, a.layout)
    bv = np_dequantize(b.data, b.scales, "nvfp4", b.global_scale, b.layout)
    assert _rel(y, av @ bv.T) < 1e-5


@needs_sm90
def test_default_backend_is_sm90_on_hopper():
    a, b = _operands("mxfp8_e4m3", "mxfp8_e4m3", (), (), 64, 64, 64)
    text = jax.jit(lambda a, b: jbs.gemm(a, b)).lower(a, b).as_text()
    assert _plugin.SM90_TARGET in text



def _run_with_command_buffers(code):
    """Run `code` in a fresh process with XLA's CUDA graphs (command buffers) on for fusions and
    custom calls, even single ones; it must print GRAPH_OK."""
    env = dict(os.environ)
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL"
                        " --xla_gpu_graph_min_graph_size=1")
    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                                         env.get("PYTHONPATH", "")])
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0 and "GRAPH_OK" in r.stdout, r.stdout + r.stderr

@needs_sm90
def test_cuda_graph():
    """The custom call inside an XLA command buffer (CUDA graph), in a fresh process."""
    code = textwrap.dedent("""
        import jax, jax.numpy as jnp, numpy as np
        import jax_blockscale as jbs
        from jax_blockscale.lowering import ffi_sm90
        ka, kb = jax.random.split(jax.random.PRNGKey(7))
        a = jbs.quantize(jax.random.normal(ka, (96, 512)), "nvfp4")
        b = jbs.quantize(jax.random.normal(kb, (160, 512)), "nvfp4", layout="blocked")
        f = jax.jit(lambda a, b: jbs.gemm(a, b, out_dtype=jnp.float32, backend="sm90") * 2.0 + 1.0)
        ref = np.asarray(jbs.gemm(a, b, out_dtype=jnp.float32, backend="reference")) * 2.0 + 1.0
        for _ in range(5):
            y = np.asarray(f(a, b))
            err = np.linalg.norm(y - ref) / np.linalg.norm(ref)
            assert err < 1e-5, err
        print("GRAPH_OK", err)
    """)
    _run_with_command_buffers(code)


_FUSED_8x8 = cat.fused_variant("mxfp8", "mxfp8", "f32", 128, 64)
_DECODE_8x8 = cat.decode_variant(cat.DecodeVariant("mxfp8", "mxfp8", "f32", 1))


@needs_sm90
@pytest.mark.parametrize("ws_len,sa_len,plain,variant,splits,match", [
    (0, 100, 0, _FUSED_8x8, 0, "scale buffer"),  # a wrongly sized A-scale buffer
    # a declared decode workspace smaller than L*M*N floats
    (60, 512, 0, _DECODE_8x8, 1, "workspace"),
    # plain A scales are 8 rows x 1 block: 8 bytes, not 512
    (64, 512, 1, _DECODE_8x8, 1, "plain layout"),
    (0, 8, 1, _FUSED_8x8, 0, "need the decode kernel"),  # plain A scales, the fused GEMM
    (0, 512, 0, cat.fused_variant("mxfp8", "mxfp8", "f32", 128, 96), 0, "no compiled"),
    (0, 512, 0, _FUSED_8x8, 2, "split count"),  # a split count for a fused variant
    (64, 512, 0, _DECODE_8x8, 0, "split count"),  # the decode kernel with no split
    (0, 512, 0, _FUSED_8x8, 0, "partials = 1"),  # split partials asked of a fused variant
])
def test_handler_rejects_bad_input(ws_len, sa_len, plain, variant, splits, match):
    """A call the kernel cannot take returns an error from the handler, never a crash (the
    variant attributes name a compiled variant unless the case says otherwise)."""
    assert _plugin.register_targets()  # (gemm registers them on first use; this test may be first)
    call = jax.ffi.ffi_call(_plugin.SM90_TARGET, (jax.ShapeDtypeStruct((1, 8, 8), jnp.float32),
                                                  jax.ShapeDtypeStruct((ws_len,), jnp.float32)))
    u8 = lambda *s: jnp.ones(s, jnp.uint8)  # noqa: E731
    with pytest.raises(Exception, match=match):
        jax.block_until_ready(call(u8(1, 8, 32), u8(1, 8, 32), u8(sa_len), u8(512),
                                   jnp.ones((1,), jnp.float32),
                                   a_kind=np.int32(cat.KIND_CODES["mxfp8"]),
                                   b_kind=np.int32(cat.KIND_CODES["mxfp8"]), a_e5m2=np.int32(0),
                                   b_e5m2=np.int32(0), m=np.int64(8), n=np.int64(8),
                                   k=np.int64(32), l=np.int64(1), a_scales_plain=np.int32(plain),
                                   nt=np.int32(variant.nt), tile_m=np.int32(variant.tile_m),
                                   tile_n=np.int32(variant.tile_n), splits=np.int32(splits),
                                   partials=np.int32(match == "partials = 1")))


@needs_sm90
def test_handler_runs_a_well_formed_call():
    """The cases above differ from this accepted call in one respect each."""
    assert _plugin.register_targets()
    call = jax.ffi.ffi_call(_plugin.SM90_TARGET, (jax.ShapeDtypeStruct((1, 8, 8), jnp.float32),
                                                  jax.ShapeDtypeStruct((0,), jnp.float32)))
    u8 = lambda *s: jnp.ones(s, jnp.uint8)  # noqa: E731
    v = _FUSED_8x8
    y, _ = call(u8(1, 8, 32), u8(1, 8, 32), u8(512), u8(512), jnp.ones((1,), jnp.float32),
                a_kind=np.int32(cat.KIND_CODES["mxfp8"]), b_kind=np.int32(cat.KIND_CODES["mxfp8"]),
                a_e5m2=np.int32(0), b_e5m2=np.int32(0), m=np.int64(8), n=np.int64(8),
                k=np.int64(32), l=np.int64(1), a_scales_plain=np.int32(0), nt=np.int32(v.nt),
                tile_m=np.int32(v.tile_m), tile_n=np.int32(v.tile_n), splits=np.int32(0),
                partials=np.int32(0))
    assert np.isfinite(np.asarray(y)).all()


# ---- the decode kernel (M <= decode_max_rows(): kernels/sm90_decode.py through the same FFI) -----

DECODE_PAIRS = [(None, "nvfp4"), (None, "mxfp4"), (None, "mxfp8_e4m3"), (None, "mxfp8_e5m2"),
                ("nvfp4", "nvfp4"), ("mxfp4", "mxfp4"), ("mxfp8_e4m3", "mxfp8_e5m2"),
                ("mxfp8_e5m2", "mxfp8_e4m3")]


def _assert_decode_lowering(a, b, out_dtype=jnp.float32):
    """The lowering declares the decode workspace (the handler then runs the decode kernel), and
    a quantized activation's plain scales go to it as they are."""
    text = jax.jit(lambda a, b: jbs.gemm(a, b, out_dtype=out_dtype, backend="sm90")).lower(
        a, b).as_text()
    calls = [ln for ln in text.splitlines() if "custom_call @" + _plugin.SM90_TARGET in ln]
    assert len(calls) == 1 and "tensor<0xf32>" not in calls[0], calls
    plain = int(isinstance(a, jbs.BlockScaled) and a.layout == "plain")
    assert f"a_scales_plain = {plain} : i32" in calls[0], calls[0][-400:]


@needs_sm90
@pytest.mark.parametrize("fmt_a,fmt_b", DECODE_PAIRS)
@pytest.mark.parametrize("m", [1, 2, 3, 7, 16, 17, 24, 25, 32])
def test_decode_pairs(fmt_a, fmt_b, m):
    # odd N (not a multiple of the 256-row CTA), K a multiple of 32 but of no tile/sub-chunk
    # (nor of the register-weight kernels' k-tile: the decode kernel at every M here); 17-24
    # rows run the 32-row variant's 24-row loop (catalog/sm90.py: DENSE_PASS_NTS), 25-32 its
    # whole one
    a, b = _operands(fmt_a, fmt_b, (), (), m, 777, 1056)
    _assert_decode_lowering(a, b)
    _check(a, b, "f32", jax.jit(lambda a, b: jbs.gemm(a, b, out_dtype=jnp.float32,
                                                      backend="sm90")))


@needs_sm90
@pytest.mark.parametrize("m", [1, 5, 16, 20, 30])
@pytest.mark.parametrize("fmt_a", [None, "mxfp4"])
def test_decode_mxfp4_large_block_scales(m, fmt_a):
    """MXFP4 weights whose block scales span 2^-1 to 2^21 (blocks scaled up by 2^5 to 2^20 in a
    few rows and K ranges, beside ordinary ones in the same steps and CTAs): the decode kernel's
    exact conversion at every scale, equal to the reference. The CTAs (tiles x K splits) that
    see such a scale run the unfolded loop, the others the folded one (Sm90DecodeGemm.mx_fold);
    one block alone in the last row and K block checks the far end of a CTA's scale check."""
    n, k = 777, 1056
    ka, kb = jax.random.split(_key())
    x = jax.random.normal(ka, (m, k), jnp.float32)
    w = np.array(jax.random.normal(kb, (n, k), jnp.float32)) * 0.5
    w[3:40:7, 64:128] *= 2.0 ** 12
    w[300:303, 1000:1056] *= 2.0 ** 5
    w[600, :] *= 2.0 ** 20  # a whole row
    w[n - 1, k - 32:] *= 2.0 ** 9  # the last block of the last (partial) row group
    a = x.astype(jnp.bfloat16) if fmt_a is None else jbs.quantize(x, fmt_a)
    b = jbs.quantize(jnp.asarray(w), "mxfp4")
    assert int(np.max(np.asarray(b.scales).view(np.uint8))) > 128
    _assert_decode_lowering(a, b)
    _check(a, b, "f32")


@needs_sm90
@pytest.mark.parametrize("m,n,k", [(1, 1, 32), (2, 3, 96), (3, 257, 544), (7, 1000, 2080),
                                   (16, 255, 4192), (9, 8191, 1024), (24, 300, 512),
                                   (32, 129, 160), (5, 4096, 8192), (40, 777, 1056),
                                   (64, 257, 2080), (17, 4096, 4096), (15, 9999, 1056)])
@pytest.mark.parametrize("fmt_a,fmt_b", [(None, "nvfp4"), ("nvfp4", "nvfp4"),
                                         (None, "mxfp8_e4m3"), ("mxfp4", "mxfp4")])
def test_decode_shapes(m, n, k, fmt_a, fmt_b):
    # M = 17..64: the wide variants (4 / 8 n8 tiles of M, 128 rows of N per CTA)
    a, b = _operands(fmt_a, fmt_b, (), (), m, n, k)
    _assert_decode_lowering(a, b)
    _check(a, b, "f32")


@needs_sm90
@pytest.mark.parametrize("m", [1, 16])
@pytest.mark.parametrize("fmt_a,fmt_b", [(None, "nvfp4"), (None, "mxfp4"), ("mxfp4", "mxfp4"),
                                         (None, "mxfp8_e4m3"), ("nvfp4", "nvfp4")])
def test_decode_last_sub_chunk_of_every_length(monkeypatch, m, fmt_a, fmt_b):
    """K whose last sub-chunk holds 1, 2, 3 or 4 steps (fp4: 128 elements a step, fp8: 64;
    4 steps a sub-chunk), the last step whole or half full: the kernel skips the steps past K
    (Sm90DecodeGemm._sub_chunk_compute) and no other. K split in 3 ranges of one sub-chunk
    (forced: the catalogue gives 1-row calls two sub-chunks a range at least): the last
    split's range ends in the partial sub-chunk."""
    set_env(monkeypatch, JAX_BLOCKSCALE_SM90_DECODE_SPLITS="3")
    se = 64 if fmt_b.startswith("mxfp8") else 128
    f = jax.jit(lambda a, b: jbs.gemm(a, b, out_dtype=jnp.float32, backend="sm90"))
    for steps in (1, 2, 3, 4):
        for k in (8 * se + steps * se, 8 * se + steps * se - se // 2):
            a, b = _operands(fmt_a, fmt_b, (), (), m, 300, k)
            _assert_decode_lowering(a, b)
            assert "splits = 3 : i32" in f.lower(a, b).as_text()  # one sub-chunk per range
            _check(a, b, "f32", f)


@needs_sm90
@pytest.mark.parametrize("m", [1, 16])
@pytest.mark.parametrize("fmt_a,fmt_b", [(None, "nvfp4"), (None, "mxfp4"), ("mxfp4", "mxfp4"),
                                         (None, "mxfp8_e4m3")])
def test_decode_k_range_past_k_is_empty(monkeypatch, m, fmt_a, fmt_b):
    """Four K ranges over 5.6 sub-chunks (gpt-oss's K = 2880 in FP4) are 2, 2, 1.6 and none:
    the last range begins past K. The handler takes any split count up to the sub-chunks (the
    catalogue itself makes no empty range); the kernel must write that range's partials as
    zeros and skip steps only in the range that ends in a partial sub-chunk."""
    choose = cat.choose_decode_variant

    def four_splits(*args, **kw):
        v, _ = choose(*args, **kw)
        return v, 4
    monkeypatch.setattr(cat, "choose_decode_variant", four_splits)
    se = 64 if fmt_b.startswith("mxfp8") else 128  # K elements per step, 4 steps a sub-chunk
    a, b = _operands(fmt_a, fmt_b, (), (), m, 300, 22 * se + se // 2)
    _assert_decode_lowering(a, b)
    f = jax.jit(lambda a, b: jbs.gemm(a, b, out_dtype=jnp.float32, backend="sm90"))
    assert "splits = 4 : i32" in f.lower(a, b).as_text()
    _check(a, b, "f32", f)


@needs_sm90
@pytest.mark.parametrize("out", ["bf16", "f16"])
@pytest.mark.parametrize("fmt_a,fmt_b", [(None, "nvfp4"), ("mxfp8_e4m3", "mxfp8_e4m3")])
def test_decode_outputs(out, fmt_a, fmt_b):
    a, b = _operands(fmt_a, fmt_b, (), (), 5, 300, 512)
    _check(a, b, out)


@needs_sm90
@pytest.mark.parametrize("layout", ["plain", "blocked"])
@pytest.mark.parametrize("fmt_a,fmt_b", [(None, "nvfp4"), ("nvfp4", "nvfp4"),
                                         (None, "mxfp8_e4m3")])
def test_decode_batched(layout, fmt_a, fmt_b):
    a, b = _operands(fmt_a, fmt_b, (3,), (3,), 4, 129, 256, layout)  # L = 3
    _assert_decode_lowering(a, b)
    _check(a, b, "f32")
    a, b = _operands(fmt_a, fmt_b, (2, 3), (), 2, 131, 96, layout)  # folded: M = 12
    _assert_decode_lowering(a, b)
    _check(a, b, "f32")
    a, b = _operands(fmt_a, fmt_b, (3,), (3,), 40, 257, 288, layout)  # L = 3, wide variant
    _assert_decode_lowering(a, b)
    _check(a, b, "f32")
    a, b = _operands(fmt_a, fmt_b, (2, 3), (), 9, 131, 96, layout)  # folded: M = 54, wide
    _assert_decode_lowering(a, b)
    _check(a, b, "f32")


@needs_sm90
def test_decode_cuda_graph():
    """The decode path (split-K workspace, its partials added by XLA) inside a CUDA graph,
    fresh process."""
    code = textwrap.dedent("""
        import jax, jax.numpy as jnp, numpy as np
        import jax_blockscale as jbs
        from jax_blockscale.lowering import ffi_sm90
        for i, (fa, fb, m, n, k) in enumerate([(None, "nvfp4", 3, 777, 544),
                                              ("nvfp4", "nvfp4", 16, 300, 1056),
                                              (None, "mxfp8_e4m3", 1, 1000, 4096)]):
            ka, kb = jax.random.split(jax.random.PRNGKey(11 + i))
            x = jax.random.normal(ka, (m, k))
            a = x.astype(jnp.bfloat16) if fa is None else jbs.quantize(x, fa)
            b = jbs.quantize(jax.random.normal(kb, (n, k)), fb, layout="blocked")
            f = jax.jit(lambda a, b: jbs.gemm(a, b, out_dtype=jnp.float32, backend="sm90")
                        * 2.0 + 1.0)
            ref = np.asarray(jbs.gemm(a, b, out_dtype=jnp.float32, backend="reference")) * 2 + 1
            for _ in range(5):  # replays: every split rewrites its workspace slice each time
                y = np.asarray(f(a, b))
                err = np.linalg.norm(y - ref) / np.linalg.norm(ref)
                assert err < 1e-5, (i, err)
        print("GRAPH_OK", err)
    """)
    _run_with_command_buffers(code)


@needs_sm90
@pytest.mark.parametrize("fmt_a,fmt_b,batch,m,n,k,out", [
    (None, "nvfp4", (), 1, 6144, 4096, "bf16"),
    (None, "mxfp4", (), 16, 777, 2080, "f32"),
    (None, "mxfp8_e4m3", (3,), 5, 300, 4096, "f16"),
    ("nvfp4", "nvfp4", (), 13, 1000, 4192, "bf16"),
    ("mxfp8_e4m3", "mxfp8_e5m2", (), 40, 520, 8192, "f32"),
])
def test_split_partials_added_by_xla_equal_the_finalize_kernel(monkeypatch, fmt_a, fmt_b, batch,
                                                               m, n, k, out):
    """A decode call with several splits leaves its partials for the lowering to add in XLA;
    the kernel's own finalize (what the layer target runs) adds them in the same order: the
    same bits, NaN and Inf included (one row of A poisoned)."""
    a, b = _operands(fmt_a, fmt_b, batch, batch, m, n, k)
    if fmt_a is None:
        a = a.at[..., 0, 7].set(jnp.nan).at[..., m - 1, 9].set(jnp.inf)
    dtype = OUTS[out][0]

    def run(partials):  # a new function each time: jit's cache would keep the first lowering
        g = jax.jit(lambda a, b: jbs.gemm(a, b, out_dtype=dtype, backend="sm90"))
        (call,) = [ln for ln in g.lower(a, b).as_text().splitlines()
                   if "custom_call @" + _plugin.SM90_TARGET in ln]
        assert f"partials = {partials} :" in call and "nt = 0 :" not in call, call
        assert "splits = 1 :" not in call, call
        return np.asarray(g(a, b).astype(jnp.float32))

    by_xla = run(1)
    monkeypatch.setattr(ffi_sm90, "leaves_partials", lambda plan: False)
    by_kernel = run(0)
    np.testing.assert_array_equal(by_xla, by_kernel)
    assert np.isfinite(by_xla).sum() < by_xla.size or fmt_a is not None


@needs_sm90
def test_decode_is_bitwise_reproducible():
    """Split-K partials are summed in a fixed order (no atomics): the same call, the same bits."""
    a, b = _operands(None, "nvfp4", (), (), 16, 4096, 8192)  # 16 row groups x several splits
    f = jax.jit(lambda a, b: jbs.gemm(a, b, out_dtype=jnp.float32, backend="sm90"))
    y0 = np.asarray(f(a, b))
    for _ in range(4):
        assert np.array_equal(np.asarray(f(a, b)), y0)


@needs_sm90
def test_decode_matches_fused_kernel(monkeypatch):
    """Same inputs through the decode kernel and the fused kernel (decode turned off)."""
    a, b = _operands(None, "nvfp4", (), (), 16, 520, 1024)
    y_dec = np.asarray(jbs.gemm(a, b, out_dtype=jnp.float32, backend="sm90"))
    set_env(monkeypatch, JAX_BLOCKSCALE_SM90_DECODE_MAX_ROWS="0")
    y_fused = np.asarray(jax.jit(lambda a, b: jbs.gemm(a, b, out_dtype=jnp.float32,
                                                       backend="sm90"))(a, b))
    assert _rel(y_dec, y_fused) < 1e-5


@needs_sm90
@pytest.mark.parametrize("fmt_a,fmt_b,global_scale", [
    (None, "mxfp4", None), ("mxfp4", "mxfp4", None), ("mxfp8_e4m3", "mxfp8_e4m3", None),
    (None, "nvfp4", None), ("nvfp4", "nvfp4", "auto"), (None, "nvfp4", "auto")])
def test_large_m_dequantize_and_dot(monkeypatch, fmt_a, fmt_b, global_scale):
    """Above the kernel's row limit the backend dequantizes and calls a library GEMM: without
    global scales (and with >= 2^22 outputs) XLA's, writing the bf16 output itself; with them the
    dot_alpha target (cuBLASLt, alpha in the epilogue). Either way: one rounding of the f32 sum."""
    from oracle import dequantize as np_dequantize  # tests/support/oracle.py

    set_env(monkeypatch, JAX_BLOCKSCALE_SM90_MAX_ROWS="16")
    kx, kw = jax.random.split(_key())
    # 2^22 outputs: the smallest problem whose GEMM may round to bf16 itself
    x = jax.random.normal(kx, (1024, 1024), jnp.float32)
    w = jax.random.normal(kw, (4096, 1024), jnp.float32)
    a = x.astype(jnp.bfloat16) if fmt_a is None else jbs.quantize(x, fmt_a,
                                                                  global_scale=global_scale)
    kw_args = {} if fmt_b != "nvfp4" else {"global_scale": global_scale}
    b = jbs.quantize(w, fmt_b, layout="blocked", **kw_args)
    f = jax.jit(lambda a, b: jbs.gemm(a, b, backend="sm90"))
    text = f.lower(a, b).as_text()
    assert _plugin.SM90_TARGET not in text  # the dequantize + dot lowering
    dots = [ln for ln in text.splitlines() if "stablehlo.dot_general" in ln]
    if global_scale is None:
        assert dots and all(ln.endswith("bf16>") for ln in dots), dots
    else:
        assert not dots and _plugin.DOT_ALPHA_TARGET in text
    _poison()
    y = np.asarray(f(a, b), np.float64)
    av = (np.asarray(a, np.float64) if fmt_a is None else
          np_dequantize(a.data, a.scales, fmt_a, a.global_scale, a.layout))
    bv = np_dequantize(b.data, b.scales, fmt_b, b.global_scale, b.layout)
    want = av @ bv.T
    # each element within bf16 rounding (2^-8 relative, plus the f32 sum's own error)
    assert np.isfinite(y).all()
    assert np.all(np.abs(y - want) <= 2.0 ** -8 * np.abs(want) + 1e-4 * np.abs(want).max())
    assert _rel(y, want) < 4e-3


def _shard_gemm(a, b, plan_shape, out_dtype=jnp.bfloat16):
    """gemm_local_p on one shard's operands, as sharding.py binds it (plan_shape: the unsharded
    call's (a_batch, b_batch, m, n), or None: the shard plans for itself)."""
    from jax_blockscale.dense.primitive import _alpha  # noqa: PLC0415
    from jax_blockscale.dense.primitive import gemm_local_p, join_operands  # noqa: PLC0415
    quantized = isinstance(a, jbs.BlockScaled)
    operands = join_operands(a.data if quantized else a, b.data, a.scales if quantized else None,
                             b.scales, _alpha(a, b))
    params = dict(fmt_a=a.fmt if quantized else None, fmt_b=b.fmt,
                  layout_a=a.layout if quantized else None, layout_b=b.layout,
                  out_dtype=np.dtype(out_dtype), backend=None,
                  alpha_is_one=_alpha(a, b).shape == () and b.global_scale is None)
    return jax.jit(lambda *o: gemm_local_p.bind(*o, **params, plan_shape=plan_shape))(*operands)


def _half(x: jbs.BlockScaled, j: int, rows: int) -> jbs.BlockScaled:
    """Rows [j rows, (j + 1) rows) of a quantized operand (blocked scales: whole 128-row tiles)."""
    r = slice(j * rows, (j + 1) * rows)
    t = slice(j * rows // 128, (j + 1) * rows // 128) if x.layout == "blocked" else r
    return jbs.BlockScaled(x.data[r], x.scales[t], x.global_scale, x.fmt, x.layout)


@needs_sm90
@pytest.mark.parametrize("fmt_a,fmt_b,m,n,k", [
    (None, "nvfp4", 1, 4096, 4096), (None, "mxfp8_e4m3", 64, 2048, 4096),
    ("nvfp4", "nvfp4", 16, 4096, 14336), (None, "mxfp4", 40, 1024, 4096)])
def test_shards_of_a_sharded_gemm_equal_it_bit_for_bit(fmt_a, fmt_b, m, n, k):
    """The N and M shards of a 2-device split, run with the unsharded call's plan (plan_shape,
    what sharding.py binds), give the unsharded call's bits; planned for themselves they run
    other split counts or kernels at these shapes (tests/unit/test_plan.py)."""
    a, b = _operands(fmt_a, fmt_b, (), (), m, n, k, layout="blocked" if fmt_a else "plain")
    b = jbs.to_blocked(b)
    whole = ((), (), m, n)
    want = np.asarray(jax.jit(lambda a, b: jbs.gemm(a, b))(a, b), np.float32).view(np.uint32)
    n_split = np.concatenate([np.asarray(_shard_gemm(a, _half(b, j, n // 2), whole), np.float32)
                              for j in range(2)], axis=1)
    assert np.array_equal(n_split.view(np.uint32), want), "N shards differ from the whole"
    if fmt_a is None and m % 2 == 0:  # (a quantized A splits M in whole 128-row scale tiles)
        m_split = np.concatenate([np.asarray(_shard_gemm(a[j * m // 2:(j + 1) * m // 2], b,
                                                         whole), np.float32)
                                  for j in range(2)], axis=0)
        assert np.array_equal(m_split.view(np.uint32), want), "M shards differ from the whole"
