"""Kernel catalogues: per architecture, everything that is decided about the compiled kernels,
in pure Python (no DSL, no CUDA import).

A catalogue lists what each kernel takes (operand kinds, format pairs, output dtypes), the kind
and output codes shared with the C++ handlers, the compiled variants (tiles, tunings), and the
measured thresholds and heuristics that choose among them. Everything else reads it:

  * the AOT build (`jax_blockscale.aot`) compiles the variants it lists and generates the C++
    variant tables and code headers from it;
  * the planner (`jax_blockscale.lowering.plan`) turns a problem into a Plan with it;
  * the tests compare the built library with it.

`sm90` is Hopper (wgmma fused GEMM, register-weight variants, split-K decode kernel); `sm100`
is Blackwell (tcgen05 block-scaled MMA).
"""
