"""The Flax NNX mixture-of-experts layers (jax_blockscale.nn.moe) against a float64 per-token
NumPy oracle, their parameter conversion, and examples/moe.py in smoke mode."""
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

nnx = pytest.importorskip("flax.nnx")

import oracle  # noqa: E402
from jax_blockscale import BlockScaled  # noqa: E402
from jax_blockscale import nn as jnn  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
H, I, E, TOP_K = 64, 32, 6, 2
call = nnx.jit(lambda m, x: m(x))


def values(q):
    v = oracle.dequantize(q.data, q.scales, q.fmt, None, q.layout)
    if q.global_scale is not None:
        gs = np.asarray(q.global_scale, np.float64)
        v = v * gs.reshape(gs.shape + (1, 1))
    return v


def moe_oracle(x, router, gate_up, down, top_k):
    """float64, token by token: top-k of the router logits, softmax over them, each chosen
    expert's SwiGLU MLP. gate_up (E, H, 2I), down (E, I, H), as (in, out) per expert."""
    x = np.asarray(x, np.float64)
    logits = x @ np.asarray(router, np.float64)
    y = np.zeros_like(x)
    for t in range(x.shape[0]):
        chosen = np.argsort(-logits[t], kind="stable")[:top_k]
        w = np.exp(logits[t, chosen] - logits[t, chosen].max())
        w /= w.sum()
        for e, we in zip(chosen, w):
            h = x[t] @ gate_up[e]
            gate, up = np.split(h, 2)
            a = gate / (1 + np.exp(-gate)) * up
            y[t] += we * (a @ down[e])
    return y


def rel_err(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return np.linalg.norm(got - want) / np.linalg.norm(want)


@pytest.fixture(scope="module")
def moe():
    return jnn.MoE(H, I, E, TOP_K, dtype=jnp.float32, rngs=nnx.Rngs(0))


@pytest.fixture(scope="module")
def tokens():
    # (2, 9) leading axes: 18 tokens, some experts get none
    return jax.random.normal(jax.random.PRNGKey(3), (2, 9, H), jnp.float32)


@pytest.mark.parametrize("split_min", [0, None], ids=["split router", "f32 dot"])
@pytest.mark.parametrize("x_dtype, r_dtype", [(jnp.bfloat16, jnp.float32),
                                               (jnp.float32, jnp.float32),
                                               (jnp.bfloat16, jnp.bfloat16)])
def test_router_logits_match_a_float64_oracle(x_dtype, r_dtype, split_min, monkeypatch):
    """Every product exact, sums in f32: within a few f32 roundings of the float64 dot of the
    same (rounded) inputs, on values spread over many binades; and one-hot tokens give the
    router's rows back bit for bit (a router split into two bf16 parts instead of three, or
    rounded to bf16, loses their low bits and fails)."""
    from jax_blockscale.nn import moe as moe_module
    if split_min is not None:  # the split router, as from ROUTER_SPLIT_MIN_TOKENS tokens
        monkeypatch.setattr(moe_module, "ROUTER_SPLIT_MIN_TOKENS", split_min)
    kx, kr, ks = jax.random.split(jax.random.PRNGKey(11), 3)
    t, h, e = 37, 1024, 24
    assert t < moe_module.ROUTER_SPLIT_MIN_TOKENS or split_min is not None
    x = (jax.random.normal(kx, (t, h)) * 3).astype(x_dtype)
    r = (jax.random.normal(kr, (h, e)) * jnp.exp2(jax.random.randint(ks, (h, e), -12, 4))
         ).astype(r_dtype)
    got = np.asarray(jnn.router_logits(x, r), np.float64)
    xs, rs = np.asarray(x, np.float64), np.asarray(r, np.float64)
    want = xs @ rs
    bound = 32 * 2.0 ** -24 * (np.abs(xs) @ np.abs(rs))
    assert jnn.router_logits(x, r).dtype == jnp.float32
    assert np.all(np.abs(got - want) <= bound), np.max(np.abs(got - want) / bound)
    one_hot = jax.nn.one_hot(jnp.arange(t) * 7 % h, h, dtype=x_dtype)
    np.testing.assert_array_equal(np.asarray(jnn.router_logits(one_hot, r)),
                                  np.asarray(r, np.float32)[np.arange(t) * 7 % h])
    # the experts and weights top_k_experts derives from them
    ids, w = jnn.top_k_experts(x, r, 3)
    np.testing.assert_array_equal(np.asarray(ids), np.argsort(-want, axis=1, kind="stable")[:, :3])
    np.testing.assert_allclose(np.asarray(w).sum(-1), 1.0, rtol=1e-6)


def test_float_moe_matches_oracle(moe, tokens):
    y = call(moe, tokens)
    assert y.shape == tokens.shape
    want = moe_oracle(tokens.reshape(-1, H), moe.router[...], np.asarray(moe.gate_up[...]),
                      np.asarray(moe.down[...]), TOP_K)
    assert rel_err(y.reshape(-1, H), want) < 1e-5


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4", "mxfp6_e3m2", "mxfp8_e4m3"])
def test_quantized_moe_matches_oracle_on_its_dequantized_experts(moe, tokens, fmt):
    """Weight-only in f32: exactly the float layer run on the dequantized experts."""
    q = jnn.QuantizedMoE.from_float(moe, fmt, dtype=jnp.float32)
    gate_up, down = q.gate_up.get_value(), q.down.get_value()
    assert isinstance(gate_up, BlockScaled) and gate_up.shape == (E, 2 * I, H)
    assert down.shape == (E, H, I) and gate_up.layout == "blocked"
    if fmt == "nvfp4":  # one global scale per expert
        assert gate_up.global_scale.shape == (E,) and down.global_scale.shape == (E,)
    y = call(q, tokens).reshape(-1, H)
    want = moe_oracle(tokens.reshape(-1, H), q.router[...],
                      values(gate_up).transpose(0, 2, 1), values(down).transpose(0, 2, 1), TOP_K)
    assert rel_err(y, want) < 1e-5
    # and close to the float layer (quantization error only)
    assert rel_err(y, call(moe, tokens).reshape(-1, H)) < (0.1 if fmt == "mxfp8_e4m3" else 0.3)


@pytest.mark.parametrize("fmt,act_fmt", [("nvfp4", "nvfp4"), ("mxfp4", "mxfp8_e4m3")])
def test_quantized_activations(moe, tokens, fmt, act_fmt):
    q = jnn.QuantizedMoE.from_float(moe, fmt, act_fmt=act_fmt, dtype=jnp.bfloat16)
    y = call(q, tokens)
    assert y.dtype == jnp.bfloat16 and y.shape == tokens.shape
    assert 0 < rel_err(y, call(moe, tokens)) < 0.35


def test_quantize_moe_params_and_from_params(moe, tokens):
    qparams = jnn.quantize_moe_params(nnx.state(moe, nnx.Param), "nvfp4")
    assert isinstance(qparams["gate_up"], BlockScaled) and isinstance(qparams["down"], BlockScaled)
    assert not isinstance(qparams["router"], BlockScaled)  # the router stays float
    assert qparams["gate_up"].global_scale.shape == (E,)
    q1 = jnn.QuantizedMoE.from_params(qparams, TOP_K, dtype=jnp.float32)
    q2 = jnn.QuantizedMoE.from_float(moe, "nvfp4", dtype=jnp.float32)
    np.testing.assert_array_equal(np.asarray(call(q1, tokens)), np.asarray(call(q2, tokens)))


def test_random_init_and_errors():
    q = jnn.QuantizedMoE(H, I, E, TOP_K, fmt="mxfp4", rngs=nnx.Rngs(1))
    assert call(q, jnp.ones((3, H), jnp.bfloat16)).shape == (3, H)
    with pytest.raises(ValueError, match="hidden=64"):
        q(jnp.ones((3, H + 32)))
    with pytest.raises(ValueError, match="top_k=7 must be between 1 and experts=6"):
        jnn.QuantizedMoE(H, I, E, 7, fmt="mxfp4", rngs=nnx.Rngs(1))
    with pytest.raises(ValueError, match="cannot multiply nvfp4 experts"):
        jnn.QuantizedMoE(H, I, E, TOP_K, fmt="nvfp4", act_fmt="mxfp8_e4m3", rngs=nnx.Rngs(1))
    with pytest.raises(ValueError, match="not a multiple of the mxfp4 block size"):
        jnn.quantize_experts(jnp.ones((2, 48, 64)), "mxfp4")
    with pytest.raises(TypeError, match="not a BlockScaled"):
        jnn.QuantizedMoE.from_params({"router": 0, "gate_up": jnp.ones((E, H, 2 * I)),
                                      "down": 0}, TOP_K)


def test_example_smoke():
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    env.pop("XLA_FLAGS", None)  # the example asks for 8 CPU devices itself
    run = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "moe.py"), "--smoke"],
                         capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    out = run.stdout
    errors = dict(re.findall(r"^(bf16|nvfp4 W4A16|nvfp4 W4A4|mxfp4 W4A16|mxfp8 W8A8)\s+"
                             r"([0-9.]+)", out, re.M))
    assert len(errors) == 5, out
    assert float(errors["bf16"]) < 0.02 and float(errors["mxfp8 W8A8"]) < 0.1, out
    assert all(0 < float(v) < 0.35 for v in errors.values()), out
    m = re.search(r"expert parallel over 8 devices.*rel. error vs one device ([0-9.e+-]+); "
                  r"collectives: (.*)$", out, re.M)
    assert m and float(m.group(1)) < 1e-6 and m.group(2) == "all-reduce", out


def test_bench_moe_tiny(tmp_path):
    """benchmarks/bench_moe.py runs on the CPU and writes its JSON rows (one small GEMM)."""
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    out = tmp_path / "moe"
    run = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench_moe.py"),
                          "--tiny", "--gemms", "down", "--tokens", "1,16", "--out", str(out)],
                         capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    import json
    rows = json.loads((tmp_path / "moe.json").read_text())["rows"]
    assert {(r["fmt"], r["tokens"]) for r in rows} == {(f, t) for f in ("mxfp4", "nvfp4")
                                                       for t in (1, 16)}
    for r in rows:
        for method in ("bf16_ragged_dot", "deq_ragged_dot", "ours", "ours_qact"):
            assert r[method + "_us"] > 0, r


def test_bench_moe_times_only_the_methods_named(tmp_path):
    """bench_moe.py --methods ours: our kernel alone (the anchors left out, their bf16 weights
    never made); an unknown method is refused by name."""
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    script = os.path.join(ROOT, "benchmarks", "bench_moe.py")
    out = tmp_path / "moe"
    run = subprocess.run([sys.executable, script, "--tiny", "--gemms", "down", "--tokens", "16",
                          "--formats", "mxfp4", "--methods", "ours", "--out", str(out)],
                         capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    import json
    (row,) = json.loads((tmp_path / "moe.json").read_text())["rows"]
    assert row["ours_us"] > 0, row
    assert not any(k.startswith(("bf16_ragged_dot", "deq_ragged_dot", "ours_qact",
                                 "tokamax_int4")) for k in row), row
    bad = subprocess.run([sys.executable, script, "--tiny", "--methods", "ours,bogus"],
                         capture_output=True, text=True, env=env, timeout=300)
    assert bad.returncode != 0 and "--methods: unknown ['bogus']" in bad.stderr, bad.stderr


def test_bench_moe_peers_pairs_rows_and_refuses_without_a_peer(tmp_path):
    """benchmarks/bench_moe_peers.py (needs a GPU to time): the peer's MoE rows are paired with
    ours by (model, tokens) and the ratio is the peer's time over ours; each row's bytes' floor
    is its hit bytes at the measured copy bandwidth; a peer folder without the script stops with
    a message naming it."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import bench_moe_peers as bp
    ours = [dict(model="m", tokens=t, ours_us=us, hit_bytes=hit)
            for t, us, hit in ((16, 50.0, 90e6), (256, 80.0, 1e8), (4096, 90.0, 1e8))]
    peer = dict(rows=[dict(part="moe", model="m", tokens=16, device_us=75.0, experts_hit=9),
                      dict(part="moe", model="m", tokens=256, error="OutOfMemoryError: x"),
                      dict(part="dense", shape="1x8x8", device_us=1.0)])
    got = {r["tokens"]: r for r in bp.merge(ours, peer, 3.0)}  # 3 TB/s
    assert got[16]["triton_over_ours"] == 1.5 and got[16]["triton_experts_hit"] == 9
    assert got[16]["floor_us"] == pytest.approx(30.0)  # 90 MB at 3 TB/s
    assert got[16]["triton_over_floor"] == pytest.approx(2.5)
    assert got[256]["floor_us"] == pytest.approx(100e6 / 3e6)
    assert got[256]["triton_kernels_error"].startswith("OutOfMemoryError")
    assert "triton_kernels_us" not in got[4096]
    with pytest.raises(SystemExit, match="peer_triton_kernels.py"):
        bp.load_peer(str(tmp_path))


def test_bench_moe_peers_times_the_call_and_our_kernel_apart():
    """bench_moe_peers.py: from a trace's kernel events, the call's time per call is the union
    of all its kernels (overlaps counted once) and "ours kernel" that of our grouped kernels
    alone (the K-order pass and the work table's XLA kernels left out); an empty trace stops
    with a message."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import bench_moe_peers as bp
    ours = bp.OUR_KERNEL_PREFIX + "_kernel_grouped_x"
    events = [("wrapped_gather", 0, 80_000), ("input_reduce_fusion", 70_000, 81_000),
              (ours, 81_000, 481_000),  # call 1
              ("wrapped_gather", 500_000, 580_000), (ours, 580_000, 990_000),
              (bp.OUR_KERNEL_PREFIX + "_finalize", 985_000, 1_000_000)]  # call 2
    call_us, kernel_us = bp.call_and_kernel_us(events, 2)
    assert call_us == pytest.approx((481_000 + 500_000) / 2 / 1e3)
    assert kernel_us == pytest.approx((400_000 + 420_000) / 2 / 1e3)
    with pytest.raises(SystemExit, match="no GPU kernel"):
        bp.call_and_kernel_us([], 2)


def test_bench_moe_peers_splits_cases_between_the_anchor_and_our_peer_script():
    """bench_moe_peers.py: the anchor times gate+up of its own models only; every other case
    (down projections, other models) goes to peer_moe_gemms.py at bench_moe's shapes; rows are
    paired by (model, gemm, tokens), an anchor row (no gemm) being gate+up; experts quantized in
    chunks equal the experts quantized at once."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import bench_moe as bm
    import bench_moe_peers as bp

    class Peer:
        MODELS = {"gpt-oss-20b": (32, 5760, 2880, 4)}

    cases = [("gpt-oss-20b", "gate_up"), ("gpt-oss-20b", "down"), ("deepseek-v3", "gate_up")]
    assert bp.anchor_cases(Peer, cases) == [("gpt-oss-20b", "gate_up")]
    others = bp.other_cases(Peer, cases, (1, 16))
    assert [(c["model"], c["gemm"], c["experts"], c["n"], c["k"], c["top_k"]) for c in others] \
        == [("gpt-oss-20b", "down", 32, 2880, 2880, 4), ("deepseek-v3", "gate_up", 256, 4096,
                                                          7168, 8)]
    assert all(c["tokens"] == [1, 16] for c in others)
    ours = [dict(model="gpt-oss-20b", gemm=g, tokens=16, ours_us=10.0, hit_bytes=1e6)
            for g in ("gate_up", "down")]
    peer = dict(rows=[dict(part="moe", model="gpt-oss-20b", tokens=16, device_us=20.0),
                      dict(part="moe", model="gpt-oss-20b", gemm="down", tokens=16,
                           device_us=5.0)])
    got = {r["gemm"]: r["triton_over_ours"] for r in bp.merge(ours, peer, 1.0)}
    assert got == {"gate_up": 2.0, "down": 0.5}
    key = jax.random.PRNGKey(1)
    chunked = bp.mxfp4_experts(key, bp.EXPERTS_PER_CHUNK + 3, 32, 64)
    parts = [bm.quantize(bm.normal(jax.random.fold_in(key, e0), (e, 32, 64), jnp.float32) / 8.0,
                         "mxfp4", layout="blocked")
             for e0, e in ((0, bp.EXPERTS_PER_CHUNK), (bp.EXPERTS_PER_CHUNK, 3))]
    for leaf, a, b in zip(jax.tree.leaves(chunked), *map(jax.tree.leaves, parts)):
        np.testing.assert_array_equal(np.asarray(leaf), np.concatenate([a, b]))


def test_stacked_layers_run_in_place():
    """A QuantizedMoE holding L layers' weights stacked runs layer i with layer=i (eager, and
    traced inside lax.scan over the index, the experts never sliced) exactly as the layer built
    on its own."""
    from jax import lax

    L = 3
    x = jnp.asarray(np.random.default_rng(3).standard_normal((5, H)), jnp.bfloat16)
    singles = [jnn.QuantizedMoE.from_float(jnn.MoE(H, I, E, TOP_K, rngs=nnx.Rngs(10 + s)),
                                           "nvfp4") for s in range(L)]
    stack = lambda name: jax.tree.map(lambda *a: jnp.stack(a),  # noqa: E731
                                      *[getattr(m, name).get_value() for m in singles])
    stacked = jnn.QuantizedMoE.from_float(jnn.MoE(H, I, E, TOP_K, rngs=nnx.Rngs(10)), "nvfp4")
    stacked.router = nnx.Param(jnp.stack([m.router[...] for m in singles]))
    stacked.gate_up = jnn.QuantizedWeight(stack("gate_up"))
    stacked.down = jnn.QuantizedWeight(stack("down"))
    assert stacked.gate_up.get_value().global_scale.shape == (L, E)
    want = np.stack([np.asarray(m(x), np.float32) for m in singles])
    assert np.abs(want[0] - want[1]).max() > 0  # the layers differ
    for i in range(L):
        np.testing.assert_array_equal(np.asarray(stacked(x, layer=i), np.float32), want[i])
    scanned = jax.jit(lambda x: lax.scan(lambda c, i: (c, stacked(x, layer=i)), 0,
                                         jnp.arange(L))[1])
    np.testing.assert_array_equal(np.asarray(scanned(x), np.float32), want)
    with pytest.raises(ValueError, match="layer= needs stacked weights"):
        singles[0](x, layer=0)
