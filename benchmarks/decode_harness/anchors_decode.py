"""The anchors at the decode shapes, measured the way /work/shared/anchors/bench_anchors.py does
(benchmarks/timing.py: jitted JAX, wall clock over 30 calls after two warm-ups, one trial): bf16
jnp.dot and the jitted "dequantize NVFP4 then dot". Prints one JSON line per shape; writes a JSON
list to argv[1].

    XLA_PYTHON_CLIENT_PREALLOCATE=false python benchmarks/decode_harness/anchors_decode.py OUT.json
"""
import json
import os
import sys

import jax
import jax.numpy as jnp

# benchmarks/timing.py (the shared method; imports jax only): this file runs as a script from
# the repository root, so put its parent folder on the path.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from timing import time_us  # noqa: E402


@jax.jit
def dot_bf16(a, b):
    return jnp.dot(a, b.T, preferred_element_type=jnp.float32).astype(jnp.bfloat16)


@jax.jit
def deq_dot_nvfp4(a, b, sb):
    n, k = b.shape
    bf = (b.astype(jnp.float32).reshape(n, k // 16, 16) * sb.astype(jnp.float32)[..., None])
    return jnp.dot(a, bf.reshape(n, k).astype(jnp.bfloat16).T,
                   preferred_element_type=jnp.float32).astype(jnp.bfloat16)


def main():
    rows = []
    vals = jnp.array([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6], jnp.float32)
    for (m, nk) in [(1, 8192), (16, 8192), (1, 16384), (16, 16384)]:
        k = jax.random.split(jax.random.PRNGKey(m + nk), 4)
        a = jax.random.normal(k[0], (m, nk), jnp.bfloat16)
        b16 = jax.random.normal(k[1], (nk, nk), jnp.bfloat16)
        b4 = vals[jax.random.randint(k[2], (nk, nk), 0, 16)].astype(jnp.float4_e2m1fn)
        sb = (2.0 ** jax.random.randint(k[3], (nk, nk // 16), -3, 3).astype(jnp.float32)).astype(
            jnp.float8_e4m3fn)
        r = dict(M=m, N=nk, K=nk, bf16_dot_us=time_us(dot_bf16, a, b16, iters=30, trials=1))
        del b16
        r["deq_dot_nvfp4_us"] = time_us(deq_dot_nvfp4, a, b4, sb, iters=30, trials=1)
        rows.append(r)
        print(json.dumps(r), flush=True)
    if len(sys.argv) > 1:
        json.dump(dict(device=str(jax.devices()[0]), jax=jax.__version__, rows=rows),
                  open(sys.argv[1], "w"), indent=1)


if __name__ == "__main__":
    main()
