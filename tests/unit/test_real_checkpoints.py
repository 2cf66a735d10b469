"""Checkpoints written by the real tools (tests/fixtures/checkpoints/, made by
scripts/make_checkpoint_fixtures.py) load through examples/llama's documented path,
``load_llama(path)``, with logits matching the tool's own reference: f32 within 1e-5 of the
logits' range, bf16 within 2e-2 of the range and the same top-1 token wherever the
reference's best two tokens are further apart than that."""
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

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures" / "checkpoints"
sys.path.insert(0, str(ROOT / "examples" / "llama"))
import model as llama  # noqa: E402

ALL = sorted(p.name for p in FIXTURES.iterdir() if (p / "reference.npz").exists()) \
    if FIXTURES.exists() else []


def run(path, dtype, **kw):
    cfg, model = llama.load_llama(path, dtype=dtype, progress=False, **kw)
    ref = np.load(path / "reference.npz")
    tokens = jnp.asarray(ref["tokens"])
    cache = llama.init_cache(cfg, tokens.shape[0], tokens.shape[1], dtype)
    logits, _ = jax.jit(lambda m, t, c: m(t, c, 0))(model, tokens, cache)
    return cfg, model, np.asarray(logits), ref["logits"]


def test_fixtures_present():
    expected = {"transformers_llama", "transformers_llama_f32", "transformers_llama3_rope",
                "transformers_llama_yarn", "transformers_llama_tied", "transformers_qwen3_moe",
                "llmcompressor_nvfp4", "llmcompressor_nvfp4a16", "modelopt_nvfp4",
                "modelopt_w4a16_nvfp4", "modelopt_qwen3_moe_w4a16_nvfp4"}
    assert expected <= set(ALL)
    total = sum(f.stat().st_size for f in FIXTURES.rglob("*") if f.is_file())
    assert total < 4 * 2**20
    for name in ALL:
        info = json.loads((FIXTURES / name / "fixture.json").read_text())
        assert info["written_by"] and info["covers"]


@pytest.mark.parametrize("name", ALL)
def test_f32_logits_match_the_tool(name):
    _, _, got, want = run(FIXTURES / name, jnp.float32)
    span = float(want.max() - want.min())
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * span)


# (not the MoE: in bf16 a token whose two best router logits are close may pick another
# expert than the f32 reference, which is a different function, not a rounding error)
@pytest.mark.parametrize("name", ["transformers_llama", "transformers_llama3_rope",
                                  "transformers_llama_tied", "llmcompressor_nvfp4a16",
                                  "modelopt_w4a16_nvfp4"])
def test_bf16_logits_match_the_tool(name):
    _, _, got, want = run(FIXTURES / name, jnp.bfloat16)
    span = float(want.max() - want.min())
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-2 * span)
    # the same top-1 token wherever the reference's best two are further apart than bf16's
    # tolerance (a closer pair may swap under bf16 rounding and still be within it)
    top2 = np.sort(want, axis=-1)[..., -2:]
    clear = (top2[..., 1] - top2[..., 0]) > 2 * 2e-2 * span
    assert clear.any()
    np.testing.assert_array_equal(got.argmax(-1)[clear], want.argmax(-1)[clear])


def test_what_was_read():
    cfg = llama.LlamaConfig.from_json(json.loads(
        (FIXTURES / "transformers_qwen3_moe" / "config.json").read_text()))
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.qk_norm) == (4, 2, True)
    assert cfg.rope_theta == 1e6
    cfg = llama.LlamaConfig.from_json(json.loads(
        (FIXTURES / "transformers_llama3_rope" / "config.json").read_text()))
    assert cfg.rope["rope_type"] == "llama3" and cfg.rope["factor"] == 8.0
    tied = llama.LlamaConfig.from_json(json.loads(
        (FIXTURES / "transformers_llama_tied" / "config.json").read_text()))
    assert tied.tie_word_embeddings
    q = interop.checkpoint_quantization(FIXTURES / "llmcompressor_nvfp4")
    assert (q.source, q.activations) == ("compressed_tensors_nvfp4", True)
    q = interop.checkpoint_quantization(FIXTURES / "llmcompressor_nvfp4a16")
    assert (q.source, q.activations) == ("compressed_tensors_nvfp4", False)
    assert interop.checkpoint_quantization(FIXTURES / "transformers_llama") is None
    q = interop.checkpoint_quantization(FIXTURES / "modelopt_nvfp4")
    assert (q.source, q.activations) == ("modelopt_nvfp4", True)
    for name in ("modelopt_w4a16_nvfp4", "modelopt_qwen3_moe_w4a16_nvfp4"):
        q = interop.checkpoint_quantization(FIXTURES / name)
        assert (q.source, q.activations) == ("modelopt_nvfp4", False)


def test_compressed_tensors_weights_are_block_scaled():
    _, model = llama.load_llama(FIXTURES / "llmcompressor_nvfp4a16", dtype=jnp.float32,
                                progress=False)
    w = model.layers.down_proj.get_value()
    assert isinstance(w, jbs.BlockScaled) and w.fmt == "nvfp4"
    assert w.global_scale.shape == (2,)  # one per layer
    assert not isinstance(model.lm_head.get_value(), jbs.BlockScaled)  # ignored: float
    assert not model.layers.w4a4
    _, model = llama.load_llama(FIXTURES / "llmcompressor_nvfp4", dtype=jnp.float32,
                                progress=False)
    assert model.layers.w4a4


def test_modelopt_weights_are_block_scaled():
    """ModelOpt's exports load as NVFP4 BlockScaled weights (not dequantized to float): the
    layers that read one input share the export's one global scale, the W4A4 export quantizes
    activations, and the MoE export's experts are stacked (E, N, K) NVFP4 weights."""
    _, model = llama.load_llama(FIXTURES / "modelopt_nvfp4", dtype=jnp.float32, progress=False)
    assert model.layers.w4a4
    q, k = model.layers.q_proj.get_value(), model.layers.k_proj.get_value()
    assert isinstance(q, jbs.BlockScaled) and q.fmt == "nvfp4"
    np.testing.assert_array_equal(q.global_scale, k.global_scale)
    _, model = llama.load_llama(FIXTURES / "modelopt_w4a16_nvfp4", dtype=jnp.float32,
                                progress=False)
    assert not model.layers.w4a4
    cfg, model = llama.load_llama(FIXTURES / "modelopt_qwen3_moe_w4a16_nvfp4",
                                  dtype=jnp.float32, progress=False)
    experts = [v for v in jax.tree.leaves(model, is_leaf=lambda x: isinstance(
        x, jbs.BlockScaled)) if isinstance(v, jbs.BlockScaled) and v.ndim == 4]
    assert experts and all(e.shape[:2] == (cfg.num_hidden_layers, cfg.num_experts)
                           for e in experts)


def test_modelopt_reference_has_teeth():
    """The ModelOpt reference is the quantized export's math: the float model it was made from
    (transformers_llama: the same seed, config and tokens) gives logits far from it, so a
    loader that dropped the quantization could not pass the f32 check."""
    want = np.load(FIXTURES / "modelopt_w4a16_nvfp4" / "reference.npz")
    float_model = np.load(FIXTURES / "transformers_llama" / "reference.npz")
    np.testing.assert_array_equal(want["tokens"], float_model["tokens"])
    span = float(want["logits"].max() - want["logits"].min())
    assert np.abs(float_model["logits"] - want["logits"]).max() > 100 * 1e-5 * span


def test_wrong_rope_theta_would_be_caught():
    """The check has teeth: the transformers 4 default theta gives logits far off."""
    path = FIXTURES / "transformers_llama"
    _, _, got, want = run(path, jnp.float32)
    cfg, model = llama.load_llama(path, dtype=jnp.float32, progress=False)
    import dataclasses
    model.cfg = dataclasses.replace(cfg, rope_theta=500000.0)
    model.layers.cfg = model.cfg
    tokens = jnp.asarray(np.load(path / "reference.npz")["tokens"])
    cache = llama.init_cache(cfg, 2, tokens.shape[1], jnp.float32)
    off = np.asarray(model(tokens, cache, 0)[0])
    span = float(want.max() - want.min())
    assert np.abs(off - want).max() > 100 * 1e-5 * span


def _config(**changes):
    d = json.loads((FIXTURES / "transformers_llama" / "config.json").read_text())
    for k, v in changes.items():
        if v is None:
            d.pop(k, None)
        else:
            d[k] = v
    return d


@pytest.mark.parametrize("changes, field", [
    (dict(rope_parameters=None), "rope_theta"),
    (dict(rope_parameters={"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}),
     "rope_type 'dynamic'"),
    (dict(rope_parameters={"rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0}),
     "low_freq_factor"),
    (dict(rope_theta=5e5), "disagree"),
    (dict(attention_bias=True), "attention_bias"),
    (dict(mlp_bias=True), "mlp_bias"),
    (dict(sliding_window=4096), "sliding_window"),
    (dict(hidden_act="gelu"), "hidden_act"),
    (dict(tie_word_embeddings=None), "tie_word_embeddings"),
    (dict(rms_norm_eps=None), "rms_norm_eps"),
    (dict(model_type="gemma3"), "model_type"),
    (dict(partial_rotary_factor=0.5), "partial_rotary_factor"),
    (dict(num_local_experts=4, num_experts=8), "expert count"),
    (dict(num_local_experts=4, moe_intermediate_size=64), "experts-per-token"),
])
def test_config_fields_refused_by_name(changes, field):
    with pytest.raises(interop.ConfigError, match=field):
        llama.LlamaConfig.from_json(_config(**changes))


def test_transformers4_spelling_reads_the_same():
    v5 = llama.LlamaConfig.from_json(_config())
    v4 = llama.LlamaConfig.from_json(_config(rope_parameters=None, rope_theta=10000.0,
                                             rope_scaling=None))
    assert v4 == v5
    scaled = _config(rope_parameters=None, rope_theta=10000.0, rope_scaling={
        "type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64})
    assert llama.LlamaConfig.from_json(scaled).rope["rope_type"] == "llama3"


def test_moe_refusals():
    d = json.loads((FIXTURES / "transformers_qwen3_moe" / "config.json").read_text())
    with pytest.raises(interop.ConfigError, match="norm_topk_prob"):
        llama.LlamaConfig.from_json(dict(d, norm_topk_prob=False))
    with pytest.raises(interop.ConfigError, match="mlp_only_layers"):
        llama.LlamaConfig.from_json(dict(d, mlp_only_layers=[0]))


def test_missing_lm_head_named(tmp_path):
    src = FIXTURES / "transformers_llama_tied"
    for f in src.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    d = json.loads((src / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(dict(d, tie_word_embeddings=False)))
    with pytest.raises(interop.CheckpointError, match="lm_head"):
        llama.load_llama(tmp_path, progress=False)


def test_w4a4_moe_export_needs_an_explicit_choice(tmp_path):
    """A ModelOpt NVFP4 (W4A4) export of an MoE model: the experts run weight-only, so the
    loader asks for w4a4=True / False instead of silently dropping the experts' input scales."""
    src = FIXTURES / "modelopt_qwen3_moe_w4a16_nvfp4"
    for f in src.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    for name in ("hf_quant_config.json", "config.json"):
        d = json.loads((tmp_path / name).read_text())
        q = d["quantization"] if name == "hf_quant_config.json" else d["quantization_config"]
        q["quant_algo"] = "NVFP4"
        (tmp_path / name).write_text(json.dumps(d))
    assert interop.checkpoint_quantization(tmp_path).activations
    with pytest.raises(interop.CheckpointError, match="w4a4=True"):
        llama.load_llama(tmp_path, progress=False)
    _, model = llama.load_llama(tmp_path, dtype=jnp.float32, progress=False, w4a4=False)
    assert not model.layers.w4a4
