"""Save and load quantized parameters: one ``.npz`` file, raw bits, metadata checked on load.

    save_params("model.npz", qparams)            # nested dicts of BlockScaled and plain arrays
    qparams = load_params("model.npz", fmt="nvfp4", like=expected)

Why ``np.savez``: it needs nothing beyond NumPy, and every array is stored as its raw bits
(uint8/16/32/64 of the same width), so FP4, FP8, e8m0 and bf16 values round-trip bit for bit
whatever dtypes the reader's NumPy or checkpoint library knows. FP4 elements are packed two per
byte (low nibble first), so a file is as small as the weights. The format, layout, shapes and
dtypes of every entry are stored beside the arrays as JSON and checked on load, and every entry
carries a SHA-256 digest of its metadata and bits (the file, one of the whole metadata): a
truncated, damaged or edited file raises `CorruptFileError` naming the entry instead of loading
wrong values (an mxfp6_e2m3 entry relabelled e3m2 would otherwise load, up to 2x off).

Orbax also stores these dtypes bit-exactly, but a BlockScaled's format and layout are static
pytree metadata that an Orbax checkpoint does not record: it restores into whatever target it is
given, casting silently (an mxfp8_e4m3 checkpoint restored into an mxfp8_e5m2 target comes back
re-rounded). With Orbax, store `describe_params(qparams)` (JSON) beside the checkpoint and call
`check_description(restored, description)` after restoring; docs/serving.md shows how.

Only nested dicts are stored (Linen ``params``, ``nnx.to_pure_dict(state)``, the output of
`jax_blockscale.nn.quantize_params`); keys are strings or ints, leaves BlockScaled or arrays.
"""
from __future__ import annotations

import hashlib
import json
import os
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from ..core import layout as _layout
from ..core.formats import get_format
from ..core.quantize import BlockScaled

__all__ = ["FILE_VERSION", "CorruptFileError", "ParamsFileError", "check_description",
           "describe_params", "load_params", "save_params"]

# 2 adds the SHA-256 digests; version 1 files (no digests) are still read.
FILE_VERSION = 2
_READS = (1, 2)
_META = "__jax_blockscale_meta__"
_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


class ParamsFileError(ValueError):
    """The file is not a jax_blockscale params file, is inconsistent, or is not what was asked."""


class CorruptFileError(ParamsFileError):
    """The file is damaged: truncated, unreadable, or its contents do not match their digests."""


# ---------------------------------------------------------------------------------------------
# Digests: each entry's metadata and bits, and the metadata as a whole


def _canonical(obj) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


def _entry_digest(entry: dict, bits: dict[str, np.ndarray]) -> str:
    """SHA-256 of an entry's metadata (without its digest) and of every part's dtype, shape and
    raw bytes, in part-name order."""
    h = hashlib.sha256(_canonical({k: v for k, v in entry.items() if k != "sha256"}))
    for part in sorted(bits):
        b = np.ascontiguousarray(bits[part])
        h.update(_canonical([part, b.dtype.str, list(b.shape)]))
        h.update(memoryview(b.reshape(-1).view(np.uint8)))
    return h.hexdigest()


def _meta_digest(meta: dict) -> str:
    return hashlib.sha256(_canonical({k: v for k, v in meta.items() if k != "sha256"})).hexdigest()


# ---------------------------------------------------------------------------------------------
# Bits in, bits out


def _dtype(name: str) -> np.dtype:
    try:
        return np.dtype(getattr(ml_dtypes, name)) if hasattr(ml_dtypes, name) else np.dtype(name)
    except TypeError:
        raise ParamsFileError(f"unknown dtype {name!r} in the file") from None


def _to_bits(x) -> tuple[np.ndarray, dict]:
    """An array as raw bits of the same width (FP4: two elements per byte) and how to undo it."""
    x = np.asarray(x)
    info = {"dtype": x.dtype.name, "shape": list(x.shape)}
    if x.dtype == np.dtype(ml_dtypes.float4_e2m1fn):
        codes = x.view(np.uint8) & 0xF
        if x.shape[-1] % 2:
            raise ValueError(f"cannot pack fp4 with an odd last axis {x.shape}")
        info["encoding"] = "fp4_packed"
        return codes[..., 0::2] | (codes[..., 1::2] << 4), info
    if x.dtype.itemsize not in _UINT:
        raise TypeError(f"cannot store dtype {x.dtype}")
    info["encoding"] = "bits"
    return x.view(_UINT[x.dtype.itemsize]), info


def _from_bits(bits: np.ndarray, info: dict, where: str) -> np.ndarray:
    dtype = _dtype(info["dtype"])
    shape = tuple(info["shape"])
    if info.get("encoding") == "fp4_packed":
        want = shape[:-1] + (shape[-1] // 2,) if shape else None
        if bits.dtype != np.uint8 or bits.shape != want:
            raise ParamsFileError(f"{where}: packed fp4 bits have {bits.dtype}{list(bits.shape)}, "
                                  f"the metadata says uint8{list(want or ())}")
        codes = np.stack([bits & 0xF, bits >> 4], axis=-1).reshape(shape)
        return codes.view(dtype)
    if info.get("encoding") != "bits" or bits.dtype != _UINT.get(dtype.itemsize):
        raise ParamsFileError(f"{where}: stored as {bits.dtype}, which cannot hold "
                              f"{dtype.name} bits ({info.get('encoding')!r} encoding)")
    if bits.shape != shape:
        raise ParamsFileError(f"{where}: array has shape {bits.shape}, the metadata says {shape}")
    return bits.view(dtype)


# ---------------------------------------------------------------------------------------------
# Save


def _flatten(tree, prefix=()):
    """(path, leaf) pairs of a nested dict; BlockScaled and arrays are leaves."""
    if isinstance(tree, dict):
        for key, value in tree.items():
            if not isinstance(key, (str, int)):
                raise TypeError(f"save_params stores dicts with str or int keys; "
                                f"{'/'.join(map(str, prefix + (key,)))!r} has a {type(key)}")
            yield from _flatten(value, prefix + (key,))
    elif tree is None:
        return
    elif isinstance(tree, BlockScaled) or hasattr(tree, "shape"):
        yield prefix, tree
    else:
        raise TypeError(f"save_params takes nested dicts of BlockScaled and arrays (Linen params, "
                        f"nnx.to_pure_dict(state)); found a {type(tree).__name__} at "
                        f"{'/'.join(map(str, prefix))!r}")


def _pure_dict(tree):
    """An nnx.State (from flax, if the caller uses it) as nested dicts."""
    if hasattr(tree, "to_pure_dict"):
        from flax import nnx
        return nnx.to_pure_dict(tree)
    return tree


def _describe(q: BlockScaled) -> dict:
    return {"kind": "blockscaled", "fmt": q.fmt, "layout": q.layout, "shape": list(q.shape),
            "has_global_scale": q.global_scale is not None}


def save_params(path: str | os.PathLike, params) -> None:
    """Write `params` (nested dicts of BlockScaled and plain arrays) to one ``.npz`` file."""
    params = _pure_dict(params)
    arrays: dict[str, np.ndarray] = {}
    entries = []
    for i, (keys, leaf) in enumerate(_flatten(params)):
        entry: dict[str, Any] = {"path": list(keys)}
        if isinstance(leaf, BlockScaled):
            entry.update(_describe(leaf))
            parts = {"data": leaf.data, "scales": leaf.scales}
            if leaf.global_scale is not None:
                parts["global_scale"] = leaf.global_scale
        else:
            entry["kind"] = "array"
            parts = {"value": leaf}
        entry["arrays"] = {}
        stored = {}
        for part, value in parts.items():
            bits, info = _to_bits(jax.device_get(value))
            name = f"{i}.{part}"
            arrays[name] = stored[part] = bits
            entry["arrays"][part] = dict(info, name=name)
        entry["sha256"] = _entry_digest(entry, stored)
        entries.append(entry)
    meta = {"version": FILE_VERSION, "library": "jax_blockscale", "entries": entries}
    meta["sha256"] = _meta_digest(meta)
    arrays[_META] = np.frombuffer(json.dumps(meta).encode(), np.uint8)
    with open(path, "wb") as f:  # an open file: np.savez would append ".npz" to a bare name
        np.savez(f, **arrays)


# ---------------------------------------------------------------------------------------------
# Load


def _check_blockscaled(where: str, entry: dict, data, scales, gs) -> None:
    """The file's own consistency: the arrays are what the format and layout say."""
    fmt = get_format(entry["fmt"])
    if entry["layout"] not in _layout.LAYOUTS:
        raise ParamsFileError(f"{where}: unknown scale layout {entry['layout']!r}")
    if list(data.shape) != entry["shape"]:
        raise ParamsFileError(f"{where}: data has shape {data.shape}, metadata says "
                              f"{tuple(entry['shape'])}")
    if data.dtype != fmt.storage_dtype:
        raise ParamsFileError(f"{where}: {fmt.name} stores {fmt.storage_dtype.name} elements, "
                              f"the file holds {data.dtype.name}")
    if fmt.is_code_stored and data.size and int(data.max()) >= 64:
        raise ParamsFileError(f"{where}: FP6 codes must be below 64, found {int(data.max())}")
    if scales.dtype != fmt.scale_dtype:
        raise ParamsFileError(f"{where}: {fmt.name} uses {fmt.scale_dtype.name} scales, the file "
                              f"holds {scales.dtype.name}")
    *batch, mn, k = data.shape
    if k % fmt.block:
        raise ParamsFileError(f"{where}: K={k} is not a multiple of the {fmt.name} block "
                              f"{fmt.block}")
    sk = k // fmt.block
    want = tuple(batch) + ((mn, sk) if entry["layout"] == "plain"
                           else _layout.blocked_shape(mn, sk))
    if scales.shape != want:
        raise ParamsFileError(f"{where}: {entry['layout']} scales have shape {scales.shape}, "
                              f"expected {want} for {fmt.name} elements of shape {data.shape}")
    if gs is not None and not fmt.has_global_scale:
        raise ParamsFileError(f"{where}: {fmt.name} has no global scale, the file holds one")
    if gs is not None and (gs.shape not in ((), tuple(batch)) or gs.dtype != np.float32):
        raise ParamsFileError(f"{where}: the global scale must be f32, a scalar or one per "
                              f"matrix {list(batch)}; got {gs.dtype}{list(gs.shape)}")


def _unflatten(items):
    tree: dict = {}
    for keys, value in items:
        node = tree
        for key in keys[:-1]:
            node = node.setdefault(key, {})
        node[keys[-1]] = value
    return tree


_ENTRY_FIELDS = {"array": ("path", "kind", "arrays"),
                 "blockscaled": ("path", "kind", "arrays", "fmt", "layout", "shape",
                                 "has_global_scale")}
_INFO_FIELDS = ("name", "dtype", "shape", "encoding")


def _entry_where(entry, i: int) -> str:
    """The entry's path ("fc/kernel") for messages, or its position if the path is unusable."""
    path = entry.get("path") if isinstance(entry, dict) else None
    if (isinstance(path, list) and path
            and all(isinstance(k, (str, int)) and not isinstance(k, bool) for k in path)):
        return "/".join(map(str, path))
    return f"entry {i}"


def _check_entry_fields(entry, where: str) -> None:
    """The metadata of one entry has the fields and types a reader needs."""
    if not isinstance(entry, dict):
        raise CorruptFileError(f"{where}: the metadata entry is not a JSON object")
    kind = entry.get("kind")
    if kind not in _ENTRY_FIELDS:
        raise CorruptFileError(f"{where}: unknown entry kind {kind!r}")
    missing = [k for k in _ENTRY_FIELDS[kind] if k not in entry]
    if missing:
        raise CorruptFileError(f"{where}: the metadata lacks {', '.join(missing)}")
    if where.startswith("entry "):
        raise CorruptFileError(f"{where}: the metadata has no usable path ({entry['path']!r})")
    arrays = entry["arrays"]
    if not isinstance(arrays, dict):
        raise CorruptFileError(f"{where}: the metadata's 'arrays' is not an object")
    for part, info in arrays.items():
        if not isinstance(info, dict) or any(k not in info for k in _INFO_FIELDS):
            raise CorruptFileError(f"{where} ({part}): the metadata lacks one of {_INFO_FIELDS}")
        shape = info["shape"]
        if (not isinstance(info["name"], str) or not isinstance(info["dtype"], str)
                or not isinstance(shape, list)
                or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0
                           for n in shape)):
            raise CorruptFileError(f"{where} ({part}): malformed array metadata {info!r}")


def _read_entry(z, entry: dict, where: str, fmt: str | None, verify: bool):
    """One leaf of the file as NumPy arrays (a BlockScaled of them), checked as it is read."""
    bits = {}
    for name, info in entry["arrays"].items():
        if info["name"] not in z.files:
            raise CorruptFileError(f"{where} ({name}): array {info['name']!r} missing from the "
                                   "file")
        try:
            bits[name] = z[info["name"]]
        except Exception as e:  # a damaged zip member or .npy header: BadZipFile, ValueError...
            raise CorruptFileError(f"{where} ({name}): cannot read array {info['name']!r} "
                                   f"({type(e).__name__}: {e})") from None
    if verify and "sha256" in entry and _entry_digest(entry, bits) != entry["sha256"]:
        raise CorruptFileError(f"{where}: its metadata or bits do not match the SHA-256 digest "
                               "stored with them (the file was damaged or edited)")

    def part(name):
        info = entry["arrays"].get(name)
        return None if info is None else _from_bits(bits[name], info, f"{where} ({name})")

    if entry["kind"] == "array":
        value = part("value")
        if value is None:
            raise ParamsFileError(f"{where}: value missing from the file")
        return value
    try:
        get_format(entry["fmt"])
    except ValueError as e:
        raise ParamsFileError(f"{where}: {e}") from None
    data, scales, gs = part("data"), part("scales"), part("global_scale")
    if data is None or scales is None:
        raise ParamsFileError(f"{where}: data or scales missing from the file")
    if entry["has_global_scale"] != (gs is not None):
        raise ParamsFileError(f"{where}: global scale presence does not match the metadata")
    _check_blockscaled(where, entry, data, scales, gs)
    if fmt is not None and entry["fmt"] != fmt:
        raise ParamsFileError(f"{where}: the file holds {entry['fmt']} weights, expected {fmt}")
    return BlockScaled(data, scales, gs, entry["fmt"], entry["layout"])


# ---------------------------------------------------------------------------------------------
# Comparing what a tree holds with what is expected (load_params(like=), check_description)


def _signature(leaf) -> list:
    """What is compared: format, layout, shapes, dtypes (never values). JSON-able."""
    if isinstance(leaf, BlockScaled):
        return ["BlockScaled", leaf.fmt, leaf.layout, list(leaf.data.shape),
                np.dtype(leaf.data.dtype).name, list(leaf.scales.shape),
                leaf.global_scale is not None]
    return ["array", list(leaf.shape), np.dtype(leaf.dtype).name]


def _describe_signature(sig) -> str:
    if sig[0] == "BlockScaled":
        return (f"BlockScaled {sig[1]} {sig[2]} {tuple(sig[3])}" +
                (" with global scale" if sig[6] else ""))
    return f"array {sig[2]}{list(sig[1])}"


def describe_params(params) -> dict:
    """A JSON-able description of every leaf: "path/to/leaf" -> format, layout, shapes, dtypes."""
    return {"/".join(map(str, keys)): _signature(leaf)
            for keys, leaf in _flatten(_pure_dict(params))}


def _compare(got: dict, want: dict, *, holder: str, holds: str, wanted: str, title: str):
    """Raise ParamsFileError listing every leaf where `got` and `want` (describe_params) differ."""
    problems = []
    for name in sorted(set(got) | set(want)):
        if name not in got:
            problems.append(f"{name}: missing from the {holder}")
        elif name not in want:
            problems.append(f"{name}: in the {holder} but not {wanted}")
        elif got[name] != want[name]:
            problems.append(f"{name}: the {holder} {holds} {_describe_signature(got[name])}, "
                            f"{wanted} {_describe_signature(want[name])}")
    if problems:
        more = f"\n  (and {len(problems) - 8} more)" if len(problems) > 8 else ""
        raise ParamsFileError(f"{title}:\n  " + "\n  ".join(problems[:8]) + more)


def check_description(params, description: dict) -> None:
    """Raise `ParamsFileError` unless `params` matches a `describe_params` result (e.g. one
    saved as JSON beside an Orbax checkpoint, checked after restoring it)."""
    want = json.loads(json.dumps(description))  # tuples -> lists, as a JSON file gives them
    _compare(describe_params(params), want, holder="params", holds="hold",
             wanted="the description says",
             title="the params do not match their description")


# ---------------------------------------------------------------------------------------------
# Load


def _read_meta(z, name: str) -> dict:
    if _META not in z.files:
        raise ParamsFileError(f"{name} is not a jax_blockscale params file (no metadata entry); "
                              "write it with save_params")
    try:
        raw = z[_META]
    except Exception as e:
        raise CorruptFileError(f"{name}: cannot read the metadata ({type(e).__name__}: "
                               f"{e})") from None
    try:
        meta = json.loads(raw.tobytes().decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise CorruptFileError(f"{name}: the metadata is not UTF-8 JSON ({e})") from None
    if not isinstance(meta, dict):
        raise CorruptFileError(f"{name}: the metadata is not a JSON object")
    if meta.get("version") not in _READS:
        raise ParamsFileError(f"{name} has file version {meta.get('version')!r}; this "
                              f"jax_blockscale reads versions {list(_READS)}")
    if not isinstance(meta.get("entries"), list):
        raise CorruptFileError(f"{name}: the metadata has no list of entries")
    if meta["version"] >= 2 and not (isinstance(meta.get("sha256"), str) and all(
            isinstance(e, dict) and isinstance(e.get("sha256"), str) for e in meta["entries"])):
        raise CorruptFileError(f"{name}: a version {meta['version']} file carries SHA-256 "
                               "digests, and some are missing")
    return meta


def _unflatten_checked(items, name: str):
    try:
        return _unflatten(items)
    except (AttributeError, TypeError):
        raise CorruptFileError(f"{name}: entry paths overlap (a leaf is also a "
                               "directory)") from None


def load_params(path: str | os.PathLike, *, fmt: str | None = None, like=None,
                as_numpy: bool = False, verify: bool = True):
    """Read a file written by `save_params`; returns the same nested dicts of jax arrays
    (NumPy arrays with ``as_numpy=True``).

    Every quantized entry is checked against its own metadata (format, layout, element and
    scale dtypes and shapes), and (``verify=True``) every entry against its SHA-256 digest.
    Then, optionally:
      fmt:  every quantized entry must be in this format;
      like: a pytree with the expected structure, formats, layouts, shapes and dtypes: e.g. the
            params you quantized, or, from a model skeleton that holds no weights,
            ``jax.eval_shape(lambda p: quantize_params(p, fmt), nnx.state(skeleton, nnx.Param))``.
    A mismatch raises `ParamsFileError` (a ValueError) naming the entry and both sides; a
    damaged file (truncated, unreadable, bits or metadata edited) raises its subclass
    `CorruptFileError`, naming the entry where there is one.
    """
    if fmt is not None:
        get_format(fmt)
    name = repr(os.fspath(path))
    try:
        z = np.load(path, allow_pickle=False)
    except OSError as e:
        if isinstance(e, (FileNotFoundError, IsADirectoryError, PermissionError)):
            raise
        raise CorruptFileError(f"{name} is not a readable params file ({e})") from None
    except Exception as e:  # empty (EOFError), truncated or damaged zip (BadZipFile, ValueError)
        raise CorruptFileError(f"{name} is not a readable params file ({type(e).__name__}: "
                               f"{e})") from None
    if not isinstance(z, np.lib.npyio.NpzFile):
        raise ParamsFileError(f"{name} is a single .npy array, not a jax_blockscale params file")
    with z:
        meta = _read_meta(z, name)
        items = []
        for i, entry in enumerate(meta["entries"]):
            where = _entry_where(entry, i)
            _check_entry_fields(entry, where)
            try:
                leaf = _read_entry(z, entry, where, fmt, verify)
            except ParamsFileError:
                raise
            except Exception as e:  # anything else a damaged entry can provoke
                raise CorruptFileError(f"{where}: unreadable ({type(e).__name__}: {e})") from None
            items.append((tuple(entry["path"]), leaf))
        if verify and "sha256" in meta and _meta_digest(meta) != meta["sha256"]:
            raise CorruptFileError(f"{name}: the metadata does not match its SHA-256 digest "
                                   "(entries were removed, reordered or edited)")
        loaded = _unflatten_checked(items, name)
    if like is not None:
        _compare(describe_params(loaded), describe_params(like), holder="file", holds="holds",
                 wanted="expected", title="the params file does not match what was expected")
    return loaded if as_numpy else jax.tree.map(jnp.asarray, loaded)
