"""The quantizer kernels' PTX (ffi/jbs_quantize_activation_ptx.h, generated from
ffi/quantize_activation.cu and loaded by the library at run time): the header is what the source
compiles to, and in the SASS ptxas makes of it the one-block-per-thread kernels load their x
blocks before griddepcontrol.wait (ACQBULK) and the amax kernel's partials only after it (a load
hoisted above the wait would race with the amax kernel). Needs the CUDA toolkit's nvcc / ptxas
and cuobjdump (tests/support/native.py: what a test does without them)."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

import cubins  # tests/support/cubins.py
import native  # tests/support/native.py

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HEADER = os.path.join(REPO, "ffi", "jbs_quantize_activation_ptx.h")


def test_header_is_generated_from_the_source():
    nvcc = native.need_tool("nvcc")
    gen = os.path.join(REPO, "ffi", "gen_quantize_activation_ptx.py")
    res = subprocess.run([sys.executable, gen, "--check", "--nvcc", nvcc], capture_output=True,
                         text=True)
    assert res.returncode == 0, res.stdout + res.stderr


@pytest.fixture(scope="module")
def sass(tmp_path_factory):
    ptxas = native.need_tool("ptxas")
    native.need_sass_tools()
    text = open(HEADER).read()
    ptx = text[text.index('R"PTX(') + 6:text.rindex(')PTX"')]
    tmp = tmp_path_factory.mktemp("ptx")
    src, cubin = os.path.join(tmp, "q.ptx"), os.path.join(tmp, "q.cubin")
    open(src, "w").write(ptx)
    subprocess.run([ptxas, "-arch=sm_90a", src, "-o", cubin], check=True)
    return cubins.dump_sass(cubin)


def _function(sass: str, name: str) -> str:
    start = sass.index(f"Function : {name}\n")
    end = sass.find("Function : ", start + 10)
    return sass[start:end if end > 0 else len(sass)]


@pytest.mark.parametrize("name", ["jbs_quantize_nvfp4_activation_static",
                                  "jbs_quantize_nvfp4_activation_static_kperm"])
def test_partial_amaxes_are_read_after_the_wait(sass, name):
    f = _function(sass, name)
    assert f.count("ACQBULK") == 1, name
    wait = f.index("ACQBULK")
    assert re.search(r"LDG\.E\.128", f[:wait]), "x's blocks load before the wait"
    assert not re.search(r"LDG\.E\.STRONG\.GPU", f[:wait]), "a partial amax read above the wait"
    assert re.search(r"LDG\.E\.STRONG\.GPU", f[wait:]), "the partials (ld.global.cg)"
    assert ".CONSTANT" not in f


def test_the_amax_and_one_cta_kernels_never_wait(sass):
    for name in ("jbs_nvfp4_activation_amax", "jbs_quantize_nvfp4_activation_cta"):
        assert "ACQBULK" not in _function(sass, name), name
