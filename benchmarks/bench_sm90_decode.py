"""Time the integrated sm90 decode path (jbs.gemm -> FFI -> decode kernel) against bf16 jnp.dot,
jitted dequantize+dot and the fused sm90 kernel, on the GPU, in one process.

    python benchmarks/bench_sm90_decode.py [--json OUT.json] [--iters 50]

Timing: benchmarks/timing.py, the method of /work/shared/anchors/bench_anchors.py and
benchmarks/bench_sm90.py (jitted function, 2 warm-up calls, mean over --iters back-to-back calls
bracketed by block_until_ready, one trial), so the numbers compare with the anchors. Output bf16.
The decode result is checked against the reference backend (f32 output, relative Frobenius
error) before it is timed.
"""
from __future__ import annotations

import argparse
import json
import os

import numpy as np

import jax
import jax.numpy as jnp

import jax_blockscale as jbs
from jax_blockscale.lowering import ffi as _sm90

from timing import time_us  # the shared method (benchmarks/timing.py)


def timeit(f, *args, iters=50):
    """Microseconds per call: one trial of `iters` calls, as in the anchor file."""
    return time_us(f, *args, iters=iters, trials=1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--fmts", default="w:nvfp4,w:mxfp4,w:mxfp8_e4m3,nvfp4")
    ap.add_argument("--ms", default="1,16,32")
    ap.add_argument("--nks", default="8192,16384")
    args = ap.parse_args()
    print(jax.__version__, jax.devices(), flush=True)
    rows = []
    key = jax.random.PRNGKey(0)
    dot = jax.jit(lambda a, b: jnp.dot(a, b.T, preferred_element_type=jnp.float32
                                       ).astype(jnp.bfloat16))
    for nk in (int(v) for v in args.nks.split(",")):
        for fmt in args.fmts.split(","):
            weight_only = fmt.startswith("w:")
            fmt_b = fmt[2:] if weight_only else fmt
            fmt_a = None if weight_only else fmt_b
            key, kb = jax.random.split(key)
            w = jax.random.normal(kb, (nk, nk), jnp.float32)
            b = jbs.quantize(w, fmt_b, layout="blocked")
            wb = w.astype(jnp.bfloat16)
            del w
            for M in (int(v) for v in args.ms.split(",")):
                key, ka = jax.random.split(key)
                x = jax.random.normal(ka, (M, nk), jnp.float32)
                a = x.astype(jnp.bfloat16) if weight_only else jbs.quantize(x, fmt_a,
                                                                             layout="blocked")
                xb = x.astype(jnp.bfloat16)
                r = dict(fmt=fmt, M=M, N=nk, K=nk)
                os.environ.pop(_sm90.ENV_DECODE_MAX_ROWS, None)
                os.environ.pop(_sm90.ENV_MAX_ROWS, None)
                dec = jax.jit(lambda a, b: jbs.gemm(a, b, out_dtype=jnp.bfloat16, backend="sm90"))
                # decode path: the custom call declares a non-empty workspace
                try:
                    r["decode_path"] = "tensor<0xf32>" not in dec.lower(a, b).as_text()
                except Exception as e:  # noqa: BLE001
                    r["decode_path"] = repr(e)[:200]
                dec32 = jax.jit(lambda a, b: jbs.gemm(a, b, out_dtype=jnp.float32,
                                                      backend="sm90"))
                ref = jax.jit(lambda a, b: jbs.gemm(a, b, out_dtype=jnp.float32,
                                                    backend="reference"))
                try:
                    y = np.asarray(dec32(a, b), np.float64)
                    yr = np.asarray(ref(a, b), np.float64)
                    r["rel_err_f32"] = float(np.linalg.norm(y - yr) / np.linalg.norm(yr))
                    r["decode_us"] = timeit(dec, a, b, iters=args.iters)
                except Exception as e:  # noqa: BLE001
                    r["decode_err"] = repr(e)[:300]
                # the fused kernel at the same shape (decode off, compiled with the variable set)
                if M >= 16:
                    os.environ[_sm90.ENV_DECODE_MAX_ROWS] = "0"
                    os.environ[_sm90.ENV_MAX_ROWS] = "0"
                    fused = jax.jit(lambda a, b: jbs.gemm(a, b, out_dtype=jnp.bfloat16,
                                                          backend="sm90"))
                    try:
                        jax.block_until_ready(fused(a, b))
                        r["fused_us"] = timeit(fused, a, b, iters=args.iters)
                    except Exception as e:  # noqa: BLE001
                        r["fused_err"] = repr(e)[:300]
                    os.environ.pop(_sm90.ENV_DECODE_MAX_ROWS, None)
                    os.environ.pop(_sm90.ENV_MAX_ROWS, None)
                deq = jax.jit(lambda a, b: jbs.gemm(a, b, out_dtype=jnp.bfloat16,
                                                    backend="reference"))
                r["deq_dot_us"] = timeit(deq, a, b, iters=args.iters)
                r["bf16_dot_us"] = timeit(dot, xb, wb, iters=args.iters)
                if "decode_us" in r:
                    r["speedup_vs_bf16_dot"] = r["bf16_dot_us"] / r["decode_us"]
                    r["speedup_vs_deq_dot"] = r["deq_dot_us"] / r["decode_us"]
                rows.append(r)
                print(json.dumps(r), flush=True)
                if args.json:
                    with open(args.json, "w") as f:
                        json.dump(rows, f, indent=1)
            del b, wb
    print("\nfmt            M     N=K | decode us | fused us | deq+dot us | bf16 dot us | x dot | err")
    for r in rows:
        g = lambda k: ("%9.1f" % r[k]) if k in r else "        -"  # noqa: E731
        print("%-12s %4d %6d | %s | %s | %s  | %s   | %5.2f | %s" % (
            r["fmt"], r["M"], r["N"], g("decode_us"), g("fused_us"), g("deq_dot_us"),
            g("bf16_dot_us"), r.get("speedup_vs_bf16_dot", 0.0),
            "%.1e" % r["rel_err_f32"] if "rel_err_f32" in r else "-"))


if __name__ == "__main__":
    main()
