"""The sm90 register-weight variants, no GPU needed: they compile for sm_90a, keep one k-tile's
wgmma group in flight while the next k-tile is converted, and never write the registers a running
group reads its A operand from (tests/wgmma_hazards.py). The last is what broke the first
in-flight version: a loop over single k-tiles converted each k-tile into the registers the
previous k-tile's MMAs were still reading.

Needs nvidia-cutlass-dsl, and for the SASS the pip packages nvidia-cuda-cuobjdump and
nvidia-cuda-nvdisasm (the [test] extra; tests/support/native.py says what a test does without
them).
"""
from __future__ import annotations

import importlib
import re

import pytest

import cubins as _cubins
import native  # tests/support/native.py
from wgmma_hazards import local_memory_in_mma_loops, register_a_hazards

from jax_blockscale.catalog import sm90 as cat

native.need_dsl()
aot = importlib.import_module("jax_blockscale.kernels.aot_sm90")
kern = importlib.import_module("jax_blockscale.kernels.sm90_blockscaled")


def _sass(tmp_path, b_kind, tile, kernel="register_weights", out="bf16"):
    native.need_sass_tools()
    v = cat.Variant(kernel, "bf16_kperm", b_kind, out, *tile)
    aot._build_one((str(tmp_path), v))
    (sass,) = _cubins.sass_of_object(str(tmp_path / f"{v.name}.o"), str(tmp_path / "cubins"))
    return sass


@pytest.mark.parametrize("b_kind", ["nvfp4", "mxfp4", "mxfp8"])
@pytest.mark.parametrize("tile,kernel", [((16, 128), "register_weights"),
                                         ((32, 128), "register_weights"),
                                         ((64, 64), "register_weights"),
                                         ((128, 128), "register_weights"),
                                         ((32, 128), "ragged_prefill"),
                                         ((64, 128), "ragged_prefill"),
                                         ((128, 128), "ragged_prefill"),
                                         ((256, 128), "ragged_prefill")])
def test_in_flight_registers_are_not_rewritten(tmp_path, b_kind, tile, kernel):
    """The dense register-weight variants and the grouped (ragged_gemm prefill) ones; none
    spills to local memory (the 256-row tile holds 128 accumulators per thread), but the
    grouped 32-row MXFP8 tile (104 registers; its natural-K-order conversion holds a row's
    two block scales and the lane's byte selector), which keeps one per-tile value in local
    memory, outside its k-tile loops (reloaded once a tile). (The planner gives MXFP8 experts
    that tile only when JAX_BLOCKSCALE_SM90_RAGGED_TILE_M forces it.)"""
    sass = _sass(tmp_path, b_kind, tile, kernel)
    assert not local_memory_in_mma_loops(sass), local_memory_in_mma_loops(sass)
    if (b_kind, tile, kernel) != ("mxfp8", (32, 128), "ragged_prefill"):
        assert "LDL" not in sass and "STL" not in sass, "spills to local memory"
    groups, hazards = register_a_hazards(sass)
    assert groups >= 2, "expected the k-tile pair's HGMMA groups"
    assert not hazards, "\n".join(hazards[:20])
    if (b_kind, tile) != ("nvfp4", (32, 128)):
        # ptxas serializes the 32-row NVFP4 k-split variants' wgmmas, dense and grouped (104
        # registers leave no room for the pipeline); the dense one still beat the unsplit one
        # at 32 x 8192^2 (24.9 against 30.0 us) and lost 1 us at 32 x 16384^2 (H100,
        # docs/design/sm90_fused.md)
        assert "WARPGROUP.DEPBAR.LE gsb0, 0x1" in sass, "no wgmma group kept in flight"
    if kernel == "ragged_prefill":
        # the grouped tiles run an item of few rows on a narrower wgmma (a loop per width)
        widths = (tile[0],) + cat.ragged_prefill_narrow_widths(tile[0])
        found = {int(w) for w in re.findall(r"HGMMA\.64x(\d+)x16", sass)}
        assert found == set(widths), (found, widths)


@pytest.mark.parametrize("tile,kernel,out", [((128, 128), "register_weights", "bf16"),
                                              ((64, 64), "register_weights", "f16"),
                                              ((128, 128), "register_weights", "f32"),
                                              ((32, 128), "register_weights", "bf16"),
                                              ((256, 128), "ragged_prefill", "bf16"),
                                              ((64, 128), "ragged_prefill", "f32")])
def test_16_bit_outputs_leave_through_shared_memory(tmp_path, tile, kernel, out):
    """The staged epilogue (kernels/sm90_blockscaled.py: _staged_epilogue): tiles with 16-bit
    outputs and one k-group store their accumulators transposed into shared memory (STSM) and
    whole 16-byte runs of output rows (STG.128), bm / 16 of each per thread (two passes of 128
    rows at bm = 256); they keep the one-by-one stores only for N % 8 != 0. f32 outputs (the
    split partials' workspace too) and the 16- / 32-row tiles, whose two k-groups add their
    sums through shared memory first, store one by one."""
    sass = _sass(tmp_path, "nvfp4", tile, kernel, out)
    staged = out != "f32" and tile[0] not in (16, 32)
    assert sass.count("STSM.16.MT88.4") == (tile[0] // 16 if staged else 0)
    assert sass.count("STG.E.128") == (tile[0] // 16 if staged else 0)
    assert "STG.E.U16" in sass or out == "f32"


SYNTHETIC = """
        /*0100*/                   HGMMA.64x64x16.F32.BF16 R24, R88, gdesc[UR12], R24 ;
        /*0110*/                   HGMMA.64x64x16.F32.BF16 R24, R92, gdesc[UR12], R24, gsb0 ;
        /*0120*/                   WARPGROUP.DEPBAR.LE gsb0, 0x1 ;
        /*0130*/                   LOP3.LUT R{w}, R17, 0x81c081c0, RZ, 0xc0, !PT ;
        /*0140*/                   HGMMA.64x64x16.F32.BF16 R24, R56, gdesc[UR12], R24, gsb0 ;
        /*0150*/                   WARPGROUP.DEPBAR.LE gsb0, 0x1 ;
        /*0160*/                   LDS.64 R{w2}, [R3] ;
        /*0170*/               @P0 BRA 0x100 ;
        /*0180*/                   WARPGROUP.DEPBAR.LE gsb0, 0x0 ;
        /*0190*/                   EXIT ;
"""


def test_the_loop_check_finds_a_spill_in_a_k_loop():
    """local_memory_in_mma_loops: a spill inside the innermost HGMMA loop is reported; one
    before it, or in an outer loop around it (once a tile), is not."""
    loop = SYNTHETIC.format(w=4, w2=8)
    assert not local_memory_in_mma_loops(loop)
    inside = loop.replace("LDS.64 R8, [R3]", "LDL R8, [R1]")
    assert local_memory_in_mma_loops(inside) == ["0x0160: LDL R8, [R1]"]
    before = loop.replace("/*0100*/", "/*00f0*/                   STL [R1], R6 ;\n        /*0100*/")
    assert not local_memory_in_mma_loops(before)
    outer = before.replace("/*0190*/                   EXIT ;",
                           "/*0190*/               @P1 BRA 0xf0 ;\n        /*01a0*/   EXIT ;")
    assert not local_memory_in_mma_loops(outer)  # the tile loop: its spill pays once a tile
    assert local_memory_in_mma_loops(outer.replace("LDS.64 R8, [R3]", "LDL R8, [R1]")) == [
        "0x0160: LDL R8, [R1]"]


def test_the_check_finds_a_rewrite():
    """The checker itself: a write to a running group's A registers is reported (before the
    retiring DEPBAR, also around the loop), one after it is not."""
    groups, hazards = register_a_hazards(SYNTHETIC.format(w=90, w2=4))
    assert groups == 2 and len(hazards) == 1 and "0x130" in hazards[0], hazards
    _, hazards = register_a_hazards(SYNTHETIC.format(w=4, w2=57))  # R57 of the 0x140 group
    assert len(hazards) == 1 and "0x160" in hazards[0], hazards
    _, hazards = register_a_hazards(SYNTHETIC.format(w=4, w2=8))
    assert not hazards, hazards
