"""What the build tests need from the install (the native library, the CuTeDSL, the CUDA tools),
and what a test does when one is missing: it fails, saying what is missing and how to get it,
except where the package was installed without the native library on purpose; there it skips.

On purpose means one of:
  * JAX_BLOCKSCALE_NO_PLUGIN is set (the package is told not to load the library);
  * the installed package's native_build.json (written by ffi/CMakeLists.txt, next to the
    package's modules) says the install built no library (JAX_BLOCKSCALE_SKIP_NATIVE=1) or could
    not build it, or its Blackwell part, and was told to go on (JAX_BLOCKSCALE_NATIVE_OPTIONAL=1).
Anything else is not: CI's `pip install ".[test]"` builds the library, so there every test of
tests/build runs (docs/building.md, "Testing the build").

The library is the one the package itself loads (jax_blockscale._plugin: JAX_BLOCKSCALE_LIBRARY,
else the package directory). Run from the repository root, `python -m pytest` imports the
source tree's package, whose directory has no library: install the package and run `pytest`
(the venv's, which imports the installed one), or name the library with JAX_BLOCKSCALE_LIBRARY.
"""
from __future__ import annotations

import functools
import importlib
import json
import os

import pytest

import jax_blockscale
from jax_blockscale import _plugin

BUILD_INFO = "native_build.json"
DSL_PIN = "nvidia-cutlass-dsl[cu13]==4.8.1"  # pyproject.toml: [build-system] requires, [test]


def package_dir() -> str:
    return os.path.dirname(os.path.abspath(jax_blockscale.__file__))


def is_source_tree() -> bool:
    """jax_blockscale is imported from a checkout (ffi/ beside it), not from an install."""
    return os.path.isdir(os.path.join(package_dir(), os.pardir, "ffi"))


@functools.cache
def build_info() -> dict | None:
    """The install's native_build.json, or None (a source tree, or a package built before it)."""
    path = os.path.join(package_dir(), BUILD_INFO)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def left_out_on_purpose(part: str = "library") -> str | None:
    """Why this run has no native library (part="sm100": no Blackwell part) on purpose, or None
    when it should have it."""
    if os.environ.get("JAX_BLOCKSCALE_NO_PLUGIN"):  # any value, as jax_blockscale.config reads it
        return "JAX_BLOCKSCALE_NO_PLUGIN is set"
    if os.environ.get("JAX_BLOCKSCALE_LIBRARY"):
        return None  # a library named by hand is meant to be there
    info = build_info()
    if info is None:
        return None
    if info.get("native") == "skipped":
        return "the package was installed with JAX_BLOCKSCALE_SKIP_NATIVE=1"
    if info.get("native") == "failed":
        return ("JAX_BLOCKSCALE_NATIVE_OPTIONAL=1 and the native build failed: "
                f"{info.get('reason', '')}")
    if part == "sm100" and not info.get("sm100", False):
        return ("the library was built without its Blackwell part "
                f"(JAX_BLOCKSCALE_NATIVE_OPTIONAL=1: {info.get('reason', '')})")
    return None


def _where() -> str:
    info = build_info()
    lines = [f"jax_blockscale imported from {package_dir()}",
             f"library looked for at {_plugin.library_path()}"]
    if info is not None:
        lines.append(f"{BUILD_INFO}: {json.dumps(info)}")
    elif is_source_tree():
        lines.append("this is a source tree (python -m pytest from the repository root?): "
                     "`pip install .` and run the venv's `pytest`, or set "
                     "JAX_BLOCKSCALE_LIBRARY=<path to libjax_blockscale.so>")
    else:
        lines.append(f"no {BUILD_INFO} in the package (installed by an older build?)")
    lines.append("set JAX_BLOCKSCALE_NO_PLUGIN=1 to run without the library on purpose "
                 "(then these tests skip)")
    return "\n  ".join(lines)


def need(missing: str | None, what: str, part: str = "library") -> None:
    """Nothing when `missing` is None; else skip where the library is left out on purpose, fail
    otherwise. In a test or at a module's top: there the failure is the module's collection
    error, and the rest of the run goes on (--continue-on-collection-errors, pyproject.toml)."""
    if missing is None:
        return
    why = left_out_on_purpose(part)
    if why is not None:
        pytest.skip(f"{what}: {missing} ({why})", allow_module_level=True)
    pytest.fail(f"{what} is missing: {missing}\n  {_where()}", pytrace=False)


def library_missing(part: str = "library") -> str | None:
    """Why the package's native library (part="sm100": with its Blackwell variants) is not
    loaded, or None."""
    if part == "sm100":
        return _plugin.sm100_unavailable_reason()
    return _plugin.unavailable_reason()


def need_library(part: str = "library") -> None:
    """need() for the package's native library (part="sm100": with its Blackwell variants)."""
    name = "the native library" + (" with its Blackwell variants" if part == "sm100" else "")
    need(library_missing(part), name, part)


def import_dsl(module: str):
    """`module` (a CuTeDSL kernel or AOT module); a test env without nvidia-cutlass-dsl fails
    (skips where the library is left out on purpose)."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        need(f"cannot import {module} ({e}); pip install '{DSL_PIN}' (the [test] extra has it)",
             "nvidia-cutlass-dsl")
        raise


def dsl_missing() -> str | None:
    try:
        import cutlass  # noqa: F401
    except ImportError as e:
        return f"cannot import cutlass ({e}): pip install '{DSL_PIN}' (the [test] extra has it)"
    return None


def need_dsl() -> None:
    """need() for nvidia-cutlass-dsl (the kernels' sources compile and export with it)."""
    need(dsl_missing(), "nvidia-cutlass-dsl")


def need_sass_tools() -> None:
    """need() for cuobjdump and nvdisasm (the [test] extra's nvidia-cuda-* wheels)."""
    import cubins  # tests/support/cubins.py

    need(cubins.sass_tools_missing(), "the SASS tools")


def need_tool(name: str) -> str:
    """The CUDA toolkit's `name` (nvcc, ptxas): from PATH, the pip wheels or the toolkit."""
    import cubins  # tests/support/cubins.py

    exe = cubins._tool(name)
    need(None if exe else f"{name} not found (PATH, CUDA_HOME, /usr/local/cuda)",
         "the CUDA toolkit")
    return exe
