"""The demo's packages (gguf, vaderSentiment, matplotlib) are the ``marl-rlhf[demo]`` extra: without them the
library imports and trains, and what needs one of them says so in one line with the command that installs it.

Each check runs in a fresh process whose imports of those three packages fail as if they were not installed
(a ``sys.meta_path`` finder put first by a bootstrap), so that the packages installed here change nothing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

from support.tiny import write_jsonl

TESTS_DIR = Path(__file__).resolve().parents[1]
REPOSITORY = TESTS_DIR.parent
DEMO_PACKAGES = ("gguf", "vaderSentiment", "matplotlib")
INSTALL = "Install it with: pip install 'marl-rlhf[demo]'"

BLOCK_DEMO_PACKAGES = textwrap.dedent(
    f"""
    import sys

    class NotInstalled:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in {DEMO_PACKAGES!r}:
                raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
            return None

    sys.meta_path.insert(0, NotInstalled())
    """
)


def run_without_demo_packages(script: str, *arguments: str, marl_home: Path) -> subprocess.CompletedProcess:
    environment = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPOSITORY), str(TESTS_DIR)]),
        "MARL_HOME": str(marl_home),  # no converted embedded model: loading it needs gguf
        "MARL_TEST_THREADS": "1",
    }
    return subprocess.run(
        [sys.executable, "-c", BLOCK_DEMO_PACKAGES + textwrap.dedent(script), *arguments],
        capture_output=True,
        text=True,
        env=environment,
        timeout=600,
    )


def test_the_library_imports_and_trains_without_the_demo_packages(tiny_llama_dir, tmp_path):
    script = """
    import importlib.util

    for package in ("gguf", "vaderSentiment", "matplotlib"):
        try:
            importlib.util.find_spec(package)
        except ImportError:
            continue
        raise SystemExit(f"the bootstrap did not block {package}")

    import marl
    from support.tiny import tiny_rloo_config
    from marl.model.loading import load_tokenizer

    model_dir, output_dir = sys.argv[1], sys.argv[2]
    config = tiny_rloo_config(output_dir, model_name_or_path=model_dir, total_episodes=4, num_ppo_epochs=1)
    model = marl.MultiAdapterModel.from_config(config)
    trainer = marl.RLOOTrainer(
        config, model, load_tokenizer(model_dir), [{"prompt": "the movie"}, {"prompt": "a film"}],
        reward_funcs=lambda prompts, completions: [float(len(c)) for c in completions],
    )
    trainer.train()
    print("updates", trainer.state.update)
    """
    output_dir = tmp_path / "run"
    done = run_without_demo_packages(script, str(tiny_llama_dir), str(output_dir), marl_home=tmp_path)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert "updates 1" in lines
    assert (output_dir / "adapter_config.json").is_file()
    assert not (output_dir / "training_curves.png").exists()
    assert (
        f"Done: policy adapter 'policy' written to {output_dir}; training curves not drawn: Drawing the "
        f"training curves needs the package 'matplotlib', which is not installed. {INSTALL}"
    ) in lines


def test_the_vader_judge_and_the_embedded_model_name_the_demo_extra(tiny_llama_dir, tmp_path):
    """``marl evaluate`` (VADER is its default judge), ``marl demo`` and ``marl train-rloo`` on the embedded
    model: one line each, exit code 2, before any model is loaded."""
    prompts = write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": "the movie"}, {"prompt": "a film"}])
    commands = {
        "evaluate": [
            "evaluate", "--model_name_or_path", str(tiny_llama_dir), "--dataset_name", str(prompts),
            "--output_dir", str(tmp_path / "evaluation"),
        ],
        "demo": ["demo", "--output_dir", str(tmp_path / "demo")],
        "train-rloo": [
            "train-rloo", "--reward_fn", "no_such_module:score", "--dataset_name", str(prompts),
            "--output_dir", str(tmp_path / "run"),
        ],
    }  # fmt: skip
    script = """
    import contextlib, io, json
    from marl.apps.cli import main

    results = {}
    for name, words in json.loads(sys.argv[1]).items():
        stderr = io.StringIO()
        with contextlib.redirect_stderr(stderr):
            try:
                main(words)
                code = 0
            except SystemExit as stop:
                code = stop.code
        results[name] = {"code": code, "stderr": stderr.getvalue()}
    print(json.dumps(results))
    """
    done = run_without_demo_packages(script, json.dumps(commands), marl_home=tmp_path / "home")
    assert done.returncode == 0, done.stderr
    results = json.loads(done.stdout.splitlines()[-1])
    vader = f"The VADER judge needs the package 'vaderSentiment', which is not installed. {INSTALL}"
    gguf = (
        "The embedded model 'smollm2-135m-instruct' needs the package 'gguf', which is not installed. "
        f"{INSTALL}"
    )
    expected = {"evaluate": vader, "demo": vader, "train-rloo": gguf}
    for name, message in expected.items():
        code, stderr = results[name]["code"], results[name]["stderr"]
        assert code == 2 and "Traceback" not in stderr, stderr
        errors = [line for line in stderr.splitlines() if ": error: " in line]
        assert errors == [f"marl {name}: error: {message}"], stderr
    assert not (tmp_path / "home" / "models").exists()
