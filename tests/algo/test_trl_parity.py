"""marl's estimators and losses against TRL 1.16's own code, not a re-derivation.

Losses: for every ``loss_type`` × ``importance_sampling_level`` × ``beta`` (0 or not, with and without
``use_bias_correction_kl``) × ``epsilon_high`` that TRL 1.16's ``GRPOTrainer`` offers and marl implements, a
``GRPOTrainer`` is built with those settings on the tiny saved model and its ``_compute_loss`` runs on fixed
inputs. Its per-token log-prob method is replaced **on that instance** by one that returns our tensors (which
require grad): everything after that call is TRL's loss code under test. The trainer is in eval mode (it was
never trained), so TRL divides by no gradient-accumulation count, as marl's loss functions do not (marl's
update divides every loss by its accumulation steps). marl's functions get the same tensors; loss and gradient
with respect to the log-probs must agree within 1e-6 in float32.

Advantages: TRL's ``_generate_and_score_completions`` runs (real generation on the tiny model) with its
``_calculate_rewards`` replaced on the instance by our reward table (NaN where unjudged); its advantages are
compared with marl's ``grpo`` estimator for each ``scale_rewards``, after turning TRL's prompt-major rows into
marl's k-major rows. TRL 1.16's ``RLOOTrainer._compute_loss`` (sequence ratio, asymmetric clip) is compared
the same way with marl's sequence loss.
"""

from __future__ import annotations

import itertools
import math
import warnings

import pytest
import torch
from datasets import Dataset

from marl.algo.advantages import configured_estimator
from marl.algo.losses import TOKEN_LOSS_TYPES, clipped_policy_loss, token_policy_loss
from marl.algo.tensors import masked_sum

trl = pytest.importorskip("trl")
if trl.__version__ != "1.16.0":  # the parity is pinned to the version "Coming from TRL" names
    pytest.skip(f"parity pinned to TRL 1.16.0, found {trl.__version__}", allow_module_level=True)

ROWS, LENGTH, K = 6, 5, 2
TOLERANCE = 1e-6


def zero_reward(completions, **_):
    return [0.0] * len(completions)


def build_trainer(kind: str, model_dir, tmp_path, **settings):
    """A TRL 1.16 GRPOTrainer / RLOOTrainer with ``settings`` on the tiny model (CPU, no logging)."""
    from trl import GRPOConfig, GRPOTrainer, RLOOConfig, RLOOTrainer

    config_class, trainer_class = (GRPOConfig, GRPOTrainer) if kind == "grpo" else (RLOOConfig, RLOOTrainer)
    defaults = dict(per_device_train_batch_size=ROWS, num_generations=K, max_completion_length=LENGTH)
    settings = defaults | settings
    args = config_class(output_dir=str(tmp_path / kind), report_to="none", use_cpu=True, **settings)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return trainer_class(
            model=str(model_dir),
            reward_funcs=zero_reward,
            args=args,
            train_dataset=Dataset.from_dict({"prompt": ["a b", "c d", "e f"]}),
        )


def loss_inputs(seed: int):
    """Per-token log-probs (new, old, reference), advantages and a mask with a fully masked row (what
    ``mask_truncated_completions`` leaves of a truncated completion) and rows of different lengths."""
    generator = torch.Generator().manual_seed(seed)
    new = -torch.rand(ROWS, LENGTH, generator=generator) * 3
    old = new + 0.4 * torch.randn(ROWS, LENGTH, generator=generator)  # ratios well outside [0.8, 1.28]
    ref = new + 0.5 * torch.randn(ROWS, LENGTH, generator=generator)
    advantages = torch.randn(ROWS, generator=generator)
    lengths = torch.tensor([5, 3, 1, 0, 4, 2])
    mask = torch.arange(LENGTH).unsqueeze(0) < lengths.unsqueeze(1)
    return new, old, ref, advantages, mask


def trl_loss(trainer, new, old, ref, advantages, mask, kind, **extra_inputs):
    """TRL's ``_compute_loss``, its per-token log-prob method returning ``new`` (a leaf that needs grad);
    ``extra_inputs`` join its inputs (the sampler correction's ``importance_sampling_ratio``)."""
    leaf = new.clone().requires_grad_(True)
    trainer._get_per_token_logps_and_entropies = lambda *args, **kwargs: (leaf, torch.zeros_like(leaf), None)
    ids = torch.ones(ROWS, LENGTH, dtype=torch.long)
    inputs = {
        "prompt_ids": ids[:, :2],
        "prompt_mask": torch.ones(ROWS, 2, dtype=torch.long),
        "completion_ids": ids,
        "completion_mask": mask.long(),
        "advantages": advantages,
        "num_items_in_batch": mask.sum(),
    }
    if kind == "grpo":
        inputs.update(old_per_token_logps=old, ref_per_token_logps=ref)
    else:  # TRL's RLOO keeps the summed old log-prob per completion
        inputs["old_logps"] = (old * mask).sum(dim=1)
    inputs.update(extra_inputs)
    trainer.model.eval()
    loss = trainer._compute_loss(trainer.model, inputs)
    loss.backward()
    return loss.detach(), leaf.grad


LOSS_COMBINATIONS = [
    (loss_type, level, beta, bias, high)
    for loss_type, level, (beta, bias), high in itertools.product(
        TOKEN_LOSS_TYPES, ("token", "sequence"), ((0.0, True), (0.04, True), (0.04, False)), (None, 0.28)
    )
]


@pytest.mark.parametrize(("loss_type", "level", "beta", "bias_correction", "epsilon_high"), LOSS_COMBINATIONS)
def test_token_losses_equal_trl_grpo_trainer(
    tiny_llama_dir, tmp_path, loss_type, level, beta, bias_correction, epsilon_high
):
    settings = dict(
        loss_type=loss_type,
        importance_sampling_level=level,
        beta=beta,
        use_bias_correction_kl=bias_correction,
        epsilon=0.2,
        epsilon_high=epsilon_high,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = build_trainer("grpo", tiny_llama_dir, tmp_path, **settings)
    for seed in range(3):
        new, old, ref, advantages, mask = loss_inputs(seed)
        expected_loss, expected_grad = trl_loss(trainer, new, old, ref, advantages, mask, "grpo")
        leaf = new.clone().requires_grad_(True)
        ours = token_policy_loss(
            leaf,
            old,
            advantages,
            mask,
            loss_type=loss_type,
            epsilon=0.2,
            epsilon_high=epsilon_high,
            importance_sampling_level=level,
            ref_logprobs=ref,
            beta=beta,
            bias_correction_kl=bias_correction,
            max_completion_length=LENGTH,
            num_items=mask.sum(),
        )
        ours.loss.backward()
        assert abs(ours.loss.item() - expected_loss.item()) <= TOLERANCE
        assert torch.allclose(leaf.grad, expected_grad, atol=TOLERANCE, rtol=0)
        assert leaf.grad.abs().sum() > 0  # the comparison has something to compare


@pytest.mark.parametrize("epsilon_high", [None, 0.28])
def test_sequence_loss_equals_trl_rloo_trainer(tiny_llama_dir, tmp_path, epsilon_high):
    trainer = build_trainer("rloo", tiny_llama_dir, tmp_path, beta=0.0, epsilon_high=epsilon_high)
    for seed in range(3):
        new, old, ref, advantages, mask = loss_inputs(seed)
        new, old = new / 4, old / 4  # keep some summed ratios inside the clip range
        expected_loss, expected_grad = trl_loss(trainer, new, old, ref, advantages, mask, "rloo")
        leaf = new.clone().requires_grad_(True)
        ours = clipped_policy_loss(
            masked_sum(leaf, mask), masked_sum(old, mask), advantages, 0.2, epsilon_high
        )
        ours.loss.backward()
        assert abs(ours.loss.item() - expected_loss.item()) <= TOLERANCE
        assert torch.allclose(leaf.grad, expected_grad, atol=TOLERANCE, rtol=0)


def prompt_major_to_k_major(values: torch.Tensor, k: int) -> torch.Tensor:
    """TRL's row ``i * k + j`` (sample j of prompt i) to marl's row ``j * P + i``."""
    return values.view(-1, k).t().reshape(-1)


@pytest.mark.parametrize("scale_rewards", ["group", "batch", "none"])
def test_grpo_advantages_equal_trl_grpo_trainer(tiny_llama_dir, tmp_path, scale_rewards):
    k, prompts = 4, 3
    trainer = build_trainer(
        "grpo",
        tiny_llama_dir,
        tmp_path,
        scale_rewards=scale_rewards,
        num_generations=k,
        per_device_train_batch_size=k * prompts,
    )
    generator = torch.Generator().manual_seed(7)
    rewards = torch.randn(prompts * k, 1, generator=generator)  # TRL's prompt-major rows, one reward function
    rewards[[1, 2, 3, 5]] = math.nan  # prompt 0: one judged sample, prompt 1: three
    trainer._calculate_rewards = lambda *args, **kwargs: rewards.clone()
    inputs = [{"prompt": text} for text in ("a b", "c d", "e f") for _ in range(k)]
    with torch.no_grad():
        expected = trainer._generate_and_score_completions(inputs)["advantages"]
    k_major = prompt_major_to_k_major(rewards[:, 0], k)
    ours = configured_estimator("grpo", scale_rewards)(k_major, ~k_major.isnan(), k, None)
    assert torch.allclose(ours, prompt_major_to_k_major(expected, k), atol=TOLERANCE, rtol=0)
    assert ours.abs().sum() > 0
