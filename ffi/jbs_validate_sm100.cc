// Pure (CUDA-free) checks and tile choice of the Blackwell block-scaled GEMM: every assumption
// ffi/../docs/blackwell.md lists under "What the caller (the FFI handler) must check".
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "jbs_sm100.h"

namespace jbs_sm100 {
namespace {

constexpr int64_t kInt32Max = 2147483647LL;

int Bits(int fmt) {
  switch (fmt) {
    case JBS100_NVFP4: case JBS100_MXFP4: return 4;
    case JBS100_MXFP6_E2M3: case JBS100_MXFP6_E3M2: return 6;
    case JBS100_MXFP8_E4M3: case JBS100_MXFP8_E5M2: return 8;
    default: return 0;
  }
}
int Block(int fmt) { return fmt == JBS100_NVFP4 ? 16 : 32; }
int OutBytes(int out) {
  switch (out) {
    case JBS100_OUT_BF16: case JBS100_OUT_F16: return 2;
    case JBS100_OUT_F32: return 4;
    default: return 0;
  }
}
// kernels/sm100_blockscaled.py:k_alignment
int KAlign(int fa, int fb) {
  int a = Bits(fa), b = Bits(fb);
  if (a != b || a == 6 || b == 6) return 128;
  int per16 = 128 / a;
  return per16 > Block(fa) ? per16 : Block(fa);
}
int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }
const char* Fail(char* buf, size_t n, const char* fmt, long long x = 0, long long y = 0,
                 long long z = 0) {
  snprintf(buf, n, fmt, x, y, z);
  return buf;
}

struct Cost {
  double time;
  bool underfilled;
  double waste;
  const char* name;
};
bool Less(const Cost& x, const Cost& y) {
  if (x.time != y.time) return x.time < y.time;
  if (x.underfilled != y.underfilled) return !x.underfilled;
  if (x.waste != y.waste) return x.waste < y.waste;
  return strcmp(x.name, y.name) < 0;
}
double Round(double x, double scale) { return nearbyint(x * scale) / scale; }

}  // namespace

int ArchFor(int cc_major, int cc_minor) {
  if (cc_major == 10 && cc_minor == 0) return 100;
  if (cc_major == 10 && cc_minor == 3) return 103;
  return 0;
}

const Variant* ChooseVariant(int64_t m, int64_t n, int64_t k, int fmt_a, int fmt_b, int out,
                             int sm_count, int sm, const Variant* variants, int num_variants) {
  if (m <= 0 || n <= 0 || k <= 0 || sm_count <= 0) return nullptr;
  const Variant* best = nullptr;
  Cost best_cost{};
  for (int i = 0; i < num_variants; ++i) {
    const Variant& v = variants[i];
    if (v.sm != sm || v.fmt_a != fmt_a || v.fmt_b != fmt_b || v.out != out) continue;
    if (k % v.k_align != 0 || n % v.n_align != 0) continue;
    int64_t tiles_m = CeilDiv(m, v.tile_m), tiles_n = CeilDiv(n, v.tile_n);
    int64_t tiles = tiles_m * tiles_n;
    int sms_per_tile = v.tile_m == 256 ? 2 : 1;
    int cluster = v.cluster_m * v.cluster_n;
    int tiles_per_cluster = cluster / sms_per_tile;
    int64_t in_flight = (sm_count / cluster > 1 ? sm_count / cluster : 1) * (int64_t)tiles_per_cluster;
    int64_t waves = CeilDiv(tiles, in_flight);
    double per_sm_area = (double)(v.tile_m / sms_per_tile) * v.tile_n / (128.0 * 128.0);
    double eff = 1.0 + 32.0 * (1.0 / v.tile_m + 1.0 / v.tile_n);
    Cost c{Round((double)waves * per_sm_area * eff, 1e6),
           tiles_per_cluster > 1 && tiles < 2 * in_flight,
           Round((double)(tiles_m * v.tile_m) * (double)(tiles_n * v.tile_n) / (double)(m * n), 1e3),
           v.name};
    if (!best || Less(c, best_cost)) {
      best = &v;
      best_cost = c;
    }
  }
  return best;
}

const char* ValidateProblem(const Problem& p, const Variant* variants, int num_variants,
                            const Variant** found, bool* empty, char* buf, size_t n) {
  *found = nullptr;
  *empty = false;
  int sm = ArchFor(p.cc_major, p.cc_minor);
  if (sm == 0)
    return Fail(buf, n, "the sm100 kernels need compute capability 10.0 or 10.3, this device is %lld.%lld",
                p.cc_major, p.cc_minor);
  int ba = Bits(p.fmt_a), bb = Bits(p.fmt_b), ob = OutBytes(p.out);
  if (!ba || !bb) return Fail(buf, n, "unknown format codes (%lld, %lld)", p.fmt_a, p.fmt_b);
  if ((p.fmt_a == JBS100_NVFP4) != (p.fmt_b == JBS100_NVFP4))
    return Fail(buf, n, "nvfp4 pairs only with nvfp4 on Blackwell");
  if (!ob) return Fail(buf, n, "output must be bf16, f16 or f32 (code %lld)", p.out);
  if (p.m < 0 || p.n < 0 || p.k < 0 || p.l < 0)
    return Fail(buf, n, "negative extents (M=%lld N=%lld K=%lld)", p.m, p.n, p.k);
  if (p.m > kInt32Max || p.n > kInt32Max || p.k > kInt32Max || p.l > kInt32Max)
    return Fail(buf, n, "M, N, K and L must fit in int32");
  if (p.c_bytes != p.l * p.m * p.n * ob)
    return Fail(buf, n, "output buffer is %lld bytes, expected L*M*N*%lld = %lld", p.c_bytes, ob,
                p.l * p.m * p.n * ob);
  if (p.m == 0 || p.n == 0 || p.l == 0 || p.k == 0) {  // nothing to launch
    *empty = true;
    return nullptr;
  }
  int ka = KAlign(p.fmt_a, p.fmt_b);
  if (p.k % ka != 0)
    return Fail(buf, n, "K=%lld must be a multiple of %lld for this format pair", p.k, ka);
  int na = p.out == JBS100_OUT_F32 ? 4 : 8;
  if (p.n % na != 0)
    return Fail(buf, n, "N=%lld must be a multiple of %lld for this output dtype", p.n, na);
  if (p.m * p.k > kInt32Max || p.n * p.k > kInt32Max || p.m * p.n > kInt32Max)
    return Fail(buf, n, "M*K, N*K and M*N must each be below 2^31 (M=%lld N=%lld K=%lld)", p.m,
                p.n, p.k);
  const uint64_t ptrs[5] = {p.a_ptr, p.b_ptr, p.sa_ptr, p.sb_ptr, p.c_ptr};
  for (int i = 0; i < 5; ++i)
    if (ptrs[i] % 16 != 0)
      return Fail(buf, n, "operand %lld (a, b, sfa, sfb, out) is not 16-byte aligned", i);
  if (p.alpha_ptr % 4 != 0) return Fail(buf, n, "alpha is not 4-byte aligned");
  if (p.alpha_bytes < 4) return Fail(buf, n, "alpha must hold one float32");
  if (p.a_bytes != p.l * p.m * p.k * ba / 8)
    return Fail(buf, n, "A is %lld bytes, expected %lld (L*M*K packed)", p.a_bytes,
                p.l * p.m * p.k * ba / 8);
  if (p.b_bytes != p.l * p.n * p.k * bb / 8)
    return Fail(buf, n, "B is %lld bytes, expected %lld (L*N*K packed)", p.b_bytes,
                p.l * p.n * p.k * bb / 8);
  int64_t sk4 = CeilDiv(p.k / Block(p.fmt_a), 4);
  int64_t sa_need = p.l * CeilDiv(p.m, 128) * sk4 * 512, sb_need = p.l * CeilDiv(p.n, 128) * sk4 * 512;
  if (p.sa_bytes < sa_need)
    return Fail(buf, n, "blocked A scales are %lld bytes, need %lld (padded atoms)", p.sa_bytes, sa_need);
  if (p.sb_bytes < sb_need)
    return Fail(buf, n, "blocked B scales are %lld bytes, need %lld (padded atoms)", p.sb_bytes, sb_need);
  if (p.sm_count < 1) return Fail(buf, n, "sm_count must be positive");
  const Variant* v = nullptr;
  if (p.tile_m || p.tile_n || p.cluster_m || p.cluster_n) {
    for (int i = 0; i < num_variants && !v; ++i) {
      const Variant& c = variants[i];
      if (c.sm == sm && c.fmt_a == p.fmt_a && c.fmt_b == p.fmt_b && c.out == p.out &&
          c.tile_m == p.tile_m && c.tile_n == p.tile_n && c.cluster_m == p.cluster_m &&
          c.cluster_n == p.cluster_n)
        v = &c;
    }
    if (!v)
      return Fail(buf, n, "no compiled variant with tile %lldx%lld for this pair/output (cluster %lld)",
                  p.tile_m, p.tile_n, p.cluster_m * 10 + p.cluster_n);
  } else {
    v = ChooseVariant(p.m, p.n, p.k, p.fmt_a, p.fmt_b, p.out, p.sm_count, sm, variants,
                      num_variants);
    if (!v) return Fail(buf, n, "no compiled variant for this format pair and output dtype");
  }
  if (p.k % v->k_align != 0 || p.n % v->n_align != 0)
    return Fail(buf, n, "variant alignment not met (K %% %lld, N %% %lld)", v->k_align, v->n_align);
  *found = v;
  return nullptr;
}

}  // namespace jbs_sm100
