"""`gemm(x, w, quantize_a="nvfp4")` lowered for CUDA on this GPU-less machine (as if on an H100):
one call to the fused target where gemm would run the quantized problem on the sm90 decode
kernel, the composition (quantize, then gemm's own target) everywhere else; the workspace the
lowering allocates is the library's layout. The numerics run in tests/gpu. Needs the library
the package loads (tests/support/native.py)."""
from __future__ import annotations

import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_blockscale as jbs
import native  # tests/support/native.py
from hopper import lower_for_cuda  # tests/support/hopper.py
from jax_blockscale import _plugin
from jax_blockscale.catalog import sm90 as cat
from jax_blockscale.lowering.ffi_sm90 import quantized_activation_scratch_bytes

native.need_library()
native.need(None if _plugin.has_quantized_act_gemm() else "the library has no fused target",
            "the quantized-activation targets")

FUSED = _plugin.QUANTIZED_ACT_SM90_TARGET
QUANTIZE = _plugin.QUANTIZE_NVFP4_SM90_TARGET


def _weight(n, k, fmt="nvfp4", lead=()):
    w = jax.random.normal(jax.random.PRNGKey(n + k), lead + (n, k), jnp.float32)
    kw = dict(global_scale="per_matrix") if fmt == "nvfp4" else {}
    return jbs.quantize(w, fmt, layout="blocked", **kw)


def _calls(text):
    return [ln for ln in text.splitlines() if "stablehlo.custom_call @jax_blockscale" in ln]


@pytest.mark.parametrize("m,n,k", [(1, 6144, 4096), (16, 4096, 14336), (4, 512, 2048),
                                   (32, 4096, 16384)])
def test_decode_sizes_run_in_one_fused_call(monkeypatch, m, n, k):
    """Within one quantizer CTA (the first and third) and past it (the amax kernel, then the
    one-block-per-thread kernel, in the same call): no size limit."""
    x, w = jnp.ones((m, k), jnp.bfloat16), _weight(n, k)
    text = lower_for_cuda(monkeypatch, lambda x, w: jbs.gemm(x, w, quantize_a="nvfp4"), x, w)
    calls = _calls(text)
    assert len(calls) == 1 and "@" + FUSED + "(" in calls[0], calls
    # no XLA quantization left around it: the activation goes in as bf16, no amax reduction
    assert f"tensor<{m}x{k}xbf16>" in calls[0]
    assert "stablehlo.reduce" not in text
    workspace = re.findall(r"tensor<(\d+)xf32>", calls[0].split("->")[-1])
    front = quantized_activation_scratch_bytes(m * k // 16)
    assert workspace and int(workspace[-1]) * 4 >= front, (workspace, front)


@pytest.mark.parametrize("block_bytes", [8, 32])
@pytest.mark.parametrize("blocks", [1, 7, 256, 1024, 1025, 2048, 2049, 16384, 57344])
def test_scratch_layout_is_the_librarys(blocks, block_bytes):
    off_scales, off_amax, off_alpha, total = _plugin.quantized_activation_scratch(blocks,
                                                                                 block_bytes)
    assert off_scales >= block_bytes * blocks and off_scales % 256 == 0
    assert off_amax >= off_scales + blocks and off_amax % 256 == 0
    partials = -(-blocks // cat.QUANTIZE_A_AMAX_CTA_BLOCKS)
    assert off_alpha >= off_amax + 4 * partials and off_alpha % 256 == 0
    assert total == quantized_activation_scratch_bytes(blocks, block_bytes) == off_alpha + 4


def test_catalog_is_the_quantizers_launch_shape():
    """The catalog's copies (QUANTIZE_A_CTA_ELEMENTS: what one calibrating CTA holds;
    QUANTIZE_A_AMAX_CTA_BLOCKS: the blocks behind each partial amax, which the lowering's
    scratch size counts) are ffi/quantize_activation_launch.h's, the kernels' and their
    launch's side."""
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    header = open(os.path.join(repo, "ffi", "quantize_activation_launch.h")).read()
    shape = {name: int(value) for name, value in re.findall(
        r"constexpr int (k\w+) = (\d+);", header)}
    assert set(shape) == {"kThreads", "kBlocksPerThread", "kStaticThreads", "kAmaxThreads",
                          "kAmaxBlocksPerThread"}, shape
    assert cat.QUANTIZE_A_CTA_ELEMENTS == shape["kThreads"] * shape["kBlocksPerThread"] * 16
    assert cat.QUANTIZE_A_AMAX_CTA_BLOCKS == shape["kAmaxThreads"] * shape["kAmaxBlocksPerThread"]


@pytest.mark.parametrize("m,n,k", [(1, 6144, 4096), (16, 4096, 14336), (32, 4096, 16384)])
def test_a_given_scale_runs_in_one_fused_call_at_any_decode_size(monkeypatch, m, n, k):
    """With a_global_scale the call gets g itself as its fifth operand (a calibrating call an
    empty one) and XLA reduces and divides nothing."""
    x, w = jnp.ones((m, k), jnp.bfloat16), _weight(n, k)
    f = lambda x, w, g: jbs.gemm(x, w, quantize_a="nvfp4", a_global_scale=g)  # noqa: E731
    text = lower_for_cuda(monkeypatch, f, x, w, jnp.float32(0.01))
    calls = _calls(text)
    assert len(calls) == 1 and "@" + FUSED + "(" in calls[0], calls
    operands = calls[0].split("->")[0]
    assert operands.rstrip().endswith("tensor<1xf32>, tensor<1xf32>)"), operands
    assert "stablehlo.reduce" not in text and "stablehlo.divide" not in text
    calibrating = lower_for_cuda(monkeypatch, lambda x, w: jbs.gemm(x, w, quantize_a="nvfp4"),
                                 x, w)
    calls = _calls(calibrating)
    assert len(calls) == 1 and "@" + FUSED + "(" in calls[0], calls
    assert calls[0].split("->")[0].rstrip().endswith("tensor<1xf32>, tensor<0xf32>)"), calls[0]


@pytest.mark.parametrize("m,n,k", [(64, 4096, 4096), (64, 28672, 4096), (64, 4096, 14336),
                                   (128, 4096, 4096)])
@pytest.mark.parametrize("given", [True, False])
def test_the_register_weight_kernel_is_one_fused_call(monkeypatch, m, n, k, given):
    """Where gemm runs the quantized problem on the register-weight kernel (33-128 rows here),
    the scale given or calibrated, one fused call: the quantizer writes the activation's values
    dequantized and K-ordered (32 bytes a block at the workspace's front), a_kind bf16_kperm;
    no XLA kernel quantizes, dequantizes or transposes x."""
    x, w = jnp.ones((m, k), jnp.bfloat16), _weight(n, k)
    if given:
        f = lambda x, w, g: jbs.gemm(x, w, quantize_a="nvfp4", a_global_scale=g)  # noqa: E731
        text = lower_for_cuda(monkeypatch, f, x, w, jnp.float32(0.01))
    else:
        text = lower_for_cuda(monkeypatch, lambda x, w: jbs.gemm(x, w, quantize_a="nvfp4"), x, w)
    calls = _calls(text)
    assert len(calls) == 1 and "@" + FUSED + "(" in calls[0], calls
    assert f"a_kind = {cat.KIND_CODES['bf16_kperm']} : i32" in calls[0], calls[0]
    assert "stablehlo.reduce" not in text and "stablehlo.transpose" not in text
    assert "stablehlo.gather" not in text  # the K order's other form (permute_activation_k)
    workspace = re.findall(r"tensor<(\d+)xf32>", calls[0].split("->")[-1])
    assert int(workspace[-1]) * 4 >= quantized_activation_scratch_bytes(m * k // 16, 32)


def test_a_scale_per_matrix_is_the_composition(monkeypatch):
    """One decode factor per matrix of a batched activation: each matrix is quantized with its
    own, which the fused call (one scale for the folded rows) cannot do."""
    x, w = jnp.ones((2, 3, 2048), jnp.bfloat16), _weight(512, 2048)
    f = lambda x, w, g: jbs.gemm(x, w, quantize_a="nvfp4", a_global_scale=g)  # noqa: E731
    text = lower_for_cuda(monkeypatch, f, x, w, jnp.full((2,), 0.01, jnp.float32))
    assert FUSED not in text and _calls(text)


@pytest.mark.parametrize("case", ["f32 activation", "mxfp4", "weight stack", "many rows"])
def test_everything_else_is_the_composition(monkeypatch, case):
    m, k, fmt, w = 2, 2048, "nvfp4", _weight(512, 2048)
    dtype = jnp.bfloat16
    if case == "f32 activation":
        dtype = jnp.float32
    elif case == "mxfp4":
        fmt, w = "mxfp4", _weight(512, 2048, "mxfp4")
    elif case == "weight stack":
        w = _weight(512, 2048, lead=(2,))
    else:
        m, w = 1024, _weight(4096, 2048)  # gemm dequantizes x for a dot there: nothing to fuse
    x = jnp.ones((2, m, k) if case == "weight stack" else (m, k), dtype)
    text = lower_for_cuda(monkeypatch, lambda x, w: jbs.gemm(x, w, quantize_a=fmt), x, w)
    assert FUSED not in text
    if fmt == "nvfp4" and dtype == jnp.bfloat16:  # jbs.quantize's own target quantizes x
        assert "@" + QUANTIZE + "(" in text and "stablehlo.reduce" not in text
    else:
        assert "stablehlo.reduce" in text, "the composition quantizes x in XLA (its amax)"
    assert any(QUANTIZE not in c for c in _calls(text)), "the composition's gemm runs a kernel"


def test_under_vmap_each_slice_is_the_composition(monkeypatch):
    w = _weight(512, 2048)
    xs = jnp.ones((3, 2, 2048), jnp.bfloat16)
    f = jax.vmap(lambda x: jbs.gemm(x, w, quantize_a="nvfp4"))
    text = lower_for_cuda(monkeypatch, f, xs)
    assert FUSED not in text and _calls(text)


# ---- jbs.quantize(x, "nvfp4") on the quantizer kernels alone ----

def _quantize_calls(text):
    return [c for c in _calls(text) if "@" + QUANTIZE + "(" in c]


@pytest.mark.parametrize("shape", [(1, 4096), (16, 14336), (2, 3, 64), (64, 4096)])
def test_quantize_of_a_bf16_activation_is_one_call(monkeypatch, shape):
    """Rows folded into one (M, K) call; XLA computes no amax, scale or element; a given
    decode factor is the call's second operand, an empty one calibrates; no weight's global
    scales (an empty third operand) to multiply alpha by."""
    x = jnp.ones(shape, jnp.bfloat16)
    m = int(np.prod(shape[:-1]))
    for g, operand in (("auto", "tensor<0xf32>"), (0.01, "tensor<1xf32>")):
        text = lower_for_cuda(monkeypatch, lambda x: jbs.quantize(x, "nvfp4", global_scale=g), x)
        calls = _calls(text)
        assert len(calls) == 1 and "@" + QUANTIZE + "(" in calls[0], calls
        assert f"tensor<{m}x{shape[-1]}xbf16>, {operand}, tensor<0xf32>)" in calls[0], calls[0]
        assert f"m = {m} : i64" in calls[0] and "stablehlo.reduce" not in text
        assert "stablehlo.divide" not in text


@pytest.mark.parametrize("given", [False, True])
def test_scanned_w4a4_quantizes_on_the_kernels(monkeypatch, given):
    """gemm(x, w_stack, quantize_a="nvfp4", layer=i) (a scanned model's W4A4): the quantizer
    target feeding the layer target, the quantizer also writing each layer's alpha (a's decode
    factor times the stack's global scales: its third operand, the layer call's alpha), so that
    XLA multiplies no (L,) alpha on every call."""
    x, w = jnp.ones((4, 2048), jnp.bfloat16), _weight(512, 2048, lead=(3,))
    g = 0.01 if given else None
    f = lambda x, w, i: jbs.gemm(x, w, quantize_a="nvfp4", layer=i, a_global_scale=g)  # noqa
    text = lower_for_cuda(monkeypatch, f, x, w, jnp.int32(1))
    calls = _calls(text)
    targets = [re.search(r"@(\w+)\(", c).group(1) for c in calls]
    assert targets == [QUANTIZE, _plugin.LAYER_SM90_TARGET], targets
    assert "stablehlo.reduce" not in text
    assert calls[0].split("->")[0].rstrip().endswith("tensor<3xf32>)"), calls[0]
    quantizer = re.match(r"\s*(%\w+):4 = ", calls[0]).group(1)
    assert f"{quantizer}#2" in calls[1].split("{")[0], calls[1]  # its alpha, as it is
    assert not re.search(r"stablehlo.multiply .*tensor<3xf32>", text)


@pytest.mark.parametrize("case", ["f32", "per_matrix", "per-matrix given", "mxfp4",
                                  "under vmap"])
def test_other_quantizations_stay_in_xla(monkeypatch, case):
    x = jnp.ones((2, 4, 64), jnp.bfloat16)
    kw, fmt = {}, "nvfp4"
    if case == "f32":
        x = x.astype(jnp.float32)
    elif case == "per_matrix":
        kw = dict(global_scale="per_matrix")
    elif case == "per-matrix given":
        kw = dict(global_scale=jnp.full((2,), 0.01, jnp.float32))
    elif case == "mxfp4":
        fmt = "mxfp4"
    if case == "under vmap":
        text = lower_for_cuda(monkeypatch, jax.vmap(lambda x: jbs.quantize(x, fmt, **kw)), x)
    else:
        text = lower_for_cuda(monkeypatch, lambda x: jbs.quantize(x, fmt, **kw), x)
    assert not _quantize_calls(text) and "stablehlo.reduce" in text
