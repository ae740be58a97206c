"""RLOO metrics: per-process sums kept in typed records, summed over processes in one collective (by the run's
:class:`marl.train.parallel.Parallelism`), then turned into the logged means.

Sums run over valid completion tokens only (up to and including the stop token, never padding), and every
mean is taken after the sums of all processes are added, so it is the mean over the whole batch.

A completion that no reward source judged has no reward: ``objective/scores``, ``objective/rlhf_reward`` and
``objective/non_score_reward`` are means over the judged completions (so that rlhf_reward = scores +
non_score_reward holds for the logged means too; NaN when none was judged), ``rewards/<name>`` over the
completions that source judged, and ``objective/kl`` and ``objective/entropy``, which every sample has, over
all completions. ``objective/unjudged`` counts the completions no source judged, over all processes.
``objective/kl`` is left out where no reference pass ran (``kl_coef`` 0, :mod:`marl.algo.scoring_passes`).

``sampling/sampling_logp_difference/mean`` and ``/max`` (TRL 1.16's names for the same quantity, logged
by its GRPO trainer beside its importance-sampling correction of vLLM samples) are the mean and the max over
every sampled token of ``|log π_sampler(y_t) − log π_trainer(y_t)|``: the log-prob the sampler drew the token
with against the one the rollout's policy pass (or the update's forward) computed for it. Logged where the
sampler keeps its log-probs (``static``, ``graph``; not ``generate``). With the same weights and dtype both
are the same function up to rounding; a sampler in another precision or kernel shows here.

With the sampler correction on (:func:`marl.algo.losses.sampler_importance_ratio`),
``sampling/importance_sampling_ratio/min``, ``/mean`` and ``/max`` (TRL's names) are taken over the valid
tokens (``token_*``) or over the completions (``sequence_*``) of every process. TRL takes the mean of each
process's mean; marl the mean over all of them (the same on one process).

``objective/zero_spread_groups`` is the share of the prompt groups with at least two judged completions whose
judged scores are all equal (they teach nothing, :mod:`marl.algo.group_spread`). With several sources,
``zero_spread_groups/<name>`` is the same for one source's own scores, and ``advantage_share/<name>`` each
source's share of the advantage, ``Σ|A_s| / Σ_s' Σ|A_s'|`` over the completions, ``A_s`` the source's part of
the advantage before any scale (:func:`marl.algo.shaping.source_advantages`; KL and missing-EOS
terms not counted). It is exact for ``rloo`` and for ``per_reward``; under ``sum`` with GRPO's group scale it
leaves out that each group is divided by its own std. Not logged for an estimator that does not split by
source (``reinforce_pp``).

Beside marl's names, the trainer logs TRL 1.16 ``GRPOTrainer``'s names where marl computes the same quantity
(:data:`TRL_ROLLOUT_METRICS`, :data:`TRL_UPDATE_METRICS`), on TRL's definitions: a completion's length counts
its valid tokens (through the stop token); ``completions/clipped_ratio`` is the share that reached the length
limit without a stop token, the ``*_terminated_length`` metrics are over the others (all 0 when none ended, as
TRL logs them); ``reward`` and ``reward_std`` are the mean and unbiased standard deviation of the weighted raw
reward (before any missing-EOS penalty or normalisation) over the judged completions, ``rewards/<name>/mean``
and ``/std`` each source's over the completions it judged (NaN where fewer than one or two: TRL's ``nanstd``);
``frac_reward_zero_std`` is the share of the prompt groups whose judged raw rewards have a standard deviation
of 0 (:func:`marl.algo.group_spread.zero_std_groups`). ``kl`` and ``entropy`` come from the update: for each
micro-batch step, the mean over every process's loss tokens of the per-token KL term the loss adds (the k3
estimate, times the ratio with ``use_bias_correction_kl``; logged only where the KL is in the loss) and of the
policy's entropy, then the mean over the update's micro-batch steps, as TRL averages the values its loss logs.
Minima and maxima are taken over processes (:data:`REDUCTION`), the rest from sums. With tools
(:mod:`marl.rollout.tool_calls`), lengths and the entropy count the model's tokens, not the tools' results,
and ``tools/call_frequency`` and ``tools/failure_frequency`` are TRL's (:func:`tool_metrics`).

Example:
    >>> stats = RolloutStats(kl=2.0, entropy=6.0, non_score_reward=-0.1, rlhf_reward=1.9, scores=2.0,
    ...                      num_eos=1.0, completions=2.0, kl_completions=2.0, judged=1.0,
    ...                      source_sums=torch.tensor([3.0]), source_counts=torch.tensor([2.0]))
    >>> metrics = rollout_metrics(stats, ["sentiment"])
    >>> metrics["rewards/sentiment"], metrics["objective/scores"], metrics["objective/unjudged"]
    (1.5, 2.0, 1.0)
    >>> metrics["rewards/sentiment/mean"], metrics["completions/clipped_ratio"]
    (1.5, 1.0)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from marl.algo.group_spread import ZERO_SPREAD_METRIC, flat_groups, zero_std_groups
from marl.algo.losses import LossSettings, PolicyLoss, loss_mask
from marl.algo.shaping import ShapedRewards
from marl.algo.tensors import masked_sum, model_tokens

if TYPE_CHECKING:
    from marl.rollout.completions import Rollout

# Field metadata key: how :func:`marl.train.parallel.sum_over_processes` combines a record's field over
# processes, "min" or "max" (unset: the sum).
REDUCTION = "reduction"
# TRL 1.16 GRPOTrainer's names for what marl's rollout metrics compute (``rewards/<name>/mean`` and ``/std``
# beside them, per reward source); ``update_metrics`` adds TRL_UPDATE_METRICS.
TRL_ROLLOUT_METRICS = (
    "completions/mean_length",
    "completions/min_length",
    "completions/max_length",
    "completions/clipped_ratio",
    "completions/mean_terminated_length",
    "completions/min_terminated_length",
    "completions/max_terminated_length",
    "reward",
    "reward_std",
    "frac_reward_zero_std",
)
TRL_UPDATE_METRICS = ("kl", "entropy")


def lowest(default: float = math.inf) -> Any:
    """A record field that processes combine by their minimum (``default``: a process that has none)."""
    return field(default=default, metadata={REDUCTION: "min"})


def highest(default: float = -math.inf) -> Any:
    """A record field that processes combine by their maximum (``default``: a process that has none)."""
    return field(default=default, metadata={REDUCTION: "max"})


def _empty() -> torch.Tensor:
    return torch.zeros(0)


def _append(values: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    return torch.cat([values.to(value.device), value.detach().float().reshape(1)])


@dataclass
class RolloutStats:
    """Sums over one process's completions of a rollout; the reward sums over its judged completions."""

    kl: float
    entropy: float  # Σ_t −log π(y_t) of the sampled tokens
    non_score_reward: float
    rlhf_reward: float
    scores: float
    num_eos: float  # completions with an end-of-sequence id among their valid tokens
    completions: float
    kl_completions: float  # completions whose KL was computed: all, or none where no reference pass ran
    judged: float  # completions at least one reward source judged
    source_sums: torch.Tensor  # [S] each reward source's scores, over the completions it judged
    source_counts: torch.Tensor  # [S] how many completions each source judged
    # [1 + S] groups whose judged scores are all equal, and groups with two judged scores: the summed score,
    # then each source (empty when not counted)
    flat_groups: torch.Tensor = field(default_factory=lambda: torch.zeros(0))
    spread_groups: torch.Tensor = field(default_factory=lambda: torch.zeros(0))
    # [S] Σ|A_s| of each source's part of the advantage (empty when the advantage does not split by source)
    source_advantage_sums: torch.Tensor = field(default_factory=lambda: torch.zeros(0))
    # completion lengths (valid tokens), and those of the completions that ended at a stop token
    length_sum: float = 0.0
    length_min: float = lowest()
    length_max: float = highest()
    terminated: float = 0.0
    terminated_length_sum: float = 0.0
    terminated_length_min: float = lowest()
    terminated_length_max: float = highest()
    # the weighted raw reward (before penalty and normalisation) over the judged completions: Σ r and Σ r²
    reward_sum: float = 0.0
    reward_squares: float = 0.0
    source_squares: torch.Tensor = field(default_factory=_empty)  # [S] Σ r² of each source's scores
    # prompt groups whose judged raw rewards have a standard deviation of 0, and groups (counted with ``k``)
    zero_std_groups: float = 0.0
    groups: float = 0.0
    # with tools: the completions counted, their tool calls and the calls that failed (TRL's tools/* metrics)
    tool_rows: float = 0.0
    tool_calls: float = 0.0
    tool_failures: float = 0.0

    @classmethod
    def of(cls, rollout: Any, shaped: ShapedRewards, k: int | None = None) -> RolloutStats:
        """From a :class:`marl.rollout.completions.Rollout` (with the policy's log-probs, which the update
        provides where the rollout skipped that pass) and its shaped rewards; with ``k`` (completions per
        prompt) the flat groups are counted too."""
        source_judged = ~torch.isnan(rollout.source_scores)
        flat = spread = torch.zeros(0)
        zero_std = groups = 0.0
        if k is not None:
            judged_scores = torch.where(shaped.judged, shaped.scores, torch.nan).unsqueeze(1)
            flat, spread = flat_groups(torch.cat([judged_scores, rollout.source_scores], dim=1), k)
            zero_std, groups = zero_std_groups(rollout.scores, k)
        parts = shaped.source_advantages
        lengths = model_tokens(rollout).sum(dim=1).double()  # the model's tokens, not the tools' results
        terminated = lengths[rollout.contains_stop]
        rewards = torch.where(shaped.judged, rollout.scores.double(), 0.0)
        sources = torch.where(source_judged, rollout.source_scores.double(), 0.0)

        def judged_sum(values: torch.Tensor) -> torch.Tensor:
            return torch.where(shaped.judged, values, torch.zeros_like(values)).sum()

        return cls(
            kl=0.0 if shaped.kl is None else shaped.kl.sum(),
            entropy=masked_sum(-rollout.logprobs, model_tokens(rollout)).sum(),
            non_score_reward=judged_sum(shaped.non_score_reward),
            rlhf_reward=judged_sum(shaped.rlhf_reward),
            scores=judged_sum(shaped.scores),
            num_eos=rollout.contains_eos.sum(),
            completions=float(rollout.contains_eos.numel()),
            kl_completions=0.0 if shaped.kl is None else float(shaped.kl.numel()),
            judged=shaped.judged.sum(),
            source_sums=torch.where(source_judged, rollout.source_scores, 0.0).sum(dim=0),
            source_counts=source_judged.sum(dim=0),
            flat_groups=flat,
            spread_groups=spread,
            source_advantage_sums=torch.zeros(0) if parts is None else parts.abs().sum(dim=0),
            length_sum=lengths.sum(),
            length_min=lengths.min(),
            length_max=lengths.max(),
            terminated=terminated.numel(),
            terminated_length_sum=terminated.sum(),
            terminated_length_min=terminated.min() if terminated.numel() else math.inf,
            terminated_length_max=terminated.max() if terminated.numel() else -math.inf,
            reward_sum=rewards.sum(),
            reward_squares=(rewards**2).sum(),
            source_squares=(sources**2).sum(dim=0),
            zero_std_groups=zero_std,
            groups=groups,
            **tool_counts(rollout),
        )


@dataclass
class UpdateStats:
    """Sums over one process's micro-batches of an update. ``first_ratio`` sums the sequence ratios of the
    update's first micro-batch, which must be 1 when the update sees the function the rollout scored."""

    approxkl: float | torch.Tensor = 0.0
    clipped: float | torch.Tensor = 0.0
    loss: float | torch.Tensor = 0.0
    ratio: float | torch.Tensor = 0.0
    ratio_squared: float | torch.Tensor = 0.0
    completions: float | torch.Tensor = 0.0
    entropy: float = 0.0  # Σ over valid tokens of the temperature-scaled policy entropy
    tokens: float | torch.Tensor = 0.0
    first_ratio: float | torch.Tensor = 0.0
    first_completions: float | torch.Tensor = 0.0
    # [M] per micro-batch step: Σ of the entropy and of the loss's per-token KL term (empty: no KL in the
    # loss) over the loss tokens, and the loss tokens (TRL's ``entropy`` and ``kl``)
    step_entropy: torch.Tensor = field(default_factory=_empty)
    step_kl: torch.Tensor = field(default_factory=_empty)
    step_tokens: torch.Tensor = field(default_factory=_empty)
    _first_seen: bool = field(default=False, repr=False, compare=False)

    def add(
        self,
        policy: PolicyLoss,
        entropy: torch.Tensor,
        mask: torch.Tensor,
        loss_mask: torch.Tensor | None = None,
    ) -> None:
        """Add one micro-batch: its policy-loss output and per-token entropies with their validity mask, and
        the tokens its loss saw (``loss_mask``; default ``mask``)."""
        loss_mask = mask if loss_mask is None else loss_mask
        self.step_entropy = _append(self.step_entropy, masked_sum(entropy.float(), loss_mask).sum())
        self.step_tokens = _append(self.step_tokens, loss_mask.sum())
        if policy.kl is not None:
            self.step_kl = _append(self.step_kl, masked_sum(policy.kl.float(), loss_mask).sum())
        count = policy.ratio.numel()
        self.approxkl += (0.5 * policy.log_ratio**2).sum()
        self.clipped += policy.clipped.sum()
        self.loss += policy.loss.detach() * count
        self.ratio += policy.ratio.sum()
        self.ratio_squared += (policy.ratio**2).sum()
        self.completions += count
        self.entropy += torch.where(mask, entropy, torch.zeros_like(entropy)).sum()
        self.tokens += mask.sum()
        if not self._first_seen:
            self.first_ratio += policy.ratio.sum()
            self.first_completions += count
            self._first_seen = True


def tool_counts(rollout: Any) -> dict[str, float]:
    """A tool-calling rollout's completions, tool calls and failed calls (none without tools)."""
    calls = getattr(rollout, "tool_calls", None)
    if calls is None:
        return {}
    failures = rollout.tool_failures
    return {"tool_rows": float(calls.numel()), "tool_calls": calls.sum(), "tool_failures": failures.sum()}


def tool_metrics(stats: RolloutStats) -> dict[str, float]:
    """TRL's ``tools/call_frequency`` (tool calls per completion) and ``tools/failure_frequency`` (the share
    of the calls that failed: 0 without calls), over every process; none without tools."""
    if stats.tool_rows == 0:
        return {}
    calls = float(stats.tool_calls)
    return {
        "tools/call_frequency": calls / float(stats.tool_rows),
        "tools/failure_frequency": float(stats.tool_failures) / calls if calls > 0 else 0.0,
    }


def rollout_metrics(stats: RolloutStats, source_names: list[str]) -> dict[str, float]:
    """The ``objective/*`` means of a rollout and each reward source's mean ``rewards/<name>`` (over the
    completions it judged), from sums over all processes; see the module docstring for which completions each
    mean is over."""
    count, judged = stats.completions, stats.judged

    def judged_mean(total: float) -> float:
        return total / judged if judged > 0 else math.nan

    per_source = {
        f"rewards/{name}": float(total / judged) if judged > 0 else math.nan
        for name, total, judged in zip(source_names, stats.source_sums, stats.source_counts, strict=True)
    }
    kl = {"objective/kl": stats.kl / stats.kl_completions} if stats.kl_completions > 0 else {}
    several = len(source_names) > 1  # one source: its share is 1, its flat groups are the overall ones
    if len(stats.spread_groups) == len(source_names) + 1:
        keys = [ZERO_SPREAD_METRIC, *(f"zero_spread_groups/{name}" for name in source_names if several)]
        per_source.update(
            {
                key: float(flat / counted) if counted > 0 else math.nan
                for key, flat, counted in zip(keys, stats.flat_groups, stats.spread_groups, strict=False)
            }
        )
    if several and len(stats.source_advantage_sums) == len(source_names):
        total = float(stats.source_advantage_sums.sum())
        per_source.update(
            {
                f"advantage_share/{name}": float(part) / total if total > 0 else math.nan
                for name, part in zip(source_names, stats.source_advantage_sums, strict=True)
            }
        )
    return {
        **per_source,
        **kl,
        **trl_rollout_metrics(stats, source_names),
        **tool_metrics(stats),
        "objective/entropy": stats.entropy / count,
        "objective/non_score_reward": judged_mean(stats.non_score_reward),
        "objective/rlhf_reward": judged_mean(stats.rlhf_reward),
        "objective/scores": judged_mean(stats.scores),
        "objective/unjudged": count - judged,
        "val/num_eos_tokens": stats.num_eos,
    }


def unbiased_std_of_sums(total: float, squares: float, count: float) -> float:
    """The standard deviation with Bessel's correction of ``count`` values from their sum and sum of squares
    (NaN for fewer than two values, as TRL's ``nanstd``).

    Example:
        >>> unbiased_std_of_sums(total=4.0, squares=10.0, count=2.0)  # 1 and 3
        1.4142135623730951
    """
    if count < 2:
        return math.nan
    return math.sqrt(max(squares - total * total / count, 0.0) / (count - 1))


def trl_rollout_metrics(stats: RolloutStats, source_names: list[str]) -> dict[str, float]:
    """TRL 1.16 GRPOTrainer's rollout metrics (:data:`TRL_ROLLOUT_METRICS` and ``rewards/<name>/mean|std``)
    from sums, minima and maxima over all processes; see the module docstring for their definitions.

    Example:
        >>> stats = RolloutStats(kl=0.0, entropy=0.0, non_score_reward=0.0, rlhf_reward=4.0, scores=4.0,
        ...     num_eos=1.0, completions=2.0, kl_completions=0.0, judged=2.0, source_sums=torch.tensor([4.0]),
        ...     source_counts=torch.tensor([2.0]), length_sum=9.0, length_min=3.0, length_max=6.0,
        ...     terminated=1.0, terminated_length_sum=3.0, terminated_length_min=3.0,
        ...     terminated_length_max=3.0,
        ...     reward_sum=4.0, reward_squares=10.0, source_squares=torch.tensor([10.0]))
        >>> metrics = trl_rollout_metrics(stats, ["accuracy"])
        >>> metrics["completions/mean_length"], metrics["completions/clipped_ratio"], metrics["reward"]
        (4.5, 0.5, 2.0)
        >>> round(metrics["reward_std"], 4), round(metrics["rewards/accuracy/std"], 4)
        (1.4142, 1.4142)
    """
    count, ended = stats.completions, stats.terminated
    metrics = {
        "completions/mean_length": stats.length_sum / count,
        "completions/min_length": stats.length_min,
        "completions/max_length": stats.length_max,
        "completions/clipped_ratio": (count - ended) / count,
        # TRL logs 0 for all three when no completion ended
        "completions/mean_terminated_length": stats.terminated_length_sum / ended if ended else 0.0,
        "completions/min_terminated_length": stats.terminated_length_min if ended else 0.0,
        "completions/max_terminated_length": stats.terminated_length_max if ended else 0.0,
    }
    for index, name in enumerate(source_names):
        judged, total = float(stats.source_counts[index]), float(stats.source_sums[index])
        metrics[f"rewards/{name}/mean"] = total / judged if judged > 0 else math.nan
        squares = float(stats.source_squares[index]) if len(stats.source_squares) else math.nan
        metrics[f"rewards/{name}/std"] = unbiased_std_of_sums(total, squares, judged)
    judged = stats.judged
    metrics["reward"] = stats.reward_sum / judged if judged > 0 else math.nan
    metrics["reward_std"] = unbiased_std_of_sums(stats.reward_sum, stats.reward_squares, judged)
    if stats.groups > 0:
        metrics["frac_reward_zero_std"] = stats.zero_std_groups / stats.groups
    return metrics


def step_mean(totals: torch.Tensor, tokens: torch.Tensor) -> float:
    """The mean over micro-batch steps of each step's token mean (``totals / max(tokens, 1)``), as TRL 1.16's
    ``log`` averages the values its ``_compute_loss`` logs once per micro-batch.

    Example:
        >>> step_mean(torch.tensor([2.0, 9.0]), torch.tensor([1.0, 3.0]))
        2.5
    """
    return float((totals / tokens.clamp(min=1.0)).mean())


def update_metrics(stats: UpdateStats) -> dict[str, float]:
    """The ``policy/*``, ``loss/*`` and ``val/ratio*`` means of an update, from sums over all processes, and
    TRL's ``entropy`` and (where the KL is in the loss) ``kl``.

    Example:
        >>> update_metrics(UpdateStats(ratio=4.0, ratio_squared=4.0, completions=4.0, tokens=1.0,
        ...                            first_ratio=2.0, first_completions=2.0))["val/ratio_first"]
        1.0
    """
    count = stats.completions
    ratio = stats.ratio / count
    return {
        "policy/approxkl_avg": stats.approxkl / count,
        "policy/clipfrac_avg": stats.clipped / count,
        "loss/policy_avg": stats.loss / count,
        "policy/entropy_avg": stats.entropy / max(stats.tokens, 1.0),
        "val/ratio": ratio,
        "val/ratio_var": max(stats.ratio_squared / count - ratio**2, 0.0),
        "val/ratio_first": stats.first_ratio / stats.first_completions,
        "entropy": step_mean(stats.step_entropy, stats.step_tokens),
        **({"kl": step_mean(stats.step_kl, stats.step_tokens)} if len(stats.step_kl) else {}),
    }


SAMPLER_GAP_MEAN = "sampling/sampling_logp_difference/mean"
SAMPLER_GAP_MAX = "sampling/sampling_logp_difference/max"


@dataclass
class SamplerGapStats:
    """Sums over one process's sampled tokens of |sampler log-prob − trainer log-prob|."""

    total: float | torch.Tensor
    tokens: float | torch.Tensor


def sampler_gap(sampled: torch.Tensor, scored: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``|sampled − scored|`` of the valid tokens ``mask`` (1-D, float32).

    Example:
        >>> sampled, scored = torch.tensor([[-1.0, -2.0]]), torch.tensor([[-1.5, -9.0]])
        >>> sampler_gap(sampled, scored, torch.tensor([[1, 0]])).tolist()
        [0.5]
    """
    return (sampled.float() - scored.float()).abs()[mask.bool()]


def sampler_gap_metrics(rollout: Any, parallelism: Any) -> dict[str, float]:
    """:data:`SAMPLER_GAP_MEAN` and :data:`SAMPLER_GAP_MAX` over every process's sampled tokens (its
    ``sum_over_processes`` for the mean, its ``gather`` for the max); empty where the sampler kept no
    log-probs (the same on every process: one sampler)."""
    if getattr(rollout, "sampled_logprobs", None) is None or rollout.logprobs is None:
        return {}
    gap = sampler_gap(rollout.sampled_logprobs, rollout.logprobs, model_tokens(rollout))
    summed = parallelism.sum_over_processes(SamplerGapStats(total=gap.sum(), tokens=float(gap.numel())))
    local_max = gap.max() if gap.numel() else torch.zeros((), device=gap.device)
    largest = float(parallelism.gather(local_max.reshape(1)).max())
    if summed.tokens == 0:
        return {}
    return {SAMPLER_GAP_MEAN: summed.total / summed.tokens, SAMPLER_GAP_MAX: largest}


RATIO_MIN = "sampling/importance_sampling_ratio/min"
RATIO_MEAN = "sampling/importance_sampling_ratio/mean"
RATIO_MAX = "sampling/importance_sampling_ratio/max"


def counted_ratios(ratio: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The ratios the metrics count, 1-D: every completion's (``[B, 1]``), else the valid tokens'.

    Example:
        >>> counted_ratios(torch.tensor([[2.0, 5.0]]), torch.tensor([[True, False]])).tolist()
        [2.0]
    """
    return ratio.flatten() if ratio.shape[1] == 1 else ratio[mask.bool()]


@dataclass
class RatioStats:
    """One process's sum, count, minimum and maximum of the counted ratios (combined over processes by
    :func:`marl.train.parallel.sum_over_processes`: sums added, the minimum and maximum of them all)."""

    total: float | torch.Tensor = 0.0
    count: float | torch.Tensor = 0.0
    smallest: float = lowest()
    largest: float = highest()

    @classmethod
    def of(cls, ratios: torch.Tensor) -> RatioStats:
        if ratios.numel() == 0:
            return cls()
        return cls(ratios.sum(), float(ratios.numel()), float(ratios.min()), float(ratios.max()))


def ratio_metrics(stats: RatioStats) -> dict[str, float]:
    """TRL's three metrics from the stats of every process (empty where no ratio was counted).

    Example:
        >>> ratio_metrics(RatioStats.of(torch.tensor([0.5, 1.5])))
        {'sampling/importance_sampling_ratio/min': 0.5, 'sampling/importance_sampling_ratio/mean': 1.0, \
'sampling/importance_sampling_ratio/max': 1.5}
    """
    if stats.count == 0:
        return {}
    return {
        RATIO_MIN: float(stats.smallest),
        RATIO_MEAN: float(stats.total / stats.count),
        RATIO_MAX: float(stats.largest),
    }


def sampler_correction_metrics(
    rollout: Rollout, settings: LossSettings, parallelism: Any
) -> dict[str, float]:
    """TRL's ``sampling/importance_sampling_ratio/*`` of an updated ``rollout`` (its ``logprobs`` are the
    trainer's: scored, or provided by the update) over its loss tokens on every process (``parallelism``'s
    ``sum_over_processes``); empty where the correction is off."""
    correction = settings.sampler_correction
    if correction is None or rollout.sampled_logprobs is None or rollout.logprobs is None:
        return {}
    mask = loss_mask(model_tokens(rollout), rollout.contains_stop, settings)
    ratios = counted_ratios(correction.ratio(rollout.logprobs, rollout.sampled_logprobs, mask), mask)
    return ratio_metrics(parallelism.sum_over_processes(RatioStats.of(ratios)))
