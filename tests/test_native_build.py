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
BLOCK = {"nvfp4": 16, "mxfp4": 32, "mxfp8": 32, "bf16": None}


def test_library_loads_and_registers():
    assert _plugin.load() is not None
    assert _plugin.register_targets()
    assert _plugin.register_targets()  # idempotent


def test_variant_table_covers_the_kernel():
    got = {(v["a_kind"], v["b_kind"], v["out"], v["tile_m"], v["tile_n"], v["sm"])
           for v in _plugin.variants()}
    want = {(KIND_CODES[a], KIND_CODES[b], OUT_CODES[o], 128, tn, 90)
            for (a, b), o, tn in itertools.product(CLAIMED_PAIRS, CLAIMED_OUTS, CLAIMED_TILE_N)}
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


def test_manifest_matches_library():
    man = _plugin.manifest()
    if man is None:
        pytest.skip("no sm90_variants.json next to the library (library given by env var)")
    assert sorted(v["name"] for v in man["variants"]) == sorted(
        v["name"] for v in _plugin.variants())


# ---- the handler's validation, without a GPU ---------------------------------------------------

def _row_bytes(kind, k):
    return {"nvfp4": k // 2, "mxfp4": k // 2, "mxfp8": k, "bf16": 2 * k}[kind]


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


def _lower_for_cuda(monkeypatch, f, *args):
    """Cross-lower `f` for CUDA on this (GPU-less) machine, as if it had a Hopper GPU."""
    from jax_blockscale.lowering import ffi as sm90

    monkeypatch.setattr(sm90, "_device_reason", lambda: None)
    return jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("case", ["plain", "fold_batch_into_m", "batched", "pad_k", "weight_only",
                                  "large_m"])
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
    elif case == "pad_k":  # NVFP4 K % 32 == 16: padded to 64
        a, b, want = q((5, 48), "nvfp4"), q((7, 48), "nvfp4"), dict(m=5, n=7, k=64, l=1)
    elif case == "weight_only":
        a = jax.random.normal(key, (9, 64)).astype(jnp.bfloat16)
        b, want = q((24, 64), "nvfp4"), dict(m=9, n=24, k=64, l=1, a_kind=4)
    else:  # past the dispatch limit: dequantize + dot, no custom call
        a, b, want = q((1024, 64), "nvfp4"), q((24, 64), "nvfp4"), None
    if want is not None:
        from jax_blockscale.lowering import ffi as sm90

        monkeypatch.setenv(sm90.ENV_MAX_ROWS, "0")  # the kernel at every size
    text = _lower_for_cuda(monkeypatch, lambda a, b: jbs.gemm(a, b, backend="sm90"), a, b)
    calls = [ln for ln in text.splitlines() if "custom_call @" + _plugin.SM90_TARGET in ln]
    if want is None:
        assert not calls
        return
    assert len(calls) == 1, text[-2000:]
    for attr, v in want.items():
        assert re.search(rf"\b{attr} = {v} : i(32|64)", calls[0]), (attr, v, calls[0][:400])
