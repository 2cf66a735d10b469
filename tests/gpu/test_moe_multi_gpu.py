"""MoE on 2 GPUs: ragged_gemm with its experts, N or K split and the QuantizedMoE layer expert
parallel, tensor parallel (N of both weights) and Megatron-style (gate_up on N, down on K), under
jax.jit on a mesh of the first 2 GPUs, equal the same call on one GPU (bit for bit where no
partial sums are added), with exactly the expected collectives (NCCL) and no expert weight moved.
The dispatching expert-parallel layer (QuantizedMoE(mesh=, expert_axis=)) runs on 2 and, where
there are 4, on 4 GPUs, with both exchanges (ragged_all_to_all, padded all_to_all), and with
exchange="reduce" (every GPU keeps every token; one f32 all-reduce of the combined shares); the
tensor-parallel layer (QuantizedMoE(mesh=, tensor_axis=)) on 2 and 4 GPUs.
The checks are tests/support/moe_multi_device.py's, as tests/unit/test_moe_sharding.py runs them
on forced CPU devices; here they run in this process. Skipped with fewer than 2 GPUs.

    XLA_PYTHON_CLIENT_PREALLOCATE=false NCCL_NVLS_ENABLE=0 \\
        python -m pytest -q -m gpu tests/gpu/test_moe_multi_gpu.py
"""
from __future__ import annotations

import os

# NVLink multicast stays off on the lent machines (before the first collective initializes NCCL).
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")

import jax  # noqa: E402
import pytest  # noqa: E402

import moe_multi_device as mmd  # noqa: E402  (tests/support, put on sys.path by conftest)


def _gpus():
    try:
        return jax.devices("gpu")
    except RuntimeError:
        return []


pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(len(_gpus()) < 2, reason="needs 2 or more GPUs")]

FORMATS = ("nvfp4", "mxfp4")


@pytest.fixture(scope="module")
def devices():
    return _gpus()[:2]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("case", list(mmd.RAGGED_CASES))
def test_ragged_gemm_split_on_2_gpus(devices, case, fmt):
    found = mmd.check_ragged(devices, case, fmt)
    print(f"ragged {case} {fmt}: {mmd.summary(found)}")


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("case", list(mmd.LAYER_INDEX_CASES))
def test_layer_index_split_on_2_gpus(devices, case, fmt):
    mmd.check_layer_index(devices, case, fmt)


def test_shards_plan_as_the_unsharded_call_on_2_gpus(devices):
    print(mmd.check_shards_plan_as_unsharded(devices))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("case", list(mmd.LAYER_CASES))
def test_moe_layer_parallel_on_2_gpus(devices, case, fmt):
    found = mmd.check_layer(devices, case, fmt)
    print(f"layer {case} {fmt}: {mmd.summary(found)}")


def test_moe_layer_w4a4_megatron_on_2_gpus(devices):
    found = mmd.check_layer(devices, "tensor_k", "nvfp4", act_fmt="nvfp4")
    print(f"layer tensor_k nvfp4 W4A4: {mmd.summary(found)}")


# The dispatched layer equals one device bit for bit, on GPUs as on forced CPU devices: its
# router runs on all tokens, as the one-device layer's does (jax_blockscale/ragged/dispatch.py).
DISPATCH_MATCH = "exact"


@pytest.mark.parametrize("exchange", ["ragged", "padded"])
@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("fmt", FORMATS)
def test_dispatching_expert_parallel_layer(n, fmt, exchange):
    gpus = _gpus()
    if len(gpus) < n:
        pytest.skip(f"needs {n} GPUs, found {len(gpus)}")
    found = mmd.check_dispatch(gpus, n, fmt, "random", exchange=exchange, match=DISPATCH_MATCH)
    print(f"dispatch {n} GPUs {fmt} {exchange}: {mmd.summary(found)}")
    if exchange == "ragged":
        assert any(c.name == "ragged-all-to-all" for c in found), mmd.summary(found)


@pytest.mark.parametrize("routing", ["uneven", "empty"])
def test_dispatching_layer_uneven_routing_on_2_gpus(devices, routing):
    mmd.check_dispatch(devices, 2, "nvfp4", routing, match=DISPATCH_MATCH)


def test_dispatching_layer_w4a4_on_2_gpus(devices):
    mmd.check_dispatch(devices, 2, "nvfp4", "random", act_fmt="nvfp4", match=DISPATCH_MATCH)


def test_hlo_check_catches_a_gathered_weight_on_2_gpus(devices):
    msg = mmd.check_catches_weight_gather(devices)
    assert "expert weight" in msg or "more than any activation" in msg, msg


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("fmt", FORMATS)
def test_reduce_expert_parallel_layer(n, fmt):
    """exchange="reduce": every GPU keeps every token, runs its own experts' rows, and one f32
    all-reduce of the (tokens, hidden) shares sums them (to f32 rounding of one GPU's layer)."""
    gpus = _gpus()
    if len(gpus) < n:
        pytest.skip(f"needs {n} GPUs, found {len(gpus)}")
    found = mmd.check_reduce(gpus, n, fmt, "random")
    print(f"reduce {n} GPUs {fmt}: {mmd.summary(found)}")


@pytest.mark.parametrize("routing", ["uneven", "empty"])
def test_reduce_layer_uneven_routing_and_w4a4_on_2_gpus(devices, routing):
    mmd.check_reduce(devices, 2, "nvfp4", routing)
    mmd.check_reduce(devices, 2, "nvfp4", routing, act_fmt="nvfp4")


def test_reduce_layer_likely_buffer_and_token_range_sums_on_2_gpus(devices, monkeypatch):
    """The paths the reduce layer takes at serving sizes, at the test's size: the thresholds
    lowered so that it compiles the smaller row buffers (random routing takes one, uneven
    routing the worst case) and sums the shares per token range (an all-to-all of the f32
    shares, a sum on each range's device, a bf16 all-gather)."""
    from jax_blockscale.ragged import dispatch
    monkeypatch.setattr(dispatch, "REDUCE_LIKELY_MIN_ROWS", 0)
    monkeypatch.setattr(dispatch, "REDUCE_ROWS_ALIGN", 8)
    monkeypatch.setattr(dispatch, "REDUCE_SCATTER_MIN_BYTES", 0)
    for routing in ("random", "uneven"):
        found = mmd.check_reduce(devices, 2, "nvfp4", routing)
        print(f"reduce 2 GPUs, likely buffer and token-range sums, {routing}: {mmd.summary(found)}")


@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("fmt", FORMATS)
def test_tensor_parallel_layer(n, fmt):
    """QuantizedMoE(mesh=, tensor_axis=): every GPU holds about I/n of every expert's features
    in whole blocks (4 GPUs pad their 64 to 128; 3 GPUs take 96 / 96 / 64 or 96 / 80 / 80),
    runs every routed row through them, and the combined partial outputs are summed once (to
    f32 rounding of the same layer on one GPU; to the bf16 rounding of the expert outputs of
    the one-GPU QuantizedMoE)."""
    gpus = _gpus()
    if len(gpus) < n:
        pytest.skip(f"needs {n} GPUs, found {len(gpus)}")
    found = mmd.check_tensor_parallel(gpus, n, fmt, "random")
    print(f"tensor parallel {n} GPUs {fmt}: {mmd.summary(found)}")


def test_tensor_parallel_layer_w4a4_uneven_and_token_range_sums_on_2_gpus(devices, monkeypatch):
    mmd.check_tensor_parallel(devices, 2, "nvfp4", "uneven", act_fmt="nvfp4")
    from jax_blockscale.ragged import dispatch
    monkeypatch.setattr(dispatch, "REDUCE_SCATTER_MIN_BYTES", 0)
    found = mmd.check_tensor_parallel(devices, 2, "mxfp4", "empty")
    print(f"tensor parallel 2 GPUs, token-range sums: {mmd.summary(found)}")
