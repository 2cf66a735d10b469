"""The backend registry: which implementations of `gemm_p` exist and on which platforms.

A backend is any object with

    name: str                       # "reference", "sm90", "sm100", ...
    platforms: tuple[str, ...]      # lowering platforms it serves: "cpu", "cuda", "rocm", "tpu"
    priority: int                   # higher wins among those that can run a problem
    plan(spec, device) -> Plan | str          # how it would run `spec`, or why it cannot
    __call__(a, b, sa, sb, alpha, *, plan) -> jax.Array   # JAX-traceable: carry the plan out

`__call__` is lowered with `mlir.lower_fun`, so a backend is written in JAX (the GPU backends call
`jax.ffi.ffi_call`). `sa` is None in weight-only mode. Which backend runs a problem is decided
once per lowering by `lowering.plan.plan` (a forced backend, or the highest-priority one that
serves the platform and accepts the problem); `reference` serves every platform and runs
everything, so there is always a choice.
"""
from __future__ import annotations

import dataclasses
import logging

import numpy as np

log = logging.getLogger("jax_blockscale")

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
    # A shard of a sharded call: (a_batch, b_batch, m, n) of the unsharded problem, whose plan
    # (backend, kernel, variant, tile, split count) the shard runs so that its results equal the
    # unsharded call's bit for bit; None: the problem is its own (sharding.py sets it where K is
    # whole; lowering/plan.py: plan).
    plan_shape: tuple | None = None


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
    from .. import config

    name = requested or config.get().backend
    if name is not None and name != "auto":
        get_backend(name)  # fail early, with the list of names
        return name
    return None
