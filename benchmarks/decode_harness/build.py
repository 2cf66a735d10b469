"""Build the decode harness library (no GPU needed): export decode variants, link one .so.

    python benchmarks/decode_harness/build.py [--out benchmarks/decode_harness/build] [--only PAT]
        [--extra-tunings cpasync:4:1:2:2,regs:2:2:1:1]

For every variant of jax_blockscale.kernels.sm90_decode (default tuning; plus, per extra tuning
pipeline:stages:sub_steps:min_blocks:ctas_per_sm[:fold 0/1[:act_window bytes[:rows_per_thread
[:probe[:box_steps]]]]],
its bf16/f32-output variants named <name>_T<tag>) it runs cute.compile for sm_90a and
export_to_c, then links the objects, a small C shim (one `load_<name>` and `run_<name>` per
variant: the header's launcher is `static inline`), the DSL's libcuda_dialect_runtime_static.a and
a static cudart into `libdecode_harness.so` (the plugin's recipe, DESIGN.md "AOT build"). Writes
`variants.json` (name -> variant, tuning, default) next to it. run_decode.py loads the result on
the GPU machine (carry the folder).
"""
from __future__ import annotations

import argparse
import dataclasses
import fnmatch
import glob
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.abspath(os.path.join(HERE, "..", "..")))

_SHIM = """
static {p}_Kernel_Module_t g_{p};
int load_{p}(void) {{ {p}_Kernel_Module_Load(&g_{p}); return (int)cudaGetLastError(); }}
int run_{p}(void *a, void *b, void *sa, void *sb, void *c, void *alpha, void *ws, int32_t m,
            int32_t n, int32_t k, int32_t l, int32_t a_e5m2, int32_t b_e5m2, int32_t splits,
            void *stream) {{
  return cute_dsl_{p}_wrapper(&g_{p}, a, b, sa, sb, c, alpha, ws, m, n, k, l, a_e5m2, b_e5m2,
                              splits, (cudaStream_t)stream);
}}
"""


def cuda_root():
    for root in (os.environ.get("CUDA_HOME"), "/usr/local/cuda"):
        if root and os.path.exists(os.path.join(root, "include", "cuda_runtime.h")):
            return root
    raise SystemExit("no CUDA toolkit (set CUDA_HOME)")


def static_cudart(root):
    for sub in ("lib64", "lib", "targets/x86_64-linux/lib"):
        p = os.path.join(root, sub, "libcudart_static.a")
        if os.path.exists(p):
            return p
    raise SystemExit("no libcudart_static.a")


def dsl_runtime():
    import nvidia_cutlass_dsl

    hits = glob.glob(os.path.join(nvidia_cutlass_dsl.__path__[0], "cu13", "lib",
                                  "libcuda_dialect_runtime_static.a"))
    if not hits:
        raise SystemExit("nvidia-cutlass-dsl[cu13] runtime library not found")
    return hits[0]


def link(exports, out_dir, lib_name="libdecode_harness.so"):
    """exports: [(prefix, header, object)] -> path of the linked shared library."""
    root = cuda_root()
    shim = os.path.join(out_dir, "decode_shim.c")
    with open(shim, "w") as f:
        f.write("#include <stdint.h>\n#include <cuda_runtime.h>\n")
        for _, h, _ in exports:
            f.write(f'#include "{os.path.basename(h)}"\n')
        for p, _, _ in exports:
            f.write(_SHIM.format(p=p))
    lib = os.path.join(out_dir, lib_name)
    cmd = ["gcc", "-O2", "-fPIC", "-shared", "-o", lib, shim, *[o for _, _, o in exports],
           f"-I{root}/include", f"-I{out_dir}", dsl_runtime(), static_cudart(root),
           "-ldl", "-lpthread", "-lrt", "-Wl,--exclude-libs,ALL", "-Wl,--no-undefined"]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        raise SystemExit(f"link failed:\n{' '.join(cmd)}\n{res.stderr}")
    return lib


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(HERE, "build"))
    ap.add_argument("--only", default="*", help="fnmatch patterns (comma list) on variant names")
    ap.add_argument("--extra-tunings", default="",
                    help="comma list of pipeline:stages:sub_steps:min_blocks:ctas_per_sm"
                         "[:fold_scale 0/1[:act_window bytes[:rows_per_thread[:probe[:box_steps]]]]]; each "
                         "adds the bf16/f32-output variants under the name suffix _T<tag>")
    args = ap.parse_args(argv)
    from jax_blockscale.kernels import sm90_decode as dec

    os.makedirs(args.out, exist_ok=True)
    jobs = [(v, dec.tuning_for(v.nt), v.name) for v in dec.VARIANTS]  # what the library ships
    for spec in filter(None, args.extra_tunings.split(",")):
        p, st, sub, mb, cps, *rest = spec.split(":")
        tun = dec.Tuning(p, int(st), int(sub), int(mb), int(cps),
                         fold_scale=bool(int(rest[0])) if rest else False,
                         act_window=int(rest[1]) if len(rest) > 1 else 0,
                         rows_per_thread=int(rest[2]) if len(rest) > 2 else 4,
                         probe=rest[3] if len(rest) > 3 else "",
                         box_steps=int(rest[4]) if len(rest) > 4 else 1)
        jobs += [(v, tun, f"{v.name}_T{tun.tag}") for v in dec.VARIANTS if v.out in ("bf16", "f32")]
    exports, table = [], {}
    for v, tun, name in jobs:
        if not any(fnmatch.fnmatch(name, pat) for pat in args.only.split(",")):
            continue
        t0 = time.time()
        try:
            h, o = dec.export_variant(v, args.out, name, tuning=tun)
        except AssertionError as e:  # a tuning this variant cannot take (e.g. fp8 + 1-step "tma")
            print(f"[build] {name}: skipped ({e})", flush=True)
            continue
        exports.append((name, h, o))
        table[name] = dict(variant=dataclasses.asdict(v), tuning=dataclasses.asdict(tun),
                           default=name == v.name)
        print(f"[build] {name}: {time.time() - t0:.1f}s", flush=True)
    lib = link(exports, args.out)
    with open(os.path.join(args.out, "variants.json"), "w") as f:
        json.dump(table, f, indent=1)
    print(f"[build] {len(exports)} variants -> {lib}")


if __name__ == "__main__":
    main()
