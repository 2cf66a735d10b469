"""Shared by the probes that compare ways of lowering one jbs.gemm call, each chosen by environment
variables read at trace time (GPU only): compile the call under each method's environment, check
that the outputs agree, and time bf16 `jnp.dot` and every method in paired rounds."""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import jax_blockscale as jbs  # noqa: E402
from bench_gemm import dot_bf16  # noqa: E402  (the anchor)
from sweep import format_token, quantize  # noqa: E402
from timing import copies, device_time_us, rotation_count  # noqa: E402


def shape_data(shape):
    """(m, n, k, f32 activation, f32 weight, rotating bf16 operand sets of the anchor dot) for a
    "MxNxK" token."""
    m, n, k = (int(v) for v in shape.split("x"))
    kx, kw = jax.random.split(jax.random.key(m + n))
    x = jax.random.normal(kx, (m, k), jnp.float32)
    w = jax.random.normal(kw, (n, k), jnp.float32)
    dot_sets = [(x.astype(jnp.bfloat16), w_) for w_ in
                copies(w.astype(jnp.bfloat16), rotation_count(2 * n * k))]
    return m, n, k, x, w, dot_sets


def gemm_sets(a, w, token, n, k):
    """Rotating (a, quantized weight) operand sets; `token` as sweep.py's --formats."""
    fmt, kw = format_token(token)
    return [(a, b) for b in copies(quantize(w, fmt, layout="blocked", **kw),
                                   rotation_count(n * k // 2))]


def compare_methods(methods, sets, dot_sets, rounds, ref="dequant_dot"):
    """methods: name -> environment. sets: rotating (a, b) operands of jbs.gemm; dot_sets: the
    bf16 dot's. Returns (median device us per method and "bf16_dot", relative difference of each
    method's output from `ref`'s, or the first method's when `ref` is not among them). One round times every method once, so clock drift within a
    run affects them alike; the median is taken per method over the rounds."""
    fns, outs = {}, {}
    for name, env in methods.items():
        with mock.patch.dict(os.environ, env):
            fns[name] = jax.jit(lambda a, b: jbs.gemm(a, b, backend="sm90"))
            outs[name] = np.asarray(fns[name](*sets[0]), np.float32)
    want = outs[ref if ref in outs else next(iter(outs))]  # else the first method
    agree = {name: float(np.linalg.norm(o - want) / np.linalg.norm(want))
             for name, o in outs.items()}
    times = {name: [] for name in ["bf16_dot"] + list(methods)}
    for _ in range(rounds):
        times["bf16_dot"].append(device_time_us(dot_bf16, arg_sets=dot_sets))
        for name, env in methods.items():
            with mock.patch.dict(os.environ, env):
                times[name].append(device_time_us(fns[name], arg_sets=sets))
    return {name: statistics.median(t) for name, t in times.items()}, agree


def report(shape, token, med, agree, ref="dequant_dot"):
    """One line per (shape, format), and the row the probes save."""
    print(f"{shape} {token}: " + ", ".join(f"{k} {v:.1f}" for k, v in med.items())
          + f" us; rel diff vs {ref} " + ", ".join(f"{k} {v:.1e}" for k, v in agree.items()),
          flush=True)
    return dict(shape=shape, format=token, us=med, **{f"rel_diff_vs_{ref}": agree})


def probe_main(doc, methods, default_shapes, default_formats, activation):
    """A probe's command line: for every --shapes x --formats token, time --methods (a subset of
    `methods`) against bf16 `jnp.dot` and print / save the rows. `activation(x, token)` turns the
    f32 activation into the call's A for that token and returns (A, the weight's format token)."""
    ap = argparse.ArgumentParser(description=doc)
    ap.add_argument("--shapes", default=default_shapes)
    ap.add_argument("--formats", default=default_formats)
    ap.add_argument("--methods", default=",".join(methods),
                    help="comma-separated subset of " + ", ".join(methods))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    chosen = {name: methods[name] for name in args.methods.split(",")}
    rows = []
    for shape in args.shapes.split(","):
        m, n, k, x, w, dot_sets = shape_data(shape)
        for token in args.formats.split(","):
            a, weight_token = activation(x, token)
            sets = gemm_sets(a, w, weight_token, n, k)
            med, agree = compare_methods(chosen, sets, dot_sets, args.rounds)
            rows.append(report(shape, token, med, agree))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=str(jax.devices()[0]), rows=rows), f, indent=1)
