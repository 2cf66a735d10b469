"""Which quantized layout a Hugging Face checkpoint directory holds, read from its own metadata.

    q = checkpoint_quantization("path/to/model")   # None: an unquantized checkpoint
    q.source        # "modelopt_nvfp4" or "compressed_tensors_nvfp4" (a `load_quantized` source)
    q.activations   # True: W4A4 (static activation global scales stored), False: weight-only
    q.ignore        # module names (or "re:" patterns) the tool left unquantized

Read from, in this order:
  hf_quant_config.json   ModelOpt's export: {"producer": {"name": "modelopt"}, "quantization":
                         {"quant_algo": "NVFP4" | "W4A16_NVFP4", "group_size": 16,
                          "exclude_modules": [...]}}
  config.json            "quantization_config": compressed-tensors' ({"quant_method":
                         "compressed-tensors", "format": "nvfp4-pack-quantized",
                         "config_groups": {...}, "ignore": [...]}) or ModelOpt's own copy
                         ({"quant_method": "modelopt", "quant_algo": ...})
Anything else that says the checkpoint is quantized (another quant_method, an algorithm, group
size, bit width or format these loaders do not read) raises CheckpointError naming it: nothing
falls back to a default.
"""
from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

from .errors import CheckpointError

__all__ = ["CheckpointQuantization", "checkpoint_quantization", "is_ignored"]

# ModelOpt quant_algo -> activations quantized (W4A4) or not
_MODELOPT_ALGOS = {"NVFP4": True, "W4A16_NVFP4": False}


@dataclasses.dataclass(frozen=True)
class CheckpointQuantization:
    source: str                  # a load_quantized source name
    activations: bool            # W4A4: the activations' static global scales are stored
    ignore: tuple[str, ...]      # modules left unquantized, as the metadata lists them
    description: str             # e.g. "ModelOpt 0.47.0 NVFP4"


def is_ignored(module: str, ignore) -> bool:
    """Whether `module` is in an ignore / exclude list (exact names, "re:" regexes as
    compressed-tensors writes them, or "*" wildcards as ModelOpt writes them)."""
    for pat in ignore:
        if pat.startswith("re:"):
            if re.match(pat[3:], module):
                return True
        elif "*" in pat:
            if re.fullmatch(re.escape(pat).replace(r"\*", ".*"), module):
                return True
        elif pat == module:
            return True
    return False


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"cannot read {str(path)!r} as JSON: {e}") from None


def checkpoint_quantization(path) -> CheckpointQuantization | None:
    """The quantization a checkpoint directory declares (None: not quantized)."""
    path = Path(path)
    hf_quant = path / "hf_quant_config.json"
    if hf_quant.exists():
        return _modelopt(_read_json(hf_quant), str(hf_quant))
    config = path / "config.json"
    qc = _read_json(config).get("quantization_config") if config.exists() else None
    if qc is None:
        return None
    where = f"{config}: quantization_config"
    method = qc.get("quant_method")
    if method == "compressed-tensors":
        return _compressed_tensors(qc, where)
    if method == "modelopt":
        return _modelopt({"producer": {"name": "modelopt"}, "quantization": qc}, where)
    raise CheckpointError(f"{where} has quant_method={method!r}; these loaders read "
                          "'compressed-tensors' (nvfp4-pack-quantized) and 'modelopt' (NVFP4, "
                          "W4A16_NVFP4) checkpoints")


def _modelopt(d: dict, where: str) -> CheckpointQuantization:
    q = d.get("quantization", {})
    algo = q.get("quant_algo")
    if algo not in _MODELOPT_ALGOS:
        raise CheckpointError(f"{where} says quant_algo={algo!r}; ModelOpt checkpoints are read "
                              f"for quant_algo in {sorted(_MODELOPT_ALGOS)}")
    group = q.get("group_size", 16)
    if group != 16:
        raise CheckpointError(f"{where} says group_size={group!r}; NVFP4 has 16-element "
                              "blocks")
    version = d.get("producer", {}).get("version")
    return CheckpointQuantization(
        "modelopt_nvfp4", _MODELOPT_ALGOS[algo], tuple(q.get("exclude_modules") or ()),
        f"ModelOpt{' ' + version if version else ''} {algo}")


def _nvfp4_args(args, what: str, where: str):
    """Check one compressed-tensors quantization-args dict is NVFP4 (4-bit float, groups of
    16, one global scale per tensor)."""
    want = {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16,
            "symmetric": True}
    for key, value in want.items():
        if args.get(key, value) != value:
            raise CheckpointError(f"{where}: {what} has {key}={args.get(key)!r}; NVFP4 is "
                                  f"{key}={value!r}")


def _compressed_tensors(qc: dict, where: str) -> CheckpointQuantization:
    status = qc.get("quantization_status")
    if status not in (None, "compressed"):
        raise CheckpointError(f"{where} has quantization_status={status!r}; only compressed "
                              "checkpoints (save_compressed=True) store packed weights")
    groups = qc.get("config_groups") or {}
    if not groups:
        raise CheckpointError(f"{where} has no config_groups")
    activations = set()
    for name, g in groups.items():
        fmt = g.get("format") or qc.get("format")
        if fmt != "nvfp4-pack-quantized":
            raise CheckpointError(f"{where}: config group {name!r} has format {fmt!r}; this "
                                  "loader reads 'nvfp4-pack-quantized'")
        if g.get("weights") is None:
            raise CheckpointError(f"{where}: config group {name!r} quantizes no weights")
        _nvfp4_args(g["weights"], f"group {name!r} weights", where)
        if g.get("weights", {}).get("dynamic", False) is not False:
            raise CheckpointError(f"{where}: group {name!r} weights are dynamic")
        act = g.get("input_activations")
        if act is not None:
            _nvfp4_args(act, f"group {name!r} input_activations", where)
            if act.get("dynamic") not in ("local", "LOCAL"):
                raise CheckpointError(f"{where}: group {name!r} input_activations have "
                                      f"dynamic={act.get('dynamic')!r}; NVFP4 activations "
                                      "take dynamic block scales under a static global scale "
                                      "('local')")
        if g.get("output_activations") is not None:
            raise CheckpointError(f"{where}: group {name!r} quantizes output activations")
        activations.add(act is not None)
    if len(activations) > 1:
        raise CheckpointError(f"{where}: some config groups quantize activations and some do "
                              "not; one scheme for every module is read")
    w4a4 = activations.pop()
    if qc.get("kv_cache_scheme") is not None:
        raise CheckpointError(f"{where} has a kv_cache_scheme (a quantized KV cache), which "
                              "this loader does not read")
    version = qc.get("version")
    return CheckpointQuantization(
        "compressed_tensors_nvfp4", w4a4, tuple(qc.get("ignore") or ()),
        f"compressed-tensors{' ' + version if version else ''} "
        f"{'NVFP4' if w4a4 else 'NVFP4A16'} (nvfp4-pack-quantized)")
