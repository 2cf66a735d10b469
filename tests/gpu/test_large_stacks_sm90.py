"""Weight stacks past 2 GiB on a Hopper GPU (skipped without one): a grouped GEMM whose experts
(DeepSeek-V3's gate+up is 3.8 GB in MXFP4) or a stacked weight whose layers pass 2^31 bytes runs
the kernels, which read the weights by TMA with 64-bit addresses, and the experts and layers
past the 2 GiB mark come out right. Before, the planner sent such calls to the reference
(13 ms per decode call at DeepSeek-V3's shapes, out of memory at 4096 tokens).

Fresh random data (never zeros), the allocator filled with NaN first (an unwritten output shows
up). Each expert's rows are compared with the reference backend on that expert alone (a slice of
the stack, small enough for the reference): relative Frobenius error < 1e-5 with f32 output.
"""
from __future__ import annotations

import numpy as np
import pytest

import jax
import jax.numpy as jnp

import jax_blockscale as jbs
from jax_blockscale.lowering import plan as planner
from jax_blockscale.ragged import ragged_gemm_spec
from jax_blockscale.ragged.api import _operands_and_params
from jax_blockscale.ragged.primitive import ragged_spec
from configure import set_env  # tests/support/configure.py
from hopper import needs_sm90, poison  # tests/support/hopper.py

pytestmark = [pytest.mark.gpu, needs_sm90]

# 152 experts of 4096 x 7168: 2.23 GB of FP4 elements, the last ones past 2^31 bytes
G, N, K = 152, 4096, 7168
PAST_2GIB = -(-2**31 // (N * K // 2))  # the first expert whose elements start past 2 GiB
CHUNK = 16  # experts drawn and quantized at a time


@pytest.fixture(scope="module", params=["mxfp4", "nvfp4"])
def stack(request):
    """(fmt, the (G, N, K) quantized stack), built on the device CHUNK experts at a time."""
    fmt = request.param
    kw = dict(global_scale="per_matrix") if fmt == "nvfp4" else {}
    parts = []
    for e0 in range(0, G, CHUNK):
        key = jax.random.fold_in(jax.random.PRNGKey(11), e0)
        w = jax.random.normal(key, (min(CHUNK, G - e0), N, K), jnp.float32) / np.sqrt(K)
        w = w * jnp.linspace(0.5, 2.0, w.shape[0])[:, None, None]  # experts differ in scale
        parts.append(jbs.quantize(w, fmt, layout="blocked", **kw))
        del w
    w = jax.tree.map(lambda *a: jnp.concatenate(a), *parts)
    assert w.shape == (G, N, K) and G * N * K // 2 > 2**31
    return fmt, w


def _rows_match_each_expert(x, w, sizes, got):
    """Each expert's rows of `got` against the reference on that expert alone."""
    start = 0
    for e, r in enumerate(sizes):
        if r:
            want = jbs.ragged_gemm(x[start:start + r], w[e:e + 1], jnp.asarray([r], jnp.int32),
                                   out_dtype=jnp.float32, backend="reference")
            want = np.asarray(want, np.float64)
            err = np.linalg.norm(got[start:start + r] - want) / np.linalg.norm(want)
            assert err < 1e-5, (e, r, err)
        start += r
    assert not np.any(got[start:]), "rows past the groups must be zero"


@pytest.mark.parametrize("kernel,m", [("decode", 40), ("prefill", 700)])
def test_ragged_gemm_reads_experts_past_2_gib(stack, kernel, m, monkeypatch):
    """Rows routed to experts before and past the 2 GiB mark (the last expert included), empty
    experts between them, and rows past the groups; both grouped kernels."""
    set_env(monkeypatch, JAX_BLOCKSCALE_SM90_RAGGED_KERNEL=kernel)
    fmt, w = stack
    rng = np.random.default_rng(7 + m)
    sizes = np.zeros(G, np.int64)
    hit = [0, 5, PAST_2GIB - 1, PAST_2GIB, PAST_2GIB + 3, G - 1]
    sizes[hit] = rng.multinomial(m - 5, np.full(len(hit), 1 / len(hit)))  # 5 rows past
    x = jnp.asarray(rng.standard_normal((m, K)), jnp.bfloat16)
    gs = jnp.asarray(sizes, jnp.int32)
    p = planner.plan_ragged_sm90(ragged_gemm_spec(x, w, gs, out_dtype=jnp.float32),
                                 planner.device_for("cuda"))
    assert not isinstance(p, str) and p.kernel == f"ragged_{kernel}", p
    poison()
    got = jax.jit(lambda a, b, g: jbs.ragged_gemm(a, b, g, out_dtype=jnp.float32))(x, w, gs)
    got = np.asarray(got, np.float64)
    assert np.all(np.isfinite(got)), "unwritten (NaN) output elements"
    _rows_match_each_expert(x, w, sizes.tolist(), got)


def test_layer_of_a_stack_past_2_gib(stack):
    """gemm(x, w, layer=i) on a stack past 2 GiB (index mode: the index a jit argument, the
    stack read in place) for layers before and past the mark, against the reference on the
    sliced layer."""
    fmt, w = stack
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.standard_normal((4, K)), jnp.bfloat16)
    operands, params = _operands_and_params(x, w, jnp.int32(0), jnp.float32, None,
                                            group_index=True)
    avals = [jax.core.ShapedArray(jnp.shape(o), jnp.result_type(o)) for o in operands]
    p = planner.plan_ragged_sm90(ragged_spec(avals, **params), planner.device_for("cuda"))
    assert not isinstance(p, str) and p.kernel == "ragged_decode", p  # index mode, in place
    run = jax.jit(lambda x, w, i: jbs.gemm(x, w, layer=i, out_dtype=jnp.float32))
    for i in (1, PAST_2GIB, G - 1):
        poison()
        got = np.asarray(run(x, w, jnp.int32(i)), np.float64)
        want = np.asarray(jbs.gemm(x, w[i], out_dtype=jnp.float32, backend="reference"),
                          np.float64)
        err = np.linalg.norm(got - want) / np.linalg.norm(want)
        assert err < 1e-5, (fmt, i, err)
