"""The dense block-scaled GEMM: `gemm` and `scaled_matmul` (api.py), `gemm_p` and its per-device
`gemm_local_p` (primitive.py), their sharding rules (sharding.py, which registers `gemm_p`'s
lowering) and `gemm(x, w, quantize_a=...)`'s primitive (quantized_activation.py)."""
from . import sharding as _sharding  # noqa: F401  (gemm_p's lowering)
from .api import gemm, scaled_matmul
from .primitive import gemm_local_p, gemm_p

__all__ = ["gemm", "gemm_local_p", "gemm_p", "scaled_matmul"]
