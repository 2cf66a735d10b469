"""The native library on a machine without a GPU: it loads, its FFI targets register, its variant
table is the catalogue's, and the sm90 handler's validation (a pure function, reached through the
exported C entry point `jbs_sm90_check_problem`) accepts exactly the planned calls the kernels
can run. The library is the one the package loads (the installed one, in CI); without it these
tests fail, unless the package was installed without it on purpose (tests/support/native.py)."""
from __future__ import annotations

import itertools
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import native  # tests/support/native.py
from configure import set_env  # tests/support/configure.py
from hopper import as_if_hopper, lower_for_cuda  # tests/support/hopper.py
from jax_blockscale import _plugin
from jax_blockscale.catalog import sm90 as cat
from jax_blockscale.core.formats import get_format
from jax_blockscale.lowering import GemmSpec
from jax_blockscale.lowering import ffi_sm90
from jax_blockscale.lowering import plan as P
from jax_blockscale.ragged import ragged_gemm_spec

native.need_library()

KIND_CODES, OUT_CODES = cat.KIND_CODES, cat.OUT_CODES
H100 = P.Device("cuda", "sm90", 132)


def test_library_loads_and_registers():
    assert _plugin.load() is not None
    assert _plugin.register_targets()
    assert _plugin.register_targets()  # idempotent


def test_variant_table_is_the_catalogue():
    """Every catalogued variant is compiled, with the catalogue's codes, tile and split unit."""
    got = {v["name"]: v for v in _plugin.variants()}
    assert len(got) == len(_plugin.variants()), "function prefixes must be unique"
    for v in cat.VARIANTS:
        row = got.get(v.name)
        assert row is not None, f"{v.name} not compiled"
        assert (row["a_kind"], row["b_kind"], row["out"], row["tile_m"], row["tile_n"],
                row["sm"], row["nt"], row["k_chunk"], row["grouped"], row["chained"]) == (
            KIND_CODES[v.a_kind], KIND_CODES[v.b_kind], OUT_CODES[v.out], v.tile_m, v.tile_n,
            90, v.nt, v.k_chunk, int(v.grouped), int(v.chained)), v.name
    assert set(got) == {v.name for v in cat.VARIANTS}


def test_manifest_matches_library():
    """The install puts the AOT build's variants.json next to the library as sm90_variants.json;
    a library named by JAX_BLOCKSCALE_LIBRARY in a CMake build tree has it in aot/."""
    import json
    import os

    man = _plugin.manifest()
    in_tree = os.path.join(os.path.dirname(_plugin.library_path()), "aot", "variants.json")
    if man is None and os.path.exists(in_tree):
        with open(in_tree) as f:
            man = json.load(f)
    if man is None:
        if os.environ.get("JAX_BLOCKSCALE_LIBRARY"):
            pytest.skip("no sm90_variants.json next to the library named by "
                        "JAX_BLOCKSCALE_LIBRARY (nor aot/variants.json)")
        pytest.fail(f"no sm90_variants.json next to the installed {_plugin.library_path()}")
    assert sorted(v["name"] for v in man["variants"]) == sorted(
        v["name"] for v in _plugin.variants())
    assert man["kind_codes"] == KIND_CODES and man["out_codes"] == OUT_CODES


# ---- the handler's validation of a planned call, without a GPU ---------------------------------

def _row_bytes(kind, k):
    return k * cat.KINDS["bf16" if kind == "bf16_kperm" else kind]["bits"] // 8


def _scale_bytes(l, mn, k, block):
    return l * math.ceil(mn / 128) * math.ceil(k // block / 4) * 512


def problem(a="nvfp4", b="nvfp4", out="bf16", m=100, n=70, k=256, l=2, *, nt=0, tile=None,
            splits=0, a_scales_plain=0, **over):
    """A valid planned call, as the FFI handler would see it; `over` replaces any field. The
    tile defaults to the fused kernel's 128x128 (or the decode variant's for nt > 0)."""
    block = cat.KINDS["bf16" if a == "bf16_kperm" else a]["block"]
    if tile is None:
        tile = (8 * nt, cat.tuning_for(nt, b).bn) if nt else (128, 128)
    if a_scales_plain and block:
        sa = l * m * (k // block)
    else:
        sa = _scale_bytes(l, m, k, block) if block else 16
    kw = dict(a_kind=KIND_CODES[a], b_kind=KIND_CODES[b], out=OUT_CODES[out], m=m, n=n, k=k,
              l=l, a_bytes=l * m * _row_bytes(a, k), b_bytes=l * n * _row_bytes(b, k),
              sa_bytes=sa, sb_bytes=_scale_bytes(l, n, k, cat.KINDS[b]["block"]),
              c_bytes=l * m * n * {"bf16": 2, "f16": 2, "f32": 4}[out], nt=nt, tile_m=tile[0],
              tile_n=tile[1], splits=splits, a_scales_plain=a_scales_plain,
              ws_bytes=4 * splits * l * m * n)
    kw.update(over)
    return kw


def check(**kw):
    return _plugin.check_problem(**problem(**kw))


@pytest.mark.parametrize("pair", cat.FUSED_PAIRS)
@pytest.mark.parametrize("out", cat.OUTS)
@pytest.mark.parametrize("tile_n", [64, 128, 256])
def test_accepts_every_fused_variant(pair, out, tile_n):
    ok, msg = check(a=pair[0], b=pair[1], out=out, tile=(128, tile_n))
    assert ok and msg == f"jbs_sm90_{pair[0]}_{pair[1]}_{out}_128x{tile_n}", msg


@pytest.mark.parametrize("m,n,k,l", [(1, 1, 32, 1), (7, 13, 96, 1), (129, 257, 64, 3),
                                     (4096, 8192, 8192, 1)])
def test_accepts_odd_shapes(m, n, k, l):
    ok, msg = check(m=m, n=n, k=k, l=l)
    assert ok, msg


@pytest.mark.parametrize("over,match", [
    (dict(cc_major=8, cc_minor=0), "compute capability 9.0"),
    (dict(cc_major=10, cc_minor=0), "compute capability 9.0"),
    (dict(cc_major=9, cc_minor=1), "compute capability 9.0"),
    (dict(a_kind=9), "unknown operand kinds"),
    (dict(b_kind=4), "unknown operand kinds"),  # bf16 weights
    (dict(out=7), "output dtype"),
    (dict(tile_n=96), "no compiled sm90 fused kernel .* tile 128x96"),
    (dict(nt=3), "no compiled sm90 decode kernel"),
    (dict(m=0), "empty problem"),
    (dict(k=0), "empty problem"),
    (dict(l=0), "empty problem"),
    (dict(a_e5m2=1), "only valid for mxfp8"),
    (dict(b_e5m2=2), "must be 0 or 1"),
    (dict(a_ptr=0x10008), "A pointer .* not 16-byte aligned"),
    (dict(sb_ptr=0x40004), "B scales pointer .* not 16-byte aligned"),
    (dict(alpha_ptr=0x60002), "alpha pointer"),
    (dict(b_ptr=0), "B pointer is null"),
    (dict(a_bytes=1), "A buffer has 1 bytes"),
    (dict(b_bytes=10), "B buffer has 10 bytes"),
    (dict(sa_bytes=512), "A scale buffer"),
    (dict(sb_bytes=0), "B scale buffer"),
    (dict(c_bytes=4), "output buffer"),
    (dict(alpha_bytes=8), "alpha must be one float32"),
    (dict(splits=2), "split count .* for the fused variant"),
])
def test_rejects_bad_calls(over, match):
    kw = problem()
    kw.update(over)
    ok, msg = _plugin.check_problem(**kw)
    assert not ok
    assert re.search(match, msg), msg


def test_rejects_k_not_multiple_of_32():
    # K must give 16-byte TMA rows (the planner pads NVFP4's K % 32 == 16 case)
    ok, msg = check(k=48)
    assert not ok and "multiple of 32" in msg


def test_rejects_unimplemented_pairs():
    for a, b in [("mxfp4", "mxfp8"), ("nvfp4", "mxfp4"), ("bf16_kperm", "nvfp4")]:
        ok, msg = check(a="mxfp8", b="mxfp8", a_kind=KIND_CODES[a], b_kind=KIND_CODES[b])
        assert not ok, (a, b, msg)


def test_rejects_32bit_overflow():
    ok, msg = check(m=65536, n=65536, k=64, l=1)
    assert not ok and "32-bit" in msg


def test_register_weight_variants():
    ok, name = check(a="bf16_kperm", b="mxfp8", m=100, n=70, k=256, l=1, tile=(128, 64),
                     b_e5m2=1)
    assert ok and name == "jbs_sm90_bf16_kperm_mxfp8_bf16_128x64", name
    ok, msg = check(a="bf16_kperm", b="nvfp4", m=16, n=70, k=96, l=1, tile=(16, 64))
    assert not ok and "multiple of 64" in msg, msg
    ok, msg = check(a="bf16_kperm", b="mxfp8", m=100, n=70, k=256, l=1, tile=(128, 64),
                    a_e5m2=1)
    assert not ok and "only valid for mxfp8" in msg, msg


# ---- the decode kernel's validation ------------------------------------------------------------

@pytest.mark.parametrize("a", ["nvfp4", "mxfp4", "mxfp8"])
def test_decode_reads_plain_activation_scales(a):
    """A quantized activation's scales may come in the plain layout [L, M, K / block] (no XLA
    conversion kernel before the call): only for the decode kernel, and the buffer must be sized
    for that layout."""
    dec = dict(a=a, b=a, m=16, n=300, k=1024, l=2, nt=2, splits=2)
    ok, name = check(a_scales_plain=1, **dec)
    assert ok and name == f"jbs_sm90_decode_{a}_{a}_bf16_m16", name
    blocked = problem(**dec)["sa_bytes"]
    ok, msg = check(a_scales_plain=1, sa_bytes=blocked, **dec)
    assert not ok and "plain layout" in msg, msg
    ok, msg = check(sa_bytes=2 * 16 * 1024 // cat.KINDS[a]["block"], **dec)
    assert not ok and "blocked layout" in msg, msg
    # the fused GEMM reads blocked scales only
    ok, msg = check(a=a, b=a, m=65, n=300, k=1024, l=1, a_scales_plain=1)
    assert not ok and "need the decode kernel" in msg, msg
    # nothing to read for a bf16 activation; the flag is 0 or 1
    ok, msg = check(a="bf16", b=a, m=4, n=300, k=1024, l=1, nt=1, splits=1, a_scales_plain=1,
                    sa_bytes=4)
    assert not ok and "unquantized activation" in msg, msg
    ok, msg = check(a_scales_plain=2, **dec)
    assert not ok and "a_scales_plain" in msg, msg


def test_decode_split_count_and_workspace():
    dec = dict(a="bf16", b="nvfp4", m=1, n=256, k=8192, l=1, nt=1)
    k_chunks = 8192 // cat.decode_chunk_elems("nvfp4", cat.tuning_for(1, "nvfp4"))
    for splits in (1, 3, k_chunks):
        ok, name = check(splits=splits, **dec)
        assert ok and name == "jbs_sm90_decode_bf16_nvfp4_bf16_m8", (splits, name)
    for splits in (0, k_chunks + 1):
        ok, msg = check(splits=splits, **dec)
        assert not ok and "split count" in msg, msg
    ok, msg = check(splits=4, ws_bytes=4 * 3 * 256, **dec)  # room for 3 slices, not 4
    assert not ok and re.search("workspace has 3072 bytes, needs 4096", msg), msg


def test_split_partials_left_to_the_caller_are_the_decode_kernels():
    """partials = 1 (the lowering adds the split partials): the dense and the grouped decode
    kernel (index mode too), any split count; the fused kernels and the grouped register-weight
    kernel refuse it."""
    dec = dict(a="bf16", b="nvfp4", m=1, n=256, k=8192, l=1, nt=1)
    for splits in (1, 4):
        ok, name = check(splits=splits, partials=1, **dec)
        assert ok and name == "jbs_sm90_decode_bf16_nvfp4_bf16_m8", (splits, name)
    ok, msg = check(splits=4, partials=2, **dec)
    assert not ok and "partials = 2: 0, or 1 for the decode kernels" in msg, msg
    ok, msg = check(partials=1)  # the fused kernel
    assert not ok and "partials = 1" in msg, msg
    for m, kernel in ((16, "ragged_decode"), (8192, "ragged_prefill")):
        p = P.plan_ragged_sm90(_ragged_spec(None, "mxfp4", None, "bfloat16", m, 1536, 2048, 8),
                               H100)
        assert p.kernel == kernel, p
        ok, msg = _plugin.check_problem(**dict(_ragged_call_of(p), partials=1))
        assert ok == (kernel == "ragged_decode"), msg
    indexed = next(p for p in _indexed_plans()
                   if not isinstance(p, str) and p.kernel == "ragged_decode")
    assert _plugin.check_problem(**dict(_ragged_call_of(indexed), partials=1))[0]


@pytest.mark.parametrize("over,match", [
    (dict(ws_ptr=0), "workspace pointer is null"),
    (dict(ws_ptr=0x70008), "workspace pointer .* not 16-byte aligned"),
    (dict(k=48), "multiple of 32"),
    (dict(k=1040, a="mxfp4", b="mxfp4"), "multiple of 32"),
    (dict(a_ptr=0x10004), "A pointer .* not 16-byte aligned"),
    (dict(sb_bytes=512), "B scale buffer"),
    (dict(sa_bytes=16), "A scale buffer"),
    (dict(cc_major=10), "compute capability 9.0"),
    (dict(a="bf16", a_bytes=4 * 1024), "A buffer"),  # weight-only means bf16 A (2 bytes each)
])
def test_decode_rejects(over, match):
    kw = dict(m=5, n=300, k=1024, l=2, nt=1, splits=2)
    kw.update(over)
    ok, msg = check(**kw)
    assert not ok, msg
    assert re.search(match, msg), msg


# ---- the plans the C++ validator sees ---------------------------------------------------------

def _spec(fa, fb, layout_a, out, m, n, k, a_batch=(), b_batch=()):
    a_dtype = np.dtype("bfloat16") if fa is None else np.dtype(get_format(fa).storage_dtype)
    return GemmSpec(fa, fb, layout_a, "blocked", a_dtype, np.dtype(out),
                    tuple(np.broadcast_shapes(a_batch, b_batch)), a_batch, b_batch, m, n, k)


def _call_of(p) -> dict:
    """The FFI call a kernel Plan becomes (what lowering/ffi_sm90.py passes)."""
    spec = p.spec if not p.dequantize_a else P.with_dequantized_activation(p.spec)
    fa = spec.fmt_a
    a_block = None if fa is None else get_format(fa).block
    if fa is None:
        sa = _scale_bytes(p.l, spec.n, p.k, get_format(spec.fmt_b).block)
    elif p.a_scales_plain:
        sa = p.l * p.m * (p.k // a_block)
    else:
        sa = _scale_bytes(p.l, p.m, p.k, a_block)
    out = cat.OUT_OF_DTYPE[np.dtype(spec.out_dtype).name]
    return dict(a_kind=KIND_CODES[p.a_kind], b_kind=KIND_CODES[p.b_kind], out=OUT_CODES[out],
                a_e5m2=int(fa == "mxfp8_e5m2"), b_e5m2=int(spec.fmt_b == "mxfp8_e5m2"),
                m=p.m, n=spec.n, k=p.k, l=p.l, a_bytes=p.l * p.m * _row_bytes(p.a_kind, p.k),
                b_bytes=p.l * spec.n * _row_bytes(p.b_kind, p.k), sa_bytes=sa,
                sb_bytes=_scale_bytes(p.l, spec.n, p.k, get_format(spec.fmt_b).block),
                c_bytes=p.l * p.m * spec.n * np.dtype(spec.out_dtype).itemsize,
                a_scales_plain=int(p.a_scales_plain), nt=p.nt, tile_m=p.tile[0],
                tile_n=p.tile[1], splits=p.splits, ws_bytes=4 * p.workspace,
                partials=int(ffi_sm90.leaves_partials(p)))


def test_chained_decode_variants_leave_their_partials():
    """A chained decode variant (behind the activation quantizer) has no finalize kernel: with
    several splits the caller must add the partials (partials = 1)."""
    dec = dict(a="nvfp4", b="nvfp4", m=16, n=256, k=8192, l=1, nt=2, a_scales_plain=1,
               chained=1)
    ok, name = check(splits=4, partials=1, **dec)
    assert ok and name == "jbs_sm90_decode_chained_nvfp4_nvfp4_bf16_m16", name
    ok, name = check(splits=1, partials=0, **dec)  # one split: the main kernel writes c
    assert ok, name
    ok, msg = check(splits=4, partials=0, **dec)
    assert not ok and "leaves its 4 splits' partials to the caller" in msg, msg


def test_register_weight_split_count_and_workspace():
    """A dense register-weight call may split K (2..min(255, K / 64)); it runs the f32 variant
    of its tile, whose output is the workspace of partials (partials = 1), whatever the call's
    output dtype."""
    rw = dict(a="bf16_kperm", b="nvfp4", m=64, n=4096, k=4096, l=1, tile=(64, 64))
    for out in ("bf16", "f16", "f32"):
        for splits in (2, 64):
            ok, name = check(out=out, splits=splits, partials=1, **rw)
            assert ok and name == "jbs_sm90_bf16_kperm_nvfp4_f32_64x64", (out, splits, name)
    for splits in (65, 256):  # past K's 64 k-tiles, past 8 bits
        ok, msg = check(splits=splits, partials=1, **rw)
        assert not ok and "register-weight split count" in msg, msg
    ok, msg = check(splits=4, partials=0, **rw)
    assert not ok and "leaves its partials to the caller" in msg, msg
    ok, msg = check(splits=4, partials=1, ws_bytes=4 * 3 * 64 * 4096, **rw)
    assert not ok and "register-weight workspace has" in msg, msg
    ok, msg = check(splits=4, partials=1, ws_ptr=0, **rw)
    assert not ok and "workspace pointer is null" in msg, msg
    ok, msg = check(splits=2, partials=1)  # the shared-memory fused variant does not split
    assert not ok and "only the dense register-weight variants split K" in msg, msg
    ok, msg = check(splits=1, **rw)  # no split is 0
    assert not ok and "0, or 2 to 255 for the register-weight variants" in msg, msg


def test_every_plan_is_accepted_and_named_back():
    """Python and C++ agree: for a grid of problems the C++ validator accepts exactly the
    variant the planner chose (with this library's tables) and names it back."""
    pairs = [(None, "nvfp4"), (None, "mxfp4"), (None, "mxfp8_e5m2"), ("nvfp4", "nvfp4"),
             ("mxfp4", "mxfp4"), ("mxfp8_e4m3", "mxfp8_e5m2"), ("mxfp8_e5m2", "mxfp4")]
    kernels = set()
    for (fa, fb), layout_a, out, m, (n, k), (ab, bb) in itertools.product(
            pairs, ["plain", "blocked"], ["bfloat16", "float32", "float16"],
            [1, 9, 16, 17, 33, 64, 65, 200, 1024],
            [(300, 1024), (4096, 4096), (16384, 16384), (24, 96), (7, 48)],
            [((), ()), ((2,), ()), ((3,), (3,))]):
        if fa is None and layout_a == "blocked":
            continue
        if k % get_format(fb).block:
            continue
        p = P.plan_sm90(_spec(fa, fb, None if fa is None else layout_a, out, m, n, k, ab, bb),
                        H100)
        if isinstance(p, str) or p.kernel in ("xla_dot", "dot_alpha"):
            continue
        kernels.add(p.kernel)
        ok, name = _plugin.check_problem(**_call_of(p))
        assert ok and name == p.variant, (p, name)
    assert kernels == {"fused", "register_weights", "decode"}


# ---- ragged_gemm's grouped decode kernel --------------------------------------------------------

def _ragged_spec(fa, fb, layout_lhs, out, m, n, k, groups, group_index=False,
                 alpha_is_one=False):
    from jax_blockscale.lowering.specs import RaggedSpec
    lhs_dtype = np.dtype("bfloat16") if fa is None else np.dtype(get_format(fa).storage_dtype)
    return RaggedSpec(fa, fb, layout_lhs if fa else None, "blocked", lhs_dtype, np.dtype(out),
                      m, n, k, groups, group_index=group_index, alpha_is_one=alpha_is_one)


def _ragged_call_of(p) -> dict:
    """The FFI call a grouped RaggedPlan becomes (what lowering/ragged_sm90.py passes)."""
    spec = p.spec
    m, n, k, g = spec.m, spec.n, spec.k, spec.groups
    bb = get_format(spec.fmt_rhs).block
    if spec.fmt_lhs is None:
        sa = _scale_bytes(g, n, k, bb)
    elif p.a_scales_plain:
        sa = m * (k // get_format(spec.fmt_lhs).block)
    else:
        sa = _scale_bytes(1, m, k, get_format(spec.fmt_lhs).block)
    if p.kernel == "ragged_prefill":  # a dequantized activation; B's scales stand in for its
        sa = _scale_bytes(g, n, k, bb)
    out = cat.OUT_OF_DTYPE[np.dtype(spec.out_dtype).name]
    a_e5m2 = spec.fmt_lhs == "mxfp8_e5m2" and p.kernel != "ragged_prefill"
    return dict(a_kind=KIND_CODES[p.a_kind], b_kind=KIND_CODES[p.b_kind], out=OUT_CODES[out],
                a_e5m2=int(a_e5m2), b_e5m2=int(spec.fmt_rhs == "mxfp8_e5m2"),
                m=m, n=n, k=k, l=g, a_bytes=m * _row_bytes(p.a_kind, k),
                b_bytes=g * n * _row_bytes(p.b_kind, k), sa_bytes=sa,
                sb_bytes=_scale_bytes(g, n, k, bb), alpha_bytes=4 * g,
                c_bytes=m * n * np.dtype(spec.out_dtype).itemsize,
                a_scales_plain=int(p.a_scales_plain), nt=p.nt, tile_m=p.tile[0],
                tile_n=p.tile[1], splits=p.splits, ws_bytes=4 * p.splits * m * n,
                grouped=2 if spec.group_index else 3 if p.raw_sizes else 1, num_items=p.items,
                items_bytes=4 if spec.group_index else 4 * g if p.raw_sizes else 12 * p.items,
                tiles_per_cta=p.tiles_per_cta)


_RAGGED_PAIRS = [(None, "nvfp4"), (None, "mxfp4"), (None, "mxfp8_e4m3"), ("nvfp4", "nvfp4"),
                 ("mxfp4", "mxfp4"), ("mxfp8_e4m3", "mxfp8_e5m2")]


def _ragged_plans():
    pairs = _RAGGED_PAIRS
    for (fa, fb), layout_lhs, out, (m, g), (n, k) in itertools.product(
            pairs, ["plain", "blocked"], ["bfloat16", "float32", "float16"],
            [(1, 8), (16, 128), (128, 128), (600, 128), (300, 32), (2048, 128), (64, 1),
             (4096, 128), (8192, 128), (32768, 128), (3000, 16), (4096, 8), (2048, 128)],
            [(1536, 2048), (2048, 768), (5760, 2880), (200, 96)]):
        if k % get_format(fb).block or (fa is None and layout_lhs == "blocked"):
            continue
        p = P.plan_ragged_sm90(_ragged_spec(fa, fb, layout_lhs, out, m, n, k, g), H100)
        if not isinstance(p, str):
            yield p


def test_every_ragged_plan_is_accepted_and_named_back(monkeypatch):
    """Python and C++ agree on ragged_gemm's grouped decode calls: the validator accepts exactly
    the planned variant and names it back, for every pair, layout, output and item height, and
    for the grouped register-weight kernel (every weight kind, every item height the planner
    picks, and each one forced: fp8 weights take 32-row items only when forced)."""
    nts, planned, forced = set(), set(), set()

    def check(p, seen):
        ok, name = _plugin.check_problem(**_ragged_call_of(p))
        assert ok and name == p.variant, (p, name)
        if p.kernel == "ragged_prefill":
            seen.add((p.b_kind, p.tile))
        else:
            nts.add(p.nt)

    for p in _ragged_plans():
        check(p, planned)
    for tile_m, _ in cat.RAGGED_PREFILL_TILES:
        set_env(monkeypatch, JAX_BLOCKSCALE_SM90_RAGGED_KERNEL="prefill",
                JAX_BLOCKSCALE_SM90_RAGGED_TILE_M=tile_m)
        for fb in ("nvfp4", "mxfp4", "mxfp8_e4m3"):
            p = P.plan_ragged_sm90(_ragged_spec(None, fb, "plain", "bfloat16", 2048, 1536, 2048,
                                                128), H100)
            assert not isinstance(p, str) and p.tile == (tile_m, 128), p
            check(p, forced)
    assert nts == {1, 2, 4, 8}
    every = {(b, t) for b in cat.REGISTER_WEIGHT_KINDS for t in cat.RAGGED_PREFILL_TILES}
    assert forced == every, forced
    assert planned == every - {("mxfp8", (cat.RAGGED_PREFILL_NARROW_TILE_M, 128))}, planned


def test_grouped_register_weight_calls_are_validated():
    """The handler refuses what the grouped register-weight kernel cannot run: a split count,
    index mode, a work table of the wrong size, a quantized activation."""
    p = next(p for p in _ragged_plans() if p.kernel == "ragged_prefill")
    call = _ragged_call_of(p)
    for change, why in [(dict(splits=1), "split count"),
                        (dict(grouped=2, items_bytes=4), "index mode"),
                        (dict(items_bytes=call["items_bytes"] - 12), "work table"),
                        (dict(num_items=0), "work table"),
                        (dict(a_kind=KIND_CODES["nvfp4"]), "no compiled sm90")]:
        ok, msg = _plugin.check_problem(**dict(call, **change))
        assert not ok and why in msg, (change, msg)


def _indexed_plans():
    for (fa, fb), out, m, (n, k) in itertools.product(
            _RAGGED_PAIRS, ["bfloat16", "float32"], [1, 7, 16, 20, 33, 64],
            [(6144, 4096), (4096, 14336), (28672, 4096), (200, 96)]):
        if k % get_format(fb).block:
            continue
        layout_lhs = None if fa is None else "plain"
        yield P.plan_ragged_sm90(_ragged_spec(fa, fb, layout_lhs, out, m, n, k, 16,
                                              group_index=True,
                                              alpha_is_one="nvfp4" not in (fa, fb)), H100)


def test_every_indexed_plan_is_accepted_and_matches_the_dense_choice():
    """gemm(..., layer=) up to INDEX_MODE_MAX_ROWS: the layer's plan is gemm's own plan for one
    layer (decode, register-weight or fused kernel), and index mode (run where XLA copied the
    probe) keeps the dense decode kernel's item height and splits where that is the plan. The C++
    validator accepts both calls the layer target can make and names their variants back.
    Register-weight plans without a global scale slice the layer instead."""
    kernels, refused = set(), 0
    for p in _indexed_plans():
        if isinstance(p, str):
            assert "the layer is sliced" in p, p
            refused += 1
            continue
        spec, layer = p.spec, p.layer
        if p.kernel == "layer_slice":  # NVFP4 register-weight plans: XLA's slices, no index mode
            assert layer.kernel == "register_weights" and not spec.alpha_is_one, p
            ok, name = _plugin.check_problem(**_call_of(layer))
            assert ok and name == layer.variant, (layer, name)
            kernels.add("slice")
            continue
        dense = P.plan_sm90(GemmSpec(spec.fmt_lhs, spec.fmt_rhs, spec.layout_lhs,
                                       spec.layout_rhs, spec.lhs_dtype, spec.out_dtype, (), (), (),
                                       spec.m, spec.n, spec.k, spec.alpha_is_one), H100)
        assert spec.m <= cat.INDEX_MODE_MAX_ROWS, p
        assert (layer.kernel, layer.variant, layer.tile, layer.splits) == (
            dense.kernel, dense.variant, dense.tile, dense.splits), (layer, dense)
        # index mode runs the decode kernel: never where the plan is the register-weight one
        # (MXFP8's reads natural K order, yet the decode kernel would be the slower there)
        assert layer.kernel != "register_weights" and not layer.permute_k, p
        if dense.kernel == "decode":
            assert (p.nt, p.splits) == (dense.nt, dense.splits), p
        assert p.items == -(-spec.m // (8 * p.nt)), p
        assert p.a_scales_plain == layer.a_scales_plain
        ok, name = _plugin.check_problem(**_call_of(layer))
        assert ok and name == layer.variant, (layer, name)
        ok, name = _plugin.check_problem(**_ragged_call_of(p))
        assert ok and name == p.variant, (p, name)
        kernels.add(layer.kernel)
    assert {"decode", "slice"} <= kernels, kernels
    assert refused  # past 64 rows, and register weights without a global scale


def test_layer_target_reads_the_layer_from_the_probe_address():
    """The handler names the layer only from a probe that starts a layer of the scales' stack;
    a copy (anywhere else), a start inside a layer or a stack that is not whole layers runs
    index mode (-1)."""
    base, stride, layers = 0x7F0000000000, 4096, 6
    for i in range(layers):
        assert _plugin.layer_at(base + i * stride, base, layers * stride, layers) == i
    for at in (base - stride, base + layers * stride, base + stride + 512, 0x1000):
        assert _plugin.layer_at(at, base, layers * stride, layers) == -1, hex(at)
    assert _plugin.layer_at(base, base, layers * stride + 1, layers) == -1
    assert _plugin.layer_at(base, base, layers * stride, 0) == -1


def test_alpha_gather_ptx_assembles(tmp_path):
    """The layer target's one-thread alpha gather is PTX in ffi/jbs_ffi.cc, JIT-loaded at run
    time; ptxas (CUDA toolkit) assembles it for sm_90a here, so a typo fails on CPU CI."""
    import os
    import subprocess

    ptxas = native.need_tool("ptxas")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    src = open(os.path.join(root, "ffi", "jbs_ffi.cc")).read()
    ptx = re.search(r'kGatherAlphaPtx\[\] = R"\((.*?)\)";', src, re.S).group(1)
    assert ".entry jbs_gather_alpha" in ptx
    (tmp_path / "g.ptx").write_text(ptx)
    r = subprocess.run([ptxas, "-arch=sm_90a", str(tmp_path / "g.ptx"), "-o",
                        str(tmp_path / "g.cubin")], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_lowering_emits_the_layer_call(monkeypatch):
    """gemm(x, stack, layer=i) in the decode rows: one call of the layer target with the whole
    stacks, the index and a PROBE_BYTES probe sliced from the scales at i (no slice of the
    elements), the layer's plan and index mode's as attributes. Past 64 rows with NVFP4's
    per-layer alpha: slice mode (index_nt 0, the probe the whole stack of scales); without a
    global scale, gemm's own target on the sliced layer."""
    import jax_blockscale as jbs
    from jax_blockscale.lowering.ragged_sm90 import PROBE_BYTES

    def stack(fmt):
        kw = dict(global_scale="per_matrix") if fmt == "nvfp4" else {}
        return jbs.quantize(jax.random.normal(jax.random.PRNGKey(1), (3, 256, 512)), fmt,
                            layout="blocked", **kw)

    scale_bytes = 3 * 2 * 32 * 512  # 3 layers x 2 row tiles x (512 / 16 / 4 = 8) k tiles x 512 B
    for fmt, m, target, probe, attrs in (
            ("nvfp4", 16, _plugin.LAYER_SM90_TARGET, PROBE_BYTES,
             dict(m=16, n=256, k=512, l=1, g=3, nt=2, index_nt=2, index_items=1, partials=0)),
            ("nvfp4", 100, _plugin.LAYER_SM90_TARGET, scale_bytes // 4,
             dict(m=100, l=1, g=3, nt=0, splits=0, index_nt=0, index_items=0, partials=0)),
            # a register-weight plan at 64 rows (2 tiles of 64 x 128): K's 8 k-tiles in 2
            # splits, whose partials the lowering adds and scales by the layer's alpha
            ("nvfp4", 64, _plugin.LAYER_SM90_TARGET, scale_bytes // 4,
             dict(m=64, l=1, g=3, nt=0, splits=2, index_nt=0, index_items=0, partials=1)),
            ("mxfp4", 100, _plugin.SM90_TARGET, None, dict(m=100, l=1))):
        w, x = stack(fmt), jnp.ones((m, 512), jnp.bfloat16)
        text = lower_for_cuda(monkeypatch, lambda x, i, w=w: jbs.gemm(x, w, layer=i), x, 1)
        calls = [ln for ln in text.splitlines() if "stablehlo.custom_call @jax_blockscale" in ln]
        assert len(calls) == 1 and "@" + target + "(" in calls[0], (fmt, m, calls)
        if probe is not None:  # the probe is the last operand
            last = re.search(r"-> \(", calls[0]) and calls[0].split(": (")[-1].split(")")[0]
            assert last.split(", ")[7] == f"tensor<{probe}xui8>", (fmt, m, last)
        for attr, v in attrs.items():
            assert re.search(rf"\b{attr} = {v} : i(32|64)", calls[0]), (fmt, m, attr, calls[0][:900])
        if m == 16:
            assert "f4E2M1FN" not in "".join(ln for ln in text.splitlines()
                                              if "dynamic_slice" in ln), "elements sliced"
        if target == _plugin.LAYER_SM90_TARGET and m == 64:  # the partials, then slice mode's
            assert f"tensor<{2 * 64 * 256 + 4}xf32>" in calls[0], calls[0]  # gathered alpha
    # a long K: both plans split it alike, and the lowering adds the partials (true scale) and
    # applies the layer's alpha
    w = jbs.quantize(jax.random.normal(jax.random.PRNGKey(1), (3, 256, 4096)), "nvfp4",
                     layout="blocked", global_scale="per_matrix")
    text = lower_for_cuda(monkeypatch, lambda x, i: jbs.gemm(x, w, layer=i),
                          jnp.ones((1, 4096), jnp.bfloat16), 1)
    (call,) = [ln for ln in text.splitlines() if "stablehlo.custom_call @jax_blockscale" in ln]
    splits = cat.choose_decode_variant(1, 256, 4096, None, "nvfp4", 132)[1]
    assert splits > 1 and f"index_splits = {splits} :" in call and f"splits = {splits} :" in call
    assert "partials = 1 :" in call, call


def test_indexed_plan_past_decode_rows_is_refused_with_the_reason():
    """Past 64 rows there is no index mode: without a global scale the layer is sliced (the
    reason says so); with NVFP4's per-layer alpha, slice mode."""
    why = P.plan_ragged_sm90(_ragged_spec(None, "nvfp4", None, "bfloat16", 65, 4096, 4096, 16,
                                          group_index=True, alpha_is_one=True), H100)
    assert isinstance(why, str) and "the layer is sliced" in why, why
    p = P.plan_ragged_sm90(_ragged_spec(None, "nvfp4", None, "bfloat16", 65, 4096, 4096, 16,
                                        group_index=True), H100)
    assert p.kernel == "layer_slice" and p.layer.kernel == "register_weights", p


def _assert_refused(call: dict, over: dict, match: str):
    """The validator accepts `call` as planned and refuses it changed by `over`, saying `match`
    (a regular expression)."""
    assert _plugin.check_problem(**call)[0], call
    ok, msg = _plugin.check_problem(**dict(call, **over))
    assert not ok and re.search(match, msg), msg


@pytest.mark.parametrize("over,match", [
    (dict(items_bytes=12), "group index has 12 bytes"),
    (dict(num_items=3), r"index mode needs ceil\(M / 32\) = 1 items, got 3"),
    (dict(grouped=4), "grouped mode 4 unknown"),
])
def test_indexed_rejects(over, match):
    p = P.plan_ragged_sm90(_ragged_spec(None, "nvfp4", None, "bfloat16", 20, 4096, 4096, 16,
                                        group_index=True), H100)
    _assert_refused(_ragged_call_of(p), over, match)


def test_ragged_shards_keep_the_unsharded_plan():
    """A shard of an expert- or N-split call (ragged_sharding.py) runs the unsharded call's
    variant and split count over its own rows and experts, and C++ accepts that call. Planned
    for itself, an expert shard of the 2-GPU tests' problem (M 128, N 768, K 512, 16 experts)
    would run another item height and split count; at Qwen3-30B-A3B's gate+up the plans agree."""
    import dataclasses

    differs = 0
    for fa, fb, (m, n, k, g) in itertools.product(
            (None, "nvfp4"), ("nvfp4", "mxfp4"),
            ((128, 768, 512, 16), (128, 1536, 2048, 128), (2048, 1536, 2048, 128))):
        if fa is not None and fa != fb:
            continue
        whole = _ragged_spec(fa, fb, "blocked", "bfloat16", m, n, k, g)
        p = P.plan_ragged_sm90(whole, H100)
        for n_shard, g_shard in ((n, g // 2), (n // 2, g)):
            own = dataclasses.replace(whole, n=n_shard, groups=g_shard, shifted=g_shard < g)
            shard = P.plan_ragged_sm90(dataclasses.replace(own, plan_shape=(m, n, g)), H100)
            assert (shard.variant, shard.splits) == (p.variant, p.splits)
            assert shard.items == cat.ragged_decode_items(m, g_shard, shard.nt)
            kw = _ragged_call_of(shard)
            assert _plugin.check_problem(**kw)[0], kw
            mine = P.plan_ragged_sm90(own, H100)
            differs += (mine.variant, mine.splits) != (p.variant, p.splits)
    assert differs


@pytest.mark.parametrize("over,match", [
    (dict(tile_n=64), "no compiled sm90 grouped decode kernel"),
    (dict(grouped=0), "A buffer"),  # read as the dense kernel's call: L activations
    (dict(items_bytes=12 * 7), "work table has 84 bytes"),
    (dict(num_items=0, items_bytes=0), "work table of 0 items"),
    (dict(alpha_bytes=8), "one float32 per expert"),
    (dict(items_ptr=0), "work table pointer is null"),
    (dict(a_bytes=2 * 1024 * 129), "A buffer"),
    (dict(c_bytes=2 * 2048 * 1536 * 8), "output buffer"),
])
def test_ragged_rejects(over, match):
    import dataclasses

    # an expert-parallel shard (rows from row_start): a work table built by XLA
    spec = _ragged_spec(None, "mxfp4", None, "bfloat16", 128, 1536, 1024, 8)
    p = P.plan_ragged_sm90(dataclasses.replace(spec, shifted=True), H100)
    assert not p.raw_sizes
    _assert_refused(_ragged_call_of(p), over, match)


@pytest.mark.parametrize("m", [8, 32768])  # the grouped decode and register-weight kernels
def test_expert_stacks_past_2_gib_are_accepted_one_expert_is_not(m):
    """The handler checks B per expert, as the planner does (weights_fit_32bit_indexing):
    DeepSeek-V3's 256 experts of 4096 x 7168 (3.8 GB of MXFP4) are accepted as planned; an
    expert of more than 2^31 bytes is refused by name, before any buffer is looked at."""
    p = P.plan_ragged_sm90(_ragged_spec(None, "mxfp4", None, "bfloat16", m, 4096, 7168, 256),
                           H100)
    call = _ragged_call_of(p)
    assert call["b_bytes"] > 2**31
    _assert_refused(call, dict(n=600_000), "problem too large for 32-bit indexing")


def test_sizes_mode_is_planned_where_groups_start_at_row_0():
    """The grouped decode kernel makes its items from the raw sizes unless the call is an
    expert-parallel shard (row_start from the sharding rule: XLA's table carries it); the
    grouped register-weight kernel always reads a table."""
    import dataclasses

    spec = _ragged_spec(None, "mxfp4", None, "bfloat16", 128, 1536, 2048, 128)
    assert P.plan_ragged_sm90(spec, H100).raw_sizes
    assert not P.plan_ragged_sm90(dataclasses.replace(spec, shifted=True), H100).raw_sizes
    prefill = P.plan_ragged_sm90(dataclasses.replace(spec, m=8192), H100)
    assert prefill.kernel == "ragged_prefill" and not prefill.raw_sizes
    # a shard (plan_shape: the unsharded call) keeps sizes mode up to SIZES_MODE_MAX_SHARD_ROWS
    # rows; a bigger one (a dispatched shard's receive buffer, mostly unrouted rows) takes
    # XLA's table, which spreads the zero rows over many items
    small = dataclasses.replace(spec, m=256, groups=64, plan_shape=(256, 1536, 128))
    assert P.plan_ragged_sm90(small, H100).raw_sizes
    big = dataclasses.replace(spec, m=2048, groups=64, plan_shape=(2048, 1536, 128))
    assert big.m > cat.SIZES_MODE_MAX_SHARD_ROWS
    p = P.plan_ragged_sm90(big, H100)
    assert p.kernel == "ragged_decode" and not p.raw_sizes


def test_a_shard_schedules_its_own_tiles_per_cta():
    """A shard keeps the unsharded call's variant and splits (its sums) but takes its tiles of
    N per CTA from its own rows and experts: with half the experts, the unsharded call's count
    would leave it half the CTAs."""
    import dataclasses

    whole = _ragged_spec(None, "mxfp4", None, "bfloat16", 128, 1536, 2048, 128)
    shard = dataclasses.replace(whole, groups=64, plan_shape=(128, 1536, 128))
    pw, ps = P.plan_ragged_sm90(whole, H100), P.plan_ragged_sm90(shard, H100)
    own = P.plan_ragged_sm90(dataclasses.replace(shard, plan_shape=None), H100)
    assert (ps.variant, ps.splits) == (pw.variant, pw.splits)
    assert ps.tiles_per_cta == own.tiles_per_cta
    assert pw.tiles_per_cta == 2 and ps.tiles_per_cta == 1


@pytest.mark.parametrize("over,match", [
    (dict(items_bytes=4 * 7), r"group sizes have 28 bytes, expected 32 \(G = 8 int32\)"),
    (dict(num_items=4 + 8 + 1), r"at least ceil\(M / 32\) \+ min\(G, M\) \+ 2 = 14 items, got 13"),
    (dict(items_ptr=0), "work table pointer is null"),
])
def test_sizes_mode_rejects(over, match):
    p = P.plan_ragged_sm90(_ragged_spec(None, "mxfp4", None, "bfloat16", 128, 1536, 1024, 8),
                           H100)
    assert p.raw_sizes and p.tile[0] == 32
    kw = _ragged_call_of(p)
    assert kw["grouped"] == 3
    _assert_refused(kw, over, match)


def test_one_alpha_for_every_expert_is_the_decode_kernels():
    """The grouped decode kernel takes one float32 for every expert (no global scale); the
    grouped register-weight kernel needs one per expert."""
    for m, ok_one in ((128, True), (8192, False)):
        p = P.plan_ragged_sm90(_ragged_spec(None, "mxfp4", None, "bfloat16", m, 1536, 2048, 128),
                               H100)
        assert (p.kernel == "ragged_decode") == ok_one, p
        kw = _ragged_call_of(p)
        assert _plugin.check_problem(**kw)[0]
        ok, msg = _plugin.check_problem(**dict(kw, alpha_bytes=4))
        assert ok == ok_one and (ok or "one float32 per expert" in msg), msg
        ok, msg = _plugin.check_problem(**dict(kw, alpha_bytes=8))
        assert not ok and "one float32 per expert" in msg, msg


def test_sizes_mode_needs_the_decode_kernel():
    p = P.plan_ragged_sm90(_ragged_spec(None, "mxfp4", None, "bfloat16", 8192, 1536, 2048, 128),
                           H100)
    assert p.kernel == "ragged_prefill"
    _assert_refused(_ragged_call_of(p), dict(grouped=3, items_bytes=4 * 128),
                    "sizes mode needs the grouped decode kernel")


def test_tiles_per_cta_follow_the_tile_bytes_and_the_waves():
    """Several tiles of N per CTA where a tile's weights are few bytes and enough CTAs remain;
    long tiles one per CTA (the choices measured best or within 1 us in
    docs/design/sm90_ragged_decode.md)."""
    for (m, n, k, g), want in {
            (128, 1536, 2048, 128): 2,  # Qwen3-30B-A3B gate+up, 16 tokens: 128 KB tiles; 3
            # would leave 1.2 waves
            (8, 1536, 2048, 128): 1,  # 1 token: 8 experts, too few CTAs for more
            (512, 1536, 2048, 128): 3,  # 64 tokens: up to 320 KB per CTA
            (2048, 1536, 2048, 128): 3,  # 256 tokens (32-row items)
            (128, 2048, 768, 128): 3,  # its down projection: 48 KB tiles; 4 leave < 1.5 waves
            (512, 2048, 768, 128): 4,  # at 64 tokens: at most 4
            (64, 5760, 2880, 32): 1,  # gpt-oss-20b gate+up, 16 tokens: 180 KB tiles, 2 CTAs
            # per SM
            (256, 5760, 2880, 32): 1,  # 64 tokens: 16-row items, 184 KB tiles, 2 CTAs per SM
            (256, 2880, 2880, 32): 1,  # its down projection
            (1024, 5760, 2880, 128): 1,  # gpt-oss-120b gate+up, 256 tokens: the same
            (1024, 2880, 2880, 128): 1,  # its down projection
            (64, 2880, 2880, 128): 1,  # 16 tokens: 8-row items, 2 CTAs per SM
            (1024, 1536, 2048, 128): 3,  # Qwen3-30B-A3B gate+up, 128 tokens: 16-row items,
            # 128 KB tiles (short): up to 320 KB per CTA
            (1024, 2048, 768, 128): 4,  # its down projection: 48 KB tiles
    }.items():
        p = P.plan_ragged_sm90(_ragged_spec(None, "mxfp4", None, "bfloat16", m, n, k, g), H100)
        assert p.kernel == "ragged_decode" and p.tiles_per_cta == want, (m, n, k, g, p)
        assert _plugin.check_problem(**_ragged_call_of(p))[0]


@pytest.mark.parametrize("raw_sizes", [True, False])
@pytest.mark.parametrize("over,match", [
    (dict(tiles_per_cta=0), "0 tiles of N per CTA: 1, or 1..16 for the grouped decode kernel"),
    (dict(tiles_per_cta=17), "17 tiles of N per CTA"),
])
def test_tiles_per_cta_out_of_range_are_refused(raw_sizes, over, match):
    import dataclasses

    p = P.plan_ragged_sm90(_ragged_spec(None, "mxfp4", None, "bfloat16", 128, 1536, 2048, 128),
                           H100)
    p = dataclasses.replace(p, raw_sizes=raw_sizes)
    assert p.kernel == "ragged_decode" and p.tiles_per_cta > 1, p
    for per_cta in (1, 16):
        assert _plugin.check_problem(**dict(_ragged_call_of(p), tiles_per_cta=per_cta))[0]
    _assert_refused(_ragged_call_of(p), over, match)


def test_several_tiles_per_cta_are_the_grouped_decode_kernels():
    """Only the grouped decode kernel reads tiles of N per CTA (bits 8-11 of its a_e5m2): the
    grouped register-weight kernel and dense calls refuse anything but 1."""
    prefill = P.plan_ragged_sm90(_ragged_spec(None, "mxfp4", None, "bfloat16", 8192, 1536, 2048,
                                              128), H100)
    assert prefill.kernel == "ragged_prefill" and prefill.tiles_per_cta == 1
    _assert_refused(_ragged_call_of(prefill), dict(tiles_per_cta=2), "2 tiles of N per CTA")
    for m, kernel in ((1, "decode"), (48, "register_weights")):
        p = P.plan_sm90(_spec("nvfp4", "nvfp4", "blocked", "bfloat16", m, 4096, 4096), H100)
        assert p.kernel == kernel, p
        _assert_refused(_call_of(p), dict(tiles_per_cta=2), "2 tiles of N per CTA")


def test_ragged_lowering_hands_the_kernel_the_raw_sizes(monkeypatch):
    """At decode sizes the program is the kernel's call alone: the raw group sizes go in as they
    are (sizes mode, sizes_items = the plan's items) and nothing is computed before it (no
    clamp, prefix sum or table: each would be a kernel launch). At prefill sizes XLA builds the
    (items, 3) table and sizes_items is 0."""
    import jax_blockscale as jbs

    w = jbs.quantize(jax.random.normal(jax.random.PRNGKey(2), (16, 256, 512)), "mxfp4",
                     layout="blocked")
    for m, mode, table in ((32, "sizes", None), (4096, "table", "x3xi32")):
        x, gs = jnp.ones((m, 512), jnp.bfloat16), jnp.full((16,), m // 16, jnp.int32)
        text = lower_for_cuda(monkeypatch, lambda x, g: jbs.ragged_gemm(x, w, g), x, gs)
        calls = [ln for ln in text.splitlines()
                 if "stablehlo.custom_call @" + _plugin.RAGGED_SM90_TARGET in ln]
        assert len(calls) == 1, (m, calls)
        items = re.search(r"sizes_items = (\d+) : i64", calls[0])
        assert items, calls[0][:900]
        plan = P.plan_ragged_sm90(ragged_gemm_spec(x, w, gs), H100)
        assert re.search(rf"tiles_per_cta = {plan.tiles_per_cta} : i32", calls[0]), calls[0][:900]
        if mode == "sizes":
            assert int(items.group(1)) == cat.ragged_decode_items(m, 16, 1), calls[0][:900]
            # the raw sizes, and one alpha for every expert: a scalar constant (a splat (G,)
            # constant becomes a broadcast kernel in XLA)
            assert calls[0].split("->")[0].split(": (")[-1].rstrip().endswith(
                "tensor<f32>, tensor<16xi32>)"), calls[0][-400:]
            assert not re.search(r"stablehlo\.(reduce|compare|add|clamp|concatenate)\b", text), \
                "work done before the kernel"
        else:
            assert int(items.group(1)) == 0 and table in calls[0].split("->")[0]


# ---- the backend on a machine without a Hopper GPU, and its lowering --------------------------

def test_sm90_backend_declines_without_hopper():
    import jax_blockscale as jbs

    spec = _spec("nvfp4", "nvfp4", "plain", "bfloat16", 64, 64, 64)
    gpus = [d for d in jax.devices() if d.platform == "gpu"]
    if gpus and all(getattr(d, "compute_capability", "") == "9.0" for d in gpus):
        pytest.skip("this machine has a Hopper GPU")
    assert isinstance(P.plan_sm90(spec, P.device_for("cuda")), str)
    # and gemm still runs (on the reference backend)
    a = jbs.quantize(jnp.ones((8, 64)) * 0.5, "nvfp4")
    assert jbs.gemm(a, a).shape == (8, 8)


def _calls(text):
    return [ln for ln in text.splitlines() if "custom_call @" + _plugin.SM90_TARGET in ln]


@pytest.mark.parametrize("case", ["plain", "fold_batch_into_m", "batched", "pad_k", "weight_only",
                                  "dequantize_a", "register_weights_in_decode_rows",
                                  "decode_rows", "decode_rows_blocked_scales",
                                  "shared_memory_weights", "large_m"])
def test_lowering_emits_the_planned_call(monkeypatch, case):
    import jax_blockscale as jbs

    key = jax.random.PRNGKey(3)
    q = lambda shape, fmt, layout="plain": jbs.quantize(  # noqa: E731
        jax.random.normal(key, shape), fmt, layout=layout)
    env = dict(JAX_BLOCKSCALE_SM90_MAX_ROWS="0",  # the kernel at every size
               JAX_BLOCKSCALE_SM90_DEQUANT_A="0")  # the two-operand kernel's own layout
    if case == "plain":
        a, b, want = q((40, 64), "nvfp4"), q((24, 64), "nvfp4"), dict(m=40, n=24, k=64, l=1)
    elif case == "fold_batch_into_m":  # batched activations x one weight: one GEMM, M = 2*3*40
        a, b = q((2, 3, 40, 64), "mxfp8_e4m3", "blocked"), q((24, 64), "mxfp4", "blocked")
        want = dict(m=240, n=24, k=64, l=1, a_kind=3, b_kind=2, nt=0, tile_m=128)
    elif case == "batched":
        a, b = q((3, 40, 64), "mxfp8_e5m2"), q((3, 24, 64), "mxfp8_e4m3")
        want = dict(m=40, n=24, k=64, l=3, a_e5m2=1, b_e5m2=0)
    elif case == "pad_k":  # NVFP4 K % 32 == 16: padded to 64 (A's plain scales by a zero block)
        a, b = q((5, 48), "nvfp4"), q((7, 48), "nvfp4")
        want = dict(m=5, n=7, k=64, l=1, a_scales_plain=1, nt=1, tile_m=8)
    elif case == "weight_only":
        a = jax.random.normal(key, (9, 64)).astype(jnp.bfloat16)
        b, want = q((24, 64), "nvfp4"), dict(m=9, n=24, k=64, l=1, a_kind=4, nt=2)
    elif case == "dequantize_a":  # the fused kernel's rows: A dequantized, K-permuted (kind
        # 5) for the register-weight variant
        a, b = q((2, 3, 40, 64), "mxfp8_e4m3", "blocked"), q((24, 64), "mxfp4", "blocked")
        want = dict(m=240, n=24, k=64, l=1, a_kind=5, b_kind=2, tile_m=128, tile_n=64)
        env.pop("JAX_BLOCKSCALE_SM90_DEQUANT_A")
    elif case == "register_weights_in_decode_rows":  # fp4 weights from 33 rows: W4A4 too
        a, b = q((48, 128), "nvfp4"), q((24, 128), "nvfp4")
        want = dict(m=48, n=24, k=128, l=1, a_kind=5, b_kind=1, tile_m=64, splits=0)
        env.pop("JAX_BLOCKSCALE_SM90_DEQUANT_A")
    elif case == "decode_rows":  # up to 32 rows: the two-operand decode kernel, which reads the
        # activation's plain scales as they are
        a, b = q((32, 128), "nvfp4"), q((24, 128), "nvfp4")
        want = dict(m=32, n=24, k=128, l=1, a_kind=1, b_kind=1, a_scales_plain=1, nt=4)
        env.pop("JAX_BLOCKSCALE_SM90_DEQUANT_A")
    elif case == "decode_rows_blocked_scales":
        a, b = q((32, 128), "mxfp4", "blocked"), q((24, 128), "mxfp4")
        want = dict(m=32, n=24, k=128, l=1, a_kind=2, b_kind=2, a_scales_plain=0, nt=4)
        env.pop("JAX_BLOCKSCALE_SM90_DEQUANT_A")
    elif case == "shared_memory_weights":  # a K not a multiple of 64: no register weights
        a = jax.random.normal(key, (90, 96)).astype(jnp.bfloat16)
        b, want = q((24, 96), "nvfp4"), dict(m=90, n=24, k=96, l=1, a_kind=4, nt=0, tile_n=64)
    else:  # past the dispatch limit: dequantize + dot, no custom call
        a, b, want, env = q((1024, 64), "nvfp4"), q((24, 64), "nvfp4"), None, {}
    set_env(monkeypatch, **env)
    calls = _calls(lower_for_cuda(monkeypatch, lambda a, b: jbs.gemm(a, b, backend="sm90"), a, b))
    if want is None:
        assert not calls
        return
    assert len(calls) == 1, calls
    for attr, v in want.items():
        assert re.search(rf"\b{attr} = {v} : i(32|64)", calls[0]), (attr, v, calls[0][:600])


def test_lowering_declares_the_split_k_workspace(monkeypatch):
    """The plan's split count sizes the workspace result (the decode kernel; a register-weight
    variant whose tiles leave SMs idle); a fused kernel that does not split declares none."""
    import jax_blockscale as jbs

    as_if_hopper(monkeypatch)
    key = jax.random.PRNGKey(5)
    w = jbs.quantize(jax.random.normal(key, (300, 1024)), "nvfp4")

    def call(m, batch=()):
        x = jax.random.normal(key, batch + (m, 1024)).astype(jnp.bfloat16)
        f = lambda x, w: jbs.gemm(x, w, out_dtype=jnp.float32, backend="sm90")  # noqa: E731
        (c,) = _calls(jax.jit(f).trace(x, w).lower(lowering_platforms=("cuda",)).as_text())
        return c

    def splits(m):  # K ranges per output tile on 132 SMs
        return cat.choose_decode_variant(m, 300, 1024, None, "nvfp4", 132, out="f32")[1]

    assert splits(16) >= 2
    c = call(16)
    assert f"tensor<{splits(16) * 16 * 300}xf32>" in c and f"splits = {splits(16)} :" in c, c
    assert "partials = 1 :" in c, c  # the lowering adds the split partials
    c = call(7, (2,))  # folded: M = 14
    assert f"tensor<{splits(14) * 14 * 300}xf32>" in c, c
    c = call(8, (2, 3))  # folded: M = 48: a register-weight variant, 3 tiles of 64 x 128 on
    # 132 SMs: K's 16 k-tiles in 4 ranges of 4 (the most), partials added by the lowering
    assert f"tensor<{4 * 48 * 300}xf32>" in c and "nt = 0 :" in c and "splits = 4 :" in c, c
    assert "partials = 1 :" in c and f"a_kind = {KIND_CODES['bf16_kperm']} :" in c, c
    c = call(7, (2, 5))  # folded: M = 70, 128-row tiles: 16 k-tiles too short to split
    assert "tensor<0xf32>" in c and "nt = 0 :" in c and "partials = 0 :" in c, c
    set_env(monkeypatch, JAX_BLOCKSCALE_SM90_REGISTER_WEIGHT_SPLITS="1")
    c = call(8, (2, 3))  # no split: no workspace
    assert "tensor<0xf32>" in c and "splits = 0 :" in c and "partials = 0 :" in c, c
    set_env(monkeypatch, JAX_BLOCKSCALE_SM90_DECODE_MAX_ROWS="16",
            JAX_BLOCKSCALE_SM90_REGISTER_WEIGHT_SPLITS=None)
    c = call(7, (2, 2))  # folded: M = 28, over the configured limit: register weights, split
    assert "nt = 0 :" in c and f"tensor<{4 * 28 * 300}xf32>" in c, c


def test_activation_dequantized_only_where_bf16_fits_the_kernel():
    """A bf16 activation takes 2-4x the bytes of a quantized one: when it would overflow the
    kernel's 32-bit offsets, the two-operand kernel keeps the call (no late FFI error)."""
    for fmt in ("nvfp4", "mxfp8_e4m3"):
        assert P.plan_sm90(_spec(fmt, fmt, "plain", "bfloat16", 200, 64, 4096), H100).dequantize_a
        big = _spec(fmt, fmt, "plain", "bfloat16", 200, 64, 1 << 23)  # A: 3.4 GB as bf16
        assert P.fits_32bit_indexing(big)
        assert not P.fits_32bit_indexing(P.with_dequantized_activation(big))
        p = P.plan_sm90(big, H100)
        assert not p.dequantize_a and p.a_kind == cat.KIND_OF_FORMAT[fmt], p


def test_activation_k_order():
    """The lowering's permutation (a transpose of small activations, a gather of large ones)
    puts element activation_k_order()[p] in slot p of every k-tile,
    and that order is the one the kernel's threads feed (the catalogue's formula)."""
    from jax_blockscale.lowering.ffi_sm90 import permute_activation_k

    order = cat.activation_k_order()
    assert sorted(order) == list(range(64))
    for s_, h, hi, t, q in itertools.product(range(2), range(2), range(2), range(4), range(2)):
        assert order[16 * (2 * s_ + h) + 8 * hi + 2 * t + q] == 16 * t + 8 * s_ + 4 * q + 2 * h + hi
    rng = np.random.default_rng(0)
    small = (2, 3, 192)  # a transpose of K's digits
    big = (2, -(-cat.K_PERMUTE_GATHER_MIN_ELEMENTS // 384), 192)  # a gather along K
    for shape, op in ((small, "transpose"), (big, "gather")):
        x = rng.normal(size=shape).astype(np.float32)
        assert op in str(jax.make_jaxpr(permute_activation_k)(x)), (shape, op)
        y = np.asarray(permute_activation_k(jnp.asarray(x)))
        for j in range(3):
            np.testing.assert_array_equal(y[..., 64 * j:64 * (j + 1)],
                                          x[..., 64 * j:][..., order])
    with pytest.raises(ValueError, match="multiple of 64"):
        permute_activation_k(jnp.zeros((2, 96)))


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4", "mxfp8_e4m3"])
def test_register_weight_activation_order_per_weight_kind(monkeypatch, fmt):
    """The register-weight kernels, dense (128 rows) and grouped (4096 rows over 16 experts):
    FP4 weights get the activation K-permuted (a transpose or a gather along K before the call),
    fp8 weights read it in natural K order, so nothing moves it (the weights' scales may be
    swizzled: a transpose of bytes)."""
    import jax_blockscale as jbs

    kind = cat.KIND_OF_FORMAT[fmt]
    permuted = cat.register_weights_permute_k(kind)
    assert permuted == (kind != "mxfp8")
    key = jax.random.PRNGKey(3)
    dense = jbs.quantize(jax.random.normal(key, (4096, 1024)), fmt)
    grouped = jbs.quantize(jax.random.normal(key, (16, 256, 1024)), fmt, layout="blocked")
    x, xs = jnp.ones((128, 1024), jnp.bfloat16), jnp.ones((4096, 1024), jnp.bfloat16)
    gs = jnp.full((16,), 256, jnp.int32)
    for text, target in (
            (lower_for_cuda(monkeypatch, lambda x: jbs.gemm(x, dense), x), _plugin.SM90_TARGET),
            (lower_for_cuda(monkeypatch, lambda x, g: jbs.ragged_gemm(x, grouped, g), xs, gs),
             _plugin.RAGGED_SM90_TARGET)):
        (call,) = [ln for ln in text.splitlines() if "stablehlo.custom_call @" + target in ln]
        assert f"a_kind = {cat.KIND_CODES['bf16_kperm']} : i32" in call, call[:600]
        moved = re.search(r"stablehlo\.(transpose|gather)\b.*bf16", text) is not None
        assert moved == permuted, (fmt, target)


def test_kernel_row_limits():
    """Where the fused kernel hands over to dequantize + a bf16 GEMM: higher with the
    register-weight variants (K % 64 == 0), by weight size and activation format (measured
    crossovers)."""
    from jax_blockscale.config import Config

    def past(m, n, k, fa=None, **cfg):
        p = P.plan_sm90(_spec(fa, "nvfp4", None if fa is None else "plain", "bfloat16", m, n, k),
                        H100, cfg=Config(**cfg))
        return p.kernel in ("xla_dot", "dot_alpha")

    assert not past(2048, 16384, 16384) and past(2049, 16384, 16384)
    assert not past(2048, 16384, 16384, "nvfp4")
    assert not past(1024, 8192, 8192) and past(1025, 8192, 8192)
    assert not past(2048, 8192, 8192, "nvfp4")
    assert not past(512, 16384, 16384 + 32) and past(513, 16384, 16384 + 32)
    assert not past(1024, 4096, 4096) and past(1025, 4096, 4096)  # from 2^24 elements
    assert not past(256, 2048, 4096) and past(257, 2048, 4096)
    assert past(129, 8192, 8192, "nvfp4", sm90_dequant_a="0")
    assert not past(8192, 16384, 16384, sm90_max_rows=0)
