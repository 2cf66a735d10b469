"""Quantization: `jbs.quantize` (api.py) and `quantize_nvfp4_p`, the NVFP4 quantizer primitive
whose lowering the planner chooses (primitive.py). The quantizer's math and the `BlockScaled`
pytree are the ground floor's (jax_blockscale/core)."""
from .api import quantize, quantize_for_layers
from .primitive import quantize_nvfp4, quantize_nvfp4_p

__all__ = ["quantize", "quantize_for_layers", "quantize_nvfp4", "quantize_nvfp4_p"]
