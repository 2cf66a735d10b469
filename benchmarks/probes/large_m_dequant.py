"""Probe: how XLA runs the dequantize + dot that large-M calls lower to (GPU only).

Above the fused kernel's row limit the sm90 backend lowers to "dequantize once, then XLA's bf16
GEMM". This probe times, at large M, that lowering against other exact ways of writing the same
dequantization, and lists the GPU kernels each one runs (whether XLA fused the dequantization into
its GEMM or ran it as a separate pass over the operand):

  current           jbs.gemm on its default backend (what the library lowers to)
  bf16_math         elements and scales converted to bf16 and multiplied in bf16, f32 dot
                    (exact: an element times a scale has at most 6 significant bits)
  ref_bf16out       jbs.dequantize to bf16, the dot writing bf16 itself (alpha = 1)
  lut_bf16out       fp4 bytes through a 256-entry table of bf16 pairs, bf16 dot output
  pairbits_bf16out  fp4: both nibbles' bf16 bits built into one u32 per byte, bf16 dot output
  elembits_bf16out  fp4: each code's bf16 bits built by integer ops, bf16 dot output
  (fp8 operands: convert in every variant)

    python benchmarks/probes/large_m_dequant.py --shapes 8192x8192x8192 --json out.json
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import sys

import jax
import ml_dtypes
import numpy as np
import jax.numpy as jnp
from jax import lax

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import jax_blockscale as jbs  # noqa: E402
from bench_gemm import dot_bf16  # noqa: E402  (the anchor)
from jax_blockscale.quantize import BlockScaled, decode_elements, e2m1_bf16_bits  # noqa: E402
from sweep import quantize  # noqa: E402
from timing import copies, device_time_us, gpu_kernel_events, rotation_count, time_us  # noqa: E402


def _scaled(vals, q):
    """bf16 element values times q's scales, in bf16."""
    f = q.format
    *lead, k = vals.shape
    s = q.plain_scales().astype(jnp.bfloat16)
    return (vals.reshape(*lead, k // f.block, f.block) * s[..., None]).reshape(vals.shape)


def bf16_values(q: BlockScaled):
    """q's values in bf16, computed in bf16."""
    return _scaled(decode_elements(q.data, q.format).astype(jnp.bfloat16), q)


def _fp4_pair_table():
    """u32 per byte: the bf16 bits of its low nibble's e2m1 value | its high nibble's << 16."""
    vals = np.array([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6], np.float32)
    bits = vals.astype(ml_dtypes.bfloat16).view(np.uint16).astype(np.uint32)
    byte = np.arange(256)
    return bits[byte & 15] | (bits[byte >> 4] << 16)


def lut_values(q: BlockScaled):
    """q's values in bf16: fp4 pairs through a 256-entry table of bf16 pairs, fp8 by convert."""
    f = q.format
    *lead, k = q.data.shape
    if f.element_bits == 4:
        codes = lax.bitcast_convert_type(q.data.reshape(*lead, k // 2, 2), jnp.uint8)
        words = jnp.asarray(_fp4_pair_table())[codes]
        vals = lax.bitcast_convert_type(words, jnp.bfloat16).reshape(*lead, k)
    else:
        vals = decode_elements(q.data, f).astype(jnp.bfloat16)
    return _scaled(vals, q)


def pair_bits_values(q: BlockScaled):
    """fp4: each byte (two codes) -> one u32 holding both bf16 values; fp8: convert."""
    f = q.format
    *lead, k = q.data.shape
    if f.element_bits != 4:
        return _scaled(decode_elements(q.data, f).astype(jnp.bfloat16), q)
    codes = lax.bitcast_convert_type(q.data.reshape(*lead, k // 2, 2), jnp.uint8)
    c = codes.astype(jnp.uint32)
    words = e2m1_bf16_bits(c & 15) | (e2m1_bf16_bits(c >> 4) << 16)
    return _scaled(lax.bitcast_convert_type(words, jnp.bfloat16).reshape(*lead, k), q)


def elem_bits_values(q: BlockScaled):
    """fp4: each code -> its bf16 bits (u16) by integer ops; fp8: convert."""
    f = q.format
    if f.element_bits != 4:
        return _scaled(decode_elements(q.data, f).astype(jnp.bfloat16), q)
    c = lax.bitcast_convert_type(q.data, jnp.uint4).astype(jnp.uint32)
    bits = e2m1_bf16_bits(c).astype(jnp.uint16)
    return _scaled(lax.bitcast_convert_type(bits, jnp.bfloat16), q)


def bf16_out_gemm(values):
    """The dot with a bf16 result straight from the GEMM (f32 accumulation inside; alpha = 1)."""
    def g(a, b):
        av = a.astype(jnp.bfloat16) if not isinstance(a, BlockScaled) else values(a)
        return lax.dot_general(av, values(b), (((1,), (1,)), ((), ())),
                               preferred_element_type=jnp.bfloat16)
    return g


def ref_values_bf16(q):
    return jbs.dequantize(q, jnp.bfloat16)


def bf16_math_gemm(a, b):
    av = a.astype(jnp.bfloat16) if not isinstance(a, BlockScaled) else bf16_values(a)
    bv = bf16_values(b)
    y = lax.dot_general(av, bv, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    alpha = 1.0
    for q in (a, b):
        if isinstance(q, BlockScaled) and q.global_scale is not None:
            alpha = alpha * q.global_scale
    return (y * alpha).astype(jnp.bfloat16)


def gpu_or_loop_us(f, arg_sets):
    """Device time on a GPU; the loop time elsewhere (CPU smoke runs)."""
    t = device_time_us(f, arg_sets=arg_sets)
    return t if t is not None else time_us(f, arg_sets=arg_sets, iters=2, trials=1)


def kernel_summary(f, arg_sets):
    """{kernel name: total us per call}, largest first."""
    events = gpu_kernel_events(f, arg_sets=arg_sets, calls=4)
    per = collections.Counter()
    for name, s, e in events:
        per[name[:90]] += (e - s) / 1e3 / 4
    return dict(per.most_common(6))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="8192x8192x8192,1024x16384x16384")
    ap.add_argument("--formats", default="nvfp4,mxfp4,mxfp8_e4m3")
    ap.add_argument("--json", default=None)
    ap.add_argument("--hlo-dir", default=None)
    ap.add_argument("--variants", default="", help="comma list (default: all)")
    args = ap.parse_args()
    rows = []
    key = jax.random.key(0)
    gemm = jax.jit(jbs.gemm)
    ref = jax.jit(lambda a, b: jbs.gemm(a, b, backend="reference"))
    variants = {"current": gemm, "bf16_math": jax.jit(bf16_math_gemm),
                "ref_bf16out": jax.jit(bf16_out_gemm(ref_values_bf16)),
                "lut_bf16out": jax.jit(bf16_out_gemm(lut_values)),
                "pairbits_bf16out": jax.jit(bf16_out_gemm(pair_bits_values)),
                "elembits_bf16out": jax.jit(bf16_out_gemm(elem_bits_values))}
    if args.variants:
        variants = {k: v for k, v in variants.items() if k in args.variants.split(",")}
    for shape in args.shapes.split(","):
        m, n, k = (int(v) for v in shape.split("x"))
        ka, kb = jax.random.split(jax.random.fold_in(key, m * 7 + n))
        x = jax.random.normal(ka, (m, k), jnp.bfloat16)
        w = jax.random.normal(kb, (n, k), jnp.bfloat16)
        ws = copies(w, rotation_count(2 * n * k))
        t_dot = gpu_or_loop_us(dot_bf16, [(x, w_) for w_ in ws])
        print(f"{shape} bf16 dot {t_dot:.1f} us", flush=True)
        for fmt in args.formats.split(","):
            # no global scale (alpha = 1): the bf16-output variants are exact then
            a_q = quantize(x.astype(jnp.float32), fmt, global_scale=None)
            b_q = quantize(w.astype(jnp.float32), fmt, layout="blocked", global_scale=None)
            for kind, a in (("weight_only", x), ("w_and_a", a_q)):
                y_ref = ref(a, b_q).astype(jnp.float32)
                for vname, f in variants.items():
                    bs = copies(b_q, rotation_count(n * k // 2))
                    sets = [(a, b_) for b_ in bs]
                    t = gpu_or_loop_us(f, sets)
                    y = f(a, b_q).astype(jnp.float32)
                    err = float(jnp.linalg.norm(y - y_ref) / jnp.linalg.norm(y_ref))
                    kern = kernel_summary(f, sets)
                    row = dict(shape=shape, fmt=fmt, kind=kind, variant=vname, device_us=t,
                               bf16_dot_us=t_dot, vs_dot=t_dot / t, rel_err_vs_ref=err,
                               kernels=kern)
                    rows.append(row)
                    print(f"{shape} {fmt:11s} {kind:11s} {vname:10s} {t:8.1f} us "
                          f"{t_dot / t:5.2f}x dot  err {err:.1e}  "
                          + "; ".join(f"{k_[:60]}={v:.0f}" for k_, v in kern.items()), flush=True)
                    if args.hlo_dir:
                        os.makedirs(args.hlo_dir, exist_ok=True)
                        txt = f.lower(a, b_q).compile().as_text()
                        with open(os.path.join(args.hlo_dir,
                                               f"{shape}_{fmt}_{kind}_{vname}.hlo"), "w") as fh:
                            fh.write(txt)
                    del bs, sets
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(dict(device=str(jax.devices()[0]), rows=rows), fh, indent=1)


if __name__ == "__main__":
    main()
