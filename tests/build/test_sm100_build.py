"""The Blackwell kernel compiles and exports for sm_100a / sm_103a without a GPU,
and what it exports is what we think it is: the launcher prototype of the FFI
contract, and cubins whose SASS holds the block-scaled MMA, the scale copies
into tensor memory and the tensor-memory loads.

Fast subset (CI): one variant per (MMA kind x 1/2-CTA) plus the special N
paths, for both archs.  Whole matrix: `pytest -m slow tests/build/test_sm100_build.py`.

Needs nvidia-cutlass-dsl; the SASS checks also need the pip packages
nvidia-cuda-cuobjdump and nvidia-cuda-nvdisasm (all three in the [test] extra; without them
the tests fail, skipping only where the package was installed without its native library on
purpose: tests/support/native.py).
"""

import importlib
import os
import re

import pytest

import cubins as _cubins  # tests/support/cubins.py
import native  # tests/support/native.py
from jax_blockscale.catalog import sm100 as cat100
from jax_blockscale.catalog.sm100 import ARCH_SM

native.need_dsl()
sm100 = importlib.import_module("jax_blockscale.kernels.sm100_blockscaled")
V = sm100.Sm100Variant

# One per MMA kind x CTA group, plus N = 64 / 192 (SFB offset tricks), the
# overlapped N = 256 accumulator, a 2x2 cluster and mixed / fp6 operands.
FAST = [
    V("nvfp4", "nvfp4", "bfloat16", 128, 128),
    V("nvfp4", "nvfp4", "float32", 256, 256, 2, 2),
    V("mxfp4", "mxfp4", "float16", 128, 128),
    V("mxfp4", "mxfp4", "bfloat16", 256, 256, 2, 1),
    V("mxfp8_e4m3", "mxfp8_e4m3", "bfloat16", 128, 64),
    V("mxfp8_e4m3", "mxfp8_e4m3", "float32", 256, 128, 2, 1),
    V("mxfp8_e4m3", "mxfp4", "bfloat16", 256, 192, 2, 1),
    V("mxfp6_e3m2", "mxfp6_e3m2", "bfloat16", 128, 128),
    V("nvfp4", "nvfp4", "bfloat16", 128, 256),
]

# SASS mnemonic of the block-scaled MMA per kind.  nvfp4's scale_vec::4X
# disassembles as ".4X" for sm_100a and as its alias ".BLOCK16" for sm_103a.
MMA_OPCODE = {"mxf4nvf4": "UTCOMMA", "mxf4": "UTCOMMA", "mxf8f6f4": "UTCQMMA"}

PROTOTYPE = re.compile(
    r"static inline int32_t cute_dsl_(?P<prefix>\w+)_wrapper\("
    r"(?P=prefix)_Kernel_Module_t \*module, void \*a_ptr, void \*b_ptr, "
    r"void \*sfa_ptr, void \*sfb_ptr, void \*out_ptr, void \*alpha_ptr, int32_t m, "
    r"int32_t n, int32_t k, int32_t l, int32_t max_active_clusters, "
    r"cudaStream_t stream\)")


# ragged_gemm's grouped variants: + the tile table, and the number of groups in place of L
GROUPED_PROTOTYPE = re.compile(
    r"static inline int32_t cute_dsl_(?P<prefix>\w+)_wrapper\("
    r"(?P=prefix)_Kernel_Module_t \*module, void \*a_ptr, void \*b_ptr, "
    r"void \*sfa_ptr, void \*sfb_ptr, void \*out_ptr, void \*alpha_ptr, void \*table_ptr, "
    r"int32_t m, int32_t n, int32_t k, int32_t g, int32_t max_active_clusters, "
    r"cudaStream_t stream\)")


def _export(variant, arch, tmp_path):
    prefix = sm100.default_function_prefix(variant, arch)
    h, o = sm100.export_variant(variant, str(tmp_path), prefix, arch)
    return prefix, h, o


def _check_export(variant, arch, tmp_path):
    prefix, h, o = _export(variant, arch, tmp_path)
    assert os.path.getsize(o) > 0
    header = open(h).read()
    m = (GROUPED_PROTOTYPE if variant.grouped else PROTOTYPE).search(header)
    assert m, f"launcher prototype changed:\n{header}"
    assert m.group("prefix") == prefix

    cubins = _cubins.find_cubins_in_file(o)
    assert len(cubins) == 1, f"expected one embedded cubin, found {len(cubins)}"
    assert cubins[0].sm == ARCH_SM[arch]

    native.need_sass_tools()
    (sass,) = _cubins.sass_of_object(o, str(tmp_path / "cubins"))
    ops = _cubins.opcodes(sass)
    _check_sass(variant, arch, ops)


def _check_sass(variant, arch, ops):
    mma_ops = {op for op in ops if op.split(".")[0] in ("UTCOMMA", "UTCQMMA", "UTCHMMA", "UTCIMMA")}
    base = MMA_OPCODE[variant.kind]
    assert mma_ops, f"no tcgen05.mma in SASS: {sorted(ops)}"
    assert all(op.split(".")[0] == base for op in mma_ops), (variant.kind, mma_ops)
    for op in mma_ops:
        mods = set(op.split(".")[1:])
        assert ("2CTA" in mods) == variant.two_cta, op
        if variant.kind == "mxf4nvf4":
            assert mods & {"4X", "BLOCK16"}, f"nvfp4 must use 16-element scale blocks: {op}"
        else:
            assert not mods & {"4X", "BLOCK16"}, op
    # Scales SMEM -> TMEM (tcgen05.cp, replicated to the 4 lane quarters).
    assert any(op.startswith("UTCCP") and "4x32dp128bit" in op for op in ops), sorted(ops)
    # Accumulator TMEM -> registers (tcgen05.ld).
    assert any(op.startswith("LDTM") for op in ops)
    # TMA loads and the TMA store of the epilogue.
    assert any(op.startswith("UTMALDG") for op in ops)
    assert any(op.startswith("UTMASTG") for op in ops)
    if variant.two_cta:
        assert any(op.startswith("UTMALDG") and "2CTA" in op for op in ops)


@pytest.mark.parametrize("arch", sorted(ARCH_SM))
@pytest.mark.parametrize("variant", FAST, ids=lambda v: v.name)
def test_fast_subset_exports(variant, arch, tmp_path):
    _check_export(variant, arch, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("arch", sorted(ARCH_SM))
@pytest.mark.parametrize("variant", sm100.VARIANTS, ids=lambda v: v.name)
def test_whole_matrix_exports(variant, arch, tmp_path):
    _check_export(variant, arch, tmp_path)


def test_fast_subset_is_in_the_matrix_or_a_valid_config():
    # The fast subset may include configs outside the shipped matrix (to cover
    # code paths), but every family of the matrix must be represented.
    kinds = {(v.kind, v.two_cta) for v in sm100.VARIANTS}
    assert kinds <= {(v.kind, v.two_cta) for v in FAST}


@pytest.mark.parametrize("arch", sorted(ARCH_SM))
@pytest.mark.parametrize("variant", [v for v in cat100.GROUPED_VARIANTS
                                     if v.out_dtype == "bfloat16"], ids=lambda v: v.name)
def test_grouped_variants_export(variant, arch, tmp_path):
    """ragged_gemm's grouped kernel: the launcher takes the tile table and G; one cubin for the
    arch with the pair's block-scaled MMA, the scale copies to TMEM, TMA loads and stores, and
    global loads of the table (each role reads its tile's group) and of the group's alpha."""
    _check_export(variant, arch, tmp_path)
    native.need_sass_tools()
    (sass,) = _cubins.sass_of_object(str(tmp_path / (cat100.default_function_prefix(
        variant, arch) + ".o")), str(tmp_path / "cubins2"))
    assert sum(op.startswith("LDG") for op in re.findall(r"\b(LDG\S*)", sass)) >= 3


def test_variant_names_and_prefixes_are_unique():
    every = sm100.VARIANTS + cat100.GROUPED_VARIANTS
    names = [v.name for v in every]
    assert len(names) == len(set(names))
    prefixes = {sm100.default_function_prefix(v, a) for v in every for a in sm100.SM100_ARCHS}
    assert len(prefixes) == len(names) * len(sm100.SM100_ARCHS)
    assert all(re.fullmatch(r"[A-Za-z_]\w*", p) for p in prefixes)


def test_variant_validation():
    with pytest.raises(ValueError, match="nvfp4"):
        V("nvfp4", "mxfp4", "bfloat16", 128, 128)
    with pytest.raises(ValueError, match="tile_n"):
        V("mxfp4", "mxfp4", "bfloat16", 128, 96)
    with pytest.raises(ValueError, match="cluster_m"):
        V("mxfp4", "mxfp4", "bfloat16", 256, 128, 1, 1)
    with pytest.raises(ValueError, match="out_dtype"):
        V("mxfp4", "mxfp4", "int8", 128, 128)


def test_kinds_and_alignment_rules():
    assert sm100.mma_kind("nvfp4", "nvfp4") == "mxf4nvf4"
    assert sm100.mma_kind("mxfp4", "mxfp4") == "mxf4"
    assert sm100.mma_kind("mxfp8_e4m3", "mxfp4") == "mxf8f6f4"
    assert sm100.mma_kind("mxfp6_e2m3", "mxfp6_e2m3") == "mxf8f6f4"
    assert sm100.k_alignment("nvfp4", "nvfp4") == 32  # 16 bytes of fp4
    assert sm100.k_alignment("mxfp4", "mxfp4") == 32
    assert sm100.k_alignment("mxfp8_e5m2", "mxfp8_e4m3") == 32  # one MX block
    assert sm100.k_alignment("mxfp8_e4m3", "mxfp4") == 128  # unpacked fp4
    assert sm100.k_alignment("mxfp6_e3m2", "mxfp6_e3m2") == 128  # unpacked fp6


def test_kinds_agree_with_the_format_table():
    formats = pytest.importorskip("jax_blockscale.core.formats")
    for name, f in sm100.FORMATS.items():
        g = formats.FORMATS[name]
        assert g.block == f.block
        assert g.element_bits == f.bits
        assert g.mma_kind == sm100.mma_kind(name, name)


# ---- static resource plan ---------------------------------------------------

SMEM_BYTES_SM100 = 232448  # 227 KiB usable per CTA on sm_100 / sm_103
TMEM_COLUMNS = 512


def _check_plan(variant):
    _, g = sm100.compile_variant_with_plan(variant, "sm_100a")
    # A pipeline needs at least two stages to overlap loads with MMAs.
    assert g.ab_stages >= 2, g.ab_stages
    assert g.c_stages >= 2, g.c_stages
    # Accumulator buffer(s) and both scale tiles must fit in the 512 TMEM columns.
    assert g.acc_tmem_cols + g.sf_tmem_cols <= TMEM_COLUMNS, (g.acc_tmem_cols, g.sf_tmem_cols)
    assert g.acc_stages == (1 if variant.tile_n == 256 else 2)
    # Everything the kernel puts in shared memory fits in one SM's.
    assert g.storage_type.size_in_bytes() <= SMEM_BYTES_SM100, g.storage_type.size_in_bytes()
    # The per-CTA tile is what the scheduler and the epilogue assume.
    assert g.cta_tile[:2] == (variant.tile_m // (2 if variant.two_cta else 1), variant.tile_n)


@pytest.mark.parametrize("variant", FAST, ids=lambda v: v.name)
def test_resource_plan_fast(variant):
    _check_plan(variant)


@pytest.mark.slow
@pytest.mark.parametrize("variant", sm100.VARIANTS, ids=lambda v: v.name)
def test_resource_plan_whole_matrix(variant):
    _check_plan(variant)
