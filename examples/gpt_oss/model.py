"""gpt-oss (openai/gpt-oss-20b, gpt-oss-120b) in JAX, its experts MXFP4 as published, on
`jbs.ragged_gemm`; its layers stacked and scanned; greedy decoding with a KV cache.

    cfg, model = load_gpt_oss("gpt-oss-20b")               # a Hugging Face checkpoint folder
    cache = init_cache(cfg, batch=1, max_len=256)
    logits, cache = model(tokens, cache, pos)              # tokens (B, T) at pos..pos+T-1
    out = generate(model, prompt, steps=32)                # greedy

The model (names as Hugging Face's GptOssForCausalLM): token embedding; per layer RMSNorm ->
grouped-query attention -> residual, RMSNorm -> sparse MLP -> residual; a final RMSNorm and an
LM head.
  attention   q / k / v / o projections with biases; rotary embedding (YaRN in the published
              configs, `jax_blockscale.interop.hf_config.rope_frequencies`); per head a learned
              "sink" logit that joins every softmax and takes its share of the weight but adds
              no value; layers of type "sliding_attention" see the last `sliding_window`
              positions (key position > query position - window), "full_attention" ones every
              earlier position (``layer_types`` says which layer is which)
  router      logits = x W^T + b, the top-k experts per token, their weights the softmax over
              the k chosen logits
  experts     gate_up = x W1^T + b1, gate clamped above at `swiglu_limit` (7), up clamped to
              [-7, 7], act = (up + 1) * gate * sigmoid(1.702 gate); y = act W2^T + b2; the
              token's output is its k experts' y weighted by the router weights

Weights: the experts are ``mxfp4`` BlockScaled stacks (L, E, 2I, H) and (L, E, H, I), the
checkpoint's codes and e8m0 scales bit for bit (`interop.from_gpt_oss_mxfp4`; gate rows first,
then up rows: the checkpoint interleaves them, the loader de-interleaves whole rows and the
gate_up bias with them). Everything else (attention, router, embedding, norms, biases, sinks)
is stored unquantized in the checkpoint and kept in `dtype` (norms and sinks in f32).

Layers: every per-layer weight is stacked along a leading L axis. `lax.scan` runs one period of
``layer_types`` per step (gpt-oss alternates sliding and full layers: two layers a step), so a
layer's attention type is known when it is traced; each step indexes the stacks at its layer
(``jbs.ragged_gemm`` reads the layer's experts in place, `jax_blockscale.nn.moe`'s
``flatten_layers`` / ``layer_group_sizes``).

Attention runs on ``jax.nn.dot_product_attention``. The sinks are applied after it from the
log-sum-exp it returns (``return_residual=True``): with Z the sum of exp(scores), the sink's
softmax scales the output by Z / (Z + exp(sink)) = sigmoid(lse - sink), exactly. A full-attention
layer at decode (one new token) masks the cache by length only (``key_value_seq_lengths``), which
cuDNN's fused kernel takes (`attention_implementation`: on Hopper or newer, bf16 / f16); a
sliding-window layer, or a prompt of several tokens, needs a mask relative to each query's
position, which JAX's cuDNN path does not express (its windows and causal mask are aligned to
the query's index in the call, not its position in the cache): those run XLA's implementation
with a boolean mask.
"""
from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import jax_blockscale as jbs
from jax_blockscale import interop
from jax_blockscale.interop import hf_config
from jax_blockscale.interop.hf_config import ConfigError, require
from jax_blockscale.nn.moe import flatten_layers, layer_group_sizes, router_logits
from jax_blockscale.ragged.primitive import stable_order, unsort_rows

LAYER_TYPES = ("sliding_attention", "full_attention")
SWIGLU_ALPHA = 1.702  # gpt-oss's sigmoid slope (a constant of the architecture)
ATTENTION = ("auto", "xla", "cudnn")  # `GptOssConfig.attention` choices


@dataclasses.dataclass(frozen=True)
class GptOssConfig:
    """The config.json fields of a gpt-oss checkpoint this model uses (`from_json` reads them
    as transformers 4 and 5 write them and refuses, naming the field, what it does not
    implement)."""
    vocab_size: int
    hidden_size: int
    intermediate_size: int  # one expert's SwiGLU width
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    num_experts: int
    num_experts_per_tok: int
    sliding_window: int
    layer_types: tuple  # per layer "sliding_attention" or "full_attention"
    rms_norm_eps: float
    rope: tuple  # the rope parameters (hf_config.rope_parameters), sorted (key, value) pairs
    max_position_embeddings: int | None = None
    tie_word_embeddings: bool = False
    swiglu_limit: float = 7.0
    # "auto": cuDNN's fused attention where `attention_implementation` says it runs, else XLA
    attention: str = "auto"

    def __post_init__(self):
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"{self.num_attention_heads} query heads do not split into "
                             f"{self.num_key_value_heads} key-value groups")
        if len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(f"layer_types has {len(self.layer_types)} entries for "
                             f"{self.num_hidden_layers} layers")
        if self.attention not in ATTENTION:
            raise ValueError(f"attention must be one of {ATTENTION}, got {self.attention!r}")

    @classmethod
    def from_json(cls, d: dict, where: str = "config.json", **overrides) -> "GptOssConfig":
        if d.get("model_type") != "gpt_oss":
            raise ConfigError(f"{where}: model_type {d.get('model_type')!r}; this model is "
                              "'gpt_oss'")
        layers = require(d, "num_hidden_layers", where)
        types = tuple(require(d, "layer_types", where))
        bad = sorted(set(types) - set(LAYER_TYPES))
        if bad:
            raise ConfigError(f"{where}: layer_types {bad} are not implemented (implemented: "
                              f"{', '.join(LAYER_TYPES)})")
        window = d.get("sliding_window")
        if "sliding_attention" in types and not (isinstance(window, int) and window > 0):
            raise ConfigError(f"{where}: sliding_window={window!r}; layer_types has "
                              "sliding_attention layers, which need a positive window")
        if d.get("attention_bias") is not True:
            raise ConfigError(f"{where}: attention_bias={d.get('attention_bias')!r}; gpt-oss's "
                              "attention projections have biases (true)")
        rope = hf_config.rope_parameters(d, where)
        heads = require(d, "num_attention_heads", where)
        experts = hf_config.expert_count(d, where)
        k = hf_config.top_k(d, where)
        if not (experts and 1 <= k <= experts):
            raise ConfigError(f"{where}: {experts} experts (num_local_experts) and {k} per "
                              "token (num_experts_per_tok / experts_per_token); gpt-oss needs "
                              "1 <= experts per token <= experts")
        tie = d.get("tie_word_embeddings")
        if not isinstance(tie, bool):
            raise ConfigError(f"{where}: tie_word_embeddings is {tie!r}; it must say true or "
                              "false (whether the LM head is the token embedding)")
        limit = d.get("swiglu_limit", 7.0)  # transformers' GptOssExperts clamps at 7.0
        cfg = dict(vocab_size=require(d, "vocab_size", where),
                   hidden_size=require(d, "hidden_size", where),
                   intermediate_size=require(d, "intermediate_size", where),
                   num_hidden_layers=layers, num_attention_heads=heads,
                   num_key_value_heads=d.get("num_key_value_heads") or heads,
                   head_dim=d.get("head_dim") or require(d, "hidden_size", where) // heads,
                   num_experts=experts, num_experts_per_tok=k,
                   sliding_window=int(window or 0), layer_types=types,
                   rms_norm_eps=float(require(d, "rms_norm_eps", where)),
                   rope=tuple(sorted(rope.items())),
                   max_position_embeddings=d.get("max_position_embeddings"),
                   tie_word_embeddings=tie, swiglu_limit=float(limit))
        cfg.update(overrides)
        return cls(**cfg)

    def rope_frequencies(self) -> tuple[np.ndarray, float]:
        """(inv_freq f32 (head_dim/2,), the factor cos / sin are scaled by: YaRN's)."""
        return hf_config.rope_frequencies(dict(self.rope), self.head_dim,
                                          self.max_position_embeddings)

    @property
    def period(self) -> int:
        """The shortest p dividing L with layer_types[i] == layer_types[i % p]: the layers one
        scan step runs."""
        n = self.num_hidden_layers
        return next(p for p in range(1, n + 1) if n % p == 0 and all(
            self.layer_types[i] == self.layer_types[i % p] for i in range(n)))


# ---------------------------------------------------------------------------------------------
# Building blocks


def _at(a, i):
    return lax.dynamic_index_in_dim(a, i, 0, keepdims=False)


def linear(x, w, b, i):
    """x @ w[i].T + b[i] for stacked (L, out, in) float weights (or a BlockScaled stack, read in
    place by ``jbs.gemm(..., layer=i)``), accumulated in f32."""
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, k)
    if isinstance(w, jbs.BlockScaled):
        y = jbs.gemm(x2, w, out_dtype=jnp.float32, layer=i)
    else:
        y = lax.dot_general(x2, _at(w, i).astype(x.dtype), (((1,), (1,)), ((), ())),
                            preferred_element_type=jnp.float32)
    y = y + _at(b, i).astype(jnp.float32)
    return y.astype(x.dtype).reshape(*lead, -1)


def rms_norm(x, weight, eps):
    x32 = x.astype(jnp.float32)
    y = x32 * lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (y * weight.astype(jnp.float32)).astype(x.dtype)


def rope(x, positions, inv_freq, scaling):
    """Rotary embedding on the two halves of each head (x (B, T, heads, hd), positions (T,)):
    (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin), cos and sin times `scaling`."""
    angles = positions.astype(jnp.float32)[:, None] * jnp.asarray(inv_freq)[None]  # (T, hd/2)
    cos = (jnp.cos(angles) * scaling)[None, :, None, :]
    sin = (jnp.sin(angles) * scaling)[None, :, None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).astype(x.dtype)


def attention_implementation(dtype, head_dim: int) -> str | None:
    """"cudnn" where JAX's cuDNN fused attention takes a decode step (an NVIDIA GPU of compute
    capability 9.0 or newer, bf16 / f16, head_dim a multiple of 8 up to 256), else None (XLA).
    ``jax.nn.dot_product_attention(implementation=None)`` is XLA's attention in this JAX: it
    does not pick cuDNN by itself, so the choice is made here."""
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


def attend(q, keys, values, sinks, positions, *, window: int | None, attention: str = "auto"):
    """Softmax attention with a sink logit per head. q (B, T, N, hd) at `positions` (T,);
    keys / values (B, S, K, hd), the cache (positions 0..S-1, those past the last query
    unwritten); sinks (N,) f32; window: a sliding window (key position > query position -
    window) or None. Returns (B, T, N, hd) in q's dtype."""
    b, t = q.shape[:2]
    keys, values = keys.astype(q.dtype), values.astype(q.dtype)
    impl = None if attention == "auto" else attention
    if t == 1 and window is None:  # decode, full attention: the cache's written length only
        if attention == "auto":
            impl = attention_implementation(q.dtype, q.shape[-1])
        kw = dict(key_value_seq_lengths=jnp.broadcast_to(
            (positions[-1] + 1).astype(jnp.int32), (b,)))
    else:  # a mask relative to each query's position: XLA's implementation
        impl = "xla" if impl == "cudnn" else impl
        kpos = jnp.arange(keys.shape[1])
        visible = kpos[None, :] <= positions[:, None]
        if window is not None:
            visible &= kpos[None, :] > positions[:, None] - window
        kw = dict(mask=visible[None, None])
    out, lse = jax.nn.dot_product_attention(q, keys, values, implementation=impl,
                                            return_residual=True, **kw)
    # the sink's share of the softmax: Z / (Z + exp(sink)), Z = exp(lse)
    keep = jax.nn.sigmoid(lse.astype(jnp.float32) - sinks.astype(jnp.float32))  # (B, T, N)
    return (out.astype(jnp.float32) * keep[..., None]).astype(q.dtype)


class KVCache(NamedTuple):
    """Every layer's keys and values, (L, 2, B, max_len, kv_heads, head_dim)."""
    kv: jax.Array


def init_cache(cfg: GptOssConfig, batch: int, max_len: int, dtype=jnp.bfloat16) -> KVCache:
    shape = (cfg.num_hidden_layers, 2, batch, max_len, cfg.num_key_value_heads, cfg.head_dim)
    return KVCache(jnp.zeros(shape, dtype))


def route(x, router, bias, top_k: int):
    """Top-k routing of tokens x (T, H), router (H, E), bias (E,): (order, group_sizes, experts
    of the sorted pairs, weights (T, k) f32: the softmax over the k chosen logits)."""
    logits = router_logits(x, router) + bias.astype(jnp.float32)
    top, experts = lax.top_k(logits, top_k)
    weights = jax.nn.softmax(top, axis=-1)
    flat = experts.reshape(-1)
    order = stable_order(flat, num_keys=router.shape[-1])
    group_sizes = jnp.bincount(flat, length=router.shape[-1]).astype(jnp.int32)
    return order, group_sizes, flat[order], weights


def clamped_swiglu(h, limit: float):
    """gpt-oss's activation of a fused gate_up output h (..., 2I) (gate columns, then up), f32:
    gate clamped above at `limit`, up to [-limit, limit]; (up + 1) * gate * sigmoid(1.702 gate)."""
    gate, up = jnp.split(h.astype(jnp.float32), 2, axis=-1)
    gate = jnp.minimum(gate, limit)
    up = jnp.clip(up, -limit, limit)
    return (up + 1.0) * (gate * jax.nn.sigmoid(SWIGLU_ALPHA * gate))


def moe(cfg: GptOssConfig, p: dict, x, i):
    """The sparse MLP of layer i for x (..., H): tokens sorted by expert, `jbs.ragged_gemm` on
    the layer's experts read in place from the (L, E, out, in) stacks, biases per row's
    expert, back to token order and combined with the router weights."""
    lead, h = x.shape[:-1], x.shape[-1]
    xt = x.reshape(-1, h)
    k, layers = cfg.num_experts_per_tok, cfg.num_hidden_layers
    order, gs, row_expert, weights = route(xt, _at(p["router"], i), _at(p["router_bias"], i), k)
    rows = xt[order // k]
    gs = layer_group_sizes(gs, layer=i, layers=layers)
    gate_up_bias, down_bias = _at(p["gate_up_bias"], i), _at(p["down_bias"], i)
    hh = jbs.ragged_gemm(rows, flatten_layers(p["gate_up"]), gs, out_dtype=jnp.float32)
    act = clamped_swiglu(hh + gate_up_bias[row_expert].astype(jnp.float32), cfg.swiglu_limit)
    y = jbs.ragged_gemm(act.astype(x.dtype), flatten_layers(p["down"]), gs,
                        out_dtype=jnp.float32)
    y = y + down_bias[row_expert].astype(jnp.float32)
    unsorted = unsort_rows(y, order).reshape(xt.shape[0], k, h)
    out = jnp.einsum("tkh,tk->th", unsorted, weights)
    return out.astype(x.dtype).reshape(*lead, h)


def decoder_layer(cfg: GptOssConfig, p: dict, h, kv, i, pos, layer_type: str):
    """Layer i (a traced index into the stacks) of type `layer_type` on h (B, T, H) at
    positions pos..pos+T-1; writes its keys / values into the stacked cache kv."""
    b, t, _ = h.shape
    kvh, hd, n = cfg.num_key_value_heads, cfg.head_dim, cfg.num_attention_heads
    positions = pos + jnp.arange(t)
    x = rms_norm(h, _at(p["input_layernorm"], i), cfg.rms_norm_eps)
    q = linear(x, p["q_proj"], p["q_bias"], i).reshape(b, t, n, hd)
    k = linear(x, p["k_proj"], p["k_bias"], i).reshape(b, t, kvh, hd)
    v = linear(x, p["v_proj"], p["v_bias"], i).reshape(b, t, kvh, hd)
    inv_freq, scaling = cfg.rope_frequencies()
    q, k = rope(q, positions, inv_freq, scaling), rope(k, positions, inv_freq, scaling)
    new = jnp.stack([k, v])[None].astype(kv.dtype)
    kv = lax.dynamic_update_slice(kv, new, (i, 0, 0, pos, 0, 0))
    keys, values = _at(kv, i)
    window = cfg.sliding_window if layer_type == "sliding_attention" else None
    a = attend(q, keys, values, _at(p["sinks"], i), positions, window=window,
               attention=cfg.attention)
    h = h + linear(a.reshape(b, t, n * hd), p["o_proj"], p["o_bias"], i)
    x = rms_norm(h, _at(p["post_attention_layernorm"], i), cfg.rms_norm_eps)
    return h + moe(cfg, p, x, i), kv


def forward(cfg: GptOssConfig, params: dict, tokens, cache: KVCache, pos, dtype=jnp.bfloat16):
    """Logits (B, T, V) f32 for tokens (B, T) at positions pos..pos+T-1, and the cache with
    their keys and values written. One scan step runs `cfg.period` layers (their types known
    when traced); the stacked weights are indexed at each layer, never scanned over."""
    h = params["embed"][tokens].astype(dtype)
    p, period = params["layers"], cfg.period

    def step(carry, _):
        h, kv, i = carry
        for j in range(period):
            h, kv = decoder_layer(cfg, p, h, kv, i + j, pos, cfg.layer_types[j])
        return (h, kv, i + period), None

    (h, kv, _), _ = lax.scan(step, (h, cache.kv, jnp.int32(0)), None,
                             length=cfg.num_hidden_layers // period)
    h = rms_norm(h, params["norm"], cfg.rms_norm_eps)
    logits = lax.dot_general(h, params["lm_head"].astype(h.dtype), (((2,), (1,)), ((), ())),
                             preferred_element_type=jnp.float32)
    return logits, KVCache(kv)


class GptOss:
    """cfg and params together: ``model(tokens, cache, pos)`` is `forward` under `jax.jit`."""

    def __init__(self, cfg: GptOssConfig, params: dict, dtype=jnp.bfloat16):
        self.cfg, self.params, self.dtype = cfg, params, dtype
        self._forward = jax.jit(functools.partial(forward, cfg, dtype=dtype), donate_argnums=2)

    def __call__(self, tokens, cache: KVCache, pos):
        return self._forward(self.params, jnp.asarray(tokens), cache, jnp.int32(pos))


def generate(model: GptOss, prompt, steps: int, max_len: int | None = None):
    """Greedy decoding: the prompt (B, T0) run at once, then `steps` tokens one at a time with
    the KV cache. Returns the new tokens (B, steps) int32."""
    prompt = jnp.asarray(prompt, jnp.int32)
    b, t0 = prompt.shape
    max_len = max_len or t0 + steps
    if t0 + steps > max_len:
        raise ValueError(f"a prompt of {t0} and {steps} new tokens need a cache of "
                         f"{t0 + steps} positions; max_len={max_len}")
    cache = init_cache(model.cfg, b, max_len, model.dtype)
    logits, cache = model(prompt, cache, 0)
    out = []
    token = jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32)
    for s in range(steps):
        out.append(token)
        if s + 1 == steps:
            break
        logits, cache = model(token[:, None], cache, t0 + s)
        token = jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32)
    return jnp.stack(out, axis=1)


# ---------------------------------------------------------------------------------------------
# Loading a Hugging Face gpt-oss checkpoint (experts in the original MXFP4 layout)


ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")


@functools.partial(jax.jit, donate_argnums=0)
def _set_layer(stack, one, i):
    return jax.tree.map(lambda s, x: lax.dynamic_update_index_in_dim(s, x, i, 0), stack, one)


def _load_experts(ckpt, cfg: GptOssConfig, name: str, n: int, k: int, layout: str,
                  progress: bool):
    """One expert weight of every layer as an (L, E, n, k) mxfp4 BlockScaled, gate_up's rows
    de-interleaved (gate first). Layer by layer into a preallocated device stack (the stack and
    one layer on the device at a time)."""
    e = cfg.num_experts
    stack = None
    layers = range(cfg.num_hidden_layers)
    if progress:
        try:
            from tqdm.auto import tqdm
            layers = tqdm(layers, desc=f"experts {name}", unit="layer", leave=False)
        except ImportError:
            pass
    for i in layers:
        base = f"model.layers.{i}.mlp.experts.{name}"
        blocks = ckpt.read(base + "_blocks", dtype="U8", shape=(e, n, k // 32, 16))
        scales = ckpt.read(base + "_scales", dtype=("U8", "F8_E8M0"), shape=(e, n, k // 32))
        q = interop.from_gpt_oss_mxfp4(blocks, scales, layout=layout,
                                       gate_up="concat" if name == "gate_up_proj" else None)
        if stack is None:
            stack = jax.tree.map(lambda a: jnp.zeros((cfg.num_hidden_layers, *a.shape), a.dtype),
                                 q)
        stack = _set_layer(stack, q, jnp.int32(i))
    return stack


def load_params(path, cfg: GptOssConfig, *, dtype=jnp.bfloat16, layout: str = "blocked",
                progress: bool = False) -> dict:
    """The model's params from a checkpoint folder (or an open SafetensorsCheckpoint) whose
    experts are stored in gpt-oss's MXFP4 layout (``mlp.experts.{gate_up,down}_proj_{blocks,
    scales}``): experts bit-exact as mxfp4 BlockScaled stacks, the rest cast to `dtype` (norms,
    sinks f32), stacked over layers. A missing tensor or one of the wrong shape raises
    CheckpointError naming it."""
    if not isinstance(path, interop.SafetensorsCheckpoint):
        with interop.SafetensorsCheckpoint(path) as ckpt:
            return load_params(ckpt, cfg, dtype=dtype, layout=layout, progress=progress)
    ckpt = path
    L, h, hd, e = cfg.num_hidden_layers, cfg.hidden_size, cfg.head_dim, cfg.num_experts
    n, kvh, inter = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.intermediate_size
    shapes = {"q_proj": (n * hd, h), "k_proj": (kvh * hd, h), "v_proj": (kvh * hd, h),
              "o_proj": (h, n * hd)}

    def stacked(fmt, shape, dt):
        arr = np.stack([np.asarray(ckpt.read(fmt.format(i), shape=shape), np.float32)
                        for i in range(L)])
        return jnp.asarray(arr, dt)

    layers = {}
    for name, shape in shapes.items():
        attn = f"model.layers.{{}}.self_attn.{name}"
        layers[name] = stacked(attn + ".weight", shape, dtype)
        layers[name[0] + "_bias"] = stacked(attn + ".bias", shape[:1], dtype)
    layers["sinks"] = stacked("model.layers.{}.self_attn.sinks", (n,), jnp.float32)
    for name in ("input_layernorm", "post_attention_layernorm"):
        layers[name] = stacked(f"model.layers.{{}}.{name}.weight", (h,), jnp.float32)
    layers["router"] = jnp.swapaxes(stacked("model.layers.{}.mlp.router.weight", (e, h),
                                            dtype), 1, 2)  # (L, H, E): x @ router
    layers["router_bias"] = stacked("model.layers.{}.mlp.router.bias", (e,), dtype)
    gate_up_bias = stacked("model.layers.{}.mlp.experts.gate_up_proj_bias", (e, 2 * inter),
                           dtype)
    layers["gate_up_bias"] = jnp.concatenate(interop.deinterleave_gate_up(gate_up_bias), -1)
    layers["down_bias"] = stacked("model.layers.{}.mlp.experts.down_proj_bias", (e, h), dtype)
    layers["gate_up"] = _load_experts(ckpt, cfg, "gate_up_proj", 2 * inter, h, layout, progress)
    layers["down"] = _load_experts(ckpt, cfg, "down_proj", h, inter, layout, progress)
    v = cfg.vocab_size
    embed = jnp.asarray(np.asarray(ckpt.read("model.embed_tokens.weight", shape=(v, h)),
                                   np.float32), dtype)
    if cfg.tie_word_embeddings:
        lm_head = embed
    else:
        lm_head = jnp.asarray(np.asarray(ckpt.read("lm_head.weight", shape=(v, h)),
                                         np.float32), dtype)
    norm = jnp.asarray(np.asarray(ckpt.read("model.norm.weight", shape=(h,)), np.float32))
    return {"embed": embed, "lm_head": lm_head, "norm": norm, "layers": layers}


def load_gpt_oss(path, *, dtype=jnp.bfloat16, layout: str = "blocked", progress: bool = True,
                 attention: str = "auto") -> tuple[GptOssConfig, GptOss]:
    """gpt-oss from a Hugging Face checkpoint folder (config.json, *.safetensors and their
    index) whose experts are MXFP4 as openai publishes them (config.json's
    ``quantization_config.quant_method`` "mxfp4"). `dtype`: the activations' and the
    unquantized weights' dtype. attention: "auto" (cuDNN where it runs, `attend`), "xla" or
    "cudnn" (decode steps of full-attention layers)."""
    path = Path(path)
    where = str(path / "config.json")
    d = json.loads((path / "config.json").read_text())
    cfg = GptOssConfig.from_json(d, where, attention=attention)
    quant = d.get("quantization_config")
    method = quant.get("quant_method") if isinstance(quant, dict) else None
    if method != "mxfp4":
        raise ConfigError(f"{where}: quantization_config.quant_method is {method!r}; this "
                          "loader reads gpt-oss's MXFP4 experts ('mxfp4', as "
                          "openai/gpt-oss-20b and -120b are published)")
    params = load_params(path, cfg, dtype=dtype, layout=layout, progress=progress)
    return cfg, GptOss(cfg, params, dtype)


def dequantize_params(params: dict, dtype=jnp.float32) -> dict:
    """The experts as float arrays (exact in f32), for references: {"gate_up": (L, E, 2I, H),
    "down": (L, E, H, I)}."""
    layers = dict(params["layers"])
    for name in ("gate_up", "down"):
        layers[name] = jbs.dequantize(layers[name], dtype)
    return dict(params, layers=layers)


def reference_moe(cfg: GptOssConfig, p: dict, x, i: int):
    """The sparse MLP of layer i with dequantized experts, every expert on every token, in f32
    (a slow reference for tests)."""
    x32 = x.astype(jnp.float32)
    logits = x32 @ p["router"][i].astype(jnp.float32) + p["router_bias"][i]
    top, experts = lax.top_k(logits, cfg.num_experts_per_tok)
    w = jax.nn.softmax(top, -1)
    gu = jnp.einsum("...h,enh->...en", x32, p["gate_up"][i]) + p["gate_up_bias"][i]
    y = jnp.einsum("...en,ehn->...eh", clamped_swiglu(gu, cfg.swiglu_limit), p["down"][i])
    y = y + p["down_bias"][i]
    chosen = jnp.take_along_axis(y, experts[..., None], axis=-2)
    return jnp.einsum("...kh,...k->...h", chosen, w)
