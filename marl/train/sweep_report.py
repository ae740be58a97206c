"""What a finished sweep shows: a table of its policies (the settings that differ, the final reward and KL,
the held-out judge score where one was asked) and one plot of their curves, written beside their folders.

Each policy's own folder is a complete run (its adapter, ``rloo_config.json``, ``metrics.jsonl``,
``training_curves.png``); the sweep's folder (the members' common parent) gets ``sweep_summary.md`` (the
table) and ``sweep_curves.png`` (every policy's reward, KL and, where logged, judge score against the
episode, one line per policy).

Example:
    >>> rows = [{"member": "kl_coef=0.05", "kl_coef": 0.05, "reward": 0.31, "kl": 1.2}]
    >>> print(markdown_table(rows))
    | member | kl_coef | reward | kl |
    |---|---|---|---|
    | kl_coef=0.05 | 0.05 | 0.31 | 1.2 |
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from marl.config.sweep import SWEEPABLE_FIELDS
from marl.data.assets import MissingAssetError
from marl.train import run_dir
from marl.train.plotting import pyplot, training_curves_note

SUMMARY_FILE, CURVES_FILE = "sweep_summary.md", "sweep_curves.png"
# What the table and the plot show of each policy, by metric: its column / panel title.
SHOWN = {
    "objective/scores": "reward",
    "objective/kl": "kl",
    "eval/judge_score": "judge",
}


def differing_settings(configs: Sequence[Any]) -> list[str]:
    """The sweepable fields whose values differ between ``configs``, in :data:`SWEEPABLE_FIELDS` order.

    Example:
        >>> from types import SimpleNamespace
        >>> configs = [SimpleNamespace(**{f: 0 for f in SWEEPABLE_FIELDS}) for _ in range(2)]
        >>> configs[1].kl_coef = 0.1
        >>> differing_settings(configs)
        ['kl_coef']
    """
    return [
        field for field in SWEEPABLE_FIELDS if len({repr(getattr(config, field)) for config in configs}) > 1
    ]


def summary_rows(
    names: Sequence[str], configs: Sequence[Any], folders: Sequence[Path]
) -> list[dict[str, Any]]:
    """One row per policy: its name, each differing setting, and the last logged value of each of
    :data:`SHOWN` that any policy logged."""
    fields = differing_settings(configs)
    histories = [run_dir.read_metrics(Path(folder)) for folder in folders]
    logged = [key for key in SHOWN if any(key in record for history in histories for record in history)]
    rows = []
    for name, config, history in zip(names, configs, histories, strict=True):
        row: dict[str, Any] = {"member": name, **{field: getattr(config, field) for field in fields}}
        for key in logged:
            values = [record[key] for record in history if key in record]
            row[SHOWN[key]] = round(values[-1], 4) if values else None
        rows.append(row)
    return rows


def markdown_table(rows: Sequence[dict[str, Any]]) -> str:
    """``rows`` (dicts with the same keys) as a Markdown table."""
    columns = list(rows[0])
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(str(row[column]) for column in columns) + " |" for row in rows]
    return "\n".join(lines)


def plot_sweep_curves(names: Sequence[str], folders: Sequence[Path], output_file: Path) -> Path:
    """Every policy's curves of :data:`SHOWN` (those logged) against the episode, one line per policy."""
    plt = pyplot()
    histories = [run_dir.read_metrics(Path(folder)) for folder in folders]
    panels = [key for key in SHOWN if any(key in record for history in histories for record in history)]
    figure, axes = plt.subplots(
        1, len(panels), figsize=(4.6 * len(panels), 3.6), constrained_layout=True, squeeze=False
    )
    for axis, key in zip(axes.flat, panels, strict=True):
        for name, history in zip(names, histories, strict=True):
            logged = [record for record in history if key in record]
            axis.plot(
                [r["episode"] for r in logged], [r[key] for r in logged], marker="o", markersize=3, label=name
            )
        axis.set_title(key, fontsize=10)
        axis.set_xlabel("episode (completions)")
        axis.grid(alpha=0.3)
    axes.flat[0].legend(fontsize=7)
    output_file.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(output_file, dpi=110)
    plt.close(figure)
    return output_file


def finish_sweep(members: Sequence[Any], folders: Sequence[Path], trainers: Sequence[Any]) -> Path:
    """At the end of a sweep (main process): each policy's own curves and last line, as its own run ends,
    then the table (printed and written to ``sweep_summary.md``) and ``sweep_curves.png`` in the members'
    common folder, which is returned."""
    for trainer, folder in zip(trainers, folders, strict=True):
        curves = training_curves_note(folder / run_dir.METRICS_FILE, folder / run_dir.CURVES_FILE)
        print(run_dir.finished_line(folder, trainer.policy, curves))
    names = [member.name for member in members]
    root = Path(os.path.commonpath([Path(folder).resolve().parent for folder in folders]))
    table = markdown_table(summary_rows(names, [member.config for member in members], folders))
    run_dir.write_atomically(root / SUMMARY_FILE, table + "\n")
    try:
        note = f"curves of every policy in {plot_sweep_curves(names, folders, root / CURVES_FILE)}"
    except MissingAssetError as missing:
        note = f"sweep curves not drawn: {missing}"
    print(f"sweep of {len(names)} policies (the last logged values; {root / SUMMARY_FILE}):\n{table}\n{note}")
    return root
