"""Our grouped MXFP4 GEMMs beside OpenAI's triton_kernels (`matmul_ogs`, the MXFP4 MoE kernel vLLM
and SGLang run gpt-oss with on Hopper), in one run on one GPU: the expert GEMMs (gate+up, and with
--gemms the down projection) of Qwen3-30B-A3B, gpt-oss-20b and gpt-oss-120b (and with --models the
other shapes of bench_moe.MODELS) at 1, 16, 256 and 4096 tokens, each token routed to top_k
distinct random experts by the peer script's own `routing` (the same draw on both sides).

    python benchmarks/bench_moe_peers.py --out benchmarks/results --tag bench_moe_peers_h200
    python benchmarks/bench_moe_peers.py --peer-dir /path/to/anchors --gemms gate_up,down ...

Ours: `jbs.ragged_gemm` on the rows already sorted by expert (bf16 activations, MXFP4 weights in
the blocked scale layout), device time from the profiler (benchmarks/timing.py), weights rotated
through copies past L2; beside the call's time, our grouped kernel's own ("ours kernel": without
the small XLA kernels around it, of which the register-weight kernel's K-order pass over the
activation is the large one at prefill sizes). The peer runs as child processes with torch and
triton (the lent GPU machines have both), from --peer-dir (default ../shared/anchors beside the
repository: the project's anchors, with the vendored triton_kernels/ beside them):
`peer_triton_kernels.py`, the anchor, for the gate+up rows of its three models (it gathers the rows
in the kernel and times with torch's profiler; its dense rows are kept in the JSON as it wrote
them), and `peer_moe_gemms.py` (this folder) for the rest: down projections (rows already grouped
by expert, as ours) and other models' shapes. Prints a table with the time ratio triton_kernels /
ours (above 1: ours is faster); writes <tag>.json and <tag>.png. Needs a GPU; without torch or the
peer folder it stops with a message naming what is missing.

The bytes' floor: the same run measures the copy bandwidth (`e2e_decode.copy_bandwidth_TBps`,
sweep's copy probe), and each row gets `floor_us`, the hit experts' bytes at that bandwidth,
and `triton_over_floor`, triton_kernels' time over it: the most `triton_over_ours` any kernel
can reach that reads those bytes once at the copy bandwidth (where the GEMM is bound by its
bytes; at 4096 tokens the tensor cores bound it first).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_moe as bm  # noqa: E402
from e2e_decode import copy_bandwidth_TBps  # noqa: E402
from plotting import pyplot  # noqa: E402
from timing import NO_GPU_TRACE, events_time_us, gpu_kernel_events  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PEER_SCRIPT = "peer_triton_kernels.py"  # the anchor: gate+up of its MODELS
OTHER_PEER_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "peer_moe_gemms.py")
FMT = "mxfp4"  # the peer's weight format
EXPERTS_PER_CHUNK = 16  # experts quantized at a time (a large model's f32 draw stays small)
# Our grouped kernels' names in the trace (CuTeDSL's kernel_cutlass_*): their own time, beside the
# call's, leaves out the small XLA kernels around them (the work table; the K-order pass of the
# register-weight kernel's activation, which a model fuses into the op that makes its rows)
OUR_KERNEL_PREFIX = "kernel_cutlass"


def load_peer(peer_dir):
    """The peer script as a module (its shapes, tokens and routing; torch is imported only when
    it runs)."""
    path = os.path.join(peer_dir, PEER_SCRIPT)
    if not os.path.exists(path):
        raise SystemExit(f"bench_moe_peers.py: no {PEER_SCRIPT} in --peer-dir {peer_dir!r}")
    spec = importlib.util.spec_from_file_location("peer_triton_kernels", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def mxfp4_experts(key, e, n, k):
    """(E, N, K) random MXFP4 experts in the blocked scale layout, EXPERTS_PER_CHUNK at a time."""
    parts = [bm.quantize(bm.normal(jax.random.fold_in(key, e0),
                                   (min(EXPERTS_PER_CHUNK, e - e0), n, k), jnp.float32)
                         / np.sqrt(k), FMT, layout="blocked")
             for e0 in range(0, e, EXPERTS_PER_CHUNK)]
    return parts[0] if len(parts) == 1 else jax.tree.map(lambda *a: jnp.concatenate(a), *parts)


def call_and_kernel_us(events, calls):
    """(the call's device time, our grouped kernels' own) per call in us, from the (name, start
    ns, end ns) kernel events of `calls` calls: each the union of its kernels' intervals."""
    if not events:
        raise SystemExit(f"bench_moe_peers.py: {NO_GPU_TRACE}")
    return events_time_us(events, calls), events_time_us(events, calls, OUR_KERNEL_PREFIX)


def ours_rows(peer, cases, tokens, calls):
    """Our device time per (model, gemm, tokens) on the peer's routing draw: the call's
    (`ours_us`) and our grouped kernel's own (`ours_kernel_us`, OUR_KERNEL_PREFIX)."""
    rows = []
    gemm = bm.ours  # jitted jbs.ragged_gemm
    for model, which in cases:
        e, n, k = bm.gemm_shape(model, which)
        top_k = bm.MODELS[model]["top_k"]
        key = jax.random.PRNGKey(0)
        w = mxfp4_experts(key, e, n, k)
        sets = bm.copies(w, bm.rotation_count(bm.quantized_bytes(FMT, e * n, k)))
        for t in tokens:
            sel = peer.routing(t, e, top_k)
            gs = jnp.asarray(np.bincount(sel.reshape(-1), minlength=e), jnp.int32)
            x = bm.normal(jax.random.fold_in(key, t), (t * top_k, k), jnp.bfloat16)
            us, kernel_us = call_and_kernel_us(
                gpu_kernel_events(gemm, arg_sets=[(x, q, gs) for q in sets], calls=calls), calls)
            hit = int(np.count_nonzero(np.asarray(gs)))
            rows.append(dict(model=model, gemm=which, tokens=t, experts=e, n=n, k=k,
                             top_k=top_k, experts_hit=hit, ours_us=us, ours_kernel_us=kernel_us,
                             hit_bytes=hit * bm.quantized_bytes(FMT, n, k)))
            print(f"ours  {model:<16}{which:<8}{t:>6}  {us:9.1f} us (kernel {kernel_us:.1f})",
                  flush=True)
        del sets, w
    return rows


def anchor_cases(peer, cases):
    """The cases the anchor script times: gate+up of its own models, at its shapes."""
    return [(m, g) for m, g in cases if g == "gate_up" and m in peer.MODELS]


def other_cases(peer, cases, tokens):
    """peer_moe_gemms.py's cases: the rest, at bench_moe's shapes."""
    out, anchored = [], anchor_cases(peer, cases)
    for model, which in cases:
        if (model, which) not in anchored:
            e, n, k = bm.gemm_shape(model, which)
            out.append(dict(model=model, gemm=which, experts=e, n=n, k=k,
                            top_k=bm.MODELS[model]["top_k"], tokens=list(tokens)))
    return out


def run_child(argv, peer_dir, what):
    """Run a peer script with the peer folder on PYTHONPATH; stop with its output on failure."""
    env = dict(os.environ, PYTHONPATH=peer_dir)
    done = subprocess.run([sys.executable, *argv], cwd=peer_dir, env=env, capture_output=True,
                          text=True)
    if done.returncode != 0:
        raise SystemExit(f"{what} failed (rc {done.returncode}):\n"
                         f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}")


def other_peer_rows(peer_dir, cases):
    """peer_moe_gemms.py's rows for `cases` (other_cases), in a child process."""
    with tempfile.TemporaryDirectory() as tmp:
        with open(os.path.join(tmp, "cases.json"), "w") as f:
            json.dump(cases, f)
        out = os.path.join(tmp, "rows.json")
        run_child([OTHER_PEER_SCRIPT, "--cases", os.path.join(tmp, "cases.json"), "--out", out],
                  peer_dir, "peer_moe_gemms.py")
        with open(out) as f:
            return json.load(f)


def peer_rows(peer_dir):
    """Run the anchor in a child process (torch beside JAX's process would share the GPU with
    two allocators); its rows."""
    with tempfile.TemporaryDirectory() as tmp:
        run_child([PEER_SCRIPT, "--out", tmp], peer_dir, PEER_SCRIPT)
        with open(os.path.join(tmp, "peers_tk_torch.json")) as f:
            return json.load(f)


def merge(ours, peer, copy_tbps):
    """Our rows with the peer's time, the ratio peer / ours and the bytes' floor beside them
    (peer rows without a gemm are the anchor's gate+up)."""
    tk = {(r["model"], r.get("gemm", "gate_up"), r["tokens"]): r for r in peer["rows"]
          if r.get("part") == "moe"}
    for r in ours:
        r["floor_us"] = r["hit_bytes"] / copy_tbps / 1e6
        p = tk.get((r["model"], r.get("gemm", "gate_up"), r["tokens"]), {})
        if "device_us" in p:
            r["triton_kernels_us"] = p["device_us"]
            r["triton_over_ours"] = p["device_us"] / r["ours_us"]
            r["triton_over_floor"] = p["device_us"] / r["floor_us"]
            if p.get("experts_hit") is not None:
                r["triton_experts_hit"] = p["experts_hit"]
        elif "error" in p:
            r["triton_kernels_error"] = p["error"]
    return ours


def plot(rows, device, path):
    plt = pyplot()
    if plt is None:
        return
    series = list(dict.fromkeys((r["model"], r.get("gemm", "gate_up")) for r in rows))
    tokens = sorted({r["tokens"] for r in rows})
    fig, ax = plt.subplots(figsize=(max(9.5, 1.2 * len(series) + 6), 3.8))
    width = 0.8 / len(series)
    floors = []
    for i, (model, which) in enumerate(series):
        mine = {r["tokens"]: r for r in rows if (r["model"], r.get("gemm", "gate_up"))
                == (model, which) and r.get("triton_over_ours")}
        xs = [j + i * width for j, t in enumerate(tokens) if t in mine]
        ax.bar(xs, [mine[t]["triton_over_ours"] for t in tokens if t in mine], width,
               label=f"{model} {which.replace('_', '+')}",
               color=plt.get_cmap("tab20")(i % 20))
        floors.append((xs, [mine[t]["triton_over_floor"] for t in tokens if t in mine]))
    # the bytes' floor of each row; past the top (compute-bound rows) a triangle at the top
    top = max(2.0, 1.25 * max([r["triton_over_ours"] for r in rows
                               if r.get("triton_over_ours")] or [1.0]))
    for i, (xs, ys) in enumerate(floors):
        ax.scatter(xs, [min(y, top) for y in ys], marker="_", s=150, color="k",
                   label="at the bytes' floor (triangle: above the scale)" if i == 0 else None)
        off = [(x, top) for x, y in zip(xs, ys) if y > top]
        if off:
            ax.scatter(*zip(*off), marker="^", s=25, color="k")
    ax.set_ylim(0, top * 1.04)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.axhline(1.15, color="tab:red", lw=0.8, ls="--", label="issue 49 target (1.15)")
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(tokens))],
                  [f"{t} tokens" for t in tokens])
    ax.set_ylabel("triton_kernels time / ours")
    ax.set_title(f"MXFP4 MoE expert GEMMs, {device}: above 1 ours is faster", fontsize=10)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--peer-dir", default=os.path.join(ROOT, "..", "shared", "anchors"),
                   help="the folder of peer_triton_kernels.py and triton_kernels/")
    p.add_argument("--models", help=f"comma-separated, from {sorted(bm.MODELS)} (default: "
                   "the anchor's three)")
    p.add_argument("--gemms", default="gate_up", help=f"comma-separated, from {bm.GEMMS}")
    p.add_argument("--calls", type=int, default=8, help="profiled calls per row")
    p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    p.add_argument("--tag", default=None, help="file name stem (default bench_moe_peers_<gpu>)")
    args = p.parse_args()
    peer_dir = os.path.abspath(args.peer_dir)
    peer = load_peer(peer_dir)
    models = args.models.split(",") if args.models else list(peer.MODELS)
    for m in models:
        if m not in bm.MODELS:
            p.error(f"unknown model {m!r}; choose from {sorted(bm.MODELS)}")
    gemms = args.gemms.split(",")
    for g in gemms:
        if g not in bm.GEMMS:
            p.error(f"unknown gemm {g!r}; choose from {bm.GEMMS}")
    if jax.devices()[0].platform != "gpu":
        raise SystemExit("bench_moe_peers.py needs a GPU (the peer runs on CUDA)")
    cases = [(m, g) for m in models for g in gemms]
    device = jax.devices()[0].device_kind
    copy_tbps = copy_bandwidth_TBps(True, {})
    rows = ours_rows(peer, cases, peer.TOKENS, args.calls)
    peer_out = (peer_rows(peer_dir) if anchor_cases(peer, cases)
                else dict(rows=[], device=None, torch=None, triton=None))
    others = other_cases(peer, cases, peer.TOKENS)
    if others:
        other = other_peer_rows(peer_dir, others)
        for key in ("device", "torch", "triton"):  # when the anchor did not run
            peer_out[key] = peer_out.get(key) or other.get(key)
        peer_out["rows"] = peer_out["rows"] + other["rows"]
    rows = merge(rows, peer_out, copy_tbps)
    print(f"\n{device}; MXFP4 expert GEMMs, bf16 activations; device time (us); copy bandwidth "
          f"{copy_tbps:.2f} TB/s; floor: the hit experts' bytes at it")
    print(f"{'model':<17}{'gemm':<9}{'tokens':>7}{'ours':>10}{'ours kernel':>13}"
          f"{'triton_kernels':>16}{'tk / ours':>11}{'floor':>9}{'tk / floor':>12}")
    for r in rows:
        tk = r.get("triton_kernels_us")
        print(f"{r['model']:<17}{r['gemm']:<9}{r['tokens']:>7}{r['ours_us']:>10.1f}"
              f"{r['ours_kernel_us']:>13.1f}"
              + (f"{tk:>16.1f}{r['triton_over_ours']:>11.2f}{r['floor_us']:>9.1f}"
                 f"{r['triton_over_floor']:>12.2f}" if tk is not None else
                 f"  {r.get('triton_kernels_error', 'no peer row')}"))
    os.makedirs(args.out, exist_ok=True)
    card = next((c for c in ("H200", "H100") if c in device), "gpu").lower()
    stem = os.path.join(args.out, args.tag or f"bench_moe_peers_{card}")
    meta = dict(device=device, jax=jax.__version__, copy_TBps=copy_tbps,
                peer_device=peer_out.get("device"),
                torch=peer_out.get("torch"), triton=peer_out.get("triton"),
                method="ours: jbs.ragged_gemm on sorted rows, device time (benchmarks/timing.py;"
                " ours_kernel_us: our grouped kernel's own, without the XLA kernels around it);"
                " triton_kernels: matmul_ogs (gate+up: rows gathered in the kernel, by "
                "peer_triton_kernels.py for its models and peer_moe_gemms.py for others; "
                "down: rows grouped by expert, peer_moe_gemms.py), torch profiler kernel time; "
                "the same routing draw")
    with open(stem + ".json", "w") as f:
        json.dump(dict(meta, rows=rows, peer_dense=[r for r in peer_out["rows"]
                                                     if r.get("part") == "dense"]), f, indent=1)
    print(f"wrote {stem}.json")
    plot(rows, device, stem + ".png")


if __name__ == "__main__":
    main()
