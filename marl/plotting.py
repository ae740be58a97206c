"""Training curves of an RLOO run, read from its ``metrics.jsonl``, as a PNG (matplotlib, no display)."""

from __future__ import annotations

import json
from pathlib import Path

CURVES = (
    ("objective/scores", "reward-adapter score"),
    ("objective/kl", "KL to the reference (sum over tokens)"),
    ("objective/rlhf_reward", "RLHF reward = score − kl_coef·KL"),
)


def read_metrics(metrics_file: str | Path) -> list[dict[str, float]]:
    """The records of a ``metrics.jsonl`` file, one dict per logged update.

    Example:
        >>> records = read_metrics("runs/rloo/metrics.jsonl")  # doctest: +SKIP
        >>> records[-1]["objective/scores"]  # doctest: +SKIP
    """
    lines = Path(metrics_file).read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def plot_training_curves(metrics_file: str | Path, output_file: str | Path, title: str | None = None) -> Path:
    """Plot score, KL and RLHF reward against the episode (completions seen) into ``output_file``.

    Example:
        >>> plot_training_curves("runs/rloo/metrics.jsonl", "runs/rloo/training_curves.png")  # doctest: +SKIP
    """
    import matplotlib

    matplotlib.use("Agg")  # files only: works without a display
    import matplotlib.pyplot as plt

    records = read_metrics(metrics_file)
    if not records:
        raise ValueError(f"{metrics_file} has no records: the run logged no update")
    episodes = [record["episode"] for record in records]
    figure, axes = plt.subplots(1, len(CURVES), figsize=(4.2 * len(CURVES), 3.4), constrained_layout=True)
    for axis, (key, label) in zip(axes, CURVES, strict=True):
        axis.plot(episodes, [record[key] for record in records], marker="o", markersize=3)
        axis.set_title(label, fontsize=10)
        axis.set_xlabel("episode (completions)")
        axis.grid(alpha=0.3)
    if title:
        figure.suptitle(title, fontsize=11)
    output_file = Path(output_file)
    output_file.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(output_file, dpi=110)
    plt.close(figure)
    return output_file
