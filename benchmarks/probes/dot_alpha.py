"""The alpha-in-the-epilogue GEMM (FFI target jax_blockscale_dot_alpha, ffi/jbs_dot_alpha.cc) against
XLA's two ways of computing round(alpha * (A @ B^T)) from bf16 operands (GPU only).

  xla_f32_pass : dot with an f32 result, times alpha, rounded (what the large-M path did with a
                 global scale: the f32 sum goes to memory and back)
  dot_alpha    : one cuBLASLt GEMM that applies alpha in its epilogue (the large-M path now)
  bf16_dot     : the bf16-output dot without alpha (the speed to match)

Prints device time per method in paired rounds and how far dot_alpha is from xla_f32_pass
(elements that differ, largest difference in output ulps), and writes --json.

    python benchmarks/probes/dot_alpha.py --rounds 3 --json out.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from jax_blockscale import _plugin  # noqa: E402
from jax_blockscale.lowering.ffi import DOT_ALPHA_WORKSPACE_BYTES, dot_alpha  # noqa: E402
from timing import copies, device_time_us, rotation_count  # noqa: E402


def xla_f32_pass(a, b, alpha):
    y = jax.lax.dot_general(a, b, (((2,), (2,)), ((0,), (0,))),
                            preferred_element_type=jnp.float32)
    return (y * alpha).astype(jnp.bfloat16)


def bf16_dot(a, b, alpha):
    del alpha
    return jax.lax.dot_general(a, b, (((2,), (2,)), ((0,), (0,))),
                               preferred_element_type=jnp.bfloat16)


def ulp_distance(x, y):
    """Largest distance in bf16 ulps between two bf16 arrays of finite values."""
    def ordered(v):
        i = np.asarray(jax.lax.bitcast_convert_type(v, jnp.int16)).astype(np.int32)
        return np.where(i < 0, -(i & 0x7FFF), i)
    return int(np.max(np.abs(ordered(x) - ordered(y))))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="1x8192x8192x8192,1x1024x16384x16384,4x2048x4096x4096,1x256x1024x16384")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    assert _plugin.register_targets(), _plugin.unavailable_reason()
    print(f"workspace {DOT_ALPHA_WORKSPACE_BYTES >> 20} MiB")
    results = []
    for shape in args.shapes.split(","):
        l, m, n, k = (int(v) for v in shape.split("x"))
        ka, kb = jax.random.split(jax.random.key(l * m + n + k))
        a = jax.random.normal(ka, (l, m, k), jnp.float32).astype(jnp.bfloat16)
        b = jax.random.normal(kb, (l, n, k), jnp.float32).astype(jnp.bfloat16)
        alpha = jnp.float32(0.3711)
        methods = {"bf16_dot": jax.jit(bf16_dot), "xla_f32_pass": jax.jit(xla_f32_pass),
                   "dot_alpha": jax.jit(lambda a, b, s: dot_alpha(a, b, s, jnp.bfloat16))}
        ref = methods["xla_f32_pass"](a, b, alpha)
        got = methods["dot_alpha"](a, b, alpha)
        differ = int(jnp.sum(ref != got))
        ulps = ulp_distance(ref, got)
        sets = [(a, b_, alpha) for b_ in copies(b, rotation_count(2 * l * n * k))]
        times = {name: [] for name in methods}
        for _ in range(args.rounds):
            for name, f in methods.items():
                times[name].append(device_time_us(f, arg_sets=sets))
        med = {name: statistics.median(t) for name, t in times.items()}
        ratio = statistics.median(d / t for d, t in zip(times["xla_f32_pass"], times["dot_alpha"]))
        vs_dot = statistics.median(d / t for d, t in zip(times["bf16_dot"], times["dot_alpha"]))
        row = dict(shape=shape, us=med, dot_alpha_speedup_vs_f32_pass=ratio,
                   dot_alpha_vs_bf16_dot=vs_dot, elements_differing=differ,
                   elements=l * m * n, max_ulps=ulps)
        results.append(row)
        print(f"{shape}: " + ", ".join(f"{k_} {v:.1f} us" for k_, v in med.items())
              + f"; dot_alpha {ratio:.3f}x the f32 pass, {vs_dot:.3f}x bf16 dot; "
              f"{differ}/{l * m * n} elements differ, max {ulps} ulp", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=str(jax.devices()[0]), results=results), f, indent=1)


if __name__ == "__main__":
    main()
