"""The backends of `ragged_gemm` (grouped block-scaled GEMM): what a backend is handed, the
group-size bookkeeping they share, and the pure-JAX reference backend.

A ragged backend is any object with

    name: str                        # "reference", "sm90", "sm100", ...
    platforms: tuple[str, ...]       # lowering platforms it serves: "cpu", "cuda", "rocm", "tpu"
    priority: int                    # higher wins among those that accept a problem
    plan(spec, platform) -> RaggedPlan | str       # how it would run `spec`, or why it cannot
    __call__(lhs, rhs, lhs_scales, rhs_scales, group_sizes, alpha, row_start, *, plan)
        -> jax.Array (M, N) in spec.out_dtype       # JAX-traceable; lowered with mlir.lower_fun

What the lowering (ragged.py) hands `__call__`, once per lowering of `ragged_gemm_local_p`:

    lhs          (M, K): quantized elements, or a plain bf16/f16/f32 activation
                 (``spec.fmt_lhs is None``; then `lhs_scales` is None)
    rhs          (G, N, K): quantized elements, one K-major weight per group
    lhs_scales   lhs's scales in ``spec.layout_lhs`` (plain (M, K/block) or blocked), or None
    rhs_scales   (G, N, K/block) plain or (G, ceil(N/128), ceil(SK/4), 32, 4, 4) blocked
    group_sizes  int32 (G,), already made safe: every size >= 0 and
                 ``row_start + sum(group_sizes) <= M`` (see `clamp_group_sizes`); or, when
                 the plan says ``raw_sizes``, as the caller passed them (row_start is then 0
                 and the backend applies `clamp_group_sizes`'s semantics itself); or, when
                 ``spec.group_index`` (a backend's plan may accept it), an int32 scalar: the
                 group that owns every row, which the backend clamps to [0, G)
                 (`index_group_sizes`)
    alpha        f32 (G,): the product of the global (decode) scales per group; when
                 ``spec.alpha_is_one`` it is all ones and may be ignored
    row_start    int32 scalar in [0, M]: group 0 starts at this row (always 0 unless
                 ``spec.shifted``; the expert-parallel sharding rule sets it per device)

and what it must return: ``y[m] = alpha[g] * lhs[m] @ rhs[g].T`` for the rows m of group g,
group g covering rows ``[row_start + sum(group_sizes[:g]), row_start + sum(group_sizes[:g+1]))``;
every other row is zero. It must read and write nothing outside those rows and groups.

The registry is separate from `gemm`'s (lowering/registry.py): `register_ragged_backend` adds
one, `lowering.plan.select_ragged_backend` picks one per lowering (a forced name, else the
highest priority whose `plan` accepts the problem; `reference` serves every platform and accepts
everything).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .reference import operand_values
from .registry import ALL_PLATFORMS, register_ragged_backend
from .specs import RaggedPlan, RaggedSpec

# ---------------------------------------------------------------------------------------------
# Group sizes and row bookkeeping (shared by the primitive's rules and the backends)


def prefix_sum(x):
    """Inclusive prefix sum of a short vector as one reduction: XLA's cumsum is a reduce-window
    kernel, and at decode sizes every small kernel before a grouped GEMM costs a measurable part
    of the call."""
    n = x.shape[0]
    if n > 2048:
        return jnp.cumsum(x)
    tri = jnp.arange(n)[:, None] >= jnp.arange(n)[None, :]
    return jnp.sum(jnp.where(tri, x[None, :], 0), axis=1)


def clamp_group_sizes(group_sizes, m: int, row_start=0):
    """The group sizes every backend receives (the documented run-time semantics).

    A negative size counts as 0; the groups then take rows in order starting at `row_start`
    and a group that would run past row M is cut at M (later groups get no rows). So the result
    is >= 0 and ``row_start + sum(result) <= M``; well-formed sizes pass through unchanged.
    """
    gs = jnp.clip(group_sizes.astype(jnp.int32), 0, m)  # clip first: the sum cannot overflow
    start = jnp.clip(jnp.asarray(row_start, jnp.int32), 0, m)
    through = start + prefix_sum(gs)  # one past each group's last row, before the cut at M
    return jnp.minimum(through, m) - jnp.minimum(through - gs, m)


def index_group_sizes(index, groups: int, m: int):
    """The group sizes of index mode (all M rows in group `index`, clamped to [0, G))."""
    index = jnp.clip(jnp.asarray(index, jnp.int32), 0, groups - 1)
    return jnp.where(jnp.arange(groups, dtype=jnp.int32) == index, jnp.int32(m), jnp.int32(0))


def row_groups(group_sizes, m: int):
    """Each of the M rows' group (G for rows past the groups' sum), for safe sizes."""
    ends = jnp.cumsum(group_sizes)
    return jnp.searchsorted(ends, jnp.arange(m, dtype=ends.dtype), side="right")


def ragged_matmul(x, w, group_sizes, *, contract: int, method: str):
    """f32 ``y[m] = x[m] . w[g]`` over x's last axis and w's axis `contract` (1 or 2) for the rows
    of group g (safe sizes, groups from row 0); rows past the sum are zero.

    method "ragged_dot": `lax.ragged_dot_general` (XLA's grouped GEMM on GPUs and TPUs; on the
    CPU it expands to a (G, M, K) masked operand and one dot, where NaN in an unused group's
    weights would reach every row). method "loop": one dot per group over all M rows, each row
    keeping its own group's result (G x the flops, M x N memory, groups never mix); the CPU's.
    """
    m = x.shape[0]
    out_axis = 3 - contract  # w is (G, a, b): the axis that is not contracted (nor G)
    if method == "ragged_dot":
        dn = lax.RaggedDotDimensionNumbers(
            dot_dimension_numbers=(([1], [contract]), ([], [])),
            lhs_ragged_dimensions=[0], rhs_group_dimensions=[0])
        y = lax.ragged_dot_general(x, w, group_sizes, dn, precision=lax.Precision.HIGHEST,
                                   preferred_element_type=jnp.float32)
    elif method == "loop":
        gid = row_groups(group_sizes, m)

        def body(g, y):
            yg = lax.dot_general(x, w[g], (((1,), (contract - 1,)), ((), ())),
                                 precision=lax.Precision.HIGHEST,
                                 preferred_element_type=jnp.float32)
            return jnp.where((gid == g)[:, None], yg, y)

        y = lax.fori_loop(0, w.shape[0], body, jnp.zeros((m, w.shape[out_axis]), jnp.float32))
    else:
        raise ValueError(f"unknown ragged_matmul method {method!r}")
    # Rows past the sum are zero in both methods already; make it explicit (cheap, and robust
    # to an XLA grouped GEMM that leaves them unwritten).
    valid = jnp.arange(m) < jnp.sum(group_sizes)
    return jnp.where(valid[:, None], y, 0.0)


def method_for(platform: str) -> str:
    """The reference's grouped product on a platform (see `ragged_matmul`)."""
    return "loop" if platform == "cpu" else "ragged_dot"


# ---------------------------------------------------------------------------------------------
# The reference backend


def reference_ragged_gemm(lhs, rhs, sl, sr, group_sizes, alpha, row_start, *, spec: RaggedSpec,
                          compute_dtype=jnp.float32, method: str = "loop"):
    """Dequantize exactly, one grouped product with f32 accumulation, alpha per group."""
    lv = operand_values(lhs, sl, spec.fmt_lhs, spec.layout_lhs, compute_dtype)  # (M, K)
    rv = operand_values(rhs, sr, spec.fmt_rhs, spec.layout_rhs, compute_dtype)  # (G, N, K)
    if spec.shifted:  # bring row_start to row 0, and the result back below
        lv = jnp.roll(lv, -row_start, axis=0)
    y = ragged_matmul(lv, rv, group_sizes, contract=2, method=method)
    if not spec.alpha_is_one:
        gid = row_groups(group_sizes, spec.m)
        row_alpha = jnp.take(alpha, gid, mode="fill", fill_value=0.0)  # rows past the sum: 0
        y = y * row_alpha[:, None]
    if spec.shifted:
        # rows [0, sum) move to [row_start, row_start + sum); what wraps around is zero rows
        y = jnp.roll(y, row_start, axis=0)
    return y.astype(spec.out_dtype)


class ReferenceRaggedBackend:
    name = "reference"
    platforms = ALL_PLATFORMS
    priority = 0

    def plan(self, spec: RaggedSpec, platform: str) -> RaggedPlan:
        return RaggedPlan("reference", method_for(platform), spec, platform)

    def __call__(self, lhs, rhs, sl, sr, group_sizes, alpha, row_start, *, plan: RaggedPlan):
        spec = plan.spec
        # On GPUs bf16 operands (tensor cores): exact for every quantized operand (bf16 has
        # f32's exponent range); a plain f16/f32 activation keeps f32. As `gemm`'s reference.
        exact_in_bf16 = spec.fmt_lhs is not None or np.dtype(spec.lhs_dtype) == jnp.bfloat16
        gpu = plan.platform in ("cuda", "rocm")
        dtype = jnp.bfloat16 if gpu and exact_in_bf16 else jnp.float32
        return reference_ragged_gemm(lhs, rhs, sl, sr, group_sizes, alpha, row_start, spec=spec,
                                     compute_dtype=dtype, method=plan.kernel)


register_ragged_backend(ReferenceRaggedBackend())


def dequantized_rhs(rhs, sr, fmt, layout, dtype=jnp.float32) -> jax.Array:
    """rhs's values (G, N, K) without global scales (alpha carries them)."""
    return operand_values(rhs, sr, fmt, layout, dtype)
