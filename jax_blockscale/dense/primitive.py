"""`gemm_p`: the block-scaled GEMM primitive (shape rules, batching, differentiation), and
`gemm_local_p`, the per-device computation it lowers to.

Two primitives, each lowered in one place, as JAX does for its own partitioned custom calls:
  * `gemm_p` is what `jbs.gemm` binds: shape rules, batching and differentiation live here; its
    lowering (sharding.py) wraps the local computation in `custom_partitioning` where an SPMD
    partitioner will split it, and is the local computation itself elsewhere;
  * `gemm_local_p` (same operands, same result) is the computation on one device: its lowering
    (below) asks the planner (lowering/plan.py) for a Plan once and lets the chosen backend carry
    it out.

Operands, in order: ``a, b, [sa], sb, alpha``.
  a      (*batch_a, M, K): quantized elements, or (weight-only mode, ``fmt_a=None``) a plain
         bf16/f16/f32 activation; then `sa` is absent.
  b      (*batch_b, N, K): quantized elements.
  sa, sb scales in `layout_a` / `layout_b` ("plain" or "blocked", see layout.py).
  alpha  f32 scalar: the product of the global scales (1.0 when there are none).
Param ``alpha_is_one`` (optional, default False): the caller promises alpha is 1.0, so a backend
may round the GEMM's f32 accumulators straight to ``out_dtype`` (no separate scaling pass).
Result: (*broadcast(batch_a, batch_b), M, N) in `out_dtype`,
``y[..., m, n] = alpha * sum_k A[..., m, k] * B[..., n, k]``.

Differentiation policy: quantized operands (elements and scales) are not differentiable; a
nonzero tangent reaching one raises a TypeError. In weight-only mode gemm is linear in the
activation and in alpha, and both differentiate (the weight acts as its dequantized value).
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
from ..core.quantize import BlockScaled, check_operand_pair
from ..lowering.plan import plan as make_plan
from ..lowering.reference import operand_values
from ..lowering.registry import ALL_PLATFORMS, get_backend
from ..lowering.specs import GemmSpec

gemm_p = Primitive("blockscale_gemm")
gemm_local_p = Primitive("blockscale_gemm_local")


def split_operands(args, fmt_a):
    """(a, b, [sa], sb, alpha) -> (a, b, sa_or_None, sb, alpha)."""
    if fmt_a is None:
        a, b, sb, alpha = args
        return a, b, None, sb, alpha
    a, b, sa, sb, alpha = args
    return a, b, sa, sb, alpha


def join_operands(a, b, sa, sb, alpha):
    return (a, b, sb, alpha) if sa is None else (a, b, sa, sb, alpha)


# ---------------------------------------------------------------------------------------------
# Binding (what jbs.gemm calls once its arguments are checked)


def _alpha(*operands) -> jax.Array:
    """The product of the operands' global (decode) scales, f32.

    A scalar (1.0 without global scales), or, when an operand keeps one global scale per matrix
    (``global_scale="per_matrix"``, shape = its batch dims), an array that broadcasts, aligned
    on the right, against the output's batch dims.
    """
    alpha = jnp.float32(1.0)
    for q in operands:
        if isinstance(q, BlockScaled) and q.global_scale is not None:
            alpha = alpha * jnp.asarray(q.global_scale, jnp.float32)
    return alpha


def bind_gemm(a, b: BlockScaled, out_dtype, backend) -> jax.Array:
    """`gemm_p` bound on checked operands (`jbs.gemm` checks them): a `BlockScaled` or plain
    activation `a` times the `BlockScaled` `b`, the product of their global scales applied."""
    if isinstance(a, BlockScaled):
        a_elems, sa, fmt_a, layout_a = a.data, a.scales, a.fmt, a.layout
    else:
        a_elems, sa, fmt_a, layout_a = jnp.asarray(a), None, None, None
    alpha = _alpha(a, b)
    no_global_scale = all(not isinstance(q, BlockScaled) or q.global_scale is None
                          for q in (a, b))
    params = dict(fmt_a=fmt_a, fmt_b=b.fmt, layout_a=layout_a, layout_b=b.layout,
                  out_dtype=np.dtype(out_dtype), backend=backend)
    if alpha.shape == ():
        operands = join_operands(a_elems, b.data, sa, b.scales, alpha)
        return gemm_p.bind(*operands, **params, alpha_is_one=no_global_scale)
    # One global scale per matrix: gemm_p's alpha is a scalar, so multiply the f32 result by the
    # per-matrix product instead (as the batching rule does for a vmapped alpha), then round.
    operands = join_operands(a_elems, b.data, sa, b.scales, jnp.float32(1.0))
    y = gemm_p.bind(*operands, **dict(params, out_dtype=np.dtype(np.float32)), alpha_is_one=True)
    y = y * jnp.reshape(alpha, alpha.shape + (1, 1))
    return y.astype(out_dtype)


# ---------------------------------------------------------------------------------------------
# Shape rules: every check raises at trace time with the argument named and the fix.


def gemm_spec(avals, *, fmt_a, fmt_b, layout_a, layout_b, out_dtype, backend=None,
              alpha_is_one=False, plan_shape=None) -> GemmSpec:
    """Validate the operands' shapes and dtypes and describe the problem."""
    a, b, sa, sb, alpha = split_operands(avals, fmt_a)
    if fmt_b is None:
        raise TypeError("b must be quantized (a jbs.BlockScaled); quantize the weight with "
                        "jbs.quantize(w, fmt)")
    check_operand_pair(("a", "b"), a, b, sa, sb, fmt_a, fmt_b, layout_a, layout_b,
                       plain_name="plain activation")
    if alpha.shape != () or np.dtype(alpha.dtype) != np.float32:
        raise TypeError(f"alpha must be an f32 scalar, got {alpha.dtype}{list(alpha.shape)}")
    check_out_dtype(out_dtype)
    try:
        batch = np.broadcast_shapes(tuple(a.shape[:-2]), tuple(b.shape[:-2]))
    except ValueError:
        raise ValueError(f"the batch dims of a {tuple(a.shape[:-2])} and b "
                         f"{tuple(b.shape[:-2])} do not broadcast") from None
    return GemmSpec(fmt_a, fmt_b, layout_a if fmt_a else None, layout_b, np.dtype(a.dtype),
                    np.dtype(out_dtype), tuple(batch), tuple(a.shape[:-2]), tuple(b.shape[:-2]),
                    a.shape[-2], b.shape[-2], a.shape[-1], bool(alpha_is_one),
                    None if plan_shape is None else _plan_shape(plan_shape))


def _plan_shape(plan_shape) -> tuple:
    a_batch, b_batch, m, n = plan_shape
    return tuple(map(int, a_batch)), tuple(map(int, b_batch)), int(m), int(n)


def _abstract_eval(*avals, **params):
    spec = gemm_spec(avals, **params)
    return jax.core.ShapedArray(spec.batch_shape + (spec.m, spec.n), spec.out_dtype)


def _impl(prim, *args, **params):
    return jax.jit(functools.partial(prim.bind, **params))(*args)


for _prim in (gemm_p, gemm_local_p):
    _prim.def_abstract_eval(_abstract_eval)
    _prim.def_impl(functools.partial(_impl, _prim))


# ---------------------------------------------------------------------------------------------
# The per-device lowering: one Plan, carried out by its backend (written in JAX).


def local_lowering(ctx, *args, platform, **params):
    spec = gemm_spec(ctx.avals_in, **params)
    plan = make_plan(spec, platform, params["backend"])
    backend = get_backend(plan.backend)

    def run(*xs):
        return backend(*split_operands(xs, params["fmt_a"]), plan=plan)

    return mlir.lower_fun(run, multiple_results=False)(ctx, *args)


for _platform in ALL_PLATFORMS:
    mlir.register_lowering(gemm_local_p, functools.partial(local_lowering, platform=_platform),
                           platform=_platform)


# ---------------------------------------------------------------------------------------------
# Batching: vmap over the leading axis of any operands; the mapped axis leads the output.


def _batch_rule(args, dims, **params):
    fmt_a = params["fmt_a"]
    a, b, sa, sb, alpha = split_operands(args, fmt_a)
    da, db, dsa, dsb, dalpha = split_operands(dims, fmt_a)
    size = next(x.shape[d] for x, d in zip(args, dims) if d is not None)
    a_batch = a.ndim - 2 - (da is not None)  # batch rank before mapping
    b_batch = b.ndim - 2 - (db is not None)
    rank = max(a_batch, b_batch)

    def lift(x, d, own_batch):
        # Mapped axis first, then pad the operand's batch dims on the left to `rank`.
        x = batching.bdim_at_front(x, d, size)
        return lax.expand_dims(x, tuple(range(1, 1 + rank - own_batch)))

    a_mapped = da is not None or dsa is not None  # dsa is None in weight-only mode too
    b_mapped = db is not None or dsb is not None
    if a_mapped:
        a = lift(a, da, a_batch)
        sa = sa if sa is None else lift(sa, dsa, a_batch)
    if b_mapped:
        b = lift(b, db, b_batch)
        sb = lift(sb, dsb, b_batch)
    if dalpha is None:
        return gemm_p.bind(*join_operands(a, b, sa, sb, alpha), **params), 0
    # A per-example alpha cannot ride in the scalar operand: apply it to an f32 result.
    f32_params = dict(params, out_dtype=np.dtype(np.float32))
    y = gemm_p.bind(*join_operands(a, b, sa, sb, jnp.float32(1.0)), **f32_params)
    if not (a_mapped or b_mapped):  # only alpha was mapped: add the axis
        y = jnp.broadcast_to(y, (size,) + y.shape)
    alpha = batching.bdim_at_front(alpha, dalpha, size)
    alpha = alpha.reshape((size,) + (1,) * (y.ndim - 1))
    return (y * alpha).astype(params["out_dtype"]), 0


batching.primitive_batchers[gemm_p] = _batch_rule


# ---------------------------------------------------------------------------------------------
# Differentiation (see the module docstring for the policy).

_NOT_DIFFERENTIABLE = (
    "jax_blockscale.gemm is not differentiable with respect to quantized operands (elements or "
    "scales of a BlockScaled). Differentiate in weight-only mode (a plain activation times a "
    "quantized weight), or wrap the quantized operand in jax.lax.stop_gradient.")


def _is_zero(t):
    return type(t) is ad.Zero


def _jvp(primals, tangents, **params):
    fmt_a = params["fmt_a"]
    a, b, sa, sb, alpha = split_operands(primals, fmt_a)
    ta, tb, tsa, tsb, talpha = split_operands(tangents, fmt_a)
    quantized = [tb, tsb] + ([ta, tsa] if fmt_a is not None else [])
    if not all(_is_zero(t) for t in quantized):
        raise TypeError(_NOT_DIFFERENTIABLE)
    y = gemm_p.bind(*primals, **params)
    terms = []
    if fmt_a is None and not _is_zero(ta):
        terms.append(gemm_p.bind(*join_operands(ta, b, sa, sb, alpha), **params))
    if not _is_zero(talpha):  # the tangent of alpha is no longer 1
        terms.append(gemm_p.bind(*join_operands(a, b, sa, sb, talpha),
                                 **dict(params, alpha_is_one=False)))
    if not terms:
        return y, ad.Zero.from_primal_value(y)
    return y, functools.reduce(jnp.add, terms)


def _sum_to_shape(x, shape):
    """Sum away the leading axes broadcasting added, and axes broadcast from size 1."""
    lead = x.ndim - len(shape)
    x = x.sum(axis=tuple(range(lead))) if lead else x
    axes = tuple(i for i, (n, m) in enumerate(zip(shape, x.shape)) if n == 1 and m != 1)
    return x.sum(axis=axes, keepdims=True) if axes else x


def _transpose(ct, *args, **params):
    fmt_a = params["fmt_a"]
    a, b, sa, sb, alpha = split_operands(args, fmt_a)
    out = [None] * len(args)
    if _is_zero(ct):
        return out
    ct = ct.astype(jnp.float32)
    if ad.is_undefined_primal(a):  # weight-only: dL/da = alpha * ct @ B
        if ad.is_undefined_primal(alpha):
            raise NotImplementedError("gemm is bilinear in (a, alpha); transpose one at a time")
        bv = operand_values(b, sb, params["fmt_b"], params["layout_b"], jnp.float32)
        ct_a = jnp.einsum("...mn,...nk->...mk", ct, bv, precision=lax.Precision.HIGHEST) * alpha
        out[0] = _sum_to_shape(ct_a, a.aval.shape).astype(a.aval.dtype)
    if ad.is_undefined_primal(alpha):
        y1 = gemm_p.bind(*join_operands(a, b, sa, sb, jnp.float32(1.0)),
                         **dict(params, out_dtype=np.dtype(np.float32)))
        out[-1] = jnp.sum(ct * y1)
    return out


ad.primitive_jvps[gemm_p] = _jvp
ad.primitive_transposes[gemm_p] = _transpose
