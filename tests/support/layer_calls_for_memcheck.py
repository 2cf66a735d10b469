"""gemm(x, stack, layer=i) calls on every path of the layer target, small, for
compute-sanitizer (tests/gpu/test_layer_memcheck.py runs this file under it): the layer found in
place (a loop counter over weights passed to jit), index mode (a jit-argument index, out of
range at both ends), slice mode in place and with its alpha gathered, split K and W4A4.
Prints one line per call and the layer target's counts."""
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import jax_blockscale as jbs
from jax_blockscale import _plugin

rng = np.random.default_rng(0)
for fmt, act, m, n, k, idx in [("nvfp4", None, 1, 256, 4096, -5), ("mxfp4", None, 20, 200, 96, 7),
                               ("mxfp8_e4m3", None, 64, 256, 512, 2),
                               ("nvfp4", "nvfp4", 5, 384, 1024, 99),
                               ("nvfp4", None, 64, 256, 1024, -1), ("nvfp4", None, 48, 256, 1024, 9)]:
    kw = dict(global_scale="per_matrix") if fmt == "nvfp4" else {}
    w = jbs.quantize(rng.standard_normal((3, n, k)).astype(np.float32), fmt, layout="blocked", **kw)
    x = rng.standard_normal((m, k)).astype(np.float32)
    a = jnp.asarray(x, jnp.bfloat16) if act is None else jbs.quantize(x, act)
    y = jax.jit(lambda a, w, i: jbs.gemm(a, w, layer=i))(a, w, idx)
    loop = jax.jit(lambda a, w: lax.fori_loop(
        0, 3, lambda i, acc: acc + jbs.gemm(a, w, layer=i, out_dtype=jnp.float32),
        jnp.zeros((m, n), jnp.float32)))(a, w)
    print(fmt, act, m, idx, float(jnp.abs(y.astype(jnp.float32)).sum()),
          float(jnp.abs(loop).sum()), flush=True)
print("layer target counts (in place, index mode or gathered):", _plugin.layer_gemm_counts())
