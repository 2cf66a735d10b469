"""ragged_gemm calls on both sm90 grouped kernels (the decode kernel and the register-weight
prefill kernel), small, for compute-sanitizer (tests/gpu/test_ragged_memcheck.py runs this file
under it): group sizes that are negative, that run past M (up to int32's extremes) or that
leave rows to no group (the decode kernel reads them raw and makes them safe itself), a
shifted first row (an expert-parallel shard), quantized and plain activations; the decode
kernel also with CTAs over three tiles of N each (the last CTA over fewer), the prefill kernel
also with 32-row items. Prints one line per call."""
import os

import jax
import jax.numpy as jnp
import numpy as np

import jax_blockscale as jbs
from jax_blockscale import config
from jax_blockscale.ragged import api as ragged_api
from jax_blockscale.ragged import primitive as ragged_mod
from jax_blockscale.catalog import sm90 as cat

rng = np.random.default_rng(0)
SIZES = ([5, -3, 40, 9, 2, 0, 1, 1], [2**30, 2**30, 5, 0, 0, 0, 0, 1], [1, 2, 3, 0, 0, 0, 0, 0],
         [2**31 - 1, -2**31, 7, 0, 0, 0, 0, 2**31 - 1])  # int32 extremes: sums saturate
# one problem per kernel (each call compiles and runs slowly under the sanitizer): the decode
# kernel with a plain activation, the prefill kernel with a quantized one (dequantized first);
# the decode kernel again with three tiles of N per CTA (N = 1000: 8-row items on 128-row tiles);
# the prefill kernel's 32-row items (two k-groups of warp groups, an odd number of k-tiles);
# the prefill kernel with fp8 weights (its rows' whole k-tiles read, natural K order)
for label, kernel, per_cta, (fmt, act, m, n, k) in [
        ("decode", "decode", None, ("nvfp4", None, 64, 256, 256)),
        ("prefill", "prefill", None, ("mxfp4", "mxfp4", 200, 320, 192)),
        ("decode3", "decode", 3, ("mxfp4", None, 12, 1000, 512)),
        ("prefill32", "prefill", None, ("nvfp4", None, 100, 320, 192)),
        ("prefill8", "prefill", None, ("mxfp8_e4m3", None, 200, 320, 192))]:
    os.environ["JAX_BLOCKSCALE_SM90_RAGGED_KERNEL"] = kernel
    if label == "prefill32":
        os.environ["JAX_BLOCKSCALE_SM90_RAGGED_TILE_M"] = str(cat.RAGGED_PREFILL_NARROW_TILE_M)
    else:
        os.environ.pop("JAX_BLOCKSCALE_SM90_RAGGED_TILE_M", None)
    config.reload()
    if per_cta is not None:
        cat.ragged_decode_tiles_per_cta = lambda *args, per_cta=per_cta, **kw: per_cta
    kw = dict(global_scale="per_matrix") if fmt == "nvfp4" else {}
    w = jbs.quantize(rng.standard_normal((8, n, k)).astype(np.float32), fmt,
                     layout="blocked", **kw)
    x = rng.standard_normal((m, k)).astype(np.float32)
    a = jnp.asarray(x, jnp.bfloat16) if act is None else jbs.quantize(x, act)
    f = jax.jit(lambda a, w, g: jbs.ragged_gemm(a, w, g))  # traced under this mode
    for sizes in SIZES:
        gs = jnp.asarray(sizes, jnp.int32)
        y = f(a, w, gs)
        print(label, fmt, act, m, sizes, float(jnp.abs(y.astype(jnp.float32)).sum()),
              flush=True)
    # an expert-parallel shard's call: rows before row_start belong to other devices
    operands, params = ragged_api._operands_and_params(a, w, gs, jnp.bfloat16, None)
    params = dict(params, out_dtype=np.dtype(jnp.bfloat16))
    y = jax.jit(lambda *o: ragged_mod.bind_local(o, params, jnp.int32(m // 3)))(*operands)
    print(label, fmt, act, m, "row_start", float(jnp.abs(y.astype(jnp.float32)).sum()),
          flush=True)
