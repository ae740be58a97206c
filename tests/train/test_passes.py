"""Only the passes the algorithm needs (marl.algo.scoring_passes): with a pass skipped, every preset's losses
and gradients are those of the same run with every pass forced on, its metrics the same up to float rounding,
and a count of the real forward calls shows which passes ran."""

from __future__ import annotations

import pytest
import torch

from marl.algo.scoring_passes import ALL_PASSES, ScoringPasses
from marl.config.algorithms import PRESETS

from support.runs import build, tiny_config

# (preset, overrides): every preset with its own defaults, and GRPO with beta in the loss
CASES = [(name, {}) for name in PRESETS] + [("grpo", {"kl_coef": 0.04})]
EXPECTED = {  # (policy pass, reference pass) under each case's own settings
    "rloo": ScoringPasses(True, True),
    "grpo": ScoringPasses(False, False),
    "dr_grpo": ScoringPasses(False, False),
    "dapo": ScoringPasses(False, False),
    "gspo": ScoringPasses(False, False),
    "reinforce_pp": ScoringPasses(True, True),
    "grpo+kl": ScoringPasses(False, True),
}


def case_id(preset: str, overrides: dict) -> str:
    return preset + ("+kl" if overrides else "")


def one_update(model_dir, output_dir, preset, overrides, forced: bool):
    """One update of ``preset`` (its own epochs and KL; 8 completions in 2 micro-batches of one mini-batch);
    returns the trainer, its history and the gradients of every optimizer step."""
    settings = dict(num_ppo_epochs=None, num_mini_batches=1, total_episodes=8, stop_token="eos")
    config = tiny_config(output_dir, algorithm=preset, **{**settings, **overrides})
    trainer = build(model_dir, config)
    if forced:
        trainer.parts.scorer.passes = ALL_PASSES
    update, gradients = trainer.parts.policy_update, []
    step = update.optimizer_step

    def recording_step(loss_finite):
        gradients.append([parameter.grad.detach().clone() for parameter in update.parameters])
        return step(loss_finite)

    update.optimizer_step = recording_step
    return trainer, trainer.train(), gradients


@pytest.mark.parametrize(("preset", "overrides"), CASES, ids=[case_id(*case) for case in CASES])
def test_skipping_a_pass_changes_no_loss_gradient_or_metric(tiny_llama_dir, tmp_path, preset, overrides):
    trainer, skipped, skipped_grads = one_update(tiny_llama_dir, tmp_path / "skip", preset, overrides, False)
    assert trainer.parts.scorer.passes == EXPECTED[case_id(preset, overrides)]
    _, forced, forced_grads = one_update(tiny_llama_dir, tmp_path / "forced", preset, overrides, True)
    assert len(skipped_grads) == len(forced_grads) == trainer.parts.sizes.optimizer_steps_per_update
    for skipped_step, forced_step in zip(skipped_grads, forced_grads, strict=True):
        for skipped_grad, forced_grad in zip(skipped_step, forced_step, strict=True):
            torch.testing.assert_close(skipped_grad, forced_grad, rtol=0, atol=1e-6)
    (skipped,), (forced,) = skipped, forced
    assert skipped["loss/policy_avg"] == pytest.approx(forced["loss/policy_avg"], abs=1e-6)
    assert skipped["val/ratio_first"] == pytest.approx(1.0, abs=1e-5)
    # what the metrics read of the skipped passes comes from the update's forward: the same numbers
    for name in (
        "objective/entropy",
        "objective/rlhf_reward",
        "objective/non_score_reward",
        "policy/entropy_avg",
    ):
        assert skipped[name] == pytest.approx(forced[name], rel=1e-5, abs=1e-5), name
    if trainer.parts.scorer.passes.reference:
        assert skipped["objective/kl"] == pytest.approx(forced["objective/kl"], abs=1e-5)
    else:  # no reference pass, no KL to report (as TRL logs none at beta = 0)
        assert "objective/kl" not in skipped and skipped["objective/non_score_reward"] == 0
        assert skipped["objective/rlhf_reward"] == skipped["objective/scores"]


def count_forwards(trainer, monkeypatch) -> list[tuple[str, bool]]:
    """``(what ran, with gradients)`` per real forward call of the base's decoder during ``trainer.train``:
    "sample" inside the sampler, "reference" with the adapters disabled, else the active adapter's name."""
    model, calls, sampling = trainer.model, [], []
    decoder = model.peft_model.get_base_model().model

    def record(module, args, kwargs):
        if sampling:
            what = "sample"
        elif model._adapters_disabled():
            what = "reference"
        else:
            what = model.peft_model.active_adapter
        calls.append((what, torch.is_grad_enabled()))

    decoder.register_forward_pre_hook(record, with_kwargs=True)
    sample = trainer.parts.sampler.sample

    def marked_sample(*args, **kwargs):
        sampling.append(True)
        try:
            return sample(*args, **kwargs)
        finally:
            sampling.clear()

    monkeypatch.setattr(trainer.parts.sampler, "sample", marked_sample)
    trainer.train()
    return calls


@pytest.mark.parametrize(
    ("preset", "overrides", "scoring"),
    [
        ("grpo", {}, []),
        ("grpo", {"kl_coef": 0.04}, ["reference"]),
        ("reinforce_pp", {}, ["policy", "reference"]),
    ],
)
def test_only_the_needed_forwards_run(tiny_llama_dir, tmp_path, monkeypatch, preset, overrides, scoring):
    settings = dict(num_ppo_epochs=None, num_mini_batches=1, total_episodes=8, stop_token="eos")
    trainer = build(tiny_llama_dir, tiny_config(tmp_path, algorithm=preset, **{**settings, **overrides}))
    policy = trainer.parts.policy
    calls = count_forwards(trainer, monkeypatch)
    assert any(what == "sample" for what, _ in calls)
    no_grad = [
        ("policy" if what == policy else what) for what, grad in calls if not grad and what != "sample"
    ]
    # one chunk of the rollout (8 rows, 64 per pass): each needed pass once, in order, nothing else
    assert no_grad == scoring
    update = [what for what, grad in calls if grad]
    assert update == [policy] * 2  # the update's 2 micro-batches, the only forwards with gradients
