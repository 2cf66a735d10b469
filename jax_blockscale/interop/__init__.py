"""Weights in and out: published block-scaled checkpoint layouts -> `BlockScaled` (element codes
and block scales bit for bit; the per-tensor global factor as docs/checkpoints.md says),
safetensors loading, Hugging Face config reading, and our own params file (params_file.py).

Converters (NumPy or JAX arrays in; nothing re-quantized):
  from_modelopt_nvfp4(weight, weight_scale, weight_scale_2)       NVIDIA ModelOpt NVFP4
  from_compressed_tensors_nvfp4(weight_packed, weight_scale,      llm-compressor NVFP4
                                weight_global_scale)
  from_gpt_oss_mxfp4(blocks, scales, gate_up=None)                 OpenAI gpt-oss MXFP4
  deinterleave_gate_up(w)                                          gpt-oss's interleaved SwiGLU
  modelopt_input_scale / compressed_tensors_input_scale            W4A4 activation global scales

Loading (needs the `safetensors` package: ``pip install 'jax_blockscale[checkpoints]'``;
imported only when a checkpoint is opened):
  SafetensorsCheckpoint(path)            one file, a sharded directory, or its index JSON
  load_quantized / load_tensor / load_input_scale / load_tree(ckpt, {...: Quantized(...)})

Checkpoint metadata (no safetensors needed):
  checkpoint_quantization(dir)           the layout a directory declares (hf_quant_config.json /
                                         config.json's quantization_config), or None
  hf_config.rope_parameters / rope_frequencies / expert_count   config.json fields, transformers
                                         4 and 5 spellings

Errors about files and tensors raise `CheckpointError` (a ValueError); a config field that is
missing or not implemented raises `ConfigError` (a CheckpointError) naming it.
docs/checkpoints.md.
"""
from .checkpoint import SafetensorsCheckpoint
from .compressed_tensors import compressed_tensors_input_scale, from_compressed_tensors_nvfp4
from .errors import CheckpointError
from .gpt_oss import deinterleave_gate_up, from_gpt_oss_mxfp4
from .hf_config import ConfigError
from .hf_quant import CheckpointQuantization, checkpoint_quantization
from .loading import (SOURCES, Quantized, Tensor, blockscaled_shardings, is_quantized,
                      load_input_scale, load_quantized, load_tensor, load_tree)
from .modelopt import from_modelopt_nvfp4, modelopt_input_scale

__all__ = [
    "CheckpointError", "CheckpointQuantization", "ConfigError", "Quantized", "SOURCES", "SafetensorsCheckpoint", "Tensor",
    "blockscaled_shardings", "checkpoint_quantization", "compressed_tensors_input_scale", "deinterleave_gate_up",
    "from_compressed_tensors_nvfp4", "from_gpt_oss_mxfp4", "from_modelopt_nvfp4",
    "is_quantized", "load_input_scale", "load_quantized", "load_tensor", "load_tree", "modelopt_input_scale",
]
