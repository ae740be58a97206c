"""The results of ``learning_vs_trl.py``: the dated markdown file (medians over seeds with min–max, every
seed, the settings, the configuration mapping, what differs between the systems, machine and versions) and
the PNG of both systems' training curves."""

from __future__ import annotations

import datetime
import json
import statistics
from pathlib import Path

SYSTEMS = ("marl", "trl")


def median_spread(values: list[float]) -> str:
    """Median (min–max) of ``values``.

    Example:
        >>> median_spread([0.2, 0.1, 0.4])
        '0.200 (0.100–0.400)'
    """
    return f"{statistics.median(values):.3f} ({min(values):.3f}–{max(values):.3f})"


def mean_gain(runs: list[dict]) -> float:
    """Mean over seeds of the VADER gain of the policy over the base."""
    return statistics.mean(
        run["evaluation"]["policy"]["judge_score"] - run["evaluation"]["base"]["judge_score"] for run in runs
    )


def report(
    results: dict[str, list[dict]],
    settings: dict,
    command: str,
    trainer: str,
    mapping: tuple[tuple[str, str], ...],
    differences: tuple[str, ...],
) -> str:
    """The results markdown against TRL's ``trainer``: ``mapping`` rows (marl, TRL) and ``differences`` (what
    the two runs cannot share) are printed as given."""
    from marl.environment import machine_description, package_versions

    rows = []
    for system in SYSTEMS:
        runs = results[system]
        evaluations = [run["evaluation"] for run in runs]
        rows.append(
            f"| {system} | {len(runs)} | {median_spread([e['comparison']['win_rate'] for e in evaluations])} "
            "| "
            f"{median_spread([e['policy']['judge_score'] - e['base']['judge_score'] for e in evaluations])} "
            "| "
            f"{median_spread([e['policy']['judge_score'] for e in evaluations])} | "
            f"{median_spread([e['policy']['reward_score'] for e in evaluations])} | "
            f"{median_spread([e['policy']['kl'] for e in evaluations])} | "
            f"{median_spread([run['train_seconds'] / 60 for run in runs])} |"
        )
    per_seed = [
        f"| {system} | {run['seed']} | {run['evaluation']['comparison']['win_rate']:.1%} | "
        f"{run['evaluation']['base']['judge_score']:.3f} → {run['evaluation']['policy']['judge_score']:.3f} "
        "| "
        f"{run['evaluation']['base']['reward_score']:.3f} → "
        f"{run['evaluation']['policy']['reward_score']:.3f} | "
        f"{run['evaluation']['policy']['kl']:.2f} | {run['train_seconds'] / 60:.1f} |"
        for system in SYSTEMS
        for run in results[system]
    ]
    seconds = {system: statistics.mean(run["train_seconds"] for run in results[system]) for system in SYSTEMS}
    time_ratio = seconds["marl"] / seconds["trl"]
    machine = machine_description()
    versions = package_versions()
    return "\n".join(
        [
            f"# Learning against TRL's {trainer} ({datetime.date.today().isoformat()})",
            "",
            "Same job for both (the demo's), evaluated by the same code "
            "(`marl.apps.evaluate.generate_and_score`) on "
            f"{settings['num_eval_prompts']} held-out prompts; medians over seeds with min–max.",
            "",
            f"Command: `{command}`",
            "",
            "| system | seeds | VADER win rate over the base | VADER gain | VADER score | reward-adapter "
            "score | "
            "KL to the base | training minutes |",
            "|---|---|---|---|---|---|---|---|",
            *rows,
            "",
            "Per seed:",
            "",
            "| system | seed | win rate | VADER base → policy | adapter base → policy | KL | training "
            "minutes |",
            "|---|---|---|---|---|---|---|",
            *per_seed,
            "",
            f"Means over the seeds: VADER gain marl {mean_gain(results['marl']):.3f}, "
            f"TRL {mean_gain(results['trl']):.3f}; marl's training time {time_ratio:.2f}× TRL's.",
            "",
            "## What differs between the two runs",
            "",
            *[f"- {line}" for line in differences],
            "",
            "## Settings",
            "",
            "```json",
            json.dumps(settings, indent=2),
            "```",
            "",
            "## Configuration mapping (marl → TRL 1.16)",
            "",
            "| marl | TRL |",
            "|---|---|",
            *[f"| {ours} | {theirs} |" for ours, theirs in mapping],
            "",
            "## Machine and versions",
            "",
            "| | |",
            "|---|---|",
            *[f"| {key} | {value} |" for key, value in {**machine, **versions}.items()],
            "",
        ]
    )


def plot(results: dict[str, list[dict]], output: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, 2, figsize=(10, 3.6), constrained_layout=True)
    for system, color in zip(SYSTEMS, ("tab:blue", "tab:orange"), strict=True):
        for index, run in enumerate(results[system]):
            episodes = [point["episode"] for point in run["curve"]]
            label = system if index == 0 else None
            axes[0].plot(
                episodes, [point["score"] for point in run["curve"]], color=color, alpha=0.7, label=label
            )
            axes[1].plot(
                episodes, [point["kl"] for point in run["curve"]], color=color, alpha=0.7, label=label
            )
    axes[0].set_title("reward-adapter score (training batches)")
    axes[1].set_title("KL to the reference (sum over tokens)")
    for axis in axes:
        axis.set_xlabel("episode (completions)")
        axis.grid(alpha=0.3)
        axis.legend()
    figure.savefig(output, dpi=110)
    plt.close(figure)
