"""Sampling exactly from the distribution that the log-probs score: ``softmax(logits / temperature)``.

``generate`` applies every logits processor of the model's ``generation_config.json`` (Qwen2.5-Instruct ships
``repetition_penalty=1.05``–``1.1``; others ship ``top_k``, ``top_p``, ``min_p``, ``no_repeat_ngram_size``,
suppressed tokens, ``min_new_tokens``...), and merges a ``GenerationConfig`` passed to it with the model's.
The RLOO ratio, the KL and the policy gradient all assume the completion was drawn from
``softmax(logits / T)``, so :func:`sample` runs ``generate`` with the model's own generation config set aside,
checks the processor list that ``generate`` builds (only the temperature warper may remain) and refuses
anything else with an error.

Several terminators: a model's ``generation_config.eos_token_id`` may be a list (Llama-3.x-Instruct ends turns
with ``<|eot_id|>`` as well as ``<|end_of_text|>``); :func:`eos_token_ids` gathers them all.

Example:
    >>> settings = SamplingSettings(temperature=0.7, max_new_tokens=16, stop_token_ids=(2,), pad_token_id=0)
    >>> exact_generation_config(settings).top_k
    0
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from transformers import GenerationConfig

from marl.errors import ModelError


@dataclass(frozen=True)
class SamplingSettings:
    """How the rollout (and ``marl evaluate``) samples: temperature, length, where to stop, what pads.

    ``synced_processes``: every process of the run takes part in every forward pass (a base sharded over the
    processes, where each forward gathers the layers): each process then keeps running forward passes, drawing
    nothing, until the rows of EVERY process have stopped (``generate``'s ``synced_gpus``), instead of
    stopping when its own rows have. The tokens drawn are the same either way.
    """

    temperature: float
    max_new_tokens: int
    stop_token_ids: tuple[int, ...]  # empty: every completion runs to max_new_tokens
    pad_token_id: int
    synced_processes: bool = False


def _as_ids(value: int | Sequence[int] | None) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(token) for token in value]


def eos_token_ids(tokenizer: Any, generation_config: GenerationConfig | None) -> tuple[int, ...]:
    """Every end-of-sequence id: the tokenizer's EOS, then each id of ``generation_config.eos_token_id``.

    Example:
        >>> class Tok: eos_token_id = 2
        >>> eos_token_ids(Tok(), GenerationConfig(eos_token_id=[2, 7, 9]))
        (2, 7, 9)
    """
    ids = _as_ids(getattr(tokenizer, "eos_token_id", None))
    if generation_config is not None:
        ids += _as_ids(generation_config.eos_token_id)
    return tuple(dict.fromkeys(ids))


def pad_token_id(tokenizer: Any) -> int:
    """The id that pads prompts and completions: the tokenizer's pad token, else its EOS (as TRL does)."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if pad is None:
        raise ModelError(
            "the tokenizer has neither a pad token nor an EOS token; set tokenizer.pad_token (e.g. "
            "tokenizer.pad_token = tokenizer.unk_token) before training or evaluating"
        )
    return int(pad)


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


def cache_argument(model: nn.Module, cache: Any) -> dict[str, Any]:
    """``cache`` as the keyword ``model``'s forward takes it: ``cache`` in transformers 5.x (where
    ``past_key_values`` is deprecated), ``past_key_values`` in a model class that has no ``cache`` yet.

    Example:
        >>> from transformers import LlamaConfig, LlamaForCausalLM
        >>> list(cache_argument(LlamaForCausalLM(LlamaConfig(num_hidden_layers=1, hidden_size=8,
        ...     intermediate_size=8, num_attention_heads=2, vocab_size=10)), None))
        ['cache']
    """
    import inspect

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    keyword = "cache" if "cache" in inspect.signature(type(base).forward).parameters else "past_key_values"
    return {keyword: cache}


def exact_generation_config(settings: SamplingSettings) -> GenerationConfig:
    """A ``GenerationConfig`` that samples from ``softmax(logits / temperature)`` and nothing else."""
    return GenerationConfig(
        do_sample=True,
        temperature=settings.temperature,
        top_k=0,
        top_p=1.0,
        max_new_tokens=settings.max_new_tokens,
        eos_token_id=list(settings.stop_token_ids) or None,
        pad_token_id=settings.pad_token_id,
    )


@contextlib.contextmanager
def _without_model_generation_config(causal_lm: nn.Module) -> Iterator[None]:
    """Set the model's own ``generation_config`` aside for the body: ``generate`` fills every setting left
    unset with the model's, and a processor that setting adds would change the distribution sampled."""
    own = causal_lm.generation_config
    causal_lm.generation_config = GenerationConfig()
    try:
        yield
    finally:
        causal_lm.generation_config = own


def logits_processors(
    causal_lm: nn.Module, config: GenerationConfig, input_ids: torch.Tensor, attention_mask: torch.Tensor
) -> list[str]:
    """Names of the logits processors ``generate`` builds for ``config`` on this input, in order.

    Uses ``generate``'s own preparation steps, so the list is what sampling will apply.
    """
    prepared, model_kwargs = causal_lm._prepare_generation_config(config)
    causal_lm._prepare_special_tokens(prepared, True, device=input_ids.device)
    processors = causal_lm._get_logits_processor(
        generation_config=prepared,
        input_ids_seq_length=input_ids.shape[1],
        encoder_input_ids=input_ids,
        device=input_ids.device,
        model_kwargs={**model_kwargs, "attention_mask": attention_mask},
    )
    return [type(processor).__name__ for processor in processors]


# The only processor whose effect the log-probs reproduce (they divide the logits by the temperature).
_EXACT_PROCESSORS = {"TemperatureLogitsWarper"}


def generate_exactly(
    peft_model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    settings: SamplingSettings,
    past_key_values: Any = None,
    **output_options: Any,
) -> Any:
    """``generate`` under the ACTIVE adapter view, sampling from ``softmax(logits / temperature)`` and nothing
    else; returns what ``generate`` returns (``output_options`` such as ``output_scores=True,
    return_dict_in_generate=True`` pass through).

    The model's own ``generation_config`` is set aside for the call, and the processor list ``generate``
    builds is checked first: a processor other than the temperature warper raises an error.
    """
    causal_lm = peft_model.get_base_model()
    config = exact_generation_config(settings)
    with _without_model_generation_config(causal_lm):
        unexpected = [
            name
            for name in logits_processors(causal_lm, config, input_ids, attention_mask)
            if name not in _EXACT_PROCESSORS
        ]
        if unexpected:
            raise ModelError(
                f"generate would apply {unexpected} while sampling; the log-probs (softmax of logits / "
                "temperature) cannot reproduce that, so the RLOO ratio and KL would be wrong. This model's "
                "generation settings are not supported by marl"
            )
        return peft_model.generate(
            input_ids=input_ids,
            attention_mask=attention_mask,
            generation_config=config,
            **cache_argument(peft_model, past_key_values),
            synced_gpus=settings.synced_processes,
            **output_options,
        )


def sample(
    peft_model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    settings: SamplingSettings,
    past_key_values: Any = None,
    **generate_options: Any,
) -> torch.Tensor:
    """Sampled completions under the ACTIVE adapter view (see :func:`generate_exactly`): ``[batch,
    max_new_tokens]`` completion ids, padded with ``settings.pad_token_id`` where ``generate`` stopped early.

    ``past_key_values`` may hold the prompt's cache (all prompt tokens but the last), e.g. one prefill shared
    by k samples of each prompt. ``generate_options`` go to ``generate`` as they are (e.g.
    ``cache_implementation="static"``, which excludes ``past_key_values``). The caller chooses eval mode and
    ``torch.no_grad``.
    """
    output = generate_exactly(
        peft_model, input_ids, attention_mask, settings, past_key_values, **generate_options
    )
    completions = output[:, input_ids.shape[1] :]
    missing = settings.max_new_tokens - completions.shape[1]
    if missing > 0:
        completions = torch.nn.functional.pad(completions, (0, missing), value=settings.pad_token_id)
    return completions


def any_process(flag: bool, device: torch.device) -> bool:
    """Whether ``flag`` holds on any process of the default group (one all-reduce; ``flag`` itself without
    one): the one agreement every loop whose length depends on a process's own data makes, so that the
    processes stay in step.

    Example:
        >>> any_process(True, torch.device("cpu"))
        True
    """
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return flag
    value = torch.tensor([1.0 if flag else 0.0], device=device)
    torch.distributed.all_reduce(value)
    return bool(value.item() > 0)
