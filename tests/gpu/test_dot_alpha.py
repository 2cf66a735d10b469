"""The dot_alpha target (ffi/jbs_dot_alpha.cc): the cuBLASLt GEMM that the sm90 backend's large-M
path runs when alpha must scale the f32 sum before its one rounding (NVFP4 global scales) or the
output is f32.

CPU: which lowering each case gets, and that our hand-declared cuBLASLt ABI matches a real
cublasLt.h wherever one is installed. GPU: the GEMM against a float64 oracle (odd M, batches,
bf16 and f32 outputs, the output buffer poisoned with NaN first), end to end through jbs.gemm,
and that malformed calls return errors.
"""
from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

import jax
import jax.numpy as jnp

import jax_blockscale as jbs
from jax_blockscale import _plugin
from jax_blockscale.lowering import ffi_sm90
from configure import set_env  # tests/support/configure.py
from hopper import lower_for_cuda, needs_sm90, poison as _poison  # tests/support/hopper.py

HERE = os.path.dirname(os.path.abspath(__file__))
needs_lib = pytest.mark.skipif(_plugin.unavailable_reason() is not None or
                               not _plugin.has_dot_alpha(),
                               reason="needs libjax_blockscale.so with the dot_alpha target")


# ---- CPU: the lowering ----

def _large_m_lowering(a, b, out_dtype, monkeypatch):
    """The CUDA lowering (as text) of jbs.gemm(a, b) on the sm90 backend's large-M path."""
    set_env(monkeypatch, JAX_BLOCKSCALE_SM90_MAX_ROWS="16")
    return lower_for_cuda(
        monkeypatch, lambda a, b: jbs.gemm(a, b, out_dtype=out_dtype, backend="sm90"), a, b)


@needs_lib
def test_large_m_lowering_chooses_dot_alpha_where_xla_needs_an_f32_pass(monkeypatch):
    rng = np.random.default_rng(20)
    x = rng.standard_normal((4096, 64)).astype(np.float32)  # x 1024 rows of w: 2^22 outputs
    w = rng.standard_normal((1024, 64)).astype(np.float32)
    act = jnp.asarray(x, jnp.bfloat16)
    scaled = jbs.quantize(w, "nvfp4")  # "auto" global scale: alpha != 1
    plain = jbs.quantize(w, "nvfp4", global_scale=None)

    def uses(a, b, out):
        """(dot_alpha custom call, XLA dot) in the lowering"""
        text = _large_m_lowering(a, b, out, monkeypatch)
        assert _plugin.SM90_TARGET not in text  # never the block-scaled kernel at large M
        return _plugin.DOT_ALPHA_TARGET in text, "stablehlo.dot_general" in text

    assert uses(act, scaled, jnp.bfloat16) == (True, False)
    assert uses(jbs.quantize(x, "nvfp4"), scaled, jnp.bfloat16) == (True, False)
    assert uses(act, plain, jnp.float32) == (True, False)
    # f16 out: cuBLASLt has no bf16 x bf16 -> f16 GEMM, XLA's f32 pass stays
    assert uses(act, plain, jnp.float16) == (False, True)
    # alpha == 1 and bf16 out: XLA's dot rounds by itself
    assert uses(act, plain, jnp.bfloat16) == (False, True)
    # fewer than 2^22 outputs: XLA's f32 dot (cuBLASLt splits K there and is slower)
    assert uses(act[:2048], scaled, jnp.bfloat16) == (False, True)
    # N not a multiple of 8: the handler's rows would not be whole 16-byte units
    assert uses(act, jbs.quantize(w[:1020], "nvfp4"), jnp.bfloat16) == (False, True)
    set_env(monkeypatch, JAX_BLOCKSCALE_SM90_DOT_ALPHA="0")
    assert uses(act, scaled, jnp.bfloat16) == (False, True)


def _cublaslt_headers() -> list[str]:
    """Directories holding a real cublasLt.h: $CUBLASLT_INCLUDE_DIR, then the nvidia-cublas wheel
    (installed with jax[cuda13])."""
    dirs = [os.environ.get("CUBLASLT_INCLUDE_DIR", "")]
    for p in sys.path:
        dirs += glob.glob(os.path.join(p, "nvidia", "cu13", "include"))
    return [d for d in dirs if d and os.path.exists(os.path.join(d, "cublasLt.h"))]


def test_cublaslt_declarations_match_the_real_header(tmp_path):
    """ffi/jbs_cublaslt_api.h declares cuBLASLt by hand (the build has no cublasLt.h); every
    value, struct layout and function type in it is checked against the header."""
    headers, cxx = _cublaslt_headers(), shutil.which("g++") or shutil.which("c++")
    if not headers or not cxx:
        pytest.skip("needs cublasLt.h (nvidia-cublas or $CUBLASLT_INCLUDE_DIR) and a C++ compiler")
    cuda_inc = [d for d in ("/usr/local/cuda/include", headers[0]) if os.path.exists(
        os.path.join(d, "library_types.h"))]
    if not cuda_inc:
        pytest.skip("needs the CUDA runtime headers (library_types.h)")
    src = tmp_path / "abi_check.cc"
    src.write_text(ABI_CHECK)
    cmd = [cxx, "-std=c++17", "-fsyntax-only", f"-I{os.path.join(HERE, '..', '..', 'ffi')}",
           f"-I{headers[0]}"] + [f"-I{d}" for d in cuda_inc] + [str(src)]
    run = subprocess.run(cmd, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-4000:]


ABI_CHECK = r"""
#include <cstddef>
#include <type_traits>
#include <cublasLt.h>
#include "jbs_cublaslt_api.h"
namespace lt = jbs_cublaslt;
static_assert(lt::kStatusSuccess == CUBLAS_STATUS_SUCCESS, "");
static_assert(sizeof(lt::Status) == sizeof(cublasStatus_t), "");
static_assert(lt::kComputeF32 == CUBLAS_COMPUTE_32F, "");
static_assert(lt::kOpN == CUBLAS_OP_N && lt::kOpT == CUBLAS_OP_T, "");
static_assert(lt::kPointerModeDevice == CUBLASLT_POINTER_MODE_DEVICE, "");
static_assert(lt::kDescPointerMode == CUBLASLT_MATMUL_DESC_POINTER_MODE, "");
static_assert(lt::kDescTransA == CUBLASLT_MATMUL_DESC_TRANSA, "");
static_assert(lt::kDescTransB == CUBLASLT_MATMUL_DESC_TRANSB, "");
static_assert(lt::kLayoutBatchCount == CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, "");
static_assert(lt::kLayoutBatchStride == CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, "");
static_assert(lt::kPrefMaxWorkspace == CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, "");
// enums passed as int
static_assert(sizeof(cublasComputeType_t) == sizeof(int), "");
static_assert(sizeof(cublasLtMatmulDescAttributes_t) == sizeof(int), "");
static_assert(sizeof(cublasLtMatrixLayoutAttribute_t) == sizeof(int), "");
static_assert(sizeof(cublasLtMatmulPreferenceAttributes_t) == sizeof(int), "");
// structs
static_assert(sizeof(lt::MatmulAlgo) == sizeof(cublasLtMatmulAlgo_t), "");
static_assert(sizeof(lt::HeuristicResult) == sizeof(cublasLtMatmulHeuristicResult_t), "");
static_assert(offsetof(lt::HeuristicResult, workspace_size) ==
              offsetof(cublasLtMatmulHeuristicResult_t, workspaceSize), "");
static_assert(offsetof(lt::HeuristicResult, state) ==
              offsetof(cublasLtMatmulHeuristicResult_t, state), "");
static_assert(std::is_same<lt::Handle, cublasLtHandle_t>::value, "");
// function signatures: ours, with each enum spelled int and each descriptor void*, must accept
// exactly the real parameter list
template <class Ours, class Real> struct SameArity;
template <class R1, class... A1, class R2, class... A2>
struct SameArity<R1 (*)(A1...), R2 (*)(A2...)> {
  static constexpr bool value = sizeof...(A1) == sizeof...(A2) && sizeof(R1) == sizeof(R2);
};
#define CHECK(ours, real) static_assert(SameArity<lt::ours, decltype(&real)>::value, #real)
CHECK(CreateFn, cublasLtCreate);
CHECK(GetStatusStringFn, cublasLtGetStatusString);
CHECK(MatmulDescCreateFn, cublasLtMatmulDescCreate);
CHECK(MatmulDescSetAttributeFn, cublasLtMatmulDescSetAttribute);
CHECK(MatrixLayoutCreateFn, cublasLtMatrixLayoutCreate);
CHECK(MatrixLayoutSetAttributeFn, cublasLtMatrixLayoutSetAttribute);
CHECK(PreferenceCreateFn, cublasLtMatmulPreferenceCreate);
CHECK(PreferenceDestroyFn, cublasLtMatmulPreferenceDestroy);
CHECK(PreferenceSetAttributeFn, cublasLtMatmulPreferenceSetAttribute);
CHECK(AlgoGetHeuristicFn, cublasLtMatmulAlgoGetHeuristic);
CHECK(MatmulFn, cublasLtMatmul);
"""


# ---- GPU: numerics and errors ----

OUT_ULP = {jnp.bfloat16: 2.0 ** -8, jnp.float32: 2.0 ** -24}


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("l,m,n,k", [(1, 1001, 264, 520), (3, 257, 512, 1024),
                                     (1, 2048, 4096, 2048), (2, 96, 8, 8)])
@pytest.mark.parametrize("out", [jnp.bfloat16, jnp.float32])
def test_dot_alpha_against_float64(l, m, n, k, out):
    ka, kb = jax.random.split(jax.random.key(l * 7919 + m * 31 + n + k))
    a = jax.random.normal(ka, (l, m, k), jnp.float32).astype(jnp.bfloat16)
    b = jax.random.normal(kb, (l, n, k), jnp.float32).astype(jnp.bfloat16)
    alpha = jnp.float32(0.03125 * 1.37)  # not a power of two: rounding after scaling matters
    _poison()
    y = np.asarray(jax.jit(ffi_sm90.dot_alpha, static_argnums=3)(a, b, alpha, out), np.float64)
    a64, b64 = np.asarray(a, np.float64), np.asarray(b, np.float64)
    want = float(alpha) * np.einsum("lmk,lnk->lmn", a64, b64)
    bound = float(alpha) * np.einsum("lmk,lnk->lmn", np.abs(a64), np.abs(b64))
    assert np.isfinite(y).all()
    # one rounding to the output (half an ulp, 2^-p relative covers it) plus the f32 sum's error
    tol = OUT_ULP[out] * np.abs(want) + k * 2.0 ** -24 * bound + 1e-30
    assert np.all(np.abs(y - want) <= tol), float(np.max(np.abs(y - want) - tol))
    # and against XLA's f32 dot scaled and rounded (the path it replaces): the same values but
    # for accumulation-order ties
    ref = jax.lax.dot_general(a, b, (((2,), (2,)), ((0,), (0,))),
                              preferred_element_type=jnp.float32)
    ref = np.asarray((ref * alpha).astype(out), np.float64)
    if out == jnp.bfloat16:
        assert np.mean(y != ref) < 0.01
    else:  # f32 keeps the order-dependent low bits of the sum
        assert np.linalg.norm(y - ref) <= 1e-6 * np.linalg.norm(ref)


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("fmt_a", [None, "nvfp4"])
@pytest.mark.parametrize("batched_b", [False, True])
def test_gemm_with_global_scales_at_large_m(monkeypatch, fmt_a, batched_b):
    """End to end: jbs.gemm with NVFP4 global scales above the kernels' row limit runs the
    dot_alpha GEMM and equals the float64 oracle of the dequantized operands."""
    from oracle import dequantize as np_dequantize  # tests/support/oracle.py

    set_env(monkeypatch, JAX_BLOCKSCALE_SM90_MAX_ROWS="16")
    kx, kw = jax.random.split(jax.random.key(31 + batched_b))
    bshape = (2,) if batched_b else ()
    # 2 x 1032 x 2048 outputs: just over 2^22, the smallest the dot_alpha path takes
    x = jax.random.normal(kx, (2, 1032, 512), jnp.float32)
    w = jax.random.normal(kw, bshape + (2048, 512), jnp.float32) * 3.0
    a = x.astype(jnp.bfloat16) if fmt_a is None else jbs.quantize(x, fmt_a)
    b = jbs.quantize(w, "nvfp4", layout="blocked")
    assert b.global_scale is not None
    f = jax.jit(lambda a, b: jbs.gemm(a, b, backend="sm90"))
    text = f.lower(a, b).as_text()
    assert _plugin.DOT_ALPHA_TARGET in text and _plugin.SM90_TARGET not in text
    _poison()
    y = np.asarray(f(a, b), np.float64)
    av = (np.asarray(a, np.float64) if fmt_a is None else
          np_dequantize(a.data, a.scales, fmt_a, a.global_scale, a.layout))
    bv = np_dequantize(b.data, b.scales, "nvfp4", b.global_scale, b.layout)
    want = np.einsum("...mk,...nk->...mn", av, bv)
    assert y.shape == want.shape == (2, 1032, 2048)
    bound = np.einsum("...mk,...nk->...mn", np.abs(av), np.abs(bv))
    assert np.all(np.abs(y - want) <= 2.0 ** -8 * np.abs(want) + 512 * 2.0 ** -24 * bound)


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("case", ["k_not_8", "alpha_len", "a_f32", "b_batch", "c_shape",
                                  "c_f16"])
def test_dot_alpha_rejects_malformed_calls(case):
    """The handler checks every call again and returns an error (never launches)."""
    _plugin.register_targets()
    a = jnp.ones((1, 16, 32), jnp.bfloat16)
    b = jnp.ones((1, 24, 32), jnp.bfloat16)
    alpha = jnp.asarray([1.0, 0.0], jnp.float32)
    c_shape = (1, 16, 24)
    if case == "k_not_8":
        a, b = a[..., :12], b[..., :12]
    elif case == "alpha_len":
        alpha = jnp.ones((24,), jnp.float32)
    elif case == "a_f32":
        a = a.astype(jnp.float32)
    elif case == "b_batch":
        b = jnp.ones((2, 24, 32), jnp.bfloat16)
    elif case == "c_shape":
        c_shape = (1, 16, 25)
    c_dtype = jnp.float16 if case == "c_f16" else jnp.bfloat16
    call = jax.ffi.ffi_call(_plugin.DOT_ALPHA_TARGET,
                            (jax.ShapeDtypeStruct(c_shape, c_dtype),
                             jax.ShapeDtypeStruct((1 << 20,), jnp.uint8)))
    with pytest.raises(Exception, match="jax_blockscale dot_alpha"):
        jax.block_until_ready(jax.jit(lambda a, b, alpha: call(
            a, b, alpha, candidates=np.int32(1)))(a, b, alpha))
