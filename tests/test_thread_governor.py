"""Every command, and ``RLOOTrainer`` on CPU, follows the free cores by default; ``--threads N`` turns it off.

Each command runs for real on a tiny model in this process, with torch at 2 threads so that the governor has
something to govern. A spy on :class:`marl.cpu.threads.FreeCoreThreads` (the real class, wrapped) records
each governor made and the thread count each of its calls set; a reward function records the thread count it
runs with.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import time

import pytest
import torch

from marl import MultiAdapterModel
from marl.apps.cli import main, train_reward_main
from marl.cpu.threads import IDLE_SHARE, FreeCoreThreads, sample_cpu

from support.runs import build, tiny_config
from support.tiny import build_tiny_tokenizer, write_jsonl

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
    """The governors made during a test; each has ``calls``: the thread count every call (between units of
    work) left, and ``measures``: that of every measure, within units of work too."""
    made: list[FreeCoreThreads] = []
    make, call, measure = FreeCoreThreads.__init__, FreeCoreThreads.__call__, FreeCoreThreads._measure

    def spied_make(self, *arguments, **options):
        make(self, *arguments, **options)
        self.calls, self.measures = [], []
        made.append(self)

    def spied_call(self, *arguments):
        threads = call(self, *arguments)
        self.calls.append(threads)
        return threads

    def spied_measure(self):
        threads = measure(self)
        self.measures.append(threads)
        return threads

    monkeypatch.setattr(FreeCoreThreads, "__init__", spied_make)
    monkeypatch.setattr(FreeCoreThreads, "__call__", spied_call)
    monkeypatch.setattr(FreeCoreThreads, "_measure", spied_measure)
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
    assert all(1 <= threads <= 2 for threads in governor.measures)
    # the reward of each update ran with a count the governor set (within an update it measures again)
    assert set(logged_threads(tmp_path / "threads.log")) <= set(governor.measures)
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
    from marl.model.loading import load_tokenizer

    for threads, expected_governors in ((0, 1), (1, 1)):
        config = RLOOConfig(
            output_dir=str(tmp_path / f"run-{threads}"),
            model_name_or_path=str(tiny_llama_dir),
            threads=threads,
            total_episodes=8,
            per_device_train_batch_size=4,
            response_length=4,
        )
        model = MultiAdapterModel.from_config(config)
        prompts = [{"prompt": prompt} for prompt in PROMPTS]
        trainer = RLOOTrainer(
            config,
            model,
            load_tokenizer(model.name_or_path),
            prompts,
            reward_funcs=lambda p, c: [0.0] * len(c),
        )
        assert len(governors) == expected_governors
        assert (governors[0] in trainer.parts.callbacks) == (threads == 0)
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


@contextlib.contextmanager
def cpu_hog():
    """Another process keeping one core busy until the block ends."""
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        yield hog
    finally:
        hog.kill()
        hog.wait()


def hog_from_the_first_sample(trainer, monkeypatch, stack: contextlib.ExitStack) -> list[float]:
    """Start a CPU hog when the update's sampling starts (within the update, after the governor's measure
    between updates); returns a list that receives the time it started."""
    started: list[float] = []
    sample = trainer.parts.sampler.sample

    def sample_beside_a_hog(*args, **kwargs):
        if not started:
            stack.enter_context(cpu_hog())
            started.append(time.perf_counter())
        return sample(*args, **kwargs)

    monkeypatch.setattr(trainer.parts.sampler, "sample", sample_beside_a_hog)
    return started


@pytest.mark.skipif(sample_cpu() is None, reason="needs /proc/stat")
def test_the_thread_count_follows_a_job_started_within_an_update(
    governors, tiny_llama_dir, tmp_path, monkeypatch
):
    """A job started during an update takes a thread away within that update, at the next forward pass after
    the governor's interval, not only once the update is over."""
    config = tiny_config(tmp_path, total_episodes=8, num_ppo_epochs=1, num_mini_batches=1, response_length=96)
    trainer = build(tiny_llama_dir, config)
    (governor,) = governors
    governor.within_work_seconds = 0.2  # the tiny update lasts about a second
    measures_before = len(governor.measures)
    with contextlib.ExitStack() as stack:
        started = hog_from_the_first_sample(trainer, monkeypatch, stack)
        trainer.train()
    # the one update measured again within itself (the last measure is the callback's), and followed the hog
    within = governor.measures[measures_before:-1]
    assert len(governor.calls) == 1 + 1 and started and len(within) >= 2
    assert within[-1] == 1 and governor.busy_elsewhere > 1 - IDLE_SHARE


def save_small_llama(directory) -> str:
    """A 4-layer llama big enough for torch to split its operations over threads (hidden 256)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    tokenizer = build_tiny_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=256, intermediate_size=768, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.eos_token_id, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


@pytest.mark.slow
@pytest.mark.skipif(sample_cpu() is None, reason="needs /proc/stat")
def test_a_job_started_within_an_update_slows_it_boundedly(governors, tmp_path, monkeypatch):
    """The same update at 2 threads, alone and with a CPU hog started when its sampling starts: following the
    free cores within the update, it takes at most 3x as long (one thread on the core left is at worst 2x
    slower; a thread sharing its core with the hog stalled an update 4-9x, and longer on a loaded machine)."""
    model_dir = save_small_llama(tmp_path / "model")
    durations = {}
    for hogged in (False, True):
        settings = dict(total_episodes=8, num_ppo_epochs=1, num_mini_batches=1, response_length=48, seed=5)
        trainer = build(model_dir, tiny_config(tmp_path / f"run-{hogged}", **settings))
        governors[-1].within_work_seconds = 0.5
        with contextlib.ExitStack() as stack:
            if hogged:
                hog_from_the_first_sample(trainer, monkeypatch, stack)
            start = time.perf_counter()
            trainer.train()
            durations[hogged] = time.perf_counter() - start
    assert durations[True] <= 3 * durations[False] + 1.0, durations
