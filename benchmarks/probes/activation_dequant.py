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
import jax.numpy as jnp

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from env_methods import compare_methods, report  # noqa: E402  (benchmarks/probes/)
from jax_blockscale.lowering import ffi as sm90_ffi  # noqa: E402
from sweep import format_token, quantize  # noqa: E402
from timing import copies, rotation_count  # noqa: E402

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
        m, n, k = (int(v) for v in shape.split("x"))
        kx, kw = jax.random.split(jax.random.key(m + n))
        x = jax.random.normal(kx, (m, k), jnp.float32)
        w = jax.random.normal(kw, (n, k), jnp.float32)
        dot_sets = [(x.astype(jnp.bfloat16), w_) for w_ in
                    copies(w.astype(jnp.bfloat16), rotation_count(2 * n * k))]
        for token in args.formats.split(","):
            fmt, kw_ = format_token(token)
            a_q = quantize(x, fmt, **kw_)
            sets = [(a_q, b) for b in copies(quantize(w, fmt, layout="blocked", **kw_),
                                             rotation_count(n * k // 2))]
            med, agree = compare_methods(METHODS, sets, dot_sets, args.rounds)
            rows.append(report(shape, token, med, agree))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=str(jax.devices()[0]), rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
