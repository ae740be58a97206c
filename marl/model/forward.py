"""Forward passes under the active view: token log-probs (plain and packed by prompt), reward scores and
sampling. :class:`ForwardPasses` is the part of :class:`~marl.model.multi_adapter.MultiAdapterModel` that
computes; the view it computes under is picked with :mod:`marl.model.views`.

Log-probs and scores are computed from the backbone's last hidden state, never from the model's full
``[batch, time, vocab]`` logits: the LM head runs a chunk of positions at a time (:mod:`marl.model.logprobs`),
a reward's score head reads one position per row.

Example:
    >>> with model.policy():  # doctest: +SKIP
    ...     logprobs = model.token_logprobs(ids, mask, response_start=8, temperature=0.7)
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from marl.model.families import LogitHead, backbone
from marl.model.generation import SamplingSettings, sample
from marl.model.logprobs import logprobs_from_hidden
from marl.model.packing import PackedRows, read_slots
from marl.model.records import RewardAdapter
from marl.model.routing import RowRoutes
from marl.model.static_decode import sample_static
from marl.model.views import AdapterViews, adapter_view, inference


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
    every forward is a graph break that made the compiled decode step fall back to eager on CUDA (torch 2.11),
    and it only adds input-gradient work to the backward pass."""
    if not causal_lm.is_activation_checkpointing:
        causal_lm.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    causal_lm.disable_input_require_grads()


class ForwardPasses(AdapterViews):
    """Log-probs, reward scores and samples of the active view (see the module docstring)."""

    logit_head: LogitHead

    @property
    def gradient_checkpointing(self) -> bool:
        """Whether activations are recomputed in the backward pass (in train mode)."""
        return bool(self.peft_model.get_base_model().is_activation_checkpointing)

    def _hidden_states(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        return hidden_states(self.peft_model, input_ids, attention_mask, position_ids)

    def _logprobs(
        self,
        hidden: torch.Tensor,
        targets: torch.Tensor,
        temperature: float,
        with_entropy: bool,
        chunk_size: int | None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Log-probs (and entropies) of ``targets`` ``[B, T]`` predicted by ``hidden`` ``[B, T, H]``."""
        batch, steps = targets.shape
        result = logprobs_from_hidden(
            hidden.reshape(batch * steps, -1),
            targets.reshape(-1).to(hidden.device),
            self.logit_head,
            temperature,
            chunk_size=chunk_size,
            with_entropy=with_entropy,
            # trading compute for memory: with checkpointing on, no chunk's logits wait for the backward pass
            recompute=self.gradient_checkpointing,
        )
        if with_entropy:
            return result[0].reshape(batch, steps), result[1].reshape(batch, steps)
        return result.reshape(batch, steps)

    def token_logprobs(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        *,
        response_start: int,
        temperature: float = 1.0,
        with_entropy: bool = False,
        chunk_size: int | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Float32 log-probs of ``input_ids[:, response_start:]``, each given its prefix, under the ACTIVE
        view.

        Pick the view with :meth:`policy` / :meth:`reference`. Logits are divided by ``temperature`` (use the
        sampling temperature). The LM head and the float32 log-softmax run ``chunk_size`` token positions at a
        time (default 1024), so no full ``[B, T, V]`` float32 tensor exists; with gradient checkpointing on,
        no chunk's logits are kept for the backward pass either
        (:func:`marl.model.logprobs.logprobs_from_hidden`).
        Gradients flow if grad is enabled. No masking is applied: the caller masks padding. Positions follow
        the attention mask (as ``generate``), so left padding does not shift them.

        Returns ``logprobs`` ``[B, T - response_start]``, and with ``with_entropy=True`` also the entropy
        of the temperature-scaled distribution at each of those positions (detached: it is a metric).

        Example:
            >>> with model.policy():  # doctest: +SKIP
            ...     logprobs = model.token_logprobs(ids, mask, response_start=8, temperature=0.7)
        """
        length = input_ids.shape[1]
        if not 0 < response_start < length:
            raise ValueError(
                f"response_start must be in [1, {length - 1}] for sequences of length {length}, got "
                f"{response_start}"
            )
        hidden = self._hidden_states(input_ids, attention_mask)[:, response_start - 1 : -1]
        return self._logprobs(hidden, input_ids[:, response_start:], temperature, with_entropy, chunk_size)

    def packed_token_logprobs(
        self,
        packed: PackedRows,
        *,
        temperature: float = 1.0,
        with_entropy: bool = False,
        chunk_size: int | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """:meth:`token_logprobs` of every completion of ``packed`` (rows grouped by prompt, see
        :mod:`marl.model.packing`): the same numbers up to float rounding, each prompt computed once. Returns
        ``[R, T]`` in the order the rows were packed in."""
        hidden = self._hidden_states(packed.input_ids, packed.attention_mask, packed.position_ids)
        flat = hidden.reshape(-1, hidden.shape[-1])
        targets = packed.input_ids.reshape(-1)[packed.completion_slots]
        return self._logprobs(flat[packed.predictors], targets, temperature, with_entropy, chunk_size)

    def compute_reward_score(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        name: str | None = None,
        packed: PackedRows | None = None,
    ) -> torch.Tensor:
        """One float32 score per row under reward adapter ``name`` (default: the first one): its score head
        on the final hidden state where a transformers sequence classifier reads it
        (:func:`reward_read_positions`), with the padding id the reward adapter was trained with.

        That padding id is the one ``marl train-reward`` recorded in the adapter folder, else the base
        tokenizer's pad token (its EOS when it has none), which is what TRL's ``RewardTrainer`` uses. With
        pad == eos a completion ending in EOS is therefore read at the token before its EOS, as the adapter
        was trained. Left or right padding: masked positions are padding. Runs in eval mode without grad; the
        active adapter and modes are restored after. The head runs in float32, under autocast too (the
        backbone keeps the caller's mixed precision). ``packed``: the same rows
        packed by prompt (:mod:`marl.model.packing`), to compute each prompt once; the scores are the same.

        Example:
            >>> scores = model.compute_reward_score(ids, mask)  # doctest: +SKIP
        """
        return reward_scores(self.peft_model, self.get_reward(name), input_ids, attention_mask, packed)

    def sample(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        settings: SamplingSettings,
        past_key_values: Any = None,
    ) -> torch.Tensor:
        """Sample completions from ``softmax(logits / temperature)`` under the ACTIVE view, in eval mode
        without grad; returns ``[batch, settings.max_new_tokens]`` completion ids. The model's own generation
        config (a repetition penalty, top-k, ...) does not apply: see :func:`marl.model.generation.sample`.

        Example:
            >>> with model.policy():  # doctest: +SKIP
            ...     completions = model.sample(ids, mask, SamplingSettings(0.7, 16, (eos,), pad))
        """
        with self._inference():
            return sample(self.peft_model, input_ids, attention_mask, settings, past_key_values)

    def sample_static(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        settings: SamplingSettings,
        copies: int = 1,
        routes: RowRoutes | None = None,
    ) -> torch.Tensor:
        """:meth:`sample` over a static KV cache, each prompt prefilled once for its ``copies`` samples
        (prompt-major rows, see :func:`marl.model.static_decode.sample_static`), in eval mode without grad.
        ``routes``: inside :meth:`routed` with these routes, one name per prompt: each prompt's rows decode
        under its own adapter.

        Example:
            >>> with model.policy():  # doctest: +SKIP
            ...     rows = model.sample_static(ids, mask, SamplingSettings(0.7, 16, (eos,), pad), copies=4)
        """
        with self._inference():
            return sample_static(self.peft_model, input_ids, attention_mask, settings, copies, routes=routes)


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
    :meth:`ForwardPasses.compute_reward_score`): in eval mode without grad, the active adapter, every
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
