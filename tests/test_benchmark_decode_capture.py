"""The decode-step micro-benchmark of issue 61 (examples/benchmarks/decode_capture.py) cannot rot between GPU
runs: its dry run measures every bucket eager on a tiny model on the CPU (the capture modes reported as not
available there), writes its dated results, and the GPU sequence records and renders them as its first
stage."""

from __future__ import annotations

import json

import pytest

from support.benchmark_scripts import benchmark_modules


@pytest.fixture(scope="module")
def modules():
    with benchmark_modules("decode_capture", "gpu_sequence") as imported:
        yield imported


def test_a_dry_run_measures_each_bucket_eager_and_the_sequence_records_it(modules, tmp_path):
    capture, sequence = modules["decode_capture"], modules["gpu_sequence"]
    report = tmp_path / "report.json"
    arguments = ["--output-dir", str(tmp_path), "--report", str(report), "--dry-run", "--setups", "gpu-0.5b"]
    assert capture.main(arguments) == 0
    record = json.loads(report.read_text())
    (dated,) = tmp_path.glob("*-decode-capture-dry-run.json")
    assert json.loads(dated.read_text())["measurements"] == record["measurements"]
    measured = [(m["setup"], m["mode"], m["rows"]) for m in record["measurements"]]
    assert measured == [("gpu-0.5b", "eager", rows) for rows in capture.DRY_RUN["rows"]]
    for m in record["measurements"]:
        assert m["steps"] == capture.DRY_RUN["new_tokens"] - 1 and m["step_ms"] > 0 and m["iteration_ms"] > 0
        assert m["cache_length"] == capture.DRY_RUN["prompt_tokens"] + capture.DRY_RUN["new_tokens"]
        assert not m["fell_back"]
    assert record["skipped"] == ["cuda_graphs and compile (no CUDA device: eager only)"]
    assert "| gpu-0.5b | 4 | eager | 24 |" in dated.with_suffix(".md").read_text()

    stage = sequence.STAGES[0]
    entry = dict(sequence.system_entry(record, stage, "decode-capture"), date="d")
    assert entry["runs"] == record["measurements"]
    markdown = sequence.render({"date": "d", "stages": {stage.name: {"decode-capture": entry}}})
    assert "capture (d, none):" in markdown and "| gpu-0.5b | 1 | eager |" in markdown
    assert "| capture |" not in markdown  # its figures are not the systems' table's
    assert "Not yet run: 0.5b-bf16 marl-graph" in markdown


def test_the_setups_are_checked_before_any_work(modules, tmp_path):
    with pytest.raises(SystemExit, match=r"--setups: unknown \['gpu-7b'\]"):
        modules["decode_capture"].main(["--output-dir", str(tmp_path), "--setups", "gpu-7b", "--dry-run"])
