"""Flax layers holding block-scaled weights (needs Flax: ``pip install 'jax_blockscale[flax]'``;
``import jax_blockscale`` does not import it).

    dense.py   the functional `dense`, `QuantizedLinear` (NNX), `QuantizedDense` (Linen), their
               variables, and the one-time conversion of float parameters (`quantize_params`,
               `quantize_model`, `from_quantized_params`)
    moe.py     `MoE` / `QuantizedMoE` (NNX) on `ragged_gemm`, `quantize_experts`, routing
"""
from .dense import (PROGRESS_MIN_KERNELS, ActivationScale, QuantizedDense, QuantizedLinear,
                    QuantizedWeight, default_filter, dense, from_quantized_params, path_name,
                    quantize_kernel, quantize_model, quantize_params)
from .moe import (MoE, QuantizedMoE, expert_shardings, quantize_experts, quantize_moe_params,
                  route, router_logits, top_k_experts)

__all__ = ["PROGRESS_MIN_KERNELS", "ActivationScale", "MoE", "QuantizedDense", "QuantizedLinear",
           "QuantizedMoE", "QuantizedWeight", "default_filter", "dense", "expert_shardings",
           "from_quantized_params",
           "path_name", "quantize_experts", "quantize_kernel", "quantize_model",
           "quantize_moe_params", "quantize_params", "route", "router_logits", "top_k_experts"]
