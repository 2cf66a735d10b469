"""The Blackwell (sm100) kernels in the shipped library, without a Blackwell GPU.

* the installed libjax_blockscale.so holds the sm100 variant table and one cubin per variant for
  sm_100a and sm_103a, whose SASS has the block-scaled MMA, scale copies and TMEM loads;
* the `jax_blockscale_gemm_sm100` FFI target registers;
* the handler's pure validation (C entry point `jbs_sm100_check_problem`) accepts / rejects the
  right problems, and accepts every variant the planner plans (naming it back);
* the JAX fp6 packer matches a NumPy bit-level packer;
* backend choice: never sm100 on CPU or on a (mocked) 9.0 device, a clear ValueError when forced;
  the CUDA lowering emits the sm100 custom call, with the planned tile, when the device is mocked
  as 10.0 / 10.3.
"""
from __future__ import annotations

import dataclasses
import itertools
import re
import types

import numpy as np
import pytest

import jax
import jax.numpy as jnp

import jax_blockscale as jbs
import cubins as _cubins  # tests/support/cubins.py
from configure import set_env  # tests/support/configure.py
from jax_blockscale import _plugin
from jax_blockscale.catalog import sm100 as cat100
from jax_blockscale.catalog.sm100 import ARCH_SM, FMT_CODES, OUT_CODES
from jax_blockscale.core.formats import get_format
from jax_blockscale.lowering import GemmSpec
from jax_blockscale.lowering import ffi_sm100
from jax_blockscale.lowering import plan as P

_lib_missing = _plugin.sm100_unavailable_reason()
needs_lib = pytest.mark.skipif(_lib_missing is not None,
                               reason=f"native library with sm100 unavailable: {_lib_missing}")


OUT_NAME = {"bfloat16": "bf16", "float16": "f16", "float32": "f32"}


# ---------------------------------------------------------------------------------------------
# fp6 packing (CPU only, no library needed)
# ---------------------------------------------------------------------------------------------

def _numpy_pack_fp6(codes: np.ndarray) -> np.ndarray:
    """Bit by bit: element i's bit j is bit 6i+j of a little-endian byte stream."""
    *lead, k = codes.shape
    bits = ((codes[..., :, None].astype(np.uint8) >> np.arange(6, dtype=np.uint8)) & 1)
    bits = bits.reshape(*lead, 6 * k)
    return np.packbits(bits, axis=-1, bitorder="little")


@pytest.mark.parametrize("shape", [(4,), (3, 128), (2, 5, 256)])
def test_fp6_packer_matches_numpy_bit_packer(shape):
    rng = np.random.default_rng(0)
    codes = rng.integers(0, 64, size=shape, dtype=np.uint8)
    got = np.asarray(jax.jit(ffi_sm100.pack_fp6)(jnp.asarray(codes)))
    want = _numpy_pack_fp6(codes)
    assert got.dtype == np.uint8 and got.shape == shape[:-1] + (shape[-1] * 3 // 4,)
    np.testing.assert_array_equal(got, want)


def test_fp6_packer_known_bytes():
    # element 0 = 0b111111 -> bits 0..5; element 1 = 1 -> bit 6; element 3 = 0b100000 -> bit 23
    codes = jnp.array([63, 1, 0, 32], jnp.uint8)
    assert list(np.asarray(ffi_sm100.pack_fp6(codes))) == [0x7F, 0x00, 0x80]


def test_fp6_packing_of_quantized_operand_round_trips():
    a = jbs.quantize(jax.random.normal(jax.random.PRNGKey(0), (8, 128)), "mxfp6_e3m2")
    codes = np.asarray(a.data)
    packed = _numpy_pack_fp6(codes)
    bits = np.unpackbits(packed, axis=-1, bitorder="little").reshape(8, 128, 6)
    np.testing.assert_array_equal((bits << np.arange(6)).sum(-1), codes)


# ---------------------------------------------------------------------------------------------
# The library: table, cubins, target
# ---------------------------------------------------------------------------------------------

@needs_lib
def test_sm100_target_registers():
    assert _plugin.register_targets()
    assert _plugin.has_sm100()
    assert _plugin.register_targets()  # idempotent


@needs_lib
def test_variant_table_is_the_kernel_matrix_for_both_archs():
    k = cat100  # the catalogue the build compiled
    table = _plugin.sm100_variants()
    names = [v["name"] for v in table]
    assert len(names) == len(set(names))
    got = {(v["sm"], v["fmt_a"], v["fmt_b"], v["out"], v["tile_m"], v["tile_n"],
            v["cluster_m"], v["cluster_n"], v["k_align"], v["n_align"], v["grouped"])
           for v in table}
    want = {(ARCH_SM[arch], FMT_CODES[v.fmt_a], FMT_CODES[v.fmt_b], OUT_CODES[v.out_dtype],
             v.tile_m, v.tile_n, v.cluster_m, v.cluster_n, v.k_align, v.n_align, int(v.grouped))
            for arch in k.SM100_ARCHS for v in k.VARIANTS + k.GROUPED_VARIANTS}
    assert got == want
    assert len(table) == len(k.SM100_ARCHS) * (len(k.VARIANTS) + len(k.GROUPED_VARIANTS))
    # every served pair has the 128x128 tile for every output on both archs, and the library
    # serves exactly the catalogue's pairs
    assert {(v["fmt_a"], v["fmt_b"]) for v in table} == {(FMT_CODES[a], FMT_CODES[b])
                                                          for a, b in k.PAIRS}
    for sm, (a, b), out in itertools.product((100, 103), k.PAIRS, OUT_CODES.values()):
        assert (sm, FMT_CODES[a], FMT_CODES[b], out, 128, 128) in {g[:6] for g in got}
    man = _plugin.sm100_manifest()
    if man is not None:  # installed next to the library by CMake
        assert sorted(v["name"] for v in man["variants"]) == sorted(names)
        assert man["fmt_codes"] == FMT_CODES and man["out_codes"] == OUT_CODES


@needs_lib
def test_library_holds_sm100a_and_sm103a_cubins_with_blackwell_sass(tmp_path):
    cubins = _cubins.find_cubins_in_file(_plugin.library_path())
    by_sm = {}
    for c in cubins:
        by_sm.setdefault(c.sm, []).append(c)
    n = len(cat100.VARIANTS) + len(cat100.GROUPED_VARIANTS)
    assert len(by_sm.get(100, [])) == n, {k: len(v) for k, v in by_sm.items()}
    assert len(by_sm.get(103, [])) == n, {k: len(v) for k, v in by_sm.items()}
    missing = _cubins.sass_tools_missing()
    if missing:
        pytest.skip(missing)
    for sm in (100, 103):
        mma_kinds = set()
        for i, c in enumerate(by_sm[sm]):
            ops = _cubins.opcodes(_cubins.dump_sass(c.write(str(tmp_path / f"{sm}_{i}.cubin"))))
            mma = {o.split(".")[0] for o in ops} & {"UTCOMMA", "UTCQMMA"}
            assert mma, f"sm_{sm}: cubin {i} has no block-scaled MMA"
            assert any(o.startswith("UTCCP") for o in ops), f"sm_{sm}: cubin {i} has no UTCCP"
            assert any(o.startswith("LDTM") for o in ops), f"sm_{sm}: cubin {i} has no LDTM"
            mma_kinds |= mma
        assert mma_kinds == {"UTCOMMA", "UTCQMMA"}  # fp4 kinds and the f8f6f4 kind


# ---------------------------------------------------------------------------------------------
# Validation (the handler's pure function)
# ---------------------------------------------------------------------------------------------

def _planned_tile(fmt_a, fmt_b, out, m, n, k, sm_count):
    """(tile_m, tile_n, cluster_m, cluster_n) the planner gives the problem (the catalogue's cost
    model); 128x128 1x1 (every pair has it) where it has none, so that the handler's own checks
    answer."""
    try:
        v = cat100.choose_sm100_variant(m, n, k, fmt_a, fmt_b, sm_count, out)
    except ValueError:  # a pair tcgen05 has no kind for, or an empty / negative extent
        v = None
    return (128, 128, 1, 1) if v is None else (v.tile_m, v.tile_n, v.cluster_m, v.cluster_n)


def _problem(fmt_a="nvfp4", fmt_b="nvfp4", out="bfloat16", m=256, n=512, k=1024, l=1, **kw):
    """The handler's view of one call; the tile attributes are the plan's unless given."""
    bits = {"nvfp4": 4, "mxfp4": 4, "mxfp6_e2m3": 6, "mxfp6_e3m2": 6, "mxfp8_e4m3": 8,
            "mxfp8_e5m2": 8}
    block = 16 if fmt_a == "nvfp4" else 32
    sk4 = -(-(k // block) // 4)
    p = dict(fmt_a=FMT_CODES[fmt_a], fmt_b=FMT_CODES[fmt_b], out=OUT_CODES[out], m=m, n=n, k=k,
             l=l, a_bytes=l * m * k * bits[fmt_a] // 8, b_bytes=l * n * k * bits[fmt_b] // 8,
             sa_bytes=l * -(-m // 128) * sk4 * 512, sb_bytes=l * -(-n // 128) * sk4 * 512,
             c_bytes=l * m * n * (4 if out == "float32" else 2), alpha_bytes=4)
    tile = _planned_tile(fmt_a, fmt_b, out, m, n, k, kw.get("sm_count", 148))
    p.update(zip(("tile_m", "tile_n", "cluster_m", "cluster_n"), tile))
    p.update(kw)
    return p


def _check(**kw):
    return _plugin.sm100_check_problem(**_problem(**kw))


@needs_lib
@pytest.mark.parametrize("case", [
    dict(),
    dict(m=1, n=8, k=32),
    dict(m=1000, n=1000, k=4096, l=3),  # partial M and N tiles
    dict(fmt_a="mxfp6_e2m3", fmt_b="mxfp6_e2m3", k=128),
    dict(fmt_a="mxfp8_e4m3", fmt_b="mxfp4", k=256, out="float32", n=4),
    dict(fmt_a="mxfp8_e5m2", fmt_b="mxfp8_e4m3", k=32, out="float16"),
    dict(cc_minor=3),
    dict(tile_m=256, tile_n=256, cluster_m=2, cluster_n=2),
    dict(sa_bytes=10**9),  # larger scale buffers are fine
])
def test_validation_accepts(case):
    ok, msg = _check(**case)
    assert ok, msg
    sm = "103a" if case.get("cc_minor") == 3 else "100a"
    assert msg.startswith(f"jbs_sm_{sm}_"), msg


@needs_lib
@pytest.mark.parametrize("case,why", [
    (dict(cc_major=9, cc_minor=0), "compute capability 10.0 or 10.3"),
    (dict(cc_major=12, cc_minor=0), "compute capability"),
    (dict(cc_major=10, cc_minor=1), "compute capability"),
    (dict(fmt_a="nvfp4", fmt_b="mxfp4"), "nvfp4"),
    (dict(k=1040), "multiple of 32"),
    (dict(fmt_a="mxfp6_e3m2", fmt_b="mxfp6_e3m2", k=96), "multiple of 128"),
    (dict(fmt_a="mxfp8_e4m3", fmt_b="mxfp4", k=64), "multiple of 128"),
    (dict(n=12), "multiple of 8"),
    (dict(n=6, out="float32"), "multiple of 4"),
    (dict(a_ptr=0x10008), "16-byte"),
    (dict(sb_ptr=0x10001), "16-byte"),
    (dict(c_ptr=0x10004), "16-byte"),
    (dict(alpha_ptr=0x10002), "alpha"),
    (dict(alpha_bytes=0), "alpha"),
    (dict(sa_bytes=512), "scales"),
    (dict(sb_bytes=1024), "scales"),
    (dict(a_bytes=1), "A is"),
    (dict(b_bytes=1), "B is"),
    (dict(c_bytes=2), "output buffer"),
    (dict(m=2**20, n=8, k=2**12), "2^31"),
    (dict(m=-1), "negative"),
    (dict(k=2**32), "int32"),
    (dict(tile_m=128, tile_n=192, cluster_m=1, cluster_n=1), "no compiled variant"),
    (dict(sm_count=0), "sm_count"),
])
def test_validation_rejects(case, why):
    ok, msg = _check(**case)
    assert not ok and why in msg, msg


def _grouped(fmt="nvfp4", out="bfloat16", m=512, n=256, k=512, g=8, **kw):
    """The grouped handler's view of one ragged_gemm call: A (m, K) one padded matrix, B (g, N, K),
    alpha one float per group, the table one int32 per 128-row tile."""
    p = _problem(fmt, fmt, out, m=m, n=n, k=k, l=g, tile_m=128, tile_n=128, cluster_m=1,
                 cluster_n=1, grouped=1, table_bytes=4 * (m // 128), alpha_bytes=4 * g)
    bits = 4 if fmt in ("nvfp4", "mxfp4") else 8
    block = 16 if fmt == "nvfp4" else 32
    p.update(a_bytes=m * k * bits // 8, sa_bytes=(m // 128) * -(-(k // block) // 4) * 512,
             c_bytes=m * n * (4 if out == "float32" else 2))
    p.update(kw)
    return p


@needs_lib
@pytest.mark.parametrize("case", [dict(), dict(fmt="mxfp4", out="float32"),
                                  dict(fmt="mxfp8_e4m3", out="float16", g=1), dict(cc_minor=3)])
def test_grouped_validation_accepts(case):
    ok, msg = _plugin.sm100_check_problem(**_grouped(**case))
    assert ok and "_grouped_" in msg, msg


@needs_lib
@pytest.mark.parametrize("case,why", [
    (dict(m=500), "whole tiles"),
    (dict(table_bytes=4), "tile table"),
    (dict(alpha_bytes=4), "one per group"),
    (dict(table_ptr=0x10002), "4-byte"),
    (dict(fmt="mxfp8_e5m2"), "no compiled grouped variant"),
    (dict(tile_n=256), "no compiled grouped variant"),
    (dict(a_bytes=1), "A is"),
    (dict(c_bytes=2), "output buffer"),
    (dict(grouped=0), "output buffer"),  # a dense call of these buffers has L batches of C
])
def test_grouped_validation_rejects(case, why):
    ok, msg = _plugin.sm100_check_problem(**_grouped(**case))
    assert not ok and why in msg, msg


@needs_lib
@pytest.mark.parametrize("dims", [dict(m=0), dict(n=0), dict(l=0), dict(k=0)])
def test_validation_empty_problems_launch_nothing(dims):
    ok, msg = _check(**dims)
    assert ok and msg == "empty", msg


# ---------------------------------------------------------------------------------------------
# Dispatch: the handler accepts the planned variant and names it back
# ---------------------------------------------------------------------------------------------

@needs_lib
def test_handler_accepts_and_names_the_planned_variant():
    ms = [1, 8, 100, 128, 129, 512, 1000, 2048, 8192]
    ns = [8, 64, 192, 256, 1000, 4096, 7168]
    ks = [128, 1024, 7168]
    pairs = [("nvfp4", "nvfp4"), ("mxfp8_e4m3", "mxfp8_e4m3"), ("mxfp4", "mxfp4"),
             ("mxfp8_e4m3", "mxfp4"), ("mxfp6_e2m3", "mxfp6_e2m3"), ("mxfp8_e5m2", "mxfp8_e5m2")]
    checked = 0
    for (fa, fb), out, sms, arch in itertools.product(
            pairs, ("bfloat16", "float32"), (148, 160, 20), ("sm_100a", "sm_103a")):
        device = P.Device("cuda", "sm100", sms)
        cc_minor = ARCH_SM[arch] - 100
        for m, n, kk in itertools.product(ms, ns, ks):
            plan = P.plan_sm100(_spec(fa, fb, m, n, kk, out), device)
            if isinstance(plan, str):  # no variant: the handler refuses the 128x128 tile too
                ok, msg = _check(fmt_a=fa, fmt_b=fb, out=out, m=m, n=n, k=kk, sm_count=sms,
                                 cc_minor=cc_minor, tile_m=128, tile_n=128, cluster_m=1,
                                 cluster_n=1)
                assert not ok, (m, n, kk, fa, fb, out, plan, msg)
                continue
            (tm, tn), (cm, cn) = plan.tile, plan.cluster
            ok, msg = _check(fmt_a=fa, fmt_b=fb, out=out, m=m, n=n, k=kk, sm_count=sms,
                             cc_minor=cc_minor, tile_m=tm, tile_n=tn, cluster_m=cm, cluster_n=cn)
            assert ok and msg == f"jbs_{arch}_{plan.variant}", (
                m, n, kk, fa, fb, out, sms, arch, plan.variant, msg)
            checked += 1
    assert checked > 1000


# ---------------------------------------------------------------------------------------------
# Backend selection and lowering
# ---------------------------------------------------------------------------------------------

def _spec(fmt_a="nvfp4", fmt_b="nvfp4", m=64, n=64, k=256, out=jnp.bfloat16):
    a_dtype = np.dtype(jnp.bfloat16) if fmt_a is None else np.dtype(get_format(fmt_a).storage_dtype)
    return GemmSpec(fmt_a=fmt_a, fmt_b=fmt_b, layout_a="plain", layout_b="plain",
                    a_dtype=a_dtype, out_dtype=np.dtype(out),
                    batch_shape=(), a_batch=(), b_batch=(), m=m, n=n, k=k)


def _q(shape, fmt, layout="plain", seed=3):
    return jbs.quantize(jax.random.normal(jax.random.PRNGKey(seed), shape), fmt, layout=layout)


_query_gpus = P._gpu_device.__wrapped__  # the planner's device query, uncached


def _mock_cc(monkeypatch, ccs, sm_count=148):
    """Make the planner see GPUs of compute capabilities `ccs`: the planner's own device query
    (plan._gpu_device) classifies stand-in devices, and the lowering then sees its answer."""
    fake = [types.SimpleNamespace(platform="gpu", compute_capability=cc, core_count=sm_count)
            for cc in ccs]
    with monkeypatch.context() as m:
        m.setattr(jax, "devices", lambda *args, **kw: fake)
        device = _query_gpus()
    monkeypatch.setattr(P, "_gpu_device", lambda: device)
    return device


def _why_not(spec):
    """Why the sm100 backend declines `spec` on the (mocked) CUDA device; None if it plans it."""
    p = ffi_sm100.SM100.plan(spec, P.device_for("cuda"))
    return p if isinstance(p, str) else None


def test_registered_with_priority_above_sm90():
    assert "sm100" in jbs.backend_names()
    from jax_blockscale.lowering import ffi_sm90 as sm90
    assert ffi_sm100.SM100.priority > sm90.SM90.priority
    assert ffi_sm100.SM100.platforms == ("cuda",)


def test_never_selected_on_cpu():
    assert P.plan(_spec(), "cpu").backend == "reference"
    with pytest.raises(ValueError, match="does not run on platform 'cpu'"):
        P.plan(_spec(), "cpu", requested="sm100")
    a, b = _q((16, 256), "nvfp4"), _q((32, 256), "nvfp4")
    with pytest.raises(ValueError, match="sm100"):
        jax.jit(lambda a, b: jbs.gemm(a, b, backend="sm100")).lower(a, b)
    assert "sm100" not in jax.jit(lambda a, b: jbs.gemm(a, b)).lower(a, b).as_text()


def test_not_selected_on_hopper_and_forcing_fails_clearly(monkeypatch):
    _mock_cc(monkeypatch, ["9.0"])
    why = _why_not(_spec())
    assert why is not None and "10.0 or 10.3" in why and "sm90" in why
    assert P.plan(_spec(), "cuda").backend != "sm100"
    with pytest.raises(ValueError, match="gemm backend 'sm100' cannot run this problem: .*sm90"):
        P.plan(_spec(), "cuda", requested="sm100")
    a, b = _q((16, 256), "nvfp4"), _q((32, 256), "nvfp4")
    with pytest.raises(ValueError, match="compute capability 10.0 or 10.3"):
        jax.jit(lambda a, b: jbs.gemm(a, b, backend="sm100")).trace(a, b).lower(
            lowering_platforms=("cuda",))


@pytest.mark.parametrize("ccs", [["12.0"], ["10.0", "9.0"], ["11.0"]])
def test_not_selected_on_other_devices(monkeypatch, ccs):
    _mock_cc(monkeypatch, ccs)
    assert "compute capability" in _why_not(_spec())
    assert P.plan(_spec(), "cuda").backend == "reference"


@pytest.mark.parametrize("spec_kw,why", [
    (dict(fmt_a=None), "reference"),
    (dict(fmt_a="nvfp4", fmt_b="mxfp4"), "no nvfp4 x mxfp4"),
    (dict(fmt_a="mxfp6_e2m3", fmt_b="mxfp6_e2m3", k=96), "multiple of 128"),
    (dict(n=12), "multiple of 8"),
    (dict(m=2**20, n=4096, k=4096), "32-bit"),
    (dict(m=0), "empty"),
])
def test_unsupported_on_blackwell(monkeypatch, spec_kw, why):
    _mock_cc(monkeypatch, ["10.0"])  # the problem is refused before the library is consulted
    assert why in _why_not(_spec(**spec_kw))


@needs_lib
@pytest.mark.parametrize("ccs", [["10.0"], ["10.3"], ["10.0", "10.3"]])
def test_selected_on_blackwell(monkeypatch, ccs):
    _mock_cc(monkeypatch, ccs)
    assert _why_not(_spec()) is None
    p = P.plan(_spec(), "cuda")
    assert (p.backend, p.kernel, p.platform) == ("sm100", "sm100", "cuda")
    assert p.variant in {v.name for v in cat100.VARIANTS}
    # weight-only on Blackwell: reference (sm90 needs 9.0)
    wo = dataclasses.replace(_spec(), fmt_a=None, a_dtype=np.dtype(jnp.bfloat16))
    assert P.plan(wo, "cuda").backend == "reference"


def _lower_for_blackwell(monkeypatch, f, *args):
    _mock_cc(monkeypatch, ["10.0"])
    return jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


@needs_lib
@pytest.mark.parametrize("case", ["nvfp4", "fold_batch_into_m", "batched", "mxfp6", "mixed",
                                  "forced_tile", "auto"])
def test_lowering_emits_the_sm100_custom_call(monkeypatch, case):
    backend = "sm100"
    if case == "nvfp4":
        a, b = _q((40, 256), "nvfp4"), _q((24, 256), "nvfp4")
        # the planned variant travels as attributes (the handler chooses nothing)
        v = cat100.choose_sm100_variant(40, 24, 256, "nvfp4", "nvfp4", 148, "bfloat16")
        want = dict(m=40, n=24, k=256, l=1, fmt_a=1, fmt_b=1, tile_m=v.tile_m, tile_n=v.tile_n,
                    cluster_m=v.cluster_m, cluster_n=v.cluster_n)
        shapes = ["tensor<1x40x128xui8>", "tensor<1x24x128xui8>"]
    elif case == "fold_batch_into_m":
        a, b = _q((2, 3, 40, 128), "mxfp8_e4m3", "blocked"), _q((24, 128), "mxfp8_e4m3", "blocked")
        want = dict(m=240, n=24, k=128, l=1, fmt_a=5, fmt_b=5)
        shapes = ["tensor<1x240x128xui8>"]
    elif case == "batched":
        a, b = _q((3, 40, 128), "mxfp8_e5m2"), _q((3, 24, 128), "mxfp8_e4m3")
        want = dict(m=40, n=24, k=128, l=3, fmt_a=6, fmt_b=5)
        shapes = ["tensor<3x40x128xui8>", "tensor<3x24x128xui8>"]
    elif case == "mxfp6":  # packed: 128 elements -> 96 bytes
        a, b = _q((40, 128), "mxfp6_e2m3"), _q((24, 128), "mxfp6_e2m3")
        want = dict(m=40, n=24, k=128, l=1, fmt_a=3, fmt_b=3)
        shapes = ["tensor<1x40x96xui8>", "tensor<1x24x96xui8>"]
    elif case == "mixed":
        a, b = _q((40, 256), "mxfp8_e4m3"), _q((24, 256), "mxfp4")
        want = dict(m=40, n=24, k=256, l=1, fmt_a=5, fmt_b=2)
        shapes = ["tensor<1x40x256xui8>", "tensor<1x24x128xui8>"]
    elif case == "forced_tile":
        set_env(monkeypatch, JAX_BLOCKSCALE_SM100_TILE="256x256c2x1")
        a, b = _q((40, 256), "nvfp4"), _q((24, 256), "nvfp4")
        want = dict(tile_m=256, tile_n=256, cluster_m=2, cluster_n=1)
        shapes = []
    else:  # chosen automatically (priority above sm90 and reference)
        backend = None
        a, b = _q((40, 256), "nvfp4"), _q((24, 256), "nvfp4")
        want, shapes = dict(m=40), []
    text = _lower_for_blackwell(monkeypatch, lambda a, b: jbs.gemm(a, b, backend=backend), a, b)
    calls = [ln for ln in text.splitlines() if "custom_call @" + _plugin.SM100_TARGET in ln]
    assert len(calls) == 1, text[-2000:]
    for attr, v in want.items():
        assert re.search(rf"\b{attr} = {v} : i(32|64)", calls[0]), (attr, v, calls[0][:600])
    for s in shapes:
        assert s in calls[0], (s, calls[0][:600])
    for attr in ("tile_m", "tile_n", "cluster_m", "cluster_n"):  # never 0 ("handler chooses")
        assert not re.search(rf"\b{attr} = 0 : i32", calls[0]), (attr, calls[0][:600])
    assert "jax_blockscale_gemm_sm90" not in text


@needs_lib
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp8_e4m3"])
def test_ragged_gemm_lowers_to_the_grouped_sm100_kernel(monkeypatch, fmt):
    """ragged_gemm on a (mocked) B200: one call of the grouped target with the activation
    padded to whole 128-row tiles per group (the static bound), the tile table and one alpha
    per expert; the grouped variant's tile as attributes. Weight-only and `layer=` calls are
    declined (they run on the reference)."""
    assert _plugin.has_ragged_sm100()
    g, m, n, k = 8, 40, 64, 256
    x = _q((m, k), fmt)
    w = jbs.quantize(jax.random.normal(jax.random.PRNGKey(2), (g, n, k)), fmt, layout="blocked",
                     **(dict(global_scale="per_matrix") if fmt == "nvfp4" else {}))
    gs = jnp.asarray([5, 0, 10, 0, 20, 5, 0, 0], jnp.int32)
    text = _lower_for_blackwell(monkeypatch, lambda x, w, gs: jbs.ragged_gemm(x, w, gs), x, w, gs)
    calls = [ln for ln in text.splitlines() if "custom_call @" + _plugin.RAGGED_SM100_TARGET in ln]
    assert len(calls) == 1, text[-2000:]
    rows = cat100.grouped_padded_rows(m, g)
    bytes_per_row = k // 2 if fmt == "nvfp4" else k
    for s in (f"tensor<{rows}x{bytes_per_row}xui8>", f"tensor<{g}xf32>",
              f"tensor<{rows // 128}xi32>", f"tensor<{rows}x{n}xbf16>"):
        assert s in calls[0], (s, calls[0][:800])
    for attr, v in dict(m=rows, n=n, k=k, g=g, tile_m=128, tile_n=128,
                        fmt_a=FMT_CODES[fmt], fmt_b=FMT_CODES[fmt]).items():
        assert re.search(rf"\b{attr} = {v} : i(32|64)", calls[0]), (attr, v, calls[0][:800])
    xw = jax.random.normal(jax.random.PRNGKey(3), (m, k)).astype(jnp.bfloat16)
    text = _lower_for_blackwell(monkeypatch, lambda x, w, gs: jbs.ragged_gemm(x, w, gs), xw, w,
                                gs)
    assert "custom_call @jax_blockscale_ragged" not in text  # weight-only: the reference


@needs_lib
def test_weight_only_on_blackwell_lowers_to_reference(monkeypatch):
    x = jax.random.normal(jax.random.PRNGKey(1), (9, 256)).astype(jnp.bfloat16)
    b = _q((24, 256), "nvfp4")
    # on a 10.0 device the sm90 backend declines by itself (it needs 9.0)
    text = _lower_for_blackwell(monkeypatch, lambda a, b: jbs.gemm(a, b), x, b)
    assert "custom_call @jax_blockscale_gemm" not in text
    with pytest.raises(ValueError, match="weight-only .*`reference`"):
        _lower_for_blackwell(monkeypatch, lambda a, b: jbs.gemm(a, b, backend="sm100"), x, b)


# ---------------------------------------------------------------------------------------------
# On a real non-Blackwell GPU (the H100 CI run)
# ---------------------------------------------------------------------------------------------

@pytest.mark.gpu
def test_gpu_sm100_never_chosen_and_forcing_fails_clearly():
    gpus = jax.devices("gpu")
    ccs = {str(getattr(d, "compute_capability", "?")) for d in gpus}
    if ccs <= {"10.0", "10.3"}:
        pytest.skip("this machine has a Blackwell GPU")
    P._gpu_device.cache_clear()
    assert "compute capability" in _why_not(_spec())
    a, b = _q((40, 256), "nvfp4"), _q((24, 256), "nvfp4")
    f = jax.jit(lambda a, b: jbs.gemm(a, b))
    assert _plugin.SM100_TARGET not in f.lower(a, b).as_text()
    y = f(a, b)
    assert y.shape == (40, 24) and bool(jnp.all(jnp.isfinite(y)))
    with pytest.raises(ValueError, match="compute capability 10.0 or 10.3"):
        jax.jit(lambda a, b: jbs.gemm(a, b, backend="sm100"))(a, b)


# ---------------------------------------------------------------------------------------------
# On a Blackwell GPU (B200/GB200/B300/GB300): end to end through jbs.gemm vs the reference
# ---------------------------------------------------------------------------------------------

_E2E = [("nvfp4", "nvfp4", (3, 200, 512), (264, 512)),   # batch folded into M, partial tiles
        ("nvfp4", "nvfp4", (2, 64, 256), (2, 128, 256)),  # batched L = 2
        ("mxfp4", "mxfp4", (1000, 1024), (512, 1024)),
        ("mxfp8_e4m3", "mxfp8_e4m3", (4, 256), (1024, 256)),
        ("mxfp8_e5m2", "mxfp8_e4m3", (96, 128), (64, 128)),
        ("mxfp8_e4m3", "mxfp4", (300, 512), (192, 512)),
        ("mxfp6_e2m3", "mxfp6_e2m3", (128, 384), (256, 384)),
        ("mxfp6_e3m2", "mxfp6_e3m2", (77, 256), (64, 256)),
        ("mxfp8_e4m3", "mxfp6_e2m3", (64, 256), (64, 256))]


@pytest.mark.gpu
@pytest.mark.parametrize("out", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("fa,fb,sa,sb", _E2E, ids=[f"{c[0]}-{c[1]}-{c[2]}" for c in _E2E])
def test_gpu_blackwell_matches_reference(fa, fb, sa, sb, out):
    ccs = {str(getattr(d, "compute_capability", "?")) for d in jax.devices("gpu")}
    if not ccs <= {"10.0", "10.3"}:
        pytest.skip(f"needs a Blackwell GPU (10.0 / 10.3), found {sorted(ccs)}")
    P._gpu_device.cache_clear()
    a, b = _q(sa, fa, seed=1), _q(sb, fb, seed=2)
    f = jax.jit(lambda a, b: jbs.gemm(a, b, out_dtype=out, backend="sm100"))
    assert _plugin.SM100_TARGET in f.lower(a, b).as_text()
    got = np.asarray(f(a, b), np.float64)
    want = np.asarray(jax.jit(lambda a, b: jbs.gemm(a, b, out_dtype=jnp.float32,
                                                     backend="reference"))(a, b), np.float64)
    err = np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30)
    assert err < (1e-5 if out == jnp.float32 else 1e-2), err


@needs_lib
@pytest.mark.parametrize("fa,fb,sa,sb", _E2E, ids=[f"{c[0]}-{c[1]}-{c[2]}" for c in _E2E])
def test_gpu_cases_lower_to_sm100_on_cpu(monkeypatch, fa, fb, sa, sb):
    """The Blackwell end-to-end cases are all ones the sm100 backend takes (checked here)."""
    a, b = _q(sa, fa, seed=1), _q(sb, fb, seed=2)
    text = _lower_for_blackwell(
        monkeypatch, lambda a, b: jbs.gemm(a, b, out_dtype=jnp.float32, backend="sm100"), a, b)
    assert text.count("custom_call @" + _plugin.SM100_TARGET) == 1


_RAGGED_E2E = [("nvfp4", 37, 256, 512, [10, 0, 20, 7, 0, 0, 0, 0]),  # empty experts
               ("mxfp4", 300, 128, 256, [0, 299, 1]),  # one expert holds (almost) every row
               ("mxfp8_e4m3", 200, 64, 128, [50, 0, 60])]  # rows past the groups are zero


@pytest.mark.gpu
@pytest.mark.parametrize("fmt,m,n,k,sizes", _RAGGED_E2E, ids=[c[0] for c in _RAGGED_E2E])
def test_gpu_blackwell_ragged_matches_reference(fmt, m, n, k, sizes):
    """ragged_gemm on the grouped sm100 kernel (a Blackwell GPU) against the reference backend,
    f32 output; the allocator is handed NaN first so a row read from an unwritten tile shows."""
    ccs = {str(getattr(d, "compute_capability", "?")) for d in jax.devices("gpu")}
    if not ccs <= {"10.0", "10.3"}:
        pytest.skip(f"needs a Blackwell GPU (10.0 / 10.3), found {sorted(ccs)}")
    P._gpu_device.cache_clear()
    g = len(sizes)
    x = _q((m, k), fmt, seed=4)
    w = jbs.quantize(jax.random.normal(jax.random.PRNGKey(5), (g, n, k)), fmt, layout="blocked",
                     **(dict(global_scale="per_matrix") if fmt == "nvfp4" else {}))
    gs = jnp.asarray(sizes, jnp.int32)
    f = jax.jit(lambda x, w, gs: jbs.ragged_gemm(x, w, gs, out_dtype=jnp.float32,
                                                 backend="sm100"))
    assert _plugin.RAGGED_SM100_TARGET in f.lower(x, w, gs).as_text()
    jnp.full((1 << 26,), jnp.nan, jnp.float32).block_until_ready()  # NaN in freed memory
    got = np.asarray(f(x, w, gs), np.float64)
    want = np.asarray(jbs.ragged_gemm(x, w, gs, out_dtype=jnp.float32, backend="reference"),
                      np.float64)
    assert np.isfinite(got).all()
    np.testing.assert_array_equal(got == 0, want == 0)
    assert np.linalg.norm(got - want) <= 1e-5 * max(np.linalg.norm(want), 1e-30)
