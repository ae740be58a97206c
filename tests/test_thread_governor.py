"""Every command, and ``RLOOTrainer`` on CPU, follows the free cores by default; ``--threads N`` turns it off.

Each command runs for real on a tiny model in this process, with torch at 2 threads so that the governor has
something to govern. A spy on :class:`marl.cpu_threads.FreeCoreThreads` (the real class, wrapped) records
each governor made and the thread count each of its calls set; a reward function records the thread count it
runs with.
"""

from __future__ import annotations

import json

import pytest
import torch

from marl.apps.cli import main, train_reward_main
from marl.cpu_threads import FreeCoreThreads

from support.tiny import write_jsonl

PROMPTS = ["the movie was", "a dull boring", "an honest story", "the plot falls"]
THREADS_LOG_REWARD = """
import os
import torch

def count_e(prompts, completions):
    with open(os.environ["MARL_TEST_THREADS_LOG"], "a") as log:
        log.write(f"{torch.get_num_threads()}\\n")
    return [c.count("e") for c in completions]
"""


@pytest.fixture
def governors(monkeypatch):
    """The governors made during a test; each has ``calls``: the thread count every call left."""
    made: list[FreeCoreThreads] = []
    make, call = FreeCoreThreads.__init__, FreeCoreThreads.__call__

    def spied_make(self, *arguments, **options):
        make(self, *arguments, **options)
        self.calls = []
        made.append(self)

    def spied_call(self, *arguments):
        threads = call(self, *arguments)
        self.calls.append(threads)
        return threads

    monkeypatch.setattr(FreeCoreThreads, "__init__", spied_make)
    monkeypatch.setattr(FreeCoreThreads, "__call__", spied_call)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield made
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("threads")
    write_jsonl(root / "prompts.jsonl", [{"text": prompt} for prompt in PROMPTS])
    pairs = [{"chosen": f"good film {i}", "rejected": f"bad film {i}"} for i in range(10)]
    write_jsonl(root / "pairs.jsonl", pairs)
    (root / "rewards.py").write_text(THREADS_LOG_REWARD)
    return root


def train_rloo(files, base, output_dir, *extra):
    return main([
        "train-rloo", "--model_name_or_path", str(base), "--dataset_name", str(files / "prompts.jsonl"),
        "--prompt_column", "text", "--reward_fn", f"{files / 'rewards.py'}:count_e",
        "--output_dir", str(output_dir), "--rloo_k", "2", "--per_device_train_batch_size", "4",
        "--total_episodes", "8", "--response_length", "4", "--num_ppo_epochs", "1",
        "--num_sample_generations", "0", *extra,
    ])  # fmt: skip


def logged_threads(path) -> list[int]:
    return [int(line) for line in path.read_text().split()]


def test_train_rloo_follows_the_free_cores_after_every_update(
    governors, files, tiny_llama_dir, tmp_path, monkeypatch
):
    monkeypatch.setenv("MARL_TEST_THREADS_LOG", str(tmp_path / "threads.log"))
    train_rloo(files, tiny_llama_dir, tmp_path / "run")
    (governor,) = governors
    assert governor.cores == 2
    assert len(governor.calls) == 1 + 2  # when the trainer is made, then after each of the 2 updates
    assert all(1 <= threads <= 2 for threads in governor.calls)
    # the reward of each update ran with the count the governor set before it
    assert logged_threads(tmp_path / "threads.log") == governor.calls[:2]
    assert json.loads((tmp_path / "run" / "rloo_config.json").read_text())["threads"] == 0


def test_threads_n_turns_the_governor_off_for_train_rloo(
    governors, files, tiny_llama_dir, tmp_path, monkeypatch
):
    monkeypatch.setenv("MARL_TEST_THREADS_LOG", str(tmp_path / "threads.log"))
    torch.set_num_threads(1)
    train_rloo(files, tiny_llama_dir, tmp_path / "run", "--threads", "2")
    assert governors == []
    assert logged_threads(tmp_path / "threads.log") == [2, 2]


def test_the_library_trainer_follows_the_free_cores_on_cpu_unless_threads_is_set(
    governors, files, tiny_llama_dir, tmp_path
):
    from marl import RLOOConfig, RLOOTrainer
    from marl.model.build import load_tokenizer

    for threads, expected_governors in ((0, 1), (1, 1)):
        config = RLOOConfig(
            output_dir=str(tmp_path / f"run-{threads}"),
            model_name_or_path=str(tiny_llama_dir),
            threads=threads,
            total_episodes=8,
            per_device_train_batch_size=4,
            response_length=4,
        )
        model = config.load_model()
        prompts = [{"prompt": prompt} for prompt in PROMPTS]
        trainer = RLOOTrainer(
            config,
            model,
            load_tokenizer(model.name_or_path),
            prompts,
            reward_funcs=lambda p, c: [0.0] * len(c),
        )
        assert len(governors) == expected_governors
        assert (governors[0] in trainer.callbacks) == (threads == 0)
    assert torch.get_num_threads() == 1


def test_train_reward_follows_the_free_cores_after_every_step(governors, files, tiny_llama_dir, tmp_path):
    summary = train_reward_main([
        "--model_name_or_path", str(tiny_llama_dir), "--dataset", str(files / "pairs.jsonl"),
        "--output_dir", str(tmp_path / "rm"), "--quantization", "none", "--eval_fraction", "0.2",
        "--batch_size", "4", "--max_length", "16",
    ])  # fmt: skip
    (governor,) = governors
    assert summary["optimizer_steps"] == 2
    assert len(governor.calls) == 1 + 2  # when the model is loaded, then after each optimizer step
    assert summary["settings"]["threads"] == 0


def test_train_reward_with_threads_n_runs_without_the_governor(governors, files, tiny_llama_dir, tmp_path):
    summary = train_reward_main([
        "--model_name_or_path", str(tiny_llama_dir), "--dataset", str(files / "pairs.jsonl"),
        "--output_dir", str(tmp_path / "rm"), "--quantization", "none", "--eval_fraction", "0.2",
        "--batch_size", "4", "--max_length", "16", "--threads", "1",
    ])  # fmt: skip
    assert governors == []
    assert summary["torch_threads"] == 1


@pytest.mark.parametrize("threads", [0, 1])
def test_evaluate_follows_the_free_cores_after_every_batch_unless_threads_is_set(
    governors, files, tiny_llama_dir, tiny_reward_adapter, tmp_path, threads
):
    main([
        "evaluate", "--model_name_or_path", str(tiny_llama_dir), "--reward_adapter", str(tiny_reward_adapter),
        "--dataset_name", str(files / "prompts.jsonl"), "--prompt_column", "text", "--num_prompts", "4",
        "--batch_size", "2", "--response_length", "3", "--output_dir", str(tmp_path / "evaluation"),
        "--threads", str(threads),
    ])  # fmt: skip
    if threads == 0:
        (governor,) = governors
        assert len(governor.calls) == 1 + 2  # when the model is loaded, then after each of the 2 batches
    else:
        assert governors == [] and torch.get_num_threads() == 1
