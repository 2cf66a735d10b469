"""Write a random Llama in NVIDIA ModelOpt's NVFP4 checkpoint layout (nothing can be downloaded
here, so this stands in for a published export such as nvidia/Llama-3.1-8B-Instruct-FP4).

    python examples/llama/write_checkpoint.py /tmp/llama-nvfp4 --tiny
    python examples/llama/write_checkpoint.py /tmp/llama-8b-nvfp4 --layers 4 --vocab 32000
    python examples/llama/write_checkpoint.py /tmp/moe-nvfp4 --tiny --moe     # mixture of experts
    python examples/llama/write_checkpoint.py /tmp/qwen3-moe-nvfp4 --moe --layers 2 --vocab 32000

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

Mixture of experts (``--moe``: Qwen3-30B-A3B's shapes, or ``--tiny --moe``), as ModelOpt exports
a Qwen3-MoE: the router ``model.layers.<i>.mlp.gate.weight`` is bf16 (E, H) (excluded from
quantization, listed in ``exclude_modules``), and every expert's projections are separate NVFP4
modules ``model.layers.<i>.mlp.experts.<e>.{gate_proj,up_proj,down_proj}`` with the four tensors
above. gate_proj and up_proj of one expert share one ``weight_scale_2`` (ModelOpt gives modules
that read the same input one amax, so serving code can fuse them: ``amax(gate, up) / (6 * 448)``).

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
from model import NORMS, LlamaConfig, expert_prefix  # noqa: E402

INPUT_SCALE = np.float32(4.0 / (6 * 448))  # placeholder activation amax of 4


@jax.jit
def _quantize(w):
    return jbs.quantize(w, "nvfp4", layout="plain")


@jax.jit
def _quantize_per_matrix(w):
    """(..., N, K) -> NVFP4 with one global scale per trailing (N, K) matrix, packed for export."""
    q = jbs.quantize(w, "nvfp4", global_scale="per_matrix", layout="plain")
    return jbs.pack_fp4(q.data), q.scales, q.global_scale


def _tensors(packed, scales, factor) -> dict[str, np.ndarray]:
    """One module's ModelOpt NVFP4 tensors from its packed codes, e4m3 scales and factor."""
    return {"weight": np.asarray(packed),
            "weight_scale": np.asarray(scales).astype(ml_dtypes.float8_e4m3fn),
            "weight_scale_2": np.array(factor, np.float32),
            "input_scale": np.array(INPUT_SCALE)}


def modelopt_tensors(w: np.ndarray) -> dict[str, np.ndarray]:
    """A float (N, K) weight as ModelOpt's NVFP4 tensors (weight, weight_scale, weight_scale_2)."""
    q = _quantize(jnp.asarray(w))
    return _tensors(jbs.pack_fp4(q.data), q.scales, q.global_scale)


def expert_tensors(gate, up, down, *, shared_gate_up_scale: bool = True):
    """Float experts gate / up (E, I, H) and down (E, H, I) as ModelOpt's per-expert NVFP4
    tensors: yields (expert, projection, tensors). Quantized a layer at a time (all experts in
    one call). shared_gate_up_scale: gate and up of an expert get one weight_scale_2 from the
    amax of both (ModelOpt's export); False quantizes each on its own (what the loader refuses
    to fuse)."""
    e, i, _ = gate.shape
    gate, up = jnp.asarray(gate), jnp.asarray(up)
    if shared_gate_up_scale:  # one (2I, H) matrix per expert: one factor over both
        packed, scales, g = _quantize_per_matrix(jnp.concatenate([gate, up], axis=1))
        packed, scales = (a.reshape(e, 2, i, -1) for a in (packed, scales))
        g = jnp.stack([g, g], axis=1)
    else:  # (E, 2, I, H): each matrix its own factor
        packed, scales, g = _quantize_per_matrix(jnp.stack([gate, up], axis=1))
    gu = [np.asarray(a) for a in (packed, scales, g)]  # (E, 2, ...): gate, up
    dn = [np.asarray(a) for a in _quantize_per_matrix(jnp.asarray(down))]
    for x in range(e):
        yield x, "gate_proj", _tensors(gu[0][x, 0], gu[1][x, 0], gu[2][x, 0])
        yield x, "up_proj", _tensors(gu[0][x, 1], gu[1][x, 1], gu[2][x, 1])
        yield x, "down_proj", _tensors(dn[0][x], dn[1][x], dn[2][x])


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
                     std: float = 0.02, shared_gate_up_scale: bool = True, log=print) -> Path:
    """Write a random `cfg` Llama (dense or MoE) to directory `out` in ModelOpt NVFP4 layout.
    shared_gate_up_scale: see `expert_tensors` (False only to test the loader's refusal)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    bf16 = lambda shape: (std * rng.standard_normal(shape, np.float32)  # noqa: E731
                          ).astype(ml_dtypes.bfloat16)
    writer = _ShardWriter(out, int(max_shard_mb * 2**20))
    writer.add("model.embed_tokens.weight", bf16((cfg.vocab_size, cfg.hidden_size)))
    for i in range(cfg.num_hidden_layers):
        for name, module in cfg.projections.items():
            w = bf16(cfg.projection_shape(name)).astype(np.float32)
            for part, arr in modelopt_tensors(w).items():
                writer.add(f"model.layers.{i}.{module}.{name}.{part}", arr)
        if cfg.is_moe:
            e = cfg.num_experts
            writer.add(f"model.layers.{i}.mlp.gate.weight", bf16((e, cfg.hidden_size)))
            gate, up, down = (bf16((e, *cfg.expert_shape(p))).astype(np.float32)
                              for p in ("gate_proj", "up_proj", "down_proj"))
            for x, proj, tensors in expert_tensors(gate, up, down,
                                                   shared_gate_up_scale=shared_gate_up_scale):
                for part, arr in tensors.items():
                    writer.add(f"{expert_prefix(i, x, proj)}.{part}", arr)
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
                          "exclude_modules": ["lm_head"] + [
                              f"model.layers.{i}.mlp.gate" for i in range(cfg.num_hidden_layers)
                              if cfg.is_moe]}}, indent=1))
    log(f"wrote {out} ({n} shard(s), {writer.total / 2**20:.1f} MiB)")
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", help="output directory")
    p.add_argument("--tiny", action="store_true", help="a tiny model (CPU tests)")
    p.add_argument("--moe", action="store_true", help="a mixture of experts (Qwen3-30B-A3B's "
                   "shapes; with --tiny: 4 experts, top-2)")
    p.add_argument("--layers", type=int, default=None, help="number of layers")
    p.add_argument("--vocab", type=int, default=None, help="vocabulary size")
    p.add_argument("--max-shard-mb", type=float, default=1024)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    cfg = {(False, False): LlamaConfig.llama3_8b, (True, False): LlamaConfig.tiny,
           (False, True): LlamaConfig.qwen3_30b_a3b, (True, True): LlamaConfig.tiny_moe}[
               (a.tiny, a.moe)]()
    changes = {k: v for k, v in (("num_hidden_layers", a.layers), ("vocab_size", a.vocab))
               if v is not None}
    cfg = LlamaConfig(**{**cfg.__dict__, **changes})
    write_checkpoint(a.out, cfg, seed=a.seed, max_shard_mb=a.max_shard_mb)


if __name__ == "__main__":
    main()
