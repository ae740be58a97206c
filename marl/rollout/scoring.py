"""Scoring sampled completions, with no sampling in it: policy and reference log-probs, and the rows a reward
adapter reads, each prompt computed once for its k completions where that is exact.

Prefix sharing (:mod:`marl.model.rows`) is decided ONCE, when the :class:`Scorer` is built:
:attr:`Scorer.share_prompt_prefix` is what was asked for, unless the model's packing probe failed (a warning
says so). The only per-batch question left is whether a packed batch fits the model's sliding attention
window (:meth:`Scorer.can_pack`). The trainer's update packs its micro-batches with the same scorer.

Example:
    >>> scorer = Scorer(model, tokenizer, temperature=0.7, rows_per_pass=64)  # doctest: +SKIP
    >>> logprobs, ref_logprobs = scorer.logprobs(samples)  # doctest: +SKIP
    >>> scores = reward.score(scorer.scoring_batch(samples))  # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch

from marl.algo.scoring_passes import ALL_PASSES, ScoringPasses
from marl.data.prompts import left_pad, reward_model_ids
from marl.model.adapters import BASE_VIEW
from marl.model.rows import PackedRows, attention_window, pack_rows, packing_mask_dtype
from marl.model.sampling import pad_token_id
from marl.rewards import ScoringBatch, ScoringChunk
from marl.rewards.trl_calls import columns_per_row, parsed_replies, parses_responses

if TYPE_CHECKING:
    from marl.model.multi_adapter import MultiAdapterModel
    from marl.rollout.completions import Samples


class Scorer:
    """Log-probs and reward rows of sampled completions for one model.

    Args:
        model: the multi-adapter model.
        tokenizer: its tokenizer (pad id; the chat template of conversations a reward adapter reads).
        temperature: the sampling temperature: log-probs are those of ``softmax(logits / temperature)``.
        rows_per_pass: rows per chunk of the no-grad forward passes.
        autocast: a context manager factory for mixed precision (e.g. ``accelerator.autocast``).
        policy: the policy adapter scored (default: the model's first policy); its reference is the
            ``"reference"`` view.
        share_prompt_prefix: compute each prompt once for all its completions; switched off, with a
            warning, on a model where that is not exact (:attr:`marl.MultiAdapterModel.packing_problem`).
        passes: which log-prob passes :meth:`logprobs` runs (:mod:`marl.algo.scoring_passes`; default both).
    """

    def __init__(
        self,
        model: MultiAdapterModel,
        tokenizer: Any,
        *,
        temperature: float,
        rows_per_pass: int = 64,
        autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
        policy: str | None = None,
        share_prompt_prefix: bool = True,
        passes: ScoringPasses = ALL_PASSES,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.temperature = temperature
        self.rows_per_pass = rows_per_pass
        self.autocast = autocast
        self.policy = policy or model.default_policy
        self.pad_token_id = pad_token_id(tokenizer)
        self.passes = passes
        self.share_prompt_prefix = share_prompt_prefix and model.packing_problem is None
        if share_prompt_prefix and not self.share_prompt_prefix:
            warnings.warn(
                f"each completion computes its own prompt on this model: {model.packing_problem}",
                stacklevel=2,
            )

    @property
    def device(self) -> torch.device:
        return self.model.device

    # ------------------------------------------------------------------ packing

    def can_pack(
        self, prompt_mask: torch.Tensor, response_ids: torch.Tensor, prompt_index: torch.Tensor
    ) -> bool:
        """Whether rows ``[prompt (left-padded), completion (right-padded)]`` grouped by ``prompt_index`` are
        packed: prefix sharing is on (decided once) and no packed sequence exceeds the model's sliding
        attention window, which depends on the batch."""
        if not self.share_prompt_prefix:
            return False
        window = attention_window(self.model.config)
        group_size = int((prompt_index == prompt_index[0]).sum())
        packed_length = int(prompt_mask.sum(dim=1).max()) + group_size * response_ids.shape[1]
        return window is None or packed_length <= window

    def pack(self, samples: Samples) -> PackedRows | None:
        """``samples`` packed by prompt when :meth:`can_pack` says so, else ``None``."""
        if not self.can_pack(samples.prompt_mask, samples.response_ids, samples.prompt_index):
            return None
        if samples.tool_mask is not None and not samples.prompts_shared():  # an environment changed a prompt
            return None
        return samples.pack(packing_mask_dtype(self.model))

    def chunks(self, samples: Samples) -> Iterator[tuple[torch.Tensor, Samples, PackedRows | None]]:
        """``(rows, those rows' samples, their packed form or None)`` for whole prompt groups at a time, about
        ``rows_per_pass`` rows per chunk."""
        for rows in samples.group_rows(self._groups_per_chunk(samples)):
            chunk = samples.select(rows)
            yield rows, chunk, self.pack(chunk)

    def _groups_per_chunk(self, samples: Samples) -> int:
        return max(1, self.rows_per_pass // samples.group_size)

    # ------------------------------------------------------------------ log-probs

    def completion_logprobs(
        self, samples: Samples, packed: PackedRows | None, with_entropy: bool = False
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Float32 log-probs ``[B, T]`` of the completions under the ACTIVE view, each prompt once when
        ``packed`` is given; the same numbers either way, up to float rounding."""
        if packed is not None:
            return self.model.packed_token_logprobs(
                packed, temperature=self.temperature, with_entropy=with_entropy
            )
        return self.model.token_logprobs(
            samples.query_responses,
            samples.attention_mask,
            response_start=samples.prompt_length,
            temperature=self.temperature,
            with_entropy=with_entropy,
        )

    def logprobs(
        self,
        samples: Samples,
        passes: ScoringPasses | None = None,
        row_policies: Sequence[str] | None = None,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """No-grad float32 log-probs of the completions under the policy and the reference, ``[B, T]``; of
        the passes ``passes`` (default :attr:`passes`) runs, ``None`` for the other. ``row_policies``: the
        policy of each row (rows of several policies, :meth:`rows_view`), instead of :attr:`policy`."""
        passes = self.passes if passes is None else passes
        shape = samples.response_ids.shape
        logprobs, ref_logprobs = (
            torch.empty(shape, dtype=torch.float32, device=self.device) if wanted else None
            for wanted in (passes.policy, passes.reference)
        )
        with torch.no_grad(), self.autocast():
            for rows, chunk, packed in self.chunks(samples) if passes.policy or passes.reference else ():
                names = [self.policy] if row_policies is None else [row_policies[r] for r in rows.tolist()]
                if logprobs is not None:
                    with self.rows_view(names, chunk.prompt_index, packed):
                        logprobs[rows] = self.completion_logprobs(chunk, packed).float()
                if ref_logprobs is not None:
                    with self.rows_view(names, chunk.prompt_index, packed, reference=True):
                        ref_logprobs[rows] = self.completion_logprobs(chunk, packed).float()
        return logprobs, ref_logprobs

    def reference_is_base(self, policies: Sequence[str] | None) -> bool:
        """Whether the reference of every policy of ``policies`` (default :attr:`policy`) is the base with
        adapters disabled, one view for all their rows (not a frozen copy of a policy's starting adapter)."""
        names = [self.policy] if policies is None else dict.fromkeys(policies)
        return all(self.model.get_policy(name).reference_adapter is None for name in names)

    def rows_view(
        self,
        policies: Sequence[str],
        prompt_index: torch.Tensor,
        packed: PackedRows | None,
        reference: bool = False,
    ) -> contextlib.AbstractContextManager:
        """The view a forward of rows of ``policies`` (one per row, or one for all) runs in: the policy's (or
        its reference's) own view when one serves every row, else the rows routed per row
        (:meth:`marl.MultiAdapterModel.routed`): each row through its policy (or its reference: the frozen
        copy of its starting adapter, or the base with adapters disabled). A packed forward has one row per
        prompt group (groups in order of first appearance in ``prompt_index``), named after its group."""
        if len(set(policies)) == 1:
            view = self.model.reference if reference else self.model.policy
            return view(policies[0])
        if packed is not None:
            first_rows = dict.fromkeys(prompt_index.tolist())
            for row, group in enumerate(prompt_index.tolist()):
                first_rows[group] = row if first_rows[group] is None else first_rows[group]
            policies = [policies[row] for row in first_rows.values()]
        if reference:
            if self.reference_is_base(policies):  # the base serves every row: no routing needed
                return self.model.base()
            policies = [self.model.get_policy(name).reference_adapter or BASE_VIEW for name in policies]
        return self.model.routed(policies)

    # ------------------------------------------------------------------ reward rows

    def scoring_batch(self, samples: Samples, trainer_state: Any = None) -> ScoringBatch:
        """``samples`` for the reward sources, with their prompt-group :class:`ScoringChunk` list (packed
        where :meth:`can_pack` says so), made here once so that no reward calls back into the rollout.
        Reward functions also get the completion ids, the prompts' dataset columns and ``trainer_state``.

        Plain prompts are read as sampled: the prompt ids followed by the completion ids. Conversations are
        read as TRL renders them for a reward model (:func:`marl.data.prompts.reward_model_text`): the
        prompt's messages and the completion as the assistant's reply, through the chat template, tokenised
        whole.
        """
        if all(messages is None for messages in samples.prompt_messages):
            input_ids, attention_mask = samples.query_responses, samples.attention_mask
            chunks = [
                ScoringChunk(rows, chunk.query_responses, chunk.attention_mask, packed)
                for rows, chunk, packed in self.chunks(samples)
            ]
        else:
            rows = self.reward_rows(samples)
            input_ids, attention_mask = left_pad(rows, self.pad_token_id)
            input_ids, attention_mask = input_ids.to(self.device), attention_mask.to(self.device)
            chunks = [
                ScoringChunk(
                    chunk_rows,
                    *self.shared_prefix_rows(
                        [rows[i] for i in chunk_rows.tolist()], samples.prompt_index[chunk_rows]
                    ),
                )
                for chunk_rows in samples.group_rows(self._groups_per_chunk(samples))
            ]
        return ScoringBatch(
            samples.prompt_texts,
            samples.completions,
            input_ids,
            attention_mask,
            chunks,
            conversations=samples.prompt_messages,
            completion_ids=samples.completion_ids,
            columns=columns_per_row(samples.prompt_columns),
            trainer_state=trainer_state,
            replies=None if samples.turns else self.replies(samples),
            turns=samples.turns or None,
            environments=samples.environments or None,
        )

    def replies(self, samples: Samples) -> list[dict[str, Any] | None] | None:
        """Each conversation's completion parsed as TRL hands it to reward functions, where the tokenizer
        parses responses (:func:`marl.rewards.trl_calls.parsed_replies`; ``None`` where it does not)."""
        if not parses_responses(self.tokenizer):
            return None
        prompts = [
            ids[mask.bool()].tolist()
            for ids, mask in zip(samples.prompt_ids, samples.prompt_mask, strict=True)
        ]
        return parsed_replies(self.tokenizer, prompts, samples.completion_ids, samples.prompt_messages)

    def reward_rows(self, samples: Samples) -> list[list[int]]:
        """Token ids a reward adapter reads per row: a conversation with the completion as the assistant's
        reply through the chat template (tokenised whole, as TRL does), a plain prompt as sampled."""
        rows = []
        for row, messages in enumerate(samples.prompt_messages):
            if messages is None:
                prompt = samples.prompt_ids[row][samples.prompt_mask[row].bool()]
                completion = samples.response_ids[row][samples.response_mask[row]]
                rows.append(torch.cat([prompt, completion]).tolist())
            else:  # with tools, the completion is its turns and the tools' results between them
                completion = samples.turns[row] if samples.turns else samples.completions[row]
                rows.append(reward_model_ids(self.tokenizer, messages, completion))
        return rows

    def shared_prefix_rows(
        self, rows: list[list[int]], prompt_index: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, PackedRows | None]:
        """``(input_ids, attention_mask, packed or None)`` of token rows grouped by ``prompt_index``.

        A rendered conversation is tokenised whole, so the tokens its completions share are checked, not
        assumed: each group's prefix is the longest run of leading tokens common to all its rows (short of
        each row's last token, so that every completion keeps one). That prefix is packed once per group;
        the rest of each row is its completion. A group with no common token is computed unshared, row by
        row, and so is the chunk it belongs to.
        """
        pad = self.pad_token_id
        prefix = common_prefix_lengths(rows, prompt_index.tolist())
        if min(prefix) < 1:
            input_ids, attention_mask = left_pad(rows, pad)
            return input_ids.to(self.device), attention_mask.to(self.device), None
        prompt_ids, prompt_mask = left_pad([row[:cut] for row, cut in zip(rows, prefix, strict=True)], pad)
        tails, tail_mask = left_pad([row[cut:][::-1] for row, cut in zip(rows, prefix, strict=True)], pad)
        response_ids, response_mask = tails.flip(dims=[1]), tail_mask.flip(dims=[1])  # right-padded
        prompt_ids, prompt_mask, response_ids, response_mask, prompt_index = (
            tensor.to(self.device)
            for tensor in (prompt_ids, prompt_mask, response_ids, response_mask, prompt_index)
        )
        input_ids = torch.cat([prompt_ids, response_ids], dim=1)
        attention_mask = torch.cat([prompt_mask, response_mask], dim=1)
        if not self.can_pack(prompt_mask, response_ids, prompt_index):
            return input_ids, attention_mask, None
        packed = pack_rows(
            prompt_ids,
            prompt_mask,
            response_ids,
            response_mask.bool(),
            prompt_index,
            packing_mask_dtype(self.model),
        )
        return input_ids, attention_mask, packed


def common_prefix_lengths(rows: list[list[int]], groups: list[int]) -> list[int]:
    """Per row, the length of the leading tokens all rows of its group share, short of the shortest row's
    last token (every completion keeps at least one token).

    Example:
        >>> common_prefix_lengths([[5, 6, 7, 8], [5, 6, 9], [20, 21], [20, 21], [3], [4]], [0, 0, 1, 1, 2, 2])
        [2, 2, 1, 1, 0, 0]
    """
    members_of: dict[int, list[int]] = {}
    for position, group in enumerate(groups):
        members_of.setdefault(group, []).append(position)
    prefix = [0] * len(rows)
    for members in members_of.values():
        length = min(len(rows[member]) for member in members) - 1
        first = rows[members[0]]
        for member in members[1:]:
            length = next((t for t in range(length) if rows[member][t] != first[t]), length)
        for member in members:
            prefix[member] = length
    return prefix
