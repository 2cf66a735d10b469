"""The sm90 fused kernel's two weight paths, side by side (GPU only):

  smem       : the weights dequantized into a bf16 shared-memory tile, both wgmma operands from
               shared memory (JAX_BLOCKSCALE_SM90_REGISTER_WEIGHTS=0)
  registers  : the weights converted straight into wgmma's register operand, the K-permuted
               activations from shared memory (the register-weight variants)
  dequant_dot: dequantize, then a library GEMM (the large-M path)
  default    : what jbs.gemm runs by default (the decode kernel up to 64 rows)

the first two forced at every M (no decode kernel, no large-M path), against bf16 `jnp.dot`, in paired rounds
(device time, median of the per-round values), for weight-only ("w:nvfp4": bf16 activations)
and two-operand calls (the activation dequantized first, the default past the decode kernel's
rows). Also checks that the paths agree.

    python benchmarks/probes/register_weights.py --shapes 128x16384x16384 \
        --formats w:nvfp4,nvfp4,w:mxfp4 --rounds 3 --json out.json
"""
from __future__ import annotations

import os
import sys

import jax.numpy as jnp

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from env_methods import probe_main  # noqa: E402
from jax_blockscale.lowering import ffi as sm90_ffi  # noqa: E402
from sweep import format_token, quantize  # noqa: E402

# method -> environment while it is compiled
_FORCED = {sm90_ffi.ENV_MAX_ROWS: "0", sm90_ffi.ENV_DECODE_MAX_ROWS: "0"}
METHODS = {
    "smem": {**_FORCED, sm90_ffi.ENV_REGISTER_WEIGHTS: "0"},
    "registers": {**_FORCED, sm90_ffi.ENV_REGISTER_WEIGHTS: "1"},
    "dequant_dot": {sm90_ffi.ENV_MAX_ROWS: "1"},
    "default": {},  # what jbs.gemm runs (the decode kernel up to 64 rows)
}


def _activation(x, token):
    """"w:<fmt>": a bf16 activation (weight-only); "<fmt>": the activation quantized like the
    weight (dequantized first by the default path)."""
    weight_token = token.removeprefix("w:")
    fmt, kw = format_token(weight_token)
    a = x.astype(jnp.bfloat16) if token.startswith("w:") else quantize(x, fmt, **kw)
    return a, weight_token


def main():
    probe_main(__doc__, METHODS, "128x16384x16384,256x16384x16384,128x8192x8192",
               "w:nvfp4,nvfp4,w:mxfp4", _activation)


if __name__ == "__main__":
    main()
