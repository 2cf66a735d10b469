"""Reading Hugging Face ``config.json`` fields that change a model's math, in both the
transformers 4 and the transformers 5 spellings, with no silent defaults.

    rope = rope_parameters(config)            # {"rope_type", "rope_theta", scaling fields...}
    inv_freq, attention_scaling = rope_frequencies(rope, head_dim, max_position_embeddings)
    n = expert_count(config)                   # num_experts / num_local_experts / n_routed_experts

transformers 5 moved ``rope_theta`` and ``rope_scaling`` into one ``rope_parameters`` dict
(``{"rope_type": "default", "rope_theta": 500000.0}``; ``{"rope_type": "llama3", "rope_theta":
..., "factor": 8.0, ...}``); transformers 4 writes ``rope_theta`` at the top level and the scaling
as ``rope_scaling`` (``"rope_type"``, or ``"type"`` in older files). Both are read; where a file
has both spellings they must agree. A field that is missing, that two spellings give differently,
or whose value this code does not implement raises `ConfigError` naming the field.

The rope types implemented are transformers' ``"default"``, ``"llama3"`` (Llama 3.1's
wavelength-dependent scaling) and ``"yarn"`` (YaRN: a ramp between interpolated and
extrapolated frequencies, and cos / sin scaled by an attention factor), computed as
transformers' ``modeling_rope_utils`` computes them: the base frequencies in f32, the
scaling in Python floats and f32.
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np

from .errors import CheckpointError

__all__ = ["ConfigError", "ROPE_TYPES", "expert_count", "require", "rope_frequencies",
           "rope_parameters", "top_k"]

ROPE_TYPES = ("default", "llama3", "yarn")

# every key a config may give the number of routed experts under
EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
TOP_K_KEYS = ("num_experts_per_tok", "num_experts_per_token", "experts_per_token", "moe_top_k")

# the rope fields each type reads (beyond rope_type and rope_theta); required ones first
_ROPE_FIELDS = {
    "default": ((), ()),
    "llama3": (("factor", "low_freq_factor", "high_freq_factor",
                "original_max_position_embeddings"), ()),
    "yarn": (("factor",), ("original_max_position_embeddings", "attention_factor", "beta_fast",
                           "beta_slow", "mscale", "mscale_all_dim", "truncate")),
}


class ConfigError(CheckpointError):
    """A config.json field is missing, contradicts another, or asks for math this code does
    not implement. The message names the field."""


def require(d: dict, key: str, where: str = "config.json"):
    """d[key], or ConfigError naming the missing field."""
    if key not in d or d[key] is None:
        raise ConfigError(f"{where} has no {key!r}, which the model needs (no default is "
                          "assumed)")
    return d[key]


def _one_of(d: dict, keys, what: str, where: str):
    """The value given under any of `keys` (None if none); ConfigError if two disagree."""
    found = {k: d[k] for k in keys if d.get(k) is not None}
    if len(set(map(repr, found.values()))) > 1:
        raise ConfigError(f"{where} gives {what} differently under {sorted(found)}: {found}")
    return next(iter(found.values()), None)


def expert_count(d: dict, where: str = "config.json") -> int:
    """The number of routed experts, read under every key known to carry it (0: dense)."""
    n = _one_of(d, EXPERT_COUNT_KEYS, "the expert count", where)
    return int(n or 0)


def top_k(d: dict, where: str = "config.json") -> int:
    """The experts each token is routed to (0 if no key gives it)."""
    k = _one_of(d, TOP_K_KEYS, "the experts per token", where)
    return int(k or 0)


def rope_parameters(d: dict, where: str = "config.json") -> dict[str, Any]:
    """The rope parameters of a config, transformers 5's ``rope_parameters`` or transformers 4's
    ``rope_theta`` + ``rope_scaling``, as one dict with ``rope_type`` and ``rope_theta`` set.

    Refused (ConfigError): no theta under either spelling; the two spellings disagreeing; a
    per-layer-type dict (different rope per attention type); a partial rotary factor other than
    1; a rope type other than those in ROPE_TYPES; a field its type needs missing."""
    v5 = d.get("rope_parameters")
    v4_scaling = d.get("rope_scaling")
    params: dict[str, Any] = {}
    if v5 is not None:
        if not isinstance(v5, dict):
            raise ConfigError(f"{where}: 'rope_parameters' must be a dict, got {v5!r}")
        if any(isinstance(v, dict) for v in v5.values()):
            raise ConfigError(f"{where}: 'rope_parameters' gives a rope per layer type "
                              f"({sorted(v5)}); one rope for every layer is implemented")
        params.update(v5)
    if v4_scaling is not None:
        if not isinstance(v4_scaling, dict):
            raise ConfigError(f"{where}: 'rope_scaling' must be a dict or null, got "
                              f"{v4_scaling!r}")
        for k, v in v4_scaling.items():
            if k in params and params[k] != v:
                raise ConfigError(f"{where}: 'rope_scaling' and 'rope_parameters' give {k!r} "
                                  f"differently ({v!r} and {params[k]!r})")
            params[k] = v
    if "type" in params:  # transformers 4's older spelling of rope_type
        if params.get("rope_type", params["type"]) != params["type"]:
            raise ConfigError(f"{where}: rope 'type' {params['type']!r} and 'rope_type' "
                              f"{params['rope_type']!r} disagree")
        params["rope_type"] = params.pop("type")
    top_theta = d.get("rope_theta")
    if top_theta is not None:
        if params.get("rope_theta") not in (None, top_theta):
            raise ConfigError(f"{where}: 'rope_theta' ({top_theta}) and "
                              f"'rope_parameters.rope_theta' ({params['rope_theta']}) disagree")
        params["rope_theta"] = top_theta
    if params.get("rope_theta") is None:
        raise ConfigError(f"{where} has no 'rope_theta' (transformers 4) and no "
                          "'rope_parameters.rope_theta' (transformers 5); no default is assumed")
    params["rope_theta"] = float(params["rope_theta"])
    partial = params.get("partial_rotary_factor", d.get("partial_rotary_factor"))
    if partial is not None and float(partial) != 1.0:
        raise ConfigError(f"{where}: partial_rotary_factor={partial} (rope on part of each head) "
                          "is not implemented")
    params.pop("partial_rotary_factor", None)
    rope_type = params.setdefault("rope_type", "default")
    if rope_type not in ROPE_TYPES:
        raise ConfigError(f"{where}: rope_type {rope_type!r} is not implemented (implemented: "
                          f"{', '.join(ROPE_TYPES)})")
    required, optional = _ROPE_FIELDS[rope_type]
    for key in required:
        if params.get(key) is None:
            raise ConfigError(f"{where}: rope_type {rope_type!r} needs "
                              f"'{key}' in its rope parameters")
    unknown = set(params) - {"rope_type", "rope_theta", *required, *optional}
    if unknown:
        raise ConfigError(f"{where}: rope parameters {sorted(unknown)} are not read by rope_type "
                          f"{rope_type!r} here; refusing rather than ignoring them")
    return params


def _base_inv_freq(theta: float, dim: int) -> np.ndarray:
    """1 / theta ** (2i / dim) in f32, as transformers computes it (an f32 power)."""
    exponent = np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / np.float32(dim)
    return (np.float32(1.0) / np.power(np.float32(theta), exponent)).astype(np.float32)


def rope_frequencies(rope: dict, head_dim: int,
                     max_position_embeddings: int | None = None) -> tuple[np.ndarray, float]:
    """(inv_freq f32 (head_dim/2,), attention_scaling) for `rope` (from `rope_parameters`).
    cos and sin of ``position * inv_freq`` are multiplied by attention_scaling (1 except for
    YaRN). max_position_embeddings: the config's, read by YaRN when its parameters give no
    ``original_max_position_embeddings``."""
    theta, rope_type = rope["rope_theta"], rope["rope_type"]
    inv_freq = _base_inv_freq(theta, head_dim)
    if rope_type == "default":
        return inv_freq, 1.0
    if rope_type == "llama3":
        return _llama3(inv_freq, rope), 1.0
    if rope_type == "yarn":
        return _yarn(rope, head_dim, max_position_embeddings)
    raise ConfigError(f"rope_type {rope_type!r} is not implemented")


def _llama3(inv_freq: np.ndarray, rope: dict) -> np.ndarray:
    """Llama 3.1: wavelengths longer than original_len / low_freq_factor are divided by
    `factor`, shorter than original_len / high_freq_factor kept, and in between a linear blend
    in original_len / wavelength."""
    factor = float(rope["factor"])
    low, high = float(rope["low_freq_factor"]), float(rope["high_freq_factor"])
    original = float(rope["original_max_position_embeddings"])
    if high <= low:
        raise ConfigError(f"llama3 rope needs high_freq_factor > low_freq_factor, got {high} "
                          f"and {low}")
    wavelen = np.float32(2 * math.pi) / inv_freq
    long_wave = wavelen > np.float32(original / low)
    short_wave = wavelen < np.float32(original / high)
    scaled = np.where(long_wave, inv_freq / np.float32(factor), inv_freq).astype(np.float32)
    smooth = ((np.float32(original) / wavelen - np.float32(low)) / np.float32(high - low))
    smoothed = ((1 - smooth) * scaled / np.float32(factor) + smooth * scaled).astype(np.float32)
    medium = ~short_wave & ~long_wave
    return np.where(medium, smoothed, scaled).astype(np.float32)


def _yarn(rope: dict, dim: int, max_position_embeddings) -> tuple[np.ndarray, float]:
    """YaRN (arXiv 2309.00071): per frequency a blend of the base frequency (extrapolation)
    and the base frequency / factor (interpolation), the blend ramping linearly over the
    dimensions between the ones that turn beta_fast and beta_slow times over the original
    context; cos / sin scaled by attention_factor (by default 0.1 ln(factor) + 1)."""
    theta = rope["rope_theta"]
    factor = float(rope["factor"])
    original = rope.get("original_max_position_embeddings")
    if original is None:
        if max_position_embeddings is None:
            raise ConfigError("yarn rope needs 'original_max_position_embeddings' (in its rope "
                              "parameters) or the config's 'max_position_embeddings'")
        original = max_position_embeddings
    original = float(original)

    def mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = rope.get("attention_factor")
    if attention is None:
        m, m_all = rope.get("mscale"), rope.get("mscale_all_dim")
        attention = (mscale(factor, m) / mscale(factor, m_all) if m and m_all
                     else mscale(factor))
    beta_fast = rope.get("beta_fast") or 32
    beta_slow = rope.get("beta_slow") or 1
    truncate = rope.get("truncate", True)

    def correction_dim(rotations):
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    pos_freqs = np.power(np.float32(theta),
                         np.arange(0, dim, 2).astype(np.float32) / np.float32(dim))
    extrapolation = np.float32(1.0) / pos_freqs
    interpolation = np.float32(1.0) / (np.float32(factor) * pos_freqs)
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - np.float32(low))
                   / np.float32(high - low), 0, 1)
    extrapolation_weight = (1 - ramp).astype(np.float32)
    inv_freq = interpolation * (1 - extrapolation_weight) + extrapolation * extrapolation_weight
    return inv_freq.astype(np.float32), float(attention)
