"""Changing jax_blockscale's configuration in a test: the package reads its JAX_BLOCKSCALE_*
variables once (jax_blockscale/config.py), so a test sets them and re-reads them; the conftest
re-reads them again after the test (after monkeypatch has undone its changes)."""
from __future__ import annotations

from jax_blockscale import config


def set_env(monkeypatch, **variables) -> config.Config:
    """set_env(monkeypatch, JAX_BLOCKSCALE_SM90_MAX_ROWS="0", ...): set (None: delete) and
    reload."""
    for name, value in variables.items():
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, str(value))
    return config.reload()
