"""``marl demo --sweep``: several of the demo's policies trained at once on its one 4-bit base, then ranked.

Each member is the demo's RLOO run with its swept settings (:func:`marl.config.sweep.parse_sweep` over the
demo's config), trained by :class:`marl.train.sweep_trainer.SweepTrainer` (one batched decode and shared
scoring passes for every policy's rows, each policy's own update) and written to
``<output_dir>/<member name>``: a PEFT adapter, ``metrics.jsonl``, ``training_curves.png``. The sweep's folder
gets ``sweep_summary.md`` and ``sweep_curves.png`` (each policy's last reward, KL and held-out VADER score
during training), then, after base and every policy sample the same held-out prompts with the same seeds,
``eval_results.json`` with their ranking (:mod:`marl.apps.evaluate.ranking`: mean VADER score, win rate over
the base, gap to the first, distinct-2, each with its 95% interval), each model's share of completions naming
the film, and ``demo_summary.json``.

Beyond what any sweep refuses (:func:`marl.train.sweep_trainer.check_sweep_configs`), the demo refuses
(:func:`marl.apps.demo.arguments.check_demo_sweep`) sweeping
``reward_weights`` (it measures the on-film weight once, at the start, for every policy; ``--topic_weight``
sets it) and a warm start (``--warm_start_epochs``), whose reference would have to be shared by the members:
train such a sweep with ``marl train-rloo --policy_adapter WARM_START --sweep ...``.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from marl.apps.demo.arguments import check_demo_sweep
from marl.apps.demo.start import (
    DEMO_SUMMARY_FILE,
    demo_rewards,
    duration_line,
    start_demo,
)

if TYPE_CHECKING:
    from marl.apps.demo.arguments import DemoArguments


def run_demo_sweep(arguments: DemoArguments) -> dict[str, Any]:
    """The demo with one policy per member of ``arguments.sweep``, trained at once, then ranked on the
    held-out prompts (see the module docstring); returns what it writes to ``demo_summary.json``.

    Example:
        >>> run_demo_sweep(DemoArguments(sweep=["kl_coef=0.15,0.3"]))  # doctest: +SKIP
    """
    from rich.console import Console

    from marl.apps.evaluate.ranking import rank_and_report
    from marl.apps.evaluate.report import write_results
    from marl.apps.evaluate.scores import generate_and_score
    from marl.apps.train_rloo import memory_card_with_plan
    from marl.data.topicality import distinct_2, film_share
    from marl.model.build import load_tokenizer
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
