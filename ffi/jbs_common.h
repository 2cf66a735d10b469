// Shared declarations of the jax_blockscale native library (no XLA, no CUDA calls here).
#pragma once
#include <stddef.h>
#include <stdint.h>

// Operand-kind and output codes. Must match jax_blockscale/aot.py (KIND_CODES, OUT_CODES)
// and jax_blockscale/lowering/ffi.py.
// JBS_BF16_KPERM: a bf16 activation whose K runs in the register-weight variants' order
// (kernels/register_weight_order.py); only those variants take it.
enum JbsKind { JBS_NVFP4 = 1, JBS_MXFP4 = 2, JBS_MXFP8 = 3, JBS_BF16 = 4, JBS_BF16_KPERM = 5 };
enum JbsOut { JBS_OUT_BF16 = 1, JBS_OUT_F16 = 2, JBS_OUT_F32 = 3 };

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
  int32_t splits;  // decode kernel only: K ranges per output tile (split-K)
};
// One compiled kernel. nt == 0: the fused GEMM (kernels/sm90_blockscaled.py, tile_m x tile_n);
// nt == 1, 2, 4, 8: the decode kernel (kernels/sm90_decode.py), nt n8 tiles of M per CTA
// (tile_m = 8 * nt), tile_n rows of N per CTA (256; 128 for nt >= 4).
struct Variant {
  const char* name;
  int a_kind, b_kind, out, tile_m, tile_n, sm, nt;
  void (*load)();
  int32_t (*launch)(const LaunchArgs&);
};

// Everything the kernel assumes about one call, as plain numbers (pointers as integers).
struct Problem {
  int a_kind, b_kind, out, a_e5m2, b_e5m2;
  int64_t m, n, k, l;
  uint64_t a_ptr, b_ptr, sa_ptr, sb_ptr, c_ptr, alpha_ptr;
  int64_t a_bytes, b_bytes, sa_bytes, sb_bytes, c_bytes, alpha_bytes;
  int cc_major, cc_minor;
  int sm_count;     // SMs of the device (persistent grid size, tile heuristic)
  int tile_n_pref;  // 0: heuristic; else the tile N to use (JAX_BLOCKSCALE_SM90_TILE_N)
  // Decode workspace (the f32 result buffer the lowering declares). ws_bytes == 0: the caller
  // opted out of the decode kernel (always the fused GEMM).
  uint64_t ws_ptr;
  int64_t ws_bytes;
  // 1: A's scales are in the plain layout [L, M, K / block] (the decode kernel reads them so;
  // the fused GEMM needs the blocked layout), 0: blocked.
  int a_scales_plain;
};

// The decode kernel's dispatch heuristic, a mirror of
// jax_blockscale/kernels/sm90_decode_variants.py: choose_decode_variant (tests check that the two
// agree). Returns true and (nt, splits) when the decode kernel should run the problem.
bool ChooseDecode(int a_kind, int b_kind, int out, int64_t m, int64_t n, int64_t k, int sm_count,
                  int* nt, int* splits);

// What one call runs: the variant and, for the decode kernel, its split count.
struct Dispatch {
  const Variant* variant;
  int splits;  // decode only (0 for the fused GEMM)
};

// Pure check + dispatch (no CUDA): ValidateProblem, then the decode kernel when the caller
// declared a workspace, ChooseDecode accepts and the table has the variant (the workspace and
// the launch grid are validated then), else the fused GEMM. nullptr on success, else a message.
const char* DispatchProblem(const Problem& p, const Variant* variants, int num_variants,
                            Dispatch* out, char* buf, size_t buf_len);

// Tile N for a problem: 64 when 128x128 tiles would leave SMs idle, else 128.
int PreferredTileN(int64_t m, int64_t n, int64_t l, int sm_count);
// Tile (activation rows, weight rows) of the register-weight variants (a_kind JBS_BF16_KPERM).
void RegisterWeightTile(int64_t m, int64_t n, int64_t l, int sm_count, int* tile_m, int* tile_n);

// Pure check (no CUDA): returns nullptr when the kernel can run `p`, else a message.
// `variants` is the compiled table; the matching variant is returned through *found.
const char* ValidateProblem(const Problem& p, const Variant* variants, int num_variants,
                            const Variant** found, char* buf, size_t buf_len);
}  // namespace jbs
#endif
