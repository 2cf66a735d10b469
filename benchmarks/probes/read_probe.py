"""Read-bandwidth probe: does a linear / per-CTA-contiguous read beat the decode kernel's
row-segment pattern, timed the way the harness (CUDA graph) and the sweep (profiler device
time) time things, beside XLA's jnp.max over the same bytes?

    OUT=<dir> python benchmarks/probes/read_probe.py     # on the GPU, from the repo root

Needs cupy (and jax for the XLA row). Writes <OUT>/probe_bw.json; the session-4 result is
benchmarks/results/read_probe_graph_h100_session4.json (docs/sm90_decode_notes.md, session 4).
"""
import json, os, sys
import numpy as np
import cupy as cp
sys.path.insert(0, os.getcwd())
N, PITCH = 16384, 9216  # 16384 rows x (8192 B fp4 + 1024 B scales): ~151 MB, like nvfp4 16384^2
NB = N * PITCH
src = r'''
__device__ __forceinline__ uint4 LD(const void* q) { uint4 v; asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.b32 {%0,%1,%2,%3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(q)); return v; }
__device__ __forceinline__ uint4 LDP(const void* q) { uint4 v; asm volatile("ld.global.nc.v4.b32 {%0,%1,%2,%3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(q)); return v; }
template <int U, bool HINT>
__device__ void lin(const uint4* __restrict__ p, long n16, unsigned* out) {
  unsigned acc = 0;
  long stride = (long)gridDim.x * blockDim.x;
  long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
  for (; i + (U - 1) * stride < n16; i += U * stride) {
    uint4 v[U];
#pragma unroll
    for (int u = 0; u < U; ++u) v[u] = HINT ? LD(p + i + u * stride) : LDP(p + i + u * stride);
#pragma unroll
    for (int u = 0; u < U; ++u) acc ^= v[u].x ^ v[u].w;
  }
  for (; i < n16; i += stride) { uint4 a = LDP(p + i); acc ^= a.x; }
  if (acc == 0x12345678) out[0] = acc;
}
extern "C" __global__ void lin4(const uint4* p, long n, unsigned* o) { lin<4, false>(p, n, o); }
extern "C" __global__ void lin8(const uint4* p, long n, unsigned* o) { lin<8, false>(p, n, o); }
extern "C" __global__ void lin8h(const uint4* p, long n, unsigned* o) { lin<8, true>(p, n, o); }
// per-CTA contiguous: CTA b reads [b*per, (b+1)*per) bytes, 16 B per thread, U in flight
template <int U>
__device__ void contig(const unsigned char* p, long per, unsigned* out) {
  const unsigned char* q = p + (long)blockIdx.x * per;
  unsigned acc = 0;
  for (long s = (long)threadIdx.x * 16; s < per; s += (long)blockDim.x * 16 * U) {
    uint4 v[U];
#pragma unroll
    for (int u = 0; u < U; ++u) v[u] = LD(q + s + (long)u * blockDim.x * 16);
#pragma unroll
    for (int u = 0; u < U; ++u) acc ^= v[u].x ^ v[u].w;
  }
  if (acc == 0x12345678) out[0] = acc;
}
extern "C" __global__ void __launch_bounds__(256, 2) contig8(const unsigned char* p, long per, unsigned* o) { contig<8>(p, per, o); }
extern "C" __global__ void __launch_bounds__(256, 2) contig4(const unsigned char* p, long per, unsigned* o) { contig<4>(p, per, o); }
// the decode kernel's pattern: CTA = 256 rows x a K range (splits), thread reads 4 rows x 16 B of
// each 64-byte step, UNR steps in flight
template <int UNR>
__device__ void tile(const unsigned char* p, int splits, unsigned* out, int bx, int by);
template <int UNR>
__device__ void tile(const unsigned char* p, int splits, unsigned* out) { tile<UNR>(p, splits, out, blockIdx.x, blockIdx.y); }
template <int UNR>
__device__ void tile(const unsigned char* p, int splits, unsigned* out, int bx, int by) {
  int w = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  int range = PITCH_ / splits;
  long kb = (long)by * range;
  unsigned acc = 0;
  const unsigned char* rows[4];
  for (int j = 0; j < 4; ++j) rows[j] = p + (long)(bx * 256 + (w / 4) * 128 + j * 32 + 8 * (w % 4) + g) * PITCH_ + kb + 16 * t;
  for (int s = 0; s < range; s += 64 * UNR) {
    uint4 v[4][UNR];
#pragma unroll
    for (int u = 0; u < UNR; ++u)
#pragma unroll
      for (int j = 0; j < 4; ++j) v[j][u] = LD(rows[j] + s + 64 * u);
#pragma unroll
    for (int u = 0; u < UNR; ++u)
#pragma unroll
      for (int j = 0; j < 4; ++j) acc ^= v[j][u].x ^ v[j][u].w;
  }
  if (acc == 0x12345678) out[0] = acc;
}
extern "C" __global__ void __launch_bounds__(256, 2) tile2(const unsigned char* p, int s, unsigned* o) { tile<2>(p, s, o); }
extern "C" __global__ void __launch_bounds__(256, 2) tile4(const unsigned char* p, int s, unsigned* o) { tile<4>(p, s, o); }
extern "C" __global__ void __launch_bounds__(256, 2) tile4sm(const unsigned char* p, int s, unsigned* o) { tile<4>(p, s, o, blockIdx.y, blockIdx.x); }
extern "C" __global__ void __launch_bounds__(256, 2) tile2sm(const unsigned char* p, int s, unsigned* o) { tile<2>(p, s, o, blockIdx.y, blockIdx.x); }
// a CTA owns RPC whole rows (one contiguous region) and reads them SEG bytes of every row at a
// time (row segments across its rows, then the next segment): the current weight layout read
// without split-K
template <int SEG, int UNR>
__device__ void rows(const unsigned char* p, int rpc, unsigned* out) {
  const int tpr = SEG / 16, rpp = 256 / tpr;  // threads per row, rows per pass
  const unsigned char* base = p + (long)blockIdx.x * rpc * PITCH_ + (threadIdx.x % tpr) * 16;
  unsigned acc = 0;
  for (int s = 0; s < PITCH_; s += SEG)
    for (int r0 = 0; r0 < rpc; r0 += rpp * UNR) {
      uint4 v[UNR];
#pragma unroll
      for (int u = 0; u < UNR; ++u) v[u] = LD(base + (long)(r0 + u * rpp + threadIdx.x / tpr) * PITCH_ + s);
#pragma unroll
      for (int u = 0; u < UNR; ++u) acc ^= v[u].x ^ v[u].w;
    }
  if (acc == 0x12345678) out[0] = acc;
}
extern "C" __global__ void __launch_bounds__(256, 2) rows512(const unsigned char* p, int r, unsigned* o) { rows<512, 4>(p, r, o); }
extern "C" __global__ void __launch_bounds__(256, 2) rows1024(const unsigned char* p, int r, unsigned* o) { rows<1024, 8>(p, r, o); }
extern "C" __global__ void __launch_bounds__(256, 2) rows256(const unsigned char* p, int r, unsigned* o) { rows<256, 2>(p, r, o); }
'''.replace("PITCH_", str(PITCH))
mod = cp.RawModule(code=src, options=("-std=c++17", "-arch=sm_90"))
nbuf = 3
bufs = [cp.random.randint(0, 255, NB, dtype=cp.uint8) for _ in range(nbuf)]
out = cp.zeros(4, cp.uint32)
sms = cp.cuda.runtime.getDeviceProperties(0)["multiProcessorCount"]

def graph_us(launch, per=20, reps=10):
    s = cp.cuda.Stream(non_blocking=True)
    with s:
        for i in range(3): launch(bufs[i % nbuf])
        s.synchronize()
        s.begin_capture()
        for i in range(per): launch(bufs[i % nbuf])
        g = s.end_capture()
        g.upload(s); g.launch(s); s.synchronize()
        ts = []
        for _ in range(reps):
            e0, e1 = cp.cuda.Event(), cp.cuda.Event()
            e0.record(s); g.launch(s); e1.record(s); e1.synchronize()
            ts.append(cp.cuda.get_elapsed_time(e0, e1) * 1e3 / per)
    return float(np.median(ts))

cases = {}
f = {n: mod.get_function(n) for n in ("lin4", "lin8", "lin8h", "contig8", "contig4", "tile2", "tile4", "tile4sm", "tile2sm")}
for name in ("lin4", "lin8", "lin8h"):
    for bpsm in (4, 8):
        blocks = sms * bpsm
        cases[f"{name}_b{bpsm}"] = lambda b, fn=f[name], blocks=blocks: fn((blocks,), (256,), (b, np.int64(NB // 16), out))
for name in ("contig8", "contig4"):
    for ctas in (256, 264, 512, 1024):
        per = NB // ctas // 16 * 16
        cases[f"{name}_c{ctas}"] = lambda b, fn=f[name], ctas=ctas, per=per: fn((ctas,), (256,), (b, np.int64(per), out))
for name in ("tile2", "tile4"):
    for splits in (4, 8):
        cases[f"{name}_s{splits}"] = lambda b, fn=f[name], sp=splits: fn((N // 256, sp), (256,), (b, np.int32(sp), out))
        cases[f"{name}sm_s{splits}"] = lambda b, fn=f[name + "sm"], sp=splits: fn((sp, N // 256), (256,), (b, np.int32(sp), out))
for seg in (256, 512, 1024):
    fn = mod.get_function(f"rows{seg}")
    for rpc in (64, 128):
        cases[f"rows{seg}_r{rpc}"] = lambda b, fn=fn, rpc=rpc: fn((N // rpc,), (256,), (b, np.int32(rpc), out))
if os.environ.get("PROBE_ONLY"):  # e.g. PROBE_ONLY=rows: just those patterns
    cases = {k: v for k, v in cases.items() if k.startswith(os.environ["PROBE_ONLY"])}
res = {"bytes": NB}
for k, launch in cases.items():
    us = graph_us(launch)
    res[k] = dict(graph_us=us, TBps=NB / us / 1e6)
    print(k, json.dumps(res[k]), flush=True)
# XLA's reduction over the same bytes, by profiler device time (the sweep's "read floor")
try:
    import jax, jax.numpy as jnp
    from benchmarks.timing import device_time_us
    xs = [jnp.arange(NB // 4, dtype=jnp.uint32) + i for i in range(3)]
    us = device_time_us(jax.jit(jnp.max), arg_sets=[(x,) for x in xs])
    res["xla_max_device_us"] = dict(us=us, TBps=NB / us / 1e6)
    print("xla max", res["xla_max_device_us"], flush=True)
    # one of ours by the same profiler method (cupy kernels show up in the trace too)
    for k in ("tile4_s4", "tile4sm_s4"):
        it = iter(range(10**9))
        def run(_x, k=k):
            cases[k](bufs[next(it) % nbuf]); cp.cuda.Device().synchronize(); return _x
        us = device_time_us(run, xs[0][:1])
        res[k + "_profiler_us"] = us
        print(k, "profiler", us, flush=True)
except Exception as e:
    print("jax part failed:", repr(e))
json.dump(res, open(os.path.join(os.environ.get("OUT", "."), "probe_bw.json"), "w"), indent=1)
