"""Sharded inference with block-scaled weights: a Llama-style MLP stack on a (data x model) mesh.

Each layer is ``x + down(silu(gate(n)) * up(n))`` with ``n = rmsnorm(x)``. The weights are
quantized to NVFP4 once and stored with blocked (tensor-core) scales; gate/up are
column-parallel (their N split over "model"), down is row-parallel (its K split over "model",
so gemm reduces the partial products with one all-reduce), and the tokens are split over
"data". The same model in bf16 is the baseline: the script prints the output error against it
and tokens/s for bf16, W4A16 (bf16 activations x NVFP4 weights) and W4A4 (NVFP4 both).

    python examples/sharded_inference.py            # 8 forced CPU devices, or all GPUs
    python examples/sharded_inference.py --smoke    # tiny sizes, a few seconds
    python examples/sharded_inference.py --data 1 --model 2   # 2 GPUs (sets NCCL_NVLS_ENABLE=0)
"""
from __future__ import annotations

import argparse
import os
import time

# NVLink multicast (NVLS) stays off unless asked for: some machines fail to set it up.
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
# Forced CPU devices must be requested before JAX starts (harmless where GPUs are used).
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P  # noqa: E402

try:
    import jax_blockscale as jbs  # noqa: E402
except ImportError:  # run from a checkout without `pip install .`
    import sys
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    import jax_blockscale as jbs  # noqa: E402

FMT = "nvfp4"


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny sizes (for tests)")
    p.add_argument("--layers", type=int)
    p.add_argument("--d-model", type=int)
    p.add_argument("--d-ff", type=int)
    p.add_argument("--tokens", type=int, help="tokens per step (batch x sequence)")
    p.add_argument("--iters", type=int, default=None, help="timed steps")
    p.add_argument("--data", type=int, help="mesh size of the data axis")
    p.add_argument("--model", type=int, help="mesh size of the model axis")
    args = p.parse_args()
    gpu = jax.devices()[0].platform == "gpu"
    # d_ff is a multiple of 128 x the model axis, so every weight shard is whole scale tiles.
    sizes = (dict(layers=2, d_model=256, d_ff=512, tokens=64, iters=2) if args.smoke else
             dict(layers=4, d_model=4096, d_ff=14336, tokens=4096, iters=20) if gpu else
             dict(layers=2, d_model=512, d_ff=1536, tokens=512, iters=5))
    for k, v in sizes.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    return args


def make_mesh(args):
    n = len(jax.devices())
    model = args.model or (4 if n % 4 == 0 and n >= 8 else 2 if n % 2 == 0 else 1)
    data = args.data or n // model
    if data * model > n:
        raise SystemExit(f"mesh {data}x{model} needs {data * model} devices; have {n}")
    devices = np.asarray(jax.devices()[:data * model]).reshape(data, model)
    return jax.sharding.Mesh(devices, ("data", "model"), axis_types=(AxisType.Auto,) * 2)


# ---------------------------------------------------------------------------------------------
# Parameters: bf16 master weights, and their NVFP4 copies placed on the mesh once.


def init_params(args, seed=0):
    rng = np.random.default_rng(seed)
    d, f = args.d_model, args.d_ff

    def w(shape, fan_in):
        return jnp.asarray(rng.standard_normal(shape) / np.sqrt(fan_in), jnp.bfloat16)

    # Weights are (out, in): gemm contracts both operands' last axis.
    return [dict(gate=w((f, d), d), up=w((f, d), d), down=w((d, f), f))
            for _ in range(args.layers)]


# Where each weight lives: (spec of the (out, in) matrix). Column-parallel gate/up split their
# output features, row-parallel down splits its input features (the contracting K).
WEIGHT_SPECS = dict(gate=P("model", None), up=P("model", None), down=P(None, "model"))


def place_bf16(params, mesh):
    return [{k: jax.device_put(v, NamedSharding(mesh, WEIGHT_SPECS[k])) for k, v in layer.items()}
            for layer in params]


def place_quantized(params, mesh):
    """Quantize each weight once (blocked scales) and put elements and scales on the mesh:
    the scales' tile dims follow the elements' (out, in) split."""
    def place(w, spec):
        q = jbs.quantize(w.astype(jnp.float32), FMT, layout="blocked")
        put = lambda x, s: jax.device_put(x, NamedSharding(mesh, s))
        return jbs.BlockScaled(put(q.data, spec), put(q.scales, P(*spec, None, None, None)),
                               put(q.global_scale, P()), q.fmt, q.layout)

    return [{k: place(v, WEIGHT_SPECS[k]) for k, v in layer.items()} for layer in params]


# ---------------------------------------------------------------------------------------------
# The model. `linear(x, w)` is x @ w.T in one of three ways.


def rmsnorm(x):
    x32 = x.astype(jnp.float32)
    return (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + 1e-6)).astype(x.dtype)


def linear_bf16(x, w):
    return jnp.einsum("md,fd->mf", x, w, preferred_element_type=jnp.float32).astype(jnp.bfloat16)


def linear_w4a16(x, w):
    return jbs.gemm(x, w, out_dtype=jnp.bfloat16)  # weight-only: bf16 activation


def linear_w4a4(x, w):
    return jbs.gemm(jbs.quantize(x, FMT), w, out_dtype=jnp.bfloat16)


def mlp_stack(params, x, linear):
    for layer in params:
        n = rmsnorm(x)
        h = jax.nn.silu(linear(n, layer["gate"])) * linear(n, layer["up"])
        x = x + linear(h, layer["down"])
    return x


# ---------------------------------------------------------------------------------------------


def collectives(compiled):
    text = compiled.as_text()
    return {c: text.count(f" {c}(") for c in ("all-gather", "all-reduce", "reduce-scatter")
            if f" {c}(" in text}


def main():
    args = parse_args()
    mesh = make_mesh(args)
    if args.tokens % mesh.shape["data"] or args.d_ff % (128 * mesh.shape["model"]):
        raise SystemExit("--tokens must divide by the data axis and --d-ff by 128 x model axis")
    platform = jax.devices()[0].platform
    print(f"{len(jax.devices())} {platform} devices, mesh data={mesh.shape['data']} x "
          f"model={mesh.shape['model']}; {args.layers} layers, d_model={args.d_model}, "
          f"d_ff={args.d_ff}, {args.tokens} tokens/step, weights {FMT} (blocked scales)")

    params = init_params(args)
    x = jax.device_put(
        jnp.asarray(np.random.default_rng(1).standard_normal((args.tokens, args.d_model)),
                    jnp.bfloat16), NamedSharding(mesh, P("data", None)))
    out_sharding = NamedSharding(mesh, P("data", None))
    runs = {
        "bf16": (place_bf16(params, mesh), linear_bf16),
        "w4a16": (place_quantized(params, mesh), linear_w4a16),
    }
    runs["w4a4"] = (runs["w4a16"][0], linear_w4a4)

    results = {}
    for name, (p, linear) in runs.items():
        step = jax.jit(lambda p, x, linear=linear: mlp_stack(p, x, linear),
                       out_shardings=out_sharding)
        y = step(p, x).block_until_ready()  # compile and warm up
        t0 = time.perf_counter()
        for _ in range(args.iters):
            y = step(p, x)
        y.block_until_ready()
        dt = (time.perf_counter() - t0) / args.iters
        results[name] = np.asarray(y, np.float32)
        err = ("" if name == "bf16" else
               f"rel. error vs bf16 {np.linalg.norm(results[name] - results['bf16']) / np.linalg.norm(results['bf16']):.4f}, ")
        print(f"{name:6s} {err}{args.tokens / dt:12.1f} tokens/s ({dt * 1e3:.2f} ms/step), "
              f"collectives {collectives(step.lower(p, x).compile())}")
        if not np.all(np.isfinite(results[name])):
            raise SystemExit(f"{name}: non-finite output")


if __name__ == "__main__":
    main()
