"""Which no-grad scoring passes a rollout runs before the update: only those the algorithm reads.

* The **policy** pass (the policy's log-probs at sampling time) is read by the ratio when a rollout is
  reused (several PPO epochs or mini-batches: after the first optimizer step the update's forward no longer
  sees the sampling policy) and by a KL folded into the reward (the advantages need it before the update).
  Otherwise the update's own forward, before its one optimizer step, computes exactly those log-probs: it
  provides them, detached, as TRL 1.16's GRPOTrainer does (``old_per_token_logps =
  per_token_logps.detach()``); the ratio is then 1 by construction (``val/ratio`` follows the same rule).
* The **reference** pass is read only by a non-zero KL (``kl_coef``, TRL's ``beta``), in the reward or in
  the loss. Without it there is no KL to report: ``objective/kl`` is not logged (TRL logs no ``kl`` at
  ``beta=0`` either).

What each preset (:mod:`marl.config.algorithms`) runs with its defaults:

==============  ======  =========  ===================================================================
preset          policy  reference  why
==============  ======  =========  ===================================================================
rloo            yes     yes        4 PPO epochs; KL in the reward
grpo, dr_grpo,  no      no         1 epoch, 1 mini-batch, beta = 0
dapo, gspo
reinforce_pp    yes     yes        KL in the reward (kl_coef 0.01)
==============  ======  =========  ===================================================================

Example:
    >>> from types import SimpleNamespace
    >>> grpo = SimpleNamespace(num_ppo_epochs=1, num_mini_batches=1, kl_coef=0.0, kl_placement="loss")
    >>> scoring_passes(grpo)
    ScoringPasses(policy=False, reference=False)
    >>> grpo.kl_coef = 0.04  # beta in the loss: the reference pass, still no policy pass
    >>> scoring_passes(grpo)
    ScoringPasses(policy=False, reference=True)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ScoringPasses:
    """The rollout's no-grad log-prob passes: under the policy, under its reference."""

    policy: bool = True
    reference: bool = True


ALL_PASSES = ScoringPasses()
POLICY_PASS = ScoringPasses(policy=True, reference=False)


def reuses_samples(settings: Any) -> bool:
    """Whether the update takes several optimizer steps on one rollout (``num_ppo_epochs`` or
    ``num_mini_batches`` above 1): then its ratio reads the log-probs the rollout scored.

    Example:
        >>> from types import SimpleNamespace
        >>> reuses_samples(SimpleNamespace(num_ppo_epochs=1, num_mini_batches=2))
        True
    """
    return settings.num_ppo_epochs > 1 or settings.num_mini_batches > 1


def scoring_passes(settings: Any) -> ScoringPasses:
    """The passes the algorithm settings read (see the module docstring); ``settings`` has
    ``num_ppo_epochs``, ``num_mini_batches``, ``kl_coef`` and ``kl_placement`` (an
    :class:`marl.RLOOConfig`)."""
    kl = settings.kl_coef != 0
    return ScoringPasses(
        policy=reuses_samples(settings) or (kl and settings.kl_placement == "reward"),
        reference=kl,
    )
