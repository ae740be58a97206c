"""The demo's front (examples/benchmarks/demo_front.py): its rule for the default, and the command on run
folders as ``marl demo`` leaves them (a ``demo_summary.json`` each), with a points file beside them."""

from __future__ import annotations

import doctest
import json
import subprocess
import sys
from pathlib import Path

import pytest

from support.benchmark_scripts import benchmark_modules

ROOT = Path(__file__).resolve().parents[1]
_HERE = ROOT / "examples" / "benchmarks"


@pytest.fixture(scope="module")
def front():
    with benchmark_modules("demo_front") as modules:
        yield modules["demo_front"]


def test_examples_of_the_front(front):
    result = doctest.testmod(front, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0 and result.attempted >= 6


def _summary(seed: int, win: float, film: float, distinct: float) -> dict:
    return {
        "settings": {"seed": seed, "rewards": "sentiment,topic"},
        "comparison": {"win_rate": win},
        "policy": {"kl": 5.0 + seed},
        "topicality": {
            "base": {"film_share": 0.1, "distinct_2": 0.8},
            "policy": {"film_share": film, "distinct_2": distinct},
        },
    }


def _setting(front, label: str, rows: list[tuple[int, float, float, float]]) -> dict:
    return {"label": label, "seeds": [front.seed_result(_summary(*row)) for row in rows]}


def test_the_default_is_the_best_minimum_win_among_settings_keeping_film_and_variety_on_every_seed(front):
    seeds = [0, 1, 2, 3, 4]
    wins_more_loses_variety = _setting(front, "a", [(s, 0.9, 0.2, 0.70) for s in seeds])
    keeps_both_low_minimum = _setting(front, "b", [(s, 0.85 if s else 0.60, 0.2, 0.75) for s in seeds])
    keeps_both = _setting(front, "c", [(s, 0.74, 0.2, 0.75) for s in seeds])
    drops_the_film_once = _setting(front, "d", [(s, 0.8, 0.05 if s == 3 else 0.2, 0.75) for s in seeds])
    two_seeds_only = _setting(front, "e", [(s, 0.95, 0.2, 0.79) for s in (0, 1)])
    settings = [
        wins_more_loses_variety,
        keeps_both_low_minimum,
        keeps_both,
        drops_the_film_once,
        two_seeds_only,
    ]
    assert front.choose_default(settings)["label"] == "c"
    # distinct-2 just above 0.9x the base's keeps the variety; just below does not
    edge = _setting(front, "edge", [(s, 0.76, 0.2, 0.7201) for s in seeds])
    below = _setting(front, "below", [(s, 0.99, 0.2, 0.7199) for s in seeds])
    assert front.choose_default([keeps_both, edge, below])["label"] == "edge"
    assert front.choose_default([wins_more_loses_variety, two_seeds_only]) is None
    one_reward = {**_setting(front, "one reward", [(s, 0.95, 0.2, 0.79) for s in seeds]), "rewards": 1}
    assert front.choose_default([keeps_both, one_reward])["label"] == "c"  # the default demo has two


def test_the_command_reads_run_folders_and_points_and_draws_the_front(tmp_path):
    folders = []
    for seed in range(5):
        folder = tmp_path / f"run-seed{seed}"
        folder.mkdir()
        (folder / "demo_summary.json").write_text(json.dumps(_summary(seed, 0.78, 0.15, 0.74)))
        folders.append(str(folder))
    earlier = {"settings": [{"label": "earlier", "seeds": [
        {"seed": s, "win_rate": 0.9, "film_base": 0.1, "film_policy": 0.3, "distinct_base": 0.8,
         "distinct_policy": 0.6, "kl": 12.0} for s in range(5)]}]}  # fmt: skip
    (tmp_path / "earlier.json").write_text(json.dumps(earlier))
    written = tmp_path / "all.json"
    result = subprocess.run(
        [sys.executable, str(_HERE / "demo_front.py"), "--points", str(tmp_path / "earlier.json"),
         "--runs", "new=" + ",".join(folders), "--plot", str(tmp_path / "front.png"),
         "--write_points", str(written)],
        capture_output=True, text=True, check=True, cwd=ROOT,
    )  # fmt: skip
    assert "chosen: new" in result.stdout
    assert "| **new** | 5 | 78.0%, 78.0% | 0.92× | 5/5 | 5/5 | 5.0–9.0 |" in result.stdout
    assert (tmp_path / "front.png").stat().st_size > 10_000
    labels = [setting["label"] for setting in json.loads(written.read_text())["settings"]]
    assert labels == ["earlier", "new"]
