"""marl's own calls raise no library deprecation warning: a tiny train (both samplers), an evaluation and a
``marl plan`` run with every deprecation warning recorded, and one whose call into the library came from marl
fails the test. A warning is marl's when the innermost frame outside torch, transformers and the warnings
machinery is marl's (``past_key_values=`` passed by marl's decode is; PEFT reading a deprecated transformers
attribute inside ``get_peft_model`` is PEFT's)."""

from __future__ import annotations

import traceback
import warnings
from pathlib import Path

import pytest

from support.runs import PROMPTS, build, tiny_config

DEPRECATIONS = (DeprecationWarning, PendingDeprecationWarning, FutureWarning)
LIBRARY_PLUMBING = ("/torch/", "/transformers/", "/peft/", "/warnings.py", "/contextlib.py", "/functools.py")
MARL = str(Path(__file__).resolve().parents[1] / "marl")


@pytest.fixture
def marl_deprecations(monkeypatch):
    """The deprecation warnings whose caller is marl, each with the marl frame that made the call."""
    found: list[str] = []

    def record(message, category, filename, lineno, file=None, line=None):
        if not issubclass(category, DEPRECATIONS):
            return
        frames = [frame for frame in traceback.extract_stack()[:-1] if "pytest" not in frame.filename]
        callers = [frame for frame in frames if not any(part in frame.filename for part in LIBRARY_PLUMBING)]
        if callers and callers[-1].filename.startswith(MARL):
            found.append(f"{category.__name__}: {message} (from {callers[-1].filename}:{callers[-1].lineno})")

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        monkeypatch.setattr(warnings, "showwarning", record)
        yield found


@pytest.mark.parametrize("sampler", ["static", "transformers"])
def test_a_tiny_train_and_evaluation_raise_no_deprecation_from_marl(
    tiny_llama_dir, tmp_path, marl_deprecations, sampler
):
    from marl.apps.evaluate.scores import generate_and_score
    from marl.model.loading import load_tokenizer
    from marl.plan.planner import plan_for_trainer
    from marl.rewards import load_judge

    trainer = build(tiny_llama_dir, tiny_config(tmp_path / "run", total_episodes=16, sampler=sampler))
    trainer.train()
    plan_for_trainer(trainer)
    judge = load_judge(f"{__name__}:length")
    generate_and_score(
        trainer.model, load_tokenizer(str(tiny_llama_dir)), PROMPTS[:3], judge, response_length=4,
        batch_size=3, progress=False, sampler=sampler,
    )  # fmt: skip
    assert marl_deprecations == []


def length(texts):
    return [float(len(text)) for text in texts]


def test_marl_plan_raises_no_deprecation_from_marl(tiny_llama_dir, marl_deprecations):
    from marl.apps.cli import plan_main

    plan_main(["--model_name_or_path", str(tiny_llama_dir), "--memory_gb", "8", "--rloo_k", "2"])
    assert marl_deprecations == []
