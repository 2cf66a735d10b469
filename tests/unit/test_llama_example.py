"""examples/llama at tiny shapes on the CPU: write a random ModelOpt NVFP4 checkpoint (two
shards), load it into the scanned NNX Llama, and check its logits against the same model with
the dequantized weights as plain f32 arrays, scanned against unrolled layers, the KV cache
against a full-sequence forward pass, and that generation under jit yields tokens. The same for
the mixture-of-experts variant (per-expert ModelOpt tensors stacked into QuantizedMoE weights),
whose loaded experts are also compared bit for bit with the checkpoint's tensors."""
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("flax")
pytest.importorskip("safetensors")

import jax_blockscale as jbs  # noqa: E402
from jax_blockscale import interop  # noqa: E402
from jax_blockscale import nn as jnn  # noqa: E402

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "llama"
sys.path.insert(0, str(EXAMPLE))
import generate as gen  # noqa: E402
import model as llama  # noqa: E402
from write_checkpoint import write_checkpoint  # noqa: E402

F32 = jnp.float32


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    cfg = llama.LlamaConfig.tiny(num_layers=2)
    path = write_checkpoint(tmp_path_factory.mktemp("llama"), cfg, seed=3, max_shard_mb=0.05,
                            std=0.2, log=lambda *_: None)
    return cfg, path


@pytest.fixture(scope="module")
def params(ckpt):
    cfg, path = ckpt
    return interop.load_tree(path, llama.checkpoint_spec(cfg, dtype=F32), progress=False)


def forward(model, tokens, max_len=16):
    cache = llama.init_cache(model.cfg, tokens.shape[0], max_len, F32)
    return jax.jit(lambda m, t, c: m(t, c, 0)[0])(model, tokens, cache)


def tokens_for(cfg, b=2, t=5, seed=1):
    return jax.random.randint(jax.random.key(seed), (b, t), 0, cfg.vocab_size, jnp.int32)


def test_checkpoint_layout(ckpt, params):
    cfg, path = ckpt
    index = json.loads((path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) >= 2  # really sharded
    w = params["layers"]["down_proj"]
    assert isinstance(w, jbs.BlockScaled) and w.fmt == "nvfp4" and w.layout == "blocked"
    assert w.shape == (2, cfg.hidden_size, cfg.intermediate_size)
    assert w.global_scale.shape == (2,)  # one per layer, as the checkpoint stores them
    assert float(w.global_scale[0]) != float(w.global_scale[1])


def test_nvfp4_model_matches_dequantized_reference(ckpt, params):
    cfg, _ = ckpt
    tokens = tokens_for(cfg)
    quantized = llama.Llama(cfg, params, dtype=F32)
    reference = llama.Llama(cfg, llama.dequantize_params(params, F32), dtype=F32)
    assert not isinstance(reference.layers.q_proj.get_value(), jbs.BlockScaled)
    got, want = forward(quantized, tokens), forward(reference, tokens)
    assert got.shape == (2, 5, cfg.vocab_size)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4,
                               atol=1e-4 * float(jnp.abs(want).max()))
    # and the weights are not trivially zero: the logits vary across the vocabulary
    assert float(jnp.std(got)) > 1e-3


def test_scan_equals_unrolled(ckpt, params):
    cfg, _ = ckpt
    tokens = tokens_for(cfg, seed=2)
    scanned = forward(llama.Llama(cfg, params, dtype=F32), tokens)
    unrolled = forward(llama.Llama(cfg, params, dtype=F32, scan_layers=False), tokens)
    # the same math; XLA fuses the two programs differently (f32 rounding order only)
    np.testing.assert_allclose(np.asarray(scanned), np.asarray(unrolled), rtol=1e-4,
                               atol=1e-5 * float(jnp.abs(scanned).max()))


def test_kv_cache_decode_matches_full_forward(ckpt, params):
    cfg, _ = ckpt
    model = llama.Llama(cfg, params, dtype=F32)
    tokens = tokens_for(cfg, t=6, seed=4)
    full = forward(model, tokens)
    step = jax.jit(lambda m, t, c, p: m(t, c, p))
    cache = llama.init_cache(cfg, 2, 16, F32)
    logits, cache = step(model, tokens[:, :3], cache, jnp.int32(0))  # prefill 3
    outs = [logits]
    for i in range(3, 6):  # then one token at a time
        logits, cache = step(model, tokens[:, i:i + 1], cache, jnp.int32(i))
        outs.append(logits)
    np.testing.assert_allclose(np.asarray(jnp.concatenate(outs, axis=1)), np.asarray(full),
                               rtol=1e-4, atol=1e-4 * float(jnp.abs(full).max()))


def test_generate_bf16_under_jit(ckpt):
    cfg, path = ckpt
    _, model = llama.load_llama(path, progress=False)  # bf16 activations, as served
    prompt = tokens_for(cfg, b=2, t=4, seed=5)
    out = gen.generate(model, prompt, 5)
    assert out.shape == (2, 5) and out.dtype == jnp.int32
    assert bool(jnp.all((out >= 0) & (out < cfg.vocab_size)))
    np.testing.assert_array_equal(np.asarray(out), np.asarray(gen.generate(model, prompt, 5)))


def test_w4a4_quantizes_activations_with_the_checkpoints_input_scales(ckpt, params,
                                                                        monkeypatch):
    """load_llama(w4a4=True) reads every dense projection's input_scale (stacked per layer)
    and quantizes that projection's activation to NVFP4 with it: the logits match the same
    model with dequantized f32 weights whose activations are quantized and dequantized in
    plain JAX (to the f32 summation order, which may flip an activation across a rounding
    boundary), and differ from weight-only by far more than that; scanned equals unrolled."""
    from write_checkpoint import INPUT_SCALE
    cfg, path = ckpt
    w4a4 = llama.load_params(path, cfg, dtype=F32, w4a4=True)
    scales = w4a4["layers"]["input_scales"]
    assert set(scales) == set(cfg.projections)
    for s in scales.values():
        np.testing.assert_array_equal(np.asarray(s), np.full((cfg.num_hidden_layers,),
                                                             INPUT_SCALE, np.float32))
    tokens = tokens_for(cfg, seed=6)
    got = forward(llama.Llama(cfg, w4a4, dtype=F32), tokens)
    unrolled = forward(llama.Llama(cfg, w4a4, dtype=F32, scan_layers=False), tokens)
    weight_only = forward(llama.Llama(cfg, params, dtype=F32), tokens)

    linear = llama.linear

    def fake_quant_linear(x, w, layer=None, input_scale=None):
        if input_scale is not None:  # the definition, in plain JAX
            q = jbs.quantize(x, "nvfp4", global_scale=input_scale)
            x = jbs.dequantize(q, x.dtype)
        return linear(x, w, layer)

    monkeypatch.setattr(llama, "linear", fake_quant_linear)
    want = forward(llama.Llama(cfg, llama.dequantize_params(w4a4, F32), dtype=F32), tokens)

    def rel(a, b):
        return float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))

    assert rel(got, want) < 1e-4
    assert rel(unrolled, got) < 1e-4
    assert rel(weight_only, got) > 10 * rel(got, want)


def test_generate_w4a4_cli(capsys):
    gen.main(["--w4a4", "--new-tokens", "3", "--batch", "2"])
    out = capsys.readouterr().out
    assert out.count("prompt ") == 2 and "tokens x batch 2" in out


def test_wrong_quant_algo(ckpt, tmp_path):
    _, path = ckpt
    for f in path.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    (tmp_path / "hf_quant_config.json").write_text(json.dumps(
        {"quantization": {"quant_algo": "FP8"}}))
    with pytest.raises(interop.CheckpointError, match="quant_algo='FP8'"):
        llama.load_llama(tmp_path, progress=False)


def test_e2e_benchmark_tiny(tmp_path):
    """benchmarks/e2e_model.py --tiny runs on the CPU and writes its table's JSON and PNG."""
    pytest.importorskip("matplotlib")
    sys.path.insert(0, str(EXAMPLE.parents[1] / "benchmarks"))
    import e2e_model
    e2e_model.main(["--tiny", "--layers", "1", "--batches", "1", "--compare-unrolled",
                    "--iters", "2", "--trials", "1", "--calls", "1", "--out", str(tmp_path),
                    "--tag", "smoke"])
    result = json.loads((tmp_path / "smoke.json").read_text())
    got = {(r["fmt"], r["mode"], r["batch"]) for r in result["rows"]}
    assert got == {(f, m, 1) for f in ("bf16", "nvfp4") for m in ("scan", "unrolled")}
    nvfp4_scan = next(r for r in result["rows"] if (r["fmt"], r["mode"]) == ("nvfp4", "scan"))
    assert nvfp4_scan["loop_us"] > 0 and "speedup_vs_bf16" in nvfp4_scan
    assert "scan_over_unrolled" in nvfp4_scan
    assert (tmp_path / "smoke.png").stat().st_size > 0


# ---------------------------------------------------------------------------------------------
# Mixture of experts


@pytest.fixture(scope="module")
def moe_ckpt(tmp_path_factory):
    cfg = llama.LlamaConfig.tiny_moe(num_layers=2, num_experts=4, top_k=2)
    path = write_checkpoint(tmp_path_factory.mktemp("moe"), cfg, seed=7, max_shard_mb=0.05,
                            std=0.2, log=lambda *_: None)
    return cfg, path


@pytest.fixture(scope="module")
def moe_params(moe_ckpt):
    cfg, path = moe_ckpt
    return llama.load_params(path, cfg, dtype=F32)


def test_config_json_and_presets():
    dense, moe = llama.LlamaConfig.tiny(), llama.LlamaConfig.tiny_moe()
    assert "num_experts" not in dense.to_json()  # a dense config.json stays a Llama's
    for cfg in (dense, moe, llama.LlamaConfig.qwen3_30b_a3b()):
        assert llama.LlamaConfig.from_json(json.loads(json.dumps(cfg.to_json()))) == cfg
    q = llama.LlamaConfig.qwen3_30b_a3b(num_layers=4)
    assert (q.num_experts, q.num_experts_per_tok, q.moe_intermediate_size) == (128, 8, 768)
    # attention is 32 x 128 = 4096 wide on a 2048 hidden size: q / o are not square
    assert q.projection_shape("q_proj") == (4096, 2048)
    assert q.projection_shape("k_proj") == (512, 2048)
    assert q.projection_shape("o_proj") == (2048, 4096)
    assert q.expert_shape("gate_up") == (1536, 2048) and q.expert_shape("down") == (2048, 768)
    assert set(q.projections) == {"q_proj", "k_proj", "v_proj", "o_proj"}
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        llama.LlamaConfig.tiny_moe(num_experts=2, top_k=3)


def test_moe_checkpoint_experts_bit_exact(moe_ckpt, moe_params):
    cfg, path = moe_ckpt
    names = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(names.values())) >= 2  # really sharded
    assert "model.layers.1.mlp.gate.weight" in names
    assert "model.layers.1.mlp.experts.3.up_proj.input_scale" in names
    assert not any(".mlp.gate_proj." in n or ".mlp.down_proj." in n for n in names)  # no dense MLP
    mlp = moe_params["layers"]["mlp"]
    plain = llama.load_params(path, cfg, dtype=F32, layout="plain")["layers"]["mlp"]
    i = cfg.moe_intermediate_size
    parts = (("gate_up", "gate_proj", slice(0, i)), ("gate_up", "up_proj", slice(i, 2 * i)),
             ("down", "down_proj", slice(None)))
    bits = lambda a: np.asarray(a).view(np.uint8)  # noqa: E731
    with interop.SafetensorsCheckpoint(path) as ck:
        for layer in range(cfg.num_hidden_layers):
            router = ck.read(f"model.layers.{layer}.mlp.gate.weight")  # (E, H) bf16
            np.testing.assert_array_equal(np.asarray(mlp["router"][layer]).T,
                                          router.astype(np.float32))
            for e in range(cfg.num_experts):
                for fused, proj, rows in parts:
                    m = llama.expert_prefix(layer, e, proj)
                    q = plain[fused][layer, e]
                    np.testing.assert_array_equal(np.asarray(jbs.pack_fp4(q.data[rows])),
                                                  ck.read(m + ".weight"))
                    np.testing.assert_array_equal(bits(q.scales[rows]),
                                                  bits(ck.read(m + ".weight_scale")))
                    assert (np.float32(q.global_scale).tobytes()
                            == ck.read(m + ".weight_scale_2").astype(np.float32).tobytes())
    for name in ("gate_up", "down"):
        w = mlp[name]  # what the model uses: the same bits with the scales swizzled
        assert w.fmt == "nvfp4" and w.layout == "blocked"
        assert w.shape == (2, 4, *cfg.expert_shape(name)) and w.global_scale.shape == (2, 4)
        # one per expert and layer (two may coincide: each is a bf16 amax / (6 * 448))
        assert len(set(np.asarray(w.global_scale).ravel().tolist())) >= 4
        np.testing.assert_array_equal(bits(w.data), bits(plain[name].data))
        np.testing.assert_array_equal(bits(w.plain_scales()), bits(plain[name].scales))


def test_moe_model_matches_dequantized_reference(moe_ckpt, moe_params):
    cfg, _ = moe_ckpt
    tokens = tokens_for(cfg, b=2, t=6, seed=11)
    quantized = llama.Llama(cfg, moe_params, dtype=F32)
    reference = llama.Llama(cfg, llama.dequantize_params(moe_params, F32), dtype=F32)
    assert isinstance(quantized.layers.mlp, jnn.QuantizedMoE)
    assert isinstance(reference.layers.mlp, jnn.MoE)  # f32 lax.ragged_dot experts
    got, want = forward(quantized, tokens), forward(reference, tokens)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4,
                               atol=1e-4 * float(jnp.abs(want).max()))
    assert float(jnp.std(got)) > 1e-3
    # the experts matter: the same model with the experts of layer 0 rolled by one differs
    mlp = dict(moe_params["layers"]["mlp"])
    mlp["gate_up"] = jax.tree.map(lambda a: a.at[0].set(jnp.roll(a[0], 1, axis=0)),
                                  mlp["gate_up"])  # elements, scales, global scales
    rolled = dict(moe_params, layers=dict(moe_params["layers"], mlp=mlp))
    other = forward(llama.Llama(cfg, rolled, dtype=F32), tokens)
    assert float(jnp.abs(other - got).max()) > 1e-2 * float(jnp.abs(got).max())


def test_moe_scan_equals_unrolled(moe_ckpt, moe_params):
    cfg, _ = moe_ckpt
    tokens = tokens_for(cfg, seed=12)
    scanned = forward(llama.Llama(cfg, moe_params, dtype=F32), tokens)
    unrolled_model = llama.Llama(cfg, moe_params, dtype=F32, scan_layers=False)
    assert unrolled_model.layers[1].mlp.gate_up.get_value().shape == (4, 64, 64)
    unrolled = forward(unrolled_model, tokens)
    np.testing.assert_allclose(np.asarray(scanned), np.asarray(unrolled), rtol=1e-4,
                               atol=1e-5 * float(jnp.abs(scanned).max()))


def test_moe_kv_cache_decode_matches_full_forward(moe_ckpt, moe_params):
    """Decoding routes B tokens per step (B * k rows); the full pass routes all B * T at once:
    each token's experts and output must not depend on which others share the call."""
    cfg, _ = moe_ckpt
    model = llama.Llama(cfg, moe_params, dtype=F32)
    tokens = tokens_for(cfg, t=5, seed=13)
    full = forward(model, tokens)
    step = jax.jit(lambda m, t, c, p: m(t, c, p))
    cache = llama.init_cache(cfg, 2, 16, F32)
    logits, cache = step(model, tokens[:, :2], cache, jnp.int32(0))
    outs = [logits]
    for i in range(2, 5):
        logits, cache = step(model, tokens[:, i:i + 1], cache, jnp.int32(i))
        outs.append(logits)
    np.testing.assert_allclose(np.asarray(jnp.concatenate(outs, axis=1)), np.asarray(full),
                               rtol=1e-4, atol=1e-4 * float(jnp.abs(full).max()))


def test_moe_generate_cli(capsys):
    """generate.py --moe: writes a tiny MoE checkpoint, loads it (bf16) and decodes under jit."""
    gen.main(["--moe", "--batch", "2", "--new-tokens", "4"])
    out = capsys.readouterr().out
    assert "MoE: 4 experts, top-2; gate_up nvfp4 (2, 4, 64, 64)" in out
    lines = [line for line in out.splitlines() if line.startswith("prompt ")]
    assert len(lines) == 2
    for line in lines:
        new = json.loads(line.split("->")[1])
        assert len(new) == 4 and all(0 <= t < 97 for t in new)


def test_moe_unshared_gate_up_scale_refused(tmp_path):
    """gate_proj and up_proj become one weight with one global scale: a checkpoint where their
    weight_scale_2 differ cannot load bit-exactly, and says so."""
    cfg = llama.LlamaConfig.tiny_moe(num_layers=1, num_experts=2, top_k=1)
    path = write_checkpoint(tmp_path, cfg, std=0.2, shared_gate_up_scale=False,
                            log=lambda *_: None)
    with pytest.raises(interop.CheckpointError, match="weight_scale_2 differs between "
                       r"model\.layers\.0\.mlp\.experts\.0\.gate_proj and"):
        llama.load_params(path, cfg)


def test_e2e_benchmark_tiny_moe(tmp_path):
    """benchmarks/e2e_model.py --tiny --moe: the QuantizedMoE model against the bf16 MoE one."""
    pytest.importorskip("matplotlib")
    sys.path.insert(0, str(EXAMPLE.parents[1] / "benchmarks"))
    import e2e_model
    e2e_model.main(["--tiny", "--moe", "--layers", "1", "--batches", "2", "--compare-unrolled",
                    "--iters", "2", "--trials", "1", "--calls", "1", "--out", str(tmp_path),
                    "--tag", "smoke"])
    result = json.loads((tmp_path / "smoke.json").read_text())
    assert result["config"]["num_experts"] == 4 and "ragged_dot" in result["mlp"]
    got = {(r["fmt"], r["mode"], r["batch"]) for r in result["rows"]}
    assert got == {(f, m, 2) for f in ("bf16", "nvfp4") for m in ("scan", "unrolled")}
    for r in result["rows"]:
        assert r["loop_us"] > 0 and r["experts_hit_est"] == 3.0  # 4 * (1 - (1 - 2/4)^2)
    nvfp4, bf16 = (next(r for r in result["rows"] if (r["fmt"], r["mode"]) == (f, "scan"))
                   for f in ("nvfp4", "bf16"))
    assert "speedup_vs_bf16" in nvfp4 and nvfp4["weight_bytes"] < bf16["weight_bytes"]


def _e2e_moe_on_2_cpu_devices(tmp_path, *extra):
    """benchmarks/e2e_model.py --tiny --moe --devices 2 (one layer, batch 2, few calls) in a
    child process with 2 forced CPU devices (XLA reads the device count once per process):
    (the finished process, its JSON)."""
    root = EXAMPLE.parents[1]
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2",
               JAX_PLATFORMS="cpu",
               PYTHONPATH=os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]))
    run = subprocess.run([sys.executable, str(root / "benchmarks" / "e2e_model.py"), "--tiny",
                          "--moe", "--devices", "2", "--layers", "1", "--batches", "2",
                          "--iters", "2", "--trials", "1", "--calls", "1", "--out",
                          str(tmp_path), "--tag", "smoke", *extra],
                         env=env, cwd=root, capture_output=True, text=True, timeout=600,
                         check=False)
    assert run.returncode == 0, (run.stdout + run.stderr)[-6000:]
    return run, json.loads((tmp_path / "smoke.json").read_text())


def test_e2e_benchmark_tiny_moe_dispatched(tmp_path):
    """benchmarks/e2e_model.py --tiny --moe --devices 2 on 2 forced CPU devices (a child
    process: XLA reads the device count once per process): beside the 1-device rows, the step
    with its MoE layers dispatching tokens over 2 devices (layers unrolled), timed as they are,
    with its speedup over the 1-device unrolled step and its logits equal to that step's bit for
    bit (0, as bench_moe_sharded's dispatch rows: the dispatched layer computes every output
    as one device does, and the rest of the model runs replicated)."""
    run, result = _e2e_moe_on_2_cpu_devices(tmp_path)
    assert result["devices"] == 2 and "dispatch" in result["sharded"]
    rows = {(r["fmt"], r["mode"], r["devices"]): r for r in result["rows"]}
    assert set(rows) == {("bf16", "scan", 1), ("bf16", "unrolled", 1), ("nvfp4", "scan", 1),
                         ("nvfp4", "unrolled", 1), ("nvfp4", "unrolled", 2)}
    sharded = rows[("nvfp4", "unrolled", 2)]
    assert sharded["placement"] == "dispatch" and sharded["batch"] == 2
    assert sharded["loop_us"] > 0 and sharded["tokens_per_s"] > 0
    assert sharded["speedup_vs_1_device"] > 0
    assert sharded["max_abs_diff_vs_1_device"] == 0 and sharded["differing_logits"] == 0
    assert sharded["same_next_tokens"]
    assert all(r["placement"] == "1 device" for key, r in rows.items() if key[2] == 1)
    assert "nvfp4 | unrolled | 2 (dispatch)" in run.stdout


def test_e2e_benchmark_tiny_moe_tensor_parallel(tmp_path):
    """--exchange tensor: the step with its MoE layers tensor parallel over 2 forced CPU devices
    (QuantizedMoE(mesh=, tensor_axis=)), its placement recorded, its logits the 1-device step's
    to the bf16 rounding of the expert outputs (the next tokens the same)."""
    run, result = _e2e_moe_on_2_cpu_devices(tmp_path, "--exchange", "tensor", "--formats",
                                            "nvfp4")
    assert "tensor_axis" in result["sharded"]
    sharded = [r for r in result["rows"] if r["devices"] == 2]
    assert len(sharded) == 1 and sharded[0]["placement"] == "tensor", result["rows"]
    assert 0 <= sharded[0]["max_abs_diff_vs_1_device"] < 0.02 and sharded[0]["same_next_tokens"]
    assert "nvfp4 | unrolled | 2 (tensor)" in run.stdout


def test_e2e_benchmark_devices_refused(capsys):
    """--devices beyond the devices present, or without --moe, stops with an error naming it."""
    sys.path.insert(0, str(EXAMPLE.parents[1] / "benchmarks"))
    import e2e_model
    for argv, message in ((["--tiny", "--moe", "--devices", "4096"], "--devices 4096 needs"),
                          (["--tiny", "--devices", "2"], "--devices N > 1 needs --moe")):
        with pytest.raises(SystemExit) as err:
            e2e_model.main(argv)
        assert err.value.code == 2
        assert message in capsys.readouterr().err


def test_moe_dispatch_placement_needs_unrolled_quantized_layers():
    """Llama(moe_placement=...) (MoE layers that dispatch tokens) is refused for scanned layers
    (the dispatched layer takes no layer=) and for float experts."""
    cfg = llama.LlamaConfig.tiny_moe(num_layers=1)
    float_params = llama.random_params(cfg, jax.random.key(0))
    mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:1]), ("expert",))
    placement = dict(mesh=mesh, expert_axis="expert")
    with pytest.raises(ValueError, match="needs scan_layers=False"):
        llama.Llama(cfg, llama.quantize_params(float_params, "nvfp4"), moe_placement=placement)
    with pytest.raises(ValueError, match="needs block-scaled experts"):
        llama.Llama(cfg, float_params, scan_layers=False, moe_placement=placement)


def test_attend_equals_the_einsum_softmax():
    """`attend` (jax.nn.dot_product_attention: a length mask at decode, a causal mask for a
    prompt) equals the masked softmax attention written out, in f32 and bf16, with a cache
    whose unwritten positions hold garbage."""
    b, s, n, kvh, hd = 2, 16, 8, 2, 32
    k0, k1, k2 = jax.random.split(jax.random.key(5), 3)
    keys = jax.random.normal(k1, (b, s, kvh, hd)) * 3
    values = jax.random.normal(k2, (b, s, kvh, hd))

    def ref(q, positions):
        qg = q.astype(jnp.float32).reshape(b, q.shape[1], kvh, n // kvh, hd)
        scores = jnp.einsum("btkgd,bskd->bkgts", qg, keys) / np.sqrt(hd)
        visible = jnp.arange(s)[None, :] <= positions[:, None]
        probs = jax.nn.softmax(jnp.where(visible, scores, -jnp.inf), axis=-1)
        return jnp.einsum("bkgts,bskd->btkgd", probs, values).reshape(q.shape)

    for dtype, tol in ((jnp.float32, 1e-5), (jnp.bfloat16, 3e-2)):
        for t, pos in ((1, 0), (1, 9), (1, s - 1), (6, 0), (4, 7)):
            q = jax.random.normal(k0, (b, t, n, hd)).astype(dtype)
            positions = pos + jnp.arange(t)
            got = jax.jit(llama.attend)(q, keys.astype(dtype), values.astype(dtype), positions)
            assert got.dtype == dtype and got.shape == q.shape
            np.testing.assert_allclose(np.asarray(got, np.float32), ref(q, positions),
                                       rtol=tol, atol=tol)
    assert llama.attention_implementation(jnp.bfloat16, 128) is None  # CPU: XLA
