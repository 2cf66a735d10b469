// Declarations of the Blackwell (sm_100a / sm_103a) part of the jax_blockscale native library.
// Self-contained (no jbs_common.h): the sm90 and sm100 handlers are separate translation units.
#pragma once
#include <stddef.h>
#include <stdint.h>

// Format / output codes. Must match jax_blockscale/aot_sm100.py (FMT_CODES, OUT_CODES).
enum JbsSm100Fmt {
  JBS100_NVFP4 = 1, JBS100_MXFP4 = 2, JBS100_MXFP6_E2M3 = 3, JBS100_MXFP6_E3M2 = 4,
  JBS100_MXFP8_E4M3 = 5, JBS100_MXFP8_E5M2 = 6
};
enum JbsSm100Out { JBS100_OUT_BF16 = 1, JBS100_OUT_F16 = 2, JBS100_OUT_F32 = 3 };

#ifndef JBS_EXPORT
#define JBS_EXPORT __attribute__((visibility("default")))
#endif

namespace jbs_sm100 {
void RecordLoadError(int cuda_error);  // jbs_ffi_sm100.cc: first module-load failure
}

// Generated loaders report errors through this macro; record them for the instantiate stage.
#ifdef CUTE_DSL_CUDA_ERROR_CHECK
#undef CUTE_DSL_CUDA_ERROR_CHECK
#endif
#define CUTE_DSL_CUDA_ERROR_CHECK(err)                          \
  do {                                                          \
    int jbs100_err_ = (int)(err);                               \
    if (jbs100_err_ != 0) jbs_sm100::RecordLoadError(jbs100_err_); \
  } while (0)

#ifdef __cplusplus
#include <cuda_runtime_api.h>
namespace jbs_sm100 {
struct LaunchArgs {
  void *a, *b, *sa, *sb, *c, *alpha;
  int32_t m, n, k, l, sm_count;
  cudaStream_t stream;
};
struct Variant {
  const char* name;
  int sm;  // 100 (sm_100a cubin) or 103 (sm_103a cubin)
  int fmt_a, fmt_b, out, tile_m, tile_n, cluster_m, cluster_n, k_align, n_align;
  void (*load)();
  int32_t (*launch)(const LaunchArgs&);
};

// Everything the kernel assumes about one call, as plain numbers (pointers as integers).
// Byte sizes are those of the buffers XLA passes. tile_* = 0: choose with the C++ heuristic
// (ChooseVariant); otherwise the tile the Python lowering chose (choose_sm100_variant).
struct Problem {
  int fmt_a, fmt_b, out;
  int64_t m, n, k, l;
  uint64_t a_ptr, b_ptr, sa_ptr, sb_ptr, c_ptr, alpha_ptr;
  int64_t a_bytes, b_bytes, sa_bytes, sb_bytes, c_bytes, alpha_bytes;
  int cc_major, cc_minor, sm_count;
  int tile_m, tile_n, cluster_m, cluster_n;
};

// The arch code (100 or 103) whose cubins run on this compute capability, or 0.
int ArchFor(int cc_major, int cc_minor);

// C++ mirror of kernels/sm100_blockscaled.py:choose_sm100_variant over the variants of `sm`.
const Variant* ChooseVariant(int64_t m, int64_t n, int64_t k, int fmt_a, int fmt_b, int out,
                             int sm_count, int sm, const Variant* variants, int num_variants);

// Pure check (no CUDA): nullptr when the kernel can run `p` (variant through *found), else why.
// Empty problems (M, N or L == 0, or K == 0) are accepted with *found == nullptr and
// *empty set: the caller writes zeros (K == 0) or nothing.
const char* ValidateProblem(const Problem& p, const Variant* variants, int num_variants,
                            const Variant** found, bool* empty, char* buf, size_t buf_len);
}  // namespace jbs_sm100
#endif
