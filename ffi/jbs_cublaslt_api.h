// The part of cuBLASLt's C API that jbs_dot_alpha.cc calls, declared here because the build
// machine's CUDA toolkit ships no cublasLt.h (cuBLAS comes as its own wheel, nvidia-cublas, which
// JAX's CUDA plugin installs and loads). The library is not linked: jbs_dot_alpha.cc finds the
// libcublasLt.so.13 that JAX has already loaded (dlopen) and takes these functions from it.
//
// Every type, value and signature below is copied by hand from cublasLt.h / cublas_api.h of
// nvidia-cublas 13.10.0.20 and is part of cuBLAS's stable C ABI within major version 13.
// tests/test_dot_alpha.py compiles static_asserts of these values against a real cublasLt.h
// wherever one is installed (the GPU machine's JAX environment has one).
#pragma once
#include <library_types.h>  // cudaDataType (CUDA toolkit)
#include <stddef.h>
#include <stdint.h>

#include <cuda_runtime_api.h>  // cudaStream_t

namespace jbs_cublaslt {

using Status = int;  // cublasStatus_t
constexpr Status kStatusSuccess = 0;  // CUBLAS_STATUS_SUCCESS

using Handle = struct cublasLtContext*;  // cublasLtHandle_t
struct MatmulAlgo { uint64_t data[8]; };  // cublasLtMatmulAlgo_t
using MatmulDesc = void*;     // cublasLtMatmulDesc_t (pointer to a semi-opaque struct)
using MatrixLayout = void*;   // cublasLtMatrixLayout_t
using Preference = void*;     // cublasLtMatmulPreference_t

struct HeuristicResult {  // cublasLtMatmulHeuristicResult_t
  MatmulAlgo algo;
  size_t workspace_size;
  Status state;
  float waves_count;
  int reserved[4];
};

// enum values (all int32 in the API)
constexpr int kComputeF32 = 68;  // CUBLAS_COMPUTE_32F
constexpr int kOpN = 0, kOpT = 1;  // CUBLAS_OP_N, CUBLAS_OP_T
constexpr int kPointerModeDevice = 1;  // CUBLASLT_POINTER_MODE_DEVICE
constexpr int kDescPointerMode = 2;    // CUBLASLT_MATMUL_DESC_POINTER_MODE
constexpr int kDescTransA = 3;         // CUBLASLT_MATMUL_DESC_TRANSA
constexpr int kDescTransB = 4;         // CUBLASLT_MATMUL_DESC_TRANSB
constexpr int kLayoutBatchCount = 5;   // CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT
constexpr int kLayoutBatchStride = 6;  // CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET
constexpr int kPrefMaxWorkspace = 1;   // CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES

// The functions, as pointer types (resolved with dlsym under their cuBLASLt names).
using CreateFn = Status (*)(Handle*);
using GetStatusStringFn = const char* (*)(Status);
using MatmulDescCreateFn = Status (*)(MatmulDesc*, int compute_type, cudaDataType scale_type);
using MatmulDescDestroyFn = Status (*)(MatmulDesc);
using MatmulDescSetAttributeFn = Status (*)(MatmulDesc, int attr, const void* buf, size_t size);
using MatrixLayoutCreateFn = Status (*)(MatrixLayout*, cudaDataType type, uint64_t rows,
                                        uint64_t cols, int64_t ld);
using MatrixLayoutDestroyFn = Status (*)(MatrixLayout);
using MatrixLayoutSetAttributeFn = Status (*)(MatrixLayout, int attr, const void* buf,
                                              size_t size);
using PreferenceCreateFn = Status (*)(Preference*);
using PreferenceDestroyFn = Status (*)(Preference);
using PreferenceSetAttributeFn = Status (*)(Preference, int attr, const void* buf, size_t size);
using AlgoGetHeuristicFn = Status (*)(Handle, MatmulDesc, MatrixLayout a, MatrixLayout b,
                                      MatrixLayout c, MatrixLayout d, Preference,
                                      int requested, HeuristicResult* results, int* returned);
using MatmulFn = Status (*)(Handle, MatmulDesc, const void* alpha, const void* a, MatrixLayout,
                            const void* b, MatrixLayout, const void* beta, const void* c,
                            MatrixLayout, void* d, MatrixLayout, const MatmulAlgo* algo,
                            void* workspace, size_t workspace_bytes, cudaStream_t stream);

}  // namespace jbs_cublaslt
