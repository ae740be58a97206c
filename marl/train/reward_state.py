"""The ``trainer_state`` reward functions receive (:mod:`marl.rewards.trl_calls`), and the metrics they log. A
``transformers.TrainerState``, the class TRL passes, filled with the run's progress so that a reward shaped by
it (``trainer_state.global_step / trainer_state.max_steps``, ``trainer_state.epoch``) reads the same numbers
as under TRL.

Filled: ``global_step`` (optimizer steps before this update's rollout), ``max_steps`` (all optimizer steps of
the run), ``epoch`` (prompts drawn before this update over the dataset's size, fractional as TRL's),
``num_train_epochs`` (the run's prompts over the dataset's size, rounded up), ``train_batch_size``
(``per_device_train_batch_size``), ``logging_steps``, ``save_steps``, ``is_world_process_zero`` and
``is_local_process_zero``. The rest keep ``TrainerState``'s defaults (``log_history`` is empty: marl's metrics
are in ``metrics.jsonl``).

Example:
    >>> state = reward_trainer_state(trainer)  # doctest: +SKIP
    >>> state.global_step, state.max_steps  # doctest: +SKIP
    (12, 48)
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from marl.errors import DataError
from marl.rewards.trl_calls import logged_metric_means


def reward_trainer_state(trainer: Any) -> Any:
    """The ``transformers.TrainerState`` of ``trainer`` (a :class:`marl.RLOOTrainer`) before its next
    update."""
    from transformers import TrainerState

    sizes, config, parallelism = trainer.sizes, trainer.config, trainer.parallelism
    dataset = max(len(trainer.train_prompts), 1)
    return TrainerState(
        epoch=trainer.state.update * sizes.prompts_per_update / dataset,
        global_step=trainer.global_step,
        max_steps=sizes.total_optimizer_steps,
        logging_steps=config.logging_steps,
        save_steps=config.save_steps,
        train_batch_size=config.per_device_train_batch_size,
        num_train_epochs=math.ceil(sizes.num_total_batches * sizes.prompts_per_update / dataset),
        is_local_process_zero=parallelism.is_local_main_process,
        is_world_process_zero=parallelism.is_main_process,
    )


def reward_function_metrics(rollout: Any, metrics: Mapping[str, float]) -> dict[str, float]:
    """What the run's reward functions logged with ``log_metric`` while scoring ``rollout`` (this process's
    :class:`marl.rollout.completions.Rollout`), to log with the update's ``metrics`` under the names given:
    each the mean of every value any process logged during the update's rollout, as TRL averages them. Every
    process calls it (it gathers the names and sums). A name that is one of marl's own metrics is an error
    naming it.

    Example:
        >>> metrics = reward_function_metrics(rollout, {"objective/kl": 0.1})  # doctest: +SKIP
    """
    from accelerate.utils import gather_object

    sums = rollout.reward_log.metric_sums() if rollout.reward_log is not None else {}
    logged = logged_metric_means(gather_object([sums]))
    taken = sorted(set(logged) & set(metrics))
    if taken:
        raise DataError(
            f"a reward function logged {taken[0]!r} with log_metric, which is one of marl's own metrics: "
            "give it another name"
        )
    return logged
