"""Test harness: link exported sm100 objects into a shared library and call them.

This is the same recipe the plugin build uses (DESIGN.md, "AOT build"): the
exported `.o` files, a tiny C shim that makes the header's `static inline`
launcher callable, the DSL's `libcuda_dialect_runtime_static.a` and a static
CUDA runtime, in one plain `.so` loaded with ctypes.  It lets the tests check
the exported artifact itself (on a B200: its numbers) without the FFI.
"""

import ctypes
import glob
import os
import shutil
import subprocess

import numpy as np

# The generated headers print CUDA errors of module loading; record the first
# one instead so load_<prefix>() can return it.
_SHIM_HEAD = """#include <stdint.h>
#include <cuda_runtime.h>
static int g_load_error = 0;
#define CUTE_DSL_CUDA_ERROR_CHECK(err) \\
  do { if ((int)(err) != 0 && g_load_error == 0) g_load_error = (int)(err); } while (0)
"""

_SHIM_FN = """
static {p}_Kernel_Module_t g_{p};
int load_{p}(void) {{ g_load_error = 0; {p}_Kernel_Module_Load(&g_{p}); return g_load_error; }}
int run_{p}(void *a, void *b, void *sfa, void *sfb, void *out, void *alpha, int32_t m,
            int32_t n, int32_t k, int32_t l, int32_t max_active_clusters, void *stream) {{
  return cute_dsl_{p}_wrapper(&g_{p}, a, b, sfa, sfb, out, alpha, m, n, k, l,
                              max_active_clusters, (cudaStream_t)stream);
}}
"""


def cuda_home():
    for root in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if root and os.path.exists(os.path.join(root, "include", "cuda_runtime.h")):
            return root
    return None


def _static_cudart(root):
    for sub in ("lib64", "lib", os.path.join("targets", "x86_64-linux", "lib")):
        cand = os.path.join(root, sub, "libcudart_static.a")
        if os.path.exists(cand):
            return cand
    return None


def dsl_runtime_lib():
    import nvidia_cutlass_dsl  # the wheel ships the runtime per CUDA major

    hits = sorted(glob.glob(os.path.join(nvidia_cutlass_dsl.__path__[0], "cu13", "lib",
                                         "libcuda_dialect_runtime_static.a")))
    return hits[0] if hits else None


def link_missing():
    """None if we can link here, else why not."""
    if not shutil.which(os.environ.get("CC", "gcc")):
        return "no C compiler (gcc) on PATH"
    root = cuda_home()
    if root is None:
        return "no CUDA toolkit headers (set CUDA_HOME)"
    if _static_cudart(root) is None:
        return "no libcudart_static.a in the CUDA toolkit"
    if dsl_runtime_lib() is None:
        return "nvidia-cutlass-dsl[cu13] runtime library not found"
    return None


def build_library(exports, out_dir):
    """exports: [(prefix, header, object)] -> path of the linked .so."""
    root = cuda_home()
    shim = os.path.join(out_dir, "sm100_shim.c")
    with open(shim, "w") as f:
        f.write(_SHIM_HEAD)
        for p, h, _ in exports:
            f.write(f'#include "{os.path.abspath(h)}"\n')
        for p, _, _ in exports:
            f.write(_SHIM_FN.format(p=p))
    lib = os.path.join(out_dir, "libsm100_test.so")
    cmd = [os.environ.get("CC", "gcc"), "-O2", "-fPIC", "-shared", "-o", lib, shim,
           *[o for _, _, o in exports], f"-I{root}/include",
           dsl_runtime_lib(), _static_cudart(root),
           "-ldl", "-lpthread", "-lrt", "-Wl,--exclude-libs,ALL", "-Wl,--no-undefined"]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"link failed:\n{' '.join(cmd)}\n{res.stderr}")
    return lib


class Library:
    """ctypes view of build_library's .so: load(prefix), run(prefix, ...)."""

    def __init__(self, path):
        self.dll = ctypes.CDLL(path)

    def _fn(self, name, argtypes):
        fn = getattr(self.dll, name)
        fn.restype = ctypes.c_int
        fn.argtypes = argtypes
        return fn

    def load(self, prefix):
        return self._fn(f"load_{prefix}", [])()

    def run(self, prefix, a, b, sfa, sfb, out, alpha, m, n, k, l, max_active_clusters, stream):
        vp, i32 = ctypes.c_void_p, ctypes.c_int32
        fn = self._fn(f"run_{prefix}", [vp] * 6 + [i32] * 5 + [vp])
        return fn(a, b, sfa, sfb, out, alpha, m, n, k, l, max_active_clusters, stream)


# ---- operand encoding (the FFI contract's memory format) ---------------------


def pack_fp4(codes):
    """(..., K) 4-bit codes -> (..., K/2) bytes, low nibble first."""
    codes = codes.astype(np.uint8)
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)


def pack_fp6(codes):
    """(..., K) 6-bit codes -> (..., 3K/4) bytes: a little-endian bit stream
    (element i in bits 6i..6i+5), the tensor map's packed 6-bit format.
    Assumed from the PTX packing rules; a B200 run confirms it."""
    c = codes.astype(np.uint32)
    word = c[..., 0::4] | (c[..., 1::4] << 6) | (c[..., 2::4] << 12) | (c[..., 3::4] << 18)
    out = np.stack([(word >> s) & 0xFF for s in (0, 8, 16)], axis=-1)
    return out.reshape(*codes.shape[:-1], codes.shape[-1] * 3 // 4).astype(np.uint8)


def blocked_scales(plain):
    """(L, MN, SK) uint8 scale bits -> blocked (L, MN/128, SK/4, 32, 4, 4), zero padded."""
    nl, mn, sk = plain.shape
    rt, ct = -(-mn // 128), -(-sk // 4)
    pad = np.zeros((nl, rt * 128, ct * 4), np.uint8)
    pad[:, :mn, :sk] = plain
    return np.ascontiguousarray(
        pad.reshape(nl, rt, 4, 32, ct, 4).transpose(0, 1, 4, 3, 2, 5))
