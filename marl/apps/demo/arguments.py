"""The settings of ``marl demo`` (:class:`DemoArguments`, checked in one line before any work), the RLOO
config they make (:func:`demo_rloo_config`), for one policy and for a sweep (:func:`check_demo_sweep`), and
the policy it starts from.

That start is a fresh LoRA, or with ``--warm_start_epochs`` (:func:`warm_start_demo_policy`) one first
fine-tuned on what positive critics wrote about the RL prompts' movies (the supervised step of the classic
RLHF recipe, :mod:`marl.train.trl_trainers`), which RLOO then trains with a frozen copy of it as the KL
reference. From a fresh LoRA the policy finds the reward adapter's taste for an upbeat storytelling register
before it finds reviews, and the win rate and the variety of the text trade against each other through the
KL; from critics' text it already writes reviews, which name the film
(benchmarks/results/2026-11-25-two-reward-demo.md, section 6).

Example:
    >>> arguments = DemoArguments(sweep=["learning_rate=5e-4,1e-3", "kl_coef=0.15,0.3"])
    >>> [member.name for member in check_demo_sweep(arguments)][:2]
    ['learning_rate=5e-4,kl_coef=0.15', 'learning_rate=5e-4,kl_coef=0.3']
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from marl.apps.demo.rewards import (
    DEMO_KL_COEF,
    DEMO_RLOO_K,
    KL_COEF_HELP,
    REWARD_CHOICES,
    RLOO_K_HELP,
    SENTIMENT_ADAPTER_NAME,
    SHIPPED_ADAPTERS_DIR,
    TOPIC_ADAPTER_NAME,
    TOPIC_SPREAD_SHARE,
    WEIGHT_PROBE_PROMPTS,
    check_topic_weight,
    parse_rewards,
)
from marl.apps.demo.verdict import TARGET_EVAL_PROMPTS
from marl.config.checks import check_fields
from marl.config.sweep import SweepMember, parse_sweep
from marl.cpu.threads import threads_field
from marl.errors import ConfigError

if TYPE_CHECKING:
    from marl.config.rloo_config import RLOOConfig

WARM_START_FOLDER = "warm-start"
# Fresh (positive) snippets only: they made a better start than all snippets (two-reward-demo.md, section 6).
WARM_START_LABEL = 1
WARM_START_LEARNING_RATE = 3e-4
# Seconds of one epoch by free cores, for the expected duration: measured on one, scaled to two as the RL
# completions scale (MEASURED_SECONDS_PER_COMPLETION of marl.apps.demo.pipeline).
WARM_START_SECONDS_PER_EPOCH = {1: 238.0, 2: 238.0 * 0.49 / 0.80}
# RLOO's learning rate: lower after a warm start, whose LoRA (both factors non-zero) moves faster per step
# than a fresh one (B = 0) (benchmarks/results/2026-11-25-two-reward-demo.md, section 6).
DEMO_LEARNING_RATE = {True: 3e-4, False: 1e-3}
LEARNING_RATE_HELP = f"{DEMO_LEARNING_RATE[True]:g} after a warm start, {DEMO_LEARNING_RATE[False]:g} without"


def rl_learning_rate(warm_start_epochs: float, learning_rate: float | None) -> float:
    """The demo's RLOO learning rate: ``learning_rate`` if given, else the one for a warm-started (epochs
    > 0) or a fresh policy LoRA; negative epochs are refused.

    Example:
        >>> rl_learning_rate(0.0, None), rl_learning_rate(1.0, None), rl_learning_rate(1.0, 5e-4)
        (0.001, 0.0003, 0.0005)
    """
    if warm_start_epochs < 0:
        raise ConfigError(f"--warm_start_epochs={warm_start_epochs} must be 0 (no warm start) or more")
    return DEMO_LEARNING_RATE[warm_start_epochs > 0] if learning_rate is None else learning_rate


def warm_start_demo_policy(
    output_dir: Path, config: RLOOConfig, epochs: float, log: Callable[[str], Any] = print
) -> str:
    """Fine-tune the policy LoRA of ``config`` (the demo's RLOO config) for ``epochs`` on the fresh snippets
    of the seed's RL movies, each split into its opening (an RL prompt) and the rest cut to the completion
    length, on the 4-bit embedded base; saved in ``output_dir/warm-start``, whose path it returns."""
    from marl.data.assets import EMBEDDED_MODEL_ID
    from marl.data.prompts import rotten_tomatoes_warm_start
    from marl.train.trl_trainers import warm_start_policy

    log("[bold]2/4[/bold] warm-starting the policy LoRA on critics' text (supervised)")
    folder = output_dir / WARM_START_FOLDER
    summary = warm_start_policy(
        EMBEDDED_MODEL_ID,
        rotten_tomatoes_warm_start(seed=config.seed, label=WARM_START_LABEL),
        folder,
        lora_config=config.policy_lora_config(),
        quantization=config.quantization,
        learning_rate=WARM_START_LEARNING_RATE,
        num_train_epochs=epochs,
        max_completion_tokens=config.response_length,
        seed=config.seed,
        threads=config.threads,
    )
    log(
        f"warm start: {summary['examples']} fresh critic snippets of the RL movies, "
        f"{summary['optimizer_steps']} steps, mean loss {summary['train_loss_mean']:.2f}, "
        f"{summary['wall_time_s']:.0f} s ({folder})"
    )
    return str(folder)


# Sample tables during training, each scoring held-out prompts with the reward adapter and VADER (the curves).
DEMO_SAMPLE_GENERATIONS = 8

REWARD_ADAPTER_NAME = SENTIMENT_ADAPTER_NAME


@dataclass
class DemoArguments:
    """Settings of ``marl demo``; the defaults are the tuned demo (docs/guides/demo.md quotes its measured
    numbers)."""

    output_dir: str | None = field(
        default=None,
        metadata={
            "help": "Folder of this run. Default: a new marl-demo/run-<time> folder in the current one."
        },
    )
    train_reward: bool = field(
        default=False,
        metadata={
            "help": "Rebuild the reward adapter with its recipe (into <output_dir>/reward) and use it."
        },
    )
    reward_adapter: str = field(
        default=str(SHIPPED_ADAPTERS_DIR / REWARD_ADAPTER_NAME),
        metadata={"help": "Sentiment reward adapter folder (ignored with --train_reward)."},
    )
    rewards: str = field(
        default="sentiment,topic",
        metadata={
            "help": f"Rewards to train against, comma-separated from {list(REWARD_CHOICES)}: "
            "'sentiment,topic' (the sentiment and the on-topic adapter, on the same base) or 'sentiment' "
            "(one reward adapter)."
        },
    )
    topic_reward_adapter: str = field(
        default=str(SHIPPED_ADAPTERS_DIR / TOPIC_ADAPTER_NAME),
        metadata={"help": "On-topic reward adapter folder (unused with --rewards sentiment)."},
    )
    topic_weight: float | None = field(
        default=None,
        metadata={
            "help": "Weight of the on-topic reward (the sentiment reward weighs 1). Default: measured at the "
            f"start on base completions of {WEIGHT_PROBE_PROMPTS} training prompts, so that the on-topic "
            f"scores spread {TOPIC_SPREAD_SHARE:g}× as widely as the sentiment scores."
        },
    )
    total_episodes: int = field(default=1536, metadata={"help": "Completions to train on (RLOO episodes)."})
    rloo_k: int | None = field(
        default=None,
        metadata={"help": f"Completions per prompt. Default: {RLOO_K_HELP} (chosen by measurement)."},
    )
    per_device_train_batch_size: int = field(default=16, metadata={"help": "Completions per optimizer step."})
    num_mini_batches: int = field(
        default=4, metadata={"help": "Optimizer steps per pass over a rollout (batch = size × mini-batches)."}
    )
    num_ppo_epochs: int = field(default=1, metadata={"help": "Passes over each rollout."})
    warm_start_epochs: float = field(
        default=0.0,
        metadata={
            "help": "Epochs of the policy's supervised warm start on the fresh critic snippets of the RL "
            "movies, before RLOO (whose reference is then a frozen copy of the warm start); 0: RLOO starts "
            "from a fresh LoRA, with the base as reference."
        },
    )
    learning_rate: float | None = field(
        default=None, metadata={"help": f"RLOO's learning rate. Default: {LEARNING_RATE_HELP}."}
    )
    kl_coef: float | None = field(
        default=None,
        metadata={"help": f"KL penalty weight. Default: {KL_COEF_HELP} (each chosen by measurement)."},
    )
    reward_normalization: str = field(
        default="sum",
        metadata={
            "help": "How the two rewards combine (marl.algo.shaping): 'sum' (the weighted sum "
            "of the raw scores) or 'per_reward' (GDPO: each reward minus its prompt group's mean, divided "
            "by its std, before the weighted sum; the KL penalty then weighs against those normalised "
            "units, and the default kl_coef was measured under 'sum')."
        },
    )
    response_length: int = field(default=20, metadata={"help": "Maximum new tokens per completion."})
    temperature: float = field(
        default=0.7, metadata={"help": "Sampling temperature (training and evaluation)."}
    )
    num_eval_prompts: int = field(
        default=TARGET_EVAL_PROMPTS, metadata={"help": "Held-out prompts to evaluate."}
    )
    seed: int = field(default=0, metadata={"help": "Seed of data order, sampling and initialisation."})
    threads: int = threads_field()
    sweep: list[str] | None = field(
        default=None,
        metadata={
            "help": "Train several policies at once on the one base, as marl train-rloo --sweep does: "
            "FIELD=V1,V2,... (repeat the flag for a grid, e.g. --sweep learning_rate=5e-4,1e-3 --sweep "
            "kl_coef=0.15,0.3). Each policy writes to <output_dir>/<its name>; the held-out evaluation "
            "ranks them (marl.apps.demo.pipeline)."
        },
    )

    def __post_init__(self) -> None:
        check_fields(self)
        rewards = parse_rewards(self.rewards)
        if self.kl_coef is None:
            self.kl_coef = DEMO_KL_COEF[len(rewards)]
        if self.rloo_k is None:
            self.rloo_k = DEMO_RLOO_K[len(rewards)]
        self.learning_rate = rl_learning_rate(self.warm_start_epochs, self.learning_rate)
        check_topic_weight(self.topic_weight)
        if self.num_eval_prompts < 1:
            raise ConfigError(f"--num_eval_prompts={self.num_eval_prompts} must be a positive integer")
        from marl.algo.shaping import reward_normalization

        # The RLOO settings are checked where they are checked for train-rloo.
        config = demo_rloo_config(self, Path("."), self.reward_adapter)
        reward_normalization(config)  # a registered choice, defined for the demo's estimator
        if self.sweep:
            check_demo_sweep(self, config)


def demo_rloo_config(
    arguments: DemoArguments,
    output_dir: Path,
    reward_adapter: str | list[str],
    reward_weights: list[float] | None = None,
    algorithm: str = "rloo",
):
    """The :class:`marl.RLOOConfig` of the demo: embedded model in 4-bit, default LoRA, no stop token
    (``stop_token="none"``: fixed-length completions); the
    demo's k, batch, learning rate, KL coefficient and epochs under the ``algorithm`` preset's other settings
    (:mod:`marl.config.algorithms`)."""
    from marl.config.rloo_config import RLOOConfig
    from marl.data.assets import EMBEDDED_MODEL_ID

    return RLOOConfig(
        output_dir=str(output_dir),
        algorithm=algorithm,
        seed=arguments.seed,
        threads=arguments.threads,
        model_name_or_path=EMBEDDED_MODEL_ID,
        quantization="4bit",
        reward_adapter=reward_adapter,
        reward_weights=reward_weights,
        rloo_k=arguments.rloo_k,
        per_device_train_batch_size=arguments.per_device_train_batch_size,
        num_mini_batches=arguments.num_mini_batches,
        num_ppo_epochs=arguments.num_ppo_epochs,
        total_episodes=arguments.total_episodes,
        learning_rate=arguments.learning_rate,
        kl_coef=arguments.kl_coef,
        reward_normalization=arguments.reward_normalization,
        # per_reward: each reward by its group std too (centring alone, the leave-one-out removes anyway)
        scale_rewards="group" if arguments.reward_normalization == "per_reward" else None,
        response_length=arguments.response_length,
        temperature=arguments.temperature,
        # No stop token: every completion runs to response_length, so that stopping early is not a way to
        # keep a positive prompt's score; the policy has to write something positive.
        stop_token="none",
        # One generate call per rollout: on CPU a 4-bit decode step costs about the same for 16 or 64 rows.
        local_rollout_forward_batch_size=arguments.per_device_train_batch_size * arguments.num_mini_batches,
        num_sample_generations=DEMO_SAMPLE_GENERATIONS,
        save_steps=0,
    )


def check_demo_sweep(arguments: DemoArguments, config: RLOOConfig | None = None) -> list[SweepMember]:
    """The members of ``arguments.sweep`` over the demo's RLOO ``config`` (default: the demo's config for
    ``arguments``), refused in one line, before any work, where the demo cannot train them together."""
    from marl.train.sweep_trainer import check_sweep_configs

    if arguments.warm_start_epochs > 0:
        raise ConfigError(
            "--sweep with --warm_start_epochs is not supported by the demo: train the warm start once, then "
            "sweep from it with marl train-rloo --policy_adapter WARM_START_FOLDER --sweep ..."
        )
    if config is None:
        config = demo_rloo_config(arguments, Path("."), arguments.reward_adapter)
    members = parse_sweep(arguments.sweep or [], config)
    if any(member.config.reward_weights != config.reward_weights for member in members):
        raise ConfigError(
            "--sweep reward_weights is not supported by the demo: it measures the on-film weight once, at "
            "the start, for every policy. Give one weight with --topic_weight, or sweep the weights with "
            "marl train-rloo --sweep reward_weights=..."
        )
    check_sweep_configs([member.config for member in members])
    return members
