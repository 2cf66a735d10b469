"""jax_blockscale.nn: the Flax layers, quantize_params / quantize_model, and jax.export of a model."""
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

flax = pytest.importorskip("flax")
from flax import linen, nnx  # noqa: E402

import jax_blockscale as jbs  # noqa: E402
from jax_blockscale import nn as jnn  # noqa: E402

TOL = 1e-5  # same operands, same backend; only fusion and accumulation order may differ

# (weight format, activation format); None = weight-only
LAYER_CASES = [("nvfp4", "nvfp4"), ("mxfp4", "mxfp8_e4m3"), ("mxfp8_e4m3", "mxfp8_e4m3"),
               ("mxfp6_e2m3", "mxfp6_e3m2"), ("nvfp4", None), ("mxfp8_e5m2", None)]


def normal(seed, shape, dtype=np.float32):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), dtype)


def rel_err(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return np.linalg.norm(got - want) / np.linalg.norm(want)


class MLP(nnx.Module):
    def __init__(self, sizes, rngs):
        self.layers = nnx.List([nnx.Linear(a, b, rngs=rngs) for a, b in zip(sizes, sizes[1:])])

    def __call__(self, x):
        for layer in self.layers[:-1]:
            x = jax.nn.gelu(layer(x))
        return self.layers[-1](x)


# ---------------------------------------------------------------------------------------------
# The layer


@pytest.mark.parametrize("fmt,act_fmt", LAYER_CASES)
def test_layer_matches_gemm(fmt, act_fmt):
    """QuantizedLinear == gemm on the same operands (+ bias), for a (batch, seq, in) input."""
    k, n = 64, 48
    layer = jnn.QuantizedLinear(k, n, fmt=fmt, act_fmt=act_fmt, dtype=jnp.float32,
                                kernel=normal(0, (k, n)), bias=normal(1, (n,)))
    x = normal(2, (3, 5, k))
    w = layer.kernel.get_value()
    assert w.shape == (n, k) and w.layout == "blocked" and w.fmt == fmt
    a = x.reshape(15, k)
    a = jbs.quantize(a, act_fmt) if act_fmt else a
    want = jbs.gemm(a, w, out_dtype=jnp.float32) + layer.bias[...]
    got = layer(x)
    assert got.shape == (3, 5, n) and got.dtype == jnp.float32
    np.testing.assert_allclose(got.reshape(15, n), want, rtol=TOL, atol=TOL)
    jitted = nnx.jit(lambda m, x: m(x))(layer, x)
    np.testing.assert_allclose(jitted, got, rtol=TOL, atol=TOL)


def test_from_linear_transposes_once_and_keeps_dtype():
    """The (in, out) Flax kernel becomes an (out, in) weight: weight-only output equals the float
    layer run with the dequantized kernel (so a wrong transpose or swizzle would show)."""
    lin = nnx.Linear(64, 64, rngs=nnx.Rngs(0), dtype=jnp.bfloat16)
    lin.bias[...] = normal(3, (64,))
    q = jnn.QuantizedLinear.from_linear(lin, "mxfp8_e4m3")
    assert q.dtype == jnp.bfloat16 and q.act_fmt is None
    x = normal(4, (8, 64))
    y = q(x)
    assert y.dtype == jnp.bfloat16
    w = jbs.dequantize(q.kernel.get_value(), jnp.float32)  # (out, in)
    want = np.asarray(x, np.float64) @ np.asarray(w, np.float64).T + np.asarray(lin.bias[...])
    got = jnn.dense(x, q.kernel.get_value(), q.bias[...], dtype=jnp.float32)
    assert rel_err(got, want) < 1e-6
    assert rel_err(y, lin(x)) < 0.05  # and close to the float layer (mxfp8 weights)


def test_layer_rejects_bad_input():
    with pytest.raises(ValueError, match="cannot multiply"):
        jnn.QuantizedLinear(32, 8, fmt="nvfp4", act_fmt="mxfp8_e4m3", rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="block size"):
        jnn.QuantizedLinear(24, 8, fmt="mxfp4", rngs=nnx.Rngs(0))
    layer = jnn.QuantizedLinear(32, 8, fmt="mxfp4", rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="in_features=32"):
        layer(normal(0, (2, 16)))
    with pytest.raises(ValueError, match="is mxfp4, but fmt='nvfp4'"):
        jnn.QuantizedLinear(32, 8, fmt="nvfp4", kernel=layer.kernel.get_value(), use_bias=False)
    same = jnn.QuantizedLinear(32, 8, kernel=layer.kernel.get_value(), bias=layer.bias[...])
    assert same.fmt == "mxfp4"  # fmt=None: the given weight's format
    with pytest.raises(ValueError, match="needs fmt="):
        jnn.QuantizedLinear(32, 8, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"needs \(out, in\) = \(16, 32\)"):
        jnn.QuantizedLinear(32, 16, kernel=layer.kernel.get_value(), use_bias=False)


def test_weight_only_layer_trains_bias_and_input():
    """Weight-only mode differentiates through the activation and the bias."""
    layer = jnn.QuantizedLinear(32, 16, fmt="nvfp4", dtype=jnp.float32, rngs=nnx.Rngs(0))
    x = normal(5, (4, 32))

    def loss(bias, x):
        return jnp.sum(jnn.dense(x, layer.kernel.get_value(), bias) ** 2)

    gb, gx = jax.grad(loss, argnums=(0, 1))(layer.bias[...], x)
    y = jnn.dense(x, layer.kernel.get_value(), layer.bias[...])
    np.testing.assert_allclose(gb, 2 * y.sum(0), rtol=1e-5)
    w = jbs.dequantize(layer.kernel.get_value())
    np.testing.assert_allclose(gx, 2 * np.asarray(y, np.float64) @ np.asarray(w, np.float64),
                               rtol=1e-4, atol=1e-5)


# ---------------------------------------------------------------------------------------------
# quantize_params


def _params():
    return {
        "fc1": {"kernel": normal(10, (64, 40)), "bias": normal(11, (40,))},
        "fc2": {"kernel": normal(12, (48, 24)), "bias": normal(13, (24,))},  # 48: nvfp4 only
        "embed": {"embedding": normal(14, (96, 64))},
        "conv": {"kernel": normal(15, (3, 3, 32, 8))},
        "norm": {"scale": normal(16, (64,))},
    }


def test_quantize_params_touches_only_the_default_selection():
    params = _params()
    q = jnn.quantize_params(params, "mxfp4")  # block 32: fc1 (64 in) yes, fc2 (48 in) no
    assert isinstance(q["fc1"]["kernel"], jbs.BlockScaled)
    assert q["fc1"]["kernel"].shape == (40, 64) and q["fc1"]["kernel"].layout == "blocked"
    np.testing.assert_array_equal(  # exactly quantize(kernel.T)
        np.asarray(q["fc1"]["kernel"].data, np.float32),
        np.asarray(jbs.quantize(params["fc1"]["kernel"].T, "mxfp4").data, np.float32))
    untouched = [("fc1", "bias"), ("fc2", "kernel"), ("fc2", "bias"), ("embed", "embedding"),
                 ("conv", "kernel"), ("norm", "scale")]
    for a, b in untouched:
        assert q[a][b] is params[a][b], (a, b)
    q16 = jnn.quantize_params(params, "nvfp4")  # block 16: fc2's 48 divides
    assert isinstance(q16["fc2"]["kernel"], jbs.BlockScaled)
    assert q16["fc2"]["kernel"].global_scale is not None
    assert q16["embed"]["embedding"] is params["embed"]["embedding"]
    again = jnn.quantize_params(q16, "nvfp4")  # already-quantized leaves are left alone
    assert again["fc2"]["kernel"] is q16["fc2"]["kernel"]


def test_quantize_params_filters():
    params = _params()
    q = jnn.quantize_params(params, "nvfp4", filter="fc2")  # regex over 2-D leaves' paths
    assert isinstance(q["fc2"]["kernel"], jbs.BlockScaled)
    assert q["fc1"]["kernel"] is params["fc1"]["kernel"]
    q = jnn.quantize_params(params, "nvfp4", filter=lambda path, leaf: path == "embed/embedding")
    assert q["embed"]["embedding"].shape == (64, 96)
    assert q["fc1"]["kernel"] is params["fc1"]["kernel"]
    with pytest.raises(ValueError, match="fc2/kernel"):  # selected but 48 % 32 != 0
        jnn.quantize_params(params, "mxfp4", filter="kernel")
    with pytest.raises(ValueError, match="unknown block-scaled format"):
        jnn.quantize_params(params, "fp3")


def test_quantize_params_progress_bar_is_optional(monkeypatch, capsys):
    params = {f"l{i}": {"kernel": normal(i, (32, 8))} for i in range(3)}
    q = jnn.quantize_params(params, "mxfp8_e4m3", progress=True)
    assert "quantize_params" in capsys.readouterr().err  # tqdm wrote its bar
    monkeypatch.setitem(sys.modules, "tqdm.auto", None)  # tqdm not installed
    q2 = jnn.quantize_params(params, "mxfp8_e4m3", progress=True)
    assert capsys.readouterr().err == ""
    for i in range(3):
        np.testing.assert_array_equal(np.asarray(q[f"l{i}"]["kernel"].data, np.float32),
                                      np.asarray(q2[f"l{i}"]["kernel"].data, np.float32))


def test_import_does_not_pull_in_flax():
    code = ("import sys, jax_blockscale, jax_blockscale.interop.params_file; "
            "assert 'flax' not in sys.modules, 'flax imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


# ---------------------------------------------------------------------------------------------
# Whole models


def test_quantize_model_nnx():
    model = MLP([64, 96, 32, 10], nnx.Rngs(0))  # in-dims 64, 96, 32: all multiples of 32
    x = normal(20, (16, 64))
    want = model(x)
    q = jnn.quantize_model(nnx.clone(model), "mxfp8_e4m3", act_fmt="mxfp8_e4m3")
    assert all(isinstance(layer, jnn.QuantizedLinear) for layer in q.layers)
    assert rel_err(q(x), want) < 0.15  # a transposed or mis-swizzled weight gives ~1.0
    np.testing.assert_array_equal(q.layers[0].bias[...], model.layers[0].bias[...])
    # A layer the filter skips stays a float nnx.Linear, unchanged.
    q2 = jnn.quantize_model(nnx.clone(model), "mxfp4", filter="layers/0/")
    assert isinstance(q2.layers[0], jnn.QuantizedLinear)
    assert type(q2.layers[1]) is nnx.Linear and type(q2.layers[2]) is nnx.Linear
    np.testing.assert_array_equal(q2.layers[1].kernel[...], model.layers[1].kernel[...])
    y = nnx.jit(lambda m, x: m(x))(q, x)
    np.testing.assert_allclose(y, q(x), rtol=TOL, atol=TOL)
    # Only biases remain nnx.Params (what an optimizer would see).
    assert all(p[-1] == "bias" for p, _ in nnx.to_flat_state(nnx.state(q, nnx.Param)))


def test_from_quantized_params_checks_what_it_loads():
    model = MLP([64, 32, 16], nnx.Rngs(0))
    qparams = jnn.quantize_params(nnx.state(model, nnx.Param), "nvfp4")
    other = MLP([64, 48, 16], nnx.Rngs(0))
    with pytest.raises(ValueError, match="layers/0: the quantized kernel has shape"):
        jnn.from_quantized_params(other, qparams)
    qparams["extra"] = {"kernel": qparams["layers"][0]["kernel"]}
    with pytest.raises(ValueError, match="no nnx.Linear there"):
        jnn.from_quantized_params(nnx.clone(model), qparams)
    del qparams["extra"]
    abstract = nnx.eval_shape(lambda: MLP([64, 32, 16], nnx.Rngs(0)))  # no float weights made
    q = jnn.from_quantized_params(abstract, qparams, act_fmt="nvfp4")
    x = normal(21, (4, 64))
    assert rel_err(q(x), model(x)) < 0.3  # nvfp4 weights and activations
    # A layer left float (48 is not a multiple of mxfp4's 32) gets its weights from qparams too.
    model = MLP([64, 48, 16], nnx.Rngs(1))
    qparams = jnn.quantize_params(nnx.state(model, nnx.Param), "mxfp4")
    abstract = nnx.eval_shape(lambda: MLP([64, 48, 16], nnx.Rngs(0)))
    q = jnn.from_quantized_params(abstract, qparams)
    assert type(q.layers[1]) is nnx.Linear
    np.testing.assert_array_equal(q.layers[1].kernel[...], model.layers[1].kernel[...])
    assert rel_err(q(x), model(x)) < 0.3


class LinenMLP(linen.Module):
    quantized: bool = False
    backend: str | None = None

    @linen.compact
    def __call__(self, x):
        def dense(features, name):  # explicit names: Linen auto-names by class
            if self.quantized:
                return jnn.QuantizedDense(features, act_fmt="nvfp4", backend=self.backend,
                                          name=name)
            return linen.Dense(features, name=name)
        return dense(16, "fc2")(jax.nn.relu(dense(64, "fc1")(x)))


def test_linen_quantized_dense():
    x = normal(30, (8, 32))
    params = LinenMLP().init(jax.random.key(0), x)["params"]
    qparams = jnn.quantize_params(params, "nvfp4")
    y = jax.jit(LinenMLP(quantized=True).apply)({"params": qparams}, x)
    h = jnn.dense(x, qparams["fc1"]["kernel"], params["fc1"]["bias"], act_fmt="nvfp4")
    want = jnn.dense(jax.nn.relu(h), qparams["fc2"]["kernel"], params["fc2"]["bias"],
                     act_fmt="nvfp4")
    np.testing.assert_allclose(y, want, rtol=TOL, atol=TOL)
    assert rel_err(y, LinenMLP().apply({"params": params}, x)) < 0.2
    with pytest.raises(TypeError, match="quantize_params"):
        LinenMLP(quantized=True).apply({"params": params}, x)
    init = jnn.QuantizedDense(8, fmt="mxfp4").init(jax.random.key(1), x)["params"]
    assert init["kernel"].fmt == "mxfp4" and init["kernel"].shape == (8, 32)
    with pytest.raises(ValueError, match="expects a nvfp4 kernel"):
        jnn.QuantizedDense(8, fmt="nvfp4").apply({"params": init}, x)


# ---------------------------------------------------------------------------------------------
# jax.export


def test_exported_nnx_model_round_trips(tmp_path):
    """A jitted NNX model with quantized weights (baked in as constants) exports for CPU and CUDA,
    serializes, and runs again after deserialization, in this process and in a fresh one that
    does not import jax_blockscale (the reference lowering is plain StableHLO)."""
    model = MLP([64, 64, 16], nnx.Rngs(0))
    # The reference backend, forced: on a GPU the sm90/sm100 lowering would put our custom call
    # into the artifact (test_gpu_custom_call_export_... covers what that needs).
    q = jnn.quantize_model(model, "nvfp4", act_fmt="nvfp4", backend="reference")
    fn = jax.jit(lambda x: q(x))
    x = normal(40, (8, 64))
    exp = jax.export.export(fn, platforms=("cpu", "cuda"))(x)
    assert "custom_call @jax_blockscale" not in exp.mlir_module()
    blob = exp.serialize()
    y = jax.export.deserialize(blob).call(x)
    np.testing.assert_array_equal(y, fn(x))
    (tmp_path / "model.bin").write_bytes(blob)
    np.save(tmp_path / "x.npy", np.asarray(x))
    np.save(tmp_path / "y.npy", np.asarray(y))
    code = f"""
import sys, jax, numpy as np
d = {str(tmp_path)!r}
exp = jax.export.deserialize(open(d + "/model.bin", "rb").read())
y = exp.call(np.load(d + "/x.npy"))
np.testing.assert_array_equal(np.asarray(y), np.load(d + "/y.npy"))
assert "jax_blockscale" not in sys.modules
"""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    subprocess.run([sys.executable, "-c", code], check=True, env=env)


def test_exported_linen_model_takes_quantized_params():
    """Parameters (BlockScaled inside dicts) as arguments of the exported function."""
    x = normal(41, (8, 32))
    params = LinenMLP().init(jax.random.key(0), x)["params"]
    qparams = jnn.quantize_params(params, "nvfp4")
    fn = jax.jit(LinenMLP(quantized=True, backend="reference").apply)
    exp = jax.export.export(fn)({"params": qparams}, x)
    again = jax.export.deserialize(exp.serialize())
    np.testing.assert_array_equal(again.call({"params": qparams}, x),
                                  fn({"params": qparams}, x))


def test_gpu_custom_call_export_needs_the_documented_allowance():
    """docs/serving.md: jax.export refuses our FFI target unless allowed at export; import has no
    allow-list, but running needs the target registered. (Checks the recipe with a stand-in
    function that calls the sm90 target, so it runs without a GPU.)"""
    from jax_blockscale import _plugin

    target = _plugin.SM90_TARGET
    assert target == "jax_blockscale_gemm_sm90"

    def f(x):
        return jax.ffi.ffi_call(target, jax.ShapeDtypeStruct(x.shape, x.dtype))(x)

    x = jnp.ones((4,), jnp.float32)
    with pytest.raises(ValueError, match="custom calls whose targets have no compatibility"):
        jax.export.export(jax.jit(f), platforms=("cuda",))(x)
    allow = [jax.export.DisabledSafetyCheck.custom_call(target)]
    blob = jax.export.export(jax.jit(f), platforms=("cuda",), disabled_checks=allow)(x).serialize()
    assert jax.export.deserialize(blob).platforms == ("cuda",)
    on_cpu = jax.export.export(jax.jit(f), platforms=("cpu",), disabled_checks=allow)(x)
    with pytest.raises(Exception, match=f"No FFI handler registered for {target}"):
        jax.export.deserialize(on_cpu.serialize()).call(x)


@pytest.mark.gpu
def test_exported_layer_on_hopper_holds_the_sm90_call():
    """On an H100 with the library: the export carries our FFI target (a W4A4 layer at 16 rows:
    the target that quantizes the activation in the GEMM's call), needs the allowance, and the
    deserialized artifact runs (targets registered in this process) and matches."""
    from jax_blockscale import _plugin
    from jax_blockscale.lowering import ffi_sm90  # noqa: F401  (registers the sm90 backend)

    from hopper import hopper_with_library  # tests/support/hopper.py

    if not hopper_with_library():
        pytest.skip("needs an sm90 GPU and libjax_blockscale.so")
    layer = jnn.QuantizedLinear(256, 256, fmt="nvfp4", act_fmt="nvfp4", dtype=jnp.bfloat16,
                                rngs=nnx.Rngs(0))
    fn = jax.jit(lambda x: layer(x))
    x = normal(50, (16, 256), jnp.bfloat16)
    with pytest.raises(ValueError, match="custom calls"):
        jax.export.export(fn)(x)
    target = _plugin.QUANTIZED_ACT_SM90_TARGET
    with pytest.raises(ValueError, match="custom calls"):  # another target's allowance
        jax.export.export(fn, disabled_checks=[
            jax.export.DisabledSafetyCheck.custom_call(_plugin.SM90_TARGET)])(x)
    allow = [jax.export.DisabledSafetyCheck.custom_call(target)]
    exp = jax.export.export(fn, disabled_checks=allow)(x)
    assert target in exp.mlir_module()
    assert _plugin.register_targets()
    y = jax.export.deserialize(exp.serialize()).call(x)
    np.testing.assert_allclose(np.asarray(y, np.float32), np.asarray(fn(x), np.float32),
                               rtol=1e-2, atol=1e-2)


# ---------------------------------------------------------------------------------------------
# A given activation scale (static W4A4)


def test_layers_with_a_given_activation_scale():
    """QuantizedLinear / QuantizedDense(act_global_scale=g) == gemm(quantize(x, "nvfp4",
    global_scale=g), w) + bias, eagerly and under jit; the scale is an ActivationScale (not a
    Param), in the model's state; a different scale gives a different result."""
    k, n = 64, 48
    x = normal(40, (3, 5, k))
    g = float(np.abs(np.asarray(x)).max()) / 2688 / 2  # the largest blocks saturate
    layer = jnn.QuantizedLinear(k, n, fmt="nvfp4", act_fmt="nvfp4", dtype=jnp.float32,
                                kernel=normal(41, (k, n)), bias=normal(42, (n,)),
                                act_global_scale=g)
    w = layer.kernel.get_value()
    a = jbs.quantize(x.reshape(15, k), "nvfp4", global_scale=g)
    want = jbs.gemm(a, w, out_dtype=jnp.float32) + layer.bias[...]
    got = layer(x)
    np.testing.assert_allclose(got.reshape(15, n), want, rtol=TOL, atol=TOL)
    np.testing.assert_allclose(nnx.jit(lambda m, x: m(x))(layer, x), got, rtol=TOL, atol=TOL)
    assert isinstance(layer.act_global_scale, jnn.ActivationScale)
    assert len(jax.tree.leaves(nnx.state(layer, jnn.ActivationScale))) == 1
    assert len(jax.tree.leaves(nnx.state(layer, nnx.Param))) == 1  # the bias only
    calibrated = jnn.QuantizedLinear(k, n, fmt="nvfp4", act_fmt="nvfp4", dtype=jnp.float32,
                                     kernel=normal(41, (k, n)), bias=normal(42, (n,)))
    assert rel_err(calibrated(x), got) > 1e-4
    calibrated.act_global_scale = jnn.ActivationScale(jnp.float32(g))  # set on a built layer
    np.testing.assert_allclose(nnx.jit(lambda m, x: m(x))(calibrated, x), got, rtol=TOL,
                               atol=TOL)

    dense = jnn.QuantizedDense(n, act_fmt="nvfp4", act_global_scale=g, dtype=jnp.float32)
    params = {"kernel": w, "bias": layer.bias[...]}
    np.testing.assert_allclose(jax.jit(dense.apply)({"params": params}, x), got,
                               rtol=TOL, atol=TOL)


@pytest.mark.parametrize("act_fmt,g,match", [
    (None, 0.01, "needs act_fmt='nvfp4'"), ("mxfp8_e4m3", 0.01, "needs act_fmt='nvfp4'"),
    ("nvfp4", [0.01, 0.02], "act_global_scale has shape"), ("nvfp4", 0.0, "finite and positive"),
    ("nvfp4", float("nan"), "finite and positive"), ("nvfp4", -1.0, "finite and positive")])
def test_layers_reject_a_bad_activation_scale(act_fmt, g, match):
    fmt = "mxfp8_e4m3" if act_fmt == "mxfp8_e4m3" else "nvfp4"
    with pytest.raises(ValueError, match=match):
        jnn.QuantizedLinear(32, 16, fmt=fmt, act_fmt=act_fmt, act_global_scale=g,
                            rngs=nnx.Rngs(0))
    params = {"kernel": jbs.quantize(normal(3, (16, 32)), fmt, layout="blocked")}
    with pytest.raises(ValueError, match=match):
        jnn.QuantizedDense(16, act_fmt=act_fmt, act_global_scale=g, use_bias=False).apply(
            {"params": params}, normal(4, (2, 32)))
