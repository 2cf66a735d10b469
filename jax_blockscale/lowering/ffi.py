"""The `sm90` backend: gemm_p lowered to the XLA FFI custom call into libjax_blockscale.so.

Chosen (priority 10 > reference's 0) on CUDA when every visible GPU has compute capability 9.0
and the problem is one the Hopper kernel implements; otherwise `unsupported_reason` says why and
the registry falls back (to `reference`), logging the reason.

The backend only reshapes operands into what the kernel reads:
  * elements -> uint8 bytes (fp4 pairs packed low nibble first, fp8 bitcast); bf16 activations
    pass through;
  * scales -> the blocked layout (converted here if given plain), as raw bytes; a quantized
    activation's plain scales go to the decode kernel as they are (`a_scales_plain`);
  * batch dims -> one L axis; a batched A times an unbatched B is folded into M instead
    (one large GEMM, the weight read once);
  * NVFP4 with K % 32 == 16 gets 16 zero elements of K padding (TMA needs 16-byte rows).

Dispatch (H100 measurements: docs/sm90_decode_notes.md, docs/sm90_notes.md), by the kernel's
row count M (after folding batch dims into M) and N, K:

  * M <= decode_max_rows() (64) and a pair the decode kernel has (bf16 x {nvfp4, mxfp4,
    mxfp8}, nvfp4 x nvfp4, mxfp4 x mxfp4, mxfp8 x mxfp8; K a multiple of 32 and of the block):
    the **decode kernel** (kernels/sm90_decode.py: split-K GEMV-like, 2.2-3.7x faster than bf16
    jnp.dot at M <= 16). The lowering declares its f32 workspace (one L*M*N slice per split) as a second
    result of the custom call, so nothing is allocated at run time (CUDA-graph safe); the FFI
    handler re-runs the same heuristic in C++ (choose_decode_variant's mirror) and picks the
    split count. M = 17..64 runs the wide variants (4 or 8 n8 tiles of M per CTA, one weight
    conversion for up to 64 rows). H100, bf16 x nvfp4 (decode notes, run 9): M = 32: 93 us at
    N=K=16384 (fused kernel 243), 30 us at 8192; M = 64: 157 / 47 us; M = 96..128 (two 64-row
    chunks): 300 us at 16384, slower than the fused kernel (~240), which takes over.
  * otherwise up to kernel_max_rows() (128 .. 2048 by weight size and path): the **fused GEMM**
    (kernels/sm90_blockscaled.py); the workspace result then has zero elements (the handler's
    opt-out). With K % 64 == 0 it runs its register-weight variants (uses_register_weights:
    the weights converted straight into wgmma's register operand, the activation K-permuted
    here, kind code 5), which also take over from the decode kernel from 17 rows when the
    weights give every SM a 128-row tile, else from 33 (register_weights_take; H100, 16384^2:
    71-76 us at 32-64 rows against 87-157).
    A quantized activation is dequantized to bf16 first and the weight-only variant runs
    (dequantizes_activation_first: 1.2-1.5x faster than converting A inside the kernel; so
    does an mxfp8 activation in the decode kernel's wide rows, 17..64).
  * above: **dequantize + a bf16 GEMM**, faster there on Hopper: XLA's, or the dot_alpha
    target (cuBLASLt with alpha in its epilogue) when alpha must scale the f32 sum first.

JAX_BLOCKSCALE_SM90_DECODE_MAX_ROWS=0 turns the decode kernel off (benchmarks, bisecting).
Every runtime assumption is re-checked by the FFI handler, which returns an error rather than
launching anything it cannot run.
"""
from __future__ import annotations

import dataclasses
import functools
import os

import jax
import jax.numpy as jnp
import numpy as np

from .. import _plugin
from ..formats import get_format
from ..aot import KIND_CODES
from ..kernels.register_weight_order import K_DIGITS, K_TILE, SLOT_ORDER
from ..kernels.sm90_decode_variants import choose_decode_variant
from . import GemmSpec, register_backend
from .kernel_operands import (element_bytes, kernel_batch_layout, kernel_plain_scale_bytes,
                              kernel_rows_and_batch, kernel_scale_bytes)
from .reference import (DIRECT_OUTPUT_MIN_OUTPUTS, direct_output, gemm_outputs, operand_values,
                        reference_gemm)

# The pairs the sm90 kernel implements (jax_blockscale/kernels/sm90_blockscaled.py: PAIRS),
# spelled with the package's format names. None = weight-only (bf16 activation).
_KIND = {"nvfp4": "nvfp4", "mxfp4": "mxfp4", "mxfp8_e4m3": "mxfp8", "mxfp8_e5m2": "mxfp8",
         None: "bf16"}
_KERNEL_PAIRS = {("nvfp4", "nvfp4"), ("mxfp4", "mxfp4"), ("mxfp8", "mxfp8"), ("mxfp8", "mxfp4"),
                 ("bf16", "nvfp4"), ("bf16", "mxfp4"), ("bf16", "mxfp8")}
_OUT = (np.dtype(jnp.bfloat16), np.dtype(jnp.float16), np.dtype(jnp.float32))
_INT32_MAX = 2**31 - 1

# Where the fused kernel beats dequantize-once + XLA's bf16 GEMM on an H100 (measured,
# docs/sm90_notes.md): the kernel dequantizes each B tile once per 128-row M tile, while cuBLAS
# runs near peak once both operands are bf16, so past a few hundred rows the GEMM wins. Above the
# limit the backend lowers to dequantize + dot instead of the custom call.
# JAX_BLOCKSCALE_SM90_MAX_ROWS overrides the limit (0: always the kernel).
ENV_MAX_ROWS = "JAX_BLOCKSCALE_SM90_MAX_ROWS"


def kernel_max_rows(spec: GemmSpec) -> int | None:
    v = os.environ.get(ENV_MAX_ROWS)
    if v is not None:
        return int(v) or None
    if _register_weights_reachable(spec):
        # The register-weight variants (H100, nvfp4, docs/sm90_notes.md, session 12): at N = K =
        # 16384 they beat dequantize + dot by 1.2-1.3x at 1024 rows and were level (weight-only,
        # 1642 against 1631 us) or ahead (W4A4, 1571 against 1629) at 2048; at 8192 ahead at
        # 1024 rows (208 against 251) and for W4A4 at 2048 (408 against 425), behind at 2048
        # weight-only (421 against 411) and at 4096.
        if spec.n * spec.k >= 2**28:
            return 2048
        if spec.n * spec.k >= 2**26:
            return 1024 if spec.fmt_a is None else 2048
    # large weights amortize better (H100, docs/sm90_notes.md, sessions 1 and 10)
    if spec.n * spec.k >= 2**28:
        return 512
    if spec.fmt_a is None:
        # weight-only: at 512 rows the kernel still won at N = K = 8192 (~162 against ~176 us)
        # but lost at 4096 from 384 rows (66.5 against 51.5, both with a dequantized nvfp4
        # activation: probes/activation_dequant.py)
        return 512 if spec.n * spec.k >= 2**26 else 256
    # A quantized activation is dequantized first (dequantizes_activation_first) and the
    # weight-only kernel beat dequantize + dot up to 256 rows at N = K = 8192 and 4096, but not
    # at 512 (4096: not at 384); the fused two-operand kernel only up to 128.
    return 128 if os.environ.get(ENV_DEQUANT_A) == "0" else 256


# Rows up to which the decode kernel runs (when it has the pair). Measured on the H100
# (docs/sm90_decode_notes.md, v5 and run 9): M <= 16: 2.4-2.6x faster than bf16 jnp.dot and ~3.5x
# faster than the fused kernel at N=K=16384; M = 32 / 64 (wide variants): 93 / 157 us against
# ~240 for the fused kernel at 16384, 30 / 47 us at 8192; two 64-row chunks (M = 96..128) lose
# to the fused kernel. The variable overrides the limit (0 turns the decode kernel off).
ENV_DECODE_MAX_ROWS = "JAX_BLOCKSCALE_SM90_DECODE_MAX_ROWS"


def decode_max_rows() -> int:
    v = os.environ.get(ENV_DECODE_MAX_ROWS)
    if v is not None:
        return int(v)
    return 64


# The large-M path's GEMM when XLA's dot cannot round to the output itself (an alpha to apply
# first: NVFP4's global scales; or an f32 output): then XLA writes the f32 sum to memory and
# a second pass scales and rounds it (~8 % of an 8192^3 call on an H100). The dot_alpha target
# (ffi/jbs_dot_alpha.cc) is one cuBLASLt GEMM that applies alpha in its epilogue instead.
# JAX_BLOCKSCALE_SM90_DOT_ALPHA=0 keeps XLA's f32 pass (benchmarks, bisecting).
ENV_DOT_ALPHA = "JAX_BLOCKSCALE_SM90_DOT_ALPHA"
# cuBLASLt's workspace, declared as a second result of the call (nothing is allocated at run
# time): 32 MiB, what cuBLAS asks for on Hopper.
DOT_ALPHA_WORKSPACE_BYTES = 32 << 20
# cuBLASLt's bf16 x bf16 GEMMs write bf16 or f32 (f16: "not supported" on the H100)
_DOT_ALPHA_OUT = (np.dtype(jnp.bfloat16), np.dtype(jnp.float32))


def uses_dot_alpha(spec: GemmSpec) -> bool:
    """Whether the large-M path runs the dot_alpha GEMM: XLA's dot cannot produce the output
    itself, the output is bf16 or f32, there are enough outputs, N and K rows are whole 16-byte
    multiples (what the handler accepts) and the library has the target.

    Below 2^22 outputs cuBLASLt splits K and lost to the f32 pass on the H100 (26.0 against 23.5
    us at 256 x 1024 x 16384); from there up it was 5-8 % faster and bitwise equal to it."""
    if os.environ.get(ENV_DOT_ALPHA) == "0" or direct_output(spec, jnp.bfloat16):
        return False
    return (gemm_outputs(spec) >= DIRECT_OUTPUT_MIN_OUTPUTS and spec.n % 8 == 0
            and spec.k % 8 == 0 and np.dtype(spec.out_dtype) in _DOT_ALPHA_OUT
            and _plugin.has_dot_alpha())


def dot_alpha(a, b, alpha, out_dtype):
    """round(alpha * sum_k a[l, m, k] * b[l, n, k]) to out_dtype, summed in f32, for bf16 a
    [L, M, K] and b [L, N, K] and a scalar alpha: one cuBLASLt GEMM (the dot_alpha target)."""
    if not _plugin.register_targets():
        raise RuntimeError(f"jax_blockscale dot_alpha: {_plugin.unavailable_reason()}")
    n = b.shape[1]
    call = jax.ffi.ffi_call(
        _plugin.DOT_ALPHA_TARGET,
        (jax.ShapeDtypeStruct(a.shape[:2] + (n,), out_dtype),
         jax.ShapeDtypeStruct((DOT_ALPHA_WORKSPACE_BYTES,), jnp.uint8)))
    # cuBLASLt reads alpha and beta from the device (alpha is traced); beta = 0: no C term
    alpha_beta = jnp.stack([jnp.asarray(alpha, jnp.float32).reshape(()), jnp.float32(0)])
    y, _ = call(a, b, alpha_beta)
    return y


_OUT_NAME = {np.dtype(jnp.bfloat16): "bf16", np.dtype(jnp.float16): "f16",
             np.dtype(jnp.float32): "f32"}


def decode_splits(spec: GemmSpec, m: int) -> int:
    """Split-K count of the decode kernel for the call with kernel row count m, or 0 if the decode
    kernel does not run it (then no workspace is declared). The FFI handler re-checks with the
    C++ mirror of the same heuristic and takes fewer splits if the workspace holds fewer."""
    if m > decode_max_rows() or register_weights_take(spec, m):
        return 0
    out = _OUT_NAME.get(np.dtype(spec.out_dtype))
    choice = out and choose_decode_variant(
        m, spec.n, _padded_k(spec), spec.fmt_a, spec.fmt_b, _sm_count(), out=out)
    return choice[1] if choice else 0


def uses_decode(spec: GemmSpec, m: int) -> bool:
    """Whether the call with kernel row count m runs the decode kernel."""
    return decode_splits(spec, m) > 0


# In the fused kernel's range, a quantized activation is dequantized to bf16 first (one small XLA
# pass over M x K) and the weight-only kernel runs: the fused kernel would convert every A tile
# again for each of the N / tile_n column tiles, and at M = 128, N = K = 16384 it ran 281 us for
# nvfp4 x nvfp4 against 220 us for bf16 x nvfp4 (docs/sm90_notes.md, session 10). Exact: the
# dequantized activation is exact in bf16, and alpha (the global scales) stays in the epilogue.
# JAX_BLOCKSCALE_SM90_DEQUANT_A=0 keeps the two-operand kernels everywhere, =all dequantizes A
# for the decode kernel's rows too (benchmarks, bisecting).
ENV_DEQUANT_A = "JAX_BLOCKSCALE_SM90_DEQUANT_A"


def dequantizes_activation_first(spec: GemmSpec, m: int) -> bool:
    """Whether the call with kernel row count m dequantizes A and runs the weight-only kernel."""
    mode = os.environ.get(ENV_DEQUANT_A, "1")
    if spec.fmt_a is None or mode == "0" or ("bf16", _KIND[spec.fmt_b]) not in _KERNEL_PAIRS:
        return False
    if not fits_32bit_indexing(with_dequantized_activation(spec)):
        return False  # A in bf16 takes 2-4x the bytes of the quantized A
    if mode == "all" or not uses_decode(spec, m):
        return True
    # In the decode kernel's rows only an mxfp8 activation past 16 rows (the wide variants)
    # gains: 168 -> 142 us at 48 x 16384^2, 50 -> 44 at 64 x 8192^2; fp4 activations convert
    # cheaply in the kernel (64 x 16384^2 nvfp4: 146 there, 160 dequantized first).
    return _KIND[spec.fmt_a] == "mxfp8" and m > 16


# Register-weight variants (kernels/sm90_blockscaled.py, weights_in_registers): the weight
# tile is converted straight into wgmma's register operand and the bf16 activation tile is the
# shared-memory operand, so no bf16 weight tile goes through shared memory. They read the
# activation with K permuted inside each 64-element k-tile (activation_k_order), which the
# lowering applies with one XLA transpose. JAX_BLOCKSCALE_SM90_REGISTER_WEIGHTS=0 keeps the
# shared-memory variants.
ENV_REGISTER_WEIGHTS = "JAX_BLOCKSCALE_SM90_REGISTER_WEIGHTS"
KPERM_KIND_CODE = KIND_CODES["bf16_kperm"]


# From this many rows the register-weight variants beat the decode kernel's wide variants, so
# such calls skip the decode kernel there. H100, nvfp4 weights (docs/sm90_notes.md, session 12):
# 71.8 against 87.2 us at 32 x 16384^2, 74.6 against 144 at 48; 24.9 against 26.8 at
# 32 x 8192^2 (64 weight tiles of 128 rows); but 65.4 against 60.6 at 16 x 16384^2.
REGISTER_WEIGHT_MIN_ROWS = 17
# ... when the weights' 64-row tiles give ~every SM one; with fewer tiles the decode kernel's
# split-K keeps more SMs busy (not measured between 17 and 32 rows there)
REGISTER_WEIGHT_MIN_ROWS_FEW_TILES = 33


def register_weight_min_rows(spec: GemmSpec) -> int:
    _, l = kernel_rows_and_batch(spec)
    weight_tiles = -(-spec.n // 64) * l
    if weight_tiles >= 0.9 * _sm_count():
        return REGISTER_WEIGHT_MIN_ROWS
    return REGISTER_WEIGHT_MIN_ROWS_FEW_TILES


def register_weights_available(spec: GemmSpec) -> bool:
    """Whether the library has a register-weight variant for this weight-only call."""
    if os.environ.get(ENV_REGISTER_WEIGHTS) == "0" or spec.fmt_a is not None:
        return False
    return spec.k % K_TILE == 0 and (
        KIND_CODES[_KIND[spec.fmt_b]] in _plugin.register_weight_kinds())


def _register_weights_reachable(spec: GemmSpec) -> bool:
    """Whether the fused range runs this call on a register-weight variant (a quantized activation
    dequantized to bf16 first)."""
    if spec.fmt_a is not None:
        if (os.environ.get(ENV_DEQUANT_A) == "0"
                or ("bf16", _KIND[spec.fmt_b]) not in _KERNEL_PAIRS
                or not fits_32bit_indexing(with_dequantized_activation(spec))):
            return False
        spec = with_dequantized_activation(spec)
    return register_weights_available(spec)


def register_weights_take(spec: GemmSpec, m: int) -> bool:
    """Whether a call with kernel row count m in the decode kernel's rows goes to a register-weight
    variant instead (a quantized activation is dequantized to bf16 first)."""
    return m >= register_weight_min_rows(spec) and _register_weights_reachable(spec)


def uses_register_weights(spec: GemmSpec, m: int) -> bool:
    """Whether a weight-only call with kernel row count m runs a register-weight variant."""
    return register_weights_available(spec) and not uses_decode(spec, m)


def permute_activation_k(a):
    """[..., K] -> the same values with K in the register-weight variants' order (K % 64 == 0)."""
    lead, k = a.shape[:-1], a.shape[-1]
    x = a.reshape(lead + (k // K_TILE,) + K_DIGITS)
    n = len(lead) + 1  # axes before the k-tile's digits
    x = jnp.transpose(x, tuple(range(n)) + tuple(n + d for d in SLOT_ORDER))
    return x.reshape(lead + (k,))


def with_dequantized_activation(spec: GemmSpec) -> GemmSpec:
    """The weight-only problem that spec becomes once A is dequantized to bf16."""
    return dataclasses.replace(spec, fmt_a=None, layout_a=None,
                               a_dtype=np.dtype(jnp.bfloat16))


@functools.lru_cache(maxsize=None)
def _sm_count() -> int:
    """Multiprocessors of the largest visible GPU (132 on an H100 SXM / H200 when none is visible,
    e.g. when lowering on a CPU host): sizes the workspace for the split count the handler picks."""
    try:
        counts = [getattr(d, "core_count", 0) or 0 for d in jax.devices() if d.platform == "gpu"]
    except RuntimeError:
        counts = []
    return max(counts, default=0) or 132


@functools.lru_cache(maxsize=None)
def _device_reason() -> str | None:
    """None if every visible CUDA GPU is compute capability 9.0, else why not."""
    try:
        gpus = [d for d in jax.devices() if d.platform == "gpu"]
    except RuntimeError as e:  # no GPU backend at all
        return f"no CUDA devices ({e})"
    if not gpus:
        return "no CUDA devices"
    ccs = sorted({str(getattr(d, "compute_capability", "?")) for d in gpus})
    if ccs != ["9.0"]:
        return f"the sm90 kernels need compute capability 9.0, found {', '.join(ccs)}"
    return None


def fits_32bit_indexing(spec: GemmSpec) -> bool:
    """Whether the kernel's buffers (A and B bytes, C elements) have 32-bit offsets."""
    m, l = kernel_rows_and_batch(spec)
    k = _padded_k(spec)
    ka, kb = _KIND[spec.fmt_a], _KIND[spec.fmt_b]
    a_row = 2 * k if ka == "bf16" else k // (2 if "fp4" in ka else 1)
    b_row = k // (2 if "fp4" in kb else 1)
    return max(m * spec.n * l, m * a_row * l, spec.n * b_row * l) <= _INT32_MAX


def _padded_k(spec: GemmSpec) -> int:
    return spec.k + (spec.k % 32)  # only NVFP4 (block 16) can leave 16 over


class Sm90Backend:
    name = "sm90"
    platforms = ("cuda",)
    priority = 10

    def unsupported_reason(self, spec: GemmSpec) -> str | None:
        ka, kb = _KIND.get(spec.fmt_a, "?"), _KIND.get(spec.fmt_b, "?")
        if (ka, kb) not in _KERNEL_PAIRS:
            return f"the sm90 kernel has no {spec.fmt_a or 'plain'} x {spec.fmt_b} variant"
        if spec.fmt_a is None and np.dtype(spec.a_dtype) != np.dtype(jnp.bfloat16):
            return (f"weight-only sm90 needs bf16 activations ({np.dtype(spec.a_dtype).name} is "
                    "not exact in bf16)")
        if np.dtype(spec.out_dtype) not in _OUT:
            return f"out dtype {np.dtype(spec.out_dtype).name} not supported"
        if min(spec.m, spec.n, spec.k) < 1 or 0 in spec.batch_shape:
            return "empty problem"
        if not fits_32bit_indexing(spec):
            return "problem too large for the kernel's 32-bit indexing"
        why = _device_reason()
        if why is not None:
            return why
        return _plugin.unavailable_reason()

    def __call__(self, a, b, sa, sb, alpha, *, spec: GemmSpec, platform: str = "cuda"):
        if not _plugin.register_targets():
            raise RuntimeError(f"jax_blockscale sm90: {_plugin.unavailable_reason()}")
        M, L = kernel_rows_and_batch(spec)
        max_rows = kernel_max_rows(spec)
        if max_rows is not None and M > max_rows:
            # Large M: the tensor cores are the limit; dequantize once and use a library GEMM.
            if uses_dot_alpha(spec):
                av = operand_values(a, sa, spec.fmt_a, spec.layout_a, jnp.bfloat16)
                bv = operand_values(b, sb, spec.fmt_b, spec.layout_b, jnp.bfloat16)
                y = dot_alpha(kernel_batch_layout(av, M, spec=spec),
                              kernel_batch_layout(bv, spec.n, spec=spec),
                              alpha, spec.out_dtype)
                return y.reshape(spec.batch_shape + (spec.m, spec.n))
            return reference_gemm(a, b, sa, sb, alpha, spec=spec, compute_dtype=jnp.bfloat16,
                                  allow_direct_output=True)
        if dequantizes_activation_first(spec, M):
            av = operand_values(a, sa, spec.fmt_a, spec.layout_a, jnp.bfloat16)
            return self(av, b, None, sb, alpha, spec=with_dequantized_activation(spec),
                        platform=platform)
        N, K = spec.n, spec.k
        Kp = _padded_k(spec)
        ka, kb = _KIND[spec.fmt_a], _KIND[spec.fmt_b]

        def elements(x, fmt, rows):
            x = kernel_batch_layout(x, rows, spec=spec)
            if Kp != K:
                x = jnp.pad(x, [(0, 0), (0, 0), (0, Kp - K)])
            return x if fmt is None else element_bytes(x)  # fmt None: the bf16 activation

        a8 = elements(a, spec.fmt_a, M)
        a_code = KIND_CODES[ka]
        if uses_register_weights(spec, M):
            a8, a_code = permute_activation_k(a8), KPERM_KIND_CODE
        b8 = elements(b, spec.fmt_b, N)
        sb8 = kernel_scale_bytes(sb, spec.fmt_b, spec.layout_b, N, N, spec=spec)
        # The decode kernel's split-K count (0: the fused GEMM runs the call)
        splits = decode_splits(spec, M)
        # plain activation scales go to the decode kernel as they are (it reads either layout;
        # converting them to the blocked one is a kernel launch of its own, ~1.5 us)
        a_scales_plain = spec.fmt_a is not None and spec.layout_a == "plain" and splits > 0
        if spec.fmt_a is None:
            # unused by the weight-only kernels; passing a buffer that exists already saves a
            # kernel launch per call (a fresh zeros array is one)
            sa8 = sb8
        elif a_scales_plain:
            sa8 = kernel_plain_scale_bytes(sa, M, (Kp - K) // get_format(spec.fmt_a).block,
                                           spec=spec)
        else:
            sa8 = kernel_scale_bytes(sa, spec.fmt_a, spec.layout_a, M, spec.m, spec=spec)
        # The decode kernel's split-K workspace (f32, one L*M*N slice per split; zero elements:
        # fused GEMM only).
        ws_len = splits * L * M * N
        call = jax.ffi.ffi_call(
            _plugin.SM90_TARGET,
            (jax.ShapeDtypeStruct((L, M, N), spec.out_dtype),
             jax.ShapeDtypeStruct((ws_len,), jnp.float32)),
        )
        y, _ = call(a8, b8, sa8, sb8, jnp.reshape(alpha.astype(jnp.float32), (1,)),
                 a_kind=np.int32(a_code), b_kind=np.int32(KIND_CODES[kb]),
                 a_e5m2=np.int32(spec.fmt_a == "mxfp8_e5m2"),
                 b_e5m2=np.int32(spec.fmt_b == "mxfp8_e5m2"),
                 m=np.int64(M), n=np.int64(N), k=np.int64(Kp), l=np.int64(L),
                 a_scales_plain=np.int32(a_scales_plain))
        return y.reshape(spec.batch_shape + (spec.m, N))


SM90 = Sm90Backend()
register_backend(SM90)
