"""Per-token log-probabilities and entropies, in float32, chunked over positions.

A float32 log-softmax over ``[batch, time, vocab]`` is the largest tensor of an RLHF step (for a 50k
vocabulary, 512 tokens and 64 rows it is 6.6 GB). Every function here works ``chunk_size`` positions at a
time: the chosen token's log-probability is ``logit[token] - logsumexp``, the entropy is ``-sum(p * log p)``;
only the per-position results are kept. :func:`logprobs_from_hidden` also applies the LM head per chunk, and
with ``recompute=True`` keeps no chunk's logits for the backward pass (they are recomputed there).

Why this head and not TRL 1.16's fused one (``add_fused_lm_head``, trl/trainer/utils.py:1548, a Triton kernel
over tiles of positions on CUDA), which GRPOTrainer installs on the base model under its PEFT wrapper
(grpo_trainer.py:1068):

- One label per position there: its forward shifts the row's own tokens (``labels[:, 1:]``) and scores each
  position against the next token of the same row (utils.py:1616-1654). marl's packed rows
  (:mod:`marl.model.packing`) hold a prompt once followed by its k completions, so the prompt's last
  position predicts k first tokens, one per completion (``PackedRows.predictors`` gathers that hidden state
  k times), and every completion token is predicted by its own completion's previous token, not by the
  token before it in the packed row. Here the head runs after that gather, on ``[N, hidden]`` rows with one
  target each, which any layout (packed, unshared, the planner's probes) reduces to.
- A LoRA on the LM head (``lora_target_modules`` naming it): TRL's kernel reads ``lm_head.weight`` and
  ``.bias`` (utils.py:1633), which on a PEFT LoRA layer are its base layer's
  (peft/tuners/tuners_utils.py:1943-1961), so the adapter's update to the head is left out; here the head is
  called as a module (:class:`marl.model.families.LogitHead`), PEFT's layer included, with the family's
  logit transform (soft-cap, scaling) after it.

Its speed against marl's chunks is not measured yet (the GPU sequence measures whole updates).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.utils.checkpoint import checkpoint

DEFAULT_CHUNK_SIZE = 1024


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
