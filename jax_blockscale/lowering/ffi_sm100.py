"""The `sm100` backend: gemm_p lowered to the XLA FFI custom call `jax_blockscale_gemm_sm100`
(Blackwell: B200/GB200, compute capability 10.0 -> sm_100a cubins; B300/GB300, 10.3 -> sm_103a).

Chosen (priority 20, above sm90's 10) on CUDA when every visible GPU has compute capability 10.0
or 10.3, the library was built with the Blackwell kernels, and the problem is one the kernel
implements; otherwise `unsupported_reason` says why and the registry falls back. In particular
**weight-only** calls (a plain bf16/f16/f32 activation x a quantized weight) are not served: tcgen05
has no block-scaled bf16 x fp4/fp8 MMA kind and the Hopper kernel's wgmma does not exist on
sm_100, so on Blackwell they run on `reference` (the sm90 backend also declines: it needs 9.0).

The backend only converts operands into what the kernel reads (docs/blackwell.md):
  * fp4 elements: two per byte, element 2i in the low nibble; fp8: one per byte;
    fp6 (stored one 6-bit code per byte): packed four elements in three bytes, a little-endian
    bit stream (element i in bits 6i..6i+5), see `pack_fp6`;
  * scales -> the blocked layout (converted here if given plain), as raw bytes;
  * batch dims -> one L axis; a batched A times an unbatched B is folded into M (one GEMM);
  * alpha -> an f32[1] device buffer (read by the kernel's epilogue).
Tile choice: by default the FFI handler's C++ mirror of `choose_sm100_variant` picks the variant
at run time with the device's SM count (attributes tile_* = 0). `JAX_BLOCKSCALE_SM100_TILE`
("256x128c2x1", "128x64", ...) forces one compiled variant (tuning aid); the handler rejects a
tile that was not compiled. Every runtime assumption is re-checked by the handler, which returns
an error rather than launching anything it cannot run.
"""
from __future__ import annotations

import functools
import os
import re

import jax
import jax.numpy as jnp
import numpy as np

from .. import _plugin
from ..aot_sm100 import FMT_CODES, OUT_CODES
from . import GemmSpec, register_backend
from .kernel_operands import (element_bytes, kernel_batch_layout, kernel_rows_and_batch,
                              kernel_scale_bytes)

# The pairs the Blackwell library serves (kernels/sm100_blockscaled.py: PAIRS; kept here because
# the installed package has no DSL to import that module; a test checks they agree).
PAIRS = frozenset({
    ("nvfp4", "nvfp4"), ("mxfp4", "mxfp4"),
    ("mxfp8_e4m3", "mxfp8_e4m3"), ("mxfp8_e4m3", "mxfp8_e5m2"),
    ("mxfp8_e5m2", "mxfp8_e4m3"), ("mxfp8_e5m2", "mxfp8_e5m2"),
    ("mxfp8_e4m3", "mxfp4"), ("mxfp8_e5m2", "mxfp4"),
    ("mxfp6_e2m3", "mxfp6_e2m3"), ("mxfp6_e3m2", "mxfp6_e3m2"),
    ("mxfp8_e4m3", "mxfp6_e2m3"),
})
_BITS = {"nvfp4": 4, "mxfp4": 4, "mxfp6_e2m3": 6, "mxfp6_e3m2": 6, "mxfp8_e4m3": 8,
         "mxfp8_e5m2": 8}
_OUT_NAMES = {np.dtype(jnp.bfloat16): "bfloat16", np.dtype(jnp.float16): "float16",
              np.dtype(jnp.float32): "float32"}
_INT32_MAX = 2**31 - 1
BLACKWELL_CCS = ("10.0", "10.3")
ENV_TILE = "JAX_BLOCKSCALE_SM100_TILE"


def k_alignment(fmt_a: str, fmt_b: str) -> int:
    """Mirror of kernels/sm100_blockscaled.py:k_alignment."""
    a, b = _BITS[fmt_a], _BITS[fmt_b]
    if a != b or 6 in (a, b):
        return 128
    return max(128 // a, 16 if fmt_a == "nvfp4" else 32)


def n_alignment(out_dtype) -> int:
    return 4 if np.dtype(out_dtype) == np.dtype(jnp.float32) else 8


@functools.lru_cache(maxsize=None)
def _device_ccs() -> tuple[str, ...] | str:
    """The compute capabilities of the visible CUDA GPUs, or a string saying why there are none."""
    try:
        gpus = [d for d in jax.devices() if d.platform == "gpu"]
    except RuntimeError as e:
        return f"no CUDA devices ({e})"
    if not gpus:
        return "no CUDA devices"
    return tuple(sorted({str(getattr(d, "compute_capability", "?")) for d in gpus}))


def _device_reason() -> str | None:
    ccs = _device_ccs()
    if isinstance(ccs, str):
        return ccs
    if not set(ccs) <= set(BLACKWELL_CCS):
        return (f"the sm100 kernels need compute capability 10.0 or 10.3 (B200/GB200, "
                f"B300/GB300), found {', '.join(ccs)}")
    return None


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


def _forced_tile() -> tuple[int, int, int, int]:
    v = os.environ.get(ENV_TILE, "").strip()
    if not v:
        return (0, 0, 0, 0)
    m = re.fullmatch(r"(\d+)x(\d+)(?:c(\d)x(\d))?", v)
    if not m:
        raise ValueError(f"{ENV_TILE}={v!r}: expected e.g. 128x64 or 256x256c2x1")
    tm, tn = int(m.group(1)), int(m.group(2))
    cm = int(m.group(3) or (2 if tm == 256 else 1))
    cn = int(m.group(4) or 1)
    return (tm, tn, cm, cn)


class Sm100Backend:
    name = "sm100"
    platforms = ("cuda",)
    priority = 20  # above sm90 (10) and reference (0)

    def unsupported_reason(self, spec: GemmSpec) -> str | None:
        if spec.fmt_a is None:
            return ("weight-only (plain activation x quantized weight) has no block-scaled MMA "
                    "on Blackwell (tcgen05 has no bf16 x fp4/fp8 kind); it runs on `reference`")
        if (spec.fmt_a, spec.fmt_b) not in PAIRS:
            return f"the sm100 kernels have no {spec.fmt_a} x {spec.fmt_b} variant"
        if np.dtype(spec.out_dtype) not in _OUT_NAMES:
            return f"out dtype {np.dtype(spec.out_dtype).name} not supported"
        if min(spec.m, spec.n, spec.k) < 1 or 0 in spec.batch_shape:
            return "empty problem"
        ka = k_alignment(spec.fmt_a, spec.fmt_b)
        if spec.k % ka:
            return f"K={spec.k} must be a multiple of {ka} for {spec.fmt_a} x {spec.fmt_b}"
        na = n_alignment(spec.out_dtype)
        if spec.n % na:
            return (f"N={spec.n} must be a multiple of {na} for "
                    f"{np.dtype(spec.out_dtype).name} output")
        m, _ = kernel_rows_and_batch(spec)
        if max(m * spec.k, spec.n * spec.k, m * spec.n) > _INT32_MAX:
            return "problem too large for the kernel's 32-bit indexing (M*K, N*K, M*N < 2^31)"
        why = _device_reason()
        if why is not None:
            return why
        return _plugin.sm100_unavailable_reason()

    def __call__(self, a, b, sa, sb, alpha, *, spec: GemmSpec, platform: str = "cuda"):
        if not _plugin.register_targets() or not _plugin.has_sm100():
            raise RuntimeError(f"jax_blockscale sm100: {_plugin.sm100_unavailable_reason()}")
        M, L = kernel_rows_and_batch(spec)
        N, K = spec.n, spec.k

        def elements(x, fmt, rows):
            x = kernel_batch_layout(x, rows, spec=spec)
            if _BITS[fmt] == 6:  # one code per byte in storage -> packed 6-bit stream
                return pack_fp6(x.astype(jnp.uint8))
            return element_bytes(x)

        a8 = elements(a, spec.fmt_a, M)
        b8 = elements(b, spec.fmt_b, N)
        sa8 = kernel_scale_bytes(sa, spec.fmt_a, spec.layout_a, M, spec.m, spec=spec)
        sb8 = kernel_scale_bytes(sb, spec.fmt_b, spec.layout_b, N, N, spec=spec)
        tm, tn, cm, cn = _forced_tile()
        call = jax.ffi.ffi_call(_plugin.SM100_TARGET,
                                jax.ShapeDtypeStruct((L, M, N), spec.out_dtype))
        y = call(a8, b8, sa8, sb8, jnp.reshape(alpha.astype(jnp.float32), (1,)),
                 fmt_a=np.int32(FMT_CODES[spec.fmt_a]), fmt_b=np.int32(FMT_CODES[spec.fmt_b]),
                 m=np.int64(M), n=np.int64(N), k=np.int64(K), l=np.int64(L),
                 tile_m=np.int32(tm), tile_n=np.int32(tn), cluster_m=np.int32(cm),
                 cluster_n=np.int32(cn))
        return y.reshape(spec.batch_shape + (spec.m, N))


def out_code(out_dtype) -> int:
    return OUT_CODES[_OUT_NAMES[np.dtype(out_dtype)]]


SM100 = Sm100Backend()
register_backend(SM100)
