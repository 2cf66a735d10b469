"""The `sm90` backend: carries out an sm90 Plan (lowering/plan.py decides; this module only
prepares the operands the chosen kernel reads and emits the call).

  * "xla_dot" / "dot_alpha": dequantize both operands to bf16 (exact) and run XLA's GEMM, or the
    cuBLASLt GEMM with alpha in its epilogue (target `jax_blockscale_dot_alpha`).
  * "fused" / "register_weights" / "decode": the FFI custom call `jax_blockscale_gemm_sm90`:
      - elements -> uint8 bytes (fp4 pairs packed low nibble first, fp8 bitcast); bf16
        activations pass through (K-permuted for the register-weight variants);
      - scales -> the blocked layout as raw bytes (a quantized activation's plain scales go to
        the decode kernel as they are);
      - batch dims -> one L axis; a batched A times an unbatched B folds into M;
      - K padded to the plan's K (NVFP4 with K % 32 == 16 gets 16 zero elements: TMA needs
        16-byte rows);
      - the f32 split-K workspace (decode kernel; register-weight variants that split K) is a
        second result of the call (nothing is allocated at run time: CUDA-graph safe); zero
        elements otherwise. With more than one split the kernel leaves its split partials
        there and this module adds them in XLA (`add_split_partials`), where the sum fuses
        into the ops around the call;
      - the plan's variant travels as attributes (kernel nt, tile, splits); the handler validates
        every assumption and returns an error rather than launching what it cannot run.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .. import _plugin
from .. import config as _config
from ..catalog import sm90 as cat
from ..core.formats import get_format
from .registry import register_backend
from .kernel_operands import (element_bytes, kernel_batch_layout, kernel_plain_scale_bytes,
                              kernel_scale_bytes)
from .plan import plan_sm90, with_dequantized_activation
from .reference import operand_values, reference_gemm
from .specs import Plan

# cuBLASLt's workspace, declared as a second result of the call (nothing is allocated at run
# time): 32 MiB, what cuBLAS asks for on Hopper.
DOT_ALPHA_WORKSPACE_BYTES = 32 << 20


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
    y, _ = call(a, b, alpha_beta, candidates=np.int32(_config.get().dot_alpha_candidates))
    return y


def permute_activation_k(a):
    """[..., K] -> the same values with K in the FP4 register-weight variants' order
    (K % 64 == 0): a gather along K with a constant index from
    cat.K_PERMUTE_GATHER_MIN_ELEMENTS elements (it fuses into the loop of an elementwise
    producer), a transpose of K's digits below (the catalogue says why)."""
    lead, k = a.shape[:-1], a.shape[-1]
    if k % cat.K_TILE:
        raise ValueError(f"permute_activation_k: K = {k} is not a multiple of {cat.K_TILE}")
    if a.size >= cat.K_PERMUTE_GATHER_MIN_ELEMENTS:
        order = np.asarray(cat.activation_k_order(), np.int32)
        index = (np.arange(k // cat.K_TILE, dtype=np.int32)[:, None] * cat.K_TILE
                 + order[None, :]).reshape(-1)
        return jnp.take(a, index, axis=-1, mode="clip", unique_indices=True)
    x = a.reshape(lead + (k // cat.K_TILE,) + cat.K_DIGITS)
    n = len(lead) + 1  # axes before the k-tile's digits
    x = jnp.transpose(x, tuple(range(n)) + tuple(n + d for d in cat.SLOT_ORDER))
    return x.reshape(lead + (k,))


def kernel_elements(x, fmt, rows, plan: Plan, spec):
    """One operand's elements as (L, rows, K') for plan's kernel (spec: plan's problem, its
    activation dequantized where the plan says so): K padded to the plan's K, then uint8 bytes
    (fmt None: the bf16 activation, as it is)."""
    x = kernel_batch_layout(x, rows, spec=spec)
    if plan.k != spec.k:
        x = jnp.pad(x, [(0, 0), (0, 0), (0, plan.k - spec.k)])
    return x if fmt is None else element_bytes(x)


def activation_operands(a, sa, plan: Plan, spec, unused_scales):
    """(elements, scales) of the activation as plan's kernel reads them: K-permuted for the FP4
    register-weight variants (plan.permute_k); plain scales for the decode kernel where it
    reads them so, else blocked. A plain activation has no scales: `unused_scales` (a buffer
    that exists already; a fresh zeros array would be a kernel launch per call) stands in for
    them."""
    a8 = kernel_elements(a, spec.fmt_a, plan.m, plan, spec)
    if plan.permute_k:
        a8 = permute_activation_k(a8)
    if spec.fmt_a is None:
        sa8 = unused_scales
    elif plan.a_scales_plain:
        pad_blocks = (plan.k - spec.k) // get_format(spec.fmt_a).block
        sa8 = kernel_plain_scale_bytes(sa, plan.m, pad_blocks, spec=spec)
    else:
        sa8 = kernel_scale_bytes(sa, spec.fmt_a, spec.layout_a, plan.m, spec.m, spec=spec)
    return a8, sa8


class Sm90Backend:
    name = "sm90"
    platforms = ("cuda",)
    priority = 10

    def plan(self, spec, device):
        return plan_sm90(spec, device)

    def __call__(self, a, b, sa, sb, alpha, *, plan: Plan):
        spec = plan.spec
        if plan.kernel == "xla_dot":
            return reference_gemm(a, b, sa, sb, alpha, spec=spec, compute_dtype=jnp.bfloat16,
                                  allow_direct_output=True)
        if plan.kernel == "dot_alpha":
            av = operand_values(a, sa, spec.fmt_a, spec.layout_a, jnp.bfloat16)
            bv = operand_values(b, sb, spec.fmt_b, spec.layout_b, jnp.bfloat16)
            y = dot_alpha(kernel_batch_layout(av, plan.m, spec=spec),
                          kernel_batch_layout(bv, spec.n, spec=spec), alpha, spec.out_dtype)
            return y.reshape(spec.batch_shape + (spec.m, spec.n))
        if not _plugin.register_targets():
            raise RuntimeError(f"jax_blockscale sm90: {_plugin.unavailable_reason()}")
        if plan.dequantize_a:  # exact in bf16; alpha stays in the epilogue
            a = operand_values(a, sa, spec.fmt_a, spec.layout_a, jnp.bfloat16)
            sa, spec = None, with_dequantized_activation(spec)
        M, L, N = plan.m, plan.l, spec.n
        b8 = kernel_elements(b, spec.fmt_b, N, plan, spec)
        sb8 = kernel_scale_bytes(sb, spec.fmt_b, spec.layout_b, N, N, spec=spec)
        a8, sa8 = activation_operands(a, sa, plan, spec, sb8)
        call = jax.ffi.ffi_call(
            _plugin.SM90_TARGET,
            (jax.ShapeDtypeStruct((L, M, N), spec.out_dtype),
             jax.ShapeDtypeStruct((plan.workspace,), jnp.float32)),
        )
        alpha = alpha.astype(jnp.float32)
        partials = leaves_partials(plan)
        y, ws = call(a8, b8, sa8, sb8, jnp.reshape(alpha, (1,)),
                    a_kind=np.int32(cat.KIND_CODES[plan.a_kind]),
                    b_kind=np.int32(cat.KIND_CODES[plan.b_kind]),
                    a_e5m2=np.int32(spec.fmt_a == "mxfp8_e5m2"),
                    b_e5m2=np.int32(spec.fmt_b == "mxfp8_e5m2"),
                    m=np.int64(M), n=np.int64(N), k=np.int64(plan.k), l=np.int64(L),
                    a_scales_plain=np.int32(plan.a_scales_plain),
                    nt=np.int32(plan.nt), tile_m=np.int32(plan.tile[0]),
                    tile_n=np.int32(plan.tile[1]), splits=np.int32(plan.splits),
                    partials=np.int32(partials))
        if partials:
            y = add_split_partials(ws, plan.splits, (L, M, N), alpha, spec.out_dtype)
        return y.reshape(spec.batch_shape + (spec.m, N))


SM90 = Sm90Backend()
register_backend(SM90)


def leaves_partials(plan) -> bool:
    """Whether the call leaves its split partials for the lowering to add (`partials` = 1):
    every plan of the decode kernel (gemm's, or ragged_gemm's grouped one) and of the
    register-weight variants with more than one split. Added in XLA, the sum is one more
    elementwise op that XLA fuses into the ops around the call (the residual add, the activation
    function, the next op's input), where the decode kernel's own finalize kernel was one more
    launch after the main one (docs/design/sm90_decode.md); the register-weight variants have no
    finalize (docs/design/sm90_fused.md)."""
    return plan.kernel in ("decode", "ragged_decode", "register_weights") and plan.splits > 1


def add_split_partials(ws, splits: int, shape: tuple, alpha, out_dtype):
    """The output from a kernel's split partials: ws holds [splits, *shape] f32 (true
    scale, before alpha) from its start. Added in split order from +0.0, times alpha, then
    converted: the finalize kernel's arithmetic, so bitwise its result (XLA reorders no float
    additions)."""
    size = int(np.prod(shape))
    parts = jnp.reshape(ws[:splits * size], (splits,) + tuple(shape))
    total = jnp.zeros(shape, jnp.float32)
    for s in range(splits):
        total = total + parts[s]
    return (total * jnp.reshape(alpha, ())).astype(out_dtype)


def quantized_activation_scratch_bytes(blocks: int, block_bytes: int = 8) -> int:
    """Bytes of the quantized activation (`blocks` NVFP4 blocks) at the front of the fused
    target's workspace: its elements (`block_bytes` per block: 8 packed, or 32 as the
    register-weight kernel's bf16 values), then its plain scales, the calibrating amax kernel's
    partial amaxes (cat.quantize_a_amax_partials f32s) and alpha, each 256-byte
    aligned (ffi/jbs_ffi.cc: QuantizedActivationScratch lays it out the same way)."""
    def up(x):
        return -(-x // 256) * 256
    return up(up(up(block_bytes * blocks) + blocks) + 4 * cat.quantize_a_amax_partials(blocks)) + 4


def quantize_nvfp4_call(x, a_decode=None, b_alpha=None):
    """jbs.quantize(x, "nvfp4", global_scale=a_decode or "auto") of a bf16 x (M, K) on the
    quantizer kernels (target `jax_blockscale_quantize_nvfp4_sm90`): (elements
    float4_e2m1fn (M, K), plain e4m3 scales (M, K // 16), alpha): alpha the stored decode
    factor f32 (), or with b_alpha (the (L,) global scales of a stacked weight) its products
    with them, f32 (L,)."""
    if not _plugin.register_targets():
        raise RuntimeError(f"jax_blockscale sm90: {_plugin.unavailable_reason()}")
    m, k = x.shape
    blocks = m * k // 16
    layers = 0 if b_alpha is None else b_alpha.shape[0]
    call = jax.ffi.ffi_call(
        _plugin.QUANTIZE_NVFP4_SM90_TARGET,
        (jax.ShapeDtypeStruct((blocks * 8,), jnp.uint8),
         jax.ShapeDtypeStruct((blocks,), jnp.uint8),
         jax.ShapeDtypeStruct((max(layers, 1),), jnp.float32),
         jax.ShapeDtypeStruct((cat.quantize_a_amax_partials(blocks),), jnp.float32)))
    a_decode = (jnp.zeros((0,), jnp.float32) if a_decode is None
                else jnp.reshape(a_decode.astype(jnp.float32), (1,)))
    b_alpha = jnp.zeros((0,), jnp.float32) if b_alpha is None else b_alpha.astype(jnp.float32)
    elements, scales, alpha, _ = call(x, a_decode, b_alpha, m=np.int64(m), k=np.int64(k))
    data = lax.bitcast_convert_type(elements.reshape(m, k // 2), jnp.float4_e2m1fn)
    return (data.reshape(m, k), lax.bitcast_convert_type(scales.reshape(m, k // 16),
                                                         jnp.float8_e4m3fn),
            alpha if layers else alpha[0])


def quantized_activation_gemm(x, b, sb, b_alpha, a_decode=None, *, plan: Plan):
    """gemm(jbs.quantize(x, "nvfp4", global_scale=a_decode or "auto"), B) for a bf16 x (M, K)
    in one call (target `jax_blockscale_quantized_act_gemm_sm90`): its kernel quantizes x as
    jbs.quantize does, then `plan` (gemm's decode plan for the quantized problem) runs.
    b_alpha: B's global scale (1.0 without one). a_decode: x's given decode factor (f32 ()), or
    None to calibrate one on this call. One f32 workspace holds the quantized activation and
    then, from the next 256-byte boundary, the plan's split-K workspace."""
    if not _plugin.register_targets():
        raise RuntimeError(f"jax_blockscale sm90: {_plugin.unavailable_reason()}")
    spec = plan.spec
    M, N = plan.m, spec.n
    b8 = kernel_elements(b, spec.fmt_b, N, plan, spec)
    sb8 = kernel_scale_bytes(sb, spec.fmt_b, spec.layout_b, N, N, spec=spec)
    # the register-weight kernel (a plan that dequantizes and K-orders the activation) reads
    # the quantized values as bf16: 32 bytes a block in the scratch
    block_bytes = 32 if plan.permute_k else 8
    scratch = quantized_activation_scratch_bytes(M * spec.k // 16, block_bytes)
    front = -(-scratch // 256) * 64  # floats
    call = jax.ffi.ffi_call(
        _plugin.QUANTIZED_ACT_SM90_TARGET,
        (jax.ShapeDtypeStruct((1, M, N), spec.out_dtype),
         jax.ShapeDtypeStruct((front + plan.workspace,), jnp.float32)))
    partials = leaves_partials(plan)
    # the given decode factor as it is (no XLA kernel computes anything from it: the quantizer
    # derives 1 / g and alpha itself), or nothing to calibrate one
    a_decode = (jnp.zeros((0,), jnp.float32) if a_decode is None
                else jnp.reshape(a_decode.astype(jnp.float32), (1,)))
    y, ws = call(x, b8, sb8, jnp.reshape(b_alpha.astype(jnp.float32), (1,)), a_decode,
                a_kind=np.int32(cat.KIND_CODES[plan.a_kind]),
                b_kind=np.int32(cat.KIND_CODES[plan.b_kind]),
                a_e5m2=np.int32(0), b_e5m2=np.int32(spec.fmt_b == "mxfp8_e5m2"),
                m=np.int64(M), n=np.int64(N), k=np.int64(plan.k), l=np.int64(1),
                a_scales_plain=np.int32(plan.a_scales_plain), nt=np.int32(plan.nt),
                tile_m=np.int32(plan.tile[0]), tile_n=np.int32(plan.tile[1]),
                splits=np.int32(plan.splits), partials=np.int32(partials))
    if partials:  # alpha = x's decode factor times b_alpha, the scratch's last float
        alpha = ws[scratch // 4 - 1]
        y = add_split_partials(ws[front:], plan.splits, (1, M, N), alpha, spec.out_dtype)
    return y.reshape(M, N)
