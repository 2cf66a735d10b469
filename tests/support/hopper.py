"""Helpers of the sm90 test modules: whether this machine can run the sm90 backend, a way to
hand the allocator NaN-filled memory before a call, and cross-lowering for CUDA without a GPU."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from jax_blockscale import _plugin


def hopper_with_library() -> bool:
    """Every visible GPU is compute capability 9.0 and libjax_blockscale.so is loaded."""
    try:
        gpus = jax.devices("gpu")
    except RuntimeError:
        return False
    return (bool(gpus) and all(getattr(d, "compute_capability", "") == "9.0" for d in gpus)
            and _plugin.unavailable_reason() is None)


needs_sm90 = pytest.mark.skipif(not hopper_with_library(),
                                reason="needs an sm90 GPU and libjax_blockscale.so")


def poison():
    """Fill 256 MiB of fresh device memory with NaN and free it, so the next allocations reuse it:
    an output element a kernel skips (or reads, as a GEMM's C) shows up as NaN."""
    x = jnp.full((64 << 20,), jnp.nan, jnp.float32)
    x.block_until_ready()
    del x


def as_if_hopper(monkeypatch, sm_count: int = 132) -> None:
    """Make the planner see an H100 (compute capability 9.0, `sm_count` SMs) on this machine."""
    from jax_blockscale.lowering import plan

    monkeypatch.setattr(plan, "_gpu_device", lambda: plan.Device("cuda", "sm90", sm_count))


def lower_for_cuda(monkeypatch, f, *args) -> str:
    """Cross-lower `f` for CUDA on this (GPU-less) machine, as if it had a Hopper GPU."""
    as_if_hopper(monkeypatch)
    return jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
