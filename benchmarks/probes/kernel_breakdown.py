"""Which GPU kernels one jitted `jbs.gemm` call runs, and how long each takes (profiler trace).

    python benchmarks/probes/kernel_breakdown.py --shapes 1x16384x16384,16x16384x16384 \
        [--formats nvfp4,mxfp4] [--calls 20] [--json OUT.json]      # on the GPU, repo root

Weight-only calls (bf16 activations, blocked weights; with --quantized-activations the
activation is quantized like the weights, plain scales, as the sweep's W4A4 / W8A8 calls), rotated through weight copies as in the
sweep (benchmarks/timing.py). For each case it prints every kernel name with its mean duration per
call, the union of the kernel intervals per call (the sweep's "device time") and the GPU's idle
time per call between the first kernel's start and the last one's end (launch gaps: inside a call,
e.g. the decode kernel's main -> finalize, and between back-to-back calls). It answers "what does
the finalize kernel cost" without a harness build.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
import jax_blockscale as jbs  # noqa: E402
from timing import copies, gpu_kernel_events, rotation_count, union_length  # noqa: E402


def breakdown(fmt, m, n, k, calls, quantized_activations=False):
    kx, kw = jax.random.split(jax.random.PRNGKey(m * 7 + n))
    x = jax.random.normal(kx, (m, k), jnp.float32)
    x = jbs.quantize(x, fmt) if quantized_activations else x.astype(jnp.bfloat16)
    w = jbs.quantize(jax.random.normal(kw, (n, k), jnp.float32), fmt, layout="blocked")
    ws = copies(w, rotation_count(n * k))  # ~1 byte per weight or less: 3x L2 of copies
    f = jax.jit(jbs.gemm)
    ev = gpu_kernel_events(f, arg_sets=[(x, w_) for w_ in ws], calls=calls)
    if not ev:
        raise SystemExit("no GPU kernels in the trace (run it on a GPU)")
    per_name = collections.defaultdict(list)
    for name, s, e in ev:
        per_name[name].append((e - s) / 1e3)
    union = union_length([(s, e) for _, s, e in ev]) / calls / 1e3
    span = (max(e for *_, e in ev) - min(s for _, s, _ in ev)) / calls / 1e3
    kernels = {name: dict(per_call=len(d) / calls, mean_us=sum(d) / len(d))
               for name, d in per_name.items()}
    return dict(fmt=fmt, M=m, N=n, K=k, quantized_activations=quantized_activations, calls=calls,
                device_us=union, idle_us=span - union, kernels=kernels)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default="1x16384x16384,16x16384x16384")
    p.add_argument("--formats", default="nvfp4")
    p.add_argument("--calls", type=int, default=20)
    p.add_argument("--json", default=None)
    p.add_argument("--quantized-activations", action="store_true",
                   help="quantize the activation like the weights (W4A4 / W8A8 calls)")
    args = p.parse_args()
    rows = []
    for fmt in args.formats.split(","):
        for shape in args.shapes.split(","):
            m, n, k = (int(v) for v in shape.split("x"))
            r = breakdown(fmt, m, n, k, args.calls, args.quantized_activations)
            rows.append(r)
            print(f"{'' if args.quantized_activations else 'w:'}{fmt} M={m} N={n} K={k}: device {r['device_us']:.2f} us/call, "
                  f"GPU idle between kernels {r['idle_us']:.2f} us/call")
            for name, d in sorted(r["kernels"].items(), key=lambda kv: -kv[1]["mean_us"]):
                print(f"    {d['mean_us']:8.2f} us  x{d['per_call']:.2f}/call  {name[:100]}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(jax=jax.__version__, device=jax.devices()[0].device_kind, rows=rows),
                      f, indent=1)


if __name__ == "__main__":
    main()
