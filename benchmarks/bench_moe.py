"""Grouped (MoE) GEMM: `jbs.ragged_gemm` beside the anchors, in one run, at real expert shapes.

For each model's expert GEMMs (gate+up and down), token count and format, in one process:
  bf16_ragged_dot   bf16 `lax.ragged_dot` on bf16 experts (XLA's grouped GEMM)
  deq_ragged_dot    jitted dequantize (all experts, to bf16) + `ragged_dot`: what qwix does
  tokamax_int4      tokamax's int4 weight-only ragged_dot (Mosaic GPU; 128-element groups,
                    about MXFP4's bytes), when tokamax imports and runs here
  ours              `jbs.ragged_gemm`, bf16 activations x block-scaled experts (weight-only)
  ours_qact         `jbs.ragged_gemm` with the activation quantized too (W4A4 / W8A8), the
                    activation quantized once outside the timed call
  ours_decode       with --compare-kernels: `ours` with the sm90 grouped decode kernel forced
  ours_prefill      ... with the grouped register-weight (prefill) kernel forced
  ours_prefill<n>   ... the same with n rows per item forced, one method per item height of
                    the catalogue (32, 64, 128, 256; JAX_BLOCKSCALE_SM90_RAGGED_KERNEL /
                    _TILE_M): where the planner's thresholds and tile choice come from
Routing: each token picks top_k distinct experts uniformly at random (seeded), the T * top_k
rows sorted by expert; `experts_hit` counts the experts with rows and `hit_bytes` their
quantized bytes (elements + scales), the floor for a kernel that streams only the hit experts;
"ours_rel_err" / "ours_qact_rel_err" the Frobenius error against the reference backend.

    python benchmarks/bench_moe.py --tiny --out /tmp/moe      # CPU smoke run, tiny shapes
    python benchmarks/bench_moe.py --out benchmarks/results/moe_h100   # GPU: the full matrix
    python benchmarks/bench_moe.py --models qwen3-30b-a3b --gemms gate_up --tokens 16,256
    python benchmarks/bench_moe.py --tokens 64,256,1024,4096 --compare-kernels --out /tmp/k
    python benchmarks/bench_moe.py --methods ours --compare-kernels ours_decode,ours_prefill32
        (our kernels alone: the anchors left out; `ours` always runs)

Timing: benchmarks/timing.py, as sweep.py: "<method>_us" is the Python-loop time (median of
--trials x --iters jitted calls), "<method>_device_us" the GPU's kernel time per call from a
profiler trace (absent on the CPU). Expert weights smaller than ~3x L2 are rotated through
copies. Writes <out>.json (rows + environment) and <out>.png (time vs tokens per GEMM).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import jax_blockscale as jbs  # noqa: E402
from jax_blockscale import config as jbs_config  # noqa: E402
from jax_blockscale.catalog import sm90 as cat90  # noqa: E402
from plotting import pyplot  # noqa: E402
from timing import copies, device_time_us, rotation_count, time_us  # noqa: E402

MODELS = {
    # hidden, intermediate (per expert), experts, top_k
    "qwen3-30b-a3b": dict(hidden=2048, intermediate=768, experts=128, top_k=8),
    "gpt-oss-20b": dict(hidden=2880, intermediate=2880, experts=32, top_k=4),
    "gpt-oss-120b": dict(hidden=2880, intermediate=2880, experts=128, top_k=4),
    # other served expert shapes (bench_moe_peers.py --models): timed when named
    "qwen3-235b-a22b": dict(hidden=4096, intermediate=1536, experts=128, top_k=8),
    "deepseek-v3": dict(hidden=7168, intermediate=2048, experts=256, top_k=8),
}
DEFAULT_MODELS = ("qwen3-30b-a3b", "gpt-oss-20b", "gpt-oss-120b")
TINY_MODELS = {"tiny": dict(hidden=256, intermediate=128, experts=8, top_k=2)}
TOKENS = (1, 16, 64, 256, 4096)
TINY_TOKENS = (1, 16, 64)
GEMMS = ("gate_up", "down")
FORMATS = ("mxfp4", "nvfp4")
METHODS = ("bf16_ragged_dot", "deq_ragged_dot", "tokamax_int4", "ours", "ours_qact")
# method -> (JAX_BLOCKSCALE_SM90_RAGGED_KERNEL, JAX_BLOCKSCALE_SM90_RAGGED_TILE_M): one
# ours_prefill<rows> per item height the catalogue has
KERNEL_METHODS = {"ours_decode": ("decode", None), "ours_prefill": ("prefill", None),
                  **{f"ours_prefill{tile_m}": ("prefill", str(tile_m))
                     for tile_m, _ in cat90.RAGGED_PREFILL_TILES}}

quantize = jax.jit(jbs.quantize, static_argnames=("fmt", "global_scale", "layout"))
normal = jax.jit(jax.random.normal, static_argnames=("shape", "dtype"))


def gemm_shape(model, gemm):
    """(G, N, K) of one expert GEMM: gate+up is fused (N = 2 * intermediate)."""
    m = MODELS.get(model) or TINY_MODELS[model]
    if gemm == "gate_up":
        return m["experts"], 2 * m["intermediate"], m["hidden"]
    return m["experts"], m["hidden"], m["intermediate"]


def routing(key, tokens, experts, top_k):
    """group_sizes (G,) int32 of T tokens each sent to top_k distinct random experts."""
    choice = jnp.argsort(jax.random.uniform(key, (tokens, experts)), axis=1)[:, :top_k]
    return jnp.bincount(choice.reshape(-1), length=experts).astype(jnp.int32)


def quantized_bytes(fmt, rows, k):
    f = jbs.get_format(fmt)
    elem_bits = 4 if f.element_bits == 4 else 8 * f.storage_dtype.itemsize
    return rows * k * elem_bits // 8 + rows * (k // f.block) * f.scale_dtype.itemsize


def short_error(e, limit=160):
    first = next(iter(str(e).splitlines()), "")
    return f"{type(e).__name__}: {first[:limit]}"


# ---------------------------------------------------------------------------------------------
# The methods (each jitted once; shapes come from the arguments)


@jax.jit
def bf16_ragged_dot(x, w_gkn, gs):
    return lax.ragged_dot(x, w_gkn, gs, preferred_element_type=jnp.float32).astype(jnp.bfloat16)


@jax.jit
def deq_ragged_dot(x, q, gs):
    w = jbs.dequantize(q, jnp.bfloat16)  # (G, N, K), the per-expert global scales applied
    dn = lax.RaggedDotDimensionNumbers(dot_dimension_numbers=(([1], [2]), ([], [])),
                                       lhs_ragged_dimensions=[0], rhs_group_dimensions=[0])
    y = lax.ragged_dot_general(x, w, gs, dn, preferred_element_type=jnp.float32)
    return y.astype(jnp.bfloat16)


@jax.jit
def ours(x, q, gs):
    return jbs.ragged_gemm(x, q, gs)


def forced_kernel(kernel, tile_m=None):
    """`ours` with the sm90 grouped kernel `kernel` ("decode" / "prefill", and the prefill
    kernel's rows per item `tile_m`) forced while it is traced (the planner reads the variables
    then; the jitted function keeps its plan)."""
    f = jax.jit(lambda x, q, gs: jbs.ragged_gemm(x, q, gs))
    forced = {"JAX_BLOCKSCALE_SM90_RAGGED_KERNEL": kernel,
              "JAX_BLOCKSCALE_SM90_RAGGED_TILE_M": tile_m}

    def call(*args):
        old = {name: os.environ.get(name) for name in forced}
        for name, value in forced.items():
            if value is not None:
                os.environ[name] = value
        jbs_config.reload()
        try:
            return f(*args)
        finally:
            for name, value in old.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value
            jbs_config.reload()
    return call


@jax.jit
def reference(x, q, gs):
    return jbs.ragged_gemm(x, q, gs, backend="reference")


def rel_error(x, q, gs):
    """Frobenius error of `ours` relative to the reference backend (same bf16 output)."""
    got = np.asarray(ours(x, q, gs), np.float64)
    want = np.asarray(reference(x, q, gs), np.float64)
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))


def ours_path(x, q, gs):
    """The ragged backend and kernel the planner picks for `ours` on this machine's platform
    (e.g. "sm90/ragged_decode", "reference/ragged_dot")."""
    from jax_blockscale.ragged import ragged_gemm_spec
    from jax_blockscale.lowering.plan import select_ragged_backend

    platform = "cuda" if jax.default_backend() == "gpu" else jax.default_backend()
    plan = select_ragged_backend(ragged_gemm_spec(x, q, gs), platform, None)
    return f"{plan.backend}/{plan.kernel}"


def tokamax_method():
    """(quantize (G, K, N) bf16 -> int4, ragged_dot) from tokamax, or None with the reason."""
    try:
        import tokamax  # noqa: PLC0415
        from tokamax._src import quantization as tq  # noqa: PLC0415
    except Exception as e:  # noqa: BLE001
        return None, short_error(e)

    def quant(w_gkn):
        try:
            return tq.quantize_as(jnp.int4, tile_shape=(1, 128, 1))(w_gkn)
        except Exception:  # noqa: BLE001  (older releases took 256-element tiles only)
            return tq.quantize_as(jnp.int4, tile_shape=(1, 256, 1))(w_gkn)

    call = jax.jit(lambda x, w, gs: tokamax.ragged_dot(x, w, gs))
    return (quant, call), None


# ---------------------------------------------------------------------------------------------


def timed(row, key, f, arg_sets, timing):
    try:
        jax.block_until_ready(f(*arg_sets[0]))
        row[key + "_us"] = time_us(f, arg_sets=arg_sets, **timing)
        dev = device_time_us(f, arg_sets=arg_sets)
        if dev is not None:
            row[key + "_device_us"] = dev
    except Exception as e:  # noqa: BLE001  (record it: not every platform runs every method)
        row[key + "_err"] = short_error(e)


def bench_gemm(model, gemm, fmts, token_counts, top_k, timing, key, tokamax,
               compare_kernels=(), methods=METHODS):
    g, n, k = gemm_shape(model, gemm)
    kw, kx, kr = jax.random.split(key, 3)
    w_f32 = normal(kw, (g, n, k), jnp.float32) / np.sqrt(k)
    w_bf16 = jnp.swapaxes(w_f32, 1, 2).astype(jnp.bfloat16)  # (G, K, N): ragged_dot's layout
    bf16_sets = (copies(w_bf16, rotation_count(2 * g * n * k)) if "bf16_ragged_dot" in methods
                 else None)
    quantized = {}
    for fmt in fmts:
        gscale = dict(global_scale="per_matrix") if fmt == "nvfp4" else {}
        quantized[fmt] = (quantize(w_f32, fmt, layout="blocked", **gscale),
                          quantize(w_f32, fmt, **gscale))  # blocked (ours), plain (dequantize)
    tk_w = None
    if tokamax[0] is not None and "tokamax_int4" in methods:
        try:
            tk_w = tokamax[0][0](w_bf16)
        except Exception as e:  # noqa: BLE001
            tokamax = (None, short_error(e))
    del w_f32
    rows = []
    for t in token_counts:
        m = t * top_k
        gs = routing(jax.random.fold_in(kr, t), t, g, top_k)
        x = normal(jax.random.fold_in(kx, t), (m, k), jnp.bfloat16)
        hit = int(jnp.sum(gs > 0))
        base = dict(model=model, gemm=gemm, tokens=t, rows=m, experts=g, n=n, k=k,
                    experts_hit=hit)
        bf16_row = dict(base)
        if "bf16_ragged_dot" in methods:
            timed(bf16_row, "bf16_ragged_dot", bf16_ragged_dot, [(x, w, gs) for w in bf16_sets],
                  timing)
        if "tokamax_int4" in methods and tk_w is not None:
            timed(bf16_row, "tokamax_int4", tokamax[0][1], [(x, tk_w, gs)], timing)
        elif "tokamax_int4" in methods and tokamax[1]:
            bf16_row["tokamax_int4_err"] = tokamax[1]
        for fmt in fmts:
            q_blocked, q_plain = quantized[fmt]
            n_copies = rotation_count(quantized_bytes(fmt, g * n, k))
            qb_sets, qp_sets = copies(q_blocked, n_copies), copies(q_plain, n_copies)
            row = dict(bf16_row, fmt=fmt, weight_copies=n_copies,
                       hit_bytes=hit * quantized_bytes(fmt, n, k),
                       all_bytes=quantized_bytes(fmt, g * n, k))
            if "deq_ragged_dot" in methods:
                timed(row, "deq_ragged_dot", deq_ragged_dot, [(x, q, gs) for q in qp_sets],
                      timing)
            timed(row, "ours", ours, [(x, q, gs) for q in qb_sets], timing)
            row["ours_path"] = ours_path(x, q_blocked, gs)
            row["ours_rel_err"] = rel_error(x, q_blocked, gs)
            if "ours_qact" in methods:
                xq = quantize(x, fmt)
                timed(row, "ours_qact", ours, [(xq, q, gs) for q in qb_sets], timing)
                row["ours_qact_path"] = ours_path(xq, q_blocked, gs)
                row["ours_qact_rel_err"] = rel_error(xq, q_blocked, gs)
            if compare_kernels:
                for method in compare_kernels:
                    timed(row, method, forced_kernel(*KERNEL_METHODS[method]),
                          [(x, q, gs) for q in qb_sets], timing)
            for clock in ("_device_us", "_us"):
                if "ours" + clock in row:
                    row["hit_TBps" + clock.replace("_us", "")] = \
                        row["hit_bytes"] / row["ours" + clock] / 1e6
            rows.append(row)
            print_row(row)
            del qb_sets, qp_sets
    return rows


def print_row(row):
    def cell(method):
        if method + "_err" in row:
            return "err"
        dev, loop = row.get(method + "_device_us"), row.get(method + "_us")
        if loop is None:
            return "-"
        return f"{dev:.0f}/{loop:.0f}" if dev is not None else f"{loop:.0f}"

    methods = METHODS + tuple(m for m in KERNEL_METHODS if m + "_us" in row or m + "_err" in row)
    print(f"{row['model']:<14}{row['gemm']:<8}{row['fmt']:<7}{row['tokens']:>5}"
          f"{row['experts_hit']:>5}" + "".join(f"{cell(m):>18}" for m in methods), flush=True)


def plot(rows, path):
    plt = pyplot()
    if plt is None:
        return
    panels = sorted({(r["model"], r["gemm"], r["fmt"]) for r in rows})
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.6), squeeze=False)
    for ax, (model, gemm, fmt) in zip(axes[0], panels):
        sel = sorted((r for r in rows if (r["model"], r["gemm"], r["fmt"]) == (model, gemm, fmt)),
                     key=lambda r: r["tokens"])
        for method in METHODS + tuple(KERNEL_METHODS):
            pts = [(r["tokens"], r.get(method + "_device_us", r.get(method + "_us")))
                   for r in sel]
            pts = [(t, v) for t, v in pts if v is not None]
            if pts:
                ax.plot(*zip(*pts), marker="o", label=method)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_title(f"{model} {gemm} ({fmt})", fontsize=9)
        ax.set_xlabel("tokens")
        ax.set_ylabel("us per call (device time where measured)")
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tiny", action="store_true", help="tiny shapes (CPU smoke run)")
    p.add_argument("--models", help=f"comma-separated, from {sorted(MODELS)} (default: "
                   f"{', '.join(DEFAULT_MODELS)})")
    p.add_argument("--gemms", default=",".join(GEMMS))
    p.add_argument("--formats", default=",".join(FORMATS))
    p.add_argument("--tokens", help="comma-separated token counts")
    p.add_argument("--iters", type=int, default=None)
    p.add_argument("--trials", type=int, default=None)
    p.add_argument("--out", default="bench_moe", help="output path prefix (.json, .png)")
    p.add_argument("--methods", default=",".join(METHODS),
                   help="comma-separated, from the default (ours always runs): leave out the "
                        "anchors to time only our kernels, e.g. with --compare-kernels")
    p.add_argument("--compare-kernels", nargs="?", const="ours_decode,ours_prefill", default="",
                   help="also time ours with sm90 grouped kernels forced: comma-separated "
                        f"from {list(KERNEL_METHODS)} (no value: decode and prefill)")
    args = p.parse_args()
    models = (args.models.split(",") if args.models else
              list(TINY_MODELS) if args.tiny else list(DEFAULT_MODELS))
    tokens = ([int(t) for t in args.tokens.split(",")] if args.tokens else
              list(TINY_TOKENS if args.tiny else TOKENS))
    timing = dict(iters=args.iters or (2 if args.tiny else 20),
                  trials=args.trials or (1 if args.tiny else 5))
    fmts = args.formats.split(",")
    compare = tuple(m for m in args.compare_kernels.split(",") if m)
    methods = tuple(m for m in args.methods.split(",") if m) + ("ours",)
    if set(methods) - set(METHODS):
        p.error(f"--methods: unknown {sorted(set(methods) - set(METHODS))}, choose from "
                f"{list(METHODS)}")
    unknown = [m for m in compare if m not in KERNEL_METHODS]
    if unknown:
        p.error(f"--compare-kernels: unknown {unknown}, choose from {list(KERNEL_METHODS)}")
    tk = tokamax_method()
    device = jax.devices()[0]
    print(f"device: {device.device_kind} ({device.platform}); jax {jax.__version__}; "
          f"tokamax: {'yes' if tk[0] else 'no (' + str(tk[1]) + ')'}")
    print(f"{'model':<14}{'gemm':<8}{'fmt':<7}{'tok':>5}{'hit':>5}"
          + "".join(f"{m:>18}" for m in METHODS) + "   (device/loop us)")
    rows = []
    key = jax.random.PRNGKey(0)
    for model in models:
        top_k = (MODELS.get(model) or TINY_MODELS[model])["top_k"]
        for gemm in args.gemms.split(","):
            key, sub = jax.random.split(key)
            rows += bench_gemm(model, gemm, fmts, tokens, top_k, timing, sub, tk,
                               compare, methods)
    out = os.path.splitext(args.out)[0]
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    meta = dict(device=device.device_kind, platform=device.platform, jax=jax.__version__,
                backends=jbs.ragged_backend_names(), timing=timing, methods=METHODS)
    with open(out + ".json", "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
    print(f"wrote {out}.json")
    plot(rows, out + ".png")


if __name__ == "__main__":
    main()
