"""The decode kernel's variant table for the harness, without jax or the plugin.

run_decode.py runs on the GPU machine with cupy only: it needs
jax_blockscale/kernels/sm90_decode_variants.py (pure Python, and it imports the pure-Python
sm90_dequant_ptx beside it) but not the package's __init__, which imports jax and loads the
plugin. So the two packages are entered as bare modules over their folders first.
"""
from __future__ import annotations

import importlib
import os
import sys
import types

HERE = os.path.dirname(os.path.abspath(__file__))


def load_decode_variants():
    root = os.path.join(HERE, "..", "..", "jax_blockscale")
    for name, path in (("jax_blockscale", root),
                       ("jax_blockscale.kernels", os.path.join(root, "kernels"))):
        if name not in sys.modules:
            pkg = types.ModuleType(name)
            pkg.__path__ = [os.path.abspath(path)]
            sys.modules[name] = pkg
    return importlib.import_module("jax_blockscale.kernels.sm90_decode_variants")
