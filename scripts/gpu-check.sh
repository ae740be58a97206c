#!/usr/bin/env bash
# Checks the GPU path on a machine with a CUDA device, and writes a dated results file:
#   bash scripts/gpu-check.sh [OUTPUT.md]
# 1. the tests marked `cuda` (family-table exactness in bf16 and fp16 on CUDA, a short 4-bit and 8-bit training
#    run with prefix packing on, an fp16 kill-and-resume), with the slow tests they need;
# 2. the benchmark's GPU setups against TRL (examples/benchmarks/vs_trl.py --setup gpu: Qwen2.5-0.5B- and
#    1.5B-shaped bases built from a config with a tokenizer the benchmark trains, bf16 and 4-bit; it needs only
#    torch, transformers, peft, trl, bitsandbytes, accelerate and this repository).
# Without CUDA it says so and exits 0 without running anything: the CPU suite (README, "Development") covers the rest.
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"

if ! "$PYTHON" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "gpu-check: torch sees no CUDA device here; the tests marked cuda are skipped and nothing was run."
    exit 0
fi

output="${1:-benchmarks/results/$(date +%F)-gpu-check.md}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # marl from this repository, installed or not
log="$(mktemp)"
if "$PYTHON" -c "import pytest, hypothesis" 2>/dev/null; then
    "$PYTHON" -m pytest --run-slow -m cuda -v tests/ 2>&1 | tee "$log"
    tests_status=${PIPESTATUS[0]}
else
    echo "gpu-check: pytest or hypothesis is not installed; the tests marked cuda were not run" | tee "$log"
    tests_status=1
fi
bench_output="${output%.md}-benchmark.md"
"$PYTHON" examples/benchmarks/vs_trl.py --setup gpu --runs 3 --output "$bench_output"
bench_status=$?

{
    echo "# GPU check, $(date +%F)"
    echo
    echo "Command: \`bash scripts/gpu-check.sh\`"
    echo
    echo '```'
    "$PYTHON" -c "from marl.environment import machine_description as m, package_versions as v
for key, value in {**m(), **v()}.items(): print(f'{key}: {value}')"
    echo '```'
    echo
    echo "## Tests marked cuda (exit status $tests_status)"
    echo
    echo '```'
    grep -E "PASSED|FAILED|ERROR|SKIPPED|passed|failed|not run" "$log"
    echo '```'
    echo
    echo "## Benchmark (exit status $bench_status): see $(basename "$bench_output")"
} > "$output"
echo "gpu-check: results written to $output"
exit $(( tests_status || bench_status ))
