"""Evaluation's report: the table printed at the end and the two files written next to the policy adapter.

``eval_results.json`` holds the settings and the means (:func:`marl.apps.evaluate.scores.summarize`);
``eval_completions.jsonl`` every completion with its measurements, one prompt a line.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from marl.apps.evaluate.scores import ScoredCompletions

RESULTS_FILE = "eval_results.json"
COMPLETIONS_FILE = "eval_completions.jsonl"


JUDGE_NAMES = {"vader": "VADER"}  # how the table names a judge: the default one by what it is


def results_table(
    summary: dict[str, Any], title: str = "Evaluation on held-out prompts", judge: str = "vader"
):
    """A rich table of :func:`marl.apps.evaluate.scores.summarize`'s output: one row per model. ``judge``
    names the judge in the column titles (``"vader"``: VADER sentiment, the default; else its
    ``module:function``);
    with several reward sources, each gets a column of its own."""
    from rich.table import Table

    def show(value: float | None, digits: int = 3) -> str:
        return (
            "—"
            if value is None or (isinstance(value, float) and math.isnan(value))
            else f"{value:.{digits}f}"
        )

    table = Table(title=title)
    judge_name = JUDGE_NAMES.get(judge, judge)
    by_name = list(next(iter(summary.values())).get("reward_scores_by_name") or {})
    reward_columns = [f"reward: {name}" for name in by_name] or ["reward-adapter score"]
    for column in (
        "model",
        *reward_columns,
        f"judge score ({judge_name})",
        f"{judge_name} win rate vs base",
        "KL to ref",
        "length",
    ):
        table.add_column(column, justify="left" if column == "model" else "right")
    # The policy's starting adapter, when it is the policy's reference, sits between the two.
    comparisons = {"reference": "reference_comparison", "policy": "comparison"}
    for name in ("base", "reference", "policy"):
        if name not in summary:
            continue
        scores = summary[name]
        win = "—"
        if name in comparisons:
            comparison = summary[comparisons[name]]
            win = (
                f"{comparison['win_rate']:.1%} ({comparison['wins']}W {comparison['ties']}T "
                f"{comparison['losses']}L)"
            )
        kl = scores["kl"] if name == "policy" else None
        rewards = [scores["reward_scores_by_name"][name] for name in by_name] or [scores["reward_score"]]
        table.add_row(
            "reference (the policy's start)" if name == "reference" else name,
            *(show(value) for value in rewards),
            show(scores["judge_score"]),
            win,
            show(kl),
            show(scores["length"], 1),
        )
    return table


def write_results(
    output_dir: str | Path,
    summary: dict[str, Any],
    samples: dict[str, ScoredCompletions],
    prompts: list[Any],
    settings: dict[str, Any],
) -> Path:
    """Write ``eval_results.json`` (settings + summary) and ``eval_completions.jsonl`` (every completion)."""
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    results_path = output_dir / RESULTS_FILE
    results_path.write_text(json.dumps({"settings": settings, **summary}, indent=2) + "\n")
    with (output_dir / COMPLETIONS_FILE).open("w") as handle:
        for index, prompt in enumerate(prompts):
            row: dict[str, Any] = {"prompt": prompt}
            for name, record in samples.items():
                row[name] = {
                    "completion": record.completions[index],
                    "judge_score": record.judge_scores[index],
                    "reward_score": record.reward_scores[index] if record.reward_scores else None,
                    **(
                        {"reward_scores": {n: v[index] for n, v in record.reward_scores_by_name.items()}}
                        if record.reward_scores_by_name
                        else {}
                    ),
                    "length": record.lengths[index],
                    **({"kl": record.kls[index]} if record.kls else {}),
                }
            handle.write(json.dumps(row) + "\n")
    return results_path
