"""``marl demo``: the whole pipeline, offline, on the embedded SmolLM2-135M-Instruct loaded in 4-bit.

1. Rewards: two reward adapters on the same loaded base (:mod:`marl.apps.demo.rewards`): the sentiment adapter
   shipped in ``adapters/smollm2-135m-rotten-tomatoes-reward`` (LoRA + score head trained on fresh-vs-rotten
   critic snippets, or rebuilt with ``--train_reward``) and the on-film adapter, weighted as measured at the
   start; ``--rewards sentiment`` trains against the sentiment adapter alone.
2. Optionally (``--warm_start_epochs N``, off by default; :mod:`marl.apps.demo.policy`) a supervised warm
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

With ``--sweep``, several policies at once on the one base, ranked at the end (:mod:`marl.apps.demo.sweep`).

Prompts for RL, prompts for evaluation and the reward pairs come from three disjoint sets of movies
(:func:`marl.data.assets.split_rotten_tomatoes`).
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from marl.apps.demo.arguments import DemoArguments
from marl.apps.demo.rewards import (
    reward_means_by_name,
    topicality_summary,
)
from marl.apps.demo.start import (
    DEMO_SUMMARY_FILE,
    demo_rewards,
    duration_line,
    start_demo,
)
from marl.apps.demo.sweep import run_demo_sweep
from marl.apps.demo.verdict import (
    verdict_rows,
    verdict_table,
)
from marl.apps.intervals import verdict_intervals


def run_demo(arguments: DemoArguments) -> dict[str, Any]:
    """Train a policy adapter with RLOO against the reward adapter, evaluate it, plot it and print a verdict
    (with ``--sweep``, several policies at once: :func:`marl.apps.demo.sweep.run_demo_sweep`).

    Example:
        >>> run_demo(DemoArguments(output_dir="marl-demo/first"))  # doctest: +SKIP
    """
    if arguments.sweep:
        return run_demo_sweep(arguments)
    import numpy as np
    from rich.console import Console

    from marl.apps.evaluate.report import results_table, write_results
    from marl.apps.evaluate.scores import generate_and_score, summarize
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
