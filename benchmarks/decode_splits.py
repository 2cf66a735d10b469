"""The sm90 dense decode kernel's split-K count, forced, against the catalogue's choice, at the
decoder step's GEMM shapes (Llama-3-8B: QKV, O, gate+up, down) or any N x K.

For every shape, row count and weight format: the device time of `jbs.gemm` with the planner's
own plan ("auto": the decode kernel at the catalogue's split count), with the split count forced
to each of `--splits` (JAX_BLOCKSCALE_SM90_DECODE_SPLITS; the planner evens the ranges out, so a
forced count can become a smaller one: the table shows the count that ran), and bf16
`jnp.dot`; weights rotated past L2, device time from the profiler (benchmarks/timing.py), the
split sums included (XLA adds them in the call). Prints a table and writes <out>/<tag>.json.

    python benchmarks/decode_splits.py                          # 1 and 16 rows, NVFP4 / MXFP4
    python benchmarks/decode_splits.py --rows 1 --formats nvfp4 --splits 1,2,4,8,16
    python benchmarks/decode_splits.py --shapes 16384x16384 --rows 16

Needs an sm90 GPU and the library.
"""
from __future__ import annotations

import json
import os
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import jax_blockscale as jbs  # noqa: E402
from register_weight_splits import (  # noqa: E402
    configured, gemm_fn, kernel_of, print_split_table, problems, save_results, split_arguments)
from timing import L2_BYTES, copies, device_time_us, rotation_count  # noqa: E402


def main(argv=None):
    p = split_arguments(__doc__, rows="1,16", formats="nvfp4,mxfp4", splits="1,2,3,4,6,8,12,16")
    p.add_argument("--calls", type=int, default=20, help="profiled calls per timing")
    p.add_argument("--tag", default="decode_splits")
    args = p.parse_args(argv)
    forced = [int(s) for s in args.splits.split(",")]
    results = []

    def timed(x, ws):  # weights rotated through ~3x L2 (up to 12 copies: small GEMMs too)
        return device_time_us(gemm_fn(), arg_sets=[(x, w) for w in ws], calls=args.calls)

    for name, n, k, w32, wb, rows_list in problems(args):
        for m in rows_list:
            x = jax.random.normal(jax.random.PRNGKey(m), (m, k)).astype(jnp.bfloat16)
            bf16_sets = [(x, w.T) for w in copies(wb, rotation_count(2 * n * k, L2_BYTES, 3, 12))]
            bf16 = device_time_us(jax.jit(jnp.dot), arg_sets=bf16_sets, calls=args.calls)
            for fmt in args.formats.split(","):
                w = jbs.quantize(w32, fmt, layout="blocked")
                ws = copies(w, rotation_count(w.data.nbytes + w.scales.nbytes, L2_BYTES, 3, 12))
                row = dict(gemm=name, n=n, k=k, rows=m, fmt=fmt, bf16_us=bf16)
                configured(JAX_BLOCKSCALE_SM90_DECODE_SPLITS=None)
                kernel, splits = kernel_of(x, w)
                row.update(auto_kernel=kernel, auto_splits=splits, auto_us=timed(x, ws))
                row["forced_us"] = {}
                for s in forced:
                    configured(JAX_BLOCKSCALE_SM90_DECODE_SPLITS=s)
                    kernel_s, ran = kernel_of(x, w)
                    if kernel_s == "decode" and ran not in row["forced_us"]:
                        row["forced_us"][ran] = timed(x, ws)
                configured(JAX_BLOCKSCALE_SM90_DECODE_SPLITS=None)
                results.append(row)
                print(json.dumps(row), flush=True)
                del ws, w
    print_split_table(results, sorted({s for r in results for s in r["forced_us"]}))
    save_results(results, args.out, args.tag)


if __name__ == "__main__":
    main()
