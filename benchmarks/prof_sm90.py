"""Run one sm90 gemm a few times (for ncu / compute-sanitizer).

    python benchmarks/prof_sm90.py FMT M N K        (FMT: nvfp4, mxfp8_e4m3, w:nvfp4, ...)
"""
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

import jax_blockscale as jbs
from jax_blockscale.lowering import ffi as sm90

fmt, M, N, K = sys.argv[1], *map(int, sys.argv[2:5])
os.environ[sm90.ENV_MAX_ROWS] = "0"
weight_only = fmt.startswith("w:")
fmt_b = fmt[2:] if weight_only else fmt
k1, k2 = jax.random.split(jax.random.PRNGKey(0))
x = jax.random.normal(k1, (M, K))
b = jbs.quantize(jax.random.normal(k2, (N, K)), fmt_b, layout="blocked")
a = x.astype(jnp.bfloat16) if weight_only else jbs.quantize(x, fmt_b, layout="blocked")
f = jax.jit(lambda a, b: jbs.gemm(a, b, out_dtype=jnp.float32, backend="sm90"))
for _ in range(3):
    y = f(a, b)
ref = jbs.gemm(a, b, out_dtype=jnp.float32, backend="reference")
y, ref = np.asarray(y, np.float64), np.asarray(ref, np.float64)
print("rel err", np.linalg.norm(y - ref) / np.linalg.norm(ref))
