"""The one timing helper every benchmark here uses (so their numbers compare with each other and
with the shared anchors, /work/shared/anchors/bench_anchors.py).

Method (the anchors'): a jitted function, 2 warm-up calls (compile + first run), then `iters`
back-to-back calls bracketed by `jax.block_until_ready`; the mean per call is one sample. The
result is the median over `trials` samples. Per-call host and dispatch cost is included, as a
user calling a jitted function from Python pays it.

Rotation: an H100 / H200 has a 50 MB L2. A weight that fits (N = K = 8192 NVFP4 is 38 MB) would
be read from L2 on every call after the first, which no real model does (the other layers'
weights evict it). Pass `arg_sets=[args_0, args_1, ...]` (copies at different addresses) and the
calls cycle through them, so a weight is evicted before it is read again. `rotation_count` says
how many copies make the working set ~3x L2. Only jax is imported here (no jax_blockscale).

Device time (`device_time_us`): the same calls under jax.profiler, summing the time the GPU spent
in kernels (the union of the kernel intervals on its streams) per call. It leaves out the host
side (Python, dispatch, XLA's per-executable cost: >= 40 us per jitted call on the lent hosts, as
much as a decode GEMM's GPU time), so it is the stable measure of the kernels themselves, and
what a call costs inside a larger jitted model whose host work overlaps the GPU.
"""
from __future__ import annotations

import glob
import math
import shutil
import statistics
import tempfile
import time

import jax
import jax.numpy as jnp

L2_BYTES = 50 * 2**20  # H100 / H200 L2 (50 MB)


def _warm_calls(f, args, arg_sets, warmup):
    """The argument tuples to cycle through (`args` alone, or `arg_sets`), after `warmup` calls
    (compile + first run) cycling through them."""
    if arg_sets is None:
        arg_sets = [args]
    elif args:
        raise TypeError("pass either positional args or arg_sets, not both")
    for i in range(warmup):
        jax.block_until_ready(f(*arg_sets[i % len(arg_sets)]))
    return arg_sets


def time_us(f, *args, arg_sets=None, iters=20, trials=5, warmup=2):
    """Median over `trials` of the mean time (microseconds) of `iters` back-to-back calls.

    f(*args), or with `arg_sets` (a list of argument tuples) f(*arg_sets[i % len(arg_sets)]) for
    call i, so that successive calls read different buffers.
    """
    arg_sets = _warm_calls(f, args, arg_sets, warmup)
    n = len(arg_sets)
    call = warmup
    samples = []
    for _ in range(trials):
        start = time.perf_counter()
        for _ in range(iters):
            out = f(*arg_sets[call % n])
            call += 1
        jax.block_until_ready(out)
        samples.append((time.perf_counter() - start) / iters * 1e6)
    return statistics.median(samples)


# Why a trace on a GPU can hold no kernel: the profiler's CUPTI interface takes one subscriber,
# and a process run under ncu or nsys has one already.
NO_GPU_TRACE = ("the profiler's trace holds no GPU kernel: is another profiler (ncu, nsys) "
                "holding the GPU's profiling interface (CUPTI)? Device times need JAX's profiler")


def device_time_us(f, *args, arg_sets=None, calls=8):
    """GPU kernel time per call (microseconds) of `calls` calls of f, from a profiler trace: the
    union of the kernel intervals on the GPU's streams, divided by `calls`. None where JAX has
    no GPU (CPU runs); on a GPU an empty trace raises RuntimeError (NO_GPU_TRACE). Same
    argument conventions as time_us."""
    events = gpu_kernel_events(f, *args, arg_sets=arg_sets, calls=calls)
    if not events:
        if any(d.platform == "gpu" for d in jax.devices()):
            raise RuntimeError(NO_GPU_TRACE)
        return None
    return events_time_us(events, calls)


def events_time_us(events, calls, name_prefix=""):
    """Per call (microseconds), the union of the intervals of the (name, start ns, end ns)
    kernel events of `calls` calls whose name starts with `name_prefix` (all by default)."""
    return union_length([(s, e) for name, s, e in events
                         if name.startswith(name_prefix)]) / calls / 1e3


def gpu_kernel_events(f, *args, arg_sets=None, calls=8, with_device=False):
    """(kernel name, start ns, end ns) of every GPU kernel that `calls` calls of f ran (after 2
    warm-up calls), from a profiler trace; [] when there is no GPU. with_device: (GPU plane
    name, kernel name, start ns, end ns) instead, for programs over several GPUs. Same argument
    conventions as time_us."""
    arg_sets = _warm_calls(f, args, arg_sets, warmup=2)
    tmp = tempfile.mkdtemp(prefix="jbs_trace_")
    try:
        with jax.profiler.trace(tmp):
            for i in range(calls):
                out = f(*arg_sets[i % len(arg_sets)])
            jax.block_until_ready(out)
        paths = glob.glob(f"{tmp}/**/*.xplane.pb", recursive=True)
        if not paths:
            return []
        data = jax.profiler.ProfileData.from_file(paths[0])
        return [((plane.name,) if with_device else ()) +
                (e.name, e.start_ns, e.start_ns + e.duration_ns)
                for plane in data.planes if plane.name.startswith("/device:GPU")
                for line in plane.lines if line.name.startswith("Stream")
                for e in line.events]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def union_length(intervals):
    """Total length covered by (start, end) intervals (kernels on several streams may overlap:
    the time the GPU was busy at all, each moment counted once)."""
    total, cur_s, cur_e = 0, None, None
    for s, e in sorted(intervals):
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    return total + (cur_e - cur_s if cur_e is not None else 0)


def rotation_count(nbytes, l2_bytes=L2_BYTES, factor=3, max_copies=4):
    """How many copies of an operand of `nbytes` to rotate through so that the copies together
    are ~`factor` x L2 (1 when one copy is already that big; at most `max_copies`, to keep
    device memory modest)."""
    return max(1, min(max_copies, math.ceil(factor * l2_bytes / max(nbytes, 1))))


def copies(tree, n):
    """`tree` plus n - 1 copies of it in fresh device buffers (each a different address)."""
    return [tree] + [jax.tree.map(lambda x: jnp.array(x, copy=True), tree)
                     for _ in range(n - 1)]
