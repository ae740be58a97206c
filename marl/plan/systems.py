"""The same RLHF job as three systems would hold it in memory: marl, TRL's ``RLOOTrainer`` with a
``peft_config``, and PPO with four model copies. These are the planner's models of those systems, used to
put marl's prediction beside theirs; only marl's is validated against measurements.

- ``marl``: one base; policy LoRA, reference (adapters off) and reward LoRAs on it; prompts computed once
  for their k samples (static cache, packed scoring and update); the LM head and float32 log-softmax in
  chunks of positions.
- ``trl-rloo``: the policy's base shared with the reference (``peft_config``), the reward model a second
  base (a sequence classifier: no LM head) with its LoRA and head; the whole rollout generated at once with
  every prompt repeated k times, scored micro-batch by micro-batch, every completion with its own prompt,
  the logits of every completion position at once.
- ``ppo``: four bases (policy, reference, reward, value); a trainable LoRA and a head on the value model
  too; the value model's backbone runs with gradients beside the policy's in the update; otherwise as
  ``trl-rloo``.

Every system keeps its trainable LoRA and AdamW state in float32 here.

Example:
    >>> sorted(SYSTEMS)
    ['marl', 'ppo', 'trl-rloo']
    >>> SYSTEMS["ppo"].value_model
    True
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from marl.errors import ConfigError


@dataclass(frozen=True)
class SystemLayout:
    """How one system lays the job out in memory."""

    label: str
    packs: bool  # prompts computed once for their k samples (sampling, scoring, update)
    full_logits: bool  # the logits of every completion position at once (else chunked float32)
    value_model: bool  # PPO: a reference base, a value base with a trainable LoRA, a second backbone pass
    notes: tuple[str, ...] = ()

    def resident(
        self,
        *,
        base_bytes: int,
        classifier_bytes: int,
        policy_parameters: int,
        reward_bytes: int,
        num_rewards: int,
        reference_copy: bool,
    ) -> dict[str, int]:
        """Bytes that stay for the whole run, by part."""
        trainable = 4 * policy_parameters
        parts = {
            "base weights": base_bytes,
            "policy LoRA (float32)": trainable,
            "reward LoRAs + score heads": reward_bytes,
            "reference copy of the policy": trainable if reference_copy and self.packs else 0,
            "AdamW moments (float32)": 2 * trainable,
        }
        if not self.packs:  # separate reward model(s): each a sequence classifier on its own base
            parts["reward model bases"] = num_rewards * classifier_bytes
        if self.value_model:
            parts["reference model base"] = base_bytes
            parts["value model base + LoRA + AdamW"] = classifier_bytes + 3 * trainable
        return parts


SYSTEMS: dict[str, SystemLayout] = {
    "marl": SystemLayout("marl", packs=True, full_logits=False, value_model=False),
    "trl-rloo": SystemLayout(
        "TRL RLOOTrainer + peft_config (planner's model)",
        packs=False,
        full_logits=True,
        value_model=False,
        notes=("a prediction of the planner's model of TRL 1.16's RLOOTrainer, not a measurement",),
    ),
    "ppo": SystemLayout(
        "PPO, four copies (planner's model)",
        packs=False,
        full_logits=True,
        value_model=True,
        notes=("a prediction of the planner's model of PPO with four models, not a measurement",),
    ),
}


def check_plannable(causal_lm: Any) -> None:
    """Refuse a model the planner does not model: one whose cache holds other states than attention keys
    and values (Mamba layers; marl samples those with ``generate``).

    Example:
        >>> import torch
        >>> from transformers import LlamaConfig
        >>> from marl.plan.trace import meta_causal_lm
        >>> check_plannable(meta_causal_lm(LlamaConfig(hidden_size=64, intermediate_size=128,
        ...     num_hidden_layers=1, num_attention_heads=4, vocab_size=100), torch.float32))
    """
    from marl.model.sampling import static_decode_problem

    problem = static_decode_problem(causal_lm)
    if problem is not None:
        raise ConfigError(
            f"marl plan cannot plan model_type {causal_lm.config.model_type!r}: {problem}; it plans models "
            "whose layers are all attention"
        )
