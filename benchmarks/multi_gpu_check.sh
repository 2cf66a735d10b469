#!/usr/bin/env bash
# The multi-GPU MoE checks on a machine with 2 or 4 GPUs, in about 9 minutes:
#   1. tests/gpu/test_moe_multi_gpu.py (rule-based placements on 2 GPUs; the dispatching
#      expert-parallel layer on 2 and, with 4 GPUs, 4, both exchanges, and exchange="reduce"),
#   2. examples/moe_sharded.py (Qwen3-30B-A3B shapes, 16 tokens, every placement on 2 GPUs),
#   3. benchmarks/bench_moe_sharded.py at the gpt-oss-120b and Qwen3-30B-A3B layer shapes,
#      16 / 256 / 4096 tokens, on 1 GPU and sharded over 2 (and 4 where present).
# Writes into "$OUT" (default ./multi_gpu_out): summary.txt, logs.tar.gz (every log),
# bench_moe_sharded_gpu.json and .png. Run from anywhere:
#   OUT=/some/dir bash benchmarks/multi_gpu_check.sh
# The native library: JAX_BLOCKSCALE_LIBRARY if set, else the one in the package.
set -u
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
OUT="${OUT:-$ROOT/multi_gpu_out}"
mkdir -p "$OUT"
LOGS="$(mktemp -d)"
PY="${PYTHON:-python3}"
export NCCL_NVLS_ENABLE=0 XLA_PYTHON_CLIENT_PREALLOCATE=false
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
SUMMARY="$OUT/summary.txt"
: > "$SUMMARY"
note() { echo "$*" | tee -a "$SUMMARY"; }
step() {  # step NAME SECONDS CMD...: run with a time limit, log, record status and duration
  local name="$1" limit="$2"; shift 2
  local t0=$SECONDS
  timeout --kill-after=10 "$limit" "$@" > "$LOGS/$name.log" 2>&1
  local rc=$?
  note "$name: rc=$rc ($((SECONDS - t0)) s, limit $limit s): $*"
  tail -n 25 "$LOGS/$name.log" | sed 's/^/    /' >> "$SUMMARY"
}

"$PY" - > "$LOGS/environment.log" 2>&1 <<'PYEOF'
import os, jax, jax_blockscale as jbs
from jax_blockscale import _plugin
print("jax", jax.__version__, "devices", jax.devices())
print("JAX_BLOCKSCALE_LIBRARY", os.environ.get("JAX_BLOCKSCALE_LIBRARY"))
print("library", _plugin.library_path(), "unavailable:", _plugin.unavailable_reason())
print("backends", jbs.backend_names(), "ragged", jbs.ragged_backend_names())
PYEOF
cat "$LOGS/environment.log" >> "$SUMMARY"
NGPU="$("$PY" -c "import jax; print(len(jax.devices('gpu')))" 2>/dev/null || echo 0)"
note "GPUs: $NGPU"
DEVICES=2
[ "$NGPU" -ge 4 ] && DEVICES=2,4

step tests 150 "$PY" -m pytest -q -m gpu -rA tests/gpu/test_moe_multi_gpu.py
step example 60 "$PY" examples/moe_sharded.py
step bench 330 "$PY" benchmarks/bench_moe_sharded.py --devices "$DEVICES" --iters 10 \
    --trials 3 --out "$OUT" --tag bench_moe_sharded_gpu

tar czf "$OUT/logs.tar.gz" -C "$LOGS" .
rm -rf "$LOGS"
note "wrote $(ls "$OUT" | tr '\n' ' ')"
