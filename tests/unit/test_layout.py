"""The blocked scale layout against its index-map definition, both directions, with padding."""
import jax.numpy as jnp
import numpy as np
import pytest

import jax_blockscale as jbs
import oracle


@pytest.mark.parametrize("mn,sk", [(1, 1), (128, 4), (129, 5), (300, 7), (256, 8), (77, 2)])
@pytest.mark.parametrize("batch", [(), (3,)])
def test_blocked_layout_index_map(mn, sk, batch):
    rng = np.random.default_rng(mn * 31 + sk)
    plain = jnp.asarray(rng.integers(100, 140, batch + (mn, sk)).astype(np.uint8)).view(
        jnp.float8_e8m0fnu)
    blocked = jbs.to_blocked_scales(plain)
    rows, cols = -(-mn // 128), -(-sk // 4)
    assert blocked.shape == batch + (rows, cols, 32, 4, 4)
    bits = np.asarray(blocked).view(np.uint8)
    np.testing.assert_array_equal(oracle.blocked_to_plain(bits, mn, sk),
                                  np.asarray(plain).view(np.uint8))
    # padding is zero bits and every real scale appears exactly once
    assert (bits != 0).sum() == np.prod(batch + (mn, sk), dtype=int)
    back = jbs.from_blocked_scales(blocked, mn, sk)
    np.testing.assert_array_equal(np.asarray(back).view(np.uint8), np.asarray(plain).view(np.uint8))


def test_to_blocked_is_idempotent_and_preserves_values():
    x = np.random.default_rng(0).standard_normal((200, 64)).astype(np.float32)
    q = jbs.quantize(x, "nvfp4")
    b = jbs.to_blocked(q)
    assert b.layout == "blocked" and jbs.to_blocked(b) is b
    np.testing.assert_array_equal(np.asarray(jbs.dequantize(b)), np.asarray(jbs.dequantize(q)))
    p = jbs.to_plain(b)
    np.testing.assert_array_equal(np.asarray(p.scales).view(np.uint8),
                                  np.asarray(q.scales).view(np.uint8))


def test_from_blocked_rejects_wrong_shape():
    s = jnp.zeros((2, 1, 32, 4, 4), jnp.uint8)
    with pytest.raises(ValueError, match="do not hold"):
        jbs.from_blocked_scales(s, 100, 4)
