"""The log-prob each token was drawn with, as the ``static`` and ``graph`` samplers keep it, is the one the
scorer computes for the policy (every family of the table, fp32), so the logged gap
(``sampling/sampling_logp_difference/*``, TRL 1.16's names) is zero up to rounding; a sampler in another
precision shows a gap; the trainer logs it per update, and not for ``generate``, which keeps none."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest
import torch
from test_samplers import PROMPT_ROWS, TEMPERATURE, load
from transformers import AutoTokenizer

from marl.algo.metrics import SAMPLER_GAP_MAX, SAMPLER_GAP_MEAN, sampler_gap, sampler_gap_metrics
from marl.data.prompts import Prompt
from marl.rollout.samplers import SamplerSettings, get_sampler
from marl.rollout.scoring import Scorer

from support.families import FAMILIES, logprob_tolerance
from support.runs import build, tiny_config

KEEPING = ("static", "graph")


def sample_and_score(model, tokenizer, name: str, autocast=contextlib.nullcontext):
    settings = SamplerSettings(TEMPERATURE, 10, rows_per_pass=4, autocast=autocast)
    sampler = get_sampler(name)(model, tokenizer, settings)
    torch.manual_seed(0)
    samples = sampler.sample(sampler.batch([Prompt(tuple(row), "p") for row in PROMPT_ROWS]), 2)
    scorer = Scorer(model, tokenizer, temperature=TEMPERATURE, rows_per_pass=4)
    return samples, scorer.logprobs(samples)[0]


@pytest.mark.parametrize("name", KEEPING)
@pytest.mark.parametrize("family", [name for name in FAMILIES if name != "falcon_h1"])
def test_the_kept_logprobs_are_the_scorers_on_every_family(family, name, family_dir):
    model = load(family_dir, family)
    tokenizer = AutoTokenizer.from_pretrained(family_dir(family))
    samples, scored = sample_and_score(model, tokenizer, name)
    assert samples.sampled_logprobs.shape == samples.response_ids.shape
    assert samples.sampled_logprobs.dtype == torch.float32
    gap = sampler_gap(samples.sampled_logprobs, scored, samples.response_mask)
    assert gap.numel() == int(samples.response_mask.sum()) > 0
    assert float(gap.max()) < 10 * logprob_tolerance(torch.float32), float(gap.max())


def test_a_sampler_in_bf16_shows_a_gap_and_generate_keeps_none(family_dir):
    model = load(family_dir, "llama")
    tokenizer = AutoTokenizer.from_pretrained(family_dir("llama"))
    bf16 = lambda: torch.autocast("cpu", dtype=torch.bfloat16)  # noqa: E731
    samples, scored = sample_and_score(model, tokenizer, "static", autocast=bf16)
    gap = sampler_gap(samples.sampled_logprobs, scored, samples.response_mask)
    assert float(gap.mean()) > 1e-3  # bf16 logits: about eps of their scale
    assert float(gap.max()) < 1.0  # the same distribution, rounded
    samples, _ = sample_and_score(model, tokenizer, "transformers")
    assert samples.sampled_logprobs is None


def test_the_metrics_are_the_mean_and_max_over_every_process():
    rollout = SimpleNamespace(
        sampled_logprobs=torch.tensor([[-1.0, -2.0, -3.0], [-1.0, -1.0, -1.0]]),
        logprobs=torch.tensor([[-1.1, -2.0, -9.0], [-1.3, -1.0, -1.0]]),
        response_mask=torch.tensor([[1, 1, 0], [1, 1, 1]]),
    )
    one = SimpleNamespace(sum_over_processes=lambda record: record, gather=lambda tensor: tensor)
    metrics = sampler_gap_metrics(rollout, one)
    assert metrics[SAMPLER_GAP_MEAN] == pytest.approx(0.4 / 5)
    assert metrics[SAMPLER_GAP_MAX] == pytest.approx(0.3)
    # another process whose largest gap is 2: the max is over all processes
    two = SimpleNamespace(
        sum_over_processes=lambda record: type(record)(record.total * 2, record.tokens * 2),
        gather=lambda tensor: torch.cat([tensor, torch.tensor([2.0])]),
    )
    assert sampler_gap_metrics(rollout, two)[SAMPLER_GAP_MAX] == 2.0
    assert sampler_gap_metrics(SimpleNamespace(sampled_logprobs=None, logprobs=None), one) == {}


@pytest.mark.parametrize("sampler", ["static", "transformers"])
def test_the_trainer_logs_the_gap_per_update(sampler, tiny_llama_dir, tmp_path):
    config = tiny_config(tmp_path, sampler=sampler, total_episodes=16, num_ppo_epochs=1, num_mini_batches=1)
    history = build(tiny_llama_dir, config).train()
    assert len(history) == 2
    for record in history:
        if sampler == "transformers":
            assert SAMPLER_GAP_MEAN not in record
        else:
            assert 0 <= record[SAMPLER_GAP_MEAN] <= record[SAMPLER_GAP_MAX] < 1e-4
