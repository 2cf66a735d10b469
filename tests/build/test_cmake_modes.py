"""ffi/CMakeLists.txt's three modes, each configured and installed in a second or two (no AOT
build): JAX_BLOCKSCALE_SKIP_NATIVE=1 builds nothing and needs no compiler or toolkit;
JAX_BLOCKSCALE_NATIVE_OPTIONAL=1 installs without the library when a step fails; by default the
failure fails the build. Each records itself in native_build.json (tests/support/native.py reads
the installed one). A failure is injected with -DJBS_TEST_GIVE_UP=<why>."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

import native  # tests/support/native.py

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FFI = os.path.join(REPO, "ffi")


def _cmake() -> str:
    exe = shutil.which("cmake")
    if exe is None:
        try:
            import cmake  # the pip package
            exe = os.path.join(cmake.CMAKE_BIN_DIR, "cmake")
        except ImportError:
            pass
    native.need(None if exe else "no cmake on PATH (pip install cmake)", "cmake")
    return exe


def _configure(tmp_path, *defines, env=None):
    build = tmp_path / "build"
    res = subprocess.run([_cmake(), "-S", FFI, "-B", str(build),
                          f"-DPython_EXECUTABLE={sys.executable}", *defines],
                         capture_output=True, text=True, env=env)
    return res, build


def _install(tmp_path, build) -> dict:
    """{path relative to the prefix: text} of what `cmake --install` puts under a prefix."""
    prefix = tmp_path / "prefix"
    subprocess.run([_cmake(), "--build", str(build)], check=True, capture_output=True)
    subprocess.run([_cmake(), "--install", str(build), "--prefix", str(prefix)], check=True,
                   capture_output=True)
    return {str(p.relative_to(prefix)): p.read_text() for p in prefix.rglob("*") if p.is_file()}


def test_skip_native_builds_nothing_and_needs_no_compiler(tmp_path):
    env = dict(os.environ, CXX="/nonexistent/c++", CUDACXX="/nonexistent/nvcc")
    res, build = _configure(tmp_path, "-DJBS_SKIP_NATIVE=ON", env=env)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "JAX_BLOCKSCALE_SKIP_NATIVE=1" in res.stdout
    assert "compiler identification" not in res.stdout  # no language enabled
    assert "compiling the kernel variants" not in res.stdout
    installed = _install(tmp_path, build)
    assert list(installed) == ["jax_blockscale/native_build.json"], installed
    info = json.loads(installed["jax_blockscale/native_build.json"])
    assert info == {"native": "skipped", "mode": "skip", "sm100": False,
                    "reason": "JAX_BLOCKSCALE_SKIP_NATIVE=1"}


def test_native_optional_installs_without_the_library_when_a_step_fails(tmp_path):
    res, build = _configure(tmp_path, "-DJBS_NATIVE_OPTIONAL=ON",
                            '-DJBS_TEST_GIVE_UP=a "quoted" failure')
    assert res.returncode == 0, res.stdout + res.stderr
    assert "JAX_BLOCKSCALE_NATIVE_OPTIONAL=1: installing without the native library" in res.stderr
    assert "compiling the kernel variants" not in res.stdout  # nothing after the failure ran
    installed = _install(tmp_path, build)
    assert list(installed) == ["jax_blockscale/native_build.json"], installed
    info = json.loads(installed["jax_blockscale/native_build.json"])
    assert info == {"native": "failed", "mode": "optional", "sm100": False,
                    "reason": 'a "quoted" failure'}


def test_a_failed_step_fails_the_default_build(tmp_path):
    res, _ = _configure(tmp_path, "-DJBS_TEST_GIVE_UP=no toolkit here")
    assert res.returncode != 0
    assert "no toolkit here" in res.stderr
    # the error names both ways out
    assert "JAX_BLOCKSCALE_NATIVE_OPTIONAL=1" in res.stderr
    assert "JAX_BLOCKSCALE_SKIP_NATIVE=1" in res.stderr


def test_pip_sets_the_modes_from_the_environment():
    """pyproject.toml maps the environment variables docs/building.md names onto the options."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        defines = tomllib.load(f)["tool"]["scikit-build"]["cmake"]["define"]
    assert defines["JBS_SKIP_NATIVE"] == {"env": "JAX_BLOCKSCALE_SKIP_NATIVE", "default": "OFF"}
    assert defines["JBS_NATIVE_OPTIONAL"] == {"env": "JAX_BLOCKSCALE_NATIVE_OPTIONAL",
                                              "default": "OFF"}


def test_the_installed_package_says_how_it_was_built():
    """The package under test carries the native_build.json of its install, and it agrees with
    what loads: a library where it says built, none where it says skipped or failed."""
    info = native.build_info()
    if info is None:
        assert native.is_source_tree(), (
            f"the package installed at {native.package_dir()} has no {native.BUILD_INFO}")
        native.need_library()  # a source tree's library is named by JAX_BLOCKSCALE_LIBRARY
        pytest.skip("jax_blockscale imported from a source tree: no install record")
    if info["native"] == "built":
        assert native.library_missing() is None or os.environ.get("JAX_BLOCKSCALE_NO_PLUGIN")
    else:
        assert info["native"] in ("skipped", "failed"), info
        assert not os.path.exists(os.path.join(native.package_dir(), "libjax_blockscale.so"))


def test_the_test_extra_has_the_builds_dsl():
    """tests/build compiles variants with the DSL the build uses: [test] pins the same one."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)
    assert native.DSL_PIN in project["build-system"]["requires"]
    assert native.DSL_PIN in project["project"]["optional-dependencies"]["test"]
