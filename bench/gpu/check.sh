#!/usr/bin/env bash
# GPU readiness check: run from the repository root on a machine with a CUDA GPU (about 5 minutes).
#
#   bash bench/gpu/check.sh [RESULTS_DIR]     # default: $OUT when set, else docs/gpu
#
# 1. env.txt      — GPU, driver, Python, torch, Triton, transformers, PEFT versions
# 2. kernels.log  — every Triton kernel vs kernels/reference.py in bfloat16 (SGMV shrink/expand with mixed
#                   ranks and slot -1, write_kv, paged decode and prefill attention), then shrink/expand
#                   bandwidth at decode and prefill sizes against the device-to-device copy bandwidth
# 3. e2e.log/json — the engine on CUDA: greedy parity with HF + PEFT (float32, mixed adapters + base), and
#                   mixed 32-adapter vs base-only throughput on a random ~1B Llama in bfloat16
# 4. features.log   — the demo model on CUDA: adapters' outputs, speculative = plain greedy, structured
#                   (JSON-schema) output, seeded sampling repeats (bench/gpu/features.py)
# Each step runs even when an earlier one failed; the exit code is non-zero when any failed.
set -u
cd "$(dirname "$0")/../.."
DIR="${1:-${OUT:-docs/gpu}}"
mkdir -p "$DIR"
PY="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1
unset TRITON_INTERPRET
status=0

step() {  # step NAME TIMEOUT_S CMD... : run CMD with its output in $DIR/NAME.log, print its tail
  local name=$1 limit=$2 start rc
  shift 2
  start=$(date +%s)
  timeout "$limit" "$@" >"$DIR/$name.log" 2>&1
  rc=$?
  echo "== $name: exit $rc after $(($(date +%s) - start)) s"
  tail -n 60 "$DIR/$name.log"
  [ "$rc" -eq 0 ] || status=1
}

{
  date -u
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv 2>&1
  "$PY" -c 'import sys, torch, triton, transformers, peft
print("python", sys.version.split()[0], "| torch", torch.__version__, "| cuda", torch.version.cuda,
      "| triton", triton.__version__, "| transformers", transformers.__version__, "| peft", peft.__version__)
print("device:", torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA device")' 2>&1
} >"$DIR/env.txt"
cat "$DIR/env.txt"

step kernels 180 "$PY" bench/kernels/triton_gpu.py --dtype bfloat16 --decode-batches 1,8,32,128 --prefill-tokens 4096
step features 120 "$PY" -m bench.gpu.features --device cuda
step e2e 360 "$PY" -m bench.gpu.e2e --size 1b --dtype bfloat16 --json "$DIR/e2e.json"
exit $status
