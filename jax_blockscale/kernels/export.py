"""Host-side set-up shared by the kernels' AOT export (build time only; needs the DSL):
compiling a kernel for an architecture without a GPU, placeholder pointer arguments, and writing
the `<prefix>.h` / `<prefix>.o` pair the native library links."""
from __future__ import annotations

import os

import cutlass.cute as cute


def compile_for_arch(fn, args, arch: str):
    """cute.compile(fn, *args) for `arch`. The DSL takes the target from CUTE_DSL_ARCH (read
    once); setting it on the DSL itself means no GPU is probed and the caller's environment
    (another arch's build in the same process, say) does not matter."""
    from cutlass.cutlass_dsl import CuTeDSL

    env = CuTeDSL._get_dsl().envar
    prev = env._arch
    env.arch = arch
    try:
        return cute.compile(fn, *args)
    finally:
        env._arch = prev


def placeholder_ptr(dtype, align: int = 16):
    """A global-memory pointer argument for tracing: only its element type and alignment matter;
    the exported launcher takes the real device address."""
    from cutlass.cute.runtime import make_ptr

    return make_ptr(dtype, 16, cute.AddressSpace.gmem, assumed_align=align)


def export_compiled(compiled, out_dir: str, prefix: str) -> tuple[str, str]:
    """Write a compiled kernel's launcher header and object as out_dir/<prefix>.h / .o, every
    symbol named after `prefix` (one per variant, so many link into one library)."""
    os.makedirs(out_dir, exist_ok=True)
    compiled.export_to_c(file_path=out_dir, file_name=prefix, function_prefix=prefix)
    return os.path.join(out_dir, prefix + ".h"), os.path.join(out_dir, prefix + ".o")
