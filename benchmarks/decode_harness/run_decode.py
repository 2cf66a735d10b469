"""Check and time the sm90 decode kernel on a Hopper GPU (cupy + the harness library).

    python benchmarks/decode_harness/run_decode.py --lib benchmarks/decode_harness/build \
        --json $OUT/decode_h100.json [--quick] [--no-perf] [--extra-only] [--profile]

Correctness: fresh random operands for every case (never zeros: random fp4/fp8 codes, random
block scales including subnormal e4m3 and tiny e8m0 ones, random bf16 activations), output and
workspace poisoned with NaN before the launch, compared with a float64 reference of the
dequantized operands (computed with cupy in float64 on the GPU: dequantize, then DGEMM).
Relative Frobenius error must be < 1e-5 for f32 output (bf16 8e-3, f16 1e-3 rounding).

Timing: a CUDA graph of 20 launches (each the launcher's three kernels; what XLA's command
buffers run), median per-launch time over graph replays ("us"), and CUDA events between eager
back-to-back launches ("us_eager"); rotating through enough weight/scale buffer sets (> 150 MB)
that L2 cannot hold them. Reports the bytes that must move (B + its unpadded scales + A + out),
the achieved TB/s on them, and the time. Extra tunings found in the library get a reduced
correctness suite (f32 output, the odd shapes) and the same timings; --profile launches three
headline cases twice each (run it under ncu).
"""
from __future__ import annotations

import argparse
import ctypes
import faulthandler
import fnmatch
import json
import math
import os
import sys
import time

import numpy as np
import cupy as cp
import ml_dtypes

HERE = os.path.dirname(os.path.abspath(__file__))


sys.path.insert(0, HERE)
from variants_loader import load_decode_variants  # noqa: E402

dec = load_decode_variants()

FP4_VALUES = np.array([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6], np.float64)
FMTS = {  # fmt -> (kernel kind, element kind)
    "nvfp4": ("nvfp4", "e2m1"), "mxfp4": ("mxfp4", "e2m1"),
    "mxfp8_e4m3": ("mxfp8", "e4m3"), "mxfp8_e5m2": ("mxfp8", "e5m2"),
}
TOL = {"f32": 1e-5, "bf16": 8e-3, "f16": 1e-3}
OUT_NP = {"f32": np.float32, "bf16": ml_dtypes.bfloat16, "f16": np.float16}
OUT_BYTES = {"f32": 4, "bf16": 2, "f16": 2}


def _lut256(elem):
    dt = {"e4m3": ml_dtypes.float8_e4m3fn, "e5m2": ml_dtypes.float8_e5m2}[elem]
    return np.arange(256, dtype=np.uint8).view(dt).astype(np.float64)


class Lib:
    def __init__(self, build_dir):
        self.dll = ctypes.CDLL(os.path.join(build_dir, "libdecode_harness.so"))
        self.loaded = set()

    def run(self, name, a, b, sa, sb, c, alpha, ws, m, n, k, l, a_e5m2, b_e5m2, splits, stream):
        if name not in self.loaded:
            fn = getattr(self.dll, f"load_{name}")
            fn.restype = ctypes.c_int
            err = fn()
            if err:
                raise RuntimeError(f"load_{name}: cuda error {err}")
            self.loaded.add(name)
        fn = getattr(self.dll, f"run_{name}")
        fn.restype = ctypes.c_int
        vp, i32 = ctypes.c_void_p, ctypes.c_int32
        fn.argtypes = [vp] * 7 + [i32] * 7 + [vp]
        return fn(a, b, sa, sb, c, alpha, ws, m, n, k, l, a_e5m2, b_e5m2, splits, stream)


# ---- operands -----------------------------------------------------------------------------------
def blocked(s_plain):
    """(L, MN, SK) uint8 plain scales -> (L, ceil(MN/128), ceil(SK/4), 32, 4, 4) blocked."""
    L, mn, sk = s_plain.shape
    r, c = -(-mn // 128) * 128, -(-sk // 4) * 4
    p = np.zeros((L, r, c), np.uint8)
    p[:, :mn, :sk] = s_plain
    return np.ascontiguousarray(
        p.reshape(L, r // 128, 4, 32, c // 4, 4).transpose(0, 1, 4, 3, 2, 5))


def rand_scales(rng, shape, kind):
    if kind == "nvfp4":  # e4m3, non-negative: exponents 0..10 (0: subnormal, incl. exact zero)
        e = rng.integers(0, 11, shape)
        mant = rng.integers(0, 8, shape)
        return ((e << 3) | mant).astype(np.uint8)
    s = (127 + rng.integers(-6, 7, shape)).astype(np.uint8)  # e8m0 around 1
    s[rng.random(shape) < 0.01] = 0  # a few 2^-127 (a bf16 subnormal)
    return s


def scale_values(s, kind):
    if kind == "nvfp4":
        return s.view(ml_dtypes.float8_e4m3fn).astype(np.float64)
    return np.exp2(s.astype(np.float64) - 127)


class Operand:
    """A quantized (L, R, K) operand on the GPU: packed data, blocked scales, and its float64
    dequantized value (on the GPU, for the reference)."""

    def __init__(self, rng, fmt, L, R, K, with_ref=True):
        kind, elem = FMTS[fmt]
        block = dec.KINDS[kind]["block"]
        self.fmt, self.kind, self.e5m2 = fmt, kind, int(elem == "e5m2")
        if elem == "e2m1":
            data = cp.random.randint(0, 256, (L, R, K // 2), dtype=cp.int32).astype(cp.uint8)
        else:
            lut = _lut256(elem)
            data = cp.random.randint(0, 256, (L, R, K), dtype=cp.int32).astype(cp.uint8)
            finite = cp.asarray(np.isfinite(lut))
            data = cp.where(finite[data], data, cp.uint8(0x38 if elem == "e4m3" else 0x3C))
        s_plain = rand_scales(rng, (L, R, K // block), kind)
        self.data = data
        self.scales = cp.asarray(blocked(s_plain))
        self.nbytes = data.nbytes + s_plain.nbytes  # unpadded scales: what must be read
        self.ref = None
        if with_ref:
            if elem == "e2m1":
                lut = cp.asarray(FP4_VALUES)
                lo = lut[data & 0xF]
                hi = lut[data >> 4]
                vals = cp.stack([lo, hi], axis=-1).reshape(L, R, K)
            else:
                vals = cp.asarray(_lut256(elem))[data]
            sv = cp.asarray(scale_values(s_plain, kind))
            self.ref = (vals.reshape(L, R, K // block, block) * sv[..., None]).reshape(L, R, K)


def rand_bf16(L, M, K):
    x = cp.random.standard_normal((L, M, K), dtype=cp.float32)
    bits = x.view(cp.uint32)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16  # round to nearest even
    b16 = bits.astype(cp.uint16)
    ref = (b16.astype(cp.uint32) << 16).view(cp.float32).astype(cp.float64)
    return b16, ref


def out_to_f64(c, out):
    h = cp.asnumpy(c)
    if out == "bf16":
        return h.view(ml_dtypes.bfloat16).astype(np.float64)
    return h.astype(np.float64)


# ---- one case -----------------------------------------------------------------------------------
def run_case(lib, rng, fmt_a, fmt_b, out, M, N, K, L=1, splits=None, check=True, time_it=False,
             reps=60, sm_count=132, log=print, tuning=None, profile=False):
    """tuning: None = the library default (plain variant names), else (tag, Tuning)."""
    tun = tuning[1] if tuning else None
    choice = dec.choose_decode_variant(M, N, K, fmt_a, fmt_b, sm_count, out, tuning=tun)
    assert choice is not None, (M, N, K, fmt_a, fmt_b)
    variant, auto_splits = choice
    name = variant.name + (f"_T{tuning[0]}" if tuning else "")
    splits = auto_splits if splits is None else splits
    # operands
    if fmt_a is None:
        a, a_ref = rand_bf16(L, M, K)
        a_bytes, sa, a_e5m2 = a.nbytes, cp.zeros(16, cp.uint8), 0
    else:
        qa = Operand(rng, fmt_a, L, M, K, with_ref=check)
        a, a_ref, sa, a_e5m2, a_bytes = qa.data, qa.ref, qa.scales, qa.e5m2, qa.nbytes
    n_sets = 1
    qb = Operand(rng, fmt_b, L, N, K, with_ref=check)
    if time_it:
        n_sets = max(1, math.ceil(160e6 / qb.nbytes))
    sets = [qb] + [Operand(rng, fmt_b, L, N, K, with_ref=False) for _ in range(n_sets - 1)]
    alpha_val = np.float32(rng.choice([0.75, 1.0, 1.5, 0.3125]))
    alpha = cp.asarray(np.array([alpha_val], np.float32))
    c = cp.empty((L, M, N), {"f32": cp.float32, "bf16": cp.uint16, "f16": cp.float16}[out])
    ws = cp.empty((splits, L, M, N), cp.float32)  # one slice per split
    stream = cp.cuda.get_current_stream()

    def launch(bset):
        err = lib.run(name, a.data.ptr, bset.data.data.ptr, sa.data.ptr,
                      bset.scales.data.ptr, c.data.ptr, alpha.data.ptr, ws.data.ptr,
                      M, N, K, L, a_e5m2, bset.e5m2, splits, stream.ptr)
        if err:
            raise RuntimeError(f"{name}: launcher returned {err}")

    rec = dict(fmt_a=fmt_a or "bf16", fmt_b=fmt_b, out=out, M=M, N=N, K=K, L=L,
               variant=name, tuning=tuning[0] if tuning else "default", splits=splits,
               auto_splits=auto_splits)
    if check:
        ref = cp.asnumpy(cp.matmul(a_ref, qb.ref.transpose(0, 2, 1)))
        if out == "f16":  # keep the result inside f16's range (max 65504): a power-of-two alpha
            amax = float(np.abs(ref).max())
            if amax * float(alpha_val) > 4096:
                alpha_val = np.float32(2.0 ** np.floor(np.log2(4096 / amax)))
                alpha[...] = cp.float32(alpha_val)
        ref = float(alpha_val) * ref
        rec["alpha"] = float(alpha_val)
        # poison: NaN everywhere the kernel writes or reads back (bf16/f16 NaN bit patterns too)
        c.view(cp.uint8).fill(0xFF)
        ws.fill(cp.nan)
        launch(qb)
        stream.synchronize()
        cp.cuda.runtime.deviceSynchronize()
        y = out_to_f64(c, out)
        finite = bool(np.isfinite(y).all())
        err = float(np.linalg.norm(y - ref) / max(np.linalg.norm(ref), 1e-30)) if finite else float("inf")
        rec.update(rel_err=err, finite=finite, ok=bool(finite and err < TOL[out]))
    if profile:
        launch(sets[0])
        launch(sets[-1])
        stream.synchronize()
        log(json.dumps(rec))
        return rec
    if time_it:
        for i in range(5):
            launch(sets[i % n_sets])
        stream.synchronize()
        # (1) eager: events between back-to-back launches
        evs = [cp.cuda.Event() for _ in range(reps + 1)]
        evs[0].record(stream)
        for i in range(reps):
            launch(sets[i % n_sets])
            evs[i + 1].record(stream)
        evs[-1].synchronize()
        ts = np.array([cp.cuda.get_elapsed_time(evs[i], evs[i + 1]) for i in range(reps)]) * 1e3
        us_eager = float(np.median(ts))
        # (2) CUDA graph of `per` launches (as XLA's command buffers run it): no host gaps
        us_graph, per = None, 20
        try:
            gs = cp.cuda.Stream(non_blocking=True)
            with gs:
                gs.begin_capture(mode=cp.cuda.runtime.streamCaptureModeRelaxed)
                for i in range(per):
                    err = lib.run(name, a.data.ptr, sets[i % n_sets].data.data.ptr,
                                  sa.data.ptr, sets[i % n_sets].scales.data.ptr, c.data.ptr,
                                  alpha.data.ptr, ws.data.ptr, M, N, K, L, a_e5m2,
                                  sets[i % n_sets].e5m2, splits, gs.ptr)
                    assert err == 0, err
                graph = gs.end_capture()
            graph.upload(gs)
            graph.launch(gs)
            gs.synchronize()
            gts = []
            for _ in range(max(5, reps // per * 2)):
                e0, e1 = cp.cuda.Event(), cp.cuda.Event()
                e0.record(gs)
                graph.launch(gs)
                e1.record(gs)
                e1.synchronize()
                gts.append(cp.cuda.get_elapsed_time(e0, e1) * 1e3 / per)
            us_graph = float(np.median(gts))
        except Exception as e:  # capture not possible: keep the eager numbers
            rec["graph_error"] = repr(e)[:200]
        us = us_graph if us_graph is not None else us_eager
        moved = qb.nbytes + a_bytes + L * M * N * OUT_BYTES[out]
        rec.update(us=us, us_eager=us_eager, us_graph=us_graph,
                   us_eager_p10=float(np.percentile(ts, 10)),
                   us_eager_p90=float(np.percentile(ts, 90)),
                   bytes=int(moved), tbps=moved / (us * 1e-6) / 1e12, buffer_sets=n_sets)
    log(json.dumps(rec))
    del sets, qb
    cp.get_default_memory_pool().free_all_blocks()
    return rec


def copy_bandwidth(log=print):
    """Device-to-device copy of 1 GiB, counting bytes read + written (the HBM ceiling)."""
    x = cp.empty(1 << 30, cp.uint8)
    y = cp.empty_like(x)
    x.fill(1)
    for _ in range(3):
        y[...] = x
    s, e = cp.cuda.Event(), cp.cuda.Event()
    s.record()
    for _ in range(10):
        y[...] = x
    e.record()
    e.synchronize()
    ms = cp.cuda.get_elapsed_time(s, e) / 10
    tb = 2 * x.nbytes / (ms * 1e-3) / 1e12
    log(json.dumps(dict(copy_tbps=tb)))
    del x, y
    cp.get_default_memory_pool().free_all_blocks()
    return tb


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lib", default=os.path.join(HERE, "build"))
    ap.add_argument("--json", default=None)
    ap.add_argument("--quick", action="store_true", help="correctness subset only")
    ap.add_argument("--no-perf", action="store_true")
    ap.add_argument("--extra-only", action="store_true",
                    help="skip the default tuning's full correctness suite and the split sweep "
                         "(a follow-up run comparing tunings)")
    ap.add_argument("--split-sweep-only", action="store_true",
                    help="only the split-K sweep of the default tuning (no correctness suite)")
    ap.add_argument("--perf-shapes", default="",
                    help="comma list of MxNK (e.g. 1x16384,16x16384): time only these shapes")
    ap.add_argument("--profile-tunings", default="default",
                    help="with --profile: comma list of tunings to launch ('default' or a tag)")
    ap.add_argument("--tunings", default="",
                    help="comma list of fnmatch patterns: only the extra tunings whose tag matches")
    ap.add_argument("--watchdog", type=float, default=0,
                    help="seconds: print every thread's stack and exit if still running (a hung "
                         "kernel shows as a stack inside synchronize)")
    ap.add_argument("--profile", action="store_true",
                    help="only launch a few headline cases twice each (run it under ncu)")
    args = ap.parse_args()
    if args.watchdog:
        faulthandler.dump_traceback_later(args.watchdog, exit=True)
    lib = Lib(args.lib)
    table = json.load(open(os.path.join(args.lib, "variants.json")))
    built = set(table)
    # extra tunings present in the library: tag -> Tuning
    extra = {}
    for name, ent in table.items():
        if not ent["default"]:
            tun = dec.Tuning(**ent["tuning"])
            extra[tun.tag] = tun
    extra = sorted(extra.items())
    if args.tunings:
        pats = args.tunings.split(",")
        extra = [(tag, tun) for tag, tun in extra if any(fnmatch.fnmatch(tag, p) for p in pats)]
    dev = cp.cuda.Device()
    props = cp.cuda.runtime.getDeviceProperties(dev.id)
    sm_count = props["multiProcessorCount"]
    info = dict(device=props["name"].decode(), sm_count=sm_count,
                cc=f"{props['major']}.{props['minor']}", default_tuning=dec.DEFAULT_TUNING.tag,
                extra_tunings=[t for t, _ in extra])
    print(json.dumps(info), flush=True)
    rng = np.random.default_rng(int(time.time()))
    cp.random.seed(int(rng.integers(1 << 30)))
    results = dict(info=info, correctness=[], perf=[])
    failures = 0

    def have(fmt_a, fmt_b, out, m, tuning=None):
        v = dec.choose_decode_variant(m, 64, 64, fmt_a, fmt_b, sm_count, out)
        return v is not None and (v[0].name + (f"_T{tuning[0]}" if tuning else "")) in built

    def guarded(fmt_a, fmt_b, out, M, N, K, **kw):
        try:
            return run_case(lib, rng, fmt_a, fmt_b, out, M, N, K, sm_count=sm_count, **kw)
        except Exception as e:  # keep going: report every failing case
            r = dict(fmt_a=fmt_a or "bf16", fmt_b=fmt_b, out=out, M=M, N=N, K=K,
                     error=repr(e)[:300], splits=kw.get("splits"), us=float("nan"),
                     tbps=float("nan"), tuning=kw["tuning"][0] if kw.get("tuning") else "default")
            print(json.dumps(r), flush=True)
            return r

    if args.profile:  # under ncu: two launches per case, nothing else
        tunings = dict(extra)
        for tag in args.profile_tunings.split(","):
            tuning = None if tag == "default" else (tag, tunings[tag])
            for (fa, fb, M, NK) in [(None, "nvfp4", 1, 16384), (None, "nvfp4", 16, 16384),
                                    (None, "mxfp8_e4m3", 16, 16384)]:
                run_case(lib, rng, fa, fb, "bf16", M, NK, NK, check=False, time_it=True, reps=1,
                         sm_count=sm_count, profile=True, tuning=tuning)
        return 0

    # ---- correctness: every pair, output dtype, odd shapes; default tuning ----------------
    pairs = [(None, f) for f in FMTS] + [(f, f) for f in FMTS] + [("mxfp8_e4m3", "mxfp8_e5m2")]
    shapes = [  # (M, N, K, L, splits)
        (1, 256, 512, 1, None), (3, 1000, 4096 + 96, 1, None), (16, 1000, 4096 + 96, 1, 3),
        (8, 520, 2080, 2, None), (13, 777, 1056, 1, 1), (16, 8192, 8192, 1, None),
        (24, 300, 1024, 1, None), (64, 264, 544, 1, 5), (40, 520, 1056, 1, None),
        (128, 264, 544, 2, 3), (100, 1000, 4096 + 96, 1, None),
        (15, 9999, 1056, 1, None),  # >= 128K outputs, odd: finalize's 4-per-thread scalar path
    ]
    if args.quick:
        shapes = shapes[:3]
    skip_suite = args.extra_only or args.split_sweep_only

    def check(*case, **kw):  # one correctness case, recorded and counted
        nonlocal failures
        r = guarded(*case, **kw)
        results["correctness"].append(r)
        failures += not r.get("ok", False)

    for fmt_a, fmt_b in ([] if skip_suite else pairs):
        for out in ("f32", "bf16", "f16"):
            for (M, N, K, L, sp) in shapes:
                if out != "f32" and (M, N) not in ((3, 1000), (16, 8192), (15, 9999)):
                    continue  # the other output dtypes: two shapes each
                if not have(fmt_a, fmt_b, out, M):
                    continue
                check(fmt_a, fmt_b, out, M, N, K, L=L, splits=sp)
    # the other tunings in the library: f32 output, the odd shapes
    for tag, tun in ([] if args.split_sweep_only else extra):
        for fmt_a, fmt_b in pairs:
            for (M, N, K, L, sp) in [shapes[1], shapes[2], shapes[3], shapes[4], shapes[6],
                                     shapes[7], shapes[8]]:  # M <= 16 and M = 24, 64, 40
                if have(fmt_a, fmt_b, "f32", M, (tag, tun)):
                    check(fmt_a, fmt_b, "f32", M, N, K, L=L, splits=sp, tuning=(tag, tun))
            M, N, K, L, sp = shapes[4]  # one split, bf16 out: the main kernel converts
            if have(fmt_a, fmt_b, "bf16", M, (tag, tun)):
                check(fmt_a, fmt_b, "bf16", M, N, K, L=L, splits=sp, tuning=(tag, tun))
    print(f"correctness: {len(results['correctness']) - failures} ok, {failures} failed", flush=True)

    # ---- performance ----------------------------------------------------------------------
    if not args.no_perf:
        results["copy_tbps"] = copy_bandwidth()
        perf = []
        perf_shapes = [(1, 8192), (16, 8192), (1, 16384), (16, 16384), (32, 8192), (32, 16384),
                       (48, 16384), (64, 16384), (64, 8192), (96, 16384), (128, 16384),
                       (128, 8192), (80, 16384)]
        if args.perf_shapes:
            perf_shapes = [tuple(int(x) for x in s.split("x")) for s in args.perf_shapes.split(",")]
        for tuning in ([] if args.split_sweep_only else [None] + list(extra)):
            for (M, NK) in perf_shapes:
                for fmt_a, fmt_b in [(None, "nvfp4"), (None, "mxfp4"), (None, "mxfp8_e4m3"),
                                     ("nvfp4", "nvfp4"), ("mxfp8_e4m3", "mxfp8_e4m3")]:
                    if fmt_a is not None and M == 1:
                        continue
                    if not have(fmt_a, fmt_b, "bf16", M, tuning):
                        continue
                    perf.append(guarded(fmt_a, fmt_b, "bf16", M, NK, NK, check=True,
                                        time_it=True, tuning=tuning))
        # split-K sweep, default tuning (checks the heuristic's choice)
        for (M, NK) in ([] if args.extra_only else [(1, 8192), (16, 8192), (1, 16384),
                                                     (16, 16384)]):
            for sp in (1, 2, 3, 4, 5, 6, 8, 12, 16, 32):
                if have(None, "nvfp4", "bf16", M):
                    perf.append(guarded(None, "nvfp4", "bf16", M, NK, NK, splits=sp, check=False,
                                        time_it=True))
        results["perf"] = perf
        print("\n tuning            fmt_a      fmt_b       M     N     K splits | us(graph) us(eager)  TB/s  rel_err")
        for r in perf:
            print(f" {r.get('tuning', ''):17s} {str(r['fmt_a']):10s} {r['fmt_b']:10s} {r['M']:3d} "
                  f"{r['N']:5d} {r['K']:5d} {str(r.get('splits')):>5s} | {r['us']:8.1f} "
                  f"{r.get('us_eager', float('nan')):8.1f} {r['tbps']:5.2f}  "
                  f"{r.get('rel_err', float('nan')):.2e}")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    bad = [r for r in results["correctness"] if not r.get("ok", False)]
    for r in bad[:20]:
        print("FAILED", json.dumps(r))
    print(f"correctness: {len(results['correctness']) - failures} ok, {failures} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
