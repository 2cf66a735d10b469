"""Train a small Flax NNX MLP in bf16, quantize it once, save, load and serve it in NVFP4 / MXFP8.

    pip install ".[flax]"           # flax, optax (pulled in by flax) and tqdm
    python examples/flax_mlp.py     # about 30 s on a laptop CPU
    python examples/flax_mlp.py --smoke   # tiny sizes, a few seconds (what CI runs)

The task is synthetic: a Gaussian mixture with several clusters per class. The student
trains with bf16 activations and f32 master weights, then `quantize_params` converts its Linear
kernels (in, out) into block-scaled weights (out, in) once; `save_params` / `load_params` store
them bit-exactly; `from_quantized_params` loads them into a model skeleton that never holds
float weights. Each served variant is compared with the bf16 model: test accuracy, how often it
predicts the same class, and the relative error of its logits. "nvfp4 W4A4 static" calibrates
each layer's activation scale once on training inputs (as a W4A4 checkpoint's `input_scale`)
and serves with it (`act_global_scale`) instead of measuring one on every call.
"""
from __future__ import annotations

import argparse
import os
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import jax_blockscale as jbs
from jax_blockscale import nn as jnn
from jax_blockscale.interop.params_file import load_params, save_params

NOISE = 0.7  # per-coordinate spread of each cluster (centers have norm 4): the task's difficulty

# (label, weight format, activation format or None for weight-only, static activation scales)
VARIANTS = [("nvfp4 W4A4", "nvfp4", "nvfp4", False),
            ("nvfp4 W4A4 static", "nvfp4", "nvfp4", True), ("nvfp4 W4A16", "nvfp4", None, False),
            ("mxfp8 W8A8", "mxfp8_e4m3", "mxfp8_e4m3", False),
            ("mxfp8 W8A16", "mxfp8_e4m3", None, False)]


class MLP(nnx.Module):
    def __init__(self, sizes, *, dtype, rngs):
        self.layers = nnx.List([nnx.Linear(a, b, dtype=dtype, rngs=rngs)
                                for a, b in zip(sizes, sizes[1:])])

    def __call__(self, x):
        for layer in self.layers[:-1]:
            x = jax.nn.gelu(layer(x))
        return self.layers[-1](x)


def make_data(key, n, dim, classes, *, clusters=4, noise=1.0):
    """A Gaussian mixture: each class owns `clusters` random centers (so the classes are not
    linearly separable); x = center + noise, scaled to unit variance; y = the center's class."""
    k_c, k_i, k_n = jax.random.split(key, 3)
    centers = jax.random.normal(k_c, (classes * clusters, dim)) / np.sqrt(dim) * 4.0
    idx = jax.random.randint(k_i, (n,), 0, classes * clusters)
    x = centers[idx] + noise * jax.random.normal(k_n, (n, dim))
    return (x / jnp.std(x)).astype(jnp.bfloat16), idx % classes


def train(model, x, y, *, steps, batch, lr, seed):
    optimizer = nnx.Optimizer(model, optax.adam(lr), wrt=nnx.Param)

    @nnx.jit
    def step(model, optimizer, xb, yb):
        def loss_fn(model):
            logits = model(xb).astype(jnp.float32)
            return optax.softmax_cross_entropy_with_integer_labels(logits, yb).mean()

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        return loss

    rng = np.random.default_rng(seed)
    for i in range(steps):
        idx = rng.integers(0, x.shape[0], batch)
        loss = step(model, optimizer, x[idx], y[idx])
    return float(loss)


def calibrate_activation_scales(model, x):
    """Each layer's NVFP4 activation decode factor, amax(input) / (6 * 448), from the bf16
    model run on calibration inputs `x` (what a W4A4 checkpoint ships as input_scale)."""
    scales = []
    for i, layer in enumerate(model.layers):
        scales.append(jnp.max(jnp.abs(x.astype(jnp.float32))) / (6 * 448))
        x = layer(x)
        x = jax.nn.gelu(x) if i < len(model.layers) - 1 else x
    return scales


def logits_of(model, x, batch=1024):
    run = nnx.jit(lambda m, xb: m(xb).astype(jnp.float32))
    return jnp.concatenate([run(model, x[i:i + batch]) for i in range(0, x.shape[0], batch)])


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny sizes (CI)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.smoke:
        sizes, n_train, n_test, steps, batch = [64, 128, 10], 4096, 1024, 150, 128
    else:
        sizes, n_train, n_test, steps, batch = [256, 512, 512, 10], 32768, 8192, 1000, 256

    key = jax.random.key(args.seed)
    k_data, k_model = jax.random.split(key)
    x_train, y_train = make_data(k_data, n_train + n_test, sizes[0], sizes[-1], noise=NOISE)
    x_train, x_test = x_train[:n_train], x_train[n_train:]
    y_train, y_test = y_train[:n_train], y_train[n_train:]

    model = MLP(sizes, dtype=jnp.bfloat16, rngs=nnx.Rngs(k_model))
    t0 = time.perf_counter()
    loss = train(model, x_train, y_train, steps=steps, batch=batch, lr=2e-3, seed=args.seed)
    print(f"trained MLP {sizes} in bf16: {steps} steps, final loss {loss:.4f} "
          f"({time.perf_counter() - t0:.1f} s, backend {jax.default_backend()})")

    ref = logits_of(model, x_test)
    ref_pred = jnp.argmax(ref, -1)
    print(f"{'model':<18} {'accuracy':>8} {'agree':>7} {'logits rel err':>15}")
    print(f"{'bf16':<18} {float(jnp.mean(ref_pred == y_test)):8.4f} {1.0:7.4f} {0.0:15.4f}")
    input_scales = calibrate_activation_scales(model, x_train[:1024])

    float_params = nnx.state(model, nnx.Param)
    with tempfile.TemporaryDirectory() as tmp:
        for label, fmt, act_fmt, static in VARIANTS:
            path = os.path.join(tmp, f"{fmt}.npz")
            if not os.path.exists(path):  # quantize once per weight format, then save
                save_params(path, jnn.quantize_params(float_params, fmt))
            # Serving side: a skeleton with no weights, the params it expects (shapes only),
            # and the file checked against them before anything is loaded into the model.
            skeleton = nnx.eval_shape(lambda: MLP(sizes, dtype=jnp.bfloat16, rngs=nnx.Rngs(0)))
            expected = jax.eval_shape(lambda p: jnn.quantize_params(p, fmt),
                                      nnx.state(skeleton, nnx.Param))
            qparams = load_params(path, fmt=fmt, like=expected)
            served = jnn.from_quantized_params(skeleton, qparams, act_fmt=act_fmt)
            if static:  # the calibrated scales, one per layer, instead of one per call
                for layer, g in zip(served.layers, input_scales):
                    layer.act_global_scale = jnn.ActivationScale(g)
            out = logits_of(served, x_test)
            pred = jnp.argmax(out, -1)
            err = float(jnp.linalg.norm(out - ref) / jnp.linalg.norm(ref))
            print(f"{label:<18} {float(jnp.mean(pred == y_test)):8.4f} "
                  f"{float(jnp.mean(pred == ref_pred)):7.4f} {err:15.4f}")
        sizes_on_disk = {f: os.path.getsize(os.path.join(tmp, f"{f}.npz"))
                         for f in ("nvfp4", "mxfp8_e4m3")}
    n_params = sum(int(np.prod(p.shape)) for p in jax.tree.leaves(float_params))
    print(f"on disk: nvfp4 {sizes_on_disk['nvfp4'] / 1e3:.0f} kB, mxfp8 "
          f"{sizes_on_disk['mxfp8_e4m3'] / 1e3:.0f} kB, vs bf16 {2 * n_params / 1e3:.0f} kB")
    print(f"jax_blockscale {jbs.__version__}: gemm backends {jbs.backend_names()}")


if __name__ == "__main__":
    main()
