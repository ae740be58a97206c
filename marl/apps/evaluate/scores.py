"""Evaluation's measurements: base and policy sample the same prompts, and each completion is scored.

For every prompt both the base (the reference view of the same loaded model: adapters disabled) and the policy
sample one completion with the same sampling settings and seeds, through training's default sampler (or the
registered one ``sampler`` names), so evaluation samples exactly as training does. Each completion gets

- the reward adapter's score of prompt + completion + EOS (the ``eos_adapter`` reward kind, see
  :class:`marl.rewards.adapter.EosTerminatedAdapterReward`),
- the judge's score of prompt + completion (VADER by default, independent of every model here; ``--judge
  module:function`` plugs in another),
- its length in tokens (up to and including the first EOS),
- for the policy, its KL to the reference: the sum over completion tokens of ``log p_policy − log p_ref``
  (temperature-scaled, as in training), whose mean estimates KL(policy ‖ reference).

The win rate pairs the two completions of each prompt: a higher judge score wins, a tie counts half. Reward
hacking shows up as a reward-adapter gain without a judge gain.

What is measured is printed as one table (:func:`results_table`) and written next to the policy adapter
(:func:`write_results`): ``eval_results.json`` holds the settings and the means (:func:`summarize`),
``eval_completions.jsonl`` every completion with its measurements, one prompt a line.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping, Sequence

    from transformers import PreTrainedTokenizerBase

    from marl.model.multi_adapter import MultiAdapterModel
    from marl.rewards import CheckedJudge


RESULTS_FILE = "eval_results.json"
COMPLETIONS_FILE = "eval_completions.jsonl"
JUDGE_NAMES = {"vader": "VADER"}  # how the table names a judge: the default one by what it is


@dataclass
class ModelScores:
    """Mean scores of one model's completions (``None`` where nothing was measured)."""

    reward_score: float | None
    judge_score: float
    length: float
    kl: float | None
    # Each reward source's mean by name (reward adapters, then reward functions), when several were asked for.
    reward_scores_by_name: dict[str, float] = field(default_factory=dict)


@dataclass
class Comparison:
    """Policy vs base under the judge, paired by prompt."""

    win_rate: float
    wins: int
    ties: int
    losses: int


def win_rate(policy_scores: list[float], base_scores: list[float]) -> Comparison:
    """Fraction of prompts where the policy's judge score beats the base's; a tie counts half.

    Example:
        >>> win_rate([0.9, 0.1, 0.5], [0.2, 0.3, 0.5])
        Comparison(win_rate=0.5, wins=1, ties=1, losses=1)
    """
    if len(policy_scores) != len(base_scores) or not policy_scores:
        raise ValueError(
            "win_rate needs the same, non-zero number of policy and base scores (one per prompt)"
        )
    wins = sum(p > b for p, b in zip(policy_scores, base_scores, strict=True))
    ties = sum(p == b for p, b in zip(policy_scores, base_scores, strict=True))
    losses = len(policy_scores) - wins - ties
    return Comparison((wins + 0.5 * ties) / len(policy_scores), wins, ties, losses)


@dataclass
class ScoredCompletions:
    """One model's completions for a list of prompts, with their measurements."""

    completions: list[str] = field(default_factory=list)
    reward_scores: list[float] = field(default_factory=list)
    judge_scores: list[float] = field(default_factory=list)
    lengths: list[int] = field(default_factory=list)
    kls: list[float] = field(default_factory=list)
    # Every reward adapter's scores by name, when more than the first was asked for (``reward_names``).
    reward_scores_by_name: dict[str, list[float]] = field(default_factory=dict)

    def means(self) -> ModelScores:
        return ModelScores(
            reward_score=_nanmean(self.reward_scores) if self.reward_scores else None,
            judge_score=_mean(self.judge_scores),
            length=_mean(self.lengths),
            kl=_mean(self.kls) if self.kls else None,
            reward_scores_by_name={
                name: _nanmean(values) for name, values in self.reward_scores_by_name.items()
            },
        )


def _mean(values: list[float] | list[int]) -> float:
    return float(sum(values) / len(values))


def _nanmean(values: list[float]) -> float | None:
    """The mean of the judged scores (a reward function's ``None`` is NaN), ``None`` if none was judged."""
    judged = [value for value in values if not math.isnan(value)]
    return _mean(judged) if judged else None


def generate_and_score(
    model: MultiAdapterModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: list[Any],
    judge: CheckedJudge,
    *,
    with_policy: bool = True,
    response_length: int = 53,
    temperature: float = 0.7,
    batch_size: int = 32,
    seed: int = 0,
    progress: bool = True,
    stop_at_eos: bool = True,
    policy: str | None = None,
    after_batch: Callable[[], Any] | None = None,
    sampler: str | None = None,
    reward_names: Sequence[str] | None = None,
    reward_functions: Sequence[str] = (),
    columns: Sequence[Mapping[str, Any]] | None = None,
    policies: Sequence[str] | None = None,
) -> dict[str, ScoredCompletions]:
    """Sample and measure completions of the base (``"base"``, adapters disabled) and, if ``with_policy``, of
    policy ``policy`` (default: the model's first policy), keyed ``"policy"``, and of its starting adapter
    (``"reference"``) when that is its KL reference. ``after_batch`` is called after every batch
    (e.g. a :class:`marl.cpu.threads.FreeCoreThreads`). ``sampler`` names a registered sampler (default: the
    one training uses by default on the model's device, :func:`marl.config.device.device_sampler`).
    ``reward_names``: the reward adapters that score each completion (default: the model's first);
    ``reward_functions``: ``module:function`` specs of reward functions, called as in training
    (:mod:`marl.rewards.trl_calls`) with ``columns`` (each prompt's other dataset columns) and a fresh
    ``transformers.TrainerState``. The first source fills ``reward_scores``; with ``reward_names`` or a reward
    function, each source fills its entry of ``reward_scores_by_name``.

    ``policies``: several policies of the model, each sampled and measured as the one policy is, keyed by its
    name (instead of ``"policy"``), the base sampled once for all of them (instead of ``policy`` and
    ``with_policy``). Every model sees the same prompts in the same batches with the same seed per batch, so
    a policy's completions are those it gets evaluated alone.

    Example:
        >>> from marl.rewards import load_judge
        >>> samples = generate_and_score(model, tokenizer, ["A film"], load_judge(None))  # doctest: +SKIP
        >>> samples["policy"].means().judge_score  # doctest: +SKIP
    """
    import torch
    from tqdm.auto import tqdm
    from transformers import TrainerState

    from marl.algo.tensors import masked_sum
    from marl.config.device import device_sampler
    from marl.data.prompts import prepare_text_prompts, prompt_text
    from marl.model.adapters import BASE_VIEW, REFERENCE_VIEW
    from marl.rewards import RewardParts, RewardSetting, plan_rewards
    from marl.rollout.samplers import SamplerSettings, get_sampler
    from marl.rollout.scoring import Scorer

    if policies is not None:
        if policy is not None or not with_policy or not policies:
            raise ValueError("pass policies=[names] (one or more) alone: not with policy= or with_policy=")
        if "base" in policies or len(set(policies)) != len(policies):
            raise ValueError(f"policies {list(policies)}: each name once, and none named 'base'")
    make_sampler = get_sampler(sampler or device_sampler(model.device.type))

    def sampler_of(name: str | None):
        # Without a stop token the completions run to the length limit, as in an RLOO run without stop_token.
        settings = SamplerSettings(
            temperature=temperature,
            response_length=response_length,
            stop_at_eos=stop_at_eos,
            rows_per_pass=batch_size,
            policy=name,
        )
        return make_sampler(model, tokenizer, settings)

    def scorer_of(name: str | None) -> Scorer:
        return Scorer(model, tokenizer, temperature=temperature, rows_per_pass=batch_size, policy=name)

    prepared = prepare_text_prompts(
        prompts,
        tokenizer,
        "evaluation prompts",
        model=model,
        response_length=response_length,
        columns=columns,
    )
    # The model's first reward adapter (if any) reads each text ending in EOS, as the shipped one was trained.
    names = list(model.rewards)[:1] if reward_names is None else list(reward_names)
    settings = [RewardSetting("eos_adapter", name) for name in names]
    settings += [RewardSetting("function", spec) for spec in reward_functions]
    names += list(reward_functions)
    by_name = reward_names is not None or bool(reward_functions)
    rewards = plan_rewards(settings).build(RewardParts(model, tokenizer, batch_size))
    # What is measured: result key -> (view, the policy whose sampler and scorer serve it).
    if policies is None:
        views = {"base": (BASE_VIEW, policy)}
        if with_policy and model.get_policy(policy).reference_adapter is not None:
            # A policy whose reference is its starting adapter is also measured against that start.
            views["reference"] = (REFERENCE_VIEW, policy)
        if with_policy:
            views["policy"] = ("policy", policy)
    else:
        views = {"base": (BASE_VIEW, policies[0]), **{name: ("policy", name) for name in policies}}
    samplers = {serving: sampler_of(serving) for _, serving in views.values()}
    scorers = {serving: scorer_of(serving) for _, serving in views.values()}
    results = {name: ScoredCompletions() for name in views}
    starts = range(0, len(prompts), batch_size)
    for batch_index, start in enumerate(tqdm(starts, desc="evaluating", unit="batch", disable=not progress)):
        raw_prompts = prompts[start : start + batch_size]
        chunk = prepared[start : start + batch_size]
        batches = {serving: sampler.batch(chunk) for serving, sampler in samplers.items()}
        for name, (view, serving) in views.items():
            torch.manual_seed(seed + batch_index)
            # The base is a view of the same model (adapters disabled), not a second copy.
            samples = samplers[serving].sample(batches[serving], k=1, view=view)
            record = results[name]
            record.completions.extend(samples.completions)
            record.judge_scores.extend(
                judge([prompt_text(p) + c for p, c in zip(raw_prompts, samples.completions, strict=True)])
            )
            record.lengths.extend(int(n) for n in samples.lengths.tolist())
            scoring = scorers[serving].scoring_batch(samples, TrainerState())
            for index, (reward_name, reward) in enumerate(zip(names, rewards, strict=True)):
                scores = reward.score(scoring).tolist()
                if index == 0:
                    record.reward_scores.extend(scores)
                if by_name:
                    record.reward_scores_by_name.setdefault(reward_name, []).extend(scores)
            if view == "policy":
                logprobs, ref_logprobs = scorers[serving].logprobs(samples)
                record.kls.extend(masked_sum(logprobs - ref_logprobs, samples.response_mask).tolist())
        if after_batch is not None:
            after_batch()
    return results


def summarize(samples: dict[str, ScoredCompletions]) -> dict[str, Any]:
    """Means per model and, with a policy, the judge win rate of the policy over the base; with the policy's
    starting adapter (``"reference"``), also that start's win rate over the base and the policy's over it.

    Example:
        >>> summary = summarize(samples)  # doctest: +SKIP
        >>> summary["comparison"]["win_rate"]  # doctest: +SKIP
    """
    summary: dict[str, Any] = {name: asdict(record.means()) for name, record in samples.items()}
    if "policy" in samples:
        comparison = win_rate(samples["policy"].judge_scores, samples["base"].judge_scores)
        summary["comparison"] = asdict(comparison)
    if "reference" in samples:
        reference = samples["reference"].judge_scores
        summary["reference_comparison"] = asdict(win_rate(reference, samples["base"].judge_scores))
        summary["comparison_to_reference"] = asdict(win_rate(samples["policy"].judge_scores, reference))
    return summary


def results_table(
    summary: dict[str, Any], title: str = "Evaluation on held-out prompts", judge: str = "vader"
):
    """A rich table of :func:`summarize`'s output: one row per model. ``judge``
    names the judge in the column titles (``"vader"``: VADER sentiment, the default; else its
    ``module:function``);
    with several reward sources, each gets a column of its own."""
    from rich.table import Table

    def show(value: float | None, digits: int = 3) -> str:
        return (
            "—"
            if value is None or (isinstance(value, float) and math.isnan(value))
            else f"{value:.{digits}f}"
        )

    table = Table(title=title)
    judge_name = JUDGE_NAMES.get(judge, judge)
    by_name = list(next(iter(summary.values())).get("reward_scores_by_name") or {})
    reward_columns = [f"reward: {name}" for name in by_name] or ["reward-adapter score"]
    for column in (
        "model",
        *reward_columns,
        f"judge score ({judge_name})",
        f"{judge_name} win rate vs base",
        "KL to ref",
        "length",
    ):
        table.add_column(column, justify="left" if column == "model" else "right")
    # The policy's starting adapter, when it is the policy's reference, sits between the two.
    comparisons = {"reference": "reference_comparison", "policy": "comparison"}
    for name in ("base", "reference", "policy"):
        if name not in summary:
            continue
        scores = summary[name]
        win = "—"
        if name in comparisons:
            comparison = summary[comparisons[name]]
            win = (
                f"{comparison['win_rate']:.1%} ({comparison['wins']}W {comparison['ties']}T "
                f"{comparison['losses']}L)"
            )
        kl = scores["kl"] if name == "policy" else None
        rewards = [scores["reward_scores_by_name"][name] for name in by_name] or [scores["reward_score"]]
        table.add_row(
            "reference (the policy's start)" if name == "reference" else name,
            *(show(value) for value in rewards),
            show(scores["judge_score"]),
            win,
            show(kl),
            show(scores["length"], 1),
        )
    return table


def write_results(
    output_dir: str | Path,
    summary: dict[str, Any],
    samples: dict[str, ScoredCompletions],
    prompts: list[Any],
    settings: dict[str, Any],
) -> Path:
    """Write ``eval_results.json`` (settings + summary) and ``eval_completions.jsonl`` (every completion)."""
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    results_path = output_dir / RESULTS_FILE
    results_path.write_text(json.dumps({"settings": settings, **summary}, indent=2) + "\n")
    with (output_dir / COMPLETIONS_FILE).open("w") as handle:
        for index, prompt in enumerate(prompts):
            row: dict[str, Any] = {"prompt": prompt}
            for name, record in samples.items():
                row[name] = {
                    "completion": record.completions[index],
                    "judge_score": record.judge_scores[index],
                    "reward_score": record.reward_scores[index] if record.reward_scores else None,
                    **(
                        {"reward_scores": {n: v[index] for n, v in record.reward_scores_by_name.items()}}
                        if record.reward_scores_by_name
                        else {}
                    ),
                    "length": record.lengths[index],
                    **({"kl": record.kls[index]} if record.kls else {}),
                }
            handle.write(json.dumps(row) + "\n")
    return results_path
