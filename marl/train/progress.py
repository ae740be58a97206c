"""What the training progress bar says: the algorithm that trains, and the KL it shows named for what it is.

``objective/kl`` is the mean over completions of ``Σ_t (log π − log π_ref)`` (the k1 estimator of the
sequence KL): an unbiased estimate whose single values can be negative. The bar names it ``kl_k1`` and says
where the KL acts (folded into the reward, or β·k3 in the loss); without a reference pass (β = 0 with the KL
in the loss) there is no KL to show and the bar shows none.

Example:
    >>> from types import SimpleNamespace
    >>> config = SimpleNamespace(algorithm="grpo", kl_placement="loss", kl_coef=0.0)
    >>> progress_description(config)
    'GRPO (KL in the loss, β=0)'
    >>> progress_postfix({"objective/scores": 0.5}, episode=16)
    {'episode': 16, 'score': '0.500'}
    >>> progress_postfix({"objective/scores": 0.5, "objective/kl": -0.01}, episode=16)
    {'episode': 16, 'score': '0.500', 'kl_k1': '-0.010'}
"""

from __future__ import annotations

from typing import Any


def progress_description(config: Any) -> str:
    """The bar's title: the ``--algorithm`` preset and where its KL acts, with its coefficient."""
    where = "in the loss, β" if config.kl_placement == "loss" else "in the reward, kl_coef"
    return f"{config.algorithm.upper()} (KL {where}={config.kl_coef:g})"


def progress_postfix(metrics: dict[str, float], episode: int) -> dict[str, Any]:
    """The bar's numbers after an update: completions so far, the mean score, and the k1 sequence KL when a
    reference pass measured it."""
    postfix: dict[str, Any] = {"episode": episode, "score": f"{metrics['objective/scores']:.3f}"}
    if "objective/kl" in metrics:
        postfix["kl_k1"] = f"{metrics['objective/kl']:.3f}"
    return postfix
