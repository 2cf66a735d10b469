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

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from env_methods import probe_main  # noqa: E402
from jax_blockscale.lowering import ffi as sm90_ffi  # noqa: E402
from sweep import format_token, quantize  # noqa: E402

# method -> environment while it is compiled
METHODS = {
    "fused": {sm90_ffi.ENV_MAX_ROWS: "0", sm90_ffi.ENV_DEQUANT_A: "0"},
    "dequant_a": {sm90_ffi.ENV_MAX_ROWS: "0", sm90_ffi.ENV_DEQUANT_A: "all"},
    "dequant_dot": {sm90_ffi.ENV_MAX_ROWS: "1"},
}


def _activation(x, token):
    """The activation quantized like the weight."""
    fmt, kw = format_token(token)
    return quantize(x, fmt, **kw), token


def main():
    probe_main(__doc__, METHODS, "128x16384x16384,256x16384x16384,512x16384x16384,"
               "128x8192x8192,256x8192x8192", "nvfp4,mxfp8_e4m3", _activation)


if __name__ == "__main__":
    main()
