"""Two-operand calls (W4A4 / W8A8), three ways (GPU only):

  fused        : the sm90 kernel converts both operands (JAX_BLOCKSCALE_SM90_DEQUANT_A=0): the
                 two-operand decode kernel up to 64 rows, the fused kernel above
  dequant_a    : A dequantized to bf16 by XLA, then the weight-only kernel (=all; the default
                 above the decode kernel's rows)
  dequant_dot  : both dequantized, then a library GEMM (the large-M path)

each forced at every M (JAX_BLOCKSCALE_SM90_MAX_ROWS), against bf16 `jnp.dot`, in paired rounds
(device time, median of the per-round values). Also checks that the three agree.

    python benchmarks/probes/activation_dequant.py --shapes 128x16384x16384,256x8192x8192 \
        --formats nvfp4,mxfp8_e4m3 --rounds 3 --json out.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import jax

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from env_methods import compare_methods, gemm_sets, report, shape_data  # noqa: E402
from jax_blockscale.lowering import ffi as sm90_ffi  # noqa: E402
from sweep import format_token, quantize  # noqa: E402

# method -> environment while it is compiled
METHODS = {
    "fused": {sm90_ffi.ENV_MAX_ROWS: "0", sm90_ffi.ENV_DEQUANT_A: "0"},
    "dequant_a": {sm90_ffi.ENV_MAX_ROWS: "0", sm90_ffi.ENV_DEQUANT_A: "all"},
    "dequant_dot": {sm90_ffi.ENV_MAX_ROWS: "1"},
}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="128x16384x16384,256x16384x16384,512x16384x16384,"
                                        "128x8192x8192,256x8192x8192")
    ap.add_argument("--formats", default="nvfp4,mxfp8_e4m3")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    rows = []
    for shape in args.shapes.split(","):
        m, n, k, x, w, dot_sets = shape_data(shape)
        for token in args.formats.split(","):
            fmt, kw_ = format_token(token)
            sets = gemm_sets(quantize(x, fmt, **kw_), w, token, n, k)
            med, agree = compare_methods(METHODS, sets, dot_sets, args.rounds)
            rows.append(report(shape, token, med, agree))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=str(jax.devices()[0]), rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
