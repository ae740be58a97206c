#!/usr/bin/env bash
# The GPU table of issue 61 in one command for a short time on a GPU (about 9 minutes):
#   bash scripts/gpu-sequence.sh OUTPUT_DIR [--stages A,B] [--budget-s SECONDS]
# 1. installs the wheels carried in .whl/ (python scripts/gpu_wheels.py download, run beforehand where a
#    package index is reachable) into /tmp/site, offline, ahead of the machine's own packages;
# 2. runs examples/benchmarks/gpu_sequence.py: from the first system the newest committed
#    benchmarks/results/*-gpu-sequence.json lacks, one process per system, the dated results (.md and .json)
#    rewritten in OUTPUT_DIR after each, stopping before a process that would not end inside --budget-s
#    (default 480 s). Copy both files into benchmarks/results/ and commit them; the next run goes on from there.
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
if [ $# -lt 1 ]; then
    echo "usage: bash scripts/gpu-sequence.sh OUTPUT_DIR [--stages A,B] [--budget-s SECONDS]" >&2
    exit 2
fi
output="$1"
shift
site=""
if compgen -G ".whl/*.whl" > /dev/null; then
    site=/tmp/site
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" \
        .whl/*.whl || { echo "gpu-sequence: installing the wheels of .whl/ failed" >&2; exit 1; }
fi
export PYTHONPATH="$PWD${site:+:$site}${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
if ! "$PYTHON" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "gpu-sequence: torch sees no CUDA device; the CPU dry run is: python examples/benchmarks/gpu_sequence.py --dry-run --output-dir DIR" >&2
    exit 1
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null
"$PYTHON" -c "import torch, transformers, peft, trl, bitsandbytes, datasets
print(*(f'{m.__name__} {m.__version__}' for m in (torch, transformers, peft, trl, bitsandbytes, datasets)))" || exit 1
"$PYTHON" examples/benchmarks/gpu_sequence.py --output-dir "$output" "$@"
