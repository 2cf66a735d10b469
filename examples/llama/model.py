"""A Llama-style decoder in Flax NNX whose linear weights are block-scaled (or bf16), with its
layers stacked and scanned, and a loader for ModelOpt NVFP4 safetensors checkpoints.

    cfg, model = load_llama("ckpt_dir")                    # ModelOpt NVFP4 -> BlockScaled weights
    cache = init_cache(cfg, batch=1, max_len=256)
    logits, cache = model(tokens, cache, pos)              # tokens (B, T) at positions pos..pos+T-1

The model: token embedding, then per layer RMSNorm -> grouped-query attention (RoPE, a KV cache)
-> residual, RMSNorm -> SwiGLU MLP -> residual; a final RMSNorm and a bf16 LM head. Names and
conventions follow Hugging Face's LlamaForCausalLM (rotate-half RoPE, weights stored (out, in)),
so the tensors of a ModelOpt export of a Llama map one to one.

Layers: every per-layer weight is stacked along a leading axis (L, ...), an NVFP4 weight with one
global scale per layer (global_scale of shape (L,)), and `jax.lax.scan` runs one layer per step
(one compiled layer, whatever L is). ``scan_layers=False`` keeps one module per layer and unrolls
the loop (for comparison; benchmarks/e2e_model.py times both).
"""
from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax

import jax_blockscale as jbs

# HF name of each projection -> the submodule that holds it
PROJECTIONS = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn",
               "o_proj": "self_attn", "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
NORMS = ("input_layernorm", "post_attention_layernorm")


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """The fields of a Hugging Face Llama config.json this model uses."""
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 500000.0

    @classmethod
    def llama3_8b(cls, num_layers: int = 32, vocab_size: int = 128256) -> "LlamaConfig":
        return cls(vocab_size, 4096, 14336, num_layers, 32, 8, 128)

    @classmethod
    def tiny(cls, num_layers: int = 2) -> "LlamaConfig":
        return cls(vocab_size=97, hidden_size=64, intermediate_size=128,
                   num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2,
                   head_dim=16)

    def projection_shape(self, name: str) -> tuple[int, int]:
        """(out, in) of a projection: the (N, K) of its gemm."""
        h, i, hd = self.hidden_size, self.intermediate_size, self.head_dim
        return {"q_proj": (self.num_attention_heads * hd, h),
                "k_proj": (self.num_key_value_heads * hd, h),
                "v_proj": (self.num_key_value_heads * hd, h),
                "o_proj": (h, self.num_attention_heads * hd),
                "gate_proj": (i, h), "up_proj": (i, h), "down_proj": (h, i)}[name]

    def to_json(self) -> dict:
        return dict(dataclasses.asdict(self), architectures=["LlamaForCausalLM"],
                    model_type="llama")

    @classmethod
    def from_json(cls, d: dict) -> "LlamaConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        d = dict(d)
        d.setdefault("head_dim", d["hidden_size"] // d["num_attention_heads"])
        return cls(**{k: v for k, v in d.items() if k in names})


# ---------------------------------------------------------------------------------------------
# Building blocks


class Weight(nnx.Variable):
    """A linear layer's weight, (out, in): a BlockScaled (used by `jbs.gemm`) or a plain array.
    Not an nnx.Param: this is an inference model."""


def linear(x: jax.Array, w) -> jax.Array:
    """y[..., n] = sum_k x[..., k] w[n, k]: `jbs.gemm` for a BlockScaled weight (weight-only: the
    activation stays in its float dtype), an f32-accumulating dot otherwise. The leading dims
    are folded into M first (batch x tokens rows against one weight: one GEMM, not a batch of
    M = 1 GEMMs)."""
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, k)
    if isinstance(w, jbs.BlockScaled):
        y = jbs.gemm(x2, w, out_dtype=x.dtype)
    else:
        y = lax.dot_general(x2, w.astype(x.dtype), (((1,), (1,)), ((), ())),
                            preferred_element_type=jnp.float32).astype(x.dtype)
    return y.reshape(*lead, y.shape[-1])


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    x32 = x.astype(jnp.float32)
    y = x32 * lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (y * weight.astype(jnp.float32)).astype(x.dtype)


def rope(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
    """Rotary embedding, HF Llama's rotate-half form. x (B, T, heads, hd), positions (T,)."""
    hd = x.shape[-1]
    inv_freq = 1.0 / theta ** (jnp.arange(0, hd, 2, dtype=jnp.float32) / hd)
    angles = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]  # (T, hd/2)
    cos = jnp.concatenate([jnp.cos(angles)] * 2, axis=-1)[None, :, None, :]
    sin = jnp.concatenate([jnp.sin(angles)] * 2, axis=-1)[None, :, None, :]
    x32 = x.astype(jnp.float32)
    rotated = jnp.concatenate([-x32[..., hd // 2:], x32[..., :hd // 2]], axis=-1)
    return (x32 * cos + rotated * sin).astype(x.dtype)


class KVCache(NamedTuple):
    """Keys and values of every layer: (L, B, max_len, kv_heads, head_dim) each."""
    k: jax.Array
    v: jax.Array


def init_cache(cfg: LlamaConfig, batch: int, max_len: int, dtype=jnp.bfloat16) -> KVCache:
    shape = (cfg.num_hidden_layers, batch, max_len, cfg.num_key_value_heads, cfg.head_dim)
    return KVCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))


class DecoderLayer(nnx.Module):
    """One decoder layer, or (stacked) all of them: every variable may carry a leading L axis."""

    def __init__(self, cfg: LlamaConfig, params: dict[str, Any]):
        self.cfg = cfg
        for name in NORMS:
            setattr(self, name, nnx.Param(params[name]))
        for name in PROJECTIONS:
            setattr(self, name, Weight(params[name]))

    def __call__(self, h, cache: KVCache, layer, pos):
        """h (B, T, hidden) at positions pos..pos+T-1; `layer` indexes the stacked cache."""
        cfg = self.cfg
        b, t, _ = h.shape
        kvh, hd = cfg.num_key_value_heads, cfg.head_dim
        group = cfg.num_attention_heads // kvh
        positions = pos + jnp.arange(t)

        w = lambda name: getattr(self, name).get_value()  # noqa: E731
        x = rms_norm(h, w("input_layernorm"), cfg.rms_norm_eps)
        q = linear(x, w("q_proj")).reshape(b, t, kvh * group, hd)
        k = linear(x, w("k_proj")).reshape(b, t, kvh, hd)
        v = linear(x, w("v_proj")).reshape(b, t, kvh, hd)
        q, k = rope(q, positions, cfg.rope_theta), rope(k, positions, cfg.rope_theta)
        # write this step's keys / values in place, then attend over the layer's cache
        at = (layer, 0, pos, 0, 0)
        ck = lax.dynamic_update_slice(cache.k, k[None].astype(cache.k.dtype), at)
        cv = lax.dynamic_update_slice(cache.v, v[None].astype(cache.v.dtype), at)
        keys = lax.dynamic_index_in_dim(ck, layer, 0, keepdims=False)  # (B, S, kvh, hd)
        values = lax.dynamic_index_in_dim(cv, layer, 0, keepdims=False)
        qg = q.reshape(b, t, kvh, group, hd)
        scores = jnp.einsum("btkgd,bskd->bkgts", qg, keys.astype(q.dtype),
                            preferred_element_type=jnp.float32) / math.sqrt(hd)
        visible = jnp.arange(keys.shape[1])[None, :] <= positions[:, None]  # causal, (T, S)
        probs = jax.nn.softmax(jnp.where(visible, scores, -jnp.inf), axis=-1)
        attn = jnp.einsum("bkgts,bskd->btkgd", probs.astype(q.dtype), values.astype(q.dtype),
                          preferred_element_type=jnp.float32).astype(h.dtype)
        h = h + linear(attn.reshape(b, t, kvh * group * hd), w("o_proj"))

        x = rms_norm(h, w("post_attention_layernorm"), cfg.rms_norm_eps)
        mlp = jax.nn.silu(linear(x, w("gate_proj"))) * linear(x, w("up_proj"))
        return h + linear(mlp, w("down_proj")), KVCache(ck, cv)


def _layer(stacked: dict, i: int) -> dict:
    """Layer i of stacked params, as separate arrays (a BlockScaled keeps its own global scale)."""
    return jax.tree.map(lambda a: a[i], stacked)


class Llama(nnx.Module):
    """params: {"embed": (V, H), "norm": (H,), "lm_head": (V, H) or BlockScaled,
    "layers": {norm / projection name: stacked (L, ...) array or BlockScaled}}."""

    def __init__(self, cfg: LlamaConfig, params: dict[str, Any], *, scan_layers: bool = True,
                 dtype=jnp.bfloat16):
        self.cfg = cfg
        self.scan_layers = scan_layers
        self.dtype = dtype
        self.embed = nnx.Param(params["embed"])
        self.norm = nnx.Param(params["norm"])
        self.lm_head = Weight(params["lm_head"])
        if scan_layers:
            self.layers = DecoderLayer(cfg, params["layers"])
        else:
            self.layers = nnx.List([DecoderLayer(cfg, _layer(params["layers"], i))
                                    for i in range(cfg.num_hidden_layers)])

    def __call__(self, tokens: jax.Array, cache: KVCache, pos) -> tuple[jax.Array, KVCache]:
        """Logits (B, T, V) in f32 for tokens (B, T) at positions pos..pos+T-1, and the cache
        with their keys and values written."""
        h = self.embed.get_value()[tokens].astype(self.dtype)
        if self.scan_layers:
            graphdef, state = nnx.split(self.layers)

            def step(carry, xs):
                h, cache = carry
                layer_state, i = xs
                h, cache = nnx.merge(graphdef, layer_state)(h, cache, i, pos)
                return (h, cache), None

            (h, cache), _ = lax.scan(step, (h, cache),
                                     (state, jnp.arange(self.cfg.num_hidden_layers)))
        else:
            for i, layer in enumerate(self.layers):
                h, cache = layer(h, cache, i, pos)
        h = rms_norm(h, self.norm.get_value(), self.cfg.rms_norm_eps)
        return linear(h, self.lm_head.get_value()).astype(jnp.float32), cache


# ---------------------------------------------------------------------------------------------
# Parameters


def random_params(cfg: LlamaConfig, key, dtype=jnp.bfloat16, std: float = 0.02) -> dict:
    """Random float parameters in the model's layout (stacked layers), for tests and timing."""
    keys = iter(jax.random.split(key, len(PROJECTIONS) + 4))
    L = cfg.num_hidden_layers
    normal = lambda shape: (std * jax.random.normal(next(keys), shape, jnp.float32)  # noqa: E731
                            ).astype(dtype)
    layers = {name: normal((L, *cfg.projection_shape(name))) for name in PROJECTIONS}
    for name in NORMS:
        layers[name] = (1.0 + 0.1 * jax.random.normal(next(keys), (L, cfg.hidden_size))
                        ).astype(jnp.float32)
    return {"embed": normal((cfg.vocab_size, cfg.hidden_size)),
            "norm": jnp.ones((cfg.hidden_size,), jnp.float32),
            "lm_head": normal((cfg.vocab_size, cfg.hidden_size)), "layers": layers}


def quantize_params(params: dict, fmt: str) -> dict:
    """Quantize every projection of float params into `fmt` (blocked scales, ready for gemm);
    NVFP4 gets one global scale per layer, as each layer of a published checkpoint has. The
    embedding, norms and LM head stay as they are."""
    one = jax.jit(jax.vmap(lambda w: jbs.quantize(w, fmt, layout="blocked",
                                                  global_scale="auto" if fmt == "nvfp4" else None)))
    layers = {k: one(v) if k in PROJECTIONS else v for k, v in params["layers"].items()}
    return dict(params, layers=layers)


def dequantize_params(params: dict, dtype=jnp.float32) -> dict:
    """Every BlockScaled weight back to a float array of `dtype` (exact in f32), layer by layer."""
    def deq(x):
        if not isinstance(x, jbs.BlockScaled):
            return x
        return jax.vmap(lambda q: jbs.dequantize(q, dtype))(x) if x.ndim == 3 \
            else jbs.dequantize(x, dtype)
    return jax.tree.map(deq, params, is_leaf=lambda x: isinstance(x, jbs.BlockScaled))


# ---------------------------------------------------------------------------------------------
# Loading a ModelOpt NVFP4 checkpoint


def checkpoint_spec(cfg: LlamaConfig, *, layout: str = "blocked", dtype=jnp.bfloat16,
                    sharding=None) -> dict:
    """What to read from a ModelOpt NVFP4 export of a Llama (HF tensor names), in the model's
    params layout: the projections as stacked NVFP4 weights, the rest as plain tensors."""
    from jax_blockscale import interop
    layers = range(cfg.num_hidden_layers)
    spec = {name: interop.Quantized(f"model.layers.{{layer}}.{module}.{name}", "modelopt_nvfp4",
                                    layers=layers, shape=cfg.projection_shape(name),
                                    layout=layout, sharding=sharding)
            for name, module in PROJECTIONS.items()}
    for name in NORMS:
        spec[name] = interop.Tensor(f"model.layers.{{layer}}.{name}.weight", layers=layers,
                                    dtype=jnp.float32, shape=(cfg.hidden_size,))
    h, v = cfg.hidden_size, cfg.vocab_size
    return {"embed": interop.Tensor("model.embed_tokens.weight", dtype=dtype, shape=(v, h)),
            "norm": interop.Tensor("model.norm.weight", dtype=jnp.float32, shape=(h,)),
            "lm_head": interop.Tensor("lm_head.weight", dtype=dtype, shape=(v, h)),
            "layers": spec}


def load_llama(path, *, scan_layers: bool = True, dtype=jnp.bfloat16, layout: str = "blocked",
               sharding=None, progress: bool = True) -> tuple[LlamaConfig, Llama]:
    """A Llama from a ModelOpt NVFP4 checkpoint directory (config.json, hf_quant_config.json,
    *.safetensors with their index): projections bit-exact as NVFP4 BlockScaled weights."""
    from jax_blockscale import interop
    path = Path(path)
    cfg = LlamaConfig.from_json(json.loads((path / "config.json").read_text()))
    quant = path / "hf_quant_config.json"
    if quant.exists():
        algo = json.loads(quant.read_text()).get("quantization", {}).get("quant_algo")
        if algo != "NVFP4":
            raise interop.CheckpointError(f"{quant} says quant_algo={algo!r}; this loader reads "
                                          "ModelOpt NVFP4 checkpoints")
    with interop.SafetensorsCheckpoint(path) as ckpt:
        params = interop.load_tree(ckpt, checkpoint_spec(cfg, layout=layout, dtype=dtype,
                                                         sharding=sharding), progress=progress)
    return cfg, Llama(cfg, params, scan_layers=scan_layers, dtype=dtype)
