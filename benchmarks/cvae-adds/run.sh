#!/usr/bin/env bash
# docs/what-the-cvae-adds.md: term 3 alone at alpha 2 (the default) against terms 1 + 3 at alpha 2, both with the
# token_weighted view, on two-factor and style-in-echo (the thesis base: K = 4, 120 steps of 8, 800 training rows
# of seed 0, 200 held-out rows of seed 1, bf16), each checkpoint then scored by eval --generation; and DailyDialog's
# dialogue act (train on dialogues 0-699 of the validation split, evaluate on 700-999), K = 8.
#   bash benchmarks/cvae-adds/run.sh [OUT] [DAILYDIALOG_JSONL]     (OUT defaults to runs/cvae-adds; without DAILYDIALOG_JSONL the DailyDialog part is skipped)
# Each run takes about 10 min on one idle core in bf16 (three to four times that on the shared 2-core machine).
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT="${1:-runs/cvae-adds}"
DD="${2:-}"
D="${DISENTANGLE:-.venv/bin/disentangle}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
mkdir -p "$OUT/data" "$OUT/evals"
RECIPES=(
  --cell "term3-alpha2 reconstruction_weight=0 token_weighted_weight=1 token_weight_alpha=2 encoder_view=token_weighted"
  --cell "terms13-alpha2 reconstruction_weight=1 token_weighted_weight=1 token_weight_alpha=2 encoder_view=token_weighted"
)
for set in two-factor style-in-echo; do
  [ -f "$OUT/data/$set-train.jsonl" ] || $D data synth "$set" --output "$OUT/data/$set-train.jsonl" --rows 800 --seed 0
  [ -f "$OUT/data/$set-heldout.jsonl" ] || $D data synth "$set" --output "$OUT/data/$set-heldout.jsonl" --rows 200 --seed 1
  $D sweep --config benchmarks/thesis/base.yaml --output-dir "$OUT/$set" --seeds 0,1,2 --jobs 1 --set dtype=bfloat16 \
    --set "data.data=$OUT/data/$set-train.jsonl" --eval-data "$OUT/data/$set-heldout.jsonl" "${RECIPES[@]}"
  for run in "$OUT/$set"/runs/*/seed-*; do
    name="$set-$(basename "$(dirname "$run")")-$(basename "$run")"
    [ -f "$OUT/evals/$name.json" ] || $D eval "$run" --data "$OUT/data/$set-heldout.jsonl" --generation \
      --output "$OUT/evals/$name.json" --no-progress
  done
done
# DailyDialog (never copied into the repository: CC BY-NC-SA). Your own copy of a split: disentangle data dailydialog DIR --output FILE.jsonl
if [ -z "$DD" ]; then
  echo "run.sh: no DailyDialog JSONL given (convert your copy: disentangle data dailydialog DIR --output FILE.jsonl); skipping it"
  python benchmarks/cvae-adds/table.py "$OUT"/evals/*.json
  exit 0
fi
$D data split "$DD" --dialogues 0-699 --output "$OUT/data/dd-train.jsonl" --rest "$OUT/data/dd-eval.jsonl"
$D sweep --config benchmarks/cvae-adds/dailydialog.yaml --output-dir "$OUT/dailydialog" --seeds 0 --jobs 1 \
  --set "data.data=$OUT/data/dd-train.jsonl" --eval-data "$OUT/data/dd-eval.jsonl" \
  --cell "term3 reconstruction_weight=0 token_weighted_weight=1 token_weight_alpha=2 encoder_view=token_weighted" \
  --cell "seeds-recipe reconstruction_weight=1 token_weighted_weight=1 token_weight_alpha=1 encoder_view=mean_last" \
  --cell "terms13-alpha2 reconstruction_weight=1 token_weighted_weight=1 token_weight_alpha=2 encoder_view=token_weighted" \
  --cell "terms13-alpha2-wattention reconstruction_weight=1 token_weighted_weight=1 token_weight_alpha=2 encoder_view=token_weighted_attention"
python benchmarks/cvae-adds/table.py "$OUT"/evals/*.json
