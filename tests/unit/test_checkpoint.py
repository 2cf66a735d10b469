"""Loading safetensors checkpoints into BlockScaled (jax_blockscale.interop): sharded files with
their index JSON, stacked layers with per-layer global scales, every source layout, placement
with a sharding, and clear errors for missing tensors, wrong dtypes or shapes and truncated
files."""
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jax_blockscale as jbs
from jax_blockscale import interop
from jax_blockscale.interop import CheckpointError

pytest.importorskip("safetensors")
from safetensors.numpy import save_file  # noqa: E402

from child_runs import finish, start  # noqa: E402  (tests/support)

from test_interop import (E2M1, codes_of, gpt_oss_arrays, modelopt_arrays,  # noqa: E402
                          oracle_gpt_oss, oracle_nvfp4, pack_low_first)

L, N, K = 3, 24, 64


def write_sharded(directory: Path, shards: list[dict]):
    """Write each dict of arrays to its own file plus model.safetensors.index.json."""
    directory.mkdir(parents=True, exist_ok=True)
    weight_map = {}
    for i, tensors in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file({k: np.array(v) for k, v in tensors.items()}, str(directory / name),
                  metadata={"format": "pt"})
        weight_map.update({k: name for k in tensors})
    (directory / interop.checkpoint.INDEX_NAME).write_text(json.dumps(
        {"metadata": {"total_size": 0}, "weight_map": weight_map}))


@pytest.fixture(scope="module")
def modelopt_ckpt(tmp_path_factory):
    """L layers of one ModelOpt NVFP4 projection, spread over two files, plus a bf16 norm."""
    r = np.random.default_rng(10)
    layers, shards = [], [{}, {}]
    for i in range(L):
        codes, scales, g = modelopt_arrays(r, (), N, K)
        norm = r.standard_normal(K).astype(ml_dtypes.bfloat16)
        layers.append((codes, scales, g, norm))
        p = f"model.layers.{i}.mlp.up_proj"
        shards[i % 2].update({f"{p}.weight": pack_low_first(codes), f"{p}.weight_scale": scales,
                              f"{p}.weight_scale_2": np.array(g, np.float32),
                              f"{p}.input_scale": np.array(0.5 + i, np.float32),
                              f"model.layers.{i}.input_layernorm.weight": norm})
    path = tmp_path_factory.mktemp("modelopt")
    write_sharded(path, shards)
    return path, layers


def test_one_weight_bit_exact(modelopt_ckpt):
    path, layers = modelopt_ckpt
    codes, scales, g, _ = layers[1]
    with interop.SafetensorsCheckpoint(path) as ckpt:
        assert len(ckpt.files()) == 2 and len(ckpt) == 5 * L
        q = interop.load_quantized(ckpt, "model.layers.1.mlp.up_proj", "modelopt_nvfp4",
                                   shape=(N, K))
    assert (q.fmt, q.layout, q.shape) == ("nvfp4", "plain", (N, K))
    np.testing.assert_array_equal(codes_of(q.data), codes)
    np.testing.assert_array_equal(np.asarray(q.scales).view(np.uint8), scales.view(np.uint8))
    np.testing.assert_array_equal(np.asarray(jbs.dequantize(q)),
                                  oracle_nvfp4(codes, scales, g).astype(np.float32))


def test_stacked_layers(modelopt_ckpt):
    path, layers = modelopt_ckpt
    q = interop.load_quantized(path, "model.layers.{layer}.mlp.up_proj", "modelopt_nvfp4",
                               layers=range(L), layout="blocked")
    assert q.shape == (L, N, K) and q.layout == "blocked" and q.global_scale.shape == (L,)
    for i, (codes, scales, g, _) in enumerate(layers):
        qi = jax.tree.map(lambda a: a[i], q)  # what lax.scan hands each layer
        np.testing.assert_array_equal(np.asarray(jbs.dequantize(qi)),
                                      oracle_nvfp4(codes, scales, g).astype(np.float32))
    # scanning over the stack: one layer's weight per step, in a gemm
    x = np.random.default_rng(0).standard_normal((2, K)).astype(np.float32)
    _, ys = jax.lax.scan(lambda c, w: (c, jbs.gemm(x, w, out_dtype=jnp.float32)), 0, q)
    for i, (codes, scales, g, _) in enumerate(layers):
        want = x.astype(np.float64) @ oracle_nvfp4(codes, scales, g).T
        np.testing.assert_allclose(np.asarray(ys[i]), want, rtol=1e-5,
                                   atol=1e-5 * np.abs(want).max())
    norms = interop.load_tensor(path, "model.layers.{layer}.input_layernorm.weight",
                                layers=range(L), dtype=np.float32)
    assert norms.shape == (L, K) and norms.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(norms[2]), layers[2][3].astype(np.float32))
    scales_in = interop.load_input_scale(interop.SafetensorsCheckpoint(path),
                                         "model.layers.{layer}.mlp.up_proj", "modelopt_nvfp4",
                                         layers=range(L))
    np.testing.assert_array_equal(np.asarray(scales_in), [0.5, 1.5, 2.5])


@pytest.mark.parametrize("with_tqdm", [True, False])
def test_load_tree(modelopt_ckpt, monkeypatch, with_tqdm):
    path, layers = modelopt_ckpt
    if not with_tqdm:  # tqdm is optional: the load runs the same without it
        monkeypatch.setitem(sys.modules, "tqdm", None)
        monkeypatch.setitem(sys.modules, "tqdm.auto", None)
    spec = {"up": interop.Quantized("model.layers.{layer}.mlp.up_proj", "modelopt_nvfp4",
                                    layers=iter(range(L))),  # a one-shot iterator is fine
            "norm": [interop.Tensor("model.layers.0.input_layernorm.weight")]}
    tree = interop.load_tree(path, spec, progress=True)
    assert tree["up"].layout == "blocked" and tree["up"].shape == (L, N, K)
    assert tree["norm"][0].dtype == jnp.bfloat16


def test_compressed_tensors_and_gpt_oss_files(tmp_path):
    r = np.random.default_rng(11)
    codes, scales, _ = modelopt_arrays(r, (), N, K)
    enc = np.array([812.5], np.float32)
    ecodes, exps, blocks = gpt_oss_arrays(r, (4,), 10, 64)
    save_file({"m.weight_packed": pack_low_first(codes), "m.weight_scale": scales,
               "m.weight_global_scale": enc, "m.input_global_scale": np.array([8.0], np.float32),
               "model.layers.0.mlp.experts.gate_up_proj_blocks": blocks,
               "model.layers.0.mlp.experts.gate_up_proj_scales": exps,
               "block.0.mlp.mlp2_weight.blocks": blocks,
               "block.0.mlp.mlp2_weight.scales": exps}, str(tmp_path / "one.safetensors"))
    ckpt = interop.SafetensorsCheckpoint(tmp_path / "one.safetensors")
    q = interop.load_quantized(ckpt, "m", "compressed_tensors_nvfp4")
    assert np.float32(q.global_scale) == np.float32(1) / enc[0]
    np.testing.assert_array_equal(codes_of(q.data), codes)
    assert float(interop.load_input_scale(ckpt, "m", "compressed_tensors_nvfp4")) == 0.125
    want = oracle_gpt_oss(ecodes, exps).astype(np.float32)
    for name in ("model.layers.0.mlp.experts.gate_up_proj", "block.0.mlp.mlp2_weight"):
        w = interop.load_quantized(ckpt, name, "gpt_oss_mxfp4", shape=(4, 10, 64))
        np.testing.assert_array_equal(np.asarray(jbs.dequantize(w)), want)
    assert E2M1.shape == (16,)


# ---------------------------------------------------------------------------------------------
# Errors


def test_missing_tensor_names_it(modelopt_ckpt):
    path, _ = modelopt_ckpt
    with pytest.raises(CheckpointError, match=r"'model.layers.7.mlp.up_proj.weight' is not in"):
        interop.load_quantized(path, "model.layers.{layer}.mlp.up_proj", "modelopt_nvfp4",
                               layers=[0, 7])
    with pytest.raises(CheckpointError, match="similar names"):
        interop.load_quantized(path, "model.layers.0.mlp.up_prj", "modelopt_nvfp4")


def test_wrong_dtype_and_shape(tmp_path, modelopt_ckpt):
    path, _ = modelopt_ckpt
    with pytest.raises(CheckpointError, match=r"up_proj.weight' .* has shape \(24, 32\), "
                                              r"expected \(24, 64\)"):
        interop.load_quantized(path, "model.layers.0.mlp.up_proj", "modelopt_nvfp4",
                               shape=(N, 2 * K))
    r = np.random.default_rng(12)
    codes, scales, g = modelopt_arrays(r, (), N, K)
    save_file({"a.weight": pack_low_first(codes), "a.weight_scale": scales.astype(np.float32),
               "a.weight_scale_2": np.array(g, np.float32),
               "b.weight": pack_low_first(codes), "b.weight_scale": scales[:, :2],
               "b.weight_scale_2": np.array(g, np.float32)}, str(tmp_path / "bad.safetensors"))
    with pytest.raises(CheckpointError, match="'a.weight_scale' .* has dtype F32, expected "
                                              "F8_E4M3 or U8"):
        interop.load_quantized(tmp_path, "a", "modelopt_nvfp4")
    with pytest.raises(CheckpointError, match=r"b.weight, b.weight_scale, b.weight_scale_2: "
                                              r"weight_scale has shape \(24, 2\)"):
        interop.load_quantized(tmp_path, "b", "modelopt_nvfp4")


def test_layers_that_differ(tmp_path):
    r = np.random.default_rng(13)
    tensors = {}
    for i, n in enumerate((N, N + 8)):
        codes, scales, g = modelopt_arrays(r, (), n, K)
        tensors.update({f"l.{i}.weight": pack_low_first(codes), f"l.{i}.weight_scale": scales,
                        f"l.{i}.weight_scale_2": np.array(g, np.float32)})
    save_file(tensors, str(tmp_path / "m.safetensors"))
    with pytest.raises(CheckpointError, match=r"'l.1.weight' .* has shape \(32, 32\), "
                                              r"expected \(24, 32\)"):
        interop.load_quantized(tmp_path, "l.{layer}", "modelopt_nvfp4", layers=range(2))


def test_truncated_file_and_missing_shard(tmp_path, modelopt_ckpt):
    path, _ = modelopt_ckpt
    bad = tmp_path / "ckpt"
    bad.mkdir()
    for f in path.iterdir():
        data = f.read_bytes()
        if f.name.startswith("model-00002"):
            data = data[:-100]  # a download cut short
        (bad / f.name).write_bytes(data)
    with pytest.raises(CheckpointError, match="model-00002-of-00002.safetensors.*truncated"):
        interop.SafetensorsCheckpoint(bad)
    (bad / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError, match="does not exist"):
        interop.SafetensorsCheckpoint(bad)
    with pytest.raises(CheckpointError, match="does not exist"):
        interop.SafetensorsCheckpoint(tmp_path / "nowhere")


def test_unknown_source_and_layer_pattern(modelopt_ckpt):
    path, _ = modelopt_ckpt
    with pytest.raises(ValueError, match="unknown checkpoint source"):
        interop.load_quantized(path, "x", "gguf")
    with pytest.raises(ValueError, match="must contain '{layer}'"):
        interop.load_quantized(path, "model.layers.0.mlp.up_proj", "modelopt_nvfp4",
                               layers=range(2))


def test_import_is_light():
    """`import jax_blockscale` does not import safetensors or tqdm (optional extras)."""
    code = ("import sys, jax_blockscale, jax_blockscale.interop; "
            "assert 'safetensors' not in sys.modules and 'tqdm' not in sys.modules")
    root = Path(jbs.__file__).resolve().parents[1]
    subprocess.run([sys.executable, "-c", code], check=True, env=dict(
        os.environ, PYTHONPATH=str(root), JAX_PLATFORMS="cpu"))


# ---------------------------------------------------------------------------------------------
# Placement with a sharding

SHARDED_CHILD = """
import sys, numpy as np, jax, jax_blockscale as jbs
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from jax_blockscale import interop
mesh = Mesh(np.array(jax.devices()).reshape(2, 2), ("x", "y"))
path = sys.argv[1]
ref = interop.load_quantized(path, "model.layers.{layer}.mlp.up_proj", "modelopt_nvfp4",
                             layers=range(3))
for spec in (P(None, "x", "y"), P("x", "y", None)):
    s = NamedSharding(mesh, spec)
    for layout in ("plain", "blocked"):
        q = interop.load_quantized(path, "model.layers.{layer}.mlp.up_proj", "modelopt_nvfp4",
                                   layers=range(3) if spec[0] is None else range(2),
                                   layout=layout, sharding=s)
        want = interop.blockscaled_shardings(s, q)
        for a, w in zip(jax.tree.leaves(q), jax.tree.leaves(want)):
            assert a.sharding.is_equivalent_to(w, a.ndim), (spec, layout, a.sharding, w)
        r = jax.tree.map(lambda a: a[:q.shape[0]], jbs.to_blocked(ref) if layout == "blocked"
                         else ref)
        for a, b in zip(jax.tree.leaves(q), jax.tree.leaves(r)):  # the same bits, placed
            assert np.array_equal(np.asarray(a).view(np.uint8) if a.dtype.itemsize == 1 else
                                  np.asarray(a), np.asarray(b).view(np.uint8)
                                  if b.dtype.itemsize == 1 else np.asarray(b))
rep = interop.load_tensor(path, "model.layers.0.input_layernorm.weight",
                          sharding=NamedSharding(mesh, P()))
assert rep.sharding.is_fully_replicated
print("ok")
"""


def test_sharded_placement(modelopt_ckpt):
    """On 4 forced CPU devices (a child process: the device count is fixed per process)."""
    path, _ = modelopt_ckpt
    rc, out = finish(start([sys.executable, "-c", SHARDED_CHILD, str(path)],
                           {"XLA_FLAGS": "--xla_force_host_platform_device_count=4"}),
                     timeout=300)
    assert rc == 0 and "ok" in out.splitlines(), out
