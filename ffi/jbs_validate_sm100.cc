// Pure (CUDA-free) checks of the Blackwell block-scaled GEMM: every assumption
// docs/design/sm100.md lists under "What the caller (the FFI handler) must check". The variant is
// the plan's (lowering/plan.py); this only checks that it exists for the device and fits.
#include "jbs_check_common.h"
#include "jbs_sm100.h"

namespace jbs_sm100 {
namespace {

using jbs_check::CeilDiv;
using jbs_check::kInt32Max;

bool KnownFmt(int fmt) { return fmt >= 1 && fmt < jbs_sm100_catalog::kNumFmts; }
int Bits(int fmt) { return KnownFmt(fmt) ? jbs_sm100_catalog::kFmtBits[fmt] : 0; }
int Block(int fmt) { return KnownFmt(fmt) ? jbs_sm100_catalog::kFmtBlock[fmt] : 0; }
int OutBytes(int out) {
  return out >= 1 && out < jbs_sm100_catalog::kNumOuts ? jbs_sm100_catalog::kOutBytes[out] : 0;
}
// the three-number messages of this file
const char* Fail(char* buf, size_t n, const char* fmt, long long x = 0, long long y = 0,
                 long long z = 0) {
  return jbs_check::Fail(buf, n, fmt, x, y, z);
}

}  // namespace

int ArchFor(int cc_major, int cc_minor) {
  if (cc_major == 10 && cc_minor == 0) return 100;
  if (cc_major == 10 && cc_minor == 3) return 103;
  return 0;
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
  const int64_t la = p.grouped ? 1 : p.l;  // batch of A and C (grouped: one matrix)
  if (p.c_bytes != la * p.m * p.n * ob)
    return Fail(buf, n, "output buffer is %lld bytes, expected L*M*N*%lld = %lld", p.c_bytes, ob,
                la * p.m * p.n * ob);
  if (p.grouped && (p.tile_m < 1 || p.m % p.tile_m != 0))
    return Fail(buf, n, "grouped: M=%lld must be whole tiles of %lld rows", p.m, p.tile_m);
  if (p.grouped && p.table_bytes != 4 * (p.m / p.tile_m))
    return Fail(buf, n, "grouped: the tile table is %lld bytes, expected one int32 per M tile "
                "(%lld)", p.table_bytes, 4 * (p.m / p.tile_m));
  if (p.m == 0 || p.n == 0 || p.l == 0 || p.k == 0) {  // nothing to launch
    *empty = true;
    return nullptr;
  }
  if (p.m * p.k > kInt32Max || p.n * p.k > kInt32Max || p.m * p.n > kInt32Max)
    return Fail(buf, n, "M*K, N*K and M*N must each be below 2^31 (M=%lld N=%lld K=%lld)", p.m,
                p.n, p.k);
  const uint64_t ptrs[5] = {p.a_ptr, p.b_ptr, p.sa_ptr, p.sb_ptr, p.c_ptr};
  for (int i = 0; i < 5; ++i)
    if (ptrs[i] % 16 != 0)
      return Fail(buf, n, "operand %lld (a, b, sfa, sfb, out) is not 16-byte aligned", i);
  if (p.alpha_ptr % 4 != 0) return Fail(buf, n, "alpha is not 4-byte aligned");
  if (p.alpha_bytes < (p.grouped ? 4 * p.l : 4))
    return Fail(buf, n, "alpha must hold one float32 (grouped: one per group)");
  if (p.grouped && p.table_ptr % 4 != 0) return Fail(buf, n, "the tile table is not 4-byte aligned");
  if (p.a_bytes != la * p.m * p.k * ba / 8)
    return Fail(buf, n, "A is %lld bytes, expected %lld (L*M*K packed)", p.a_bytes,
                la * p.m * p.k * ba / 8);
  if (p.b_bytes != p.l * p.n * p.k * bb / 8)
    return Fail(buf, n, "B is %lld bytes, expected %lld (L*N*K packed)", p.b_bytes,
                p.l * p.n * p.k * bb / 8);
  int64_t sk4 = CeilDiv(p.k / Block(p.fmt_a), 4);
  int64_t sa_need = la * CeilDiv(p.m, 128) * sk4 * 512, sb_need = p.l * CeilDiv(p.n, 128) * sk4 * 512;
  if (p.sa_bytes < sa_need)
    return Fail(buf, n, "blocked A scales are %lld bytes, need %lld (padded atoms)", p.sa_bytes, sa_need);
  if (p.sb_bytes < sb_need)
    return Fail(buf, n, "blocked B scales are %lld bytes, need %lld (padded atoms)", p.sb_bytes, sb_need);
  if (p.sm_count < 1) return Fail(buf, n, "sm_count must be positive");
  const Variant* v = nullptr;
  for (int i = 0; i < num_variants && !v; ++i) {
    const Variant& c = variants[i];
    if (c.sm == sm && c.fmt_a == p.fmt_a && c.fmt_b == p.fmt_b && c.out == p.out &&
        c.tile_m == p.tile_m && c.tile_n == p.tile_n && c.cluster_m == p.cluster_m &&
        c.cluster_n == p.cluster_n && c.grouped == p.grouped)
      v = &c;
  }
  if (!v && p.grouped)
    return Fail(buf, n, "no compiled grouped variant with tile %lldx%lld for this pair/output",
                p.tile_m, p.tile_n);
  if (!v)
    return Fail(buf, n, "no compiled variant with tile %lldx%lld for this pair/output (cluster %lld)",
                p.tile_m, p.tile_n, p.cluster_m * 10 + p.cluster_n);
  if (p.k % v->k_align != 0)
    return Fail(buf, n, "K=%lld must be a multiple of %lld for this format pair", p.k, v->k_align);
  if (p.n % v->n_align != 0)
    return Fail(buf, n, "N=%lld must be a multiple of %lld for this output dtype", p.n, v->n_align);
  *found = v;
  return nullptr;
}

}  // namespace jbs_sm100
