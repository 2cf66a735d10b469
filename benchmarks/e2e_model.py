"""Time one decode step of a Llama-3-8B-shaped model (or, with --moe, a Qwen3-30B-A3B-shaped
mixture of experts): block-scaled weights (weight-only `jbs.gemm` / `jbs.ragged_gemm`, bf16
activations) against the same model in bf16, scanned (and optionally unrolled) layers, batch
1 / 16 / 64.

    python benchmarks/e2e_model.py --out /tmp/e2e                      # GPU: 16 layers, nvfp4
    python benchmarks/e2e_model.py --formats nvfp4,mxfp4,mxfp8_e4m3 --compare-unrolled
    python benchmarks/e2e_model.py --moe --compare-unrolled --out /tmp/e2e   # GPU: 8 MoE layers
    python benchmarks/e2e_model.py --tiny --out /tmp/e2e_smoke         # CPU smoke run
    python benchmarks/e2e_model.py --tiny --moe --out /tmp/e2e_smoke   # CPU smoke run, MoE
    python benchmarks/e2e_model.py --moe --devices 2 --out /tmp/e2e    # GPU: + 2 GPUs, dispatch
    XLA_FLAGS=--xla_force_host_platform_device_count=2 JAX_PLATFORMS=cpu \
        python benchmarks/e2e_model.py --tiny --moe --devices 2 --out /tmp/e2e_smoke  # CPU
    python benchmarks/e2e_model.py --breakdown --compare-unrolled --out /tmp/e2e  # + kernels
    python benchmarks/e2e_model.py --breakdown --attention xla --tag e2e_model_xla_attn  # before

The model is examples/llama/model.py: hidden 4096, 32 query / 8 key-value heads of 128, MLP
14336 (SwiGLU), --layers layers (default 16), a --vocab-sized embedding and bf16 LM head (small
by default: the vocabulary projection is the same in every variant and not what is compared).
Weights are random; the quantized model is the bf16 model's weights quantized per layer (NVFP4:
one global scale per layer, blocked scales), the embedding, norms and LM head stay as they are.

--moe: hidden 2048, 32 query / 4 key-value heads of 128, every MLP a sparse block of 128
SwiGLU experts of width 768, top-8 (Qwen3-30B-A3B's shapes; --layers of its 48, default 8).
The bf16 model's MLP is `jax_blockscale.nn.MoE` (bf16 `lax.ragged_dot` experts), the quantized
one `jax_blockscale.nn.QuantizedMoE` (the same experts quantized by `quantize_experts`: NVFP4
with one global scale per expert, `ragged_gemm`); the router stays bf16 in both.

A decode step: B new tokens (one per sequence, distinct random ids, so an MoE routes them to
different experts as real traffic does) at position --pos of a KV cache of --max-len positions
(bf16), all layers, the LM head and the greedy next token, under one `jax.jit`, the cache
donated and updated in place (the step is called on its own output cache, as in serving).

Timing: benchmarks/timing.py. "device": GPU kernel time per step from a profiler trace (the
number to compare: no host cost); "loop": median over --trials of the mean of --iters
back-to-back steps from Python (host and dispatch cost included). Prints a table; writes
<tag>.json and <tag>.png under --out. "weight_bytes": the projection weights a step must read
(elements and block scales, all layers); for an MoE, the attention, the router and the experts
a batch is expected to hit if its B * k choices were uniform and independent
(E * (1 - (1 - k/E)^B) per layer: 8, 82 and 126 of 128 experts at batch 1, 16, 64).
--breakdown adds each row's GPU kernels from the same trace (time and launches per step and per
layer, most time first), printed after the table and stored as the row's "kernels".

--devices N (with --moe; default 1, one device only): the block-scaled model's step also runs
expert parallel over the first N devices, dispatching tokens: a `jax.sharding.Mesh` of them with
one axis "expert", every MoE layer `QuantizedMoE(..., mesh=mesh, expert_axis="expert")`
(`jax_blockscale.ragged.dispatch`: each device routes its share of the tokens and sends each
(token, expert) row only to the device holding that expert, and back; ragged_all_to_all on GPUs,
a padded all_to_all on CPUs; --exchange reduce: every device keeps every token, runs its own
experts' rows and the shares are summed across devices), its gate_up and down weights
(elements, blocked scales, per-expert global scales) split on their expert dim
(``P("expert")``), everything else (embedding, attention, norms, routers, LM head, KV cache,
tokens) replicated; the model pins each MoE layer's input and output replicated, so attention
runs on every token on every device, as on one. The dispatched layer runs one layer's experts
(it takes no ``layer=`` into a scanned stack), so the sharded step has its layers unrolled, and
the run times the unrolled 1-device step too (--devices N > 1 implies --compare-unrolled). Every
row records "devices" and "placement" ("1 device", "dispatch", or "reduce" with --exchange
reduce, "tensor" with --exchange tensor: tensor parallel instead, `QuantizedMoE(..., mesh=mesh,
tensor_axis="expert")`, gate_up split on N and down on K of its re-laid experts); a sharded
row (mode "unrolled") also has speedup_vs_1_device (the 1-device unrolled step of the same
format and batch over it) and its logits for one step from a fresh cache
against that 1-device step's: max_abs_diff_vs_1_device, differing_logits (bitwise) and
same_next_tokens (the dispatched layer is built to equal one device bit for bit, 0 on CPU
devices; the reduce layer to f32 rounding; the tensor-parallel layer to the bf16 rounding of its
expert outputs). Its device_us is the time per step during which any
of the N GPUs ran a kernel (the trace holds every GPU's streams; --breakdown sums their
kernels), its weight_bytes all devices' together. tokens/s: batch / step time, as for one
device.
Output: <tag> defaults to e2e_model_moe_<platform>_x<N>. N beyond the devices present, N not
dividing the experts, or N > 1 without --moe stops with an error naming --devices.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples",
                                "llama"))
from model import (EXPERT_WEIGHTS, Llama, LlamaConfig, init_cache,  # noqa: E402
                   quantize_params, random_params)
from plotting import pyplot  # noqa: E402
from timing import gpu_kernel_events, time_us, union_length  # noqa: E402

import jax_blockscale as jbs  # noqa: E402
from jax_blockscale.ragged.dispatch import EXCHANGES  # noqa: E402

EXPERT_AXIS = "expert"  # the mesh axis --devices shards the experts (--exchange tensor: their
# intermediate features) over


@functools.partial(jax.jit, static_argnums=0, donate_argnums=3)
def decode_step(graphdef, state, tokens, cache, pos):
    """One decode step: logits for tokens (B, 1) at `pos`, the greedy next token, the cache."""
    logits, cache = nnx.merge(graphdef, state)(tokens, cache, pos)
    return jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32), cache


@functools.partial(jax.jit, static_argnums=0)
def step_logits(graphdef, state, tokens, cache, pos):
    """The decode step's logits (B, V) in f32 (the cache not donated)."""
    logits, _ = nnx.merge(graphdef, state)(tokens, cache, pos)
    return logits[:, -1]


class Stepper:
    """Calls decode_step on its own previous cache (donated, so updated in place), like a
    serving loop; a no-argument callable for timing.time_us / device_time_us. replicated: a
    sharding for the tokens and the cache (a sharded model's mesh, everything on every device),
    or None (the default device)."""

    def __init__(self, model, batch, max_len, pos, replicated=None):
        self.graphdef, self.state = nnx.split(model)
        self.place = ((lambda a: a) if replicated is None else
                      (lambda a: jax.device_put(a, replicated)))
        self.new_cache = lambda: self.place(init_cache(model.cfg, batch, max_len, model.dtype))
        self.cache = self.new_cache()
        # distinct tokens per sequence: identical ones would all route to the same k experts
        self.tokens = self.place(jax.random.randint(jax.random.key(batch), (batch, 1), 0,
                                                    model.cfg.vocab_size, jnp.int32))
        self.pos = self.place(jnp.int32(pos))

    def __call__(self):
        tok, self.cache = decode_step(self.graphdef, self.state, self.tokens, self.cache,
                                      self.pos)
        return tok

    def logits(self):
        """The step's logits (B, V) f32 from a fresh cache (the same for every model of a
        config and batch, whatever was timed before), on the host."""
        return np.asarray(step_logits(self.graphdef, self.state, self.tokens, self.new_cache(),
                                      self.pos))


def matrix_bytes(n: int, k: int, fmt: str) -> int:
    """Bytes of one (N, K) weight: elements + unpadded block scales."""
    if fmt == "bf16":
        return 2 * n * k
    f = jbs.get_format(fmt)
    bits = 4 if f.element_bits == 4 else 8 * f.storage_dtype.itemsize
    return n * k * bits // 8 + n * (k // f.block) * f.scale_dtype.itemsize


def experts_hit(cfg: LlamaConfig, batch: int) -> float:
    """Expected distinct experts a batch of single tokens hits in one layer, if each token's k
    choices were uniform and independent of the others'."""
    e, k = cfg.num_experts, cfg.num_experts_per_tok
    return e * (1 - (1 - k / e) ** batch)


def weight_bytes(cfg: LlamaConfig, fmt: str, batch: int = 1) -> int:
    """Bytes of the projection weights one step reads (elements + unpadded scales), all layers;
    for an MoE the bf16 router and the expected experts hit (`experts_hit`)."""
    total = sum(matrix_bytes(*cfg.projection_shape(name), fmt) for name in cfg.projections)
    if cfg.is_moe:
        one_expert = sum(matrix_bytes(*cfg.expert_shape(name), fmt) for name in EXPERT_WEIGHTS)
        total += 2 * cfg.hidden_size * cfg.num_experts + experts_hit(cfg, batch) * one_expert
    return int(total * cfg.num_hidden_layers)


def model_on_gpu(model) -> bool:
    return any(d.platform == "gpu" for leaf in jax.tree.leaves(nnx.state(model))
               for d in getattr(leaf, "devices", lambda: ())())


def bench(model, fmt, mode, batch, args, cfg, mesh=None, logits=None):
    """One row: the model's decode step at `batch`, timed. mesh: the model's MoE layers are
    sharded over it (placement `placement_name(args.exchange)`); None: one device. logits: a
    dict to store the step's logits in under (fmt, batch) (a 1-device unrolled row, the
    reference), or to compare them with (a sharded row)."""
    replicated = None if mesh is None else NamedSharding(mesh, P())
    step = Stepper(model, batch, args.max_len, args.pos, replicated)
    start = time.perf_counter()
    jax.block_until_ready(step())  # compile
    compile_s = time.perf_counter() - start
    devices = 1 if mesh is None else mesh.size
    row = dict(fmt=fmt, mode=mode, batch=batch, devices=devices,
               placement="1 device" if mesh is None else placement_name(args.exchange),
               compile_s=round(compile_s, 2), weight_bytes=weight_bytes(cfg, fmt, batch))
    if logits is not None:
        got = step.logits()
        if mesh is None:
            logits[(fmt, batch)] = got
        elif (fmt, batch) in logits:
            want = logits[(fmt, batch)]
            row["max_abs_diff_vs_1_device"] = float(np.max(np.abs(got - want)))
            row["differing_logits"] = int(np.sum(got.view(np.uint32) != want.view(np.uint32)))
            row["same_next_tokens"] = bool(np.array_equal(got.argmax(-1), want.argmax(-1)))
    if cfg.is_moe:
        row["experts_hit_est"] = round(experts_hit(cfg, batch), 1)
    row["loop_us"] = time_us(step, iters=args.iters, trials=args.trials)
    # the profiler trace holds GPU kernel times only: skip it elsewhere (it costs seconds)
    events = gpu_kernel_events(step, calls=args.calls) if model_on_gpu(model) else []
    if events:
        dev = union_length([(s, e) for _, s, e in events]) / args.calls / 1e3
        row["device_us"] = dev
        row["weight_TBps"] = row["weight_bytes"] / (dev * 1e-6) / 1e12
        if args.breakdown:
            row["kernels"] = kernel_breakdown(events, args.calls, cfg.num_hidden_layers)
    clock = row.get("device_us", row["loop_us"])
    row["tokens_per_s"] = batch / (clock * 1e-6)
    return row


def placement_name(exchange: str) -> str:
    """A sharded row's placement: "reduce" (every device keeps every token, one all-reduce of
    the combined outputs), "tensor" (every device holds I/N of every expert's features, one
    all-reduce of the combined partial outputs) or "dispatch" (rows sent to their experts'
    devices and back)."""
    return exchange if exchange in ("reduce", "tensor") else "dispatch"


def place_on_mesh(model, mesh, axis: str, tensor: bool = False):
    """The model with its MoE expert weights (elements, blocked scales, per-expert global
    scales of every layer's gate_up and down) split on their leading expert dim over mesh axis
    `axis` (tensor: gate_up's elements and scales on their N dim, down's on their K dim, the
    global scales replicated, as the tensor-parallel layer reads them), and every other array
    (embedding, attention, norms, routers, LM head) replicated on the mesh."""
    graphdef, state = nnx.split(model)

    def put(path, leaf):
        names = [str(getattr(k, "key", getattr(k, "name", k))) for k in path]
        which = [w for w in ("gate_up", "down") if w in names]
        spec = P()
        if "mlp" in names and which and jnp.ndim(leaf) >= 1:
            spec = P(axis)
            if tensor:
                spec = P() if jnp.ndim(leaf) == 1 else (
                    P(None, axis) if which[0] == "gate_up" else P(None, None, axis))
        return jax.device_put(leaf, NamedSharding(mesh, spec))

    return nnx.merge(graphdef, jax.tree_util.tree_map_with_path(put, state))


def kernel_breakdown(events, calls: int, layers: int, top: int = 25) -> list[dict]:
    """The step's GPU kernels by name, most time first: microseconds and launches per step,
    launches per layer (the launch count is what a fused or persistent kernel would remove).
    A kernel launched with programmatic dependent launch (the sm90 decode kernel's split-K
    finalize) starts while the kernel before it runs and waits for it: its time overlaps that
    kernel's, so the rows add up to more than the step's device time."""
    per_name: dict[str, list[float]] = {}
    for name, s, e in events:
        per_name.setdefault(name, []).append((e - s) / 1e3)
    rows = [dict(kernel=name[:120], us_per_step=round(sum(d) / calls, 2),
                 launches_per_step=round(len(d) / calls, 2),
                 launches_per_layer=round(len(d) / calls / layers, 2))
            for name, d in per_name.items()]
    rows.sort(key=lambda r: -r["us_per_step"])
    return rows[:top]


def print_breakdown(rows):
    for r in rows:
        if "kernels" not in r:
            continue
        print(f"\n{r['fmt']} {r['mode']} batch {r['batch']}: {r.get('device_us', 0):.0f} us")
        for k in r["kernels"][:12]:
            print(f"  {k['us_per_step']:9.1f} us  {k['launches_per_step']:6.1f} x "
                  f"({k['launches_per_layer']:.2f} / layer)  {k['kernel'][:80]}")


def add_ratios(rows):
    """speedup_vs_bf16: the bf16 step time / this one (same mode, batch and devices);
    scan_over_unrolled: scanned time / unrolled time (same format, batch and devices);
    speedup_vs_1_device (sharded rows): the 1-device step time / this one (same format, mode
    and batch). Device time when there is one."""
    def clock(r):
        return r.get("device_us", r["loop_us"])
    by = {(r["fmt"], r["mode"], r["batch"], r["devices"]): r for r in rows}
    for r in rows:
        n = r["devices"]
        base = by.get(("bf16", r["mode"], r["batch"], n))
        if base is not None:
            r["speedup_vs_bf16"] = clock(base) / clock(r)
        unrolled = by.get((r["fmt"], "unrolled", r["batch"], n))
        if r["mode"] == "scan" and unrolled is not None:
            r["scan_over_unrolled"] = clock(r) / clock(unrolled)
        one = by.get((r["fmt"], r["mode"], r["batch"], 1))
        if n > 1 and one is not None:
            r["speedup_vs_1_device"] = clock(one) / clock(r)


def print_table(rows):
    dev = any("device_us" in r for r in rows)
    sharded = any(r["devices"] > 1 for r in rows)
    head = ["format", "layers", "devices" if sharded else "", "batch",
            "device us" if dev else "", "loop us", "vs bf16", "scan/unrolled",
            "vs 1 device" if sharded else "", "max diff" if sharded else "",
            "weights TB/s" if dev else "", "tokens/s"]
    print("\n| " + " | ".join(h for h in head if h) + " |")
    print("|" + "---|" * sum(1 for h in head if h))
    for r in rows:
        cells = [r["fmt"], r["mode"]]
        if sharded:
            cells.append(f"{r['devices']} ({r['placement']})" if r["devices"] > 1 else "1")
        cells.append(str(r["batch"]))
        if dev:
            cells.append(f"{r['device_us']:.0f}" if "device_us" in r else "-")
        cells += [f"{r['loop_us']:.0f}", f"{r['speedup_vs_bf16']:.2f}x"
                  if "speedup_vs_bf16" in r else "-",
                  f"{r['scan_over_unrolled']:.3f}" if "scan_over_unrolled" in r else "-"]
        if sharded:
            cells += [f"{r['speedup_vs_1_device']:.2f}x" if "speedup_vs_1_device" in r else "-",
                      f"{r['max_abs_diff_vs_1_device']:.3g}"
                      if "max_abs_diff_vs_1_device" in r else "-"]
        if dev:
            cells.append(f"{r['weight_TBps']:.2f}" if "weight_TBps" in r else "-")
        cells.append(f"{r['tokens_per_s']:.4g}")
        print("| " + " | ".join(cells) + " |")


def plot(rows, title, path):
    """Step time per batch size, one bar per (format, layers mode, devices). Rows without
    "devices" (e2e_decode.py's) ran on one device."""
    plt = pyplot()
    if plt is None:
        return
    rows = [dict(r, devices=r.get("devices", 1)) for r in rows]
    key = "device_us" if any("device_us" in r for r in rows) else "loop_us"
    series = list(dict.fromkeys((r["fmt"], r["mode"], r["devices"]) for r in rows))
    batches = sorted({r["batch"] for r in rows})
    width = 0.8 / len(series)
    fig, ax = plt.subplots(figsize=(max(6, 2.2 * len(batches)), 4.2))
    for i, (fmt, mode, n) in enumerate(series):
        vals = [next((r[key] for r in rows if (r["fmt"], r["mode"], r["batch"], r["devices"])
                      == (fmt, mode, b, n) and key in r), 0.0) for b in batches]
        xs = [j + (i - (len(series) - 1) / 2) * width for j in range(len(batches))]
        label = f"{fmt}, {mode}" + (f", {n} devices (dispatch)" if n > 1 else "")
        bars = ax.bar(xs, vals, width, label=label)
        ax.bar_label(bars, fmt="%.0f", fontsize=6)
    ax.set_xticks(range(len(batches)), [f"batch {b}" for b in batches])
    ax.set_ylabel(("device" if key == "device_us" else "Python-loop") + " time per step (us)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)
    ax.grid(True, axis="y", lw=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=None,
                   help="decoder layers (default 16, --moe 8; tiny 2)")
    p.add_argument("--moe", action="store_true", help="a mixture-of-experts model "
                   "(Qwen3-30B-A3B's shapes; tiny: 4 experts, top-2)")
    p.add_argument("--batches", default=None, help="comma list (default 1,16,64; tiny 1,2)")
    p.add_argument("--formats", default="nvfp4",
                   help="comma list of block-scaled formats timed against bf16 (e.g. "
                   "nvfp4,mxfp4,mxfp8_e4m3)")
    p.add_argument("--vocab", type=int, default=None, help="vocabulary (default 8192; tiny 97)")
    p.add_argument("--max-len", type=int, default=None, help="KV cache length (default 512)")
    p.add_argument("--pos", type=int, default=None, help="decode position (default max-len/2)")
    p.add_argument("--compare-unrolled", action="store_true",
                   help="also time every model with its layers unrolled (no lax.scan)")
    p.add_argument("--tiny", action="store_true", help="tiny shapes, few calls (CPU smoke run)")
    p.add_argument("--iters", type=int, default=None, help="steps per trial (default 20)")
    p.add_argument("--trials", type=int, default=None, help="trials, median (default 5)")
    p.add_argument("--calls", type=int, default=None, help="profiled steps (default 10)")
    p.add_argument("--breakdown", action="store_true",
                   help="record and print the step's GPU kernels (time and launches per step "
                   "and per layer) from the profiler trace")
    p.add_argument("--attention", choices=("auto", "xla", "cudnn"), default="auto",
                   help="the model's decode attention (examples/llama/model.py attend): auto "
                   "(cuDNN's fused kernel on Hopper+, XLA's elsewhere), xla, cudnn")
    p.add_argument("--devices", type=int, default=1,
                   help="with --moe: also run the step with its MoE layers expert parallel over "
                   "the first N devices, dispatching tokens (QuantizedMoE(mesh=, expert_axis=), "
                   "layers unrolled), beside the 1-device step (default 1: one device only)")
    p.add_argument("--exchange", choices=EXCHANGES + ("tensor",), default="auto",
                   help="with --devices N > 1: the MoE layers' exchange (QuantizedMoE "
                   "exchange=): auto / ragged / padded dispatch rows to their experts' devices "
                   "(placement 'dispatch'); reduce keeps every token on every device and "
                   "all-reduces the combined outputs (placement 'reduce'); tensor: tensor "
                   "parallel instead (QuantizedMoE(mesh=, tensor_axis=): every device holds I/N "
                   "of every expert's features; placement 'tensor')")
    p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    p.add_argument("--tag", default=None, help="file name stem (default e2e_model_<platform>)")
    args = p.parse_args(argv)
    if args.devices < 1:
        p.error(f"--devices must be at least 1, got {args.devices}")
    if args.devices > 1 and not args.moe:
        p.error("--devices N > 1 needs --moe: only the MoE layers are sharded (expert "
                "parallel, dispatching tokens)")
    present = jax.devices()
    if args.devices > len(present):
        p.error(f"--devices {args.devices} needs {args.devices} devices and found "
                f"{len(present)} ({present[0].device_kind}); run it on a machine with that many "
                "GPUs, or force CPU devices (XLA_FLAGS=--xla_force_host_platform_device_count="
                f"{args.devices} JAX_PLATFORMS=cpu)")

    tiny = args.tiny
    layers = args.layers or (2 if tiny else 8 if args.moe else 16)
    if tiny:
        cfg = (LlamaConfig.tiny_moe if args.moe else LlamaConfig.tiny)(num_layers=layers)
        if args.vocab:
            cfg = LlamaConfig(**{**cfg.__dict__, "vocab_size": args.vocab})
    else:
        cfg = (LlamaConfig.qwen3_30b_a3b if args.moe else LlamaConfig.llama3_8b)(
            num_layers=layers, vocab_size=args.vocab or 8192)
    batches = [int(b) for b in (args.batches or ("1,2" if tiny else "1,16,64")).split(",")]
    args.max_len = args.max_len or (32 if tiny else 512)
    args.pos = args.max_len // 2 if args.pos is None else args.pos
    args.iters = args.iters or (3 if tiny else 20)
    args.trials = args.trials or (2 if tiny else 5)
    args.calls = args.calls or (3 if tiny else 10)
    formats = ["bf16"] + [f for f in args.formats.split(",") if f and f != "bf16"]
    for f in formats[1:]:
        jbs.get_format(f)  # an unknown name fails before anything is built
    modes = ["scan", "unrolled"] if args.compare_unrolled else ["scan"]
    mesh = None
    if args.devices > 1:
        if cfg.num_experts % args.devices and args.exchange != "tensor":
            p.error(f"--devices {args.devices}: the {cfg.num_experts} experts per layer do not "
                    "split evenly over that many devices")
        if len(formats) == 1:
            p.error("--devices N > 1 shards block-scaled experts: give a block-scaled format "
                    "in --formats")
        mesh = Mesh(np.asarray(present[:args.devices]), (EXPERT_AXIS,))
        # the dispatched layer runs one layer's experts (no layer= in a scan): the sharded step
        # is unrolled, and its 1-device baseline is the unrolled step
        modes = ["scan", "unrolled"]

    device = jax.devices()[0]
    print(f"jax {jax.__version__}, {device.device_kind}"
          f"{f' x {args.devices}' if mesh is not None else ''}; {cfg}", flush=True)
    os.makedirs(args.out, exist_ok=True)
    stem = os.path.join(args.out, args.tag or
                        f"e2e_model{'_moe' if args.moe else ''}_{device.platform}"
                        f"{f'_x{args.devices}' if mesh is not None else ''}")
    meta = dict(jax=jax.__version__, device=device.device_kind, platform=device.platform,
                config=cfg.__dict__, max_len=args.max_len, pos=args.pos,
                attention=args.attention,
                timing=dict(iters=args.iters, trials=args.trials, calls=args.calls,
                            method="benchmarks/timing.py: loop_us = median over trials of the "
                            "mean of back-to-back jitted decode steps (host cost included); "
                            "device_us = GPU kernel time per step from a profiler trace"))
    if cfg.is_moe:
        meta["mlp"] = ("bf16: jax_blockscale.nn.MoE (bf16 lax.ragged_dot experts); block-scaled: "
                       "jax_blockscale.nn.QuantizedMoE (weight-only ragged_gemm, NVFP4 with one "
                       "global scale per expert); router bf16 in both. weight_bytes counts the "
                       "experts_hit_est experts per layer (uniform independent routing)")
    if mesh is not None and args.exchange == "tensor":
        meta["devices"] = args.devices
        meta["sharded"] = (
            f"placement 'tensor': every MoE layer QuantizedMoE(mesh=, tensor_axis="
            f"{EXPERT_AXIS!r}) over the first {args.devices} devices "
            "(jax_blockscale.ragged.tensor_parallel: every device holds I/N of every expert's "
            "intermediate features, gate and up paired, runs every routed row through them, "
            "and the combined f32 partial outputs are summed across devices), the layers "
            "unrolled; gate_up split on N and down on K of their re-laid layout, everything "
            "else replicated. device_us, weight_bytes, speedup_vs_1_device and the logits' "
            "comparison as for the expert-parallel placements")
    elif mesh is not None:
        meta["devices"] = args.devices
        meta["sharded"] = (
            f"placement {placement_name(args.exchange)!r}: every MoE layer QuantizedMoE(mesh=, "
            f"expert_axis={EXPERT_AXIS!r}, exchange={args.exchange!r}) over the first "
            f"{args.devices} devices (jax_blockscale.ragged.dispatch: 'reduce' keeps every "
            "token on every device, runs each device's experts' rows and all-reduces the "
            "combined outputs; the others route each device's share of the tokens and send each "
            "(token, expert) row to the device holding that expert, 'auto': ragged_all_to_all "
            "on GPUs, a padded all_to_all elsewhere), the layers unrolled "
            "(the dispatched layer takes one layer's experts, not a scanned stack's layer=); "
            "the expert weights (elements, blocked scales, global scales) split P("
            f"{EXPERT_AXIS!r}) on their expert dim, everything else replicated. device_us: "
            "the time per step during which any of the devices ran a kernel; weight_bytes: all "
            "devices together. speedup_vs_1_device: the 1-device unrolled step of the same "
            "format and batch over this one; max_abs_diff_vs_1_device / differing_logits / "
            "same_next_tokens: one step's logits from a fresh cache against that step's")

    float_params = random_params(cfg, jax.random.key(0), jnp.bfloat16)
    rows = []
    logits = {}  # (fmt, batch) -> the 1-device unrolled step's logits, for the sharded rows
    for fmt in formats:
        params = float_params if fmt == "bf16" else quantize_params(float_params, fmt)
        # (layers mode, mesh): the 1-device runs, then the sharded one for a block-scaled format
        runs = [(mode, None) for mode in modes]
        if mesh is not None and fmt != "bf16":
            runs.append(("unrolled", mesh))
        for mode, on in runs:
            placement = (None if on is None else
                         dict(mesh=on, tensor_axis=EXPERT_AXIS) if args.exchange == "tensor" else
                         dict(mesh=on, expert_axis=EXPERT_AXIS, exchange=args.exchange))
            model = Llama(cfg, params, scan_layers=mode == "scan", dtype=jnp.bfloat16,
                          attention=args.attention, moe_placement=placement)
            if on is not None:
                model = place_on_mesh(model, on, EXPERT_AXIS, tensor=args.exchange == "tensor")
            check = logits if mesh is not None and mode == "unrolled" and fmt != "bf16" else None
            for batch in batches:
                rows.append(bench(model, fmt, mode, batch, args, cfg, on, check))
                print(json.dumps(rows[-1]), flush=True)
                add_ratios(rows)
                with open(stem + ".json", "w") as f:  # keep what was measured if the run is cut
                    json.dump(dict(meta, rows=rows), f, indent=1)
            del model
        del params
    print_table(rows)
    print_breakdown(rows)
    shape = "Qwen3-30B-A3B-shaped MoE" if args.moe else "Llama-3-8B-shaped"
    plot(rows, f"{device.device_kind}, jax {jax.__version__}: {shape} decode step, "
         f"{cfg.num_hidden_layers} layers" if not tiny else "tiny smoke run", stem + ".png")
    print(f"wrote {stem}.json")


if __name__ == "__main__":
    main()
