// Validation of one sm90 GEMM call against every assumption of the variant the planner chose.
// Pure arithmetic: no CUDA calls, so tests can exercise it through jbs_sm90_check_problem
// (ctypes) on a machine without a GPU. The FFI handler calls it before every launch. It decides
// nothing: the variant, tile and split count come from the plan (lowering/plan.py); a call the
// library cannot run is an error, never a different kernel.
#include "jbs_check_common.h"
#include "jbs_common.h"

namespace jbs {
namespace {

using jbs_check::BlockedScaleBytes;
using jbs_check::CeilDiv;
using jbs_check::Fail;
using jbs_check::kInt32Max;

bool KnownKind(int kind) { return kind >= 1 && kind < jbs_catalog::kNumKinds; }
int BlockOf(int kind) { return KnownKind(kind) ? jbs_catalog::kKindBlock[kind] : 0; }
// bytes of one row of K elements (fp4 packed two per byte)
int64_t RowBytes(int kind, int64_t k) {
  return KnownKind(kind) ? k * jbs_catalog::kKindBits[kind] / 8 : -1;
}
int OutBytes(int out) {
  return out >= 1 && out < jbs_catalog::kNumOuts ? jbs_catalog::kOutBytes[out] : 0;
}
const char* KindName(int kind) { return KnownKind(kind) ? jbs_catalog::kKindName[kind] : "unknown"; }

// A grouped kernel's work table: entries (expert, first row, end row), one tile (decode: one
// CTA) per entry and tile of N; or, for the grouped decode kernel's index mode, one int32 (the
// expert) and items of tile_m rows covering M; or, for its sizes mode, the G group sizes from
// which the kernel makes num_items entries.
const char* CheckWorkTable(const Problem& p, const Variant& v, char* buf, size_t n) {
  if (p.num_items < 1 || p.num_items > kInt32Max / CeilDiv(p.n, v.tile_n))
    return Fail(buf, n, "grouped work table of %lld items out of range", (long long)p.num_items);
  if (p.grouped == 2) {
    if (!v.nt) return Fail(buf, n, "index mode needs the grouped decode kernel, not %s", v.name);
    if (p.items_bytes != 4)
      return Fail(buf, n, "the group index has %lld bytes, expected 4 (one int32)",
                  (long long)p.items_bytes);
    if (p.num_items != CeilDiv(p.m, v.tile_m))
      return Fail(buf, n, "index mode needs ceil(M / %d) = %lld items, got %lld", v.tile_m,
                  (long long)CeilDiv(p.m, v.tile_m), (long long)p.num_items);
    return nullptr;
  }
  if (p.grouped == 3) {  // sizes mode: the G raw group sizes; the kernel makes the entries
    if (!v.nt) return Fail(buf, n, "sizes mode needs the grouped decode kernel, not %s", v.name);
    if (p.items_bytes != 4 * p.l)
      return Fail(buf, n, "the group sizes have %lld bytes, expected %lld (G = %lld int32)",
                  (long long)p.items_bytes, (long long)(4 * p.l), (long long)p.l);
    // every real item, the lead and the zero item: at most ceil(M / tile_m) + min(G, M) + 2
    const int64_t bound = CeilDiv(p.m, v.tile_m) + (p.l < p.m ? p.l : p.m) + 2;
    if (p.num_items < bound)
      return Fail(buf, n, "sizes mode needs at least ceil(M / %d) + min(G, M) + 2 = %lld items, "
                  "got %lld", v.tile_m, (long long)bound, (long long)p.num_items);
    return nullptr;
  }
  if (p.grouped != 1) return Fail(buf, n, "grouped mode %d unknown", p.grouped);
  if (p.items_bytes != p.num_items * 12)
    return Fail(buf, n, "grouped work table has %lld bytes, expected %lld (%lld items of 3 "
                "int32)", (long long)p.items_bytes, (long long)(p.num_items * 12),
                (long long)p.num_items);
  return nullptr;
}

// The split-K workspace: one L*M*N f32 slice per split (cells = L*M*N), 32-bit offsets.
const char* CheckSplitWorkspace(const Problem& p, int64_t cells, const char* kernel, char* buf,
                                size_t n) {
  if (p.splits > kInt32Max / cells)
    return Fail(buf, n, "%s workspace too large for 32-bit indexing (%d splits)", kernel,
                p.splits);
  if (p.ws_bytes < p.splits * cells * 4)
    return Fail(buf, n, "%s workspace has %lld bytes, needs %lld (%d splits of L*M*N float32)",
                kernel, (long long)p.ws_bytes, (long long)(p.splits * cells * 4), p.splits);
  if (p.ws_ptr == 0) return Fail(buf, n, "workspace pointer is null");
  if (p.ws_ptr % 16)
    return Fail(buf, n, "workspace pointer 0x%llx is not 16-byte aligned",
                (unsigned long long)p.ws_ptr);
  return nullptr;
}

// The decode kernel's own limits: the workspace, the split count and the launch grid (grouped:
// the work table too).
const char* CheckDecode(const Problem& p, const Variant& v, char* buf, size_t n) {
  // output cells, bounded by INT32_MAX (checked before); a grouped call has one (M, N) output
  const int64_t cells = (p.grouped ? 1 : p.l) * p.m * p.n;
  const int64_t k_chunks = CeilDiv(p.k, v.k_chunk);
  // grid (ceil(N / rows per CTA) * ceil(M / (8 nt)), splits, L): y and z at most 65535
  if (p.splits < 1 || p.splits > k_chunks || p.splits > 65535)
    return Fail(buf, n, "decode split count %d out of range [1, %lld]", p.splits,
                (long long)k_chunks);
  if (const char* why = CheckSplitWorkspace(p, cells, "decode", buf, n)) return why;
  if (p.grouped) return CheckWorkTable(p, v, buf, n);
  if (p.l > 65535 || CeilDiv(p.n, v.tile_n) * CeilDiv(p.m, v.tile_m) > kInt32Max)
    return Fail(buf, n, "decode grid too large (L=%lld, M=%lld)", (long long)p.l, (long long)p.m);
  return nullptr;
}

}  // namespace

const char* ValidateProblem(const Problem& p, const Variant* variants, int num_variants,
                            const Variant** found, char* buf, size_t n) {
  if (found) *found = nullptr;
  if (p.cc_major != 9 || p.cc_minor != 0)
    return Fail(buf, n, "jax_blockscale sm90 kernels need compute capability 9.0 (sm_90a), "
                "device has %d.%d", p.cc_major, p.cc_minor);
  if (!KnownKind(p.a_kind) || !KnownKind(p.b_kind) || !BlockOf(p.b_kind))
    return Fail(buf, n, "unknown operand kinds a=%d b=%d", p.a_kind, p.b_kind);
  if (OutBytes(p.out) == 0) return Fail(buf, n, "unknown output dtype code %d", p.out);
  // The planned variant, exactly. A register-weight split (nt 0, splits > 1) runs the f32
  // variant of the tile: its output is the workspace of f32 partials.
  const bool fused_split = p.nt == 0 && p.splits > 1;
  const int variant_out = fused_split ? JBS_OUT_F32 : p.out;
  const Variant* v = nullptr;
  for (int i = 0; i < num_variants && !v; ++i) {
    const Variant& c = variants[i];
    if (c.sm == 90 && c.a_kind == p.a_kind && c.b_kind == p.b_kind && c.out == variant_out &&
        c.nt == p.nt && c.tile_m == p.tile_m && c.tile_n == p.tile_n &&
        c.grouped == (p.grouped != 0) && c.chained == p.chained)
      v = &c;
  }
  if (!v)
    return Fail(buf, n, "no compiled sm90 %s kernel for %s x %s with output code %d and tile "
                "%dx%d", p.grouped ? (p.nt ? "grouped decode" : "grouped register-weight")
                             : p.chained ? "chained decode" :
                p.nt ? "decode" : "fused",
                KindName(p.a_kind), KindName(p.b_kind), p.out, p.tile_m, p.tile_n);
  if ((p.a_e5m2 != 0 && p.a_e5m2 != 1) || (p.b_e5m2 != 0 && p.b_e5m2 != 1))
    return Fail(buf, n, "a_e5m2/b_e5m2 must be 0 or 1");
  if ((p.a_e5m2 && p.a_kind != JBS_MXFP8) || (p.b_e5m2 && p.b_kind != JBS_MXFP8))
    return Fail(buf, n, "e5m2 elements are only valid for mxfp8 operands");
  if (p.m < 1 || p.n < 1 || p.k < 1 || p.l < 1)
    return Fail(buf, n, "empty problem: M=%lld N=%lld K=%lld L=%lld (M, N, K, L must be >= 1)",
                (long long)p.m, (long long)p.n, (long long)p.k, (long long)p.l);
  // TMA needs 16-byte row pitches: K/2 bytes (fp4), K bytes (fp8), 2K bytes (bf16).
  if (p.k % 32 != 0) return Fail(buf, n, "K=%lld must be a multiple of 32", (long long)p.k);
  const int ba = BlockOf(p.a_kind), bb = BlockOf(p.b_kind);
  if (ba && p.k % ba) return Fail(buf, n, "K=%lld not a multiple of A's block %d", (long long)p.k, ba);
  if (p.k % bb) return Fail(buf, n, "K=%lld not a multiple of B's block %d", (long long)p.k, bb);
  // the register-weight variants permute K within 64-element k-tiles
  if (p.a_kind == JBS_BF16_KPERM && p.k % 64)
    return Fail(buf, n, "K=%lld must be a multiple of 64 for a K-permuted activation",
                (long long)p.k);
  // The kernel indexes A and C with 32-bit integers, and B (TMA: 64-bit addresses, 32-bit
  // coordinates and strides) per batch entry or expert, so a stack of B may pass 2 GiB (its
  // scale rows are checked below). la: batch of A and C (a grouped call has one activation and
  // one output; its L counts the experts of B).
  const int64_t la = p.grouped ? 1 : p.l;
  const int64_t a_row = RowBytes(p.a_kind, p.k), b_row = RowBytes(p.b_kind, p.k);
  if (p.m > kInt32Max / p.n / la || p.m > kInt32Max / a_row / la ||
      p.n > kInt32Max / b_row || p.l > kInt32Max / p.n || p.k > kInt32Max)
    return Fail(buf, n, "problem too large for 32-bit indexing (M=%lld N=%lld K=%lld L=%lld)",
                (long long)p.m, (long long)p.n, (long long)p.k, (long long)p.l);
  // Buffer sizes.
  if (p.a_bytes != la * p.m * a_row)
    return Fail(buf, n, "A buffer has %lld bytes, expected %lld", (long long)p.a_bytes,
                (long long)(la * p.m * a_row));
  if (p.b_bytes != p.l * p.n * b_row)
    return Fail(buf, n, "B buffer has %lld bytes, expected %lld", (long long)p.b_bytes,
                (long long)(p.l * p.n * b_row));
  if (p.a_scales_plain != 0 && p.a_scales_plain != 1)
    return Fail(buf, n, "a_scales_plain must be 0 or 1");
  if (p.a_scales_plain && !ba) return Fail(buf, n, "plain A scales given for an unquantized activation");
  if (p.a_scales_plain && !v->nt)
    return Fail(buf, n, "plain A scales need the decode kernel; the planned %s is a fused "
                "variant", v->name);
  if (ba) {
    const int64_t want = p.a_scales_plain ? la * p.m * (p.k / ba)
                                          : BlockedScaleBytes(la, p.m, p.k, ba);
    if (p.sa_bytes != want)
      return Fail(buf, n, "A scale buffer has %lld bytes, expected %lld (%s layout)",
                  (long long)p.sa_bytes, (long long)want, p.a_scales_plain ? "plain" : "blocked");
  }
  const int64_t want_sb = BlockedScaleBytes(p.l, p.n, p.k, bb);
  if (p.sb_bytes != want_sb)
    return Fail(buf, n, "B scale buffer has %lld bytes, expected %lld (blocked layout)",
                (long long)p.sb_bytes, (long long)want_sb);
  if (p.c_bytes != la * p.m * p.n * OutBytes(p.out))
    return Fail(buf, n, "output buffer has %lld bytes, expected %lld", (long long)p.c_bytes,
                (long long)(la * p.m * p.n * OutBytes(p.out)));
  // a grouped call: one float32 per expert, or (the grouped decode kernel) one for all
  if (p.alpha_bytes != (p.grouped ? 4 * p.l : 4) && !(p.grouped && v->nt && p.alpha_bytes == 4))
    return Fail(buf, n, "alpha must be %s, got %lld bytes",
                p.grouped ? "one float32 per expert" : "one float32", (long long)p.alpha_bytes);
  if (BlockedScaleBytes(p.l, p.n, p.k, bb) / 128 > kInt32Max ||
      (ba && BlockedScaleBytes(la, p.m, p.k, ba) / 128 > kInt32Max))
    return Fail(buf, n, "scale tensors too large for 32-bit indexing");
  // TMA needs 16-byte aligned global addresses.
  const jbs_check::Pointer ptrs[] = {
      {"A", p.a_ptr, 16, true},       {"B", p.b_ptr, 16, true},
      {"A scales", p.sa_ptr, 16, ba != 0}, {"B scales", p.sb_ptr, 16, true},
      {"output", p.c_ptr, OutBytes(p.out), true}, {"alpha", p.alpha_ptr, 4, true},
      {"work table", p.items_ptr, 4, p.grouped != 0}};
  if (const char* why = jbs_check::CheckPointers(ptrs, buf, n)) return why;
  // several tiles of N per CTA: the grouped decode kernel only (bits 8-11 of its a_e5m2)
  if (p.tiles_per_cta != 1 && (!v->nt || !p.grouped || p.tiles_per_cta < 1 ||
                               p.tiles_per_cta > 16))
    return Fail(buf, n, "%d tiles of N per CTA: 1, or 1..16 for the grouped decode kernel",
                p.tiles_per_cta);
  // the split partials left to the caller: the decode kernels (bit 5 of their a_e5m2) and the
  // register-weight splits (always)
  if (p.partials != 0 && (p.partials != 1 || !(v->nt || fused_split)))
    return Fail(buf, n, "partials = %d: 0, or 1 for the decode kernels and register-weight "
                "splits", p.partials);
  // a chained decode variant has no finalize: its caller adds the partials of several splits
  if (v->chained && p.splits > 1 && p.partials != 1)
    return Fail(buf, n, "the chained decode variant %s leaves its %d splits' partials to the "
                "caller (partials = 1)", v->name, p.splits);
  if (v->nt) {
    if (const char* why = CheckDecode(p, *v, buf, n)) return why;
  } else if (fused_split) {  // a dense register-weight variant, K split (bits 8-15 of a_e5m2)
    const int64_t k_tiles = CeilDiv(p.k, 64);
    if (p.a_kind != JBS_BF16_KPERM || p.grouped)
      return Fail(buf, n, "a split count (%d) for the fused variant %s: only the dense "
                  "register-weight variants split K", p.splits, v->name);
    if (p.splits > 255 || p.splits > k_tiles)
      return Fail(buf, n, "register-weight split count %d out of range [2, %lld]", p.splits,
                  (long long)(k_tiles < 255 ? k_tiles : 255));
    if (p.partials != 1)
      return Fail(buf, n, "a register-weight split leaves its partials to the caller "
                  "(partials = 1)");
    if (const char* why = CheckSplitWorkspace(p, p.l * p.m * p.n, "register-weight", buf, n))
      return why;
  } else if (p.splits != 0) {
    return Fail(buf, n, "a split count (%d) for the fused variant %s: 0, or 2 to 255 for the "
                "register-weight variants", p.splits, v->name);
  } else if (p.grouped) {  // the grouped register-weight kernel
    if (const char* why = CheckWorkTable(p, *v, buf, n)) return why;
  }
  if (found) *found = v;
  return nullptr;
}

}  // namespace jbs
