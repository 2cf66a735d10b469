"""`gemm(x, w, layer=i)` on a Hopper GPU: one layer of a stacked weight, read in place (skipped
without one). Where XLA hands the layer target its probe in place (the index a loop counter) the
layer runs gemm's own plan for it, bit for bit as `gemm(x, w[i])`; elsewhere the grouped decode
kernel's index mode reads the index on the device.

Fresh random data every check (never zeros), the allocator filled with NaN first (an unwritten
output shows up). Errors are relative Frobenius errors against the reference backend on the
sliced layer (`gemm(x, w[i], backend="reference")`): < 1e-5 for f32 output, output rounding for
bf16.
"""
from __future__ import annotations

import re

import numpy as np
import pytest

import jax
import jax.numpy as jnp

import jax_blockscale as jbs
from jax_blockscale import _plugin
from jax_blockscale.lowering import plan as planner
from jax_blockscale.ragged.api import _operands_and_params
from jax_blockscale.ragged.primitive import ragged_spec
from hopper import needs_sm90, poison  # tests/support/hopper.py

pytestmark = [pytest.mark.gpu, needs_sm90]

LAYER = "jax_blockscale_layer_gemm_sm90"
DENSE = "jax_blockscale_gemm_sm90"
PAIRS = [(None, "nvfp4"), (None, "mxfp4"), (None, "mxfp8_e4m3"), (None, "mxfp8_e5m2"),
         ("nvfp4", "nvfp4"), ("mxfp4", "mxfp4"), ("mxfp8_e4m3", "mxfp8_e5m2")]
OUTS = {"f32": (jnp.float32, 1e-5), "bf16": (jnp.bfloat16, 8e-3)}
_seed = [9000]


def _rng():
    _seed[0] += 1
    return np.random.default_rng(_seed[0])


def _stack(fmt, layers, n, k):
    w = (_rng().standard_normal((layers, n, k)) / np.sqrt(k)).astype(np.float32)
    w[:, :, :k // 3] *= 4.0  # blocks of different magnitudes
    w *= np.linspace(0.5, 2.0, layers, dtype=np.float32)[:, None, None]  # layers differ
    kw = dict(global_scale="per_matrix") if fmt == "nvfp4" else {}
    return jbs.quantize(jnp.asarray(w), fmt, layout="blocked", **kw)


def _activation(fmt, m, k):
    x = _rng().standard_normal((m, k)).astype(np.float32)
    return jnp.asarray(x, jnp.bfloat16) if fmt is None else jbs.quantize(x, fmt)


def _layer_of(w, i):
    return jax.tree.map(lambda t: t[i], w)


def _plan(x, w, out_dtype):
    operands, params = _operands_and_params(x, w, jnp.int32(0), out_dtype, None,
                                            group_index=True)
    avals = [jax.core.ShapedArray(jnp.shape(o), jnp.result_type(o)) for o in operands]
    return planner.plan_ragged_sm90(ragged_spec(avals, **params), planner.device_for("cuda"))


def _check(x, w, i, out="bf16"):
    dtype, tol = OUTS[out]
    poison()
    got = jax.jit(lambda x, w, i: jbs.gemm(x, w, layer=i, out_dtype=dtype))(x, w, i)
    clamped = int(np.clip(i, 0, w.shape[0] - 1))
    want = jbs.gemm(x, _layer_of(w, clamped), out_dtype=dtype, backend="reference")
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape and np.all(np.isfinite(got)), "unwritten output elements"
    err = np.linalg.norm(got - want) / np.linalg.norm(want)
    assert err < tol, err


@pytest.mark.parametrize("fmt_a,fmt_b", PAIRS)
@pytest.mark.parametrize("out", ["bf16", "f32"])
def test_every_pair_and_row_count(fmt_a, fmt_b, out):
    """Every decode pair at 1 to 64 rows (each item height, split-K on and off) runs the layer
    target (always up to 16 rows; at more, where gemm runs the layer on another path, the
    layer is sliced) and equals the reference on the sliced layer. The index is a jit argument
    here, so XLA copies the probe and index mode runs."""
    layers = 5
    w = _stack(fmt_b, layers, 384, 1024)
    for m in (1, 7, 16, 20, 64):
        x = _activation(fmt_a, m, 1024)
        p = _plan(x, w, OUTS[out][0])
        if m <= 16:
            assert not isinstance(p, str), p
        elif isinstance(p, str):
            assert "the layer is sliced" in p, p
        _check(x, w, int(_rng().integers(layers)), out)


def test_shapes_odd_n_and_long_k():
    for n, k, m in [(200, 96, 3), (4096, 14336, 16), (6144, 4096, 1), (130, 4096, 33)]:
        w = _stack("nvfp4", 3, n, k)
        _check(_activation(None, m, k), w, 2)


def test_out_of_range_layer_is_clamped():
    w = _stack("mxfp4", 4, 256, 512)
    x = _activation(None, 5, 512)
    for i in (-3, 4, 100):
        _check(x, w, i)


def test_scan_reads_the_stack_in_place():
    """lax.scan over the layer index with the stack passed whole: the kernel reads the stack (no
    dynamic slice of the elements anywhere in the program), and each step equals its layer."""
    layers, n = 4, 1024
    for fmt in ("nvfp4", "mxfp4", "mxfp8_e4m3"):
        w = _stack(fmt, layers, n, n)
        x = jnp.asarray(_rng().standard_normal((2, n)), jnp.bfloat16)

        def step(h, i, w=w):
            return jnp.tanh(jbs.gemm(h, w, layer=i, out_dtype=jnp.float32)).astype(h.dtype), None

        f = jax.jit(lambda x: jax.lax.scan(step, x, jnp.arange(layers))[0])
        hlo = f.lower(x).compile().as_text()
        assert LAYER in hlo
        element = "f4e2m1fn" if "fp4" in fmt else "f8e4m3fn"
        assert not re.search(rf"{element}\[1,{n},\d+\][^\n]*dynamic-slice\(", hlo), fmt
        want = x
        for i in range(layers):
            want = jnp.tanh(jbs.gemm(want, _layer_of(w, i), out_dtype=jnp.float32,
                                     backend="reference")).astype(x.dtype)
        got, want = np.asarray(f(x), np.float64), np.asarray(want, np.float64)
        assert np.linalg.norm(got - want) / np.linalg.norm(want) < 2e-2, fmt  # bf16 per layer


def test_prefill_rows_slice_the_layer_and_run_the_dense_kernels():
    """Past the decode kernels' 64 rows the layer is sliced and gemm's wide kernels run it:
    through gemm's own target without a global scale, through the layer target's slice mode
    (alpha read from the stack) with NVFP4's per-layer ones."""
    for fmt, target in (("mxfp4", DENSE), ("nvfp4", LAYER)):
        w = _stack(fmt, 3, 512, 1024)
        x = _activation(None, 200, 1024)
        f = jax.jit(lambda x, i, w=w: jbs.gemm(x, w, layer=i))
        hlo = f.lower(x, 1).as_text()
        assert target in hlo and ({DENSE, LAYER} - {target}).isdisjoint(
            re.findall(r"@(jax_blockscale_\w+)", hlo)), fmt
        _check(x, w, 1)


def test_prefill_rows_in_a_loop_read_the_layer_in_place():
    """Past 64 rows inside a loop with a counter index, each call's layer (its packed elements
    and its scales) is a slice XLA hands the dense kernel in place: every slice of those stacks
    sits in the kernel's dynamic-slice fusion, none is copied out first."""
    layers, n, k, m = 3, 512, 1024, 200
    w = _stack("nvfp4", layers, n, k)
    x = _activation(None, m, k)

    def body(i, acc):
        return acc + jbs.gemm(x, w, layer=i, out_dtype=jnp.float32)

    f = jax.jit(lambda x: jax.lax.fori_loop(0, layers, body, jnp.zeros((m, n), jnp.float32)))
    hlo = f.lower(x).compile().as_text()
    blocks = re.split(r"\n(?=%|ENTRY)", hlo)
    stack_slice = re.compile(r"(u8|f8e4m3fn|f4e2m1fn)\[[\d,]+\][^\n]*dynamic-slice\(")
    slicing = [b for b in blocks if stack_slice.search(b)]
    assert slicing, "no slice of the stacks found"
    for b in slicing:  # NVFP4: the layer target's slice mode
        assert LAYER in b, "a slice of the stack is copied outside the kernel's fusion:\n" + b[:2000]
    want = sum(np.asarray(jbs.gemm(x, _layer_of(w, i), out_dtype=jnp.float32,
                                   backend="reference"), np.float64) for i in range(layers))
    got = np.asarray(f(x), np.float64)
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 1e-5


def test_batch_dims_vmap_grad_and_export():
    """Leading dims of x fold into the rows, vmap over examples shares the layer, grad with
    respect to a plain x, and a jax.export round trip all run the kernel."""
    w = _stack("mxfp4", 3, 256, 512)
    x = jnp.asarray(_rng().standard_normal((2, 3, 512)), jnp.float32).astype(jnp.bfloat16)

    def f(x, i, backend=None):
        return jbs.gemm(x, w, layer=i, out_dtype=jnp.float32, backend=backend)

    assert LAYER in jax.jit(f).lower(x, 2).as_text()
    want = np.asarray(f(x, 2, "reference"))
    np.testing.assert_allclose(np.asarray(jax.jit(f)(x, 2)), want, rtol=1e-5, atol=1e-5)
    batched = jax.jit(jax.vmap(f, in_axes=(0, None)))
    assert LAYER in batched.lower(x, 2).as_text()
    np.testing.assert_allclose(np.asarray(batched(x, 2)), want, rtol=1e-5, atol=1e-5)

    def loss(x, backend=None):
        return jnp.sum(f(x, 1, backend) ** 2)

    g_got = np.asarray(jax.jit(jax.grad(loss))(x), np.float32)
    g_want = np.asarray(jax.grad(lambda x: loss(x, "reference"))(x), np.float32)
    assert np.linalg.norm(g_got - g_want) / np.linalg.norm(g_want) < 1e-2

    exp = jax.export.export(jax.jit(f), disabled_checks=[
        jax.export.DisabledSafetyCheck.custom_call(LAYER)])(x, 2)
    back = jax.export.deserialize(exp.serialize())
    np.testing.assert_array_equal(np.asarray(back.call(x, 2)), np.asarray(jax.jit(f)(x, 2)))


@pytest.mark.parametrize("fmt_a,fmt_b", [(None, "nvfp4"), (None, "mxfp4"), (None, "mxfp8_e4m3"),
                                         ("nvfp4", "nvfp4"), ("mxfp8_e4m3", "mxfp8_e5m2")])
def test_a_layer_found_in_place_runs_gemms_plan_bit_for_bit(fmt_a, fmt_b):
    """Weights passed to jit and the index a loop counter: XLA hands the probe in place, the
    handler names the layer from its address and runs gemm's plan for that layer (decode,
    register-weight or fused kernel, NVFP4's per-layer alpha included), so every layer equals
    `gemm(x, w[i])` bit for bit, and index mode never runs."""
    layers, n, k = 4, 768, 2048
    w = _stack(fmt_b, layers, n, k)
    for m in (1, 16, 40, 64):
        x = _activation(fmt_a, m, k)
        if isinstance(_plan(x, w, jnp.float32), str):
            continue

        def run(x, w):
            def body(i, acc):
                return acc.at[i].set(jbs.gemm(x, w, layer=i, out_dtype=jnp.float32))
            return jax.lax.fori_loop(0, layers, body, jnp.zeros((layers, m, n), jnp.float32))

        before = _plugin.layer_gemm_counts()
        got = np.asarray(jax.jit(run)(x, w))
        in_place, indexed = np.subtract(_plugin.layer_gemm_counts(), before)
        assert in_place > 0 and indexed == 0, (m, in_place, indexed)
        for i in range(layers):
            want = np.asarray(jax.jit(lambda x, wl: jbs.gemm(x, wl, out_dtype=jnp.float32))(
                x, _layer_of(w, i)))
            np.testing.assert_array_equal(got[i], want, err_msg=f"m={m} layer {i}")


@pytest.mark.parametrize("fmt_a,fmt_b", [(None, "nvfp4"), (None, "mxfp8_e4m3"),
                                         ("nvfp4", "nvfp4")])
def test_both_plans_leave_the_same_split_partials(fmt_a, fmt_b):
    """A long K: the layer's own plan (probe in place) and index mode (probe copied) split K
    alike and leave their partials in true scale for the lowering, which applies the layer's
    alpha: whichever plan the handler picks, the same bits."""
    w = _stack(fmt_b, 3, 512, 8192)
    x = _activation(fmt_a, 16, 8192)
    p = _plan(x, w, jnp.float32)
    assert p.kernel == "ragged_decode" and p.splits > 1 and p.layer.splits == p.splits, p

    def in_place(x, w):
        def body(i, acc):
            return acc.at[i].set(jbs.gemm(x, w, layer=i, out_dtype=jnp.float32))
        return jax.lax.fori_loop(0, 3, body, jnp.zeros((3, 16, 512), jnp.float32))

    indexed = jax.jit(lambda x, w, i: jbs.gemm(x, w, layer=i, out_dtype=jnp.float32))
    before = _plugin.layer_gemm_counts()
    got = np.asarray(jax.jit(in_place)(x, w))
    for i in range(3):
        np.testing.assert_array_equal(np.asarray(indexed(x, w, i)), got[i], err_msg=str(i))
    in_place_calls, indexed_calls = np.subtract(_plugin.layer_gemm_counts(), before)
    assert in_place_calls > 0 and indexed_calls == 3, (in_place_calls, indexed_calls)


def test_a_copied_probe_runs_index_mode():
    """An index that is no loop counter (a jit argument): XLA copies the probe, the handler
    cannot name the layer and index mode reads the index on the device."""
    w = _stack("nvfp4", 3, 512, 1024)
    x = _activation(None, 16, 1024)
    f = jax.jit(lambda x, w, i: jbs.gemm(x, w, layer=i, out_dtype=jnp.float32))
    before = _plugin.layer_gemm_counts()
    for i in range(3):
        got = np.asarray(f(x, w, i), np.float64)
        want = np.asarray(jbs.gemm(x, _layer_of(w, i), out_dtype=jnp.float32,
                                   backend="reference"), np.float64)
        assert np.linalg.norm(got - want) / np.linalg.norm(want) < 1e-5
    in_place, indexed = np.subtract(_plugin.layer_gemm_counts(), before)
    assert indexed == 3 and in_place == 0, (in_place, indexed)


def test_slice_mode_gathers_alpha_where_the_layer_was_copied():
    """NVFP4 at 64 rows (a register-weight plan: slice mode). With the index a jit argument XLA
    copies the layer's slices; the handler cannot name the layer, gathers its alpha on the
    device, and the result still equals `gemm(x, w[i])` bit for bit, as in place."""
    w = _stack("nvfp4", 4, 512, 1024)
    x = _activation(None, 64, 1024)
    assert _plan(x, w, jnp.float32).kernel == "layer_slice"
    f = jax.jit(lambda x, w, i: jbs.gemm(x, w, layer=i, out_dtype=jnp.float32))
    dense = jax.jit(lambda x, wl: jbs.gemm(x, wl, out_dtype=jnp.float32))
    before = _plugin.layer_gemm_counts()
    for i in (0, 3, 2, 7, -1):  # out of range: clamped as the slice clamps it
        want = dense(x, _layer_of(w, int(np.clip(i, 0, 3))))
        np.testing.assert_array_equal(np.asarray(f(x, w, i)), np.asarray(want), err_msg=str(i))
    # every handler call gathered; XLA may replay some calls from a command buffer (the call and
    # the sum of its split partials after it) without calling the handler again
    in_place, gathered = np.subtract(_plugin.layer_gemm_counts(), before)
    assert gathered >= 1 and in_place == 0, (in_place, gathered)
