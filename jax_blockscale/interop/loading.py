"""Load published FP4 checkpoints from safetensors straight into BlockScaled weights.

    from jax_blockscale import interop
    with interop.SafetensorsCheckpoint("Llama-3.1-8B-Instruct-FP4") as ckpt:
        w = interop.load_quantized(ckpt, "model.layers.0.mlp.down_proj", "modelopt_nvfp4",
                                   layout="blocked")
        # scanned layers: one (L, N, K) weight, global_scale of shape (L,) (one per layer)
        w_up = interop.load_quantized(ckpt, "model.layers.{layer}.mlp.up_proj",
                                      "modelopt_nvfp4", layers=range(32), layout="blocked")
        params = interop.load_tree(ckpt, {"norm": interop.Tensor("model.norm.weight"), ...})

Each weight is read tensor by tensor (a layer at a time for a stack) from the memory-mapped
files, converted bit for bit on the host (packed fp4 bytes -> e2m1 elements, e4m3 / e8m0
scales as stored), and put on the device once, optionally with a `jax.sharding.Sharding`; no
full-precision copy exists at any point. Host memory peaks at one (stacked) weight with one
byte per fp4 element.

Sources (the tensor names under a module prefix ``<m>``):
  "modelopt_nvfp4":            <m>.weight, <m>.weight_scale, <m>.weight_scale_2 (+ <m>.input_scale)
  "compressed_tensors_nvfp4":  <m>.weight_packed, <m>.weight_scale, <m>.weight_global_scale
                               (+ <m>.input_global_scale)
  "gpt_oss_mxfp4":             <m>_blocks, <m>_scales (transformers) or <m>.blocks, <m>.scales
                               (openai/gpt-oss)
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Iterable

import jax
import jax.numpy as jnp
import numpy as np

from ..core import layout as _layout
from ..core.formats import get_format
from ..core.placement import blockscaled_shardings
from ..core.quantize import BlockScaled
from . import _arrays as A
from .checkpoint import SafetensorsCheckpoint
from .compressed_tensors import from_compressed_tensors_nvfp4
from .errors import CheckpointError
from .gpt_oss import from_gpt_oss_mxfp4
from .modelopt import from_modelopt_nvfp4

__all__ = ["SOURCES", "Quantized", "Tensor", "blockscaled_shardings", "is_quantized",
           "load_input_scale", "load_quantized", "load_tensor", "load_tree"]


# ---------------------------------------------------------------------------------------------
# What each source stores


@dataclasses.dataclass(frozen=True)
class _Source:
    fmt: str
    # role -> (tensor name suffixes tried in order, allowed dtype codes, raw shape from the
    # logical (..., N, K) shape); the roles are the converter's positional arguments
    parts: tuple[tuple[str, tuple[str, ...], tuple[str, ...], Callable], ...]
    convert: Callable
    input_scale: tuple[str, bool] | None  # (suffix, stored as an encode factor)


_NVFP4_PACKED = lambda s: (*s[:-1], s[-1] // 2)  # noqa: E731
_NVFP4_SCALES = lambda s: (*s[:-1], s[-1] // 16)  # noqa: E731
_PER_TENSOR = lambda s: None  # noqa: E731  (shape () or (1,): checked by the converter)

SOURCES: dict[str, _Source] = {
    "modelopt_nvfp4": _Source(
        "nvfp4",
        (("weight", (".weight",), ("U8",), _NVFP4_PACKED),
         ("weight_scale", (".weight_scale",), ("F8_E4M3", "U8"), _NVFP4_SCALES),
         ("weight_scale_2", (".weight_scale_2",), ("F32",), _PER_TENSOR)),
        from_modelopt_nvfp4, (".input_scale", False)),
    "compressed_tensors_nvfp4": _Source(
        "nvfp4",
        (("weight_packed", (".weight_packed",), ("U8",), _NVFP4_PACKED),
         ("weight_scale", (".weight_scale",), ("F8_E4M3", "U8"), _NVFP4_SCALES),
         ("weight_global_scale", (".weight_global_scale",), ("F32",), _PER_TENSOR)),
        from_compressed_tensors_nvfp4, (".input_global_scale", True)),
    "gpt_oss_mxfp4": _Source(
        "mxfp4",
        (("blocks", ("_blocks", ".blocks"), ("U8",), lambda s: (*s[:-1], s[-1] // 32, 16)),
         ("scales", ("_scales", ".scales"), ("U8", "F8_E8M0"), lambda s: (*s[:-1], s[-1] // 32))),
        from_gpt_oss_mxfp4, None),
}


def _source(name: str) -> _Source:
    if name not in SOURCES:
        raise ValueError(f"unknown checkpoint source {name!r}; known: {sorted(SOURCES)}")
    return SOURCES[name]


def _tensor_name(ckpt, prefix: str, suffixes) -> str:
    for s in suffixes:
        if prefix + s in ckpt:
            return prefix + s
    return prefix + suffixes[0]  # missing: `read` raises naming the first spelling


def is_quantized(ckpt, prefix: str, source: str) -> bool:
    """Whether module `prefix` is stored quantized as `source` stores it (its packed tensor is
    there with the packed dtype): a module the tool left out (an LM head, a router) is not."""
    _, suffixes, dtypes, _ = _source(source).parts[0]
    name = _tensor_name(ckpt, prefix, suffixes)
    return name in ckpt and ckpt.info(name)[0] in dtypes


# ---------------------------------------------------------------------------------------------
# Progress bar (tqdm when installed; silent otherwise)


class _Progress:
    def __init__(self, total: int, enabled: bool, desc: str):
        self._bar = None
        if enabled and total > 1:
            try:
                from tqdm.auto import tqdm
            except ImportError:
                tqdm = None
            if tqdm is not None:
                self._bar = tqdm(total=total, desc=desc, unit="tensor", leave=False)

    def update(self, n: int = 1):
        if self._bar is not None:
            self._bar.update(n)

    def close(self):
        if self._bar is not None:
            self._bar.close()


# ---------------------------------------------------------------------------------------------
# Placement


@functools.cache
def _blocked_scales_fn(out_sharding):
    return jax.jit(_layout.to_blocked_scales, out_shardings=out_sharding)


def _place(q: BlockScaled, layout: str, sharding) -> BlockScaled:
    """Host (NumPy, plain) -> device arrays, placed, scales swizzled once if asked."""
    if sharding is None:
        q = jax.tree.map(jnp.asarray, q)
        if layout == "blocked":
            q = BlockScaled(q.data, _blocked_scales_fn(None)(q.scales), q.global_scale, q.fmt,
                            "blocked")
        return q
    q = jax.device_put(q, blockscaled_shardings(sharding, q))
    if layout == "blocked":
        target = blockscaled_shardings(sharding, dataclasses.replace(q, layout="blocked"))
        q = BlockScaled(q.data, _blocked_scales_fn(target.scales)(q.scales), q.global_scale,
                        q.fmt, "blocked")
    return q


# ---------------------------------------------------------------------------------------------
# Loading


def _open(ckpt) -> SafetensorsCheckpoint:
    return ckpt if isinstance(ckpt, SafetensorsCheckpoint) else SafetensorsCheckpoint(ckpt)


def _names(pattern: str, layers) -> list[tuple[int | None, str]]:
    if layers is None:
        return [(None, pattern)]
    layers = list(layers)
    if not layers:
        raise ValueError(f"layers= is empty for {pattern!r}")
    if "{layer}" not in pattern:
        raise ValueError(f"with layers=, the name must contain '{{layer}}', got {pattern!r}")
    return [(i, pattern.format(layer=i)) for i in layers]


def _read_one(ckpt, src: _Source, prefix: str, shape) -> BlockScaled:
    """One matrix (or one checkpoint tensor's stack, e.g. gpt-oss experts) on the host."""
    args, names = [], []
    for role, suffixes, dtypes, raw_shape in src.parts:
        name = _tensor_name(ckpt, prefix, suffixes)
        want = None if shape is None else raw_shape(tuple(shape))
        args.append(ckpt.read(name, dtype=dtypes, shape=want))
        names.append(name)
    try:
        return src.convert(*args, _host=True)
    except (ValueError, TypeError) as e:
        raise CheckpointError(f"{', '.join(names)}: {e}") from None


def _check_shape(shape, fmt: str, name: str):
    if shape is None:
        return
    f = get_format(fmt)
    if len(shape) < 2 or shape[-1] % f.block:
        raise ValueError(f"shape for {name!r} must be (..., N, K) with K a multiple of "
                         f"{f.block} ({fmt}), got {tuple(shape)}")


def load_quantized(ckpt, name: str, source: str, *, layers: Iterable[int] | None = None,
                   shape: tuple[int, ...] | None = None, layout: str = "plain", sharding=None,
                   progress: bool = False, _bar: _Progress | None = None) -> BlockScaled:
    """A quantized weight from a checkpoint as a BlockScaled, bit-exact.

    ckpt:     a SafetensorsCheckpoint, or a path to open.
    name:     the module prefix (e.g. "model.layers.0.mlp.down_proj"); with `layers`, a pattern
              with "{layer}" (e.g. "model.layers.{layer}.mlp.down_proj").
    source:   "modelopt_nvfp4", "compressed_tensors_nvfp4" or "gpt_oss_mxfp4" (see the module
              docstring for the tensor names each one reads).
    layers:   layer indices to stack into one (L, ..., N, K) weight for scanned layers; an
              NVFP4 weight gets one global scale per layer (global_scale of shape (L,)).
    shape:    the logical (..., N, K) shape of one layer's weight, checked against the file.
    layout:   "plain" or "blocked" (swizzled once on the device: what `gemm` weights use).
    sharding: None (default device) or a `jax.sharding.Sharding` of the logical weight
              (see `blockscaled_shardings`).
    A missing tensor, a wrong dtype or shape, or layers that differ raise CheckpointError.
    """
    src = _source(source)
    if layout not in _layout.LAYOUTS:
        raise ValueError(f"layout must be one of {_layout.LAYOUTS}, got {layout!r}")
    _check_shape(shape, src.fmt, name)
    ckpt = _open(ckpt)
    names = _names(name, layers)
    bar = _bar or _Progress(len(names), progress, name)
    try:
        first = _read_one(ckpt, src, names[0][1], shape)
        bar.update()
        if layers is None:
            return _place(first, layout, sharding)
        shape = first.shape
        n = len(names)
        stack = BlockScaled(
            np.empty((n, *first.data.shape), first.data.dtype),
            np.empty((n, *first.scales.shape), first.scales.dtype),
            None if first.global_scale is None else
            np.empty((n, *np.shape(first.global_scale)), np.float32),
            first.fmt, "plain")
        for i, (layer, prefix) in enumerate(names):
            q = first if i == 0 else _read_one(ckpt, src, prefix, shape)
            if i:
                bar.update()
            stack.data[i] = q.data
            stack.scales[i] = q.scales
            if stack.global_scale is not None:
                stack.global_scale[i] = q.global_scale
        return _place(stack, layout, sharding)
    finally:
        if _bar is None:
            bar.close()


def load_tensor(ckpt, name: str, *, layers: Iterable[int] | None = None, dtype=None,
                shape: tuple[int, ...] | None = None, sharding=None,
                progress: bool = False, _bar: _Progress | None = None) -> jax.Array:
    """A plain (unquantized) tensor, e.g. an embedding or a norm weight; with `layers`, the
    per-layer tensors stacked into (L, ...). dtype: cast to it (None keeps the stored dtype);
    shape: one layer's expected shape; sharding: where to put the result."""
    ckpt = _open(ckpt)
    names = _names(name, layers)
    bar = _bar or _Progress(len(names), progress, name)
    try:
        out = None
        for i, (_, tensor) in enumerate(names):
            arr = ckpt.read(tensor, shape=shape)
            shape = arr.shape
            if dtype is not None:
                arr = arr.astype(dtype)
            if layers is None:
                out = arr
            else:
                if out is None:
                    out = np.empty((len(names), *arr.shape), arr.dtype)
                out[i] = arr
            bar.update()
        return jax.device_put(out, sharding) if sharding is not None else jnp.asarray(out)
    finally:
        if _bar is None:
            bar.close()


def load_input_scale(ckpt, name: str, source: str, *, layers: Iterable[int] | None = None):
    """The activation's NVFP4 global decode factor a W4A4 checkpoint stores for the module
    `name` (for ``jbs.quantize(x, "nvfp4", global_scale=...)``): ModelOpt's ``input_scale`` as
    is, compressed-tensors' ``input_global_scale`` inverted. With `layers`: shape (L,)."""
    src = _source(source)
    if src.input_scale is None:
        raise ValueError(f"{source} checkpoints store no activation scale")
    suffix, encode = src.input_scale
    vals = []
    for _, prefix in _names(name, layers):
        raw = ckpt.read(prefix + suffix, dtype=("F32",))
        try:
            vals.append(A.decode_factor(raw, prefix + suffix, (), invert=encode))
        except (ValueError, TypeError) as e:
            raise CheckpointError(str(e)) from None
    return jnp.asarray(vals[0] if layers is None else np.stack(vals), jnp.float32)


# ---------------------------------------------------------------------------------------------
# Many at once


@dataclasses.dataclass(frozen=True)
class Quantized:
    """A `load_tree` leaf: a quantized weight (arguments as `load_quantized`)."""
    name: str
    source: str
    layers: Iterable[int] | None = None
    shape: tuple[int, ...] | None = None
    layout: str = "blocked"
    sharding: Any = None

    def __post_init__(self):  # a generator of layers would be used up by the first pass
        if self.layers is not None:
            object.__setattr__(self, "layers", tuple(self.layers))


@dataclasses.dataclass(frozen=True)
class Tensor:
    """A `load_tree` leaf: a plain tensor (arguments as `load_tensor`)."""
    name: str
    layers: Iterable[int] | None = None
    dtype: Any = None
    shape: tuple[int, ...] | None = None
    sharding: Any = None

    __post_init__ = Quantized.__post_init__


def load_tree(ckpt, spec, *, progress: bool = True):
    """Load every `Quantized` / `Tensor` leaf of a nested dict (or list / tuple) `spec`; returns
    the same structure with BlockScaled weights and arrays. One progress bar (tqdm, if
    installed) counts the checkpoint matrices and tensors read."""
    ckpt = _open(ckpt)
    is_leaf = lambda x: isinstance(x, (Quantized, Tensor))  # noqa: E731
    leaves, treedef = jax.tree_util.tree_flatten(spec, is_leaf=is_leaf)
    for leaf in leaves:
        if not is_leaf(leaf):
            raise TypeError(f"load_tree spec leaves must be Quantized or Tensor, got "
                            f"{type(leaf).__name__}")
    total = sum(1 if leaf.layers is None else len(leaf.layers) for leaf in leaves)
    bar = _Progress(total, progress, "loading checkpoint")
    try:
        out = []
        for leaf in leaves:
            if isinstance(leaf, Quantized):
                out.append(load_quantized(ckpt, leaf.name, leaf.source, layers=leaf.layers,
                                          shape=leaf.shape, layout=leaf.layout,
                                          sharding=leaf.sharding, _bar=bar))
            else:
                out.append(load_tensor(ckpt, leaf.name, layers=leaf.layers, dtype=leaf.dtype,
                                       shape=leaf.shape, sharding=leaf.sharding, _bar=bar))
        return jax.tree_util.tree_unflatten(treedef, out)
    finally:
        bar.close()
