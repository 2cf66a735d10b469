// XLA FFI handlers for the jax_blockscale sm90 block-scaled GEMM.
//
//   target "jax_blockscale_gemm_sm90"
//   operands: a (u8 packed | bf16) [L,M,Ka], b (u8) [L,N,Kb], sa (u8, blocked or, for the decode
//             kernel, plain; any buffer in weight-only mode), sb (u8, blocked), alpha (f32 [1])
//   results:  c (bf16 | f16 | f32) [L, M, N]
//             ws (f32): the split-K workspace, splits*L*M*N floats (the decode kernel, or a
//                       register-weight variant that splits K; zero elements otherwise)
//   attrs:    a_kind, b_kind, a_e5m2, b_e5m2, a_scales_plain (int32), m, n, k, l (int64), the
//             planned variant: nt (0: fused; 1/2/4/8: decode), tile_m, tile_n, splits (int32),
//             and partials (int32): 1 = the split partials [splits, L, M, N] (true scale,
//             before alpha) stay in ws and the caller adds them in split order and applies
//             alpha (c is then not written when splits > 1); 0 = the decode kernel's finalize
//             kernel does, into c. A register-weight variant that splits K (splits 2..255) runs
//             its f32 twin with ws as its output and always needs partials = 1.
//
//   target "jax_blockscale_ragged_gemm_sm90" (ragged_gemm: the grouped decode kernel, or at
//   prefill sizes the grouped register-weight kernel: nt = 0, a bf16_kperm activation, splits 0)
//   operands: a [M, Ka] (as above, one activation, rows sorted by expert), b (u8) [G, N, Kb],
//             sa, sb (as above; sb [G, ...]), alpha (f32 [G]: one per expert; the grouped
//             decode kernel also takes f32 [1] or a scalar: one for every expert),
//             items (s32 [num_items, 3]: expert, first row, end row; expert -1 = zero rows;
//             or, in sizes mode, s32 [G]: the raw group sizes, groups from row 0)
//   results:  c [M, N], ws (f32, splits*M*N floats when splits > 1)
//   attrs:    as above with g (experts) in place of l, and sizes_items (int64): 0 for a work
//             table, else sizes mode (grouped decode kernel only) with that many items (at
//             least ceil(M / tile_m) + min(G, M) + 2), tiles_per_cta (int32): adjacent
//             tiles of N each CTA of the grouped decode kernel runs (1..16; 1 for the others),
//             and partials (int32) as for gemm (the grouped decode kernel's partials [splits, M,
//             N] already carry each expert's alpha: the caller only adds them)
//
//   target "jax_blockscale_layer_gemm_sm90" (`jbs.gemm(x, stack, layer=i)`: one layer of a stack)
//   operands: a, a_index (the activation as the layer's plan and as index mode read it), b (u8)
//             [G, N, Kb], sa, sb [G, ...], alpha (f32 [G]), index (s32 [1]: the layer),
//             probe (u8: the start of layer index's scales, a slice of sb)
//   results:  c [M, N], ws (f32, room for either plan's split-K workspace)
//   attrs:    the layer's plan as for gemm (l = 1), then g and index mode's plan: index_a_kind,
//             index_nt, index_tile_m, index_tile_n, index_splits, index_items, and partials:
//             1 where the layer's plan splits K in slice mode (index_nt 0), or where both plans
//             are the decode kernel with the same splits (> 1); the partials are then in true
//             scale: the caller adds them and applies alpha[clamp(index)]
//   XLA hands the probe in place when the index is a loop counter (as it does the layer slices
//   of a scanned model); its address then says which layer it is, and the layer's own plan runs
//   on that layer's part of b, sb and alpha, as an unrolled model's gemm would (nothing waits
//   for the index). When XLA copied the probe (an index read from an array), index mode runs
//   instead: the grouped decode kernel reads the index on the device.
//   Slice mode (index_nt = 0: a plan whose activation index mode cannot read): b and sb are
//   the layer's slices (XLA's: in place at a loop counter, else copies) and the probe is the
//   whole stack of scales; sb's address names the layer for alpha, and where sb was copied one
//   thread gathers alpha[clamp(index)] into the workspace's last float first.
//
//   target "jax_blockscale_quantized_act_gemm_sm90" (`jbs.gemm(x, w, quantize_a="nvfp4")`)
//   operands: x (bf16) [M, K], the activation before quantization; b, sb (as for gemm, L = 1);
//             b_alpha (f32 [1]): b's global scale (1 without one); a_decode (f32): [0] to
//             calibrate x's global scale on this call, or [1], the given decode factor
//             (`quantize_a="nvfp4", a_global_scale=g`)
//   results:  c [1, M, N], ws (f32): the quantized activation (QuantizedActivationScratch), then
//             from the next 256-byte boundary the decode plan's split-K workspace
//   attrs:    as for gemm (a_kind nvfp4, plain A scales, l = 1; with partials = 1 the caller
//             reads alpha from the scratch, where the quantizer wrote it)
//   The quantizer (quantize_activation.cu, PTX loaded at run time: one kernel, or for a
//   calibrated scale past one CTA an amax kernel and then that one) quantizes x to NVFP4 exactly
//   as jbs.quantize does (its amax or the given scale, scales, elements, and alpha) into the
//   front of ws; the planned decode kernel's chained variant then multiplies it by b. It is
//   launched with programmatic dependent launch: its CTAs start while the quantizer runs, issue
//   their first weight copies and wait for the quantizer before reading what it wrote.
//   With a_kind = bf16_kperm (a plan of the register-weight kernel), the quantizer writes the
//   quantized activation's values (dequantized, exact in bf16) in that kernel's K order
//   instead, and the kernel runs after it on the stream.
//
//   target "jax_blockscale_quantize_nvfp4_sm90" (`jbs.quantize(x, "nvfp4")` of a bf16 x)
//   operands: x (bf16) [M, K]; a_decode (f32): [0] to calibrate, or [1] the given decode factor;
//             b_alpha (f32): [0], or the L global scales of a stacked weight
//   results:  elements (u8 [M * K / 2], two per byte), scales (u8 [M * K / 16], e4m3, plain),
//             alpha (f32: [1] the stored decode factor, or [L] its products with b_alpha),
//             amax (f32, the partial amaxes' scratch: one per kAmaxCtaBlocks blocks)
//   attrs:    m, k
//   The same quantizer kernels, alone: what a composition (`layer=`, a call the fused target
//   does not take) or a user's jbs.quantize runs instead of XLA's four kernels.
//
// instantiate: loads every compiled kernel module (fused GEMM and decode) once per process (the
//              generated loader loads onto all devices) and caches each device's compute
//              capability / SM count.
// execute:     validates the call against the planned variant (jbs_validate.cc:
//              ValidateProblem) and launches it on XLA's stream. It chooses nothing: the plan
//              (jax_blockscale/lowering/plan.py) did. Only stream-ordered work, so it is
//              CUDA-graph (command buffer) compatible.
#include <cuda_runtime_api.h>

#include <stdio.h>

#include <atomic>
#include <mutex>
#include <string>
#include <utility>

#include "jbs_common.h"
#include "jbs_ffi_common.h"  // state, device cache, loading, checks shared with jbs_ffi_sm100.cc
#include "jbs_quantize_activation_ptx.h"  // generated from quantize_activation.cu
#include "quantize_activation_launch.h"  // the quantizer's launch shape
#include "jbs_variants.h"  // generated by python -m jax_blockscale.aot
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jbs {
namespace {

using jbs_ffi::DeviceInfo;

jbs_ffi::HandlerState g_state("jax_blockscale: ");
std::once_flag g_load_once;

ffi::Error LoadModules() {
  return g_state.LoadOnce(g_load_once, [] {
    for (int i = 0; i < kJbsNumVariants; ++i) kJbsVariants[i].load();
  });
}

ffi::Error Instantiate() {
  DeviceInfo* d = nullptr;
  if (auto err = g_state.CurrentDevice(&d); err.failure()) return err;
  if (d->cc_major != 9 || d->cc_minor != 0) return ffi::Error::Success();  // execute reports it
  return LoadModules();
}

// Validates one call (dense: items null) and launches the planned variant on XLA's stream.
ffi::Error Run(cudaStream_t stream, ffi::AnyBuffer a, ffi::AnyBuffer b, ffi::AnyBuffer sa,
               ffi::AnyBuffer sb, ffi::AnyBuffer alpha, const ffi::AnyBuffer* items,
               ffi::Result<ffi::AnyBuffer> c, ffi::Result<ffi::AnyBuffer> ws, int32_t a_kind,
               int32_t b_kind, int32_t a_e5m2, int32_t b_e5m2, int64_t m, int64_t n, int64_t k,
               int64_t l, int32_t a_scales_plain, int32_t nt, int32_t tile_m, int32_t tile_n,
               int32_t splits, int64_t index_items = 0, int64_t stack = 0, int64_t layer = 0,
               void* alpha_at = nullptr, bool chained = false, int64_t sizes_items = 0,
               int32_t tiles_per_cta = 1, int32_t partials = 0) {
  DeviceInfo* d = nullptr;
  if (auto err = g_state.CurrentDevice(&d); err.failure()) return err;

  // dtypes of the buffers (sizes and everything else: ValidateProblem)
  const bool a_is_bf16 = a_kind == JBS_BF16 || a_kind == JBS_BF16_KPERM;
  if (a.element_type() != (a_is_bf16 ? ffi::DataType::BF16 : ffi::DataType::U8))
    return g_state.InvalidArgument("A must be uint8 (packed) or bf16 (weight-only)");
  if (auto err = jbs_ffi::CheckU8AndAlpha(g_state, {&b, &sb, &sa},
                                          "B and the scales must be uint8 buffers", alpha);
      err.failure())
    return err;
  if (ws->element_type() != ffi::DataType::F32)
    return g_state.InvalidArgument("the decode workspace must be float32");
  if (items && items->element_type() != ffi::DataType::S32)
    return g_state.InvalidArgument("the grouped work table must be int32");

  Problem p{};
  p.a_kind = a_kind;
  p.b_kind = b_kind;
  p.a_e5m2 = a_e5m2;
  p.b_e5m2 = b_e5m2;
  jbs_ffi::FillProblem(p, jbs_ffi::OutCode(c->element_type(), JBS_OUT_BF16, JBS_OUT_F16, JBS_OUT_F32),
                       m, n, k, l, a, b, sa, sb, *c, alpha, *d);
  p.a_scales_plain = a_scales_plain;
  p.nt = nt; p.tile_m = tile_m; p.tile_n = tile_n; p.splits = splits;
  p.ws_ptr = reinterpret_cast<uint64_t>(ws->untyped_data());
  p.ws_bytes = ws->size_bytes();
  if (stack > 0) {  // a dense call on layer `layer` of stacks of `stack` b, sb and alpha
    if (p.b_bytes % stack || p.sb_bytes % stack || p.alpha_bytes != 4 * stack)
      return g_state.InvalidArgument("b and sb must hold G equal layers and alpha G floats");
    p.b_bytes /= stack;
    p.sb_bytes /= stack;
    p.alpha_bytes = 4;
    p.b_ptr += layer * p.b_bytes;
    p.sb_ptr += layer * p.sb_bytes;
    p.alpha_ptr += 4 * layer;
  }
  if (alpha_at) {  // slice mode: alpha is the layer's float at alpha_at (see ExecuteLayer)
    p.alpha_ptr = reinterpret_cast<uint64_t>(alpha_at);
    p.alpha_bytes = 4;
  }
  if (items) {  // a work table of (expert, first row, end row); index mode: one int32; sizes
                // mode: the G group sizes
    p.grouped = index_items > 0 ? 2 : sizes_items > 0 ? 3 : 1;
    p.items_ptr = reinterpret_cast<uint64_t>(items->untyped_data());
    p.items_bytes = items->size_bytes();
    p.num_items = index_items > 0   ? index_items
                  : sizes_items > 0 ? sizes_items
                                    : static_cast<int64_t>(items->element_count() / 3);
  }
  p.chained = chained ? 1 : 0;
  p.tiles_per_cta = tiles_per_cta;
  p.partials = partials;
  char msg[512];
  const Variant* v = nullptr;
  if (const char* why = ValidateProblem(p, kJbsVariants, kJbsNumVariants, &v, msg, sizeof(msg)))
    return g_state.InvalidArgument(why);
  if (auto err = LoadModules(); err.failure()) return err;  // no-op after instantiate

  auto args = jbs_ffi::GemmLaunchArgs<LaunchArgs>(a, b, sa, sb, *c, alpha, m, n, k, l);
  args.b = reinterpret_cast<void*>(p.b_ptr);  // the layer's, for a layer of a stack
  args.sb = reinterpret_cast<void*>(p.sb_ptr);
  args.alpha = reinterpret_cast<void*>(p.alpha_ptr);
  args.a_e5m2 = a_e5m2; args.b_e5m2 = b_e5m2; args.max_ctas = d->sm_count;
  // the decode kernel takes the scale layout as bit 1 of a_e5m2 (ValidateProblem allows plain A
  // scales only for it)
  if (v->nt > 0) args.a_e5m2 |= a_scales_plain << 1;
  args.stream = stream; args.ws = ws->untyped_data(); args.splits = splits;
  if (v->nt) {
    args.a_e5m2 |= partials << 5;  // the caller adds the split partials
  } else if (splits > 1) {  // a register-weight split (validated): f32 partials into ws
    args.a_e5m2 |= splits << 8;
    args.c = ws->untyped_data();
  }
  if (items) {
    args.items = items->untyped_data();
    args.num_items = static_cast<int32_t>(p.num_items);
    if (p.grouped == 2) args.a_e5m2 |= 4;  // the grouped kernel's index mode
    if (p.grouped == 3) args.a_e5m2 |= 8;  // its sizes mode
    if (v->nt && p.alpha_bytes == 4) args.a_e5m2 |= 16;  // one alpha for every expert
    args.a_e5m2 |= (tiles_per_cta - 1) << 8;  // tiles of N per CTA (validated: 1 unless decode)
  }
  return g_state.Launch(*v, args);
}

ffi::Error Execute(cudaStream_t stream, ffi::AnyBuffer a, ffi::AnyBuffer b, ffi::AnyBuffer sa,
                   ffi::AnyBuffer sb, ffi::AnyBuffer alpha, ffi::Result<ffi::AnyBuffer> c,
                   ffi::Result<ffi::AnyBuffer> ws, int32_t a_kind, int32_t b_kind,
                   int32_t a_e5m2, int32_t b_e5m2, int64_t m, int64_t n, int64_t k, int64_t l,
                   int32_t a_scales_plain, int32_t nt, int32_t tile_m, int32_t tile_n,
                   int32_t splits, int32_t partials) {
  return Run(stream, a, b, sa, sb, alpha, nullptr, c, ws, a_kind, b_kind, a_e5m2, b_e5m2, m, n,
             k, l, a_scales_plain, nt, tile_m, tile_n, splits, /*index_items=*/0, /*stack=*/0,
             /*layer=*/0, /*alpha_at=*/nullptr, /*chained=*/false, /*sizes_items=*/0,
             /*tiles_per_cta=*/1, partials);
}

ffi::Error ExecuteRagged(cudaStream_t stream, ffi::AnyBuffer a, ffi::AnyBuffer b,
                         ffi::AnyBuffer sa, ffi::AnyBuffer sb, ffi::AnyBuffer alpha,
                         ffi::AnyBuffer items, ffi::Result<ffi::AnyBuffer> c,
                         ffi::Result<ffi::AnyBuffer> ws, int32_t a_kind, int32_t b_kind,
                         int32_t a_e5m2, int32_t b_e5m2, int64_t m, int64_t n, int64_t k,
                         int64_t g, int32_t a_scales_plain, int32_t nt, int32_t tile_m,
                         int32_t tile_n, int32_t splits, int64_t sizes_items,
                         int32_t tiles_per_cta, int32_t partials) {
  return Run(stream, a, b, sa, sb, alpha, &items, c, ws, a_kind, b_kind, a_e5m2, b_e5m2, m, n,
             k, g, a_scales_plain, nt, tile_m, tile_n, splits, /*index_items=*/0, /*stack=*/0,
             /*layer=*/0, /*alpha_at=*/nullptr, /*chained=*/false, sizes_items, tiles_per_cta,
             partials);
}

// out[0] = alpha[clamp(index[0], 0, count - 1)], one thread: slice mode's alpha where XLA copied
// the layer (the index is only on the device). PTX, loaded once by the runtime's JIT (no CUDA
// compiler in the build); ptxas checks it in tests/build/test_native_build.py.
constexpr const char kGatherAlphaPtx[] = R"(.version 8.0
.target sm_90
.address_size 64
.visible .entry jbs_gather_alpha(.param .u64 out_param, .param .u64 alpha_param,
                                 .param .u64 index_param, .param .s32 count_param)
{
  .reg .b64 %rd<6>;
  .reg .b32 %r<4>;
  .reg .f32 %f<2>;
  ld.param.u64 %rd1, [out_param];
  ld.param.u64 %rd2, [alpha_param];
  ld.param.u64 %rd3, [index_param];
  ld.param.s32 %r1, [count_param];
  cvta.to.global.u64 %rd1, %rd1;
  cvta.to.global.u64 %rd2, %rd2;
  cvta.to.global.u64 %rd3, %rd3;
  ld.global.s32 %r2, [%rd3];
  add.s32 %r3, %r1, -1;
  min.s32 %r2, %r2, %r3;
  max.s32 %r2, %r2, 0;
  mul.wide.s32 %rd4, %r2, 4;
  add.s64 %rd5, %rd2, %rd4;
  ld.global.f32 %f1, [%rd5];
  st.global.f32 [%rd1], %f1;
  ret;
}
)";

// A kernel of PTX text, loaded once per process by the runtime's JIT.
struct PtxKernel {
  const char* ptx;
  const char* name;
  std::once_flag once;
  cudaKernel_t kernel = nullptr;
  cudaError_t error = cudaSuccess;

  ffi::Error Get(cudaKernel_t* out) {
    std::call_once(once, [this] {
      cudaLibrary_t lib = nullptr;
      error = cudaLibraryLoadData(&lib, ptx, nullptr, nullptr, 0, nullptr, nullptr, 0);
      if (error == cudaSuccess) error = cudaLibraryGetKernel(&kernel, lib, name);
    });
    if (error != cudaSuccess) return g_state.CudaError(name, error);
    *out = kernel;
    return ffi::Error::Success();
  }
};

PtxKernel g_gather_alpha{kGatherAlphaPtx, "jbs_gather_alpha"};
PtxKernel g_quantize_activation_cta{kQuantizeActivationPtx, "jbs_quantize_nvfp4_activation_cta"};
PtxKernel g_quantize_activation_static{kQuantizeActivationPtx,
                                       "jbs_quantize_nvfp4_activation_static"};
PtxKernel g_quantize_activation_static_kperm{kQuantizeActivationPtx,
                                             "jbs_quantize_nvfp4_activation_static_kperm"};
PtxKernel g_activation_amax{kQuantizeActivationPtx, "jbs_nvfp4_activation_amax"};

// A launch of a quantizer kernel on `ctas` CTAs of `threads` threads; `dependent`: as a
// programmatic dependent of the kernel before it on the stream (the one-block-per-thread kernel
// behind the amax kernel: it starts at once and waits for that kernel before reading its
// output). Not copyable: the config points at the attribute beside it.
struct QuantizerLaunch {
  cudaLaunchAttribute dependent_attr;
  cudaLaunchConfig_t config = {};
  QuantizerLaunch(int ctas, int threads, cudaStream_t stream, bool dependent) {
    dependent_attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
    dependent_attr.val.programmaticStreamSerializationAllowed = 1;
    config.gridDim = dim3(ctas);
    config.blockDim = dim3(threads);
    config.stream = stream;
    config.attrs = &dependent_attr;
    config.numAttrs = dependent ? 1 : 0;
  }
  QuantizerLaunch(const QuantizerLaunch&) = delete;
  QuantizerLaunch& operator=(const QuantizerLaunch&) = delete;
};

ffi::Error GatherAlpha(cudaStream_t stream, void* out, const void* alpha, const void* index,
                       int32_t count) {
  cudaKernel_t kernel = nullptr;
  if (auto err = g_gather_alpha.Get(&kernel); err.failure()) return err;
  void* args[] = {&out, &alpha, &index, &count};
  cudaError_t e = cudaLaunchKernel(reinterpret_cast<const void*>(kernel), dim3(1), dim3(1), args,
                                   0, stream);
  if (e != cudaSuccess) return g_state.CudaError("jbs_gather_alpha", e);
  return ffi::Error::Success();
}

// Where the quantized activation lies in the scratch result (jax_blockscale/lowering/
// ffi_sm90.py: quantized_activation_scratch_bytes computes the same): elements at 0
// (`block_bytes` per block: 8 packed NVFP4, or 32 for the register-weight kernel's bf16 values),
// then the plain scales, the partial amaxes of the calibrating path past one CTA (one per
// CTA of the amax kernel) and alpha, each 256-byte aligned; the GEMM's own workspace from
// gemm_ws.
struct ScratchLayout {
  int64_t scales, amax, alpha, bytes, gemm_ws;
};
ScratchLayout QuantizedActivationScratch(int64_t blocks, int64_t block_bytes) {
  auto up = [](int64_t x) { return (x + 255) / 256 * 256; };
  ScratchLayout s;
  s.scales = up(block_bytes * blocks);
  s.amax = up(s.scales + blocks);
  s.alpha = up(s.amax + 4 * jbs_quantize::AmaxPartials(blocks));
  s.bytes = s.alpha + 4;
  s.gemm_ws = up(s.bytes);
  return s;
}

// A view of `bytes` of device memory as a one-dimensional buffer of `type`, for Run.
struct BufferView {
  int64_t dims[1];
  XLA_FFI_Buffer buf;
  BufferView(void* data, XLA_FFI_DataType type, int64_t count) : dims{count}, buf{} {
    buf.struct_size = XLA_FFI_Buffer_STRUCT_SIZE;
    buf.dtype = type;
    buf.data = data;
    buf.rank = 1;
    buf.dims = dims;
  }
  ffi::AnyBuffer any() const { return ffi::AnyBuffer(&buf); }
};

// How often the layer target found its layer in place (0) or did not (1: index mode, or slice
// mode with its alpha gathered): tests read them through jbs_layer_gemm_counts.
std::atomic<long long> g_layer_calls[2];

// The layer of a stack of `layers` equal layers at [base, base + bytes) that a slice starting at
// `at` begins: its offset is a whole number of layers. -1 when it lies outside (XLA copied it).
int64_t LayerAt(uint64_t at, uint64_t base, uint64_t bytes, int64_t layers) {
  if (layers < 1 || bytes % layers != 0 || at < base || at - base >= bytes) return -1;
  const uint64_t stride = bytes / layers;
  return (at - base) % stride == 0 ? static_cast<int64_t>((at - base) / stride) : -1;
}

ffi::Error ExecuteLayer(cudaStream_t stream, ffi::AnyBuffer a, ffi::AnyBuffer a_index,
                        ffi::AnyBuffer b, ffi::AnyBuffer sa, ffi::AnyBuffer sb,
                        ffi::AnyBuffer alpha, ffi::AnyBuffer index, ffi::AnyBuffer probe,
                        ffi::Result<ffi::AnyBuffer> c, ffi::Result<ffi::AnyBuffer> ws,
                        int32_t a_kind, int32_t b_kind, int32_t a_e5m2, int32_t b_e5m2,
                        int64_t m, int64_t n, int64_t k, int64_t l, int32_t a_scales_plain,
                        int32_t nt, int32_t tile_m, int32_t tile_n, int32_t splits, int64_t g,
                        int32_t index_a_kind, int32_t index_nt, int32_t index_tile_m,
                        int32_t index_tile_n, int32_t index_splits, int64_t index_items,
                        int32_t partials) {
  if (probe.element_type() != ffi::DataType::U8 || probe.size_bytes() < 1)
    return g_state.InvalidArgument("the layer probe must be uint8 bytes");
  if (l != 1) return g_state.InvalidArgument("a layer call has l = 1");
  if (index_nt == 0) {  // slice mode: b, sb are the layer's; probe is the stack of scales
    if (alpha.element_count() != g || index.element_count() != 1 || g < 1)
      return g_state.InvalidArgument("slice mode needs alpha of G floats and one int32 index");
    const int64_t layer = LayerAt(reinterpret_cast<uint64_t>(sb.untyped_data()),
                                  reinterpret_cast<uint64_t>(probe.untyped_data()),
                                  probe.size_bytes(), g);
    char* alpha_at = static_cast<char*>(alpha.untyped_data()) + 4 * (layer < 0 ? 0 : layer);
    if (layer < 0) {  // copied: the layer's alpha from the device index, into ws's last float
      if (ws->size_bytes() < 4) return g_state.InvalidArgument("slice mode needs a workspace");
      alpha_at = static_cast<char*>(ws->untyped_data()) + ws->size_bytes() - 4;
      if (auto err = GatherAlpha(stream, alpha_at, alpha.untyped_data(), index.untyped_data(),
                                 static_cast<int32_t>(g));
          err.failure())
        return err;
    }
    g_layer_calls[layer < 0 ? 1 : 0].fetch_add(1, std::memory_order_relaxed);
    return Run(stream, a, b, sa, sb, alpha, nullptr, c, ws, a_kind, b_kind, a_e5m2, b_e5m2, m,
               n, k, 1, a_scales_plain, nt, tile_m, tile_n, splits, /*index_items=*/0,
               /*stack=*/0, /*layer=*/0, alpha_at, /*chained=*/false, /*sizes_items=*/0,
               /*tiles_per_cta=*/1, partials);
  }
  const int64_t layer = LayerAt(reinterpret_cast<uint64_t>(probe.untyped_data()),
                                reinterpret_cast<uint64_t>(sb.untyped_data()), sb.size_bytes(), g);
  if (layer >= 0) {
    g_layer_calls[0].fetch_add(1, std::memory_order_relaxed);
    return Run(stream, a, b, sa, sb, alpha, nullptr, c, ws, a_kind, b_kind, a_e5m2, b_e5m2, m,
               n, k, 1, a_scales_plain, nt, tile_m, tile_n, splits, /*index_items=*/0,
               /*stack=*/g, layer, /*alpha_at=*/nullptr, /*chained=*/false, /*sizes_items=*/0,
               /*tiles_per_cta=*/1, partials);
  }
  g_layer_calls[1].fetch_add(1, std::memory_order_relaxed);
  return Run(stream, a_index, b, sa, sb, alpha, &index, c, ws, index_a_kind, b_kind, a_e5m2,
             b_e5m2, m, n, k, g, a_scales_plain, index_nt, index_tile_m, index_tile_n,
             index_splits, index_items, /*stack=*/0, /*layer=*/0, /*alpha_at=*/nullptr,
             /*chained=*/false, /*sizes_items=*/0, /*tiles_per_cta=*/1, partials);
}

// How the activation is quantized: `kernel` on `ctas` CTAs of `threads`, and where
// amax_ctas > 0, after the amax kernel on that many CTAs (kernel is then its programmatic
// dependent and reduces its partial amaxes).
struct QuantizerChoice {
  cudaKernel_t kernel = nullptr;
  int ctas = 0, threads = 0;
  cudaKernel_t amax_kernel = nullptr;
  int amax_ctas = 0;
};

// The quantizer for `blocks` blocks: a calibrated global scale on one CTA where the tensor fits
// it (and the packed activation is wanted), else the one-block-per-thread kernel (its K-ordered
// bf16 twin for the register-weight kernel), with a given scale alone, calibrating behind the
// amax kernel.
ffi::Error ChooseQuantizer(int64_t blocks, bool given_scale, bool k_ordered,
                           QuantizerChoice* q) {
  if (!given_scale && !k_ordered && blocks <= jbs_quantize::kCtaBlocks) {
    q->threads = jbs_quantize::kThreads;
    q->ctas = 1;
    return g_quantize_activation_cta.Get(&q->kernel);
  }
  q->threads = jbs_quantize::kStaticThreads;
  q->ctas = static_cast<int>((blocks + q->threads - 1) / q->threads);
  if (!given_scale) {
    if (auto err = g_activation_amax.Get(&q->amax_kernel); err.failure()) return err;
    q->amax_ctas = static_cast<int>(jbs_quantize::AmaxPartials(blocks));
  }
  return (k_ordered ? g_quantize_activation_static_kperm : g_quantize_activation_static)
      .Get(&q->kernel);
}

// Where a quantizer writes: the packed elements (or K-ordered bf16 values), the plain scales,
// the partial amaxes (past one calibrating CTA) and alpha = decode * b_alpha (decode itself
// where b_alpha is null).
struct QuantizerOutputs {
  void* elements;
  void* scales;
  void* amax_partials;
  void* alpha;
};

// Launches the quantizer `q` chose for x's `blocks` blocks on `stream`: the amax kernel first
// where it has one, then the quantizing kernel (its programmatic dependent). a_decode: the given
// decode factor, or an empty buffer to calibrate. alpha: alpha_count products decode *
// b_alpha[i] (b_alpha null: one entry, decode).
ffi::Error LaunchQuantizer(cudaStream_t stream, const QuantizerChoice& q, const void* x,
                           int64_t blocks, const QuantizerOutputs& out, const float* b_alpha,
                           int alpha_count, const void* a_decode) {
  const void* x_ptr = x;
  long long count = blocks;
  void* amax_partials = q.amax_ctas > 0 ? out.amax_partials : nullptr;
  int amax_count = q.amax_ctas;
  if (q.amax_ctas > 0) {
    void* amax_args[] = {&x_ptr, &count, &amax_partials};
    const QuantizerLaunch amax(q.amax_ctas, jbs_quantize::kAmaxThreads, stream,
                               /*dependent=*/false);
    cudaError_t e = cudaLaunchKernelExC(&amax.config, reinterpret_cast<const void*>(q.amax_kernel),
                                        amax_args);
    if (e != cudaSuccess) return g_state.CudaError("jbs_nvfp4_activation_amax", e);
  }
  void* elements = out.elements;
  void* scales = out.scales;
  void* alpha_out = out.alpha;
  void* args[] = {&x_ptr,    &count,         &elements,   &scales,     &alpha_out,
                  &b_alpha,  &a_decode,      &amax_partials, &amax_count, &alpha_count};
  const QuantizerLaunch launch(q.ctas, q.threads, stream, /*dependent=*/q.amax_ctas > 0);
  cudaError_t e =
      cudaLaunchKernelExC(&launch.config, reinterpret_cast<const void*>(q.kernel), args);
  if (e != cudaSuccess) return g_state.CudaError("jbs_quantize_nvfp4_activation", e);
  return ffi::Error::Success();
}

// The given decode factor (a_decode [1]) or none (a_decode [0]: calibrate), as both quantizing
// targets take it.
ffi::Error CheckDecodeOperand(const ffi::AnyBuffer& a_decode) {
  if (a_decode.element_type() != ffi::DataType::F32 || a_decode.element_count() > 1)
    return g_state.InvalidArgument("a_decode must be float32 [0] (calibrate) or [1] (given)");
  return ffi::Error::Success();
}

// x must be bf16 [M, K] with K a multiple of `k_multiple`, small enough for the quantizer's grid
// (one CTA per kStaticThreads blocks).
ffi::Error CheckActivation(const ffi::AnyBuffer& x, int64_t m, int64_t k, int64_t k_multiple) {
  if (x.element_type() != ffi::DataType::BF16 || m < 1 || k < 16 || k % k_multiple ||
      static_cast<int64_t>(x.element_count()) != m * k)
    return g_state.InvalidArgument("x must be bf16 [M, K], K a multiple of 16 (64 K-ordered)");
  if (m * k / 16 / jbs_quantize::kStaticThreads >= 0x7FFFFFFF)
    return g_state.InvalidArgument("the activation is too large for the quantizer's grid");
  if (reinterpret_cast<uint64_t>(x.untyped_data()) % 16)
    return g_state.InvalidArgument("x must be 16-byte aligned");
  return ffi::Error::Success();
}

ffi::Error ExecuteQuantizedActivation(
    cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer b, ffi::AnyBuffer sb,
    ffi::AnyBuffer b_alpha, ffi::AnyBuffer a_decode, ffi::Result<ffi::AnyBuffer> c,
    ffi::Result<ffi::AnyBuffer> ws,
    int32_t a_kind, int32_t b_kind, int32_t a_e5m2,
    int32_t b_e5m2, int64_t m, int64_t n, int64_t k, int64_t l, int32_t a_scales_plain,
    int32_t nt, int32_t tile_m, int32_t tile_n, int32_t splits, int32_t partials) {
  // a_kind: NVFP4 (the decode kernel reads the quantized activation: plain scales) or
  // BF16_KPERM (the register-weight kernel reads its values, dequantized and K-ordered: only
  // with a given scale)
  const bool k_ordered = a_kind == JBS_BF16_KPERM;
  if (auto err = CheckDecodeOperand(a_decode); err.failure()) return err;
  const bool given_scale = a_decode.element_count() == 1;
  if (!(a_kind == JBS_NVFP4 && a_scales_plain == 1) && !k_ordered)
    return g_state.InvalidArgument(
        "the activation is quantized to NVFP4 with plain scales, or dequantized in the "
        "register-weight kernel's K order");
  if (a_e5m2 != 0 || l != 1) return g_state.InvalidArgument("a_e5m2 = 0 and l = 1");
  if (auto err = CheckActivation(x, m, k, k_ordered ? 64 : 16); err.failure()) return err;
  const int64_t blocks = m * k / 16;
  // ws holds the quantized activation first, then (from a 256-byte boundary) the GEMM's own
  // split-K workspace: one result, so XLA cannot place the two anywhere near each other
  const ScratchLayout lay = QuantizedActivationScratch(blocks, k_ordered ? 32 : 8);
  if (ws->element_type() != ffi::DataType::F32 ||
      static_cast<int64_t>(ws->size_bytes()) < lay.gemm_ws)
    return g_state.InvalidArgument("the workspace is too small for the quantized activation");
  if (b_alpha.element_type() != ffi::DataType::F32 || b_alpha.element_count() != 1)
    return g_state.InvalidArgument("b_alpha must be one float32");
  // the data must be aligned as the kernel reads it (XLA's buffers are)
  char* base = static_cast<char*>(ws->untyped_data());
  if (reinterpret_cast<uint64_t>(base) % 16)
    return g_state.InvalidArgument("the scratch must be 16-byte aligned");
  const BufferView a_view(base, k_ordered ? XLA_FFI_DataType_BF16 : XLA_FFI_DataType_U8,
                          k_ordered ? m * k : blocks * 8);
  // the register-weight kernel reads no activation scales: b's stand in (as in gemm's call)
  const BufferView sa_view(base + lay.scales, XLA_FFI_DataType_U8, blocks);
  const ffi::AnyBuffer sa = k_ordered ? sb : sa_view.any();
  const BufferView alpha_view(base + lay.alpha, XLA_FFI_DataType_F32, 1);

  QuantizerChoice q;
  if (auto err = ChooseQuantizer(blocks, given_scale, k_ordered, &q); err.failure()) return err;
  const QuantizerOutputs out{base, base + lay.scales, base + lay.amax, base + lay.alpha};
  if (auto err = LaunchQuantizer(stream, q, x.untyped_data(), blocks, out,
                                 static_cast<const float*>(b_alpha.untyped_data()),
                                 /*alpha_count=*/1, a_decode.untyped_data());
      err.failure())
    return err;
  const int64_t gemm_ws_floats = (static_cast<int64_t>(ws->size_bytes()) - lay.gemm_ws) / 4;
  BufferView gemm_ws(base + lay.gemm_ws, XLA_FFI_DataType_F32, gemm_ws_floats);
  // the chained decode variant: launched while the quantizer runs, it waits for it before
  // reading the activation, its scales and alpha; the register-weight kernel runs after it
  return Run(stream, a_view.any(), b, sa, sb, alpha_view.any(), nullptr, c,
             ffi::Result<ffi::AnyBuffer>(gemm_ws.any()),
             a_kind, b_kind, a_e5m2, b_e5m2, m, n, k, l, a_scales_plain, nt, tile_m, tile_n,
             splits, /*index_items=*/0, /*stack=*/0, /*layer=*/0, /*alpha_at=*/nullptr,
             /*chained=*/!k_ordered, /*sizes_items=*/0, /*tiles_per_cta=*/1, partials);
}

// Loads the quantizer kernels jbs.quantize's target launches once, before any call runs (a call
// may be recorded into a CUDA graph).
ffi::Error InstantiateQuantizeNvfp4() {
  cudaKernel_t kernel = nullptr;
  for (PtxKernel* k :
       {&g_quantize_activation_cta, &g_activation_amax, &g_quantize_activation_static})
    if (auto err = k->Get(&kernel); err.failure()) return err;
  return ffi::Error::Success();
}

// jbs.quantize(x, "nvfp4") of a bf16 x [M, K] (the global scale calibrated, or given: a_decode
// [1]) by the same quantizer kernels: the packed elements, the plain scales and alpha, each a
// result of its own; amax: the partial amaxes' scratch. alpha: the stored decode factor (b_alpha
// [0]), or its products with the L global scales of a stacked weight (b_alpha [L]: what the
// layer target reads, so that no XLA kernel multiplies them).
ffi::Error ExecuteQuantizeNvfp4(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer a_decode,
                                ffi::AnyBuffer b_alpha, ffi::Result<ffi::AnyBuffer> elements,
                                ffi::Result<ffi::AnyBuffer> scales,
                                ffi::Result<ffi::AnyBuffer> alpha,
                                ffi::Result<ffi::AnyBuffer> amax, int64_t m, int64_t k) {
  if (auto err = CheckDecodeOperand(a_decode); err.failure()) return err;
  const int64_t layers = static_cast<int64_t>(b_alpha.element_count());
  if (b_alpha.element_type() != ffi::DataType::F32 || layers > 0x7FFFFFFF)
    return g_state.InvalidArgument("b_alpha must be float32 [0] or [L] (a stack's scales)");
  const int alpha_count = layers > 0 ? static_cast<int>(layers) : 1;
  if (auto err = CheckActivation(x, m, k, 16); err.failure()) return err;
  const int64_t blocks = m * k / 16;
  if (elements->element_type() != ffi::DataType::U8 ||
      static_cast<int64_t>(elements->element_count()) != blocks * 8 ||
      scales->element_type() != ffi::DataType::U8 ||
      static_cast<int64_t>(scales->element_count()) != blocks ||
      alpha->element_type() != ffi::DataType::F32 ||
      static_cast<int64_t>(alpha->element_count()) != alpha_count ||
      amax->element_type() != ffi::DataType::F32 ||
      static_cast<int64_t>(amax->element_count()) < jbs_quantize::AmaxPartials(blocks))
    return g_state.InvalidArgument(
        "results: elements u8 [M * K / 2], scales u8 [M * K / 16], alpha f32 [max(L, 1)], amax "
        "f32 [one per 256 blocks]");
  if (reinterpret_cast<uint64_t>(elements->untyped_data()) % 8)
    return g_state.InvalidArgument("elements must be 8-byte aligned");
  QuantizerChoice q;
  if (auto err = ChooseQuantizer(blocks, a_decode.element_count() == 1, /*k_ordered=*/false, &q);
      err.failure())
    return err;
  const QuantizerOutputs out{elements->untyped_data(), scales->untyped_data(),
                             amax->untyped_data(), alpha->untyped_data()};
  return LaunchQuantizer(stream, q, x.untyped_data(), blocks, out,
                         layers > 0 ? static_cast<const float*>(b_alpha.untyped_data()) : nullptr,
                         alpha_count, a_decode.untyped_data());
}

}  // namespace

void RecordLoadError(int cuda_error) { g_state.RecordLoadError(cuda_error); }

}  // namespace jbs

JBS_FFI_EXPORT_HANDLER(jax_blockscale_gemm_sm90_instantiate, jbs::Instantiate,
                       ffi::Ffi::BindInstantiate());

namespace jbs {
// The attributes both execute handlers take after their buffers, in their signatures' order: the
// operand kinds and flavours, the problem (`batch` names L: "l" for gemm, "g", the experts, for
// ragged_gemm) and the planned variant.
template <class Binding>
auto BindPlannedAttrs(Binding b, const char* batch) {
  return std::move(b)
      .template Attr<int32_t>("a_kind")
      .template Attr<int32_t>("b_kind")
      .template Attr<int32_t>("a_e5m2")
      .template Attr<int32_t>("b_e5m2")
      .template Attr<int64_t>("m")
      .template Attr<int64_t>("n")
      .template Attr<int64_t>("k")
      .template Attr<int64_t>(batch)
      .template Attr<int32_t>("a_scales_plain")
      .template Attr<int32_t>("nt")
      .template Attr<int32_t>("tile_m")
      .template Attr<int32_t>("tile_n")
      .template Attr<int32_t>("splits");
}
}  // namespace jbs

JBS_FFI_EXPORT_HANDLER(jax_blockscale_gemm_sm90, jbs::Execute,
                       jbs::BindPlannedAttrs(
                           jbs_ffi::BindGemmOperands()    // stream, a, b, sa, sb, alpha, c
                               .Ret<ffi::AnyBuffer>(),    // ws (decode workspace, f32)
                           "l")
                           // 1: the caller adds the decode kernel's split partials
                           .Attr<int32_t>("partials"),
                       {ffi::Traits::kCmdBufferCompatible});

JBS_FFI_EXPORT_HANDLER(jax_blockscale_ragged_gemm_sm90, jbs::ExecuteRagged,
                       jbs::BindPlannedAttrs(
                           ffi::Ffi::Bind()
                               .Ctx<ffi::PlatformStream<cudaStream_t>>()
                               .Arg<ffi::AnyBuffer>()    // a
                               .Arg<ffi::AnyBuffer>()    // b
                               .Arg<ffi::AnyBuffer>()    // sa
                               .Arg<ffi::AnyBuffer>()    // sb
                               .Arg<ffi::AnyBuffer>()    // alpha
                               .Arg<ffi::AnyBuffer>()    // items
                               .Ret<ffi::AnyBuffer>()    // c
                               .Ret<ffi::AnyBuffer>(),   // ws
                           "g")
                           // 0: items is a work table; > 0: items holds the G group sizes
                           // (groups from row 0) and the kernel makes this many items
                           .Attr<int64_t>("sizes_items")
                           // the grouped decode kernel: adjacent tiles of N per CTA (1..16)
                           .Attr<int32_t>("tiles_per_cta")
                           // 1: the caller adds the grouped decode kernel's split partials
                           .Attr<int32_t>("partials"),
                       {ffi::Traits::kCmdBufferCompatible});

JBS_FFI_EXPORT_HANDLER(jax_blockscale_layer_gemm_sm90, jbs::ExecuteLayer,
                       jbs::BindPlannedAttrs(
                           ffi::Ffi::Bind()
                               .Ctx<ffi::PlatformStream<cudaStream_t>>()
                               .Arg<ffi::AnyBuffer>()    // a (the layer's plan)
                               .Arg<ffi::AnyBuffer>()    // a_index (index mode's)
                               .Arg<ffi::AnyBuffer>()    // b (the stack)
                               .Arg<ffi::AnyBuffer>()    // sa
                               .Arg<ffi::AnyBuffer>()    // sb (the stack)
                               .Arg<ffi::AnyBuffer>()    // alpha (one per layer)
                               .Arg<ffi::AnyBuffer>()    // index
                               .Arg<ffi::AnyBuffer>()    // probe (slice mode: the sb stack)
                               .Ret<ffi::AnyBuffer>()    // c
                               .Ret<ffi::AnyBuffer>(),   // ws
                           "l")
                           .Attr<int64_t>("g")
                           .Attr<int32_t>("index_a_kind")
                           .Attr<int32_t>("index_nt")
                           .Attr<int32_t>("index_tile_m")
                           .Attr<int32_t>("index_tile_n")
                           .Attr<int32_t>("index_splits")
                           .Attr<int64_t>("index_items")
                           // 1: the caller adds the split partials (both plans split alike)
                           .Attr<int32_t>("partials"),
                       {ffi::Traits::kCmdBufferCompatible});

JBS_FFI_EXPORT_HANDLER(jax_blockscale_quantized_act_gemm_sm90, jbs::ExecuteQuantizedActivation,
                       jbs::BindPlannedAttrs(
                           ffi::Ffi::Bind()
                               .Ctx<ffi::PlatformStream<cudaStream_t>>()
                               .Arg<ffi::AnyBuffer>()    // x (bf16, before quantization)
                               .Arg<ffi::AnyBuffer>()    // b
                               .Arg<ffi::AnyBuffer>()    // sb
                               .Arg<ffi::AnyBuffer>()    // b_alpha
                               .Arg<ffi::AnyBuffer>()    // a_decode: [0] or the given [1]
                               .Ret<ffi::AnyBuffer>()    // c
                               .Ret<ffi::AnyBuffer>(),   // ws (the quantized x, then the GEMM's)
                           "l")
                           .Attr<int32_t>("partials"),  // as for gemm
                       {ffi::Traits::kCmdBufferCompatible});

JBS_FFI_EXPORT_HANDLER(jax_blockscale_quantize_nvfp4_sm90_instantiate,
                       jbs::InstantiateQuantizeNvfp4, ffi::Ffi::BindInstantiate());

JBS_FFI_EXPORT_HANDLER(jax_blockscale_quantize_nvfp4_sm90, jbs::ExecuteQuantizeNvfp4,
                       ffi::Ffi::Bind()
                           .Ctx<ffi::PlatformStream<cudaStream_t>>()
                           .Arg<ffi::AnyBuffer>()   // x (bf16 [M, K])
                           .Arg<ffi::AnyBuffer>()   // a_decode: [0] or the given [1]
                           .Arg<ffi::AnyBuffer>()   // b_alpha: [0] or a stack's [L]
                           .Ret<ffi::AnyBuffer>()   // elements (u8, two per byte)
                           .Ret<ffi::AnyBuffer>()   // scales (u8 e4m3, plain)
                           .Ret<ffi::AnyBuffer>()   // alpha (f32 [max(L, 1)])
                           .Ret<ffi::AnyBuffer>()   // amax (f32 partials' scratch)
                           .Attr<int64_t>("m")
                           .Attr<int64_t>("k"),
                       {ffi::Traits::kCmdBufferCompatible});

// ---- plain C entry points (ctypes): introspection and the pure validation, no GPU needed ----
extern "C" {

JBS_EXPORT int jbs_num_variants() { return kJbsNumVariants; }

// The layer target's test of a probe's address (LayerAt), without a GPU.
JBS_EXPORT long long jbs_layer_at(unsigned long long at, unsigned long long base,
                                  unsigned long long bytes, long long layers) {
  return jbs::LayerAt(at, base, bytes, layers);
}

// The quantized activation's scratch layout for `blocks` blocks of `block_bytes` elements:
// offsets of the scales and alpha, and the bytes in all (the lowering's
// quantized_activation_scratch_bytes is checked against it).
JBS_EXPORT void jbs_quantized_activation_scratch(long long blocks, long long block_bytes,
                                                 long long* out) {
  const jbs::ScratchLayout s = jbs::QuantizedActivationScratch(blocks, block_bytes);
  out[0] = s.scales; out[1] = s.amax; out[2] = s.alpha; out[3] = s.bytes;
}

// counts[0]: layer calls that found their layer in place; counts[1]: those that did not.
JBS_EXPORT void jbs_layer_gemm_counts(long long* counts) {
  for (int i = 0; i < 2; ++i) counts[i] = jbs::g_layer_calls[i].load();
}

// vals: a_kind, b_kind, out, tile_m, tile_n, sm, nt, k_chunk, grouped
JBS_EXPORT int jbs_variant_info(int i, const char** name, int* vals) {
  if (i < 0 || i >= kJbsNumVariants) return 1;
  const jbs::Variant& v = kJbsVariants[i];
  *name = v.name;
  const int x[10] = {v.a_kind, v.b_kind, v.out, v.tile_m, v.tile_n, v.sm, v.nt, v.k_chunk,
                     v.grouped, v.chained};
  for (int j = 0; j < 10; ++j) vals[j] = x[j];
  return 0;
}

// The execute stage's validation (ValidateProblem), without a GPU. ints: a_kind, b_kind, out,
// a_e5m2, b_e5m2, cc_major, cc_minor, sm_count, a_scales_plain, nt, tile_m, tile_n, splits,
// grouped, chained, tiles_per_cta, partials; longs: m, n, k, l, a_bytes, b_bytes, sa_bytes, sb_bytes, c_bytes, alpha_bytes,
// ws_bytes, items_bytes, num_items; ptrs: a, b, sa, sb, c, alpha, ws, items. Returns 0 with the
// variant's name in msg, or 1 with the reason.
JBS_EXPORT int jbs_sm90_check_problem(const int* ints, const long long* longs,
                                      const unsigned long long* ptrs, char* msg, int msg_len) {
  jbs::Problem p{};
  p.a_kind = ints[0]; p.b_kind = ints[1]; p.out = ints[2]; p.a_e5m2 = ints[3];
  p.b_e5m2 = ints[4]; p.cc_major = ints[5]; p.cc_minor = ints[6]; p.sm_count = ints[7];
  p.a_scales_plain = ints[8]; p.nt = ints[9]; p.tile_m = ints[10]; p.tile_n = ints[11];
  p.splits = ints[12]; p.grouped = ints[13]; p.chained = ints[14]; p.tiles_per_cta = ints[15];
  p.partials = ints[16];
  p.m = longs[0]; p.n = longs[1]; p.k = longs[2]; p.l = longs[3];
  p.a_bytes = longs[4]; p.b_bytes = longs[5]; p.sa_bytes = longs[6]; p.sb_bytes = longs[7];
  p.c_bytes = longs[8]; p.alpha_bytes = longs[9]; p.ws_bytes = longs[10];
  p.items_bytes = longs[11]; p.num_items = longs[12];
  p.a_ptr = ptrs[0]; p.b_ptr = ptrs[1]; p.sa_ptr = ptrs[2]; p.sb_ptr = ptrs[3];
  p.c_ptr = ptrs[4]; p.alpha_ptr = ptrs[5]; p.ws_ptr = ptrs[6]; p.items_ptr = ptrs[7];
  char buf[512];
  const jbs::Variant* v = nullptr;
  const char* why = jbs::ValidateProblem(p, kJbsVariants, kJbsNumVariants, &v, buf, sizeof(buf));
  if (msg && msg_len > 0) snprintf(msg, static_cast<size_t>(msg_len), "%s", why ? why : v->name);
  return why ? 1 : 0;
}

}  // extern "C"
