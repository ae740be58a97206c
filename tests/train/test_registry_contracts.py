"""Every registry's protocol is the whole contract: for each extension point a minimal implementation written
only against its documented protocol (no marl base class, no marl attribute the protocol does not name;
wrapping a marl implementation through its protocol is allowed) is registered, and a 2-update ``marl
train-rloo`` and a library run (``RLOOTrainer``) train through it under ``--fit auto --fit_memory_gb`` with an
out-of-memory error injected in its phase (``MARL_TEST_OUT_OF_MEMORY``).

A part the guard can resize is retried smaller and the run ends normally; the outside sampler has no chunk
rows, so an out-of-memory error in sampling is not retried: one line says so and the run ends as at the
smallest size (the last completed update checkpointed, exit 3).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import textwrap
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from marl import MultiAdapterModel, RLOOConfig, RLOOTrainer
from marl.algo.advantages import ADVANTAGE_ESTIMATORS, register_advantage_estimator
from marl.algo.shaping import REWARD_NORMALIZATIONS, PerRewardNormalization, register_reward_normalization
from marl.errors import OUT_OF_MEMORY_EXIT_CODE, PhaseMemoryError
from marl.plan.fit import fit_run
from marl.rewards import RewardParts, plan_rewards
from marl.rewards.reward_kinds import REWARD_KINDS, register_reward_kind
from marl.rollout.completions import Samples
from marl.rollout.samplers import SAMPLERS, get_sampler, register_sampler
from marl.train.memory_guard import TEST_HOOK
from marl.train.parallel import PARALLELISMS, get_parallelism, register_parallelism

from support.processes import run_processes
from support.runs import PROMPTS, count_e

ADAPTER = "adapter_model.safetensors"
FIT_MEMORY_GB = "64"  # fits the tiny run with room to spare: --fit auto plans and changes what it may
REWARD_FILE = "def count_e(prompts, completions):\n    return [float(c.count('e')) for c in completions]\n"


# ------------------------------------------------------------------ minimal implementations, protocol only


class PerPromptSampler:
    """A sampler to :class:`marl.rollout.samplers.Sampler`'s three methods: it wraps ``static`` and draws each
    prompt in a decode of its own (the rows put back k-major); it has no ``settings``, so it cannot be
    resized."""

    def __init__(self, model, tokenizer, settings) -> None:
        self._inner = get_sampler("static")(model, tokenizer, settings)

    def batch(self, prompts):
        return self._inner.batch(prompts)

    def sample(self, prompts, k, *, view="policy"):
        count = len(prompts.texts)
        each = [
            self._inner.sample(
                dataclasses.replace(
                    prompts,
                    texts=prompts.texts[i : i + 1],
                    ids=prompts.ids[i : i + 1],
                    mask=prompts.mask[i : i + 1],
                    messages=prompts.messages[i : i + 1],
                    columns=prompts.columns[i : i + 1],
                ),
                k,
                view=view,
            )
            for i in range(count)
        ]
        return k_major(each, k, count)

    def policy_weights_changed(self) -> None:
        self._inner.policy_weights_changed()


def k_major(each: list[Samples], k: int, count: int) -> Samples:
    """One prompt's samples per entry of ``each`` (rows ``j``) as one k-major :class:`Samples` (row ``j *
    count + i``)."""
    fields = {}
    for field in dataclasses.fields(Samples):
        values = [getattr(samples, field.name) for samples in each]
        if field.name == "prompt_index":
            fields[field.name] = torch.arange(count).repeat(k)
        elif values[0] is None or (isinstance(values[0], list) and not values[0]):  # a field left unset
            fields[field.name] = values[0]
        elif isinstance(values[0], torch.Tensor):
            fields[field.name] = torch.stack(values, dim=1).reshape(k * count, *values[0].shape[1:])
        else:
            fields[field.name] = [value[j] for j in range(k) for value in values]
    return Samples(**fields)


def centred_advantages(rewards, judged, k, gather):
    """An advantage estimator to its protocol: each judged reward minus its group's judged mean."""
    per_prompt, chosen = rewards.view(k, -1), judged.view(k, -1)
    kept = torch.where(chosen, per_prompt, torch.zeros_like(per_prompt))
    mean = kept.sum(dim=0, keepdim=True) / chosen.sum(dim=0, keepdim=True).clamp(min=1)
    return torch.where(chosen, per_prompt - mean, torch.zeros_like(per_prompt)).flatten()


def centred_normalization(config):
    """A reward normalisation to its protocol: each source's centred scores, unscaled, then the estimator."""
    return PerRewardNormalization(scale=False, estimator=centred_advantages)


@dataclass
class LetterReward:
    """A reward source to its protocol: a ``name`` and ``score(batch) -> float32 [B]``."""

    name: str
    letter: str

    def score(self, batch):
        return torch.tensor([float(text.count(self.letter)) for text in batch.completions])


def letter_kind(spec: str):
    """A reward kind to its protocol: the spec (a letter) checked now, the source built from the parts."""
    if len(spec) != 1:
        raise ValueError(f"one letter, got {spec!r}")
    return lambda parts: LetterReward(f"letter_{spec}", spec)


class Delegated:
    """A parallelism to :class:`marl.train.parallel.Parallelism`'s members only, delegated to ``replicated``:
    any other attribute the trainer reads is an ``AttributeError``."""

    __slots__ = ("_inner", "accelerator")

    def __init__(self, model, config) -> None:
        self._inner = get_parallelism("replicated")(model, config)
        self.accelerator = self._inner.accelerator

    process_index = property(lambda self: self._inner.process_index)
    num_processes = property(lambda self: self._inner.num_processes)
    is_main_process = property(lambda self: self._inner.is_main_process)
    is_local_main_process = property(lambda self: self._inner.is_local_main_process)
    device = property(lambda self: self._inner.device)
    shards_base = property(lambda self: self._inner.shards_base)

    def autocast(self):
        return self._inner.autocast()

    def prepare(self, optimizer, scheduler):
        return self._inner.prepare(optimizer, scheduler)

    def backward(self, loss):
        self._inner.backward(loss)

    def clip_gradients(self, parameters, max_norm):
        return self._inner.clip_gradients(parameters, max_norm)

    def save_policy_adapter(self, model, directory, policy):
        self._inner.save_policy_adapter(model, directory, policy)

    def any_process(self, flag):
        return self._inner.any_process(flag)

    def sum_over_processes(self, record):
        return self._inner.sum_over_processes(record)

    def gather(self, tensor):
        return self._inner.gather(tensor)

    def wait(self):
        self._inner.wait()

    def finish(self):
        self._inner.finish()


@dataclass(frozen=True)
class Case:
    """One registry: how to register its outside part, the flags and config fields that choose it, and the
    phase its out-of-memory error is injected in (``retried``: whether the guard can resize that phase)."""

    registry: dict
    register: Callable[[str, Callable], None]
    implementation: Callable
    flags: tuple[str, ...]
    settings: dict
    hook: str
    retried: bool = True
    reward: str | None = None  # a --reward KIND:SPEC in place of the reward function


NAME = "outside"
CASES = {
    "sampler": Case(SAMPLERS, register_sampler, PerPromptSampler, ("--sampler", NAME), {"sampler": NAME},
                    "sampling", retried=False),
    "advantage_estimator": Case(ADVANTAGE_ESTIMATORS, register_advantage_estimator, centred_advantages,
                                ("--advantage_estimator", NAME), {"advantage_estimator": NAME}, "update:3"),
    "reward_normalization": Case(REWARD_NORMALIZATIONS, register_reward_normalization, centred_normalization,
                                 ("--reward_normalization", NAME), {"reward_normalization": NAME},
                                 "update:3"),
    "reward_kind": Case(REWARD_KINDS, register_reward_kind, letter_kind, (), {}, "scoring:2",
                        reward=f"{NAME}:e"),
    "parallelism": Case(PARALLELISMS, register_parallelism, Delegated, ("--parallelism", NAME),
                        {"parallelism": NAME}, "update:3"),
}  # fmt: skip


def test_every_registry_has_a_protocol_only_case():
    from test_docs import _registries  # every Registry(...) of the package, as (register function, flag)

    assert sorted(function for function, _ in _registries()) == sorted(
        case.register.__name__ for case in CASES.values()
    )


@contextlib.contextmanager
def registered(case: Case) -> Iterator[None]:
    case.register(NAME, case.implementation)
    try:
        yield
    finally:
        del case.registry[NAME]


# 2 updates of 8 completions (4 prompts, k = 2), rows per chunk 4; 2 mini-batches of micro-batches of 2, 2
# accumulated (as typed: --fit auto may choose larger ones), 2 epochs
SETTINGS = dict(
    rloo_k=2, per_device_train_batch_size=2, gradient_accumulation_steps=2, num_mini_batches=2,
    num_ppo_epochs=2, total_episodes=16, response_length=6, lora_r=4, lora_alpha=8, num_sample_generations=0,
    learning_rate=1e-2, seed=3, local_rollout_forward_batch_size=4, save_steps=0,
)  # fmt: skip


def words(model_dir: Path, prompts: Path, reward: Path, output_dir: Path, *extra: str) -> list[str]:
    flags = [
        "train-rloo", "--model_name_or_path", str(model_dir), "--dataset_name", str(prompts),
        "--output_dir", str(output_dir), "--fit", "auto", "--fit_memory_gb", FIT_MEMORY_GB,
    ]  # fmt: skip
    for name, value in SETTINGS.items():
        flags += [f"--{name}", str(value)]
    if "--reward" not in extra:
        flags += ["--reward_fn", f"{reward}:count_e"]
    return [*flags, *extra]


@pytest.fixture
def world(tmp_path) -> dict[str, Path]:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": text}) + "\n" for text in PROMPTS[:4]))
    reward = tmp_path / "reward.py"
    reward.write_text(REWARD_FILE)
    return {"prompts": prompts, "reward": reward}


def library_run(model_dir: Path, output_dir: Path, case: Case, callbacks=()) -> RLOOTrainer:
    config = RLOOConfig(output_dir=str(output_dir), model_name_or_path=str(model_dir), fit="auto",
                        fit_memory_gb=float(FIT_MEMORY_GB), **SETTINGS, **case.settings)  # fmt: skip
    import datasets

    dataset = datasets.Dataset.from_dict({"prompt": PROMPTS[:4]})
    fit_run(config, dataset, "cpu")
    torch.manual_seed(0)
    model = MultiAdapterModel.from_config(config)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    rewards = count_e
    if case.reward is not None:
        kind, spec = case.reward.split(":", 1)
        rewards = plan_rewards([(kind, spec)]).build(RewardParts(model, tokenizer, 4))
    return RLOOTrainer(config, model, tokenizer, dataset, reward_funcs=rewards, callbacks=list(callbacks))


def sampling_forwards_of_one_update(model_dir: Path, output_dir: Path, case: Case, monkeypatch) -> int:
    """The forward passes of the first update's sampling (counted by the test hook, armed never to fire)."""
    monkeypatch.setenv(TEST_HOOK, "sampling:1000000000")
    counted: list[int] = []
    trainer = library_run(model_dir, output_dir, case, [lambda state, metrics: counted.append(forwards())])

    def forwards() -> int:
        return trainer.phases._forwards.get("sampling", 0)

    trainer.train()
    return counted[0]


@pytest.mark.parametrize("registry", sorted(CASES))
def test_an_outside_part_written_to_its_protocol_trains_and_meets_an_out_of_memory_error(
    registry, tiny_llama_dir, tmp_path, world, monkeypatch, capsys
):
    from marl.apps.cli import main

    case = CASES[registry]
    with registered(case):
        hook = case.hook
        if not case.retried:  # the second update's first forward pass: after a completed update
            counted = sampling_forwards_of_one_update(tiny_llama_dir, tmp_path / "count", case, monkeypatch)
            hook = f"{hook}:{counted + 1}"
        monkeypatch.setenv(TEST_HOOK, hook)
        phase = hook.split(":")[0]
        reward = ("--reward", case.reward) if case.reward else ()
        extra = (*case.flags, *reward)
        command = words(tiny_llama_dir, world["prompts"], world["reward"], tmp_path / "cli", *extra)

        # the library run
        library = tmp_path / "library"
        trainer = library_run(tiny_llama_dir, library, case)
        if case.retried:
            trainer.train()
            changes = [change.split(":")[0] for change in trainer.phases.changes]
            assert changes == [f"out of memory in {phase}"]
            assert trainer.state.update == 2 and (library / ADAPTER).exists()
        else:
            with pytest.raises(PhaseMemoryError) as raised:
                trainer.train()
            assert raised.value.checkpoint == str(library / "checkpoint-1")
            assert raised.value.exit_code == OUT_OF_MEMORY_EXIT_CODE
        capsys.readouterr()

        # the command
        if case.retried:
            main(command)
            err = capsys.readouterr().err
            assert err.count(f"marl: out of memory in {phase}: ") == 1
            assert (tmp_path / "cli" / ADAPTER).exists()
            records = (tmp_path / "cli" / "metrics.jsonl").read_text().splitlines()
            assert [json.loads(line)["update"] for line in records] == [1, 2]
        else:
            with pytest.raises(SystemExit) as exited:
                main(command)
            assert exited.value.code == OUT_OF_MEMORY_EXIT_CODE
            err = capsys.readouterr().err
            assert "Traceback" not in err
            said = (
                "marl: out of memory in sampling: the sampler PerPromptSampler cannot be resized (it has no "
                "settings.rows_per_pass), so it is not retried"
            )
            assert err.count(said) == 1 and err.count("cannot be resized") == 1
            [line] = [line for line in err.splitlines() if line.startswith("marl train-rloo: error: ")]
            assert "out of memory in the sampling phase" in line
            assert f"The last completed update is in {tmp_path / 'cli' / 'checkpoint-1'}" in line
            assert sorted(path.name for path in (tmp_path / "cli").glob("checkpoint-*")) == ["checkpoint-1"]
        assert "marl: --fit auto: " in err  # --fit auto planned the run with the outside part


# ------------------------------------------------------------- the outside sampler against --sampler static

LAUNCHED = textwrap.dedent(
    """
    import os
    import sys
    # this test's folder, and tests/ for the `support` package it imports (pytest puts it there)
    sys.path[:0] = [sys.argv[1], os.path.dirname(sys.argv[1])]
    from test_registry_contracts import NAME, PerPromptSampler
    from marl.apps.cli import main
    from marl.rollout.samplers import register_sampler

    register_sampler(NAME, PerPromptSampler)
    main(sys.argv[2:])
    """
)


def equality_words(model_dir: Path, world: dict[str, Path], output_dir: Path, processes: int, *extra: str):
    """8 prompts, 2 updates on any number of processes, one prompt (k = 2 rows) per sampling and scoring
    chunk."""
    flags = words(model_dir, world["prompts"], world["reward"], output_dir, *extra)
    flags[flags.index("--total_episodes") + 1] = str(16 * processes)
    flags[flags.index("--local_rollout_forward_batch_size") + 1] = "2"
    return [word for word in flags if word not in ("--fit", "auto")]


def assert_same_runs(first: Path, second: Path) -> None:
    assert (first / ADAPTER).read_bytes() == (second / ADAPTER).read_bytes()
    from marl.train.memory_guard import is_measurement

    def records(folder: Path) -> list[dict]:
        lines = (folder / "metrics.jsonl").read_text().splitlines()
        return [{k: v for k, v in json.loads(line).items() if not is_measurement(k)} for line in lines]

    assert [record["update"] for record in records(first)] == [1, 2]
    assert records(first) == records(second)


@pytest.fixture
def eight_prompts(world) -> dict[str, Path]:
    world["prompts"].write_text("".join(json.dumps({"prompt": text}) + "\n" for text in PROMPTS))
    return world


def test_the_outside_sampler_trains_as_static_does_where_the_draws_are_the_same(
    tiny_llama_dir, tmp_path, eight_prompts
):
    """The outside sampler draws each prompt in a decode of its own, from the run's generator; ``--sampler
    static`` with one prompt per chunk (``--local_rollout_forward_batch_size`` = k) draws each prompt in a
    decode of its own too, from the same generator in the same order: the draws are the same, so the runs
    are the same byte for byte (a reseed per prompt inside the outside sampler would draw what no static run
    draws)."""
    from marl.apps.cli import main

    with registered(CASES["sampler"]):
        main(equality_words(tiny_llama_dir, eight_prompts, tmp_path / "outside", 1, "--sampler", NAME))
    main(equality_words(tiny_llama_dir, eight_prompts, tmp_path / "static", 1, "--sampler", "static"))
    assert_same_runs(tmp_path / "outside", tmp_path / "static")


@pytest.mark.slow
@pytest.mark.parametrize("parallelism", ["replicated", "fsdp2"])
def test_the_outside_sampler_trains_on_two_processes_as_static_does(
    parallelism, tiny_llama_dir, tmp_path, eight_prompts
):
    """As the one-process test, on 2 CPU processes (gloo) under ``--parallelism``: each process draws its own
    prompts, one decode per prompt with either sampler (under ``fsdp2`` every decode is a collective; both
    processes make the same number of them)."""
    script = tmp_path / "launched.py"
    script.write_text(LAUNCHED)
    here = str(Path(__file__).resolve().parent)
    for sampler in (NAME, "static"):
        flags = equality_words(tiny_llama_dir, eight_prompts, tmp_path / sampler, 2, "--sampler", sampler)
        run_processes(str(script), here, *flags, "--parallelism", parallelism)
    assert_same_runs(tmp_path / NAME, tmp_path / "static")
