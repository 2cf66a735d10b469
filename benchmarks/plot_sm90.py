"""Plot a bench_sm90.py JSON file: TFLOP/s per shape for every timed path.

    python benchmarks/plot_sm90.py benchmarks/results/sm90_h100.json [OUT.png]
"""
import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

rows = json.load(open(sys.argv[1]))
out = sys.argv[2] if len(sys.argv) > 2 else sys.argv[1].replace(".json", ".png")
fmts = list(dict.fromkeys(r["fmt"] for r in rows))
paths = [("sm90_tflops", "sm90 kernel"), ("auto_tflops", "sm90 backend (auto dispatch)"),
         ("deq_dot_tflops", "dequantize + dot"), ("nn_scaled_tflops", "jax.nn.scaled_matmul"),
         ("bf16_dot_tflops", "bf16 jnp.dot")]
fig, axes = plt.subplots(1, len(fmts), figsize=(5 * len(fmts), 4.5), squeeze=False)
for ax, fmt in zip(axes[0], fmts):
    rs = [r for r in rows if r["fmt"] == fmt]
    labels = [f"{r['M']}\n{r['N']}" for r in rs]
    w = 0.8 / len(paths)
    for i, (key, name) in enumerate(paths):
        ys = [r.get(key, 0.0) for r in rs]
        if any(ys):
            ax.bar([j + i * w for j in range(len(rs))], ys, w, label=name)
    ax.set_xticks([j + 0.4 - w / 2 for j in range(len(rs))], labels, fontsize=7)
    ax.set_title(fmt + " (x: M / N=K)")
    ax.set_ylabel("TFLOP/s")
    ax.set_yscale("log")
axes[0][0].legend(fontsize=7)
fig.suptitle("H100: block-scaled GEMM, bf16 output")
fig.tight_layout()
fig.savefig(out, dpi=110)
print("wrote", out)
