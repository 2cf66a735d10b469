"""Generate tokens with a Llama loaded from a ModelOpt NVFP4 safetensors checkpoint.

    python examples/llama/write_checkpoint.py /tmp/llama-nvfp4 --tiny
    python examples/llama/generate.py /tmp/llama-nvfp4 --new-tokens 16
    python examples/llama/generate.py --moe             # writes a tiny MoE checkpoint first
    python examples/llama/generate.py /tmp/llama-nvfp4 --w4a4    # activations NVFP4 too

The checkpoint's projections load bit-exact into NVFP4 `BlockScaled` weights (blocked scales,
one global scale per layer), stacked for `lax.scan`; each step runs under one `jax.jit`
(prefill of the prompt, then one token at a time with a KV cache), with weight-only `jbs.gemm`
(bf16 activations x NVFP4 weights). A mixture-of-experts checkpoint (config.json has
num_experts) runs its MLPs as `jax_blockscale.nn.QuantizedMoE`: a bf16 router, the per-expert
NVFP4 tensors stacked into (L, E, N, K) weights with one global scale per expert, weight-only
`jbs.ragged_gemm`. With ``--w4a4`` the dense projections' activations are quantized to NVFP4
with the checkpoint's per-layer `input_scale` (static W4A4, `jbs.gemm(..., quantize_a="nvfp4",
a_global_scale=...)`), as the checkpoint was calibrated. Without a checkpoint argument a tiny random one is written to a temporary
directory (``--moe``: 4 experts, top-2). Greedy decoding; the prompt is random token ids (the
checkpoint's weights are random too: the tokens mean nothing, the point is the path).
"""
from __future__ import annotations

import argparse
import functools
import os
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
from flax import nnx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from model import LlamaConfig, init_cache, load_llama  # noqa: E402


@functools.partial(jax.jit, static_argnums=0, donate_argnums=3)
def _step(graphdef, state, tokens, cache, pos):
    """One forward pass under jit: logits of the last position, greedy next token, cache."""
    model = nnx.merge(graphdef, state)
    logits, cache = model(tokens, cache, pos)
    return jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32), cache


def generate(model, prompt: jax.Array, new_tokens: int, *, max_len: int | None = None):
    """Greedy continuation of `prompt` (B, T) by `new_tokens` tokens: returns (B, new_tokens)."""
    b, t = prompt.shape
    max_len = max_len or t + new_tokens
    if t + new_tokens > max_len:
        raise ValueError(f"prompt ({t}) + new tokens ({new_tokens}) exceed max_len {max_len}")
    graphdef, state = nnx.split(model)
    cache = init_cache(model.cfg, b, max_len, model.dtype)
    token, cache = _step(graphdef, state, prompt, cache, jnp.int32(0))  # prefill
    out = [token]
    for i in range(new_tokens - 1):
        token, cache = _step(graphdef, state, token[:, None], cache, jnp.int32(t + i))
        out.append(token)
    return jnp.stack(out, axis=1)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("checkpoint", nargs="?", help="a directory written by write_checkpoint.py "
                   "(or a ModelOpt NVFP4 Llama export); none: write a tiny random one first")
    p.add_argument("--moe", action="store_true", help="the tiny checkpoint written when none is "
                   "given is a mixture of experts; with a checkpoint: require it to be one")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--prompt-len", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--no-scan", action="store_true", help="unroll the layers instead of scan")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--w4a4", action="store_true", help="quantize the dense projections' "
                   "activations to NVFP4 with the checkpoint's input scales (static W4A4)")
    a = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        if a.checkpoint is None:
            from write_checkpoint import write_checkpoint
            a.checkpoint = write_checkpoint(
                tmp, LlamaConfig.tiny_moe() if a.moe else LlamaConfig.tiny(), seed=a.seed,
                std=0.2, log=lambda *_: None)
            print(f"wrote a tiny random {'MoE ' if a.moe else ''}checkpoint to {a.checkpoint}")
        start = time.perf_counter()
        cfg, model = load_llama(a.checkpoint, scan_layers=not a.no_scan, w4a4=a.w4a4)
    if a.moe and not cfg.is_moe:
        p.error(f"--moe: {a.checkpoint} is not a mixture-of-experts checkpoint")
    print(f"loaded {cfg.num_hidden_layers} layers (hidden {cfg.hidden_size}) in "
          f"{time.perf_counter() - start:.1f} s on {jax.devices()[0].device_kind}")
    if cfg.is_moe:
        layer = model.layers[0] if a.no_scan else model.layers  # scanned: all layers stacked
        w = layer.mlp.gate_up.get_value()
        print(f"MoE: {cfg.num_experts} experts, top-{cfg.num_experts_per_tok}; gate_up "
              f"{w.fmt} {w.shape}, global scales {tuple(w.global_scale.shape)}")
    prompt = jax.random.randint(jax.random.key(a.seed), (a.batch, a.prompt_len), 0,
                                cfg.vocab_size, jnp.int32)
    tokens = generate(model, prompt, a.new_tokens)  # compiles prefill and decode once each
    start = time.perf_counter()
    tokens = jax.block_until_ready(generate(model, prompt, a.new_tokens))
    elapsed = time.perf_counter() - start
    for row in range(a.batch):
        print(f"prompt {prompt[row].tolist()} -> {tokens[row].tolist()}")
    print(f"{a.new_tokens} tokens x batch {a.batch} in {elapsed * 1e3:.0f} ms "
          f"({a.batch * a.new_tokens / elapsed:.1f} tokens/s, compiled)")


if __name__ == "__main__":
    main()
