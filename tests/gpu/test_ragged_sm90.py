"""`ragged_gemm` on a Hopper GPU: both grouped kernels, the decode kernel and the register-weight
(prefill) kernel, equal the reference backend (skipped without one). Most tests run once per
kernel (the `kernel` fixture forces it with JAX_BLOCKSCALE_SM90_RAGGED_KERNEL; where the prefill
kernel cannot run a problem, K % 64 != 0, the decode kernel must).

Fresh random data every check (never zeros); the allocator is filled with NaN first, so a row the
kernel fails to write (including the zero rows past the groups) shows up. Errors are relative
Frobenius errors against `backend="reference"`: < 1e-5 for f32 output (dequantization is exact
in both; only the f32 accumulation order differs), output rounding for bf16 / f16.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import jax
import jax.numpy as jnp

import jax_blockscale as jbs
from jax_blockscale.ragged import api as ragged_api
from jax_blockscale.ragged import primitive as ragged_mod
from jax_blockscale.ragged import ragged_gemm_spec
from jax_blockscale.lowering import plan as planner
from jax_blockscale.lowering import ragged_sm90
from jax_blockscale.catalog import sm90 as cat
from configure import set_env  # tests/support/configure.py
from hopper import needs_sm90, poison  # tests/support/hopper.py

pytestmark = [pytest.mark.gpu, needs_sm90]

PAIRS = [(None, "nvfp4"), (None, "mxfp4"), (None, "mxfp8_e4m3"), (None, "mxfp8_e5m2"),
         ("nvfp4", "nvfp4"), ("mxfp4", "mxfp4"), ("mxfp8_e4m3", "mxfp8_e5m2"),
         ("mxfp8_e5m2", "mxfp8_e4m3")]
OUTS = {"f32": (jnp.float32, 1e-5), "bf16": (jnp.bfloat16, 8e-3), "f16": (jnp.float16, 1e-3)}
_seed = [5000]


def _rng():
    _seed[0] += 1
    return np.random.default_rng(_seed[0])


def _problem(fmt_lhs, fmt_rhs, sizes, m, n, k, *, layout_lhs="plain", per_expert_scale=True):
    rng = _rng()
    g = len(sizes)
    x = rng.standard_normal((m, k)).astype(np.float32)
    w = (rng.standard_normal((g, n, k)) / np.sqrt(k)).astype(np.float32)
    w[:, :, :k // 3] *= 4.0  # blocks of different magnitudes (different scales)
    gkw = dict(global_scale="per_matrix") if fmt_rhs == "nvfp4" and per_expert_scale else {}
    rhs = jbs.quantize(w, fmt_rhs, layout="blocked", **gkw)
    lhs = (jnp.asarray(x, jnp.bfloat16) if fmt_lhs is None
           else jbs.quantize(x, fmt_lhs, layout=layout_lhs))
    return lhs, rhs, jnp.asarray(np.asarray(sizes, np.int32))


@pytest.fixture(params=["decode", "prefill"])
def kernel(request, monkeypatch):
    """The grouped kernel the planner is told to take for this test."""
    set_env(monkeypatch, JAX_BLOCKSCALE_SM90_RAGGED_KERNEL=request.param)
    return request.param


def _expected_kernel(mode, rhs, k):
    """The RaggedPlan kernel a forced mode gives: prefill where its variants can run."""
    if mode == "prefill" and k % cat.K_TILE == 0 and (
            cat.KIND_OF_FORMAT[rhs.fmt] in cat.REGISTER_WEIGHT_KINDS):
        return "ragged_prefill"
    return "ragged_decode"


def _plan_of(lhs, rhs, gs, out_dtype):
    """The plan the sm90 ragged backend makes for this call (the kernel must be what runs)."""
    spec = ragged_gemm_spec(lhs, rhs, gs, out_dtype=out_dtype)
    return planner.plan_ragged_sm90(spec, planner.device_for("cuda"))


def _compare(lhs, rhs, gs, out="bf16", mode=None):
    dtype, tol = OUTS[out]
    p = _plan_of(lhs, rhs, gs, dtype)
    assert not isinstance(p, str), p
    if mode is not None:
        assert p.kernel == _expected_kernel(mode, rhs, rhs.shape[-1]), p
    poison()
    got = jax.jit(lambda a, b, g: jbs.ragged_gemm(a, b, g, out_dtype=dtype))(lhs, rhs, gs)
    want = jax.jit(lambda a, b, g: jbs.ragged_gemm(a, b, g, out_dtype=dtype,
                                                   backend="reference"))(lhs, rhs, gs)
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.dtype == want.dtype and got.shape == want.shape
    assert np.all(np.isfinite(got)), "unwritten (NaN) output elements"
    total = int(np.clip(np.asarray(gs), 0, None).sum())
    assert not np.any(got[min(total, got.shape[0]):]), "rows past the groups must be zero"
    err = np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30)
    assert err < tol, (err, p)
    return p


@pytest.mark.parametrize("fmt_lhs,fmt_rhs", PAIRS)
@pytest.mark.parametrize("out", ["bf16", "f32"])
def test_every_pair(fmt_lhs, fmt_rhs, out, kernel):
    sizes = [3, 0, 9, 1, 0, 17, 2, 5]  # empty experts, one past a 16-row item, sum 37 < M
    lhs, rhs, gs = _problem(fmt_lhs, fmt_rhs, sizes, 48, 384, 512)
    _compare(lhs, rhs, gs, out, kernel)


@pytest.mark.parametrize("m,g,n,k,sizes", [
    (1, 8, 256, 256, "one"),  # a single decode token's row
    (16 * 8, 128, 1536, 2048, "topk"),  # Qwen3-30B-A3B gate+up at 16 tokens
    (4 * 4, 32, 5760, 2880, "topk"),  # gpt-oss-20b at 4 tokens
    (300, 16, 200, 96, "random"),  # odd N (past a 128-row tile), few K chunks
    (1024, 64, 384, 256, "random"),  # 16 rows per expert on average: 32-row items (nt = 4)
    (2048, 64, 384, 256, "random"),  # 32 rows per expert on average: 32-row items too
    (1000, 16, 256, 128, "heavy"),  # 62 rows per expert on average: 64-row items (nt = 8)
    (4096, 8, 256, 256, "random"),  # 512 rows per expert: eight 64-row items each (prefill)
])
def test_shapes_and_routings(m, g, n, k, sizes, kernel):
    rng = _rng()
    if sizes == "one":
        s = np.zeros(g, np.int64)
        s[5] = 1
    elif sizes == "topk":  # tokens x top_k rows over random experts
        s = np.bincount(rng.integers(0, g, m), minlength=g)
    elif sizes == "heavy":
        s = np.bincount(rng.integers(0, g, m - 300), minlength=g)
        s[3] += 300
    else:
        s = np.bincount(rng.integers(0, g, m - 7), minlength=g)  # 7 rows past the sum
    for fmt in ("mxfp4", "nvfp4"):
        lhs, rhs, gs = _problem(None, fmt, s.tolist(), m, n, k)
        _compare(lhs, rhs, gs, "f32", kernel)


def test_out_of_range_group_sizes_are_clamped(kernel):
    """Negative sizes count as 0, a group running past M is cut there, later groups get no rows:
    what the reference computes, no read or write out of bounds (the NaN-filled memory and the
    shapes around the buffers would show it)."""
    for sizes in ([5, -3, 40, 9, 2, 0, 1, 1], [70, 10, 0, 0, 0, 0, 0, 3], [-1] * 8,
                  [2**30, 2**30, 5, 0, 0, 0, 0, 1]):
        lhs, rhs, gs = _problem(None, "nvfp4", sizes, 64, 256, 256)
        _compare(lhs, rhs, gs, "f32", kernel)


@pytest.mark.parametrize("g,m,nt_rows,h200_rows", [
    (1, 40, 64, 64), (33, 64, 8, 8), (64, 512, 16, 16), (100, 1000, 32, 16), (60, 1200, 32, 32),
    (300, 600, 8, 8), (1100, 64, 8, 8)])
def test_decode_kernel_makes_its_items_from_the_raw_sizes(g, m, nt_rows, h200_rows, monkeypatch):
    """Sizes mode (the grouped decode kernel reads the raw group sizes, every warp makes its
    CTA's item): one expert per lane and several (G past 32, up to 35 per lane at G = 1100),
    G not a multiple of 32, item heights 8 to 64 rows (the H200 keeps 16-row items to 13 rows
    per expert), and sizes that must be clamped (negative, int32 extremes whose sum would
    overflow, a group past M) beside random routing."""
    set_env(monkeypatch, JAX_BLOCKSCALE_SM90_RAGGED_KERNEL="decode")
    rng = _rng()
    routed = np.bincount(rng.integers(0, g, m - 3), minlength=g)
    wild = rng.integers(-3, 9, g)
    wild[rng.integers(g)] = 2**31 - 1
    wild[rng.integers(g)] = -2**31
    for sizes in (routed, wild):
        lhs, rhs, gs = _problem(None, "mxfp4", sizes.tolist(), m, 136, 64)
        p = _compare(lhs, rhs, gs, "f32")
        assert p.kernel == "ragged_decode" and p.raw_sizes, p
        if sizes is routed:
            card = planner.device_for("cuda").card
            assert p.tile[0] == (h200_rows if card == "h200" else nt_rows), p


def _force_decode_plan(monkeypatch, splits, per_cta=None, nt=None):
    """The grouped decode kernel, with its split count forced, and its tiles of N per CTA and
    item height (n8 tiles) where given (else as the catalogue chooses them)."""
    set_env(monkeypatch, JAX_BLOCKSCALE_SM90_RAGGED_KERNEL="decode")
    choose = cat.choose_ragged_decode_variant

    def forced(m, n, k, groups, *args, **kw):
        v, _, items = choose(m, n, k, groups, *args, **kw)
        if nt is not None:
            v, items = dataclasses.replace(v, nt=nt), cat.ragged_decode_items(m, groups, nt)
        return v, splits, items
    monkeypatch.setattr(cat, "choose_ragged_decode_variant", forced)
    if per_cta is not None:
        monkeypatch.setattr(cat, "ragged_decode_tiles_per_cta", lambda *args, **kw: per_cta)


@pytest.mark.parametrize("per_cta", [2, 3, 16])
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("work", ["sizes", "table"])
def test_decode_kernel_runs_several_tiles_of_n_per_cta(per_cta, splits, work, monkeypatch):
    """CTAs over several adjacent tiles of N (the ring runs on from one tile's weights to the
    next; each tile's outputs written as it ends): N not a multiple of the tiles per CTA (the
    last CTA has fewer, or all tiles are one CTA's), K split (three splits of four K chunks: the
    last split's range is empty and writes zeros), experts with no rows and rows past the
    groups (zero items over several tiles), on 8- and 16-row items, in sizes mode and from
    XLA's work table."""
    _force_decode_plan(monkeypatch, splits, per_cta)
    if work == "table":
        plan_ragged = ragged_sm90.plan_ragged_sm90
        monkeypatch.setattr(ragged_sm90, "plan_ragged_sm90", lambda *args: dataclasses.replace(
            plan_ragged(*args), raw_sizes=False))
    for m, sizes, bn in (
            (12, [0, 3, 1, 0, 2, 4, 0, 1], 128),  # 8-row items: 128-row tiles, 8 of them
            (40, [0, 7, 3, 0, 12, 9], 128)):  # 16-row items: 128-row tiles too
        for fmt in ("mxfp4", "nvfp4"):
            lhs, rhs, gs = _problem(None, fmt, sizes, m, 1000, 2048)
            p = _compare(lhs, rhs, gs, "f32")
            assert (p.kernel, p.tiles_per_cta, p.splits, p.tile[1]) == (
                "ragged_decode", per_cta, splits, bn), p


@pytest.mark.parametrize("per_cta", [1, 3])
@pytest.mark.parametrize("splits", [1, 2, 4])
@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4", "mxfp8_e4m3"])
def test_decode_kernel_skips_the_steps_past_k(per_cta, splits, fmt, monkeypatch):
    """K whose last sub-chunk holds 1, 2, 3 or 4 steps of K (the last one half full, or all
    whole: Qwen3-30B-A3B's K = 768), one tile of N per CTA or several (each tile's last
    sub-chunk then comes between full ones of the next tile), K unsplit or in ranges. Four
    ranges over 5.6 sub-chunks (gpt-oss's K = 2880) are 2, 2, 1.6 and none: the last range
    begins past K, is empty and must write zeros (no last sub-chunk to skip steps in). The
    grouped kernel skips each tile's steps past K and no others."""
    _force_decode_plan(monkeypatch, splits, per_cta)
    se = 64 if fmt.startswith("mxfp8") else 128  # K elements per step, 4 steps a sub-chunk
    ks = [4 * se + steps * se - se // 2 for steps in (1, 2, 3, 4)] + [6 * se]
    if splits == 4:
        ks = [20 * se + 2 * se + se // 2]  # 5.6 sub-chunks
    for k in ks:
        lhs, rhs, gs = _problem(None, fmt, [0, 3, 1, 0, 2, 4, 0, 1], 12, 1000, k)
        p = _compare(lhs, rhs, gs, "f32")
        assert (p.kernel, p.tiles_per_cta, p.splits) == ("ragged_decode", per_cta, splits), p


def test_blocked_activation_scales_and_f16_output(kernel):
    lhs, rhs, gs = _problem("mxfp4", "mxfp4", [10, 0, 100, 20, 0, 1], 200, 512, 256,
                            layout_lhs="blocked")
    _compare(lhs, rhs, gs, "f16", kernel)


def test_scalar_global_scale_and_plain_weight_scales(kernel):
    lhs, rhs, gs = _problem("nvfp4", "nvfp4", [7, 0, 9, 16], 40, 256, 512,
                            per_expert_scale=False)
    _compare(lhs, rhs, gs, "bf16", kernel)
    rhs_plain = jbs.to_plain(rhs)
    _compare(lhs, rhs_plain, gs, "bf16", kernel)


def test_rows_past_the_groups_span_several_tiles(kernel):
    """The zero item after the last group covers more rows than any tile (293 of 300 here): the
    kernels write all of them (the NaN-filled memory would show a row left out)."""
    lhs, rhs, gs = _problem(None, "mxfp8_e4m3", [3, 0, 4], 300, 320, 192)
    _compare(lhs, rhs, gs, "bf16", kernel)


@pytest.mark.parametrize("fmt_lhs,fmt_rhs", [(None, "mxfp4"), (None, "nvfp4"),
                                             ("mxfp8_e4m3", "mxfp8_e4m3")])
def test_prefill_sizes_take_the_register_weight_kernel(fmt_lhs, fmt_rhs):
    """With no forcing, the planner gives many rows per expert to the grouped register-weight
    kernel (here ~190 per expert: 128-row items, several per expert, and uneven routing)."""
    assert cat.RAGGED_PREFILL_WIDE_ROWS <= 188 < cat.RAGGED_PREFILL_WIDEST_ROWS
    rng = _rng()
    m, g = 3000, 16
    s = np.bincount(rng.integers(0, g, m - 11), minlength=g)
    s[2] = 0  # an expert with no rows
    lhs, rhs, gs = _problem(fmt_lhs, fmt_rhs, s.tolist(), m, 640, 1024)
    p = _compare(lhs, rhs, gs, "bf16")
    assert p.kernel == "ragged_prefill" and p.tile[0] == 128, p


@pytest.mark.parametrize("fmt_lhs,fmt_rhs", [(None, "mxfp4"), (None, "nvfp4"),
                                             ("mxfp4", "mxfp4"), ("nvfp4", "nvfp4")])
def test_narrow_items_take_the_register_weight_kernel(fmt_lhs, fmt_rhs):
    """With no forcing, ~24 rows per expert of long weight tiles (N = 2880, K = 2880, as
    gpt-oss's down projection) go to the register-weight kernel's items for long tiles on this
    card (32 rows; 64 on the H200) (uneven routing: experts past one item, an empty one, rows
    past the groups), weight-only or with the activation quantized too."""
    sizes = [48, 12, 20, 0, 28, 26, 22, 25]  # 181 of 192 rows; expert 0 takes two 32-row items
    m, g = 192, len(sizes)
    lhs, rhs, gs = _problem(fmt_lhs, fmt_rhs, sizes, m, 2880, 2880)
    card = planner.device_for("cuda").card
    assert cat.register_weights_win_early(m, 2880, 2880, g, fmt_lhs, fmt_rhs,
                                          cat.DEFAULT_SM_COUNT, card=card)
    p = _compare(lhs, rhs, gs, "bf16")
    assert p.kernel == "ragged_prefill", p
    assert p.tile == (cat.ragged_prefill_long_tiles(card, fmt_lhs, fmt_rhs)[1], 128), p


@pytest.mark.parametrize("fmt_lhs,fmt_rhs", [(None, "mxfp4"), (None, "nvfp4"),
                                             ("nvfp4", "nvfp4"), (None, "mxfp8_e4m3")])
def test_sixteen_row_items_at_twelve_rows_per_expert(fmt_lhs, fmt_rhs):
    """~12 rows per expert of long weight tiles: the H200's 16-row decode items (the busiest
    experts take two, one expert none), elsewhere the catalogue's own choice; the numbers
    against the reference either way."""
    sizes = [12, 30, 9, 0, 14, 11, 16, 17, 5, 13]  # 127 of 130 rows; expert 1 takes two items
    lhs, rhs, gs = _problem(fmt_lhs, fmt_rhs, sizes, 130, 2880, 2880)
    p = _compare(lhs, rhs, gs, "bf16")
    if planner.device_for("cuda").card == "h200":
        assert p.kernel == "ragged_decode" and p.nt == 2, p


@pytest.mark.parametrize("splits", [1, 2])
@pytest.mark.parametrize("nt", sorted(cat.GROUPED_ITEM_NTS))
@pytest.mark.parametrize("fmt_lhs,fmt_rhs", [(None, "mxfp4"), (None, "nvfp4"),
                                             ("nvfp4", "nvfp4"), (None, "mxfp8_e4m3")])
def test_items_on_both_sides_of_the_narrow_loop(fmt_lhs, fmt_rhs, nt, splits, monkeypatch):
    """Items of 8 nt rows (nt forced) whose CTAs run the narrower main loops of GROUPED_ITEM_NTS
    where the item's rows fit one: experts of 1 row, of exactly each narrower height, one more,
    a whole item, one more (a full item and a short one), an empty expert, several items and
    a short last one, rows past the groups; K unsplit and split in two. Against the
    reference: a narrow loop that dropped or misplaced a row's products, or a wide one taken
    by a short item's neighbour, shows."""
    narrower = [8 * h for h in cat.grouped_item_nts(nt)[:-1]]
    rows = 8 * nt
    sizes = ([1] + [s for h in narrower for s in (h, h + 1, rows + h, rows + h + 1)]
             + [rows, rows + 1, 0, 2 * rows + 5, 3])
    m = sum(sizes) + 5
    _force_decode_plan(monkeypatch, splits, nt=nt)
    lhs, rhs, gs = _problem(fmt_lhs, fmt_rhs, sizes, m, 384, 1024)
    p = _compare(lhs, rhs, gs, "f32")
    assert (p.kernel, p.nt, p.splits) == ("ragged_decode", nt, splits), p


# Group sizes for the register-weight kernel's item heights (2027 rows): groups shorter than an
# item, of exactly one, past one and over several (600: two 256-row items and a part), an empty
# one, one row, and last items on both sides of each narrower wgmma width
ITEM_HEIGHT_SIZES = [600, 0, 37, 256, 255, 1, 300, 129, 16, 17, 31, 33, 64, 65, 32, 160]


@pytest.mark.parametrize("k", [512, 576])
@pytest.mark.parametrize("tile_m", [t for t, _ in cat.RAGGED_PREFILL_TILES])
@pytest.mark.parametrize("fmt_lhs,fmt_rhs,out", [(None, "nvfp4", "bf16"), (None, "mxfp4", "f32"),
                                                 (None, "mxfp8_e5m2", "f16"),
                                                 ("nvfp4", "nvfp4", "f32")])
def test_every_item_height_of_the_register_weight_kernel(tile_m, fmt_lhs, fmt_rhs, out, k,
                                                         monkeypatch):
    """Each item height of the grouped register-weight kernel, forced, on every weight kind:
    groups shorter than an item, of exactly one, past one and over several (600 rows: two
    256-row items and a part), an empty expert, one row, rows past the groups' sum; an even and
    an odd number of 64-element k-tiles (the 32-row items split them over two k-groups of warp
    groups). The last items of the groups hold 1 to tile_m rows, on both sides of each
    narrower wgmma width the 64- and 128-row tiles run such items on (a half and a quarter of
    the tile: 16, 17, 31, 32, 33, 64, 65 rows and more)."""
    set_env(monkeypatch, JAX_BLOCKSCALE_SM90_RAGGED_KERNEL="prefill",
            JAX_BLOCKSCALE_SM90_RAGGED_TILE_M=str(tile_m))
    sizes = ITEM_HEIGHT_SIZES
    lhs, rhs, gs = _problem(fmt_lhs, fmt_rhs, sizes, 2060, 384, k)
    p = _compare(lhs, rhs, gs, out, "prefill")
    assert p.tile == (tile_m, 128), p


@pytest.mark.parametrize("tile_m", [t for t, _ in cat.RAGGED_PREFILL_TILES])
@pytest.mark.parametrize("out,n", [("bf16", 384), ("f16", 384), ("bf16", 300)])
def test_register_weight_kernel_16_bit_outputs_are_its_f32_outputs_rounded(tile_m, out, n,
                                                                          monkeypatch):
    """A bf16 / f16 call of the grouped register-weight kernel writes, bit for bit, its own f32
    result rounded to nearest-even: the same tiles sum the same k-tiles, and only the epilogue
    differs (16-bit outputs go through shared memory in whole 16-byte runs of N where N % 8 == 0,
    one by one otherwise; docs/design/sm90_fused.md, "The staged epilogue"). Items of 1 to 600
    rows, so that a tile's last rows, the narrower wgmma widths and the 256-row tile's two passes
    are all stored; rows past the groups must be zeros."""
    set_env(monkeypatch, JAX_BLOCKSCALE_SM90_RAGGED_KERNEL="prefill",
            JAX_BLOCKSCALE_SM90_RAGGED_TILE_M=str(tile_m))
    sizes = ITEM_HEIGHT_SIZES
    lhs, rhs, gs = _problem(None, "nvfp4", sizes, 2060, n, 512)
    dtype = OUTS[out][0]
    p = _compare(lhs, rhs, gs, out, "prefill")
    assert p.tile == (tile_m, 128), p
    f = jax.jit(lambda a, b, g, d: jbs.ragged_gemm(a, b, g, out_dtype=d), static_argnums=3)
    poison()
    got = np.asarray(f(lhs, rhs, gs, dtype))
    want = np.asarray(f(lhs, rhs, gs, jnp.float32).astype(dtype))
    assert np.array_equal(got.view(np.uint16), want.view(np.uint16))


def _mxfp4_experts_with_large_scales(rng, g, n, k, whole_row_expert):
    """G MXFP4 experts (N, K), blocked scales, some of whose blocks are scaled up by 2^9 to 2^14
    beside ordinary ones: rows of expert 1 over one K range, a whole row of `whole_row_expert`,
    and one block alone in the last expert's last row and K block."""
    w = (rng.standard_normal((g, n, k)) / np.sqrt(k)).astype(np.float32)
    w[1, 5:90:9, 32:96] *= 2.0 ** 14
    w[whole_row_expert, 200, :] *= 2.0 ** 9
    w[g - 1, n - 1, k - 32:] *= 2.0 ** 12
    rhs = jbs.quantize(w, "mxfp4", layout="blocked")
    assert int(np.max(np.asarray(rhs.scales).view(np.uint8))) > 128
    return rhs


@pytest.mark.parametrize("m,nt", [(8, None), (40, None), (150, 4)])
def test_decode_kernel_mxfp4_large_block_scales(m, nt, monkeypatch):
    """The grouped decode kernel with MXFP4 experts some of whose blocks are scaled up by 2^9 to
    2^14 (e8m0 scales far over 1, beside ordinary blocks of the same items): equal to the
    reference. A CTA whose tiles hold such a scale runs the unfolded loop, the others the
    folded one (Sm90DecodeGemm.mx_fold); one block alone in the last expert's last row and K
    block checks the far end of a CTA's scale check. With 32-row items forced (nt = 4), the
    experts' rows reach each item height's loop (16, 24 and 32 rows), folded and unfolded."""
    if nt is None:
        set_env(monkeypatch, JAX_BLOCKSCALE_SM90_RAGGED_KERNEL="decode")
    else:
        _force_decode_plan(monkeypatch, 1, nt=nt)
    rng = _rng()
    g, n, k = 8, 384, 512
    sizes = np.bincount(rng.integers(0, g, m - 3), minlength=g)
    if nt is not None:  # items of 1-16, 17-24 and 25-32 rows, each on its own loop
        sizes = np.array([16, 24, 20, 32, 30, 3, 17, 5])
        m = int(sizes.sum()) + 3
    sizes[g - 1] += 1  # the last expert owns a row
    x = rng.standard_normal((m, k)).astype(np.float32)
    # nt = 4: the CTAs of expert 1 (24 rows) and 3 (32) whose tiles of N hold the scaled weight
    # rows run unfolded loops; their other tiles and experts 6 (17) and 4 (30) folded ones
    rhs = _mxfp4_experts_with_large_scales(rng, g, n, k, whole_row_expert=6 if nt is None else 3)
    p = _compare(jnp.asarray(x, jnp.bfloat16), rhs, jnp.asarray(sizes.astype(np.int32)), "f32",
                 "decode")
    assert p.kernel == "ragged_decode", p


@pytest.mark.parametrize("tile_m", [32, 64, 128, 256])
def test_register_weight_kernel_mxfp4_large_block_scales(tile_m, monkeypatch):
    """The grouped register-weight kernel with MXFP4 experts some of whose blocks are scaled up
    by 2^9 to 2^14 (e8m0 scales far over 1, beside ordinary blocks of the same tiles): equal to
    the reference on every wgmma width. The scaled blocks sit in an expert of 5 rows (a narrow
    item), one of 130 (a whole item and a narrow one), and alone in the last expert's last row
    and K block; 32-row tiles split their k-tiles between two k-groups, 256-row ones take a
    whole expert of 130 rows."""
    set_env(monkeypatch, JAX_BLOCKSCALE_SM90_RAGGED_KERNEL="prefill",
            JAX_BLOCKSCALE_SM90_RAGGED_TILE_M=str(tile_m))
    rng = _rng()
    g, n, k = 8, 384, 512
    sizes = np.array([70, 5, 40, 0, 130, 3, 33, 20])
    x = rng.standard_normal((int(sizes.sum()) + 7, k)).astype(np.float32)
    rhs = _mxfp4_experts_with_large_scales(rng, g, n, k, whole_row_expert=4)
    p = _compare(jnp.asarray(x, jnp.bfloat16), rhs, jnp.asarray(sizes.astype(np.int32)), "f32",
                 "prefill")
    assert p.tile == (tile_m, 128), p


def test_split_k_is_planned_and_correct():
    """Few experts hit at a long K: the plan splits K, the finalize adds the splits."""
    lhs, rhs, gs = _problem(None, "mxfp4", [0, 2, 0, 0], 4, 256, 8192)
    p = _compare(lhs, rhs, gs, "bf16")
    assert p.splits > 1, p


@pytest.mark.parametrize("fmt_lhs,fmt_rhs,sizes,m,n,k", [
    (None, "mxfp4", [0, 2, 0, 0], 4, 256, 8192),
    (None, "nvfp4", [3, 0, 1, 9, 0, 2], 16, 640, 4096),
    ("nvfp4", "nvfp4", [1, 0, 0, 0, 0, 0, 0, 0], 1, 2880, 2880),
])
def test_split_partials_added_by_xla_equal_the_finalize_kernel(monkeypatch, fmt_lhs, fmt_rhs,
                                                               sizes, m, n, k):
    """A split grouped decode call leaves its partials (each expert's alpha applied) for the
    lowering to add in XLA; the kernel's own finalize adds them in the same order: the same
    bits, and the rows no expert owns zero either way. (The catalogue's default split rule on
    every card: K = 2880 at one token stays whole on the H200.)"""
    from jax_blockscale.lowering import ffi_sm90  # noqa: PLC0415
    monkeypatch.setattr(cat, "RAGGED_DECODE_MIN_SPLIT_CHUNKS_BY_CARD", {})

    lhs, rhs, gs = _problem(fmt_lhs, fmt_rhs, sizes, m, n, k)

    def run(partials):  # a new function each time: jit's cache would keep the first lowering
        f = jax.jit(lambda a, b, g: jbs.ragged_gemm(a, b, g, out_dtype=jnp.float32))
        (call,) = [ln for ln in f.lower(lhs, rhs, gs).as_text().splitlines()
                   if "custom_call @jax_blockscale_ragged_gemm_sm90" in ln]
        assert f"partials = {partials} :" in call and "splits = 1 :" not in call, call
        poison()
        return np.asarray(f(lhs, rhs, gs))

    by_xla = run(1)
    monkeypatch.setattr(ffi_sm90, "leaves_partials", lambda plan: False)
    by_kernel = run(0)
    np.testing.assert_array_equal(by_xla, by_kernel)
    assert not np.any(by_xla[sum(sizes):]) and np.all(np.isfinite(by_xla))


def test_expert_parallel_row_start(kernel):
    """The local primitive with a shifted first row (the expert-parallel rule's per-device
    call): rows before row_start and past the groups are zero."""
    lhs, rhs, gs = _problem(None, "nvfp4", [3, 0, 5, 2], 24, 256, 256)
    params = dict(fmt_lhs=None, fmt_rhs=rhs.fmt, layout_lhs=None, layout_rhs=rhs.layout,
                  out_dtype=np.dtype(jnp.float32), alpha_is_one=False)
    operands = ragged_mod.join_operands(lhs, rhs.data, None, rhs.scales, gs,
                                        jnp.asarray(rhs.global_scale, jnp.float32))
    outs = {}
    for backend in ("sm90", "reference"):
        f = jax.jit(lambda *ops, b=backend: ragged_mod.bind_local(
            ops, dict(params, backend=b), row_start=jnp.int32(6)))
        poison()
        outs[backend] = np.asarray(f(*operands))
    got, want = outs["sm90"], outs["reference"]
    assert np.all(np.isfinite(got)) and not np.any(got[:6]) and not np.any(got[16:])
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 1e-5



def test_vmap_grad_and_export_run_the_kernel(kernel):
    """vmap over sequences sharing experts (one merged grouped call), grad with respect to a
    plain activation, and a jax.export round trip: the kernel's custom call is in the program
    and the values equal the reference's."""
    target = "jax_blockscale_ragged_gemm_sm90"
    lhs, rhs, gs = _problem(None, "mxfp4", [5, 0, 7, 4], 20, 256, 256)
    xs = jnp.stack([lhs, lhs[::-1]])
    gss = jnp.stack([gs, jnp.asarray([1, 9, 0, 6], jnp.int32)])

    def f(x, g, backend=None):
        return jbs.ragged_gemm(x, rhs, g, out_dtype=jnp.float32, backend=backend)

    batched = jax.jit(jax.vmap(f))
    assert target in batched.lower(xs, gss).as_text()
    got = np.asarray(batched(xs, gss))
    want = np.asarray(jax.vmap(lambda x, g: f(x, g, "reference"))(xs, gss))
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 1e-5

    def loss(x, backend=None):
        return jnp.sum(f(x, gs, backend) ** 2)

    g_got = np.asarray(jax.jit(jax.grad(loss))(lhs), np.float32)
    g_want = np.asarray(jax.grad(lambda x: loss(x, "reference"))(lhs), np.float32)
    assert np.linalg.norm(g_got - g_want) / np.linalg.norm(g_want) < 1e-2  # bf16 gradient

    exp = jax.export.export(jax.jit(f), disabled_checks=[
        jax.export.DisabledSafetyCheck.custom_call(target)])(lhs, gs)
    assert target in exp.mlir_module()
    back = jax.export.deserialize(exp.serialize())
    np.testing.assert_array_equal(np.asarray(back.call(lhs, gs)), np.asarray(jax.jit(f)(lhs, gs)))


def _shards(lhs, rhs, gs, out_dtype, split, plan_shape):
    """The two shards of a 2-device expert (`split="experts"`) or N (`"n"`) split of this call,
    as ragged_sharding.py runs them, here one after the other on this GPU."""
    operands, params = ragged_api._operands_and_params(lhs, rhs, gs, out_dtype, None)
    params = dict(params, out_dtype=np.dtype(out_dtype))
    x, w, sl, sr, sizes, alpha = ragged_mod.split_operands(operands, params["fmt_lhs"])
    g, n = w.shape[0], w.shape[1]
    outs = []
    for j in range(2):
        if split == "experts":
            e = slice(j * g // 2, (j + 1) * g // 2)
            row_start = jnp.sum(sizes[:e.start]).astype(jnp.int32)
            ops = ragged_mod.join_operands(x, w[e], sl, sr[e], sizes[e], alpha[e])
        else:  # N in whole 128-row scale tiles
            cols = slice(j * n // 2, (j + 1) * n // 2)
            tiles = slice(j * n // 256, (j + 1) * n // 256)
            row_start = None
            ops = ragged_mod.join_operands(x, w[:, cols], sl, sr[:, tiles], sizes, alpha)
        outs.append(jax.jit(lambda *o, rs: ragged_mod.bind_local(o, params, rs, plan_shape))(
            *ops, rs=row_start))
    return outs


@pytest.mark.parametrize("fmt_lhs,fmt_rhs", [(None, "nvfp4"), (None, "mxfp4"),
                                             ("nvfp4", "nvfp4")])
@pytest.mark.parametrize("split", ["experts", "n"])
def test_shards_of_a_sharded_call_equal_it_bit_for_bit(fmt_lhs, fmt_rhs, split, kernel):
    """Expert and N shards, planned as the unsharded call (plan_shape), give its bits: the sum of
    the expert shards (zeros outside each one's rows), the concatenation of the N shards. At this
    size a shard planned for itself runs another item height and split count (the build test
    test_ragged_shards_keep_the_unsharded_plan), which differ in the last bits."""
    sizes = [0, 9, 0, 3, 20, 1, 3, 0, 7, 0, 15, 2, 0, 31, 6, 10]  # sum 107 < M = 128
    lhs, rhs, gs = _problem(fmt_lhs, fmt_rhs, sizes, 128, 768, 512, layout_lhs="blocked")
    want = np.asarray(jax.jit(lambda a, b, g: jbs.ragged_gemm(a, b, g))(lhs, rhs, gs))
    a, b = (np.asarray(y) for y in _shards(lhs, rhs, gs, jnp.bfloat16, split, (128, 768, 16)))
    got = a + b if split == "experts" else np.concatenate([a, b], axis=1)
    bits = lambda y: np.asarray(y, np.float32).view(np.uint32)  # noqa: E731
    assert np.array_equal(bits(got), bits(want)), int((bits(got) != bits(want)).sum())
