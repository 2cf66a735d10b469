"""Regenerate tests/fixtures/checkpoints/: tiny checkpoints written by the real tools, each with
the tool's own reference logits.

    pip install ".[fixtures]"        # torch, transformers 5, llm-compressor, compressed-tensors
    python scripts/make_checkpoint_fixtures.py [--out tests/fixtures/checkpoints] [--only NAME]

Every fixture is a directory as the tool saved it (config.json, model.safetensors, and for a
quantized model the tool's quantization metadata), plus:
  reference.npz   tokens (2, T) int32 and logits (2, T, vocab) f32: the checkpoint loaded back
                  by transformers (compressed weights decompressed by compressed-tensors), run
                  in f32 on the CPU
  fixture.json    which tool and version wrote it, and what it covers
Weights are random (the model's own initializer, std `INIT_STD`) and stored in bf16 where the
tool allows, to keep the files small; the references run them in f32, so a loader that reads
the bf16 weights exactly can match them to f32 rounding.

Tools that cannot run here are skipped with the reason printed: ModelOpt's quantization needs a
CUDA device, so its fixtures are made on a GPU machine. One without network takes the wheels
downloaded elsewhere (torch, triton, numpy and scipy as the machine has them):

    pip download -d wheels --python-version 3.12 --only-binary=:all: --no-deps \
        nvidia-modelopt==0.47.0 transformers==5.17.0 huggingface-hub tokenizers safetensors \
        regex tqdm pydantic pydantic-core annotated-types typing-inspection omegaconf \
        antlr4-python3-runtime nvidia-ml-py pulp==3.3.2 hf-xet httpx httpcore h11 anyio \
        sniffio idna certifi click typer shellingham
    pip install --no-index --no-deps --target site wheels/*.whl   # on the GPU machine
    PYTHONPATH=site python scripts/make_checkpoint_fixtures.py --only modelopt_nvfp4 ...
"""
from __future__ import annotations

import argparse
import copy
import json
import shutil
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "tests" / "fixtures" / "checkpoints"
INIT_STD = 0.1
SEQ = 24
KEEP = {"config.json", "model.safetensors", "hf_quant_config.json", "recipe.yaml"}


def _versions(*names):
    import importlib.metadata as md
    out = {}
    for n in names:
        try:
            out[n] = md.version(n)
        except md.PackageNotFoundError:
            pass
    return out


def _llama_config(**kw):
    from transformers import LlamaConfig
    base = dict(vocab_size=128, hidden_size=128, intermediate_size=256, num_hidden_layers=1,
                num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                max_position_embeddings=256, rms_norm_eps=1e-5, initializer_range=INIT_STD,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                tie_word_embeddings=False)
    base.update(kw)
    return LlamaConfig(**base)


def _tokens(vocab, seed=0):
    return np.random.default_rng(seed).integers(0, vocab, (2, SEQ)).astype(np.int32)


def _reference(path: Path, tokens: np.ndarray) -> np.ndarray:
    """The saved checkpoint loaded back by transformers and run in f32."""
    import torch
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        return model(torch.from_numpy(tokens).long()).logits.float().numpy()


def _finish(path: Path, tokens, logits, tool: dict, what: str):
    for f in path.iterdir():
        if f.name not in KEEP:
            f.unlink() if f.is_file() else shutil.rmtree(f)
    if logits is None:
        logits = _reference(path, tokens)
    np.savez_compressed(path / "reference.npz", tokens=tokens, logits=logits)
    (path / "fixture.json").write_text(json.dumps({"written_by": tool, "covers": what},
                                                  indent=1) + "\n")
    size = sum(f.stat().st_size for f in path.iterdir())
    print(f"{path.name}: {size / 1024:.0f} KiB, logits range "
          f"{float(logits.max() - logits.min()):.3f}")


def _save_float(model, path: Path, dtype):
    import torch
    model.to(getattr(torch, dtype)).save_pretrained(path)


def make_llama(out: Path, name: str, what: str, dtype="bfloat16", **cfg):
    import torch
    from transformers import LlamaForCausalLM
    torch.manual_seed(0)
    config = _llama_config(**cfg)
    model = LlamaForCausalLM(config)
    path = out / name
    _save_float(model, path, dtype)
    _finish(path, _tokens(config.vocab_size), None, _versions("transformers", "torch"), what)


def _qwen3_moe_config():
    from transformers import Qwen3MoeConfig
    return Qwen3MoeConfig(vocab_size=128, hidden_size=128, intermediate_size=256,
                          moe_intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                          num_key_value_heads=2, head_dim=32, num_experts=4,
                          num_experts_per_tok=2, norm_topk_prob=True, rms_norm_eps=1e-6,
                          max_position_embeddings=256, initializer_range=INIT_STD,
                          rope_parameters={"rope_type": "default", "rope_theta": 1e6},
                          tie_word_embeddings=False)


def make_qwen3_moe(out: Path):
    import torch
    from transformers import Qwen3MoeForCausalLM
    torch.manual_seed(0)
    config = _qwen3_moe_config()
    model = Qwen3MoeForCausalLM(config)
    path = out / "transformers_qwen3_moe"
    _save_float(model, path, "bfloat16")
    _finish(path, _tokens(128), None, _versions("transformers", "torch"),
            "Qwen3-MoE (per-head q/k norms, 4 experts top-2, expert count as "
            "num_local_experts), bf16 weights")


def _tokenizer(vocab: int):
    """A word-level tokenizer over `vocab` made-up words (oneshot wants a processor beside a
    dataset; the dataset here is already token ids)."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast
    words = {f"w{i}": i for i in range(vocab)}
    tok = Tokenizer(models.WordLevel(words, unk_token="w0"))
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0", pad_token="w0")


def make_llm_compressor(out: Path, scheme: str):
    import torch
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from transformers import AutoModelForCausalLM, LlamaForCausalLM
    import tempfile
    torch.manual_seed(0)
    config = _llama_config(num_hidden_layers=2)
    base = Path(tempfile.mkdtemp())  # oneshot reads the model's config (and tokenizer) by path
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(base)
    _tokenizer(config.vocab_size).save_pretrained(base)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.bfloat16)
    recipe = QuantizationModifier(targets="Linear", scheme=scheme, ignore=["lm_head"])
    if scheme == "NVFP4A16":  # weight-only: no calibration data
        oneshot(model=model, recipe=recipe)
    else:  # the activations' global scales are calibrated on random token ids
        rng = np.random.default_rng(1)
        calib = Dataset.from_dict({
            "input_ids": [rng.integers(0, 128, 32).tolist() for _ in range(16)],
            "attention_mask": [[1] * 32 for _ in range(16)]})
        oneshot(model=model, dataset=calib, recipe=recipe, max_seq_length=32,
                num_calibration_samples=16)
    # The reference: llm-compressor's own quantized forward (weights, and for W4A4 the
    # activations, quantized and dequantized by compressed-tensors with the calibrated scales)
    # in f32. (transformers' reload of the compressed file decompresses to bf16 only.)
    tokens = _tokens(128)
    reference = copy.deepcopy(model).float().eval()
    with torch.no_grad():
        logits = reference(torch.from_numpy(tokens).long()).logits.float().numpy()
    del reference
    path = out / f"llmcompressor_{scheme.lower()}"
    model.save_pretrained(path, save_compressed=True)
    _finish(path, tokens, logits, _versions("llmcompressor", "compressed-tensors", "transformers",
                                         "torch"),
            f"llm-compressor oneshot scheme {scheme!r}, saved compressed "
            "(nvfp4-pack-quantized), 2 layers")


def make_modelopt(out: Path, algo: str, moe: bool = False):
    """NVIDIA ModelOpt: ``mtq.quantize`` with NVFP4_DEFAULT_CFG (W4A4: the activations' global
    scales calibrated on random token ids) or W4A16_NVFP4_CFG (weight-only), then
    ``export_hf_checkpoint`` (hf_quant_config.json beside the weights). ModelOpt's NVFP4 fake
    quantization (inside ``mtq.quantize``) runs only on a CUDA device, so this runs on a GPU
    machine; the reference (`_modelopt_reference`) runs anywhere."""
    import torch
    if not torch.cuda.is_available():
        raise RuntimeError("ModelOpt's NVFP4 fake quantization (mtq.quantize) needs a CUDA device")
    import tempfile

    import modelopt.torch.quantization as mtq
    from modelopt.torch.export import export_hf_checkpoint
    from transformers import AutoModelForCausalLM
    torch.manual_seed(0)
    if moe:
        from transformers import Qwen3MoeForCausalLM
        model = Qwen3MoeForCausalLM(_qwen3_moe_config())
    else:
        from transformers import LlamaForCausalLM
        model = LlamaForCausalLM(_llama_config())
    with tempfile.TemporaryDirectory() as base:  # read back as a user's model is
        model.to(torch.bfloat16).save_pretrained(base)
        model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.bfloat16).cuda().eval()
    cfg = copy.deepcopy({"NVFP4": mtq.NVFP4_DEFAULT_CFG, "W4A16_NVFP4": mtq.W4A16_NVFP4_CFG}[algo])
    rng = np.random.default_rng(1)
    calib = [torch.from_numpy(rng.integers(0, 128, (4, 32))).long().cuda() for _ in range(4)]

    def forward_loop(m):
        with torch.no_grad():
            for batch in calib:
                m(batch)

    model = mtq.quantize(model, cfg, forward_loop)
    path = out / f"modelopt_{'qwen3_moe_' if moe else ''}{algo.lower()}"
    export_hf_checkpoint(model, export_dir=str(path))
    tokens = _tokens(128)
    _finish(path, tokens, _modelopt_reference(path, tokens),
            _versions("nvidia-modelopt", "transformers", "torch"),
            f"ModelOpt mtq.quantize {algo} + export_hf_checkpoint"
            + (", Qwen3-MoE (4 experts top-2)" if moe else ", Llama, 1 layer")
            + "; reference: the export dequantized by ModelOpt's NVFP4QTensor, run by "
            "transformers in f32")


def _modelopt_reference(path: Path, tokens: np.ndarray) -> np.ndarray:
    """The exported checkpoint as ModelOpt itself reads it back, run by transformers in f32 on
    the CPU: every packed weight dequantized by ModelOpt's ``NVFP4QTensor.dequantize`` (its
    block scales times ``weight_scale_2``), and for a W4A4 export every quantized layer's input
    quantized and dequantized by ModelOpt's ``NVFP4QTensor.quantize`` with the exported
    ``input_scale`` (16-element blocks, E4M3 block scales), as a serving kernel does.

    Not the fake-quantized model inside ``mtq.quantize``: the export is what is served, and it
    differs from that model. The export gives layers that read one input (q/k/v, gate/up) one
    shared global scale; even after that step the fake-quantized model (its GPU kernel) gave
    logits 0.8-2% of their range away from the export's on these fixtures."""
    import tempfile

    import torch
    from modelopt.torch.quantization.qtensor.nvfp4_tensor import NVFP4QTensor
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM
    stored = load_file(str(path / "model.safetensors"))
    tensors, input_scales = {}, {}
    for name, t in stored.items():
        module, _, field = name.rpartition(".")
        if field in ("weight_scale", "weight_scale_2"):
            continue
        if field == "input_scale":
            input_scales[module] = t.float()
        elif field == "weight" and t.dtype == torch.uint8:
            rows, packed = t.shape
            q = NVFP4QTensor(torch.Size((rows, 2 * packed)), torch.float32, t)
            tensors[name] = q.dequantize(dtype=torch.float32,
                                         scale=stored[module + ".weight_scale"],
                                         double_scale=stored[module + ".weight_scale_2"].float(),
                                         block_sizes={-1: 16})
        else:
            tensors[name] = t.float()
    config = json.loads((path / "config.json").read_text())
    config.pop("quantization_config")
    with tempfile.TemporaryDirectory() as tmp:  # the same model, unquantized, for transformers
        plain = Path(tmp)
        (plain / "config.json").write_text(json.dumps(config))
        save_file(tensors, str(plain / "model.safetensors"), metadata={"format": "pt"})
        model = AutoModelForCausalLM.from_pretrained(plain, dtype=torch.float32).eval()

    def quantize_input(scale):
        def hook(_, args):
            x = args[0]
            q, block_scale, global_scale = NVFP4QTensor.quantize(
                x, 16, weights_scaling_factor_2=scale)
            return (q.dequantize(dtype=x.dtype, scale=block_scale, double_scale=global_scale,
                                 block_sizes={-1: 16}),)
        return hook

    for module, scale in input_scales.items():
        model.get_submodule(module).register_forward_pre_hook(quantize_input(scale))
    with torch.no_grad():
        return model(torch.from_numpy(tokens).long()).logits.float().numpy()


# e2m1 magnitudes by code (bit 3 is the sign), as gpt-oss's MXFP4 tensors store them
E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], np.float32)


def _mxfp4_gpt_oss(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """w (..., N, K) f32 -> gpt-oss's original MXFP4 layout: blocks uint8 (..., N, K/32, 16)
    (two e2m1 codes a byte, element 2i in the low nibble) and scales uint8 (..., N, K/32)
    (biased exponents, value = e2m1 * 2 ** (scale - 127)). The OCP MX recipe: each block of 32
    along K shares the exponent floor(log2(amax)) - 2, codes round to nearest (ties to the even
    code), magnitudes past 6 saturate."""
    *lead, n, k = w.shape
    blocks = w.reshape(*lead, n, k // 32, 32).astype(np.float32)
    amax = np.abs(blocks).max(axis=-1)
    exp = np.where(amax > 0, np.floor(np.log2(np.where(amax > 0, amax, 1))) - 2, -127)
    exp = np.clip(exp, -127, 127).astype(np.int32)
    scaled = np.abs(blocks) / np.ldexp(np.float32(1), exp)[..., None]
    dist = np.abs(scaled[..., None] - E2M1)  # nearest magnitude; ties to the even code
    best = dist.min(axis=-1, keepdims=True)
    ties = dist == best
    even = ties & (np.arange(8) % 2 == 0)
    mag = np.where(even.any(axis=-1), even.argmax(axis=-1), ties.argmax(axis=-1))
    codes = (mag | np.where(blocks < 0, 8, 0)).astype(np.uint8)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return packed.astype(np.uint8), (exp + 127).astype(np.uint8)


def make_gpt_oss(out: Path):
    """gpt-oss with its experts in the original MXFP4 layout (as openai/gpt-oss-20b / -120b
    publish them: ``*_blocks`` / ``*_scales`` per expert weight, biases and everything else in
    bf16, config.json's quantization_config ``quant_method: mxfp4``), written here (transformers
    cannot quantize to MXFP4 without its GPU kernels) and read back by transformers' own MXFP4
    loader (dequantized on the CPU) for the reference. Expert gate_up weights are drawn wide
    enough that the SwiGLU clamp (limit 7) is hit; biases and sinks are random, not zero."""
    import torch
    from safetensors.torch import save_file
    from transformers import GptOssConfig, GptOssForCausalLM
    torch.manual_seed(0)
    config = GptOssConfig(vocab_size=32, hidden_size=128, intermediate_size=32,
                          num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                          head_dim=16, num_local_experts=4, num_experts_per_tok=2,
                          sliding_window=6, layer_types=["sliding_attention", "full_attention"],
                          max_position_embeddings=64, rms_norm_eps=1e-5,
                          initializer_range=INIT_STD, tie_word_embeddings=False,
                          rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0,
                                           "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                           "truncate": False,
                                           "original_max_position_embeddings": 16})
    model = GptOssForCausalLM(config)
    gen = torch.Generator().manual_seed(1)
    state = {}
    with torch.no_grad():
        for name, t in model.state_dict().items():
            if name.endswith(("_bias", ".bias", ".sinks")):
                t = torch.randn(t.shape, generator=gen) * (1.0 if name.endswith("sinks")
                                                           else INIT_STD)
            if name.endswith("experts.gate_up_proj"):
                t = t * 4  # gate / up values past the clamp
            state[name] = t.to(torch.bfloat16)
    path = out / "gpt_oss_tiny"
    path.mkdir(parents=True)
    tensors = {}
    for name, t in state.items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            # transformers holds (E, in, out); the checkpoint stores (E, out, in) in MXFP4
            w = t.float().transpose(1, 2).numpy()
            blocks, scales = _mxfp4_gpt_oss(w)
            tensors[name + "_blocks"] = torch.from_numpy(np.ascontiguousarray(blocks))
            tensors[name + "_scales"] = torch.from_numpy(np.ascontiguousarray(scales))
        else:
            tensors[name] = t.contiguous()
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    config_json = json.loads(config.to_json_string())
    config_json["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                   "model.embed_tokens", "lm_head"]}
    (path / "config.json").write_text(json.dumps(config_json, indent=2) + "\n")
    # transformers' MXFP4 loader dequantizes the experts to bf16 (exact: e2m1 times a power of
    # two) whatever dtype is asked for; the reference runs every weight in f32
    from transformers import AutoModelForCausalLM
    tokens = _tokens(config.vocab_size)
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).float().eval()
    with torch.no_grad():
        logits = reference(torch.from_numpy(tokens).long()).logits.float().numpy()
    _finish(path, tokens, logits,
            _versions("transformers", "torch", "safetensors"),
            "gpt-oss: MXFP4 experts in the original layout (*_blocks / *_scales), expert and "
            "attention biases, attention sinks, sliding-window (6) and full layers, YaRN rope "
            "(factor 4, truncate false), 4 experts top-2, clamped SwiGLU; 2 layers")
    # not reference.npz: tests/unit/test_real_checkpoints.py loads every fixture that has one
    # through examples/llama; this one is read by tests/unit/test_gpt_oss.py
    (path / "reference.npz").rename(path / "reference_gpt_oss.npz")


FIXTURES = {
    "transformers_llama": lambda out: make_llama(
        out, "transformers_llama", "Llama, transformers 5 config (rope_parameters, theta "
        "10000), bf16 weights"),
    "transformers_llama_f32": lambda out: make_llama(
        out, "transformers_llama_f32", "Llama, f32 weights", dtype="float32",
        intermediate_size=128),
    "transformers_llama3_rope": lambda out: make_llama(
        out, "transformers_llama3_rope", "Llama 3.1 rope scaling (rope_type llama3, factor 8)",
        rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 64}),
    "transformers_llama_yarn": lambda out: make_llama(
        out, "transformers_llama_yarn", "YaRN rope (factor 4, attention factor from it)",
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                         "original_max_position_embeddings": 64}),
    "transformers_llama_tied": lambda out: make_llama(
        out, "transformers_llama_tied", "tied embeddings (no lm_head.weight)",
        tie_word_embeddings=True),
    "transformers_qwen3_moe": make_qwen3_moe,
    "llmcompressor_nvfp4": lambda out: make_llm_compressor(out, "NVFP4"),
    "llmcompressor_nvfp4a16": lambda out: make_llm_compressor(out, "NVFP4A16"),
    "modelopt_nvfp4": lambda out: make_modelopt(out, "NVFP4"),
    "modelopt_w4a16_nvfp4": lambda out: make_modelopt(out, "W4A16_NVFP4"),
    "modelopt_qwen3_moe_w4a16_nvfp4": lambda out: make_modelopt(out, "W4A16_NVFP4", moe=True),
    "gpt_oss_tiny": make_gpt_oss,
}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=OUT)
    p.add_argument("--only", action="append", choices=sorted(FIXTURES))
    a = p.parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    for name in a.only or FIXTURES:
        if (a.out / name).exists():
            shutil.rmtree(a.out / name)
        try:
            FIXTURES[name](a.out)
        except RuntimeError as e:
            print(f"{name}: skipped: {e}")


if __name__ == "__main__":
    main()
