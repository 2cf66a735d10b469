"""Sweep M for block-scaled GEMM against the anchors and against the device's own limits.

For each format and shape, in one process: bf16 `jnp.dot`, a jitted dequantize+dot,
`jax.nn.scaled_matmul` (the anchors, as in bench_gemm.py), and `jbs.gemm` on the backend it picks
by default, with A quantized (W4A4 / W8A8) and weight-only (bf16 A). The two ceilings are measured
in the same run: device copy bandwidth and the bf16 matmul peak. Prints a table; writes JSON and a
roofline-style PNG (achieved TB/s and TFLOP/s against those ceilings) to --out.

    python benchmarks/sweep.py --quick --out /tmp/sweep   # CPU smoke run, tiny shapes
    python benchmarks/sweep.py                            # M = 1..8192 x N=K = 8192, 16384 (GPU)
    python benchmarks/sweep.py --shapes 1x16384x16384,8192x8192x8192 --formats nvfp4

Timing: benchmarks/timing.py, two numbers per method. "loop": median over --trials of the mean of
--iters back-to-back jitted calls from Python (the anchors' method: host and dispatch cost
included, ~40+ us per call on the lent hosts). "device": the GPU's kernel time per call from a
profiler trace of the same calls (no host cost: what the call costs inside a jitted model). The
speedups are given for both; the plot uses device time where there is one. Weights smaller than
~3x L2 are rotated through 2-4 copies so they are not read from L2.
Bytes counted per call: B elements + B scales (unpadded) + A (bf16, or elements + scales) + the
bf16 output; achieved TB/s = bytes / time, TFLOP/s = 2*M*N*K / time.
"""
from __future__ import annotations

import argparse
import json
import os

import jax
import jax.numpy as jnp

import jax_blockscale as jbs
from jax_blockscale.lowering.plan import plan

# the anchors and helpers of the side-by-side bench (one definition of each)
from bench_gemm import (dequant_dot, dot_bf16, lowering_platform, nn_scaled, short_error,
                        spec_of)
from plotting import pyplot
from timing import L2_BYTES, copies, device_time_us, rotation_count, time_us

DEFAULT_SHAPES = [(m, nk, nk) for nk in (8192, 16384) for m in (1, 16, 128, 1024, 8192)]
QUICK_SHAPES = [(m, nk, nk) for nk in (256, 512) for m in (1, 16, 128)]

ANCHORS = [("bf16_dot", "bf16 jnp.dot"), ("deq_dot", "dequantize+dot"),
           ("nn_scaled", "jax.nn.scaled_matmul")]
OURS = [("gemm", "jbs.gemm"), ("gemm_weight_only", "jbs.gemm, bf16 activation")]
METHODS = ANCHORS + OURS
CLOCKS = ("", "_device")  # row keys: <method>_us (Python loop), <method>_device_us (GPU kernels)

# One compiled program each (run eagerly, they compile op by op for every new shape: slow).
quantize = jax.jit(jbs.quantize, static_argnames=("fmt", "global_scale", "layout"))
normal = jax.jit(jax.random.normal, static_argnames=("shape", "dtype"))


# ---------------------------------------------------------------------------------------------
# Bytes that must move


def quantized_bytes(fmt, rows, k):
    """Elements (fp4: half a byte) + unpadded block scales of a (rows, K) operand."""
    f = jbs.get_format(fmt)
    elem_bits = 4 if f.element_bits == 4 else 8 * f.storage_dtype.itemsize  # fp6: uint8 codes
    return rows * k * elem_bits // 8 + rows * (k // f.block) * f.scale_dtype.itemsize


def bytes_moved(method, fmt, m, n, k):
    """Bytes a call must read and write at least: B, A and the bf16 output."""
    out = 2 * m * n
    if method == "bf16_dot":
        return 2 * n * k + 2 * m * k + out
    a = 2 * m * k if method == "gemm_weight_only" else quantized_bytes(fmt, m, k)
    return quantized_bytes(fmt, n, k) + a + out


# ---------------------------------------------------------------------------------------------
# Ceilings, measured in the same process


def read_time_us(nbytes, cache):
    """Device time of the cheapest program that reads `nbytes` once: a jitted max over a uint32
    array of that size (XLA's reduction streams it at the read bandwidth a kernel of this length
    can reach; rotated through copies when it would fit in L2). The floor for a decode GEMM
    that must read as many bytes: at ~150 MB the H100 reads ~3.0 TB/s (50 us; plain CUDA read
    kernels reach the same, docs/design/sm90_decode.md). Cached per size; None on CPU."""
    if nbytes not in cache:
        n = max(nbytes // 4, 1)
        xs = copies(jnp.arange(n, dtype=jnp.uint32), rotation_count(nbytes))
        cache[nbytes] = device_time_us(jax.jit(jnp.max), arg_sets=[(x,) for x in xs])
        del xs
    return cache[nbytes]


def copy_probe(on_gpu):
    """The copy-bandwidth probe: (jitted x + 1, x, bytes it reads and writes), x far beyond L2
    (1 GiB on a GPU)."""
    nbytes = 2**30 if on_gpu else 64 * 2**20
    return jax.jit(lambda x: x + 1), jnp.ones(nbytes // 4, jnp.float32), 2 * nbytes


def measure_ceilings(on_gpu, timing):
    """Copy bandwidth (`copy_probe`) and bf16 matmul peak (a square jnp.dot with f32
    accumulation, bf16 output)."""
    copy, x, copy_bytes = copy_probe(on_gpu)
    copy_us = time_us(copy, x, **timing)
    del x
    n = 8192 if on_gpu else 512
    a = normal(jax.random.PRNGKey(1), (n, n), jnp.bfloat16)
    b = normal(jax.random.PRNGKey(2), (n, n), jnp.bfloat16)
    dot_us = time_us(dot_bf16, a, b, **timing)
    return dict(copy_bytes=copy_bytes, copy_us=copy_us, copy_TBps=copy_bytes / copy_us / 1e6,
                peak_shape=[n, n, n], peak_us=dot_us,
                bf16_peak_TFLOPs=2.0 * n ** 3 / dot_us / 1e6)


# ---------------------------------------------------------------------------------------------
# One (format, shape)


def _timed(row, key, f, arg_sets, timing):
    try:
        row[key + "_us"] = time_us(f, arg_sets=arg_sets, **timing)
        device_us = device_time_us(f, arg_sets=arg_sets)
        if device_us is not None:  # None: no GPU in the trace (CPU run)
            row[key + "_device_us"] = device_us
    except Exception as e:  # noqa: BLE001  (record it: not every platform runs every method)
        row[key + "_err"] = short_error(e)


def bf16_dot_row(m, n, k, key, timing):
    """The bf16 jnp.dot anchor for a shape (the same for every format: timed once per shape)."""
    kx, kw = jax.random.split(key)
    x = normal(kx, (m, k), jnp.bfloat16)
    w = normal(kw, (n, k), jnp.bfloat16)
    ws = copies(w, rotation_count(2 * n * k))
    row = dict(bf16_weight_copies=len(ws))
    _timed(row, "bf16_dot", dot_bf16, [(x, w_) for w_ in ws], timing)
    return row


def format_token(token):
    """(format, quantize keywords) of a --formats entry. "nvfp4/none": NVFP4 quantized without
    the global (fp32) scale, so alpha == 1 and large-M calls let the GEMM write bf16 itself
    (plain "nvfp4" calibrates one: alpha != 1)."""
    fmt, _, global_scale = token.partition("/")
    return fmt, (dict(global_scale=None) if global_scale == "none" else {})


def bench_row(token, m, n, k, platform, key, timing, bf16_cache, read_cache):
    fmt, ours = format_token(token)
    ka, kb = jax.random.split(key)
    a_f = normal(ka, (m, k), jnp.float32)
    b_f = normal(kb, (n, k), jnp.float32)
    a_plain = quantize(a_f, fmt, global_scale=None)  # the anchors take plain scales
    b_plain = quantize(b_f, fmt, global_scale=None)
    a_q, b_q = quantize(a_f, fmt, **ours), quantize(b_f, fmt, layout="blocked", **ours)
    x = a_f.astype(jnp.bfloat16)
    del a_f, b_f
    n_copies = rotation_count(quantized_bytes(fmt, n, k))
    b_plains, b_qs = copies(b_plain, n_copies), copies(b_q, n_copies)

    plan_q, plan_w = plan(spec_of(a_q, b_q), platform), plan(spec_of(x, b_q), platform)
    row = dict(fmt=token, M=m, N=n, K=k, platform=platform,
               backend=plan_q.backend, backend_weight_only=plan_w.backend,
               kernel=plan_q.kernel, kernel_weight_only=plan_w.kernel,  # what the planner chose
               weight_copies=n_copies)
    if (m, n, k) not in bf16_cache:
        bf16_cache[(m, n, k)] = bf16_dot_row(m, n, k, key, timing)
    row.update(bf16_cache[(m, n, k)])
    _timed(row, "deq_dot", dequant_dot, [(a_plain, b) for b in b_plains], timing)
    _timed(row, "nn_scaled", nn_scaled, [(a_plain, b) for b in b_plains], timing)
    gemm = jax.jit(jbs.gemm)  # default backend, bf16 output
    _timed(row, "gemm", gemm, [(a_q, b) for b in b_qs], timing)
    _timed(row, "gemm_weight_only", gemm, [(x, b) for b in b_qs], timing)
    read_us = read_time_us(bytes_moved("gemm_weight_only", fmt, m, n, k), read_cache)
    if read_us is not None:
        row["read_device_us"] = read_us  # reading the weight-only call's bytes once, nothing else

    # a fast wrong answer is no result: check the default backend against the reference one
    ref = jax.jit(lambda a, b: jbs.gemm(a, b, backend="reference"))
    for key_, a, name in (("gemm", a_q, row["backend"]),
                          ("gemm_weight_only", x, row["backend_weight_only"])):
        if name != "reference" and key_ + "_us" in row:
            try:
                y, yr = gemm(a, b_q).astype(jnp.float32), ref(a, b_q).astype(jnp.float32)
                row[key_ + "_rel_err"] = float(jnp.linalg.norm(y - yr) / jnp.linalg.norm(yr))
            except Exception as e:  # noqa: BLE001  (keep the sweep going; the row says why)
                row[key_ + "_check_err"] = short_error(e)

    flops = 2.0 * m * n * k
    for method, _ in METHODS:
        row[method + "_bytes"] = bytes_moved(method, fmt, m, n, k)
        for clock in CLOCKS:  # "" (Python loop) and "_device"
            if method + clock + "_us" in row:
                t = row[method + clock + "_us"] * 1e-6
                row[method + clock + "_TBps"] = row[method + "_bytes"] / t / 1e12
                row[method + clock + "_TFLOPs"] = flops / t / 1e12
    for ours, _ in OURS:
        for anchor, _ in ANCHORS:
            for clock in CLOCKS:
                if ours + clock + "_us" in row and anchor + clock + "_us" in row:
                    row[f"{ours}{clock}_speedup_vs_{anchor}"] = (row[anchor + clock + "_us"]
                                                                 / row[ours + clock + "_us"])
    return row


# ---------------------------------------------------------------------------------------------
# Output


def print_table(rows, ceilings, clock=""):
    """One table: clock "" = Python-loop times, "_device" = GPU kernel time per call."""
    bw = ceilings["copy_TBps"]

    def us(r, k):
        return f"{r[k + clock + '_us']:9.1f}" if k + clock + "_us" in r else f"{'-':>9s}"

    def x(r, ours, anchor):
        s = r.get(f"{ours}{clock}_speedup_vs_{anchor}")
        return f"{s:5.2f}" if s is not None else f"{'-':>5s}"

    def backend(r):
        same = r["backend"] == r["backend_weight_only"]
        return r["backend"] if same else f"{r['backend']}/{r['backend_weight_only']}"

    def pct(r, k):
        return (f"{100 * r[k + clock + '_TBps'] / bw:5.0f}%" if k + clock + "_TBps" in r
                else f"{'-':>6s}")

    print("\n" + ("DEVICE TIME: GPU kernel time per call (profiler), no host cost."
                  if clock else "PYTHON LOOP: back-to-back jitted calls, host cost included."))
    print(f"copy bandwidth {bw:.3g} TB/s, bf16 peak {ceilings['bf16_peak_TFLOPs']:.3g} TFLOP/s "
          f"(measured). Times in us; speedup = anchor time / ours; BW = achieved TB/s as % of "
          f"copy bandwidth. gemm: quantized A; w-only: bf16 A."
          + (" read: device time of a jitted max over as many bytes as the w-only call must "
             "read; w/read: that time / ours." if clock else ""))
    print(f"{'fmt':11s} {'M':>5s} {'N':>6s} {'K':>6s} {'backend':>9s} | {'bf16 dot':>9s} "
          f"{'deq+dot':>9s} {'nn.scaled':>9s} {'gemm':>9s} {'w-only':>9s} | gemm x: "
          f"{'dot':>5s} {'deq':>5s} {'nn':>5s} | w-only x: {'dot':>5s} {'deq':>5s} {'nn':>5s} | "
          f"BW: {'gemm':>6s} {'w-only':>6s}" + (f" | {'read':>7s} {'w/read':>6s}" if clock else ""))
    for r in rows:
        read = ""
        if clock and "read_device_us" in r:  # the time to read the bytes once; ours vs it
            frac = (f"{100 * r['read_device_us'] / r['gemm_weight_only_device_us']:5.0f}%"
                    if "gemm_weight_only_device_us" in r else f"{'-':>6s}")
            read = f" | {r['read_device_us']:7.1f} {frac}"
        print(f"{r['fmt']:11s} {r['M']:5d} {r['N']:6d} {r['K']:6d} {backend(r):>9s} | "
              + " ".join(us(r, k) for k, _ in METHODS) + " |         "
              + " ".join(x(r, "gemm", a) for a, _ in ANCHORS) + " |           "
              + " ".join(x(r, "gemm_weight_only", a) for a, _ in ANCHORS) + " |     "
              + pct(r, "gemm") + " " + pct(r, "gemm_weight_only") + read)


def plot(rows, ceilings, title, path):
    """Per format: achieved TB/s vs M with the copy bandwidth, TFLOP/s vs M with the peaks
    (from the device times when the run has them, else the Python-loop times)."""
    plt = pyplot()
    if plt is None:
        return
    clock = "_device" if any(m + "_device_us" in r for r in rows for m, _ in METHODS) else ""
    title += " (device time)" if clock else " (Python-loop time)"
    fmts = list(dict.fromkeys(r["fmt"] for r in rows))
    nks = list(dict.fromkeys((r["N"], r["K"]) for r in rows))
    styles = ["-", "--", ":", "-."]
    colors = dict(zip([m for m, _ in METHODS], plt.rcParams["axes.prop_cycle"].by_key()["color"]))
    fig, axes = plt.subplots(len(fmts), 2, figsize=(13, 4.2 * len(fmts)), squeeze=False)
    for row_i, ((ax_bw, ax_fl), fmt) in enumerate(zip(axes, fmts)):
        for method, label in METHODS:  # colour: method; line style: N, K
            for i, nk in enumerate(nks):
                sub = sorted((r for r in rows if r["fmt"] == fmt and (r["N"], r["K"]) == nk
                              and method + clock + "_us" in r), key=lambda r: r["M"])
                if not sub:
                    continue
                ms = [r["M"] for r in sub]
                kw = dict(color=colors[method], ls=styles[i % len(styles)], marker="o", ms=3)
                ax_bw.plot(ms, [r[method + clock + "_TBps"] for r in sub], label=label, **kw)
                ax_fl.plot(ms, [r[method + clock + "_TFLOPs"] for r in sub], label=label, **kw)
        bw, peak = ceilings["copy_TBps"], ceilings["bf16_peak_TFLOPs"]
        ax_bw.axhline(bw, color="k", lw=1, label=f"copy bandwidth {bw:.3g} TB/s (measured)")
        ax_fl.axhline(peak, color="k", lw=1, label=f"bf16 peak {peak:.3g} TFLOP/s (measured)")
        ax_fl.axhline(2 * peak, color="gray", lw=1, ls="--", label="fp8 peak (nominal 2x bf16)")
        backends = ", ".join(sorted({r["backend"] for r in rows if r["fmt"] == fmt}))
        for ax, ylabel in ((ax_bw, "achieved TB/s"), (ax_fl, "TFLOP/s")):
            ax.set_xscale("log")
            ax.set_yscale("log")
            ax.set_xlabel("M")
            ax.set_ylabel(ylabel)
            ax.set_title(f"{fmt} (jbs.gemm backend: {backends})", fontsize=9)
            ax.grid(True, which="both", lw=0.3)
            if row_i == 0:  # the same series in every row: one legend per column
                for i, nk in enumerate(nks):
                    ax.plot([], [], color="gray", ls=styles[i % len(styles)],
                            label=f"N={nk[0]}, K={nk[1]}")
                handles, labels = ax.get_legend_handles_labels()
                unique = dict(zip(labels, handles))  # one entry per method
                ax.legend(unique.values(), unique.keys(), fontsize=6)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", help="comma-separated MxNxK list (default: M in 1..8192 x N=K in "
                   "8192, 16384)")
    p.add_argument("--formats", default="nvfp4,mxfp4,mxfp8_e4m3",
                   help="comma list; nvfp4/none: NVFP4 without the global scale (alpha = 1)")
    p.add_argument("--quick", action="store_true", help="tiny shapes, few calls (CPU smoke run)")
    p.add_argument("--iters", type=int, default=None, help="calls per trial (default 20; quick 5)")
    p.add_argument("--trials", type=int, default=None, help="trials, median (default 5; quick 3)")
    p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    p.add_argument("--tag", default=None, help="file name stem (default: sweep_<platform>)")
    args = p.parse_args()

    device = jax.devices()[0]
    platform = lowering_platform(device)
    shapes = ([tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")] if args.shapes
              else QUICK_SHAPES if args.quick else DEFAULT_SHAPES)
    timing = dict(iters=args.iters or (5 if args.quick else 20),
                  trials=args.trials or (3 if args.quick else 5))
    print(f"jax {jax.__version__}, {device.device_kind}, backends {jbs.backend_names()}",
          flush=True)
    ceilings = measure_ceilings(platform in ("cuda", "rocm"), timing)
    print(json.dumps(ceilings), flush=True)

    os.makedirs(args.out, exist_ok=True)
    stem = os.path.join(args.out, args.tag or f"sweep_{platform}")
    meta = dict(jax=jax.__version__, device=device.device_kind, platform=platform,
                timing=dict(timing, l2_bytes=L2_BYTES,
                            method="benchmarks/timing.py: <method>_us = median over trials of "
                            "the mean of back-to-back jitted calls (host cost included); "
                            "<method>_device_us = GPU kernel time per call from a profiler "
                            "trace; weights < ~3x L2 rotated through copies"),
                ceilings=ceilings)
    rows, bf16_cache, read_cache = [], {}, {}
    key = jax.random.PRNGKey(0)
    for fmt in args.formats.split(","):
        for (m, n, k) in shapes:
            key, sub = jax.random.split(key)
            rows.append(bench_row(fmt, m, n, k, platform, sub, timing, bf16_cache, read_cache))
            print(json.dumps(rows[-1]), flush=True)
            with open(stem + ".json", "w") as f:  # keep what was measured if the run is cut
                json.dump(dict(meta, rows=rows), f, indent=1)
    print_table(rows, ceilings)
    if any(m + "_device_us" in r for r in rows for m, _ in METHODS):
        print_table(rows, ceilings, clock="_device")
    plot(rows, ceilings, f"{device.device_kind}, jax {jax.__version__}: block-scaled GEMM, "
         "bf16 output", stem + ".png")
    print(f"wrote {stem}.json")


if __name__ == "__main__":
    main()
