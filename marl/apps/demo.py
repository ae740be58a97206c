"""``marl demo``: the whole pipeline, offline, on the embedded SmolLM2-135M-Instruct loaded in 4-bit.

1. Rewards: two reward adapters on the same loaded base (:mod:`marl.apps.demo_rewards`): the sentiment adapter
   shipped in ``adapters/smollm2-135m-rotten-tomatoes-reward`` (LoRA + score head trained on fresh-vs-rotten
   critic snippets, or rebuilt with ``--train_reward``) and the on-film adapter, weighted as measured at the
   start; ``--rewards sentiment`` trains against the sentiment adapter alone.
2. Optionally (``--warm_start_epochs N``, off by default; :mod:`marl.apps.demo_policy`) a supervised warm
   start of the policy LoRA on what positive critics wrote about the RL prompts' movies.
   RLOO: the policy LoRA on the same 4-bit base learns to continue Rotten Tomatoes review openings ("The film
   is a ...") so that the reward adapters like them; the reference is the base with adapters disabled (a
   frozen copy of the warm start after one).
3. Evaluation on held-out prompts from other movies: base (adapters disabled) vs policy (and vs the warm
   start after one), under the reward adapters and under VADER, a rule-based judge that no model here was
   trained on, so a policy that fools the reward adapter without becoming more positive shows up as a missed
   target.
4. A PNG of the training curves next to the policy adapter, and a verdict table against the targets, with
   two checks no reward sees: the share of completions naming the film, and distinct-2.

Prompts for RL, prompts for evaluation and the reward pairs come from three disjoint sets of movies
(:func:`marl.data.assets.split_rotten_tomatoes`).
"""

from __future__ import annotations

import datetime
import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from marl.apps import demo_policy
from marl.apps.demo_rewards import (
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
    chosen_rewards,
    parse_rewards,
    rebuild_sentiment_adapter,
    reward_adapter_entries,
    reward_means_by_name,
    topicality_summary,
    weigh_rewards,
)
from marl.apps.demo_verdict import (
    TARGET_EVAL_PROMPTS,
    verdict_rows,
    verdict_table,
)
from marl.apps.intervals import verdict_intervals
from marl.cpu_threads import threads_field
from marl.errors import ConfigError, MissingPathError
from marl.validation import check_fields

REWARD_ADAPTER_NAME = SENTIMENT_ADAPTER_NAME
DEMO_SUMMARY_FILE = "demo_summary.json"

# Sample tables during training, each scoring held-out prompts with the reward adapter and VADER (the curves).
DEMO_SAMPLE_GENERATIONS = 8
# Measured with the defaults on a 2-core x86-64 CPU (docs/guides/demo.md), by free cores: 2 = the
# demo alone (seed 0), 1 = another process holding the other core (seeds 1 and 2). Loading (with the one-off
# model conversion), seconds per training completion (sample tables included), and the final evaluation.
MEASURED_LOAD_SECONDS = 25.0
MEASURED_SECONDS_PER_COMPLETION = {1: 0.80, 2: 0.49}
MEASURED_EVAL_SECONDS = {1: 150.0, 2: 100.0}


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
        default=None, metadata={"help": f"RLOO's learning rate. Default: {demo_policy.LEARNING_RATE_HELP}."}
    )
    kl_coef: float | None = field(
        default=None,
        metadata={"help": f"KL penalty weight. Default: {KL_COEF_HELP} (each chosen by measurement)."},
    )
    reward_normalization: str = field(
        default="sum",
        metadata={
            "help": "How the two rewards combine (marl.algo.reward_normalization): 'sum' (the weighted sum "
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

    def __post_init__(self) -> None:
        check_fields(self)
        rewards = parse_rewards(self.rewards)
        if self.kl_coef is None:
            self.kl_coef = DEMO_KL_COEF[len(rewards)]
        if self.rloo_k is None:
            self.rloo_k = DEMO_RLOO_K[len(rewards)]
        self.learning_rate = demo_policy.rl_learning_rate(self.warm_start_epochs, self.learning_rate)
        check_topic_weight(self.topic_weight)
        if self.num_eval_prompts < 1:
            raise ConfigError(f"--num_eval_prompts={self.num_eval_prompts} must be a positive integer")
        from marl.algo.reward_normalization import reward_normalization

        # The RLOO settings are checked where they are checked for train-rloo.
        config = demo_rloo_config(self, Path("."), self.reward_adapter)
        reward_normalization(config)  # a registered choice, defined for the demo's estimator


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
    (:mod:`marl.algorithms`)."""
    from marl.config import RLOOConfig
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


def expected_seconds(arguments: DemoArguments, threads: int) -> float:
    """The demo's expected duration with ``threads`` free cores, scaled from the measured run by the number
    of completions trained on and evaluated (a rebuilt reward adapter not counted).

    Example:
        >>> round(expected_seconds(DemoArguments(), threads=2) / 60)
        15
    """
    cores = min(max(threads, 1), 2)
    length = arguments.response_length / 20
    per_completion = MEASURED_SECONDS_PER_COMPLETION[cores]
    evaluation = MEASURED_EVAL_SECONDS[cores] * length * arguments.num_eval_prompts / TARGET_EVAL_PROMPTS
    if arguments.warm_start_epochs > 0:  # the warm start, and its completions measured with the others'
        evaluation *= 1.5
        evaluation += demo_policy.WARM_START_SECONDS_PER_EPOCH[cores] * arguments.warm_start_epochs
    return MEASURED_LOAD_SECONDS + per_completion * length * arguments.total_episodes + evaluation


def _default_output_dir() -> Path:
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    return Path("marl-demo") / f"run-{stamp}"


def run_demo(arguments: DemoArguments) -> dict[str, Any]:
    """Train a policy adapter with RLOO against the reward adapter, evaluate it, plot it and print a verdict.

    Example:
        >>> run_demo(DemoArguments(output_dir="marl-demo/first"))  # doctest: +SKIP
    """
    import numpy as np
    import torch
    from rich.console import Console

    from marl.apps.eval_report import results_table, write_results
    from marl.apps.eval_scores import generate_and_score, summarize
    from marl.apps.train_rloo import memory_card_with_plan
    from marl.data.gold_judge import check_gold_judge
    from marl.data.prompts import rotten_tomatoes_prompts
    from marl.model.build import load_tokenizer
    from marl.model.multi_adapter import MultiAdapterModel
    from marl.rewards import RewardParts, RewardSetting, load_judge, plan_rewards
    from marl.train.plotting import plot_training_curves, pyplot
    from marl.train.run_dir import CURVES_FILE, METRICS_FILE, plan_start
    from marl.train.trainer import RLOOTrainer

    start = time.perf_counter()
    console = Console()
    output_dir = Path(arguments.output_dir) if arguments.output_dir else _default_output_dir()
    plan_start(output_dir / "policy")
    # The demo's judge and curves come from its extra: without it, stop now rather than after training.
    check_gold_judge()
    pyplot()
    if not arguments.train_reward and not (Path(arguments.reward_adapter) / "adapter_config.json").is_file():
        raise MissingPathError(
            f"no reward adapter in {arguments.reward_adapter}. Run `marl demo --train_reward` to build one, "
            "or pass --reward_adapter DIR"
        )
    reward_names = chosen_rewards(arguments.rewards, arguments.topic_reward_adapter)
    adapters = "a reward adapter" if len(reward_names) == 1 else f"{len(reward_names)} reward adapters"
    console.rule(f"[bold]marl demo[/bold]: RLOO on SmolLM2-135M-Instruct (4-bit) with {adapters}, offline")

    if arguments.train_reward:
        console.print(
            "[bold]1/4[/bold] rebuilding the reward adapter (Rotten Tomatoes fresh vs rotten pairs)"
        )
        reward_adapter = rebuild_sentiment_adapter(output_dir)
    else:
        reward_adapter = arguments.reward_adapter
        console.print(f"[bold]1/4[/bold] reward adapter: {reward_adapter}")

    train_prompts = rotten_tomatoes_prompts("train", seed=arguments.seed)
    eval_prompts = rotten_tomatoes_prompts("test", seed=arguments.seed)["prompt"][
        : arguments.num_eval_prompts
    ]
    folders = {"sentiment": reward_adapter, "topic": arguments.topic_reward_adapter}
    adapter_entries = reward_adapter_entries(reward_names, folders)
    config = demo_rloo_config(
        arguments, output_dir / "policy", adapter_entries if len(adapter_entries) > 1 else reward_adapter
    )
    if arguments.warm_start_epochs > 0:
        config.policy_adapter = demo_policy.warm_start_demo_policy(
            output_dir, config, arguments.warm_start_epochs, console.print
        )
    console.print("[bold]2/4[/bold] loading the base in 4-bit with the policy and reward adapters")
    model = MultiAdapterModel.from_config(config)
    tokenizer = load_tokenizer(model.name_or_path)
    weighing = None
    if "topic" in reward_names:
        weighing = weigh_rewards(
            model,
            tokenizer,
            train_prompts["prompt"][:WEIGHT_PROBE_PROMPTS],
            arguments.topic_weight,
            console.print,
            response_length=config.response_length,
            temperature=config.temperature,
            seed=arguments.seed,
        )
        config.reward_weights = weighing["weights"]

    sizes = config.batch_sizes(1, len(train_prompts))
    console.print(
        f"[bold]3/4[/bold] RLOO: {sizes.num_total_batches} updates × {sizes.batch_size} completions "
        f"({sizes.prompts_per_update} prompts × k={config.rloo_k}) from {len(train_prompts)} training prompts"
    )
    # The reward adapter scores every completion as it was trained, text + EOS: read at the last word of a
    # completion cut off by the length limit, it rewards stopping early over what the text says.
    rewards = plan_rewards(RewardSetting("eos_adapter", name) for name in config.reward_adapter_folders())
    reward = rewards.build(RewardParts(model, tokenizer, config.local_rollout_forward_batch_size))
    trainer = RLOOTrainer(
        config,
        model,
        tokenizer,
        train_prompts,
        eval_dataset=[{"prompt": prompt} for prompt in eval_prompts],
        reward_funcs=reward,
        judge=load_judge(None),
    )
    console.print(memory_card_with_plan(trainer))  # with the predicted peak of each phase of this run
    threads = torch.get_num_threads()
    how = "--threads" if arguments.threads else "the free cores, measured again after every update"
    console.print(
        f"{threads} torch thread(s) ({how}); expected duration about "
        f"{expected_seconds(arguments, threads) / 60:.0f} min (measured: "
        f"{expected_seconds(arguments, 2) / 60:.0f} min on 2 free cores, "
        f"{expected_seconds(arguments, 1) / 60:.0f} min on 1)"
    )
    trainer.train()
    train_seconds = time.perf_counter() - start

    console.print(f"[bold]4/4[/bold] evaluating base and policy on {len(eval_prompts)} held-out prompts")
    samples = generate_and_score(
        model,
        tokenizer,
        eval_prompts,
        load_judge(None),
        response_length=config.response_length,
        temperature=config.temperature,
        batch_size=100,
        seed=arguments.seed,
        stop_at_eos=False,
        reward_names=list(config.reward_adapter_folders()) if len(reward_names) > 1 else None,
    )
    summary = summarize(samples)
    texts = {name: record.completions for name, record in samples.items()}
    summary["topicality"] = topicality_summary(texts["base"], texts["policy"], texts.get("reference"))
    summary["intervals"] = verdict_intervals(  # 95% intervals over the prompts
        texts["base"],
        texts["policy"],
        samples["base"].judge_scores,
        samples["policy"].judge_scores,
        summary["comparison"],
    )
    if weighing is not None:
        summary["reward_weights"] = weighing
        summary["reward_scores_by_name"] = reward_means_by_name(samples)
    both = [*samples["base"].reward_scores, *samples["policy"].reward_scores]
    judged = [*samples["base"].judge_scores, *samples["policy"].judge_scores]
    summary["judge_reward_correlation"] = float(np.corrcoef(np.asarray(both), np.asarray(judged))[0, 1])
    # The trainer drew this file untitled at the end of training; the demo redraws it with its title.
    curves = plot_training_curves(
        Path(config.output_dir) / METRICS_FILE,
        Path(config.output_dir) / CURVES_FILE,
        title="marl demo: RLOO on SmolLM2-135M-Instruct (4-bit), Rotten Tomatoes",
    )
    seconds = time.perf_counter() - start
    settings = {
        **asdict(arguments),
        "reward_adapter": reward_adapter,
        "reward_adapters": adapter_entries,
        "num_prompts": len(eval_prompts),
        "judge": "vader",
        "train_seconds": round(train_seconds, 1),
        "total_seconds": round(seconds, 1),
    }
    write_results(config.output_dir, summary, samples, eval_prompts, settings)

    console.print(results_table(summary, title=f"Held-out evaluation ({len(eval_prompts)} prompts)"))
    rows = verdict_rows(summary, seconds, len(eval_prompts))
    console.print(verdict_table(rows))
    console.print(f"policy adapter, metrics, evaluation and curves: {config.output_dir} ({curves.name})")
    result = {"settings": settings, **summary, "verdict": [list(row) for row in rows]}
    (Path(config.output_dir) / DEMO_SUMMARY_FILE).write_text(json.dumps(result, indent=2) + "\n")
    return result
