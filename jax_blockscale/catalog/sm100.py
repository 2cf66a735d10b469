"""The Blackwell (sm_100a / sm_103a) kernel catalogue: the formats the tcgen05 block-scaled MMA
takes, the format pairs and variants (tile, cluster, output) the library ships, the codes shared
with the C++ handler, and the tile heuristic. Pure Python: the runtime, the AOT build
(`jax_blockscale.aot_sm100`), the kernel (kernels/sm100_blockscaled.py) and the tests read it.
"""
from __future__ import annotations

import dataclasses
from typing import Optional, Sequence, Tuple

# Codes shared with the C++ handler (generated into jbs_codes_sm100.h by the AOT build)
FMT_CODES = {"nvfp4": 1, "mxfp4": 2, "mxfp6_e2m3": 3, "mxfp6_e3m2": 4, "mxfp8_e4m3": 5,
             "mxfp8_e5m2": 6}
OUT_CODES = {"bfloat16": 1, "float16": 2, "float32": 3}
ARCH_SM = {"sm_100a": 100, "sm_103a": 103}
# compute capabilities (as JAX reports them) whose cubins the library ships
BLACKWELL_CCS = ("10.0", "10.3")
# Multiprocessors the planner assumes when no GPU is visible (lowering on a CPU host): a B200.
DEFAULT_SM_COUNT = 148

# ---------------------------------------------------------------------------
# Formats and variants (pure Python: importable without CuTeDSL)
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Fmt:
    element: str  # cutlass numeric type name
    bits: int
    block: int  # elements per scale along K
    scale: str  # cutlass numeric type name of the scale


# The hardware view of the formats in DESIGN.md.  `jax_blockscale/formats.py` is
# the package's source of truth for names; this table only adds the CuTeDSL
# type names the kernel needs.
FORMATS = {
    "nvfp4": _Fmt("Float4E2M1FN", 4, 16, "Float8E4M3FN"),
    "mxfp4": _Fmt("Float4E2M1FN", 4, 32, "Float8E8M0FNU"),
    "mxfp6_e2m3": _Fmt("Float6E2M3FN", 6, 32, "Float8E8M0FNU"),
    "mxfp6_e3m2": _Fmt("Float6E3M2FN", 6, 32, "Float8E8M0FNU"),
    "mxfp8_e4m3": _Fmt("Float8E4M3FN", 8, 32, "Float8E8M0FNU"),
    "mxfp8_e5m2": _Fmt("Float8E5M2", 8, 32, "Float8E8M0FNU"),
}

OUT_DTYPES = {"float32": "Float32", "bfloat16": "BFloat16", "float16": "Float16"}

# Architectures we export cubins for.  sm_100a = B200/GB200, sm_103a = B300/GB300.
SM100_ARCHS = ("sm_100a", "sm_103a")


def check_format_pair(fmt_a: str, fmt_b: str) -> None:
    """Raise ValueError unless tcgen05 has a block-scaled MMA kind for the pair.

    nvfp4 (16-element blocks, e4m3 scales) only exists as fp4 x fp4
    (kind::mxf4nvf4); every MX pair maps to kind::mxf4 (fp4 x fp4) or
    kind::mxf8f6f4 (anything else, all with e8m0 scales and 32-element blocks).
    """
    for f in (fmt_a, fmt_b):
        if f not in FORMATS:
            raise ValueError(f"unknown format {f!r}; expected one of {sorted(FORMATS)}")
    if (fmt_a == "nvfp4") != (fmt_b == "nvfp4"):
        raise ValueError(
            f"nvfp4 can only be paired with nvfp4 on Blackwell, got ({fmt_a}, {fmt_b})"
        )


def mma_kind(fmt_a: str, fmt_b: str) -> str:
    """The tcgen05.mma `.kind` the pair compiles to (for docs, tests and logs)."""
    check_format_pair(fmt_a, fmt_b)
    if fmt_a == "nvfp4":
        return "mxf4nvf4"
    if FORMATS[fmt_a].bits == 4 and FORMATS[fmt_b].bits == 4:
        return "mxf4"
    return "mxf8f6f4"


def k_alignment(fmt_a: str, fmt_b: str) -> int:
    """K must be a multiple of this (elements) for the kernel's TMA descriptors.

    * a row of A/B must be a whole number of 16-byte units (TMA stride rule):
      32 fp4 or 16 fp8 elements;
    * when an operand is unpacked into byte containers (any fp6 operand, or
      mixed widths) the TMA unpack formats need rows of 128 elements;
    * and K is always a whole number of scale blocks.
    """
    a, b = FORMATS[fmt_a], FORMATS[fmt_b]
    if a.bits != b.bits or 6 in (a.bits, b.bits):
        return 128
    per_16_bytes = 128 // a.bits
    return max(per_16_bytes, a.block)


@dataclasses.dataclass(frozen=True)
class Sm100Variant:
    """One compiled kernel: formats, output dtype, tile and cluster shape."""

    fmt_a: str
    fmt_b: str
    out_dtype: str  # "float32" | "bfloat16" | "float16"
    tile_m: int  # 128 (1 CTA per MMA) or 256 (2-CTA pair MMA)
    tile_n: int  # 64 | 128 | 192 | 256
    cluster_m: int = 1
    cluster_n: int = 1
    # grouped: ragged_gemm's contiguous grouped kernel (A's rows padded per group to whole
    # tile_m tiles, B holding the groups as its L, one group per M tile from a table; see
    # GROUPED_VARIANTS)
    grouped: bool = False

    def __post_init__(self):
        check_format_pair(self.fmt_a, self.fmt_b)
        if self.out_dtype not in OUT_DTYPES:
            raise ValueError(f"out_dtype must be one of {sorted(OUT_DTYPES)}")
        if self.tile_m not in (128, 256):
            raise ValueError("tile_m must be 128 or 256")
        if self.tile_n not in (64, 128, 192, 256):
            raise ValueError("tile_n must be 64, 128, 192 or 256")
        for c in (self.cluster_m, self.cluster_n):
            if c not in (1, 2):
                raise ValueError("cluster dims must be 1 or 2 (up to 2x2)")
        if self.two_cta and self.cluster_m % 2:
            raise ValueError("a 256-row tile (2-CTA MMA) needs cluster_m == 2")
        if self.grouped and (self.two_cta or self.cluster_m * self.cluster_n != 1):
            raise ValueError("the grouped kernel runs 1-CTA tiles without clusters")

    @property
    def two_cta(self) -> bool:
        return self.tile_m == 256

    @property
    def kind(self) -> str:
        return mma_kind(self.fmt_a, self.fmt_b)

    @property
    def block(self) -> int:
        return FORMATS[self.fmt_a].block

    @property
    def k_align(self) -> int:
        return k_alignment(self.fmt_a, self.fmt_b)

    @property
    def n_align(self) -> int:
        """N must be a multiple of this: the output row stride must be 16 B."""
        return 4 if self.out_dtype == "float32" else 8

    @property
    def name(self) -> str:
        out = {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}[self.out_dtype]
        return (
            f"{'grouped_' if self.grouped else ''}{self.fmt_a}_x_{self.fmt_b}_{out}_"
            f"{self.tile_m}x{self.tile_n}_c{self.cluster_m}x{self.cluster_n}"
        )


def _family_variants(fmt_a, fmt_b, tiles, outs):
    return [
        Sm100Variant(fmt_a, fmt_b, o, tm, tn, cm, cn)
        for (tm, tn, cm, cn) in tiles
        for o in outs
    ]


# Tile menus.  "small" serves skinny N (decode), "base" is the 1-CTA default,
# "pair" and "pair_wide" are the 2-CTA tiles for large M.
_T_SMALL = (128, 64, 1, 1)
_T_BASE = (128, 128, 1, 1)
_T_WIDE = (128, 256, 1, 1)
_T_PAIR = (256, 128, 2, 1)
_T_PAIR_WIDE = (256, 256, 2, 1)
_T_PAIR_192 = (256, 192, 2, 1)
_T_PAIR_2X2 = (256, 256, 2, 2)

_ALL_OUT = ("bfloat16", "float16", "float32")

# Format pairs the library serves on Blackwell.  mxfp8 covers e4m3 and e5m2 on
# either side (the Hopper FFI passes them as runtime flags; here each is its own
# variant because the element types are baked into the MMA instruction).
PAIRS = (
    ("nvfp4", "nvfp4"),
    ("mxfp4", "mxfp4"),
    ("mxfp8_e4m3", "mxfp8_e4m3"),
    ("mxfp8_e4m3", "mxfp8_e5m2"),
    ("mxfp8_e5m2", "mxfp8_e4m3"),
    ("mxfp8_e5m2", "mxfp8_e5m2"),
    ("mxfp8_e4m3", "mxfp4"),
    ("mxfp8_e5m2", "mxfp4"),
    ("mxfp6_e2m3", "mxfp6_e2m3"),
    ("mxfp6_e3m2", "mxfp6_e3m2"),
    ("mxfp8_e4m3", "mxfp6_e2m3"),
)

# The exported matrix, compiled for every arch in SM100_ARCHS at build time.
# Every pair gets the 1-CTA 128x128 tile for every output dtype, so dispatch
# always has a kernel for a supported pair; the main inference families add
# tiles for decode (128x64) and for large problems (2-CTA pair tiles).
VARIANTS: Tuple[Sm100Variant, ...] = tuple(
    [v for a, b in PAIRS for v in _family_variants(a, b, (_T_BASE,), _ALL_OUT)]
    + _family_variants("nvfp4", "nvfp4", (_T_SMALL, _T_PAIR, _T_PAIR_WIDE), _ALL_OUT)
    + _family_variants("nvfp4", "nvfp4", (_T_PAIR_2X2, _T_WIDE), ("bfloat16",))
    + _family_variants("mxfp8_e4m3", "mxfp8_e4m3", (_T_SMALL, _T_PAIR, _T_PAIR_WIDE), _ALL_OUT)
    + _family_variants("mxfp4", "mxfp4", (_T_PAIR_WIDE,), _ALL_OUT)
    + _family_variants("mxfp8_e5m2", "mxfp8_e5m2", (_T_PAIR,), ("bfloat16", "float32"))
    + _family_variants("mxfp6_e2m3", "mxfp6_e2m3", (_T_PAIR,), ("bfloat16", "float32"))
    + _family_variants("mxfp6_e3m2", "mxfp6_e3m2", (_T_PAIR,), ("bfloat16", "float32"))
    + _family_variants("mxfp8_e4m3", "mxfp4", (_T_PAIR_192,), ("bfloat16", "float32"))
)


# ragged_gemm on Blackwell (lowering/ragged_sm100.py): the "contiguous grouped" form of the
# kernel. The lowering pads each group's rows of A to whole GROUPED_TILE_M-row tiles, so that
# every M tile belongs to one group, and passes an int32 table with the group of each M tile
# (-1: a tile no group owns: its loads and MMAs are skipped, its output rows are never read).
# B is (G, N, K) with the groups as the kernel's L, alpha one f32 per group. Same-width pairs,
# one 128 x 128 tile, every output dtype.
GROUPED_TILE_M = 128
GROUPED_PAIRS = (("nvfp4", "nvfp4"), ("mxfp4", "mxfp4"), ("mxfp8_e4m3", "mxfp8_e4m3"))
GROUPED_VARIANTS: Tuple[Sm100Variant, ...] = tuple(
    Sm100Variant(a, b, o, GROUPED_TILE_M, 128, grouped=True)
    for a, b in GROUPED_PAIRS for o in _ALL_OUT)


def grouped_padded_rows(m: int, groups: int, tile_m: int = GROUPED_TILE_M) -> int:
    """Rows of the padded activation for M rows in G groups: each group that has rows takes
    ceil(rows / tile_m) whole tiles, so at most ceil(M / tile_m) + min(G, M) tiles in all
    (a static bound; the group sizes are only known on the device)."""
    return (_ceil_div(m, tile_m) + min(groups, m)) * tile_m


def choose_grouped_variant(fmt_a: str, fmt_b: str, out_dtype: str, n: int, k: int
                           ) -> Optional[Sm100Variant]:
    """The grouped variant for the pair, or None where there is none or K / N break its
    alignment rules."""
    for v in GROUPED_VARIANTS:
        if ((v.fmt_a, v.fmt_b, v.out_dtype) == (fmt_a, fmt_b, out_dtype)
                and k % v.k_align == 0 and n % v.n_align == 0):
            return v
    return None


def variants_for(fmt_a: str, fmt_b: str, out_dtype: str,
                 variants: Sequence[Sm100Variant] = VARIANTS) -> list:
    return [v for v in variants
            if (v.fmt_a, v.fmt_b, v.out_dtype) == (fmt_a, fmt_b, out_dtype)]


# ---------------------------------------------------------------------------
# The tile heuristic (the planner calls it; nothing mirrors it)
# ---------------------------------------------------------------------------


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def choose_sm100_variant(m: int, n: int, k: int, fmt_a: str, fmt_b: str,
                         sm_count: int = 148, out_dtype: str = "bfloat16",
                         variants: Sequence[Sm100Variant] = VARIANTS,
                         ) -> Optional[Sm100Variant]:
    """Pick the variant for one (M, N, K) problem, or None if none can run it.

    A variant can run the problem when K and N meet its alignment rules (M has
    none: TMA zero-fills partial tiles on load and clips them on store).
    Among those, pick the smallest estimated time:

      waves      = ceil(tiles / tiles in flight); a 256-row pair tile holds
                   two SMs, and the launch is made of whole clusters;
      per-wave   = the output area one SM computes per tile (padding included,
                   so partial tiles cost what they occupy);
      efficiency = 1 + 32 * (1/MMA_M + 1/MMA_N): a small MMA tile re-reads its
                   operands from SMEM more often per flop, so 128x64 runs the
                   tensor core at roughly 57% of a 256x256 pair MMA's rate;
      ties go to the variant without an under-filled cluster, then to less
      padding.

    This is a model, not a measurement: the constants must be re-tuned on a
    B200 (see docs/design/sm100.md).
    """
    check_format_pair(fmt_a, fmt_b)
    if min(m, n, k) <= 0:
        raise ValueError(f"M, N, K must be positive, got {(m, n, k)}")
    if sm_count <= 0:
        raise ValueError(f"sm_count must be positive, got {sm_count}")
    cands = [v for v in variants_for(fmt_a, fmt_b, out_dtype, variants)
             if k % v.k_align == 0 and n % v.n_align == 0]
    if not cands:
        return None

    def cost(v: Sm100Variant):
        tiles_m = _ceil_div(m, v.tile_m)
        tiles_n = _ceil_div(n, v.tile_n)
        tiles = tiles_m * tiles_n
        sms_per_tile = 2 if v.two_cta else 1
        cluster_size = v.cluster_m * v.cluster_n
        tiles_per_cluster = cluster_size // sms_per_tile
        in_flight = max(1, sm_count // cluster_size) * tiles_per_cluster
        waves = _ceil_div(tiles, in_flight)
        per_sm_area = (v.tile_m // sms_per_tile) * v.tile_n / (128.0 * 128.0)
        efficiency = 1.0 + 32.0 * (1.0 / v.tile_m + 1.0 / v.tile_n)
        time = waves * per_sm_area * efficiency
        underfilled_cluster = tiles_per_cluster > 1 and tiles < 2 * in_flight
        waste = tiles_m * v.tile_m * tiles_n * v.tile_n / float(m * n)
        return (round(time, 6), underfilled_cluster, round(waste, 3), v.name)

    return min(cands, key=cost)


def default_function_prefix(variant: Sm100Variant, arch: str) -> str:
    """The C identifier of one (variant, arch) object in the library (unique per pair)."""
    return f"jbs_{arch}_{variant.name}"
