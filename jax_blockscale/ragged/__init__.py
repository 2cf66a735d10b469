"""The grouped GEMM of mixtures of experts: `ragged_gemm` (api.py), its primitives
(primitive.py) and their sharding rules (sharding.py, which registers `ragged_gemm_p`'s lowering).
"""
from . import sharding as _sharding  # noqa: F401  (ragged_gemm_p's lowering)
from .api import indexed_gemm, ragged_gemm, ragged_gemm_spec
from .primitive import ragged_gemm_local_p, ragged_gemm_p

__all__ = ["indexed_gemm", "ragged_gemm", "ragged_gemm_local_p", "ragged_gemm_p",
           "ragged_gemm_spec"]
