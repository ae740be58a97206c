"""Training curves of an RLOO run, read from its ``metrics.jsonl``, as a PNG (matplotlib, no display).

matplotlib is in marl's ``demo`` extra: without it a run still finishes, and its last line says why there
are no curves (:func:`training_curves_note`).
"""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType

from marl.data.assets import MissingAssetError, demo_package

# One panel per entry: its title and the (metric, legend) lines it draws. A panel none of whose metrics a run
# logged is left out (the judge panel needs a trainer with a judge and held-out prompts).
PANELS = (
    (
        "reward-adapter score",
        (("objective/scores", "training rollouts"), ("eval/score", "held-out prompts")),
    ),
    ("gold-judge score, held-out prompts", (("eval/judge_score", None),)),
    ("KL to the reference (sum over tokens)", (("objective/kl", None),)),
    ("RLHF reward = score − kl_coef·KL", (("objective/rlhf_reward", None),)),
)


def read_metrics(metrics_file: str | Path) -> list[dict[str, float]]:
    """The records of a ``metrics.jsonl`` file, one dict per logged update.

    Example:
        >>> records = read_metrics("runs/rloo/metrics.jsonl")  # doctest: +SKIP
        >>> records[-1]["objective/scores"]  # doctest: +SKIP
    """
    lines = Path(metrics_file).read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def logged_panels(records: list[dict[str, float]]) -> list[tuple[str, tuple[tuple[str, str | None], ...]]]:
    """The entries of ``PANELS`` with at least one metric in ``records``.

    Example:
        >>> [title for title, _ in logged_panels([{"objective/scores": 1.0, "objective/kl": 0.1}])]
        ['reward-adapter score', 'KL to the reference (sum over tokens)']
    """
    return [(title, lines) for title, lines in PANELS if any(key in r for r in records for key, _ in lines)]


def pyplot() -> ModuleType:
    """matplotlib's ``pyplot`` drawing into files only (works without a display); without matplotlib, a
    :class:`~marl.data.assets.MissingAssetError` naming it and ``pip install 'marl[demo]'``.

    Example:
        >>> pyplot().get_backend().lower()
        'agg'
    """
    matplotlib = demo_package("matplotlib", "Drawing the training curves")
    matplotlib.use("Agg")
    import matplotlib.pyplot

    return matplotlib.pyplot


def training_curves_note(metrics_file: str | Path, output_file: str | Path) -> str:
    """Draw a finished run's curves into ``output_file`` and say where they are, for the run's last line; the
    run is done either way, so without matplotlib the note says why they were not drawn instead of failing.

    Example:
        >>> training_curves_note("runs/a/metrics.jsonl", "runs/a/training_curves.png")  # doctest: +SKIP
        'training curves in runs/a/training_curves.png'
    """
    try:
        return f"training curves in {plot_training_curves(metrics_file, output_file)}"
    except MissingAssetError as missing:
        return f"training curves not drawn: {missing}"


def plot_training_curves(metrics_file: str | Path, output_file: str | Path, title: str | None = None) -> Path:
    """Plot score, judge score (when logged), KL and RLHF reward against the episode (completions seen)
    into ``output_file``.

    Example:
        >>> plot_training_curves("runs/rloo/metrics.jsonl", "runs/rloo/training_curves.png")  # doctest: +SKIP
    """
    plt = pyplot()
    records = read_metrics(metrics_file)
    if not records:
        raise ValueError(f"{metrics_file} has no records: the run logged no update")
    panels = logged_panels(records)
    figure, axes = plt.subplots(
        1, len(panels), figsize=(4.2 * len(panels), 3.4), constrained_layout=True, squeeze=False
    )
    for axis, (panel_title, lines) in zip(axes[0], panels, strict=True):
        for key, legend in lines:
            logged = [record for record in records if key in record]
            if logged:
                values = [record[key] for record in logged]
                axis.plot(
                    [record["episode"] for record in logged], values, marker="o", markersize=3, label=legend
                )
        if any(legend for _, legend in lines):
            axis.legend(fontsize=8)
        axis.set_title(panel_title, fontsize=10)
        axis.set_xlabel("episode (completions)")
        axis.grid(alpha=0.3)
    if title:
        figure.suptitle(title, fontsize=11)
    output_file = Path(output_file)
    output_file.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(output_file, dpi=110)
    plt.close(figure)
    return output_file
