"""An out-of-memory error in a phase (torch's own ``OutOfMemoryError``, raised at a chosen forward pass by the
``MARL_TEST_OUT_OF_MEMORY`` hook of :mod:`marl.train.memory_guard`): the phase runs again at half its size,
the run goes on and ends as a run started at that size ends; at the smallest size the run checkpoints its last
completed update and stops, and resuming finishes it as an uninterrupted run."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch
from safetensors.torch import load_file

from marl.errors import OUT_OF_MEMORY_EXIT_CODE, PhaseMemoryError
from marl.train.memory_guard import TEST_HOOK

from support.runs import build, tiny_config

ADAPTER = "adapter_model.safetensors"
# 3 updates of 16 completions (8 prompts, k = 2); sampling and scoring in chunks of 8 rows; micro-batches
# of 4, 2 accumulated, 2 mini-batches, 2 epochs: 8 update forward passes per update
SETTINGS = dict(local_rollout_forward_batch_size=8)


def adapter(folder):
    return load_file(str(folder / ADAPTER))


def largest_difference(first, second) -> float:
    assert first.keys() == second.keys()
    return max(float((first[key] - second[key]).abs().max()) for key in first)


def halve_sampling(trainer):
    trainer.parts.sampler.settings = dataclasses.replace(trainer.parts.sampler.settings, rows_per_pass=4)


def halve_scoring(trainer):
    trainer.parts.scorer.rows_per_pass = 4


@pytest.mark.parametrize(
    ("hook", "halved", "change"),
    [
        # the first decode chunk's prefill: sampling starts over at 4 rows per chunk
        ("sampling:2", halve_sampling, "sampling rows per chunk 8 -> sampling rows per chunk 4"),
        ("scoring:2", halve_scoring, "scoring rows per chunk 8 -> scoring rows per chunk 4"),
        # the first micro-batch of the second mini-batch: after an optimizer step of this update, undone
        (
            "update:3",
            dict(per_device_train_batch_size=2, gradient_accumulation_steps=4),
            "--per_device_train_batch_size 4 --gradient_accumulation_steps 2 -> "
            "--per_device_train_batch_size 2 --gradient_accumulation_steps 4",
        ),
    ],
)
def test_a_phase_out_of_memory_is_run_again_at_half_its_size(
    tiny_llama_dir, tmp_path, monkeypatch, capsys, hook, halved, change
):
    monkeypatch.setenv(TEST_HOOK, hook)
    survived = build(tiny_llama_dir, tiny_config(tmp_path / "survived", **SETTINGS))
    survived.train()
    phase = hook.split(":")[0]
    assert survived.phases.changes == [f"out of memory in {phase}: {change}, kept for the rest"]
    err = capsys.readouterr().err
    assert err.count(f"marl: out of memory in {phase}") == 1  # logged once
    # on a line of its own, though the bar is drawn on stderr: the bar's line is cleared first
    before = err[: err.index(f"marl: out of memory in {phase}")]
    assert "RLOO (" in before and re.split(r"[\r\n]", before)[-1] == "", before[-200:]

    monkeypatch.delenv(TEST_HOOK)
    if callable(halved):  # a run started at the halved size
        started = build(tiny_llama_dir, tiny_config(tmp_path / "started", **SETTINGS))
        halved(started)
    else:
        started = build(tiny_llama_dir, tiny_config(tmp_path / "started", **SETTINGS, **halved))
    started.train()
    assert largest_difference(adapter(tmp_path / "survived"), adapter(tmp_path / "started")) <= 1e-5
    if phase == "sampling":  # the retried sampling drew what the halved run drew, not what the first try drew
        build(tiny_llama_dir, tiny_config(tmp_path / "typed", **SETTINGS)).train()
        assert largest_difference(adapter(tmp_path / "typed"), adapter(tmp_path / "started")) > 1e-3


def test_out_of_memory_at_the_smallest_size_checkpoints_and_resuming_finishes_the_run(
    tiny_llama_dir, tmp_path, monkeypatch
):
    build(tiny_llama_dir, tiny_config(tmp_path / "full", **SETTINGS)).train()

    # every update forward pass from update 2's first on: micro-batches of 4, then 2 (one prompt group) fail
    monkeypatch.setenv(TEST_HOOK, "update:9+")
    run = tmp_path / "run"
    with pytest.raises(PhaseMemoryError) as raised:
        build(tiny_llama_dir, tiny_config(run, **SETTINGS)).train()
    error = raised.value
    assert error.phase == "update" and error.exit_code == OUT_OF_MEMORY_EXIT_CODE
    assert error.tried == [
        "--per_device_train_batch_size 4 --gradient_accumulation_steps 2",
        "--per_device_train_batch_size 2 --gradient_accumulation_steps 4",
    ]
    assert error.checkpoint == str(run / "checkpoint-1")
    assert "\n" not in str(error) and "out of memory in the update phase" in str(error)
    assert sorted(path.name for path in run.glob("checkpoint-*")) == ["checkpoint-1"]

    monkeypatch.delenv(TEST_HOOK)
    resumed = build(tiny_llama_dir, tiny_config(run, **SETTINGS))
    resumed.train(resume_from_checkpoint=True)
    assert (run / ADAPTER).read_bytes() == (tmp_path / "full" / ADAPTER).read_bytes()


def test_out_of_memory_in_the_first_update_says_nothing_was_saved_in_a_sentence(
    tiny_llama_dir, tmp_path, monkeypatch
):
    monkeypatch.setenv(TEST_HOOK, "update:1+")
    with pytest.raises(PhaseMemoryError) as raised:
        build(tiny_llama_dir, tiny_config(tmp_path / "run", **SETTINGS)).train()
    assert raised.value.checkpoint is None
    line = str(raised.value)
    assert "\n" not in line and "goes on and smaller settings" not in line
    assert "No update was completed, so nothing was saved: run again with smaller settings. marl plan" in line


def test_the_hook_raises_torchs_own_error_and_refuses_a_bad_spec(monkeypatch):
    from marl.errors import ConfigError
    from marl.train.memory_guard import PhaseGuard, Resizable

    embeddings = torch.nn.Embedding(4, 2)
    monkeypatch.setenv(TEST_HOOK, "scoring:1")
    sizes = {"scoring": Resizable(lambda: "one size", lambda: False)}
    # under several processes nothing is retried: torch's error itself goes on
    with pytest.raises(torch.OutOfMemoryError, match="forward pass 1 of scoring"):
        PhaseGuard(torch.device("cpu"), sizes, embeddings, retry=False).run(
            "scoring", lambda: embeddings(torch.tensor([1]))
        )
    with pytest.raises(PhaseMemoryError, match=r"at every size tried \(one size\): MARL_TEST_OUT_OF_MEMORY"):
        guard = PhaseGuard(torch.device("cpu"), sizes, embeddings)
        guard.run("scoring", lambda: embeddings(torch.tensor([1])))
    monkeypatch.setenv(TEST_HOOK, "decoding:1")
    with pytest.raises(ConfigError, match="use PHASE:N or PHASE:N\\+"):
        PhaseGuard(torch.device("cpu"), {}, embeddings)


def test_the_advice_is_marl_plans_for_the_budget(tiny_llama_dir, tmp_path):
    from marl.plan.fit import out_of_memory_advice

    trainer = build(tiny_llama_dir, tiny_config(tmp_path / "run", **SETTINGS))
    # on CPU no budget is known: how to ask marl plan
    assert "--memory_gb GB lists the settings that fit" in out_of_memory_advice(trainer)
    fits = out_of_memory_advice(trainer, memory_gb=64)
    assert fits.startswith("marl plan (64.0 GB): (none: it fits as it is)")
    assert "nothing fits on this card; closest" in out_of_memory_advice(trainer, memory_gb=0.01)


@pytest.mark.slow
def test_the_command_stops_with_one_line_and_its_own_exit_code_and_resumes(tmp_path):
    from support.kill_resume import command, make_world, run_cli, start_cli

    world = make_world(tmp_path / "world")
    assert run_cli(world, command(world, tmp_path / "reference")).returncode == 0
    run = tmp_path / "run"
    words = [*command(world, run), "--save_steps", "0", "--save_minutes", "0"]
    # 2 update forward passes per update: update 3's fail at micro-batches of 4 and of 2 (one prompt group)
    process = start_cli(world, words, environment={TEST_HOOK: "update:5+"})
    _, stderr = process.communicate(timeout=600)
    assert process.returncode == OUT_OF_MEMORY_EXIT_CODE, stderr[-3000:]
    assert "Traceback" not in stderr
    [line] = [line for line in stderr.splitlines() if line.startswith("marl train-rloo: error: ")]
    assert line.startswith(
        "marl train-rloo: error: out of memory in the update phase at every size tried "
        "(--per_device_train_batch_size 4 --gradient_accumulation_steps 1; "
        "--per_device_train_batch_size 2 --gradient_accumulation_steps 2): "
    )
    assert (
        f"The last completed update is in {run / 'checkpoint-2'}: resume it with "
        "--resume_from_checkpoint latest "
        "and smaller settings." in line
    )
    assert "marl plan with the same flags and --device cpu --memory_gb GB" in line
    resumed = run_cli(world, [*words, "--resume_from_checkpoint", "latest"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert (run / ADAPTER).read_bytes() == (tmp_path / "reference" / ADAPTER).read_bytes()


def test_a_sweeps_update_out_of_memory_is_run_again_for_every_policy(tiny_llama_dir, tmp_path, monkeypatch):
    """Two policies: update 1 fails at the second mini-batch's first micro-batch (the first policy's: 2 per
    micro-batch step), after both policies stepped once; both are put back and update with half the
    micro-batch, and end as a sweep started at that size."""
    from transformers import AutoTokenizer

    from marl.config.sweep import parse_sweep
    from marl.train.sweep_trainer import SweepTrainer, build_sweep_model

    from support.runs import count_e, prompt_dataset

    def sweep(folder, **settings):
        config = tiny_config(folder, model_name_or_path=str(tiny_llama_dir), **SETTINGS, **settings)
        members = parse_sweep(["learning_rate=1e-2,2e-2"], config)
        model = build_sweep_model([member.config for member in members])
        tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
        return SweepTrainer(members, model, tokenizer, prompt_dataset(), reward_funcs=count_e)

    monkeypatch.setenv(TEST_HOOK, "update:5")
    survived = sweep(tmp_path / "survived")
    survived.train()
    assert [run.config.per_device_train_batch_size for run in survived.trainers] == [2, 2]
    monkeypatch.delenv(TEST_HOOK)
    sweep(tmp_path / "started", per_device_train_batch_size=2, gradient_accumulation_steps=4).train()
    for member in ("learning_rate=1e-2", "learning_rate=2e-2"):
        first, second = adapter(tmp_path / "survived" / member), adapter(tmp_path / "started" / member)
        assert largest_difference(first, second) <= 1e-5


def test_the_micro_batch_in_force_after_a_retry_is_recorded_planned_and_resumed(
    tiny_llama_dir, tmp_path, monkeypatch, capsys
):
    """Update 2 is retried at micro-batches of 2: rloo_config.json and the update's plan metric say so from
    then on; a run stopped in update 3 resumes at that micro-batch and ends as the run that went on."""
    import json

    from test_stop_on_error import FailingForward

    from marl.apps.train_rloo import memory_card_with_plan

    def planned(folder, **settings):
        trainer = build(tiny_llama_dir, tiny_config(folder, **SETTINGS, **settings))
        memory_card_with_plan(trainer)  # as the command plans the run
        return trainer

    monkeypatch.setenv(TEST_HOOK, "update:9")  # update 2's first forward pass
    planned(tmp_path / "went-on").train()
    recorded = json.loads((tmp_path / "went-on" / "rloo_config.json").read_text())
    halved = "--per_device_train_batch_size 2 --gradient_accumulation_steps 4"
    assert [recorded[key] for key in ("per_device_train_batch_size", "gradient_accumulation_steps")] == [2, 4]
    assert recorded["retried_smaller"] == [
        "out of memory in update: --per_device_train_batch_size 4 --gradient_accumulation_steps 2 -> "
        f"{halved}, kept for the rest"
    ]
    metrics = [json.loads(line) for line in (tmp_path / "went-on" / "metrics.jsonl").read_text().splitlines()]
    at_two = planned(tmp_path / "at-two", per_device_train_batch_size=2, gradient_accumulation_steps=4)
    assert metrics[0]["memory/update_plan_mb"] != metrics[-1]["memory/update_plan_mb"]
    assert metrics[-1]["memory/update_plan_mb"] == at_two.phases.planned["update"] / 1e6

    run = tmp_path / "run"
    trainer = planned(run)
    FailingForward(trainer, 30)  # update 3's fifth forward pass, after its first optimizer step
    with pytest.raises(RuntimeError, match="a custom part failed"):
        trainer.train()
    assert sorted(path.name for path in run.glob("checkpoint-*")) == ["checkpoint-2"]
    stopped = json.loads((run / "rloo_config.json").read_text())
    assert [stopped[key] for key in ("per_device_train_batch_size", "gradient_accumulation_steps")] == [2, 4]
    monkeypatch.delenv(TEST_HOOK)
    capsys.readouterr()
    planned(run).train(resume_from_checkpoint=True)
    assert (
        f"marl: resuming with {halved}, as the run went on after running out of memory"
        in capsys.readouterr().err
    )
    assert (run / ADAPTER).read_bytes() == (tmp_path / "went-on" / ADAPTER).read_bytes()
