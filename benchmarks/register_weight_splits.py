"""The sm90 register-weight variants' split-K count, forced, against the catalogue's choice and
the decode kernel, at the decoder step's GEMM shapes (Llama-3-8B: QKV, O, gate+up, down).

For every shape, row count and weight format: the device time of `jbs.gemm` with the planner's
own plan ("auto"), with the register-weight variant forced (the decode kernel off) at each split
count of `--splits` (1: no split), and bf16 `jnp.dot`; weights rotated past L2, device time from
the profiler (benchmarks/timing.py). Prints a table and writes <out>/<tag>.json.

    python benchmarks/register_weight_splits.py                       # 33 / 48 / 64 rows
    python benchmarks/register_weight_splits.py --rows 24,32 --formats nvfp4
    python benchmarks/register_weight_splits.py --tile-n 128 --splits 1,2,4,8  # 128 weight rows

Needs an sm90 GPU and the library.
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

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import jax_blockscale as jbs  # noqa: E402
from jax_blockscale import config  # noqa: E402
from jax_blockscale.catalog import sm90 as cat  # noqa: E402
from timing import copies, device_time_us, rotation_count  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096),
          "down": (4096, 14336)}


def configured(**env):
    """Set the JAX_BLOCKSCALE_* variables `env` (None: unset) and re-read the configuration."""
    for name, value in env.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = str(value)
    config.reload()


def gemm_fn():
    return jax.jit(lambda x, w: jbs.gemm(x, w, out_dtype=jnp.bfloat16))  # fresh: plans anew


def kernel_of(x, w):
    """(kernel, splits) of the call gemm lowers (x, w) to under the current configuration:
    "register_weights", "fused", "decode" or "other" (read from the custom call's attributes)."""
    text = gemm_fn().lower(x, w).as_text()
    call = next((ln for ln in text.splitlines() if "custom_call @jax_blockscale_gemm_sm90" in ln),
                None)
    if call is None:
        return "other", 0
    splits = int(re.search(r"splits = (\d+) :", call).group(1))
    if re.search(r"\bnt = 0 :", call) is None:
        return "decode", splits
    kperm = f"a_kind = {cat.KIND_CODES['bf16_kperm']} :" in call
    return ("register_weights" if kperm else "fused"), splits


def time_gemm(x, ws):
    return device_time_us(gemm_fn(), arg_sets=[(x, w) for w in ws])


def split_arguments(doc, rows, formats, splits):
    """The argument parser the split-count scripts share (their defaults given)."""
    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    p.add_argument("--rows", default=rows)
    p.add_argument("--formats", default=formats)
    p.add_argument("--splits", default=splits)
    p.add_argument("--shapes", default=",".join(SHAPES),
                   help="names of SHAPES or NxK, comma-separated")
    p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    return p


def problems(args):
    """(name, N, K, f32 weight, its bf16, rows list) for each of args.shapes."""
    rows_list = [int(r) for r in args.rows.split(",")]
    for name in args.shapes.split(","):
        n, k = SHAPES[name] if name in SHAPES else (int(d) for d in name.split("x"))
        w32 = jax.random.normal(jax.random.PRNGKey(len(name)), (n, k), jnp.float32) / np.sqrt(k)
        yield name, n, k, w32, w32.astype(jnp.bfloat16), rows_list


def print_split_table(results, counts):
    """The markdown table of split-count rows: bf16, the plan, and each forced count."""
    print("\n| GEMM | rows | format | bf16 dot | auto (kernel, splits) | "
          + " | ".join(f"{s} split{'s' * (s > 1)}" for s in counts) + " |")
    print("|---|---|---|---|---|" + "---|" * len(counts))
    for r in results:
        cells = " | ".join(f"{r['forced_us'][s]:.1f}" if s in r["forced_us"] else "-"
                           for s in counts)
        print(f"| {r['gemm']} {r['n']}x{r['k']} | {r['rows']} | {r['fmt']} | {r['bf16_us']:.1f} "
              f"| {r['auto_us']:.1f} ({r['auto_kernel']}, {r['auto_splits']}) | {cells} |")


def save_results(results, out, tag):
    """<out>/<tag>.json: the rows with JAX's version and the device."""
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, f"{tag}.json")
    with open(path, "w") as f:
        json.dump(dict(jax=jax.__version__, device=str(jax.devices()[0]), results=results), f,
                  indent=1)
    print("wrote", path)


def main(argv=None):
    p = split_arguments(__doc__, rows="33,48,64", formats="nvfp4,mxfp4,mxfp8_e4m3",
                        splits="1,2,3,4,6,8")
    p.add_argument("--tile-n", type=int, default=None,
                   help="force the forced runs' tile N (64 or 128 weight rows; default: the "
                        "catalogue's)")
    p.add_argument("--tag", default="register_weight_splits_h100")
    args = p.parse_args(argv)
    forced = [int(s) for s in args.splits.split(",")]
    results = []
    for name, n, k, w32, wb, rows_list in problems(args):
        for m in rows_list:
            x = jax.random.normal(jax.random.PRNGKey(m), (m, k)).astype(jnp.bfloat16)
            bf16_sets = [(x, w.T) for w in copies(wb, rotation_count(2 * n * k))]
            bf16 = device_time_us(jax.jit(jnp.dot), arg_sets=bf16_sets)
            for fmt in args.formats.split(","):
                w = jbs.quantize(w32, fmt, layout="blocked")
                ws = copies(w, rotation_count(w.data.nbytes + w.scales.nbytes))
                row = dict(gemm=name, n=n, k=k, rows=m, fmt=fmt, bf16_us=bf16)
                configured(JAX_BLOCKSCALE_SM90_DECODE_MAX_ROWS=None,
                           JAX_BLOCKSCALE_SM90_REGISTER_WEIGHT_SPLITS=None)
                kernel, splits = kernel_of(x, w)
                row.update(auto_kernel=kernel, auto_splits=splits, auto_us=time_gemm(x, ws))
                configured(JAX_BLOCKSCALE_SM90_DECODE_MAX_ROWS="0",
                           JAX_BLOCKSCALE_SM90_TILE_N=args.tile_n)
                row["forced_us"] = {}
                for s in forced:
                    configured(JAX_BLOCKSCALE_SM90_REGISTER_WEIGHT_SPLITS=s)
                    if kernel_of(x, w)[0] != "register_weights":
                        continue
                    row["forced_us"][s] = time_gemm(x, ws)
                configured(JAX_BLOCKSCALE_SM90_DECODE_MAX_ROWS=None,
                           JAX_BLOCKSCALE_SM90_TILE_N=None,
                           JAX_BLOCKSCALE_SM90_REGISTER_WEIGHT_SPLITS=None)
                row["forced_tile_n"] = args.tile_n
                results.append(row)
                print(json.dumps(row), flush=True)
                del ws, w
    print_split_table(results, forced)
    save_results(results, args.out, args.tag)


if __name__ == "__main__":
    main()
