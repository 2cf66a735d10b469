#!/usr/bin/env bash
# The GPU verification run (used on the lent H100/H200 machines): every gpu-marked test against
# the built library, the demo, a benchmark subset beside the anchors and the roofline sweep
# (benchmarks/sweep.py: table, JSON, PNG). Logs and results go to $OUT.
#   JAX_BLOCKSCALE_LIBRARY=/path/to/libjax_blockscale.so OUT=/tmp/out benchmarks/gpu_check.sh [PHASE]
# PHASE: "tests" (the gpu tests), "memcheck" (the compute-sanitizer ones, one at a time, in a
# phase of their own: beside the suite they ran out of time), "bench" (demo, benchmark, sweep) or "all" (default). Each phase's timeouts
# add up to under 600 s, the lent machines' limit per command: run the phases as three commands
# there. The build tests (tests/build) are left out: they need nvidia-cutlass-dsl, which builds
# the library and is not on the GPU machines; CI and the build machine run them.
set -uo pipefail
: "${OUT:=/tmp/jbs_gpu_check}"; mkdir -p "$OUT"
PHASE="${1:-all}"
export PYTHONPATH="$PWD" XLA_PYTHON_CLIENT_PREALLOCATE=false NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
nvidia-smi -L | tee "$OUT/devices.txt"
if [[ "$PHASE" == tests || "$PHASE" == all ]]; then
  timeout 540 python3 -m pytest -q -rs -p no:cacheprovider -n 8 --timeout 300 -m "gpu and not memcheck" \
    --ignore=tests/build ${GPU_TESTS:-tests/} 2>&1 | tee "$OUT/gpu_tests.log" | tail -25
fi
if [[ "$PHASE" == memcheck || "$PHASE" == all ]]; then
  # the compute-sanitizer runs, one at a time (beside 7 other workers they take minutes)
  timeout 540 python3 -m pytest -q -rs -p no:cacheprovider -p no:xdist --timeout 300 -m memcheck \
    --ignore=tests/build ${GPU_TESTS:-tests/} 2>&1 | tee "$OUT/memcheck.log" | tail -3
fi
[[ "$PHASE" == bench || "$PHASE" == all ]] || exit 0
timeout 60 python3 examples/quickstart.py --m 16 --n 8192 --k 8192 2>&1 | tee "$OUT/quickstart.log"
timeout 100 python3 benchmarks/bench_gemm.py --shapes ${BENCH_SHAPES:-16x16384x16384,8192x8192x8192} \
  --formats nvfp4,mxfp8_e4m3 --out "$OUT" --tag "bench_gemm_$(nvidia-smi --query-gpu=name \
  --format=csv,noheader | head -1 | tr -c 'A-Za-z0-9' _)" 2>&1 | tail -8
timeout 190 python3 benchmarks/sweep.py --shapes ${SWEEP_SHAPES:-1x16384x16384,16x16384x16384,128x16384x16384,8192x8192x8192} \
  --out "$OUT" --tag "sweep_$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 \
  | tr -c 'A-Za-z0-9' _)" 2>&1 | tee "$OUT/sweep.log" | tail -16
