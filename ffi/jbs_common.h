// Shared declarations of the sm90 part of the jax_blockscale native library (no XLA, no CUDA
// calls here). The operand-kind and output codes and the kinds' bits and blocks come from the
// generated jbs_codes_sm90.h (python -m jax_blockscale.aot, from jax_blockscale/catalog/sm90.py).
#pragma once
#include <stddef.h>
#include <stdint.h>

#include "jbs_codes_sm90.h"  // generated: JbsKind, JbsOut, jbs_catalog::kKind* tables

#ifndef JBS_EXPORT
#define JBS_EXPORT __attribute__((visibility("default")))
#endif

namespace jbs {
void RecordLoadError(int cuda_error);  // jbs_ffi.cc: remembers the first module-load failure
}

// The generated launchers print module-load errors by default; record them instead so the
// FFI instantiate stage can return them as ffi::Error.
#define CUTE_DSL_CUDA_ERROR_CHECK(err)   \
  do {                                   \
    int jbs_err_ = (int)(err);           \
    if (jbs_err_ != 0) jbs::RecordLoadError(jbs_err_); \
  } while (0)

#ifdef __cplusplus
#include <cuda_runtime_api.h>
namespace jbs {
struct LaunchArgs {
  void *a, *b, *sa, *sb, *c, *alpha;
  int32_t m, n, k, l, a_e5m2, b_e5m2, max_ctas;
  cudaStream_t stream;
  void* ws;        // decode kernel only: f32 workspace, one L*M*N slice per split
  int32_t splits;  // decode kernel only: K ranges per output tile (split-K; the register-weight
                   // variants take theirs in bits 8-15 of a_e5m2 and write partials to c = ws)
  void* items;        // grouped kernels only: int32 work table [num_items, 3]
  int32_t num_items;  // (l is then the number of experts G)
};
// One compiled kernel (a row of the generated table). nt == 0: the fused GEMM
// (kernels/sm90_blockscaled.py, tile_m x tile_n; a_kind JBS_BF16_KPERM: its register-weight
// variants); nt == 1, 2, 4, 8: the decode kernel (kernels/sm90_decode.py), nt n8 tiles of M per
// CTA (tile_m = 8 * nt), tile_n rows of N per CTA, k_chunk K elements per sub-chunk; grouped 1:
// a kernel for ragged_gemm (experts), target jax_blockscale_ragged_gemm_sm90: the decode kernel
// (nt > 0) or the register-weight kernel (nt == 0, prefill sizes); chained 1:
// the decode kernel launched as a programmatic dependent of the activation quantizer (target
// jax_blockscale_quantized_act_gemm_sm90), which waits for it before reading the activation.
struct Variant {
  const char* name;
  int a_kind, b_kind, out, tile_m, tile_n, sm, nt, k_chunk, grouped, chained;
  void (*load)();
  int32_t (*launch)(const LaunchArgs&);
};

// Everything the kernel assumes about one call, as plain numbers (pointers as integers), and
// the variant the planner chose (lowering/plan.py): nt, tile_m, tile_n, and for the decode
// kernel and the dense register-weight variants their split count and workspace (splits 0: a
// fused variant that does not split; a register-weight split runs the f32-output variant, whose
// "output" is the workspace).
struct Problem {
  int a_kind, b_kind, out, a_e5m2, b_e5m2;
  int64_t m, n, k, l;
  uint64_t a_ptr, b_ptr, sa_ptr, sb_ptr, c_ptr, alpha_ptr;
  int64_t a_bytes, b_bytes, sa_bytes, sb_bytes, c_bytes, alpha_bytes;
  int cc_major, cc_minor;
  int sm_count;  // SMs of the device (the fused kernel's persistent grid)
  // 1: A's scales are in the plain layout [L, M, K / block] (the decode kernel reads them so;
  // the fused GEMM needs the blocked layout), 0: blocked.
  int a_scales_plain;
  int nt, tile_m, tile_n, splits;
  uint64_t ws_ptr;  // the split-K f32 workspace (the lowering declares it)
  int64_t ws_bytes;
  // grouped (ragged_gemm): A is one (M, K) activation, B holds L = G experts, C is (M, N),
  // alpha one float per expert, and the rows come from an int32 work table [num_items, 3]
  // (grouped = 1), or (grouped = 2, index mode) from one int32, the expert that owns every row,
  // in num_items = ceil(M / tile_m) items of tile_m rows (`jbs.gemm(..., layer=i)`).
  int grouped;
  uint64_t items_ptr;
  int64_t items_bytes, num_items;
  // the grouped decode kernel: adjacent tiles of N each CTA runs as one stream (1..16; 1 for
  // every other call)
  int tiles_per_cta;
  // 1: the activation comes from the quantizer launched just before in the same call (the
  // chained decode variant runs it); 0: from XLA
  int chained;
  // the decode kernels with splits > 1: 1 = their split partials stay in ws and the caller adds
  // them (c is not written), 0 = their finalize kernel adds them into c; a register-weight
  // variant with splits > 1 always leaves them (1)
  int partials;
};

// Pure check (no CUDA): nullptr when the planned variant is in `variants` and can run `p`
// (returned through *found), else a message.
const char* ValidateProblem(const Problem& p, const Variant* variants, int num_variants,
                            const Variant** found, char* buf, size_t buf_len);
}  // namespace jbs
#endif
