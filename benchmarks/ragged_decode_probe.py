"""`jbs.ragged_gemm` at decode sizes on the sm90 grouped decode kernel: the whole call's device
time, its share of the copy bandwidth on the hit experts' bytes (the GPU's copy bandwidth
measured in the same run, `e2e_decode.copy_bandwidth_TBps`), and the call's kernels by time
(the kernel itself, and the small XLA kernels that build a work table where the kernel does not
make its items from the raw sizes). `--sweep` also forces every item height (nt) and split count
the kernel has, to check the catalogue's choice; `--table` also runs each plan with the work
table built by XLA (what an expert-parallel shard runs) instead of the kernel's sizes mode;
`--per-cta 1,2,4` also forces those tiles of N per CTA.

    python benchmarks/ragged_decode_probe.py --out /tmp/probe            # the planner's plans
    python benchmarks/ragged_decode_probe.py --sweep --out /tmp/probe    # every nt x splits
    python benchmarks/ragged_decode_probe.py --table --out /tmp/probe    # sizes mode vs table
    python benchmarks/ragged_decode_probe.py --per-cta 1,2,3 --out /tmp/probe  # tiles per CTA
    python benchmarks/ragged_decode_probe.py --sweep --nts 2 --splits 1 --out /tmp/probe
        # 16-row items, one split, beside the plan (JAX_BLOCKSCALE_SM90_RAGGED_KERNEL=decode
        # keeps the planner off the register-weight kernel where it would take over)
    ncu -k regex:kernel_grouped --launch-skip 2 --launch-count 1 --set full -o /tmp/r \
        python benchmarks/ragged_decode_probe.py --no-timing --cases gpt-oss-120b:gate_up:256
        # only the calls, for a profiler that holds the GPU's profiling interface itself

Needs an sm90 GPU and the library. Shapes: benchmarks/bench_moe.py's models (mxfp4; --cases),
its routing and weight rotation. Writes <out>.json.
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import itertools
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_moe as bm  # noqa: E402
import jax_blockscale as jbs  # noqa: E402
from jax_blockscale.catalog import sm90 as cat  # noqa: E402
from jax_blockscale.lowering import plan, ragged_sm90  # noqa: E402
from e2e_decode import copy_bandwidth_TBps  # noqa: E402
from timing import device_time_us, gpu_kernel_events  # noqa: E402

CASES = (("qwen3-30b-a3b", "gate_up", 1), ("qwen3-30b-a3b", "gate_up", 16),
         ("gpt-oss-20b", "gate_up", 16), ("qwen3-30b-a3b", "gate_up", 64))


def forced(nt, splits):
    """choose_ragged_decode_variant with the item height and split count forced."""
    choose = cat.choose_ragged_decode_variant

    def pick(m, n, k, groups, *args, **kw):
        v, _, _ = choose(m, n, k, groups, *args, **kw)
        return dataclasses.replace(v, nt=nt), splits, cat.ragged_decode_items(m, groups, nt)
    return pick


def replanned(planner, **fields):
    """plan_ragged_sm90 with `fields` of its plan replaced (raw_sizes=False: the kernel reads
    XLA's work table instead of the raw sizes; tiles_per_cta=...)."""
    def pick(*args, **kw):
        p = planner(*args, **kw)
        return p if isinstance(p, str) else dataclasses.replace(p, **fields)
    return pick


def fresh_gemm():
    """The grouped GEMM jitted anew: each configuration patches the planner, which a jitted
    function traced before would not consult again."""
    return jax.jit(lambda x, q, gs: jbs.ragged_gemm(x, q, gs))


def measure(x, weights, gs, hit_bytes, copy_tbps):
    f = fresh_gemm()
    sets = [(x, q, gs) for q in weights]
    jax.block_until_ready(f(*sets[0]))
    us = device_time_us(f, arg_sets=sets)
    per = collections.defaultdict(float)
    for name, s, e in gpu_kernel_events(f, arg_sets=sets, calls=4):
        per[name[:48]] += (e - s) / 4e3
    return dict(device_us=us, copy_bw_share=hit_bytes / us / 1e6 / copy_tbps,
                kernels_us=dict(sorted(per.items(), key=lambda kv: -kv[1])))


def run_calls(x, weights, gs, calls=4):
    """`calls` calls of the jitted grouped GEMM, untimed (--no-timing)."""
    f = fresh_gemm()
    for i in range(calls):
        out = f(x, weights[i % len(weights)], gs)
    jax.block_until_ready(out)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sweep", action="store_true", help="also every nt x splits")
    p.add_argument("--cases", help="model:gemm:tokens,... (default: "
                   + ",".join(":".join(map(str, c)) for c in CASES) + ")")
    p.add_argument("--nts", help="with --sweep: only these item heights (comma-separated nt)")
    p.add_argument("--splits", default="1,2,4",
                   help="with --sweep: these split counts (comma-separated)")
    p.add_argument("--table", action="store_true",
                   help="also each configuration with XLA's work table (no sizes mode)")
    p.add_argument("--per-cta", help="also these tiles of N per CTA (comma-separated)")
    p.add_argument("--out", default="ragged_decode_probe", help="output path prefix (.json)")
    p.add_argument("--no-timing", action="store_true",
                   help="only run each configuration's calls, untimed (under ncu or nsys, which "
                        "hold the profiling interface JAX's profiler times with)")
    args = p.parse_args()
    rows = []
    choose = cat.choose_ragged_decode_variant
    device = plan.device_for("cuda")
    sm_count = device.sm_count
    copy_tbps = None
    if not args.no_timing:
        copy_tbps = copy_bandwidth_TBps(True, {})  # this GPU's, measured here: the share's base
        print(f"{jax.devices()[0].device_kind}: copy bandwidth {copy_tbps:.2f} TB/s")
    cases = CASES if not args.cases else [
        (c.split(":")[0], c.split(":")[1], int(c.split(":")[2])) for c in args.cases.split(",")]
    nts = [int(x) for x in args.nts.split(",")] if args.nts else cat.DECODE_NTS
    split_counts = [int(x) for x in args.splits.split(",")]
    for model, gemm, tokens in cases:
        g, n, k = bm.gemm_shape(model, gemm)
        top_k = bm.MODELS[model]["top_k"]
        key = jax.random.PRNGKey(0)
        q = bm.quantize(bm.normal(key, (g, n, k), jnp.float32) / np.sqrt(k), "mxfp4",
                        layout="blocked")
        weights = bm.copies(q, bm.rotation_count(bm.quantized_bytes("mxfp4", g * n, k)))
        m = tokens * top_k
        gs = bm.routing(jax.random.fold_in(key, tokens), tokens, g, top_k)
        x = bm.normal(jax.random.fold_in(key, 7), (m, k), jnp.bfloat16)
        hit_bytes = int(jnp.sum(gs > 0)) * bm.quantized_bytes("mxfp4", n, k)
        v, splits, _ = choose(m, n, k, g, None, "mxfp4", sm_count, "bf16", card=device.card)
        configs = [(v.nt, splits, True)]
        if args.sweep:
            configs += [(nt, s, False) for nt in nts for s in split_counts
                        if (nt, s) != (v.nt, splits)]
        planner = ragged_sm90.plan_ragged_sm90
        per_ctas = [None] + ([int(x) for x in args.per_cta.split(",")] if args.per_cta else [])
        for (nt, s, planned), work, per_cta in itertools.product(
                configs, ("sizes", "table") if args.table else ("sizes",), per_ctas):
            row = dict(model=model, gemm=gemm, tokens=tokens, nt=nt, splits=s, planned=planned,
                       work=work, hit_bytes=hit_bytes)
            cat.choose_ragged_decode_variant = forced(nt, s)
            fields = {} if work == "sizes" else dict(raw_sizes=False)
            if per_cta is not None:
                fields["tiles_per_cta"] = row["tiles_per_cta"] = per_cta
                row["planned"] = False
            else:
                row["tiles_per_cta"] = cat.ragged_decode_tiles_per_cta(
                    m, n, k, g, "mxfp4", nt, s, sm_count, card=device.card)
            if fields:
                ragged_sm90.plan_ragged_sm90 = replanned(planner, **fields)
            try:
                if args.no_timing:
                    run_calls(x, weights, gs)
                else:
                    row.update(measure(x, weights, gs, hit_bytes, copy_tbps))
            except Exception as e:  # noqa: BLE001  (a split count the problem cannot take)
                row["err"] = bm.short_error(e)
            finally:
                cat.choose_ragged_decode_variant = choose
                ragged_sm90.plan_ragged_sm90 = planner
            rows.append(row)
            top = "  ".join(f"{kn}: {t:.1f}" for kn, t in
                            list(row.get("kernels_us", {}).items())[:5])
            plan_mark = " (plan)" if row["planned"] else ""
            print(f"{model:<14}{gemm:<8}{tokens:>4}  nt={nt} splits={s} "
                  f"per_cta={row['tiles_per_cta']} {work:<5}{plan_mark:<7}"
                  + (f"{row['device_us']:8.1f} us {row['copy_bw_share']:6.1%}  {top}"
                     if "device_us" in row else f"  error: {row['err']}" if "err" in row
                     else "  ran (untimed)"), flush=True)
    out = os.path.splitext(args.out)[0] + ".json"
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out, "w") as f:
        json.dump(dict(device=jax.devices()[0].device_kind, jax=jax.__version__,
                       copy_TBps=copy_tbps, rows=rows), f, indent=1)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
