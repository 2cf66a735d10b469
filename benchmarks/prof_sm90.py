"""Run one sm90 gemm a few times and check it against the reference backend: the target to wrap
in `ncu` or `compute-sanitizer` (GPU only).

    python benchmarks/prof_sm90.py FMT M N K [--path kernels|decode|registers|smem|...]
    compute-sanitizer --tool memcheck python benchmarks/prof_sm90.py nvfp4 129 300 160
    ncu --clock-control none -k regex:Sm90 python benchmarks/prof_sm90.py w:nvfp4 128 16384 16384

FMT as in bench_sm90.py ("w:nvfp4" is weight-only); the paths are bench_sm90.py's (default
"kernels": the sm90 kernels at every M, never dequantize + GEMM).
"""
import argparse
import os
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np

import jax_blockscale as jbs
from jax_blockscale import config

from bench_sm90 import PATHS


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="\n".join(__doc__.splitlines()[1:]))
    ap.add_argument("fmt")
    ap.add_argument("m", type=int)
    ap.add_argument("n", type=int)
    ap.add_argument("k", type=int)
    ap.add_argument("--path", default="kernels", choices=sorted(PATHS))
    ap.add_argument("--calls", type=int, default=3)
    args = ap.parse_args()
    weight_only = args.fmt.startswith("w:")
    fmt = args.fmt.removeprefix("w:")
    k1, k2 = jax.random.split(jax.random.PRNGKey(0))
    x = jax.random.normal(k1, (args.m, args.k))
    b = jbs.quantize(jax.random.normal(k2, (args.n, args.k)), fmt, layout="blocked")
    a = x.astype(jnp.bfloat16) if weight_only else jbs.quantize(x, fmt, layout="blocked")
    backend, env = PATHS[args.path]
    with mock.patch.dict(os.environ, env):
        config.reload()
        f = jax.jit(lambda a, b: jbs.gemm(a, b, out_dtype=jnp.float32, backend=backend)
                    ).lower(a, b).compile()
    config.reload()
    for _ in range(args.calls):
        y = f(a, b)
    ref = jbs.gemm(a, b, out_dtype=jnp.float32, backend="reference")
    y, ref = np.asarray(y, np.float64), np.asarray(ref, np.float64)
    print("rel err", np.linalg.norm(y - ref) / np.linalg.norm(ref))


if __name__ == "__main__":
    main()
