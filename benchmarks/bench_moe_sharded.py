"""The QuantizedMoE layer on 1 device and sharded over N (expert parallel by the grouped GEMM's
rule, expert parallel dispatching tokens, tensor parallel, Megatron) at the gpt-oss-120b layer
shape (128 experts, hidden 2880, intermediate 2880, top-4; MXFP4 experts) and Qwen3-30B-A3B's
(128 experts, hidden 2048, intermediate 768, top-8; NVFP4 experts with one global scale each),
16, 256 and 4096 tokens, bf16 activations.

    python benchmarks/bench_moe_sharded.py --devices 2 --out benchmarks/results \
        --tag bench_moe_sharded_h200
    python benchmarks/bench_moe_sharded.py --devices 2,4 ...      # 2 and 4 GPUs in one run
    XLA_FLAGS=--xla_force_host_platform_device_count=4 JAX_PLATFORMS=cpu \
        python benchmarks/bench_moe_sharded.py --smoke --devices 2,4 --out /tmp/moe_sharded

Each row is one jitted layer call (routing, both ragged GEMMs, SwiGLU, the combine) with its
expert weights (elements, blocked scales, global scales) placed as
  1 device      everything on the first device (the baseline)
  expert        gate_up and down split on the expert axis over N devices; the grouped GEMM's
                rule gives each device every routed row and all-reduces the (rows, N) outputs
  dispatch      the experts split as for "expert", the layer built with
                QuantizedMoE(mesh=, expert_axis=): tokens split over the devices, each routed
                row sent only to its expert's device and back (ragged_all_to_all on GPUs, a
                padded all_to_all on CPUs; --exchange picks); output split along the tokens
  reduce        the experts split as for "expert", the layer built with QuantizedMoE(mesh=,
                expert_axis=, exchange="reduce"): every device keeps every token, runs only
                its own experts' rows and its share of each token's combine; one f32
                all-reduce of the (tokens, hidden) shares; output replicated
  tensor        gate_up and down split on N (their output features)
  tensor_k      gate_up on N, down on K = intermediate (Megatron's pairing)
  tensor_layer  the layer built with QuantizedMoE(mesh=, tensor_axis=): every device holds I/N
                of every expert's features, gate and up paired (re-laid once, padded to whole
                128-row tiles), and runs every routed row through them; one f32 sum of the
                combined (tokens, hidden) partial outputs; output replicated
and the router and tokens replicated. A placement whose shards are not whole blocked-scale tiles
at a shape is left out with a note (the rule would gather the weight): gpt-oss's hidden 2880 / 2
= 1440 rows are not whole 128-row tiles, so its tensor-parallel rows are absent.
--devices N (or a list) sets the device counts of the sharded rows; it stops when fewer devices
are present, unless --allow-one (then only the 1-device rows run).

--breakdown also records, per row, each GPU's busy time and the kernels that took longest
(summed over the GPUs; an NCCL kernel's time includes its wait for the peers).

Timing: benchmarks/timing.py. "device_us": the time per call during which a GPU ran a kernel
(the union of the kernel intervals on every stream of all N GPUs, NCCL's kernels included),
from a profiler trace; absent on the CPU. "loop_us": median over --trials of the mean of
--iters back-to-back calls from Python (host and dispatch cost included). Weights smaller than
~3x L2 are rotated through copies. Each sharded row also records the compiled program's
collectives, its largest difference to the 1-device output (0 where the math allows: expert,
dispatch, tensor), how many outputs differ (for the rule's placements also of its two ragged
GEMMs given the same inputs in both programs, which tells the kernels' share of a difference
from the share of what XLA compiles around them), and the speedup over 1 device. A row that
fails records its error and the run goes on. Prints a table; writes <tag>.json and <tag>.png.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import jax_blockscale as jbs  # noqa: E402
from jax_blockscale import nn as jnn  # noqa: E402
from jax_blockscale.nn.moe import route, swiglu  # noqa: E402
from jax_blockscale.ragged.tensor_parallel import feature_ranges  # noqa: E402
from plotting import pyplot  # noqa: E402
from timing import (copies, device_time_us, gpu_kernel_events, rotation_count,  # noqa: E402
                    time_us, union_length)

# name: (layer shape, expert formats)
SHAPES = {
    "qwen3-30b-a3b": (dict(hidden=2048, intermediate=768, experts=128, top_k=8), ("nvfp4",)),
    "gpt-oss-120b": (dict(hidden=2880, intermediate=2880, experts=128, top_k=4), ("mxfp4",)),
}
# N / d and K / d whole blocked-scale tiles for every format up to d = 2 (MX: K / 2 a multiple
# of 128); 16 experts split over up to 8 devices
SMOKE_SHAPES = {"smoke": (dict(hidden=256, intermediate=256, experts=16, top_k=2),
                          ("nvfp4", "mxfp4"))}
TOKENS, SMOKE_TOKENS = (16, 256, 4096), (4, 16)
BREAKDOWN_KERNELS = 12  # --breakdown: the kernels kept per row, by time
# placement: (gate_up (E, 2I, H) spec, down (E, H, I) spec) on the mesh axis "d"
PLACEMENTS = {
    "expert": (P("d", None, None), P("d", None, None)),
    "dispatch": (P("d", None, None), P("d", None, None)),
    "reduce": (P("d", None, None), P("d", None, None)),
    "tensor": (P(None, "d", None), P(None, "d", None)),
    "tensor_k": (P(None, "d", None), P(None, None, "d")),
    "tensor_layer": (P(None, "d", None), P(None, None, "d")),
}
# placements run by the layer built for them: QuantizedMoE(mesh=, expert_axis=, exchange=) for
# "dispatch" (with --exchange) and "reduce" (exchange="reduce"), QuantizedMoE(mesh=,
# tensor_axis=) for "tensor_layer" (its experts re-laid: the specs above split that layout)
LAYER_PLACEMENTS = ("dispatch", "reduce", "tensor_layer")
COLLECTIVE = re.compile(r"=\s*(\(?[^=]*?\)?)\s+(all-gather|all-reduce|reduce-scatter|"
                        r"ragged-all-to-all|all-to-all|collective-permute)(?:-start)?\(")
SHAPE = re.compile(r"([a-z][a-z0-9]*)\[([0-9,]*)\]")


def shard_state(state, mesh, gate_up_spec, down_spec):
    """The layer's state placed on the mesh: each expert weight's arrays on its spec (its
    scales and global scales following, `jnn.expert_shardings`), the router replicated."""
    return jax.device_put(state, jnn.expert_shardings(state, mesh, gate_up=gate_up_spec,
                                                      down=down_spec))


def collectives(hlo_text):
    """e.g. "all-reduce bf16[128,1536] x1, all-reduce bf16[128,2048] x1" (the last shape of each
    collective's result type: the result of an async start)."""
    counts = {}
    for line in hlo_text.splitlines():
        m = COLLECTIVE.search(line)
        if m:
            shapes = SHAPE.findall(m.group(1))
            dt, dims = shapes[-1] if shapes else ("", "")
            key = f"{m.group(2)} {dt}[{dims}]"
            counts[key] = counts.get(key, 0) + 1
    return ", ".join(f"{k} x{n}" for k, n in sorted(counts.items())) or "none"


def expert_bytes(layer):
    """Bytes of both expert weights: elements (fp4 packed, half a byte), scales, global scales."""
    total = 0
    for w in (layer.gate_up.get_value(), layer.down.get_value()):
        f = jbs.get_format(w.fmt)
        bits = 4 if f.element_bits == 4 else 8 * f.storage_dtype.itemsize
        total += w.data.size * bits // 8 + w.scales.size * w.scales.dtype.itemsize
        total += 0 if w.global_scale is None else 4 * w.global_scale.size
    return total


def timed(row, f, arg_sets, timing, calls=8):
    """Fills row's loop_us and device_us; with timing["breakdown"] also each GPU's busy time
    and the kernels that took the most time."""
    timing = dict(timing)
    breakdown = timing.pop("breakdown", False)
    row["loop_us"] = time_us(f, arg_sets=arg_sets, **timing)
    if not breakdown:
        dev = device_time_us(f, arg_sets=arg_sets, calls=calls)
        if dev is not None:
            row["device_us"] = dev
        return
    events = gpu_kernel_events(f, arg_sets=arg_sets, calls=calls, with_device=True)
    if not events:
        return
    row["device_us"] = union_length([(s, e) for *_, s, e in events]) / calls / 1e3
    gpus = sorted({g for g, *_ in events})
    row["busy_us_per_gpu"] = [round(union_length([(s, e) for g, _, s, e in events if g == gpu])
                                    / calls / 1e3, 2) for gpu in gpus]
    per_kernel = {}
    for _, name, s, e in events:
        per_kernel[name] = per_kernel.get(name, 0) + (e - s)
    top = sorted(per_kernel.items(), key=lambda kv: -kv[1])[:BREAKDOWN_KERNELS]
    # kernel time per call, summed over the GPUs (NCCL kernels include their waits)
    row["kernels_us"] = {name[:120]: round(ns / calls / 1e3, 2) for name, ns in top}


def expert_gemms(graphdef, top_k):
    """The layer's two ragged GEMMs, each on given inputs: gate_up on the rows a given routing
    sorts, down on a given SwiGLU output (the sharded part of the layer, without the router,
    the SwiGLU and the combine that XLA compiles)."""
    def gate_up(state, x, order, group_sizes):
        w = nnx.merge(graphdef, state).gate_up.get_value()
        return jbs.ragged_gemm(x[order // top_k], w, group_sizes)

    def down(state, a, group_sizes):
        return jbs.ragged_gemm(a, nnx.merge(graphdef, state).down.get_value(), group_sizes)
    return jax.jit(gate_up), jax.jit(down)


def differing(got, want) -> int:
    """Outputs whose bits differ."""
    bits = lambda y: np.asarray(y, np.float32).view(np.uint32)  # noqa: E731
    return int(np.sum(bits(got) != bits(want)))


def tile_aligned(name, shape, fmt, n):
    """Why placement `name` cannot keep every weight shard whole blocked-scale tiles over n
    devices at `shape` (None: it can)."""
    h, i, e = shape["hidden"], shape["intermediate"], shape["experts"]
    block = jbs.get_format(fmt).block
    k_tile = 4 * block
    if name == "tensor_layer":  # the layer's own rule for its feature ranges
        try:
            feature_ranges(i, n, block)
        except ValueError as e:
            return str(e)
        return None
    if name in ("expert",) + LAYER_PLACEMENTS:
        return None if e % n == 0 else f"{e} experts over {n} devices"
    if (2 * i) % (128 * n):
        return f"gate_up's {2 * i} rows over {n} devices are not whole 128-row tiles"
    if name == "tensor" and h % (128 * n):
        return f"down's {h} rows over {n} devices are not whole 128-row tiles"
    if name == "tensor_k" and i % (k_tile * n):
        return f"down's K = {i} over {n} devices is not whole {k_tile}-column tiles"
    return None


def bench_format(label, fmt, moe, shape, tokens, devices, counts, placements, timing,
                 exchange):
    layer = jnn.QuantizedMoE.from_float(moe, fmt)
    graphdef, state = nnx.split(layer)
    forward = jax.jit(lambda s, x: nnx.merge(graphdef, s)(x))
    n_copies = rotation_count(expert_bytes(layer))
    one = copies(jax.device_put(state, devices[0]), n_copies)
    meshes = {n: Mesh(np.asarray(devices[:n]), ("d",), axis_types=(AxisType.Auto,))
              for n in counts}
    dispatched = {}  # (placement, n): (jitted layer call, its state)
    for n, mesh in meshes.items():
        for name in LAYER_PLACEMENTS:
            if name in placements and not tile_aligned(name, shape, fmt, n):
                parallel = (dict(tensor_axis="d") if name == "tensor_layer" else
                            dict(expert_axis="d",
                                 exchange=exchange if name == "dispatch" else name))
                q = jnn.QuantizedMoE.from_float(moe, fmt, mesh=mesh, **parallel)
                g, st = nnx.split(q)
                dispatched[name, n] = (jax.jit(lambda s, x, g=g: nnx.merge(g, s)(x)), st)
    rows = []
    for t in tokens:
        x = jax.random.normal(jax.random.PRNGKey(t), (t, shape["hidden"]), jnp.bfloat16)
        x1 = jax.device_put(x, devices[0])
        base = dict(shape_name=label, fmt=fmt, tokens=t, **shape, weight_copies=n_copies,
                    expert_bytes=expert_bytes(layer))
        baseline = dict(base, placement="1 device", devices=1)
        timed(baseline, forward, [(s, x1) for s in one], timing)
        want = np.asarray(forward(one[0], x1), np.float32)
        # the expert GEMMs on the same inputs in both programs: a difference there is the
        # kernels'; the rest of a layer's difference is the router's, SwiGLU's or the combine's
        order, group_sizes, _ = jax.jit(route, static_argnums=2)(x1, layer.router[...],
                                                                 shape["top_k"])
        gate_up, down = expert_gemms(graphdef, shape["top_k"])
        want_h = gate_up(one[0], x1, order, group_sizes)
        a = jax.jit(lambda h: swiglu(h).astype(h.dtype))(want_h)  # as QuantizedMoE does
        want_down = down(one[0], a, group_sizes)
        rows.append(baseline)
        print_row(baseline)
        for n, mesh in meshes.items():
            for name in placements:
                row = dict(base, placement=name, devices=n)
                why = tile_aligned(name, shape, fmt, n)
                if why is not None:
                    row["skipped"] = why
                    rows.append(row)
                    print(f"{fmt:<7}{t:>6}  {name:<13}{n:>3}  skipped: {why}", flush=True)
                    continue
                try:
                    sharded_row(row, name, n, mesh, state, dispatched, forward, x, want,
                                (gate_up, down, order, group_sizes, a, want_h, want_down),
                                n_copies, timing)
                except Exception as err:  # noqa: BLE001  (recorded; the run goes on)
                    row["error"] = f"{type(err).__name__}: {str(err)[:2000]}"
                    print(f"{fmt:<7}{t:>6}  {name:<13}{n:>3}  error: {row['error'][:300]}",
                          flush=True)
                    rows.append(row)
                    continue
                rows.append(row)
                print_row(row, baseline)
    del one
    return rows


def sharded_row(row, name, n, mesh, state, dispatched, forward, x, want, gemms, n_copies,
                timing):
    """Time and check one sharded placement; fills `row`."""
    fwd, st = dispatched.get((name, n), (forward, state))
    sharded = copies(shard_state(st, mesh, *PLACEMENTS[name]), n_copies)
    xs = jax.device_put(x, NamedSharding(mesh, P()))
    got = np.asarray(fwd(sharded[0], xs), np.float32)
    row["max_abs_diff_vs_1_device"] = float(np.max(np.abs(got - want)))
    row["differing_outputs"] = dict(layer=differing(got, want))
    if name not in LAYER_PLACEMENTS:
        gate_up, down, order, group_sizes, a, want_h, want_down = gemms
        xr, order_r, sizes_r, a_r = jax.device_put((x, order, group_sizes, a),
                                                   NamedSharding(mesh, P()))
        row["differing_outputs"].update(
            gate_up=differing(gate_up(sharded[0], xr, order_r, sizes_r), want_h),
            down=differing(down(sharded[0], a_r, sizes_r), want_down))
    row["collectives"] = collectives(fwd.lower(sharded[0], xs).compile().as_text())
    timed(row, fwd, [(s, xs) for s in sharded], timing)
    del sharded


def print_row(row, baseline=None):
    dev, loop = row.get("device_us"), row["loop_us"]
    speedup = ""
    if baseline is not None:
        clock = "device_us" if dev is not None else "loop_us"
        speedup = f"{baseline[clock] / row[clock]:.2f}x"
    diff = row.get("max_abs_diff_vs_1_device")
    if baseline is not None:
        row["speedup_vs_1_device"] = float(speedup[:-1])
    print(f"{row['fmt']:<7}{row['tokens']:>6}  {row['placement']:<13}{row['devices']:>3}"
          f"{(f'{dev:.1f}' if dev is not None else '-'):>11}{loop:>11.1f}{speedup:>9}"
          f"{('-' if diff is None else f'{diff:.3g}'):>10}  {row.get('collectives', '')}",
          flush=True)
    if "differing_outputs" in row:
        print(f"{'':<28}differing outputs: {row['differing_outputs']}", flush=True)
    if "kernels_us" in row:
        print(f"{'':<28}busy per GPU: {row['busy_us_per_gpu']} us", flush=True)
        for name, us in row["kernels_us"].items():
            print(f"{'':<28}{us:>9.1f} us  {name[:90]}", flush=True)


def plot(rows, path):
    """One panel per (shape, format): time per layer call against tokens, one bar per placement
    and device count."""
    plt = pyplot()
    rows = [r for r in rows if "loop_us" in r]
    if plt is None or not rows:
        return
    panels = list(dict.fromkeys((r["shape_name"], r["fmt"]) for r in rows))
    series = list(dict.fromkeys((r["placement"], r["devices"]) for r in rows))
    clock = "device_us" if all("device_us" in r for r in rows) else "loop_us"
    fig, axes = plt.subplots(1, len(panels), figsize=(5.2 * len(panels), 3.8), squeeze=False)
    for ax, (label, fmt) in zip(axes[0], panels):
        mine = [r for r in rows if (r["shape_name"], r["fmt"]) == (label, fmt)]
        tokens = sorted({r["tokens"] for r in mine})
        width = 0.8 / len(series)
        for i, (name, n) in enumerate(series):
            got = {r["tokens"]: r[clock] for r in mine
                   if (r["placement"], r["devices"]) == (name, n)}
            xs = [j + i * width for j, t in enumerate(tokens) if t in got]
            ax.bar(xs, [got[t] for t in tokens if t in got], width,
                   color=plt.get_cmap("tab20")(i % 20),  # more series than the default 10
                   label=name if n == 1 else f"{name}, {n} devices")
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(tokens))],
                      [f"{t} tokens" for t in tokens])
        ax.set_yscale("log")
        ax.set_title(f"QuantizedMoE layer, {label}, {fmt} experts", fontsize=9)
        ax.set_ylabel(f"us per call ({clock})")
        ax.grid(True, axis="y", alpha=0.3)
    axes[0][0].legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny shapes, few calls (CPU smoke run)")
    p.add_argument("--shapes", default=None,
                   help=f"comma-separated, from {list(SHAPES)} (default: all)")
    p.add_argument("--formats", default=None,
                   help="comma-separated expert formats (default: each shape's own)")
    p.add_argument("--tokens", help="comma-separated token counts (default 16,256,4096)")
    p.add_argument("--devices", default="2",
                   help="device counts of the sharded rows, comma-separated (default 2)")
    p.add_argument("--placements", default=",".join(PLACEMENTS),
                   help=f"sharded placements, from {list(PLACEMENTS)}")
    p.add_argument("--exchange", default="auto", choices=["auto", "ragged", "padded"],
                   help="the dispatch row's exchange (QuantizedMoE exchange=)")
    p.add_argument("--breakdown", action="store_true",
                   help="also record each GPU's busy time and the kernels that took longest")
    p.add_argument("--allow-one", action="store_true",
                   help="with fewer devices than --devices, time the 1-device layer only")
    p.add_argument("--iters", type=int, default=None, help="calls per trial (default 20)")
    p.add_argument("--trials", type=int, default=None, help="trials, median (default 5)")
    p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    p.add_argument("--tag", default=None, help="file name stem (default: "
                   "bench_moe_sharded_<platform>)")
    args = p.parse_args()

    devices = jax.devices()
    placements = [s for s in args.placements.split(",") if s]
    for s in placements:
        if s not in PLACEMENTS:
            p.error(f"unknown placement {s!r}; choose from {list(PLACEMENTS)}")
    try:
        counts = sorted({int(n) for n in args.devices.split(",") if n})
    except ValueError:
        p.error(f"--devices must be comma-separated device counts, got {args.devices!r}")
    if any(n < 2 for n in counts):
        p.error(f"--devices counts must be at least 2 (the 1-device row always runs): {counts}")
    if counts and counts[-1] > len(devices):
        if not args.allow_one:
            raise SystemExit(
                f"bench_moe_sharded.py --devices {args.devices} needs {counts[-1]} devices and "
                f"found {len(devices)} ({devices[0].device_kind}). Run it on a machine with that "
                "many GPUs, or force CPU devices (XLA_FLAGS=--xla_force_host_platform_device_"
                f"count={counts[-1]} JAX_PLATFORMS=cpu), or pass --allow-one to time the "
                "1-device layer only.")
        counts = [n for n in counts if n <= len(devices)]
    if not counts:
        placements = []
    table = SMOKE_SHAPES if args.smoke else SHAPES
    names = [s for s in (args.shapes or ",".join(table)).split(",") if s]
    for name in names:
        if name not in table:
            p.error(f"unknown shape {name!r}; choose from {list(table)}")
    tokens = ([int(t) for t in args.tokens.split(",")] if args.tokens else
              list(SMOKE_TOKENS if args.smoke else TOKENS))
    timing = dict(iters=args.iters or (2 if args.smoke else 20),
                  trials=args.trials or (1 if args.smoke else 5), breakdown=args.breakdown)
    device = devices[0]
    print(f"{len(devices)} x {device.device_kind} ({device.platform}); jax {jax.__version__}; "
          f"shapes {names}; sharded over {counts} devices; timing {timing}")
    print(f"{'fmt':<7}{'tokens':>6}  {'placement':<13}{'n':>3}{'device_us':>11}{'loop_us':>11}"
          f"{'speedup':>9}{'max diff':>10}  collectives")
    rows = []
    os.makedirs(args.out, exist_ok=True)
    stem = os.path.join(args.out, args.tag or f"bench_moe_sharded_{device.platform}")
    meta = dict(device=device.device_kind, platform=device.platform, devices=len(devices),
                sharded_over=counts, jax=jax.__version__,
                ragged_backends=jbs.ragged_backend_names(), exchange=args.exchange,
                shapes={n: dict(table[n][0], formats=list(table[n][1])) for n in names},
                timing=dict(timing, method="benchmarks/timing.py: loop_us = median over trials "
                            "of the mean of back-to-back jitted calls (host cost included); "
                            "device_us = time per call during which any GPU ran a kernel "
                            "(profiler trace, every GPU's streams, NCCL included)"),
                placements={k: [str(s) for s in v] for k, v in PLACEMENTS.items()},
                env={k: os.environ.get(k) for k in ("XLA_FLAGS", "NCCL_NVLS_ENABLE",
                                                     "XLA_PYTHON_CLIENT_PREALLOCATE")})
    for name in names:
        shape, formats = table[name]
        moe = jnn.MoE(shape["hidden"], shape["intermediate"], shape["experts"],
                      shape["top_k"], rngs=nnx.Rngs(0))
        for fmt in (args.formats.split(",") if args.formats else formats):
            rows += bench_format(name, fmt, moe, shape, tokens, devices, counts, placements,
                                 timing, args.exchange)
            with open(stem + ".json", "w") as f:  # keep what was measured if the run is cut
                json.dump(dict(meta=meta, rows=rows), f, indent=1)
        del moe
    print(f"wrote {stem}.json")
    plot(rows, stem + ".png")


if __name__ == "__main__":
    main()
