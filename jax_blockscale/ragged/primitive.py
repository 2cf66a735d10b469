"""The primitives of the grouped (ragged) block-scaled GEMM, `ragged_gemm` (api.py), the
block-scaled counterpart of `jax.lax.ragged_dot` for mixtures of experts.

    y = jbs.ragged_gemm(lhs, rhs, group_sizes)     # lhs (M, K), rhs (G, N, K) -> y (M, N)

Rows of `lhs` are sorted by group: group g owns the next ``group_sizes[g]`` rows, and
``y[m] = lhs[m] @ rhs[g].T`` (times the global scales) for those rows; rows past
``sum(group_sizes)`` are zero. At run time (values are not known when tracing) a negative size
counts as 0 and a group running past row M is cut at M
(`lowering.ragged_reference.clamp_group_sizes`).

Two primitives, as for `gemm` (dense/primitive.py):
  * `ragged_gemm_p` is what `ragged_gemm` binds: shape rules, batching and differentiation;
    its lowering (sharding.py) wraps the local computation in `custom_partitioning`
    where an SPMD partitioner will split it, and is the local computation itself elsewhere.
  * `ragged_gemm_local_p` is the computation on one device. Its lowering (below) makes the
    group sizes safe, asks the planner for a ragged backend once (lowering/plan.py:
    select_ragged_backend), and
    lets it run. It takes one more operand, `row_start` (group 0's first row), which the
    expert-parallel rule sets per device.

Operands of `ragged_gemm_p`, in order: ``lhs, rhs, [lhs_scales], rhs_scales, group_sizes, alpha``
(``ragged_gemm_local_p``: the same, then ``row_start``).
  lhs          (M, K) quantized elements, or (weight-only, ``fmt_lhs=None``) a plain
               bf16/f16/f32 activation; then lhs_scales is absent.
  rhs          (G, N, K) quantized elements: expert g's weight, K-major like `gemm`'s b.
  *_scales     in `layout_lhs` / `layout_rhs` ("plain" or "blocked", layout.py); the blocked
               rhs scales keep G as a leading axis: (G, ceil(N/128), ceil(SK/4), 32, 4, 4).
  group_sizes  int32 (G,).
  alpha        f32 (G,): per group, the product of the global (decode) scales of lhs and rhs[g].
Params: fmt_lhs, fmt_rhs, layout_lhs, layout_rhs, out_dtype, backend, alpha_is_one (the caller
promises alpha is all ones), group_index; the local primitive adds `shifted` (row_start may be
nonzero) and `plan_shape` (a shard's unsharded (M, N, G), whose kernel choice it keeps).

Index mode (``group_index=True``, what ``jbs.gemm(x, w, layer=i)`` binds): the group_sizes
operand is an int32 scalar, the one group that owns every row (clamped to [0, G) by whoever
runs it): a dense GEMM against one matrix of a stack (a layer of a scanned model) that reads it
where it lies. A backend whose plan accepts it runs it in place (sm90: the layer target, which
runs gemm's plan on the layer it finds from an in-place probe, else the grouped decode kernel
with no work table; lowering/ragged_sm90.py); otherwise the lowering slices that matrix out and
runs gemm's plan for it (as `gemm`'s local primitive would).

Differentiation: as `gemm` (primitive.py): quantized operands are not differentiable (a nonzero
tangent reaching one raises); in weight-only mode the product is linear in lhs and in alpha,
and both differentiate. group_sizes is integer (no tangent).

Batching (vmap): when only lhs (plain or with plain scales) and group_sizes carry the mapped
axis, which is how a model vmaps over sequences that share experts, the rows of all examples
are merged, sorted by group and multiplied in ONE grouped call (every expert's weight is read
once, not once per example), then put back. Otherwise (mapped weights, mapped global scales,
blocked lhs scales) the examples run one after another (`lax.map`).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from ..core.formats import check_out_dtype
from ..core.quantize import check_operand_pair
from ..lowering.kernel_operands import element_bytes, take_layer
from ..lowering.plan import plan as plan_gemm
from ..lowering.plan import select_ragged_backend
from ..lowering.ragged_reference import (clamp_group_sizes, dequantized_rhs, index_group_sizes,
                                         method_for, ragged_matmul, row_groups)
from ..lowering.registry import ALL_PLATFORMS, get_backend, get_ragged_backend
from ..lowering.specs import GemmSpec, RaggedSpec

ragged_gemm_p = Primitive("blockscale_ragged_gemm")
ragged_gemm_local_p = Primitive("blockscale_ragged_gemm_local")


def split_operands(args, fmt_lhs):
    """(lhs, rhs, [sl], sr, gs, alpha, *rest) -> (lhs, rhs, sl_or_None, sr, gs, alpha, *rest)."""
    if fmt_lhs is None:
        lhs, rhs, sr, *rest = args
        return (lhs, rhs, None, sr, *rest)
    return tuple(args)


def join_operands(lhs, rhs, sl, sr, *rest):
    return (lhs, rhs, sr, *rest) if sl is None else (lhs, rhs, sl, sr, *rest)


# ---------------------------------------------------------------------------------------------
# Shape rules: every check raises at trace time with the argument named and the fix.


def ragged_spec(avals, *, fmt_lhs, fmt_rhs, layout_lhs, layout_rhs, out_dtype, backend=None,
                alpha_is_one=False, group_index=False, shifted=False, plan_shape=None,
                local=False) -> RaggedSpec:
    """Validate the operands' shapes and dtypes and describe the problem."""
    del backend
    lhs, rhs, sl, sr, gs, alpha, *rest = split_operands(avals, fmt_lhs)
    if fmt_rhs is None:
        raise TypeError("rhs must be quantized (a jbs.BlockScaled (G, N, K))")
    if lhs.ndim != 2:
        raise ValueError(f"lhs must have shape (M, K) (tokens sorted by group), got "
                         f"{tuple(lhs.shape)}; fold leading axes into M, or vmap")
    if rhs.ndim != 3:
        raise ValueError(f"rhs must have shape (G, N, K) (one weight per group), got "
                         f"{tuple(rhs.shape)}")
    check_operand_pair(("lhs", "rhs"), lhs, rhs, sl, sr, fmt_lhs, fmt_rhs, layout_lhs,
                       layout_rhs, plain_name="plain lhs")
    groups = rhs.shape[0]
    if group_index:
        if np.dtype(gs.dtype) != np.int32 or gs.shape != ():
            raise TypeError(f"the layer (group) index must be an int32 scalar, got "
                            f"{gs.dtype}{list(gs.shape)}")
        if shifted:
            raise ValueError("index mode has no row offset (shifted=True)")
    elif np.dtype(gs.dtype) != np.int32:
        raise TypeError(f"group_sizes must be int32, got {gs.dtype}; pass "
                        "group_sizes.astype(jnp.int32)")
    elif gs.shape != (groups,):
        raise ValueError(f"group_sizes must have shape (G,) = ({groups},), one size per group "
                         f"of rhs {tuple(rhs.shape)}; got shape {tuple(gs.shape)}")
    if alpha.shape != (groups,) or np.dtype(alpha.dtype) != np.float32:
        raise TypeError(f"alpha must be f32 of shape ({groups},), got "
                        f"{alpha.dtype}{list(alpha.shape)}")
    if local:
        (row_start,) = rest
        if row_start.shape != () or np.dtype(row_start.dtype) != np.int32:
            raise TypeError(f"row_start must be an int32 scalar, got "
                            f"{row_start.dtype}{list(row_start.shape)}")
    elif rest or shifted or plan_shape is not None:
        raise TypeError("only ragged_gemm_local_p takes row_start, shifted and plan_shape")
    check_out_dtype(out_dtype)
    return RaggedSpec(fmt_lhs, fmt_rhs, layout_lhs if fmt_lhs else None, layout_rhs,
                      np.dtype(lhs.dtype), np.dtype(out_dtype), lhs.shape[0], rhs.shape[1],
                      lhs.shape[1], groups, bool(alpha_is_one), bool(shifted), bool(group_index),
                      None if plan_shape is None else tuple(int(d) for d in plan_shape))


def _abstract_eval(*avals, local, **params):
    spec = ragged_spec(avals, local=local, **params)
    return jax.core.ShapedArray((spec.m, spec.n), spec.out_dtype)


def _impl(prim, *args, **params):
    return jax.jit(functools.partial(prim.bind, **params))(*args)


ragged_gemm_p.def_abstract_eval(functools.partial(_abstract_eval, local=False))
ragged_gemm_local_p.def_abstract_eval(functools.partial(_abstract_eval, local=True))
for _prim in (ragged_gemm_p, ragged_gemm_local_p):
    _prim.def_impl(functools.partial(_impl, _prim))


# ---------------------------------------------------------------------------------------------
# The per-device lowering: safe group sizes, one backend chosen, its computation.


def local_lowering(ctx, *args, platform, **params):
    spec = ragged_spec(ctx.avals_in, local=True, **params)
    plan = select_ragged_backend(spec, platform, params["backend"])
    backend = get_ragged_backend(plan.backend)
    if spec.group_index and plan.backend == "reference":
        # no kernel reads the stack in place: slice the matrix out and run gemm's best backend
        return mlir.lower_fun(functools.partial(_sliced_gemm, spec=spec, platform=platform,
                                                params=params),
                              multiple_results=False)(ctx, *args)

    def run(*xs):
        lhs, rhs, sl, sr, gs, alpha, row_start = split_operands(xs, params["fmt_lhs"])
        if spec.group_index or plan.raw_sizes:
            # the backend clamps the index, or makes the sizes safe in its kernel (an XLA clamp
            # is kernel launches before the call)
            return backend(lhs, rhs, sl, sr, gs, alpha, jnp.int32(0), plan=plan)
        if spec.shifted:
            row_start = jnp.clip(row_start, 0, spec.m)
        else:
            row_start = jnp.int32(0)
        gs = clamp_group_sizes(gs, spec.m, row_start)
        return backend(lhs, rhs, sl, sr, gs, alpha, row_start, plan=plan)

    return mlir.lower_fun(run, multiple_results=False)(ctx, *args)


for _platform in ALL_PLATFORMS:
    mlir.register_lowering(ragged_gemm_local_p,
                           functools.partial(local_lowering, platform=_platform),
                           platform=_platform)


def _sliced_gemm(*xs, spec: RaggedSpec, platform: str, params):
    """Index mode without an in-place kernel: gemm's plan and backend on rhs[index] (a slice
    XLA hands the kernel in place when the index is a loop counter, else a copy), as gemm's
    local primitive lowers it."""

    lhs, rhs, sl, sr, index, alpha, _ = split_operands(xs, params["fmt_lhs"])
    take = lambda x: take_layer(x, index)  # noqa: E731
    if rhs.dtype == jnp.float4_e2m1fn:
        # Slice the packed bytes and view them as FP4 again: the kernels' byte view of the
        # result cancels the view, and XLA hands a kernel the byte slice in place (a slice of
        # the FP4 array itself is copied, inside a loop by a slow elementwise kernel).
        rhs_layer = lax.bitcast_convert_type(take(element_bytes(rhs)), rhs.dtype)
        rhs_layer = rhs_layer.reshape(rhs.shape[1:])
    else:
        rhs_layer = take(rhs)
    # The layer's alpha: XLA turns a bare 4-byte slice at a loop counter into an asynchronous
    # device memcpy before each call, slower in a decode loop than the one small fusion a
    # slice of the edge-padded vector is (same value at every clamped index; see
    # docs/design/scanned_layers.md). XLA hands no 4-byte slice to a kernel in place.
    alpha_layer = take(jnp.pad(alpha, (0, 1), mode="edge"))
    # a shard of a sharded call runs the unsharded layer's plan (see RaggedSpec.plan_shape)
    whole = params["plan_shape"]
    layer_spec = GemmSpec(spec.fmt_lhs, spec.fmt_rhs, spec.layout_lhs, spec.layout_rhs,
                          spec.lhs_dtype, spec.out_dtype, (), (), (), spec.m, spec.n, spec.k,
                          spec.alpha_is_one,
                          None if whole is None else ((), (), int(whole[0]), int(whole[1])))
    plan = plan_gemm(layer_spec, platform, params["backend"])
    return get_backend(plan.backend)(lhs, rhs_layer, sl, take(sr), alpha_layer, plan=plan)


def bind_local(operands, params, row_start=None, plan_shape=None):
    """`ragged_gemm_local_p` on ragged_gemm_p's operands (row_start None: group 0 at row 0;
    plan_shape: a shard's unsharded (M, N, G), see RaggedSpec)."""
    shifted = row_start is not None
    row_start = jnp.int32(0) if row_start is None else row_start
    return ragged_gemm_local_p.bind(*operands, row_start, **params, shifted=shifted,
                                    plan_shape=plan_shape)


# ---------------------------------------------------------------------------------------------
# Batching (see the module docstring).


# stable_order: up to this many keys, ranks from all pairs of keys (one fused compare-and-count
# kernel and an int scatter) instead of a sort: XLA's GPU sort of a few thousand keys is one
# long kernel of many passes, while n^2 compares of n <= 4096 keys are a few microseconds.
STABLE_ORDER_RANK_MAX = 4096
# Past that, up to STABLE_ORDER_COUNT_MAX keys, where the caller bounds the keys (`num_keys`,
# the experts, at most STABLE_ORDER_COUNT_MAX_KEYS values), each key's place is counted in
# chunks of STABLE_ORDER_CHUNK keys instead: the keys before it are the smaller keys (a count
# per key value), the equal keys of earlier chunks (a count per chunk and key value) and the
# equal earlier keys of its own chunk (compares within the chunk). That is about
# n * (num_keys + STABLE_ORDER_CHUNK) compares in fused reductions, linear in n, against XLA's
# sort, which costs about the same from a few thousand keys to a hundred thousand; the two
# cross between 32768 and 65536 keys of 128 values (docs/design/moe_layer.md).
STABLE_ORDER_CHUNK = 128
STABLE_ORDER_COUNT_MAX = 32768
STABLE_ORDER_COUNT_MAX_KEYS = 1024


def stable_order(keys, num_keys: int | None = None):
    """int32 (n,): the permutation sorting int keys (n,) stably, as
    ``jnp.argsort(keys, stable=True)`` (equal keys keep their order): the order of the rows of
    a mixture-of-experts layer sorted by expert. `num_keys`: a bound the caller guarantees,
    every key in [0, num_keys) (the experts, one more for "routed nowhere" rows), which lets
    more than STABLE_ORDER_RANK_MAX keys be counted instead of sorted. Up to
    STABLE_ORDER_RANK_MAX keys each key's place is counted from all key pairs and the
    permutation is its inverse; up to STABLE_ORDER_COUNT_MAX keys with `num_keys` they are
    counted per chunk; more are sorted."""
    return stable_order_and_counts(keys, num_keys, counts=False)[0]


def _counts_the_keys(n: int, num_keys: int | None) -> bool:
    """Whether stable_order places n keys by counting them per value (_counted_order)."""
    return (STABLE_ORDER_RANK_MAX < n <= STABLE_ORDER_COUNT_MAX and num_keys is not None
            and num_keys <= STABLE_ORDER_COUNT_MAX_KEYS)


def stable_order_and_counts(keys, num_keys: int | None, counts: bool = True):
    """(stable_order(keys, num_keys), each key value's count: int32 (num_keys,), or None
    without `counts`): the counts come with the order where it counts the keys itself
    (_counted_order), else from one scatter-add."""
    n = keys.shape[0]
    if _counts_the_keys(n, num_keys):
        return _counted_order(keys, int(num_keys))
    count = (jnp.zeros((num_keys,), jnp.int32).at[keys].add(1) if counts else None)
    if n > STABLE_ORDER_RANK_MAX:
        return jnp.argsort(keys, stable=True).astype(jnp.int32), count
    i = jnp.arange(n, dtype=jnp.int32)
    mine, other = keys[:, None], keys[None, :]
    before = (other < mine) | ((other == mine) & (i[None, :] < i[:, None]))
    return inverse_permutation(jnp.sum(before, axis=1, dtype=jnp.int32)), count


def _counted_order(keys, num_keys: int):
    """(stable_order, each key value's count) of keys in [0, num_keys) from counts (see
    STABLE_ORDER_CHUNK). The keys are padded to whole chunks with the key num_keys, which sorts
    after all of them."""
    n, c = keys.shape[0], STABLE_ORDER_CHUNK
    chunks = jnp.concatenate([keys.astype(jnp.int32),
                              jnp.full((-n % c,), num_keys, jnp.int32)]).reshape(-1, c)
    values = jnp.arange(num_keys + 1, dtype=jnp.int32)
    counts = jnp.sum(chunks[:, :, None] == values, axis=1, dtype=jnp.int32)  # (chunks, keys)
    per_value = jnp.sum(counts, axis=0, dtype=jnp.int32)
    smaller = jnp.cumsum(per_value, dtype=jnp.int32) - per_value  # keys below each value
    earlier_chunks = jnp.cumsum(counts, axis=0, dtype=jnp.int32) - counts  # equal, earlier chunks
    i = jnp.arange(c, dtype=jnp.int32)
    same = chunks[:, :, None] == chunks[:, None, :]  # [chunk, key, other key of its chunk]
    within = jnp.sum(same & (i[None, None, :] < i[None, :, None]), axis=2, dtype=jnp.int32)
    place = smaller[chunks] + jnp.take_along_axis(earlier_chunks, chunks, axis=1) + within
    return inverse_permutation(place.reshape(-1))[:n], per_value[:num_keys]


def inverse_permutation(order):
    """int32 (n,): where each element went under the permutation `order` (inverse[order[i]] =
    i), by an int scatter of n indices."""
    n = order.shape[0]
    return jnp.zeros((n,), jnp.int32).at[order].set(jnp.arange(n, dtype=jnp.int32))


def unsort_rows(rows, order):
    """rows (n, ...) sorted by the permutation `order` (row i is row order[i] of the unsorted
    array) back in their unsorted order: a gather by the inverse permutation (an int scatter of
    n indices, then one coalesced row gather; a row scatter of the (n, ...) rows themselves
    costs several times more on GPUs). Used by the batching rule below and by the MoE layers
    (ragged/dispatch.py, nn/moe.py)."""
    return rows[inverse_permutation(order)]


def _merged_rows(args, dims, size, params):
    """One grouped call for a batch of (lhs, group_sizes) sharing rhs and alpha."""
    fmt_lhs = params["fmt_lhs"]
    lhs, rhs, sl, sr, gs, alpha = split_operands(args, fmt_lhs)
    dl, _, dsl, _, dgs, _ = split_operands(dims, fmt_lhs)
    lhs = batching.bdim_at_front(lhs, dl, size)  # (B, M, K)
    sl = None if sl is None else batching.bdim_at_front(sl, dsl, size)
    gs = batching.bdim_at_front(gs, dgs, size)  # (B, G)
    m = lhs.shape[1]
    safe = jax.vmap(lambda g: clamp_group_sizes(g, m))(gs)  # each example's own semantics
    gid = jax.vmap(lambda g: row_groups(g, m))(safe)  # (B, M); G past the example's sum
    # Stable sort of all B*M rows by group: group g's rows of example 0, then of example 1, ...
    order = stable_order(gid.reshape(-1), num_keys=gs.shape[-1] + 1)  # G: past the sum
    flat = lambda x: x.reshape((size * m,) + x.shape[2:])
    lhs_sorted = flat(lhs)[order]
    sl_sorted = None if sl is None else flat(sl)[order]
    total_gs = jnp.sum(safe, axis=0).astype(jnp.int32)  # (G,): rows past it are past the sum
    y_sorted = ragged_gemm_p.bind(*join_operands(lhs_sorted, rhs, sl_sorted, sr, total_gs,
                                                 alpha), **params)
    y = unsort_rows(y_sorted, order)
    return y.reshape(size, m, y.shape[-1])


def _folded_rows(args, dims, size, params):
    """Index mode, one index for the whole batch: the examples' rows as one (B*M, K) call."""
    lhs, rhs, sl, sr, index, alpha = split_operands(args, params["fmt_lhs"])
    dl, _, dsl, _, _, _ = split_operands(dims, params["fmt_lhs"])
    lhs = batching.bdim_at_front(lhs, dl, size)
    m = lhs.shape[1]
    fold = lambda x: x.reshape((size * m,) + x.shape[2:])
    sl = None if sl is None else fold(batching.bdim_at_front(sl, dsl, size))
    y = ragged_gemm_p.bind(*join_operands(fold(lhs), rhs, sl, sr, index, alpha), **params)
    return y.reshape(size, m, y.shape[-1])


def _batch_rule(args, dims, **params):
    fmt_lhs = params["fmt_lhs"]
    size = next(x.shape[d] for x, d in zip(args, dims) if d is not None)
    _, drhs, dsl, dsr, dgs, dalpha = split_operands(dims, fmt_lhs)
    shared_weights = drhs is None and dsr is None and dalpha is None
    if params["group_index"]:
        if shared_weights and dgs is None and params["layout_lhs"] != "blocked":
            return _folded_rows(args, dims, size, params), 0
    elif shared_weights and params["layout_lhs"] != "blocked":
        return _merged_rows(args, dims, size, params), 0
    # General case: one example at a time.
    mapped = [i for i, d in enumerate(dims) if d is not None]
    xs = [batching.bdim_at_front(args[i], dims[i], size) for i in mapped]

    def one(example):
        full = list(args)
        for i, x in zip(mapped, example):
            full[i] = x
        return ragged_gemm_p.bind(*full, **params)

    return lax.map(one, xs), 0


batching.primitive_batchers[ragged_gemm_p] = _batch_rule


# ---------------------------------------------------------------------------------------------
# Differentiation (see the module docstring for the policy).

_NOT_DIFFERENTIABLE = (
    "jax_blockscale.ragged_gemm is not differentiable with respect to quantized operands "
    "(elements or scales of a BlockScaled). Differentiate in weight-only mode (a plain lhs times "
    "quantized experts), or wrap the quantized operand in jax.lax.stop_gradient.")


def _is_zero(t):
    return type(t) is ad.Zero


def _jvp(primals, tangents, **params):
    fmt_lhs = params["fmt_lhs"]
    lhs, rhs, sl, sr, gs, alpha = split_operands(primals, fmt_lhs)
    tl, trhs, tsl, tsr, _, talpha = split_operands(tangents, fmt_lhs)
    quantized = [trhs, tsr] + ([tl, tsl] if fmt_lhs is not None else [])
    if not all(_is_zero(t) for t in quantized):
        raise TypeError(_NOT_DIFFERENTIABLE)
    y = ragged_gemm_p.bind(*primals, **params)
    terms = []
    if fmt_lhs is None and not _is_zero(tl):
        terms.append(ragged_gemm_p.bind(*join_operands(tl, rhs, sl, sr, gs, alpha), **params))
    if not _is_zero(talpha):
        terms.append(ragged_gemm_p.bind(*join_operands(lhs, rhs, sl, sr, gs, talpha),
                                        **dict(params, alpha_is_one=False)))
    if not terms:
        return y, ad.Zero.from_primal_value(y)
    return y, functools.reduce(jnp.add, terms)


def _transpose(ct, *args, **params):
    fmt_lhs = params["fmt_lhs"]
    lhs, rhs, sl, sr, gs, alpha = split_operands(args, fmt_lhs)
    out = [None] * len(args)
    if _is_zero(ct):
        return out
    if ad.is_undefined_primal(gs):
        raise TypeError("ragged_gemm: group_sizes must be a known value when transposing")
    ct = ct.astype(jnp.float32)
    m = ct.shape[0]
    sizes = index_group_sizes(gs, rhs.shape[0], m) if params["group_index"] else gs
    safe = clamp_group_sizes(sizes, m)
    gid = row_groups(safe, m)
    if ad.is_undefined_primal(lhs):  # weight-only: dL/dlhs[m] = alpha[g] * ct[m] @ W_g
        if ad.is_undefined_primal(alpha):
            raise NotImplementedError("ragged_gemm is bilinear in (lhs, alpha); transpose one "
                                      "at a time")
        wv = dequantized_rhs(rhs, sr, params["fmt_rhs"], params["layout_rhs"])  # (G, N, K)
        row_alpha = jnp.take(alpha, gid, mode="fill", fill_value=0.0)
        scaled = ct * row_alpha[:, None]
        # The grouped product picks its method per platform when lowered (see ragged_matmul).
        ct_lhs = lax.platform_dependent(
            scaled, wv, safe,
            cpu=functools.partial(ragged_matmul, contract=1, method=method_for("cpu")),
            default=functools.partial(ragged_matmul, contract=1, method="ragged_dot"))
        out[0] = ct_lhs.astype(lhs.aval.dtype)
    if ad.is_undefined_primal(alpha):
        y1 = ragged_gemm_p.bind(*join_operands(lhs, rhs, sl, sr, gs,
                                               jnp.ones(alpha.aval.shape, jnp.float32)),
                                **dict(params, out_dtype=np.dtype(np.float32),
                                       alpha_is_one=True))
        per_row = jnp.sum(ct * y1, axis=1)
        groups = alpha.aval.shape[0]
        # rows past the sum have group G: they fall into the extra segment that is dropped
        out[-1] = jax.ops.segment_sum(per_row, gid, num_segments=groups + 1)[:groups]
    return out


ad.primitive_jvps[ragged_gemm_p] = _jvp
ad.primitive_transposes[ragged_gemm_p] = _transpose

