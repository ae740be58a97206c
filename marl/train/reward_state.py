"""The ``trainer_state`` reward functions receive (:mod:`marl.rewards.calls`): a
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
from typing import Any


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
