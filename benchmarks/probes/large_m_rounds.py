"""Paired timing at large M: bf16 `jnp.dot` against `jbs.gemm`, in alternating rounds (GPU only).

At 8192^3 an H100 runs a 1.1 PFLOP GEMM at a clock that drifts with temperature and power: the
same bf16 dot timed 1458-1711 us of device time in one session's runs, more than the differences
being measured. Here every round times each method once, back to back (device time, profiler),
and the speedup is the median over rounds of the ratio within a round, so a drift between rounds
cancels.

    python benchmarks/probes/large_m_rounds.py --rounds 5 --json out.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import jax_blockscale as jbs  # noqa: E402
from bench_gemm import dot_bf16  # noqa: E402  (the anchor)
from sweep import format_token, quantize  # noqa: E402
from timing import copies, device_time_us, rotation_count, time_us  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="8192x8192x8192")
    ap.add_argument("--formats", default="nvfp4,nvfp4/none,mxfp4,mxfp8_e4m3",
                    help="nvfp4/none: NVFP4 without the global scale")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    m, n, k = (int(v) for v in args.shape.split("x"))
    kx, kw = jax.random.split(jax.random.key(1))
    x = jax.random.normal(kx, (m, k), jnp.float32)
    w = jax.random.normal(kw, (n, k), jnp.float32)
    xb, wb = x.astype(jnp.bfloat16), w.astype(jnp.bfloat16)
    methods = {"bf16_dot": (dot_bf16, [(xb, w_) for w_ in copies(wb, rotation_count(2 * n * k))])}
    gemm = jax.jit(jbs.gemm)
    for token in args.formats.split(","):
        fmt, kw_ = format_token(token)
        a_q = quantize(x, fmt, **kw_)
        b_qs = copies(quantize(w, fmt, layout="blocked", **kw_), rotation_count(n * k // 2))
        methods[token + " gemm"] = (gemm, [(a_q, b) for b in b_qs])
        methods[token + " w-only"] = (gemm, [(xb, b) for b in b_qs])
    times = {name: [] for name in methods}
    for r in range(args.rounds):
        for name, (f, sets) in methods.items():
            t = device_time_us(f, arg_sets=sets)  # None without a GPU: loop time (smoke run)
            times[name].append(t if t is not None else time_us(f, arg_sets=sets, trials=1))
        print(f"round {r}: " + ", ".join(f"{k_} {v[-1]:.0f}" for k_, v in times.items()),
              flush=True)
    dot = times["bf16_dot"]
    rows = []
    print(f"\n{args.shape}, device us (median of {args.rounds} rounds), speedup vs bf16 dot "
          "(median of per-round ratios, min-max)")
    for name, ts in times.items():
        ratios = [d / t for d, t in zip(dot, ts)]
        rows.append(dict(method=name, us=statistics.median(ts), all_us=ts,
                         vs_bf16_dot=statistics.median(ratios), ratios=ratios))
        print(f"  {name:22s} {statistics.median(ts):8.1f} us  {statistics.median(ratios):.3f}x "
              f"({min(ratios):.3f}-{max(ratios):.3f})")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(dict(device=jax.devices()[0].device_kind, jax=jax.__version__,
                           shape=args.shape, rows=rows), fh, indent=1)


if __name__ == "__main__":
    main()
