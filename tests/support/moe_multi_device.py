"""Expert-, tensor- and K-parallel MoE checks on a 2-device mesh, shared by the 2-GPU test
(tests/gpu/test_moe_multi_gpu.py, in process) and its CPU twin (tests/unit/test_moe_sharding.py,
a child process with 8 forced CPU devices).

Each check builds one problem at small Qwen3-MoE-like shapes, runs it under `jax.jit` once
unsharded (every operand on one device) and once with the expert weights placed on a mesh, and
asserts
  * the result equals the unsharded one: bit for bit where each output element is computed by
    one device from the same operands (experts split, N split); where K is split the partial
    products are summed in f32 across devices, so an f32 output matches to f32 rounding and a
    bf16 output (the layer's) in all but a few elements, which differ by a bf16 rounding step;
  * the compiled program's collectives are exactly the expected reductions (an all-reduce of
    (rows, N) per expert-split or K-split ragged_gemm, none for an N split) plus, for the
    tensor-parallel layer, moves of activations (never of a weight: no collective takes or
    produces an array shaped like an expert weight or a 2-device shard of one, and none moves
    more elements than the largest activation);
  * the compiled program takes the weights as they were placed (not gathered on entry), and
    ragged_gemm went through the package's partitioning rule.

Only jax, numpy, flax and jax_blockscale are imported; the caller picks the devices.
"""
from __future__ import annotations

import dataclasses
import re
from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

import jax_blockscale as jbs
from jax_blockscale import nn as jnn
from jax_blockscale.lowering import ALL_PLATFORMS
from jax_blockscale.lowering.registry import get_ragged_backend, register_ragged_backend
from jax_blockscale.ragged import dispatch

# Qwen3-30B-A3B has hidden 2048, intermediate 768, 128 experts, top-8. These are small enough
# for a CPU and keep what matters: every expert gets rows (32 tokens x top-4 over 16 experts),
# and every N / K shard is whole blocked-scale tiles over 2 devices (N % 256 == 0; K % 256 == 0,
# 4 MX blocks of 32 per scale tile). The widths differ (2I = 512 != H = 768) so that each
# collective's shape says which GEMM it belongs to.
HIDDEN, INTERMEDIATE, EXPERTS, TOP_K, TOKENS = 768, 256, 16, 4, 32
ROWS = TOKENS * TOP_K  # the sorted (token, expert) pairs: the rows of both expert GEMMs
# ragged_gemm alone: G experts, (M, K) rows x (G, N, K) experts
G, M, N, K = 16, 128, 768, 512

MOVES = frozenset({"all-gather", "collective-permute", "all-to-all"})  # activations only


@dataclasses.dataclass(frozen=True)
class Expect:
    """What a placement must give. `match`: "exact" (bitwise), "f32" (f32 output of a K split),
    "bf16" (bf16 output downstream of a K split). `reductions`: (rows, cols) of each all-reduce,
    with the dtypes it may have: a K split reduces in f32 by design; an expert split reduces in
    the output dtype (bf16), which XLA's CPU backend promotes to f32 (all-reduce-promotion), so
    both are accepted there. `moves`: the collectives allowed to move activations."""
    match: str
    reductions: tuple = ()
    moves: frozenset = frozenset()


EITHER = ("bf16", "f32")
RAGGED_CASES = {
    # name: (lhs spec (M, K), rhs spec (G, N, K), out dtype, expectation)
    "experts": (P(None, None), P("d", None, None), jnp.bfloat16,
                Expect("exact", (((M, N), EITHER),))),
    "n": (P(None, None), P(None, "d", None), jnp.bfloat16, Expect("exact")),
    "k": (P(None, "d"), P(None, None, "d"), jnp.float32, Expect("f32", (((M, N), ("f32",)),))),
}
# The layer: (gate_up (E, 2I, H) spec, down (E, H, I) spec, expectation).
#  "experts": each device holds half the experts of both weights; each ragged_gemm's rows are
#    combined by one all-reduce (gate_up's (rows, 2I), down's (rows, H)).
#  "tensor": N of both weights split. SwiGLU pairs gate column j with up column j, but an N
#    split of the fused weight (gate rows, then up rows) puts gate on one device and up on the
#    other, and down needs all of I: XLA moves the activations (half of h each way, then the
#    SwiGLU output gathered). Nothing is reduced: every output element comes from one device.
#  "tensor_k": Megatron's pairing (gate_up on N, down on K = I): the same exchange of h, then
#    down's partial products summed by one f32 all-reduce of (rows, H).
LAYER_CASES = {
    "experts": (P("d", None, None), P("d", None, None),
                Expect("exact", (((ROWS, 2 * INTERMEDIATE), EITHER), ((ROWS, HIDDEN), EITHER)))),
    "tensor": (P(None, "d", None), P(None, "d", None), Expect("exact", (), MOVES)),
    "tensor_k": (P(None, "d", None), P(None, None, "d"),
                 Expect("bf16", (((ROWS, HIDDEN), ("f32",)),), MOVES)),
}


def mesh_of(devices, n=2):
    assert len(devices) >= n, f"needs {n} devices, got {devices}"
    return Mesh(np.asarray(devices[:n]), ("d",), axis_types=(AxisType.Auto,))


def rand(seed, shape, scale=1.0):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32) * scale


def place(mesh, x, spec):
    """device_put an array or BlockScaled (G, N, K) on `spec`: the blocked scales follow the
    elements' tile dims, a per-expert global scale follows G."""
    put = lambda v, s: jax.device_put(v, NamedSharding(mesh, s))
    if not isinstance(x, jbs.BlockScaled):
        return put(x, spec)
    gs = x.global_scale
    if gs is not None and jnp.ndim(gs) == 1:
        gs = put(gs, P(spec[0]))
    extra = (None,) * 3 if x.layout == "blocked" else ()
    return jbs.BlockScaled(put(x.data, spec), put(x.scales, P(*spec, *extra)), gs, x.fmt,
                           x.layout)


# ---------------------------------------------------------------------------------------------
# Reading the compiled program


@dataclasses.dataclass(frozen=True)
class Collective:
    name: str  # "all-reduce", "all-gather", ... ("-start" of an async pair folded in)
    results: tuple  # ((dtype, dims), ...) it produces
    shapes: tuple  # every (dtype, dims) in its result type (async starts list operands too)


_INSTR = re.compile(r"=\s*(\(?[^=]*?\)?)\s+(all-gather|all-reduce|reduce-scatter|"
                    r"ragged-all-to-all|all-to-all|collective-permute)(-start)?\(")
_TUPLE_INDEX = re.compile(r"/\*index=\d+\*/")  # XLA numbers every fifth element of a tuple
_SHAPE = re.compile(r"([a-z][a-z0-9]*)\[([0-9,]*)\]")


def collectives(hlo_text) -> list[Collective]:
    """The collectives of a compiled program's text, with their shapes."""
    found = []
    for line in hlo_text.splitlines():
        line = _TUPLE_INDEX.sub("", line)
        m = _INSTR.search(line)
        if not m:
            continue
        shapes = tuple((dt, tuple(int(d) for d in dims.split(",") if d))
                       for dt, dims in _SHAPE.findall(m.group(1)))
        results = shapes
        if m.group(3) and m.group(2) != "all-reduce":
            # an async start's type is (operands..., results..., [u32[] contexts]): the second
            # half of its arrays are the results
            arrays = tuple(s for s in shapes if s[1]) or shapes
            results = arrays[len(arrays) // 2:]
        found.append(Collective(m.group(2), results, shapes))
    return found


def summary(found: list[Collective]) -> str:
    """e.g. "all-reduce f32[128,768] x1, collective-permute f32[128,128] x2"."""
    counts = Counter((c.name, dt, dims) for c in found for dt, dims in c.results)
    return ", ".join(f"{name} {dt}[{','.join(map(str, dims))}] x{n}"
                     for (name, dt, dims), n in sorted(counts.items())) or "none"


def hlo_dtype(dtype) -> str:
    """The name XLA's HLO text gives a numpy / ml_dtypes dtype: float32 -> f32, bfloat16 ->
    bf16, int32 -> s32, uint8 -> u8, float4_e2m1fn -> f4e2m1fn, float8_e4m3fn -> f8e4m3fn."""
    name = np.dtype(dtype).name
    if name == "bfloat16":
        return "bf16"
    if name.startswith("float"):
        return "f" + name[len("float"):].replace("_", "")
    if name.startswith("uint"):
        return "u" + name[len("uint"):]
    if name.startswith("int"):
        return "s" + name[len("int"):]
    return name


def weight_shapes(*weights):
    """(HLO dtype, dims) of every array of the given BlockScaled weights, whole and as a shard of
    up to 8 devices (any one dim divided), each also flattened to 1-D (XLA's GPU pipeline hands
    NCCL flat buffers) and, for packed FP4 elements, as the bytes XLA may move them as (u8 / s8,
    last dim halved): a collective taking or producing one of these moves a weight. The dtype is
    part of the match, so an activation (bf16 / f32) or an int32 count never matches a weight
    (FP4 / FP8 elements and scales) by a coincidence of element counts."""
    out = set()
    for w in weights:
        for a in (w.data, w.scales, w.global_scale):
            if a is None or jnp.ndim(a) == 0:
                continue
            dims = tuple(a.shape)
            forms = {dims}
            forms.update(dims[:i] + (d // p,) + dims[i + 1:] for i, d in enumerate(dims)
                         for p in (2, 4, 8) if d % p == 0)
            dtypes = {hlo_dtype(a.dtype)}
            if np.dtype(a.dtype).itemsize == 1 and "4" == hlo_dtype(a.dtype)[1:2]:
                # FP4 elements moved as bytes: two per byte along the last dim
                byte_forms = {f[:-1] + (f[-1] // 2,) for f in forms if f[-1] % 2 == 0}
                out.update((dt, f) for dt in ("u8", "s8") for f in byte_forms)
                out.update((dt, (int(np.prod(f)),)) for dt in ("u8", "s8") for f in byte_forms)
            for dt in dtypes:
                out.update((dt, f) for f in forms)
                out.update((dt, (int(np.prod(f)),)) for f in forms)
    return out


def _unflattened(dims, expected):
    """`dims` as the expected 2-D shape it flattens (XLA's GPU pipeline hands NCCL 1-D buffers:
    an all-reduce of (128, 768) reads f32[98304] there), else as it is."""
    if len(dims) == 1:
        for want in expected:
            if int(np.prod(want)) == dims[0]:
                return want
    return dims


def check_hlo(compiled_text, weights, expect: Expect, max_moved: int, scalar_reductions=False):
    """The compiled program moves no weight, reduces exactly `expect.reductions` (plus scalar
    all-reduces where `scalar_reductions`: an NVFP4 activation's global amax) and moves
    activations of at most `max_moved` elements, only with `expect.moves`. Returns the
    collectives."""
    found = collectives(compiled_text)
    text = summary(found)
    wshapes = weight_shapes(*weights)
    for c in found:
        bad = [s for s in c.shapes if s in wshapes]
        assert not bad, f"{c.name} moves an expert weight {bad}; collectives: {text}"
    want = sorted(dims for dims, _ in expect.reductions)
    reductions = [(dt, _unflattened(dims, want)) for c in found if c.name == "all-reduce"
                  for dt, dims in c.results if dims or not scalar_reductions]
    assert sorted(dims for _, dims in reductions) == want, \
        f"all-reduces {sorted(reductions)}, expected shapes {want}; collectives: {text}"
    for dims, dtypes in expect.reductions:
        got = {dt for dt, d in reductions if d == dims}
        assert got <= set(dtypes), f"all-reduce of {dims} in {got}, expected {dtypes}"
    others = {c.name for c in found} - {"all-reduce"}
    assert others <= expect.moves, f"unexpected {sorted(others - expect.moves)}: {text}"
    for c in found:
        if c.name != "all-reduce":
            big = [s for s in c.shapes if np.prod(s[1], dtype=np.int64) > max_moved]
            assert not big, f"{c.name} moves {big}, more than any activation ({max_moved} " \
                            f"elements); collectives: {text}"
    return found


def assert_match(got, want, match, what):
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert got.shape == want.shape, (got.shape, want.shape)
    diff = got.view(np.uint32) != want.view(np.uint32)
    row_max = np.abs(want).max(axis=-1, keepdims=True) + 1e-30
    err = float(np.max(np.abs(got - want) / row_max))
    detail = (f"{what}: {int(diff.sum())} of {got.size} elements differ from the unsharded "
              f"call, max error {err:.2e} of the row's magnitude")
    if match == "exact":
        assert not diff.any(), detail
    elif match == "f32":  # f32 partial sums added in another order: a few ulps of the row
        assert err < 1e-5, detail
        assert np.linalg.norm(got - want) / np.linalg.norm(want) < 1e-5, detail
    elif match == "bf16":
        # f32 partial sums rounded to bf16 once: where the two f32 sums straddle a bf16
        # rounding boundary the outputs differ by one bf16 step (2^-8..2^-7 relative), which
        # the layer's weighted combine carries on. A wrong shard or a dropped partial sum
        # changes most elements, and by far more.
        assert diff.mean() < 0.01 and err < 2.0 ** -6, detail
    else:
        raise ValueError(match)


def expect_sharded(compiled, args):
    """The compiled program takes every placed array as it was placed (not gathered on entry)."""
    in_shardings = jax.tree.leaves(compiled.input_shardings[0])
    leaves = jax.tree.leaves(args)
    assert len(in_shardings) == len(leaves)
    for s, leaf in zip(in_shardings, leaves):
        if isinstance(leaf, jax.Array) and isinstance(leaf.sharding, NamedSharding):
            assert s.is_equivalent_to(leaf.sharding, leaf.ndim), (s, leaf.sharding)


# ---------------------------------------------------------------------------------------------
# ragged_gemm on its own


def ragged_problem(fmt="nvfp4", seed=0):
    x = jnp.asarray(rand(seed, (M, K)), jnp.bfloat16)
    gkw = dict(global_scale="per_matrix") if fmt == "nvfp4" else {}
    w = jax.jit(lambda w: jbs.quantize(w, fmt, layout="blocked", **gkw))(
        rand(seed + 1, (G, N, K), 1 / np.sqrt(K)))
    # uneven routing: empty experts, a heavy one, a sum below M (rows past it are zero)
    gs = np.array([0, 9, 0, 3, 20, 1, 3, 0, 7, 0, 15, 2, 0, 31, 6, 10], np.int32)
    assert gs.size == G and gs.sum() < M
    return x, w, jnp.asarray(gs)


def check_ragged(devices, case, fmt="nvfp4"):
    """ragged_gemm with its experts (G), N or K split over 2 devices equals the unsharded call.
    Returns the sharded program's collectives."""
    lhs_spec, rhs_spec, out_dtype, expect = RAGGED_CASES[case]
    mesh = mesh_of(devices)
    x, w, gs = ragged_problem(fmt)
    f = jax.jit(lambda x, w, g: jbs.ragged_gemm(x, w, g, out_dtype=out_dtype))
    want = f(*jax.device_put((x, w, gs), devices[0]))
    args = (place(mesh, x, lhs_spec), place(mesh, w, rhs_spec), place(mesh, gs, P()))
    got = f(*args)
    assert got.dtype == out_dtype
    assert_match(got, want, expect.match, f"ragged_gemm, {case} split ({fmt})")
    assert not np.any(np.asarray(got, np.float32)[int(gs.sum()):])
    lowered = f.lower(*args)
    assert "CustomSPMDPartitioning" in lowered.as_text()  # the package's rule decides
    compiled = lowered.compile()
    expect_sharded(compiled, args)
    if case == "n":  # the output keeps N split: nothing to combine
        assert tuple(got.sharding.spec)[1:2] == ("d",), got.sharding
    return check_hlo(compiled.as_text(), [w], expect, max_moved=M * max(N, K))


class _PlanRecorder:
    """A ragged backend that runs the reference and records each shard's RaggedSpec."""
    name, priority = "plan_recorder", -1
    platforms = ALL_PLATFORMS

    def __init__(self):
        self.specs = []

    def plan(self, spec, platform):
        self.specs.append(spec)
        return get_ragged_backend("reference").plan(spec, platform)

    def __call__(self, *operands, plan):
        return get_ragged_backend("reference")(*operands, plan=plan)


def check_shards_plan_as_unsharded(devices):
    """Each shard of an expert-, N- or M-split ragged_gemm is planned with the unsharded
    problem's (M, N, G) (so the kernels split K as one device would, and round the same); with K
    split each shard plans for itself. Returns {case: plan_shape of the shards}."""
    recorder = _PlanRecorder()
    register_ragged_backend(recorder)
    mesh = mesh_of(devices)
    x, w, gs = ragged_problem("mxfp4")
    cases = {"experts": (P(None, None), P("d", None, None), (M, N, G), (M, N, G // 2)),
             "n": (P(None, None), P(None, "d", None), (M, N, G), (M, N // 2, G)),
             "m": (P("d", None), P(None, None, None), (M, N, G), (M // 2, N, G)),
             "k": (P(None, "d"), P(None, None, "d"), None, (M, N, G))}
    found = {}
    for case, (lhs_spec, rhs_spec, plan_shape, local) in cases.items():
        recorder.specs.clear()
        f = jax.jit(lambda x, w, g: jbs.ragged_gemm(x, w, g, backend=recorder.name))
        f.lower(place(mesh, x, lhs_spec), place(mesh, w, rhs_spec), place(mesh, gs, P())
                ).compile()
        shards = [s for s in recorder.specs if (s.m, s.n, s.groups) == local]
        assert shards, f"{case}: no shard of shape {local} was planned: {recorder.specs}"
        assert {s.plan_shape for s in shards} == {plan_shape}, (case, shards)
        found[case] = plan_shape
    # gemm(x, stack, layer=i) past index mode's rows: the sliced layer's gemm keeps the plan of
    # the unsharded layer too. Every plan made for the shard (M, N/2) is the unsharded layer's
    # (M, N) plan run on it (lowering/plan.py: as_shard, recorded here with the plan it is given).
    # More than one planner may ask: on Hopper the grouped planner's index mode first tries the
    # layer's plan in place (as_shard on the shard's own spec, whose plan_shape it does not
    # carry: it planned the whole layer itself), then hands the sliced layer to gemm's planner
    # (the shard's spec with plan_shape). What matters is the plan each was given.
    from jax_blockscale.lowering import plan as planner  # noqa: PLC0415
    seen, as_shard = [], planner.as_shard
    planner.as_shard = lambda whole, spec: (seen.append(((whole.spec.m, whole.spec.n),
                                                         (spec.m, spec.n)))
                                            or as_shard(whole, spec))
    try:
        f = jax.jit(lambda x, w: jbs.gemm(x, w, layer=3))
        f.lower(place(mesh, x, P(None, None)), place(mesh, w, P(None, "d", None))).compile()
    finally:
        planner.as_shard = as_shard
    assert seen, "the shard of gemm(x, stack, layer=3) split on N was not planned as a shard"
    assert set(seen) == {((M, N), (M, N // 2))}, seen
    found["layer, n"] = ((), (), M, N)
    return found


# gemm(x, stack, layer=i) (ragged_gemm's index mode): (x spec (M, K), stack spec (L, N, K),
# out dtype, how it must match the unsharded call). The stack axis itself is never split by
# the rule (every device needs the layer it runs): a stack placed split on it is gathered.
LAYER_INDEX_CASES = {
    "n": (P(None, None), P(None, "d", None), jnp.bfloat16, "exact"),
    "k": (P(None, "d"), P(None, None, "d"), jnp.float32, "f32"),
    "m": (P("d", None), P(None, None, None), jnp.bfloat16, "exact"),
    "stack": (P(None, None), P("d", None, None), jnp.bfloat16, "exact"),
}


def check_layer_index(devices, case, fmt="nvfp4"):
    """gemm(x, stack, layer=i) with M, N, K or the stack split over 2 devices equals the
    unsharded call, for every layer index (clamped past the end)."""
    x_spec, w_spec, out_dtype, match = LAYER_INDEX_CASES[case]
    mesh = mesh_of(devices)
    x, w, _ = ragged_problem(fmt)
    f = jax.jit(lambda x, w, i: jbs.gemm(x, w, layer=i, out_dtype=out_dtype))
    args = (place(mesh, x, x_spec), place(mesh, w, w_spec))
    lowered = f.lower(*args, 3)
    assert "CustomSPMDPartitioning" in lowered.as_text()  # the package's rule decides
    for i in (0, 5, G - 1, G + 4):
        want = f(*jax.device_put((x, w), devices[0]), i)
        assert_match(f(*args, i), want, match, f"gemm(layer={i}), {case} split ({fmt})")


def check_catches_weight_gather(devices, fmt="nvfp4"):
    """The HLO check is not vacuous: a program that gathers the expert weights (a sharding
    constraint replicating them before ragged_gemm) must fail it. Returns the failure."""
    mesh = mesh_of(devices)
    x, w, gs = ragged_problem(fmt)
    replicate = lambda a: jax.lax.with_sharding_constraint(a, NamedSharding(mesh, P()))
    f = jax.jit(lambda x, w, g: jbs.ragged_gemm(x, jax.tree.map(replicate, w), g))
    args = (place(mesh, x, P()), place(mesh, w, P("d", None, None)), place(mesh, gs, P()))
    text = f.lower(*args).compile().as_text()
    try:
        check_hlo(text, [w], RAGGED_CASES["experts"][3], max_moved=M * max(N, K))
    except AssertionError as e:
        return str(e)
    raise AssertionError(f"a gathered weight passed the check: {summary(collectives(text))}")


# ---------------------------------------------------------------------------------------------
# The QuantizedMoE layer


def moe_layer(fmt="nvfp4", act_fmt=None, seed=0):
    moe = jnn.MoE(HIDDEN, INTERMEDIATE, EXPERTS, TOP_K, rngs=nnx.Rngs(seed))
    return jnn.QuantizedMoE.from_float(moe, fmt, act_fmt=act_fmt)


def shard_layer(state, mesh, gate_up_spec, down_spec):
    """The layer's state with gate_up / down (elements, scales, global scales) on their specs
    and the router replicated (`jnn.expert_shardings`, whose own test spells the specs out)."""
    return jax.device_put(state, jnn.expert_shardings(state, mesh, gate_up=gate_up_spec,
                                                      down=down_spec))


def check_layer(devices, case, fmt="nvfp4", act_fmt=None):
    """A QuantizedMoE layer with its experts split over 2 devices ("experts"), N of both
    weights split ("tensor") or gate_up on N and down on K ("tensor_k"), under jit, equals the
    unsharded layer. Returns the sharded program's collectives."""
    gate_up_spec, down_spec, expect = LAYER_CASES[case]
    mesh = mesh_of(devices)
    layer = moe_layer(fmt, act_fmt)
    graphdef, state = nnx.split(layer)
    x = jnp.asarray(rand(7, (TOKENS, HIDDEN)), jnp.bfloat16)
    f = jax.jit(lambda s, x: nnx.merge(graphdef, s)(x))
    want = f(*jax.device_put((state, x), devices[0]))
    sharded = shard_layer(state, mesh, gate_up_spec, down_spec)
    xs = jax.device_put(x, NamedSharding(mesh, P()))
    got = f(sharded, xs)
    assert got.dtype == jnp.bfloat16
    assert_match(got, want, expect.match, f"QuantizedMoE, {case} parallel ({fmt}, act {act_fmt})")
    lowered = f.lower(sharded, xs)
    assert "CustomSPMDPartitioning" in lowered.as_text()
    compiled = lowered.compile()
    expect_sharded(compiled, (sharded, xs))
    weights = [layer.gate_up.get_value(), layer.down.get_value()]
    act_global = act_fmt is not None and jbs.get_format(act_fmt).has_global_scale
    return check_hlo(compiled.as_text(), weights, expect,
                     max_moved=ROWS * max(2 * INTERMEDIATE, HIDDEN),
                     scalar_reductions=act_global)


# ---------------------------------------------------------------------------------------------
# Expert parallelism that dispatches tokens (QuantizedMoE(mesh=, expert_axis=))

# routing: how the router is rigged (a feature every token shares dominates the logits)
#   "random"  the router as initialized: every expert gets rows
#   "uneven"  every token's experts among the first top_k: one device gets every row
#   "empty"   only even experts are chosen: odd experts get no rows (with 8 devices, every
#             other device has nothing to compute)
#   "balanced" every token's experts are the first top_k/2 of each half of the experts: on 2
#             devices each gets exactly its even share of the rows
DISPATCH_ROUTINGS = ("random", "uneven", "empty")


def dispatch_problem(fmt, routing, act_fmt=None, tokens=TOKENS, seed=0, mesh=None,
                     exchange="auto"):
    """(one-device layer, dispatching layer on `mesh`, tokens x) with the same weights."""
    moe, x = rigged_moe(routing, tokens, seed)
    one = jnn.QuantizedMoE.from_float(moe, fmt, act_fmt=act_fmt)
    ep = jnn.QuantizedMoE.from_float(moe, fmt, act_fmt=act_fmt, mesh=mesh, expert_axis="d",
                                     exchange=exchange)
    return one, ep, x


def rigged_moe(routing, tokens=TOKENS, seed=0):
    """(float MoE whose router gives `routing`, tokens x (tokens, HIDDEN) bf16)."""
    moe = jnn.MoE(HIDDEN, INTERMEDIATE, EXPERTS, TOP_K, rngs=nnx.Rngs(seed))
    x = rand(7, (tokens, HIDDEN))
    if routing != "random":
        favoured = {"uneven": np.arange(TOP_K), "empty": np.arange(0, EXPERTS, 2),
                    "balanced": np.concatenate([np.arange(TOP_K // 2),
                                                EXPERTS // 2 + np.arange(TOP_K // 2)])}[routing]
        router = np.array(moe.router[...]) * 0.01
        router[0, :] = -50.0
        router[0, favoured] = 50.0
        router[1:, favoured] += rand(seed + 3, (HIDDEN - 1, len(favoured)))  # among them: random
        moe.router[...] = jnp.asarray(router)
        x[:, 0] = 4.0
    return moe, jnp.asarray(x, jnp.bfloat16)


def dispatch_moves(found, weights, *, rows_dtype="bf16"):
    """The dispatching layer's collectives move routed rows (bf16, or f32 on forced CPU
    devices) and integer counts / offsets only: no weight by (dtype, dims), no other dtype.
    (The layer's offsets are int32; XLA's GPU ragged all-to-all may carry them as s64.)"""
    wshapes = weight_shapes(*weights)
    text = summary(found)
    for c in found:
        bad = [s for s in c.shapes if s in wshapes]
        assert not bad, f"{c.name} moves an expert weight {bad}; collectives: {text}"
        other = {dt for dt, dims in c.shapes if dims} - {rows_dtype, "f32", "s32", "s64", "u32"}
        assert not other, f"{c.name} moves {other}: neither rows nor counts; {text}"


def run_expert_parallel(devices, n, fmt, routing, act_fmt, tokens, exchange):
    """The one-device layer and QuantizedMoE(mesh=, expert_axis=, exchange=) on n devices (its
    experts split, x replicated), both jitted and run on the same weights and tokens: (the
    sharded layer, its output, the one-device output, its compiled program, its arguments)."""
    mesh = mesh_of(devices, n)
    one, ep, x = dispatch_problem(fmt, routing, act_fmt, tokens, mesh=mesh, exchange=exchange)
    g1, s1 = nnx.split(one)
    g2, s2 = nnx.split(ep)
    f1 = jax.jit(lambda s, x: nnx.merge(g1, s)(x))
    f2 = jax.jit(lambda s, x: nnx.merge(g2, s)(x))
    want = f1(*jax.device_put((s1, x), devices[0]))
    placed = shard_layer(s2, mesh, P("d", None, None), P("d", None, None))
    xs = jax.device_put(x, NamedSharding(mesh, P()))
    got = f2(placed, xs)
    assert got.dtype == jnp.bfloat16 and got.shape == want.shape
    return ep, got, want, f2.lower(placed, xs).compile(), (placed, xs)


def check_dispatch(devices, n, fmt="nvfp4", routing="random", act_fmt=None, exchange="auto",
                   tokens=TOKENS, match="exact"):
    """QuantizedMoE(mesh=, expert_axis=) over n devices: the one-device layer (`match`: bit for
    bit, or, where a platform does not give that yet, to one bf16 step); its
    program exchanges rows with all-to-all (or ragged-all-to-all) only: no all-reduce of whole
    outputs (only the scalar amax of NVFP4 activations), no all-gather (tokens a multiple of
    n), no weight moved, every weight used where it was placed. Returns the collectives."""
    ep, got, want, compiled, args = run_expert_parallel(devices, n, fmt, routing, act_fmt,
                                                        tokens, exchange)
    assert_match(got, want, match, f"dispatched QuantizedMoE on {n} devices ({fmt}, "
                 f"{routing} routing, act {act_fmt}, {exchange} exchange)")
    expect_sharded(compiled, args)
    found = collectives(compiled.as_text())
    names = {c.name for c in found}
    assert names & {"all-to-all", "ragged-all-to-all"}, summary(found)
    act_global = act_fmt is not None and jbs.get_format(act_fmt).has_global_scale
    reductions = [dims for c in found if c.name == "all-reduce" for _, dims in c.results]
    if act_global:
        assert reductions and all(d == () for d in reductions), summary(found)
    else:
        assert not reductions, f"an all-reduce in the dispatching layer: {summary(found)}"
    # one all-gather: every device's per-expert row counts, (n, E) int32 (the exchanges'
    # offsets are worked out from it on each device); nothing else gathered
    experts = ep.gate_up.get_value().shape[0]
    gathers = [(str(t), tuple(dims)) for c in found if c.name == "all-gather"
               for t, dims in c.results]
    assert gathers.count(("s32", (n, experts))) == 1, summary(found)
    if tokens % n == 0:
        assert len(gathers) == 1, summary(found)
        assert not names & {"reduce-scatter", "collective-permute"}, summary(found)
    dispatch_moves(found, [ep.gate_up.get_value(), ep.down.get_value()])
    return found


def check_reduce(devices, n, fmt="nvfp4", routing="random", act_fmt=None, tokens=TOKENS):
    """QuantizedMoE(mesh=, expert_axis=, exchange="reduce") over n devices: every device keeps
    every token and runs its own experts' rows; the result is the one-device layer's to f32
    rounding (each device's share of a token's combine is summed across devices in f32, in
    another order than one device's slot-by-slot sum: outputs differ by at most a bf16 step,
    in few elements); its program's only collectives of any size sum the (tokens, hidden)
    shares: one f32 all-reduce, or, for shares of REDUCE_SCATTER_MIN_BYTES and more, an
    all-to-all of the f32 shares of each device's tokens (a reduce-scatter summed in device
    order) and an all-gather of the bf16 result (besides the scalar amax of NVFP4
    activations); no weight moved, every weight used where it was placed. Returns the
    collectives."""
    ep, got, want, compiled, args = run_expert_parallel(devices, n, fmt, routing, act_fmt,
                                                        tokens, "reduce")
    what = (f"QuantizedMoE with exchange='reduce' on {n} devices ({fmt}, {routing} routing, "
            f"act {act_fmt})")
    assert_match(got, want, "bf16", what)
    # every device's shares summed: a dropped or doubled share moves whole tokens far away
    err = np.abs(np.asarray(got, np.float32) - np.asarray(want, np.float32))
    assert float(err.max()) <= 2.0 ** -6 * float(np.abs(np.asarray(want, np.float32)).max()), what
    expect_sharded(compiled, args)
    return check_share_sum(compiled, tokens, n, act_fmt,
                           [ep.gate_up.get_value(), ep.down.get_value()])


def check_share_sum(compiled, tokens, n, act_fmt, weights):
    """The collectives of a layer that sums (tokens, hidden) f32 shares across n devices (the
    reduce and the tensor-parallel layer): its only collectives of any size are one f32
    all-reduce of (tokens, HIDDEN), or, for shares of REDUCE_SCATTER_MIN_BYTES and more, one
    all-to-all of every device's f32 shares of all tokens and one all-gather of the bf16 sums;
    scalar all-reduces exactly where NVFP4 activations calibrate a global scale; no weight
    moved. Returns the collectives."""
    found = collectives(compiled.as_text())
    text = summary(found)
    assert not {c.name for c in found} & {"ragged-all-to-all", "collective-permute",
                                          "reduce-scatter"}, text
    sized = Counter((c.name, str(t), tuple(dims)) for c in found for t, dims in c.results
                    if dims and c.name != "all-to-all")
    padded = -(-tokens // n) * n
    exchanged = [c for c in found if c.name == "all-to-all"]
    if tokens * HIDDEN * 4 >= dispatch.REDUCE_SCATTER_MIN_BYTES:
        # one all-to-all of every device's f32 shares, as one (n, T/n, H) array or as n
        # pieces (XLA splits it), of all T tokens' shares: an exchange of fewer would leave
        # some token ranges unsummed
        assert len(exchanged) == 1, text
        pieces = exchanged[0].results
        assert {t for t, _ in pieces} == {"f32"}, text
        assert sum(int(np.prod(dims)) for _, dims in pieces) == padded * HIDDEN, text
        assert all(dims[-1] == HIDDEN for _, dims in pieces), text
        # the bf16 gather: f32 where XLA's CPU backend promotes it
        gathered = [key for key in sized if key[0] == "all-gather"]
        assert gathered in ([("all-gather", "bf16", (padded, HIDDEN))],
                            [("all-gather", "f32", (padded, HIDDEN))]), text
        want_sized = {gathered[0]: 1}
    else:
        assert not exchanged, text
        want_sized = {("all-reduce", "f32", (tokens, HIDDEN)): 1}
    assert dict(sized) == want_sized, text
    act_global = act_fmt is not None and jbs.get_format(act_fmt).has_global_scale
    scalars = [c for c in found if c.name == "all-reduce" and all(not d for _, d in c.results)]
    assert bool(scalars) == act_global, text
    dispatch_moves(found, weights)
    return found


# ---------------------------------------------------------------------------------------------
# Tensor parallelism (QuantizedMoE(mesh=, tensor_axis=))


def tensor_parallel_layers(devices, n, fmt, routing, act_fmt, tokens):
    """The one-device layer, QuantizedMoE(mesh=, tensor_axis="d") on one device and on n
    devices (experts re-laid, placed split on gate_up's N and down's K; x replicated), run on
    the same weights and tokens: (one-device output, 1-device tensor-parallel output, n-device
    output, the n-device layer, its compiled program, its arguments)."""
    moe_float, x = rigged_moe(routing, tokens)
    one = jnn.QuantizedMoE.from_float(moe_float, fmt, act_fmt=act_fmt)
    outs = []
    for m in (1, n):
        mesh = mesh_of(devices, m)
        tp = jnn.QuantizedMoE.from_float(moe_float, fmt, act_fmt=act_fmt, mesh=mesh,
                                         tensor_axis="d")
        g, s = nnx.split(tp)
        placed = shard_layer(s, mesh, P(None, "d"), P(None, None, "d"))
        xs = jax.device_put(x, NamedSharding(mesh, P()))
        f = jax.jit(lambda s, x, g=g: nnx.merge(g, s)(x))
        outs.append((tp, f(placed, xs), f.lower(placed, xs).compile(), (placed, xs)))
    g1, s1 = nnx.split(one)
    want = jax.jit(lambda s, x: nnx.merge(g1, s)(x))(*jax.device_put((s1, x), devices[0]))
    (_, got1, _, _), (tp, got, compiled, args) = outs
    return want, got1, got, tp, compiled, args


def check_tensor_parallel(devices, n, fmt="nvfp4", routing="random", act_fmt=None,
                          tokens=TOKENS):
    """QuantizedMoE(mesh=, tensor_axis=) over n devices:
      * equals the same layer on one device to f32 rounding (down's K split over the devices
        sums its partial products in another order: a few bf16 outputs one step apart);
      * equals the one-device QuantizedMoE to the bf16 rounding of the expert outputs (that
        layer rounds each row of down's output to bf16 before the combine; the tensor-parallel
        layer combines the f32 partial sums): within one bf16 step of the largest output;
      * its program's only collectives of any size sum the (tokens, hidden) f32 shares (one
        all-reduce, or an all-to-all and an all-gather from REDUCE_SCATTER_MIN_BYTES), plus the
        scalar amax of NVFP4 activations; no weight moved; every weight used as placed.
    Returns the collectives."""
    want, got1, got, tp, compiled, args = tensor_parallel_layers(devices, n, fmt, routing,
                                                                 act_fmt, tokens)
    what = f"tensor-parallel QuantizedMoE on {n} devices ({fmt}, {routing} routing, act {act_fmt})"
    assert_match(got, got1, "bf16", what + ", against itself on one device")
    err = np.abs(np.asarray(got, np.float32) - np.asarray(want, np.float32))
    scale = float(np.abs(np.asarray(want, np.float32)).max())
    assert float(err.max()) <= 2.0 ** -7 * scale, (what, float(err.max()), scale)
    expect_sharded(compiled, args)
    return check_share_sum(compiled, tokens, n, act_fmt,
                           [tp.gate_up.get_value(), tp.down.get_value()])
