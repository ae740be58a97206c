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

With ``--sweep``, several policies at once on the one base, ranked at the end (:mod:`marl.apps.demo_sweep`).

Prompts for RL, prompts for evaluation and the reward pairs come from three disjoint sets of movies
(:func:`marl.data.assets.split_rotten_tomatoes`).
"""

from __future__ import annotations

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
    parse_rewards,
    reward_means_by_name,
    topicality_summary,
)
from marl.apps.demo_start import (
    DEMO_SUMMARY_FILE,
    demo_rewards,
    demo_rloo_config,
    duration_line,
    start_demo,
)
from marl.apps.demo_sweep import check_demo_sweep, run_demo_sweep
from marl.apps.demo_verdict import (
    TARGET_EVAL_PROMPTS,
    verdict_rows,
    verdict_table,
)
from marl.apps.intervals import verdict_intervals
from marl.cpu_threads import threads_field
from marl.errors import ConfigError
from marl.validation import check_fields

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
    sweep: list[str] | None = field(
        default=None,
        metadata={
            "help": "Train several policies at once on the one base, as marl train-rloo --sweep does: "
            "FIELD=V1,V2,... (repeat the flag for a grid, e.g. --sweep learning_rate=5e-4,1e-3 --sweep "
            "kl_coef=0.15,0.3). Each policy writes to <output_dir>/<its name>; the held-out evaluation "
            "ranks them (marl.apps.demo_sweep)."
        },
    )

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
        if self.sweep:
            check_demo_sweep(self, config)


def run_demo(arguments: DemoArguments) -> dict[str, Any]:
    """Train a policy adapter with RLOO against the reward adapter, evaluate it, plot it and print a verdict
    (with ``--sweep``, several policies at once: :func:`marl.apps.demo_sweep.run_demo_sweep`).

    Example:
        >>> run_demo(DemoArguments(output_dir="marl-demo/first"))  # doctest: +SKIP
    """
    if arguments.sweep:
        return run_demo_sweep(arguments)
    import numpy as np
    from rich.console import Console

    from marl.apps.eval_report import results_table, write_results
    from marl.apps.eval_scores import generate_and_score, summarize
    from marl.apps.train_rloo import memory_card_with_plan
    from marl.model.build import load_tokenizer
    from marl.model.multi_adapter import MultiAdapterModel
    from marl.rewards import load_judge
    from marl.train.plotting import plot_training_curves
    from marl.train.run_dir import CURVES_FILE, METRICS_FILE
    from marl.train.trainer import RLOOTrainer

    start_time = time.perf_counter()
    console = Console()
    start = start_demo(arguments, console)
    config, train_prompts, eval_prompts = start.config, start.train_prompts, start.eval_prompts
    console.print("[bold]2/4[/bold] loading the base in 4-bit with the policy and reward adapters")
    model = MultiAdapterModel.from_config(config)
    tokenizer = load_tokenizer(model.name_or_path)
    weighing, reward = demo_rewards(start, [config], model, tokenizer, arguments, console.print)

    sizes = config.batch_sizes(1, len(train_prompts))
    console.print(
        f"[bold]3/4[/bold] RLOO: {sizes.num_total_batches} updates × {sizes.batch_size} completions "
        f"({sizes.prompts_per_update} prompts × k={config.rloo_k}) from {len(train_prompts)} training prompts"
    )
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
    console.print(duration_line(arguments))
    trainer.train()
    train_seconds = time.perf_counter() - start_time

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
        reward_names=list(config.reward_adapter_folders()) if len(start.reward_names) > 1 else None,
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
    seconds = time.perf_counter() - start_time
    settings = {
        **asdict(arguments),
        "reward_adapter": start.reward_adapter,
        "reward_adapters": start.adapter_entries,
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
