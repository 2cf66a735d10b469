"""Hopper (sm90) paths side by side: each way the sm90 backend can run one `jbs.gemm` call, forced
at the same shape, against bf16 `jnp.dot` (GPU; on a CPU it runs as a smoke test, the forced sm90
paths then record why they cannot run).

    python benchmarks/bench_sm90.py --shapes 16x16384x16384,128x16384x16384 \\
        --formats w:nvfp4,nvfp4 --paths default,decode,registers,smem --rounds 3 \\
        [--kernels] [--json OUT.json] [--png OUT.png]

Paths (each compiled with the planner's environment variables set, docs/backends.md):

  default      what `jbs.gemm` runs (the planner's choice for this shape)
  kernels      the sm90 kernels at every M (JAX_BLOCKSCALE_SM90_MAX_ROWS=0): no dequantize + GEMM
  decode       the split-K decode kernel (register weights off; it takes M <= 64)
  registers    the fused kernel with the weights in wgmma's registers (decode kernel off)
  smem         the fused kernel with the weights dequantized into shared memory (decode kernel
               and register weights off)
  two_operand  a quantized activation kept quantized: the two-operand decode / fused kernels
               (JAX_BLOCKSCALE_SM90_DEQUANT_A=0); else the activation is dequantized first
  dequant_dot  dequantize, then a library GEMM (cuBLASLt with alpha in its epilogue where an
               alpha must scale the f32 sum, else XLA's), for M > 1
  xla_dot      dequantize, then XLA's GEMM and an f32 scaling pass (JAX_BLOCKSCALE_SM90_DOT_ALPHA=0)

Formats: "w:<fmt>" is weight-only (bf16 activation), "<fmt>" quantizes the activation like the
weight; "nvfp4/none" quantizes NVFP4 without the global scale (alpha = 1), as in sweep.py.

Timing (benchmarks/timing.py): device time from a profiler trace (the GPU's kernel time per call,
no host cost), in paired rounds: each round times bf16 `jnp.dot` and every path once, and the
result is the median per path over the rounds, so a clock drift during the run affects all paths
alike (an H100 running a large GEMM moves its clock by several %). Weights rotate through copies
(about 3x L2) as in sweep.py. Without a GPU in the trace the Python-loop time is used instead.
Every path's output is compared with the reference backend (relative Frobenius error, bf16 output).
`--kernels` lists each path's GPU kernels with their mean duration per call. Where `kernels` and
`dequant_dot` both ran at several M of one weight shape, the run ends with each shape's
crossover (the faster path at each M, and with `default` the planner's kernel there), also in the
JSON: the measurement behind the catalogue's row limits, to check a card's rule against, e.g.

    python benchmarks/bench_sm90.py --shapes 1024x16384x16384,1536x16384x16384,2048x16384x16384 \
        --formats w:nvfp4,w:mxfp8_e4m3,nvfp4 --paths default,kernels,dequant_dot
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np

import jax_blockscale as jbs
from jax_blockscale import config
from jax_blockscale.lowering.plan import plan

from bench_gemm import dot_bf16, lowering_platform, short_error, spec_of
from sweep import format_token
from plotting import pyplot
from timing import copies, device_time_us, gpu_kernel_events, rotation_count, time_us

_KERNELS = {"JAX_BLOCKSCALE_SM90_MAX_ROWS": "0"}
_NO_DECODE = {**_KERNELS, "JAX_BLOCKSCALE_SM90_DECODE_MAX_ROWS": "0"}
PATHS = {  # path -> (backend forced, environment while it is planned and compiled)
    "default": (None, {}),
    "kernels": ("sm90", _KERNELS),
    "decode": ("sm90", {**_KERNELS, "JAX_BLOCKSCALE_SM90_REGISTER_WEIGHTS": "0"}),
    "registers": ("sm90", {**_NO_DECODE, "JAX_BLOCKSCALE_SM90_REGISTER_WEIGHTS": "1"}),
    "smem": ("sm90", {**_NO_DECODE, "JAX_BLOCKSCALE_SM90_REGISTER_WEIGHTS": "0"}),
    "two_operand": ("sm90", {**_KERNELS, "JAX_BLOCKSCALE_SM90_DEQUANT_A": "0"}),
    "dequant_dot": ("sm90", {"JAX_BLOCKSCALE_SM90_MAX_ROWS": "1"}),
    "xla_dot": ("sm90", {"JAX_BLOCKSCALE_SM90_MAX_ROWS": "1", "JAX_BLOCKSCALE_SM90_DOT_ALPHA": "0"}),
}


def compile_path(name, a, b, platform):
    """(jitted call, "backend/kernel" the planner chose) for one path, or (None, error)."""
    backend, env = PATHS[name]
    with mock.patch.dict(os.environ, env):
        config.reload()  # the planner reads the environment once; already-compiled calls keep theirs
        try:
            p = plan(spec_of(a, b), platform, requested=backend)
            # compiled here, inside the environment (the plan is made while lowering/compiling)
            f = jax.jit(lambda a, b: jbs.gemm(a, b, out_dtype=jnp.bfloat16, backend=backend)
                        ).lower(a, b).compile()
            chosen = f"{p.backend}/{p.kernel}" + (f" {p.variant}" if p.variant else "")
        except Exception as e:  # noqa: BLE001  (the row says why)
            f, chosen = None, short_error(e)
        finally:
            config.reload()
    return f, chosen


def timer(on_gpu):
    if on_gpu:
        return lambda f, sets: device_time_us(f, arg_sets=sets)
    return lambda f, sets: time_us(f, arg_sets=sets, iters=5, trials=1)


def bench(token, shape, paths, rounds, platform, on_gpu, list_kernels):
    m, n, k = (int(v) for v in shape.split("x"))
    weight_only = token.startswith("w:")
    fmt, kw = format_token(token.removeprefix("w:"))
    kx, kw_ = jax.random.split(jax.random.PRNGKey(m * 7 + n))
    x = jax.random.normal(kx, (m, k), jnp.float32)
    w = jax.random.normal(kw_, (n, k), jnp.float32)
    a = x.astype(jnp.bfloat16) if weight_only else jbs.quantize(x, fmt, **kw)
    b = jbs.quantize(w, fmt, layout="blocked", **kw)
    sets = [(a, b_) for b_ in copies(b, rotation_count(n * k // 2) if on_gpu else 1)]
    dot_sets = [(x.astype(jnp.bfloat16), w_) for w_ in
                copies(w.astype(jnp.bfloat16), rotation_count(2 * n * k) if on_gpu else 1)]
    row = dict(format=token, M=m, N=n, K=k, clock="device" if on_gpu else "python loop",
               plans={}, errors={}, rel_err_vs_reference={}, us={})
    ref = np.asarray(jbs.gemm(a, b, out_dtype=jnp.bfloat16, backend="reference"), np.float32)
    fns = {}
    for name in paths:
        f, chosen = compile_path(name, a, b, platform)
        if f is None:
            row["errors"][name] = chosen
            continue
        row["plans"][name] = chosen
        y = np.asarray(f(a, b), np.float32)
        row["rel_err_vs_reference"][name] = float(np.linalg.norm(y - ref) / np.linalg.norm(ref))
        fns[name] = f
    time = timer(on_gpu)
    samples = collections.defaultdict(list)
    for _ in range(rounds):
        samples["bf16_dot"].append(time(dot_bf16, dot_sets))
        for name, f in fns.items():
            samples[name].append(time(f, sets))
    row["us"] = {name: statistics.median(v) for name, v in samples.items()}
    if list_kernels and on_gpu:
        row["kernels"] = {name: kernel_list(f, sets) for name, f in fns.items()}
    return row


def kernel_list(f, sets, calls=10):
    """{kernel name: mean us per call} of one path (profiler trace)."""
    per_name = collections.defaultdict(float)
    for name, start, end in gpu_kernel_events(f, arg_sets=sets, calls=calls):
        per_name[name] += (end - start) / 1e3 / calls
    return dict(sorted(per_name.items(), key=lambda kv: -kv[1]))


def print_row(r):
    dot = r["us"].get("bf16_dot")
    print(f"\n{r['format']} {r['M']}x{r['N']}x{r['K']} ({r['clock']} us, bf16 jnp.dot {dot:.1f})")
    for name, us in r["us"].items():
        if name == "bf16_dot":
            continue
        print(f"  {name:12s} {us:9.1f}  {dot / us:5.2f}x dot  err {r['rel_err_vs_reference'][name]:.1e}"
              f"  {r['plans'][name]}")
        for kname, kus in r.get("kernels", {}).get(name, {}).items():
            print(f"      {kus:8.2f} us  {kname[:90]}")
    for name, e in r["errors"].items():
        print(f"  {name:12s} not run: {e}")


def crossovers(rows, faster="kernels", slower="dequant_dot"):
    """Per (format, N, K) measured at several M with both paths: which path was faster at each
    M, the last M up to which `faster` won without a loss in between, and the default plan's
    kernel at each M where the "default" path ran. The catalogue's row limits
    (catalog/sm90.py: fused_max_rows) are such crossovers; this states them for the GPU that
    ran, to check a card's rule against."""
    groups = collections.defaultdict(list)
    for r in rows:
        if faster in r["us"] and slower in r["us"]:
            groups[(r["format"], r["N"], r["K"])].append(r)
    out = []
    for (fmt, n, k), rs in groups.items():
        rs = sorted(rs, key=lambda r: r["M"])
        wins = [r["us"][faster] <= r["us"][slower] for r in rs]
        last = None
        for r, won in zip(rs, wins):
            if not won:
                break
            last = r["M"]
        cells = [f"{r['M']}: {faster if won else slower}"
                 + (f" (default: {r['plans']['default'].split(' ')[0]})"
                    if "default" in r.get("plans", {}) else "")
                 for r, won in zip(rs, wins)]
        out.append(dict(format=fmt, N=n, K=k, faster=faster, slower=slower,
                        last_m_faster=last, per_m=cells))
    return out


def print_crossovers(summary):
    if not summary:
        return
    print("\ncrossovers (the faster path at each M; the last M up to which the first one won):")
    for c in summary:
        print(f"  {c['format']} N x K = {c['N']} x {c['K']}: {c['faster']} up to "
              f"M = {c['last_m_faster']}; " + ", ".join(c["per_m"]))


def plot(rows, path):
    plt = pyplot()
    if plt is None:
        return
    names = list(dict.fromkeys(n for r in rows for n in r["us"]))
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(rows)), 4.5))
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        ax.bar([j + i * width for j in range(len(rows))], [r["us"].get(name, 0) for r in rows],
               width, label=name)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(rows))],
                  [f"{r['format']}\n{r['M']}x{r['N']}x{r['K']}" for r in rows], fontsize=7)
    ax.set_ylabel(f"{rows[0]['clock']} time per call (us)")
    ax.set_yscale("log")
    ax.legend(fontsize=7)
    ax.set_title(f"sm90 paths, {jax.devices()[0].device_kind}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print("wrote", path)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="\n".join(__doc__.splitlines()[1:]))
    ap.add_argument("--shapes", default="16x16384x16384,128x16384x16384,8192x8192x8192",
                    help="MxNxK,...")
    ap.add_argument("--formats", default="w:nvfp4,nvfp4")
    ap.add_argument("--paths", default="default,kernels,dequant_dot",
                    help="comma-separated subset of " + ", ".join(PATHS))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--kernels", action="store_true", help="list each path's GPU kernels")
    ap.add_argument("--json", default=None)
    ap.add_argument("--png", default=None)
    args = ap.parse_args()
    paths = args.paths.split(",")
    unknown = [p for p in paths if p not in PATHS]
    if unknown:
        ap.error(f"unknown paths {unknown}; choose from {list(PATHS)}")
    device = jax.devices()[0]
    platform, on_gpu = lowering_platform(device), device.platform == "gpu"
    print(jax.__version__, device.device_kind, flush=True)
    rows = []
    for shape in args.shapes.split(","):
        for token in args.formats.split(","):
            rows.append(bench(token, shape, paths, args.rounds, platform, on_gpu, args.kernels))
            print_row(rows[-1])
            if args.json:  # keep what was measured if the run is cut short
                with open(args.json, "w") as f:
                    json.dump(dict(jax=jax.__version__, device=device.device_kind, rows=rows), f,
                              indent=1)
    summary = crossovers(rows)
    print_crossovers(summary)
    if args.json and summary:
        with open(args.json, "w") as f:
            json.dump(dict(jax=jax.__version__, device=device.device_kind, rows=rows,
                           crossovers=summary), f, indent=1)
    if args.png and rows:
        plot(rows, args.png)


if __name__ == "__main__":
    main()
