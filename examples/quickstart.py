"""Quantize random weights, run `gemm` under jit, compare with a float64 reference, time it.

    python examples/quickstart.py [--m 256 --n 1024 --k 1024] [--formats nvfp4,mxfp8_e4m3]

Runs on the GPU when there is one (through the fastest backend that can run each format),
otherwise on the CPU through the pure-JAX reference backend.
"""
import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

import jax_blockscale as jbs


def time_call(f, *args, iters=20, trials=5):
    """Seconds per call: the median over `trials` of back-to-back calls' mean (host included).
    One short loop alone can catch a stall of the host (a garbage collection, the first calls
    of a new program) and read several times too slow."""
    jax.block_until_ready(f(*args))  # compile and warm up
    jax.block_until_ready(f(*args))
    means = []
    for _ in range(trials):
        start = time.perf_counter()
        for _ in range(iters):
            out = f(*args)
        jax.block_until_ready(out)
        means.append((time.perf_counter() - start) / iters)
    return float(np.median(means))


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--m", type=int, default=256)
    p.add_argument("--n", type=int, default=1024)
    p.add_argument("--k", type=int, default=1024)
    p.add_argument("--formats", default="nvfp4,mxfp4,mxfp6_e2m3,mxfp8_e4m3,mxfp8_e5m2")
    args = p.parse_args()

    device = jax.devices()[0]
    print(f"jax {jax.__version__} on {device.platform} ({device.device_kind}); "
          f"backends registered: {jbs.backend_names()}")
    rng = np.random.default_rng(0)
    w = rng.standard_normal((args.n, args.k)).astype(np.float32)  # a Dense weight, (out, in)
    x = rng.standard_normal((args.m, args.k)).astype(np.float32)
    exact = x.astype(np.float64) @ w.astype(np.float64).T  # float64, unquantized
    x_dev = jnp.asarray(x)  # on the device, so the timings do not include a host copy
    x_bf16 = jnp.asarray(x, jnp.bfloat16)

    @jax.jit
    def w4a4(x, w):  # quantize the activation per call, multiply by the stored weight
        return jbs.gemm(jbs.quantize(x, w.fmt), w, out_dtype=jnp.float32)

    @jax.jit
    def weight_only(x, w):
        return jbs.gemm(x, w, out_dtype=jnp.float32)

    def rel(y, ref):
        return np.linalg.norm(y - ref) / np.linalg.norm(ref)

    print(f"\nM={args.m} N={args.n} K={args.k}. quant. error: vs x @ w.T in float64 on the "
          "unquantized inputs;\ngemm error: vs float64 on the dequantized operands (the kernel's "
          "own error);\nwall us: per jitted call, the host's dispatch included (the GPU's own "
          "time: benchmarks/)")
    print(f"{'format':12s} {'mode':12s} {'quant. error':>12s} {'gemm error':>11s} "
          f"{'wall us':>10s}")
    for fmt in args.formats.split(","):
        wq = jbs.quantize(w, fmt, layout="blocked")  # once, at load time
        w_vals = np.asarray(jbs.dequantize(wq), np.float64)
        x_vals = {"quantized": np.asarray(jbs.dequantize(jbs.quantize(x, fmt)), np.float64),
                  "weight-only": np.asarray(x_bf16, np.float64)}
        for mode, f, a in (("quantized", w4a4, x_dev), ("weight-only", weight_only, x_bf16)):
            y = np.asarray(f(a, wq), np.float64)
            own = rel(y, x_vals[mode] @ w_vals.T)
            print(f"{fmt:12s} {mode:12s} {rel(y, exact):12.4f} {own:11.1e} "
                  f"{time_call(f, a, wq) * 1e6:10.1f}")


if __name__ == "__main__":
    main()
