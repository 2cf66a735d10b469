"""triton_kernels' MXFP4 expert GEMMs at any model's shapes: the child process of
bench_moe_peers.py for the rows the project's anchor script (`peer_triton_kernels.py`, gate+up of
three models) does not time: the down projection, and the expert shapes of other models.

Runs with torch and triton (the lent GPU machines have both), the peer folder (the vendored
`triton_kernels/` and `peer_triton_kernels.py`, whose `routing` draws the tokens' experts) on
PYTHONPATH:

    PYTHONPATH=<peer-dir> python benchmarks/peer_moe_gemms.py --cases cases.json --out rows.json

cases.json: a list of {model, gemm, experts, n, k, top_k, tokens: [...]}. Each row times
`matmul_ogs` as a serving stack calls it, MXFP4 weights in the Hopper layout, bf16 activations:
gate+up reads the tokens in token order and gathers each expert's rows in the kernel (as the
anchor script does); down reads rows already grouped by expert (the gate+up output's order) and
writes them in that order, the grouped GEMM `ragged_gemm` is (the combine over top_k, which a
serving stack fuses as a scatter, is not timed on either side). Time: the GPU kernels' device
time per call from torch's profiler. A case that fails records its error and the run goes on.
"""
import argparse
import json
import traceback

EXPERTS_PER_CHUNK = 16  # experts quantized at a time (bounds the bf16 draw's memory)


def kernel_us(torch, fn, calls=8):
    """Device time per call: the CUDA kernels' total in a profiled run of `calls` calls."""
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    total = sum(ev.device_time_total for ev in prof.key_averages()
                if ev.device_time_total > 0 and "CUDA" in str(getattr(ev, "device_type", "")))
    return total / calls


def mxfp4_experts(torch, e, n, k, dev):
    """(E, K, N) random MXFP4 experts in triton_kernels' Hopper layout, and their precision
    config; quantized EXPERTS_PER_CHUNK experts at a time."""
    from triton_kernels.matmul_ogs import PrecisionConfig
    from triton_kernels.numerics_details.mxfp import downcast_to_mxfp
    from triton_kernels.tensor import FP4, convert_layout, wrap_torch_tensor
    from triton_kernels.tensor_details import layout
    values, scales = [], []
    for e0 in range(0, e, EXPERTS_PER_CHUNK):
        c = min(EXPERTS_PER_CHUNK, e - e0)
        w = 0.02 * torch.randn(c, k, n, device=dev, dtype=torch.bfloat16)
        q, s = downcast_to_mxfp(w, torch.uint8, axis=1)
        # (c, K/2, N) and (c, K/32, N) views of contiguous (c, N, ...) tensors: kept so
        values.append(q.transpose(1, 2))
        scales.append(s.transpose(1, 2))
        del w
    q, s = torch.cat(values).transpose(1, 2), torch.cat(scales).transpose(1, 2)
    value_layout, value_opts = layout.make_default_matmul_mxfp4_w_layout(mx_axis=1)
    scale_layout, scale_opts = layout.make_default_matmul_mxfp4_w_scale_layout(
        mx_axis=1, num_warps=8)
    w = convert_layout(wrap_torch_tensor(q, dtype=FP4), value_layout, **value_opts)
    config = PrecisionConfig(weight_scale=convert_layout(wrap_torch_tensor(s), scale_layout,
                                                         **scale_opts))
    return w, config


def case_rows(torch, case, dev):
    """One case's rows, a row per token count."""
    import triton_kernels.routing as tk_routing
    from peer_triton_kernels import routing
    from triton_kernels.matmul_ogs import matmul_ogs
    e, n, k, top_k = case["experts"], case["n"], case["k"], case["top_k"]
    base = dict(part="moe", model=case["model"], gemm=case["gemm"],
                method="triton_kernels mxfp4 w-only")
    try:
        w, config = mxfp4_experts(torch, e, n, k, dev)
    except Exception as ex:  # noqa: BLE001  (recorded: the run goes on with the next case)
        traceback.print_exc()
        return [dict(base, tokens=t, error=f"{type(ex).__name__}: {str(ex)[:300]}")
                for t in case["tokens"]]
    rows = []
    for t in case["tokens"]:
        row = dict(base, tokens=t)
        try:
            sel = torch.from_numpy(routing(t, e, top_k)).to(dev).long()
            logits = torch.randn(t, e, device=dev)
            logits.scatter_(1, sel, 100.0 + torch.rand(t, top_k, device=dev))
            rdata, gather, _ = tk_routing.routing(logits.to(torch.bfloat16), top_k,
                                                  sm_first=False)
            if case["gemm"] == "gate_up":
                x = torch.randn(t, k, device=dev, dtype=torch.bfloat16)
                fn = lambda: matmul_ogs(x, w, None, rdata, gather_indx=gather,  # noqa: E731
                                        precision_config=config)
            else:
                x = torch.randn(t * top_k, k, device=dev, dtype=torch.bfloat16)
                fn = lambda: matmul_ogs(x, w, None, rdata,  # noqa: E731
                                        precision_config=config)
            y = fn()
            row.update(device_us=kernel_us(torch, fn), out_shape=list(y.shape),
                       experts_hit=int((torch.bincount(sel.flatten(), minlength=e) > 0).sum()))
        except Exception as ex:  # noqa: BLE001
            traceback.print_exc()
            row["error"] = f"{type(ex).__name__}: {str(ex)[:300]}"
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", required=True, help="JSON file: the cases (module docstring)")
    p.add_argument("--out", required=True, help="JSON file the rows are written to")
    args = p.parse_args()
    import torch
    import triton
    import triton_kernels.matmul_ogs_details.opt_flags as opt_flags
    opt_flags.update_opt_flags_constraints({"split_k": 1})  # what vLLM and SGLang set on sm90
    with open(args.cases) as f:
        cases = json.load(f)
    dev = torch.device("cuda")
    torch.manual_seed(0)
    rows = []
    for case in cases:
        rows += case_rows(torch, case, dev)
        torch.cuda.empty_cache()  # the case's experts, freed on return
    with open(args.out, "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                       triton=triton.__version__, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
