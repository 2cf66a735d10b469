"""The native library on a machine without a GPU: it loads, its FFI targets register, its variant
table covers what the sm90 kernel claims, and the FFI handler's validation (a pure function,
reached through the exported C entry point `jbs_check_problem`) accepts exactly what the kernel
can run. Skipped when the package was installed without the library
(JAX_BLOCKSCALE_SKIP_NATIVE=1)."""
from __future__ import annotations

import itertools
import math
import re

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from hopper import lower_for_cuda  # tests/support/hopper.py
from jax_blockscale import _plugin
from jax_blockscale.aot import KIND_CODES, OUT_CODES

if _plugin.unavailable_reason() is not None:
    pytest.skip(f"native library unavailable: {_plugin.unavailable_reason()}",
                allow_module_level=True)

# What the kernel module claims (kept free of a cutlass import: the installed package has no DSL)
CLAIMED_PAIRS = [("nvfp4", "nvfp4"), ("mxfp4", "mxfp4"), ("mxfp8", "mxfp8"), ("mxfp8", "mxfp4"),
                 ("bf16", "nvfp4"), ("bf16", "mxfp4"), ("bf16", "mxfp8")]
CLAIMED_OUTS = ["bf16", "f16", "f32"]
CLAIMED_TILE_N = [64, 128, 256]
BLOCK = {"nvfp4": 16, "mxfp4": 32, "mxfp8": 32, "bf16": None, "bf16_kperm": None}
# the register-weight variants: (activation rows, weight rows) tiles, fp4 weights
CLAIMED_RW_KINDS = ["nvfp4", "mxfp4", "mxfp8"]
CLAIMED_RW_TILES = [(16, 64), (16, 128), (32, 64), (32, 128), (64, 64), (64, 128), (128, 64), (128, 128)]


def test_library_loads_and_registers():
    assert _plugin.load() is not None
    assert _plugin.register_targets()
    assert _plugin.register_targets()  # idempotent


def test_variant_table_covers_the_kernel():
    got = {(v["a_kind"], v["b_kind"], v["out"], v["tile_m"], v["tile_n"], v["sm"])
           for v in _plugin.variants()}
    want = {(KIND_CODES[a], KIND_CODES[b], OUT_CODES[o], 128, tn, 90)
            for (a, b), o, tn in itertools.product(CLAIMED_PAIRS, CLAIMED_OUTS, CLAIMED_TILE_N)}
    want |= {(KIND_CODES["bf16_kperm"], KIND_CODES[b], OUT_CODES[o], tm, tn, 90)
             for b, o, (tm, tn) in itertools.product(CLAIMED_RW_KINDS, CLAIMED_OUTS,
                                                     CLAIMED_RW_TILES)}
    assert want <= got, f"missing variants: {sorted(want - got)}"
    names = [v["name"] for v in _plugin.variants()]
    assert len(names) == len(set(names)), "function prefixes must be unique"


def test_kernel_module_claims_match(request):
    """When the DSL is importable (a build environment), the kernel's own list is the same."""
    try:
        from jax_blockscale.kernels import sm90_blockscaled as k
    except Exception:  # noqa: BLE001  (no cutlass-dsl at run time is the normal case)
        pytest.skip("nvidia-cutlass-dsl not installed")
    assert sorted(k.PAIRS) == sorted(CLAIMED_PAIRS)
    assert sorted(k.OUT_DTYPES) == sorted(CLAIMED_OUTS)
    assert sorted(k.REGISTER_WEIGHT_KINDS) == sorted(CLAIMED_RW_KINDS)
    assert sorted(k.REGISTER_WEIGHT_TILES) == CLAIMED_RW_TILES


def test_manifest_matches_library():
    man = _plugin.manifest()
    if man is None:
        pytest.skip("no sm90_variants.json next to the library (library given by env var)")
    assert sorted(v["name"] for v in man["variants"]) == sorted(
        v["name"] for v in _plugin.variants())


# ---- the handler's validation, without a GPU ---------------------------------------------------

def _row_bytes(kind, k):
    return {"nvfp4": k // 2, "mxfp4": k // 2, "mxfp8": k, "bf16": 2 * k, "bf16_kperm": 2 * k}[kind]


def _scale_bytes(l, mn, k, block):
    return l * math.ceil(mn / 128) * math.ceil(k // block / 4) * 512


def problem(a="nvfp4", b="nvfp4", out="bf16", m=100, n=70, k=256, l=2, **over):
    """A valid call, as the FFI handler would see it; `over` replaces any field."""
    kw = dict(a_kind=KIND_CODES[a], b_kind=KIND_CODES[b], out=OUT_CODES[out], a_e5m2=0,
              b_e5m2=0, m=m, n=n, k=k, l=l, a_ptr=0x10000, b_ptr=0x20000, sa_ptr=0x30000,
              sb_ptr=0x40000, c_ptr=0x50000, alpha_ptr=0x60000,
              a_bytes=l * m * _row_bytes(a, k), b_bytes=l * n * _row_bytes(b, k),
              sa_bytes=_scale_bytes(l, m, k, BLOCK[a]) if BLOCK[a] else 16,
              sb_bytes=_scale_bytes(l, n, k, BLOCK[b]),
              c_bytes=l * m * n * {"bf16": 2, "f16": 2, "f32": 4}[out], alpha_bytes=4,
              cc_major=9, cc_minor=0, sm_count=132)
    kw.update(over)
    return kw


@pytest.mark.parametrize("pair", CLAIMED_PAIRS)
@pytest.mark.parametrize("out", CLAIMED_OUTS)
def test_accepts_every_claimed_pair(pair, out):
    ok, msg = _plugin.check_problem(**problem(*pair, out=out))
    assert ok, msg
    assert msg.startswith(f"jbs_sm90_{pair[0]}_{pair[1]}_{out}_128x")


@pytest.mark.parametrize("m,n,k,l", [(1, 1, 32, 1), (7, 13, 96, 1), (129, 257, 64, 3),
                                     (4096, 8192, 8192, 1)])
def test_accepts_odd_shapes(m, n, k, l):
    ok, msg = _plugin.check_problem(**problem(m=m, n=n, k=k, l=l))
    assert ok, msg


@pytest.mark.parametrize("over,match", [
    (dict(cc_major=8, cc_minor=0), "compute capability 9.0"),
    (dict(cc_major=10, cc_minor=0), "compute capability 9.0"),
    (dict(cc_major=9, cc_minor=1), "compute capability 9.0"),
    (dict(a_kind=9), "unknown operand kinds"),
    (dict(out=7), "output dtype"),
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
])
def test_rejects_bad_calls(over, match):
    kw = problem()
    kw.update(over)
    ok, msg = _plugin.check_problem(**kw)
    assert not ok
    assert re.search(match, msg), msg


def test_rejects_k_not_multiple_of_32():
    # K must give 16-byte TMA rows (the lowering pads NVFP4's K % 32 == 16 case)
    p = problem(k=48)
    ok, msg = _plugin.check_problem(**p)
    assert not ok and "multiple of 32" in msg


def test_rejects_unimplemented_pairs():
    for a, b in [("mxfp4", "mxfp8"), ("nvfp4", "mxfp4"), ("bf16", "bf16")]:
        kw = problem("mxfp8", "mxfp8")
        kw.update(a_kind=KIND_CODES[a], b_kind=KIND_CODES[b] if b != "bf16" else 9)
        ok, msg = _plugin.check_problem(**kw)
        assert not ok, (a, b)


def test_rejects_32bit_overflow():
    ok, msg = _plugin.check_problem(**problem(m=65536, n=65536, k=64, l=1))
    assert not ok and "32-bit" in msg


def test_tile_heuristic():
    small = _plugin.check_problem(**problem(m=16, n=8192, k=8192, l=1))
    large = _plugin.check_problem(**problem(m=8192, n=8192, k=8192, l=1))
    mid = _plugin.check_problem(**problem(m=512, n=8192, k=8192, l=1))
    assert small[1].endswith("128x64") and large[1].endswith("128x256") and mid[1].endswith(
        "128x128"), (small, mid, large)


# ---- the backend on a machine without a Hopper GPU ---------------------------------------------

def test_sm90_backend_declines_without_hopper():
    import jax_blockscale as jbs
    from jax_blockscale.lowering import ffi as sm90
    from jax_blockscale.lowering import GemmSpec

    spec = GemmSpec("nvfp4", "nvfp4", "plain", "plain", np.dtype(jnp.float4_e2m1fn),
                    np.dtype(jnp.bfloat16), (), (), (), 64, 64, 64)
    gpus = [d for d in jax.devices() if d.platform == "gpu"]
    if gpus and all(getattr(d, "compute_capability", "") == "9.0" for d in gpus):
        pytest.skip("this machine has a Hopper GPU")
    assert sm90.SM90.unsupported_reason(spec) is not None
    # and gemm still runs (on the reference backend)
    a = jbs.quantize(jnp.ones((8, 64)) * 0.5, "nvfp4")
    assert jbs.gemm(a, a).shape == (8, 8)


@pytest.mark.parametrize("case", ["plain", "fold_batch_into_m", "batched", "pad_k", "weight_only",
                                  "dequantize_a", "register_weights_in_decode_rows",
                                  "decode_rows", "decode_rows_blocked_scales",
                                  "shared_memory_weights", "large_m"])
def test_lowering_emits_the_custom_call(monkeypatch, case):
    import jax_blockscale as jbs

    key = jax.random.PRNGKey(3)
    q = lambda shape, fmt, layout="plain": jbs.quantize(  # noqa: E731
        jax.random.normal(key, shape), fmt, layout=layout)
    if case == "plain":
        a, b, want = q((40, 64), "nvfp4"), q((24, 64), "nvfp4"), dict(m=40, n=24, k=64, l=1)
    elif case == "fold_batch_into_m":  # batched activations x one weight: one GEMM, M = 2*3*40
        a, b = q((2, 3, 40, 64), "mxfp8_e4m3", "blocked"), q((24, 64), "mxfp4", "blocked")
        want = dict(m=240, n=24, k=64, l=1, a_kind=3, b_kind=2)
    elif case == "batched":
        a, b = q((3, 40, 64), "mxfp8_e5m2"), q((3, 24, 64), "mxfp8_e4m3")
        want = dict(m=40, n=24, k=64, l=3, a_e5m2=1, b_e5m2=0)
    elif case == "pad_k":  # NVFP4 K % 32 == 16: padded to 64 (A's plain scales by a zero block)
        a, b = q((5, 48), "nvfp4"), q((7, 48), "nvfp4")
        want = dict(m=5, n=7, k=64, l=1, a_scales_plain=1)
    elif case == "weight_only":
        a = jax.random.normal(key, (9, 64)).astype(jnp.bfloat16)
        b, want = q((24, 64), "nvfp4"), dict(m=9, n=24, k=64, l=1, a_kind=4)
    elif case == "dequantize_a":  # the fused kernel's rows: A dequantized, K-permuted (kind
        # 5) for the register-weight variant
        a, b = q((2, 3, 40, 64), "mxfp8_e4m3", "blocked"), q((24, 64), "mxfp4", "blocked")
        want = dict(m=240, n=24, k=64, l=1, a_kind=5, b_kind=2)
    elif case == "register_weights_in_decode_rows":  # fp4 weights from 33 rows: W4A4 too
        a, b = q((48, 128), "nvfp4"), q((24, 128), "nvfp4")
        want = dict(m=48, n=24, k=128, l=1, a_kind=5, b_kind=1)
    elif case == "decode_rows":  # up to 32 rows: the two-operand decode kernel, which reads the
        # activation's plain scales as they are
        a, b = q((32, 128), "nvfp4"), q((24, 128), "nvfp4")
        want = dict(m=32, n=24, k=128, l=1, a_kind=1, b_kind=1, a_scales_plain=1)
    elif case == "decode_rows_blocked_scales":
        a, b = q((32, 128), "mxfp4", "blocked"), q((24, 128), "mxfp4")
        want = dict(m=32, n=24, k=128, l=1, a_kind=2, b_kind=2, a_scales_plain=0)
    elif case == "shared_memory_weights":  # a K not a multiple of 64: no register weights
        a = jax.random.normal(key, (90, 96)).astype(jnp.bfloat16)
        b, want = q((24, 96), "nvfp4"), dict(m=90, n=24, k=96, l=1, a_kind=4)
    else:  # past the dispatch limit: dequantize + dot, no custom call
        a, b, want = q((1024, 64), "nvfp4"), q((24, 64), "nvfp4"), None
    if want is not None:
        from jax_blockscale.lowering import ffi as sm90

        monkeypatch.setenv(sm90.ENV_MAX_ROWS, "0")  # the kernel at every size
        if case not in ("dequantize_a", "register_weights_in_decode_rows", "decode_rows",
                        "decode_rows_blocked_scales"):
            monkeypatch.setenv(sm90.ENV_DEQUANT_A, "0")  # the two-operand kernel's own layout
    text = lower_for_cuda(monkeypatch, lambda a, b: jbs.gemm(a, b, backend="sm90"), a, b)
    calls = [ln for ln in text.splitlines() if "custom_call @" + _plugin.SM90_TARGET in ln]
    if want is None:
        assert not calls
        return
    assert len(calls) == 1, text[-2000:]
    for attr, v in want.items():
        assert re.search(rf"\b{attr} = {v} : i(32|64)", calls[0]), (attr, v, calls[0][:400])


# ---- the decode kernel (kernels/sm90_decode.py): table, dispatch, C++ vs Python heuristic -------

import ctypes  # noqa: E402

from jax_blockscale.kernels import sm90_decode_variants as dv  # noqa: E402

DECODE_OUT = {"bf16": 1, "f16": 2, "f32": 3}


def _lib():
    lib = _plugin.load()
    c = ctypes
    lib.jbs_variant_nt.argtypes = [c.c_int]
    lib.jbs_variant_nt.restype = c.c_int
    lib.jbs_choose_decode.argtypes = [c.c_int] * 3 + [c.c_longlong] * 3 + [
        c.c_int, c.POINTER(c.c_int), c.POINTER(c.c_int)]
    lib.jbs_choose_decode.restype = c.c_int
    lib.jbs_dispatch_problem.argtypes = (
        [c.c_int] * 5 + [c.c_longlong] * 4 + [c.c_ulonglong] * 6 + [c.c_longlong] * 6
        + [c.c_int] * 3 + [c.c_ulonglong, c.c_longlong, c.c_int, c.POINTER(c.c_int), c.c_char_p,
                          c.c_int])
    lib.jbs_dispatch_problem.restype = c.c_int
    return lib


def cpp_choose(a, b, out, m, n, k, sm_count=132):
    nt, splits = ctypes.c_int(), ctypes.c_int()
    ok = _lib().jbs_choose_decode(KIND_CODES[a], KIND_CODES[b], OUT_CODES[out], m, n, k, sm_count,
                                  ctypes.byref(nt), ctypes.byref(splits))
    return (nt.value, splits.value) if ok else None


def dispatch(ws_bytes=None, ws_ptr=0x70000, a_scales_plain=0, **kw):
    """The execute stage's validation + dispatch: (ok, variant name or reason, splits).
    a_scales_plain: A's scales in the plain layout (sa_bytes sized for it unless given)."""
    p = problem(**kw)
    if a_scales_plain and "sa_bytes" not in kw:
        p["sa_bytes"] = p["l"] * p["m"] * (p["k"] // BLOCK[kw.get("a", "nvfp4")])
    if ws_bytes is None:  # room for every split the heuristic can pick
        ws_bytes = p["l"] * p["m"] * p["n"] * 4 * 1024
    names = ["a_kind", "b_kind", "out", "a_e5m2", "b_e5m2", "m", "n", "k", "l", "a_ptr",
             "b_ptr", "sa_ptr", "sb_ptr", "c_ptr", "alpha_ptr", "a_bytes", "b_bytes",
             "sa_bytes", "sb_bytes", "c_bytes", "alpha_bytes", "cc_major", "cc_minor", "sm_count"]
    buf = ctypes.create_string_buffer(512)
    splits = ctypes.c_int(-1)
    rc = _lib().jbs_dispatch_problem(*(p[n] for n in names), ws_ptr, ws_bytes, a_scales_plain,
                                     ctypes.byref(splits), buf, len(buf))
    return rc == 0, buf.value.decode(), splits.value


@pytest.mark.parametrize("b", CLAIMED_RW_KINDS)
@pytest.mark.parametrize("m,n,l,tile", [
    (40, 16384, 1, "64x128"),     # 128 tiles of 128 weight rows: every SM busy
    (16, 16384, 1, "16x128"), (17, 16384, 1, "32x128"), (1, 8192, 1, "16x64"),
    (128, 16384, 1, "128x128"),
    (128, 8192, 1, "128x64"),     # 64 tiles of 128 rows would leave half the SMs idle
    (65, 300, 2, "128x64"), (500, 16384, 1, "128x128")])
def test_register_weight_dispatch(b, m, n, l, tile):
    """A K-permuted bf16 activation (kind 5) runs a register-weight variant, tile chosen by
    RegisterWeightTile; never the decode kernel."""
    ok, name, splits = dispatch(a="bf16_kperm", b=b, m=m, n=n, k=256, l=l)
    assert ok and name == f"jbs_sm90_bf16_kperm_{b}_bf16_{tile}" and splits == 0, name


def test_register_weight_rejects():
    # K must be whole 64-element k-tiles; e5m2 applies to the mxfp8 weight only
    ok, msg, _ = dispatch(a="bf16_kperm", b="nvfp4", m=100, n=70, k=96, l=1)
    assert not ok and "multiple of 64" in msg, msg
    ok, msg, _ = dispatch(a="bf16_kperm", b="mxfp8", m=100, n=70, k=256, l=1, a_e5m2=1)
    assert not ok and "only valid for mxfp8" in msg, msg
    ok, name, _ = dispatch(a="bf16_kperm", b="mxfp8", m=100, n=70, k=256, l=1, b_e5m2=1)
    assert ok and name == "jbs_sm90_bf16_kperm_mxfp8_bf16_128x64", name


def test_activation_k_order():
    """The lowering's transpose puts element activation_k_order()[p] in slot p of every k-tile,
    and that order is the one the kernel's threads feed (register_weight_order's formula)."""
    from jax_blockscale.kernels.register_weight_order import activation_k_order
    from jax_blockscale.lowering.ffi import permute_activation_k

    order = activation_k_order()
    assert sorted(order) == list(range(64))
    for s_, h, hi, t, q in itertools.product(range(2), range(2), range(2), range(4), range(2)):
        assert order[16 * (2 * s_ + h) + 8 * hi + 2 * t + q] == 16 * t + 8 * s_ + 4 * q + 2 * h + hi
    x = np.random.default_rng(0).normal(size=(2, 3, 192)).astype(np.float32)
    y = np.asarray(permute_activation_k(jnp.asarray(x)))
    for j in range(3):
        np.testing.assert_array_equal(y[..., 64 * j:64 * (j + 1)], x[..., 64 * j:][..., order])


def test_decode_variants_in_the_table():
    lib = _lib()
    table = _plugin.variants()
    got = {v["name"]: (v, lib.jbs_variant_nt(i)) for i, v in enumerate(table)}
    assert len(dv.VARIANTS) == 72
    for v in dv.VARIANTS:
        assert v.name in got, f"missing decode variant {v.name}"
        row, nt = got[v.name]
        assert nt == v.nt
        assert (row["a_kind"], row["b_kind"], row["out"], row["tile_m"], row["tile_n"],
                row["sm"]) == (KIND_CODES[v.a_kind], KIND_CODES[v.b_kind], DECODE_OUT[v.out],
                               8 * v.nt, dv.tuning_for(v.nt).bn, 90)
    # the fused GEMM's rows are nt == 0, the decode rows nt in (1, 2, 4, 8)
    for i, v in enumerate(table):
        assert (lib.jbs_variant_nt(i) > 0) == v["name"].startswith("jbs_sm90_decode_")


DECODE_PAIRS = [("bf16", "nvfp4"), ("bf16", "mxfp4"), ("bf16", "mxfp8"), ("nvfp4", "nvfp4"),
                ("mxfp4", "mxfp4"), ("mxfp8", "mxfp8")]
_PY_FMT = {"bf16": None, "nvfp4": "nvfp4", "mxfp4": "mxfp4", "mxfp8": "mxfp8_e4m3"}


def test_cpp_and_python_heuristics_agree():
    ms = [0, 1, 2, 3, 7, 8, 9, 15, 16, 17, 31, 32, 33, 63, 64, 65, 128]
    ns = [1, 7, 255, 256, 257, 777, 4096, 8191, 16384, 53248]
    ks = [16, 32, 48, 64, 96, 112, 256, 272, 544, 1056, 4192, 8192, 16384, 28672]
    pairs = DECODE_PAIRS + [("mxfp8", "mxfp4"), ("nvfp4", "mxfp4"), ("bf16", "bf16")]
    checked = taken = 0
    for (a, b), out, sms in itertools.product(pairs, ["bf16", "f32"], [132, 114, 78]):
        for m, n, k in itertools.product(ms, ns, ks):
            py = dv.choose_decode_variant(m, n, k, _PY_FMT[a], _PY_FMT.get(b, b), sms, out=out)
            cc = cpp_choose(a, b, out, m, n, k, sms)
            want = None if py is None else (py[0].nt, py[1])
            assert cc == want, (a, b, out, m, n, k, sms, cc, want)
            checked += 1
            taken += want is not None
    assert taken > 1000 and checked - taken > 1000


def test_decode_dispatch_small_m():
    for (a, b), out in itertools.product(DECODE_PAIRS, CLAIMED_OUTS):
        for m in (1, 8, 9, 16, 17, 32, 40, 64):
            ok, name, splits = dispatch(a=a, b=b, out=out, m=m, n=300, k=1024, l=2)
            assert ok, name
            nt = 1 if m <= 8 else 2 if m <= 16 else 4 if m <= 32 else 8
            assert name == f"jbs_sm90_decode_{a}_{b}_{out}_m{8 * nt}", (a, b, m, name)
            py = dv.choose_decode_variant(m, 300, 1024, _PY_FMT[a], _PY_FMT[b], 132, out=out)
            assert splits == py[1] >= 1


def test_decode_dispatch_falls_back_to_the_fused_kernel():
    # M > 64, a pair the decode kernel lacks, or no workspace declared (the lowering's opt-out)
    ok, name, splits = dispatch(m=65, n=300, k=1024, l=1)
    assert ok and name.startswith("jbs_sm90_nvfp4_nvfp4_bf16_128x") and splits == 0
    ok, name, _ = dispatch(a="mxfp8", b="mxfp4", m=4, n=300, k=1024, l=1)
    assert ok and name.startswith("jbs_sm90_mxfp8_mxfp4_bf16_128x"), name
    ok, name, splits = dispatch(ws_bytes=0, m=4, n=300, k=1024, l=1)
    assert ok and name.startswith("jbs_sm90_nvfp4_nvfp4_bf16_128x") and splits == 0
    # an e5m2 mxfp8 operand is a run-time flag of the same decode kernel
    ok, name, _ = dispatch(a="mxfp8", b="mxfp8", m=4, n=300, k=1024, l=1, a_e5m2=1, b_e5m2=0)
    assert ok and name == "jbs_sm90_decode_mxfp8_mxfp8_bf16_m8", name


@pytest.mark.parametrize("a", ["nvfp4", "mxfp4", "mxfp8"])
def test_decode_reads_plain_activation_scales(a):
    """A quantized activation's scales may come in the plain layout [L, M, K / block] (no XLA
    conversion kernel before the call): only for the decode kernel, and the buffer must be sized
    for that layout."""
    ok, name, splits = dispatch(a=a, b=a, m=16, n=300, k=1024, l=2, a_scales_plain=1)
    assert ok and name == f"jbs_sm90_decode_{a}_{a}_bf16_m16" and splits >= 1, name
    # the blocked size with the plain flag (and the other way round) is a size error
    blocked = problem(a=a, b=a, m=16, n=300, k=1024, l=2)["sa_bytes"]
    ok, msg, _ = dispatch(a=a, b=a, m=16, n=300, k=1024, l=2, a_scales_plain=1, sa_bytes=blocked)
    assert not ok and "plain layout" in msg, msg
    ok, msg, _ = dispatch(a=a, b=a, m=16, n=300, k=1024, l=2, sa_bytes=2 * 16 * 1024 // BLOCK[a])
    assert not ok and "blocked layout" in msg, msg
    # the fused GEMM reads blocked scales only: M past the decode kernel, or no workspace
    ok, msg, _ = dispatch(a=a, b=a, m=65, n=300, k=1024, l=1, a_scales_plain=1)
    assert not ok and "need the decode kernel" in msg, msg
    ok, msg, _ = dispatch(a=a, b=a, m=4, n=300, k=1024, l=1, a_scales_plain=1, ws_bytes=0)
    assert not ok and "need the decode kernel" in msg, msg
    # nothing to read for a bf16 activation; the flag is 0 or 1
    ok, msg, _ = dispatch(a="bf16", b=a, m=4, n=300, k=1024, l=1, a_scales_plain=1, sa_bytes=4)
    assert not ok and "unquantized activation" in msg, msg
    ok, msg, _ = dispatch(a=a, b=a, m=4, n=300, k=1024, l=1, a_scales_plain=2)
    assert not ok and "a_scales_plain" in msg, msg


def test_decode_splits_fit_the_workspace():
    # a workspace with room for fewer slices than the heuristic wants: fewer, equal splits
    _, _, want = dispatch(m=1, n=256, k=8192, l=1)
    assert want > 3
    for slices in (1, 2, 3):
        ok, name, splits = dispatch(m=1, n=256, k=8192, l=1, ws_bytes=256 * 4 * slices + 4)
        k_chunks = 8192 // (dv.tuning_for(1).sub_steps * dv.steps_elems("nvfp4"))
        per = -(-k_chunks // splits)
        assert ok and name.startswith("jbs_sm90_decode_") and 1 <= splits <= slices, splits
        assert (splits - 1) * per < k_chunks  # no empty split


def test_decode_one_split_and_several():
    # K within one sub-chunk: one split, and the main kernel converts and writes the output
    # itself (no finalize kernel). The GPU tests' test_decode_outputs (bf16 / f16 out) and
    # test_decode_batched (L = 3) shapes take this path; the mxfp8 output case takes two splits.
    for a, b, m, n, k, l, want in [("bf16", "nvfp4", 5, 300, 512, 1, 1),
                                   ("bf16", "nvfp4", 4, 129, 256, 3, 1),
                                   ("mxfp8", "mxfp8", 5, 300, 512, 1, 2)]:
        ok, name, splits = dispatch(a=a, b=b, m=m, n=n, k=k, l=l)
        assert ok and name.startswith("jbs_sm90_decode_") and splits == want, (a, m, splits)


@pytest.mark.parametrize("over,match", [
    (dict(ws_bytes=4 * 2 * 5 * 300 - 4), "workspace has .* bytes, needs 12000"),
    (dict(ws_ptr=0), "workspace pointer is null"),
    (dict(ws_ptr=0x70008), "workspace pointer .* not 16-byte aligned"),
    (dict(ws_bytes=-4), "negative workspace"),
    (dict(k=48), "multiple of 32"),
    (dict(k=1040, a="mxfp4", b="mxfp4"), "multiple of 32"),
    (dict(a_ptr=0x10004), "A pointer .* not 16-byte aligned"),
    (dict(sb_bytes=512), "B scale buffer"),
    (dict(sa_bytes=16), "A scale buffer"),
    (dict(cc_major=10), "compute capability 9.0"),
])
def test_decode_dispatch_rejects(over, match):
    kw = dict(m=5, n=300, k=1024, l=2)
    kw.update(over)
    ok, msg, _ = dispatch(**kw)
    assert not ok, msg
    assert re.search(match, msg), msg


def test_decode_weight_only_needs_bf16_activations():
    # weight-only means a bf16 A buffer (2 bytes per element); f16 activations never reach the
    # handler (the backend declines them) and a wrongly sized A buffer is rejected
    ok, msg, _ = dispatch(a="bf16", b="nvfp4", m=4, n=300, k=1024, l=1, a_bytes=4 * 1024)
    assert not ok and "A buffer" in msg


def test_activation_dequantized_only_where_bf16_fits_the_kernel():
    """A bf16 activation takes 2-4x the bytes of a quantized one: when it would overflow the
    kernel's 32-bit offsets, the two-operand kernel keeps the call (no late FFI error)."""
    from jax_blockscale.lowering import GemmSpec
    from jax_blockscale.lowering import ffi as sm90

    def spec(fmt, k):
        return GemmSpec(fmt, fmt, "plain", "plain", np.dtype(np.uint8), np.dtype(jnp.bfloat16),
                        (), (), (), 200, 64, k)

    for fmt in ("nvfp4", "mxfp8_e4m3"):
        assert sm90.dequantizes_activation_first(spec(fmt, 4096), 200)
        big = spec(fmt, 1 << 23)  # A: 200 x 2^23 elements, 3.4 GB as bf16
        assert sm90.fits_32bit_indexing(big)
        assert not sm90.fits_32bit_indexing(sm90.with_dequantized_activation(big))
        assert not sm90.dequantizes_activation_first(big, 200)


def test_lowering_declares_the_decode_workspace(monkeypatch):
    import jax_blockscale as jbs
    from jax_blockscale.lowering import ffi as sm90

    monkeypatch.setattr(sm90, "_device_reason", lambda: None)
    key = jax.random.PRNGKey(5)
    w = jbs.quantize(jax.random.normal(key, (300, 1024)), "nvfp4")

    def text(m, batch=()):
        x = jax.random.normal(key, batch + (m, 1024)).astype(jnp.bfloat16)
        f = lambda x, w: jbs.gemm(x, w, out_dtype=jnp.float32, backend="sm90")  # noqa: E731
        t = jax.jit(f).trace(x, w).lower(lowering_platforms=("cuda",)).as_text()
        return [ln for ln in t.splitlines() if "custom_call @" + _plugin.SM90_TARGET in ln]

    def splits(m):  # K ranges per output tile (132 SMs: no GPU is visible here)
        return dv.choose_decode_variant(m, 300, 1024, None, "nvfp4", 132, out="f32")[1]

    def ws_len(m):  # one L*M*N slice per split
        return splits(m) * m * 300

    calls = text(16)
    # 3 output tiles on 132 SMs: K is split (how many ways depends on the shipped tuning)
    assert splits(16) >= 2 and ws_len(16) == splits(16) * 4800
    assert len(calls) == 1 and f"tensor<{ws_len(16)}xf32>" in calls[0], calls
    from jax_blockscale.lowering import GemmSpec

    big = GemmSpec(None, "nvfp4", "plain", "plain", np.dtype(jnp.bfloat16),
                   np.dtype(jnp.bfloat16), (), (), (), 32, 16384, 16384)
    # the register-weight variants from 17 rows when the weights give every SM a 128-row tile
    assert sm90.uses_decode(big, 16) and not sm90.uses_decode(big, 17)
    assert sm90.uses_register_weights(big, 17) and not sm90.uses_register_weights(big, 16)
    import dataclasses

    mx8 = dataclasses.replace(big, fmt_b="mxfp8_e4m3")
    assert sm90.uses_decode(mx8, 16) and sm90.uses_register_weights(mx8, 17)
    odd_k = dataclasses.replace(big, k=16384 + 32)  # not whole 64-element k-tiles: decode
    assert sm90.uses_decode(odd_k, 64) and not sm90.uses_decode(odd_k, 65)
    mid = dataclasses.replace(big, n=8192, k=8192)  # 64 weight tiles: half the SMs
    assert sm90.uses_decode(mid, 16) and not sm90.uses_decode(mid, 17)
    small = dataclasses.replace(big, n=4096, k=8192)  # 32 weight tiles: from 33 rows
    assert sm90.uses_decode(small, 32) and not sm90.uses_decode(small, 33)
    batched = dataclasses.replace(small, b_batch=(2,), batch_shape=(2,), a_batch=(2,))
    assert not sm90.uses_decode(batched, 17)  # two batches of 32 tiles
    monkeypatch.setenv(sm90.ENV_REGISTER_WEIGHTS, "0")  # the decode kernel's wide rows again
    assert sm90.uses_decode(small, 64) and not sm90.uses_decode(small, 65)
    monkeypatch.delenv(sm90.ENV_REGISTER_WEIGHTS)
    calls = text(7, (2,))  # folded: M = 14
    assert len(calls) == 1 and f"tensor<{ws_len(14)}xf32>" in calls[0], calls
    calls = text(7, (2, 5))  # folded: M = 70 > 64: the fused GEMM
    assert len(calls) == 1 and "tensor<0xf32>" in calls[0], calls
    monkeypatch.setenv(sm90.ENV_DECODE_MAX_ROWS, "16")
    calls = text(7, (2, 2))  # folded: M = 28, over the lowered limit
    assert len(calls) == 1 and "tensor<0xf32>" in calls[0], calls
    monkeypatch.setenv(sm90.ENV_DECODE_MAX_ROWS, "64")
    calls = text(7, (2, 2))
    assert len(calls) == 1 and f"tensor<{ws_len(28)}xf32>" in calls[0], calls
    calls = text(7, (2, 3))  # folded: M = 42: the register-weight variant (fp4 weight)
    assert len(calls) == 1 and "tensor<0xf32>" in calls[0] and "a_kind = 5" in calls[0], calls
    monkeypatch.delenv(sm90.ENV_DECODE_MAX_ROWS)
    monkeypatch.setenv(sm90.ENV_MAX_ROWS, "0")
    calls = text(100)  # fused GEMM: an empty workspace
    assert len(calls) == 1 and "tensor<0xf32>" in calls[0], calls
    monkeypatch.setenv(sm90.ENV_DECODE_MAX_ROWS, "0")
    calls = text(16)
    assert len(calls) == 1 and "tensor<0xf32>" in calls[0], calls


def test_kernel_row_limits(monkeypatch):
    """Where the fused kernel hands over to dequantize + dot: higher with the register-weight
    variants (K % 64 == 0), by weight size and activation format (measured crossovers)."""
    import dataclasses

    from jax_blockscale.lowering import GemmSpec
    from jax_blockscale.lowering import ffi as sm90

    monkeypatch.delenv(sm90.ENV_MAX_ROWS, raising=False)
    monkeypatch.delenv(sm90.ENV_DEQUANT_A, raising=False)
    w_only = GemmSpec(None, "nvfp4", "plain", "plain", np.dtype(jnp.bfloat16),
                      np.dtype(jnp.bfloat16), (), (), (), 128, 16384, 16384)
    w4a4 = dataclasses.replace(w_only, fmt_a="nvfp4", layout_a="plain",
                               a_dtype=np.dtype(np.uint8))
    assert sm90.kernel_max_rows(w_only) == 2048 and sm90.kernel_max_rows(w4a4) == 2048
    mid = dict(n=8192, k=8192)
    assert sm90.kernel_max_rows(dataclasses.replace(w_only, **mid)) == 1024
    assert sm90.kernel_max_rows(dataclasses.replace(w4a4, **mid)) == 2048
    # no register-weight variant (K not whole 64-element k-tiles): the shared-memory path's limits
    assert sm90.kernel_max_rows(dataclasses.replace(w_only, k=16384 + 32)) == 512
    assert sm90.kernel_max_rows(dataclasses.replace(w_only, n=8192, k=8192 + 32)) == 512
    assert sm90.kernel_max_rows(dataclasses.replace(w_only, n=4096, k=4096)) == 256
    monkeypatch.setenv(sm90.ENV_DEQUANT_A, "0")  # the two-operand fused kernel
    assert sm90.kernel_max_rows(dataclasses.replace(w4a4, **mid)) == 128
    monkeypatch.setenv(sm90.ENV_MAX_ROWS, "0")
    assert sm90.kernel_max_rows(w_only) is None
