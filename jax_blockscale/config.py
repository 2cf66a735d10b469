"""The package's configuration: every `JAX_BLOCKSCALE_*` environment variable, read in one place.

`get()` reads the environment once (on first use) into a frozen `Config`; the planner, the
backends and the plugin loader read that object, never `os.environ`. `reload()` reads it again
(tests, or a program that changes a variable after the first gemm was lowered: already-compiled
functions keep the plan they were lowered with). docs/backends.md lists every variable.

Build-time variables (`JAX_BLOCKSCALE_SKIP_NATIVE`, read by the CMake build) are documented there
too but are not part of this object.
"""
from __future__ import annotations

import dataclasses
import functools
import os


def _int(name: str) -> int | None:
    v = os.environ.get(name, "").strip()
    if not v:
        return None
    try:
        return int(v)
    except ValueError:
        raise ValueError(f"{name}={v!r} must be an integer") from None


def _split_count(name: str) -> int | None:
    """A forced split-K count: an integer in [1, 255] (the kernels' limit), or None if unset."""
    v = _int(name)
    if v is not None and not 1 <= v <= 255:
        raise ValueError(f"{name}={v} must be in [1, 255]")
    return v


def _choice(name: str, choices: tuple[str, ...], default: str) -> str:
    v = os.environ.get(name, "").strip() or default
    if v not in choices:
        raise ValueError(f"{name}={v!r} must be one of {choices}")
    return v


@dataclasses.dataclass(frozen=True)
class Config:
    # JAX_BLOCKSCALE_BACKEND: force a backend ("reference", "sm90", "sm100"; "auto" or unset:
    # the fastest that can run the problem)
    backend: str | None = None
    # JAX_BLOCKSCALE_LIBRARY: path of libjax_blockscale.so (default: next to the package)
    library: str | None = None
    # JAX_BLOCKSCALE_NO_PLUGIN: never load the native library (the build sets it while compiling)
    no_plugin: bool = False
    # JAX_BLOCKSCALE_SM90_MAX_ROWS: rows up to which the sm90 kernels run before dequantize + a
    # bf16 GEMM takes over (None: the catalogue's measured limits; 0: always the kernels)
    sm90_max_rows: int | None = None
    # JAX_BLOCKSCALE_SM90_DECODE_MAX_ROWS: rows up to which the decode kernel may run (None: the
    # catalogue's 64; 0: never)
    sm90_decode_max_rows: int | None = None
    # JAX_BLOCKSCALE_SM90_DEQUANT_A: "1" dequantize a quantized activation first where that wins
    # (the catalogue's rule), "0" never (the two-operand kernels), "all" also in the decode rows
    sm90_dequant_a: str = "1"
    # JAX_BLOCKSCALE_SM90_REGISTER_WEIGHTS=0: never the register-weight variants
    sm90_register_weights: bool = True
    # JAX_BLOCKSCALE_SM90_DOT_ALPHA=0: past the kernels' rows, XLA's dot and an f32 scaling pass
    # instead of the cuBLASLt GEMM with alpha in its epilogue
    sm90_dot_alpha: bool = True
    # JAX_BLOCKSCALE_SM90_TILE_N: force the fused kernel's tile N (64, 128, 256; tuning aid)
    sm90_tile_n: int | None = None
    # JAX_BLOCKSCALE_SM90_REGISTER_WEIGHT_SPLITS: force the dense register-weight variants'
    # split-K count (1: no split; tuning aid; None: the catalogue's choice)
    sm90_register_weight_splits: int | None = None
    # JAX_BLOCKSCALE_SM90_DECODE_SPLITS: force the dense decode kernel's split-K count (1: no
    # split; at most one K range per sub-chunk; tuning aid; None: the catalogue's choice)
    sm90_decode_splits: int | None = None
    # JAX_BLOCKSCALE_SM90_RAGGED_KERNEL: ragged_gemm's sm90 kernel ("decode": the grouped decode
    # kernel, "prefill": the grouped register-weight kernel where it can run; "auto" or unset:
    # the catalogue's choice by rows per expert; tuning and testing aid)
    sm90_ragged_kernel: str = "auto"
    # JAX_BLOCKSCALE_SM90_RAGGED_TILE_M: force the grouped register-weight kernel's rows per item
    # (32, 64, 128 or 256; tuning aid)
    sm90_ragged_tile_m: int | None = None
    # JAX_BLOCKSCALE_SM100_TILE: force one Blackwell variant ("128x64", "256x128c2x1"; tuning aid)
    sm100_tile: str | None = None
    # JAX_BLOCKSCALE_DOT_ALPHA_CANDIDATES: cuBLASLt algorithms the dot_alpha GEMM times on its
    # first call of a shape (1: the heuristic's first choice, untimed)
    dot_alpha_candidates: int = 8


def _read() -> Config:
    backend = os.environ.get("JAX_BLOCKSCALE_BACKEND", "").strip() or None
    tile_n = _int("JAX_BLOCKSCALE_SM90_TILE_N")
    if tile_n is not None and tile_n not in (64, 128, 256):
        raise ValueError(f"JAX_BLOCKSCALE_SM90_TILE_N={tile_n} must be 64, 128 or 256")
    ragged_tile_m = _int("JAX_BLOCKSCALE_SM90_RAGGED_TILE_M")
    if ragged_tile_m is not None and ragged_tile_m not in (32, 64, 128, 256):
        raise ValueError(f"JAX_BLOCKSCALE_SM90_RAGGED_TILE_M={ragged_tile_m} must be 32, 64, 128 "
                         "or 256")
    candidates = _int("JAX_BLOCKSCALE_DOT_ALPHA_CANDIDATES")
    return Config(
        backend=None if backend == "auto" else backend,
        library=os.environ.get("JAX_BLOCKSCALE_LIBRARY") or None,
        no_plugin=bool(os.environ.get("JAX_BLOCKSCALE_NO_PLUGIN")),
        sm90_max_rows=_int("JAX_BLOCKSCALE_SM90_MAX_ROWS"),
        sm90_decode_max_rows=_int("JAX_BLOCKSCALE_SM90_DECODE_MAX_ROWS"),
        sm90_dequant_a=_choice("JAX_BLOCKSCALE_SM90_DEQUANT_A", ("1", "0", "all"), "1"),
        sm90_register_weights=os.environ.get("JAX_BLOCKSCALE_SM90_REGISTER_WEIGHTS") != "0",
        sm90_dot_alpha=os.environ.get("JAX_BLOCKSCALE_SM90_DOT_ALPHA") != "0",
        sm90_tile_n=tile_n,
        sm90_register_weight_splits=_split_count("JAX_BLOCKSCALE_SM90_REGISTER_WEIGHT_SPLITS"),
        sm90_decode_splits=_split_count("JAX_BLOCKSCALE_SM90_DECODE_SPLITS"),
        sm90_ragged_kernel=_choice("JAX_BLOCKSCALE_SM90_RAGGED_KERNEL",
                                   ("auto", "decode", "prefill"), "auto"),
        sm90_ragged_tile_m=ragged_tile_m,
        sm100_tile=os.environ.get("JAX_BLOCKSCALE_SM100_TILE", "").strip() or None,
        dot_alpha_candidates=max(1, min(32, candidates if candidates is not None else 8)),
    )


@functools.cache
def get() -> Config:
    """The configuration, read from the environment on first use."""
    return _read()


def reload() -> Config:
    """Read the environment again (already-lowered functions keep their plans)."""
    get.cache_clear()
    return get()
