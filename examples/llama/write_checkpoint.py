"""Write a random Llama in NVIDIA ModelOpt's NVFP4 checkpoint layout (nothing can be downloaded
here, so this stands in for a published export such as nvidia/Llama-3.1-8B-Instruct-FP4).

    python examples/llama/write_checkpoint.py /tmp/llama-nvfp4 --tiny
    python examples/llama/write_checkpoint.py /tmp/llama-8b-nvfp4 --layers 4 --vocab 32000

What is written, as a ModelOpt Hugging Face export has it:
  config.json                       the Llama config (HF field names)
  hf_quant_config.json              {"producer": {"name": "modelopt"}, "quantization":
                                     {"quant_algo": "NVFP4", "group_size": 16, ...}}
  model-0000i-of-0000n.safetensors  shards of at most --max-shard-mb, layer by layer
  model.safetensors.index.json      {"metadata": {"total_size": ...}, "weight_map": {...}}
Per projection ``model.layers.<i>.<self_attn|mlp>.<name>``: ``weight`` (uint8 (N, K/2), two e2m1
codes per byte, low nibble first), ``weight_scale`` (float8_e4m3fn (N, K/16)), ``weight_scale_2``
(float32 (), the decode factor amax / (6 * 448)) and ``input_scale`` (float32 (), the
activation's decode factor; a fixed placeholder here, no calibration data). Embedding, norms
and ``lm_head`` are bf16 (ModelOpt leaves lm_head unquantized).

The weights are random (std 0.02), quantized with ModelOpt's two-level recipe (which
`jbs.quantize(..., "nvfp4")` implements) one layer at a time, so host memory stays at one
layer's weights.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

import jax_blockscale as jbs

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from model import NORMS, PROJECTIONS, LlamaConfig  # noqa: E402

INPUT_SCALE = np.float32(4.0 / (6 * 448))  # placeholder activation amax of 4


@jax.jit
def _quantize(w):
    return jbs.quantize(w, "nvfp4", layout="plain")


def modelopt_tensors(w: np.ndarray) -> dict[str, np.ndarray]:
    """A float (N, K) weight as ModelOpt's NVFP4 tensors (weight, weight_scale, weight_scale_2)."""
    q = _quantize(jnp.asarray(w))
    return {"weight": np.asarray(jbs.pack_fp4(q.data)),
            "weight_scale": np.asarray(q.scales).astype(ml_dtypes.float8_e4m3fn),
            "weight_scale_2": np.array(q.global_scale, np.float32),
            "input_scale": np.array(INPUT_SCALE)}


class _ShardWriter:
    """Accumulates tensors and writes a new .safetensors shard whenever one is full."""

    def __init__(self, out: Path, max_bytes: int):
        self.out, self.max_bytes = out, max_bytes
        self.pending: dict[str, np.ndarray] = {}
        self.pending_bytes = 0
        self.shards: list[list[str]] = []
        self.total = 0

    def add(self, name: str, arr: np.ndarray):
        arr = np.ascontiguousarray(arr) if arr.ndim else np.array(arr)
        if self.pending and self.pending_bytes + arr.nbytes > self.max_bytes:
            self.flush()
        self.pending[name] = arr
        self.pending_bytes += arr.nbytes
        self.total += arr.nbytes

    def flush(self):
        if not self.pending:
            return
        from safetensors.numpy import save_file
        tmp = self.out / f"shard-{len(self.shards):05d}.tmp"
        save_file(self.pending, str(tmp), metadata={"format": "pt"})
        self.shards.append(list(self.pending))
        self.pending, self.pending_bytes = {}, 0

    def finish(self) -> int:
        """Name the shards model-0000i-of-0000n.safetensors and write the index."""
        self.flush()
        n = len(self.shards)
        weight_map = {}
        for i, names in enumerate(self.shards):
            final = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            (self.out / f"shard-{i:05d}.tmp").rename(self.out / final)
            weight_map.update({name: final for name in names})
        (self.out / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {"total_size": self.total}, "weight_map": weight_map}, indent=1))
        return n


def write_checkpoint(out, cfg: LlamaConfig, *, seed: int = 0, max_shard_mb: float = 1024,
                     std: float = 0.02, log=print) -> Path:
    """Write a random `cfg` Llama to directory `out` in ModelOpt NVFP4 layout."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    bf16 = lambda shape: (std * rng.standard_normal(shape, np.float32)  # noqa: E731
                          ).astype(ml_dtypes.bfloat16)
    writer = _ShardWriter(out, int(max_shard_mb * 2**20))
    writer.add("model.embed_tokens.weight", bf16((cfg.vocab_size, cfg.hidden_size)))
    for i in range(cfg.num_hidden_layers):
        for name, module in PROJECTIONS.items():
            w = bf16(cfg.projection_shape(name)).astype(np.float32)
            for part, arr in modelopt_tensors(w).items():
                writer.add(f"model.layers.{i}.{module}.{name}.{part}", arr)
        for name in NORMS:
            norm = 1.0 + 0.1 * rng.standard_normal(cfg.hidden_size, np.float32)
            writer.add(f"model.layers.{i}.{name}.weight", norm.astype(ml_dtypes.bfloat16))
        log(f"layer {i + 1}/{cfg.num_hidden_layers} written")
    writer.add("model.norm.weight", np.ones(cfg.hidden_size, ml_dtypes.bfloat16))
    writer.add("lm_head.weight", bf16((cfg.vocab_size, cfg.hidden_size)))
    n = writer.finish()
    (out / "config.json").write_text(json.dumps(cfg.to_json(), indent=1))
    (out / "hf_quant_config.json").write_text(json.dumps(
        {"producer": {"name": "modelopt"},
         "quantization": {"quant_algo": "NVFP4", "kv_cache_quant_algo": None, "group_size": 16,
                          "exclude_modules": ["lm_head"]}}, indent=1))
    log(f"wrote {out} ({n} shard(s), {writer.total / 2**20:.1f} MiB)")
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", help="output directory")
    p.add_argument("--tiny", action="store_true", help="a tiny model (CPU tests)")
    p.add_argument("--layers", type=int, default=None, help="number of layers")
    p.add_argument("--vocab", type=int, default=None, help="vocabulary size")
    p.add_argument("--max-shard-mb", type=float, default=1024)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    cfg = LlamaConfig.tiny() if a.tiny else LlamaConfig.llama3_8b()
    changes = {k: v for k, v in (("num_hidden_layers", a.layers), ("vocab_size", a.vocab))
               if v is not None}
    cfg = LlamaConfig(**{**cfg.__dict__, **changes})
    write_checkpoint(a.out, cfg, seed=a.seed, max_shard_mb=a.max_shard_mb)


if __name__ == "__main__":
    main()
