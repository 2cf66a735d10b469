"""ragged_gemm's sm100 backend (lowering/ragged_sm100.py) on the CPU: everything it hands the
grouped Blackwell kernel, checked without a Blackwell GPU.

The FFI call is replaced by an emulator of the kernel's contract (ffi/jbs_ffi_sm100.cc, target
jax_blockscale_ragged_gemm_sm100): it decodes the raw operands the backend passes (fp4 bytes
two per element pair, fp8 bytes, blocked scale bytes, alpha per group, the int32 tile table),
computes each 128-row M tile with its group's weights and alpha, and leaves the rows of tiles
no group owns as NaN (the kernel does not write them). Whatever the padding, the table or the
gather back get wrong then shows up against the float64 oracle and the reference backend:
rows in the wrong tile, a tile with the wrong group, a row read from an unwritten tile.
The kernel itself is the dense sm100 kernel with its L index taken from the table
(tests/build/test_sm100_build.py compiles it; docs/design/sm100.md).
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_blockscale as jbs
from jax_blockscale import _plugin
from jax_blockscale.core import layout
from jax_blockscale.catalog import sm100 as cat100
from jax_blockscale.lowering import plan as P
from jax_blockscale.lowering import ragged_sm100
from jax_blockscale.lowering.registry import get_ragged_backend
from test_ragged_gemm import quantize, quantize_experts, ragged_oracle, rand, values

FMT_OF_CODE = {code: name for name, code in cat100.FMT_CODES.items()}
E2M1 = np.array([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6], np.float32)


def _elements(u8, fmt, shape):
    """The kernel's element bytes -> f32 values of `shape` (..., K)."""
    if fmt in ("nvfp4", "mxfp4"):
        nib = jnp.stack([u8 & 0xF, u8 >> 4], axis=-1).reshape(shape)  # low nibble first
        return jnp.asarray(E2M1)[nib]
    return jax.lax.bitcast_convert_type(u8.reshape(shape), jnp.float8_e4m3fn).astype(jnp.float32)


def _scales(u8, fmt, lead, mn, k):
    """Flat blocked scale bytes -> f32 (*lead, mn, K / block), padding dropped."""
    block = cat100.FORMATS[fmt].block
    sk = k // block
    dt = jnp.float8_e4m3fn if fmt == "nvfp4" else jnp.float8_e8m0fnu
    s = jax.lax.bitcast_convert_type(u8, dt).reshape(lead + layout.blocked_shape(mn, sk))
    return layout.from_blocked_scales(s, mn, sk).astype(jnp.float32)


def emulated_kernel(target, result):
    """Stands in for jax.ffi.ffi_call(RAGGED_SM100_TARGET, ...): the grouped kernel's contract."""
    assert target == _plugin.RAGGED_SM100_TARGET

    def run(a8, b8, sa8, sb8, alpha, table, *, fmt_a, fmt_b, m, n, k, g, tile_m, tile_n):
        fmt = FMT_OF_CODE[int(fmt_a)]
        m, n, k, g, tile_m = int(m), int(n), int(k), int(g), int(tile_m)
        assert FMT_OF_CODE[int(fmt_b)] == fmt and m % tile_m == 0 and result.shape == (m, n)
        assert table.shape == (m // tile_m,) and table.dtype == jnp.int32
        assert alpha.shape == (g,) and int(tile_n) == 128
        block = cat100.FORMATS[fmt].block
        a = _elements(a8, fmt, (m, k)) * jnp.repeat(_scales(sa8, fmt, (), m, k), block, -1)
        b = _elements(b8, fmt, (g, n, k)) * jnp.repeat(_scales(sb8, fmt, (g,), n, k), block, -1)
        group = jnp.where(table >= g, -1, table)  # the kernel's clamp
        owned = group >= 0
        bt = b[jnp.maximum(group, 0)]  # (tiles, N, K)
        at = a.reshape(m // tile_m, tile_m, k)
        y = jnp.einsum("tmk,tnk->tmn", at, bt, precision=jax.lax.Precision.HIGHEST)
        y = y * alpha[jnp.maximum(group, 0)][:, None, None]
        y = jnp.where(owned[:, None, None], y, jnp.nan)  # unwritten tiles
        return y.reshape(m, n).astype(result.dtype)

    return run


@pytest.fixture
def sm100_backend_on_cpu(monkeypatch):
    """The sm100 ragged backend serving the CPU, planning as for a B200 with the grouped kernels
    in its library, its FFI call emulated."""
    backend = get_ragged_backend("sm100")
    lib = type("Lib", (), {"sm100_unavailable_reason": lambda self: None,
                           "has_ragged_sm100": lambda self: True})()
    device = P.Device("cuda", "sm100", 148)
    monkeypatch.setattr(backend, "platforms", ("cpu", "cuda"))
    monkeypatch.setattr(backend, "plan", lambda spec, platform: P.plan_ragged_sm100(
        spec, device, library=lib))
    monkeypatch.setattr(_plugin, "register_targets", lambda: True)
    monkeypatch.setattr(_plugin, "has_ragged_sm100", lambda lib=None: True)
    monkeypatch.setattr(jax.ffi, "ffi_call", emulated_kernel)
    return backend


CASES = [  # fmt, m, n, k, group sizes, lhs scale layout
    ("nvfp4", 37, 64, 128, [10, 0, 20, 7, 0], "plain"),  # empty groups, partial tiles
    ("mxfp4", 50, 40, 256, [5, 0, 30, 2], "plain"),  # rows past the sum are zero
    ("mxfp8_e4m3", 300, 64, 64, [0, 0, 300], "blocked"),  # one group holds every row
    ("nvfp4", 260, 32, 96, [129, 1, 128, 2], "blocked"),  # groups across tile edges
    ("mxfp4", 16, 64, 64, [0, 0, 0, 0], "plain"),  # no rows at all
    ("nvfp4", 9, 64, 64, [-3, 20, 4], "plain"),  # clamped: negative, past M
]


@pytest.mark.parametrize("fmt,m,n,k,sizes,lhs_layout", CASES)
@pytest.mark.parametrize("out", [jnp.float32, jnp.bfloat16])
def test_padded_grouped_call_equals_the_oracle(sm100_backend_on_cpu, fmt, m, n, k, sizes,
                                               lhs_layout, out):
    g = len(sizes)
    x = quantize(rand(m + k, (m, k), 2.0), fmt=fmt, layout=lhs_layout,
                 global_scale="auto" if fmt == "nvfp4" else None)
    w = quantize_experts(rand(n + g, (g, n, k)), fmt)
    gs = jnp.asarray(sizes, jnp.int32)
    f = jax.jit(functools.partial(jbs.ragged_gemm, out_dtype=out, backend="sm100"))
    text = f.lower(x, w, gs).as_text()
    assert "custom_call" not in text  # the emulator ran in its place
    got = np.asarray(f(x, w, gs), np.float64)
    assert np.isfinite(got).all(), "a row was read from a tile the kernel does not write"
    want = ragged_oracle(values(x), values(w), sizes)  # global scales included
    tol = 1e-6 if out == jnp.float32 else 1e-2
    assert np.linalg.norm(got - want) <= tol * max(np.linalg.norm(want), 1e-30)
    ref = np.asarray(jbs.ragged_gemm(x, w, gs, out_dtype=out, backend="reference"), np.float64)
    np.testing.assert_array_equal(got == 0, ref == 0)  # the same rows are zero
    assert np.linalg.norm(got - ref) <= tol * max(np.linalg.norm(ref), 1e-30)


def test_padded_layout_tiles_hold_one_group_each():
    sizes = jnp.asarray([3, 0, 130, 1], jnp.int32)
    tiles = cat100.grouped_padded_rows(140, 4) // 128
    dest, table = jax.jit(ragged_sm100.padded_layout, static_argnums=(2, 3, 4))(
        sizes, jnp.int32(2), 140, 128, tiles)
    dest, table = np.asarray(dest), np.asarray(table)
    # rows 0-1 precede the groups (row_start 2), 136-139 follow them: nowhere
    assert (dest[:2] == tiles * 128).all() and (dest[136:] == tiles * 128).all()
    # group 0: rows 2-4 -> tile 0; group 2: rows 5-134 -> tiles 1-2; group 3: row 135 -> tile 3
    np.testing.assert_array_equal(dest[2:5], [0, 1, 2])
    np.testing.assert_array_equal(dest[5:135], 128 + np.arange(130))
    assert dest[135] == 3 * 128
    np.testing.assert_array_equal(table, [0, 2, 2, 3] + [-1] * (tiles - 4))
    owned = dest < tiles * 128
    assert len(set(dest[owned])) == owned.sum()  # no two rows share a padded row
