"""Module paths of earlier releases, kept working: each old path names the module that now holds
its code (docs/architecture.md draws the layout).

Old modules that `import jax_blockscale` loads anyway become aliases in `sys.modules`, so
``from jax_blockscale.quantize import BlockScaled`` and ``jax_blockscale.api.gemm`` work as
before. Those that need an optional dependency (Flax) are aliased by an import hook on first
import, and the build-time ones raise an ImportError naming their new path.
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys

_PACKAGE = __name__.rsplit(".", 1)[0]

# old module -> the module that holds its code now
MOVED = {
    "formats": "core.formats",
    "layout": "core.layout",
    "quantize": "core.quantize",
    "nvfp4_quantizer": "quantization.primitive",
    "api": "dense.api",
    "primitive": "dense.primitive",
    "sharding": "dense.sharding",
    "quantized_activation": "dense.quantized_activation",
    "ragged_sharding": "ragged.sharding",
    "ragged_backends": "lowering.ragged_reference",
    "partitioning": "lowering.partitioning",
    "serialization": "interop.params_file",
}
# old modules that need Flax: aliased when first imported
MOVED_LAZY = {"nn_moe": "nn.moe"}
# build-time modules: run them under their new names
MOVED_BUILD = {"aot": "kernels.aot_sm90", "aot_sm100": "kernels.aot_sm100"}


def alias_old_module_paths() -> None:
    for old, new in MOVED.items():
        sys.modules.setdefault(f"{_PACKAGE}.{old}", importlib.import_module(f"{_PACKAGE}.{new}"))
    if not any(isinstance(f, _OldPathFinder) for f in sys.meta_path):
        sys.meta_path.append(_OldPathFinder())


class _AliasLoader(importlib.abc.Loader):
    def __init__(self, new: str):
        self.new = new

    def create_module(self, spec):
        module = importlib.import_module(self.new)
        self.own_spec, self.own_loader = module.__spec__, module.__loader__
        return module

    def exec_module(self, module):
        # the import system stamped the old name's spec on the module: give it back its own
        module.__spec__, module.__loader__ = self.own_spec, self.own_loader


class _OldPathFinder(importlib.abc.MetaPathFinder):
    """Finds the lazily aliased old paths, and refuses the build-time ones with their new name."""

    def find_spec(self, fullname, path=None, target=None):
        if not fullname.startswith(_PACKAGE + "."):
            return None
        old = fullname[len(_PACKAGE) + 1:]
        if old in MOVED_BUILD:
            raise ImportError(f"{fullname} moved to {_PACKAGE}.{MOVED_BUILD[old]} (run "
                              f"`python -m {_PACKAGE}.{MOVED_BUILD[old]}`)", name=fullname)
        if old in MOVED_LAZY:
            return importlib.util.spec_from_loader(
                fullname, _AliasLoader(f"{_PACKAGE}.{MOVED_LAZY[old]}"))
        return None
