"""Scanned layers with block-scaled weights: `jax.lax.scan` over the layer index, each step
multiplying by its layer of the stacked weights where they lie (`jbs.gemm(x, w, layer=i)`).

    python examples/scanned_layers.py            # CPU or GPU; prints the error against unrolled

A stack of L residual MLP blocks (x + W2 gelu(W1 x)) is quantized once, stacked: NVFP4 with
one global scale per layer (`global_scale="per_matrix"`), scales in the blocked layout. The
scan keeps the stacks out of its scanned state (so nothing is sliced) and hands each step the
loop index; the result is checked against the same layers unrolled, layer by layer
(`w[i]` is layer i as its own BlockScaled). Why: a scan that slices FP4 weights has XLA copy
each layer before its GEMM (docs/design/scanned_layers.md).
"""
from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

import jax_blockscale as jbs


def block(x, w1, w2, layer=None):
    """x + w2 gelu(w1 x) for layer `layer` of stacked weights (or unstacked ones, layer None)."""
    kw = {} if layer is None else dict(layer=layer)
    h = jax.nn.gelu(jbs.gemm(x, w1, out_dtype=jnp.float32, **kw)).astype(x.dtype)
    return x + jbs.gemm(h, w2, out_dtype=x.dtype, **kw)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--ffn", type=int, default=512)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--fmt", default="nvfp4")
    args = ap.parse_args(argv)

    rng = np.random.default_rng(0)
    L, H, F = args.layers, args.hidden, args.ffn
    gs = dict(global_scale="per_matrix") if args.fmt == "nvfp4" else {}
    w1 = jbs.quantize(jnp.asarray(rng.standard_normal((L, F, H)) / np.sqrt(H), jnp.float32),
                      args.fmt, layout="blocked", **gs)  # (L, out, in)
    w2 = jbs.quantize(jnp.asarray(rng.standard_normal((L, H, F)) / np.sqrt(F), jnp.float32),
                      args.fmt, layout="blocked", **gs)
    x = jnp.asarray(rng.standard_normal((args.batch, H)), jnp.bfloat16)

    @jax.jit
    def scanned(x, w1, w2):
        def step(carry, _):  # the stacks are closed over, not scanned; the index is carried
            x, i = carry
            return (block(x, w1, w2, layer=i), i + 1), None
        return jax.lax.scan(step, (x, jnp.int32(0)), None, length=L)[0][0]

    @jax.jit
    def unrolled(x, w1, w2):
        for i in range(L):
            x = block(x, w1[i], w2[i])
        return x

    got = np.asarray(scanned(x, w1, w2), np.float32)
    want = np.asarray(unrolled(x, w1, w2), np.float32)
    err = float(np.abs(got - want).max() / np.abs(want).max())
    print(f"{L} scanned layers ({args.fmt}, on {jax.default_backend()}): output {got.shape}, "
          f"max difference from unrolled {err:.2e} of the largest value")
    # The GEMMs agree (tests/unit/test_layer_gemm.py); the residual stream is bf16, and XLA may
    # fuse and round the elementwise ops of a loop body differently from unrolled code.
    assert err < 2e-2, err


if __name__ == "__main__":
    main()
