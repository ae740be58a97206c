"""``marl demo``: the whole pipeline, offline, on the embedded SmolLM2-135M-Instruct loaded in 4-bit.

1. Rewards: two reward adapters on the same loaded base (:mod:`marl.apps.demo.rewards`): the sentiment adapter
   shipped in ``adapters/smollm2-135m-rotten-tomatoes-reward`` (LoRA + score head trained on fresh-vs-rotten
   critic snippets, or rebuilt with ``--train_reward``) and the on-film adapter, weighted as measured at the
   start; ``--rewards sentiment`` trains against the sentiment adapter alone.
2. Optionally (``--warm_start_epochs N``, off by default) a supervised warm start of the policy LoRA on what
   positive critics wrote about the RL prompts' movies
   (:func:`marl.apps.demo.arguments.warm_start_demo_policy`).
   RLOO: the policy LoRA on the same 4-bit base learns to continue Rotten Tomatoes review openings ("The film
   is a ...") so that the reward adapters like them; the reference is the base with adapters disabled (a
   frozen copy of the warm start after one).
3. Evaluation on held-out prompts from other movies: base (adapters disabled) vs policy (and vs the warm
   start after one), under the reward adapters and under VADER, a rule-based judge that no model here was
   trained on, so a policy that fools the reward adapter without becoming more positive shows up as a missed
   target.
4. A PNG of the training curves next to the policy adapter, and a verdict table against the targets
   (:mod:`marl.apps.demo.verdict`), with two checks no reward sees: the share of completions naming the film,
   and distinct-2.

Prompts for RL, prompts for evaluation and the reward pairs come from three disjoint sets of movies
(:func:`marl.data.assets.split_rotten_tomatoes`). One policy and a sweep start alike: :func:`start_demo`
checks the run folders and the demo's extra, rebuilds the reward adapter when asked, reads the prompts and
makes the RLOO config and the warm start; once the model is loaded, :func:`demo_rewards` weighs the two
rewards and builds the reward to train against.

With ``--sweep`` (:func:`run_demo_sweep`), several of the demo's policies train at once on its one base: each
member is the demo's RLOO run with its swept settings (:func:`marl.config.sweep.parse_sweep` over the demo's
config), trained by :class:`marl.train.sweep_trainer.SweepTrainer` (one batched decode and shared scoring
passes for every policy's rows, each policy's own update) and written to ``<output_dir>/<member name>``: a
PEFT adapter, ``metrics.jsonl``, ``training_curves.png``. The sweep's folder gets ``sweep_summary.md`` and
``sweep_curves.png`` (each policy's last reward, KL and held-out VADER score during training), then, after
base and every policy sample the same held-out prompts with the same seeds, ``eval_results.json`` with their
ranking (:mod:`marl.apps.evaluate.ranking`: mean VADER score, win rate over the base, gap to the first,
distinct-2, each with its 95% interval), each model's share of completions naming the film, and
``demo_summary.json``. Beyond what any sweep refuses (:func:`marl.train.sweep_trainer.check_sweep_configs`),
the demo refuses (:func:`marl.apps.demo.arguments.check_demo_sweep`) sweeping ``reward_weights`` (it measures
the on-film weight once, at the start, for every policy; ``--topic_weight`` sets it) and a warm start
(``--warm_start_epochs``), whose reference would have to be shared by the members: train such a sweep with
``marl train-rloo --policy_adapter WARM_START --sweep ...``.
"""

from __future__ import annotations

import datetime
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from marl.apps.demo.arguments import (
    WARM_START_SECONDS_PER_EPOCH,
    DemoArguments,
    check_demo_sweep,
    demo_rloo_config,
    warm_start_demo_policy,
)
from marl.apps.demo.rewards import (
    WEIGHT_PROBE_PROMPTS,
    chosen_rewards,
    rebuild_sentiment_adapter,
    reward_adapter_entries,
    reward_means_by_name,
    weigh_rewards,
)
from marl.apps.demo.verdict import (
    TARGET_EVAL_PROMPTS,
    topicality_summary,
    verdict_intervals,
    verdict_rows,
    verdict_table,
)
from marl.errors import MissingPathError

DEMO_SUMMARY_FILE = "demo_summary.json"
# The expected duration scales the demo's run with the defaults on a 2-core CPU, by free cores (1: another
# process holds the other core; docs/guides/demo.md): loading (with the one-off model conversion), seconds
# per training completion (sample tables included), and the final evaluation.
MEASURED_LOAD_SECONDS = 25.0
MEASURED_SECONDS_PER_COMPLETION = {1: 0.80, 2: 0.49}
MEASURED_EVAL_SECONDS = {1: 150.0, 2: 100.0}


def expected_seconds(arguments: DemoArguments, threads: int, policies: int = 1) -> float:
    """The demo's expected duration with ``threads`` free cores, scaled from the measured run by the number
    of completions trained on and evaluated (a rebuilt reward adapter not counted); ``policies`` trained at
    once (``--sweep``) each count their completions, and evaluate beside the one base.

    Example:
        >>> round(expected_seconds(DemoArguments(), threads=2) / 60)
        15
    """
    cores = min(max(threads, 1), 2)
    length = arguments.response_length / 20
    per_completion = MEASURED_SECONDS_PER_COMPLETION[cores]
    evaluation = MEASURED_EVAL_SECONDS[cores] * length * arguments.num_eval_prompts / TARGET_EVAL_PROMPTS
    evaluation *= (1 + policies) / 2  # measured: the base and one policy
    if arguments.warm_start_epochs > 0:  # the warm start, and its completions measured with the others'
        evaluation *= 1.5
        evaluation += WARM_START_SECONDS_PER_EPOCH[cores] * arguments.warm_start_epochs
    training = per_completion * length * arguments.total_episodes * policies
    return MEASURED_LOAD_SECONDS + training + evaluation


def duration_line(arguments: DemoArguments, policies: int = 1) -> str:
    """The threads the demo runs with and its expected duration, as it prints them at the start."""
    import torch

    threads = torch.get_num_threads()
    how = "--threads" if arguments.threads else "the free cores, measured again after every update"
    minutes = {cores: expected_seconds(arguments, cores, policies) / 60 for cores in (threads, 2, 1)}
    return (
        f"{threads} torch thread(s) ({how}); expected duration about {minutes[threads]:.0f} min (measured: "
        f"{minutes[2]:.0f} min on 2 free cores, {minutes[1]:.0f} min on 1)"
    )


def _default_output_dir() -> Path:
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    return Path("marl-demo") / f"run-{stamp}"


@dataclass
class DemoStart:
    """What the demo has before its model loads: its folder, reward adapters, prompts and RLOO config."""

    output_dir: Path
    reward_adapter: str
    reward_names: tuple[str, ...]
    adapter_entries: list[str]
    train_prompts: Any
    eval_prompts: list[str]
    config: Any


def start_demo(arguments: DemoArguments, console: Any, sweep_names: list[str] | None = None) -> DemoStart:
    """Check the run folders (``<output_dir>/policy``, or one folder per sweep member in ``sweep_names``), the
    demo's extra and the reward adapter; rebuild the sentiment adapter when asked; read the prompts; make the
    RLOO config (writing to ``<output_dir>/policy``, or to ``<output_dir>`` whose members' folders a sweep
    adds) and the warm start when asked."""
    from marl.data.fixed_rules import check_gold_judge
    from marl.data.prompts import rotten_tomatoes_prompts
    from marl.train.curves import pyplot
    from marl.train.run_dir import plan_start

    output_dir = Path(arguments.output_dir) if arguments.output_dir else _default_output_dir()
    for name in sweep_names or ["policy"]:
        plan_start(output_dir / name)
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
    policies = f", {len(sweep_names)} policies at once" if sweep_names else ""
    console.rule(
        f"[bold]marl demo[/bold]: RLOO on SmolLM2-135M-Instruct (4-bit) with {adapters}{policies}, offline"
    )

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
        arguments,
        output_dir if sweep_names else output_dir / "policy",
        adapter_entries if len(adapter_entries) > 1 else reward_adapter,
    )
    if arguments.warm_start_epochs > 0:
        config.policy_adapter = warm_start_demo_policy(
            output_dir, config, arguments.warm_start_epochs, console.print
        )
    return DemoStart(
        output_dir, reward_adapter, reward_names, adapter_entries, train_prompts, eval_prompts, config
    )


def demo_rewards(
    start: DemoStart, configs: list[Any], model: Any, tokenizer: Any, arguments: DemoArguments, say: Any
) -> tuple[dict[str, Any] | None, Any]:
    """The on-film weight (measured on base completions, or ``--topic_weight``; set on every config in
    ``configs``) and the reward to train against: each adapter read as it was trained, text + EOS."""
    from marl.rewards import RewardParts, RewardSetting, plan_rewards

    weighing = None
    config = configs[0]
    if "topic" in start.reward_names:
        weighing = weigh_rewards(
            model,
            tokenizer,
            start.train_prompts["prompt"][:WEIGHT_PROBE_PROMPTS],
            arguments.topic_weight,
            say,
            response_length=config.response_length,
            temperature=config.temperature,
            seed=arguments.seed,
        )
        for each in configs:
            each.reward_weights = weighing["weights"]
    # The reward adapter scores every completion as it was trained, text + EOS: read at the last word of a
    # completion cut off by the length limit, it rewards stopping early over what the text says.
    rewards = plan_rewards(RewardSetting("eos_adapter", name) for name in config.reward_adapter_folders())
    return weighing, rewards.build(RewardParts(model, tokenizer, config.local_rollout_forward_batch_size))


def run_demo(arguments: DemoArguments) -> dict[str, Any]:
    """Train a policy adapter with RLOO against the reward adapter, evaluate it, plot it and print a verdict
    (with ``--sweep``, several policies at once: :func:`run_demo_sweep`).

    Example:
        >>> run_demo(DemoArguments(output_dir="marl-demo/first"))  # doctest: +SKIP
    """
    if arguments.sweep:
        return run_demo_sweep(arguments)
    import numpy as np
    from rich.console import Console

    from marl.apps.evaluate.scores import generate_and_score, results_table, summarize, write_results
    from marl.apps.train_rloo import memory_card_with_plan
    from marl.model.loading import load_tokenizer
    from marl.model.multi_adapter import MultiAdapterModel
    from marl.rewards import load_judge
    from marl.train.curves import plot_training_curves
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


def run_demo_sweep(arguments: DemoArguments) -> dict[str, Any]:
    """The demo with one policy per member of ``arguments.sweep``, trained at once, then ranked on the
    held-out prompts (see the module docstring); returns what it writes to ``demo_summary.json``.

    Example:
        >>> run_demo_sweep(DemoArguments(sweep=["kl_coef=0.15,0.3"]))  # doctest: +SKIP
    """
    from rich.console import Console

    from marl.apps.evaluate.command import rank_and_report
    from marl.apps.evaluate.scores import generate_and_score, write_results
    from marl.apps.train_rloo import memory_card_with_plan
    from marl.data.fixed_rules import distinct_2, film_share
    from marl.model.loading import load_tokenizer
    from marl.rewards import load_judge
    from marl.train.sweep_trainer import SweepTrainer, build_sweep_model

    start_time = time.perf_counter()
    console = Console()
    start = start_demo(arguments, console, [member.name for member in check_demo_sweep(arguments)])
    members = check_demo_sweep(arguments, start.config)
    configs = [member.config for member in members]
    console.print(
        f"[bold]2/4[/bold] loading the base in 4-bit with {len(members)} policy adapters and the reward "
        "adapters"
    )
    model = build_sweep_model(configs)
    tokenizer = load_tokenizer(model.name_or_path)
    weighing, reward = demo_rewards(start, configs, model, tokenizer, arguments, console.print)

    sizes = configs[0].batch_sizes(1, len(start.train_prompts))
    console.print(
        f"[bold]3/4[/bold] RLOO, {len(members)} policies at once: {sizes.num_total_batches} updates × "
        f"{sizes.batch_size} completions each ({sizes.prompts_per_update} prompts × k={configs[0].rloo_k}) "
        f"from {len(start.train_prompts)} training prompts"
    )
    trainer = SweepTrainer(
        members,
        model,
        tokenizer,
        start.train_prompts,
        eval_dataset=[{"prompt": prompt} for prompt in start.eval_prompts],
        reward_funcs=reward,
        judge=load_judge(None),
    )
    console.print(memory_card_with_plan(trainer))  # every policy's LoRA and training state
    console.print(duration_line(arguments, len(members)))
    trainer.train()
    train_seconds = time.perf_counter() - start_time

    console.print(
        f"[bold]4/4[/bold] evaluating base and {len(members)} policies on {len(start.eval_prompts)} "
        "held-out prompts"
    )
    samples = generate_and_score(
        model,
        tokenizer,
        start.eval_prompts,
        load_judge(None),
        response_length=configs[0].response_length,
        temperature=configs[0].temperature,
        batch_size=100,
        seed=arguments.seed,
        stop_at_eos=False,
        reward_names=list(configs[0].reward_adapter_folders()) if len(start.reward_names) > 1 else None,
        policies=[config.policy_adapter_name for config in configs],
    )
    title = f"Held-out evaluation ({len(start.eval_prompts)} prompts), {len(members)} policies of the sweep"
    folders = {config.policy_adapter_name: config.output_dir for config in configs}
    samples, summary, table = rank_and_report(samples, folders, title)
    # The two checks no reward sees, per model: the share of completions naming the film, and distinct-2.
    summary["topicality"] = {
        name: {"film_share": film_share(record.completions), "distinct_2": distinct_2(record.completions)}
        for name, record in samples.items()
    }
    if weighing is not None:
        summary["reward_weights"] = weighing
    seconds = time.perf_counter() - start_time
    settings = {
        **asdict(arguments),
        "reward_adapter": start.reward_adapter,
        "reward_adapters": start.adapter_entries,
        "num_prompts": len(start.eval_prompts),
        "judge": "vader",
        "train_seconds": round(train_seconds, 1),
        "total_seconds": round(seconds, 1),
    }
    write_results(start.output_dir, summary, samples, start.eval_prompts, settings)
    console.print(table)
    for name, checks in summary["topicality"].items():
        console.print(
            f"{name}: film named in {checks['film_share']:.1%} of completions, distinct-2 "
            f"{checks['distinct_2']:.3f}"
        )
    console.print(
        f"{len(members)} policies in {start.output_dir} (sweep_summary.md, sweep_curves.png, "
        f"eval_results.json); {seconds / 60:.1f} min in total"
    )
    result = {"settings": settings, **summary}
    (start.output_dir / DEMO_SUMMARY_FILE).write_text(json.dumps(result, indent=2) + "\n")
    return result
