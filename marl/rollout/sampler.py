"""The rollout: prompts in, sampled and scored completions out, with no gradients.

The RLOO trainer, its periodic sample tables and ``marl evaluate`` all sample here, the same way:

1. prompts are tokenised once (:func:`prepare_prompts`) and left-padded per batch (:class:`PromptBatch`);
2. :class:`Sampler` draws ``k`` completions of every prompt from ``softmax(logits / T)`` under a view of the
   model, prefilling each prompt once for its k samples, cuts them after the stop token and decodes them
   (:class:`Samples`, k-major: row ``j * P + i`` is sample ``j`` of prompt ``i``);
3. :meth:`Sampler.logprobs` scores the completions under the policy and the reference by forward passes, in
   float32, at the sampling temperature;
4. :func:`collect_rollout` adds the reward source's scores: a :class:`Rollout` holds everything an update
needs,
   and :meth:`Rollout.select` cuts micro-batches from it.

Example:
    >>> batch = PromptBatch.of([Prompt((5, 6), "a b"), Prompt((7,), "c")], pad_token_id=0)
    >>> batch.ids, batch.mask
    (tensor([[5, 6],
            [0, 7]]), tensor([[1, 1],
            [0, 1]]))
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from marl.data.prompts import is_conversation, left_pad, reward_model_ids, tokenize_prompt
from marl.errors import ConfigError, DataError
from marl.model.generation import SamplingSettings, eos_token_ids, pad_token_id, prompt_cache_can_be_shared
from marl.model.multi_adapter import position_ids_from_mask
from marl.model.packing import PackedRows, attention_window, pack_rows, packing_mask_dtype
from marl.rewards import ScoringBatch, ScoringChunk
from marl.rollout import stops

if TYPE_CHECKING:
    from marl.config import BatchSizes
    from marl.model.multi_adapter import MultiAdapterModel
    from marl.rewards import WeightedRewards


@dataclass(frozen=True)
class Prompt:
    """One tokenised prompt: the ids the model reads, the text shown to reward functions and in tables, and
    for a conversation its messages (reward adapters read the conversation with each completion as the
    assistant's reply, :meth:`Sampler.scoring_batch`)."""

    ids: tuple[int, ...]
    text: str
    messages: list[dict[str, Any]] | None = None


def prepare_prompts(
    dataset: Any, tokenizer: Any, name: str, *, context_length: int | None, response_length: int
) -> list[Prompt]:
    """Tokenise every prompt of ``dataset`` once (a ``prompt`` column of text or conversations rendered with
    the chat template, or an ``input_ids`` column), and check that each fits the context with its completion.
    """
    if dataset is None or len(dataset) == 0:
        raise DataError(f"{name} is empty; pass a dataset with at least one prompt")
    columns = list(dataset.column_names) if hasattr(dataset, "column_names") else list(dataset[0].keys())
    if "prompt" not in columns and "input_ids" not in columns:
        raise DataError(
            f"{name} has no 'prompt' or 'input_ids' column (columns: {columns}). Rename the prompt column, "
            "e.g. "
            "dataset.rename_column('text', 'prompt')"
        )
    use_ids = "prompt" not in columns
    prompts = []
    for index in range(len(dataset)):
        row = dataset[index]
        if use_ids:
            ids = [int(token) for token in row["input_ids"]]
            text = tokenizer.decode(ids, skip_special_tokens=True)
        else:
            ids, text = tokenize_prompt(tokenizer, row["prompt"], f"{name} row {index}")
        if not ids:
            raise DataError(f"{name} row {index} has an empty prompt; remove it or give it text")
        messages = None if use_ids or not is_conversation(row["prompt"]) else list(row["prompt"])
        prompts.append(Prompt(tuple(ids), text, messages))
    longest = max(len(prompt.ids) for prompt in prompts)
    if context_length is not None and longest + response_length > context_length:
        too_long = sum(len(prompt.ids) + response_length > context_length for prompt in prompts)
        raise DataError(
            f"{too_long} prompt(s) of {name} (longest {longest} tokens) plus "
            f"response_length={response_length} "
            f"exceed the model's context of {context_length} tokens. Filter or shorten those prompts, or "
            "lower "
            "--response_length"
        )
    return prompts


def prompts_for_update(
    prompts: Sequence[Prompt], update: int, process_index: int, sizes: BatchSizes, seed: int
) -> list[Prompt]:
    """The prompts of process ``process_index`` for update ``update`` (0-based).

    The order is an endless concatenation of seeded permutations of the dataset, so the data position is a
    function of the update number alone and a resumed run sees the same prompts. Processes take consecutive
    slices of each update's prompts.
    """
    start = update * sizes.prompts_per_update + process_index * sizes.prompts_per_process
    chosen = []
    for position in range(start, start + sizes.prompts_per_process):
        epoch, offset = divmod(position, len(prompts))
        chosen.append(prompts[_epoch_order(seed + epoch, len(prompts))[offset]])
    return chosen


@functools.lru_cache(maxsize=2)
def _epoch_order(seed: int, size: int) -> list[int]:
    return torch.randperm(size, generator=torch.Generator().manual_seed(seed)).tolist()


@dataclass(frozen=True)
class PromptBatch:
    """Prompts left-padded to one width: ``ids`` and ``mask`` are ``[P, L]``."""

    texts: list[str]
    ids: torch.Tensor
    mask: torch.Tensor
    messages: list[list[dict[str, Any]] | None]

    @classmethod
    def of(
        cls, prompts: Sequence[Prompt], pad_token_id: int, device: torch.device | str = "cpu"
    ) -> PromptBatch:
        ids, mask = left_pad([prompt.ids for prompt in prompts], pad_token_id)
        messages = [prompt.messages for prompt in prompts]
        return cls([prompt.text for prompt in prompts], ids.to(device), mask.to(device), messages)


@dataclass
class Samples:
    """Sampled completions, k-major, cut after their stop token. Every tensor has one row per completion."""

    prompt_texts: list[str]
    completions: list[str]
    prompt_ids: torch.Tensor  # [B, L], left-padded
    prompt_mask: torch.Tensor
    response_ids: torch.Tensor  # [B, T]; padding after the stop token
    response_mask: torch.Tensor  # [B, T] bool: the valid tokens, through the stop token
    contains_stop: torch.Tensor  # [B] bool
    contains_eos: torch.Tensor  # [B] bool: an end-of-sequence id among the valid tokens
    prompt_index: torch.Tensor  # [B]: which prompt of the batch each row completes (its group)
    prompt_messages: list[list[dict[str, Any]] | None]  # a conversation's messages, None for a plain prompt

    @property
    def prompt_length(self) -> int:
        return self.prompt_ids.shape[1]

    @property
    def query_responses(self) -> torch.Tensor:
        return torch.cat([self.prompt_ids, self.response_ids], dim=1)

    @property
    def attention_mask(self) -> torch.Tensor:
        return torch.cat([self.prompt_mask, self.response_mask.long()], dim=1)

    @property
    def lengths(self) -> torch.Tensor:
        return self.response_mask.sum(dim=1)

    def pack(self, mask_dtype: torch.dtype) -> PackedRows:
        """These rows packed by prompt (:mod:`marl.model.packing`): each prompt once, then its completions."""
        return pack_rows(
            self.prompt_ids,
            self.prompt_mask,
            self.response_ids,
            self.response_mask,
            self.prompt_index,
            mask_dtype,
        )

    def group_rows(self, groups_per_chunk: int) -> list[torch.Tensor]:
        """The rows of ``groups_per_chunk`` prompts at a time, prompts in order of first appearance."""
        prompts = list(dict.fromkeys(self.prompt_index.tolist()))
        chunks = []
        for start in range(0, len(prompts), groups_per_chunk):
            chosen = torch.tensor(prompts[start : start + groups_per_chunk], device=self.prompt_index.device)
            chunks.append(torch.nonzero(torch.isin(self.prompt_index, chosen)).flatten())
        return chunks

    def select(self, rows: torch.Tensor) -> Samples:
        """The same record for the given rows only (a micro-batch)."""
        positions = rows.tolist()
        values = {}
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            values[field.name] = (
                value[rows] if isinstance(value, torch.Tensor) else [value[i] for i in positions]
            )
        return type(self)(**values)


@dataclass
class Rollout(Samples):
    """Samples with what the update needs: float32 log-probs under the policy at sampling time and under the
    reference ``[B, T]``, the reward's weighted scores ``[B]`` (NaN where no source judged a completion) and
    each source's own scores ``[B, S]``."""

    logprobs: torch.Tensor = None
    ref_logprobs: torch.Tensor = None
    scores: torch.Tensor = None
    source_scores: torch.Tensor = None


class Sampler:
    """Samples and scores completions for one model, tokenizer and sampling setting.

    Args:
        model: the multi-adapter model.
        tokenizer: its tokenizer (pad token, EOS, decoding).
        temperature, response_length: the sampling temperature and the completion length limit.
        stop_at_eos: end completions at any of the model's end-of-sequence ids; ``stop_token_id`` ends them at
            that id instead; neither: every completion runs to ``response_length``.
        rows_per_pass: rows per chunk of generation and of the no-grad forward passes.
        autocast: a context manager factory for mixed precision (e.g. ``accelerator.autocast``).
        policy: the policy adapter that samples (default: the model's first policy); its reference is the
            ``"reference"`` view.
        share_prompt_prefix: compute each prompt once for all its completions in the scoring passes
            (:mod:`marl.model.packing`); switched off, with a warning, on a model where that is not exact.
    """

    def __init__(
        self,
        model: MultiAdapterModel,
        tokenizer: Any,
        *,
        temperature: float,
        response_length: int,
        stop_at_eos: bool = False,
        stop_token_id: int | None = None,
        rows_per_pass: int = 64,
        autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
        policy: str | None = None,
        share_prompt_prefix: bool = True,
    ) -> None:
        self.model = model
        self.policy = policy or model.default_policy
        self.tokenizer = tokenizer
        # Every end-of-sequence id of the model: a list in generation_config.eos_token_id (Llama-3.x-Instruct
        # has three) all end a completion with stop_at_eos, and all count as an EOS.
        self.eos_token_ids = eos_token_ids(tokenizer, model.generation_config)
        if stop_at_eos and not self.eos_token_ids:
            raise DataError("stop_token='eos' but the tokenizer has no EOS token; pass --stop_token_id ID")
        vocabulary = model.peft_model.get_input_embeddings().num_embeddings
        if stop_token_id is not None and not 0 <= stop_token_id < vocabulary:
            raise ConfigError(
                f"--stop_token_id {stop_token_id} is not a token of this model (ids 0 to {vocabulary - 1}); "
                "pass an id from its tokenizer"
            )
        stop_ids = self.eos_token_ids if stop_at_eos else (() if stop_token_id is None else (stop_token_id,))
        self.settings = SamplingSettings(temperature, response_length, stop_ids, pad_token_id(tokenizer))
        self.rows_per_pass = rows_per_pass
        self.autocast = autocast
        self.share_prompt_cache = prompt_cache_can_be_shared(model.peft_model.get_base_model())
        self.share_prompt_prefix = share_prompt_prefix and model.packing_problem is None
        if share_prompt_prefix and not self.share_prompt_prefix:
            warnings.warn(
                f"each completion computes its own prompt on this model: {model.packing_problem}",
                stacklevel=2,
            )

    @property
    def device(self) -> torch.device:
        return self.model.device

    def batch(self, prompts: Sequence[Prompt]) -> PromptBatch:
        return PromptBatch.of(prompts, self.settings.pad_token_id, self.device)

    def sample(self, prompts: PromptBatch, k: int, *, view: str = "policy") -> Samples:
        """``k`` completions of every prompt under ``view`` (``"policy"`` or ``"reference"``), k-major."""
        responses = self._generate(prompts, k, view)
        stop_ids, pad = self.settings.stop_token_ids, self.settings.pad_token_id
        responses, contains_stop = stops.truncate_after_stop_token(responses, stop_ids, pad)
        lengths = stops.response_lengths(responses, stop_ids)
        response_mask = stops.response_mask(lengths, responses.shape[1])
        contains_eos = (stops.is_stop_token(responses, self.eos_token_ids) & response_mask).any(dim=1)
        completions = self.tokenizer.batch_decode(
            [row[:length].tolist() for row, length in zip(responses, lengths.tolist(), strict=True)],
            skip_special_tokens=True,
        )
        return Samples(
            prompt_texts=prompts.texts * k,
            completions=completions,
            prompt_ids=prompts.ids.repeat(k, 1),
            prompt_mask=prompts.mask.repeat(k, 1),
            response_ids=responses,
            response_mask=response_mask,
            contains_stop=contains_stop,
            contains_eos=contains_eos,
            prompt_index=torch.arange(prompts.ids.shape[0], device=responses.device).repeat(k),
            prompt_messages=prompts.messages * k,
        )

    def _generate(self, prompts: PromptBatch, k: int, view: str) -> torch.Tensor:
        """Completion ids ``[k * P, response_length]``, k-major, in chunks of ``rows_per_pass`` sampled rows.

        Each prompt is prefilled ONCE: its KV cache is copied to its k samples, instead of running the prompt
        through the model k times.
        """
        prompts_per_chunk = max(1, self.rows_per_pass // k)
        pieces = []
        for start in range(0, prompts.ids.shape[0], prompts_per_chunk):
            ids = prompts.ids[start : start + prompts_per_chunk]
            mask = prompts.mask[start : start + prompts_per_chunk]
            with self._view(view), self.autocast():
                responses = self.model.sample(
                    ids.repeat_interleave(k, dim=0),
                    mask.repeat_interleave(k, dim=0),
                    self.settings,
                    past_key_values=self._shared_prompt_cache(ids, mask, k),
                )
            # generate ran prompt-major (row i * k + j); the rollout layout is k-major (row j * P + i)
            pieces.append(responses.view(ids.shape[0], k, -1).transpose(0, 1))
        return torch.cat(pieces, dim=1).reshape(k * prompts.ids.shape[0], -1)

    def _view(self, view: str) -> contextlib.AbstractContextManager:
        if view == "reference":
            return self.model.reference(self.policy)
        return self.model.policy(self.policy)

    def _shared_prompt_cache(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, copies: int) -> Any:
        """KV cache of all prompt tokens but the last (generate feeds that one), repeated ``copies`` times.

        ``None`` (generate prefills by itself) when there is nothing to share, or the model's cache holds
        states that cannot be repeated.
        """
        if copies == 1 or prompt_ids.shape[1] < 2 or not self.share_prompt_cache:
            return None
        with torch.no_grad():
            prefill = self.model.peft_model(
                input_ids=prompt_ids[:, :-1],
                attention_mask=prompt_mask[:, :-1],
                position_ids=position_ids_from_mask(prompt_mask[:, :-1]),
                use_cache=True,
                logits_to_keep=1,
            )
        cache = prefill.past_key_values
        cache.batch_repeat_interleave(copies)
        return cache

    def chunks(
        self, samples: Samples, rows_per_pass: int | None = None
    ) -> Iterator[tuple[torch.Tensor, Samples, PackedRows | None]]:
        """``(rows, those rows' samples, their packed form or None)`` for whole prompt groups at a time, about
        ``rows_per_pass`` rows per chunk."""
        group_size = int((samples.prompt_index == samples.prompt_index[0]).sum())
        groups_per_chunk = max(1, (rows_per_pass or self.rows_per_pass) // group_size)
        for rows in samples.group_rows(groups_per_chunk):
            chunk = samples.select(rows)
            yield rows, chunk, self.pack(chunk)

    def pack(self, samples: Samples) -> PackedRows | None:
        """``samples`` packed by prompt when prefix sharing is on and exact for them, else ``None``."""
        if not self.can_pack(samples.prompt_mask, samples.response_ids, samples.prompt_index):
            return None
        return samples.pack(packing_mask_dtype(self.model))

    def can_pack(
        self, prompt_mask: torch.Tensor, response_ids: torch.Tensor, prompt_index: torch.Tensor
    ) -> bool:
        """Whether rows ``[prompt (left-padded), completion (right-padded)]`` grouped by ``prompt_index`` may
        be packed: prefix sharing is on and exact on this model, and no packed sequence exceeds its
        sliding attention window."""
        if not self.share_prompt_prefix:
            return False
        window = attention_window(self.model.config)
        group_size = int((prompt_index == prompt_index[0]).sum())
        packed_length = int(prompt_mask.sum(dim=1).max()) + group_size * response_ids.shape[1]
        return window is None or packed_length <= window

    def completion_logprobs(
        self, samples: Samples, packed: PackedRows | None, with_entropy: bool = False
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Float32 log-probs ``[B, T]`` of the completions under the ACTIVE view, each prompt once when
        ``packed`` is given; the same numbers either way, up to float rounding."""
        temperature = self.settings.temperature
        if packed is not None:
            return self.model.packed_token_logprobs(
                packed, temperature=temperature, with_entropy=with_entropy
            )
        return self.model.token_logprobs(
            samples.query_responses,
            samples.attention_mask,
            response_start=samples.prompt_length,
            temperature=temperature,
            with_entropy=with_entropy,
        )

    def logprobs(self, samples: Samples) -> tuple[torch.Tensor, torch.Tensor]:
        """No-grad float32 log-probs of the completions under the policy and the reference, ``[B, T]``."""
        logprobs = torch.empty(samples.response_ids.shape, dtype=torch.float32, device=self.device)
        ref_logprobs = torch.empty_like(logprobs)
        with torch.no_grad(), self.autocast():
            for rows, chunk, packed in self.chunks(samples):
                with self.model.policy(self.policy):
                    logprobs[rows] = self.completion_logprobs(chunk, packed).float()
                with self.model.reference(self.policy):
                    ref_logprobs[rows] = self.completion_logprobs(chunk, packed).float()
        return logprobs, ref_logprobs

    def scoring_batch(self, samples: Samples) -> ScoringBatch:
        """``samples`` for the reward sources; reward adapters score them in prompt-group chunks, packed.

        Plain prompts are read as sampled: the prompt ids followed by the completion ids. Conversations are
        read as TRL renders them for a reward model (:func:`marl.data.prompts.reward_model_text`): the
        prompt's
        messages and the completion as the assistant's reply, through the chat template, tokenised whole.
        """
        if all(messages is None for messages in samples.prompt_messages):
            chunks = [
                ScoringChunk(rows, chunk.query_responses, chunk.attention_mask, packed)
                for rows, chunk, packed in self.chunks(samples)
            ]
            return ScoringBatch(
                samples.prompt_texts,
                samples.completions,
                samples.query_responses,
                samples.attention_mask,
                chunks,
                conversations=samples.prompt_messages,
            )
        rows = self.reward_rows(samples)
        input_ids, attention_mask = left_pad(rows, self.settings.pad_token_id)

        group_size = int((samples.prompt_index == samples.prompt_index[0]).sum())
        rendered_chunks = [
            ScoringChunk(
                chunk_rows,
                *self.shared_prefix_rows(
                    [rows[i] for i in chunk_rows.tolist()], samples.prompt_index[chunk_rows]
                ),
            )
            for chunk_rows in samples.group_rows(max(1, self.rows_per_pass // group_size))
        ]

        return ScoringBatch(
            samples.prompt_texts,
            samples.completions,
            input_ids.to(self.device),
            attention_mask.to(self.device),
            rendered_chunks,
            conversations=samples.prompt_messages,
        )

    def reward_rows(self, samples: Samples) -> list[list[int]]:
        """Token ids a reward adapter reads per row: a conversation with the completion as the assistant's
        reply through the chat template (tokenised whole, as TRL does), a plain prompt as sampled."""
        rows = []
        for row, messages in enumerate(samples.prompt_messages):
            if messages is None:
                prompt = samples.prompt_ids[row][samples.prompt_mask[row].bool()]
                completion = samples.response_ids[row][samples.response_mask[row]]
                rows.append(torch.cat([prompt, completion]).tolist())
            else:
                rows.append(reward_model_ids(self.tokenizer, messages, samples.completions[row]))
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
        pad = self.settings.pad_token_id
        groups: dict[int, list[int]] = {}
        for position, index in enumerate(prompt_index.tolist()):
            groups.setdefault(index, []).append(position)
        prefix = [0] * len(rows)
        for members in groups.values():
            length = min(len(rows[member]) for member in members) - 1
            first = rows[members[0]]
            for member in members[1:]:
                length = next(
                    (t for t in range(length) if rows[member][t] != first[t]),
                    length,
                )
            for member in members:
                prefix[member] = length
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


def collect_rollout(sampler: Sampler, prompts: Sequence[Prompt], k: int, reward: WeightedRewards) -> Rollout:
    """Everything one update needs: k completions per prompt under the policy, their policy and reference
    log-probs, and their scores from ``reward``."""
    samples = sampler.sample(sampler.batch(prompts), k)
    logprobs, ref_logprobs = sampler.logprobs(samples)
    with torch.no_grad(), sampler.autocast():
        scores = reward.score(sampler.scoring_batch(samples))
    values = {field.name: getattr(samples, field.name) for field in dataclasses.fields(Samples)}
    return Rollout(
        **values,
        logprobs=logprobs,
        ref_logprobs=ref_logprobs,
        scores=scores.total,
        source_scores=scores.per_source,
    )
