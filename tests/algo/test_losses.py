"""The sampler correction (TRL 1.16's importance-sampling correction of vLLM samples) against TRL's own code.

The ratio: TRL computes it inside ``GRPOTrainer._generate_and_score_completions``, only with ``use_vllm``.
vLLM is not installed here, so a ``GRPOTrainer`` is built without it and, on that instance only,
``use_vllm`` is set, ``_generate`` returns fixed completions with fixed sampler log-probs (what vLLM would
return), ``_get_per_token_logps_and_entropies`` returns fixed trainer log-probs and ``_calculate_rewards``
fixed rewards: the ratio, its masking and bounding, and its three metrics are TRL's code. marl's
:func:`sampler_importance_ratio` must give the same ratio and :func:`selection.sampler_correction_metrics`
the same metrics, for each of the four modes.

The loss: TRL's ``_compute_loss`` with ``use_vllm`` set on the instance and the ratio in its inputs, as the
other loss parity tests (``test_trl_parity.py``) run it, against :func:`token_policy_loss` with
``sampler_ratio``: loss and gradient within 1e-6.
"""

from __future__ import annotations

import itertools
import warnings
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from marl.algo.losses import LossSettings, sampler_importance_ratio, token_policy_loss
from marl.algo.metrics import RATIO_MAX, RATIO_MEAN, RATIO_MIN, sampler_correction_metrics
from marl.config import RLOOConfig
from marl.config.sampler_correction import SAMPLER_CORRECTION_MODES
from marl.errors import ConfigError
from tests.algo.test_trl_parity import LENGTH, ROWS, TOLERANCE, build_trainer, loss_inputs, trl_loss

BOUNDS = [(None, 3.0), (0.5, 2.0)]


def one_process() -> SimpleNamespace:
    return SimpleNamespace(sum_over_processes=lambda stats: stats)


def sampling_inputs(seed: int):
    """Trainer and sampler log-probs that disagree by about 0.8 nat per token (some ratios beyond every
    bound), and completion lengths of 1 to 5 tokens."""
    generator = torch.Generator().manual_seed(seed)
    trainer = -torch.rand(ROWS, LENGTH, generator=generator) * 3
    sampled = trainer + 0.8 * torch.randn(ROWS, LENGTH, generator=generator)
    lengths = [5, 3, 1, 2, 4, 5]
    return trainer, sampled, lengths


def trl_ratio_and_metrics(trainer, trainer_logprobs, sampled_logprobs, lengths):
    """TRL's ``_generate_and_score_completions`` with vLLM's outputs stood in for (see the module docstring):
    its ``importance_sampling_ratio`` and its ``sampling/importance_sampling_ratio/*`` metrics."""
    prompts = ["a b", "c d", "e f"]
    trainer.use_vllm = True  # the correction runs only with vLLM: its outputs are given below
    completion_ids = [[5 + (row % 7)] * length for row, length in enumerate(lengths)]
    sampled = [sampled_logprobs[row, :length].tolist() for row, length in enumerate(lengths)]

    def generate(prompt_texts):
        prompt_ids = [[1, 2] for _ in prompt_texts]
        texts = ["x" * length for length in lengths]
        return prompt_ids, completion_ids, None, texts, sampled, {}, None, None

    trainer._generate = generate
    scored = (trainer_logprobs.clone(), None, None)
    trainer._get_per_token_logps_and_entropies = lambda *args, **kwargs: scored
    trainer._calculate_rewards = lambda *args, **kwargs: torch.randn(ROWS, 1)
    trainer._metrics["train"].clear()
    trainer.model.train()
    inputs = [{"prompt": text} for text in prompts for _ in range(ROWS // len(prompts))]
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        output = trainer._generate_and_score_completions(inputs)
    metrics = {name: values[-1] for name, values in trainer._metrics["train"].items()}
    return output["importance_sampling_ratio"], metrics, output["completion_mask"].bool()


@pytest.mark.parametrize(("mode", "bounds"), list(itertools.product(SAMPLER_CORRECTION_MODES, BOUNDS)))
def test_ratio_and_metrics_equal_trl_grpo_trainer(tiny_llama_dir, tmp_path, mode, bounds):
    low, high = bounds
    trainer = build_trainer(
        "grpo",
        tiny_llama_dir,
        tmp_path,
        vllm_importance_sampling_mode=mode,
        vllm_importance_sampling_clip_min=low,
        vllm_importance_sampling_clip_max=high,
    )
    config = RLOOConfig(
        algorithm="grpo",
        vllm_importance_sampling_correction=True,
        vllm_importance_sampling_mode=mode,
        vllm_importance_sampling_clip_min=low,
        vllm_importance_sampling_clip_max=high,
    )
    loss_settings = LossSettings.from_config(config)
    bounded = torch.zeros((), dtype=torch.bool)
    for seed in range(3):
        trainer_logprobs, sampled_logprobs, lengths = sampling_inputs(seed)
        expected, trl_metrics, mask = trl_ratio_and_metrics(
            trainer, trainer_logprobs, sampled_logprobs, lengths
        )
        ours = sampler_importance_ratio(trainer_logprobs, sampled_logprobs, mask, mode, low, high)
        assert ours.shape == expected.shape
        assert torch.allclose(ours, expected, atol=TOLERANCE, rtol=0)
        rollout = SimpleNamespace(
            logprobs=trainer_logprobs,
            sampled_logprobs=sampled_logprobs,
            response_mask=mask,
            contains_stop=torch.ones(ROWS, dtype=torch.bool),
        )
        metrics = sampler_correction_metrics(rollout, loss_settings, one_process())
        for name in (RATIO_MIN, RATIO_MEAN, RATIO_MAX):
            assert metrics[name] == pytest.approx(trl_metrics[name], abs=1e-6)
        bounded |= ((expected == 0) | (expected == high) | (expected == (low or 0.0))).any()
        assert (expected != 1).any()
    assert bounded  # the comparison covered the bounding or masking, not only exp


LOSS_CASES = [
    (mode, loss_type, beta)
    for mode, loss_type, beta in itertools.product(SAMPLER_CORRECTION_MODES, ("grpo", "dapo"), (0.0, 0.04))
]


@pytest.mark.parametrize(("mode", "loss_type", "beta"), LOSS_CASES)
def test_corrected_loss_equals_trl_grpo_trainer(tiny_llama_dir, tmp_path, mode, loss_type, beta):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        settings = dict(loss_type=loss_type, beta=beta, vllm_importance_sampling_mode=mode)
        trainer = build_trainer("grpo", tiny_llama_dir, tmp_path, **settings)
    trainer.use_vllm = True  # _compute_loss applies inputs["importance_sampling_ratio"] only with vLLM
    for seed in range(3):
        new, old, ref, advantages, mask = loss_inputs(seed)
        sampled = old + 0.3 * torch.randn(old.shape, generator=torch.Generator().manual_seed(seed))
        ratio = sampler_importance_ratio(old, sampled, mask, mode, None, 3.0)
        expected_loss, expected_grad = trl_loss(
            trainer, new, old, ref, advantages, mask, "grpo", importance_sampling_ratio=ratio
        )
        leaf = new.clone().requires_grad_(True)
        ours = token_policy_loss(
            leaf,
            old,
            advantages,
            mask,
            loss_type=loss_type,
            epsilon=0.2,
            ref_logprobs=ref,
            beta=beta,
            max_completion_length=LENGTH,
            num_items=mask.sum(),
            sampler_ratio=ratio,
        )
        ours.loss.backward()
        assert abs(ours.loss.item() - expected_loss.item()) <= TOLERANCE
        assert torch.allclose(leaf.grad, expected_grad, atol=TOLERANCE, rtol=0)
        # the ratio changes the loss: without it the gradient differs
        plain = new.clone().requires_grad_(True)
        token_policy_loss(
            plain, old, advantages, mask, loss_type=loss_type, epsilon=0.2, ref_logprobs=ref, beta=beta,
            max_completion_length=LENGTH, num_items=mask.sum(),
        ).loss.backward()  # fmt: skip
        assert not torch.allclose(plain.grad, expected_grad, atol=TOLERANCE, rtol=0)


log_probs = st.lists(st.floats(-8.0, 0.0), min_size=6, max_size=6)


@settings(max_examples=60, deadline=None)
@given(trainer=log_probs, sampled=log_probs, valid=st.lists(st.booleans(), min_size=6, max_size=6))
def test_ratio_properties(trainer, sampled, valid):
    trainer_logprobs, sampled_logprobs = torch.tensor([trainer]), torch.tensor([sampled])
    mask = torch.tensor([valid])
    for mode in SAMPLER_CORRECTION_MODES:
        ratio = sampler_importance_ratio(trainer_logprobs, sampled_logprobs, mask, mode, 0.5, 2.0)
        assert ratio.shape == ((1, 1) if mode.startswith("sequence") else (1, 6))
        if mode.endswith("truncate"):
            assert ((ratio >= 0.5) & (ratio <= 2.0)).all()
        else:
            assert ((ratio == 0) | ((ratio >= 0.5) & (ratio <= 2.0))).all()
        # what lies outside the mask never changes the ratio
        moved = torch.where(mask, sampled_logprobs, sampled_logprobs - 5.0)
        assert torch.equal(ratio, sampler_importance_ratio(trainer_logprobs, moved, mask, mode, 0.5, 2.0))
        # a sampler that agrees with the trainer: ratio 1 on every token and completion
        same = sampler_importance_ratio(trainer_logprobs, trainer_logprobs, mask, mode, 0.5, 2.0)
        assert torch.equal(same, torch.ones_like(same))


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        (dict(vllm_importance_sampling_mode="token"), "is not one of"),
        (dict(vllm_importance_sampling_clip_min=3.0), "is not below"),
        (
            dict(vllm_importance_sampling_mode="token_truncate", vllm_importance_sampling_clip_max=None),
            "neither bound is set",
        ),
        (dict(algorithm="rloo"), "loss_type='sequence'"),
    ],
)
def test_bad_settings_are_one_line_errors(settings, message):
    with pytest.raises(ConfigError, match=message) as raised:
        RLOOConfig(**({"algorithm": "grpo", "vllm_importance_sampling_correction": True} | settings))
    assert "\n" not in str(raised.value)


def test_sampler_without_logprobs_is_refused_before_model_work():
    from marl.train.training_parts import check_components

    check_components(RLOOConfig(algorithm="grpo", vllm_importance_sampling_correction=True, sampler="graph"))
    with pytest.raises(ConfigError, match="--sampler 'transformers' keeps none"):
        check_components(
            RLOOConfig(algorithm="grpo", vllm_importance_sampling_correction=True, sampler="transformers")
        )


def test_correction_is_off_by_default_and_changes_nothing_then():
    config = RLOOConfig(algorithm="grpo")
    assert not config.vllm_importance_sampling_correction
    assert LossSettings.from_config(config).sampler_correction is None
