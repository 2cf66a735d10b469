"""A decoder step's linear layers at Llama-3-8B shapes: bf16 against block-scaled weights, the
whole step under one `jax.jit`, with a per-kernel breakdown and each GEMM timed alone.

    python benchmarks/e2e_decode.py --out /tmp/e2e_decode          # GPU: 16 layers, batch 1/16/64
    python benchmarks/e2e_decode.py --scan                         # + layers scanned (layer=i)
    python benchmarks/e2e_decode.py --tiny --out /tmp/smoke        # CPU smoke run

The step (what issue 27 measures): --layers layers of RMSNorm -> fused QKV (6144 x 4096) -> O
(4096 x 4096, fed the Q part of QKV: attention itself is left out) -> residual -> RMSNorm ->
fused gate+up (28672 x 4096) -> SwiGLU -> down (4096 x 14336) -> residual, for a batch of
single-token rows. Variants: bf16 weights (`jnp.dot`, f32 accumulation); NVFP4 and MXFP4
weight-only (bf16 activations); NVFP4 W4A4 (each GEMM's activation quantized to NVFP4 in the
step, its global scale calibrated per call); NVFP4 W4A4 static (each activation's global scale
given, as a W4A4 checkpoint's `input_scale`: calibrated once here, on one weight-only step at
batch 16, amax / 2688 per layer and GEMM); MXFP8 weight-only. Layers unrolled; with --scan also
scanned over stacked weights with `jbs.gemm(x, stack, layer=i)`.

Per step: device time (GPU kernel time from a profiler trace, benchmarks/timing.py), the bytes
it must read (all layers' weights: elements and block scales), their rate against the
device's copy bandwidth, the speedup over bf16 and the GPU kernels (time and launches per step
and per layer). Per GEMM (the four shapes at 1, 16 and 64 rows, each alone): device time, the
bytes it must move, the read floor (a jitted reduction over as many bytes,
benchmarks/sweep.py: read_time_us) and bf16 `jnp.dot`. The issue's targets are printed beside
the numbers. Writes <tag>.json and <tag>.png under --out.

The bound (`bounds` in the JSON): the step's time if every block-scaled GEMM took its read floor
(alone, at the step's rows) and the step's other kernels (RMSNorm, residuals, SwiGLU, the split
sums fused into them, an activation quantizer) took what they took; bf16's step over it is the
most any GEMM kernel could give without also removing those kernels.
    python benchmarks/e2e_decode.py --from-json benchmarks/results/e2e_decode_h100.json
prints the tables and the bound of a saved run.
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
import jax_blockscale as jbs  # noqa: E402
from e2e_model import kernel_breakdown, plot, print_breakdown  # noqa: E402
from sweep import bytes_moved, copy_probe, quantized_bytes, read_time_us  # noqa: E402
from timing import copies, device_time_us, gpu_kernel_events, rotation_count, time_us  # noqa: E402

HIDDEN, FFN, QKV = 4096, 14336, 6144
SHAPES = {"qkv": (QKV, HIDDEN), "o": (HIDDEN, HIDDEN), "gate_up": (2 * FFN, HIDDEN),
          "down": (HIDDEN, FFN)}  # name: (N, K), weights (out, in)
# variant: (weight format or None for bf16, activation format or None). W4A4 quantizes the
# activation in the GEMM's call (`gemm(x, w, quantize_a="nvfp4")`); ":static" with the layer's
# given input scale (`a_global_scale=`); ":composed": written out, `gemm(jbs.quantize(x,
# "nvfp4"), w)`, the same numbers (not run by default).
VARIANTS = {"bf16": (None, None), "nvfp4": ("nvfp4", None), "nvfp4_w4a4": ("nvfp4", "nvfp4"),
            "nvfp4_w4a4_static": ("nvfp4", "nvfp4:static"),
            "mxfp4": ("mxfp4", None), "mxfp8": ("mxfp8_e4m3", None),
            "nvfp4_w4a4_composed": ("nvfp4", "nvfp4:composed"),
            "nvfp4_w4a4_static_composed": ("nvfp4", "nvfp4:static:composed")}
DEFAULT_VARIANTS = ("bf16", "nvfp4", "nvfp4_w4a4", "nvfp4_w4a4_static", "mxfp4", "mxfp8")
# The step targets (H100): speedup over bf16 at batch 1 / 16 / 64 (W4A4: within x of
# weight-only NVFP4).
TARGETS = {"nvfp4": {1: 3.2, 16: 2.8, 64: 2.0}, "mxfp8": {1: 1.8, 16: 1.6, 64: 1.2}}
W4A4_WITHIN = {1: 1.10, 16: 1.10, 64: 1.15}

quantize = jax.jit(jbs.quantize, static_argnames=("fmt", "global_scale", "layout"))


def make_weights(variant, layers, scale, seed=0):
    """{name: per-layer list of weights} (bf16 arrays or BlockScaled (N, K), NVFP4 one global
    scale per matrix)."""
    fmt, _ = VARIANTS[variant]
    key = jax.random.PRNGKey(seed)
    out = {}
    for name, (n, k) in SHAPES.items():
        n, k = n // scale, k // scale
        ws = []
        for _ in range(layers):
            key, sub = jax.random.split(key)
            w = jax.random.normal(sub, (n, k), jnp.float32) * (0.5 / np.sqrt(k))
            ws.append(w.astype(jnp.bfloat16) if fmt is None else
                      quantize(w, fmt=fmt, layout="blocked"))
        out[name] = ws
    return out


def stack(weights):
    """Per-layer lists -> one stacked weight per name (BlockScaled: global scales (L,))."""
    return {name: jax.tree.map(lambda *xs: jnp.stack(xs), *ws) for name, ws in weights.items()}


class InputAmax(list):
    """An act_fmt that records each linear's input scale (amax / 2688, as "auto" would
    calibrate it) in call order and multiplies weight-only: run eagerly, once."""


def linear(x, w, act_fmt, layer=None, input_scale=None):
    if not isinstance(w, jbs.BlockScaled):
        return jnp.dot(x, w.T, preferred_element_type=jnp.float32).astype(x.dtype)
    kw = {} if layer is None else dict(layer=layer)
    if isinstance(act_fmt, InputAmax):
        act_fmt.append(jnp.max(jnp.abs(x.astype(jnp.float32))) / 2688.0)
        act_fmt = None
    if act_fmt is not None and act_fmt.endswith(":composed"):
        g = input_scale if ":static" in act_fmt else "auto"
        return jbs.gemm(jbs.quantize(x, act_fmt.split(":")[0], global_scale=g), w,
                        out_dtype=x.dtype, **kw)
    if act_fmt is not None and act_fmt.endswith(":static"):
        return jbs.gemm(x, w, out_dtype=x.dtype, quantize_a=act_fmt.split(":")[0],
                        a_global_scale=input_scale, **kw)
    return jbs.gemm(x, w, out_dtype=x.dtype, quantize_a=act_fmt, **kw)


def rms_norm(x):
    x32 = x.astype(jnp.float32)
    return (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, -1, keepdims=True) + 1e-5)).astype(x.dtype)


def layer_step(h, w, act_fmt, layer=None):
    """One decoder layer's linear part (w: this layer's weights, or the stacks and `layer`;
    w["input_scales"], where present: each GEMM's given activation scale)."""
    def lin(x, name):
        scales = w.get("input_scales")
        g = None if scales is None else scales[name] if layer is None else scales[name][layer]
        return linear(x, w[name], act_fmt, layer, g)

    n_q = w["o"].shape[-1]  # the O projection reads the Q part of QKV
    x = rms_norm(h)
    qkv = lin(x, "qkv")
    h = h + lin(qkv[:, :n_q], "o")
    x = rms_norm(h)
    gu = lin(x, "gate_up")
    ffn = gu.shape[-1] // 2
    a = (jax.nn.silu(gu[:, :ffn].astype(jnp.float32)) * gu[:, ffn:]).astype(h.dtype)
    return h + lin(a, "down")


def calibrate_input_scales(weights, hidden, batch=16):
    """Per layer, each GEMM's activation scale from one eager weight-only step on random rows:
    [{"qkv": g, "o": g, ...} per layer] (what a W4A4 checkpoint ships as input_scale)."""
    h = jax.random.normal(jax.random.PRNGKey(99), (batch, hidden), jnp.float32).astype(
        jnp.bfloat16)
    out = []
    for i in range(len(weights["qkv"])):
        rec = InputAmax()
        h = layer_step(h, {name: ws[i] for name, ws in weights.items()}, rec)
        out.append({name: jnp.float32(g) for name, g in zip(("qkv", "o", "gate_up", "down"),
                                                            rec)})
    return out


def unrolled_step(act_fmt):
    def step(h, weights):
        for i in range(len(weights["qkv"])):
            h = layer_step(h, {name: ws[i] for name, ws in weights.items()}, act_fmt)
        return h
    return jax.jit(step)


def scanned_step(act_fmt):
    """The layers scanned with the index in the carry (see docs/design/scanned_layers.md)."""
    def step(h, stacks):
        layers = stacks["qkv"].shape[0]

        def body(carry, _):
            h, i = carry
            return (layer_step(h, stacks, act_fmt, i), i + 1), None

        return jax.lax.scan(body, (h, jnp.int32(0)), None, length=layers)[0][0]
    return jax.jit(step)


def weight_bytes(variant, scale):
    fmt, _ = VARIANTS[variant]
    total = 0
    for n, k in SHAPES.values():
        n, k = n // scale, k // scale
        total += 2 * n * k if fmt is None else quantized_bytes(fmt, n, k)
    return total


def copy_bandwidth_TBps(on_gpu, timing):
    """Copy bandwidth of sweep's `copy_probe`, in device time on a GPU."""
    f, x, nbytes = copy_probe(on_gpu)
    us = device_time_us(f, x) if on_gpu else time_us(f, x, **timing)
    return nbytes / us / 1e6


def time_step(f, args, on_gpu, calls, timing):
    if not on_gpu:
        return dict(loop_us=time_us(f, *args, **timing))
    events = gpu_kernel_events(f, *args, calls=calls)
    from timing import union_length
    return dict(device_us=union_length([(s, e) for _, s, e in events]) / calls / 1e3,
                events=events)


def per_gemm_rows(variants, rows_list, scale, on_gpu, timing):
    """Each GEMM alone: device time, bytes, read floor, bf16 dot (weights rotated past L2)."""
    floors, out = {}, []
    for name, (n, k) in SHAPES.items():
        n, k = n // scale, k // scale
        key = jax.random.PRNGKey(hash(name) % 1000)
        w32 = jax.random.normal(key, (n, k), jnp.float32) / np.sqrt(k)
        for m in rows_list:
            x = jax.random.normal(jax.random.PRNGKey(m), (m, k), jnp.float32).astype(jnp.bfloat16)
            for variant in variants:
                fmt, act = VARIANTS[variant]
                w = w32.astype(jnp.bfloat16) if fmt is None else quantize(w32, fmt=fmt,
                                                                          layout="blocked")
                g = jnp.max(jnp.abs(x.astype(jnp.float32))) / 2688.0  # used by ":static"
                f = jax.jit(lambda x, w, act=act, g=g: linear(x, w, act, input_scale=g))
                method = ("bf16_dot" if fmt is None else "gemm_weight_only" if act is None
                          else "gemm")
                nbytes = bytes_moved(method, fmt, m, n, k)
                sets = [(x, wi) for wi in copies(w, rotation_count(nbytes))]
                us = (device_time_us(f, arg_sets=sets) if on_gpu
                      else time_us(f, arg_sets=sets, **timing))
                floor = read_time_us(nbytes, floors) if on_gpu else None
                out.append(dict(gemm=name, rows=m, n=n, k=k, variant=variant, us=us,
                                bytes=nbytes, read_floor_us=floor,
                                over_floor=None if floor is None else us / floor))
                print(json.dumps(out[-1]), flush=True)
                del sets, w
    base = {(r["gemm"], r["rows"]): r["us"] for r in out if r["variant"] == "bf16"}
    for r in out:
        r["speedup_vs_bf16"] = base[(r["gemm"], r["rows"])] / r["us"]
    return out


def print_step_table(rows):
    print("\n| variant | layers | batch | us | weights TB/s (% copy bw) | vs bf16 | target |")
    print("|---|---|---|---|---|---|---|")
    by = {(r["variant"], r["mode"], r["batch"]): r for r in rows}
    for r in rows:
        target = "-"
        if r["variant"] in TARGETS and r["mode"] == "unrolled":
            target = f">= {TARGETS[r['variant']][r['batch']]}x" if r["batch"] in TARGETS[
                r["variant"]] else "-"
        if r["variant"].startswith("nvfp4_w4a4"):
            wo = by.get(("nvfp4", r["mode"], r["batch"]))
            if wo is not None and r["batch"] in W4A4_WITHIN:
                target = (f"<= {W4A4_WITHIN[r['batch']]:.2f}x weight-only "
                          f"(is {r['us'] / wo['us']:.2f}x)")
        print(f"| {r['variant']} | {r['mode']} | {r['batch']} | {r['us']:.0f} | "
              f"{r['weight_TBps']:.2f} ({r['pct_copy_bw']:.0f}%) | {r['speedup_vs_bf16']:.2f}x | "
              f"{target} |")


def is_gemm_kernel(name: str) -> bool:
    """This package's GEMM kernels in a profile (CuTeDSL kernels: the decode, fused and
    register-weight kernels; not the activation quantizer, which is CUDA C++)."""
    return name.startswith("kernel_cutlass")


def step_bounds(rows, gemms):
    """Per unrolled weight-only step with a kernel breakdown and read floors at its batch: the
    step with every GEMM at its read floor and the other kernels as measured (module doc)."""
    bf16 = {r["batch"]: r["us"] for r in rows if r["variant"] == "bf16" and r["mode"] == "unrolled"}
    out = []
    for r in rows:
        fmt, act = VARIANTS[r["variant"]]
        if fmt is None or act is not None or r["mode"] != "unrolled" or not r.get("kernels"):
            continue
        floors = [g["read_floor_us"] for g in gemms
                  if g["variant"] == r["variant"] and g["rows"] == r["batch"]]
        if len(floors) != len(SHAPES) or None in floors or r["batch"] not in bf16:
            continue
        gemm_us = sum(k["us_per_step"] for k in r["kernels"] if is_gemm_kernel(k["kernel"]))
        other_us = r["us"] - gemm_us
        at_floor_us = r["layers"] * sum(floors)
        bound = at_floor_us + other_us
        out.append(dict(variant=r["variant"], batch=r["batch"], us=r["us"], gemm_us=gemm_us,
                        other_us=other_us, gemms_at_floor_us=at_floor_us, bound_us=bound,
                        speedup_now=bf16[r["batch"]] / r["us"],
                        speedup_bound=bf16[r["batch"]] / bound,
                        target=TARGETS.get(r["variant"], {}).get(r["batch"])))
    return out


def print_bound_table(bounds):
    print("\n| variant | batch | step us | GEMM kernels | other kernels "
          "| GEMMs at their read floor | bound us | vs bf16 now | at the bound | target |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for b in bounds:
        target = "-" if b["target"] is None else f">= {b['target']}x"
        print(f"| {b['variant']} | {b['batch']} | {b['us']:.0f} | {b['gemm_us']:.0f} | "
              f"{b['other_us']:.0f} | {b['gemms_at_floor_us']:.0f} | {b['bound_us']:.0f} | "
              f"{b['speedup_now']:.2f}x | {b['speedup_bound']:.2f}x | {target} |")


def print_gemm_table(rows):
    print("\n| GEMM | rows | variant | us | MB moved | x read floor | vs bf16 |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        floor = "-" if r["over_floor"] is None else f"{r['over_floor']:.2f}"
        print(f"| {r['gemm']} {r['n']}x{r['k']} | {r['rows']} | {r['variant']} | {r['us']:.1f} "
              f"| {r['bytes'] / 1e6:.1f} | {floor} | {r['speedup_vs_bf16']:.2f}x |")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--batches", default="1,16,64")
    p.add_argument("--variants", default=",".join(DEFAULT_VARIANTS),
                   help=f"comma-separated, of {list(VARIANTS)}")
    p.add_argument("--scan", action="store_true", help="also time scanned layers (layer=i)")
    p.add_argument("--no-per-gemm", action="store_true", help="skip the per-GEMM table")
    p.add_argument("--gemm-rows", default="1,16,64", help="rows of the per-GEMM table")
    p.add_argument("--breakdown", type=int, default=12, help="kernels printed per step row")
    p.add_argument("--calls", type=int, default=10, help="profiled steps")
    p.add_argument("--tiny", action="store_true", help="1/32 of the shapes, 2 layers (CPU)")
    p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    p.add_argument("--tag", default=None, help="file name stem (default e2e_decode_<platform>)")
    p.add_argument("--from-json", default=None, metavar="FILE",
                   help="print the tables and the bound of a saved run; runs nothing")
    args = p.parse_args(argv)
    if args.from_json:
        with open(args.from_json) as f:
            saved = json.load(f)
        print_step_table(saved["steps"])
        print_gemm_table(saved["gemms"])
        print_bound_table(saved.get("bounds") or step_bounds(saved["steps"], saved["gemms"]))
        return saved["steps"], saved["gemms"]
    on_gpu = jax.default_backend() == "gpu"
    scale = 32 if args.tiny else 1
    layers = 2 if args.tiny else args.layers
    batches = [1, 2] if args.tiny else [int(b) for b in args.batches.split(",")]
    variants = [v for v in args.variants.split(",") if v]
    for v in variants:
        if v not in VARIANTS:
            p.error(f"unknown variant {v!r}; choose from {list(VARIANTS)}")
    if "bf16" not in variants:
        variants.insert(0, "bf16")  # every speedup is against it
    timing = dict(iters=3, trials=2) if args.tiny or not on_gpu else dict(iters=10, trials=3)
    copy_bw = copy_bandwidth_TBps(on_gpu, timing)
    print(f"device {jax.devices()[0]}: copy bandwidth {copy_bw:.2f} TB/s", flush=True)

    rows = []
    for variant in variants:
        weights = make_weights(variant, layers, scale)
        act = VARIANTS[variant][1]
        if act is not None and ":static" in act:
            weights["input_scales"] = calibrate_input_scales(weights, HIDDEN // scale)
        modes = [("unrolled", unrolled_step(act), weights)]
        if args.scan and VARIANTS[variant][0] is not None:
            modes.append(("scan", scanned_step(act), stack(weights)))
        nbytes = weight_bytes(variant, scale) * layers
        for batch in batches:
            h = jax.random.normal(jax.random.PRNGKey(batch), (batch, HIDDEN // scale),
                                  jnp.float32).astype(jnp.bfloat16)
            for mode, f, w in modes:
                t = time_step(f, (h, w), on_gpu, args.calls, timing)
                us = t.get("device_us", t.get("loop_us"))
                row = dict(variant=variant, mode=mode, batch=batch, layers=layers, us=us,
                           clock="device" if on_gpu else "loop", weight_bytes=nbytes,
                           weight_TBps=nbytes / us / 1e6, pct_copy_bw=100 * nbytes / us / 1e6 /
                           copy_bw)
                if "events" in t:
                    row["kernels"] = kernel_breakdown(t["events"], args.calls, layers)
                rows.append(row)
                print(json.dumps({k: v for k, v in row.items() if k != "kernels"}), flush=True)
        del weights, modes
    base = {(r["mode"] if r["mode"] == "unrolled" else "unrolled", r["batch"]): r["us"]
            for r in rows if r["variant"] == "bf16"}
    for r in rows:
        r["speedup_vs_bf16"] = base[("unrolled", r["batch"])] / r["us"]
    gemm_rows = [1, 2] if args.tiny else [int(r) for r in args.gemm_rows.split(",")]
    gemms = [] if args.no_per_gemm else per_gemm_rows(variants, gemm_rows, scale, on_gpu, timing)
    print_step_table(rows)
    bounds = step_bounds(rows, gemms)
    if gemms:
        print_gemm_table(gemms)
    if bounds:
        print_bound_table(bounds)
    print_breakdown([dict(r, fmt=r["variant"], device_us=r["us"],
                          kernels=r.get("kernels", [])[:args.breakdown])
                     for r in rows if "kernels" in r])

    os.makedirs(args.out, exist_ok=True)
    tag = args.tag or f"e2e_decode_{'h100' if on_gpu else jax.default_backend()}"
    path = os.path.join(args.out, tag + ".json")
    with open(path, "w") as f:
        json.dump(dict(jax=jax.__version__, device=str(jax.devices()[0]), layers=layers,
                       shapes={k: [v[0] // scale, v[1] // scale] for k, v in SHAPES.items()},
                       copy_bandwidth_TBps=copy_bw, targets=dict(step=TARGETS,
                                                                  w4a4_within=W4A4_WITHIN),
                       timing=("device: GPU kernel time per step from a profiler trace "
                               "(benchmarks/timing.py)" if on_gpu else
                               f"loop: benchmarks/timing.py time_us {timing}"),
                       steps=rows, gemms=gemms, bounds=bounds), f, indent=1)
    print(f"wrote {path}")
    plot([dict(r, fmt=r["variant"], device_us=r["us"]) if on_gpu else
          dict(r, fmt=r["variant"], loop_us=r["us"]) for r in rows],
         f"{layers} Llama-3-8B-shaped decoder layers (linear part), {jax.devices()[0]}",
         os.path.join(args.out, tag + ".png"))
    return rows, gemms


if __name__ == "__main__":
    main()
