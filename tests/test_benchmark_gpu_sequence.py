"""The GPU sequence of issue 61 (examples/benchmarks/gpu_sequence.py) cannot rot between GPU runs: its
steps resume where a results file left off, every step's command parses to the issue's shapes, and a
``--dry-run`` of the whole sequence runs every step on tiny models on the CPU (slow)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from support.benchmark_scripts import benchmark_modules

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def modules():
    with benchmark_modules("gpu_sequence", "vs_trl", "sweep", "built_models", "decode_capture") as imported:
        yield imported


def test_the_sequence_resumes_at_the_first_system_not_done(modules):
    sequence = modules["gpu_sequence"]
    everything = sequence.steps({})
    assert (everything[0][0].name, everything[0][1]) == ("capture", "decode-capture")  # the step per bucket
    assert [stage.name for stage, _ in everything][1:6] == ["0.5b-bf16"] * 5
    # the issue's order, the compiled graph sampler's runs beside those captured in plain CUDA graphs
    assert [system for _, system in everything[1:5]] == ["marl-graph", "marl-cudagraph", "trl-grpo", "marl"]
    done = {
        "capture": {"decode-capture": {}},
        "0.5b-bf16": {system: {} for system in sequence.STAGES[1].systems},
        "1.5b-bf16": {"marl-graph": {}},
    }
    assert sequence.steps(done)[0][0].name == "1.5b-bf16" and sequence.steps(done)[0][1] == "marl-cudagraph"
    assert len(sequence.steps(done)) == len(everything) - 1 - len(sequence.STAGES[1].systems) - 1
    # a record of the first GPU runs (before the capture stage): it comes first, then what 0.5b-bf16 lacks
    earlier = {"0.5b-bf16": {"marl-graph": {}, "trl-grpo": {}, "marl": {}}}
    assert [(s.name, x) for s, x in sequence.steps(earlier)[:4]] == [
        ("capture", "decode-capture"), ("0.5b-bf16", "marl-cudagraph"), ("0.5b-bf16", "trl-grpo-cb"),
        ("0.5b-bf16", "hf-generate"),
    ]  # fmt: skip
    names = [stage.name for stage in sequence.STAGES]
    assert names.index("8b-4bit") < names.index("sweep-4") < names.index("0.5b-bf16-x3")


def test_every_step_parses_to_the_issue_shapes(modules, tmp_path):
    sequence, vs_trl, sweep = modules["gpu_sequence"], modules["vs_trl"], modules["sweep"]
    for stage, system in sequence.steps({}):
        line = sequence.command(stage, system, tmp_path, dry_run=False)[2:]
        if (
            stage.script == "decode_capture"
        ):  # inside the stage's estimate, its report where the loop reads it
            args = modules["decode_capture"].parse_args(line)
            assert args.budget_s < stage.seconds and args.report == str(tmp_path / "report.json")
            assert args.setups.split(",") == ["gpu-0.5b", "gpu-1.5b"] and not args.dry_run
            continue
        if stage.script == "sweep":
            args = sweep.parse_args(line)
            assert (args.policies, args.sampler, args.quantization) == ("4", "graph", "none")
            continue
        args = vs_trl.parse_args(line)
        config = vs_trl.build_config(stage.setup, args)
        assert (config.device, config.dtype, config.rloo_k, config.prompts_per_update) == (
            "cuda",
            "bfloat16",
            8,
            8,
        )
        assert (config.context_tokens, config.response_length, config.algorithm) == (256, 256, "grpo")
        assert args.systems == system and args.quantization == stage.quantization
    eight_b = vs_trl.build_config("gpu-8b", vs_trl.parse_args(["--setup", "gpu-8b"]))
    shape = modules["built_models"].BUILT_SHAPES[eight_b.model]
    assert (shape["hidden_size"], shape["num_hidden_layers"], shape["vocab_size"]) == (4096, 32, 128_256)
    assert eight_b.gradient_checkpointing
    dry = vs_trl.build_config("gpu-8b", vs_trl.parse_args(["--setup", "gpu-8b", "--dry-run"]))
    assert (dry.device, dry.model) == ("cpu", "tiny-llama-shaped")


def test_the_table_reports_what_was_measured_and_what_is_left(modules):
    sequence = modules["gpu_sequence"]
    run = dict(eps=18.4, sampling_tokens_per_s=9000, decode_step_ms=2.5, first_sampling_s=12.0,
               cuda_max_allocated_mib=5128, logprob_gap_mean=[1e-3, 3e-3], logprob_gap_max=[0.2, 0.4],
               sampler_path="compiled+graphs")  # fmt: skip
    entry = dict(runs=[run], config={"response_length": 256}, machine={"gpu": "card"}, date="d",
                 machine_floors={"bytes_per_s": 2e12}, work={"decode": {"bytes": 256 * 1e9}})  # fmt: skip
    record = {"date": "d", "stages": {"0.5b-bf16": {"marl-graph": entry}}}
    markdown = sequence.render(record)
    row = next(line for line in markdown.splitlines() if line.startswith("| 0.5b-bf16 | marl-graph"))
    assert "| 18.40 | 9000 | 2.50 | 0.50 | 2.15 | 12.0 | 5128 | 3.0e-03 / 4.0e-01 | compiled+graphs |" in row
    assert "Not yet run: capture decode-capture, 0.5b-bf16 marl-cudagraph, 0.5b-bf16 trl-grpo" in markdown


# The stages whose code paths differ: the others repeat one of these at another shape or with more runs (the
# test above parses each of their commands; the capture stage's dry run is tests/test_benchmark_decode_
# capture.py's); the whole sequence's dry run takes about 15 processes of 20-60 s. On a CPU marl-graph and
# marl-cudagraph both decode eager: 0.5b-bf16 runs marl-cudagraph, the later stages marl-graph.
DISTINCT_STAGES = ("0.5b-bf16", "0.5b-4bit", "8b-4bit", "sweep-4")


def dry_run(tmp_path: Path, name: str, stages: tuple[str, ...], systems: tuple[str, ...] = ()) -> dict:
    environment = dict(os.environ, PYTHONPATH=str(ROOT))
    command = [sys.executable, str(ROOT / "examples" / "benchmarks" / "gpu_sequence.py"), "--dry-run"]
    command += ["--output-dir", str(tmp_path / name), "--work-dir", str(tmp_path / "work")]
    command += ["--stages", ",".join(stages), *(["--systems", ",".join(systems)] if systems else [])]
    completed = subprocess.run(command, env=environment, capture_output=True, text=True, cwd=tmp_path)
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    (record_file,) = (tmp_path / name).glob("*-gpu-sequence-dry-run.json")
    return {"stages": json.loads(record_file.read_text())["stages"], "md": record_file.with_suffix(".md")}


@pytest.mark.slow
def test_a_dry_run_of_the_sequence_runs_every_distinct_step(tmp_path, modules):
    first, *others = DISTINCT_STAGES
    systems = tuple(s for s in modules["gpu_sequence"].STAGES[1].systems if s != "marl-graph")
    bf16 = dry_run(tmp_path, "bf16", (first,), systems)
    record = dry_run(tmp_path, "out", tuple(others))
    stages = {**bf16["stages"], **record["stages"]}
    markdown = record["md"].read_text()
    assert "Not yet run: capture decode-capture, 0.5b-bf16 marl-graph" in markdown
    for stage in DISTINCT_STAGES:
        assert all(entry["runs"] for entry in stages[stage].values()), stage
    assert set(stages[first]) == set(systems) and "marl-graph" in stages["0.5b-4bit"]
    assert stages["0.5b-bf16"]["marl"]["runs"][0]["logprob_gap_mean"]  # the static sampler logs the gap
    # the graph sampler with --graph_capture cuda_graphs, on a CPU: eager (CUDA graphs need a CUDA device)
    assert stages["0.5b-bf16"]["marl-cudagraph"]["runs"][0]["sampler_path"] == "eager"
    assert (
        "Peak" in stages["8b-4bit"]["marl-graph"]["plan"] or "peak" in stages["8b-4bit"]["marl-graph"]["plan"]
    )
