"""Fold the raw H100 runs of the decode harness into benchmarks/results/decode_h100.json.

    python benchmarks/decode_harness/summarize.py

Reads benchmarks/results/decode_h100_run*_raw.json (run_decode.py output, one per device call)
and decode_h100_anchors_run1.json (anchors_decode.py), plus the shared anchors file for
jax.nn.scaled_matmul at M=16, N=K=16384. Writes per-version headline tables and, for the latest
run's default tuning, the speedup over each anchor.
"""
import glob
import json
import os
import re

HERE = os.path.dirname(os.path.abspath(__file__))
RES = os.path.join(HERE, "..", "results")
SHARED_ANCHORS = "/work/shared/anchors/h100_anchors_2026-11-22.json"


def headline(run):
    """(tuning, fmt_a, fmt_b, M, N) -> perf row, first timing with the heuristic's split."""
    out = {}
    for r in run.get("perf", []):
        if "us" not in r or r.get("splits") != r.get("auto_splits") or r["us"] != r["us"]:
            continue
        key = (r.get("tuning", "default"), r["fmt_a"], r["fmt_b"], r["M"], r["N"])
        out.setdefault(key, r)
    return out


def main():
    runs = {}
    for path in sorted(glob.glob(os.path.join(RES, "decode_h100_run*_raw.json"))):
        n = int(re.search(r"run(\d+)_raw", path).group(1))
        runs[n] = json.load(open(path))
    anchors = json.load(open(os.path.join(RES, "decode_h100_anchors_run1.json")))["rows"]
    shared = {}
    if os.path.exists(SHARED_ANCHORS):
        for r in json.load(open(SHARED_ANCHORS)):
            shared[(r["fmt"], r["M"], r["N"])] = r
    latest = max(runs)
    summary = dict(
        device="NVIDIA H100 80GB HBM3 (132 SMs), this workplace's nvidia-h100-x1",
        command=("python3 benchmarks/decode_harness/run_decode.py --lib "
                 "benchmarks/decode_harness/build --json $OUT/decode_h100_runN.json  "
                 "(library from: python benchmarks/decode_harness/build.py "
                 "[--extra-tunings ...], carried to the device)"),
        timing=("CUDA graph of 20 launches (zero + main + finalize kernels each), median "
                "per-launch time over graph replays; weight/scale buffer sets rotated so that "
                "> 150 MB are touched; bf16 output; us_eager = events between eager launches"),
        bytes_counted="B + its (unpadded) block scales + A + output, each once",
        copy_tbps={n: r.get("copy_tbps") for n, r in runs.items()},
        versions={},
        correctness={},
    )
    for n, run in sorted(runs.items()):
        rows = []
        for key, r in headline(run).items():
            rows.append(dict(tuning=key[0], fmt_a=key[1], fmt_b=key[2], M=key[3], N=key[4],
                             K=r["K"], splits=r["splits"], us=round(r["us"], 2),
                             us_eager=round(r.get("us_eager", float("nan")), 2),
                             tbps=round(r["tbps"], 3), bytes=r["bytes"],
                             rel_err_bf16_out=r.get("rel_err")))
        summary["versions"][f"run{n}"] = dict(default_tuning=run["info"].get("default_tuning",
                                                                              "regs_s2_k2_b1"),
                                              rows=rows)
        cor = run.get("correctness", [])
        if cor:
            f32 = [r["rel_err"] for r in cor if r.get("out") == "f32" and "rel_err" in r]
            summary["correctness"][f"run{n}"] = dict(
                cases=len(cor), ok=sum(bool(r.get("ok")) for r in cor),
                max_rel_err_f32=max(f32) if f32 else None,
                max_rel_err_bf16=max([r["rel_err"] for r in cor if r.get("out") == "bf16"
                                      and r.get("ok")] or [None]),
                max_rel_err_f16=max([r["rel_err"] for r in cor if r.get("out") == "f16"
                                     and r.get("ok")] or [None]))
    # speedups of the latest default tuning vs the anchors
    best = headline(runs[latest])
    speed = []
    for a in anchors:
        for (tun, fa, fb, m, n), r in best.items():
            if tun != "default" or m != a["M"] or n != a["N"]:
                continue
            if fb != "nvfp4":
                continue
            row = dict(fmt_a=fa, fmt_b=fb, M=m, N=n, K=n, us=round(r["us"], 2),
                       tbps=round(r["tbps"], 3),
                       bf16_dot_us=round(a["bf16_dot_us"], 1),
                       deq_dot_nvfp4_us=round(a["deq_dot_nvfp4_us"], 1),
                       speedup_vs_bf16_dot=round(a["bf16_dot_us"] / r["us"], 2),
                       speedup_vs_deq_dot=round(a["deq_dot_nvfp4_us"] / r["us"], 2))
            sh = shared.get(("nvfp4", m, n))
            if sh and "nn_scaled_us" in sh:
                row["nn_scaled_matmul_us_shared_anchor"] = round(sh["nn_scaled_us"], 1)
                row["speedup_vs_nn_scaled_matmul"] = round(sh["nn_scaled_us"] / r["us"], 2)
            speed.append(row)
    summary["summary"] = dict(run=f"run{latest}", vs_anchors=speed,
                              anchors_source="decode_h100_anchors_run1.json (bf16 dot, "
                              "jitted NVFP4 dequantize+dot, same harness call as run 1); "
                              "nn.scaled_matmul from the shared anchors file (M=16 only)")
    with open(os.path.join(RES, "decode_h100.json"), "w") as f:
        json.dump(summary, f, indent=1)
    for r in speed:
        print(json.dumps(r))


if __name__ == "__main__":
    main()
