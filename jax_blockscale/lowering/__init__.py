"""The backend registry: which implementation of `gemm_p` runs on which platform and device.

A backend is any object with

    name: str                       # "reference", "sm90", "sm100", ...
    platforms: tuple[str, ...]      # lowering platforms it serves: "cpu", "cuda", "rocm", "tpu"
    priority: int                   # higher wins among those that can run a problem
    unsupported_reason(spec) -> str | None   # None: it can run `spec`; else why not (logged)
    __call__(a, b, sa, sb, alpha, *, spec, platform) -> jax.Array   # JAX-traceable

`__call__` is lowered with `mlir.lower_fun`, so a backend is written in JAX (the GPU backends call
`jax.ffi.ffi_call`). `sa` is None in weight-only mode. The choice is made when `gemm_p` is lowered
for a platform: a forced backend (`backend=` or `JAX_BLOCKSCALE_BACKEND`) or else the
highest-priority backend that serves the platform and can run the problem. `reference` serves
every platform and runs everything, so there is always a choice.
"""
from __future__ import annotations

import dataclasses
import logging
import os

import numpy as np

log = logging.getLogger("jax_blockscale")

ENV_BACKEND = "JAX_BLOCKSCALE_BACKEND"
ALL_PLATFORMS = ("cpu", "cuda", "rocm", "tpu")


@dataclasses.dataclass(frozen=True)
class GemmSpec:
    """The static description of one gemm problem, as a backend sees it."""
    fmt_a: str | None  # None: weight-only mode, A is a plain activation
    fmt_b: str
    layout_a: str | None
    layout_b: str
    a_dtype: np.dtype  # storage dtype of A (the activation dtype in weight-only mode)
    out_dtype: np.dtype
    batch_shape: tuple[int, ...]  # broadcast batch shape of the output
    a_batch: tuple[int, ...]
    b_batch: tuple[int, ...]
    m: int
    n: int
    k: int
    # True when the caller promises alpha == 1.0 (no global scales): a backend may then let its
    # GEMM round straight to out_dtype instead of scaling an f32 result first (same value).
    alpha_is_one: bool = False


_BACKENDS: dict[str, object] = {}
_logged: set = set()


def register_backend(backend) -> None:
    """Add (or replace) a backend; the lowering rules consult the registry at lowering time."""
    _BACKENDS[backend.name] = backend


def backend_names() -> list[str]:
    return sorted(_BACKENDS)


def get_backend(name: str):
    try:
        return _BACKENDS[name]
    except KeyError:
        raise ValueError(f"unknown gemm backend {name!r}; registered: {backend_names()}") from None


def _log_once(level, msg, *args):
    key = (msg,) + args
    if key not in _logged:
        _logged.add(key)
        log.log(level, msg, *args)


def forced_backend(requested: str | None) -> str | None:
    """The backend the caller forces (argument first, then the environment), or None."""
    name = requested or os.environ.get(ENV_BACKEND) or None
    if name is not None and name != "auto":
        get_backend(name)  # fail early, with the list of names
        return name
    return None


def select_backend(spec: GemmSpec, platform: str, requested: str | None = None):
    """Pick the backend that runs `spec` on `platform` (see the module docstring)."""
    name = forced_backend(requested)
    if name is not None:
        backend = get_backend(name)
        if platform not in backend.platforms:
            raise ValueError(f"gemm backend {name!r} does not run on platform {platform!r} "
                             f"(it serves {backend.platforms})")
        reason = backend.unsupported_reason(spec)
        if reason is not None:
            raise ValueError(f"gemm backend {name!r} cannot run this problem: {reason}")
        return backend
    candidates = sorted((b for b in _BACKENDS.values() if platform in b.platforms),
                        key=lambda b: -b.priority)
    for backend in candidates:
        reason = backend.unsupported_reason(spec)
        if reason is None:
            _log_once(logging.DEBUG, "gemm on %s uses backend %s", platform, backend.name)
            return backend
        _log_once(logging.INFO, "gemm backend %s skipped on %s: %s", backend.name, platform,
                  reason)
    raise ValueError(f"no gemm backend can run this problem on {platform!r}")
