"""A mixture-of-experts layer with block-scaled experts: `jax_blockscale.nn.QuantizedMoE` on
`jbs.ragged_gemm`, against the same layer in float, then with its experts sharded over devices.

    python examples/moe.py            # a small Qwen3-MoE-shaped layer (8 forced CPU devices)
    python examples/moe.py --smoke    # tiny sizes, a few seconds (what CI runs)

1. A float `MoE` layer (router, top-k, SwiGLU experts on lax.ragged_dot) with random weights.
2. Its experts quantized once into NVFP4 (one global scale per expert), MXFP4 and MXFP8, served
   weight-only (bf16 activations) and with quantized activations; for each: the relative error
   of the output against the float layer computed in f32, the experts' bytes, time per call.
3. Expert parallel: the NVFP4 experts sharded over every device (each holds experts / devices),
   tokens replicated; the output equals the one-device output, and the compiled program's only
   collective is the all-reduce that combines the experts' rows (no weight is gathered).
"""
from __future__ import annotations

import argparse
import os
import time

# Forced CPU devices must be requested before JAX starts (harmless where GPUs are used).
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

try:
    import jax_blockscale as jbs  # noqa: E402,F401
except ImportError:  # run from a checkout without `pip install .`
    import sys
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from jax_blockscale import nn as jnn  # noqa: E402

# (label, expert format, activation format or None for weight-only)
VARIANTS = [("nvfp4 W4A16", "nvfp4", None), ("nvfp4 W4A4", "nvfp4", "nvfp4"),
            ("mxfp4 W4A16", "mxfp4", None), ("mxfp8 W8A8", "mxfp8_e4m3", "mxfp8_e4m3")]


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny sizes (for tests)")
    p.add_argument("--tokens", type=int)
    p.add_argument("--hidden", type=int)
    p.add_argument("--intermediate", type=int)
    p.add_argument("--experts", type=int)
    p.add_argument("--top-k", type=int)
    p.add_argument("--iters", type=int)
    args = p.parse_args()
    gpu = jax.devices()[0].platform == "gpu"
    sizes = (dict(tokens=32, hidden=64, intermediate=64, experts=8, top_k=2, iters=2)
             if args.smoke else
             dict(tokens=256, hidden=2048, intermediate=768, experts=128, top_k=8, iters=20)
             if gpu else  # Qwen3-30B-A3B's expert shapes
             dict(tokens=128, hidden=512, intermediate=256, experts=16, top_k=4, iters=5))
    for k, v in sizes.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    return args


def rel_err(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


def expert_bytes(layer):
    """Bytes of the experts' elements (fp4: half a byte), scales and global scales."""
    total = 0
    for w in (layer.gate_up.get_value(), layer.down.get_value()):
        f = jbs.get_format(w.fmt)
        bits = 4 if f.element_bits == 4 else 8 * f.storage_dtype.itemsize  # fp6: uint8 codes
        total += w.data.size * bits // 8 + w.scales.size
        total += 0 if w.global_scale is None else 4 * w.global_scale.size
    return total


def per_call_ms(f, *args, iters):
    jax.block_until_ready(f(*args))
    start = time.perf_counter()
    for _ in range(iters):
        out = f(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - start) / iters * 1e3


def main():
    args = parse_args()
    devices = jax.devices()
    print(f"{len(devices)} {devices[0].platform} devices; MoE: {args.tokens} tokens, hidden "
          f"{args.hidden}, intermediate {args.intermediate}, {args.experts} experts, "
          f"top-{args.top_k}")
    moe = jnn.MoE(args.hidden, args.intermediate, args.experts, args.top_k,
                  dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.PRNGKey(1), (args.tokens, args.hidden), jnp.bfloat16)
    call = nnx.jit(lambda m, x: m(x))

    # The float layer in f32 is the reference; in bf16 it is the baseline to beat on bytes.
    moe_f32 = nnx.clone(moe)
    moe_f32.dtype = jnp.float32
    want = call(moe_f32, x)
    bf16_bytes = 2 * (moe.gate_up.size + moe.down.size)
    print(f"\n{'layer':<14}{'rel. error':>12}{'expert MB':>11}{'ms/call':>10}")
    print(f"{'bf16':<14}{rel_err(call(moe, x), want):>12.4f}{bf16_bytes / 1e6:>11.2f}"
          f"{per_call_ms(call, moe, x, iters=args.iters):>10.2f}")
    layers = {}
    for label, fmt, act_fmt in VARIANTS:
        q = jnn.QuantizedMoE.from_float(moe, fmt, act_fmt=act_fmt)
        layers[label] = q
        print(f"{label:<14}{rel_err(call(q, x), want):>12.4f}{expert_bytes(q) / 1e6:>11.2f}"
              f"{per_call_ms(call, q, x, iters=args.iters):>10.2f}")
    gs = layers["nvfp4 W4A16"].gate_up.get_value().global_scale
    print(f"nvfp4 experts carry one global scale each: shape {tuple(gs.shape)}")

    # Expert parallel: shard every expert-indexed leaf (elements, scales, global scales) on "e".
    n_dev = len(devices)
    if n_dev > 1 and args.experts % n_dev == 0:
        mesh = jax.make_mesh((n_dev,), ("e",), axis_types=(jax.sharding.AxisType.Auto,))
        layer = layers["nvfp4 W4A16"]
        graphdef, state = nnx.split(layer)

        def shard(path, leaf):
            names = [str(getattr(k, "key", getattr(k, "name", k))) for k in path]
            expert_leaf = ("gate_up" in names or "down" in names) and jnp.ndim(leaf) >= 1
            spec = P("e") if expert_leaf else P()
            return jax.device_put(leaf, NamedSharding(mesh, spec))

        sharded = jax.tree_util.tree_map_with_path(shard, state)
        f = jax.jit(lambda s, x: nnx.merge(graphdef, s)(x))
        one_device = f(state, x)
        y = f(sharded, x)
        text = f.lower(sharded, x).compile().as_text()
        found = sorted(c for c in ("all-gather", "all-reduce", "reduce-scatter", "all-to-all")
                       if c in text)
        print(f"\nexpert parallel over {n_dev} devices ({args.experts // n_dev} experts each): "
              f"rel. error vs one device {rel_err(y, one_device):.2e}; collectives: "
              f"{', '.join(found) or 'none'}")


if __name__ == "__main__":
    main()
