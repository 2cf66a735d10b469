"""The K order of the activations that the sm90 register-weight variants read (pure Python: the
lowering imports it at run time, the kernel at build time).

In those variants (kernels/sm90_blockscaled.py, `weights_in_registers`) a thread converts the 16
contiguous weight elements 16t .. 16t + 15 (t = lane % 4) of each 64-element k-tile straight into
the A registers of four k16 wgmmas. The fp4 bit trick yields pairs of elements (j, j + 4) of each
8-element chunk s, and an A register pair must hold K slots (2t, 2t + 1) or (2t + 8, 2t + 9) of
its MMA, so MMA b = 2s + h takes pairs 2h (slots 2t, 2t+1) and 2h + 1 (slots 2t + 8, 2t + 9).
Written as digits, element k = 16t + 8s + 4q + 2h + hi of a k-tile lands in slot
16 (2s + h) + 8 hi + 2t + q. The activations (wgmma's shared-memory operand, read in slot order)
must be stored in that order: slot p holds element activation_k_order()[p].
"""
from __future__ import annotations

K_TILE = 64
K_DIGITS = (4, 2, 2, 2, 2)  # element k of a k-tile = digits (t, s, q, h, hi), most significant first
SLOT_ORDER = (1, 3, 4, 0, 2)  # slot = digits (s, h, hi, t, q): a transpose of K_DIGITS' axes


def activation_k_order() -> list[int]:
    """Slot p of a 64-element k-tile holds activation element order[p]."""
    import numpy as np

    return np.arange(K_TILE).reshape(K_DIGITS).transpose(SLOT_ORDER).reshape(K_TILE).tolist()
