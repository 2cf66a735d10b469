"""A mixture-of-experts feed-forward layer (Flax NNX) whose experts are block-scaled, on
`jax_blockscale.ragged_gemm`.

    MoE                      the float layer (router, SwiGLU experts) with lax.ragged_dot: train
                             or load it, and the reference the quantized layer is checked against
    QuantizedMoE             the same layer with block-scaled experts (NVFP4 with one global
                             scale per expert, MXFP4, MXFP6, MXFP8); ``QuantizedMoE.from_float``
    quantize_experts(w, fmt) float experts (E, in, out) -> BlockScaled (E, out, in), once
    quantize_moe_params      a parameter pytree's "gate_up" / "down" leaves -> BlockScaled
    expert_shardings(state, mesh, gate_up=, down=)  NamedShardings placing a layer's state
    route(x, router, top_k)  top-k routing: expert ids, combine weights, the token sort
    top_k_experts(x, router, top_k)  the routing itself: expert ids and combine weights
    router_logits(x, router) the router's f32 logits (exact products, f32 sums)
    swiglu(h)                the SwiGLU of a fused gate+up output (gate columns, then up), f32

The forward pass (both layers): router logits in f32, the top-k experts per token with softmax
weights over the chosen k (renormalized, as Qwen3-MoE and gpt-oss do); the T*k (token, expert)
pairs sorted by expert (stable), the group sizes counted; ``ragged_gemm`` gate+up (one fused
weight, N = 2 * intermediate: gate rows first, then up), SwiGLU ``silu(gate) * up``,
``ragged_gemm`` down; then the pairs are put back in token order and each token's k outputs
summed with their weights (`jax_blockscale.ragged.dispatch.combine`: in f32, slot by slot).

Placements on a mesh (docs/sharding.md): QuantizedMoE runs unchanged under `jax.jit` with its
expert weights placed on a mesh (expert parallel by replicating rows and all-reducing, tensor
parallel, Megatron: the grouped GEMM's sharding rule). ``QuantizedMoE(..., mesh=mesh,
expert_axis="expert")`` instead dispatches tokens: each device takes its share of the tokens
and sends each (token, expert) row only to the device holding that expert
(`jax_blockscale.ragged.dispatch`); ``QuantizedMoE(..., mesh=mesh, tensor_axis="model")`` splits
every expert's intermediate features over the axis, gate and up paired on each device, and sums
the devices' combined outputs once (`jax_blockscale.ragged.tensor_parallel`).

Weights are stored the way ragged_gemm reads them: expert e's weight K-major, (out, in), with
blocked scales, so no call transposes or swizzles a weight. This module needs Flax.
"""
from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

from ..core.formats import OUT_DTYPES, can_multiply, get_format, supported_pairs
from ..core.quantize import BlockScaled, to_blocked
from ..core.placement import blockscaled_shardings
from ..quantization.api import quantize
from ..ragged.api import ragged_gemm
from ..ragged.dispatch import EXCHANGES, combine, dispatch_moe, expert_order
from ..ragged.primitive import unsort_rows
from ..ragged.tensor_parallel import split_intermediate, tensor_parallel_moe

try:
    from flax import nnx
except ImportError as e:  # pragma: no cover - exercised only without flax installed
    raise ImportError("jax_blockscale.nn needs Flax: pip install 'jax_blockscale[flax]'") \
        from e

from .dense import QuantizedWeight, _key_name  # noqa: E402  (after the Flax check)

__all__ = ["MoE", "QuantizedMoE", "expert_shardings", "quantize_experts", "quantize_moe_params",
           "route", "router_logits", "top_k_experts"]

EXPERT_PARAMS = ("gate_up", "down")  # the leaves quantize_moe_params converts


# ---------------------------------------------------------------------------------------------
# Routing (shared by both layers)


# router_logits: from this many tokens, bf16 tokens against an f32 router take the split-router
# dot (below); fewer take the f32 dot, whose cost grows with the tokens but whose fixed cost is
# lower than splitting the router on every call.
ROUTER_SPLIT_MIN_TOKENS = 512


def router_logits(x, router):
    """The router's f32 logits (T, E) of tokens x (T, H) under router weights (H, E): every
    product exact, the sums in f32.

    Many bf16 tokens (ROUTER_SPLIT_MIN_TOKENS and more) take one bf16 tensor-core dot with f32
    accumulation against the f32 router split into three bf16 parts (hi + mid + lo == router
    exactly: 3 x 8 significant bits hold f32's 24), the three partial logits added smallest
    first: an f32 GEMM runs on the CUDA cores, and at thousands of tokens takes several times
    as long. Fewer tokens, and other token dtypes, take the f32 dot at HIGHEST precision; a
    bf16 router, one bf16 dot."""
    if x.dtype == jnp.bfloat16 and router.dtype == jnp.bfloat16:
        return jnp.dot(x, router, preferred_element_type=jnp.float32)
    r = router.astype(jnp.float32)
    tokens = int(np.prod(x.shape[:-1]))
    if x.dtype != jnp.bfloat16 or tokens < ROUTER_SPLIT_MIN_TOKENS:
        return jnp.dot(x.astype(jnp.float32), r, precision=lax.Precision.HIGHEST)
    hi = r.astype(jnp.bfloat16)
    rest = r - hi.astype(jnp.float32)  # exact
    mid = rest.astype(jnp.bfloat16)
    lo = (rest - mid.astype(jnp.float32)).astype(jnp.bfloat16)  # exact: <= 8 bits are left
    e = r.shape[-1]
    y = jnp.dot(x, jnp.concatenate([hi, mid, lo], axis=-1), preferred_element_type=jnp.float32)
    return (y[..., 2 * e:] + y[..., e:2 * e]) + y[..., :e]


def top_k_experts(x, router, top_k: int):
    """The top-k experts of tokens x (T, H) under router weights (H, E): (experts (T, k) int32,
    weights (T, k) f32, the softmax of the chosen logits: they sum to 1 per token)."""
    top_logits, experts = lax.top_k(router_logits(x, router), top_k)  # (T, k)
    return experts.astype(jnp.int32), jax.nn.softmax(top_logits, axis=-1)


def route(x, router, top_k: int):
    """Top-k routing of tokens x (T, H) with router weights (H, E).

    Returns (order, group_sizes, weights): `order` (T*k,) sorts the flattened (token, slot)
    pairs by expert (pair p is token p // k), `group_sizes` (E,) int32 counts the pairs per
    expert, `weights` (T, k) f32 are the softmax of the chosen logits (they sum to 1 per token).
    """
    experts, weights = top_k_experts(x, router, top_k)
    flat = experts.reshape(-1)
    order, group_sizes = expert_order(flat.astype(jnp.int32), router.shape[-1])
    return order, group_sizes, weights


def _moe_forward(x, router, top_k, expert_mlp):
    """Route, sort, run `expert_mlp(rows (T*k, H) sorted by expert, group_sizes)`, unsort and
    combine. x: (..., H)."""
    lead, h = x.shape[:-1], x.shape[-1]
    xt = x.reshape(-1, h)
    order, group_sizes, weights = route(xt, router, top_k)
    rows = xt[order // top_k]  # (T*k, H): the token of each sorted pair
    out = expert_mlp(rows, group_sizes)  # (T*k, H), sorted
    unsorted = unsort_rows(out, order)  # back to (token, slot) order
    y = combine(unsorted.reshape(xt.shape[0], top_k, -1), weights)
    return y.astype(x.dtype).reshape(*lead, -1)


def swiglu(h):
    """silu(gate) * up in f32, for h (..., 2 * intermediate): gate columns, then up columns."""
    gate, up = jnp.split(h, 2, axis=-1)
    return jax.nn.silu(gate.astype(jnp.float32)) * up.astype(jnp.float32)


# ---------------------------------------------------------------------------------------------
# The float layer


class MoE(nnx.Module):
    """A float mixture-of-experts SwiGLU feed-forward layer (lax.ragged_dot experts).

    Params: ``router`` (hidden, experts), ``gate_up`` (experts, hidden, 2 * intermediate) (gate
    columns first, then up), ``down`` (experts, intermediate, hidden): (in, out) per expert, as
    nnx.Linear kernels. Computes in `dtype` (activations and weights cast), accumulates in f32.
    """

    def __init__(self, hidden: int, intermediate: int, experts: int, top_k: int, *,
                 dtype=jnp.bfloat16, param_dtype=jnp.float32,
                 kernel_init: Callable = nnx.initializers.lecun_normal(), rngs: nnx.Rngs):
        if not 1 <= top_k <= experts:
            raise ValueError(f"top_k={top_k} must be between 1 and experts={experts}")
        key = rngs.params
        init = lambda shape: kernel_init(key(), shape, param_dtype)
        self.router = nnx.Param(init((hidden, experts)))
        # lecun_normal on a 3-D shape treats the expert axis as a receptive field: init each
        # expert as its own (in, out) matrix instead
        self.gate_up = nnx.Param(jnp.stack([init((hidden, 2 * intermediate))
                                            for _ in range(experts)]))
        self.down = nnx.Param(jnp.stack([init((intermediate, hidden)) for _ in range(experts)]))
        self.top_k = top_k
        self.dtype = dtype

    def __call__(self, x):
        dt = self.dtype

        def experts(rows, gs):
            h = lax.ragged_dot(rows.astype(dt), self.gate_up[...].astype(dt), gs,
                               preferred_element_type=jnp.float32)
            a = swiglu(h).astype(dt)
            return lax.ragged_dot(a, self.down[...].astype(dt), gs,
                                  preferred_element_type=jnp.float32)

        return _moe_forward(x.astype(dt), self.router[...], self.top_k, experts)


# ---------------------------------------------------------------------------------------------
# Quantizing experts


def quantize_experts(w, fmt: str, *, global_scale: Any = "auto") -> BlockScaled:
    """Float experts (E, in, out) -> a BlockScaled (E, out, in) with blocked scales, ready for
    `ragged_gemm`. NVFP4 gets one global scale per expert (``global_scale="per_matrix"``) when
    `global_scale` is "auto"; None drops the tier; MX formats have none."""
    w = jnp.asarray(w)
    if w.ndim != 3:
        raise ValueError(f"experts must be a 3-D (experts, in, out) array, got shape {w.shape}")
    f = get_format(fmt)
    if w.shape[1] % f.block:
        raise ValueError(f"the experts' in-dim {w.shape[1]} is not a multiple of the {fmt} block "
                         f"size {f.block}; it cannot be quantized along K")
    if f.has_global_scale and isinstance(global_scale, str) and global_scale == "auto":
        global_scale = "per_matrix"
    if not f.has_global_scale and global_scale == "auto":
        global_scale = None
    if global_scale is None or isinstance(global_scale, str):  # hashable: jit once per shape
        return _quantize_experts_jit(w, fmt, global_scale)
    return quantize(jnp.swapaxes(w, 1, 2), fmt, global_scale=global_scale, layout="blocked")


@functools.partial(jax.jit, static_argnames=("fmt", "global_scale"))
def _quantize_experts_jit(w, fmt, global_scale):
    return quantize(jnp.swapaxes(w, 1, 2), fmt, global_scale=global_scale, layout="blocked")


def quantize_moe_params(params, fmt: str, *, names=EXPERT_PARAMS):
    """Convert the float expert weights of a parameter pytree (an ``nnx.State`` or nested dicts)
    into BlockScaled weights, once: every 3-D floating leaf whose last path component is in
    `names` ("gate_up", "down") becomes ``quantize_experts(leaf, fmt)`` (E, out, in). Other
    leaves (the router) are returned as they are. Returns a pure dict."""
    get_format(fmt)
    if isinstance(params, nnx.State):
        params = nnx.to_pure_dict(params)

    def convert(path, leaf):
        if (path and _key_name(path[-1]) in names and not isinstance(leaf, BlockScaled)
                and jnp.ndim(leaf) == 3):
            return quantize_experts(leaf, fmt)
        return leaf

    return jax.tree_util.tree_map_with_path(convert, params,
                                            is_leaf=lambda x: isinstance(x, BlockScaled))


def expert_shardings(state, mesh, *, gate_up, down):
    """NamedShardings for a QuantizedMoE's state (``nnx.state(layer)``, or any pytree whose
    expert weights sit under "gate_up" / "down" keys), for ``jax.device_put(state, ...)``.

    gate_up, down: PartitionSpecs of the logical expert weights (E, out, in), e.g.
    ``P("expert")`` (expert parallel: what ``QuantizedMoE(mesh=, expert_axis="expert")``
    expects) or ``P(None, "model")`` (split on out). Each BlockScaled weight's arrays follow its
    spec as `jax_blockscale.interop.blockscaled_shardings` maps it (elements as given; scales
    on their row and K-block tiles; per-expert global scales on the expert axis); every other
    leaf (the router) is replicated."""
    specs = {"gate_up": gate_up, "down": down}
    replicated = NamedSharding(mesh, P())

    def place(path, leaf):
        spec = specs.get(_key_name(path[0])) if path else None
        if isinstance(leaf, BlockScaled) and spec is not None:
            return blockscaled_shardings(NamedSharding(mesh, spec), leaf)
        if spec is not None:
            raise TypeError(f"{_key_name(path[0])} holds a {type(leaf).__name__}, not a "
                            "BlockScaled: pass a QuantizedMoE's state")
        return replicated

    return jax.tree_util.tree_map_with_path(place, state,
                                            is_leaf=lambda x: isinstance(x, BlockScaled))


# ---------------------------------------------------------------------------------------------
# The quantized layer


class QuantizedMoE(nnx.Module):
    """A mixture-of-experts SwiGLU layer with block-scaled experts (``ragged_gemm``).

    QuantizedMoE(hidden, intermediate, experts, top_k, fmt="nvfp4", rngs=nnx.Rngs(0)) initializes
    float weights like `MoE` and quantizes the experts; ``QuantizedMoE.from_float(moe, fmt)``
    quantizes a trained `MoE`; ``QuantizedMoE.from_params(qparams, top_k)`` takes the output of
    `quantize_moe_params`. Attributes: ``router`` (nnx.Param, float (hidden, experts)),
    ``gate_up`` (a QuantizedWeight: BlockScaled (experts, 2 * intermediate, hidden)), ``down``
    (BlockScaled (experts, hidden, intermediate)).

    act_fmt: quantize the sorted activations into this format on every call (NVFP4 activations
      calibrate one global scale per call), or None for weight-only (activations in `dtype`).
    dtype: activation and output dtype (bf16 default).
    mesh, expert_axis: expert parallelism that dispatches tokens (`jax_blockscale.ragged.
      dispatch`): the tokens are split over mesh axis `expert_axis`, each device holds
      experts/d of the experts (place gate_up and down split on their expert axis over it,
      ``P(expert_axis)``), and each routed (token, expert) row is sent only to the device that
      owns its expert and back. The output is split over the axis along the tokens
      (replicated with exchange="reduce"). Both or neither; mesh=None with expert_axis uses the
      mesh set by ``jax.set_mesh``. Without them the layer runs as placed (under jit, the
      grouped GEMM's sharding rule).
    tensor_axis: with mesh=, tensor parallelism over that mesh axis instead
      (`jax_blockscale.ragged.tensor_parallel`): every device holds about I/d (whole blocks of the
      format) of every expert's intermediate features (gate and up rows, and down's columns) and
      runs every routed row through them; the devices' combined outputs are summed once per layer
      (f32), coming out replicated. The layer stores its experts re-laid for it
      (`split_intermediate`: gate_up (E, d x 2 Ip, H), down (E, H, d x Ip)); place them with
      ``expert_shardings(state, mesh, gate_up=P(None, tensor_axis), down=P(None, None,
      tensor_axis))``. The output equals the one-device layer's to the bf16 rounding of each
      expert's output rows (down's partial sums stay f32 until the combine).
    exchange: with expert_axis, how rows cross devices: "auto" (ragged_all_to_all on GPUs, a
      padded all_to_all elsewhere), "ragged" or "padded"; or "reduce": no token moves, every
      device runs its own experts' rows of all tokens and the combined outputs are summed across
      devices in f32, coming out replicated (equal to one device's to f32 rounding; the fewest
      bytes when the input is replicated anyway, as after tensor-parallel attention).
    """

    def __init__(self, hidden: int, intermediate: int, experts: int, top_k: int, *,
                 fmt: str | None = "nvfp4", act_fmt: str | None = None, dtype=jnp.bfloat16,
                 router=None, gate_up=None, down=None, backend: str | None = None,
                 mesh=None, expert_axis: str | None = None, exchange: str = "auto",
                 tensor_axis: str | None = None, rngs: nnx.Rngs | None = None):
        _check_parallel(mesh, expert_axis, exchange, tensor_axis, experts)
        if gate_up is None or down is None or router is None:
            if rngs is None:
                raise ValueError("QuantizedMoE needs rngs= to initialize weights, or router=, "
                                 "gate_up= and down=")
            if fmt is None:
                raise ValueError("QuantizedMoE needs fmt= to quantize initialized weights")
            float_moe = MoE(hidden, intermediate, experts, top_k, rngs=rngs)
            router = float_moe.router[...] if router is None else router
            gate_up = float_moe.gate_up[...] if gate_up is None else gate_up
            down = float_moe.down[...] if down is None else down
        gate_up = self._expert_weight("gate_up", gate_up, fmt, (experts, 2 * intermediate, hidden))
        down = self._expert_weight("down", down, fmt, (experts, hidden, intermediate))
        if gate_up.fmt != down.fmt:
            raise ValueError(f"gate_up is {gate_up.fmt} but down is {down.fmt}")
        if tuple(jnp.shape(router)) != (hidden, experts):
            raise ValueError(f"router has shape {jnp.shape(router)}, expected (hidden, experts) "
                             f"= {(hidden, experts)}")
        if not 1 <= top_k <= experts:
            raise ValueError(f"top_k={top_k} must be between 1 and experts={experts}")
        if not can_multiply(act_fmt, gate_up.fmt):
            raise ValueError(f"activations in {act_fmt} cannot multiply {gate_up.fmt} experts; "
                             f"supported pairs: {supported_pairs()}, or act_fmt=None")
        if np.dtype(dtype) not in OUT_DTYPES:
            raise TypeError(f"dtype must be one of {[d.name for d in OUT_DTYPES]}")
        self.hidden, self.intermediate, self.experts, self.top_k = (hidden, intermediate,
                                                                    experts, top_k)
        self.fmt = gate_up.fmt
        self.act_fmt = act_fmt
        self.dtype = dtype
        self.backend = backend
        self.mesh, self.expert_axis, self.exchange = mesh, expert_axis, exchange
        self.tensor_axis = tensor_axis
        if tensor_axis is not None:  # re-laid once for the devices of the axis
            gate_up, down = split_intermediate(gate_up, down, mesh.shape[tensor_axis])
        self.router = nnx.Param(jnp.asarray(router))
        self.gate_up = QuantizedWeight(gate_up)
        self.down = QuantizedWeight(down)

    @staticmethod
    def _expert_weight(name, w, fmt, want_shape):
        """A float (E, in, out) weight quantized, or a given BlockScaled (E, out, in) checked."""
        if isinstance(w, BlockScaled):
            if fmt is not None and w.fmt != fmt:
                raise ValueError(f"the given {name} is {w.fmt}, but fmt={fmt!r}")
            q = to_blocked(w)
        else:
            if fmt is None:
                raise ValueError(f"QuantizedMoE needs fmt= to quantize a float {name}")
            q = quantize_experts(w, fmt)
        if q.shape != want_shape:
            raise ValueError(f"{name} has shape {q.shape} (experts, out, in); this layer needs "
                             f"{want_shape}")
        return q

    @classmethod
    def from_float(cls, moe: MoE, fmt: str, *, act_fmt: str | None = None, dtype=None,
                   backend: str | None = None, **placement) -> "QuantizedMoE":
        """Quantize a float `MoE`'s experts (its dtype carries over unless `dtype` is given).
        placement: mesh=, expert_axis=, exchange=, tensor_axis= as for the constructor."""
        experts, hidden, two_i = moe.gate_up.shape
        return cls(hidden, two_i // 2, experts, moe.top_k, fmt=fmt, act_fmt=act_fmt,
                   dtype=dtype if dtype is not None else moe.dtype, router=moe.router[...],
                   gate_up=moe.gate_up[...], down=moe.down[...], backend=backend, **placement)

    @classmethod
    def from_params(cls, qparams, top_k: int, *, act_fmt: str | None = None,
                    dtype=jnp.bfloat16, backend: str | None = None,
                    **placement) -> "QuantizedMoE":
        """Build from ``{"router": (H, E), "gate_up": BlockScaled, "down": BlockScaled}`` (what
        `quantize_moe_params` returns for a `MoE`'s parameters). placement: mesh=,
        expert_axis=, exchange=, tensor_axis= as for the constructor."""
        gate_up, down, router = qparams["gate_up"], qparams["down"], qparams["router"]
        for name, w in (("gate_up", gate_up), ("down", down)):
            if not isinstance(w, BlockScaled):
                raise TypeError(f"qparams[{name!r}] is a {type(w).__name__}, not a BlockScaled; "
                                "convert the float params with quantize_moe_params first")
        experts, two_i, hidden = gate_up.shape
        return cls(hidden, two_i // 2, experts, top_k, fmt=None, act_fmt=act_fmt, dtype=dtype,
                   router=router, gate_up=gate_up, down=down, backend=backend, **placement)

    def __call__(self, x, *, layer=None):
        """x (..., hidden) -> (..., hidden) in `dtype`.

        layer: for a layer that holds every layer's weights stacked (router (L, hidden, E),
          experts (L, E, out, in): a scanned model's layer), the index of the layer to run, a
          traced int32 scalar. The experts are then read in place: the stack is viewed as L * E
          experts and only layer `layer`'s get rows, so no layer's experts are sliced out of the
          stack (inside `lax.scan`, XLA copies a sliced FP4 operand; here every expert would be
          copied on every step).
        """
        x = jnp.asarray(x)
        if x.shape[-1] != self.hidden:
            raise ValueError(f"the input's last axis must be hidden={self.hidden}, got shape "
                             f"{x.shape}")
        dt = np.dtype(self.dtype)
        gate_up, down = self.gate_up.get_value(), self.down.get_value()
        router = self.router[...]
        if self.expert_axis is not None or self.tensor_axis is not None:
            return self._parallel(x.astype(dt), router, gate_up, down, layer)
        place = lambda gs: gs  # noqa: E731  (group sizes of the experts as stored)
        if layer is not None:
            if gate_up.ndim != 4 or down.ndim != 4 or jnp.ndim(router) != 3:
                raise ValueError("layer= needs stacked weights: router (L, hidden, experts) and "
                                 f"experts (L, E, out, in); got router {jnp.shape(router)}, "
                                 f"gate_up {gate_up.shape}, down {down.shape}")
            layers = gate_up.shape[0]
            router = lax.dynamic_index_in_dim(router, layer, 0, keepdims=False)
            gate_up, down = flatten_layers(gate_up), flatten_layers(down)
            place = functools.partial(layer_group_sizes, layer=layer, layers=layers)

        def activation(a):
            return quantize(a, self.act_fmt) if self.act_fmt is not None else a.astype(dt)

        def experts(rows, gs):
            gs = place(gs)
            h = ragged_gemm(activation(rows), gate_up, gs, out_dtype=dt, backend=self.backend)
            a = swiglu(h)
            return ragged_gemm(activation(a), down, gs, out_dtype=dt, backend=self.backend)

        return _moe_forward(x.astype(dt), router, self.top_k, experts)

    def _parallel(self, x, router, gate_up, down, layer):
        """The forward over the mesh: expert parallel (expert_axis=, `dispatch_moe`) or tensor
        parallel (tensor_axis=, `tensor_parallel_moe`)."""
        option = "expert_axis" if self.expert_axis is not None else "tensor_axis"
        if layer is not None:
            raise ValueError(f"layer= (stacked weights) is not supported with {option}=: build "
                             f"one QuantizedMoE per layer, or leave {option} unset")
        if option == "expert_axis":
            run = functools.partial(dispatch_moe, axis=self.expert_axis, exchange=self.exchange)
        else:
            run = functools.partial(tensor_parallel_moe, axis=self.tensor_axis,
                                    intermediate=self.intermediate)
        act = None if self.act_fmt is None else functools.partial(quantize, fmt=self.act_fmt)
        y = run(x.reshape(-1, self.hidden), router, gate_up, down,
                route=functools.partial(top_k_experts, top_k=self.top_k), activation=swiglu,
                mesh=self.mesh, quantize=act, dtype=self.dtype, backend=self.backend)
        return y.reshape(*x.shape[:-1], self.hidden)


def _check_parallel(mesh, expert_axis, exchange, tensor_axis, experts):
    """QuantizedMoE's mesh= / expert_axis= / exchange= / tensor_axis=, checked at
    construction."""
    if exchange not in EXCHANGES:
        raise ValueError(f"exchange must be one of {EXCHANGES}, got {exchange!r}")
    if tensor_axis is not None:
        if expert_axis is not None:
            raise ValueError("expert_axis= and tensor_axis= are both given: a QuantizedMoE is "
                             "expert parallel or tensor parallel, not both")
        if not isinstance(tensor_axis, str):
            raise TypeError(f"tensor_axis must be a mesh axis name (str), got {tensor_axis!r}")
        if mesh is None:
            raise ValueError("tensor_axis= needs mesh=: the experts are re-laid for the axis' "
                             "device count when the layer is built")
        if tensor_axis not in mesh.axis_names:
            raise ValueError(f"tensor_axis={tensor_axis!r} is not an axis of the mesh "
                             f"{dict(mesh.shape)}")
        return
    if mesh is not None and expert_axis is None:
        raise ValueError("mesh= is given without expert_axis= or tensor_axis=: name the mesh "
                         "axis the experts are split over (or leave out mesh= and place the "
                         "weights yourself)")
    if expert_axis is None:
        return
    if not isinstance(expert_axis, str):
        raise TypeError(f"expert_axis must be a mesh axis name (str), got {expert_axis!r}")
    if mesh is None:
        return  # the mesh set with jax.set_mesh, checked when called
    if expert_axis not in mesh.axis_names:
        raise ValueError(f"expert_axis={expert_axis!r} is not an axis of the mesh "
                         f"{dict(mesh.shape)}")
    if experts % mesh.shape[expert_axis]:
        raise ValueError(f"experts={experts} cannot be split evenly over mesh axis "
                         f"{expert_axis!r} of {mesh.shape[expert_axis]} devices")


def flatten_layers(w: BlockScaled) -> BlockScaled:
    """A stack of L layers' experts (L, E, out, in) as L * E experts (free reshapes; a global
    scale per layer and expert (L, E) becomes one per expert)."""
    lead = (w.shape[0] * w.shape[1],)
    gs = w.global_scale
    if gs is not None and jnp.ndim(gs) == 2:
        gs = jnp.reshape(gs, lead)
    return BlockScaled(w.data.reshape(lead + w.data.shape[2:]),
                       w.scales.reshape(lead + w.scales.shape[2:]), gs, w.fmt, w.layout)


def layer_group_sizes(group_sizes, *, layer, layers: int):
    """One layer's E group sizes placed among L * E (every other layer's experts get none)."""
    experts = group_sizes.shape[0]
    full = jnp.zeros((layers * experts,), group_sizes.dtype)
    return lax.dynamic_update_slice(full, group_sizes, (layer * experts,))
