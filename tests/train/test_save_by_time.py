"""Checkpoints by time (``--save_minutes``): a run killed long after its last update-count checkpoint resumes
from the time checkpoint and ends as the uninterrupted run ends. The clock is the trainer's
``save_schedule.clock``, so minutes pass without waiting for them."""

from __future__ import annotations

import json

import pytest

from marl.train.memory_guard import is_measurement

from support.runs import build, tiny_config

MINUTE = 60.0


def read_metrics(output_dir):
    records = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]
    return [{key: value for key, value in record.items() if not is_measurement(key)} for record in records]


class Crash(KeyboardInterrupt):
    """A kill in the middle of the run (after the update's metrics, before its checkpoint)."""


def crash_at(update):
    def callback(state, metrics):
        if state.update == update:
            raise Crash

    return callback


def test_a_run_killed_11_minutes_after_its_last_step_checkpoint_resumes_from_the_time_checkpoint(
    tiny_llama_dir, tmp_path
):
    settings = dict(total_episodes=64, save_steps=2)  # 4 updates; checkpoint-2 by the update count
    build(tiny_llama_dir, tiny_config(tmp_path / "full", **settings, save_minutes=0)).train()

    # updates end 1, 2, 13 and 14 minutes after the start: update 3 ends 11 minutes after checkpoint-2
    ends = {0: 0.0, 1: 1 * MINUTE, 2: 2 * MINUTE, 3: 13 * MINUTE, 4: 14 * MINUTE}
    run = tmp_path / "run"
    for minutes, expected in [(0, ["checkpoint-2"]), (10, ["checkpoint-2", "checkpoint-3"])]:
        trainer = build(tiny_llama_dir, tiny_config(run, **settings, save_minutes=minutes))
        trainer.save_schedule.clock = lambda trainer=trainer: ends[trainer.state.update]
        trainer.parts.callbacks.append(crash_at(4))  # killed during update 4, before its checkpoint
        with pytest.raises(Crash):
            trainer.train(overwrite_output_dir=True)
        assert sorted(path.name for path in run.glob("checkpoint-*")) == expected

    resumed = build(tiny_llama_dir, tiny_config(run, **settings))
    resumed.train(resume_from_checkpoint=True)
    assert resumed.state.update == 4
    assert read_metrics(run) == read_metrics(tmp_path / "full")
    adapter = "adapter_model.safetensors"
    assert (run / adapter).read_bytes() == (tmp_path / "full" / adapter).read_bytes()


def test_the_time_schedule_counts_from_the_last_checkpoint_of_either_kind():
    from marl.train.checkpoints import SaveSchedule

    now = iter([0.0, 5 * MINUTE, 9 * MINUTE, 18 * MINUTE, 25 * MINUTE])
    schedule = SaveSchedule(steps=2, minutes=10, clock=now.__next__)
    schedule.start()
    # update 2 saves by its count at 9 min; update 3 ends at 18 min, 9 after it: no checkpoint
    assert [schedule.due(update, lambda late: late) for update in (1, 2, 3)] == [False, True, False]
    assert schedule.due(5, lambda late: late)  # 25 min: 16 after the last
    off = SaveSchedule(steps=0, minutes=0, clock=lambda: pytest.fail("no clock read when both are off"))
    assert not off.due(1, lambda late: pytest.fail("no collective when both are off"))
