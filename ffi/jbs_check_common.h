// Arithmetic shared by the two handlers' pure validation (jbs_validate.cc for sm90,
// jbs_validate_sm100.cc for sm100): no CUDA, no XLA. Header-only, hidden (the library is built
// with -fvisibility=hidden).
#pragma once
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

namespace jbs_check {

constexpr int64_t kInt32Max = 2147483647LL;

inline int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Bytes of a blocked scale tensor [L, ceil(MN/128), ceil(SK/4), 32, 4, 4] of one-byte scales.
inline int64_t BlockedScaleBytes(int64_t l, int64_t mn, int64_t k, int block) {
  return l * CeilDiv(mn, 128) * CeilDiv(k / block, 4) * 512;
}

// Writes the message into buf and returns it (the validators' error return).
inline const char* Fail(char* buf, size_t buf_len, const char* fmt, ...)
    __attribute__((format(printf, 3, 4)));
inline const char* Fail(char* buf, size_t buf_len, const char* fmt, ...) {
  va_list args;
  va_start(args, fmt);
  vsnprintf(buf, buf_len, fmt, args);
  va_end(args);
  return buf;
}

// One device pointer the kernel reads or writes: null and alignment checks.
struct Pointer {
  const char* name;
  uint64_t ptr;
  int align;
  bool used;
};

// nullptr when every used pointer is non-null and aligned, else the message.
template <size_t N>
const char* CheckPointers(const Pointer (&ptrs)[N], char* buf, size_t buf_len) {
  for (const Pointer& q : ptrs) {
    if (!q.used) continue;
    if (q.ptr == 0) return Fail(buf, buf_len, "%s pointer is null", q.name);
    if (q.ptr % q.align)
      return Fail(buf, buf_len, "%s pointer 0x%llx is not %d-byte aligned", q.name,
                  (unsigned long long)q.ptr, q.align);
  }
  return nullptr;
}

}  // namespace jbs_check
