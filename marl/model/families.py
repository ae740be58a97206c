"""What differs between model families, and the load-time checks that keep marl exact on each of them.

marl computes log-probabilities from the backbone's hidden states, one chunk of positions at a time, instead
of
calling ``*ForCausalLM.forward`` (whose full ``[batch, time, vocab]`` logits are the largest tensor of a
step).
Some families transform the LM head's output inside that forward: Gemma 2/3 soft-cap it, Granite divides it by
``logits_scaling``, Cohere multiplies it by ``logit_scale``, Falcon-H1 by ``lm_head_multiplier``.
:class:`LogitHead` applies the same transform, and :func:`check_logit_head` proves on a probe input that
``LogitHead(hidden states)`` equals the model's own forward logits; a family whose forward does something else
is refused with an error instead of being trained on another distribution than the one it samples.

RL needs the update to see the same function as the rollout, so :func:`disable_dropout` turns every dropout
off (as TRL's trainers do: ``nn.Dropout`` modules, and the float rates that attention and decoder layers apply
functionally), and :func:`check_train_matches_eval` proves that train mode (needed for gradient checkpointing)
computes what eval mode computes.

Rotary scalings whose frequencies transformers recomputes from the batch (``dynamic_rope_update``: every
``rope_type`` containing "dynamic", and "longrope") are refused by :func:`check_static_rotary`: a completion's
frequencies would depend on the longest position of the batch it is computed in and, in ``generate``, on the
step, so it would be sampled and scored under different functions.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from marl.errors import ModelError

# Relative tolerance of the probes: the two paths run the same operations, so only rounding may differ.
PROBE_TOLERANCE = 1e-4
PROBE_LENGTH = 8

_GRANITE_TYPES = ("granite", "granitemoe", "granitemoeshared", "granitemoehybrid", "granitemoe_swa")
_COHERE_TYPES = ("cohere", "cohere2", "cohere2_moe")


def _soft_cap(cap: float) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda logits: torch.tanh(logits / cap) * cap


def _scale(factor: float) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda logits: logits * factor


def family_logit_transform(causal_lm: nn.Module) -> tuple[str, Callable[[torch.Tensor], torch.Tensor] | None]:
    """``(description, transform)`` that ``causal_lm.forward`` applies to its LM head's output; ``None`` when
    the logits are the head's output as it is.

    Example:
        >>> from transformers import GraniteConfig, GraniteForCausalLM
        >>> config = GraniteConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1,
        ...                        num_attention_heads=4, vocab_size=32, logits_scaling=4.0)
        >>> granite = GraniteForCausalLM(config)
        >>> family_logit_transform(granite)[0]
        'divided by logits_scaling=4.0'
    """
    config = causal_lm.config
    model_type = getattr(config, "model_type", "")
    if model_type in _GRANITE_TYPES and getattr(config, "logits_scaling", 1.0) != 1.0:
        return f"divided by logits_scaling={config.logits_scaling}", _scale(1.0 / config.logits_scaling)
    if model_type in _COHERE_TYPES:
        scale = getattr(causal_lm, "logit_scale", getattr(config, "logit_scale", 1.0))
        return f"multiplied by logit_scale={scale}", _scale(scale)
    if model_type == "falcon_h1":
        multiplier = causal_lm.model.lm_head_multiplier
        return f"multiplied by lm_head_multiplier={multiplier}", _scale(multiplier)
    if model_type == "recurrent_gemma":
        return f"soft-capped at {config.logits_soft_cap}", _soft_cap(config.logits_soft_cap)
    cap = getattr(config, "final_logit_softcapping", None)
    if cap:
        return f"soft-capped at final_logit_softcapping={cap}", _soft_cap(cap)
    return "the LM head's output", None


@dataclass
class LogitHead:
    """The LM head of a causal LM plus its family's logit transform: ``hidden states -> logits`` exactly as
    the model's forward computes them."""

    lm_head: nn.Module
    description: str
    transform: Callable[[torch.Tensor], torch.Tensor] | None

    @classmethod
    def of(cls, causal_lm: nn.Module) -> LogitHead:
        description, transform = family_logit_transform(causal_lm)
        return cls(causal_lm.get_output_embeddings(), description, transform)

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)
        return logits if self.transform is None else self.transform(logits)


def backbone(causal_lm: nn.Module) -> nn.Module:
    """The transformer body of a causal LM: its final hidden states, without the LM head (which
    :class:`LogitHead` applies chunk by chunk).

    Example:
        >>> from transformers import LlamaConfig, LlamaForCausalLM
        >>> config = LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        ...                      num_attention_heads=2, vocab_size=32)
        >>> type(backbone(LlamaForCausalLM(config))).__name__
        'LlamaModel'
    """
    return getattr(causal_lm, causal_lm.base_model_prefix)


def prompt_cache_can_be_shared(causal_lm: nn.Module) -> bool:
    """Whether a prompt's KV cache can be repeated for its k samples: every layer of the model's cache holds
    attention keys and values only. Recurrent states (Mamba layers of hybrid models such as Falcon-H1) are not
    repeated by ``Cache.batch_repeat_interleave``, so those models prefill each sample's prompt themselves.

    Example:
        >>> from transformers import LlamaConfig, LlamaForCausalLM
        >>> prompt_cache_can_be_shared(LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128,
        ...     num_hidden_layers=1, num_attention_heads=4, vocab_size=32)))
        True
    """
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

    cache = DynamicCache(config=causal_lm.config)
    return all(type(layer) in (DynamicLayer, DynamicSlidingWindowLayer) for layer in cache.layers)


def _probe_ids(causal_lm: nn.Module) -> torch.Tensor:
    vocab = causal_lm.get_output_embeddings().weight.shape[0]
    device = causal_lm.get_input_embeddings().weight.device
    ids = (torch.arange(PROBE_LENGTH, device=device) * 7 + 3) % vocab
    return ids.unsqueeze(0)


def _max_relative_difference(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    ours, theirs = ours.float(), theirs.float()
    return float((ours - theirs).abs().max() / (1.0 + theirs.abs().max()))


def check_logit_head(causal_lm: nn.Module, backbone: nn.Module, head: LogitHead) -> None:
    """Refuse the model if ``head(backbone(x))`` differs from ``causal_lm(x).logits`` on a probe input.

    Runs in eval mode without gradients under whatever adapter view is active; the train/eval flags are
    restored.
    """
    probe = _probe_ids(causal_lm)
    mask = torch.ones_like(probe)
    with _eval_mode(causal_lm), torch.no_grad():
        theirs = causal_lm(input_ids=probe, attention_mask=mask, use_cache=False).logits
        hidden = backbone(input_ids=probe, attention_mask=mask, use_cache=False).last_hidden_state
        ours = head(hidden)
    difference = _max_relative_difference(ours, theirs)
    if ours.shape != theirs.shape or difference > PROBE_TOLERANCE:
        raise ModelError(
            f"{type(causal_lm).__name__} (model_type {causal_lm.config.model_type!r}) computes its logits in "
            f"a way marl does not reproduce: marl's head ({head.description}) differs from the model's "
            f"forward by {difference:.2e} on a probe input. Training it would score completions under "
            "another distribution than the one it samples, so it is refused. Supported logit transforms: "
            "soft-capping (final_logit_softcapping), Granite's logits_scaling, Cohere's logit_scale, "
            "Falcon-H1's lm_head_multiplier"
        )


def batch_dependent_rope_types(config: object) -> list[str]:
    """The rotary scaling types in ``config`` whose frequencies transformers recomputes in every forward from
    ``max(position_ids)`` (the rule of ``transformers.modeling_rope_utils.dynamic_rope_update``): dynamic NTK
    (any type with "dynamic" in its name) raises the base once positions pass ``max_position_embeddings``,
    "longrope" switches all rows of a batch to its long factors once one position passes
    ``original_max_position_embeddings``.

    Example:
        >>> from transformers import LlamaConfig
        >>> batch_dependent_rope_types(LlamaConfig(rope_scaling={"rope_type": "dynamic", "factor": 2.0}))
        ['dynamic']
        >>> batch_dependent_rope_types(LlamaConfig(rope_scaling={"rope_type": "linear", "factor": 2.0}))
        []
    """
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    parameters = getattr(text_config, "rope_parameters", None) or getattr(text_config, "rope_scaling", None)
    if not isinstance(parameters, dict):
        return []
    # one set of parameters, or one per layer type ({"full_attention": {...}, "sliding_attention": {...}})
    is_one_set = "rope_type" in parameters or "type" in parameters
    groups = (
        [parameters] if is_one_set else [value for value in parameters.values() if isinstance(value, dict)]
    )
    types = [str(group.get("rope_type", group.get("type", ""))) for group in groups]
    return [kind for kind in types if "dynamic" in kind or kind == "longrope"]


def check_static_rotary(causal_lm: nn.Module) -> None:
    """Refuse a model whose rotary frequencies depend on the batch (:func:`batch_dependent_rope_types`).

    RLOO needs one distribution per completion: the one it is sampled from, scored under (in rollout chunks
    and packed by prompt) and updated on (in micro-batches). These scalings pick their frequencies from the
    longest position of each forward pass, so the same completion gets other numbers in ``generate`` (one
    step at a time), in a chunk next to a longer row, and in the update. marl does not override transformers'
    rotary modules, so such models are refused before any training.
    """
    kinds = batch_dependent_rope_types(causal_lm.config)
    if kinds:
        raise ModelError(
            f"{type(causal_lm).__name__} (model_type {causal_lm.config.model_type!r}) uses rotary scaling "
            f"rope_type={kinds[0]!r} (config.json 'rope_scaling' / 'rope_parameters'), whose frequencies "
            "transformers recomputes from the longest position in each forward pass: a completion would be "
            "sampled and scored under different frequencies, and its log-probs would depend on the other "
            "rows of its batch. Set rope_type in the model's config.json to a static scaling ('linear', "
            "'yarn' or 'llama3', with the same factor), or remove the rotary scaling"
        )


def disable_dropout(model: nn.Module) -> int:
    """Set every dropout rate in ``model`` to 0: ``nn.Dropout`` modules (LoRA's ``lora_dropout`` too), and
    float rates such as ``attention_dropout`` that layers apply functionally, on modules and on their configs.
    Returns how many rates were non-zero.

    Example:
        >>> disable_dropout(nn.Sequential(nn.Linear(2, 2), nn.Dropout(0.1)))
        1
    """
    changed = 0
    configs = {}
    for module in model.modules():
        if isinstance(module, nn.modules.dropout._DropoutNd):
            changed += module.p != 0
            module.p = 0.0
            continue
        changed += _zero_dropout_rates(module)
        config = getattr(module, "config", None)
        if config is not None:
            configs[id(config)] = config
    # Some layers read their rate from the config at forward time (``self.config.attention_dropout``).
    for config in configs.values():
        changed += _zero_dropout_rates(config)
        for name in ("text_config", "decoder"):
            sub_config = getattr(config, name, None)
            if sub_config is not None and sub_config is not config:
                changed += _zero_dropout_rates(sub_config)
    return changed


def _zero_dropout_rates(holder: object) -> int:
    changed = 0
    for name, value in list(vars(holder).items()):
        is_rate = isinstance(value, float) and not isinstance(value, bool)
        if is_rate and ("dropout" in name or "pdrop" in name) and value != 0.0:
            setattr(holder, name, 0.0)
            changed += 1
    return changed


def check_train_matches_eval(causal_lm: nn.Module) -> None:
    """Refuse the model if its train-mode forward differs from its eval-mode forward after
    :func:`disable_dropout` (e.g. router noise in training): the update would optimise another function than
    the one the rollout scored."""
    probe = _probe_ids(causal_lm)
    mask = torch.ones_like(probe)
    modes = [(module, module.training) for module in causal_lm.modules()]
    try:
        with torch.no_grad():
            causal_lm.eval()
            evaluated = causal_lm(input_ids=probe, attention_mask=mask, use_cache=False).logits
            causal_lm.train()
            trained = causal_lm(input_ids=probe, attention_mask=mask, use_cache=False).logits
    finally:
        for module, training in modes:
            module.training = training
    difference = _max_relative_difference(trained, evaluated)
    if difference > PROBE_TOLERANCE:
        raise ModelError(
            f"{type(causal_lm).__name__} computes differently in train mode than in eval mode even with "
            f"every dropout rate set to 0 (difference {difference:.2e} on a probe input), e.g. through "
            "router noise. The RLOO update would optimise another function than the one the rollout scored, "
            "so this model is refused"
        )


class _eval_mode:
    """Context manager: the module in eval mode for the body, its train/eval flags restored after."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.modes: list[tuple[nn.Module, bool]] = []

    def __enter__(self) -> None:
        self.modes = [(module, module.training) for module in self.module.modules()]
        self.module.eval()

    def __exit__(self, *exc: object) -> None:
        for module, training in self.modes:
            module.training = training
