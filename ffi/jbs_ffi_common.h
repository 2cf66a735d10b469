// Code shared by the two XLA FFI handlers, jbs_ffi.cc (sm90) and jbs_ffi_sm100.cc (sm100): the
// per-device info cache, module loading with the recorded load error, buffer-dtype checks,
// filling the buffer fields of a Problem and the launch. The handlers were copies of each other.
//
// Header-only (inline functions and templates, hidden by -fvisibility=hidden /
// VISIBILITY_INLINES_HIDDEN): CMakeLists.txt needs no new source and no symbol is exported. Each
// handler keeps its own state (one HandlerState object per .cc) and its own message prefix, so
// both return exactly the errors they returned before. No jbs_common.h / jbs_sm100.h here: the
// two handlers include different ones.
#pragma once
#include <cuda_runtime_api.h>

#include <stdint.h>

#include <atomic>
#include <initializer_list>
#include <mutex>
#include <string>
#include <utility>

#include "xla/ffi/api/ffi.h"

// Defines the exported XLA FFI handler symbol fn. Declared with JBS_EXPORT (jbs_common.h /
// jbs_sm100.h) first: the library is built with -fvisibility=hidden, and
// XLA_FFI_DEFINE_HANDLER_SYMBOL alone would leave the symbol hidden.
#define JBS_FFI_EXPORT_HANDLER(fn, impl, ...)                                   \
  extern "C" JBS_EXPORT XLA_FFI_Error* fn(XLA_FFI_CallFrame*);                 \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(fn, impl, __VA_ARGS__)

namespace jbs_ffi {
namespace ffi = xla::ffi;

constexpr int kMaxDevices = 64;

struct DeviceInfo {
  std::atomic<bool> ready{false};
  std::atomic<bool> loaded{false};  // sm100 only: this device's arch modules are loaded
  int cc_major = 0, cc_minor = 0, sm_count = 0;
};

// The output code of c's dtype (each handler passes its own table's codes), 0 if unsupported.
inline int OutCode(ffi::DataType t, int bf16, int f16, int f32) {
  switch (t) {
    case ffi::DataType::BF16: return bf16;
    case ffi::DataType::F16: return f16;
    case ffi::DataType::F32: return f32;
    default: return 0;
  }
}

// True when every buffer has dtype t (element_type() only reads the call frame).
inline bool AllOfType(ffi::DataType t, std::initializer_list<const ffi::AnyBuffer*> bufs) {
  for (const ffi::AnyBuffer* b : bufs)
    if (b->element_type() != t) return false;
  return true;
}

// The Problem fields both handlers' structs (jbs::Problem, jbs_sm100::Problem) have under the
// same names: output code, shape, the buffers' pointers and byte sizes, the device.
template <class P>
void FillProblem(P& p, int out, int64_t m, int64_t n, int64_t k, int64_t l,
                 const ffi::AnyBuffer& a, const ffi::AnyBuffer& b, const ffi::AnyBuffer& sa,
                 const ffi::AnyBuffer& sb, const ffi::AnyBuffer& c, const ffi::AnyBuffer& alpha,
                 const DeviceInfo& d) {
  p.out = out;
  p.m = m; p.n = n; p.k = k; p.l = l;
  p.a_ptr = reinterpret_cast<uint64_t>(a.untyped_data());
  p.b_ptr = reinterpret_cast<uint64_t>(b.untyped_data());
  p.sa_ptr = reinterpret_cast<uint64_t>(sa.untyped_data());
  p.sb_ptr = reinterpret_cast<uint64_t>(sb.untyped_data());
  p.c_ptr = reinterpret_cast<uint64_t>(c.untyped_data());
  p.alpha_ptr = reinterpret_cast<uint64_t>(alpha.untyped_data());
  p.a_bytes = a.size_bytes(); p.b_bytes = b.size_bytes();
  p.sa_bytes = sa.size_bytes(); p.sb_bytes = sb.size_bytes();
  p.c_bytes = c.size_bytes(); p.alpha_bytes = alpha.size_bytes();
  p.cc_major = d.cc_major; p.cc_minor = d.cc_minor; p.sm_count = d.sm_count;
}

// The LaunchArgs fields both handlers' structs have under the same names: buffers and shape
// (value-initialised first; the caller sets the rest by name).
template <class Args>
Args GemmLaunchArgs(const ffi::AnyBuffer& a, const ffi::AnyBuffer& b, const ffi::AnyBuffer& sa,
                    const ffi::AnyBuffer& sb, const ffi::AnyBuffer& c,
                    const ffi::AnyBuffer& alpha, int64_t m, int64_t n, int64_t k, int64_t l) {
  Args args{};
  args.a = a.untyped_data(); args.b = b.untyped_data();
  args.sa = sa.untyped_data(); args.sb = sb.untyped_data();
  args.c = c.untyped_data(); args.alpha = alpha.untyped_data();
  args.m = static_cast<int32_t>(m); args.n = static_cast<int32_t>(n);
  args.k = static_cast<int32_t>(k); args.l = static_cast<int32_t>(l);
  return args;
}

// The start of both execute bindings: XLA's stream, the operands a, b, sa, sb, alpha and the
// result c. Each handler appends its own results and attributes; the bound signature is the same
// as writing the whole chain out.
inline auto BindGemmOperands() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::PlatformStream<cudaStream_t>>()
      .Arg<ffi::AnyBuffer>()   // a
      .Arg<ffi::AnyBuffer>()   // b
      .Arg<ffi::AnyBuffer>()   // sa
      .Arg<ffi::AnyBuffer>()   // sb
      .Arg<ffi::AnyBuffer>()   // alpha
      .Ret<ffi::AnyBuffer>();  // c
}

// One handler's process-wide state. prefix starts every message ("jax_blockscale: ",
// "jax_blockscale sm100: ").
class HandlerState {
 public:
  explicit HandlerState(const char* prefix) : prefix_(prefix) {}

  ffi::Error CudaError(const char* what, cudaError_t e) const {
    return ffi::Error(ffi::ErrorCode::kInternal,
                      std::string(prefix_) + what + ": " + cudaGetErrorString(e));
  }

  ffi::Error InvalidArgument(const std::string& why) const {
    return ffi::Error::InvalidArgument(prefix_ + why);
  }

  // Compute capability and SM count of the current device, queried once.
  ffi::Error CurrentDevice(DeviceInfo** out) {
    int dev = 0;
    cudaError_t e = cudaGetDevice(&dev);
    if (e != cudaSuccess) return CudaError("cudaGetDevice", e);
    if (dev < 0 || dev >= kMaxDevices)
      return ffi::Error(ffi::ErrorCode::kOutOfRange,
                        std::string(prefix_) + "device ordinal too large");
    DeviceInfo& d = devices_[dev];
    if (!d.ready.load(std::memory_order_acquire)) {
      std::lock_guard<std::mutex> lock(device_mu_);
      if (!d.ready.load(std::memory_order_relaxed)) {
        int ma = 0, mi = 0, sms = 0;
        if ((e = cudaDeviceGetAttribute(&ma, cudaDevAttrComputeCapabilityMajor, dev)) != cudaSuccess ||
            (e = cudaDeviceGetAttribute(&mi, cudaDevAttrComputeCapabilityMinor, dev)) != cudaSuccess ||
            (e = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev)) != cudaSuccess)
          return CudaError("cudaDeviceGetAttribute", e);
        d.cc_major = ma;
        d.cc_minor = mi;
        d.sm_count = sms;
        d.ready.store(true, std::memory_order_release);
      }
    }
    *out = &d;
    return ffi::Error::Success();
  }

  // Called (through CUTE_DSL_CUDA_ERROR_CHECK) by the generated loaders: keeps the first error.
  void RecordLoadError(int cuda_error) {
    int expected = 0;
    load_error_.compare_exchange_strong(expected, cuda_error);
  }

  // Runs load() once per `once`, then reports any module-load error recorded so far.
  template <class F>
  ffi::Error LoadOnce(std::once_flag& once, F&& load) {
    std::call_once(once, std::forward<F>(load));
    int e = load_error_.load();
    if (e != 0) return CudaError("loading kernel modules", static_cast<cudaError_t>(e));
    return ffi::Error::Success();
  }

  // Launches variant v (a launcher returns a CUDA error code) and checks for launch errors.
  template <class V, class Args>
  ffi::Error Launch(const V& v, const Args& args) const {
    int32_t ret = v.launch(args);
    if (ret != 0) return CudaError(v.name, static_cast<cudaError_t>(ret));
    cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess) return CudaError(v.name, e);
    return ffi::Error::Success();
  }

 private:
  const char* prefix_;
  std::atomic<int> load_error_{0};
  DeviceInfo devices_[kMaxDevices];
  std::mutex device_mu_;
};

// The dtype checks both handlers make after their own: `u8` all uint8 (else u8_why), then alpha
// float32.
inline ffi::Error CheckU8AndAlpha(const HandlerState& s,
                                  std::initializer_list<const ffi::AnyBuffer*> u8,
                                  const char* u8_why, const ffi::AnyBuffer& alpha) {
  if (!AllOfType(ffi::DataType::U8, u8)) return s.InvalidArgument(u8_why);
  if (alpha.element_type() != ffi::DataType::F32)
    return s.InvalidArgument("alpha must be float32");
  return ffi::Error::Success();
}

}  // namespace jbs_ffi
