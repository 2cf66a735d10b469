// XLA FFI handler: a bf16 GEMM whose f32 sum is scaled by a device-resident alpha before its
// single rounding to the output type. cuBLASLt does the work (its epilogue applies alpha); the
// library is the libcublasLt.so.13 that JAX's CUDA plugin has loaded, found with dlopen.
//
//   target "jax_blockscale_dot_alpha"
//   operands: a (bf16) [L, M, K], b (bf16) [L, N, K], alpha_beta (f32) [2] = (alpha, 0)
//   results:  c (bf16 | f32) [L, M, N] = alpha * (a @ b^T), summed in f32
//             ws (u8) [W]: cuBLASLt's workspace (declared by the lowering: nothing is allocated
//                          at run time)
//
// The first call of each shape times the heuristic's candidate algorithms on its own buffers and
// keeps the fastest (it synchronizes the stream once); later calls only launch the GEMM.
//
// Why it exists: at large M the sm90 backend dequantizes both operands to bf16 and runs a GEMM
// (lowering/ffi.py). With a global scale (NVFP4) alpha must scale the f32 sum before it is
// rounded, so XLA's dot has to write M*N f32 values and a second pass reads them back: ~8 % of an
// 8192^3 call on an H100 (docs/design/large_m.md). Here alpha rides in the GEMM's epilogue instead.
//
// alpha stays on the device (it is a traced value): CUBLASLT_POINTER_MODE_DEVICE, which takes
// beta from the device too, hence the (alpha, 0) pair. On the H100 that mode is the only one of
// the device modes cuBLASLt 13 has bf16 algorithms for (the alpha-vector modes: "not supported"),
// and with beta = 0 it leaves C alone: an output buffer filled with NaN before the call came back
// bitwise equal to XLA's f32 dot scaled and rounded (docs/design/large_m.md).
#include <cuda_runtime_api.h>
#include <dlfcn.h>

#include <stdlib.h>

#include <map>
#include <mutex>
#include <string>
#include <tuple>
#include <vector>

#include "jbs_common.h"        // JBS_EXPORT
#include "jbs_cublaslt_api.h"  // the cuBLASLt functions and values used here
#include "jbs_ffi_common.h"    // JBS_FFI_EXPORT_HANDLER
#include "xla/ffi/api/ffi.h"

namespace jbs_dot_alpha {
namespace {

namespace ffi = xla::ffi;
namespace lt = jbs_cublaslt;

constexpr const char* kPrefix = "jax_blockscale dot_alpha: ";
constexpr int64_t kRowAlign = 8;  // bf16 elements in 16 bytes: what cuBLASLt's fast kernels want
using jbs_ffi::kMaxDevices;

ffi::Error Invalid(const std::string& why) { return ffi::Error::InvalidArgument(kPrefix + why); }
ffi::Error Internal(const std::string& why) {
  return ffi::Error(ffi::ErrorCode::kInternal, kPrefix + why);
}

// ---- cuBLASLt, resolved once from the already-loaded library ----
struct Api {
  lt::CreateFn create;
  lt::GetStatusStringFn status_string;
  lt::MatmulDescCreateFn desc_create;
  lt::MatmulDescSetAttributeFn desc_set;
  lt::MatrixLayoutCreateFn layout_create;
  lt::MatrixLayoutSetAttributeFn layout_set;
  lt::PreferenceCreateFn pref_create;
  lt::PreferenceDestroyFn pref_destroy;
  lt::PreferenceSetAttributeFn pref_set;
  lt::AlgoGetHeuristicFn heuristic;
  lt::MatmulFn matmul;
};

constexpr const char* kLibName = "libcublasLt.so.13";

std::once_flag g_api_once;
Api g_api{};
std::string g_api_error;  // empty: g_api is usable

template <class Fn>
bool Resolve(void* lib, const char* name, Fn* out) {
  *out = reinterpret_cast<Fn>(dlsym(lib, name));
  if (*out == nullptr) g_api_error = std::string("symbol ") + name + " missing in " + kLibName;
  return *out != nullptr;
}

void LoadApi() {
  // JAX's CUDA plugin loads cuBLASLt with its own GEMMs; take that copy (RTLD_NOLOAD), else let
  // the dynamic loader search for one.
  void* lib = dlopen(kLibName, RTLD_NOW | RTLD_LOCAL | RTLD_NOLOAD);
  if (lib == nullptr) lib = dlopen(kLibName, RTLD_NOW | RTLD_LOCAL);
  if (lib == nullptr) {
    const char* why = dlerror();
    g_api_error = std::string("cannot load ") + kLibName + " (installed with jax[cuda13]): " +
                  (why ? why : "not found");
    return;
  }
  Api a{};
  if (Resolve(lib, "cublasLtCreate", &a.create) &&
      Resolve(lib, "cublasLtGetStatusString", &a.status_string) &&
      Resolve(lib, "cublasLtMatmulDescCreate", &a.desc_create) &&
      Resolve(lib, "cublasLtMatmulDescSetAttribute", &a.desc_set) &&
      Resolve(lib, "cublasLtMatrixLayoutCreate", &a.layout_create) &&
      Resolve(lib, "cublasLtMatrixLayoutSetAttribute", &a.layout_set) &&
      Resolve(lib, "cublasLtMatmulPreferenceCreate", &a.pref_create) &&
      Resolve(lib, "cublasLtMatmulPreferenceDestroy", &a.pref_destroy) &&
      Resolve(lib, "cublasLtMatmulPreferenceSetAttribute", &a.pref_set) &&
      Resolve(lib, "cublasLtMatmulAlgoGetHeuristic", &a.heuristic) &&
      Resolve(lib, "cublasLtMatmul", &a.matmul))
    g_api = a;
}

ffi::Error GetApi(const Api** out) {
  std::call_once(g_api_once, LoadApi);
  if (!g_api_error.empty()) return Internal(g_api_error);
  *out = &g_api;
  return ffi::Error::Success();
}

ffi::Error LtError(const Api& api, const char* what, lt::Status s) {
  return Internal(std::string(what) + ": " + api.status_string(s));
}

// ---- per-device handle and per-problem plan (descriptors + the fastest algorithm) ----
struct Plan {
  lt::MatmulDesc desc;
  lt::MatrixLayout a, b, d;  // cuBLASLt's A, B (our b, a: see MakePlan) and C = D
  std::vector<lt::MatmulAlgo> candidates;  // the heuristic's, best guess first
  lt::MatmulAlgo algo;  // the one that runs: the fastest candidate, timed on the first call
  bool tuned;
};

// The buffers of one call.
struct Operands {
  const float* alpha_beta;
  const void *a, *b;
  void *c, *ws;
  size_t ws_bytes;
  cudaStream_t stream;
};

// (device, L, M, N, K, output dtype, workspace bytes)
using PlanKey = std::tuple<int, int64_t, int64_t, int64_t, int64_t, int, int64_t>;

std::mutex g_mu;
lt::Handle g_handles[kMaxDevices] = {};
std::map<PlanKey, Plan> g_plans;  // never freed: a few descriptors per distinct shape

ffi::Error GetHandle(const Api& api, int dev, lt::Handle* out) {
  std::lock_guard<std::mutex> lock(g_mu);
  if (g_handles[dev] == nullptr) {
    if (lt::Status s = api.create(&g_handles[dev]); s != lt::kStatusSuccess)
      return LtError(api, "cublasLtCreate", s);
  }
  *out = g_handles[dev];
  return ffi::Error::Success();
}

cudaDataType OutType(ffi::DataType t) {
  return t == ffi::DataType::BF16 ? CUDA_R_16BF : CUDA_R_32F;
}

// cuBLASLt is column-major. Our row-major C[M, N] = A[M, K] B[N, K]^T is its column-major
// C^T (N x M) = op(B) op(A) with op(B) = B^T read from b's K x N column-major storage and op(A)
// = a's K x M storage as is ("TN", the layout Hopper's GEMMs prefer).
// candidates: how many of the heuristic's algorithms the first call of a shape times (XLA
// autotunes its own GEMMs the same way; the `candidates` attribute, from
// JAX_BLOCKSCALE_DOT_ALPHA_CANDIDATES, default 8; 1 takes the heuristic's first choice untimed).
ffi::Error MakePlan(const Api& api, lt::Handle h, int64_t l, int64_t m, int64_t n, int64_t k,
                    ffi::DataType c_type, int64_t ws_bytes, int candidates, Plan* p) {
  auto check = [&](const char* what, lt::Status s) {
    return s == lt::kStatusSuccess ? ffi::Error::Success() : LtError(api, what, s);
  };
  const int32_t trans_a = lt::kOpT, trans_b = lt::kOpN;
  const int32_t mode = lt::kPointerModeDevice;
  if (auto e = check("matmul descriptor", api.desc_create(&p->desc, lt::kComputeF32, CUDA_R_32F));
      e.failure())
    return e;
  if (auto e = check("transa", api.desc_set(p->desc, lt::kDescTransA, &trans_a, sizeof(trans_a)));
      e.failure())
    return e;
  if (auto e = check("transb", api.desc_set(p->desc, lt::kDescTransB, &trans_b, sizeof(trans_b)));
      e.failure())
    return e;
  if (auto e = check("pointer mode", api.desc_set(p->desc, lt::kDescPointerMode, &mode,
                                                  sizeof(mode)));
      e.failure())
    return e;
  struct LayoutSpec { lt::MatrixLayout* out; cudaDataType type; int64_t rows, cols; };
  const LayoutSpec layouts[] = {{&p->a, CUDA_R_16BF, k, n},  // our b
                                {&p->b, CUDA_R_16BF, k, m},  // our a
                                {&p->d, OutType(c_type), n, m}};
  const int32_t batch = static_cast<int32_t>(l);
  for (const LayoutSpec& s : layouts) {
    const int64_t stride = s.rows * s.cols;
    if (auto e = check("matrix layout", api.layout_create(s.out, s.type, s.rows, s.cols, s.rows));
        e.failure())
      return e;
    if (auto e = check("batch count", api.layout_set(*s.out, lt::kLayoutBatchCount, &batch,
                                                     sizeof(batch)));
        e.failure())
      return e;
    if (auto e = check("batch stride", api.layout_set(*s.out, lt::kLayoutBatchStride, &stride,
                                                      sizeof(stride)));
        e.failure())
      return e;
  }
  lt::Preference pref = nullptr;
  if (auto e = check("preference", api.pref_create(&pref)); e.failure()) return e;
  const uint64_t max_ws = static_cast<uint64_t>(ws_bytes);
  lt::Status s = api.pref_set(pref, lt::kPrefMaxWorkspace, &max_ws, sizeof(max_ws));
  std::vector<lt::HeuristicResult> results(candidates < 1 ? 1 : candidates > 32 ? 32 : candidates);
  int found = 0;
  if (s == lt::kStatusSuccess)
    s = api.heuristic(h, p->desc, p->a, p->b, p->d, p->d, pref, static_cast<int>(results.size()),
                      results.data(), &found);
  api.pref_destroy(pref);
  if (s != lt::kStatusSuccess) return LtError(api, "cublasLtMatmulAlgoGetHeuristic", s);
  for (int i = 0; i < found; ++i)
    if (results[i].state == lt::kStatusSuccess) p->candidates.push_back(results[i].algo);
  if (p->candidates.empty())
    return Internal("cuBLASLt has no algorithm for L=" + std::to_string(l) + " M=" +
                    std::to_string(m) + " N=" + std::to_string(n) + " K=" + std::to_string(k));
  p->algo = p->candidates[0];
  p->tuned = p->candidates.size() == 1;
  return ffi::Error::Success();
}

lt::Status RunMatmul(const Api& api, lt::Handle h, const Plan& p, const lt::MatmulAlgo& algo,
                     const Operands& o) {
  // beta = alpha_beta[1] = 0: C (the output buffer) is not read
  return api.matmul(h, p.desc, o.alpha_beta, o.b, p.a, o.a, p.b, o.alpha_beta + 1, o.c, p.d,
                    o.c, p.d, &algo, o.ws, o.ws_bytes, o.stream);
}

// Times every candidate on this call's buffers (3 runs each after a warm-up, CUDA events on
// XLA's stream) and keeps the fastest; once per plan. The runs only write c and ws, which the
// real call then overwrites.
ffi::Error Tune(const Api& api, lt::Handle h, Plan* p, const Operands& o) {
  cudaEvent_t start = nullptr, stop = nullptr;
  cudaError_t e = cudaEventCreate(&start);
  if (e == cudaSuccess) e = cudaEventCreate(&stop);
  float best_ms = -1.0f;
  for (const lt::MatmulAlgo& algo : p->candidates) {
    if (e != cudaSuccess) break;
    if (RunMatmul(api, h, *p, algo, o) != lt::kStatusSuccess) continue;  // skip what fails
    bool ran = true;
    e = cudaEventRecord(start, o.stream);
    for (int r = 0; r < 3 && ran && e == cudaSuccess; ++r)
      ran = RunMatmul(api, h, *p, algo, o) == lt::kStatusSuccess;
    if (e == cudaSuccess) e = cudaEventRecord(stop, o.stream);
    if (e == cudaSuccess) e = cudaEventSynchronize(stop);
    float ms = 0.0f;
    if (e == cudaSuccess) e = cudaEventElapsedTime(&ms, start, stop);
    if (e == cudaSuccess && ran && (best_ms < 0.0f || ms < best_ms)) {
      best_ms = ms;
      p->algo = algo;
    }
  }
  if (start) cudaEventDestroy(start);
  if (stop) cudaEventDestroy(stop);
  if (e != cudaSuccess)
    return Internal(std::string("timing the cuBLASLt candidates: ") + cudaGetErrorString(e));
  if (best_ms < 0.0f) return Internal("none of cuBLASLt's candidate algorithms ran");
  p->tuned = true;
  return ffi::Error::Success();
}

// The plan of `key`, made and tuned on first use (under the lock: one tuning per shape).
ffi::Error GetPlan(const Api& api, lt::Handle h, const PlanKey& key, const Operands& o,
                   int candidates, const Plan** out) {
  std::lock_guard<std::mutex> lock(g_mu);
  auto it = g_plans.find(key);
  if (it == g_plans.end()) {
    Plan p{};
    auto [dev, l, m, n, k, c_code, ws_bytes] = key;
    const auto c_type = static_cast<ffi::DataType>(c_code);
    if (auto e = MakePlan(api, h, l, m, n, k, c_type, ws_bytes, candidates, &p);
        e.failure())
      return e;
    it = g_plans.emplace(key, p).first;
  }
  if (!it->second.tuned)
    if (auto e = Tune(api, h, &it->second, o); e.failure()) return e;
  *out = &it->second;
  return ffi::Error::Success();
}

// ---- the call's checks (everything the lowering promises, checked again) ----
ffi::Error Validate(const ffi::AnyBuffer& a, const ffi::AnyBuffer& b,
                    const ffi::AnyBuffer& alpha_beta,
                    const ffi::AnyBuffer& c, const ffi::AnyBuffer& ws) {
  using T = ffi::DataType;
  if (a.element_type() != T::BF16 || b.element_type() != T::BF16)
    return Invalid("a and b must be bfloat16");
  if (alpha_beta.element_type() != T::F32) return Invalid("alpha_beta must be float32");
  const T ct = c.element_type();
  // cuBLASLt has bf16 x bf16 GEMMs into bf16 and f32 only (f16: "not supported")
  if (ct != T::BF16 && ct != T::F32) return Invalid("the output must be bfloat16 or float32");
  if (ws.element_type() != T::U8) return Invalid("the workspace must be uint8");
  auto ad = a.dimensions(), bd = b.dimensions(), cd = c.dimensions();
  if (ad.size() != 3 || bd.size() != 3 || cd.size() != 3)
    return Invalid("a, b and c must be rank 3: [L, M, K], [L, N, K], [L, M, N]");
  const int64_t l = ad[0], m = ad[1], k = ad[2], n = bd[1];
  if (l < 1 || m < 1 || n < 1 || k < 1) return Invalid("empty problem");
  if (bd[0] != l || bd[2] != k) return Invalid("b must be [L, N, K] with a's L and K");
  if (cd[0] != l || cd[1] != m || cd[2] != n) return Invalid("c must be [L, M, N]");
  if (alpha_beta.element_count() != 2) return Invalid("alpha_beta must hold 2 values (alpha, 0)");
  if (k % kRowAlign != 0 || n % kRowAlign != 0)
    return Invalid("K and N must be multiples of 8 (16-byte rows)");
  if (l > 0x7fffffff) return Invalid("L must fit in int32");
  return ffi::Error::Success();
}

ffi::Error CurrentDevice(int* dev) {
  if (cudaError_t e = cudaGetDevice(dev); e != cudaSuccess)
    return Internal(std::string("cudaGetDevice: ") + cudaGetErrorString(e));
  if (*dev < 0 || *dev >= kMaxDevices) return Internal("device ordinal too large");
  return ffi::Error::Success();
}

// Instantiate: load cuBLASLt and create this device's handle before any stream work.
ffi::Error Instantiate() {
  int dev = 0;
  if (auto e = CurrentDevice(&dev); e.failure()) return e;
  const Api* api = nullptr;
  if (auto e = GetApi(&api); e.failure()) return e;
  lt::Handle h = nullptr;
  return GetHandle(*api, dev, &h);
}

ffi::Error Execute(cudaStream_t stream, ffi::AnyBuffer a, ffi::AnyBuffer b,
                   ffi::AnyBuffer alpha_beta_buf,
                   ffi::Result<ffi::AnyBuffer> c, ffi::Result<ffi::AnyBuffer> ws,
                   int32_t candidates) {
  if (auto e = Validate(a, b, alpha_beta_buf, *c, *ws); e.failure()) return e;
  int dev = 0;
  if (auto e = CurrentDevice(&dev); e.failure()) return e;
  const Api* api = nullptr;
  if (auto e = GetApi(&api); e.failure()) return e;
  lt::Handle h = nullptr;
  if (auto e = GetHandle(*api, dev, &h); e.failure()) return e;
  auto ad = a.dimensions();
  const int64_t ws_bytes = static_cast<int64_t>(ws->size_bytes());
  const PlanKey key{dev, ad[0], ad[1], b.dimensions()[1], ad[2],
                    static_cast<int>(c->element_type()), ws_bytes};
  const Operands o{static_cast<const float*>(alpha_beta_buf.untyped_data()), a.untyped_data(),
                   b.untyped_data(), c->untyped_data(), ws->untyped_data(),
                   static_cast<size_t>(ws_bytes), stream};
  const Plan* p = nullptr;
  if (auto e = GetPlan(*api, h, key, o, candidates, &p); e.failure()) return e;
  if (lt::Status s = RunMatmul(*api, h, *p, p->algo, o); s != lt::kStatusSuccess)
    return LtError(*api, "cublasLtMatmul", s);
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jbs_dot_alpha

JBS_FFI_EXPORT_HANDLER(jax_blockscale_dot_alpha_instantiate, jbs_dot_alpha::Instantiate,
                       xla::ffi::Ffi::BindInstantiate());

JBS_FFI_EXPORT_HANDLER(jax_blockscale_dot_alpha, jbs_dot_alpha::Execute,
                       xla::ffi::Ffi::Bind()
                           .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                           .Arg<xla::ffi::AnyBuffer>()   // a
                           .Arg<xla::ffi::AnyBuffer>()   // b
                           .Arg<xla::ffi::AnyBuffer>()   // alpha_beta
                           .Ret<xla::ffi::AnyBuffer>()   // c
                           .Ret<xla::ffi::AnyBuffer>()   // ws
                           .Attr<int32_t>("candidates"));
