"""Test layout: unit/ (pure Python and JAX, any machine), build/ (the kernel sources and the built
library, no GPU), gpu/ (a CUDA GPU; skipped without one); shared helpers live in support/."""
import functools
import os
import sys

import jax
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "support"))


@functools.cache
def has_gpu() -> bool:
    try:
        return bool(jax.devices("gpu"))
    except RuntimeError:
        return False


@pytest.fixture(autouse=True)
def _fresh_config():
    """Every test starts and ends with the configuration read from the environment as it is
    (tests change JAX_BLOCKSCALE_* variables with set_env below)."""
    from jax_blockscale import config as jbs_config

    jbs_config.reload()
    yield
    jbs_config.reload()


def pytest_collection_modifyitems(config, items):
    if has_gpu():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        # the gpu marker, not the keyword: a test under tests/gpu/ that needs only the built
        # library (the sm100 dispatch and validation checks) runs here too
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)
