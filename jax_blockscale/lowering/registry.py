"""The backend registries: which implementations of `gemm_p` and of `ragged_gemm_p` exist and on
which platforms (the problem and plan types they take are in specs.py).

A gemm backend is any object with

    name: str                       # "reference", "sm90", "sm100", ...
    platforms: tuple[str, ...]      # lowering platforms it serves: "cpu", "cuda", "rocm", "tpu"
    priority: int                   # higher wins among those that can run a problem
    plan(spec, device) -> Plan | str          # how it would run `spec`, or why it cannot
    __call__(a, b, sa, sb, alpha, *, plan) -> jax.Array   # JAX-traceable: carry the plan out

`__call__` is lowered with `mlir.lower_fun`, so a backend is written in JAX (the GPU backends call
`jax.ffi.ffi_call`). `sa` is None in weight-only mode. Which backend runs a problem is decided
once per lowering by `lowering.plan.plan` (a forced backend, or the highest-priority one that
serves the platform and accepts the problem); `reference` serves every platform and runs
everything, so there is always a choice. A ragged backend is described in ragged_reference.py;
`lowering.plan.select_ragged_backend` picks one per lowering of `ragged_gemm_local_p`.
"""
from __future__ import annotations

import logging

from .. import config

log = logging.getLogger("jax_blockscale")

ALL_PLATFORMS = ("cpu", "cuda", "rocm", "tpu")


_BACKENDS: dict[str, object] = {}
_logged: set = set()


def register_backend(backend) -> None:
    """Add (or replace) a backend; the planner consults the registry at lowering time."""
    _BACKENDS[backend.name] = backend


def backend_names() -> list[str]:
    return sorted(_BACKENDS)


def get_backend(name: str):
    try:
        return _BACKENDS[name]
    except KeyError:
        raise ValueError(f"unknown gemm backend {name!r}; registered: {backend_names()}") from None


def backends_for(platform: str) -> list:
    """The backends serving `platform`, highest priority first."""
    return sorted((b for b in _BACKENDS.values() if platform in b.platforms),
                  key=lambda b: -b.priority)


def log_once(level, msg, *args):
    key = (msg,) + args
    if key not in _logged:
        _logged.add(key)
        log.log(level, msg, *args)


def forced_backend(requested: str | None) -> str | None:
    """The backend the caller forces (the argument, else JAX_BLOCKSCALE_BACKEND), or None;
    an unknown name raises here, at trace time."""
    name = requested or config.get().backend
    if name is not None and name != "auto":
        get_backend(name)  # fail early, with the list of names
        return name
    return None


# ---------------------------------------------------------------------------------------------
# ragged_gemm's backends: a registry of their own (they take a RaggedSpec)

_RAGGED_BACKENDS: dict[str, object] = {}


def register_ragged_backend(backend) -> None:
    """Add (or replace) a ragged backend; consulted when `ragged_gemm_local_p` is lowered."""
    _RAGGED_BACKENDS[backend.name] = backend


def ragged_backend_names() -> list[str]:
    return sorted(_RAGGED_BACKENDS)


def get_ragged_backend(name: str):
    try:
        return _RAGGED_BACKENDS[name]
    except KeyError:
        raise ValueError(f"unknown ragged_gemm backend {name!r}; registered: "
                         f"{ragged_backend_names()}") from None


def check_backend_name(requested: str | None) -> None:
    """Raise at trace time for a `backend=` that names no ragged backend."""
    if requested is not None and requested != "auto":
        get_ragged_backend(requested)


def ragged_backends() -> list:
    """The registered ragged backends (the planner chooses among them)."""
    return list(_RAGGED_BACKENDS.values())
