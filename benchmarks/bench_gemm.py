"""Time every gemm backend that runs here side by side with the anchors, in one run.

Anchors (what a JAX user has today): bf16 `jnp.dot`, a jitted dequantize+dot, and
`jax.nn.scaled_matmul`. Ours: `jbs.gemm` forced onto each registered backend that can run the
problem, with A quantized (W4A4 / W8A8) and in weight-only mode (bf16 activation).

    python benchmarks/bench_gemm.py                    # small sizes (CPU smoke run)
    python benchmarks/bench_gemm.py --full             # the issue's sizes, on a GPU
    python benchmarks/bench_gemm.py --shapes 16x16384x16384 --formats nvfp4

Prints a table, writes JSON and a PNG plot (TFLOP/s per shape) to --out.
"""
from __future__ import annotations

import argparse
import json
import os

import jax
import jax.numpy as jnp
import numpy as np

import jax_blockscale as jbs
from jax_blockscale.lowering import get_backend
from jax_blockscale.lowering.plan import device_for
from jax_blockscale.dense.primitive import gemm_spec, join_operands

from plotting import pyplot
from timing import time_us  # the shared method (benchmarks/timing.py)

SMALL = [(16, 512, 512), (128, 1024, 1024), (256, 2048, 2048)]
FULL = [(m, nk, nk) for nk in (8192, 16384) for m in (16, 128, 1024, 8192)]


@jax.jit
def dot_bf16(a, b):
    return jnp.dot(a, b.T, preferred_element_type=jnp.float32).astype(jnp.bfloat16)


def _anchor_values(q):
    """bf16 values of a plain-scaled operand, written as the shared anchor writes them (f32
    convert, times the f32 scales, to bf16), not with jbs.dequantize: the anchor is what a
    JAX user writes, and must not pick up this package's faster dequantization."""
    f = q.format
    if f.is_code_stored:  # fp6 codes (uint8): no jnp dtype converts them
        return jbs.dequantize(q, jnp.bfloat16)
    *lead, k = q.data.shape
    v = q.data.astype(jnp.float32).reshape(*lead, k // f.block, f.block)
    return (v * q.scales.astype(jnp.float32)[..., None]).reshape(*lead, k).astype(jnp.bfloat16)


@jax.jit
def dequant_dot(a, b):
    av, bv = _anchor_values(a), _anchor_values(b)
    return jnp.dot(av, bv.T, preferred_element_type=jnp.float32).astype(jnp.bfloat16)


@jax.jit
def nn_scaled(a, b):
    return jax.nn.scaled_matmul(a.data[None], b.data[None], a.scales[None], b.scales[None],
                                preferred_element_type=jnp.bfloat16)[0]


def lowering_platform(device) -> str:
    """The platform name lowering rules (and backends) use: JAX calls CUDA devices "gpu"."""
    if device.platform != "gpu":
        return device.platform
    return "rocm" if "rocm" in device.client.platform_version.lower() else "cuda"


def short_error(e, limit=160):
    """`Type: first line of the message` for a result row (an empty message is fine too)."""
    first = next(iter(str(e).splitlines()), "")
    return f"{type(e).__name__}: {first[:limit]}"


def spec_of(a, b):
    """The GemmSpec that `jbs.gemm(a, b)` (bf16 output) lowers with: what backends look at."""
    avals = [jax.core.ShapedArray(x.shape, x.dtype) for x in
             join_operands(a.data if isinstance(a, jbs.BlockScaled) else a, b.data,
                           a.scales if isinstance(a, jbs.BlockScaled) else None, b.scales,
                           jnp.float32(1))]
    return gemm_spec(avals, fmt_a=a.fmt if isinstance(a, jbs.BlockScaled) else None,
                     fmt_b=b.fmt, layout_a=getattr(a, "layout", None), layout_b=b.layout,
                     out_dtype=jnp.bfloat16)


def runnable_backends(a, b, platform):
    """Registered backends that serve this platform and can run gemm(a, b)."""
    spec, device = spec_of(a, b), device_for(platform)
    names = []
    for name in jbs.backend_names():
        backend = get_backend(name)
        # a backend's plan is a Plan when it can run the problem, else the reason it cannot
        if platform in backend.platforms and not isinstance(backend.plan(spec, device), str):
            names.append(name)
    return names


def bench_shape(fmt, m, n, k, platform, rng_key):
    ka, kb, kx = jax.random.split(rng_key, 3)
    a_f = jax.random.normal(ka, (m, k), jnp.float32)
    b_f = jax.random.normal(kb, (n, k), jnp.float32)
    a_plain = jbs.quantize(a_f, fmt, global_scale=None)  # the anchors take plain scales
    b_plain = jbs.quantize(b_f, fmt, global_scale=None)
    a_q, b_q = jbs.quantize(a_f, fmt), jbs.quantize(b_f, fmt, layout="blocked")
    x_bf16 = jax.random.normal(kx, (m, k), jnp.bfloat16)
    row = dict(fmt=fmt, M=m, N=n, K=k, platform=platform)
    row["bf16_dot_us"] = time_us(dot_bf16, x_bf16, jax.random.normal(kb, (n, k), jnp.bfloat16))
    row["deq_dot_us"] = time_us(dequant_dot, a_plain, b_plain)
    try:
        row["nn_scaled_us"] = time_us(nn_scaled, a_plain, b_plain)
    except Exception as e:  # not every platform / format has it
        row["nn_scaled_err"] = short_error(e, 120)
    reference = None
    for name in runnable_backends(a_q, b_q, platform):
        f = jax.jit(lambda a, b, name=name: jbs.gemm(a, b, backend=name))
        row[f"{name}_us"] = time_us(f, a_q, b_q)
        # correctness beside the speed: every backend against the reference, f32 output
        y = np.asarray(jbs.gemm(a_q, b_q, backend=name, out_dtype=jnp.float32), np.float64)
        if name == "reference":
            reference = y
        elif reference is not None:
            row[f"{name}_rel_err"] = float(np.linalg.norm(y - reference) / np.linalg.norm(reference))
    for name in runnable_backends(x_bf16, b_q, platform):
        f = jax.jit(lambda a, b, name=name: jbs.gemm(a, b, backend=name))
        row[f"{name}_weight_only_us"] = time_us(f, x_bf16, b_q)
    flops = 2.0 * m * n * k
    for key in [k_ for k_ in row if k_.endswith("_us")]:
        row[key.replace("_us", "_tflops")] = flops / (row[key] * 1e-6) / 1e12
    return row


def print_table(rows):
    cols = [c[:-3] for c in rows[0] if c.endswith("_us")]
    for r in rows[1:]:
        cols += [c[:-3] for c in r if c.endswith("_us") and c[:-3] not in cols]
    print("\n" + f"{'fmt':11s} {'M':>5s} {'N':>6s} {'K':>6s} | "
          + " | ".join(f"{c:>20s}" for c in cols))
    print("(microseconds, TFLOP/s in parentheses)")
    for r in rows:
        cells = [(f"{r[c + '_us']:11.1f} ({r[c + '_tflops']:6.1f})" if c + "_us" in r else
                  f"{'-':>20s}") for c in cols]
        print(f"{r['fmt']:11s} {r['M']:5d} {r['N']:6d} {r['K']:6d} | " + " | ".join(cells))


def plot(rows, path):
    plt = pyplot()
    if plt is None:
        return
    fmts = sorted({r["fmt"] for r in rows})
    fig, axes = plt.subplots(1, len(fmts), figsize=(6 * len(fmts), 4.5), squeeze=False)
    for ax, fmt in zip(axes[0], fmts):
        sub = [r for r in rows if r["fmt"] == fmt]
        labels = [f"{r['M']}x{r['N']}x{r['K']}" for r in sub]
        series = sorted({c[:-7] for r in sub for c in r if c.endswith("_tflops")})
        width = 0.8 / len(series)
        for i, s in enumerate(series):
            vals = [r.get(s + "_tflops", 0.0) for r in sub]
            ax.bar(np.arange(len(sub)) + i * width, vals, width, label=s)
        ax.set_xticks(np.arange(len(sub)) + 0.4 - width / 2, labels, rotation=30, fontsize=8)
        ax.set_ylabel("TFLOP/s")
        ax.set_title(f"{fmt} on {sub[0]['platform']}")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--full", action="store_true", help="the GPU sizes of the issue")
    p.add_argument("--shapes", help="comma-separated MxNxK list")
    p.add_argument("--formats", default="nvfp4,mxfp4,mxfp8_e4m3")
    p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    p.add_argument("--tag", default=None, help="file name stem (default: platform)")
    args = p.parse_args()

    platform = lowering_platform(jax.devices()[0])
    shapes = (FULL if args.full else SMALL) if not args.shapes else [
        tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}, backends {jbs.backend_names()}",
          flush=True)
    rows = []
    key = jax.random.PRNGKey(0)
    for fmt in args.formats.split(","):
        for (m, n, k) in shapes:
            key, sub = jax.random.split(key)
            rows.append(bench_shape(fmt, m, n, k, platform, sub))
            print(json.dumps(rows[-1]), flush=True)
    os.makedirs(args.out, exist_ok=True)
    stem = os.path.join(args.out, args.tag or f"bench_gemm_{platform}")
    with open(stem + ".json", "w") as f:
        json.dump(dict(jax=jax.__version__, device=jax.devices()[0].device_kind, rows=rows), f,
                  indent=1)
    plot(rows, stem + ".png")
    print_table(rows)


if __name__ == "__main__":
    main()
