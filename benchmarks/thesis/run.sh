#!/usr/bin/env bash
# The thesis sweeps of the README table: which factor the latent takes under each reconstruction term.
# Embedded model, CPU: about 6 min a run on 2 cores (2 jobs of 1 thread), so about 1 hour per sweep of 9 runs.
# ALL=1 adds the cells the README table does not have yet.
#   bash benchmarks/thesis/run.sh [OUT]      (default OUT = runs/thesis)
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT="${1:-runs/thesis}"
D=".venv/bin/disentangle"
mkdir -p "$OUT/data"
for set in two-factor style-in-content; do
  [ -f "$OUT/data/$set-train.jsonl" ] || $D data synth "$set" --output "$OUT/data/$set-train.jsonl" --rows 800 --seed 0
  [ -f "$OUT/data/$set-heldout.jsonl" ] || $D data synth "$set" --output "$OUT/data/$set-heldout.jsonl" --rows 200 --seed 1
done
TERMS=(
  --cell "raw reconstruction_weight=1"
  --cell "term3-alpha1 reconstruction_weight=0 token_weighted_weight=1 token_weight_alpha=1"
  --cell "term3-alpha2 reconstruction_weight=0 token_weighted_weight=1 token_weight_alpha=2"
  --cell "term3-alpha2-tokenview reconstruction_weight=0 token_weighted_weight=1 token_weight_alpha=2 encoder_view=token_weighted"
  --cell "raw-alpha2-tokenview reconstruction_weight=1 token_weight_alpha=2 encoder_view=token_weighted"
)
# Not run for the README table yet (CPU time): term 4 and the term-5 ablation, term 3 at alpha 0.5 and 1 with the token_weighted view.
MORE=(
  --cell "term4 reconstruction_weight=0 normalized_concentration_corrected_token_weighted_weight=1"
  --cell "term5 reconstruction_weight=0 normalized_inverse_surprisal_token_weighted_weight=1"
  --cell "term3-alpha0.5 reconstruction_weight=0 token_weighted_weight=1 token_weight_alpha=0.5"
  --cell "term3-alpha1-tokenview reconstruction_weight=0 token_weighted_weight=1 token_weight_alpha=1 encoder_view=token_weighted"
)
if [ "${ALL:-0}" = 1 ]; then TERMS+=("${MORE[@]}"); fi
$D sweep --config benchmarks/thesis/base.yaml --output-dir "$OUT/two-factor" --seeds 0,1,2 --jobs 2 \
  --set "data.data=$OUT/data/two-factor-train.jsonl" --eval-data "$OUT/data/two-factor-heldout.jsonl" "${TERMS[@]}"
$D sweep --config benchmarks/thesis/base.yaml --output-dir "$OUT/style-in-content" --seeds 0,1,2 --jobs 2 \
  --set "data.data=$OUT/data/style-in-content-train.jsonl" --eval-data "$OUT/data/style-in-content-heldout.jsonl" \
  --cell "raw reconstruction_weight=1" \
  --cell "default reconstruction_weight=1 token_weighted_weight=1 token_weight_alpha=1" \
  --cell "term3-alpha2-tokenview reconstruction_weight=0 token_weighted_weight=1 token_weight_alpha=2 encoder_view=token_weighted"
# Where the weights fall (the README's weight tables).
for set in two-factor style-in-content; do .venv/bin/python benchmarks/thesis/weight_shares.py "$OUT/data/$set-heldout.jsonl"; done
# The real-data row: the main job on the chatterbot corpus, evaluated on its validation split (labels = categories).
$D train --config configs/default.yaml --output-dir "$OUT/chatterbot/default"
$D eval "$OUT/chatterbot/default" --data validation
