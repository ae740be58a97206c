"""``SweepTrainer``: several policies trained at once on one base, one policy LoRA per member of a sweep.

Every update, in one process:

1. rollout (:func:`marl.rollout.collect.collect_rollout` with ``policies``): each policy's prompts (its own
   seed's order, as its own run would draw them), ALL rows sampled in one batched decode routed per row
   (``sampler.sample_routed``: the static decode names the rows still decoding before each step), scored in
   the same passes (each policy's log-probs routed per row; the reference pass is the base with adapters
   disabled for every row; the reward passes score every row once; where every policy drew the same
   prompts, these two compute each prompt once for all of them). A pass runs when any policy reads it
   (:mod:`marl.algo.scoring_passes`); each policy then sees only the passes its own run would have, its rows
   (:func:`marl.rollout.collect.split_rollout`) and its own weighted reward
   (:func:`marl.rewards.weighted.weighted_total`);
2. advantages per policy with its own settings (:meth:`marl.RLOOTrainer.shaped_rewards`);
3. update (:func:`marl.train.trainer.update_policies`): one loop for every policy; at each micro-batch
   step, one micro-batch PER POLICY, one after another, each in its policy's own view exactly as its own run
   runs it (so each policy gets exactly its solo gradients, and the update holds one run's activations:
   :mod:`marl.train.training_parts` says why); each policy's own optimizer, LR schedule, clipping and
   skipped steps;
4. each policy's metrics, sample tables, checkpoints and output folder, as its own run writes them.

The loop is the trainer's own (:func:`marl.train.trainer.train_policies`), run with every member's
:class:`marl.RLOOTrainer` and this sweep's joint rollout.

Randomness: one stream. The process's generators are seeded once with the FIRST policy's seed (as a single
run seeds them with its own), and the decode draws every row's token from it in one ``multinomial`` per step;
each policy's shuffles of its update rows follow, policy after policy. Per-policy generators would let a
policy draw its solo run's tokens only if its rows also decoded in its solo run's batches (float rounding of
a batched forward differs with the batch), so they buy no exact equality and cost one draw per policy per
step. The policies' own seeds choose their prompt order and initial LoRA weights; a sweep of one policy is
bit-identical to that policy's own run (tested). Kill and resume follows each member's checkpoints, taken
together after the same update.

Example:
    >>> config = RLOOConfig(output_dir="runs/sweep")
    >>> members = parse_sweep(["learning_rate=1e-4,3e-4"], config)  # doctest: +SKIP
    >>> model = build_sweep_model([member.config for member in members])  # doctest: +SKIP
    >>> trainer = SweepTrainer(members, model, tokenizer, train_dataset=prompts)  # doctest: +SKIP
    >>> histories = trainer.train()  # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from accelerate.utils import set_seed

from marl.algo.scoring_passes import ScoringPasses, scoring_passes
from marl.config.device import device_sampler
from marl.config.rloo_config import RLOOConfig
from marl.config.sweep import SHARED_FIELDS, SWEEPABLE_FIELDS, SweepMember
from marl.data.prompts import prompts_for_update
from marl.errors import CheckpointError, ConfigError
from marl.model.multi_adapter import MultiAdapterModel
from marl.model.rows import routing_problem
from marl.rewards.weighted import weighted_total
from marl.rollout.collect import collect_rollout, split_rollout
from marl.rollout.completions import Rollout
from marl.rollout.samplers import get_sampler
from marl.train import run_dir
from marl.train.curves import finish_sweep
from marl.train.memory_guard import guard_for
from marl.train.trainer import RLOOTrainer, train_policies
from marl.train.training_parts import reward_trainer_state

# Set per policy by the sweep, or following a swept field.
_PER_POLICY = {"output_dir", "policy_adapter_name", "token_level_kl"}


def check_sweep_configs(configs: Sequence[RLOOConfig]) -> None:
    """Refuse, before any model work, a sweep whose policies cannot train together: none, a config that is
    not an :class:`marl.RLOOConfig`, two policies with one adapter name or output folder, a shared setting
    that differs (:data:`marl.config.sweep.SHARED_FIELDS`), and several policies in several processes.

    Example:
        >>> check_sweep_configs([RLOOConfig(output_dir="a", policy_adapter_name="a"),
        ...                      RLOOConfig(output_dir="b", policy_adapter_name="b", rloo_k=4)])
        Traceback (most recent call last):
        ...
        marl.errors.ConfigError: the policies of a sweep differ in rloo_k (2 for a, 4 for b): every policy's \
rows are sampled in one batched decode with k completions per prompt (the groups of the advantages). Give \
every policy the same rloo_k
    """
    if not configs:
        raise ConfigError("a sweep needs at least one policy: pass one RLOOConfig per policy")
    for config in configs:
        if not isinstance(config, RLOOConfig):
            raise TypeError(f"every policy's config must be a marl.RLOOConfig, got {type(config).__name__}")
    for field, what in (("policy_adapter_name", "policy adapter name"), ("output_dir", "output folder")):
        values = [str(Path(getattr(config, field))) for config in configs]
        if len(set(values)) < len(values):
            raise ConfigError(
                f"two policies of the sweep share the {what} {_repeated(values)!r}: give each policy its own "
                f"{field} (marl.config.sweep.parse_sweep sets both from the member's name)"
            )
    first = configs[0]
    for field in dataclasses.fields(RLOOConfig):
        if field.name in SWEEPABLE_FIELDS or field.name in _PER_POLICY:
            continue
        for config in configs[1:]:
            if getattr(config, field.name) != getattr(first, field.name):
                why = SHARED_FIELDS.get(field.name, "the shared passes read it")
                raise ConfigError(
                    f"the policies of a sweep differ in {field.name} ({getattr(first, field.name)} for "
                    f"{first.policy_adapter_name}, {getattr(config, field.name)} for "
                    f"{config.policy_adapter_name}): {why}. Give every policy the same {field.name}"
                )
    if len(configs) > 1 and (int(os.environ.get("WORLD_SIZE", "1")) > 1 or first.parallelism != "replicated"):
        raise ConfigError(
            "a sweep of several policies runs in one process (--parallelism replicated, the default): launch "
            "it without torchrun / accelerate launch"
        )


def check_sweep_model(configs: Sequence[RLOOConfig], model: MultiAdapterModel) -> None:
    """Refuse a model on which the policies of ``configs`` cannot train together: a policy it lacks, rows it
    cannot route per row (mixture-of-experts), or a sampler that cannot sample several policies at once."""
    for config in configs:
        if config.policy_adapter_name not in model.policies:
            raise ConfigError(
                f"the model has no policy {config.policy_adapter_name!r} (its policies: "
                f"{list(model.policies)}); "
                "build it with marl.train.sweep_trainer.build_sweep_model(configs), or add_policy each policy"
            )
    if len(configs) > 1:
        problem = routing_problem(model.config)
        if problem is not None:
            raise ConfigError(
                f"several policies cannot share this model's passes: {problem}. Train them one after another"
            )
        name = configs[0].sampler or device_sampler(model.device.type)  # unset: the device's (all route)
        sampler = get_sampler(name)
        if getattr(sampler, "sample_routed", None) is None:  # optional in the sampler protocol
            raise ConfigError(
                f"--sampler {name} cannot sample the rows of several policies in one decode "
                "(it has no sample_routed): use --sampler static"
            )


def build_sweep_model(configs: Sequence[RLOOConfig], **overrides: Any) -> MultiAdapterModel:
    """ONE base with a policy per config, each named ``config.policy_adapter_name``, each drawn as its own
    run draws it: the generators seeded with its seed before its fresh LoRA is made (so a sweep's policy
    starts from its own run's weights). ``overrides`` go to :meth:`marl.MultiAdapterModel.from_config`.

    Example:
        >>> model = build_sweep_model([member.config for member in members])  # doctest: +SKIP
    """
    check_sweep_configs(configs)
    model = MultiAdapterModel.from_config(configs[0], **overrides)
    for config in configs[1:]:
        set_seed(config.seed)
        adapter = config.policy_adapter if config.policy_adapter is not None else config.policy_lora_config()
        model.add_policy(config.policy_adapter_name, adapter, reference=config.reference)
    return model


class SweepTrainer:
    """Trains one policy per member at once on one :class:`marl.MultiAdapterModel` (see the module
    docstring). ``model``, ``tokenizer``, ``train_dataset``, ``eval_dataset``, ``reward_funcs``, ``judge``,
    ``callbacks`` and ``dataset_source`` are what :class:`marl.RLOOTrainer` takes, for every policy
    (callbacks are called after every policy's update, with that policy's state and metrics).

    Args:
        members: :class:`marl.config.sweep.SweepMember` objects (from
            :func:`marl.config.sweep.parse_sweep`) or one :class:`marl.RLOOConfig` per policy (named after
            its ``output_dir``'s last part); each with its own ``policy_adapter_name`` on ``model``
            (:func:`build_sweep_model`) and ``output_dir``.

    Attributes:
        members: the members, in order. trainers: each member's :class:`marl.RLOOTrainer` (its state,
            metrics, optimizer, checkpoints). state, config, sizes, parts, output_dir: the first member's.
    """

    def __init__(
        self,
        members: Sequence[SweepMember | RLOOConfig],
        model: MultiAdapterModel,
        tokenizer: Any,
        train_dataset: Any,
        eval_dataset: Any = None,
        reward_funcs: Any = None,
        judge: Callable[[list[str]], Any] | None = None,
        callbacks: Sequence[Callable[..., Any]] = (),
        dataset_source: Mapping[str, Any] | None = None,
    ) -> None:
        self.members = [
            member if isinstance(member, SweepMember) else SweepMember(Path(member.output_dir).name, member)
            for member in members
        ]
        configs = [member.config for member in self.members]
        check_sweep_configs(configs)
        check_sweep_model(configs, model)
        self.model = model
        self.trainers = [
            RLOOTrainer(
                config,
                model,
                tokenizer,
                train_dataset,
                eval_dataset,
                reward_funcs,
                judge,
                callbacks,
                dataset_source,
            )
            for config in configs
        ]
        # the first trainer's guard runs the sweep's phases; a smaller micro-batch is every policy's
        self.trainers[0].phases = guard_for(self.trainers[0].parts, model, configs)
        every = [scoring_passes(config) for config in configs]
        self.passes = ScoringPasses(
            policy=any(passes.policy for passes in every), reference=any(passes.reference for passes in every)
        )

    @property
    def state(self) -> Any:
        return self.trainers[0].state

    @property
    def config(self) -> RLOOConfig:
        return self.trainers[0].config

    @property
    def sizes(self) -> Any:
        return self.trainers[0].parts.sizes

    @property
    def parts(self) -> Any:
        return self.trainers[0].parts

    @property
    def output_dir(self) -> Path:
        return self.trainers[0].output_dir

    # ------------------------------------------------------------------ one update

    def _rollouts(self) -> list[Rollout]:
        """Every policy's rollout of the next update, sampled and scored together."""
        first = self.trainers[0].parts
        self.model.eval()
        process = first.parallelism.process_index
        prompts, policies = [], []
        for trainer in self.trainers:
            own = prompts_for_update(
                trainer.parts.train_prompts,
                trainer.state.update,
                process,
                trainer.parts.sizes,
                trainer.config.seed,
            )
            prompts += own
            policies += [trainer.parts.policy] * len(own)
        rollout = collect_rollout(
            first.sampler,
            first.scorer,
            prompts,
            self.config.rloo_k,
            first.reward,
            reward_trainer_state(self.trainers[0]),
            policies,
            self.passes,
            run_phase=self.trainers[0].phases.run,
        )
        parts = split_rollout(rollout, len(self.trainers))
        for trainer, part in zip(self.trainers, parts, strict=True):
            own_passes = scoring_passes(trainer.config)  # what this policy's own run would have scored
            part.logprobs = part.logprobs if own_passes.policy else None
            part.ref_logprobs = part.ref_logprobs if own_passes.reference else None
            part.scores = weighted_total(part.source_scores, trainer.parts.reward.weights)
        return parts

    # ------------------------------------------------------------------ resuming

    def _plans(self, resume: str | os.PathLike | bool | None, overwrite: bool) -> list[run_dir.RunStart]:
        """Each member's start. ``resume=True``: every member resumes from the latest update ALL of them
        have a checkpoint of (a sweep killed while saving may have saved some members only), or every member
        starts again when one has none."""
        folders = [trainer.output_dir for trainer in self.trainers]
        if resume is not True:
            if resume:
                raise ConfigError(
                    "a sweep resumes every policy together: pass resume_from_checkpoint=True "
                    "(--resume_from_checkpoint latest), not one checkpoint folder"
                )
            return [run_dir.plan_start(folder, None, overwrite=overwrite) for folder in folders]
        plans = [run_dir.plan_start(folder, True) for folder in folders]
        if any(plan.checkpoint is None for plan in plans):
            return [
                run_dir.RunStart(plan.output_dir, replace=True, notice=plan.notice)
                if plan.checkpoint is not None
                else plan
                for plan in plans
            ]
        common = min(_update_of(plan.checkpoint) for plan in plans)
        chosen = []
        for plan in plans:
            path = plan.output_dir / run_dir.checkpoint_name(common)
            if not path.is_dir():
                raise CheckpointError(
                    f"the sweep's policies were last saved together at update {common}, but {path} is gone "
                    "(--save_total_limit removed it): resume each policy's folder as its own run, or start "
                    "the sweep again with --overwrite_output_dir"
                )
            chosen.append(dataclasses.replace(plan, checkpoint=path))
        return chosen

    # ------------------------------------------------------------------ the loop

    def train(
        self,
        resume_from_checkpoint: str | os.PathLike | bool | None = None,
        overwrite_output_dir: bool = False,
    ) -> dict[str, list[dict[str, float]]]:
        """Train every policy until ``num_total_batches`` updates are done; returns each member's logged
        metric dicts by name. ``resume_from_checkpoint=True`` resumes every policy from the sweep's latest
        common checkpoint; ``overwrite_output_dir`` replaces the runs in the members' folders. At the end a
        table of the members is printed and their curves drawn (:mod:`marl.train.curves`).

        Example:
            >>> histories = trainer.train()  # doctest: +SKIP
        """
        trainers, first = self.trainers, self.trainers[0].parts
        plans = self._plans(resume_from_checkpoint, overwrite_output_dir)
        for plan in plans:
            if plan.notice and first.parallelism.is_main_process:
                print(plan.notice, file=sys.stderr)
        labels = [f"policy {member.name}: " if len(self.members) > 1 else "" for member in self.members]
        train_policies(trainers, plans, self._rollouts, labels)
        if first.parallelism.is_main_process:
            finish_sweep(
                self.members, [trainer.output_dir for trainer in trainers], [t.parts for t in trainers]
            )
        first.parallelism.wait()
        for trainer in trainers:
            trainer.parts.parallelism.finish()
        return {
            member.name: trainer.log_history for member, trainer in zip(self.members, trainers, strict=True)
        }


def _update_of(checkpoint: Path) -> int:
    return int(checkpoint.name.removeprefix(run_dir.CHECKPOINT_PREFIX))


def _repeated(values: list[str]) -> str:
    return next(value for value in values if values.count(value) > 1)
