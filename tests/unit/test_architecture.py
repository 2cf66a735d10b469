"""The package's floors (docs/architecture.md), read from its own source: who may import whom,
no import circles, no function-level imports of the package's own modules, and the module paths
of earlier releases still working."""
import ast
import importlib
import os
import subprocess
import sys

import pytest

import jax_blockscale

PACKAGE_DIR = os.path.dirname(jax_blockscale.__file__)
PKG = "jax_blockscale"

# folder (or top-level module) -> its floor; a module may import only floors below its own, and
# modules of its own folder
FLOORS = {
    "config": 0, "core": 1, "catalog": 1, "_plugin": 2, "lowering": 3,
    "quantization": 4, "ragged": 5, "dense": 6, "interop": 7, "nn": 7, "kernels": 7,
    "_moved": 7, "__init__": 8,
}
# the only function-level imports of the package's own modules: the AOT build's workers load the
# CuTeDSL kernel modules after choosing the target arch (the DSL reads it on import)
FUNCTION_LEVEL_IMPORTS = {"jax_blockscale.kernels.aot_sm90": 1, "jax_blockscale.kernels.aot_sm100": 1}


def _module_name(path):
    rel = os.path.relpath(path, PACKAGE_DIR)[:-3].replace(os.sep, ".")
    return PKG if rel == "__init__" else f"{PKG}.{rel[:-9] if rel.endswith('.__init__') else rel}"


def _modules():
    for root, _, files in os.walk(PACKAGE_DIR):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(root, f)
                yield _module_name(path), path


def _resolve(module, is_pkg, node):
    """The absolute module names an import node refers to (package-internal ones only)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name.startswith(PKG)]
    if node.level == 0:
        base = node.module or ""
        if not base.startswith(PKG):
            return []
    else:
        parts = module.split(".")
        parts = parts if is_pkg else parts[:-1]
        parts = parts[:len(parts) - node.level + 1]
        base = ".".join(parts + ([node.module] if node.module else []))
    out = []
    for a in node.names:
        sub = f"{base}.{a.name}"
        out.append(sub if _exists(sub) else base)
    return out


def _exists(name):
    rel = name[len(PKG) + 1:].replace(".", os.sep)
    return (os.path.isfile(os.path.join(PACKAGE_DIR, rel + ".py"))
            or os.path.isfile(os.path.join(PACKAGE_DIR, rel, "__init__.py")))


def _imports():
    """{module: (module-level imports, function-level imports)} of the package's own modules."""
    graph = {}
    for module, path in _modules():
        tree = ast.parse(open(path).read())
        is_pkg = path.endswith("__init__.py")
        top, inner = set(), []
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                targets = _resolve(module, is_pkg, node)
                if node in tree.body:
                    top.update(targets)
                else:
                    inner.extend((t, node.lineno) for t in targets)
        graph[module] = (top, inner)
    return graph


def _floor(module):
    parts = module.split(".")
    return FLOORS[parts[1]] if len(parts) > 1 else FLOORS["__init__"]


def _folder(module):
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


GRAPH = _imports()


def test_function_level_imports_of_the_package_are_the_aot_workers_only():
    statements = {m: len({line for _, line in i}) for m, (_, i) in GRAPH.items() if i}
    assert statements == FUNCTION_LEVEL_IMPORTS, (
        f"function-level imports of the package's own modules: "
        f"{ {m: i for m, (_, i) in GRAPH.items() if i} }")


def test_every_import_goes_down_a_floor_or_stays_in_its_folder():
    up = []
    for module, (top, _) in GRAPH.items():
        for target in top:
            if target == PKG or _folder(target) == _folder(module):
                continue
            if _floor(target) >= _floor(module):
                up.append((module, target))
    assert not up, f"imports that do not go down a floor: {up}"


def test_the_lowering_machinery_imports_no_operation():
    for module, (top, _) in GRAPH.items():
        if _folder(module) in ("core", "lowering", "catalog", "config", "_plugin"):
            ops = [t for t in top if _folder(t) in ("dense", "ragged", "quantization", "nn",
                                                    "interop", "kernels")]
            assert not ops, f"{module} imports operations {ops}"


def test_no_import_circles():
    edges = {m: {t for t in top if t in GRAPH and t != m} for m, (top, _) in GRAPH.items()}
    # a package's __init__ is imported before its modules; an import of a package is an edge to
    # its __init__ only
    state, stack = {}, []

    def visit(m):
        state[m] = "open"
        stack.append(m)
        for t in edges[m]:
            if state.get(t) == "open":
                raise AssertionError("import circle: " + " -> ".join(stack[stack.index(t):] + [t]))
            if t not in state:
                visit(t)
        stack.pop()
        state[m] = "done"

    for m in sorted(edges):
        if m not in state:
            visit(m)


def test_nothing_imports_the_build_time_kernels_at_run_time():
    users = [m for m, (top, _) in GRAPH.items()
             if _folder(m) != "kernels" and any(_folder(t) == "kernels" for t in top)]
    assert not users, f"run-time modules importing kernels/: {users}"
    code = ("import sys, jax_blockscale, jax_blockscale.nn; "
            "print(sorted(m for m in sys.modules if m.startswith('jax_blockscale.kernels')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=dict(os.environ, JAX_PLATFORMS="cpu"), check=True).stdout
    assert out.strip() == "[]"


@pytest.mark.parametrize("old, new, name", [
    ("jax_blockscale.quantize", "jax_blockscale.core.quantize", "BlockScaled"),
    ("jax_blockscale.formats", "jax_blockscale.core.formats", "get_format"),
    ("jax_blockscale.layout", "jax_blockscale.core.layout", "to_blocked_scales"),
    ("jax_blockscale.api", "jax_blockscale.dense.api", "gemm"),
    ("jax_blockscale.primitive", "jax_blockscale.dense.primitive", "gemm_p"),
    ("jax_blockscale.sharding", "jax_blockscale.dense.sharding", "gemm_p"),
    ("jax_blockscale.nvfp4_quantizer", "jax_blockscale.quantization.primitive",
     "quantize_nvfp4_p"),
    ("jax_blockscale.ragged_backends", "jax_blockscale.lowering.ragged_reference",
     "clamp_group_sizes"),
    ("jax_blockscale.serialization", "jax_blockscale.interop.params_file", "save_params"),
    ("jax_blockscale.nn_moe", "jax_blockscale.nn.moe", "QuantizedMoE"),
    ("jax_blockscale.ragged", "jax_blockscale.ragged", "ragged_gemm"),
    ("jax_blockscale.nn", "jax_blockscale.nn", "QuantizedLinear"),
])
def test_old_module_paths_keep_working(old, new, name):
    pytest.importorskip("flax")
    assert getattr(importlib.import_module(old), name) is getattr(importlib.import_module(new),
                                                                  name)


def test_old_module_paths_leave_the_public_functions_alone():
    import jax_blockscale as jbs
    import jax_blockscale.quantize  # noqa: F401  (the old module path)

    assert callable(jbs.quantize) and jbs.quantize.__module__ == "jax_blockscale.quantization.api"
    assert jbs.gemm.__module__ == "jax_blockscale.dense.api"


@pytest.mark.parametrize("old, new", [("jax_blockscale.aot", "jax_blockscale.kernels.aot_sm90"),
                                      ("jax_blockscale.aot_sm100",
                                       "jax_blockscale.kernels.aot_sm100")])
def test_the_moved_build_modules_name_their_new_path(old, new):
    with pytest.raises(ImportError, match=new.replace(".", r"\.")):
        importlib.import_module(old)
