"""examples/gpt_oss: a gpt-oss checkpoint in the original MXFP4 layout (tests/fixtures/
checkpoints/gpt_oss_tiny, written by scripts/make_checkpoint_fixtures.py) loaded the documented
way, ``load_gpt_oss(path)``, against transformers' own f32 logits (its MXFP4 loader's
dequantized weights): f32 within 1e-5 of the logits' range; bf16 within 2e-2 and the same top-1
token wherever the reference's best two are further apart than that. Then the pieces the
fixture can hide: the experts bit-exact, the clamp and the sinks doing something, the KV cache,
greedy generation, and the config fields refused by name."""
import importlib.util
import json
import shutil
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("safetensors")

import jax_blockscale as jbs  # noqa: E402
from jax_blockscale import interop  # noqa: E402
from jax_blockscale.interop.hf_config import ConfigError  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
FIXTURE = ROOT / "tests" / "fixtures" / "checkpoints" / "gpt_oss_tiny"
_spec = importlib.util.spec_from_file_location("gpt_oss_model",
                                               ROOT / "examples" / "gpt_oss" / "model.py")
g = importlib.util.module_from_spec(_spec)
sys.modules["gpt_oss_model"] = g  # (dataclasses look their module up there)
_spec.loader.exec_module(g)

REF = np.load(FIXTURE / "reference_gpt_oss.npz")


@pytest.fixture(scope="module")
def f32():
    return g.load_gpt_oss(FIXTURE, dtype=jnp.float32, progress=False)


def logits_of(model, cfg, tokens, dtype):
    cache = g.init_cache(cfg, tokens.shape[0], tokens.shape[1], dtype)
    logits, _ = model(tokens, cache, 0)
    return np.asarray(logits)


def test_fixture_covers_what_it_says():
    cfg = json.loads((FIXTURE / "config.json").read_text())
    assert cfg["quantization_config"]["quant_method"] == "mxfp4"
    assert cfg["layer_types"] == ["sliding_attention", "full_attention"]
    assert cfg["sliding_window"] < REF["tokens"].shape[1]  # the window cuts the sequence
    assert cfg["rope_parameters"]["rope_type"] == "yarn"
    assert 128 <= cfg["hidden_size"] <= 256 and cfg["num_hidden_layers"] == 2
    assert sum(f.stat().st_size for f in FIXTURE.iterdir()) < 1.5e6
    info = json.loads((FIXTURE / "fixture.json").read_text())
    assert info["written_by"]["transformers"].startswith("5.")


def test_f32_logits_match_transformers(f32):
    cfg, model = f32
    got, want = logits_of(model, cfg, REF["tokens"], jnp.float32), REF["logits"]
    span = float(want.max() - want.min())
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * span)


def test_bf16_logits_match_transformers():
    cfg, model = g.load_gpt_oss(FIXTURE, dtype=jnp.bfloat16, progress=False)
    got, want = logits_of(model, cfg, REF["tokens"], jnp.bfloat16), REF["logits"]
    span = float(want.max() - want.min())
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-2 * span)
    top2 = np.sort(want, axis=-1)[..., -2:]
    clear = top2[..., 1] - top2[..., 0] > 2e-2 * span
    assert clear.mean() > 0.5
    np.testing.assert_array_equal(got.argmax(-1)[clear], want.argmax(-1)[clear])


def test_experts_bit_exact(f32):
    """The loaded stacks dequantize to the checkpoint's e2m1 codes times 2^(scale - 127), gate
    rows (even rows of the checkpoint) first, then up rows."""
    cfg, model = f32
    with interop.SafetensorsCheckpoint(FIXTURE) as ckpt:
        for i in range(cfg.num_hidden_layers):
            for name, fused in (("gate_up_proj", "gate_up"), ("down_proj", "down")):
                blocks = ckpt.read(f"model.layers.{i}.mlp.experts.{name}_blocks")
                scales = ckpt.read(f"model.layers.{i}.mlp.experts.{name}_scales")
                codes = np.stack([blocks & 15, blocks >> 4], -1).reshape(*blocks.shape[:-1], 32)
                mag = np.array([0, .5, 1, 1.5, 2, 3, 4, 6], np.float32)[codes & 7]
                w = np.where(codes & 8, -mag, mag) * np.ldexp(
                    np.float32(1), scales.astype(np.int32) - 127)[..., None]
                w = w.reshape(*w.shape[:2], -1)
                if name == "gate_up_proj":
                    w = np.concatenate([w[:, 0::2], w[:, 1::2]], axis=1)
                q = model.params["layers"][fused]
                assert q.fmt == "mxfp4"
                got = np.asarray(jbs.dequantize(q, jnp.float32))[i]
                np.testing.assert_array_equal(got, w)


def test_moe_matches_dense_reference(f32):
    """ragged_gemm's sorted experts equal every expert run on every token (dequantized)."""
    cfg, model = f32
    x = jax.random.normal(jax.random.key(0), (2, 7, cfg.hidden_size), jnp.float32)
    p = model.params["layers"]
    ref = g.dequantize_params(model.params)["layers"]
    for i in range(cfg.num_hidden_layers):
        got = g.moe(cfg, p, x, jnp.int32(i))
        np.testing.assert_allclose(got, g.reference_moe(cfg, ref, x, i), rtol=1e-5, atol=1e-5)


def test_clamped_swiglu():
    h = jnp.array([[-10.0, 0.5, 9.0, 2.0, -9.0, 8.0]])  # gate (-10, .5, 9), up (2, -9, 8)
    gate = np.array([-10.0, 0.5, 7.0])
    up = np.array([2.0, -7.0, 7.0])
    want = (up + 1) * gate / (1 + np.exp(-1.702 * gate))
    np.testing.assert_allclose(g.clamped_swiglu(h, 7.0)[0], want, rtol=1e-6)


def test_the_sink_and_the_window_change_the_logits(f32):
    """Without the sinks, or with every layer full-attention, the logits move far from the
    reference: the fixture exercises both."""
    cfg, model = f32
    span = float(REF["logits"].max() - REF["logits"].min())
    no_sink = dict(model.params, layers=dict(model.params["layers"],
                                             sinks=jnp.full_like(model.params["layers"]["sinks"],
                                                                 -1e9)))
    full = g.GptOssConfig(**{**cfg.__dict__, "layer_types": ("full_attention",) * 2})
    for c, params in ((cfg, no_sink), (full, model.params)):
        got = logits_of(g.GptOss(c, params, jnp.float32), c, REF["tokens"], jnp.float32)
        assert np.abs(got - REF["logits"]).max() > 1e-3 * span


def test_decode_with_cache_matches_full_forward(f32):
    """Prefill 10 tokens, then one at a time: each step's logits equal the whole sequence's
    (positions past the sliding window included)."""
    cfg, model = f32
    tokens = jnp.asarray(REF["tokens"])
    t = tokens.shape[1]
    want = REF["logits"]
    span = float(want.max() - want.min())
    cache = g.init_cache(cfg, 2, t, jnp.float32)
    logits, cache = model(tokens[:, :10], cache, 0)
    steps = [np.asarray(logits)]
    for p in range(10, t):
        logits, cache = model(tokens[:, p:p + 1], cache, p)
        steps.append(np.asarray(logits))
    np.testing.assert_allclose(np.concatenate(steps, 1), want, rtol=0, atol=1e-5 * span)


def test_attend_equals_einsum_softmax_with_sinks():
    """`attend` (jax.nn.dot_product_attention and the sink's share from its log-sum-exp)
    equals the softmax over [scores, sink] written out, for decode and prefill, with and
    without a window."""
    k0, k1, k2, k3 = jax.random.split(jax.random.key(3), 4)
    b, s, n, kvh, hd = 2, 12, 4, 2, 16
    keys = jax.random.normal(k1, (b, s, kvh, hd))
    values = jax.random.normal(k2, (b, s, kvh, hd))
    sinks = jax.random.normal(k3, (n,)) * 2

    def ref(q, positions, window):
        qg = q.reshape(*q.shape[:2], kvh, n // kvh, hd)
        scores = jnp.einsum("btkgd,bskd->bkgts", qg, keys) / np.sqrt(hd)
        kpos = jnp.arange(s)
        vis = kpos[None] <= positions[:, None]
        if window:
            vis &= kpos[None] > positions[:, None] - window
        scores = jnp.where(vis, scores, -jnp.inf)
        sink = jnp.broadcast_to(sinks.reshape(kvh, n // kvh)[None, :, :, None, None],
                                scores.shape[:-1] + (1,))
        probs = jax.nn.softmax(jnp.concatenate([scores, sink], -1), -1)[..., :-1]
        return jnp.einsum("bkgts,bskd->btkgd", probs, values).reshape(q.shape)

    for t, pos in ((1, 9), (5, 3)):
        q = jax.random.normal(k0, (b, t, n, hd))
        positions = pos + jnp.arange(t)
        for window in (None, 4):
            got = g.attend(q, keys, values, sinks, positions, window=window)
            np.testing.assert_allclose(got, ref(q, positions, window), rtol=1e-5, atol=1e-5)


def test_generate_greedy(f32):
    cfg, model = f32
    prompt = REF["tokens"][:, :8]
    out = np.asarray(g.generate(model, prompt, steps=6))
    assert out.shape == (2, 6)
    # the same tokens as argmax over full forwards of the growing sequence
    seq = np.asarray(prompt)
    for s in range(6):
        logits = logits_of(model, cfg, jnp.asarray(seq), jnp.float32)
        nxt = logits[:, -1].argmax(-1)
        np.testing.assert_array_equal(out[:, s], nxt)
        seq = np.concatenate([seq, nxt[:, None]], 1)


@pytest.mark.parametrize("edit, field", [
    (lambda d: d.update(model_type="llama"), "model_type"),
    (lambda d: d.update(layer_types=["sliding_attention", "chunked_attention"]), "layer_types"),
    (lambda d: d.pop("layer_types"), "layer_types"),
    (lambda d: d.update(sliding_window=None), "sliding_window"),
    (lambda d: d.update(attention_bias=False), "attention_bias"),
    (lambda d: d.pop("rope_parameters"), "rope_theta"),
    (lambda d: d["rope_parameters"].update(rope_type="dynamic"), "rope_type"),
    (lambda d: d.update(num_experts_per_tok=9), "num_experts_per_tok"),
    (lambda d: d.update(experts_per_token=3), "experts per token"),
    (lambda d: d.pop("tie_word_embeddings"), "tie_word_embeddings"),
    (lambda d: d.pop("quantization_config"), "quantization_config.quant_method"),
    (lambda d: d["quantization_config"].update(quant_method="fp8"),
     "quantization_config.quant_method"),
])
def test_config_refused_naming_the_field(tmp_path, edit, field):
    for f in ("model.safetensors", "config.json"):
        shutil.copy(FIXTURE / f, tmp_path / f)
    d = json.loads((tmp_path / "config.json").read_text())
    edit(d)
    (tmp_path / "config.json").write_text(json.dumps(d))
    with pytest.raises(ConfigError, match=field):
        g.load_gpt_oss(tmp_path, progress=False)


def test_missing_expert_tensor_is_named(tmp_path):
    from safetensors.numpy import save_file
    shutil.copy(FIXTURE / "config.json", tmp_path / "config.json")
    with interop.SafetensorsCheckpoint(FIXTURE) as ckpt:
        keep = {k: np.array(ckpt.read(k)) for k in ckpt.keys()
                if k != "model.layers.1.mlp.experts.down_proj_scales"}
    save_file(keep, str(tmp_path / "model.safetensors"))
    with pytest.raises(interop.CheckpointError, match="down_proj_scales"):
        g.load_gpt_oss(tmp_path, progress=False)
