"""The training curves say what a run's ``objective/rlhf_reward`` is to that run: read from the
``rloo_config.json`` beside its ``metrics.jsonl``, the panel is the reward trained on where the KL is folded
into the reward, score − β·KL (not a reward) where the KL is in the loss, and left out at β = 0. With several
reward sources, the panels' titles fit their panels. A run with tools draws its tool calls."""

from __future__ import annotations

import json
from dataclasses import asdict

import pytest
import torch

from marl.algo.shaping import shape_rewards
from marl.train.curves import RLHF_METRIC, logged_panels, plot_training_curves, run_settings_of
from marl.train.run_dir import METRICS_FILE, write_run_config

from support.tiny import tiny_rloo_config


def _advantages(config, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """The run's advantages of fixed scores and policy log-probs against ``ref_logprobs``, as the trainer
    shapes them (its KL coefficient and placement)."""
    logprobs = torch.linspace(-2.0, -0.5, 8).reshape(4, 2)
    mask = torch.ones(4, 2, dtype=torch.bool)
    scores = torch.tensor([1.0, 0.0, 0.5, 2.0])
    shaped = shape_rewards(
        scores, logprobs, ref_logprobs, mask, torch.ones(4, dtype=torch.bool), k=2,
        kl_coef=config.kl_coef, token_level_kl=config.token_level_kl,
    )  # fmt: skip
    return shaped.advantages


@pytest.mark.parametrize(
    ("algorithm", "kl_coef"),
    [("rloo", None), ("reinforce_pp", None), ("grpo", 0.04), ("dapo", 0.04), ("grpo", None)],
)
def test_the_rlhf_panel_is_what_the_runs_algorithm_makes_of_the_kl(tmp_path, algorithm, kl_coef):
    config = tiny_rloo_config(
        tmp_path, algorithm=algorithm, **({} if kl_coef is None else {"kl_coef": kl_coef})
    )
    write_run_config(tmp_path, asdict(config))  # as the run records its settings
    records = [
        {
            "update": u,
            "episode": 8.0 * u,
            "objective/scores": 0.1 * u,
            "objective/kl": 0.2 * u,
            RLHF_METRIC: 0.1 * u,
        }
        for u in range(1, 4)
    ]
    metrics = tmp_path / METRICS_FILE
    metrics.write_text("".join(json.dumps(record) + "\n" for record in records))
    panels = [
        title
        for title, lines in logged_panels(records, run_settings_of(metrics))
        if lines[0][0] == RLHF_METRIC
    ]
    # Does the KL change the advantages (is it in the reward)?
    ref = torch.full((4, 2), -1.0)
    in_reward = not torch.equal(
        _advantages(config, ref), _advantages(config, ref - torch.arange(8.0).reshape(4, 2))
    )
    assert in_reward == (config.kl_placement == "reward" and config.kl_coef > 0)
    if config.kl_placement == "reward":
        assert panels == [f"RLHF reward = score − kl_coef·KL (KL in the reward, kl_coef={config.kl_coef:g})"]
    elif config.kl_coef > 0:
        assert panels == [
            f"score − β·KL (KL in the loss as β·k3 per token, β={config.kl_coef:g}; not the reward)"
        ]
    else:  # β = 0: no KL anywhere, the "RLHF reward" is the score, drawn already
        assert panels == []
    png = plot_training_curves(metrics, tmp_path / "curves.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_without_the_runs_settings_the_panel_does_not_claim_a_placement(tmp_path):
    records = [{"episode": 8.0, "objective/scores": 0.1, RLHF_METRIC: 0.1}]
    assert run_settings_of(tmp_path / METRICS_FILE) is None
    (title,) = [title for title, lines in logged_panels(records) if lines[0][0] == RLHF_METRIC]
    assert "kl_coef" not in title and "β" not in title and "reward =" not in title


def test_panel_titles_of_several_reward_sources_do_not_run_into_each_other():
    from marl.train.curves import pyplot, source_names, training_curves_figure

    names = ["length_of_the_completion", "politeness_of_the_reply", "accuracy_against_the_answer"]
    records = [
        {
            "episode": float(episode),
            "objective/scores": 1.0,
            "objective/kl": 0.1,
            "objective/zero_spread_groups": 0.2,
            **{f"rewards/{name}{suffix}": 0.5 for name in names for suffix in ("", "/mean", "/std")},
            **{f"advantage_share/{name}": 1 / 3 for name in names},
        }
        for episode in (8, 16)
    ]
    assert source_names(records) == names  # TRL's rewards/<name>/mean and /std are not sources
    figure = training_curves_figure(records)
    figure.canvas.draw()
    renderer = figure.canvas.get_renderer()
    visible = [axis for axis in figure.axes if axis.get_visible()]
    assert len(visible) == 7  # weighted sum, three sources, shares, KL, flat groups
    boxes = [axis.title.get_window_extent(renderer) for axis in visible]
    slot = figure.bbox.width / 4  # four panels a row
    for index, box in enumerate(boxes):
        assert box.width <= slot, visible[index].get_title()
        for other in boxes[index + 1 :]:
            assert not box.overlaps(other), visible[index].get_title()
    pyplot().close(figure)


def test_a_run_with_tools_draws_its_tool_calls_and_a_run_without_does_not():
    from marl.train.curves import pyplot, training_curves_figure

    plain = [{"episode": 8.0 * u, "objective/scores": 0.1 * u, "objective/kl": 0.1} for u in (1, 2)]
    tools = [
        {**record, "tools/call_frequency": 0.5 * u, "tools/failure_frequency": 0.25}
        for u, record in enumerate(plain, start=1)
    ]
    lines = {title: lines for title, lines in logged_panels(tools)}
    assert lines["tool calls (TRL's tools/* metrics)"] == (
        ("tools/call_frequency", "calls per completion"),
        ("tools/failure_frequency", "share that failed"),
    )
    assert not any(title.startswith("tool calls") for title, _ in logged_panels(plain))
    figure = training_curves_figure(tools)
    (axis,) = [axis for axis in figure.axes if axis.get_title().startswith("tool calls")]
    assert [list(line.get_ydata()) for line in axis.get_lines()] == [[0.5, 1.0], [0.25, 0.25]]
    pyplot().close(figure)
