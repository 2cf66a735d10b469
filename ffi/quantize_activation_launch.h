// The NVFP4 activation quantizer's launch shapes (quantize_activation.cu), shared by the kernels
// and their launch in jbs_ffi.cc (tests/build/test_quantized_activation_lowering.py checks
// jax_blockscale/catalog/sm90.py's copies against this file).
#pragma once

namespace jbs_quantize {
// Calibrating its global scale on one CTA of kThreads threads, each holding up to
// kBlocksPerThread 16-element blocks in registers: up to kCtaBlocks blocks.
constexpr int kThreads = 512;
constexpr int kBlocksPerThread = 4;
constexpr long long kCtaBlocks = static_cast<long long>(kThreads) * kBlocksPerThread;
// One block per thread, CTAs of this many threads: with a given global scale (no amax to
// reduce), and behind the amax kernel below.
constexpr int kStaticThreads = 128;
// Calibrating past one CTA (any size): a first kernel writes one amax per CTA of kAmaxThreads
// threads, each reading kAmaxBlocksPerThread blocks, and the one-block-per-thread kernel reduces
// those partial amaxes before it quantizes.
constexpr int kAmaxThreads = 256;
constexpr int kAmaxBlocksPerThread = 1;
constexpr long long kAmaxCtaBlocks = static_cast<long long>(kAmaxThreads) * kAmaxBlocksPerThread;
constexpr long long AmaxPartials(long long blocks) {
  return (blocks + kAmaxCtaBlocks - 1) / kAmaxCtaBlocks;
}
}  // namespace jbs_quantize
