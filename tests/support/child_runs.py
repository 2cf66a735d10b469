"""Checks that need their own devices run in child processes.

XLA reads the device count once per process and other test modules import jax with one device,
so the sharding tests (tests/unit/test_sharding.py, test_ragged_sharding.py,
test_moe_sharding.py) start child pytests (and example scripts) with 8 forced host devices, or
on the GPUs, and report their output. The parent side: `pytest_argv`, `start`, `start_all`,
`finish`; the child side: `use_partitioner`.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
N_CPU_DEVICES = 8


def pytest_argv(test_file) -> list[str]:
    """A child pytest of one test module (quiet, no cache)."""
    return [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
            str(Path(test_file).resolve().relative_to(ROOT))]


def start(argv, env_extra, *, gpu: bool = False) -> subprocess.Popen:
    """Start `argv` in the repository root with the package importable: on N_CPU_DEVICES
    forced CPU devices, or (gpu) on the GPUs; `env_extra` is applied last."""
    env = dict(os.environ,
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    if gpu:
        # The parent may hold GPU memory already (conftest looks for GPUs); NVLink multicast
        # (NVLS) stays off on the lent machines.
        env.update(XLA_PYTHON_CLIENT_PREALLOCATE="false", NCCL_NVLS_ENABLE="0")
    else:
        env.update(XLA_FLAGS=f"--xla_force_host_platform_device_count={N_CPU_DEVICES}",
                   JAX_PLATFORMS="cpu")
    env.update(env_extra)
    return subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def start_all(jobs: dict):
    """Generator for a module fixture: every job {name: (argv, env_extra)} started at once (each
    is mostly single-threaded compilation), yielded as {name: process}, killed if left over."""
    procs = {name: start(argv, env) for name, (argv, env) in jobs.items()}
    yield procs
    for p in procs.values():
        if p.poll() is None:
            p.kill()


def finish(proc, timeout: int = 600) -> tuple[int, str]:
    """(return code, output) of a started child; a child past `timeout` seconds is killed and
    reported as return code -1."""
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        return -1, out + f"\n[timed out after {timeout} s]"
    return proc.returncode, out


def use_partitioner() -> bool:
    """In a child: the SPMD partitioner JBS_PARTITIONER names ("shardy", the default, or
    "gspmd"), set on jax; a JAX without the switch runs Shardy only (the GSPMD child skips).
    Returns whether Shardy is on."""
    import jax

    shardy = os.environ.get("JBS_PARTITIONER", "shardy") == "shardy"
    if hasattr(jax.config, "jax_use_shardy_partitioner"):
        jax.config.update("jax_use_shardy_partitioner", shardy)
    elif not shardy:
        pytest.skip("this JAX has no GSPMD switch", allow_module_level=True)
    return shardy
