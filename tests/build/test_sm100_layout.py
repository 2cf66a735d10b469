"""The scale layout the Blackwell kernel reads is our blocked layout.

The kernel views the sfa / sfb buffers through `blocked_scale_layout` (the DSL's
scale atom tiled over the operand shape).  Here we build that layout with the
DSL's layout algebra on the CPU (static shapes are evaluated while tracing; no
GPU needed) and compare its index map, element by element, with

* the formula of the FFI contract: plain s[l, mn, sk] lives at flat index of
  [l, mn//128, sk//4, mn%32, (mn%128)//32, sk%4] in a C-order
  (L, ceil(MN/128), ceil(SK/4), 32, 4, 4) array, and
* `jax_blockscale.core.layout.to_blocked_scales`, the function users call,

for shapes with and without padding in MN and in SK.
"""

import importlib

import numpy as np
import pytest

import native  # tests/support/native.py

native.need_dsl()
sm100 = importlib.import_module("jax_blockscale.kernels.sm100_blockscaled")
import cutlass  # noqa: E402  (after the check above)
import cutlass.cute as cute  # noqa: E402

# (MN, SK, L, block): SK = K / block scale columns.
SHAPES = [
    (128, 4, 1, 16),   # exactly one atom
    (200, 6, 2, 16),   # MN and SK both padded, batched
    (300, 5, 1, 32),   # three MN tiles, SK padded
    (1, 1, 1, 16),     # a single scale
    (256, 16, 3, 32),  # several K tiles and batches, no padding
    (129, 12, 1, 16),  # one row into a second MN tile
    (64, 2, 2, 32),    # less than one atom in both directions
]


def _ceil(a, b):
    return -(-a // b)


@pytest.fixture(scope="module")
def dsl_maps():
    """{shape: (offsets[l, mn, sk], cosize, broadcast_ok)} from the DSL layout."""
    maps = {}

    @cute.jit
    def trace():
        for (mn, sk, nl, block) in SHAPES:
            lay = sm100.blocked_scale_layout((mn, sk * block, nl), block)
            offs = np.zeros((nl, mn, sk), np.int64)
            bcast = True
            for l in cutlass.range_constexpr(nl):
                for r in cutlass.range_constexpr(mn):
                    for c in cutlass.range_constexpr(sk):
                        o = lay((r, c * block, l))
                        offs[l, r, c] = o
                        # Every element of a block reads the block's scale.
                        bcast = bcast and lay((r, c * block + block - 1, l)) == o
            maps[(mn, sk, nl, block)] = (offs, int(cute.cosize(lay)), bcast)

    cute.compile(trace, options="--gpu-arch sm_100a")
    return maps


def _formula(mn, sk, nl):
    rt, ct = _ceil(mn, 128), _ceil(sk, 4)
    l, r, c = np.meshgrid(np.arange(nl), np.arange(mn), np.arange(sk), indexing="ij")
    return np.ravel_multi_index((l, r // 128, c // 4, r % 32, (r % 128) // 32, c % 4),
                                (nl, rt, ct, 32, 4, 4))


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_dsl_layout_is_the_blocked_formula(dsl_maps, shape):
    mn, sk, nl, _ = shape
    offs, cosize, bcast = dsl_maps[shape]
    np.testing.assert_array_equal(offs, _formula(mn, sk, nl))
    # The kernel's view spans exactly the padded blocked buffer, no more.
    assert cosize == nl * _ceil(mn, 128) * _ceil(sk, 4) * 512
    assert bcast


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("scale_dtype", ["float8_e4m3fn", "float8_e8m0fnu"])
def test_dsl_layout_reads_what_to_blocked_scales_writes(dsl_maps, shape, scale_dtype):
    layout = pytest.importorskip("jax_blockscale.core.layout")
    import jax.numpy as jnp
    import ml_dtypes

    mn, sk, nl, _ = shape
    offs, _, _ = dsl_maps[shape]
    rng = np.random.default_rng(hash(shape) % 2**32)
    # Non-zero random bit patterns (avoid NaN codes: 0x7f/0xff for e4m3, 0xff for e8m0).
    bits = rng.integers(1, 0x7F, size=(nl, mn, sk), dtype=np.uint8)
    plain = bits.view(getattr(ml_dtypes, scale_dtype))
    blocked = np.asarray(layout.to_blocked_scales(jnp.asarray(plain)))
    assert blocked.shape == (nl, _ceil(mn, 128), _ceil(sk, 4), 32, 4, 4)
    flat = blocked.view(np.uint8).reshape(-1)
    # Every scale is where the kernel looks for it ...
    np.testing.assert_array_equal(flat[offs], bits)
    # ... and everything the kernel reads that is not a scale is zero padding.
    pad = np.ones(flat.size, bool)
    pad[offs.reshape(-1)] = False
    assert not flat[pad].any()


def test_dynamic_shape_layout_structure():
    """With runtime (M, K, L), as in the kernel, the atom and the K-tile stride
    stay static: 512-byte atoms, K tiles adjacent, MN tiles and L strided by
    whole rows of atoms."""
    seen = {}

    @cute.jit
    def trace(m: cutlass.Int32, k: cutlass.Int32, l: cutlass.Int32):
        seen["nvfp4"] = str(sm100.blocked_scale_layout((m, k, l), 16))
        seen["mx"] = str(sm100.blocked_scale_layout((m, k, l), 32))

    cute.compile(trace, cutlass.Int32(1), cutlass.Int32(1), cutlass.Int32(1),
                 options="--gpu-arch sm_100a")
    for key, vec in (("nvfp4", 16), ("mx", 32)):
        shape, stride = seen[key].split(":")
        assert shape.startswith(f"(((32,4),?),(({vec},4),?),(1,?))"), seen[key]
        assert stride.startswith("(((16,4),?{div=512}),((0,1),512),(0,?"), seen[key]
