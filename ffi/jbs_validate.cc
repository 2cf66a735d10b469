// Validation of one GEMM call against every assumption the sm90 kernel makes.
// Pure arithmetic: no CUDA calls, so tests can exercise it through jbs_check_problem (ctypes)
// on a machine without a GPU. The FFI handler calls it before every launch.
#include <stdio.h>
#include <string.h>

#include "jbs_common.h"

namespace jbs {
namespace {

int BlockOf(int kind) {
  switch (kind) {
    case JBS_NVFP4: return 16;
    case JBS_MXFP4: return 32;
    case JBS_MXFP8: return 32;
    default: return 0;  // bf16: no blocks
  }
}
// bytes of packed data per row of K elements
int64_t RowBytes(int kind, int64_t k) {
  switch (kind) {
    case JBS_NVFP4:
    case JBS_MXFP4: return k / 2;
    case JBS_MXFP8: return k;
    case JBS_BF16:
    case JBS_BF16_KPERM: return 2 * k;
    default: return -1;
  }
}
int OutBytes(int out) { return out == JBS_OUT_F32 ? 4 : (out == JBS_OUT_BF16 || out == JBS_OUT_F16) ? 2 : 0; }
int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }
// bytes of a blocked scale tensor [L, ceil(MN/128), ceil(SK/4), 32, 4, 4]
int64_t BlockedScaleBytes(int64_t l, int64_t mn, int64_t k, int block) {
  return l * CeilDiv(mn, 128) * CeilDiv(k / block, 4) * 512;
}
const char* KindName(int kind) {
  switch (kind) {
    case JBS_NVFP4: return "nvfp4";
    case JBS_MXFP4: return "mxfp4";
    case JBS_MXFP8: return "mxfp8";
    case JBS_BF16: return "bf16";
    case JBS_BF16_KPERM: return "bf16 (register-weight K order)";
    default: return "unknown";
  }
}

}  // namespace

int PreferredTileN(int64_t m, int64_t n, int64_t l, int sm_count) {
  // Measured on H100 (docs/sm90_notes.md): 128x64 wins while 128x128 tiles would leave SMs
  // idle; 128x256 wins once it still gives every SM a tile (it re-reads/dequantizes A half as
  // often); 128x128 in between.
  if (sm_count <= 0) return 128;
  if (CeilDiv(m, 128) * CeilDiv(n, 128) * l < sm_count) return 64;
  if (CeilDiv(m, 128) * CeilDiv(n, 256) * l >= sm_count) return 256;
  return 128;
}

void RegisterWeightTile(int64_t m, int64_t n, int64_t l, int sm_count, int* tile_m, int* tile_n) {
  // activation rows: the smallest of 16, 32, 64 that covers M, else 128. Weight rows: 128 (two
  // consumer warp groups per SM) while that gives at least half the SMs a tile, else 64 (one
  // warp group per SM, twice the SMs): H100, 128 x 8192^2 nvfp4 ran 55 us with 128 rows, 35
  // with 64.
  *tile_m = m <= 16 ? 16 : m <= 32 ? 32 : m <= 64 ? 64 : 128;
  *tile_n = 2 * CeilDiv(m, *tile_m) * CeilDiv(n, 128) * l >= sm_count ? 128 : 64;
}

#define JBS_FAIL(...)                        \
  do {                                       \
    snprintf(buf, buf_len, __VA_ARGS__);     \
    return buf;                              \
  } while (0)

const char* ValidateProblem(const Problem& p, const Variant* variants, int num_variants,
                            const Variant** found, char* buf, size_t buf_len) {
  if (found) *found = nullptr;
  const int64_t kInt32Max = 2147483647LL;
  if (p.cc_major != 9 || p.cc_minor != 0)
    JBS_FAIL("jax_blockscale sm90 kernels need compute capability 9.0 (sm_90a), device has %d.%d",
             p.cc_major, p.cc_minor);
  if (p.a_kind < JBS_NVFP4 || p.a_kind > JBS_BF16_KPERM || p.b_kind < JBS_NVFP4 ||
      p.b_kind > JBS_MXFP8)
    JBS_FAIL("unknown operand kinds a=%d b=%d", p.a_kind, p.b_kind);
  if (OutBytes(p.out) == 0) JBS_FAIL("unknown output dtype code %d", p.out);
  // The variant: operand kinds and output must match; among tiles prefer the requested one.
  int want_m = 128, want_n = p.tile_n_pref ? p.tile_n_pref : PreferredTileN(p.m, p.n, p.l, p.sm_count);
  if (p.a_kind == JBS_BF16_KPERM) {
    int rw_n = 0;
    RegisterWeightTile(p.m, p.n, p.l, p.sm_count, &want_m, &rw_n);
    if (!p.tile_n_pref) want_n = rw_n;
  }
  // the preferred tile, else one with tile_n 128 and the preferred tile_m, else any
  auto score = [&](const Variant& c) {
    return 4 * (c.tile_m == want_m) + 2 * (c.tile_n == want_n) + (c.tile_n == 128);
  };
  const Variant* v = nullptr;
  for (int i = 0; i < num_variants; ++i) {
    const Variant& c = variants[i];
    if (c.a_kind == p.a_kind && c.b_kind == p.b_kind && c.out == p.out && c.sm == 90 &&
        c.nt == 0 && (!v || score(c) > score(*v)))
      v = &c;
  }
  if (!v) JBS_FAIL("no sm90 kernel for %s x %s with output code %d", KindName(p.a_kind),
                   KindName(p.b_kind), p.out);
  if ((p.a_e5m2 != 0 && p.a_e5m2 != 1) || (p.b_e5m2 != 0 && p.b_e5m2 != 1))
    JBS_FAIL("a_e5m2/b_e5m2 must be 0 or 1");
  if ((p.a_e5m2 && p.a_kind != JBS_MXFP8) || (p.b_e5m2 && p.b_kind != JBS_MXFP8))
    JBS_FAIL("e5m2 elements are only valid for mxfp8 operands");
  if (p.m < 1 || p.n < 1 || p.k < 1 || p.l < 1)
    JBS_FAIL("empty problem: M=%lld N=%lld K=%lld L=%lld (M, N, K, L must be >= 1)",
             (long long)p.m, (long long)p.n, (long long)p.k, (long long)p.l);
  // TMA needs 16-byte row pitches: K/2 bytes (fp4), K bytes (fp8), 2K bytes (bf16).
  if (p.k % 32 != 0) JBS_FAIL("K=%lld must be a multiple of 32", (long long)p.k);
  const int ba = BlockOf(p.a_kind), bb = BlockOf(p.b_kind);
  if (ba && p.k % ba) JBS_FAIL("K=%lld not a multiple of A's block %d", (long long)p.k, ba);
  if (p.k % bb) JBS_FAIL("K=%lld not a multiple of B's block %d", (long long)p.k, bb);
  // the register-weight variants permute K within 64-element k-tiles
  if (p.a_kind == JBS_BF16_KPERM && p.k % 64)
    JBS_FAIL("K=%lld must be a multiple of 64 for a K-permuted activation", (long long)p.k);
  // The kernel indexes with 32-bit integers.
  const int64_t a_row = RowBytes(p.a_kind, p.k), b_row = RowBytes(p.b_kind, p.k);
  if (p.m > kInt32Max / p.n / p.l || p.m > kInt32Max / a_row / p.l ||
      p.n > kInt32Max / b_row / p.l || p.k > kInt32Max)
    JBS_FAIL("problem too large for 32-bit indexing (M=%lld N=%lld K=%lld L=%lld)",
             (long long)p.m, (long long)p.n, (long long)p.k, (long long)p.l);
  // Buffer sizes.
  const int64_t a_bytes = p.l * p.m * a_row, b_bytes = p.l * p.n * b_row;
  if (p.a_bytes != a_bytes)
    JBS_FAIL("A buffer has %lld bytes, expected %lld", (long long)p.a_bytes, (long long)a_bytes);
  if (p.b_bytes != b_bytes)
    JBS_FAIL("B buffer has %lld bytes, expected %lld", (long long)p.b_bytes, (long long)b_bytes);
  if (p.a_scales_plain != 0 && p.a_scales_plain != 1) JBS_FAIL("a_scales_plain must be 0 or 1");
  if (p.a_scales_plain && !ba) JBS_FAIL("plain A scales given for an unquantized activation");
  if (ba) {
    const int64_t want = p.a_scales_plain ? p.l * p.m * (p.k / ba)
                                          : BlockedScaleBytes(p.l, p.m, p.k, ba);
    if (p.sa_bytes != want)
      JBS_FAIL("A scale buffer has %lld bytes, expected %lld (%s layout)", (long long)p.sa_bytes,
               (long long)want, p.a_scales_plain ? "plain" : "blocked");
  }
  const int64_t want_sb = BlockedScaleBytes(p.l, p.n, p.k, bb);
  if (p.sb_bytes != want_sb)
    JBS_FAIL("B scale buffer has %lld bytes, expected %lld (blocked layout)",
             (long long)p.sb_bytes, (long long)want_sb);
  if (p.c_bytes != p.l * p.m * p.n * OutBytes(p.out))
    JBS_FAIL("output buffer has %lld bytes, expected %lld", (long long)p.c_bytes,
             (long long)(p.l * p.m * p.n * OutBytes(p.out)));
  if (p.alpha_bytes != 4) JBS_FAIL("alpha must be one float32, got %lld bytes", (long long)p.alpha_bytes);
  if (BlockedScaleBytes(p.l, p.n, p.k, bb) / 128 > kInt32Max ||
      (ba && BlockedScaleBytes(p.l, p.m, p.k, ba) / 128 > kInt32Max))
    JBS_FAIL("scale tensors too large for 32-bit indexing");
  // Alignment: TMA needs 16-byte aligned global addresses.
  struct { const char* name; uint64_t ptr; int align; bool used; } ptrs[] = {
      {"A", p.a_ptr, 16, true},       {"B", p.b_ptr, 16, true},
      {"A scales", p.sa_ptr, 16, ba != 0}, {"B scales", p.sb_ptr, 16, true},
      {"output", p.c_ptr, OutBytes(p.out), true}, {"alpha", p.alpha_ptr, 4, true}};
  for (const auto& q : ptrs) {
    if (!q.used) continue;
    if (q.ptr == 0) JBS_FAIL("%s pointer is null", q.name);
    if (q.ptr % q.align) JBS_FAIL("%s pointer 0x%llx is not %d-byte aligned", q.name,
                                  (unsigned long long)q.ptr, q.align);
  }
  if (found) *found = v;
  return nullptr;
}

// ---- the decode kernel ---------------------------------------------------------------------------
// Constants of kernels/sm90_decode_variants.py (MAX_M, tuning_for(nt) and the CTA shape).
namespace {
constexpr int kDecodeMaxM = 64;        // past this the tensor-core GEMM wins
constexpr int kDecodeStepBytes = 64;   // bytes of one weight row per step
// n8 tiles of M per CTA (nt_for): M <= 8, 16, 32, 64
int DecodeNt(int64_t m) { return m <= 8 ? 1 : m <= 16 ? 2 : m <= 32 ? 4 : 8; }
// NARROW_TUNING (nt 1): 128 rows of N per CTA, 4-step sub-chunks, 2 CTAs per SM;
// DEFAULT_TUNING (nt 2): 256 rows, 4-step sub-chunks, 1 CTA per SM;
// WIDE_TUNING (nt 4, 8): 128 rows, 2-step sub-chunks, 2 CTAs per SM
int DecodeRowsPerCta(int nt) { return nt == 2 ? 256 : 128; }
int DecodeSubSteps(int nt) { return nt <= 2 ? 4 : 2; }
int DecodeCtasPerSm(int nt) { return nt == 2 ? 1 : 2; }
int BitsOf(int kind) { return kind == JBS_MXFP8 ? 8 : (kind == JBS_BF16 ? 16 : 4); }
int64_t DecodeKChunks(int b_kind, int64_t k, int nt) {
  const int64_t chunk = DecodeSubSteps(nt) * (kDecodeStepBytes * 8 / BitsOf(b_kind));
  return CeilDiv(k, chunk);
}
}  // namespace

bool ChooseDecode(int a_kind, int b_kind, int out, int64_t m, int64_t n, int64_t k, int sm_count,
                  int* nt_out, int* splits_out) {
  // pairs: weight-only (bf16 x {nvfp4, mxfp4, mxfp8}) and same-kind quantized pairs
  if (b_kind != JBS_NVFP4 && b_kind != JBS_MXFP4 && b_kind != JBS_MXFP8) return false;
  if (a_kind != JBS_BF16 && a_kind != b_kind) return false;
  if (out != JBS_OUT_BF16 && out != JBS_OUT_F16 && out != JBS_OUT_F32) return false;
  if (m < 1 || n < 1 || k < 32 || k % 32 || k % BlockOf(b_kind)) return false;
  if (m > kDecodeMaxM) return false;
  const int nt = DecodeNt(m);
  const int64_t k_chunks = DecodeKChunks(b_kind, k, nt);
  const int64_t ctas = CeilDiv(n, DecodeRowsPerCta(nt)) * CeilDiv(m, 8 * nt);
  int64_t want = (int64_t)DecodeCtasPerSm(nt) * sm_count / (ctas > 1 ? ctas : 1);
  int64_t splits = k_chunks < want ? k_chunks : want;
  if (splits < 1) splits = 1;
  const int64_t per = CeilDiv(k_chunks, splits);  // equal sub-chunks per split
  splits = CeilDiv(k_chunks, per);
  if (nt_out) *nt_out = nt;
  if (splits_out) *splits_out = (int)splits;
  return true;
}

const char* DispatchProblem(const Problem& p, const Variant* variants, int num_variants,
                            Dispatch* out, char* buf, size_t buf_len) {
  const Variant* main = nullptr;
  if (out) *out = Dispatch{nullptr, 0};
  // Every assumption of the fused GEMM holds for the decode kernel too (16-byte aligned operands,
  // K % 32, K % block, exact buffer sizes, 32-bit indexing), and the decode pairs are a subset.
  if (const char* why = ValidateProblem(p, variants, num_variants, &main, buf, buf_len)) return why;
  if (p.ws_bytes < 0) JBS_FAIL("negative workspace size");
  int nt = 0, splits = 0;
  const Variant* dec = nullptr;
  if (p.ws_bytes > 0 &&
      ChooseDecode(p.a_kind, p.b_kind, p.out, p.m, p.n, p.k, p.sm_count, &nt, &splits)) {
    for (int i = 0; i < num_variants; ++i) {
      const Variant& c = variants[i];
      if (c.nt == nt && c.a_kind == p.a_kind && c.b_kind == p.b_kind && c.out == p.out &&
          c.sm == 90) dec = &c;
    }
  }
  if (!dec) {  // the fused GEMM
    if (p.a_scales_plain)
      JBS_FAIL("plain A scales need the decode kernel, which does not run this call (M=%lld)",
               (long long)p.m);
    if (out) *out = Dispatch{main, 0};
    return nullptr;
  }
  const int64_t kInt32Max = 2147483647LL;
  const int64_t cells = p.l * p.m * p.n;  // ValidateProblem bounded it by INT32_MAX
  if (p.ws_bytes < cells * 4)
    JBS_FAIL("decode workspace has %lld bytes, needs %lld (L*M*N float32 per split)",
             (long long)p.ws_bytes, (long long)(cells * 4));
  if (p.ws_ptr == 0) JBS_FAIL("workspace pointer is null");
  if (p.ws_ptr % 16)
    JBS_FAIL("workspace pointer 0x%llx is not 16-byte aligned", (unsigned long long)p.ws_ptr);
  const int64_t k_chunks = DecodeKChunks(p.b_kind, p.k, nt);
  // The workspace holds one L*M*N slice per split (the kernel's finalize indexes it with 32-bit
  // offsets): a workspace sized for a GPU with fewer SMs takes fewer, equal splits.
  int64_t fit = p.ws_bytes / (cells * 4);
  if (fit > kInt32Max / cells) fit = kInt32Max / cells;
  if (splits > fit) {
    const int64_t per = CeilDiv(k_chunks, fit);
    splits = (int)CeilDiv(k_chunks, per);
  }
  // launch grid (ceil(N / rows per CTA) * ceil(M / (8 nt)), splits, L): y and z at most 65535
  if (splits < 1 || splits > k_chunks || splits > 65535)
    JBS_FAIL("decode split count %d out of range [1, %lld]", splits, (long long)k_chunks);
  if (p.l > 65535 || CeilDiv(p.n, DecodeRowsPerCta(nt)) * CeilDiv(p.m, 8 * nt) > kInt32Max)
    JBS_FAIL("decode grid too large (L=%lld, M=%lld)", (long long)p.l, (long long)p.m);
  if (out) *out = Dispatch{dec, splits};
  return nullptr;
}

}  // namespace jbs
