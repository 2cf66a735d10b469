"""The `sm100` backend: gemm_p lowered to the XLA FFI custom call `jax_blockscale_gemm_sm100`
(Blackwell: B200/GB200, compute capability 10.0 -> sm_100a cubins; B300/GB300, 10.3 -> sm_103a).

Chosen (priority 20, above sm90's 10) on CUDA when every visible GPU has compute capability 10.0
or 10.3, the library was built with the Blackwell kernels, and the problem is one the kernel
implements; otherwise its plan says why and the planner falls back. In particular
**weight-only** calls (a plain bf16/f16/f32 activation x a quantized weight) are not served: tcgen05
has no block-scaled bf16 x fp4/fp8 MMA kind and the Hopper kernel's wgmma does not exist on
sm_100, so on Blackwell they run on `reference` (the sm90 backend also declines: it needs 9.0).

The backend only converts operands into what the kernel reads (docs/design/sm100.md):
  * fp4 elements: two per byte, element 2i in the low nibble; fp8: one per byte;
    fp6 (stored one 6-bit code per byte): packed four elements in three bytes, a little-endian
    bit stream (element i in bits 6i..6i+5), see `pack_fp6`;
  * scales -> the blocked layout (converted here if given plain), as raw bytes;
  * batch dims -> one L axis; a batched A times an unbatched B is folded into M (one GEMM);
  * alpha -> an f32[1] device buffer (read by the kernel's epilogue).
The variant (tile, cluster) is the plan's (lowering/plan.py: the catalogue's cost model, or
`JAX_BLOCKSCALE_SM100_TILE` to force one); it travels as attributes, and the handler validates
the call and picks the device's cubin arch (sm_100a or sm_103a) at run time. Every runtime
assumption is re-checked by the handler, which returns an error rather than launching anything
it cannot run.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from .. import _plugin
from ..catalog.sm100 import FMT_CODES, FORMATS
from .registry import register_backend
from .kernel_operands import element_bytes, kernel_batch_layout, kernel_scale_bytes
from .plan import plan_sm100
from .specs import Plan


def pack_fp6(codes):
    """(..., K) uint8 6-bit codes -> (..., 3K/4) uint8: four elements in three bytes, a
    little-endian bit stream (element i in bits 6i..6i+5). K must be a multiple of 4."""
    k = codes.shape[-1]
    if k % 4:
        raise ValueError(f"fp6 packing needs K % 4 == 0, got K={k}")
    c = codes.reshape(codes.shape[:-1] + (k // 4, 4)).astype(jnp.uint32) & 0x3F
    word = c[..., 0] | (c[..., 1] << 6) | (c[..., 2] << 12) | (c[..., 3] << 18)
    out = jnp.stack([(word >> s) & 0xFF for s in (0, 8, 16)], axis=-1).astype(jnp.uint8)
    return out.reshape(codes.shape[:-1] + (3 * k // 4,))


class Sm100Backend:
    name = "sm100"
    platforms = ("cuda",)
    priority = 20  # above sm90 (10) and reference (0)

    def plan(self, spec, device):
        return plan_sm100(spec, device)

    def __call__(self, a, b, sa, sb, alpha, *, plan: Plan):
        if not _plugin.register_targets() or not _plugin.has_sm100():
            raise RuntimeError(f"jax_blockscale sm100: {_plugin.sm100_unavailable_reason()}")
        spec = plan.spec
        M, L, N, K = plan.m, plan.l, spec.n, spec.k

        def elements(x, fmt, rows):
            x = kernel_batch_layout(x, rows, spec=spec)
            if FORMATS[fmt].bits == 6:  # one code per byte in storage -> packed 6-bit stream
                return pack_fp6(x.astype(jnp.uint8))
            return element_bytes(x)

        a8 = elements(a, spec.fmt_a, M)
        b8 = elements(b, spec.fmt_b, N)
        sa8 = kernel_scale_bytes(sa, spec.fmt_a, spec.layout_a, M, spec.m, spec=spec)
        sb8 = kernel_scale_bytes(sb, spec.fmt_b, spec.layout_b, N, N, spec=spec)
        (tm, tn), (cm, cn) = plan.tile, plan.cluster
        call = jax.ffi.ffi_call(_plugin.SM100_TARGET,
                                jax.ShapeDtypeStruct((L, M, N), spec.out_dtype))
        y = call(a8, b8, sa8, sb8, jnp.reshape(alpha.astype(jnp.float32), (1,)),
                 fmt_a=np.int32(FMT_CODES[spec.fmt_a]), fmt_b=np.int32(FMT_CODES[spec.fmt_b]),
                 m=np.int64(M), n=np.int64(N), k=np.int64(K), l=np.int64(L),
                 tile_m=np.int32(tm), tile_n=np.int32(tn), cluster_m=np.int32(cm),
                 cluster_n=np.int32(cn))
        return y.reshape(spec.batch_shape + (spec.m, N))


SM100 = Sm100Backend()
register_backend(SM100)
