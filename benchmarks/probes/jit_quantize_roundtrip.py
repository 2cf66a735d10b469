"""Probe: does quantize -> dequantize / gemm inside one jit give the step-by-step numbers?

On an H100 before session 9's fix (an optimization barrier in `jbs.dequantize`), XLA's GPU
pipeline removed the f32 -> fp8 -> f32 converts of a jit that quantizes and then dequantizes, so
nvfp4 (its e4m3 scales) and mxfp8 activations were used unrounded (results/
jit_roundtrip_h100_session9_{before,after}.log). The same check is tests/test_jit_numerics.py.

    python benchmarks/probes/jit_quantize_roundtrip.py     # prints BAD 0 when all agree
"""
import os

import jax
import jax.numpy as jnp
import numpy as np

import jax_blockscale as jbs
from jax_blockscale.lowering import ffi as sm90_ffi

FORMATS = ["nvfp4", "mxfp4", "mxfp8_e4m3", "mxfp8_e5m2", "mxfp6_e2m3"]


def main():
    os.environ[sm90_ffi.ENV_MAX_ROWS] = "16"  # M = 256: the sm90 backend's dequantize + dot
    rng = np.random.default_rng(0)
    x = rng.standard_normal((256, 1024)).astype(np.float32)
    w = rng.standard_normal((512, 1024)).astype(np.float32)
    bad = 0
    for fmt in FORMATS:
        wq = jbs.quantize(w, fmt, layout="blocked")
        for backend in [None, "reference"]:
            fused = jax.jit(lambda x, w: jbs.gemm(jbs.quantize(x, fmt), w, out_dtype=jnp.float32,
                                                  backend=backend))
            y1 = np.asarray(fused(x, wq))
            y2 = np.asarray(jbs.gemm(jbs.quantize(x, fmt), wq, out_dtype=jnp.float32,
                                     backend=backend))
            e = float(np.abs(y1 - y2).max() / np.abs(y2).max())
            bad += e > 1e-5
            print(fmt, backend, "jit vs eager gemm", e)
        roundtrip = jax.jit(lambda x: jbs.dequantize(jbs.quantize(x, fmt)))
        eager = np.asarray(jbs.dequantize(jbs.quantize(x, fmt)))
        e = float(np.abs(np.asarray(roundtrip(x)) - eager).max())
        bad += e > 0
        print(fmt, "jit vs eager dequantize(quantize)", e)
    print("BAD", bad)


if __name__ == "__main__":
    main()
