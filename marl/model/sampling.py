"""Sampling exactly from the distribution that the log-probs score, ``softmax(logits / temperature)``: with
``generate`` (:func:`sample`), or with a static KV cache, one prefill per prompt and a plain decode loop that
draws exactly what ``generate`` draws (:func:`sample_static`).

``generate`` applies every logits processor of the model's ``generation_config.json`` (Qwen2.5-Instruct ships
``repetition_penalty=1.05``–``1.1``; others ship ``top_k``, ``top_p``, ``min_p``, ``no_repeat_ngram_size``,
suppressed tokens, ``min_new_tokens``...), and merges a ``GenerationConfig`` passed to it with the model's.
The RLOO ratio, the KL and the policy gradient all assume the completion was drawn from
``softmax(logits / T)``, so :func:`sample` runs ``generate`` with the model's own generation config set aside,
checks the processor list that ``generate`` builds (only the temperature warper may remain) and refuses
anything else with an error.

Several terminators: a model's ``generation_config.eos_token_id`` may be a list (Llama-3.x-Instruct ends turns
with ``<|eot_id|>`` as well as ``<|end_of_text|>``); :func:`eos_token_ids` gathers them all.

:func:`sample_static` prefills each prompt ONCE into a transformers ``StaticCache`` sized prompt + response,
repeats that cache for the prompt's ``copies`` samples, and decodes one token per step for every unfinished
row: no logits processors, stopping criteria or cache bookkeeping run per token, and rows that have ended
leave the batch (their KV rows are dropped), so they stop costing compute.

Its random stream is ``generate``'s: each step draws ``torch.multinomial(softmax(logits / T), 1)`` over ALL
rows of the chunk, finished ones included (``multinomial`` consumes the same random numbers whatever the
probabilities, so a finished row gets a placeholder distribution), and the loop ends when every row has
stopped or the length limit is reached, as ``generate``'s does. With the same seed and the same rows it draws
the same tokens as :func:`sample`, up to floating-point rounding of the logits (a
static and a growing cache add the attention terms in another order).

With ``settings.synced_processes`` (a base sharded over processes: every forward pass is a collective) the
processes agree after every step whether any row of any process still decodes (one all-reduce); a process
whose rows have all stopped keeps ONE of them in the batch and runs its forward passes, drawing nothing, until
every process is done, as ``generate(..., synced_gpus=True)`` does. Its tokens and random stream are those of
a run without the flag.

:func:`static_decode_problem` says why a model cannot use it (recurrent layers in the cache: the sampler then
samples with ``generate``).

Example:
    >>> settings = SamplingSettings(temperature=0.7, max_new_tokens=16, stop_token_ids=(2,), pad_token_id=0)
    >>> exact_generation_config(settings).top_k
    0
    >>> from transformers import LlamaConfig, LlamaForCausalLM
    >>> llama = LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1,
    ...     num_attention_heads=4, vocab_size=32))
    >>> static_decode_problem(llama) is None
    True
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from transformers import GenerationConfig

from marl.errors import ModelError
from marl.model.rows import RowRoutes


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


# ------------------------------------------------------------------ the static-cache decode loop

# A decode step: (input ids [A, 1], attention mask [A, S], position ids [A, 1], cache) -> logits [A, 1, V].
DecodeStep = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, Any], torch.Tensor]


def static_decode_problem(causal_lm: nn.Module) -> str | None:
    """Why ``causal_lm`` cannot decode over a ``StaticCache`` of attention keys and values, or ``None``.

    Layers whose cache holds something else (Mamba / linear-attention states of hybrid models such as
    Falcon-H1) cannot be repeated for k samples nor have finished rows dropped, so those models sample with
    ``generate``.

    Example:
        >>> from transformers import GPT2Config, GPT2LMHeadModel
        >>> static_decode_problem(GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=1, n_head=2))) is None
        True
    """
    from transformers import StaticCache
    from transformers.cache_utils import StaticLayer, StaticSlidingWindowLayer

    try:
        cache = StaticCache(config=causal_lm.config, max_cache_len=8)
    except (KeyError, ValueError, TypeError, NotImplementedError) as error:
        return f"transformers has no static cache for model_type {causal_lm.config.model_type!r} ({error})"
    others = sorted({type(layer).__name__ for layer in cache.layers} - {"StaticLayer"})
    if any(type(layer) not in (StaticLayer, StaticSlidingWindowLayer) for layer in cache.layers):
        return f"its cache has {others} layers, which hold states other than attention keys and values"
    return None


def drawn_logprobs(probs: torch.Tensor, drawn: torch.Tensor) -> torch.Tensor:
    """Each row's log-probability of its drawn token ``[A]``, from the probabilities ``[A, V]`` it was drawn
    from: a gather and a log, no second softmax.

    Example:
        >>> drawn_logprobs(torch.tensor([[0.25, 0.75], [0.5, 0.5]]), torch.tensor([1, 0])).exp().tolist()
        [0.75, 0.5]
    """
    return probs.gather(1, drawn.unsqueeze(1)).squeeze(1).log()


def stacked_logprobs(steps: list[torch.Tensor], rows: int, length: int, device: torch.device) -> torch.Tensor:
    """The per-step log-probs a decode appended (``token_logprobs``) as ``[rows, length]`` float32, zeros
    after the last step it ran (a decode whose rows all stopped early).

    Example:
        >>> stacked_logprobs([torch.tensor([-1.0, -2.0])], 2, 3, torch.device("cpu")).tolist()
        [[-1.0, 0.0, 0.0], [-2.0, 0.0, 0.0]]
    """
    out = torch.zeros(rows, length, dtype=torch.float32, device=device)
    if steps:
        out[:, : len(steps)] = torch.stack(steps, dim=1)
    return out


def _forward_step(peft_model: nn.Module) -> DecodeStep:
    def step(ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, cache: Any) -> torch.Tensor:
        return peft_model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions,
            **cache_argument(peft_model, cache),
            use_cache=True,
            logits_to_keep=1,
        ).logits

    return step


def _repeat_rows(cache: Any, copies: int) -> None:
    """Each row of every layer of ``cache`` repeated ``copies`` times (row ``i`` becomes ``i * copies`` to
    ``i * copies + copies - 1``): the prompt's keys and values for its samples."""
    for layer in cache.layers:
        layer.keys = layer.keys.repeat_interleave(copies, dim=0)
        layer.values = layer.values.repeat_interleave(copies, dim=0)
        layer.batch_size = layer.keys.shape[0]


def _keep_rows(cache: Any, rows: torch.Tensor) -> None:
    """Only ``rows`` of every layer of ``cache`` stay (finished rows leave the decode batch)."""
    for layer in cache.layers:
        layer.keys = layer.keys.index_select(0, rows)
        layer.values = layer.values.index_select(0, rows)
        layer.batch_size = layer.keys.shape[0]


def sample_static(
    peft_model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    settings: SamplingSettings,
    copies: int = 1,
    decode_step: DecodeStep | None = None,
    scores: list[torch.Tensor] | None = None,
    routes: RowRoutes | None = None,
    token_logprobs: list[torch.Tensor] | None = None,
) -> torch.Tensor:
    """``copies`` completions of each left-padded prompt under the ACTIVE adapter view, prompt-major (row
    ``i * copies + j`` is sample ``j`` of prompt ``i``, as ``generate`` on ``input_ids.repeat_interleave``
    orders them): ``[P * copies, settings.max_new_tokens]`` ids, ``settings.pad_token_id`` after a row
    stopped. The caller chooses eval mode and ``torch.no_grad``; ``decode_step`` replaces the model call of
    the decode steps (e.g. a compiled one). ``scores``: a list that receives each step's ``logits / T``
    ``[P * copies, V]`` (zeros on rows that had stopped), as ``generate(..., output_scores=True)`` returns
    them. ``routes``: the adapter of each prompt (one name per row of ``input_ids``), read by the routing
    hooks the caller installed (:meth:`marl.MultiAdapterModel.routed`); before every step the decode names
    the rows still in the batch, each after its prompt. ``token_logprobs``: a list that receives each step's
    log-probability of the drawn token under the distribution it was drawn from ``[P * copies]`` (a finished
    row's is that of its placeholder: read it only where the completion's mask is set).
    """
    from transformers import StaticCache

    prompts, prompt_length = input_ids.shape
    steps = settings.max_new_tokens
    rows = prompts * copies
    device = input_ids.device
    step = decode_step or _forward_step(peft_model)
    cache = StaticCache(config=peft_model.get_base_model().config, max_cache_len=prompt_length + steps)
    positions = (attention_mask.long().cumsum(dim=1) - 1).clamp(min=0)
    prompt_names = None if routes is None else list(routes.names)
    logits = _forward_step(peft_model)(input_ids, attention_mask, positions, cache)
    _repeat_rows(cache, copies)
    logits = logits[:, -1].float().repeat_interleave(copies, dim=0)

    # Positions and mask of every row over the whole cache: the columns of the response are attended once
    # written (the causal mask hides those not written yet), so the mask keeps one shape for every step.
    next_position = positions[:, -1].repeat_interleave(copies) + 1
    mask = torch.cat(
        [
            attention_mask.repeat_interleave(copies, dim=0),
            torch.ones(rows, steps, dtype=attention_mask.dtype, device=device),
        ],
        dim=1,
    )
    stop_ids = torch.tensor(settings.stop_token_ids, dtype=torch.long, device=device)
    # without a stop token every process decodes every step anyway: nothing to agree on
    synced = settings.synced_processes and bool(settings.stop_token_ids)
    completions = torch.full((rows, steps), settings.pad_token_id, dtype=torch.long, device=device)
    # One distribution per row of the chunk, whatever has finished: finished rows keep a placeholder.
    probs = torch.full((rows, logits.shape[-1]), 1.0 / logits.shape[-1], device=device)
    active = torch.arange(rows, device=device)  # rows still decoding, in the order of the decode batch
    idle = None  # under synced processes, the row that keeps this process's forward passes going once done
    for index in range(steps):
        if idle is None:
            scaled = logits / settings.temperature
            probs[active] = torch.softmax(scaled, dim=-1)
            if scores is not None:
                scores.append(torch.zeros_like(probs).index_copy_(0, active, scaled))
            drawn = torch.multinomial(probs, num_samples=1).squeeze(1)
            completions[active, index] = drawn[active]
            if token_logprobs is not None:
                token_logprobs.append(drawn_logprobs(probs, drawn))
        if index == steps - 1:
            break
        running = ~torch.isin(drawn[active], stop_ids) if idle is None else stop_ids.new_zeros(0).bool()
        here = bool(running.any())
        if not (any_process(here, device) if synced else here):
            break
        if idle is None and not bool(running.all()):
            if here:
                kept = running.nonzero().squeeze(1)
                _keep_rows(cache, kept)
                active = active[kept]
            else:  # every row of this process stopped while another process decodes: one row keeps this
                # process's forward passes (collectives under a sharded base) going; nothing is drawn any more
                _keep_rows(cache, torch.zeros(1, dtype=torch.long, device=device))
                idle = active[:1]
        rows_now = active if idle is None else idle
        tokens = completions[rows_now, index : index + 1]
        if prompt_names is not None:  # each row still decoding keeps its prompt's adapter
            routes.names = [prompt_names[row // copies] for row in rows_now.tolist()]
        logits = step(tokens, mask[rows_now], next_position[rows_now, None] + index, cache)[:, -1].float()
    return completions
