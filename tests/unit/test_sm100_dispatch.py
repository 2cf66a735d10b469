"""choose_sm100_variant: the (tile, cluster, 1/2-CTA) pick for a problem."""

import itertools

import pytest

from jax_blockscale.catalog import sm100  # the pure-Python catalogue: no CuTeDSL needed

choose = sm100.choose_sm100_variant

PAIRS = sorted({(v.fmt_a, v.fmt_b) for v in sm100.VARIANTS})
SHAPES = [(1, 4096, 4096), (16, 7168, 2048), (128, 4096, 7168), (200, 72, 256),
          (512, 4096, 4096), (4096, 1024, 4096), (8192, 8192, 8192), (8192, 28672, 4096)]


@pytest.mark.parametrize("fmt_a,fmt_b", PAIRS)
@pytest.mark.parametrize("out", ["bfloat16", "float32"])
def test_pick_is_a_shipped_variant_that_can_run_the_problem(fmt_a, fmt_b, out):
    for m, n, k in SHAPES:
        k = max(k, 128)
        v = choose(m, n, k, fmt_a, fmt_b, out_dtype=out)
        if not sm100.variants_for(fmt_a, fmt_b, out):
            assert v is None
            continue
        assert v in sm100.VARIANTS
        assert (v.fmt_a, v.fmt_b, v.out_dtype) == (fmt_a, fmt_b, out)
        assert k % v.k_align == 0 and n % v.n_align == 0


def test_decode_shapes_use_one_cta_tiles():
    # One token: a 256-row pair tile would be 255/256 padding.
    for fmt in ("nvfp4", "mxfp8_e4m3"):
        v = choose(1, 4096, 4096, fmt, fmt)
        assert not v.two_cta and v.tile_n == 64, v.name


def test_large_square_problems_use_the_wide_pair_tile():
    for fmt in ("nvfp4", "mxfp8_e4m3", "mxfp4"):
        v = choose(8192, 8192, 8192, fmt, fmt)
        assert v.two_cta and v.tile_m == 256 and v.tile_n == 256, v.name


def test_clusters_larger_than_the_pair_only_when_the_grid_fills_them():
    two_by_two = [v for v in sm100.VARIANTS if v.cluster_m * v.cluster_n == 4]
    assert two_by_two, "the matrix ships a 2x2 cluster variant"
    for m, n in [(256, 256), (512, 512), (1024, 256)]:
        v = choose(m, n, 4096, "nvfp4", "nvfp4")
        assert v.cluster_m * v.cluster_n <= 2, (m, n, v.name)


def test_alignment_rules_reject_or_redirect():
    # nvfp4 rows must be whole 16-byte units: K % 32.
    assert choose(256, 256, 48, "nvfp4", "nvfp4") is None
    # bf16 output rows must be 16-byte aligned: N % 8.
    assert choose(256, 252, 256, "nvfp4", "nvfp4") is None
    # ... but f32 only needs N % 4.
    assert choose(256, 252, 256, "nvfp4", "nvfp4", out_dtype="float32") is not None
    # Unpacked fp6 needs K % 128.
    assert choose(256, 256, 96, "mxfp6_e2m3", "mxfp6_e2m3") is None
    assert choose(256, 256, 128, "mxfp6_e2m3", "mxfp6_e2m3") is not None


def test_mixed_pairs_only_get_mixed_kernels():
    v = choose(4096, 4096, 4096, "mxfp8_e4m3", "mxfp4")
    assert (v.fmt_a, v.fmt_b) == ("mxfp8_e4m3", "mxfp4") and v.kind == "mxf8f6f4"
    # B-operand order matters: the reverse pair is not shipped.
    assert choose(4096, 4096, 4096, "mxfp4", "mxfp8_e4m3") is None


def test_bad_arguments():
    with pytest.raises(ValueError, match="nvfp4"):
        choose(128, 128, 128, "nvfp4", "mxfp4")
    with pytest.raises(ValueError, match="unknown format"):
        choose(128, 128, 128, "fp4", "fp4")
    with pytest.raises(ValueError, match="positive"):
        choose(0, 128, 128, "nvfp4", "nvfp4")
    with pytest.raises(ValueError, match="sm_count"):
        choose(128, 128, 128, "nvfp4", "nvfp4", sm_count=0)


def test_pick_keeps_padded_work_bounded():
    """The pick may trade a little padding for a more efficient, larger MMA,
    but never does much more padded work per SM than the plain 128x128 1-CTA
    tile: guards against e.g. 256-row pair tiles for a handful of rows."""
    def per_sm_work(v, m, n, sms=148):
        tiles = -(-m // v.tile_m) * -(-n // v.tile_n)
        per_tile = 2 if v.two_cta else 1
        in_flight = (sms // (v.cluster_m * v.cluster_n)) * (v.cluster_m * v.cluster_n // per_tile)
        return -(-tiles // in_flight) * (v.tile_m // per_tile) * v.tile_n

    base = sm100.Sm100Variant("nvfp4", "nvfp4", "bfloat16", 128, 128)
    for m, n in itertools.product([1, 100, 640, 3000, 8192], [64, 1000, 4096, 20000]):
        n = -(-n // 8) * 8
        v = choose(m, n, 4096, "nvfp4", "nvfp4")
        assert per_sm_work(v, m, n) <= per_sm_work(base, m, n) * 1.25, (m, n, v.name)


def test_fewer_sms_never_break_the_pick():
    for sms in (1, 2, 8, 148, 160):
        assert choose(4096, 4096, 4096, "nvfp4", "nvfp4", sm_count=sms) is not None


def test_every_served_pair_and_output_has_a_kernel():
    for (a, b), out in itertools.product(sm100.PAIRS, ["bfloat16", "float16", "float32"]):
        v = choose(256, 256, 512, a, b, out_dtype=out)
        assert v is not None and (v.fmt_a, v.fmt_b, v.out_dtype) == (a, b, out)


def test_grouped_variants():
    """The grouped kernel: same-width pairs, 1-CTA 128 x 128 tiles, every output; a 2-CTA or
    clustered grouped variant is refused (a tile must hold one group)."""
    assert {(v.fmt_a, v.fmt_b) for v in sm100.GROUPED_VARIANTS} == set(sm100.GROUPED_PAIRS)
    assert all(v.grouped and (v.tile_m, v.tile_n, v.cluster_m, v.cluster_n) == (128, 128, 1, 1)
               for v in sm100.GROUPED_VARIANTS)
    assert not set(sm100.GROUPED_VARIANTS) & set(sm100.VARIANTS)
    with pytest.raises(ValueError, match="1-CTA"):
        sm100.Sm100Variant("nvfp4", "nvfp4", "bfloat16", 256, 128, 2, 1, grouped=True)
    assert sm100.choose_grouped_variant("nvfp4", "nvfp4", "float32", 64, 256).grouped
    assert sm100.choose_grouped_variant("nvfp4", "nvfp4", "bfloat16", 60, 256) is None  # N % 8
    assert sm100.choose_grouped_variant("mxfp8_e4m3", "mxfp4", "bfloat16", 64, 256) is None
    # the padded rows bound: every group that has rows may add one partial tile
    assert sm100.grouped_padded_rows(1, 128) == 2 * 128
    assert sm100.grouped_padded_rows(300, 4) == (3 + 4) * 128
