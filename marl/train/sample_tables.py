"""The sample tables of a run: a few completions with their scores, saved every ``num_sample_generations``-th
of the run; of held-out prompts when the run has them (sampled without disturbing the training RNG), scored by
the reward and, with a judge, by the judge (``eval/score``, ``eval/judge_score``).

Example:
    >>> held_out = sample_table(trainer, rollout)  # doctest: +SKIP
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from marl.data.prompts import prompt_text
from marl.train import run_dir
from marl.train.reward_state import reward_trainer_state

if TYPE_CHECKING:
    from marl.rollout.completions import Rollout

SAMPLE_TABLE_ROWS = 8
# Held-out prompts a judge scores at each sample table: enough for a readable curve, cheap next to an update.
JUDGED_EVAL_ROWS = 32


# `trainer` below is the run's marl.RLOOTrainer, typed Any as in marl.train.reward_state: the trainer imports
# this module, so naming its class here would tie the two modules into a cycle.


def judged_prompt_text(trainer: Any, index: int) -> str:
    """What `marl evaluate` gives its judge of a held-out prompt: a conversation's last message, not the
    chat template's rendering."""
    row = trainer.eval_dataset[index]
    return prompt_text(row["prompt"]) if "prompt" in row else trainer.eval_prompts[index].text


def sample_table(trainer: Any, rollout: Rollout) -> dict[str, float]:
    """Save a table of sample completions: of held-out prompts when given (sampled without disturbing the
    training RNG), else of this rollout. Returns the held-out means to log (none without a judge). With a
    sharded base every process samples with the main one (each forward pass gathers the layers)."""
    if not trainer.parallelism.is_main_process and not (
        trainer.parallelism.shards_base and trainer.eval_prompts is not None
    ):
        return {}
    held_out = {}
    if trainer.eval_prompts is not None:
        rows = JUDGED_EVAL_ROWS if trainer.judge is not None else SAMPLE_TABLE_ROWS
        devices = [trainer.parallelism.device] if trainer.parallelism.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            samples = trainer.sampler.sample(trainer.sampler.batch(trainer.eval_prompts[:rows]), k=1)
        with torch.no_grad(), trainer.parallelism.autocast():
            batch = trainer.scorer.scoring_batch(samples, reward_trainer_state(trainer))
            scores, extra = trainer.reward.score(batch).total.tolist(), batch.reward_log.extra
        if not trainer.parallelism.is_main_process:
            return {}
        if trainer.judge is not None:
            texts = [
                judged_prompt_text(trainer, index) + completion
                for index, completion in enumerate(samples.completions)
            ]
            held_out = {
                "eval/score": float(torch.tensor(scores).nanmean()),
                "eval/judge_score": sum(trainer.judge(texts)) / len(texts),
            }
    else:
        samples, scores = rollout, rollout.scores.tolist()
        extra = rollout.reward_log.extra if rollout.reward_log is not None else {}
    rows = run_dir.sample_rows(samples.prompt_texts, samples.completions, scores, extra)[:SAMPLE_TABLE_ROWS]
    run_dir.write_sample_table(trainer.output_dir, trainer.state.update, rows)
    return held_out
