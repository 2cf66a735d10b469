"""A block-scaled mixture-of-experts layer on 2 devices: `jax_blockscale.nn.QuantizedMoE` expert
parallel, then tensor parallel, under `jax.jit` with a mesh, against the same layer on one
device.

    python examples/moe_sharded.py              # Qwen3-30B-A3B's experts, 16 tokens
    python examples/moe_sharded.py --smoke      # tiny sizes, a few seconds (what CI runs)
    python examples/moe_sharded.py --fmt mxfp4 --tokens 256

With 2 or more GPUs it uses the first two; otherwise 2 CPU devices (the script asks XLA for
them before JAX starts). The layer (hidden 2048, intermediate 768, 128 experts, top-8 by
default) has random weights quantized once (NVFP4 with one global scale per expert, or an MX
format), bf16 activations. Each placement puts the expert weights' elements, blocked scales and
global scales on a 1-D mesh "d" of 2 devices, replicates the router and the tokens, and prints

  * each weight's shard on one device (the placement the compiled program keeps);
  * the largest difference to the one-device layer: none (bit for bit) when the experts or N
    are split, since every output element is computed by one device from the same operands;
    with down split on K the f32 partial sums are added across devices and rounded to bf16
    once, so a few elements differ by one bf16 step;
  * the collectives of the compiled program, and whether any of them moves an expert weight
    (none should: expert parallel combines the experts' rows with one all-reduce per ragged
    GEMM; tensor parallel moves activations only).

Placements:
  expert parallel            gate_up and down split on the expert axis (64 experts each)
  tensor parallel            gate_up and down split on N (their output features)
  tensor parallel, down on K gate_up on N, down on K = intermediate (Megatron's pairing)
  expert parallel, dispatched
                             the experts split as in expert parallel, and the layer built with
                             QuantizedMoE(..., mesh=mesh, expert_axis="d"): the tokens are split
                             over the devices and each routed row is sent only to its expert's
                             device and back (all-to-all; ragged_all_to_all on GPUs); bit for bit
  expert parallel, reduce    the experts split as in expert parallel, the layer built with
                             exchange="reduce": every device keeps every token, runs its own
                             experts' rows and its share of each token's combine, and one f32
                             all-reduce sums the shares (to f32 rounding: a few bf16 steps)
  tensor parallel, paired    the layer built with QuantizedMoE(..., mesh=mesh, tensor_axis="d"):
                             its experts re-laid once so that each device holds the gate and up
                             rows of the same half of the intermediate features and the matching
                             columns of down; SwiGLU stays on the device, the combined f32
                             partial outputs are summed by one all-reduce (the one-device layer
                             to the bf16 rounding of its expert outputs: many outputs one bf16
                             step apart, none further)
"""
from __future__ import annotations

import argparse
import os
import re

# NVLink multicast (NVLS) stays off unless asked for: some machines fail to set it up.
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
# 2 CPU devices where there are not 2 GPUs; must be asked for before JAX starts (the flag only
# affects the host platform, so it is harmless on GPUs).
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_force_host_platform_device_count=2").strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

try:
    import jax_blockscale as jbs  # noqa: E402
except ImportError:  # run from a checkout without `pip install .`
    import sys
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    import jax_blockscale as jbs  # noqa: E402
from jax_blockscale import nn as jnn  # noqa: E402

# name: (gate_up (E, 2I, H) spec, down (E, H, I) spec, bit for bit expected)
PLACEMENTS = {
    "expert parallel": (P("d", None, None), P("d", None, None), True),
    "tensor parallel": (P(None, "d", None), P(None, "d", None), True),
    "tensor parallel, down on K": (P(None, "d", None), P(None, None, "d"), False),
}
COLLECTIVE = re.compile(r"=\s*(\(?[^=]*?\)?)\s+(all-gather|all-reduce|reduce-scatter|"
                        r"ragged-all-to-all|all-to-all|collective-permute)(?:-start)?\(")
SHAPE = re.compile(r"([a-z][a-z0-9]*)\[([0-9,]*)\]")


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny sizes (for tests)")
    p.add_argument("--fmt", default="nvfp4", help="expert format: nvfp4, mxfp4, mxfp8_e4m3, ...")
    p.add_argument("--tokens", type=int)
    p.add_argument("--hidden", type=int)
    p.add_argument("--intermediate", type=int)
    p.add_argument("--experts", type=int)
    p.add_argument("--top-k", type=int)
    args = p.parse_args()
    # Every N and K shard must be whole blocked-scale tiles: N / 2 a multiple of 128 rows,
    # K / 2 of 4 blocks (128 elements for MX formats).
    sizes = (dict(tokens=16, hidden=256, intermediate=256, experts=8, top_k=2) if args.smoke else
             dict(tokens=16, hidden=2048, intermediate=768, experts=128, top_k=8))
    for k, v in sizes.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    return args


def two_devices():
    """The first 2 GPUs if there are 2, else 2 CPU devices (forced above)."""
    try:
        gpus = jax.devices("gpu")
    except RuntimeError:
        gpus = []
    devices = gpus if len(gpus) >= 2 else jax.devices("cpu")
    if len(devices) < 2:
        raise SystemExit(f"needs 2 devices, found {devices}; XLA_FLAGS={os.environ['XLA_FLAGS']}")
    return devices[:2]


def shard_state(state, mesh, gate_up_spec, down_spec):
    """The layer's state placed on the mesh: each expert weight's arrays on its spec (its
    scales and global scales following, `jnn.expert_shardings`), the router replicated."""
    return jax.device_put(state, jnn.expert_shardings(state, mesh, gate_up=gate_up_spec,
                                                      down=down_spec))


def leaves_by_name(state):
    """[(path names, leaf)] of a layer's state, e.g. (("gate_up", "value", "data"), array)."""
    return [([str(getattr(k, "key", getattr(k, "name", k))) for k in path], leaf)
            for path, leaf in jax.tree_util.tree_leaves_with_path(state)]


def collectives(hlo_text):
    """[(name, [(dtype, dims), ...])] of every collective in a compiled program's text."""
    found = []
    for line in hlo_text.splitlines():
        m = COLLECTIVE.search(line)
        if m:
            shapes = [(dt, tuple(int(d) for d in dims.split(",") if d))
                      for dt, dims in SHAPE.findall(m.group(1))]
            found.append((m.group(2), shapes))
    return found


def hlo_dtype(dtype):
    """The HLO text's name of a dtype: float32 -> f32, bfloat16 -> bf16, float4_e2m1fn ->
    f4e2m1fn, float8_e4m3fn -> f8e4m3fn."""
    name = np.dtype(dtype).name
    if name == "bfloat16":
        return "bf16"
    return "f" + name[5:].replace("_", "") if name.startswith("float") else name


def weight_dims(*weights):
    """(dtype, dims) of every expert-weight array, whole and as a 2-device shard (one dim
    halved), and flattened: the dtype keeps an activation of the same element count from
    matching."""
    out = set()
    for w in weights:
        for a in (w.data, w.scales, w.global_scale):
            if a is not None and a.ndim:
                forms = {tuple(a.shape)}
                forms.update(a.shape[:i] + (d // 2,) + a.shape[i + 1:]
                              for i, d in enumerate(a.shape) if d % 2 == 0)
                forms |= {(int(np.prod(f)),) for f in forms}
                out.update((hlo_dtype(a.dtype), f) for f in forms)
    return out


def describe(found):
    counts = {}
    for name, shapes in found:
        shape = shapes[-1] if shapes else ("", ())
        key = f"{name} {shape[0]}[{','.join(map(str, shape[1]))}]"
        counts[key] = counts.get(key, 0) + 1
    return ", ".join(f"{k} x{n}" for k, n in sorted(counts.items())) or "none"


def main():
    args = parse_args()
    jbs.get_format(args.fmt)  # an unknown format fails here, before any weight is built
    devices = two_devices()
    platform = devices[0].platform
    mesh = Mesh(np.asarray(devices), ("d",), axis_types=(AxisType.Auto,))
    print(f"2 {platform} devices; QuantizedMoE {args.fmt} experts, bf16 activations: "
          f"{args.tokens} tokens, hidden {args.hidden}, intermediate {args.intermediate}, "
          f"{args.experts} experts, top-{args.top_k}")

    layer = jnn.QuantizedMoE(args.hidden, args.intermediate, args.experts, args.top_k,
                             fmt=args.fmt, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(layer)
    x = jax.random.normal(jax.random.PRNGKey(1), (args.tokens, args.hidden), jnp.bfloat16)
    forward = jax.jit(lambda s, x: nnx.merge(graphdef, s)(x))

    # The reference: the same jitted layer with every operand on one device.
    want = np.asarray(forward(*jax.device_put((state, x), devices[0])))
    weights = (layer.gate_up.get_value(), layer.down.get_value())
    moved_dims = weight_dims(*weights)
    x_rep = jax.device_put(x, NamedSharding(mesh, P()))

    # the same weights, dispatching tokens to the experts' devices
    dispatched = jnn.QuantizedMoE(args.hidden, args.intermediate, args.experts, args.top_k,
                                  fmt=args.fmt, rngs=nnx.Rngs(0), mesh=mesh, expert_axis="d")
    d_graphdef, d_state = nnx.split(dispatched)
    d_forward = jax.jit(lambda s, x: nnx.merge(d_graphdef, s)(x))
    # ... and keeping every token on every device, one all-reduce of the combined shares
    reduced = jnn.QuantizedMoE(args.hidden, args.intermediate, args.experts, args.top_k,
                               fmt=args.fmt, rngs=nnx.Rngs(0), mesh=mesh, expert_axis="d",
                               exchange="reduce")
    r_graphdef, r_state = nnx.split(reduced)
    r_forward = jax.jit(lambda s, x: nnx.merge(r_graphdef, s)(x))
    # ... and splitting every expert's intermediate features, gate and up paired per device
    paired = jnn.QuantizedMoE(args.hidden, args.intermediate, args.experts, args.top_k,
                              fmt=args.fmt, rngs=nnx.Rngs(0), mesh=mesh, tensor_axis="d")
    t_graphdef, t_state = nnx.split(paired)
    t_forward = jax.jit(lambda s, x: nnx.merge(t_graphdef, s)(x))
    runs = [(name, forward, state, specs) for name, specs in PLACEMENTS.items()]
    gate_up_spec, down_spec, _ = PLACEMENTS["expert parallel"]
    runs.append(("expert parallel, dispatched", d_forward, d_state,
                 (gate_up_spec, down_spec, True)))
    runs.append(("expert parallel, reduce", r_forward, r_state,
                 (gate_up_spec, down_spec, False)))
    runs.append(("tensor parallel, paired", t_forward, t_state,
                 (P(None, "d", None), P(None, None, "d"), False)))
    for name, fwd, st, (gate_up_spec, down_spec, exact) in runs:
        sharded = shard_state(st, mesh, gate_up_spec, down_spec)
        got = np.asarray(fwd(sharded, x_rep))
        same = np.array_equal(got.view(np.uint16), want.view(np.uint16))
        diff = float(np.max(np.abs(got.astype(np.float32) - want.astype(np.float32))))
        scale = float(np.max(np.abs(want.astype(np.float32))))
        note = "" if exact else ", f32 partial sums or shares added across devices"
        if fwd is t_forward:
            note = ", down's outputs combined in f32, not rounded to bf16 first"
        print(f"\n{name}: max |sharded - unsharded| {diff:.3g} (output max {scale:.3g}; "
              f"bitwise equal: {'yes' if same else 'no'}{note})")
        per_device = {names[0]: leaf.addressable_shards[0].data.shape
                      for names, leaf in leaves_by_name(sharded) if names[-1] == "data"}
        print(f"  per device: gate_up elements {per_device['gate_up']} of "
              f"{weights[0].shape}, down elements {per_device['down']} of {weights[1].shape}")
        found = collectives(fwd.lower(sharded, x_rep).compile().as_text())
        moved = [(c, s) for c, shapes in found for s in shapes if s in moved_dims]
        print(f"{name} collectives: {describe(found)}")
        print(f"  expert weights moved: {moved if moved else 'none'}")
    if platform == "cpu":
        print("\n(on the CPU, XLA computes bf16 collectives in f32; on GPUs they stay bf16)")


if __name__ == "__main__":
    main()
