"""A Llama-style decoder in Flax NNX whose linear weights are block-scaled (or bf16), with its
layers stacked and scanned, and a loader for ModelOpt NVFP4 safetensors checkpoints.

    cfg, model = load_llama("ckpt_dir")                    # ModelOpt NVFP4 -> BlockScaled weights
    cache = init_cache(cfg, batch=1, max_len=256)
    logits, cache = model(tokens, cache, pos)              # tokens (B, T) at positions pos..pos+T-1

The model: token embedding, then per layer RMSNorm -> grouped-query attention (RoPE, a KV cache)
-> residual, RMSNorm -> SwiGLU MLP -> residual; a final RMSNorm and a bf16 LM head. Names and
conventions follow Hugging Face's LlamaForCausalLM (rotate-half RoPE, weights stored (out, in)),
so the tensors of a ModelOpt export of a Llama map one to one.

Mixture of experts (``cfg.num_experts > 0``): the MLP of every layer is a sparse block, Qwen3-MoE
style: a bf16 router (never quantized), each token's top-k experts weighted by the softmax over
the chosen k logits, SwiGLU experts. It is `jax_blockscale.nn.QuantizedMoE` (``ragged_gemm``,
experts NVFP4 with one global scale per expert) or, for float experts, `jax_blockscale.nn.MoE`
(``lax.ragged_dot``); this file only builds them (`moe_block`). Checkpoint tensors use Qwen3-MoE's
names (``mlp.gate`` is the router, ``mlp.experts.<e>.{gate,up,down}_proj``); `load_experts`
stacks ModelOpt's per-expert NVFP4 tensors into one (L, E, N, K) weight per projection.

Layers: every per-layer weight is stacked along a leading axis (L, ...), an NVFP4 weight with one
global scale per layer (global_scale of shape (L,); experts: (L, E), one per expert and layer),
and `jax.lax.scan` runs one layer per step (one compiled layer, whatever L is). Block-scaled
weights are not scanned over: each step hands the whole stacks and its layer index to
``jbs.gemm(..., layer=i)`` / ``QuantizedMoE(layer=i)``, which read the layer in place (a scanned
slice of FP4 weights is copied first).
``scan_layers=False`` keeps one module per layer and unrolls the loop (for comparison;
benchmarks/e2e_model.py times both). It is also what ``moe_placement=`` needs: MoE layers that
dispatch tokens over a mesh axis (`jax_blockscale.ragged.dispatch`) each run their own layer's
experts.

Attention is ``jax.nn.dot_product_attention`` (`attend`): a decode step masks the cache by length
and runs cuDNN's fused kernel on Hopper or newer (bf16), XLA's elsewhere; a prompt runs XLA's.
"""
from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax
from jax.sharding import PartitionSpec as P

import jax_blockscale as jbs
from jax_blockscale import nn as jnn
from jax_blockscale.ragged.tensor_parallel import split_intermediate

# HF name of each projection -> the submodule that holds it
PROJECTIONS = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn",
               "o_proj": "self_attn", "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
NORMS = ("input_layernorm", "post_attention_layernorm")
QK_NORMS = ("q_norm", "k_norm")  # Qwen3's per-head norms: self_attn.{q,k}_norm.weight (head_dim,)
# An MoE layer's MLP: the fused expert weights QuantizedMoE / MoE hold -> the per-expert HF
# projections they are made of (gate_up: gate rows first, then up rows, as nn_moe computes it)
EXPERT_WEIGHTS = {"gate_up": ("gate_proj", "up_proj"), "down": ("down_proj",)}


# config.json model types this model implements: Llama, and Qwen3 / Qwen3-MoE (a Llama with
# per-head RMSNorms on q and k, and for Qwen3-MoE sparse MLPs); "llama_moe" is this example's
# own name for a Llama whose MLPs are Qwen3-MoE sparse blocks
MODEL_TYPES = {"llama": False, "mistral": False, "llama_moe": False, "qwen3": True,
               "qwen3_moe": True}  # -> per-head q / k norms


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """The fields of a Hugging Face Llama (or Qwen3 / Qwen3-MoE) config.json this model uses.

    `from_json` reads a config.json written by transformers 4 or 5 and refuses, naming the
    field, anything that would change the math and is not implemented here; the defaults below
    are only for configs built in code (presets, tests)."""
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    # Mixture of experts (Qwen3-MoE's config.json names): 0 experts is a dense model
    num_experts: int = 0
    num_experts_per_tok: int = 0  # top-k
    moe_intermediate_size: int = 0  # one expert's SwiGLU width
    # rope scaling: the rope parameters other than rope_theta, as sorted (key, value) pairs
    # (hashable); () is the plain rope ("default")
    rope_scaling: tuple = ()
    max_position_embeddings: int | None = None
    tie_word_embeddings: bool = False  # the LM head is the token embedding
    qk_norm: bool = False  # Qwen3: an RMSNorm over each head of q and of k, before the rope

    def __post_init__(self):
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"{self.num_attention_heads} query heads do not split into "
                             f"{self.num_key_value_heads} key-value groups")
        if self.num_experts and not (1 <= self.num_experts_per_tok <= self.num_experts
                                     and self.moe_intermediate_size > 0):
            raise ValueError(f"an MoE config needs 1 <= num_experts_per_tok <= num_experts "
                             f"and moe_intermediate_size > 0, got {self.num_experts_per_tok}, "
                             f"{self.num_experts}, {self.moe_intermediate_size}")
        if isinstance(self.rope_scaling, dict):
            object.__setattr__(self, "rope_scaling", tuple(sorted(self.rope_scaling.items())))
        self.rope_frequencies()  # an unknown rope type or a missing field fails here

    @classmethod
    def llama3_8b(cls, num_layers: int = 32, vocab_size: int = 128256) -> "LlamaConfig":
        return cls(vocab_size, 4096, 14336, num_layers, 32, 8, 128)

    @classmethod
    def tiny(cls, num_layers: int = 2) -> "LlamaConfig":
        return cls(vocab_size=97, hidden_size=64, intermediate_size=128,
                   num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2,
                   head_dim=16)

    @classmethod
    def qwen3_30b_a3b(cls, num_layers: int = 48, vocab_size: int = 151936) -> "LlamaConfig":
        """Qwen3-30B-A3B's shapes: hidden 2048, 32 query / 4 key-value heads of 128 (so the
        attention is 4096 wide, twice the hidden size), 128 experts of width 768, top-8. Its
        shapes only: the per-head q/k RMSNorms are off (a real Qwen3-MoE config.json turns them
        on). intermediate_size is its config's (unused: every layer is sparse)."""
        return cls(vocab_size, 2048, 6144, num_layers, 32, 4, 128, rms_norm_eps=1e-6,
                   rope_theta=1e6, num_experts=128, num_experts_per_tok=8,
                   moe_intermediate_size=768)

    @classmethod
    def tiny_moe(cls, num_layers: int = 2, num_experts: int = 4,
                 top_k: int = 2) -> "LlamaConfig":
        return dataclasses.replace(cls.tiny(num_layers), num_experts=num_experts,
                                   num_experts_per_tok=top_k, moe_intermediate_size=32)

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def rope(self) -> dict:
        """The rope parameters (transformers 5's ``rope_parameters``)."""
        return {"rope_type": "default", **dict(self.rope_scaling), "rope_theta": self.rope_theta}

    def rope_frequencies(self) -> tuple[np.ndarray, float]:
        """(inv_freq f32 (head_dim/2,), the factor cos / sin are scaled by)."""
        from jax_blockscale.interop import hf_config
        return hf_config.rope_frequencies(hf_config.rope_parameters(
            {"rope_parameters": self.rope}, "LlamaConfig"), self.head_dim,
            self.max_position_embeddings)

    @property
    def projections(self) -> dict[str, str]:
        """The dense projections of a layer (name -> HF submodule): an MoE layer has the
        attention ones only."""
        return {n: m for n, m in PROJECTIONS.items() if not (self.is_moe and m == "mlp")}

    def projection_shape(self, name: str) -> tuple[int, int]:
        """(out, in) of a projection: the (N, K) of its gemm."""
        h, i, hd = self.hidden_size, self.intermediate_size, self.head_dim
        return {"q_proj": (self.num_attention_heads * hd, h),
                "k_proj": (self.num_key_value_heads * hd, h),
                "v_proj": (self.num_key_value_heads * hd, h),
                "o_proj": (h, self.num_attention_heads * hd),
                "gate_proj": (i, h), "up_proj": (i, h), "down_proj": (h, i)}[name]

    def expert_shape(self, name: str) -> tuple[int, int]:
        """(out, in) of one expert's projection (gate_proj, up_proj, down_proj) or of a fused
        expert weight (gate_up, down)."""
        h, i = self.hidden_size, self.moe_intermediate_size
        return {"gate_proj": (i, h), "up_proj": (i, h), "down_proj": (h, i),
                "gate_up": (2 * i, h), "down": (h, i)}[name]

    def to_json(self) -> dict:
        """A config.json (transformers 5 spelling: the rope under ``rope_parameters``) that
        `from_json` reads back to this config."""
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
             if f.name not in ("rope_theta", "rope_scaling", "qk_norm")}
        d.update(rope_parameters=self.rope, hidden_act="silu", attention_bias=False,
                 mlp_bias=False)
        if d["max_position_embeddings"] is None:
            del d["max_position_embeddings"]
        moe_fields = ("num_experts", "num_experts_per_tok", "moe_intermediate_size")
        if self.qk_norm:
            model_type = "qwen3_moe" if self.is_moe else "qwen3"
            arch = "Qwen3MoeForCausalLM" if self.is_moe else "Qwen3ForCausalLM"
        elif self.is_moe:
            # not a transformers architecture: a Llama whose MLPs are Qwen3-MoE sparse blocks
            model_type, arch = "llama_moe", "LlamaMoeForCausalLM"
        else:
            model_type, arch = "llama", "LlamaForCausalLM"
        if self.is_moe:  # norm_topk_prob: the chosen k weights are renormalized (nn_moe.route)
            d.update(norm_topk_prob=True)
        else:
            for name in moe_fields:
                del d[name]
        return dict(d, architectures=[arch], model_type=model_type)

    @classmethod
    def from_json(cls, d: dict, where: str = "config.json") -> "LlamaConfig":
        """A config.json (dict) written by transformers 4 or 5. Every field that changes the
        math is read under both spellings (``rope_theta`` / ``rope_scaling`` or
        ``rope_parameters``; the expert count under ``num_experts``, ``num_local_experts``,
        ``n_routed_experts``, ...) and honoured, or refused with an
        ``interop.hf_config.ConfigError`` that names it: rope types other than default /
        llama3 / yarn, sliding-window attention, attention or MLP biases, activations other
        than SiLU, unnormalized top-k routing, shared experts, dense layers in an MoE model."""
        from jax_blockscale.interop import hf_config
        from jax_blockscale.interop.hf_config import ConfigError, require
        model_type = d.get("model_type")
        if model_type not in MODEL_TYPES:
            raise ConfigError(f"{where}: model_type {model_type!r} is not implemented by this "
                              f"model (implemented: {', '.join(MODEL_TYPES)})")
        act = require(d, "hidden_act", where)
        if act != "silu":
            raise ConfigError(f"{where}: hidden_act={act!r}; this model's MLP is SwiGLU (silu)")
        for key in ("attention_bias", "mlp_bias"):
            if d.get(key):
                raise ConfigError(f"{where}: {key}=true; this model's projections have no bias")
        if d.get("use_sliding_window") or ("use_sliding_window" not in d
                                           and d.get("sliding_window") is not None):
            raise ConfigError(f"{where}: sliding_window={d.get('sliding_window')!r} "
                              f"(use_sliding_window={d.get('use_sliding_window')!r}); this "
                              "model attends over the whole sequence")
        layer_types = d.get("layer_types") or []
        if any(t != "full_attention" for t in layer_types):
            raise ConfigError(f"{where}: layer_types {sorted(set(layer_types))}; only "
                              "'full_attention' layers are implemented")
        rope = hf_config.rope_parameters(d, where)
        theta = rope.pop("rope_theta")
        if rope["rope_type"] == "default":
            rope.pop("rope_type")
        heads = require(d, "num_attention_heads", where)
        head_dim = d.get("head_dim")
        if head_dim is None:
            head_dim = require(d, "hidden_size", where) // heads
        experts = hf_config.expert_count(d, where)
        moe = {}
        if experts:
            k = hf_config.top_k(d, where)
            if not k:
                raise ConfigError(f"{where} has {experts} experts but no experts-per-token "
                                  f"(any of {list(hf_config.TOP_K_KEYS)})")
            if require(d, "norm_topk_prob", where) is not True:
                raise ConfigError(f"{where}: norm_topk_prob={d['norm_topk_prob']!r}; this model "
                                  "renormalizes the top-k routing weights")
            if d.get("decoder_sparse_step", 1) != 1 or d.get("mlp_only_layers"):
                raise ConfigError(f"{where}: decoder_sparse_step="
                                  f"{d.get('decoder_sparse_step')!r}, mlp_only_layers="
                                  f"{d.get('mlp_only_layers')!r}; every layer must be sparse")
            for key in ("n_shared_experts", "shared_expert_intermediate_size"):
                if d.get(key):
                    raise ConfigError(f"{where}: {key}={d[key]!r}; shared experts are not "
                                      "implemented")
            moe = dict(num_experts=experts, num_experts_per_tok=k,
                       moe_intermediate_size=require(d, "moe_intermediate_size", where))
        tie = d.get("tie_word_embeddings")
        if not isinstance(tie, bool):
            raise ConfigError(f"{where}: tie_word_embeddings is {tie!r}; it must say true or "
                              "false (whether the LM head is the token embedding)")
        return cls(vocab_size=require(d, "vocab_size", where),
                   hidden_size=require(d, "hidden_size", where),
                   intermediate_size=require(d, "intermediate_size", where),
                   num_hidden_layers=require(d, "num_hidden_layers", where),
                   num_attention_heads=heads,
                   num_key_value_heads=d.get("num_key_value_heads") or heads,
                   head_dim=head_dim, rms_norm_eps=float(require(d, "rms_norm_eps", where)),
                   rope_theta=theta, rope_scaling=tuple(sorted(rope.items())),
                   max_position_embeddings=d.get("max_position_embeddings"),
                   tie_word_embeddings=tie, qk_norm=MODEL_TYPES[model_type], **moe)


# ---------------------------------------------------------------------------------------------
# Building blocks


class Weight(nnx.Variable):
    """A linear layer's weight, (out, in): a BlockScaled (used by `jbs.gemm`) or a plain array.
    Not an nnx.Param: this is an inference model."""


class InputScale(nnx.Variable):
    """A projection's static activation scale (a W4A4 checkpoint's `input_scale`: the NVFP4
    decode factor its activations are quantized with), f32, (L,) when stacked."""


def linear(x: jax.Array, w, layer=None, input_scale=None) -> jax.Array:
    """y[..., n] = sum_k x[..., k] w[n, k]: `jbs.gemm` for a BlockScaled weight (weight-only: the
    activation stays in its float dtype), an f32-accumulating dot otherwise. The leading dims
    are folded into M first (batch x tokens rows against one weight: one GEMM, not a batch of
    M = 1 GEMMs). A BlockScaled stack of every layer's weights (L, out, in) runs layer `layer`,
    read where it lies (``jbs.gemm(..., layer=)``). With the checkpoint's `input_scale` (W4A4),
    the activation is quantized to NVFP4 with it, as the checkpoint was calibrated
    (``jbs.gemm(..., quantize_a="nvfp4", a_global_scale=input_scale)``)."""
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, k)
    if isinstance(w, jbs.BlockScaled):
        kw = dict(layer=layer) if w.ndim == 3 else {}
        if input_scale is not None:
            kw.update(quantize_a="nvfp4", a_global_scale=input_scale)
        y = jbs.gemm(x2, w, out_dtype=x.dtype, **kw)
    else:
        y = lax.dot_general(x2, w.astype(x.dtype), (((1,), (1,)), ((), ())),
                            preferred_element_type=jnp.float32).astype(x.dtype)
    return y.reshape(*lead, y.shape[-1])


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    x32 = x.astype(jnp.float32)
    y = x32 * lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (y * weight.astype(jnp.float32)).astype(x.dtype)


def rope(x: jax.Array, positions: jax.Array, inv_freq, scaling: float = 1.0) -> jax.Array:
    """Rotary embedding, HF Llama's rotate-half form. x (B, T, heads, hd), positions (T,),
    inv_freq (hd/2,) f32 (`LlamaConfig.rope_frequencies`: plain, llama3 or YaRN), cos and sin
    scaled by `scaling` (YaRN's attention factor; 1 otherwise)."""
    hd = x.shape[-1]
    angles = positions.astype(jnp.float32)[:, None] * jnp.asarray(inv_freq, jnp.float32)[None]
    emb = jnp.concatenate([angles, angles], axis=-1)  # (T, hd)
    cos = (jnp.cos(emb) * scaling)[None, :, None, :]
    sin = (jnp.sin(emb) * scaling)[None, :, None, :]
    x32 = x.astype(jnp.float32)
    rotated = jnp.concatenate([-x32[..., hd // 2:], x32[..., :hd // 2]], axis=-1)
    return (x32 * cos + rotated * sin).astype(x.dtype)


ATTENTION = ("auto", "xla", "cudnn")  # `attend`'s choices (Llama(attention=...))


def attention_implementation(dtype, head_dim: int) -> str | None:
    """"cudnn" where JAX's cuDNN fused attention takes a decode step (an NVIDIA GPU of compute
    capability 9.0 or newer, bf16 / f16, head_dim a multiple of 8 up to 256), else None (XLA).
    ``jax.nn.dot_product_attention(implementation=None)`` is XLA's attention in this JAX (it
    does not pick cuDNN by itself), so the choice is made here."""
    dev = jax.devices()[0]
    cc = getattr(dev, "compute_capability", None)
    if dev.platform != "gpu" or cc is None:
        return None
    try:
        major = int(str(cc).split(".")[0])
    except ValueError:
        return None
    ok = (major >= 9 and np.dtype(dtype) in (np.dtype(jnp.bfloat16), np.dtype(jnp.float16))
          and head_dim % 8 == 0 and head_dim <= 256)
    return "cudnn" if ok else None


def attend(q, keys, values, positions, attention: str = "auto"):
    """Causal grouped-query attention over a KV cache on ``jax.nn.dot_product_attention``.
    q (B, T, heads, hd) at `positions` (T,) (consecutive); keys / values (B, S, kv_heads, hd),
    the cache, positions past the last query unwritten. Returns (B, T, heads, hd) in q's dtype.

    A decode step (T = 1) sees the cache's first pos + 1 entries: a length mask
    (``key_value_seq_lengths``), which cuDNN's fused kernel takes (`attention_implementation`
    for "auto"). Several tokens at once (a prompt) need a causal mask offset by their position
    in the cache, which JAX's cuDNN path does not express (its causal mask is aligned to the
    queries' indices in the call): they run XLA's implementation with a boolean mask.
    attention: "auto", "xla" (XLA's everywhere) or "cudnn" (decode steps on cuDNN)."""
    b, t = q.shape[:2]
    keys, values = keys.astype(q.dtype), values.astype(q.dtype)
    if t == 1:
        impl = (attention_implementation(q.dtype, q.shape[-1]) if attention == "auto"
                else attention)
        lengths = jnp.broadcast_to((positions[-1] + 1).astype(jnp.int32), (b,))
        return jax.nn.dot_product_attention(q, keys, values, key_value_seq_lengths=lengths,
                                            implementation=impl)
    visible = jnp.arange(keys.shape[1])[None, :] <= positions[:, None]  # causal, (T, S)
    return jax.nn.dot_product_attention(q, keys, values, mask=visible[None, None],
                                        implementation="xla")


class KVCache(NamedTuple):
    """Keys and values of every layer in one array, (L, 2, B, max_len, kv_heads, head_dim): a
    layer's keys and values are written with one update and read with one slice (two would be
    two small kernels each per layer in a decode step)."""
    kv: jax.Array


def init_cache(cfg: LlamaConfig, batch: int, max_len: int, dtype=jnp.bfloat16) -> KVCache:
    shape = (cfg.num_hidden_layers, 2, batch, max_len, cfg.num_key_value_heads, cfg.head_dim)
    return KVCache(jnp.zeros(shape, dtype))


def moe_block(cfg: LlamaConfig, params: dict[str, Any], dtype=jnp.bfloat16,
              placement: dict | None = None) -> nnx.Module:
    """The sparse MLP of one layer, or of all layers stacked (every array with a leading L axis,
    which `lax.scan` slices per layer): `jnn.QuantizedMoE` when the experts are BlockScaled,
    `jnn.MoE` (lax.ragged_dot experts, computing in `dtype`) when they are float arrays.

    params: ``router`` (..., hidden, experts); ``gate_up`` and ``down``: BlockScaled
    (..., E, 2I, H) and (..., E, H, I) (out, in), or float (..., E, H, 2I) and (..., E, I, H)
    (nnx kernels' (in, out)), gate before up in both.

    The layer is built for one layer's shapes under `nnx.eval_shape` (its constructor checks
    them; nothing is initialized or quantized) and then handed `params` as its variables'
    values, which may carry the stacked L axis: the forward pass is nn_moe's, unchanged.

    placement: None, or ``QuantizedMoE``'s expert parallelism, as its keywords
    (``dict(mesh=mesh, expert_axis="expert")``, optionally ``exchange=``), or its tensor
    parallelism (``dict(mesh=mesh, tensor_axis="model")``: the experts are re-laid here with
    `split_intermediate`, as the layer stores them): block-scaled experts of one layer only
    (these layers take no ``layer=``, so a scanned stack cannot use them). The caller places
    the expert weights (split on their expert axis; tensor parallel: gate_up on N, down on K)."""
    k = cfg.num_experts_per_tok
    quantized = isinstance(params["gate_up"], jbs.BlockScaled)
    lead = jnp.ndim(params["router"]) - 2  # 1 for stacked layers
    placement = dict(placement or {})
    if placement and not quantized:
        raise ValueError("expert or tensor parallelism (placement=) needs block-scaled experts "
                         "(QuantizedMoE); these experts are float")
    if placement and lead:
        raise ValueError("expert or tensor parallelism (placement=) runs one layer's experts; "
                         "these are stacked (scanned) layers: build the model with "
                         "scan_layers=False")
    one = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[lead:], a.dtype), params)
    e, h = cfg.num_experts, cfg.hidden_size
    want = {"router": (h, e)}
    for name in EXPERT_WEIGHTS:
        n, kk = cfg.expert_shape(name)
        want[name] = (e, n, kk) if quantized else (e, kk, n)
    got = {name: tuple(one[name].shape) for name in want}
    if got != want:
        raise ValueError(f"MoE params have per-layer shapes {got}; the config needs {want}")
    if quantized:
        abstract = nnx.eval_shape(
            lambda p: jnn.QuantizedMoE.from_params(p, k, dtype=dtype, **placement), one)
    else:
        abstract = nnx.eval_shape(lambda: jnn.MoE(h, cfg.moe_intermediate_size, e, k,
                                                  dtype=dtype, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    values = {name: params[name] for name in want}
    if quantized and placement.get("tensor_axis") is not None:
        # the tensor-parallel layer holds its experts re-laid for its devices (its constructor
        # re-lays them; the abstract layer above has that layout's shapes, which for I/d a
        # multiple of 128 are the original's: values in the original layout would mispair)
        d = placement["mesh"].shape[placement["tensor_axis"]]
        values["gate_up"], values["down"] = split_intermediate(values["gate_up"],
                                                               values["down"], d)
    nnx.replace_by_pure_dict(state, values)
    return nnx.merge(graphdef, state)


class DecoderLayer(nnx.Module):
    """One decoder layer, or (stacked) all of them: every variable may carry a leading L axis.
    moe_placement: an MoE layer's expert parallelism (`moe_block`'s placement)."""

    def __init__(self, cfg: LlamaConfig, params: dict[str, Any], dtype=jnp.bfloat16,
                 attention: str = "auto", moe_placement: dict | None = None):
        self.cfg = cfg
        self.attention = attention  # `attend`'s implementation choice
        for name in NORMS + (QK_NORMS if cfg.qk_norm else ()):
            setattr(self, name, nnx.Param(params[name]))
        for name in cfg.projections:
            setattr(self, name, Weight(params[name]))
        # W4A4: params["input_scales"] = {projection: its input_scale} (load_params(w4a4=True))
        self.w4a4 = "input_scales" in params
        if self.w4a4:
            for name in cfg.projections:
                setattr(self, name + "_input_scale", InputScale(params["input_scales"][name]))
        if cfg.is_moe:
            self.mlp = moe_block(cfg, params["mlp"], dtype, moe_placement)

    def __call__(self, h, cache: KVCache, layer, pos):
        """h (B, T, hidden) at positions pos..pos+T-1; `layer` indexes the stacked cache."""
        cfg = self.cfg
        b, t, _ = h.shape
        kvh, hd = cfg.num_key_value_heads, cfg.head_dim
        group = cfg.num_attention_heads // kvh
        positions = pos + jnp.arange(t)

        w = lambda name: getattr(self, name).get_value()  # noqa: E731

        def proj(x, name):  # W4A4 with the projection's input scale, else weight-only
            scale = w(name + "_input_scale") if self.w4a4 else None
            return linear(x, w(name), layer, scale)

        x = rms_norm(h, w("input_layernorm"), cfg.rms_norm_eps)
        q = proj(x, "q_proj").reshape(b, t, kvh * group, hd)
        k = proj(x, "k_proj").reshape(b, t, kvh, hd)
        v = proj(x, "v_proj").reshape(b, t, kvh, hd)
        if cfg.qk_norm:  # Qwen3: RMSNorm over each head, before the rope
            q = rms_norm(q, w("q_norm"), cfg.rms_norm_eps)
            k = rms_norm(k, w("k_norm"), cfg.rms_norm_eps)
        inv_freq, scaling = cfg.rope_frequencies()
        q, k = rope(q, positions, inv_freq, scaling), rope(k, positions, inv_freq, scaling)
        # write this step's keys / values in place, then attend over the layer's cache
        new = jnp.stack([k, v])[None].astype(cache.kv.dtype)  # (1, 2, B, T, kvh, hd)
        kv = lax.dynamic_update_slice(cache.kv, new, (layer, 0, 0, pos, 0, 0))
        keys, values = lax.dynamic_index_in_dim(kv, layer, 0, keepdims=False)  # (B, S, kvh, hd)
        attn = attend(q, keys, values, positions, self.attention).astype(h.dtype)
        h = h + proj(attn.reshape(b, t, kvh * group * hd), "o_proj")

        x = rms_norm(h, w("post_attention_layernorm"), cfg.rms_norm_eps)
        if cfg.is_moe:  # the B*T tokens routed together (QuantizedMoE folds the leading dims)
            # A scanned model hands its block-scaled MoE every layer's experts (see Llama): the
            # layer's are read in place, never sliced out of the stack.
            stacked = isinstance(self.mlp, jnn.QuantizedMoE) and self.mlp.router[...].ndim == 3
            dispatched = getattr(self.mlp, "expert_axis", None) is not None
            if dispatched:
                # A layer that dispatches tokens splits them over its mesh axis and returns them
                # split. Its input and output are pinned replicated (its output gathered back:
                # one all-gather of (B*T, hidden)), so the rest of the model runs replicated,
                # every token on every device as on one device; unpinned, XLA propagates the
                # split into the attention and the KV cache.
                mesh = self.mlp.mesh
                everywhere = P() if mesh is None else jax.sharding.NamedSharding(mesh, P())
                x = jax.lax.with_sharding_constraint(x, everywhere)
            y = self.mlp(x, layer=layer) if stacked else self.mlp(x)
            if dispatched:
                y = jax.lax.with_sharding_constraint(y, everywhere)
            return h + y.astype(h.dtype), KVCache(kv)
        mlp = jax.nn.silu(proj(x, "gate_proj")) * proj(x, "up_proj")
        return h + proj(mlp, "down_proj"), KVCache(kv)


def _block_scaled_weight(path, node) -> bool:
    """nnx filter: a projection's Weight holding a BlockScaled (read in place when scanned)."""
    del path
    return isinstance(node, Weight) and isinstance(node.get_value(), jbs.BlockScaled)


def _layer(stacked: dict, i: int) -> dict:
    """Layer i of stacked params, as separate arrays (a BlockScaled keeps its own global scale)."""
    return jax.tree.map(lambda a: a[i], stacked)


class Llama(nnx.Module):
    """params: {"embed": (V, H), "norm": (H,), "lm_head": (V, H) or BlockScaled,
    "layers": {norm / projection name: stacked (L, ...) array or BlockScaled,
               (MoE) "mlp": {"router", "gate_up", "down"} stacked as `moe_block` takes them}}.
    `dtype` is the activations' (and a float MoE's compute) dtype.

    moe_placement: None, or ``dict(mesh=mesh, expert_axis="expert")`` (and optionally
    ``exchange=``): every MoE layer a ``QuantizedMoE`` expert parallel over that mesh axis
    (`moe_block`). Everything else here is replicated, so ``exchange="reduce"`` (no token moves;
    one sum of the combined outputs per layer) is the faster one measured on 2 and 4 H200s
    (docs/sharding.md); the default exchange dispatches tokens and equals one device bit for
    bit. It needs scan_layers=False (the dispatched layer runs one layer's
    experts, not a stack's ``layer=``); place the expert weights split on their expert axis
    (``P(expert_axis)``) and the rest replicated before calling the model. Or
    ``dict(mesh=mesh, tensor_axis="model")``: every MoE layer tensor parallel over that axis
    (gate_up placed on N, down on K of the layer's re-laid experts)."""

    def __init__(self, cfg: LlamaConfig, params: dict[str, Any], *, scan_layers: bool = True,
                 dtype=jnp.bfloat16, attention: str = "auto",
                 moe_placement: dict | None = None):
        if attention not in ATTENTION:
            raise ValueError(f"attention must be one of {ATTENTION}, got {attention!r}")
        if moe_placement and scan_layers:
            raise ValueError("moe_placement (MoE layers that dispatch tokens) needs "
                             "scan_layers=False: the dispatched layer runs one layer's experts, "
                             "not a scanned stack's")
        self.cfg = cfg
        self.scan_layers = scan_layers
        self.dtype = dtype
        self.embed = nnx.Param(params["embed"])
        self.norm = nnx.Param(params["norm"])
        self.lm_head = Weight(params["lm_head"])
        if scan_layers:
            self.layers = DecoderLayer(cfg, params["layers"], dtype, attention)
        else:
            self.layers = nnx.List([DecoderLayer(cfg, _layer(params["layers"], i), dtype,
                                                 attention, moe_placement)
                                    for i in range(cfg.num_hidden_layers)])

    def __call__(self, tokens: jax.Array, cache: KVCache, pos) -> tuple[jax.Array, KVCache]:
        """Logits (B, T, V) in f32 for tokens (B, T) at positions pos..pos+T-1, and the cache
        with their keys and values written."""
        h = self.embed.get_value()[tokens].astype(self.dtype)
        if self.scan_layers:
            # lax.scan slices every layer's weights out of the stacks it scans over, and XLA
            # copies a sliced FP4 array before each use. Block-scaled weights stay out of the
            # scanned state instead: every step sees the whole stacks and runs its own layer's
            # where they lie (jbs.gemm(..., layer=i), QuantizedMoE(layer=i)).
            experts = (nnx.All(nnx.PathContains("mlp"), nnx.Any(*map(nnx.PathContains, (
                "router", "gate_up", "down"))))
                if self.cfg.is_moe and isinstance(self.layers.mlp, jnn.QuantizedMoE)
                else nnx.Nothing())
            in_place = nnx.Any(experts, _block_scaled_weight)
            graphdef, whole, state = nnx.split(self.layers, in_place, ...)

            # The layer index rides in the carry (a loop counter): XLA can then hand a kernel a
            # slice at that index in place, which it cannot for an index scanned out of an
            # arange (docs/design/scanned_layers.md).
            def step(carry, layer_state):
                h, cache, i = carry
                h, cache = nnx.merge(graphdef, whole, layer_state)(h, cache, i, pos)
                return (h, cache, i + 1), None

            (h, cache, _), _ = lax.scan(step, (h, cache, jnp.int32(0)), state)
        else:
            for i, layer in enumerate(self.layers):
                h, cache = layer(h, cache, i, pos)
        h = rms_norm(h, self.norm.get_value(), self.cfg.rms_norm_eps)
        return linear(h, self.lm_head.get_value()).astype(jnp.float32), cache


# ---------------------------------------------------------------------------------------------
# Parameters


def random_params(cfg: LlamaConfig, key, dtype=jnp.bfloat16, std: float = 0.02) -> dict:
    """Random float parameters in the model's layout (stacked layers), for tests and timing.
    MoE experts are in `jnn.MoE`'s (E, in, out) layout (what `quantize_params` quantizes)."""
    keys = iter(jax.random.split(key, len(PROJECTIONS) + 4))
    L = cfg.num_hidden_layers
    normal = lambda shape, k=None: _normal(next(keys) if k is None else k, shape,  # noqa: E731
                                           std, dtype)
    layers = {name: normal((L, *cfg.projection_shape(name))) for name in cfg.projections}
    for name in NORMS:
        layers[name] = (1.0 + 0.1 * jax.random.normal(next(keys), (L, cfg.hidden_size))
                        ).astype(jnp.float32)
    if cfg.is_moe:
        e, h, i = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        k_router, k_gate_up, k_down = jax.random.split(jax.random.fold_in(key, 1), 3)
        layers["mlp"] = {"router": normal((L, h, e), k_router),
                         "gate_up": normal((L, e, h, 2 * i), k_gate_up),
                         "down": normal((L, e, i, h), k_down)}
    return {"embed": normal((cfg.vocab_size, cfg.hidden_size)),
            "norm": jnp.ones((cfg.hidden_size,), jnp.float32),
            "lm_head": normal((cfg.vocab_size, cfg.hidden_size)), "layers": layers}


@functools.partial(jax.jit, static_argnums=(1, 3))
def _normal(key, shape, std, dtype):
    # jitted so the f32 draw is fused with the cast: at Qwen3-30B-A3B's expert shapes a layer's
    # f32 draw alone is 1.6 GB
    return (std * jax.random.normal(key, shape, jnp.float32)).astype(dtype)


def quantize_params(params: dict, fmt: str) -> dict:
    """Quantize every projection of float params into `fmt` (blocked scales, ready for gemm);
    NVFP4 gets one global scale per layer, as each layer of a published checkpoint has, and
    MoE experts one per expert and layer (`jnn.quantize_experts`: (L, E, out, in), global scale
    (L, E)). The embedding, norms, LM head and MoE router stay as they are."""
    one = jax.jit(jax.vmap(lambda w: jbs.quantize(w, fmt, layout="blocked",
                                                  global_scale="auto" if fmt == "nvfp4" else None)))
    layers = {k: one(v) if k in PROJECTIONS else v for k, v in params["layers"].items()}
    if "mlp" in layers:
        mlp = dict(layers["mlp"])
        for name in EXPERT_WEIGHTS:  # a layer at a time: one layer's f32 temporaries at most
            per_layer = [jnn.quantize_experts(w, fmt) for w in mlp[name]]
            mlp[name] = jax.tree.map(lambda *a: jnp.stack(a), *per_layer)
        layers["mlp"] = mlp
    return dict(params, layers=layers)


def dequantize_params(params: dict, dtype=jnp.float32) -> dict:
    """Every BlockScaled weight back to a float array of `dtype` (exact in f32), layer by layer;
    MoE experts (out, in) -> `jnn.MoE`'s (in, out)."""
    def deq(x):
        if not isinstance(x, jbs.BlockScaled):
            return x
        return jax.vmap(lambda q: jbs.dequantize(q, dtype))(x) if x.ndim == 3 \
            else jbs.dequantize(x, dtype)
    is_q = lambda x: isinstance(x, jbs.BlockScaled)  # noqa: E731
    out = jax.tree.map(deq, {**params, "layers": {k: v for k, v in params["layers"].items()
                                                  if k != "mlp"}}, is_leaf=is_q)
    if "mlp" in params["layers"]:
        out["layers"]["mlp"] = {k: jnp.swapaxes(jbs.dequantize(v, dtype), -1, -2) if is_q(v)
                                else v for k, v in params["layers"]["mlp"].items()}
    return out


# ---------------------------------------------------------------------------------------------
# Loading a checkpoint: unquantized, ModelOpt NVFP4 / W4A16_NVFP4, compressed-tensors NVFP4


def _stored_quantized(ckpt, source, module: str) -> bool:
    from jax_blockscale import interop
    return ckpt is not None and source is not None and interop.is_quantized(ckpt, module,
                                                                              source)


def checkpoint_spec(cfg: LlamaConfig, *, source: str | None = "modelopt_nvfp4", ckpt=None,
                    layout: str = "blocked", dtype=jnp.bfloat16, sharding=None) -> dict:
    """What to read from a Hugging Face Llama checkpoint (HF tensor names), in the model's
    params layout. source: the quantized layout (an `interop.SOURCES` name; None: an
    unquantized checkpoint). With `ckpt` (an open SafetensorsCheckpoint), a module the tool
    left unquantized (an LM head, a router) is read as a plain tensor; without it every
    projection is taken to be quantized and the LM head not. A tied model
    (`cfg.tie_word_embeddings`) has no LM head entry: `load_params` uses the embedding. An MoE
    model's router (``mlp.gate``, (E, H) as stored) is here; its experts are read by
    `load_experts`."""
    from jax_blockscale import interop
    layers = range(cfg.num_hidden_layers)

    def entry(name, module):
        pattern = f"model.layers.{{layer}}.{module}.{name}"
        quantized = (source is not None if ckpt is None else
                     _stored_quantized(ckpt, source, pattern.format(layer=0)))
        if quantized:
            return interop.Quantized(pattern, source, layers=layers,
                                     shape=cfg.projection_shape(name), layout=layout,
                                     sharding=sharding)
        return interop.Tensor(pattern + ".weight", layers=layers, dtype=dtype,
                              shape=cfg.projection_shape(name), sharding=sharding)

    spec = {name: entry(name, module) for name, module in cfg.projections.items()}
    for name in NORMS:
        spec[name] = interop.Tensor(f"model.layers.{{layer}}.{name}.weight", layers=layers,
                                    dtype=jnp.float32, shape=(cfg.hidden_size,))
    if cfg.qk_norm:
        for name in QK_NORMS:
            spec[name] = interop.Tensor(f"model.layers.{{layer}}.self_attn.{name}.weight",
                                        layers=layers, dtype=jnp.float32, shape=(cfg.head_dim,))
    h, v = cfg.hidden_size, cfg.vocab_size
    if cfg.is_moe:
        if _stored_quantized(ckpt, source, "model.layers.0.mlp.gate"):
            raise interop.CheckpointError("the MoE router model.layers.0.mlp.gate is stored "
                                          "quantized; this model keeps routers in float")
        spec["mlp"] = {"router": interop.Tensor("model.layers.{layer}.mlp.gate.weight",
                                                layers=layers, dtype=dtype,
                                                shape=(cfg.num_experts, h))}
    out = {"embed": interop.Tensor("model.embed_tokens.weight", dtype=dtype, shape=(v, h)),
           "norm": interop.Tensor("model.norm.weight", dtype=jnp.float32, shape=(h,)),
           "layers": spec}
    if not cfg.tie_word_embeddings:
        if ckpt is not None and "lm_head.weight" not in ckpt and not _stored_quantized(
                ckpt, source, "lm_head"):
            raise interop.CheckpointError(
                f"{ckpt.path} has no lm_head.weight and its config says "
                "tie_word_embeddings=false: the LM head is missing")
        out["lm_head"] = (interop.Quantized("lm_head", source, shape=(v, h), layout=layout)
                          if _stored_quantized(ckpt, source, "lm_head") else
                          interop.Tensor("lm_head.weight", dtype=dtype, shape=(v, h)))
    return out


def expert_prefix(layer: int, expert: int, proj: str) -> str:
    """The HF module name of one expert's projection (as Qwen3-MoE's checkpoints name them)."""
    return f"model.layers.{layer}.mlp.experts.{expert}.{proj}"


def load_experts(ckpt, cfg: LlamaConfig, *, source: str | None = "modelopt_nvfp4",
                 layout: str = "blocked", dtype=jnp.bfloat16, sharding=None,
                 progress: bool = False) -> dict:
    """Every layer's experts from per-expert tensors (Qwen3-MoE's names), as the fused weights
    the MoE block takes.

    Quantized (`source` "modelopt_nvfp4" or "compressed_tensors_nvfp4"): {"gate_up": (L, E, 2I,
    H), "down": (L, E, H, I)}, BlockScaled with one global scale per expert and layer ((L, E)),
    bit-exact. Each expert's packed e2m1 bytes and e4m3 block scales are copied from the
    memory-mapped files into one preallocated host stack (gate_proj's rows, then up_proj's),
    converted once (nothing is dequantized). gate_proj and up_proj become one weight with one
    global scale, so their stored per-tensor factors (``weight_scale_2`` /
    ``weight_global_scale``) must be equal: ModelOpt's export and llm-compressor make them so
    (modules that read the same input share one amax); a checkpoint where they differ raises
    CheckpointError, as bit-exact loading would need two scales.

    Unquantized (`source` None): float stacks in `jnn.MoE`'s (in, out) layout, cast to `dtype`:
    {"gate_up": (L, E, H, 2I), "down": (L, E, I, H)}.

    sharding: None or a Sharding of the (L, E, N, K) stacks, mapped onto the scales by
    `interop.blockscaled_shardings` (e.g. ``NamedSharding(mesh, P(None, "e"))``)."""
    from jax_blockscale import interop
    L, E = cfg.num_hidden_layers, cfg.num_experts
    layers = range(L)
    if progress:
        try:
            from tqdm.auto import tqdm
            layers = tqdm(layers, desc="loading experts", unit="layer", leave=False)
        except ImportError:
            pass
    if source is None or not _stored_quantized(ckpt, source, expert_prefix(0, 0, "down_proj")):
        return _load_float_experts(ckpt, cfg, layers, dtype, sharding)
    src = interop.SOURCES[source]
    (_, (w_suffix, *_), _, _), (_, (s_suffix, *_), _, _), (g_role, (g_suffix, *_), _, _) = \
        src.parts
    stacks = {}
    for fused, parts in EXPERT_WEIGHTS.items():
        n, k = cfg.expert_shape(parts[0])
        stacks[fused] = (np.empty((L, E, n * len(parts), k // 2), np.uint8),   # packed e2m1
                         np.empty((L, E, n * len(parts), k // 16), np.uint8),  # e4m3 bits
                         np.empty((L, E), np.float32))                         # per-tensor factor
    for layer in layers:
        for fused, parts in EXPERT_WEIGHTS.items():
            packed, scales, factor = stacks[fused]
            n, k = cfg.expert_shape(parts[0])
            for e in range(E):
                factors = {}
                for j, proj in enumerate(parts):
                    m = expert_prefix(layer, e, proj)
                    rows = slice(j * n, (j + 1) * n)
                    packed[layer, e, rows] = ckpt.read(m + w_suffix, dtype="U8",
                                                       shape=(n, k // 2))
                    scales[layer, e, rows] = ckpt.read(
                        m + s_suffix, dtype=("F8_E4M3", "U8"),
                        shape=(n, k // 16)).view(np.uint8)
                    g = ckpt.read(m + g_suffix, dtype="F32")
                    if g.size != 1:
                        raise interop.CheckpointError(f"{m}{g_suffix} has shape {g.shape}; "
                                                      "expected one per-tensor factor")
                    factors[m] = np.float32(g.reshape(()))
                values = list(factors.values())
                if any(v.tobytes() != values[0].tobytes() for v in values):
                    raise interop.CheckpointError(
                        f"{g_role} differs between {' and '.join(factors)} "
                        f"({', '.join(map(str, values))}): they are fused into one weight with "
                        "one global scale, so they must be equal to load bit-exactly")
                factor[layer, e] = values[0]
    out = {}
    for fused, (packed, scales, factor) in stacks.items():
        q = src.convert(packed, scales, factor, layout=layout)
        if sharding is not None:
            q = jax.device_put(q, interop.blockscaled_shardings(sharding, q))
        out[fused] = q
    return out


def _load_float_experts(ckpt, cfg: LlamaConfig, layers, dtype, sharding) -> dict:
    L, E = cfg.num_hidden_layers, cfg.num_experts
    h, i = cfg.hidden_size, cfg.moe_intermediate_size
    gate_up = np.empty((L, E, h, 2 * i), np.float32)
    down = np.empty((L, E, i, h), np.float32)
    for layer in layers:
        for e in range(E):
            read = lambda p: ckpt.read(expert_prefix(layer, e, p) + ".weight",  # noqa: E731
                                       shape=cfg.expert_shape(p)).astype(np.float32)
            gate_up[layer, e, :, :i] = read("gate_proj").T
            gate_up[layer, e, :, i:] = read("up_proj").T
            down[layer, e] = read("down_proj").T
    put = (lambda a: jax.device_put(a, sharding)) if sharding is not None else jnp.asarray
    return {"gate_up": put(gate_up.astype(dtype)), "down": put(down.astype(dtype))}


def load_params(ckpt, cfg: LlamaConfig, *, source: str | None = "modelopt_nvfp4",
                layout: str = "blocked", dtype=jnp.bfloat16, sharding=None,
                expert_sharding=None, progress: bool = False, w4a4: bool = False) -> dict:
    """The model's params from a checkpoint (a path or an open SafetensorsCheckpoint) whose
    quantized modules are stored as `source` (None: an unquantized checkpoint):
    `checkpoint_spec` through `interop.load_tree`, for a tied model the embedding as the LM
    head, and for an MoE model its experts (`load_experts`, placed by `expert_sharding`) with
    the router turned to (L, H, E). `sharding` places the dense projections, as
    `checkpoint_spec` says. w4a4: also each quantized dense projection's activation global
    scale (`interop.load_input_scale`), stacked (L,) in params["layers"]["input_scales"] (the
    model then quantizes those projections' activations with them)."""
    from jax_blockscale import interop
    if not isinstance(ckpt, interop.SafetensorsCheckpoint):
        with interop.SafetensorsCheckpoint(ckpt) as opened:
            return load_params(opened, cfg, source=source, layout=layout, dtype=dtype,
                               sharding=sharding, expert_sharding=expert_sharding,
                               progress=progress, w4a4=w4a4)
    spec = checkpoint_spec(cfg, source=source, ckpt=ckpt, layout=layout, dtype=dtype,
                           sharding=sharding)
    params = interop.load_tree(ckpt, spec, progress=progress)
    if cfg.tie_word_embeddings:
        params["lm_head"] = params["embed"]
    if w4a4:
        if source is None:
            raise interop.CheckpointError("w4a4=True needs a quantized checkpoint with "
                                          "activation scales; this one is not quantized")
        layers = range(cfg.num_hidden_layers)
        params["layers"]["input_scales"] = {
            name: interop.load_input_scale(ckpt, f"model.layers.{{layer}}.{module}.{name}",
                                           source, layers=layers)
            for name, module in cfg.projections.items()
            if isinstance(spec["layers"][name], interop.Quantized)}
        if len(params["layers"]["input_scales"]) != len(cfg.projections):
            raise interop.CheckpointError("w4a4: some dense projections are not quantized; "
                                          "W4A4 is run on all of them or none")
    if cfg.is_moe:
        mlp = params["layers"]["mlp"]
        mlp["router"] = jnp.swapaxes(mlp["router"], -1, -2)  # HF Linear (E, H) -> x @ (H, E)
        mlp.update(load_experts(ckpt, cfg, source=source, layout=layout, dtype=dtype,
                                sharding=expert_sharding, progress=progress))
    return params


def load_llama(path, *, scan_layers: bool = True, dtype=jnp.bfloat16, layout: str = "blocked",
               sharding=None, expert_sharding=None, progress: bool = True,
               w4a4: bool | None = None) -> tuple[LlamaConfig, Llama]:
    """A Llama (or Qwen3 / Qwen3-MoE) from a Hugging Face checkpoint directory (config.json,
    *.safetensors, their index if sharded). The layout is read from the checkpoint's own
    metadata (`interop.checkpoint_quantization`: hf_quant_config.json or config.json's
    quantization_config): unquantized (every weight cast to `dtype`), ModelOpt NVFP4 /
    W4A16_NVFP4, or compressed-tensors NVFP4 / NVFP4A16 (nvfp4-pack-quantized); quantized
    projections and experts load bit-exact as NVFP4 BlockScaled weights. The config is read
    by `LlamaConfig.from_json`, which refuses what this model does not implement.

    w4a4: None (default) runs the dense projections as the checkpoint was made: activations
    quantized to NVFP4 with its static global scales if it is a W4A4 checkpoint (ModelOpt
    NVFP4, compressed-tensors NVFP4), weight-only otherwise. False: weight-only even for a
    W4A4 checkpoint. True: W4A4, refused for a weight-only checkpoint. An MoE's experts are
    always weight-only (`QuantizedMoE`), so a W4A4 MoE checkpoint needs an explicit w4a4
    (True: the attention projections W4A4) to say so. sharding / expert_sharding: see
    `load_params`."""
    from jax_blockscale import interop
    path = Path(path)
    config = json.loads((path / "config.json").read_text())
    cfg = LlamaConfig.from_json(config, where=str(path / "config.json"))
    quant = interop.checkpoint_quantization(path)
    source = None if quant is None else quant.source
    stored_w4a4 = quant is not None and quant.activations
    if w4a4 and not stored_w4a4:
        raise interop.CheckpointError(
            f"w4a4=True, but {path} is "
            f"{'not quantized' if quant is None else quant.description + ' (weight-only)'}: "
            "it stores no activation scales")
    if w4a4 is None:
        if stored_w4a4 and cfg.is_moe:
            raise interop.CheckpointError(
                f"{path} is {quant.description} (activations quantized), and this model runs "
                "MoE experts weight-only: pass w4a4=True (attention projections W4A4, experts "
                "weight-only) or w4a4=False (all weight-only)")
        w4a4 = stored_w4a4
    with interop.SafetensorsCheckpoint(path) as ckpt:
        if not cfg.qk_norm and "model.layers.0.self_attn.q_norm.weight" in ckpt:
            raise interop.CheckpointError(f"{path} has per-head q/k RMSNorms (q_norm / k_norm) "
                                          f"but its model_type {config.get('model_type')!r} "
                                          "has none")
        params = load_params(ckpt, cfg, source=source, layout=layout, dtype=dtype,
                             sharding=sharding, expert_sharding=expert_sharding,
                             progress=progress, w4a4=w4a4)
    return cfg, Llama(cfg, params, scan_layers=scan_layers, dtype=dtype)
