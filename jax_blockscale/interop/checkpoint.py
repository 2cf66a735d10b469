"""Read tensors, one at a time and bit for bit, from ``.safetensors`` checkpoints.

    ckpt = SafetensorsCheckpoint("path/to/model")   # a directory, one file, or an index JSON
    w = ckpt.read("model.layers.0.mlp.down_proj.weight", dtype="U8", shape=(4096, 7168))

A directory is read through its ``model.safetensors.index.json`` (the Hugging Face sharded
layout: ``{"weight_map": {tensor name: file name}}``) when it has one, else every
``*.safetensors`` file in it. Files are opened with the ``safetensors`` package (install
``jax_blockscale[checkpoints]``), which checks each header and that the file is as long as the
header says (a truncated download fails here, naming the file). Tensors come back as NumPy
arrays backed by the memory-mapped file: nothing is read until it is used, and nothing is ever
converted to a wider dtype.

safetensors' NumPy API returns the dtypes NumPy knows (U8, F32, BF16, ...); for the 8-bit float
dtypes it has no NumPy type for (F8_E4M3, F8_E5M2, F8_E8M0) the same bytes are read from the
file at the offsets its header gives, as ml_dtypes arrays.
"""
from __future__ import annotations

import difflib
import json
import os
import struct
from pathlib import Path

import ml_dtypes
import numpy as np

from .errors import CheckpointError

__all__ = ["INDEX_NAME", "SafetensorsCheckpoint"]

INDEX_NAME = "model.safetensors.index.json"

# safetensors dtype codes read through the file's own offsets (safetensors' NumPy API has no
# type for them), and the NumPy dtype of every code this reader returns.
_RAW_DTYPES = {
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "F8_E8M0": np.dtype(ml_dtypes.float8_e8m0fnu),
}
_NUMPY_DTYPES = {
    "BOOL": np.dtype(bool), "U8": np.dtype(np.uint8), "I8": np.dtype(np.int8),
    "U16": np.dtype(np.uint16), "I16": np.dtype(np.int16), "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16), "U32": np.dtype(np.uint32),
    "I32": np.dtype(np.int32), "F32": np.dtype(np.float32), "U64": np.dtype(np.uint64),
    "I64": np.dtype(np.int64), "F64": np.dtype(np.float64),
}
DTYPES = {**_NUMPY_DTYPES, **_RAW_DTYPES}


def _safetensors():
    try:
        import safetensors
    except ImportError:
        raise ImportError("reading .safetensors checkpoints needs the safetensors package: "
                          "pip install 'jax_blockscale[checkpoints]' (or pip install "
                          "safetensors)") from None
    return safetensors


def _read_header(path: Path) -> tuple[int, dict]:
    """(offset of the data section, header dict) of a safetensors file (u64 little-endian header
    length, then the JSON header, then the data). Only called on files safetensors has opened
    and checked."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return 8 + n, json.loads(f.read(n))


class SafetensorsCheckpoint:
    """A checkpoint of one or more ``.safetensors`` files, read tensor by tensor.

    path: a ``.safetensors`` file, a ``*.index.json`` file, or a directory (its
    ``model.safetensors.index.json`` if present, else all its ``*.safetensors`` files).
    Use as a context manager (or call `close`) to release the open files.
    """

    def __init__(self, path: str | os.PathLike):
        path = Path(path)
        self.path = path
        self._handles: dict[Path, object] = {}
        self._headers: dict[Path, tuple[int, dict]] = {}
        if path.is_dir():
            index = path / INDEX_NAME
            if index.exists():
                self._where = self._from_index(index)
            else:
                files = sorted(path.glob("*.safetensors"))
                if not files:
                    raise CheckpointError(f"{str(path)!r} has no *.safetensors files and no "
                                          f"{INDEX_NAME}")
                self._where = self._from_files(files)
        elif path.name.endswith(".json"):
            self._where = self._from_index(path)
        elif path.exists():
            self._where = self._from_files([path])
        else:
            raise CheckpointError(f"checkpoint {str(path)!r} does not exist")

    # -- which file holds which tensor

    def _from_index(self, index: Path) -> dict[str, Path]:
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise CheckpointError(f"{str(index)!r} is not a safetensors index (a JSON object "
                                  f"with a 'weight_map'): {e}") from None
        where = {}
        for name, file in weight_map.items():
            f = index.parent / file
            if not f.exists():
                raise CheckpointError(f"{str(index)!r} puts tensor {name!r} in {file!r}, which "
                                      "does not exist (a shard missing from the download?)")
            where[name] = f
        for f in sorted(set(where.values())):
            listed = {n for n, g in where.items() if g == f}
            missing = listed - set(self._handle(f).keys())
            if missing:
                raise CheckpointError(f"{str(index)!r} lists {len(missing)} tensors in "
                                      f"{f.name!r} that it does not hold, e.g. "
                                      f"{sorted(missing)[0]!r}")
        return where

    def _from_files(self, files) -> dict[str, Path]:
        where = {}
        for f in files:
            for name in self._handle(f).keys():
                if name in where:
                    raise CheckpointError(f"tensor {name!r} is in both {where[name].name!r} and "
                                          f"{f.name!r}")
                where[name] = f
        return where

    def _handle(self, f: Path):
        if f not in self._handles:
            st = _safetensors()
            try:
                self._handles[f] = st.safe_open(str(f), framework="np")
            except Exception as e:  # SafetensorError (truncated, bad header), OSError
                raise CheckpointError(f"cannot read {str(f)!r} as safetensors (truncated or "
                                      f"corrupt?): {e}") from None
        return self._handles[f]

    # -- public

    def keys(self) -> list[str]:
        return sorted(self._where)

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def __len__(self) -> int:
        return len(self._where)

    def files(self) -> list[Path]:
        return sorted(set(self._where.values()))

    def _locate(self, name: str) -> Path:
        if name not in self._where:
            near = difflib.get_close_matches(name, list(self._where), n=3)
            hint = f"; similar names: {near}" if near else ""
            raise CheckpointError(f"tensor {name!r} is not in the checkpoint {str(self.path)!r} "
                                  f"({len(self._where)} tensors){hint}")
        return self._where[name]

    def info(self, name: str) -> tuple[str, tuple[int, ...]]:
        """(safetensors dtype code, shape) of a tensor, without reading it."""
        sl = self._handle(self._locate(name)).get_slice(name)
        return sl.get_dtype(), tuple(sl.get_shape())

    def read(self, name: str, *, dtype: str | tuple[str, ...] | None = None,
             shape: tuple | None = None) -> np.ndarray:
        """Tensor `name` as a NumPy array holding the file's bits (memory-mapped).

        dtype: the safetensors dtype code(s) it must have ("U8", "F8_E4M3", ("F32", "BF16"), ...)
        shape: the shape it must have (None entries match anything).
        A missing tensor or a wrong dtype or shape raises CheckpointError naming the tensor.
        """
        f = self._locate(name)
        code, got_shape = self.info(name)
        allowed = (dtype,) if isinstance(dtype, str) else dtype
        if allowed is not None and code not in allowed:
            want = allowed[0] if len(allowed) == 1 else " or ".join(allowed)
            raise CheckpointError(f"tensor {name!r} ({f.name}) has dtype {code}, expected {want}")
        if shape is not None and (len(shape) != len(got_shape) or any(
                w is not None and w != g for w, g in zip(shape, got_shape))):
            want = tuple("*" if w is None else w for w in shape)
            raise CheckpointError(f"tensor {name!r} ({f.name}) has shape {got_shape}, expected "
                                  f"{want}")
        if code in _RAW_DTYPES:
            return self._read_raw(f, name, _RAW_DTYPES[code])
        if code not in _NUMPY_DTYPES:
            raise CheckpointError(f"tensor {name!r} ({f.name}) has dtype {code}, which this "
                                  "reader does not handle")
        try:
            arr = self._handle(f).get_tensor(name)
        except Exception as e:
            raise CheckpointError(f"cannot read tensor {name!r} from {str(f)!r}: {e}") from None
        return np.asarray(arr).view(_NUMPY_DTYPES[code]) if arr.dtype != _NUMPY_DTYPES[code] \
            else arr

    def _read_raw(self, f: Path, name: str, dtype: np.dtype) -> np.ndarray:
        if f not in self._headers:
            self._headers[f] = _read_header(f)
        base, header = self._headers[f]
        entry = header[name]
        start, end = entry["data_offsets"]
        shape = tuple(entry["shape"])
        if end - start != int(np.prod(shape)) * dtype.itemsize:
            raise CheckpointError(f"tensor {name!r} ({f.name}): {end - start} bytes for shape "
                                  f"{shape} of {entry['dtype']}")
        if end == start:
            return np.zeros(shape, dtype)
        mm = np.memmap(f, dtype=np.uint8, mode="r", offset=base + start, shape=(end - start,))
        return mm.view(dtype).reshape(shape)

    def close(self) -> None:
        self._handles.clear()  # safe_open handles close (unmap) when released

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self) -> str:
        return (f"SafetensorsCheckpoint({str(self.path)!r}: {len(self._where)} tensors in "
                f"{len(self.files())} files)")
