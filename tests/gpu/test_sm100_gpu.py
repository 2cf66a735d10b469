"""The exported Blackwell kernels, linked the way the plugin links them, give the
right numbers on a B200 / GB200 (sm_100) or B300 / GB300 (sm_103).

* `test_exported_objects_link_and_load` runs anywhere (no GPU): the exported
  objects link with the DSL runtime and a static cudart into a plain .so.
* Everything else needs a compute capability 10.x GPU and is skipped without one:
      pytest -m gpu tests/test_sm100_gpu.py              # correctness
      pytest -m gpu -s tests/test_sm100_gpu.py -k bench  # speed (prints TFLOP/s)

Reference: float64 NumPy on the decoded operands; the kernel must match to
relative Frobenius error < 1e-5 with f32 output (dequantized products are exact
in f32, only the summation order differs) and < 1e-2 with bf16 / f16 output.
"""

import numpy as np
import pytest

ml_dtypes = pytest.importorskip("ml_dtypes")
sm100 = pytest.importorskip(
    "jax_blockscale.kernels.sm100_blockscaled",
    reason="needs nvidia-cutlass-dsl (build-time dependency)")
import sm100_harness as H  # noqa: E402

V = sm100.Sm100Variant

# ---- which device, if any -----------------------------------------------------


def _blackwell_device():
    """(arch, sm_count) of device 0 if it is a CC 10.x GPU, else None."""
    try:
        from cuda.bindings import runtime as rt
    except ImportError:
        return None
    err, count = rt.cudaGetDeviceCount()
    if err != rt.cudaError_t.cudaSuccess or count == 0:
        return None
    err, prop = rt.cudaGetDeviceProperties(0)
    if err != rt.cudaError_t.cudaSuccess or prop.major != 10:
        return None
    return f"sm_{prop.major}{prop.minor}a", prop.multiProcessorCount


DEVICE = _blackwell_device()
needs_blackwell = pytest.mark.skipif(
    DEVICE is None, reason="needs a compute capability 10.x (Blackwell datacenter) GPU")

# ---- the cases ------------------------------------------------------------------

# (variant, (M, N, K, L)).  Shapes cover exact tiles, partial tiles in M, N and
# K, batches, a single row (decode) and the special N = 64 / 192 / 256 paths.
CASES = [
    (V("nvfp4", "nvfp4", "float32", 128, 128), (256, 256, 512, 1)),
    (V("nvfp4", "nvfp4", "float32", 128, 128), (200, 136, 352, 2)),
    (V("nvfp4", "nvfp4", "bfloat16", 128, 64), (1, 1000, 1024, 1)),
    (V("nvfp4", "nvfp4", "float32", 128, 64), (130, 200, 256, 1)),
    (V("nvfp4", "nvfp4", "float32", 256, 128, 2, 1), (300, 264, 1024, 1)),
    (V("nvfp4", "nvfp4", "float16", 256, 256, 2, 1), (512, 512, 768, 2)),
    (V("nvfp4", "nvfp4", "float32", 256, 256, 2, 2), (1024, 1024, 512, 1)),
    (V("nvfp4", "nvfp4", "float32", 128, 256), (384, 520, 256, 1)),
    (V("mxfp4", "mxfp4", "float32", 128, 128), (256, 384, 1024, 1)),
    (V("mxfp4", "mxfp4", "bfloat16", 256, 256, 2, 1), (700, 600, 512, 1)),
    (V("mxfp8_e4m3", "mxfp8_e4m3", "float32", 128, 64), (100, 200, 320, 3)),
    (V("mxfp8_e4m3", "mxfp8_e4m3", "float32", 256, 128, 2, 1), (512, 384, 2048, 1)),
    (V("mxfp8_e4m3", "mxfp8_e4m3", "float32", 256, 256, 2, 1), (1000, 1000, 1024, 1)),
    (V("mxfp8_e5m2", "mxfp8_e5m2", "float32", 128, 128), (256, 256, 256, 1)),
    (V("mxfp6_e2m3", "mxfp6_e2m3", "float32", 128, 128), (256, 256, 512, 1)),
    (V("mxfp6_e3m2", "mxfp6_e3m2", "float32", 256, 128, 2, 1), (384, 256, 384, 1)),
    (V("mxfp8_e4m3", "mxfp4", "float32", 128, 128), (256, 256, 512, 1)),
    (V("mxfp8_e4m3", "mxfp4", "float32", 256, 192, 2, 1), (512, 960, 512, 1)),
    (V("mxfp8_e4m3", "mxfp6_e2m3", "float32", 128, 128), (128, 256, 256, 1)),
]

BENCH = [
    (V("nvfp4", "nvfp4", "bfloat16", 256, 256, 2, 1), (8192, 8192, 8192, 1)),
    (V("mxfp8_e4m3", "mxfp8_e4m3", "bfloat16", 256, 256, 2, 1), (8192, 8192, 8192, 1)),
    (V("nvfp4", "nvfp4", "bfloat16", 128, 64), (16, 7168, 16384, 1)),
]

# ---- building -------------------------------------------------------------------


def _export_all(variants, arch, out_dir):
    exports, seen = [], set()
    for v in variants:
        p = sm100.default_function_prefix(v, arch)
        if p not in seen:
            seen.add(p)
            exports.append((p, *sm100.export_variant(v, out_dir, p, arch)))
    return exports


def test_exported_objects_link_and_load(tmp_path):
    why = H.link_missing()
    if why:
        pytest.skip(why)
    variants = [CASES[0][0], CASES[4][0]]
    exports = []
    for arch in sm100.SM100_ARCHS:
        exports += _export_all(variants, arch, str(tmp_path))
    lib = H.Library(H.build_library(exports, str(tmp_path)))
    for p, _, _ in exports:
        assert hasattr(lib.dll, f"run_{p}") and hasattr(lib.dll, f"load_{p}")


@pytest.fixture(scope="module")
def library(tmp_path_factory):
    if DEVICE is None:
        pytest.skip("needs a Blackwell GPU")
    why = H.link_missing()
    if why:
        pytest.skip(why)
    out = str(tmp_path_factory.mktemp("sm100_gpu"))
    arch, _ = DEVICE
    exports = _export_all([v for v, _ in CASES + BENCH], arch, out)
    lib = H.Library(H.build_library(exports, out))
    for p, _, _ in exports:
        assert lib.load(p) == 0, f"module load failed for {p}"
    return lib


# ---- operands -------------------------------------------------------------------

_ELEM = {"nvfp4": "float4_e2m1fn", "mxfp4": "float4_e2m1fn",
         "mxfp6_e2m3": "float6_e2m3fn", "mxfp6_e3m2": "float6_e3m2fn",
         "mxfp8_e4m3": "float8_e4m3fn", "mxfp8_e5m2": "float8_e5m2"}


def _operand(fmt, rows, k, nl, rng):
    """-> (device bytes, blocked scale bytes, float64 dequantized (L, rows, K))."""
    f = sm100.FORMATS[fmt]
    et = getattr(ml_dtypes, _ELEM[fmt])
    vals = rng.standard_normal((nl, rows, k)).astype(et)  # round to the grid
    codes = vals.view(np.uint8)
    sk = k // f.block
    if fmt == "nvfp4":
        s = rng.uniform(0.25, 4.0, (nl, rows, sk)).astype(ml_dtypes.float8_e4m3fn)
    else:
        s = (127 + rng.integers(-3, 4, (nl, rows, sk))).astype(np.uint8).view(
            ml_dtypes.float8_e8m0fnu)
    deq = vals.astype(np.float64) * np.repeat(s.astype(np.float64), f.block, axis=-1)
    if f.bits == 4:
        data = H.pack_fp4(codes & 0xF)
    elif f.bits == 6:
        data = H.pack_fp6(codes & 0x3F)
    else:
        data = codes
    return np.ascontiguousarray(data), H.blocked_scales(s.view(np.uint8)), deq


class _Device:
    """Device copies of host arrays, freed together."""

    def __init__(self):
        from cuda.bindings import runtime as rt

        self.rt, self.ptrs = rt, []

    def _ok(self, res):
        err = res[0] if isinstance(res, tuple) else res
        assert err == self.rt.cudaError_t.cudaSuccess, err
        return res[1] if isinstance(res, tuple) and len(res) > 1 else None

    def alloc(self, nbytes):
        p = self._ok(self.rt.cudaMalloc(max(nbytes, 1)))
        self.ptrs.append(p)
        self._ok(self.rt.cudaMemset(p, 0xFF, max(nbytes, 1)))  # poison
        return p

    def put(self, arr):
        p = self.alloc(arr.nbytes)
        self._ok(self.rt.cudaMemcpy(p, arr.ctypes.data, arr.nbytes,
                                    self.rt.cudaMemcpyKind.cudaMemcpyHostToDevice))
        return p

    def get(self, p, arr):
        self._ok(self.rt.cudaDeviceSynchronize())
        self._ok(self.rt.cudaMemcpy(arr.ctypes.data, p, arr.nbytes,
                                    self.rt.cudaMemcpyKind.cudaMemcpyDeviceToHost))
        return arr

    def free(self):
        for p in self.ptrs:
            self.rt.cudaFree(p)


_OUT_NP = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}


def _launch_args(v, shape, rng, dev):
    m, n, k, nl = shape
    a, sfa, da = _operand(v.fmt_a, m, k, nl, rng)
    b, sfb, db = _operand(v.fmt_b, n, k, nl, rng)
    out = np.zeros((nl, m, n), _OUT_NP[v.out_dtype])
    ptrs = [dev.put(x) for x in (a, b, sfa, sfb)] + [dev.alloc(out.nbytes)]
    return ptrs, out, da, db


def _max_active_clusters(v):
    return max(1, DEVICE[1] // (v.cluster_m * v.cluster_n))


@needs_blackwell
@pytest.mark.gpu
@pytest.mark.parametrize("variant,shape", CASES, ids=lambda x: getattr(x, "name", str(x)))
def test_matches_float64_reference(library, variant, shape):
    m, n, k, nl = shape
    assert k % variant.k_align == 0 and n % variant.n_align == 0
    rng = np.random.default_rng(0)
    dev = _Device()
    try:
        ptrs, out, da, db = _launch_args(variant, shape, rng, dev)
        alpha = 0.75
        alpha_dev = dev.put(np.array([alpha], np.float32))
        rc = library.run(sm100.default_function_prefix(variant, DEVICE[0]), *ptrs,
                         alpha_dev, m, n, k, nl, _max_active_clusters(variant), None)
        assert rc == 0, f"launcher returned {rc}"
        got = dev.get(ptrs[4], out).astype(np.float64)
    finally:
        dev.free()
    want = alpha * np.einsum("lmk,lnk->lmn", da, db)
    err = np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30)
    tol = 1e-5 if variant.out_dtype == "float32" else 1e-2
    assert err < tol, f"relative Frobenius error {err:.3e}"


@needs_blackwell
@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.parametrize("variant,shape", BENCH, ids=lambda x: getattr(x, "name", str(x)))
def test_bench(library, variant, shape):
    from cuda.bindings import runtime as rt

    m, n, k, nl = shape
    dev = _Device()
    try:
        ptrs, _, _, _ = _launch_args(variant, shape, np.random.default_rng(1), dev)
        prefix = sm100.default_function_prefix(variant, DEVICE[0])
        one = dev.put(np.array([1.0], np.float32))
        args = (*ptrs, one, m, n, k, nl, _max_active_clusters(variant), None)
        for _ in range(3):
            assert library.run(prefix, *args) == 0
        _, start = rt.cudaEventCreate()
        _, stop = rt.cudaEventCreate()
        iters = 20
        rt.cudaEventRecord(start, 0)
        for _ in range(iters):
            library.run(prefix, *args)
        rt.cudaEventRecord(stop, 0)
        rt.cudaEventSynchronize(stop)
        _, ms = rt.cudaEventElapsedTime(start, stop)
    finally:
        dev.free()
    us = ms * 1e3 / iters
    tflops = 2.0 * m * n * k * nl / (us * 1e-6) / 1e12
    print(f"\n{variant.name} {shape}: {us:.1f} us  {tflops:.0f} TFLOP/s")
    assert us > 0
