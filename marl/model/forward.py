"""Forward passes of a PEFT causal LM under one adapter view: the view, hidden states, per-token
log-probabilities and entropies in float32, and reward scores.
:class:`~marl.model.multi_adapter.MultiAdapterModel` computes with these; so can any PEFT model that carries
marl's adapters (a TRL trainer's, :mod:`marl.integrations.trl`).

A view is the policy (its LoRA active), its reference (adapters disabled, or the frozen copy of its starting
weights), or a reward adapter. :func:`adapter_view` enters one without changing which parameters train, and
leaving it restores the previous active adapter, every parameter's ``requires_grad`` and every module's
train/eval mode exactly, also when the body raises.

Log-probs and scores are computed from the backbone's last hidden state (:func:`hidden_states`), never from
the model's full ``[batch, time, vocab]`` logits: the LM head runs a chunk of positions at a time
(:func:`logprobs_from_hidden`), a reward's score head reads one position per row (:func:`reward_scores`).

A float32 log-softmax over ``[batch, time, vocab]`` is the largest tensor of an RLHF step (for a 50k
vocabulary, 512 tokens and 64 rows it is 6.6 GB). The log-prob functions work ``chunk_size`` positions at a
time: the chosen token's log-probability is ``logit[token] - logsumexp``, the entropy is ``-sum(p * log p)``;
only the per-position results are kept. :func:`logprobs_from_hidden` also applies the LM head per chunk, and
with ``recompute=True`` keeps no chunk's logits for the backward pass (they are recomputed there).

Why this head and not TRL 1.16's fused one (``add_fused_lm_head``, trl/trainer/utils.py:1548, a Triton kernel
over tiles of positions on CUDA), which GRPOTrainer installs on the base model under its PEFT wrapper
(grpo_trainer.py:1068):

- One label per position there: its forward shifts the row's own tokens (``labels[:, 1:]``) and scores each
  position against the next token of the same row (utils.py:1616-1654). marl's packed rows
  (:mod:`marl.model.rows`) hold a prompt once followed by its k completions, so the prompt's last
  position predicts k first tokens, one per completion (``PackedRows.predictors`` gathers that hidden state
  k times), and every completion token is predicted by its own completion's previous token, not by the
  token before it in the packed row. Here the head runs after that gather, on ``[N, hidden]`` rows with one
  target each, which any layout (packed, unshared, the planner's probes) reduces to.
- A LoRA on the LM head (``lora_target_modules`` naming it): TRL's kernel reads ``lm_head.weight`` and
  ``.bias`` (utils.py:1633), which on a PEFT LoRA layer are its base layer's
  (peft/tuners/tuners_utils.py:1943-1961), so the adapter's update to the head is left out; here the head is
  called as a module (:class:`marl.model.families.LogitHead`), PEFT's layer included, with the family's
  logit transform (soft-cap, scaling) after it.

Example:
    >>> selective_log_softmax(torch.tensor([[1.0, 2.0, 1.0, 1.0]]), torch.tensor([1]))
    tensor([-0.7437])
    >>> with adapter_view(peft_model, "reward"), inference(peft_model):  # doctest: +SKIP
    ...     hidden = hidden_states(peft_model, input_ids, attention_mask)
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from peft import PeftModel
from peft.tuners.tuners_utils import BaseTunerLayer
from torch import nn
from torch.utils.checkpoint import checkpoint

from marl.model.adapters import RewardAdapter
from marl.model.families import backbone
from marl.model.rows import PackedRows, read_slots

DEFAULT_CHUNK_SIZE = 1024


# ------------------------------------------------------------------ the view


@dataclass
class _ViewState:
    active_adapter: str
    adapters_disabled: bool
    requires_grad: list[tuple[nn.Parameter, bool]]
    training: list[tuple[nn.Module, bool]]


def adapters_disabled(peft_model: PeftModel) -> bool:
    """Whether ``peft_model``'s adapter layers are disabled (inside ``disable_adapter()``)."""
    for module in peft_model.modules():
        if isinstance(module, BaseTunerLayer):
            return module.disable_adapters
    return False


def capture_view(peft_model: PeftModel) -> _ViewState:
    """What a view changes on ``peft_model``: the active adapter, whether adapters are disabled, every
    parameter's ``requires_grad`` and every module's train/eval mode."""
    return _ViewState(
        active_adapter=peft_model.active_adapter,
        adapters_disabled=adapters_disabled(peft_model),
        requires_grad=[(p, p.requires_grad) for p in peft_model.parameters()],
        training=[(m, m.training) for m in peft_model.modules()],
    )


def restore_view(peft_model: PeftModel, state: _ViewState) -> None:
    """Put back exactly what :func:`capture_view` recorded (``set_adapter`` flips ``requires_grad``: the
    recorded flags are restored after it)."""
    tuner = peft_model.base_model
    if state.adapters_disabled:
        tuner.disable_adapter_layers()
    else:
        tuner.enable_adapter_layers()
    peft_model.set_adapter(state.active_adapter)
    if state.adapters_disabled:
        tuner.disable_adapter_layers()
    for parameter, requires_grad in state.requires_grad:
        parameter.requires_grad_(requires_grad)
    for module, training in state.training:
        module.training = training


@contextlib.contextmanager
def adapter_view(peft_model: PeftModel, adapter_name: str | None) -> Iterator[None]:
    """Any PEFT model with adapter ``adapter_name`` active (``None``: adapters disabled) for the body; on
    exit, also on an exception, everything :func:`capture_view` records is restored. Which parameters train is
    not changed inside either: switching must not make a frozen adapter trainable.

    Example:
        >>> with adapter_view(peft_model, "reward"):  # doctest: +SKIP
        ...     hidden = peft_model(input_ids).logits
    """
    state = capture_view(peft_model)
    try:
        tuner = peft_model.base_model
        if adapter_name is None:
            tuner.disable_adapter_layers()
        else:
            tuner.enable_adapter_layers()
            peft_model.set_adapter(adapter_name)
        for parameter, requires_grad in state.requires_grad:
            parameter.requires_grad_(requires_grad)
        yield
    finally:
        restore_view(peft_model, state)


@contextlib.contextmanager
def inference(peft_model: nn.Module) -> Iterator[None]:
    """Eval mode (no dropout) and no grad for the body; every module's train/eval flag restored after."""
    training = [(m, m.training) for m in peft_model.modules()]
    peft_model.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        for module, flag in training:
            module.training = flag


# ------------------------------------------------------------------ hidden states and reward scores


def reward_read_positions(
    input_ids: torch.Tensor, attention_mask: torch.Tensor, pad_token_id: int
) -> torch.Tensor:
    """Where a sequence classifier reads each row's score: the last token that is not ``pad_token_id``, once
    every masked position holds that id. This is the rule of transformers' ``*ForSequenceClassification``
    (and so of TRL's ``RewardTrainer``): when pad == eos, a final EOS counts as padding and the score is read
    at the token before it.

    Example:
        >>> ids = torch.tensor([[0, 5, 6, 2], [5, 6, 7, 8]])
        >>> mask = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]])
        >>> reward_read_positions(ids, mask, pad_token_id=2)  # pad == eos == 2: row 0 is read before its EOS
        tensor([2, 3])
    """
    ids = input_ids.masked_fill(attention_mask == 0, pad_token_id)
    positions = torch.arange(ids.shape[1], device=ids.device)
    return (positions * (ids != pad_token_id).long()).argmax(dim=1)


def without_autocast(device: torch.device) -> contextlib.AbstractContextManager:
    """A region where float32 math stays float32 on ``device``: mixed precision (``accelerator.autocast()``)
    would otherwise run an ``nn.Linear`` in bf16/fp16 whatever its weights' and inputs' dtype.

    Example:
        >>> with torch.autocast("cpu", dtype=torch.bfloat16), without_autocast(torch.device("cpu")):
        ...     torch.nn.Linear(2, 1)(torch.ones(1, 2)).dtype
        torch.float32
    """
    if torch.amp.is_autocast_available(device.type):
        return torch.autocast(device.type, enabled=False)
    return contextlib.nullcontext()  # no autocast exists for this device type, so none can be active


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions counted over real tokens only, as ``generate`` does, so a left-padded row sees the same
    positions as the unpadded one (padding gets position 0; it is masked anyway).

    Example:
        >>> position_ids_from_mask(torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]]))
        tensor([[0, 0, 0, 1],
                [0, 1, 2, 3]])
    """
    return (attention_mask.long().cumsum(dim=1) - 1).clamp(min=0)


def enable_gradient_checkpointing(causal_lm: torch.nn.Module) -> None:
    """Recompute activations in the backward pass; active in train mode.

    Non-reentrant, so the LoRA weights inside a recomputed layer get their gradients without the input
    embeddings' output requiring grad, on quantized and plain bases alike. transformers registers a hook that
    makes it require grad anyway (for reentrant checkpointing); it is removed: its ``requires_grad_`` call in
    every forward is a graph break that sends a compiled decode step back to eager on CUDA
    (benchmarks/results/2026-11-26-gpu-h200.md), and it only adds input-gradient work to the backward pass."""
    if not causal_lm.is_activation_checkpointing:
        causal_lm.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    causal_lm.disable_input_require_grads()


def hidden_states(
    peft_model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """Last hidden state (after the final norm) of a PEFT causal LM under its active adapter, skipping the LM
    head. A 2-D mask gives positions over real tokens; a 4-D mask (packed rows) comes with its own
    ``position_ids``."""
    output = backbone(peft_model.get_base_model())(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids_from_mask(attention_mask) if position_ids is None else position_ids,
        use_cache=False,
    )
    return output.last_hidden_state


def reward_scores(
    peft_model: torch.nn.Module,
    reward: RewardAdapter,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    packed: PackedRows | None = None,
) -> torch.Tensor:
    """One float32 score per row of reward adapter ``reward`` on any PEFT causal LM that carries it (see
    :meth:`MultiAdapterModel.compute_reward_score`): in eval mode without grad, the active adapter, every
    ``requires_grad`` flag and every train/eval mode restored after, also on an exception.

    Example:
        >>> reward_scores(peft_model, reward, ids, mask)  # doctest: +SKIP
        tensor([0.4100, -1.2000])
    """
    read_at = reward_read_positions(input_ids, attention_mask, reward.pad_token_id)
    with adapter_view(peft_model, reward.name), inference(peft_model):
        if packed is None:
            hidden = hidden_states(peft_model, input_ids, attention_mask)
            pooled = hidden[torch.arange(hidden.shape[0], device=hidden.device), read_at.to(hidden.device)]
        else:
            hidden = hidden_states(peft_model, packed.input_ids, packed.attention_mask, packed.position_ids)
            pooled = hidden.reshape(-1, hidden.shape[-1])[read_slots(packed, read_at)]
        pooled = pooled.to(device=reward.head.weight.device, dtype=torch.float32)
        with without_autocast(pooled.device):
            return reward.head(pooled).squeeze(-1)


# ------------------------------------------------------------------ log-probabilities, chunked over positions


def _check_temperature(temperature: float) -> None:
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}; use 1.0 for the unscaled distribution")


def selective_log_softmax(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    temperature: float = 1.0,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """Log-probability of ``tokens`` under ``softmax(logits / temperature)``, in float32.

    ``logits`` is ``[..., vocab]`` in any float dtype, ``tokens`` the matching ``[...]`` integer ids. Rows are
    upcast to float32 ``chunk_size`` at a time (default 1024), so the float32 copy that exists at once is
    at most ``chunk_size x vocab``. Differentiable.

    Example:
        >>> logits = torch.tensor([[1.0, 2.0, 1.0, 1.0]])
        >>> selective_log_softmax(logits, torch.tensor([1]))
        tensor([-0.7437])
    """
    _check_temperature(temperature)
    if logits.shape[:-1] != tokens.shape:
        raise ValueError(
            f"logits {tuple(logits.shape)} and tokens {tuple(tokens.shape)} disagree: tokens must have the "
            f"shape "
            "of logits without the vocabulary dimension"
        )
    vocab = logits.shape[-1]
    flat_logits = logits.reshape(-1, vocab)
    flat_tokens = tokens.reshape(-1, 1).long()
    step = chunk_size or DEFAULT_CHUNK_SIZE
    pieces = []
    for start in range(0, flat_logits.shape[0], step):
        scaled = flat_logits[start : start + step].float() / temperature
        token_logit = scaled.gather(-1, flat_tokens[start : start + step]).squeeze(-1)
        pieces.append(token_logit - torch.logsumexp(scaled, dim=-1))
    if not pieces:
        return logits.new_zeros(tokens.shape, dtype=torch.float32)
    return torch.cat(pieces).reshape(tokens.shape)


def entropy_from_logits(
    logits: torch.Tensor, temperature: float = 1.0, chunk_size: int | None = None
) -> torch.Tensor:
    """Entropy (nats) of ``softmax(logits / temperature)`` over the last dimension, in float32, chunked by
    rows.

    Example:
        >>> entropy_from_logits(torch.zeros(1, 4))  # uniform over 4 tokens: log(4)
        tensor([1.3863])
    """
    _check_temperature(temperature)
    vocab = logits.shape[-1]
    flat_logits = logits.reshape(-1, vocab)
    step = chunk_size or DEFAULT_CHUNK_SIZE
    pieces = []
    for start in range(0, flat_logits.shape[0], step):
        scaled = flat_logits[start : start + step].float() / temperature
        # -sum(p * log p) rather than logsumexp(z) - sum(p * z): the latter subtracts two large, nearly equal
        # numbers when the distribution is peaked.
        log_probabilities = scaled - torch.logsumexp(scaled, dim=-1, keepdim=True)
        pieces.append(-(log_probabilities.exp() * log_probabilities).sum(-1))
    if not pieces:
        return logits.new_zeros(logits.shape[:-1], dtype=torch.float32)
    return torch.cat(pieces).reshape(logits.shape[:-1])


def logprobs_from_hidden(
    hidden: torch.Tensor,
    targets: torch.Tensor,
    head: Callable[[torch.Tensor], torch.Tensor],
    temperature: float = 1.0,
    *,
    chunk_size: int | None = None,
    with_entropy: bool = False,
    recompute: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Float32 log-probabilities of ``targets`` ``[N]`` under ``softmax(head(hidden) / temperature)`` for
    hidden states ``[N, hidden_size]``, ``chunk_size`` positions at a time (default 1024).

    With ``recompute`` (and gradients enabled) a chunk's logits are not kept for the backward pass but
    recomputed there: the update then holds ``chunk_size x vocab`` logits at most instead of ``N x vocab``.
    With ``with_entropy`` the entropy of each position's distribution comes too (detached: a metric).

    Example:
        >>> head = torch.nn.Linear(2, 4, bias=False)
        >>> with torch.no_grad():
        ...     _ = head.weight.copy_(torch.tensor([[1.0, 0.0], [2.0, 0.0], [1.0, 0.0], [1.0, 0.0]]))
        >>> logprobs_from_hidden(torch.tensor([[1.0, 0.0]]), torch.tensor([1]), head)
        tensor([-0.7437], grad_fn=<CatBackward0>)
    """
    step = chunk_size or DEFAULT_CHUNK_SIZE
    logprob_pieces: list[torch.Tensor] = []
    entropy_pieces: list[torch.Tensor] = []

    def chunk_logprobs(hidden_chunk: torch.Tensor, target_chunk: torch.Tensor, index: int) -> torch.Tensor:
        logits = head(hidden_chunk)
        # The entropy comes from the same logits (no second LM head product), on the chunk's first run only:
        # with ``recompute`` the backward pass runs it again.
        if with_entropy and len(entropy_pieces) == index:
            with torch.no_grad():
                entropy_pieces.append(entropy_from_logits(logits.detach(), temperature, chunk_size=step))
        return selective_log_softmax(logits, target_chunk, temperature, chunk_size=step)

    for index, start in enumerate(range(0, hidden.shape[0], step)):
        hidden_chunk, target_chunk = hidden[start : start + step], targets[start : start + step]
        if recompute and torch.is_grad_enabled():
            piece = checkpoint(chunk_logprobs, hidden_chunk, target_chunk, index, use_reentrant=False)
        else:
            piece = chunk_logprobs(hidden_chunk, target_chunk, index)
        logprob_pieces.append(piece)
    logprobs = torch.cat(logprob_pieces) if logprob_pieces else hidden.new_zeros(0, dtype=torch.float32)
    if with_entropy:
        return logprobs, torch.cat(entropy_pieces) if entropy_pieces else logprobs.detach().clone()
    return logprobs
