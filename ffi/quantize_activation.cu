// NVFP4 quantization of a bf16 activation, for `jbs.gemm(x, w, quantize_a="nvfp4")` on sm90
// (the global scale calibrated per call, or, with `a_global_scale=`, given: the last kernel).
//
// Computes, for x of `blocks` 16-element blocks laid out one after the other (an (M, K) bf16
// array, K a multiple of 16), exactly what `jbs.quantize(x, "nvfp4")` computes in XLA
// (jax_blockscale/quantize.py: _quantize_nvfp4, global_scale "auto"):
//   amax   the largest finite |x| of the whole tensor (NaN and Inf ignored)
//   enc    min(6 * 448 / amax, 2^126), 1 when amax is 0; decode = 1 / enc
//   scale  e4m3(min(amax_block * (enc * f32(1 / 6)), 448)), rounded to nearest; NaN for a
//          block holding a NaN or Inf (the whole block decodes to NaN)
//   elem   e2m1(clip(x * (enc / scale), -6, 6)), rounded to nearest-even; 0 where the scale is
//          0 or x is not finite; x * enc / scale where enc / scale overflows
// and writes the elements packed two per byte (element 2i in the low nibble), the scales in the
// plain layout (one byte per block, in block order) and alpha = decode * b_alpha[i] for each of
// the weight's global scales (the GEMM's epilogue factor; one per layer of a stacked weight).
// Every step is the same f32 operation XLA's GPU code performs (its divisions are PTX
// div.full.f32, not IEEE quotients: XLA compiles with -nvptx-prec-divf32=1; XlaDiv below), so
// the bytes are those of jbs.quantize run by XLA on the GPU
// (tests/gpu/test_quantized_activation.py compares the GEMMs bit for bit).
//
// Up to kCtaBlocks blocks one CTA does it all (jbs_quantize_nvfp4_activation_cta): each thread
// loads up to kBlocksPerThread blocks into registers, the tensor's amax is reduced in the CTA,
// and every thread quantizes the blocks it holds (one launch, one read of x). Larger tensors take
// two kernels: jbs_nvfp4_activation_amax writes one partial amax per CTA, and
// jbs_quantize_nvfp4_activation_static, one block per thread on as many CTAs as needed, loads its
// block, waits for the amax kernel (it is that kernel's programmatic dependent), reduces the
// partials and quantizes. With a given global scale the last kernel runs alone. Each lets its
// dependent (the chained decode kernel, launched with programmatic dependent launch) start at
// once: that kernel waits for this one before it reads the activation.
//
// The PTX the library loads is generated from this file: python ffi/gen_quantize_activation_ptx.py
#include <cuda_fp8.h>
#include <stdint.h>

#include "quantize_activation_launch.h"  // the kernels' launch shapes

using jbs_quantize::kBlocksPerThread;
using jbs_quantize::kThreads;

// a / b as XLA's GPU code divides f32: div.full.f32 (at most 2 ulp from the IEEE quotient).
__device__ __forceinline__ float XlaDiv(float a, float b) {
  float q;
  asm("div.full.f32 %0, %1, %2;" : "=f"(q) : "f"(a), "f"(b));
  return q;
}

__device__ __forceinline__ float Bf16ToFloat(uint32_t bits16) {
  return __uint_as_float(bits16 << 16);
}

// e2m1 code (sign bit 8) of v, rounded to nearest-even; |v| <= 6 (clipped by the caller).
// E2m1RoundMagnitude(|v|) is the code's value. Adding and subtracting 1.5 * 2^23 * u rounds |v|
// to a multiple of u, ties to the even multiple, in the f32 adder itself; u is e2m1's spacing in |v|'s binade (0.5 below 2, 1 below 4,
// 2 from 4 on), and an even multiple of it is the even code. The rounded value times 2^-126 then
// holds the code in its exponent and first mantissa bit (0.5 becomes the subnormal 2^-127, so
// the product must not flush to zero: this file is compiled without -ftz). It gives the codes a
// compare per midpoint gives, for every f32 in [0, 6], in fewer instructions.
__device__ __forceinline__ float E2m1RoundMagnitude(float m) {
  const float magic = m < 2.0f ? 0x1.8p22f : (m < 4.0f ? 0x1.8p23f : 0x1.8p24f);
  return __fsub_rn(__fadd_rn(m, magic), magic);
}

__device__ __forceinline__ uint32_t E2m1Code(float v) {
  const float rounded = E2m1RoundMagnitude(fabsf(v));
  const uint32_t mag = __float_as_uint(__fmul_rn(rounded, 0x1p-126f)) >> 22;
  return mag | ((__float_as_uint(v) >> 28) & 8u);
}

// Element e (bf16 bits) of a block scaled into e2m1's range: x * ratio, or x * enc / scale
// (kDivide, where enc / scale overflows); 0 where the block has no scale or x is not finite;
// clipped to [-6, 6]. Rounding it to e2m1 gives the element's code.
template <bool kDivide>
__device__ __forceinline__ float ScaledElement(uint32_t b, float scale, float ratio, float enc,
                                               float safe) {
  const float v = Bf16ToFloat(b);
  float q = kDivide ? XlaDiv(v * enc, safe) : v * ratio;
  if (!(scale > 0.0f) || (b & 0x7F80u) == 0x7F80u) q = 0.0f;  // no scale, or not finite
  return fminf(fmaxf(q, -6.0f), 6.0f);
}

// Bits of element e of a block held as 8 bf16 pairs.
__device__ __forceinline__ uint32_t ElementBits(const uint32_t (&raw)[8], int e) {
  return (raw[e / 2] >> (16 * (e % 2))) & 0xFFFFu;
}

// The 16 elements of one block (bf16 pairs) as e2m1 codes, two per byte.
template <bool kDivide>
__device__ __forceinline__ uint2 PackBlock(const uint32_t (&raw)[8], float scale, float ratio,
                                           float enc, float safe) {
  uint32_t packed[2] = {0u, 0u};
#pragma unroll
  for (int e = 0; e < 16; ++e) {
    const float q = ScaledElement<kDivide>(ElementBits(raw, e), scale, ratio, enc, safe);
    packed[e / 8] |= E2m1Code(q) << (4 * (e % 8));
  }
  return make_uint2(packed[0], packed[1]);
}

// The rare path out of line: one copy of it, not one per block a thread holds.
__device__ __noinline__ uint2 PackBlockDividing(uint4 lo, uint4 hi, float scale, float ratio,
                                                float enc, float safe) {
  const uint32_t raw[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
  return PackBlock<true>(raw, scale, ratio, enc, safe);
}

// One 16-element block of x in registers: its bf16 pairs, the largest finite |x| in it and
// whether all of it is finite (NaN and Inf are ignored by every amax).
struct Block {
  uint32_t raw[8];
  float amax = 0.0f;
  bool finite = true;
};

__device__ __forceinline__ void LoadBlock(const uint4* __restrict__ x, long long j, Block& blk) {
  const uint4 lo = x[2 * j], hi = x[2 * j + 1];
  const uint32_t w[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
#pragma unroll
  for (int e = 0; e < 8; ++e) {
    blk.raw[e] = w[e];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const uint32_t bits = (w[e] >> (16 * h)) & 0xFFFFu;
      if ((bits & 0x7F80u) == 0x7F80u) {
        blk.finite = false;
      } else {
        blk.amax = fmaxf(blk.amax, fabsf(Bf16ToFloat(bits)));
      }
    }
  }
}

// A block's e4m3 scale under the encode factor `enc`, and what its elements are scaled with.
struct BlockScale {
  __nv_fp8_e4m3 scale;
  float s;      // the scale's value
  float safe;   // s, or 1 where s is 0
  float ratio;  // enc / safe: not finite (a huge enc and a tiny block, rare) means divide
};

__device__ __forceinline__ BlockScale ScaleBlock(const Block& blk, float enc) {
  BlockScale bs;
  const float enc_per_elem_max = enc * (1.0f / 6.0f);  // 1 / 6 rounded to f32 at compile time
  // round to nearest, saturating (the value is at most 448)
  bs.scale = __nv_fp8_e4m3(fminf(blk.amax * enc_per_elem_max, 448.0f));
  bs.s = static_cast<float>(bs.scale);
  bs.safe = bs.s > 0.0f ? bs.s : 1.0f;
  bs.ratio = XlaDiv(enc, bs.safe);
  return bs;
}

// Block j's scale and packed elements under the encode factor `enc`.
__device__ __forceinline__ void StoreBlock(const Block& blk, long long j, float enc,
                                           uint2* __restrict__ elements,
                                           uint8_t* __restrict__ scales) {
  const BlockScale bs = ScaleBlock(blk, enc);
  // x * enc / scale only where enc / scale overflows: rare
  const uint2 packed = isfinite(bs.ratio)
                           ? PackBlock<false>(blk.raw, bs.s, bs.ratio, enc, bs.safe)
                           : PackBlockDividing(
                                 make_uint4(blk.raw[0], blk.raw[1], blk.raw[2], blk.raw[3]),
                                 make_uint4(blk.raw[4], blk.raw[5], blk.raw[6], blk.raw[7]),
                                 bs.s, bs.ratio, enc, bs.safe);
  elements[j] = packed;
  scales[j] = blk.finite ? bs.scale.__x : static_cast<uint8_t>(0x7F);
}

// The tensor's global scale: the encode factor the blocks are scaled with and the stored decode
// factor 1 / enc.
struct GlobalScale {
  float enc;
  float decode;
};

// Calibrated from the tensor's amax: enc = min(6 * 448 / amax, 2^126), 1 when amax is 0.
__device__ __forceinline__ GlobalScale CalibratedScale(float amax) {
  float enc = fminf(XlaDiv(2688.0f, amax > 0.0f ? amax : 1.0f), 0x1p126f);
  if (!(amax > 0.0f)) enc = 1.0f;
  return {enc, XlaDiv(1.0f, enc)};
}

// Given as the decode factor g: enc = 1 / g as XLA divides (jbs.quantize keeps XLA from folding
// that quotient on the host).
__device__ __forceinline__ GlobalScale GivenScale(float decode) {
  return {XlaDiv(1.0f, decode), decode};
}

// alpha[i] = decode * b_alpha[i] for the alpha_count entries of b_alpha (the weight's global
// scale, or one per layer of a stacked weight), the product of the stored decode factors:
// jbs.quantize puts an optimization barrier on its decode factor so that XLA multiplies exactly
// these values. Without b_alpha, one entry: the decode factor itself. Thread t of `threads`
// writes every threads-th entry.
__device__ __forceinline__ void WriteAlpha(const GlobalScale& gs, const float* b_alpha,
                                           int alpha_count, float* alpha_out, long long t,
                                           long long threads) {
  for (long long i = t; i < alpha_count; i += threads)
    alpha_out[i] = b_alpha != nullptr ? gs.decode * b_alpha[i] : gs.decode;
}

// The largest of amax_count partial amaxes (float bits; non-negative floats order as their
// bits), reduced by each warp on its own: every lane must call it. The partials are another
// kernel's output, read after griddepcontrol.wait with ld.global.cg (never the non-coherent
// path, which ptxas may hoist above the wait).
__device__ __forceinline__ float GatherAmax(const uint32_t* partials, int amax_count) {
  uint32_t bits = 0u;
  for (int i = threadIdx.x % 32; i < amax_count; i += 32) bits = max(bits, __ldcg(partials + i));
  return __uint_as_float(__reduce_max_sync(0xFFFFFFFFu, bits));
}

// The largest of each thread's `amax` over the CTA of kCtaThreads, returned to every thread
// (non-negative floats order as their bits).
template <int kCtaThreads>
__device__ __forceinline__ float CtaAmax(float amax) {
  constexpr int kCtaWarps = kCtaThreads / 32;
  __shared__ uint32_t warp_amax[kCtaWarps];
  __shared__ uint32_t cta_amax;
  uint32_t bits = __reduce_max_sync(0xFFFFFFFFu, __float_as_uint(amax));
  if (threadIdx.x % 32 == 0) warp_amax[threadIdx.x / 32] = bits;
  __syncthreads();
  if (threadIdx.x < 32) {
    bits = __reduce_max_sync(0xFFFFFFFFu, threadIdx.x < kCtaWarps ? warp_amax[threadIdx.x] : 0u);
    if (threadIdx.x == 0) cta_amax = bits;
  }
  __syncthreads();
  return __uint_as_float(cta_amax);
}

// The whole quantization, the global scale calibrated, on one CTA: up to kCtaBlocks blocks. The
// quantizing kernels share one signature (jbs_ffi.cc: LaunchQuantizer); this one reads no given
// scale and no partial amaxes.
extern "C" __global__ void __launch_bounds__(kThreads)
    jbs_quantize_nvfp4_activation_cta(const uint4* __restrict__ x, long long blocks,
                                      uint2* __restrict__ elements, uint8_t* __restrict__ scales,
                                      float* __restrict__ alpha_out,
                                      const float* __restrict__ b_alpha, const float*,
                                      const uint32_t*, int, int alpha_count) {
  // the chained decode kernel may launch now: it streams weights, which this kernel does not
  // write, and waits (griddepcontrol.wait) for this grid's end before it reads what it writes
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  const int tid = threadIdx.x;
  const long long first = tid;
  const long long stride = kThreads;

  Block blk[kBlocksPerThread];
  float amax = 0.0f;
#pragma unroll
  for (int i = 0; i < kBlocksPerThread; ++i) {
    const long long j = first + i * stride;
    if (j < blocks) {
      LoadBlock(x, j, blk[i]);
      amax = fmaxf(amax, blk[i].amax);
    }
  }

  const GlobalScale gs = CalibratedScale(CtaAmax<kThreads>(amax));
  WriteAlpha(gs, b_alpha, alpha_count, alpha_out, first, kThreads);

#pragma unroll
  for (int i = 0; i < kBlocksPerThread; ++i) {
    const long long j = first + i * stride;
    if (j < blocks) StoreBlock(blk[i], j, gs.enc, elements, scales);
  }
}

// The calibrating path past one CTA (any size), first kernel: the largest finite |x| of
// each CTA's kAmaxCtaBlocks blocks, written to partials[CTA]. The static kernel below, launched
// as its programmatic dependent, loads its blocks meanwhile and reduces the partials once this
// grid has finished.
extern "C" __global__ void __launch_bounds__(jbs_quantize::kAmaxThreads)
    jbs_nvfp4_activation_amax(const uint4* x, long long blocks, uint32_t* partials) {
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  const long long first = blockIdx.x * jbs_quantize::kAmaxCtaBlocks + threadIdx.x;
  float amax = 0.0f;
#pragma unroll
  for (int i = 0; i < jbs_quantize::kAmaxBlocksPerThread; ++i) {
    const long long j = first + 1LL * i * jbs_quantize::kAmaxThreads;
    if (j < blocks) {
      Block blk;
      LoadBlock(x, j, blk);
      amax = fmaxf(amax, blk.amax);
    }
  }
  amax = CtaAmax<jbs_quantize::kAmaxThreads>(amax);
  if (threadIdx.x == 0) partials[blockIdx.x] = __float_as_uint(amax);
}

// The one-block-per-thread kernels' global scale: the given decode factor a_decode[0], or, with
// amax_count > 0, calibrated from the partial amaxes jbs_nvfp4_activation_amax wrote (after
// waiting for that kernel: this one is its programmatic dependent). Every lane calls it.
__device__ __forceinline__ GlobalScale StaticGlobalScale(const float* a_decode,
                                                         const uint32_t* amax_partials,
                                                         int amax_count) {
  if (amax_count == 0) return GivenScale(a_decode[0]);
  asm volatile("griddepcontrol.wait;" ::: "memory");
  return CalibratedScale(GatherAmax(amax_partials, amax_count));
}

// The start both one-block-per-thread kernels share: thread j's block loaded (x is no earlier
// kernel's output, so before any wait), then the global scale, and alpha written. Returns false
// for a thread past the tensor.
__device__ __forceinline__ bool LoadStaticBlock(const uint4* x, long long blocks,
                                                float* alpha_out, const float* b_alpha,
                                                const float* a_decode,
                                                const uint32_t* amax_partials, int amax_count,
                                                int alpha_count, long long* j, Block* blk,
                                                GlobalScale* gs) {
  *j = 1LL * blockIdx.x * jbs_quantize::kStaticThreads + threadIdx.x;
  const bool inside = *j < blocks;
  if (inside) LoadBlock(x, *j, *blk);
  *gs = StaticGlobalScale(a_decode, amax_partials, amax_count);
  WriteAlpha(*gs, b_alpha, alpha_count, alpha_out, *j,
             1LL * gridDim.x * jbs_quantize::kStaticThreads);
  return inside;
}

// One block per thread on as many CTAs of kStaticThreads as the tensor needs: with a given
// global scale (static W4A4, `gemm(x, w, quantize_a="nvfp4", a_global_scale=g)`) there is no
// amax to reduce; calibrated (amax_count > 0) the amax kernel above has reduced it in parts.
extern "C" __global__ void __launch_bounds__(jbs_quantize::kStaticThreads)
    jbs_quantize_nvfp4_activation_static(const uint4* x, long long blocks, uint2* elements,
                                         uint8_t* scales, float* alpha_out,
                                         const float* b_alpha, const float* a_decode,
                                         const uint32_t* amax_partials, int amax_count,
                                         int alpha_count) {
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");  // as the one-CTA kernel
  long long j;
  Block blk;
  GlobalScale gs;
  if (LoadStaticBlock(x, blocks, alpha_out, b_alpha, a_decode, amax_partials, amax_count,
                      alpha_count, &j, &blk, &gs))
    StoreBlock(blk, j, gs.enc, elements, scales);
}

// The same for the register-weight GEMM (a bf16 activation in its K order, kernels/
// sm90_blockscaled.py): each block's values as gemm's composition dequantizes them before that
// kernel (e2m1 value x e4m3 scale, exact in bf16; NaN for a block holding a NaN or Inf; the
// global scale stays in alpha), written where catalog/sm90.py: activation_k_order puts them.
// Element 8s + 4q + 2h + hi of the k-tile's block t goes to slot 32s + 16h + 8hi + 2t + q, so
// the pair q = 0, 1 is one 32-bit word, 16s + 8h + 4hi + t of the k-tile's 32. K % 64 == 0.
extern "C" __global__ void __launch_bounds__(jbs_quantize::kStaticThreads)
    jbs_quantize_nvfp4_activation_static_kperm(const uint4* x, long long blocks,
                                               uint32_t* values, uint8_t* unused_scales,
                                               float* alpha_out, const float* b_alpha,
                                               const float* a_decode,
                                               const uint32_t* amax_partials, int amax_count,
                                               int alpha_count) {
  long long j;
  Block blk;
  GlobalScale gs;
  if (!LoadStaticBlock(x, blocks, alpha_out, b_alpha, a_decode, amax_partials, amax_count,
                       alpha_count, &j, &blk, &gs))
    return;
  const float enc = gs.enc;
  const BlockScale bs = ScaleBlock(blk, enc);
  const bool divide = !isfinite(bs.ratio);
  const float factor = blk.finite ? bs.s : __int_as_float(0x7FFFFFFF);  // the stored scale (NaN)
  uint32_t* tile = values + (j / 4) * 32;
  const int t = static_cast<int>(j % 4);
#pragma unroll
  for (int w = 0; w < 8; ++w) {  // w = 4s + 2h + hi: the word's element pair
    const int e0 = 8 * (w / 4) + (w % 4);  // element of q = 0 in the block; q = 1 is e0 + 4
    uint32_t word = 0u;
#pragma unroll
    for (int q = 0; q < 2; ++q) {
      const uint32_t b = ElementBits(blk.raw, e0 + 4 * q);
      const float qv = divide ? ScaledElement<true>(b, bs.s, bs.ratio, enc, bs.safe)
                              : ScaledElement<false>(b, bs.s, bs.ratio, enc, bs.safe);
      const float value = copysignf(E2m1RoundMagnitude(fabsf(qv)), qv) * factor;
      word |= (__float_as_uint(value) >> 16) << (16 * q);  // exact: the truncation is the value
    }
    tile[16 * (w / 4) + 8 * ((w / 2) % 2) + 4 * (w % 2) + t] = word;
  }
}
