"""The block-scaled formats: one table, the single source of truth for every other module.

A block-scaled tensor stores low-precision *elements* and one *scale* per block of `block`
consecutive elements along K (the last, contracting axis). The value an element stands for is
``element * scale * global_scale`` (the global scale exists only for NVFP4 and may be absent).
"""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import ml_dtypes
import numpy as np


@dataclasses.dataclass(frozen=True)
class Format:
    name: str
    # The dtype `BlockScaled.data` is stored in. FP6 has no usable JAX array dtype (XLA rejects
    # F6E2M3FN/F6E3M2FN buffers), so its elements travel as uint8 holding the 6-bit code.
    storage_dtype: np.dtype
    # The element type as ml_dtypes knows it (for decoding and for the NumPy oracle).
    element_dtype: np.dtype
    block: int  # elements per scale, along K
    scale_dtype: np.dtype
    emax: int  # exponent of the largest normal element (OCP MX v1.0, table 1)
    elem_max: float  # largest finite element magnitude; quantization saturates here
    has_global_scale: bool  # NVFP4's fp32 per-tensor tier
    mma_kind: str  # the Blackwell tcgen05 block-scaled MMA kind that multiplies it

    @property
    def element_bits(self) -> int:
        return _bits(self.element_dtype)

    @property
    def is_code_stored(self) -> bool:
        """True when data holds raw element bit codes in uint8 (FP6)."""
        return self.storage_dtype == np.dtype(np.uint8)


def _bits(dt) -> int:
    return {"float4_e2m1fn": 4, "float6_e2m3fn": 6, "float6_e3m2fn": 6}.get(np.dtype(dt).name, 8)


_E8M0 = np.dtype(jnp.float8_e8m0fnu)
_E4M3 = np.dtype(jnp.float8_e4m3fn)


def _fmt(name, storage, element, block, scale, emax, elem_max, global_scale, kind):
    return Format(name, np.dtype(storage), np.dtype(element), block, np.dtype(scale), emax,
                  float(elem_max), global_scale, kind)


FORMATS: dict[str, Format] = {f.name: f for f in [
    _fmt("nvfp4", jnp.float4_e2m1fn, ml_dtypes.float4_e2m1fn, 16, _E4M3, 2, 6.0, True, "mxf4nvf4"),
    _fmt("mxfp4", jnp.float4_e2m1fn, ml_dtypes.float4_e2m1fn, 32, _E8M0, 2, 6.0, False, "mxf4"),
    _fmt("mxfp6_e2m3", np.uint8, ml_dtypes.float6_e2m3fn, 32, _E8M0, 2, 7.5, False, "mxf8f6f4"),
    _fmt("mxfp6_e3m2", np.uint8, ml_dtypes.float6_e3m2fn, 32, _E8M0, 4, 28.0, False, "mxf8f6f4"),
    _fmt("mxfp8_e4m3", jnp.float8_e4m3fn, ml_dtypes.float8_e4m3fn, 32, _E8M0, 8, 448.0, False,
         "mxf8f6f4"),
    _fmt("mxfp8_e5m2", jnp.float8_e5m2, ml_dtypes.float8_e5m2, 32, _E8M0, 15, 57344.0, False,
         "mxf8f6f4"),
]}

# Plain (unquantized) activation dtypes accepted in weight-only mode.
PLAIN_DTYPES = (np.dtype(jnp.bfloat16), np.dtype(jnp.float16), np.dtype(jnp.float32))
# Output dtypes gemm can produce.
OUT_DTYPES = (np.dtype(jnp.bfloat16), np.dtype(jnp.float16), np.dtype(jnp.float32))

_MX_NAMES = frozenset(n for n in FORMATS if n.startswith("mx"))


def check_out_dtype(out_dtype) -> None:
    """Raise TypeError (at trace time) unless `out_dtype` is one gemm can produce."""
    if np.dtype(out_dtype) not in OUT_DTYPES:
        raise TypeError(f"out_dtype must be one of {[d.name for d in OUT_DTYPES]}, "
                        f"got {np.dtype(out_dtype).name}")


def get_format(name: str | Format) -> Format:
    """Look a format up by name, with an error that lists the valid names."""
    if isinstance(name, Format):
        return name
    try:
        return FORMATS[name]
    except (KeyError, TypeError):
        raise ValueError(
            f"unknown block-scaled format {name!r}; choose one of {sorted(FORMATS)}") from None


def can_multiply(fmt_a: str | None, fmt_b: str) -> bool:
    """Whether the pair (A, B) is one the tensor cores multiply (and so one gemm accepts).

    NVFP4 (e4m3 scales, block 16) pairs only with itself (MMA kind mxf4nvf4). The MX formats
    share e8m0 scales and block 32, and kind mxf8f6f4 takes any mix of e2m1/e2m3/e3m2/e4m3/e5m2
    for A and B. ``fmt_a=None`` is weight-only mode: a plain activation times any quantized B.
    """
    get_format(fmt_b)
    if fmt_a is None:
        return True
    get_format(fmt_a)
    if fmt_a == "nvfp4" or fmt_b == "nvfp4":
        return fmt_a == fmt_b
    return fmt_a in _MX_NAMES and fmt_b in _MX_NAMES


def supported_pairs() -> list[tuple[str, str]]:
    """Every quantized (A, B) pair `can_multiply` accepts."""
    return [(a, b) for a in FORMATS for b in FORMATS if can_multiply(a, b)]


def format_for(element_dtype, scale_dtype, block: int) -> Format:
    """The format whose storage, scale dtype and block size match (used by `scaled_matmul`)."""
    for f in FORMATS.values():
        if (f.storage_dtype == np.dtype(element_dtype) and f.scale_dtype == np.dtype(scale_dtype)
                and f.block == block and not f.is_code_stored):
            return f
    raise ValueError(
        f"no block-scaled format has elements {np.dtype(element_dtype).name}, scales "
        f"{np.dtype(scale_dtype).name} and block size {block}; supported: "
        + ", ".join(f"{f.name} ({f.storage_dtype.name}, {f.scale_dtype.name}, block {f.block})"
                    for f in FORMATS.values() if not f.is_code_stored))
