"""Find and load the native library (libjax_blockscale.so) and register its XLA FFI targets.

The library is a plain shared object (no Python extension): the AOT-compiled kernels, their
host launchers and the typed XLA FFI handlers. It is loaded with ctypes, so it works with any
Python version and needs no CUDA DSL at run time.

Search order: the file named by ``JAX_BLOCKSCALE_LIBRARY`` (jax_blockscale.config), then the
package directory.
A missing or unloadable library is not an error: the GPU backends report themselves
unavailable and gemm runs on the reference backend, after one warning that says why.
"""
from __future__ import annotations

import ctypes
import functools
import json
import os
import threading
import warnings

from . import config as _config

LIB_NAME = "libjax_blockscale.so"
SM90_TARGET = "jax_blockscale_gemm_sm90"
SM100_TARGET = "jax_blockscale_gemm_sm100"  # Blackwell (ffi/jbs_ffi_sm100.cc), same library
RAGGED_SM100_TARGET = "jax_blockscale_ragged_gemm_sm100"  # ragged_gemm's grouped sm100 kernel
# cuBLASLt GEMM with alpha in its epilogue (ffi/jbs_dot_alpha.cc): the sm90 large-M path with a
# global scale
DOT_ALPHA_TARGET = "jax_blockscale_dot_alpha"
RAGGED_SM90_TARGET = "jax_blockscale_ragged_gemm_sm90"  # ragged_gemm's grouped sm90 kernels
LAYER_SM90_TARGET = "jax_blockscale_layer_gemm_sm90"  # gemm(..., layer=i): one layer of a stack
# gemm(x, w, quantize_a="nvfp4"): the activation quantized in the GEMM's call
QUANTIZED_ACT_SM90_TARGET = "jax_blockscale_quantized_act_gemm_sm90"
# jbs.quantize(x, "nvfp4") of a bf16 activation by the same quantizer kernels
QUANTIZE_NVFP4_SM90_TARGET = "jax_blockscale_quantize_nvfp4_sm90"

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_error: str | None = None  # why the library is unavailable (None: not tried yet or loaded)
_tried = False
_registered = False


def library_path() -> str:
    return _config.get().library or os.path.join(os.path.dirname(__file__), LIB_NAME)


def _declare(lib: ctypes.CDLL) -> None:
    c = ctypes
    lib.jbs_num_variants.restype = c.c_int
    lib.jbs_variant_info.argtypes = [c.c_int, c.POINTER(c.c_char_p), c.POINTER(c.c_int)]
    lib.jbs_variant_info.restype = c.c_int
    lib.jbs_sm90_check_problem.argtypes = [c.POINTER(c.c_int), c.POINTER(c.c_longlong),
                                           c.POINTER(c.c_ulonglong), c.c_char_p, c.c_int]
    lib.jbs_sm90_check_problem.restype = c.c_int
    if hasattr(lib, "jbs_layer_at"):  # libraries built before the layer target lack it
        lib.jbs_layer_at.argtypes = [c.c_ulonglong, c.c_ulonglong, c.c_ulonglong, c.c_longlong]
        lib.jbs_layer_at.restype = c.c_longlong
    if hasattr(lib, "jbs_quantized_activation_scratch"):
        lib.jbs_quantized_activation_scratch.argtypes = [c.c_longlong, c.c_longlong,
                                                         c.POINTER(c.c_longlong)]
        lib.jbs_quantized_activation_scratch.restype = None
    _declare_sm100(lib)


def _declare_sm100(lib: ctypes.CDLL) -> None:
    """The Blackwell entry points; a library built without them just has no sm100 target."""
    c = ctypes
    try:
        lib.jbs_sm100_num_variants.restype = c.c_int
    except AttributeError:
        return
    lib.jbs_sm100_variant_info.argtypes = [c.c_int, c.POINTER(c.c_char_p), c.POINTER(c.c_int)]
    lib.jbs_sm100_variant_info.restype = c.c_int
    lib.jbs_sm100_check_problem.argtypes = [c.POINTER(c.c_int), c.POINTER(c.c_longlong),
                                            c.POINTER(c.c_ulonglong), c.c_char_p, c.c_int]
    lib.jbs_sm100_check_problem.restype = c.c_int


def load() -> ctypes.CDLL | None:
    """The loaded library, or None (then `unavailable_reason()` says why; warned once)."""
    global _lib, _error, _tried
    with _lock:
        if _tried:
            return _lib
        _tried = True
        if _config.get().no_plugin:
            _error = "JAX_BLOCKSCALE_NO_PLUGIN is set"
            return None
        path = library_path()
        if not os.path.exists(path):
            _error = (f"native library not found at {path} (built without it? set "
                      "JAX_BLOCKSCALE_LIBRARY to its path)")
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
            if has_ragged_sm90(lib):
                jax.ffi.register_ffi_target(RAGGED_SM90_TARGET, {
                    "instantiate": jax.ffi.pycapsule(lib.jax_blockscale_gemm_sm90_instantiate),
                    "execute": jax.ffi.pycapsule(lib.jax_blockscale_ragged_gemm_sm90),
                }, platform="CUDA")
            if has_layer_gemm(lib):
                jax.ffi.register_ffi_target(LAYER_SM90_TARGET, {
                    "instantiate": jax.ffi.pycapsule(lib.jax_blockscale_gemm_sm90_instantiate),
                    "execute": jax.ffi.pycapsule(lib.jax_blockscale_layer_gemm_sm90),
                }, platform="CUDA")
            if has_quantized_act_gemm(lib):
                jax.ffi.register_ffi_target(QUANTIZED_ACT_SM90_TARGET, {
                    "instantiate": jax.ffi.pycapsule(lib.jax_blockscale_gemm_sm90_instantiate),
                    "execute": jax.ffi.pycapsule(lib.jax_blockscale_quantized_act_gemm_sm90),
                }, platform="CUDA")
            if has_quantize_nvfp4(lib):
                jax.ffi.register_ffi_target(QUANTIZE_NVFP4_SM90_TARGET, {
                    "instantiate": jax.ffi.pycapsule(
                        lib.jax_blockscale_quantize_nvfp4_sm90_instantiate),
                    "execute": jax.ffi.pycapsule(lib.jax_blockscale_quantize_nvfp4_sm90),
                }, platform="CUDA")
            if has_sm100(lib):
                jax.ffi.register_ffi_target(SM100_TARGET, {
                    "instantiate": jax.ffi.pycapsule(lib.jax_blockscale_gemm_sm100_instantiate),
                    "execute": jax.ffi.pycapsule(lib.jax_blockscale_gemm_sm100),
                }, platform="CUDA")
            if has_ragged_sm100(lib):
                jax.ffi.register_ffi_target(RAGGED_SM100_TARGET, {
                    "instantiate": jax.ffi.pycapsule(lib.jax_blockscale_gemm_sm100_instantiate),
                    "execute": jax.ffi.pycapsule(lib.jax_blockscale_ragged_gemm_sm100),
                }, platform="CUDA")
            if has_dot_alpha(lib):
                jax.ffi.register_ffi_target(DOT_ALPHA_TARGET, {
                    "instantiate": jax.ffi.pycapsule(lib.jax_blockscale_dot_alpha_instantiate),
                    "execute": jax.ffi.pycapsule(lib.jax_blockscale_dot_alpha),
                }, platform="CUDA")
            _registered = True
    return True


_SM90_FIELDS = ("a_kind", "b_kind", "out", "tile_m", "tile_n", "sm", "nt", "k_chunk", "grouped",
                "chained")


def variants() -> list[dict]:
    """The compiled sm90 variant table, read from the library itself."""
    lib = load()
    if lib is None:
        return []
    out = []
    for i in range(lib.jbs_num_variants()):
        name = ctypes.c_char_p()
        vals = (ctypes.c_int * len(_SM90_FIELDS))()
        if lib.jbs_variant_info(i, ctypes.byref(name), vals):
            continue
        out.append(dict(name=name.value.decode(), **dict(zip(_SM90_FIELDS, vals))))
    return out


@functools.lru_cache(maxsize=None)
def variant_names() -> frozenset:
    """Names of every compiled variant (sm90 and sm100 tables; sm100 without the arch prefix)."""
    sm100 = {v["name"].split("_", 2)[2] for v in sm100_variants()}  # jbs_<arch>_<name>
    return frozenset({v["name"] for v in variants()} | sm100)


def _manifest_next_to_library(name: str) -> dict | None:
    path = os.path.join(os.path.dirname(library_path()), name)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def manifest() -> dict | None:
    """The build's variant manifest (sm90_variants.json next to the library), if installed."""
    return _manifest_next_to_library("sm90_variants.json")


_SM90_INTS = ("a_kind", "b_kind", "out", "a_e5m2", "b_e5m2", "cc_major", "cc_minor", "sm_count",
               "a_scales_plain", "nt", "tile_m", "tile_n", "splits", "grouped", "chained",
               "tiles_per_cta", "partials")
_SM90_LONGS = ("m", "n", "k", "l", "a_bytes", "b_bytes", "sa_bytes", "sb_bytes", "c_bytes",
               "alpha_bytes", "ws_bytes", "items_bytes", "num_items")
_SM90_PTRS = ("a_ptr", "b_ptr", "sa_ptr", "sb_ptr", "c_ptr", "alpha_ptr", "ws_ptr", "items_ptr")


def check_problem(**kw) -> tuple[bool, str]:
    """Run the sm90 FFI handler's pure validation (no GPU): (True, the variant's name) if the
    call is accepted, else (False, the reason). Fields: _SM90_INTS / _LONGS / _PTRS (codes from
    catalog/sm90.py); the device defaults to an H100 (9.0, 132 SMs), pointers to aligned ones."""
    lib = load()
    if lib is None:
        raise RuntimeError(unavailable_reason())
    kw = dict(dict(cc_major=9, cc_minor=0, sm_count=132, a_e5m2=0, b_e5m2=0, a_scales_plain=0,
                   nt=0, splits=0, alpha_bytes=4, ws_bytes=0, grouped=0, chained=0,
                   items_bytes=0, num_items=0, tiles_per_cta=1, partials=0), **kw)
    ptrs = [kw.get(n, 0x10000 * (i + 1)) for i, n in enumerate(_SM90_PTRS)]
    buf = ctypes.create_string_buffer(512)
    rc = lib.jbs_sm90_check_problem((ctypes.c_int * len(_SM90_INTS))(*(kw[n] for n in _SM90_INTS)),
                                    (ctypes.c_longlong * len(_SM90_LONGS))(
                                        *(kw[n] for n in _SM90_LONGS)),
                                    (ctypes.c_ulonglong * len(_SM90_PTRS))(*ptrs), buf, len(buf))
    return rc == 0, buf.value.decode()


def _has(symbol: str, lib: ctypes.CDLL | None) -> bool:
    """Whether the library (`lib`, else the one `load` finds) exports `symbol`."""
    lib = lib if lib is not None else load()
    return lib is not None and hasattr(lib, symbol)


def has_ragged_sm90(lib: ctypes.CDLL | None = None) -> bool:
    """Whether the library has ragged_gemm's sm90 target (the grouped decode and register-weight
    kernels)."""
    return _has("jax_blockscale_ragged_gemm_sm90", lib)


def has_layer_gemm(lib: ctypes.CDLL | None = None) -> bool:
    """Whether the library has the layer target (gemm(..., layer=i) finding its layer)."""
    return _has("jax_blockscale_layer_gemm_sm90", lib)


def has_quantized_act_gemm(lib: ctypes.CDLL | None = None) -> bool:
    """Whether the library has the target that quantizes the activation in the GEMM's call."""
    return _has("jax_blockscale_quantized_act_gemm_sm90", lib)


def has_quantize_nvfp4(lib: ctypes.CDLL | None = None) -> bool:
    """Whether the library has jbs.quantize's NVFP4 target (the quantizer kernels alone)."""
    return _has("jax_blockscale_quantize_nvfp4_sm90", lib)


def quantized_activation_scratch(blocks: int, block_bytes: int = 8) -> tuple[int, int, int, int]:
    """The library's scratch layout for an activation of `blocks` NVFP4 blocks, `block_bytes`
    of elements each (8 packed, 32 as bf16 values): (offset of the scales, offset of the partial
    amaxes, offset of alpha, bytes in all) (tests compare it with the lowering's)."""
    out = (ctypes.c_longlong * 4)()
    load().jbs_quantized_activation_scratch(blocks, block_bytes, out)
    return int(out[0]), int(out[1]), int(out[2]), int(out[3])


def layer_gemm_counts() -> tuple[int, int]:
    """(calls that found their layer in place, calls that did not: index mode, or slice mode
    with its alpha gathered on the device) of the layer target in this process, counted each
    time its handler runs (tests read it)."""
    lib = load()
    if lib is None or not hasattr(lib, "jbs_layer_gemm_counts"):
        return (0, 0)
    out = (ctypes.c_longlong * 2)()
    lib.jbs_layer_gemm_counts(out)
    return int(out[0]), int(out[1])


def layer_at(at: int, base: int, nbytes: int, layers: int) -> int:
    """The layer target's reading of a probe's address: the layer of a stack of `layers` at
    [base, base + nbytes) that a slice starting at `at` begins, or -1 (tests; no GPU needed)."""
    return int(load().jbs_layer_at(at, base, nbytes, layers))


def has_dot_alpha(lib: ctypes.CDLL | None = None) -> bool:
    """Whether the library has the dot_alpha target (libraries built before it do not)."""
    return _has("jax_blockscale_dot_alpha", lib)


# ---- Blackwell (sm100) part of the library ----

def has_ragged_sm100(lib: ctypes.CDLL | None = None) -> bool:
    """Whether the library has ragged_gemm's grouped Blackwell kernels and their FFI target."""
    return _has("jax_blockscale_ragged_gemm_sm100", lib)


def has_sm100(lib: ctypes.CDLL | None = None) -> bool:
    """Whether the library was built with the Blackwell kernels and their FFI target."""
    return _has("jax_blockscale_gemm_sm100", lib)


def sm100_unavailable_reason() -> str | None:
    """None when the library is loaded and has the sm100 target, else why not."""
    why = unavailable_reason()
    if why is not None:
        return why
    if not has_sm100():
        return f"{library_path()} was built without the Blackwell (sm100) kernels"
    return None


_SM100_FIELDS = ("sm", "fmt_a", "fmt_b", "out", "tile_m", "tile_n", "cluster_m", "cluster_n",
                 "k_align", "n_align", "grouped")


def sm100_variants() -> list[dict]:
    """The compiled Blackwell variant table, read from the library itself."""
    lib = load()
    if not has_sm100(lib):
        return []
    out = []
    for i in range(lib.jbs_sm100_num_variants()):
        name = ctypes.c_char_p()
        vals = (ctypes.c_int * len(_SM100_FIELDS))()
        if lib.jbs_sm100_variant_info(i, ctypes.byref(name), vals):
            continue
        out.append(dict(name=name.value.decode(), **dict(zip(_SM100_FIELDS, vals))))
    return out


def sm100_manifest() -> dict | None:
    """The build's Blackwell manifest (variants_sm100.json next to the library), if installed."""
    return _manifest_next_to_library("variants_sm100.json")


def sm100_check_problem(**kw) -> tuple[bool, str]:
    """The sm100 FFI handler's pure validation (no GPU): (True, variant name or "empty") if the
    call is accepted, else (False, the reason). Codes: catalog/sm100.py FMT_CODES / OUT_CODES."""
    lib = load()
    if not has_sm100(lib):
        raise RuntimeError(sm100_unavailable_reason())
    kw = dict(dict(cc_major=10, cc_minor=0, sm_count=148, alpha_bytes=4, grouped=0,
                   table_bytes=0), **kw)
    ints = [kw[n] for n in ("fmt_a", "fmt_b", "out", "cc_major", "cc_minor", "sm_count",
                            "tile_m", "tile_n", "cluster_m", "cluster_n", "grouped")]
    longs = [kw[n] for n in ("m", "n", "k", "l", "a_bytes", "b_bytes", "sa_bytes", "sb_bytes",
                             "c_bytes", "alpha_bytes", "table_bytes")]
    ptrs = [kw.get(n, 0x10000 * (i + 1)) for i, n in enumerate(
        ("a_ptr", "b_ptr", "sa_ptr", "sb_ptr", "c_ptr", "alpha_ptr", "table_ptr"))]
    buf = ctypes.create_string_buffer(512)
    rc = lib.jbs_sm100_check_problem((ctypes.c_int * 11)(*ints), (ctypes.c_longlong * 11)(*longs),
                                     (ctypes.c_ulonglong * 7)(*ptrs), buf, len(buf))
    return rc == 0, buf.value.decode()
