"""Scanned against unrolled layers: a stack of weight-only linear layers (y = x @ W_l^T, then a
cheap nonlinearity) run by `lax.scan` over the stacked weights, or unrolled over per-layer
weights, per format; device time from the profiler (benchmarks/timing.py).

    python benchmarks/scan_layers.py --out /tmp/scan                  # GPU
    python benchmarks/scan_layers.py --tiny                           # CPU smoke run

Modes: "unrolled" (one weight per layer), "scan" (the stacked weight is the scan's xs) and, for
block-scaled formats, "scan_in_place" (the stack stays whole, the layer index is carried as a
counter and each step calls ``jbs.gemm(x, stack, layer=i)``, which runs the layer where it lies
on gemm's own plan) and "scan_in_place_arange" (the same with the index scanned out of an
arange: XLA copies the layer's probe and index mode runs). The per-kernel breakdown
(--kernels) shows where the time goes (a copy of each layer's weight slice, for bf16 and FP4:
docs/design/scanned_layers.md).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import timing  # noqa: E402

import jax_blockscale as jbs  # noqa: E402


def stacked(fmt, layers, n, k, seed=0):
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((layers, n, k), np.float32) * 0.02
    if fmt == "bf16":
        return jnp.asarray(w, jnp.bfloat16)
    gs = "per_matrix" if fmt == "nvfp4" else "auto"
    return jbs.quantize(jnp.asarray(w), fmt, layout="blocked", **(
        dict(global_scale=gs) if fmt == "nvfp4" else {}))


def layer(x, w):
    y = x @ w.T if not isinstance(w, jbs.BlockScaled) else jbs.gemm(x, w)
    return jnp.tanh(y.astype(jnp.float32)).astype(jnp.bfloat16)


def run_unrolled(x, ws):
    for w in ws:
        x = layer(x, w)
    return x


def run_scan(x, w):
    return jax.lax.scan(lambda x, w: (layer(x, w), None), x, w)[0]


def _in_place_layer(x, w, i):
    y = jbs.gemm(x, w, layer=i)
    return jnp.tanh(y.astype(jnp.float32)).astype(jnp.bfloat16)


def run_scan_in_place(x, w):
    """The stack stays whole; each step runs its layer with gemm(..., layer=i), the index
    carried as a counter (what XLA slices in place)."""
    def step(carry, _):
        x, i = carry
        return (_in_place_layer(x, w, i), i + 1), None

    return jax.lax.scan(step, (x, jnp.int32(0)), None, length=w.shape[0])[0][0]


def run_scan_in_place_arange(x, w):
    """As run_scan_in_place with the index scanned out of an arange."""
    return jax.lax.scan(lambda x, i: (_in_place_layer(x, w, i), None), x,
                        jnp.arange(w.shape[0]))[0]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--formats", default="bf16,nvfp4,mxfp4,mxfp8_e4m3")
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--n", type=int, default=4096)
    ap.add_argument("--k", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--tiny", action="store_true", help="small CPU smoke run")
    ap.add_argument("--kernels", action="store_true", help="print each mode's GPU kernels")
    ap.add_argument("--hlo", default=None, help="write each mode's optimized HLO into this folder")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.tiny:
        args.layers, args.n, args.k = 3, 128, 128
    if args.n != args.k:
        ap.error("--n and --k must be equal (each layer feeds the next)")
    gpu = jax.default_backend() == "gpu"
    rows = []
    x = jnp.asarray(np.random.default_rng(1).standard_normal((args.batch, args.k)), jnp.bfloat16)
    for fmt in args.formats.split(","):
        w = stacked(fmt, args.layers, args.n, args.k)
        per_layer = [jax.tree.map(lambda a, i=i: a[i], w) for i in range(args.layers)]
        modes = {"unrolled": (jax.jit(run_unrolled), (x, per_layer)),
                 "scan": (jax.jit(run_scan), (x, w))}
        if fmt != "bf16":
            modes["scan_in_place"] = (jax.jit(run_scan_in_place), (x, w))
            modes["scan_in_place_arange"] = (jax.jit(run_scan_in_place_arange), (x, w))
        want = np.asarray(modes["unrolled"][0](*modes["unrolled"][1]), np.float32)
        for mode, (f, a) in modes.items():
            if args.hlo:
                os.makedirs(args.hlo, exist_ok=True)
                with open(os.path.join(args.hlo, f"{fmt}_{mode}.txt"), "w") as fh:
                    fh.write(f.lower(*a).compile().as_text())
            got = np.asarray(f(*a), np.float32)
            err = float(np.abs(got - want).max())
            us = timing.device_time_us(f, *a) if gpu else timing.time_us(f, *a, iters=3, trials=2)
            row = dict(fmt=fmt, mode=mode, layers=args.layers, n=args.n, k=args.k,
                       batch=args.batch, us=us, max_abs_diff_vs_unrolled=err)
            if args.kernels and gpu:
                per = {}
                for name, t0, t1 in timing.gpu_kernel_events(f, *a, calls=8):
                    per[name] = per.get(name, 0.0) + (t1 - t0) / 8e3
                row["kernels"] = dict(sorted(per.items(), key=lambda kv: -kv[1])[:12])
                print(json.dumps(dict(fmt=fmt, mode=mode, kernels_us=row["kernels"])), flush=True)
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "kernels"}), flush=True)
    base = {(r["fmt"]): r["us"] for r in rows if r["mode"] == "unrolled"}
    print("\n| format | mode | us | vs unrolled | max |diff| |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['fmt']} | {r['mode']} | {r['us']:.1f} | {r['us'] / base[r['fmt']]:.3f} | "
              f"{r['max_abs_diff_vs_unrolled']:.2e} |")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "scan_layers.json"), "w") as f:
            json.dump(dict(device=str(jax.devices()[0]), rows=rows), f, indent=1, default=str)
    return rows


if __name__ == "__main__":
    main()
