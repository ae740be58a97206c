#!/usr/bin/env bash
# Checks the GPU path on a machine with a CUDA device, and writes a dated results file:
#   bash scripts/gpu-check.sh [--quick] [OUTPUT.md]
# 1. the tests marked `cuda` (family-table exactness in bf16 and fp16 on CUDA, a short 4-bit and 8-bit training
#    run with prefix packing on, an fp16 kill-and-resume, the graph sampler's capture), with the slow tests
#    they need;
# 2. the benchmark's GPU setups against TRL (examples/benchmarks/vs_trl.py --setup gpu: Qwen2.5-0.5B- and
#    1.5B-shaped bases built from a config with a tokenizer the benchmark trains, bf16 and 4-bit; it needs
#    marl's requirements and this repository). About an hour on an H200 (a run takes about a minute).
# 3. --fit auto and the out-of-memory retry (examples/benchmarks/fit_check.py), also with --quick.
# --quick fits a short GPU session (about 10 minutes, estimated): the graph sampler's capture tests in bf16, and one run
# each of marl's graph and eager decodes and TRL's RLOOTrainer at both shapes in bf16.
# Without CUDA it says so and exits 0 without running anything: the CPU suite (docs/development.md) covers the rest.
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"

if ! "$PYTHON" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "gpu-check: torch sees no CUDA device here; the tests marked cuda are skipped and nothing was run."
    exit 0
fi

quick=0
if [ "${1:-}" = --quick ]; then quick=1; shift; fi
output="${1:-benchmarks/results/$(date +%F)-gpu-check.md}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # marl from this repository, installed or not

# marl run from a checkout was never installed by pip, so nothing checked its requirements (pyproject.toml):
# check them before any test or benchmark starts. MARL_ALLOW_UNMET=1 runs anyway (a machine whose CUDA build of
# torch cannot be replaced, say); the results file then lists what was unmet.
unmet="$("$PYTHON" -c "import tomllib; from marl.environment import unmet_requirements as unmet
print('; '.join(unmet(tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies'])))")" || exit 1
if [ -n "$unmet" ] && [ "${MARL_ALLOW_UNMET:-0}" != 1 ]; then
    echo "gpu-check: requirements of marl (pyproject.toml) not met here: $unmet."
    echo "  Install them (each is a pip requirement: pip install '<requirement>'), or run with MARL_ALLOW_UNMET=1."
    exit 1
fi
log="$(mktemp)"
if "$PYTHON" -c "import pytest, hypothesis" 2>/dev/null; then
    if [ "$quick" = 1 ]; then
        tests=(tests/rollout/test_samplers_cuda.py -k "bfloat16 or a_bf16_run")
    else
        tests=(tests/)
    fi
    "$PYTHON" -m pytest --run-slow -m cuda -v "${tests[@]}" 2>&1 | tee "$log"
    tests_status=${PIPESTATUS[0]}
else
    echo "gpu-check: pytest or hypothesis is not installed; the tests marked cuda were not run" | tee "$log"
    tests_status=1
fi
bench_output="${output%.md}-benchmark.md"
if [ "$quick" = 1 ]; then
    bench=(--quantization none --runs 1 --updates 3 --systems marl-graph,marl,trl)
else
    bench=(--runs 3)
fi
"$PYTHON" examples/benchmarks/vs_trl.py --setup gpu "${bench[@]}" --output "$bench_output"
bench_status=$?
# --fit auto under a cap below the typed settings' plan, and a real out-of-memory error after update 1 retried
# at half the micro-batch (a few minutes; its CPU dry run is tests/test_benchmark_fit_check.py)
fit_output="${output%.md}-fit.md"
"$PYTHON" examples/benchmarks/fit_check.py --work "$(mktemp -d)" --output "$fit_output"
fit_status=$?

{
    echo "# GPU check, $(date +%F)"
    echo
    echo "Command: \`bash scripts/gpu-check.sh$([ "$quick" = 1 ] && echo " --quick")\`"
    echo
    echo '```'
    "$PYTHON" -c "from marl.environment import machine_description as m, package_versions as v
for key, value in {**m(), **v()}.items(): print(f'{key}: {value}')"
    echo '```'
    echo
    [ -n "$unmet" ] && echo "Requirements not met (run with MARL_ALLOW_UNMET=1): $unmet." && echo
    echo "## Tests marked cuda (exit status $tests_status)"
    echo
    echo '```'
    grep -E "PASSED|FAILED|ERROR|SKIPPED|passed|failed|not run" "$log"
    echo '```'
    echo
    echo "## Benchmark (exit status $bench_status): see $(basename "$bench_output")"
    echo
    echo "## --fit auto and the out-of-memory retry (exit status $fit_status): see $(basename "$fit_output")"
} > "$output"
echo "gpu-check: results written to $output"
exit $(( tests_status || bench_status || fit_status ))
