#!/usr/bin/env bash
# The checks of the CUDA path, on a machine with one CUDA GPU (never run yet: until this script has run on one,
# the CUDA path is untested). Steps, each logged to its own file under LOG_DIR:
#   1. set-up: scripts/setup.sh (torch==2.13.0 from PyPI is the CUDA build on a Linux x86 GPU machine)
#   2. the device: torch sees CUDA, its name, CUDA version and bf16 support
#   3. the test suite (pytest -q; the tests build their tiny models on the CPU)
#   4. CUDA smoke runs of the trainer: a few steps of the main job's config, frozen decoder (--preset frozen), then
#      the default's LoRA with --gradient-checkpointing; generation from the first one's checkpoint, plain and guided (--guidance 2)
#   5. benchmarks/step_cost.py in bf16: the embedded SmolLM2-135M (with case (g), activation checkpointing, and the
#      useful-FLOP MFU and --profile breakdown; on CUDA the matmul rate is torch.matmul's on the GPU),
#      and the decoder-size table of real shapes with random weights (MODELS, config:smollm2-1.7b among them);
#      benchmarks/prompt_apart.py: the between placement's prompt once, against the prefix placement
#   6. the main job, `disentangle train --config configs/default.yaml`, timed by phase (benchmarks/main_job.py):
#      with an empty model cache (the GGUF is dequantised again) and an empty feature cache, then again on the
#      caches that run filled (the second run: no dequantisation, no frozen pass)
#   Every run here uses feature caches under LOG_DIR, never the user's ~/.cache/disentanglement/features.
# then one summary block. Any failing step stops the script (set -euo pipefail) naming the step and its log.
#
# Usage: bash scripts/gpu_check.sh
# Environment:
#   DEVICE=cuda|cpu   cpu runs every piece on the CPU (to check the script without a GPU; slow: use QUICK=1)
#   QUICK=1           a check of the script, not of the GPU: 2 steps on 64 examples, 1 repeat, no memory
#                     measurement, only this script's own test files instead of the whole suite
#   PY=PYTHON         the interpreter with the project installed (default .venv/bin/python)
#   SKIP_SETUP=1      use the existing .venv (e.g. on a machine without network access)
#   LOG_DIR=DIR       where logs and runs go (default runs/gpu_check/<UTC time>)
#   MODELS=LIST       the step_cost size table's models (default: all four config:NAME shapes)
#   PYTEST_ARGS=...   instead of "-q" (split on spaces, no quoting: e.g. "-q -x tests/test_models.py")
set -Eeuo pipefail
cd "$(dirname "$0")/.."

DEVICE="${DEVICE:-cuda}"
QUICK="${QUICK:-0}"
LOG_DIR="${LOG_DIR:-runs/gpu_check/$(date -u +%Y%m%dT%H%M%SZ)}"
MODELS="${MODELS:-config:smollm2-135m,config:smollm2-360m,config:smollm2-1.7b,config:llama-1b}"
PY="${PY:-.venv/bin/python}"
mkdir -p "$LOG_DIR"
LOG_DIR="$(cd "$LOG_DIR" && pwd)"
SUMMARY="$LOG_DIR/summary.txt"
STEP="start"
trap 'echo "gpu_check: FAILED at step \"$STEP\" (exit $?); see $LOG_DIR/$STEP.log" >&2' ERR

if [ "$QUICK" = 1 ]; then
    SMOKE_STEPS=2 REPEATS=(--repeats 1 --warmup 0) MEMORY=(--skip-memory) EXAMPLES=(--max-examples 64)
    MAIN_STEPS=(--max-steps 2 --max-examples 64)
else
    SMOKE_STEPS=5 REPEATS=() MEMORY=() EXAMPLES=() MAIN_STEPS=()
fi

# Run "$@" with its output in $LOG_DIR/$1.log (the step's name), echoed; record its wall time.
declare -A SECONDS_OF
run_step() {
    STEP="$1"
    shift
    echo "== $STEP: $*" | tee "$LOG_DIR/$STEP.log"
    local start=$SECONDS
    "$@" 2>&1 | tee -a "$LOG_DIR/$STEP.log"
    SECONDS_OF[$STEP]=$((SECONDS - start))
    echo "== $STEP done in ${SECONDS_OF[$STEP]} s" | tee -a "$LOG_DIR/$STEP.log"
}

# 1. set-up
if [ "${SKIP_SETUP:-0}" != 1 ]; then
    run_step setup bash scripts/setup.sh
fi
[ -x "$PY" ] || { echo "gpu_check: $PY is missing (run scripts/setup.sh)" >&2; exit 1; }
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-4}"

# 2. the device
run_step device "$PY" - "$DEVICE" <<'EOF'
import sys

import torch

device = sys.argv[1]
print(f"torch {torch.__version__}, CUDA build {torch.version.cuda}, cuda available {torch.cuda.is_available()}")
if device == "cuda":
    if not torch.cuda.is_available():
        sys.exit(
            "no CUDA device: this torch is the CPU build or sees no GPU; install the CUDA build of torch==2.13.0 "
            "(pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128) or run with DEVICE=cpu"
        )
    print(f"device: {torch.cuda.get_device_name(0)}, bf16 supported {torch.cuda.is_bf16_supported()}, "
          f"memory {torch.cuda.get_device_properties(0).total_memory / 2**30:.1f} GiB")
    x = torch.randn(64, 64, device="cuda", dtype=torch.bfloat16)
    torch.testing.assert_close((x @ x).float(), x.float() @ x.float(), rtol=0.05, atol=0.5)
EOF

# 3. the test suite (CPU-only tests: conftest builds tiny models on the CPU; this checks the install)
if [ "$QUICK" = 1 ]; then
    run_step tests "$PY" -m pytest -q -x tests/test_gradient_checkpointing.py tests/test_model_shapes.py \
        tests/test_feature_store.py tests/test_flops.py tests/test_attention_backward.py
else
    # shellcheck disable=SC2086 # PYTEST_ARGS is a list of words
    run_step tests "$PY" -m pytest ${PYTEST_ARGS:--q}
fi

# 4. CUDA smoke runs of the trainer (the model cache of the main job's later run is a different, empty folder)
SMOKE_CACHE="$LOG_DIR/smoke_model_cache"
export DISENTANGLEMENT_FEATURE_CACHE="$LOG_DIR/smoke_feature_cache"  # not the user's feature cache
run_step smoke_frozen "$PY" -m disentanglement.cli train --config configs/default.yaml --preset frozen \
    --device "$DEVICE" \
    --max-steps "$SMOKE_STEPS" --eval-every "$SMOKE_STEPS" --save-every "$SMOKE_STEPS" --no-progress \
    --output-dir "$LOG_DIR/smoke_frozen" --model-cache-dir "$SMOKE_CACHE" "${EXAMPLES[@]}"
run_step smoke_lora_checkpointed "$PY" -m disentanglement.cli train --config configs/default.yaml \
    --device "$DEVICE" --decoder-training lora --gradient-checkpointing \
    --max-steps "$SMOKE_STEPS" --eval-every "$SMOKE_STEPS" --save-every "$SMOKE_STEPS" --no-progress \
    --output-dir "$LOG_DIR/smoke_lora" --model-cache-dir "$SMOKE_CACHE" "${EXAMPLES[@]}"
# the same run again into another folder: it reads the feature cache the first one filled (no frozen pass)
run_step smoke_frozen_again "$PY" -m disentanglement.cli train --config configs/default.yaml --preset frozen \
    --device "$DEVICE" \
    --max-steps "$SMOKE_STEPS" --eval-every "$SMOKE_STEPS" --save-every "$SMOKE_STEPS" --no-progress \
    --output-dir "$LOG_DIR/smoke_frozen_again" --model-cache-dir "$SMOKE_CACHE" "${EXAMPLES[@]}"
grep -qE ", 0 computed$" "$LOG_DIR/smoke_frozen_again.log" || { echo "gpu_check: the second run ran the frozen pass" >&2; exit 1; }
run_step cache_list "$PY" -m disentanglement.cli cache list
# generation on the device from the smoke run's checkpoint: plain, then guided (the default's 8 codes, 8 streams a
# prompt); generate loads the model through the user's model cache (~/.cache/disentanglement), as a user's would
run_step generate_plain "$PY" -m disentanglement.cli generate "$LOG_DIR/smoke_frozen" --device "$DEVICE" \
    --prompt "What is your favourite colour?" --greedy --max-new-tokens 24 --no-progress
run_step generate_guided "$PY" -m disentanglement.cli generate "$LOG_DIR/smoke_frozen" --device "$DEVICE" \
    --prompt "What is your favourite colour?" --greedy --max-new-tokens 24 --guidance 2 --no-progress

# 5. step cost in bf16
run_step step_cost_embedded "$PY" benchmarks/step_cost.py --model embedded --device "$DEVICE" --dtype bfloat16 \
    --gradient-checkpointing --skip-scaling --profile "${REPEATS[@]}" "${MEMORY[@]}"
run_step step_cost_sizes "$PY" benchmarks/step_cost.py --models "$MODELS" --device "$DEVICE" --dtype bfloat16 \
    --batch-size 8 --gradient-checkpointing "${REPEATS[@]}" "${MEMORY[@]}"

# the between placement's prompt run once (a step and the verdict's scoring against the prefix placement)
run_step prompt_apart "$PY" benchmarks/prompt_apart.py --device "$DEVICE" "${REPEATS[@]}"

# 6. the main job, timed by phase: empty model and feature caches, then the second run on the caches it filled
run_step main_job "$PY" benchmarks/main_job.py --device "$DEVICE" --caches both "${MAIN_STEPS[@]}"

STEP=summary
{
    echo "================ gpu_check summary ($(date -u +%Y-%m-%dT%H:%M:%SZ), DEVICE=$DEVICE QUICK=$QUICK) ================"
    grep -E "^(torch |device: )" "$LOG_DIR/device.log" || true
    echo "tests: $(grep -E "(passed|failed|error)" "$LOG_DIR/tests.log" | tail -n 1)"
    for step in "${!SECONDS_OF[@]}"; do echo "time $step: ${SECONDS_OF[$step]} s"; done | sort
    "$PY" - "$LOG_DIR" <<'EOF'
import json
import sys
from pathlib import Path

log_dir = Path(sys.argv[1])


def last_json(log: str):
    """The last line of ``log`` that is a JSON object or list (step_cost.py's summary), else None."""
    path = log_dir / log
    for line in reversed(path.read_text().splitlines() if path.exists() else []):
        if line.startswith(("{", "[")):
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                continue
    return None


for run in ("smoke_frozen", "smoke_lora", "smoke_frozen_again"):
    path = log_dir / run / "metrics.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    train = [r for r in records if "loss" in r]
    if train:
        first, last = train[0], train[-1]
        print(f"{run}: {len(train)} steps, loss {first['loss']:.4f} -> {last['loss']:.4f}")
    else:
        print(f"{run}: no metrics")
main_log = log_dir / "main_job.log"
for line in main_log.read_text().splitlines() if main_log.exists() else []:
    if line.startswith('{"run"'):
        job = json.loads(line)
        print(f"main_job {job['run']}: {job['seconds']}, step mean {job['step_mean_s']} s")
embedded = last_json("step_cost_embedded.log")
if embedded:
    ms, peak = embedded["ms"], embedded["peak_mib"]
    print(
        f"step_cost embedded bf16: (c)/(a) {embedded['c_over_a']}, (c)/(f) {embedded['c_over_f']}, "
        f"(g)/(c) {embedded.get('g_over_c')}, frozen pass {embedded['frozen_pass_tokens_per_s']} tokens/s, "
        f"ms {ms}, peak MiB {peak}"
    )
    mfu = (embedded.get("mfu") or {}).get("cases", {}).get("c")
    if mfu:
        print(f"step_cost embedded bf16 (c): {mfu['gflop']} GFLOP/step, MFU {mfu['mfu_bf16']} of bf16 matmul rate "
              f"{embedded['mfu']['matmul_gflops']}; profile ms {embedded.get('profile_ms')}")
for row in last_json("step_cost_sizes.log") or []:
    print(
        f"step_cost {row['model']} ({row['parameters'] / 1e6:.0f}M): (c) {row['ms']['c']} ms, "
        f"(c)/(f) {row['c_over_f']}, (g)/(c) {row.get('g_over_c')}, frozen pass "
        f"{row['frozen_pass_tokens_per_s']} tokens/s, peak MiB {row['peak_mib']}"
    )
EOF
    echo "logs: $LOG_DIR"
} | tee "$SUMMARY"
