"""gemm(x, w, quantize_a="nvfp4") calls on the fused target, small and large, and jbs.quantize
on the quantizer kernels alone, for compute-sanitizer (tests/gpu/test_quantized_activation.py
runs this file under it): the one-CTA quantizer, the amax kernel and the one-block-per-thread
kernel behind it (packing, and writing the register-weight kernel's K order with split K), the
given-scale quantizer (a_global_scale, one partial CTA, large, K-ordered), the chained decode
kernel with one K range and with split K, every output dtype, N not a multiple of the tile.
Prints one line per call: whether it ran on its target and whether it equals the XLA
composition bit for bit."""
import jax
import jax.numpy as jnp
import numpy as np

import jax_blockscale as jbs
from jax_blockscale import _plugin

rng = np.random.default_rng(0)
for m, n, k, out, g in [(1, 256, 4096, jnp.bfloat16, None), (3, 1000, 64, jnp.float32, None),
                        (16, 384, 2048, jnp.float16, None),
                        (16, 512, 16384, jnp.float32, None), (40, 4096, 8192, jnp.bfloat16, None),
                        (32, 256, 1024, jnp.bfloat16, None), (5, 300, 2048, jnp.float32, 0.01),
                        (32, 512, 16384, jnp.bfloat16, 0.02),
                        (64, 384, 1024, jnp.bfloat16, 0.01), (40, 4096, 8192, jnp.float32, 0.01)]:
    x = jnp.asarray(rng.standard_normal((m, k)) * 10.0 ** rng.uniform(-2, 2, (m, 1)),
                    jnp.bfloat16)
    w = jbs.quantize(rng.standard_normal((n, k)).astype(np.float32), "nvfp4",
                     global_scale="per_matrix", layout="blocked")
    gs = "auto" if g is None else jnp.float32(g)
    fused = jax.jit(lambda x, w: jbs.gemm(x, w, quantize_a="nvfp4", out_dtype=out,
                                          a_global_scale=None if g is None else gs))
    composed = jax.jit(lambda x, w: jbs.gemm(jbs.quantize(x, "nvfp4", global_scale=gs), w,
                                             out_dtype=out))
    on_target = _plugin.QUANTIZED_ACT_SM90_TARGET in fused.lower(x, w).as_text()
    same = bool(np.array_equal(np.asarray(fused(x, w), np.float32),
                               np.asarray(composed(x, w), np.float32), equal_nan=True))
    print(f"call m={m} n={n} k={k} given_scale={g}: fused={on_target} equal={same}", flush=True)

# jbs.quantize's own target (the quantizer kernels alone): one CTA, and the amax kernel behind
# which one block per thread quantizes (a partial last amax CTA)
from jax_blockscale.core.formats import get_format  # noqa: E402
from jax_blockscale.core.quantize import _quantize_nvfp4  # noqa: E402

for m, k in [(3, 1024), (3, 21856)]:
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    f = jax.jit(lambda x: jbs.quantize(x, "nvfp4"))
    on_target = _plugin.QUANTIZE_NVFP4_SM90_TARGET in f.lower(x).as_text()
    q = f(x)
    data, scales, g = jax.jit(lambda x: _quantize_nvfp4(x, get_format("nvfp4"), "auto"))(x)
    same = bool(np.array_equal(np.asarray(q.data, np.float32), np.asarray(data, np.float32))
                and np.array_equal(np.asarray(q.scales, np.float32),
                                   np.asarray(scales, np.float32), equal_nan=True)
                and float(q.global_scale) == float(g))
    print(f"call quantize m={m} k={k}: fused={on_target} equal={same}", flush=True)
