"""The measured front of ``marl demo``'s settings: VADER win rate against variety (distinct-2) and the film,
over every seed each setting ran, and the setting the demo's default is chosen by.

A setting is a list of per-seed results: the policy's VADER win rate over the base, the share of
completions naming the film and distinct-2 for the base and the policy, and the KL. Results come from the
``demo_summary.json`` files that ``marl demo`` writes (``--runs``) and from a points file of settings measured
earlier (``--points``, the same records; the folders of those runs were not kept, so their numbers are the
ones their dated results file printed, rounded as printed). The default is chosen by the rule of the issue
that asked for it: among the settings run on all five seeds (0-4) that keep the film (named at least as often
as by the base) and the variety (distinct-2 at least 0.9x the base's) on every seed, as the demo's verdict
decides both, the one with the best minimum win rate.

    python examples/benchmarks/demo_front.py --points benchmarks/results/2026-11-26-demo-front.json \\
        --runs "per_reward, kl 0.1=runs/pr-seed0,runs/pr-seed1" --plot front.png --write_points all.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from marl.apps.demo.verdict import TARGET_DISTINCT_2_RATIO

FIVE_SEEDS = (0, 1, 2, 3, 4)


def seed_result(summary: dict[str, Any]) -> dict[str, float]:
    """One seed's record from a ``demo_summary.json`` of ``marl demo``.

    Example:
        >>> summary = {"settings": {"seed": 3}, "comparison": {"win_rate": 0.8}, "policy": {"kl": 6.0},
        ...            "topicality": {"base": {"film_share": 0.1, "distinct_2": 0.8},
        ...                           "policy": {"film_share": 0.2, "distinct_2": 0.76}}}
        >>> seed_result(summary)["distinct_policy"]
        0.76
    """
    topic = summary["topicality"]
    return {
        "seed": summary["settings"]["seed"],
        "win_rate": summary["comparison"]["win_rate"],
        "film_base": topic["base"]["film_share"],
        "film_policy": topic["policy"]["film_share"],
        "distinct_base": topic["base"]["distinct_2"],
        "distinct_policy": topic["policy"]["distinct_2"],
        "kl": summary["policy"]["kl"],
    }


def keeps_film(result: dict[str, float]) -> bool:
    return result["film_policy"] >= result["film_base"]


def keeps_variety(result: dict[str, float]) -> bool:
    """As the demo's verdict decides it (:func:`marl.apps.demo.verdict.topicality_rows`)."""
    return result["distinct_policy"] / result["distinct_base"] >= TARGET_DISTINCT_2_RATIO


def verdict(setting: dict[str, Any], seeds: tuple[int, ...] = FIVE_SEEDS) -> dict[str, Any]:
    """Mean and minimum win rate, the lowest distinct-2 ratio, and on how many seeds the film and the
    variety hold; ``complete`` when every seed of ``seeds`` ran.

    Example:
        >>> run = lambda seed, win, film, distinct: {"seed": seed, "win_rate": win, "film_base": 0.1,
        ...     "film_policy": film, "distinct_base": 0.8, "distinct_policy": distinct, "kl": 5.0}
        >>> v = verdict({"seeds": [run(0, 0.7, 0.2, 0.76), run(1, 0.9, 0.05, 0.70)]}, seeds=(0, 1))
        >>> v["min_win"], v["film_kept"], v["variety_kept"], v["complete"], v["keeps_both"]
        (0.7, 1, 1, True, False)
    """
    results = setting["seeds"]
    wins = [result["win_rate"] for result in results]
    ratios = [result["distinct_policy"] / result["distinct_base"] for result in results]
    film_kept = sum(keeps_film(result) for result in results)
    variety_kept = sum(keeps_variety(result) for result in results)
    complete = set(seeds) <= {result["seed"] for result in results}
    return {
        "seeds": len(results),
        "mean_win": sum(wins) / len(wins),
        "min_win": min(wins),
        "min_distinct_ratio": min(ratios),
        "film_kept": film_kept,
        "variety_kept": variety_kept,
        "complete": complete,
        "keeps_both": complete and film_kept == variety_kept == len(results),
    }


def choose_default(
    settings: list[dict[str, Any]], seeds: tuple[int, ...] = FIVE_SEEDS
) -> dict[str, Any] | None:
    """The setting with the best minimum win rate among the two-reward settings (the default demo's) run on
    every seed that keep the film and the variety on every seed; ``None`` when no setting does.

    Example:
        >>> run = lambda win, distinct: {"seed": 0, "win_rate": win, "film_base": 0.1, "film_policy": 0.2,
        ...                             "distinct_base": 0.8, "distinct_policy": distinct, "kl": 5.0}
        >>> settings = [{"label": "a", "seeds": [run(0.9, 0.6)]}, {"label": "b", "seeds": [run(0.7, 0.78)]},
        ...             {"label": "c", "seeds": [run(0.75, 0.73)]}]
        >>> choose_default(settings, seeds=(0,))["label"]
        'c'
    """
    eligible = [
        setting
        for setting in settings
        if setting.get("rewards", 2) == 2 and verdict(setting, seeds)["keeps_both"]
    ]
    return max(eligible, key=lambda setting: verdict(setting, seeds)["min_win"], default=None)


def markdown(settings: list[dict[str, Any]], seeds: tuple[int, ...] = FIVE_SEEDS) -> str:
    """One row per setting, best minimum win rate first; the chosen default in bold."""
    chosen = choose_default(settings, seeds)
    lines = [
        "| setting | seeds | win rate: mean, min | lowest distinct-2 ratio | seeds keeping the film "
        "| seeds keeping distinct-2 ≥ 0.9× | KL range |",
        "|---|---|---|---|---|---|---|",
    ]
    ranked = sorted(settings, key=lambda setting: -verdict(setting, seeds)["min_win"])
    for setting in ranked:
        v, kls = verdict(setting, seeds), [result["kl"] for result in setting["seeds"]]
        label = f"**{setting['label']}**" if setting is chosen else setting["label"]
        wins = f"{v['mean_win']:.1%}, {v['min_win']:.1%}"
        kept = f"{v['film_kept']}/{v['seeds']} | {v['variety_kept']}/{v['seeds']}"
        kl_range = f"{min(kls):.1f}–{max(kls):.1f}"
        lines.append(
            f"| {label} | {v['seeds']} | {wins} | {v['min_distinct_ratio']:.2f}× | {kept} | {kl_range} |"
        )
    return "\n".join(lines)


def plot(settings: list[dict[str, Any]], path: Path, seeds: tuple[int, ...] = FIVE_SEEDS) -> None:
    """Each setting at (lowest distinct-2 ratio, minimum win rate), with a line up to its mean win rate;
    filled when it keeps the film on every seed it ran, large when it ran on every seed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(9, 6))
    chosen = choose_default(settings, seeds)
    for number, setting in enumerate(settings, start=1):
        v = verdict(setting, seeds)
        x = v["min_distinct_ratio"]
        film = v["film_kept"] == v["seeds"]
        axes.plot([x, x], [v["min_win"], v["mean_win"]], color="0.6", linewidth=1)
        axes.scatter(
            x, v["min_win"], s=90 if v["complete"] else 35, marker="o",
            facecolors="C0" if film else "none", edgecolors="C3" if setting is chosen else "C0", linewidths=2,
        )  # fmt: skip
        axes.annotate(str(number), (x, v["min_win"]), textcoords="offset points", xytext=(6, -10), fontsize=8)
    axes.axvline(TARGET_DISTINCT_2_RATIO, color="0.5", linestyle="--", linewidth=1)
    axes.axhline(0.72, color="0.5", linestyle=":", linewidth=1)
    axes.axhline(0.80, color="0.5", linestyle="--", linewidth=1)
    axes.set_xlabel("lowest distinct-2 of the policy / the base's, over the seeds (target ≥ 0.9×)")
    axes.set_ylabel("VADER win rate over the base: minimum over the seeds (dot) to mean (line top)")
    axes.set_title("marl demo settings: win rate against variety (filled: film kept on every seed run;\n"
                   "large: run on all five seeds; red edge: the default chosen)", fontsize=10)  # fmt: skip
    legend = "\n".join(f"{number}: {setting['label']}" for number, setting in enumerate(settings, start=1))
    axes.text(1.02, 1.0, legend, transform=axes.transAxes, fontsize=7, va="top")
    figure.savefig(path, bbox_inches="tight", dpi=120)
    plt.close(figure)


def runs_setting(spec: str) -> dict[str, Any]:
    """``"LABEL=DIR,DIR,..."``: a setting from the ``demo_summary.json`` in each run folder."""
    label, _, folders = spec.partition("=")
    summaries = [
        json.loads((Path(folder) / "demo_summary.json").read_text()) for folder in folders.split(",")
    ]
    settings = summaries[0]["settings"]
    rewards = len(settings["rewards"].split(","))
    return {
        "label": label,
        "rewards": rewards,
        "source": "runs",
        "seeds": [seed_result(s) for s in summaries],
    }


def merged(settings: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Settings of the same label as one, their seeds together (some seeds measured earlier, others now).

    Example:
        >>> merged([{"label": "a", "seeds": [{"seed": 2}]}, {"label": "a", "seeds": [{"seed": 0}]}])
        [{'label': 'a', 'seeds': [{'seed': 0}, {'seed': 2}]}]
    """
    by_label: dict[str, dict[str, Any]] = {}
    for setting in settings:
        if setting["label"] in by_label:
            by_label[setting["label"]]["seeds"] += setting["seeds"]
        else:
            by_label[setting["label"]] = {**setting, "seeds": list(setting["seeds"])}
    for setting in by_label.values():
        setting["seeds"].sort(key=lambda result: result["seed"])
    return list(by_label.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--points", action="append", default=[], help="JSON file of settings measured earlier"
    )
    parser.add_argument("--runs", action="append", default=[], help='"LABEL=DIR,DIR,..." demo output folders')
    parser.add_argument("--plot", type=Path, help="PNG of the front")
    parser.add_argument("--write_points", type=Path, help="write every setting read to this JSON file")
    arguments = parser.parse_args()
    settings = [
        setting for path in arguments.points for setting in json.loads(Path(path).read_text())["settings"]
    ]
    settings = merged(settings + [runs_setting(spec) for spec in arguments.runs])
    print(markdown(settings))
    chosen = choose_default(settings)
    print(f"\nchosen: {chosen['label'] if chosen else 'none keeps the film and the variety on every seed'}")
    if arguments.plot:
        plot(settings, arguments.plot)
    if arguments.write_points:
        arguments.write_points.write_text(json.dumps({"settings": settings}, indent=1) + "\n")


if __name__ == "__main__":
    main()
