"""jax_blockscale: block-scaled low-precision GEMM (NVFP4, MXFP4, MXFP6, MXFP8) for JAX.

The package's floors (docs/architecture.md), from the ground up:

    config.py, core/      settings; the format table, scale layouts, `BlockScaled`, the pure-JAX
                          quantize / dequantize (imports no backend)
    catalog/, _plugin.py  what the compiled kernels are (pure data); the native library's loader
    lowering/             specs, backend registries, the planner, the reference and FFI backends
    quantization/, dense/, ragged/
                          the operations: `quantize`, `gemm`, `ragged_gemm` (check, bind, shard)
    nn/, interop/         Flax layers; checkpoint loading and saving
    kernels/              CuTeDSL kernel sources and their AOT build (build time only)
"""
from . import config  # noqa: F401  (JAX_BLOCKSCALE_* variables, read once)
from .core.formats import FORMATS, Format, can_multiply, get_format, supported_pairs
from .core.layout import from_blocked_scales, to_blocked_scales
from .core.quantize import (BlockScaled, check_blockscaled, dequantize, pack_fp4, to_blocked,
                            to_plain, unpack_fp4)
from .lowering import (GemmSpec, RaggedSpec, backend_names, ragged_backend_names,
                       register_backend, register_ragged_backend)
from .quantization import quantize
from .dense import gemm, gemm_p, scaled_matmul
from .ragged import ragged_gemm, ragged_gemm_p
from . import interop  # noqa: F401  (published checkpoint layouts; safetensors loads lazily)
from .interop.params_file import CorruptFileError, ParamsFileError
from ._moved import alias_old_module_paths

alias_old_module_paths()

__version__ = "0.1.0"

__all__ = [
    "BlockScaled", "CorruptFileError", "FORMATS", "Format", "GemmSpec", "ParamsFileError",
    "backend_names", "can_multiply", "check_blockscaled", "dequantize",
    "from_blocked_scales", "gemm", "gemm_p", "get_format", "pack_fp4", "quantize",
    "RaggedSpec", "ragged_backend_names", "ragged_gemm", "ragged_gemm_p", "register_ragged_backend",
    "register_backend", "scaled_matmul", "supported_pairs", "to_blocked", "to_blocked_scales",
    "to_plain", "unpack_fp4",
]
