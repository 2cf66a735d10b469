"""A float64 NumPy oracle for every format, written from the specs (OCP MX v1.0, the NVFP4
two-level recipe) with ml_dtypes, independently of the package's JAX implementation."""
from __future__ import annotations

import ml_dtypes
import numpy as np

# name: (element dtype, block, scale dtype, emax of the element, largest element)
SPEC = {
    "nvfp4": (ml_dtypes.float4_e2m1fn, 16, ml_dtypes.float8_e4m3fn, 2, 6.0),
    "mxfp4": (ml_dtypes.float4_e2m1fn, 32, ml_dtypes.float8_e8m0fnu, 2, 6.0),
    "mxfp6_e2m3": (ml_dtypes.float6_e2m3fn, 32, ml_dtypes.float8_e8m0fnu, 2, 7.5),
    "mxfp6_e3m2": (ml_dtypes.float6_e3m2fn, 32, ml_dtypes.float8_e8m0fnu, 4, 28.0),
    "mxfp8_e4m3": (ml_dtypes.float8_e4m3fn, 32, ml_dtypes.float8_e8m0fnu, 8, 448.0),
    "mxfp8_e5m2": (ml_dtypes.float8_e5m2, 32, ml_dtypes.float8_e8m0fnu, 15, 57344.0),
}
FP6 = ("mxfp6_e2m3", "mxfp6_e3m2")


def decode_elements(data, fmt) -> np.ndarray:
    elem = SPEC[fmt][0]
    data = np.asarray(data)
    if fmt in FP6:  # stored as uint8 6-bit codes
        return data.astype(np.uint8).view(elem).astype(np.float64)
    return data.astype(np.float64)


def blocked_to_plain(blocked, mn, sk) -> np.ndarray:
    """Read plain s[m, k] from [m // 128, k // 4, m % 32, (m % 128) // 32, k % 4]."""
    blocked = np.asarray(blocked)
    m = np.arange(mn)[:, None]
    k = np.arange(sk)[None, :]
    return blocked[..., m // 128, k // 4, m % 32, (m % 128) // 32, k % 4]


def dequantize(data, scales, fmt, global_scale=None, layout="plain") -> np.ndarray:
    _, block, _, _, _ = SPEC[fmt]
    vals = decode_elements(data, fmt)
    *lead, mn, k = vals.shape
    scales = np.asarray(scales)
    if layout == "blocked":
        scales = blocked_to_plain(scales, mn, k // block)
    s = scales.astype(np.float64)
    vals = vals * np.repeat(s, block, axis=-1)
    if global_scale is not None:
        vals = vals * np.float64(np.asarray(global_scale))
    return vals


def gemm(a_vals, b_vals, alpha=1.0) -> np.ndarray:
    """y[..., m, n] = alpha * sum_k a[..., m, k] b[..., n, k], in float64."""
    return alpha * np.einsum("...mk,...nk->...mn", a_vals, b_vals)


def quantize(x, fmt):
    """Returns (decoded elements float64, scales as ml_dtypes array, global decode scale or None)."""
    elem, block, scale_dt, emax, elem_max = SPEC[fmt]
    x = np.asarray(x, np.float32)
    xb = x.reshape(*x.shape[:-1], x.shape[-1] // block, block)
    amax = np.abs(xb).max(axis=-1)
    if fmt == "nvfp4":
        tensor_amax = np.float32(np.abs(x).max())
        enc = np.float32(6.0 * 448.0) / tensor_amax if tensor_amax > 0 else np.float32(1.0)
        scales = np.minimum(amax / np.float32(6.0) * enc, np.float32(448.0)).astype(scale_dt)
        sf = scales.astype(np.float32)[..., None]
        with np.errstate(divide="ignore", invalid="ignore"):
            q = np.where(sf > 0, xb * (enc / np.where(sf > 0, sf, 1)), 0).astype(np.float32)
        elems = np.clip(q, -elem_max, elem_max).astype(elem)
        return (elems.astype(np.float64).reshape(x.shape), scales,
                np.float32(1.0) / enc)
    # OCP MX: shared_exp = floor(log2(amax)) - emax, clamped to e8m0's [-127, 127]
    mant, exp = np.frexp(amax)
    shared = np.where(amax > 0, exp - 1 - emax, -127).clip(-127, 127)
    scales = np.ldexp(1.0, shared).astype(scale_dt)
    q = np.clip(xb.astype(np.float64) / np.ldexp(1.0, shared)[..., None], -elem_max, elem_max)
    elems = q.astype(np.float32).astype(elem)
    return elems.astype(np.float64).reshape(x.shape), scales, None
