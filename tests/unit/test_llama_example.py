"""examples/llama at tiny shapes on the CPU: write a random ModelOpt NVFP4 checkpoint (two
shards), load it into the scanned NNX Llama, and check its logits against the same model with
the dequantized weights as plain f32 arrays, scanned against unrolled layers, the KV cache
against a full-sequence forward pass, and that generation under jit yields tokens."""
import json
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
