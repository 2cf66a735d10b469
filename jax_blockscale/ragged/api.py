"""`jbs.ragged_gemm`, the grouped block-scaled GEMM of mixtures of experts, and its index mode
(`indexed_gemm`, and `layer_gemm`, what `jbs.gemm(x, w_stack, layer=i)` calls): check the
arguments and bind `ragged_gemm_p` (primitive.py, where the semantics, operands and rules are
described).

    y = jbs.ragged_gemm(lhs, rhs, group_sizes)     # lhs (M, K), rhs (G, N, K) -> y (M, N)
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ..core.quantize import BlockScaled, check_blockscaled
from ..lowering.registry import check_backend_name
from ..lowering.specs import RaggedSpec
from .primitive import join_operands, ragged_gemm_p, ragged_spec


def ragged_gemm(lhs, rhs: BlockScaled, group_sizes, *, out_dtype=jnp.bfloat16,
                backend: str | None = None) -> jax.Array:
    """Grouped GEMM: ``y[m] = lhs[m] @ rhs[g].T`` for the rows m of group g (like lax.ragged_dot).

    lhs: a `BlockScaled` (M, K) (its NVFP4 global scale, if any, a scalar), or a plain
      bf16/f16/f32 (M, K) array (weight-only mode). Rows sorted by group.
    rhs: a `BlockScaled` (G, N, K): one K-major weight per group (expert), as `gemm`'s b;
      typically ``jbs.quantize(w, fmt, layout="blocked")`` of a (G, N, K) stack. An NVFP4
      global scale may be a scalar or one per expert (shape (G,), ``global_scale="per_matrix"``).
    group_sizes: int32 (G,): rows per group, in order. Rows past their sum are zero in the
      output. At run time a negative size counts as 0, and a group running past row M is cut
      at M (later groups then get no rows).
    out_dtype: bf16 (default), f16 or f32; accumulation is always f32.
    backend: force a ragged backend ("reference", "sm90" on Hopper); default: the
      fastest that accepts the problem.
    Returns (M, N) in out_dtype. Any format pair `gemm` takes (`jbs.can_multiply`) works.
    """
    operands, params = _operands_and_params(lhs, rhs, group_sizes, out_dtype, backend)
    return ragged_gemm_p.bind(*operands, **params)


def indexed_gemm(lhs, rhs: BlockScaled, index, *, out_dtype=jnp.bfloat16,
                 backend: str | None = None, alpha=None) -> jax.Array:
    """``lhs @ rhs[index].T`` for an (M, K) lhs and a stack rhs (G, N, K), reading rhs[index]
    in place (index mode, see the module docstring); what ``jbs.gemm(..., layer=)`` calls.
    alpha: the (G,) products of the operands' global scales where the caller has them (then
    the operands' own are not multiplied again)."""
    operands, params = _operands_and_params(lhs, rhs, index, out_dtype, backend,
                                            group_index=True, alpha=alpha)
    return ragged_gemm_p.bind(*operands, **params)


def ragged_gemm_spec(lhs, rhs: BlockScaled, group_sizes, *,
                     out_dtype=jnp.bfloat16) -> RaggedSpec:
    """The problem ``ragged_gemm(lhs, rhs, group_sizes, out_dtype=...)`` hands the backends'
    planners (benchmarks and tests use it to ask which backend and kernel would run a call)."""
    operands, params = _operands_and_params(lhs, rhs, group_sizes, out_dtype, None)
    avals = [jax.core.ShapedArray(jnp.shape(x), jnp.result_type(x)) for x in operands]
    return ragged_spec(avals, **params)


def _operands_and_params(lhs, rhs, group_sizes, out_dtype, backend, group_index=False,
                         alpha=None):
    """ragged_gemm's arguments checked (naming the bad one) and turned into ragged_gemm_p's
    operands and params (group_index: group_sizes is the index of index mode; alpha: the (G,)
    products of the global scales, computed by the caller, else here from the operands')."""
    if not isinstance(rhs, BlockScaled):
        raise TypeError(f"rhs must be a jbs.BlockScaled (G, N, K), got {type(rhs).__name__}; "
                        "quantize the expert weights with jbs.quantize(w, fmt, layout='blocked')")
    check_backend_name(backend)
    if rhs.ndim != 3:
        raise ValueError(f"rhs must have shape (G, N, K) (one weight per group), got {rhs.shape}")
    check_blockscaled(rhs, "rhs")
    groups = rhs.shape[0]
    if isinstance(lhs, BlockScaled):
        if lhs.ndim != 2:
            raise ValueError(f"lhs must have shape (M, K) (tokens sorted by group), got "
                             f"{lhs.shape}; fold leading axes into M, or vmap")
        check_blockscaled(lhs, "lhs")
        l_elems, sl, fmt_lhs, layout_lhs = lhs.data, lhs.scales, lhs.fmt, lhs.layout
    else:
        l_elems, sl, fmt_lhs, layout_lhs = jnp.asarray(lhs), None, None, None
    group_sizes = jnp.asarray(group_sizes)
    if alpha is not None:
        alpha, no_global_scale = jnp.asarray(alpha, jnp.float32), False
        if alpha.shape != (groups,):
            raise ValueError(f"alpha must hold one f32 per group, shape ({groups},); got "
                             f"{alpha.shape}")
    else:
        alpha = jnp.ones((groups,), jnp.float32)
        no_global_scale = True
        # check_blockscaled allowed a scalar lhs global scale, and a scalar or (G,) one for rhs
        for q in (lhs, rhs):
            if isinstance(q, BlockScaled) and q.global_scale is not None:
                alpha = alpha * jnp.asarray(q.global_scale, jnp.float32)
                no_global_scale = False
    operands = join_operands(l_elems, rhs.data, sl, rhs.scales, group_sizes, alpha)
    return operands, dict(fmt_lhs=fmt_lhs, fmt_rhs=rhs.fmt, layout_lhs=layout_lhs,
                          layout_rhs=rhs.layout, out_dtype=np.dtype(out_dtype), backend=backend,
                          alpha_is_one=no_global_scale, group_index=group_index)


def layer_gemm(a, b: BlockScaled, layer, *, out_dtype=jnp.bfloat16, backend=None,
               alpha=None) -> jax.Array:
    """`jbs.gemm(a, b, layer=...)`: gemm(a, b[layer]) with b (L, N, K) read in place, the index
    mode of the grouped GEMM (a's leading dims fold into its rows). alpha: each layer's product
    of the global scales where the caller has it (a's quantizer)."""
    if b.ndim != 3:
        raise ValueError(f"layer= needs b stacked as (L, N, K) (one matrix per layer), got b of "
                         f"shape {b.shape}")
    layer = jnp.asarray(layer)
    if layer.shape != () or not jnp.issubdtype(layer.dtype, jnp.integer):
        raise TypeError(f"layer must be an integer scalar (the index into b's {b.shape[0]} "
                        f"layers), got {layer.dtype}{list(layer.shape)}")
    lead = tuple(a.shape[:-1])  # the rows of y, whatever their dims
    if isinstance(a, BlockScaled):
        check_blockscaled(a, "a")
        if a.ndim > 2:
            if a.layout == "blocked":
                raise ValueError(f"with layer=, a BlockScaled a of shape {a.shape} must be 2-D "
                                 "when its scales are blocked (quantize it with "
                                 "layout='plain', or fold its leading dims before quantizing)")
            if a.global_scale is not None and jnp.ndim(a.global_scale):
                raise ValueError("with layer=, a's global scale must be one scalar (got shape "
                                 f"{jnp.shape(a.global_scale)})")
            a = BlockScaled(a.data.reshape((-1,) + a.shape[-1:]),
                            a.scales.reshape((-1,) + a.scales.shape[-1:]), a.global_scale,
                            a.fmt, a.layout)
    else:
        a = jnp.asarray(a)
        a = a.reshape((-1,) + a.shape[-1:])
    y = indexed_gemm(a, b, layer.astype(jnp.int32), out_dtype=out_dtype, backend=backend,
                     alpha=alpha)
    return y.reshape(lead + y.shape[-1:])
