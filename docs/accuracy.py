"""Quantization error of every format on a few input distributions (CPU is fine).

    python docs/accuracy.py                 # prints the markdown tables pasted into accuracy.md
    python docs/accuracy.py --png docs/accuracy.png --markdown /tmp/accuracy_tables.md

The third table compares the two MX scale rules of `jbs.quantize(..., scale_rounding=)`:
"ocp" (OCP MX v1.0: 2^(floor(log2 amax) - emax)) and "round_up" (2^ceil(log2(amax / elem_max)),
the default), tensor error on the same data; docs/formats.md quotes it.

Two measurements per (format, distribution), both relative Frobenius errors against float64:
  tensor  ||dequantize(quantize(x)) - x|| / ||x||            for x of shape (ROWS, K)
  gemm    ||gemm(quantize(a), quantize(w)) - a @ w.T|| / ||a @ w.T||, both operands in the format,
          a (M, K) from the distribution, w (N, K) normal (a weight) - the W*A* serving case.
bf16 (a plain cast) is the baseline row. Seeds are fixed, so the numbers are reproducible.
Quantization uses the package defaults (MX: scale_rounding="round_up").
"""
from __future__ import annotations

import argparse
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import jax_blockscale as jbs  # noqa: E402

ROWS, K = 512, 1024
M, N = 256, 512
FORMATS = ["nvfp4", "mxfp4", "mxfp6_e2m3", "mxfp6_e3m2", "mxfp8_e4m3", "mxfp8_e5m2"]


def distributions(rng, shape):
    """name -> sampler(shape); each is a kind of tensor a model holds."""
    def outliers(shape):
        x = rng.standard_normal(shape)
        mask = rng.random(shape) < 1e-3  # 0.1% of entries 100x larger, as in LLM activations
        return np.where(mask, 100 * x, x)

    return {
        "normal": lambda s: rng.standard_normal(s),
        "student-t (df 3)": lambda s: rng.standard_t(3, s),
        "uniform": lambda s: rng.uniform(-1, 1, s),
        "normal + 0.1% outliers x100": outliers,
    }


@jax.jit
def _bf16_round_trip(x):
    return x.astype(jnp.bfloat16).astype(jnp.float32)


def tensor_error(x: np.ndarray, fmt: str, **quantize_kw) -> float:
    xj = jnp.asarray(x, jnp.float32)
    if fmt == "bf16":
        back = _bf16_round_trip(xj)
    else:
        back = jax.jit(lambda v: jbs.dequantize(jbs.quantize(v, fmt, **quantize_kw)))(xj)
    back = np.asarray(back, np.float64)
    return float(np.linalg.norm(back - x) / np.linalg.norm(x))


def gemm_error(a: np.ndarray, w: np.ndarray, fmt: str) -> float:
    want = a @ w.T
    aj, wj = jnp.asarray(a, jnp.float32), jnp.asarray(w, jnp.float32)
    if fmt == "bf16":
        got = jnp.dot(aj.astype(jnp.bfloat16), wj.astype(jnp.bfloat16).T,
                      preferred_element_type=jnp.float32)
    else:
        got = jax.jit(lambda a, w: jbs.gemm(jbs.quantize(a, fmt),
                                            jbs.quantize(w, fmt, layout="blocked"),
                                            out_dtype=jnp.float32))(aj, wj)
    got = np.asarray(got, np.float64)
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


def measure(seed: int = 0):
    rows = ["bf16"] + FORMATS
    tensor, gemm = {}, {}
    rng = np.random.default_rng(seed)
    dists = distributions(rng, None)
    w = rng.standard_normal((N, K))
    for dname, sample in dists.items():
        x = sample((ROWS, K))
        a = sample((M, K))
        for fmt in rows:
            tensor[fmt, dname] = tensor_error(x, fmt)
            gemm[fmt, dname] = gemm_error(a, w, fmt)
    return rows, list(dists), tensor, gemm


MX_FORMATS = [f for f in FORMATS if f.startswith("mx")]
RULES = ("ocp", "round_up")


def measure_rounding(seed: int = 0):
    """Tensor error of every MX format under both scale rules, same data for both."""
    rng = np.random.default_rng(seed)
    dists = distributions(rng, None)
    table = {}
    for dname, sample in dists.items():
        x = sample((ROWS, K))
        for fmt in MX_FORMATS:
            for rule in RULES:
                table[fmt, dname, rule] = tensor_error(x, fmt, scale_rounding=rule)
    return MX_FORMATS, list(dists), table


def rounding_markdown(rows, dists, table):
    lines = [f"**MX scale rule, tensor error {ROWS} x {K}** (relative Frobenius error, %: "
             "`ocp` / `round_up`)", "",
             "| format | " + " | ".join(dists) + " |",
             "|---|" + "---:|" * len(dists)]
    for fmt in rows:
        lines.append(f"| `{fmt}` | " + " | ".join(
            f"{100 * table[fmt, d, 'ocp']:.2f} / {100 * table[fmt, d, 'round_up']:.2f}"
            for d in dists) + " |")
    return "\n".join(lines)


def markdown(rows, dists, table, title):
    lines = [f"**{title}** (relative Frobenius error, %)", "",
             "| format | " + " | ".join(dists) + " |",
             "|---|" + "---:|" * len(dists)]
    for fmt in rows:
        lines.append(f"| `{fmt}` | " + " | ".join(f"{100 * table[fmt, d]:.2f}" for d in dists)
                     + " |")
    return "\n".join(lines)


def plot(rows, dists, tensor, gemm, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(13, 4.6), sharey=True)
    width = 0.8 / len(dists)
    xs = np.arange(len(rows))
    for ax, table, title in [(axes[0], tensor, f"tensor: dequantize(quantize(x)), {ROWS}x{K}"),
                             (axes[1], gemm, f"gemm, both operands quantized, M={M} N={N} K={K}")]:
        for i, d in enumerate(dists):
            ax.bar(xs + (i - (len(dists) - 1) / 2) * width, [100 * table[f, d] for f in rows],
                   width, label=d)
        ax.set_xticks(xs, rows, rotation=20)
        ax.set_yscale("log")
        ax.set_title(title, fontsize=10)
        ax.grid(axis="y", which="both", alpha=0.3)
    axes[0].set_ylabel("relative Frobenius error (%)")
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(dists), fontsize=9)
    fig.suptitle("jax_blockscale quantization error by format and input distribution")
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    fig.savefig(path, dpi=110)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--png", help="also write the plot here")
    parser.add_argument("--markdown", help="also write the tables to this file")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    rows, dists, tensor, gemm = measure(args.seed)
    tables = [markdown(rows, dists, tensor, f"Tensor error, {ROWS} x {K}"),
              markdown(rows, dists, gemm,
                       f"GEMM error, activations (M={M}, K={K}) from the distribution x normal "
                       f"weights (N={N}), both in the format"),
              rounding_markdown(*measure_rounding(args.seed))]
    text = "\n\n".join(tables)
    print(text)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(text + "\n")
        print(f"\nwrote {args.markdown}")
    if args.png:
        plot(rows, dists, tensor, gemm, args.png)
        print(f"\nwrote {args.png}")


if __name__ == "__main__":
    main()
