"""Training curves of an RLOO run, read from its ``metrics.jsonl``, as a PNG (matplotlib, no display), the
progress bar's title and numbers, and what a finished sweep shows beside its policies' folders.

matplotlib is in marl's ``demo`` extra: without it a run still finishes, and its last line says why there
are no curves (:func:`training_curves_note`).

Each policy of a sweep has its own folder, a complete run (its adapter, ``rloo_config.json``,
``metrics.jsonl``, ``training_curves.png``); the sweep's folder (the members' common parent) gets
``sweep_summary.md`` (a table of its policies: the settings that differ, the final reward and KL, the
held-out judge score where one was asked) and ``sweep_curves.png`` (every policy's reward, KL and, where
logged, judge score against the episode, one line per policy): :func:`finish_sweep`.

Example:
    >>> rows = [{"member": "kl_coef=0.05", "kl_coef": 0.05, "reward": 0.31, "kl": 1.2}]
    >>> print(markdown_table(rows))
    | member | kl_coef | reward | kl |
    |---|---|---|---|
    | kl_coef=0.05 | 0.05 | 0.31 | 1.2 |
"""

from __future__ import annotations

import json
import os
import textwrap
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

from marl.config.sweep import SWEEPABLE_FIELDS
from marl.data.assets import MissingAssetError, demo_package
from marl.train import run_dir
from marl.train.run_dir import read_metrics_file

Panel = tuple[str, tuple[tuple[str, str | None], ...]]

RLHF_METRIC = "objective/rlhf_reward"
# ``objective/rlhf_reward`` is score − coef·KL under every preset; what it is to the run depends on where
# the run's KL acts (``kl_placement`` in its ``rloo_config.json``, :func:`rlhf_panel`). Without the settings:
RLHF_TITLE = "score − coef·KL (objective/rlhf_reward)"

# One panel per entry: its title and the (metric, legend) lines it draws. A panel none of whose metrics a run
# logged is left out (the judge panel needs a trainer with a judge and held-out prompts, the tools panel a run
# with tools: marl.algo.metrics.tool_metrics). With several reward sources, :func:`logged_panels` adds one
# panel per source's own score, one with each source's share of the advantage, and their flat groups beside
# the overall ones.
PANELS: tuple[Panel, ...] = (
    (
        "reward: weighted sum of the sources (Σ w·r)",
        (("objective/scores", "training rollouts"), ("eval/score", "held-out prompts")),
    ),
    ("gold-judge score, held-out prompts", (("eval/judge_score", None),)),
    ("KL to the reference (sum over tokens)", (("objective/kl", None),)),
    (RLHF_TITLE, ((RLHF_METRIC, None),)),
    (
        "tool calls (TRL's tools/* metrics)",
        (("tools/call_frequency", "calls per completion"), ("tools/failure_frequency", "share that failed")),
    ),
    (
        "groups whose rewards are all equal (teach nothing)",
        (("objective/zero_spread_groups", "weighted sum"),),
    ),
)
SOURCE_PREFIX, SHARE_PREFIX, FLAT_PREFIX = "rewards/", "advantage_share/", "zero_spread_groups/"
# TRL's per-source names logged beside marl's rewards/<name> (marl.algo.metrics.trl_rollout_metrics)
TRL_SOURCE_STATISTICS = ("mean", "std")
PANELS_PER_ROW = 4
PANEL_WIDTH_INCHES, PANEL_HEIGHT_INCHES, TITLE_FONT_SIZE = 4.2, 3.4, 10
# Characters of a title line that fit a panel's width at TITLE_FONT_SIZE (tests/train/test_curves.py measures
# the drawn titles); longer titles wrap.
TITLE_CHARACTERS = 46


def source_names(records: list[dict[str, float]]) -> list[str]:
    """The reward sources a run logged (``rewards/<name>``), in the order it logged them; TRL's names of their
    mean and std logged beside them (``rewards/<name>/mean``, ``/std``) are not sources.

    Example:
        >>> source_names([{"rewards/tone": 1.0, "rewards/tone/mean": 1.0, "rewards/tone/std": 0.2,
        ...                "rewards/topic": 0.5, "objective/kl": 0.1}])
        ['tone', 'topic']
    """
    names: dict[str, None] = {}
    for record in records:
        logged = [key.removeprefix(SOURCE_PREFIX) for key in record if key.startswith(SOURCE_PREFIX)]
        names.update({name: None for name in logged})
        for name in logged:
            base, _, statistic = name.rpartition("/")
            if statistic in TRL_SOURCE_STATISTICS and base in logged:
                names.pop(name, None)
    return list(names)


def wrapped_title(title: str, width: int = TITLE_CHARACTERS) -> str:
    """``title`` broken into lines of at most ``width`` characters (a longer word keeps its own line), so
    that the titles of panels side by side do not run into each other.

    Example:
        >>> print(wrapped_title("reward source 'length_on_the_completion': mean score (unweighted)"))
        reward source 'length_on_the_completion': mean
        score (unweighted)
    """
    return textwrap.fill(title, width, break_long_words=False, break_on_hyphens=False)


def rlhf_panel(settings: Mapping[str, Any] | None) -> Panel | None:
    """The RLHF-reward panel as true for a run of ``settings`` (its ``rloo_config.json``): with the KL in the
    reward (``--kl_placement reward``: rloo, reinforce_pp) the reward the advantages are computed from; with
    the KL in the loss (the GRPO presets) score − β·KL is what the loss's KL term and the reward optimise
    together, not a reward, and with β = 0 it is the score itself, so no panel (``None``).

    Example:
        >>> rlhf_panel({"kl_placement": "reward", "kl_coef": 0.05})[0]
        'RLHF reward = score − kl_coef·KL (KL in the reward, kl_coef=0.05)'
        >>> rlhf_panel({"kl_placement": "loss", "kl_coef": 0.04})[0]
        'score − β·KL (KL in the loss as β·k3 per token, β=0.04; not the reward)'
        >>> rlhf_panel({"kl_placement": "loss", "kl_coef": 0.0}) is None
        True
    """
    lines = ((RLHF_METRIC, None),)
    if not settings or settings.get("kl_placement") not in ("reward", "loss"):
        return (RLHF_TITLE, lines)
    coefficient = float(settings.get("kl_coef") or 0.0)
    if settings["kl_placement"] == "reward":
        return (f"RLHF reward = score − kl_coef·KL (KL in the reward, kl_coef={coefficient:g})", lines)
    if coefficient == 0:
        return None
    return (f"score − β·KL (KL in the loss as β·k3 per token, β={coefficient:g}; not the reward)", lines)


def run_settings_of(metrics_file: str | Path) -> dict[str, Any] | None:
    """The settings of the run whose ``metrics.jsonl`` is ``metrics_file``: its ``rloo_config.json`` beside
    it, or ``None`` where there is none (metrics copied elsewhere).

    Example:
        >>> run_settings_of("/nonexistent/metrics.jsonl") is None
        True
    """
    from marl.train.run_dir import CONFIG_FILE

    path = Path(metrics_file).parent / CONFIG_FILE
    return json.loads(path.read_text()) if path.is_file() else None


def logged_panels(records: list[dict[str, float]], settings: Mapping[str, Any] | None = None) -> list[Panel]:
    """The panels of ``records``: those of ``PANELS`` with at least one metric logged, and with several reward
    sources, after the weighted sum, one panel per source's own mean score and one with each source's share
    of the advantage; the flat-groups panel then draws each source's too. ``settings`` (the run's
    ``rloo_config.json``) decide the RLHF-reward panel (:func:`rlhf_panel`).

    Example:
        >>> [title for title, _ in logged_panels([{"objective/scores": 1.0, "objective/kl": 0.1}])]
        ['reward: weighted sum of the sources (Σ w·r)', 'KL to the reference (sum over tokens)']
        >>> records = [{"objective/scores": 1.0, "rewards/tone": 0.5, "rewards/topic": 2.0,
        ...             "advantage_share/tone": 0.4, "advantage_share/topic": 0.6}]
        >>> [title for title, _ in logged_panels(records)]  # doctest: +NORMALIZE_WHITESPACE
        ['reward: weighted sum of the sources (Σ w·r)', "reward source 'tone': mean score (unweighted)",
         "reward source 'topic': mean score (unweighted)", 'share of the advantage by reward source']
    """
    names = source_names(records)
    rlhf = rlhf_panel(settings)
    panels = [panel if panel[0] != RLHF_TITLE else rlhf for panel in PANELS]
    panels = [panel for panel in panels if panel is not None]
    if len(names) > 1:
        per_source: list[Panel] = [
            (f"reward source {name!r}: mean score (unweighted)", ((f"{SOURCE_PREFIX}{name}", None),))
            for name in names
        ]
        shares: Panel = (
            "share of the advantage by reward source",
            tuple((f"{SHARE_PREFIX}{name}", name) for name in names),
        )
        title, lines = panels[-1]
        panels[-1] = (title, lines + tuple((f"{FLAT_PREFIX}{name}", name) for name in names))
        panels[1:1] = [*per_source, shares]
    return [(title, lines) for title, lines in panels if any(key in r for r in records for key, _ in lines)]


def pyplot() -> ModuleType:
    """matplotlib's ``pyplot`` drawing into files only (works without a display); without matplotlib, a
    :class:`~marl.data.assets.MissingAssetError` naming it and ``pip install 'marl-rlhf[demo]'``.

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
    """Plot the panels of :func:`logged_panels` (the weighted reward, each source's score and share of the
    advantage, judge score, KL, RLHF reward as the run's ``rloo_config.json`` says it, flat groups: those the
    run logged) against the episode (completions seen) into ``output_file``, four panels a row.

    Example:
        >>> plot_training_curves("runs/rloo/metrics.jsonl", "runs/rloo/training_curves.png")  # doctest: +SKIP
    """
    plt = pyplot()
    records = read_metrics_file(metrics_file)
    if not records:
        raise ValueError(f"{metrics_file} has no records: the run logged no update")
    figure = training_curves_figure(records, run_settings_of(metrics_file), title)
    output_file = Path(output_file)
    output_file.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(output_file, dpi=110)
    plt.close(figure)
    return output_file


def training_curves_figure(
    records: list[dict[str, float]], settings: Mapping[str, Any] | None = None, title: str | None = None
) -> Any:
    """The matplotlib figure of :func:`plot_training_curves` for ``records`` (the run's settings decide the
    RLHF-reward panel); the caller closes it.

    Example:
        >>> figure = training_curves_figure([{"episode": 8.0, "objective/scores": 1.0}])
        >>> [axis.get_title() for axis in figure.axes]
        ['reward: weighted sum of the sources (Σ w·r)']
        >>> pyplot().close(figure)
    """
    plt = pyplot()
    panels = logged_panels(records, settings)
    columns = min(len(panels), PANELS_PER_ROW)
    rows = -(-len(panels) // columns)
    figure, axes = plt.subplots(
        rows,
        columns,
        figsize=(PANEL_WIDTH_INCHES * columns, PANEL_HEIGHT_INCHES * rows),
        constrained_layout=True,
        squeeze=False,
    )
    for axis in axes.flat[len(panels) :]:
        axis.set_visible(False)
    for axis, (panel_title, lines) in zip(axes.flat, panels, strict=False):
        for key, legend in lines:
            logged = [record for record in records if key in record]
            if logged:
                values = [record[key] for record in logged]
                axis.plot(
                    [record["episode"] for record in logged], values, marker="o", markersize=3, label=legend
                )
        if any(legend for _, legend in lines):
            axis.legend(fontsize=8)
        axis.set_title(wrapped_title(panel_title), fontsize=TITLE_FONT_SIZE)
        axis.set_xlabel("episode (completions)")
        axis.grid(alpha=0.3)
    if title:
        figure.suptitle(title, fontsize=11)
    return figure


# ------------------------------------------------------------------------------------------------------------
# A sweep's table and curves

# The sweep's own files, in the members' common folder (a run's curves: run_dir.CURVES_FILE).
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


def progress_description(config: Any) -> str:
    """The bar's title: the ``--algorithm`` preset and where its KL acts, with its coefficient.

    Example:
        >>> from types import SimpleNamespace
        >>> progress_description(SimpleNamespace(algorithm="grpo", kl_placement="loss", kl_coef=0.0))
        'GRPO (KL in the loss, β=0)'
    """
    where = "in the loss, β" if config.kl_placement == "loss" else "in the reward, kl_coef"
    return f"{config.algorithm.upper()} (KL {where}={config.kl_coef:g})"


def progress_postfix(metrics: Sequence[dict[str, float]], episode: int) -> dict[str, Any]:
    """The bar's numbers after an update: completions so far, the mean score (each policy's, in a sweep), and
    with one policy its k1 sequence KL when a reference pass measured it: ``objective/kl``, the mean over
    completions of ``Σ_t (log π − log π_ref)``, unbiased but single values can be negative.

    Example:
        >>> progress_postfix([{"objective/scores": 0.5, "objective/kl": -0.01}], episode=16)
        {'episode': 16, 'score': '0.500', 'kl_k1': '-0.010'}
        >>> progress_postfix([{"objective/scores": 0.5}, {"objective/scores": 0.25}], episode=16)
        {'episode': 16, 'score': '0.500/0.250'}
    """
    postfix: dict[str, Any] = {
        "episode": episode,
        "score": "/".join(f"{m['objective/scores']:.3f}" for m in metrics),
    }
    if len(metrics) == 1 and "objective/kl" in metrics[0]:
        postfix["kl_k1"] = f"{metrics[0]['objective/kl']:.3f}"
    return postfix
