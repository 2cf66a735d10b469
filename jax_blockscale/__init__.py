"""jax_blockscale: block-scaled low-precision GEMM (NVFP4, MXFP4, MXFP6, MXFP8) for JAX."""
from . import config  # noqa: F401  (JAX_BLOCKSCALE_* variables, read once)
from . import lowering as _lowering_registry  # noqa: F401  (the backend registry)
from .lowering import reference as _reference_backend  # noqa: F401  (registers "reference")
from .api import gemm, scaled_matmul
from .formats import FORMATS, Format, can_multiply, get_format, supported_pairs
from .layout import from_blocked_scales, to_blocked_scales
from .lowering import GemmSpec, backend_names, register_backend
from .primitive import gemm_p
from .ragged import ragged_gemm, ragged_gemm_p  # grouped GEMM (MoE); registers its lowerings
from .ragged_backends import RaggedSpec, ragged_backend_names, register_ragged_backend
from . import sharding as _sharding  # noqa: F401,E402  (partitioned lowering of gemm_p for pjit)
from .lowering import ffi_sm90 as _ffi_sm90_backend  # noqa: F401,E402  (Hopper; library loads lazily)
from .lowering import ffi_sm100 as _ffi_sm100_backend  # noqa: F401,E402  (Blackwell backend)
from .lowering import ragged_sm90 as _ragged_sm90_backend  # noqa: F401,E402  (ragged_gemm on Hopper)
from .lowering import ragged_sm100 as _ragged_sm100_backend  # noqa: F401,E402  (Blackwell)
from . import quantized_activation as _quantized_activation  # noqa: F401,E402  (gemm(quantize_a=))
from .quantize import (BlockScaled, check_blockscaled, dequantize, pack_fp4, quantize, to_blocked,
                       to_plain, unpack_fp4)
from .serialization import CorruptFileError, ParamsFileError  # noqa: E402  (load_params' errors)
from . import interop  # noqa: E402  (published checkpoint layouts; safetensors loads lazily)

__version__ = "0.1.0"

__all__ = [
    "BlockScaled", "CorruptFileError", "FORMATS", "Format", "GemmSpec", "ParamsFileError",
    "backend_names", "can_multiply", "check_blockscaled", "dequantize",
    "from_blocked_scales", "gemm", "gemm_p", "get_format", "pack_fp4", "quantize",
    "RaggedSpec", "ragged_backend_names", "ragged_gemm", "ragged_gemm_p", "register_ragged_backend",
    "register_backend", "scaled_matmul", "supported_pairs", "to_blocked", "to_blocked_scales",
    "to_plain", "unpack_fp4",
]
