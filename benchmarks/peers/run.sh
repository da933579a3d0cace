#!/usr/bin/env bash
# Side by side with the peers (benchmarks/README.md, "peers"): LangVAE's sentence VAE, peft prompt tuning and
# this tool's discrete and continuous CVAEs on the embedded SmolLM2-135M and the two-factor hidden-factor set.
#
#   bash benchmarks/peers/run.sh [--rows 200] [--steps 40] [--batch-size 8] [--warmup 3] [--seed 0] [--out runs/peers]
#
# Makes LangVAE's own venv (benchmarks/peers/.venv-langvae, gitignored) the first time: langvae 0.6.13 pins
# transformers 4.48.0 and pythae 0.1.2, so it cannot share the project's venv; torch is pinned to the project's
# 2.13.0 (CPU) so that pip does not pull a CUDA build, and everything else to langvae-constraints.txt (the versions
# the table in benchmarks/README.md was measured with). Then runs peers.py in the project's venv, one thread,
# pinned to one core (TASKSET_CPUS, default 0). Not in CI.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"
python="${PYTHON:-$root/.venv/bin/python}"
venv="$here/.venv-langvae"
# (re)installed when missing or when langvae-constraints.txt changed since the last install
if [[ ! -x "$venv/bin/python" ]] || ! "$venv/bin/python" -c "import langvae" 2>/dev/null \
  || ! cmp -s "$here/langvae-constraints.txt" "$venv/installed-constraints.txt"; then
  [[ -x "$venv/bin/python" ]] || "${BASE_PYTHON:-python3}" -m venv "$venv"
  "$venv/bin/pip" install --quiet -c "$here/langvae-constraints.txt" "torch==2.13.0" "langvae==0.6.13"
  cp "$here/langvae-constraints.txt" "$venv/installed-constraints.txt"
fi
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export PYTHONPATH="$root/src${PYTHONPATH:+:$PYTHONPATH}"
cd "$root"
exec taskset -c "${TASKSET_CPUS:-0}" "$python" "$here/peers.py" all --langvae-python "$venv/bin/python" "$@"
