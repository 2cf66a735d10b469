"""Flax layers holding block-scaled weights, and the one-time conversion of float parameters.

This module needs Flax (``pip install 'jax_blockscale[flax]'``); ``import jax_blockscale`` does
not import it.

Weights are stored the way `jax_blockscale.gemm` reads them: (out, in) = (N, K), quantized along
`in` (the contracting axis) with scales in the ``blocked`` layout, so no call ever transposes or
swizzles a weight. Flax's own ``Dense`` / ``nnx.Linear`` kernels are (in, out); converting
transposes them once.

    dense(x, kernel, bias, act_fmt=...)       the functional layer both modules below call
    QuantizedLinear                           Flax NNX, a stand-in for nnx.Linear
    QuantizedDense                            Flax Linen, a stand-in for linen.Dense
    quantize_params(params, fmt)              float kernels (in, out) -> BlockScaled (out, in)
    from_quantized_params(model, qparams)     NNX: swap nnx.Linear layers for QuantizedLinear
    quantize_model(model, fmt)                NNX: both of the above in one call

Activations are quantized on every call when ``act_fmt`` is set (NVFP4 activations calibrate
their global scale on the whole batch, per call, or take a given one: ``act_global_scale``, a
W4A4 checkpoint's ``input_scale``), or passed through as bf16/f16/f32 (weight-only mode) when
``act_fmt=None``.
"""
from __future__ import annotations

import functools
import math
import re
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from ..core.formats import OUT_DTYPES, can_multiply, get_format, supported_pairs
from ..core.quantize import BlockScaled, check_global_scale, to_blocked
from ..dense.api import gemm
from ..quantization.api import quantize

try:
    from flax import linen
    from flax import nnx
except ImportError as e:  # pragma: no cover - exercised only without flax installed
    raise ImportError("jax_blockscale.nn needs Flax: pip install 'jax_blockscale[flax]' "
                      "(or pip install flax)") from e

__all__ = ["QuantizedDense", "QuantizedLinear", "QuantizedWeight", "default_filter", "dense",
           "from_quantized_params", "quantize_kernel", "quantize_model", "quantize_params"]

# quantize_params shows a progress bar (when tqdm is installed) from this many kernels up.
PROGRESS_MIN_KERNELS = 16


# ---------------------------------------------------------------------------------------------
# The functional layer


def quantize_kernel(kernel, fmt: str, *, global_scale: Any = "auto") -> BlockScaled:
    """A Flax kernel (in, out) -> a BlockScaled weight (out, in), blocked scales, ready for gemm."""
    kernel = jnp.asarray(kernel)
    if kernel.ndim != 2:
        raise ValueError(f"a Dense kernel must be 2-D (in, out), got shape {kernel.shape}")
    block = get_format(fmt).block
    if kernel.shape[0] % block:
        raise ValueError(f"the kernel's in-dim {kernel.shape[0]} is not a multiple of the {fmt} "
                         f"block size {block}; it cannot be quantized along K")
    if isinstance(global_scale, str) or global_scale is None:  # hashable: jit it once per shape
        return _quantize_kernel_jit(kernel, fmt, global_scale)
    return quantize(kernel.T, fmt, global_scale=global_scale, layout="blocked")


@functools.partial(jax.jit, static_argnums=(1, 2))
def _quantize_kernel_jit(kernel, fmt, global_scale):
    return quantize(kernel.T, fmt, global_scale=global_scale, layout="blocked")


def dense(x, kernel: BlockScaled, bias=None, *, act_fmt: str | None = None, dtype=None,
          backend: str | None = None, act_global_scale=None) -> jax.Array:
    """``y = x @ W.T + bias`` for a quantized weight W (out, in); x is (..., in).

    act_fmt: quantize x into this format on every call, or None for weight-only mode (x goes in
      as a plain bf16/f16/f32 array, cast to `dtype` when that is given).
    act_global_scale: with act_fmt="nvfp4", x's decode factor (an f32 scalar, e.g. a W4A4
      checkpoint's input_scale) instead of one calibrated per call (`gemm`'s a_global_scale).
    dtype: the output (and, weight-only, the activation) dtype; None keeps x's dtype.
    """
    if not isinstance(kernel, BlockScaled):
        raise TypeError(f"kernel must be a jbs.BlockScaled (out, in), got {type(kernel).__name__}; "
                        "convert float parameters with jax_blockscale.nn.quantize_params")
    if kernel.ndim != 2:
        raise ValueError(f"kernel must be 2-D (out, in), got shape {kernel.shape}")
    x = jnp.asarray(x)
    n, k = kernel.shape
    if x.ndim < 1 or x.shape[-1] != k:
        raise ValueError(f"the input's last axis must be the layer's in_features={k}, "
                         f"got input shape {x.shape}")
    out_dtype = np.dtype(dtype if dtype is not None else x.dtype)
    if out_dtype not in OUT_DTYPES:
        raise TypeError(f"output dtype {out_dtype.name} is not one gemm produces "
                        f"({[d.name for d in OUT_DTYPES]}); pass dtype=")
    if not can_multiply(act_fmt, kernel.fmt):
        raise ValueError(f"activations in {act_fmt} cannot multiply a {kernel.fmt} weight; "
                         f"supported pairs: {supported_pairs()}, or act_fmt=None (weight-only)")
    lead = x.shape[:-1]
    x2 = x.reshape(math.prod(lead), k)  # gemm takes (M, K); fold every leading axis into M
    # with act_fmt, gemm quantizes x2 itself: gemm(quantize(x2, act_fmt), kernel), in the GEMM's
    # call where the kernel can (docs/design/quantized_activation.md)
    a = x2 if act_fmt is not None else x2.astype(out_dtype)
    if act_global_scale is not None and jnp.ndim(act_global_scale) != 0:
        raise ValueError(f"act_global_scale must be one decode factor (a scalar), got shape "
                         f"{jnp.shape(act_global_scale)}")
    y = gemm(a, kernel, out_dtype=out_dtype, backend=backend, quantize_a=act_fmt,
             a_global_scale=act_global_scale)
    if bias is not None:
        y = y + jnp.asarray(bias).astype(out_dtype)
    return y.reshape(*lead, n)


# ---------------------------------------------------------------------------------------------
# Flax NNX


class QuantizedWeight(nnx.Variable):
    """An NNX variable holding a `BlockScaled` weight.

    Not an ``nnx.Param``: ``nnx.state(model, nnx.Param)`` and optimizers built on it leave the
    quantized weights alone (gemm does not differentiate through quantized operands anyway).
    """


class ActivationScale(nnx.Variable):
    """An NNX variable holding an NVFP4 activation's given decode factor (an f32 scalar: static
    W4A4). Not an ``nnx.Param``: optimizers leave it alone."""


def _check_act_global_scale(act_global_scale, act_fmt):
    """A layer's static activation scale: None, or a finite positive scalar with act_fmt
    "nvfp4" (MX formats have no global scale). Raised at construction, naming the argument."""
    if act_global_scale is None:
        return None
    if act_fmt != "nvfp4":
        raise ValueError(f"act_global_scale is an NVFP4 activation's decode factor; it needs "
                         f"act_fmt='nvfp4', got act_fmt={act_fmt!r}")
    check_global_scale(act_global_scale, (), "act_global_scale")  # one finite decode factor > 0
    return jnp.asarray(act_global_scale, jnp.float32)


class QuantizedLinear(nnx.Module):
    """A stand-in for ``nnx.Linear`` with a block-scaled weight.

    QuantizedLinear(in_features, out_features, fmt="nvfp4", rngs=nnx.Rngs(0)) initializes a
    float kernel like nnx.Linear does and quantizes it; pass ``kernel=`` to use a given one:
    a float (in, out) array (nnx.Linear's layout, quantized here into `fmt`) or a BlockScaled
    (out, in) (e.g. from `quantize_params`; ``fmt=None`` takes its format, a different `fmt`
    is an error). ``act_global_scale`` (with ``act_fmt="nvfp4"``): the activation's given
    decode factor (static W4A4, e.g. a checkpoint's ``input_scale``) instead of one calibrated
    per call. Attributes: ``kernel`` (a QuantizedWeight holding a BlockScaled (out, in), blocked
    scales), ``bias`` (an nnx.Param, or None) and ``act_global_scale`` (an ActivationScale, or
    None; assignable on a built layer).
    """

    def __init__(self, in_features: int, out_features: int, *, fmt: str | None = None,
                 act_fmt: str | None = None, use_bias: bool = True, dtype=None,
                 param_dtype=jnp.float32, kernel=None, bias=None,
                 kernel_init: Callable = nnx.initializers.lecun_normal(),
                 bias_init: Callable = nnx.initializers.zeros_init(),
                 global_scale: Any = "auto", backend: str | None = None,
                 act_global_scale=None, rngs: nnx.Rngs | None = None):
        act_g = _check_act_global_scale(act_global_scale, act_fmt)
        if kernel is None:
            if rngs is None:
                raise ValueError("QuantizedLinear needs rngs= to initialize a kernel, or kernel=")
            kernel = kernel_init(rngs.params(), (in_features, out_features), param_dtype)
        if isinstance(kernel, BlockScaled):
            if fmt is not None and kernel.fmt != fmt:
                raise ValueError(f"the given kernel is {kernel.fmt}, but fmt={fmt!r}")
            q = to_blocked(kernel)
        elif fmt is None:
            raise ValueError("QuantizedLinear needs fmt= to quantize a float kernel")
        else:
            q = quantize_kernel(kernel, fmt, global_scale=global_scale)
        if q.shape != (out_features, in_features):
            raise ValueError(f"the quantized kernel has shape {q.shape}; a layer "
                             f"{in_features} -> {out_features} needs (out, in) = "
                             f"{(out_features, in_features)}")
        if bias is None and use_bias:
            if rngs is None:
                raise ValueError("QuantizedLinear needs rngs= to initialize a bias, or bias=")
            bias = bias_init(rngs.params(), (out_features,), param_dtype)
        if bias is not None and tuple(jnp.shape(bias)) != (out_features,):
            raise ValueError(f"bias has shape {jnp.shape(bias)}, expected ({out_features},)")
        if not can_multiply(act_fmt, q.fmt):  # fail at construction, not on the first call
            raise ValueError(f"activations in {act_fmt} cannot multiply a {q.fmt} weight; "
                             f"supported pairs: {supported_pairs()}, or act_fmt=None")
        self.in_features = in_features
        self.out_features = out_features
        self.fmt = q.fmt
        self.act_fmt = act_fmt
        self.dtype = dtype
        self.backend = backend
        self.kernel = QuantizedWeight(q)
        self.bias = nnx.Param(jnp.asarray(bias)) if bias is not None else None
        # data either way, so that a scale calibrated later can be set on a built layer:
        # layer.act_global_scale = ActivationScale(g)
        self.act_global_scale = nnx.data(ActivationScale(act_g) if act_g is not None else None)

    @classmethod
    def from_linear(cls, linear: nnx.Linear, fmt: str, *, act_fmt: str | None = None,
                    dtype=None, global_scale: Any = "auto", backend: str | None = None):
        """Quantize an ``nnx.Linear`` (its dtype carries over unless `dtype` is given)."""
        bias = linear.bias[...] if linear.bias is not None else None
        return cls(linear.in_features, linear.out_features, fmt=fmt, act_fmt=act_fmt,
                   dtype=dtype if dtype is not None else linear.dtype,
                   kernel=linear.kernel[...], bias=bias, global_scale=global_scale,
                   backend=backend)

    def __call__(self, x: jax.Array) -> jax.Array:
        bias = self.bias[...] if self.bias is not None else None
        act_g = self.act_global_scale[...] if self.act_global_scale is not None else None
        return dense(x, self.kernel.get_value(), bias, act_fmt=self.act_fmt, dtype=self.dtype,
                     backend=self.backend, act_global_scale=act_g)


# ---------------------------------------------------------------------------------------------
# Flax Linen


class QuantizedDense(linen.Module):
    """A stand-in for ``linen.Dense`` whose ``kernel`` parameter is a BlockScaled (out, in).

    Build the model with QuantizedDense where it had Dense (same names), then apply it to
    ``quantize_params(float_params, fmt)``; ``init`` creates a random quantized kernel in
    `fmt`. ``fmt=None`` (the default) accepts whatever format the given parameters hold; a
    format makes ``apply`` check it. ``act_global_scale`` (with ``act_fmt="nvfp4"``): the
    activation's given decode factor (static W4A4) instead of one calibrated per call.
    """
    features: int
    fmt: str | None = None
    act_fmt: str | None = None
    act_global_scale: Any = None
    use_bias: bool = True
    dtype: Any = None
    param_dtype: Any = jnp.float32
    kernel_init: Callable = linen.initializers.lecun_normal()
    bias_init: Callable = linen.initializers.zeros_init()
    backend: str | None = None

    @linen.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        k = jnp.shape(x)[-1]

        def init_kernel(key):
            if self.fmt is None:
                raise ValueError("QuantizedDense needs fmt= to initialize a kernel")
            return quantize_kernel(self.kernel_init(key, (k, self.features), self.param_dtype),
                                   self.fmt)

        if self.fmt is None and self.has_variable("params", "kernel"):
            kernel = self.get_variable("params", "kernel")  # any format: nothing to check against
        else:
            kernel = self.param("kernel", init_kernel)  # Linen checks the shapes against init's
        if not isinstance(kernel, BlockScaled):
            raise TypeError(f"QuantizedDense's kernel is a {type(kernel).__name__}, not a "
                            "BlockScaled; convert the float params with "
                            "jax_blockscale.nn.quantize_params first")
        if self.fmt is not None and kernel.fmt != self.fmt:
            raise ValueError(f"QuantizedDense expects a {self.fmt} kernel; the params hold "
                             f"{kernel.fmt} (set fmt=None to accept any)")
        bias = (self.param("bias", self.bias_init, (self.features,), self.param_dtype)
                if self.use_bias else None)
        act_g = _check_act_global_scale(self.act_global_scale, self.act_fmt)
        return dense(x, kernel, bias, act_fmt=self.act_fmt, dtype=self.dtype,
                     backend=self.backend, act_global_scale=act_g)


# ---------------------------------------------------------------------------------------------
# Converting parameters


def _pure_dict(tree):
    """An nnx.State as nested dicts (other pytrees unchanged)."""
    if isinstance(tree, nnx.State):
        return nnx.to_pure_dict(tree)
    return tree


def _key_name(key) -> str:
    for attr in ("key", "name", "idx"):  # DictKey, GetAttrKey, SequenceKey
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def path_name(path) -> str:
    """A key path as "layers/0/kernel" (what filters see)."""
    return "/".join(_key_name(k) for k in path)


def default_filter(fmt: str) -> Callable[[str, Any], bool]:
    """Select 2-D floating leaves named "kernel" whose in-dim is a multiple of fmt's block."""
    block = get_format(fmt).block

    def select(path: str, leaf) -> bool:
        return (path.rsplit("/", 1)[-1] == "kernel" and not isinstance(leaf, BlockScaled)
                and jnp.ndim(leaf) == 2 and jnp.issubdtype(jnp.result_type(leaf), jnp.floating)
                and jnp.shape(leaf)[0] % block == 0)

    return select


def _progress(items, total, enabled):
    if not enabled:
        return items
    try:
        from tqdm.auto import tqdm
    except ImportError:  # tqdm is optional: no bar, no message
        return items
    return tqdm(items, total=total, desc="quantize_params", unit="kernel")


def quantize_params(params, fmt: str, *, filter: Callable | str | None = None,
                    global_scale: Any = "auto", progress: bool | None = None):
    """Convert float Dense kernels in a parameter pytree into BlockScaled weights, once.

    params: a pytree of arrays: Linen ``variables["params"]``, a dict, or an NNX state
      (``nnx.state(model, nnx.Param)``, converted with ``nnx.to_pure_dict``; the result is a pure
      dict either way).
    filter: which leaves to convert. None: `default_filter` (2-D "kernel" leaves whose in-dim is
      a multiple of the block; others are left alone). A string: a regular expression searched in
      the path ("layers/0/kernel") of each leaf of 2 or more axes; every match must be
      convertible (else a ValueError names it). A callable ``filter(path: str, leaf) -> bool``.
    Each selected kernel (in, out) becomes ``quantize(kernel.T, fmt, layout="blocked")``, an
    (out, in) BlockScaled; every other leaf is returned as is. A selected kernel with leading
    axes, (..., in, out) (stacked layers under nnx.scan, experts), becomes (..., out, in) with
    one NVFP4 global scale per matrix (``global_scale="per_matrix"`` where `global_scale` is
    "auto"), so scan and vmap slice it layer by layer. progress: a tqdm bar (if tqdm is
    installed); None shows one from PROGRESS_MIN_KERNELS kernels up.
    """
    get_format(fmt)
    params = _pure_dict(params)
    strict = isinstance(filter, str)
    if filter is None:
        select = default_filter(fmt)
    elif strict:
        pattern = re.compile(filter)
        def select(path, leaf):
            return pattern.search(path) is not None and jnp.ndim(leaf) >= 2
    elif callable(filter):
        select = filter
    else:
        raise TypeError(f"filter must be None, a regular expression or a callable, got {filter!r}")

    leaves, treedef = jax.tree_util.tree_flatten_with_path(
        params, is_leaf=lambda x: isinstance(x, BlockScaled))
    chosen = [i for i, (path, leaf) in enumerate(leaves)
              if not isinstance(leaf, BlockScaled) and select(path_name(path), leaf)]
    out = [leaf for _, leaf in leaves]
    show = progress if progress is not None else len(chosen) >= PROGRESS_MIN_KERNELS
    for i in _progress(chosen, len(chosen), show):
        path, leaf = leaves[i]
        try:
            if jnp.ndim(leaf) > 2:  # stacked (..., in, out) kernels: one global scale each
                out[i] = _quantize_stacked_kernel(leaf, fmt, global_scale)
            else:
                out[i] = quantize_kernel(leaf, fmt, global_scale=global_scale)
        except ValueError as e:
            raise ValueError(f"cannot quantize {path_name(path)!r}: {e}") from None
    return jax.tree_util.tree_unflatten(treedef, out)


def _quantize_stacked_kernel(kernel, fmt: str, global_scale: Any) -> BlockScaled:
    """(..., in, out) float kernels -> a BlockScaled (..., out, in), blocked scales, with one
    NVFP4 global scale per matrix when `global_scale` is "auto"."""
    kernel = jnp.asarray(kernel)
    block = get_format(fmt).block
    if kernel.shape[-2] % block:
        raise ValueError(f"the kernel's in-dim {kernel.shape[-2]} is not a multiple of the {fmt} "
                         f"block size {block}; it cannot be quantized along K")
    if isinstance(global_scale, str) and global_scale == "auto":
        global_scale = "per_matrix"
    elif (global_scale is not None and not isinstance(global_scale, str)
          and get_format(fmt).has_global_scale):
        # a given decode factor, one copy per matrix, so that scan / vmap can slice it
        global_scale = jnp.broadcast_to(jnp.asarray(global_scale, jnp.float32), kernel.shape[:-2])
    return quantize(jnp.swapaxes(kernel, -1, -2), fmt, global_scale=global_scale,
                    layout="blocked")


def _get(tree, path):
    for key in path:
        if not isinstance(tree, dict) or key not in tree:
            return None
        tree = tree[key]
    return tree


def _by_attribute(node, key) -> bool:
    """Graph paths name module attributes (str) and container items (nnx.List/Dict, dicts)."""
    return isinstance(key, str) and not isinstance(node, (dict, nnx.Dict))


def _get_child(node, key):
    return getattr(node, key) if _by_attribute(node, key) else node[key]


def _set_child(node, key, value):
    if _by_attribute(node, key):
        setattr(node, key, value)
    else:
        node[key] = value


def _quantized_paths(tree, prefix=()):
    if isinstance(tree, BlockScaled):
        yield prefix
    elif isinstance(tree, dict):
        for k, v in tree.items():
            yield from _quantized_paths(v, prefix + (k,))


def from_quantized_params(model: nnx.Module, qparams, *, act_fmt: str | None = None, dtype=None,
                          backend: str | None = None) -> nnx.Module:
    """Load `qparams` (from `quantize_params` or `load_params`) into an NNX model, in place.

    Every ``nnx.Linear`` whose kernel is a BlockScaled in `qparams` is replaced by a
    QuantizedLinear holding it (act_fmt, dtype and backend as given; dtype None keeps the
    Linear's); every other parameter is set from `qparams`. `model` may be abstract
    (``nnx.eval_shape(lambda: MyModel(...))``), so a float copy is never allocated. Returns the
    model; pass ``nnx.clone(model)`` to keep the float one.
    """
    qparams = _pure_dict(qparams)
    # Exactly nnx.Linear: a subclass may change what __call__ does, which a swap would drop.
    linears = {path: node for path, node in nnx.iter_graph(model) if type(node) is nnx.Linear}
    for path in _quantized_paths(qparams):
        layer_path = path[:-1]
        if path[-1] != "kernel" or layer_path not in linears:
            raise ValueError(f"qparams holds a quantized weight at {'/'.join(map(str, path))!r} "
                             "but the model has no nnx.Linear there whose kernel it could be "
                             "(subclasses of nnx.Linear are not replaced)")
    for layer_path, linear in linears.items():
        q = _get(qparams, layer_path + ("kernel",))
        if not isinstance(q, BlockScaled):
            continue
        name = "/".join(map(str, layer_path))
        if q.shape != (linear.out_features, linear.in_features):
            raise ValueError(f"{name}: the quantized kernel has shape {q.shape}, but the layer "
                             f"is {linear.in_features} -> {linear.out_features} (expected (out, "
                             f"in) = {(linear.out_features, linear.in_features)})")
        has_bias = linear.bias is not None
        bias = _get(qparams, layer_path + ("bias",)) if has_bias else None
        if has_bias and bias is None:
            raise ValueError(f"{name}: the layer has a bias but qparams holds none")
        new = QuantizedLinear(linear.in_features, linear.out_features, fmt=None, act_fmt=act_fmt,
                              use_bias=has_bias, dtype=dtype if dtype is not None else linear.dtype,
                              kernel=q, bias=bias, backend=backend)
        if not layer_path:
            raise ValueError("the model itself is an nnx.Linear; use QuantizedLinear.from_linear")
        parent = functools.reduce(_get_child, layer_path[:-1], model)
        _set_child(parent, layer_path[-1], new)
    state = nnx.state(model, (nnx.Param, QuantizedWeight))
    nnx.replace_by_pure_dict(state, qparams)
    nnx.update(model, state)
    return model


def quantize_model(model: nnx.Module, fmt: str, *, act_fmt: str | None = None,
                   filter: Callable | str | None = None, dtype=None, backend: str | None = None,
                   progress: bool | None = None) -> nnx.Module:
    """Quantize an NNX model's Linear layers in place: `quantize_params` on its nnx.Param state,
    then `from_quantized_params`. Returns the model (use ``nnx.clone`` first to keep a float copy).
    """
    qparams = quantize_params(nnx.state(model, nnx.Param), fmt, filter=filter, progress=progress)
    return from_quantized_params(model, qparams, act_fmt=act_fmt, dtype=dtype, backend=backend)
