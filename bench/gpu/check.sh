#!/usr/bin/env bash
# GPU check: run from the repository root on a machine with a CUDA GPU; at most 6 minutes in all (each
# step's time limit is cut to what is left of that budget), so it can run twice in a short GPU window.
#
#   bash bench/gpu/check.sh [RESULTS_DIR]     # default: $OUT when set, else docs/gpu
#   WHEELS=dir bash bench/gpu/check.sh ...     # first pip-install the wheels in dir (packages it lacks)
#
# Without CUDA (or without a package it needs) it stops at once with a message and exit code 2.
# 1. env.txt       — GPU, driver, Python, torch, Triton, transformers, PEFT versions
# 2. kernels.log   — every Triton kernel vs kernels/reference.py in bfloat16 (SGMV shrink/expand and the
#                    fused BGMV kernel with mixed ranks and slot -1, write_kv, paged decode and prefill
#                    attention), then the LoRA kernels timed from CUDA graphs at decode batches 1, 64, 256
#                    and a 4096-token prefill against the device-to-device copy bandwidth
# 3. parity.log/json — the engine on CUDA in float32: greedy tokens equal HF + PEFT's (mixed adapters and
#                    base rows in one batch; bench.gpu.e2e --skip-throughput)
# 4. moe.log, moe_graphs.json — a random Qwen3-MoE in float32: greedy tokens with decode graphs on and
#                    off equal transformers', graphs captured, decode time graphs / eager
#                    (bench/gpu/moe_graphs.py)
# 5. overhead.log/json — bench.gpu.lora_overhead on a random ~1B Llama in bfloat16: decode steps at batch
#                    1, 64, 256 with 32 distinct rank-16 adapters vs base-only on the same engine vs a
#                    LoRA-disabled engine; prefill of 4 x 1024-token prompts on 4 adapters, the same three
#                    ways; the mixed decode batches again with the fused BGMV kernel off (SGMV only);
#                    engine start, decode-graph count, capture time and graph memory
# 6. profile.log   — bench.gpu.step_profile: where a mixed and a base decode step's time goes (batch 64)
# 7. features.log  — the demo model on CUDA: adapters' outputs, speculative = plain greedy, structured
#                    (JSON-schema) output, seeded sampling repeats (bench/gpu/features.py)
# summary.md       — the tables of steps 2-5 and 7, for docs/benchmarks.md section 5 (docs/gpu/runN/)
# Each step runs even when an earlier one failed; the exit code is non-zero when any failed.
set -u
cd "$(dirname "$0")/../.."
DIR="${1:-${OUT:-docs/gpu}}"
mkdir -p "$DIR"
PY="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1
unset TRITON_INTERPRET
BUDGET_S="${CHECK_BUDGET_S:-360}"
deadline=$(($(date +%s) + BUDGET_S))
status=0

if [ -n "${WHEELS:-}" ]; then
  "$PY" -m pip install -q --no-index --no-deps "$WHEELS"/*.whl || echo "warning: installing $WHEELS failed"
fi
if ! "$PY" - <<'EOF'; then
import importlib.util, sys
missing = [m for m in ("torch", "triton", "transformers", "peft", "safetensors", "msgspec", "numpy")
           if importlib.util.find_spec(m) is None]
if missing:
    sys.exit(f"bench/gpu/check.sh: missing Python packages: {', '.join(missing)} (carry wheels: WHEELS=dir)")
import torch
if not torch.cuda.is_available():
    sys.exit("bench/gpu/check.sh needs a CUDA GPU: torch sees none (torch " + torch.__version__ + "); "
             "on CPU run the interpreter tests instead: pytest tests/kernels tests/engine/test_decode_graphs*.py")
EOF
  exit 2
fi

step() {  # step NAME LIMIT_S CMD... : run CMD (cut to the budget left) into $DIR/NAME.log, print its tail
  local name=$1 limit=$2 start rc left
  shift 2
  left=$((deadline - $(date +%s)))
  [ "$left" -lt "$limit" ] && limit=$left
  if [ "$limit" -le 5 ]; then
    echo "== $name: skipped, the ${BUDGET_S} s budget is spent" | tee "$DIR/$name.log"
    status=1
    return
  fi
  start=$(date +%s)
  timeout "$limit" "$@" >"$DIR/$name.log" 2>&1
  rc=$?
  echo "== $name: exit $rc after $(($(date +%s) - start)) s (limit $limit s)" | tee -a "$DIR/$name.log"
  tail -n 40 "$DIR/$name.log"
  [ "$rc" -eq 0 ] || status=1
}

{
  date -u
  git log -1 --format='commit %h %s' 2>/dev/null
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv 2>&1
  "$PY" -c 'import sys, torch, triton, transformers, peft
print("python", sys.version.split()[0], "| torch", torch.__version__, "| cuda", torch.version.cuda,
      "| triton", triton.__version__, "| transformers", transformers.__version__, "| peft", peft.__version__)
print("device:", torch.cuda.get_device_name())' 2>&1
} >"$DIR/env.txt"
cat "$DIR/env.txt"

step kernels 70 "$PY" bench/kernels/triton_gpu.py --dtype bfloat16 --hidden 2048 --slices 2048,256,256 \
  --decode-batches 1,64,256 --prefill-tokens 4096
step parity 75 "$PY" -m bench.gpu.e2e --skip-throughput --json "$DIR/parity.json"
step moe 45 "$PY" -m bench.gpu.moe_graphs --device cuda --json "$DIR/moe_graphs.json"
step overhead 150 "$PY" -m bench.gpu.lora_overhead --size 1b --dtype bfloat16 --batches 1,64,256 \
  --adapters 32 --rank 16 --compare-sgmv --json "$DIR/overhead.json"
step profile 45 "$PY" -m bench.gpu.step_profile --size 1b --requests 64 --steps 10
step features 45 "$PY" -m bench.gpu.features --device cuda

{
  echo "# GPU check $(date -u +%F) — $(sed -n 2p "$DIR/env.txt")"
  echo
  sed -n '3,$p' "$DIR/env.txt"
  for name in kernels parity moe overhead features; do
    echo
    echo "## $name"
    echo
    grep -E '^\||^== |^[A-Z].*;' "$DIR/$name.log" 2>/dev/null || echo "(no $name.log)"
  done
} >"$DIR/summary.md"
echo "results in $DIR (summary.md for docs/benchmarks.md section 5); exit $status"
exit $status
