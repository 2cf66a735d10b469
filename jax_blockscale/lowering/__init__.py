"""The lowering machinery every operation shares: the problem and plan types (specs.py), the
backend registries (registry.py), the planner (plan.py), the pure-JAX reference backends
(reference.py, ragged_reference.py), the operand views the kernels take (kernel_operands.py),
the FFI calls of the Hopper and Blackwell kernels (ffi_sm90.py, ffi_sm100.py, ragged_sm90.py,
ragged_sm100.py) and the custom-partitioning glue (partitioning.py).

It imports no operation: `jax_blockscale.dense`, `.ragged` and `.quantization` hand it a spec and
carry out the plan it returns. Importing this package registers every backend.
"""
from . import ffi_sm90, ffi_sm100, ragged_sm90, ragged_sm100  # noqa: F401  (register the kernels)
from . import ragged_reference, reference  # noqa: F401  (register "reference")
from .plan import select_ragged_backend
from .registry import (ALL_PLATFORMS, backend_names, forced_backend, get_backend,
                       get_ragged_backend, log_once, ragged_backend_names, register_backend,
                       register_ragged_backend)
from .specs import GemmSpec, Plan, RaggedPlan, RaggedSpec

__all__ = ["ALL_PLATFORMS", "GemmSpec", "Plan", "RaggedPlan", "RaggedSpec", "backend_names",
           "forced_backend", "get_backend", "get_ragged_backend", "log_once",
           "ragged_backend_names", "register_backend", "register_ragged_backend",
           "select_ragged_backend"]
