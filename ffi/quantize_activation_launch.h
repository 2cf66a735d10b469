// The NVFP4 activation quantizer's launch shape (quantize_activation.cu): calibrating its global
// scale, one CTA of kThreads threads, each holding up to kBlocksPerThread 16-element blocks in
// registers, or one cluster of kClusterCtas such CTAs. Shared by the kernel and by its launch
// in jbs_ffi.cc; the planner's limit (jax_blockscale/catalog/sm90.py: QUANTIZE_A_MAX_ELEMENTS)
// is the cluster's capacity, checked against this file by
// tests/build/test_quantized_activation_lowering.py.
#pragma once

namespace jbs_quantize {
constexpr int kThreads = 512;
constexpr int kClusterCtas = 8;
constexpr int kBlocksPerThread = 4;
constexpr long long kCtaBlocks = static_cast<long long>(kThreads) * kBlocksPerThread;
constexpr long long kClusterBlocks = kCtaBlocks * kClusterCtas;
// Past two blocks per thread of the 8-CTA cluster, a cluster of 16 CTAs (the non-portable size
// Hopper allows) where the device can place one: each thread then holds half as many blocks.
constexpr int kWideClusterCtas = 16;
constexpr long long kWideClusterFrom = 2LL * kThreads * kClusterCtas;
// With a given global scale (no amax to reduce): one block per thread, CTAs of this many threads.
constexpr int kStaticThreads = 128;
}  // namespace jbs_quantize
