#!/usr/bin/env bash
# The thesis sweeps of docs/results.md: which factor the latent takes under each reconstruction term.
# Embedded model, CPU: one run takes about 12 min on one idle core in float32 (7 in bf16); 2 jobs of 1 thread each.
# docs/results.md ran fewer seeds of some cells (it says which). The tables: .venv/bin/python benchmarks/thesis/table.py "$OUT" (every finished run under OUT, per data set).
#   bash benchmarks/thesis/run.sh [OUT]      (default OUT = runs/thesis)
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT="${1:-runs/thesis}"
D=".venv/bin/disentangle"
mkdir -p "$OUT/data"
for set in two-factor style-in-content style-in-echo; do
  [ -f "$OUT/data/$set-train.jsonl" ] || $D data synth "$set" --output "$OUT/data/$set-train.jsonl" --rows 800 --seed 0
  [ -f "$OUT/data/$set-heldout.jsonl" ] || $D data synth "$set" --output "$OUT/data/$set-heldout.jsonl" --rows 200 --seed 1
done
TERMS=(
  --cell "raw reconstruction_weight=1"
  --cell "term3-alpha1 reconstruction_weight=0 token_weighted_weight=1 token_weight_alpha=1"
  --cell "term3-alpha2 reconstruction_weight=0 token_weighted_weight=1 token_weight_alpha=2"
  --cell "raw-alpha2-tokenview reconstruction_weight=1 token_weight_alpha=2 encoder_view=token_weighted"
  --cell "term3-alpha0.5-tokenview reconstruction_weight=0 token_weighted_weight=1 token_weight_alpha=0.5 encoder_view=token_weighted"
  --cell "term3-alpha1-tokenview reconstruction_weight=0 token_weighted_weight=1 token_weight_alpha=1 encoder_view=token_weighted"
  --cell "term3-alpha2-tokenview reconstruction_weight=0 token_weighted_weight=1 token_weight_alpha=2 encoder_view=token_weighted"
  --cell "term3-alpha2-attention reconstruction_weight=0 token_weighted_weight=1 token_weight_alpha=2 encoder_view=attention"
  --cell "term4-alpha2-tokenview reconstruction_weight=0 normalized_concentration_corrected_token_weighted_weight=1 token_weight_alpha=2 encoder_view=token_weighted"
  --cell "term5-alpha2-tokenview reconstruction_weight=0 normalized_inverse_surprisal_token_weighted_weight=1 token_weight_alpha=2 encoder_view=token_weighted"
)
$D sweep --config benchmarks/thesis/base.yaml --output-dir "$OUT/two-factor" --seeds 0,1,2 --jobs 2 \
  --set "data.data=$OUT/data/two-factor-train.jsonl" --eval-data "$OUT/data/two-factor-heldout.jsonl" "${TERMS[@]}"
# The memory placement's row (one seed).
$D sweep --config benchmarks/thesis/base.yaml --output-dir "$OUT/tf-mem" --seeds 0 --jobs 1 \
  --set "data.data=$OUT/data/two-factor-train.jsonl" --eval-data "$OUT/data/two-factor-heldout.jsonl" \
  --cell "term3-alpha2-tokenview-memory reconstruction_weight=0 token_weighted_weight=1 token_weight_alpha=2 encoder_view=token_weighted latent_placement=memory"
STYLE=(
  --cell "raw reconstruction_weight=1"
  --cell "default reconstruction_weight=1 token_weighted_weight=1 token_weight_alpha=1"
  --cell "term3-alpha2-tokenview reconstruction_weight=0 token_weighted_weight=1 token_weight_alpha=2 encoder_view=token_weighted"
)
$D sweep --config benchmarks/thesis/base.yaml --output-dir "$OUT/style-in-content" --seeds 0 --jobs 2 \
  --set "data.data=$OUT/data/style-in-content-train.jsonl" --eval-data "$OUT/data/style-in-content-heldout.jsonl" \
  "${STYLE[@]:2}"  # docs/results.md's two style-in-content rows (one seed each): STYLE without its raw cell
# style-in-echo in bf16 (the fast path on this CPU; its table is all bf16).
$D sweep --config benchmarks/thesis/base.yaml --output-dir "$OUT/echo" --seeds 0,1,2 --jobs 2 --set dtype=bfloat16 \
  --set "data.data=$OUT/data/style-in-echo-train.jsonl" --eval-data "$OUT/data/style-in-echo-heldout.jsonl" "${STYLE[@]}" \
  --cell "terms13-alpha2-tokenview reconstruction_weight=1 token_weighted_weight=1 token_weight_alpha=2 encoder_view=token_weighted"
# Where the weights fall (docs/results.md's weight tables).
for set in two-factor style-in-content style-in-echo; do .venv/bin/python benchmarks/thesis/weight_shares.py "$OUT/data/$set-heldout.jsonl"; done
# The real-data row: the main job on the chatterbot corpus, evaluated on its validation split (labels = categories).
$D train --config configs/default.yaml --output-dir "$OUT/chatterbot/default"
$D eval "$OUT/chatterbot/default" --data validation
