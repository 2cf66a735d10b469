"""Time the sm90 backend against the anchors (bf16 jnp.dot, jitted dequantize+dot,
jax.nn.scaled_matmul) side by side in one process, on the GPU.

    python benchmarks/bench_sm90.py [--quick] [--json OUT.json]

Timing: benchmarks/timing.py (jitted function, 2 warm-up calls, then the mean over 30
back-to-back calls bracketed by block_until_ready, one trial: the method of
/work/shared/anchors/bench_anchors.py, so the numbers are comparable with the anchor file). Fresh
random data per shape; the sm90 result is checked against the reference backend (relative
Frobenius error) before it is timed.
"""
from __future__ import annotations

import argparse
import json
import os

import numpy as np

import jax
import jax.numpy as jnp

import jax_blockscale as jbs
from jax_blockscale.lowering import ffi as _sm90  # noqa: F401  (registers "sm90")

from timing import time_us  # the shared method (benchmarks/timing.py)


def timeit(f, *args):
    """Microseconds per call: one trial of 30 calls, as in the anchor file."""
    return time_us(f, *args, iters=30, trials=1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", default=None)
    ap.add_argument("--fmts", default="nvfp4,mxfp4,mxfp8_e4m3,w:nvfp4")
    ap.add_argument("--tiles", default="", help="also time these tile N values (64,128,256)")
    ap.add_argument("--shapes", default="", help="M,N,K;M,N,K;...")
    args = ap.parse_args()
    print(jax.__version__, jax.devices(), flush=True)
    if args.shapes:
        shapes = [tuple(int(v) for v in t.split(",")) for t in args.shapes.split(";")]
    elif args.quick:
        shapes = [(16, 8192, 8192), (1024, 8192, 8192), (8192, 8192, 8192)]
    else:
        shapes = [(m, nk, nk) for nk in (8192, 16384) for m in (16, 128, 1024, 8192)]
    rows = []
    key = jax.random.PRNGKey(0)
    for fmt in args.fmts.split(","):
        weight_only = fmt.startswith("w:")
        fmt_b = fmt[2:] if weight_only else fmt
        fmt_a = None if weight_only else fmt_b
        for (M, N, K) in shapes:
            key, k1, k2 = jax.random.split(key, 3)
            x = jax.random.normal(k1, (M, K), jnp.float32)
            w = jax.random.normal(k2, (N, K), jnp.float32)
            b = jbs.quantize(w, fmt_b, layout="blocked")
            a = x.astype(jnp.bfloat16) if weight_only else jbs.quantize(x, fmt_a, layout="blocked")
            xb, wb = x.astype(jnp.bfloat16), w.astype(jnp.bfloat16)
            del x, w
            r = dict(fmt=fmt, M=M, N=N, K=K)
            # "sm90": the fused kernel at every size; "auto": the default dispatch (large M
            # lowers to dequantize + XLA GEMM, see lowering/ffi.py)
            os.environ[_sm90.ENV_MAX_ROWS] = "0"
            sm90 = jax.jit(lambda a, b: jbs.gemm(a, b, out_dtype=jnp.bfloat16, backend="sm90"))
            try:
                y = np.asarray(sm90(a, b), np.float32)  # compiles now, with the variable set
            except Exception as e:  # noqa: BLE001
                y = e
            del os.environ[_sm90.ENV_MAX_ROWS]
            auto = jax.jit(lambda a, b: jbs.gemm(a, b, out_dtype=jnp.bfloat16))
            ref = jax.jit(lambda a, b: jbs.gemm(a, b, out_dtype=jnp.bfloat16, backend="reference"))
            dot = jax.jit(lambda a, b: jnp.dot(a, b.T, preferred_element_type=jnp.float32
                                               ).astype(jnp.bfloat16))
            try:
                if isinstance(y, Exception):
                    raise y
                yr = np.asarray(ref(a, b), np.float32)
                r["rel_err_vs_reference"] = float(np.linalg.norm(y - yr) / np.linalg.norm(yr))
                r["sm90_us"] = timeit(sm90, a, b)
                for t in filter(None, args.tiles.split(",")):  # the FFI reads it per call
                    os.environ["JAX_BLOCKSCALE_SM90_TILE_N"] = t
                    r[f"sm90_n{t}_us"] = timeit(sm90, a, b)
                    del os.environ["JAX_BLOCKSCALE_SM90_TILE_N"]
            except Exception as e:  # noqa: BLE001
                r["sm90_err"] = repr(e)[:300]
            r["auto_us"] = timeit(auto, a, b)
            r["deq_dot_us"] = timeit(ref, a, b)
            r["bf16_dot_us"] = timeit(dot, xb, wb)
            if not weight_only:  # JAX's own API, as in the anchor file (plain scales, batch 1)
                try:
                    pa, pb = jbs.to_plain(a), jbs.to_plain(b)
                    nn = jax.jit(lambda x, y, sx, sy: jax.nn.scaled_matmul(
                        x[None], y[None], sx[None], sy[None],
                        preferred_element_type=jnp.bfloat16)[0])
                    r["nn_scaled_us"] = timeit(nn, pa.data, pb.data, pa.scales, pb.scales)
                except Exception as e:  # noqa: BLE001
                    r["nn_scaled_err"] = repr(e)[:200]
            fl = 2.0 * M * N * K
            for k in ("sm90_us", "auto_us", "deq_dot_us", "bf16_dot_us", "nn_scaled_us"):
                if k in r:
                    r[k.replace("_us", "_tflops")] = fl / (r[k] * 1e-6) / 1e12
            for t in filter(None, args.tiles.split(",")):
                if f"sm90_n{t}_us" in r:
                    r[f"sm90_n{t}_tflops"] = fl / (r[f"sm90_n{t}_us"] * 1e-6) / 1e12
            rows.append(r)
            print(json.dumps(r), flush=True)
            if args.json:  # keep what was measured even if the run is cut short
                with open(args.json, "w") as f:
                    json.dump(rows, f, indent=1)
            del a, b, xb, wb
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    print("\nfmt          M     N     K | sm90 us (TF)     | auto us (TF)     | deq+dot us (TF)  | bf16 dot us (TF) | nn.scaled_mm (TF) | err")
    for r in rows:
        f = lambda k: ("%9.1f (%5.0f)" % (r[k + "_us"], r[k + "_tflops"])) if k + "_us" in r else "      err       "  # noqa: E731
        print("%-10s %5d %5d %5d | %s | %s | %s | %s | %s | %s" % (
            r["fmt"], r["M"], r["N"], r["K"], f("sm90"), f("auto"), f("deq_dot"), f("bf16_dot"),
            f("nn_scaled"),
            "%.1e" % r["rel_err_vs_reference"] if "rel_err_vs_reference" in r else "-"))


if __name__ == "__main__":
    main()
