"""Expert parallelism that dispatches tokens (jax_blockscale/ragged/dispatch.py,
`QuantizedMoE(mesh=, expert_axis=)`) on 2, 4 and 8 forced CPU devices: bit for bit the
one-device layer (weight-only NVFP4 / MXFP4, NVFP4 activations), with random, uneven (every row
on one device) and empty-expert routing and a token count that does not split evenly; the
compiled program exchanges rows with all-to-all only (no all-reduce of outputs, no weight
moved); the padded exchange has `lax.ragged_all_to_all`'s semantics; the option's errors name
the argument. exchange="reduce" (every device keeps every token; the combined shares summed by
one f32 all-reduce, or per token range by an all-to-all and an all-gather) equals the one-device
layer to f32 rounding, with those collectives only; so does the tensor-parallel layer
(`QuantizedMoE(mesh=, tensor_axis=)`, ragged/tensor_parallel.py) against itself on one device,
and the one-device QuantizedMoE to the bf16 rounding of the expert outputs. The checks live in
tests/support/moe_multi_device.py (check_dispatch, check_reduce, check_tensor_parallel), which
tests/gpu/test_moe_multi_gpu.py runs on the GPUs.

As tests/unit/test_moe_sharding.py: XLA reads the device count once per process, so the checks
run in a child pytest (`JBS_DISPATCH_CHILD=1`, 8 host devices) started by the parent's test.
"""
import os

import pytest

from child_runs import finish, pytest_argv, start_all  # tests/support

CHILD = os.environ.get("JBS_DISPATCH_CHILD") == "1"

if not CHILD:
    @pytest.fixture(scope="module")
    def child():
        yield from start_all({"dispatch": (pytest_argv(__file__), {"JBS_DISPATCH_CHILD": "1"})})

    def test_expert_dispatch_on_cpu_devices(child):
        rc, out = finish(child["dispatch"])
        assert rc == 0, f"child pytest failed:\n{out[-12000:]}"
        assert " passed" in out and "skipped" not in out and "failed" not in out, out[-3000:]

else:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx
    from jax.sharding import AxisType, Mesh, PartitionSpec as P

    import moe_multi_device as mmd  # tests/support
    from jax_blockscale import nn as jnn
    from jax_blockscale.nn.moe import top_k_experts
    from jax_blockscale.ragged import dispatch

    DEVICES = jax.devices("cpu")
    assert len(DEVICES) == 8, DEVICES

    @pytest.mark.parametrize("n", [2, 4, 8])
    def test_dispatch_equals_one_device(n):
        found = mmd.check_dispatch(DEVICES, n, "nvfp4")
        print(f"{n} devices: {mmd.summary(found)}")

    @pytest.mark.parametrize("routing", ["uneven", "empty"])
    def test_dispatch_uneven_and_empty_experts(routing):
        # 8 devices, 2 experts each: "empty" leaves every other device without rows
        mmd.check_dispatch(DEVICES, 8, "mxfp4", routing)

    def test_dispatch_quantized_activations():
        """NVFP4 activations: the global scale is calibrated on every device's rows (one scalar
        all-reduce of the amax), so the quantized rows are one device's."""
        mmd.check_dispatch(DEVICES, 4, "nvfp4", "uneven", act_fmt="nvfp4")

    def test_dispatch_tokens_not_a_multiple_of_the_devices():
        mmd.check_dispatch(DEVICES, 4, "nvfp4", tokens=mmd.TOKENS - 3)

    @pytest.fixture(params=["all-reduce", "likely buffer, all-to-all sum"])
    def reduce_path(request, monkeypatch):
        """The reduce layer as it runs at these sizes (one worst-case buffer, one all-reduce),
        and with the thresholds lowered so that it also compiles the smaller buffer (taken
        under random routing, not under uneven routing, which puts every row on one device)
        and sums the shares per token range (all-to-all, all-gather), as at serving sizes."""
        if request.param != "all-reduce":
            monkeypatch.setattr(dispatch, "REDUCE_LIKELY_MIN_ROWS", 0)
            monkeypatch.setattr(dispatch, "REDUCE_ROWS_ALIGN", 8)
            monkeypatch.setattr(dispatch, "REDUCE_SCATTER_MIN_BYTES", 0)
        return request.param

    @pytest.mark.parametrize("n,fmt,routing", [(2, "nvfp4", "random"), (4, "mxfp4", "uneven"),
                                               (8, "mxfp4", "empty")])
    def test_reduce_equals_one_device_to_f32_rounding(reduce_path, n, fmt, routing):
        found = mmd.check_reduce(DEVICES, n, fmt, routing)
        print(f"reduce {n} devices ({reduce_path}): {mmd.summary(found)}")

    def test_reduce_quantized_activations_and_odd_tokens(reduce_path):
        mmd.check_reduce(DEVICES, 4, "nvfp4", "uneven", act_fmt="nvfp4")
        mmd.check_reduce(DEVICES, 2, "nvfp4", "random", act_fmt="nvfp4")
        mmd.check_reduce(DEVICES, 4, "nvfp4", tokens=mmd.TOKENS - 3)

    def test_reduce_buffers_and_the_one_each_routing_takes(monkeypatch):
        """The smaller buffers: their sizes, and the one each routing takes, the smallest that
        holds every device's rows (a buffer too small for a device's rows would drop them,
        which check_reduce would see)."""
        monkeypatch.setattr(dispatch, "REDUCE_LIKELY_MIN_ROWS", 0)
        assert dispatch._row_buffers(128, 2, 128) == (128,)  # 68 and 80 -> one 128-row unit
        monkeypatch.setattr(dispatch, "REDUCE_ROWS_ALIGN", 8)
        assert dispatch._row_buffers(128, 2, 128) == (72, 80, 128)  # 1.0625 / 1.25 x 64
        assert dispatch._row_buffers(128, 2, 64) == (64,)  # never past the worst case
        monkeypatch.setattr(dispatch, "REDUCE_LIKELY_MIN_ROWS", 129)
        assert dispatch._row_buffers(128, 2, 128) == (128,)  # below the threshold: one buffer
        monkeypatch.setattr(dispatch, "REDUCE_LIKELY_MIN_ROWS", 0)
        # slacks that put these routings' busiest devices (64, 68, 128 rows) in three buffers
        monkeypatch.setattr(dispatch, "REDUCE_LIKELY_SLACKS", (1.0, 1.125))
        buffers = dispatch._row_buffers(128, 2, 128)
        assert buffers == (64, 72, 128)
        for busiest in range(0, 129):
            got = int(dispatch._buffer_index(jnp.int32(busiest), buffers))
            want = min(i for i, size in enumerate(buffers) if busiest <= size)
            assert got == want, (busiest, got, want)
        taken = {}
        for routing in ("balanced", "random", "uneven"):
            one, _, x = mmd.dispatch_problem("nvfp4", routing)
            ids, _ = top_k_experts(x, one.router[...], mmd.TOP_K)
            counts = np.bincount(np.asarray(ids).ravel(), minlength=mmd.EXPERTS)
            busiest = counts.reshape(2, -1).sum(axis=1).max()
            taken[routing] = int(dispatch._buffer_index(jnp.int32(busiest), buffers))
            mmd.check_reduce(DEVICES, 2, "nvfp4", routing)
        # every buffer is run by one of these routings
        assert taken == {"balanced": 0, "random": 1, "uneven": 2}, taken

    def test_reduce_takes_tokens_split_over_the_devices():
        """x split along the tokens (as a data-parallel layer before it leaves it): the reduce
        layer gathers it (every device needs every token) and gives the same output."""
        mesh = mmd.mesh_of(DEVICES, 4)
        one, ep, x = mmd.dispatch_problem("nvfp4", "random", mesh=mesh, exchange="reduce")
        g1, s1 = nnx.split(one)
        g2, s2 = nnx.split(ep)
        want = jax.jit(lambda s, x: nnx.merge(g1, s)(x))(s1, x)
        placed = mmd.shard_layer(s2, mesh, P("d", None, None), P("d", None, None))
        xs = jax.device_put(x, jax.sharding.NamedSharding(mesh, P("d")))
        got = jax.jit(lambda s, x: nnx.merge(g2, s)(x))(placed, xs)
        mmd.assert_match(got, want, "bf16", "reduce layer, tokens split over 4 devices")

    def test_reduce_check_catches_a_lost_share(monkeypatch):
        """The check has teeth: a layer whose devices keep their own share (no all-reduce)
        fails it."""
        monkeypatch.setattr(dispatch.lax, "psum", lambda x, axis: x)
        with pytest.raises(AssertionError):
            mmd.check_reduce(DEVICES, 2, "nvfp4")

    @pytest.mark.parametrize("n,fmt,routing", [(2, "nvfp4", "random"), (4, "mxfp4", "uneven"),
                                               (8, "mxfp4", "empty"), (3, "mxfp4", "random")])
    def test_tensor_parallel_equals_one_device(reduce_path, n, fmt, routing):
        """QuantizedMoE(mesh=, tensor_axis=): I/d of every expert's features per device (4 and 8
        devices pad each device's 64 / 32 features to 128; 3 devices take 96 / 96 / 64 whole
        MXFP4 blocks), one sum of the combined shares."""
        found = mmd.check_tensor_parallel(DEVICES, n, fmt, routing)
        print(f"tensor parallel {n} devices ({reduce_path}): {mmd.summary(found)}")

    def test_tensor_parallel_quantized_activations_and_odd_tokens():
        mmd.check_tensor_parallel(DEVICES, 4, "nvfp4", "uneven", act_fmt="nvfp4")
        mmd.check_tensor_parallel(DEVICES, 2, "mxfp4", "random", act_fmt="mxfp4")
        mmd.check_tensor_parallel(DEVICES, 4, "nvfp4", tokens=mmd.TOKENS - 3)

    def test_tensor_parallel_check_catches_a_lost_share(monkeypatch):
        """The check has teeth: devices that keep their own partial sums fail it."""
        monkeypatch.setattr(dispatch.lax, "psum", lambda x, axis: x)
        with pytest.raises(AssertionError):
            mmd.check_tensor_parallel(DEVICES, 2, "nvfp4")

    @pytest.mark.parametrize("fmt,d", [("nvfp4", 2), ("mxfp4", 4), ("mxfp8_e4m3", 8),
                                       ("mxfp4", 3), ("nvfp4", 3)])
    def test_split_intermediate_pairs_gate_and_up_per_device(fmt, d):
        """split_intermediate puts device j's gate rows, then its up rows (each padded with
        zeros to whole 128-row tiles), in its N block of gate_up and the same features in its K
        block of down; the dequantized values are the originals', the padding 0;
        unsplit_intermediate gives back the original arrays bit for bit. Over 3 devices the
        256 features split unevenly in whole blocks (96 / 96 / 64 of 32-element MXFP4 blocks,
        96 / 80 / 80 of 16-element NVFP4 blocks)."""
        import jax_blockscale as jbs
        from jax_blockscale.ragged.tensor_parallel import split_intermediate, unsplit_intermediate

        layer = mmd.moe_layer(fmt)
        gu, dn = layer.gate_up.get_value(), layer.down.get_value()
        gt, dt = split_intermediate(gu, dn, d)
        inter = mmd.INTERMEDIATE
        widths = {("mxfp4", 3): [96, 96, 64], ("nvfp4", 3): [96, 80, 80]}.get(
            (fmt, d), [inter // d] * d)
        firsts = np.cumsum([0] + widths[:-1])
        ip = 128  # the widest device's features, in whole 128-row tiles
        assert gt.shape == (mmd.EXPERTS, d * 2 * ip, mmd.HIDDEN) and gt.layout == "blocked"
        assert dt.shape == (mmd.EXPERTS, mmd.HIDDEN, d * ip) and dt.layout == "blocked"
        g, g_tp = np.asarray(jbs.dequantize(gu)), np.asarray(jbs.dequantize(gt))
        w, w_tp = np.asarray(jbs.dequantize(dn)), np.asarray(jbs.dequantize(dt))
        for j, (first, per) in enumerate(zip(firsts, widths)):
            block = g_tp[:, j * 2 * ip:(j + 1) * 2 * ip]
            np.testing.assert_array_equal(block[:, :per], g[:, first:first + per])
            np.testing.assert_array_equal(block[:, ip:ip + per],
                                          g[:, inter + first:inter + first + per])
            assert not block[:, per:ip].any() and not block[:, ip + per:].any()
            cols = w_tp[:, :, j * ip:(j + 1) * ip]
            np.testing.assert_array_equal(cols[:, :, :per], w[:, :, first:first + per])
            assert not cols[:, :, per:].any()
        back = unsplit_intermediate(gt, dt, d, inter)
        for a, b in zip(back, (gu, dn)):
            assert a.shape == b.shape and a.layout == b.layout == "blocked"
            np.testing.assert_array_equal(np.asarray(a.data, np.float32),
                                          np.asarray(b.data, np.float32))
            bits = lambda v: np.asarray(jax.lax.bitcast_convert_type(v, jnp.uint8))  # noqa: E731
            np.testing.assert_array_equal(bits(a.scales), bits(b.scales))
        blocks = inter // jbs.get_format(fmt).block
        with pytest.raises(ValueError, match=f"intermediate=256 has {blocks} blocks"):
            split_intermediate(gu, dn, blocks + 1)
        with pytest.raises(ValueError, match="split_intermediate"):
            # the original layout over 4 devices: 64-row N blocks, not whole tiles
            from jax_blockscale.ragged.tensor_parallel import tensor_parallel_moe
            tensor_parallel_moe(jnp.zeros((4, mmd.HIDDEN)), None, gu, dn, route=None,
                                activation=None, mesh=mmd.mesh_of(DEVICES, 4), axis="d")

    def test_feature_ranges_in_whole_blocks():
        """Each device's features are whole blocks, as even as whole blocks allow, and padded
        to the widest in whole 128-row tiles: gpt-oss-120b's 2880 over 2 and 4 devices."""
        from jax_blockscale.ragged.tensor_parallel import feature_ranges, padded_features
        assert feature_ranges(2880, 2, 32) == [(0, 1440), (1440, 1440)]
        assert padded_features(2880, 2, 32) == 1536
        assert feature_ranges(2880, 4, 32) == [(0, 736), (736, 736), (1472, 704), (2176, 704)]
        assert padded_features(2880, 4, 32) == 768
        assert feature_ranges(768, 4, 16) == [(0, 192), (192, 192), (384, 192), (576, 192)]
        assert padded_features(768, 4, 16) == 256
        assert feature_ranges(64, 3, 16) == [(0, 32), (32, 16), (48, 16)]
        with pytest.raises(ValueError, match="not whole 32-element blocks"):
            feature_ranges(2880 + 16, 2, 32)
        with pytest.raises(ValueError, match="fewer than the 4 devices"):
            feature_ranges(96, 4, 32)

    def test_tensor_parallel_option_errors_name_the_argument():
        mesh = Mesh(np.asarray(DEVICES[:2]), ("d",), axis_types=(AxisType.Auto,))
        kw = dict(fmt="mxfp4", rngs=nnx.Rngs(0))
        with pytest.raises(ValueError, match="both given"):
            jnn.QuantizedMoE(256, 256, 8, 2, mesh=mesh, expert_axis="d", tensor_axis="d", **kw)
        with pytest.raises(ValueError, match="tensor_axis= needs mesh="):
            jnn.QuantizedMoE(256, 256, 8, 2, tensor_axis="d", **kw)
        with pytest.raises(ValueError, match="tensor_axis='x'"):
            jnn.QuantizedMoE(256, 256, 8, 2, mesh=mesh, tensor_axis="x", **kw)
        with pytest.raises(ValueError, match="intermediate=96"):
            jnn.QuantizedMoE(256, 96, 8, 2, mesh=Mesh(np.asarray(DEVICES[:4]), ("d",)),
                             tensor_axis="d", **kw)
        layer = jnn.QuantizedMoE(256, 256, 8, 2, mesh=mesh, tensor_axis="d", **kw)
        with pytest.raises(ValueError, match="layer="):
            layer(jnp.zeros((4, 256), jnp.bfloat16), layer=jnp.int32(0))

    def test_llama_moe_block_tensor_parallel_relays_its_experts():
        """examples/llama's moe_block with a tensor-parallel placement hands the layer its
        experts re-laid (split_intermediate): with intermediate 256 over 2 devices the re-laid
        shapes are the original's, so experts handed over unsplit would pair gate with the other
        device's up silently; its output equals the one-device block to a bf16 step."""
        import dataclasses
        import pathlib
        import sys

        sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "examples" / "llama"))
        import model as llama

        cfg = dataclasses.replace(llama.LlamaConfig.tiny_moe(num_layers=1),
                                  moe_intermediate_size=256)
        params = llama.quantize_params(llama.random_params(cfg, jax.random.key(0)), "nvfp4")
        mlp = {k: v[0] for k, v in params["layers"]["mlp"].items()}
        mesh = mmd.mesh_of(DEVICES, 2)
        x = jnp.asarray(mmd.rand(3, (8, cfg.hidden_size)), jnp.bfloat16)
        want = np.asarray(llama.moe_block(cfg, mlp)(x), np.float32)
        tp = llama.moe_block(cfg, mlp, placement=dict(mesh=mesh, tensor_axis="d"))
        assert tp.gate_up.get_value().shape == mlp["gate_up"].shape  # the case shapes miss
        got = np.asarray(jax.jit(lambda x: tp(x))(x), np.float32)
        assert np.abs(got - want).max() <= 2.0 ** -7 * np.abs(want).max(), np.abs(got - want).max()

    def test_padded_exchange_has_ragged_all_to_all_semantics():
        """The example of lax.ragged_all_to_all's documentation, through the padded exchange,
        and a shuffled multi-slice one checked against the documented pseudocode."""
        mesh = Mesh(np.asarray(DEVICES[:2]), ("d",), axis_types=(AxisType.Auto,))
        args = [[[1, 2, 2], [3, 4, 0]], [[0] * 4] * 2, [[0, 1], [0, 1]], [[1, 2], [1, 1]],
                [[0, 0], [1, 2]], [[1, 1], [2, 1]]]

        def run(op, out, io, ss, oo, rs):
            # peer_rows: the most rows one device sends one peer (5, below)
            f = lambda *a: dispatch.ragged_exchange(*(v[0] for v in a), axis_name="d",  # noqa
                                                    axis_size=2, exchange="padded",
                                                    peer_rows=5)[None]
            return jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P("d"), out_specs=P("d"),
                                         check_vma=False))(op, out, io, ss, oo, rs)

        got = run(*(jnp.asarray(a, jnp.int32) for a in args))
        np.testing.assert_array_equal(np.asarray(got), [[1, 3, 0, 0], [2, 2, 4, 0]])
        # 2 slices per peer, out of order in the operand, into a nonzero output
        rng = np.random.default_rng(0)
        op = rng.integers(1, 99, (2, 8)).astype(np.int32)
        io = np.array([[5, 0, 2, 7], [0, 6, 3, 1]], np.int32)
        ss = np.array([[2, 1, 0, 1], [1, 2, 3, 2]], np.int32)
        # receiver r gets from sender s slices s's [2r, 2r+1]; lay them out back to back
        rs = np.stack([np.concatenate([ss[s, 2 * r:2 * r + 2] for s in range(2)])
                       for r in range(2)])
        recv_off = np.stack([np.cumsum(rs[r]) - rs[r] for r in range(2)]).astype(np.int32)
        oo = np.stack([np.concatenate([recv_off[r, 2 * s:2 * s + 2] for r in range(2)])
                       for s in range(2)])
        out = np.full((2, 9), -1, np.int32)
        want = out.copy()
        for s in range(2):
            for i in range(4):
                r = i // 2
                want[r, oo[s, i]:oo[s, i] + ss[s, i]] = op[s, io[s, i]:io[s, i] + ss[s, i]]
        got = run(*(jnp.asarray(a) for a in (op, out, io, ss, oo, rs)))
        np.testing.assert_array_equal(np.asarray(got), want)

    def test_dispatch_option_errors_name_the_argument():
        mesh = Mesh(np.asarray(DEVICES[:4]), ("d",), axis_types=(AxisType.Auto,))
        kw = dict(fmt="mxfp4", rngs=nnx.Rngs(0))
        with pytest.raises(ValueError, match="expert_axis='x'"):
            jnn.QuantizedMoE(256, 256, 8, 2, mesh=mesh, expert_axis="x", **kw)
        with pytest.raises(ValueError, match="experts=6"):
            jnn.QuantizedMoE(256, 256, 6, 2, mesh=mesh, expert_axis="d", **kw)
        with pytest.raises(ValueError, match="without expert_axis"):
            jnn.QuantizedMoE(256, 256, 8, 2, mesh=mesh, **kw)
        with pytest.raises(ValueError, match="exchange"):
            jnn.QuantizedMoE(256, 256, 8, 2, mesh=mesh, expert_axis="d", exchange="nccl", **kw)
        layer = jnn.QuantizedMoE(256, 256, 8, 2, expert_axis="d", **kw)  # no mesh set
        with pytest.raises(ValueError, match="mesh="):
            layer(jnp.zeros((4, 256), jnp.bfloat16))
