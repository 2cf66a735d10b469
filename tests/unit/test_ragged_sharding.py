"""ragged_gemm under jax.jit with NamedShardings on 8 (forced CPU) devices: expert parallel (G),
tensor parallel (N), data parallel (M) and K-split placements equal the unsharded call, with
no all-gather (expert weights are never gathered) and exactly the reductions expected.

As tests/unit/test_sharding.py: the real tests run in a child pytest with 8 host devices
(`JBS_RAGGED_SHARDING_CHILD=1`), once with Shardy and once with GSPMD.
"""
import os

import pytest

from child_runs import finish, pytest_argv, start_all, use_partitioner  # tests/support

CHILD = os.environ.get("JBS_RAGGED_SHARDING_CHILD") == "1"


if not CHILD:
    @pytest.fixture(scope="module")
    def children():
        yield from start_all({p: (pytest_argv(__file__), {"JBS_RAGGED_SHARDING_CHILD": "1",
                                                          "JBS_PARTITIONER": p})
                              for p in ("shardy", "gspmd")})

    @pytest.mark.parametrize("partitioner", ["shardy", "gspmd"])
    def test_sharded_ragged_gemm_on_8_cpu_devices(children, partitioner):
        rc, out = finish(children[partitioner])
        assert rc == 0, f"child pytest ({partitioner}) failed:\n{out[-12000:]}"

else:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

    import jax_blockscale as jbs
    from jax_blockscale.lowering import registry as jbs_lowering

    SHARDY = use_partitioner()
    DEVICES = jax.devices("cpu")
    assert len(DEVICES) == 8, DEVICES
    TOL = 1e-6

    def mesh_of(shape, names):
        n = int(np.prod(shape))
        return Mesh(np.asarray(DEVICES[:n]).reshape(shape), names,
                    axis_types=(AxisType.Auto,) * len(names))

    MESH_1D = mesh_of((8,), ("x",))
    MESH_2D = mesh_of((2, 4), ("x", "y"))

    quantize = jax.jit(jbs.quantize, static_argnames=("fmt", "global_scale", "layout"))

    @jax.jit
    def experts_nvfp4(w):  # one global scale per expert
        return jax.vmap(lambda x: jbs.quantize(x, "nvfp4", layout="blocked"))(w)

    def rand(seed, shape):
        return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)

    def rel_err(got, want):
        got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
        return np.linalg.norm(got - want) / np.linalg.norm(want)

    def place(mesh, x, spec):
        """device_put a plain array or BlockScaled (scales follow the elements' spec; a
        per-expert global scale follows G)."""
        put = lambda v, s: jax.device_put(v, NamedSharding(mesh, s))
        if not isinstance(x, jbs.BlockScaled):
            return put(x, spec)
        extra = [None] * 3 if x.layout == "blocked" else []
        gs = x.global_scale
        if gs is not None and jnp.ndim(gs) == 1:
            gs = put(gs, P(spec[0]))
        return jbs.BlockScaled(put(x.data, spec), put(x.scales, P(*spec, *extra)), gs, x.fmt,
                               x.layout)

    def collectives(text):
        return {c for c in ("all-gather", "all-reduce", "reduce-scatter", "all-to-all",
                            "collective-permute") if c in text}

    ragged_f32 = jax.jit(lambda x, w, g: jbs.ragged_gemm(x, w, g, out_dtype=jnp.float32))

    # G = 16 experts, N = 1024 (8 whole 128-row scale tiles), K = 512 (8 whole 4x16 tiles)
    G, M, N, K = 16, 96, 1024, 512
    # uneven routing: empty experts, one expert with many rows, sum < M
    GROUP_SIZES = np.array([0, 9, 0, 0, 20, 1, 3, 0, 7, 0, 15, 2, 0, 11, 6, 0], np.int32)

    @pytest.fixture(scope="module")
    def problem():
        x = rand(1, (M, K))
        w = experts_nvfp4(rand(2, (G, N, K)))
        gs = jnp.asarray(GROUP_SIZES)
        return x, w, gs, np.asarray(ragged_f32(x, w, gs))

    CASES = [
        # (mesh, lhs spec, rhs spec, expect a reduction)
        (MESH_1D, P(None, None), P("x", None, None), True),  # expert parallel
        (MESH_1D, P(None, None), P(None, "x", None), False),  # tensor parallel (N)
        (MESH_1D, P("x", None), P(None, None, None), False),  # data parallel (M)
        (MESH_1D, P(None, "x"), P(None, None, "x"), True),  # K split
        (MESH_2D, P(None, None), P("x", "y", None), True),  # experts x N
        (MESH_2D, P("x", None), P("y", None, None), True),  # tokens x experts
        (MESH_2D, P(None, "y"), P("x", None, "y"), True),  # experts x K
        (MESH_2D, P("x", None), P(None, "y", None), False),  # tokens x N
    ]

    @pytest.mark.parametrize("mesh,lhs_spec,rhs_spec,reduces", CASES, ids=[
        f"{'x'.join(map(str, c[0].devices.shape))}-lhs{tuple(c[1])}-rhs{tuple(c[2])}"
        for c in CASES])
    def test_placement_matches_unsharded(problem, mesh, lhs_spec, rhs_spec, reduces):
        x, w, gs, want = problem
        xs, ws = place(mesh, x, lhs_spec), place(mesh, w, rhs_spec)
        y = ragged_f32(xs, ws, gs)
        assert rel_err(y, want) < TOL
        assert not np.any(np.asarray(y)[GROUP_SIZES.sum():])
        lowered = ragged_f32.lower(xs, ws, gs)
        assert "CustomSPMDPartitioning" in lowered.as_text()  # our rule decides
        found = collectives(lowered.compile().as_text())
        assert "all-gather" not in found, found  # no expert weights (nor anything) gathered
        assert ("all-reduce" in found) == reduces, found
        # the output keeps M and N sharded as the operands were
        out = tuple(y.sharding.spec) + (None, None)
        assert out[:2] == (lhs_spec[0], rhs_spec[1]), out

    @pytest.mark.parametrize("gs", [
        [5, -3, 40, 0, 30, 30, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9],  # negative, and past M = 96
        [200, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1],  # the first expert takes every row
    ])
    def test_expert_parallel_clamps_like_unsharded(problem, gs):
        x, w, _, _ = problem
        gs = jnp.asarray(gs, jnp.int32)
        want = np.asarray(ragged_f32(x, w, gs))
        y = ragged_f32(place(MESH_2D, x, P("x", None)), place(MESH_2D, w, P("y", None, None)),
                       gs)
        assert rel_err(y, want) < TOL

    def test_expert_parallel_bf16_is_exact(problem):
        """Rows of different experts never mix: the combine adds zeros, bf16 equals bf16."""
        x, w, gs, _ = problem
        f = jax.jit(lambda x, w, g: jbs.ragged_gemm(x, w, g))
        want = np.asarray(f(x, w, gs), np.float32)
        y = f(x, place(MESH_1D, w, P("x", None, None)), gs)
        assert y.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(y, np.float32), want)

    @pytest.mark.parametrize("fmt_lhs,fmt_rhs", [("mxfp8_e4m3", "mxfp4"), (None, "mxfp6_e2m3")])
    def test_mx_formats_expert_and_k_parallel(fmt_lhs, fmt_rhs):
        x = rand(3, (64, 1024))
        lhs = x if fmt_lhs is None else quantize(x, fmt_lhs)
        w = quantize(rand(4, (8, 256, 1024)), fmt_rhs, layout="blocked")
        gs = jnp.asarray([8, 0, 16, 4, 0, 20, 10, 6], jnp.int32)
        want = np.asarray(ragged_f32(lhs, w, gs))
        y = ragged_f32(place(MESH_2D, lhs, P(None, "y")), place(MESH_2D, w, P("x", None, "y")),
                       gs)
        assert rel_err(y, want) < TOL

    def test_misaligned_n_reshards_and_stays_correct(caplog):
        jbs_lowering._logged.clear()
        caplog.set_level("INFO", logger="jax_blockscale")
        x = rand(5, (32, 256))
        w = experts_nvfp4(rand(6, (8, 384, 256)))  # N = 384 = 3 tiles: not 8 whole shards
        gs = jnp.asarray([4] * 8, jnp.int32)
        want = np.asarray(ragged_f32(x, w, gs))
        # the elements sharded on N; the blocked scales (3 tiles) cannot be, and stay whole
        data = jax.device_put(w.data, NamedSharding(MESH_1D, P(None, "x")))
        y = ragged_f32(x, jbs.BlockScaled(data, w.scales, w.global_scale, w.fmt, w.layout), gs)
        assert rel_err(y, want) < TOL
        assert "N=384 cannot be split" in caplog.text

    def test_grad_and_vmap_under_expert_parallel(problem):
        x, w, gs, _ = problem
        wp = place(MESH_1D, w, P("x", None, None))
        loss = lambda x, w: jnp.sum(jbs.ragged_gemm(x, w, gs, out_dtype=jnp.float32) ** 2)
        g = jax.jit(jax.grad(loss))
        assert rel_err(g(x, wp), g(x, w)) < 1e-5
        xs = np.stack([x, x[::-1]])
        gss = jnp.stack([gs, gs[::-1]])
        f = jax.jit(jax.vmap(lambda x, g, w: jbs.ragged_gemm(x, w, g, out_dtype=jnp.float32),
                             in_axes=(0, 0, None)))
        assert rel_err(f(xs, gss, wp), f(xs, gss, w)) < TOL
