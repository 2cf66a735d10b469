"""Find and load the native library (libjax_blockscale.so) and register its XLA FFI targets.

The library is a plain shared object (no Python extension): the AOT-compiled kernels, their
host launchers and the typed XLA FFI handlers. It is loaded with ctypes, so it works with any
Python version and needs no CUDA DSL at run time.

Search order: the file named by ``$JAX_BLOCKSCALE_LIBRARY``, then the package directory.
A missing or unloadable library is not an error: the GPU backends report themselves
unavailable and gemm runs on the reference backend, after one warning that says why.
"""
from __future__ import annotations

import ctypes
import json
import os
import threading
import warnings

ENV_LIBRARY = "JAX_BLOCKSCALE_LIBRARY"
ENV_NO_PLUGIN = "JAX_BLOCKSCALE_NO_PLUGIN"  # set by the AOT build: never load the library
LIB_NAME = "libjax_blockscale.so"
SM90_TARGET = "jax_blockscale_gemm_sm90"

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_error: str | None = None  # why the library is unavailable (None: not tried yet or loaded)
_tried = False
_registered = False


def library_path() -> str:
    return os.environ.get(ENV_LIBRARY) or os.path.join(os.path.dirname(__file__), LIB_NAME)


def _declare(lib: ctypes.CDLL) -> None:
    c = ctypes
    lib.jbs_num_variants.restype = c.c_int
    lib.jbs_variant_info.argtypes = [c.c_int, c.POINTER(c.c_char_p)] + [c.POINTER(c.c_int)] * 6
    lib.jbs_variant_info.restype = c.c_int
    lib.jbs_check_problem.argtypes = (
        [c.c_int] * 5 + [c.c_longlong] * 4 + [c.c_ulonglong] * 6 + [c.c_longlong] * 6
        + [c.c_int] * 3 + [c.c_char_p, c.c_int])
    lib.jbs_check_problem.restype = c.c_int


def load() -> ctypes.CDLL | None:
    """The loaded library, or None (then `unavailable_reason()` says why; warned once)."""
    global _lib, _error, _tried
    with _lock:
        if _tried:
            return _lib
        _tried = True
        if os.environ.get(ENV_NO_PLUGIN):
            _error = f"{ENV_NO_PLUGIN} is set"
            return None
        path = library_path()
        if not os.path.exists(path):
            _error = (f"native library not found at {path} (built without it? set "
                      f"{ENV_LIBRARY} to its path)")
        else:
            try:
                lib = ctypes.CDLL(path)
                _declare(lib)
                _lib = lib
            except (OSError, AttributeError) as e:
                _error = f"cannot load native library {path}: {e}"
        if _lib is None:
            warnings.warn(f"jax_blockscale: {_error}; GPU gemm falls back to the reference "
                          "backend", RuntimeWarning, stacklevel=2)
        return _lib


def unavailable_reason() -> str | None:
    """None when the library is loaded, else why not."""
    return None if load() is not None else _error


def register_targets() -> bool:
    """Register the FFI targets with XLA (once). False if the library is unavailable."""
    global _registered
    lib = load()
    if lib is None:
        return False
    with _lock:
        if not _registered:
            import jax

            handlers = {
                "instantiate": jax.ffi.pycapsule(lib.jax_blockscale_gemm_sm90_instantiate),
                "execute": jax.ffi.pycapsule(lib.jax_blockscale_gemm_sm90),
            }
            jax.ffi.register_ffi_target(SM90_TARGET, handlers, platform="CUDA")
            _registered = True
    return True


def variants() -> list[dict]:
    """The compiled variant table, read from the library itself."""
    lib = load()
    if lib is None:
        return []
    out = []
    for i in range(lib.jbs_num_variants()):
        name = ctypes.c_char_p()
        vals = [ctypes.c_int() for _ in range(6)]
        if lib.jbs_variant_info(i, ctypes.byref(name), *(ctypes.byref(v) for v in vals)):
            continue
        a, b, o, tm, tn, sm = (v.value for v in vals)
        out.append(dict(name=name.value.decode(), a_kind=a, b_kind=b, out=o, tile_m=tm,
                        tile_n=tn, sm=sm))
    return out


def manifest() -> dict | None:
    """The build's variant manifest (sm90_variants.json next to the library), if installed."""
    path = os.path.join(os.path.dirname(library_path()), "sm90_variants.json")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def check_problem(**kw) -> tuple[bool, str]:
    """Run the FFI handler's pure validation (no GPU): (True, chosen variant name) if the call
    is accepted, else (False, the reason)."""
    lib = load()
    if lib is None:
        raise RuntimeError(unavailable_reason())
    names = ["a_kind", "b_kind", "out", "a_e5m2", "b_e5m2", "m", "n", "k", "l", "a_ptr",
             "b_ptr", "sa_ptr", "sb_ptr", "c_ptr", "alpha_ptr", "a_bytes", "b_bytes",
             "sa_bytes", "sb_bytes", "c_bytes", "alpha_bytes", "cc_major", "cc_minor", "sm_count"]
    kw.setdefault("sm_count", 132)
    buf = ctypes.create_string_buffer(512)
    rc = lib.jbs_check_problem(*(kw[n] for n in names), buf, len(buf))
    return rc == 0, buf.value.decode()
