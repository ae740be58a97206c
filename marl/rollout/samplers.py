"""The sampler extension point: what draws the completions of a rollout, chosen by name (``--sampler``).

A sampler turns prompts into k completions each under a view of the model; everything after that (log-probs,
packing, reward rows) is the :class:`marl.rollout.scoring.Scorer`'s, so a faster sampler (a static-cache
decode, an inference engine) is one new file with a class that has :class:`Sampler`'s three methods plus one
:func:`register_sampler` call. The trainer builds it as ``get_sampler(config.sampler)(model, tokenizer,
settings)`` and calls :meth:`Sampler.policy_weights_changed` whenever the policy adapter's weights change, so
that a sampler holding its own copy of them can refresh it.

Example:
    >>> get_sampler("transformers").__name__
    'TransformersSampler'
    >>> settings = SamplerSettings(temperature=0.7, response_length=16, stop_at_eos=True)
    >>> settings.rows_per_pass, settings.policy
    (64, None)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from marl.errors import ConfigError
from marl.registry import Registry
from marl.rollout.graph_sampler import GraphSampler
from marl.rollout.sampler_settings import SamplerSettings
from marl.rollout.static_sampler import StaticSampler
from marl.rollout.transformers_sampler import TransformersSampler

if TYPE_CHECKING:
    from marl.model.multi_adapter import MultiAdapterModel
    from marl.rollout.prompts import Prompt, PromptBatch
    from marl.rollout.records import Samples


class Sampler(Protocol):
    """Draws completions. Built as ``factory(model, tokenizer, settings)`` (:func:`register_sampler`)."""

    def batch(self, prompts: Sequence[Prompt]) -> PromptBatch:
        """``prompts`` left-padded on the sampler's device, ready for :meth:`sample`."""
        ...

    def sample(self, prompts: PromptBatch, k: int, *, view: str = "policy") -> Samples:
        """``k`` completions of every prompt under ``view`` (``"policy"``, ``"reference"`` or the base with
        adapters disabled, :data:`marl.model.adapters.BASE_VIEW`), k-major (row
        ``j * P + i`` is sample ``j`` of prompt ``i``), cut after their stop token and decoded."""
        ...

    def policy_weights_changed(self) -> None:
        """The policy adapter's weights changed (after every optimizer step the trainer took, and after it
        loaded a checkpoint): a sampler that holds its own copy of them refreshes it before it samples
        again."""
        ...


SamplerFactory = Callable[["MultiAdapterModel", Any, SamplerSettings], Sampler]

SAMPLERS: Registry[SamplerFactory] = Registry(
    "sampler",
    "--sampler",
    "marl.rollout.samplers.register_sampler",
    {"transformers": TransformersSampler, "static": StaticSampler, "graph": GraphSampler},
)


def register_sampler(name: str, factory: SamplerFactory) -> None:
    """Make ``factory`` the sampler named ``name`` (``--sampler name``); a name is registered once.

    Example:
        >>> register_sampler("mine", TransformersSampler)
        >>> get_sampler("mine") is TransformersSampler
        True
        >>> del SAMPLERS["mine"]
    """
    SAMPLERS.register(name, factory)


def check_keeps_logprobs(name: str, sampler: Any) -> None:
    """Refuse ``sampler`` (the factory registered as ``name``, or the sampler it built for the model) where it
    keeps no log-probs (its ``keeps_logprobs``; unset: none), which the sampler correction reads.

    Example:
        >>> check_keeps_logprobs("static", StaticSampler)
        >>> check_keeps_logprobs("transformers", TransformersSampler)
        Traceback (most recent call last):
        ...
        marl.errors.ConfigError: --vllm_importance_sampling_correction reads the log-prob the sampler drew ...
    """
    if getattr(sampler, "keeps_logprobs", False):
        return
    reason = getattr(sampler, "fallback_reason", None)
    raise ConfigError(
        "--vllm_importance_sampling_correction reads the log-prob the sampler drew each token with, but "
        f"--sampler {name!r} keeps none{f' for this model ({reason})' if reason else ''}. Use --sampler "
        "static or graph (a registered sampler: set keeps_logprobs = True on it where it keeps them), or "
        "drop --vllm_importance_sampling_correction"
    )


def get_sampler(name: str) -> SamplerFactory:
    """The factory of the sampler named ``name``.

    Example:
        >>> get_sampler("nope")
        Traceback (most recent call last):
        ...
        marl.errors.ConfigError: --sampler 'nope' is not a registered sampler; pass one of ...
    """
    return SAMPLERS.lookup(name)
