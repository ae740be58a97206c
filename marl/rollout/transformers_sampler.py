"""The ``transformers`` sampler (``--sampler transformers``): ``generate`` on the training model.

It samples with :meth:`marl.MultiAdapterModel.sample` (exactly ``softmax(logits / T)``, see
:mod:`marl.model.sampling`) under the policy or the reference view of the one shared base, prefilling each
prompt once for its k samples, and cuts every completion after its stop token
(:meth:`marl.rollout.records.Samples.from_responses`). It reads the live adapter weights, so it has nothing
to refresh when the policy changes.

Example:
    >>> sampler = TransformersSampler(model, tokenizer, SamplerSettings(0.7, 16))  # doctest: +SKIP
    >>> samples = sampler.sample(sampler.batch(prompts), k=4)  # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from marl.errors import ConfigError, DataError
from marl.model.adapters import BASE_VIEW, DEFAULT_POLICY, REFERENCE_VIEW
from marl.model.families import prompt_cache_can_be_shared
from marl.model.forward import position_ids_from_mask
from marl.model.rows import RowRoutes
from marl.model.sampling import SamplingSettings, eos_token_ids, pad_token_id
from marl.rollout.prompts import Prompt, PromptBatch
from marl.rollout.records import Samples

if TYPE_CHECKING:
    from marl.model.multi_adapter import MultiAdapterModel
    from marl.rollout.sampler_settings import SamplerSettings

# What a chunk's decode returns: completion ids [rows, T] and the log-prob each token was drawn with (float32
# [rows, T]), or None where the decode does not keep them.
SampledChunk = tuple[torch.Tensor, torch.Tensor | None]


class TransformersSampler:
    """Samples completions with ``generate`` on the model itself (:class:`marl.rollout.samplers.Sampler`).

    Args:
        model: the multi-adapter model.
        tokenizer: its tokenizer (pad token, EOS, decoding).
        settings: a :class:`marl.rollout.samplers.SamplerSettings`.

    Attributes:
        sampling: what :meth:`marl.MultiAdapterModel.sample` reads: the temperature, the length limit, every
            id that ends a completion and the pad id.
        eos_token_ids: every end-of-sequence id of the model (``contains_eos``).
        stacked_routing: how rows of several policies are routed (``stacked`` of
            :meth:`marl.MultiAdapterModel.routed`; ``None``: the device's default).
        keeps_logprobs: whether the samples carry the log-prob each token was drawn with (``generate``
            does not); the sampler correction reads them.
    """

    stacked_routing: bool | None = None
    keeps_logprobs: bool = False

    def __init__(self, model: MultiAdapterModel, tokenizer: Any, settings: SamplerSettings) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.settings = settings
        self.policy = settings.policy or model.default_policy
        # Every end-of-sequence id of the model: a list in generation_config.eos_token_id (Llama-3.x-Instruct
        # has three) all end a completion with stop_at_eos, and all count as an EOS.
        self.eos_token_ids = eos_token_ids(tokenizer, model.generation_config)
        if settings.stop_at_eos and not self.eos_token_ids:
            raise DataError("stop_token='eos' but the tokenizer has no EOS token; pass --stop_token_id ID")
        stop_token_id = settings.stop_token_id
        vocabulary = model.peft_model.get_input_embeddings().num_embeddings
        if stop_token_id is not None and not 0 <= stop_token_id < vocabulary:
            raise ConfigError(
                f"--stop_token_id {stop_token_id} is not a token of this model (ids 0 to {vocabulary - 1}); "
                "pass an id from its tokenizer"
            )
        stop_ids = () if stop_token_id is None else (stop_token_id,)
        if settings.stop_at_eos:
            stop_ids = self.eos_token_ids
        self.sampling = SamplingSettings(
            settings.temperature,
            settings.response_length,
            stop_ids,
            pad_token_id(tokenizer),
            synced_processes=settings.synced_processes,
        )
        self.share_prompt_cache = prompt_cache_can_be_shared(model.peft_model.get_base_model())

    def batch(self, prompts: Sequence[Prompt]) -> PromptBatch:
        return PromptBatch.of(prompts, self.sampling.pad_token_id, self.model.device)

    def sample(self, prompts: PromptBatch, k: int, *, view: str = "policy") -> Samples:
        """``k`` completions of every prompt under ``view`` (``"policy"``, ``"reference"`` or the base,
        :data:`marl.model.adapters.BASE_VIEW`), k-major."""
        return self._samples(prompts, k, *self._generate(prompts, k, view))

    def sample_routed(self, prompts: PromptBatch, k: int, policies: Sequence[str]) -> Samples:
        """``k`` completions of every prompt, prompt ``i`` under the policy adapter ``policies[i]``, all in
        the same batched decode (:meth:`marl.MultiAdapterModel.routed`), k-major. A chunk holds
        ``rows_per_pass`` rows of every policy; a chunk whose prompts all name one policy decodes under that
        policy's view, as :meth:`sample` does.

        Example:
            >>> samples = sampler.sample_routed(batch, 4, ["a", "a", "b", "b"])  # doctest: +SKIP
        """
        if len(policies) != prompts.ids.shape[0]:
            raise ValueError(
                f"{len(policies)} policies for {prompts.ids.shape[0]} prompts: give one per prompt"
            )
        return self._samples(prompts, k, *self._generate(prompts, k, DEFAULT_POLICY, list(policies)))

    def _samples(
        self, prompts: PromptBatch, k: int, responses: torch.Tensor, logprobs: torch.Tensor | None
    ) -> Samples:
        return Samples.from_responses(
            prompts,
            k,
            responses,
            sampled_logprobs=logprobs,
            stop_token_ids=self.sampling.stop_token_ids,
            eos_token_ids=self.eos_token_ids,
            pad_token_id=self.sampling.pad_token_id,
            tokenizer=self.tokenizer,
        )

    def policy_weights_changed(self) -> None:
        """Nothing to do: generation runs on the model's own policy adapter, whose weights are the live ones
        the optimizer just changed (no copy to refresh)."""

    def _generate(
        self, prompts: PromptBatch, k: int, view: str, policies: list[str] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Completion ids ``[k * P, response_length]``, k-major, in chunks of ``rows_per_pass`` sampled rows
        (per policy, with ``policies``: one per prompt, see :meth:`sample_routed`), and the log-prob each
        token was drawn with where the decode keeps them (``None`` here: ``generate`` does not).

        Each prompt is prefilled ONCE: its KV cache is copied to its k samples, instead of running the prompt
        through the model k times.
        """
        return self._in_chunks(prompts, k, view, self._sample_chunk, policies)

    def _in_chunks(
        self,
        prompts: PromptBatch,
        k: int,
        view: str,
        sample_chunk: Callable[[torch.Tensor, torch.Tensor, int, RowRoutes | None], SampledChunk],
        policies: list[str] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``sample_chunk(ids, mask, k, routes)`` (ids and log-probs or ``None``, prompt-major rows
        ``i * k + j``) over chunks of
        ``rows_per_pass`` sampled rows under ``view``, put in the rollout's k-major layout (row ``j * P +
        i``). With ``policies`` (one per prompt), a chunk holds ``rows_per_pass`` rows of every policy and
        runs routed, ``routes`` naming its prompts' policies (``None``: one view)."""
        prompts_per_chunk = max(1, self.settings.rows_per_pass // k)
        if policies is not None:
            prompts_per_chunk *= len(set(policies))
        pieces, logprob_pieces = [], []
        for start in range(0, prompts.ids.shape[0], prompts_per_chunk):
            ids = prompts.ids[start : start + prompts_per_chunk]
            mask = prompts.mask[start : start + prompts_per_chunk]
            names = None if policies is None else policies[start : start + prompts_per_chunk]
            routes = None if names is None or len(set(names)) == 1 else RowRoutes(names)
            if routes is not None:
                chosen = self.model.routed(routes, stacked=self.stacked_routing)
            else:
                chosen = self._view(view) if names is None else self.model.policy(names[0])
            with chosen, self.settings.autocast():
                responses, logprobs = sample_chunk(ids, mask, k, routes)
            pieces.append(responses.view(ids.shape[0], k, -1).transpose(0, 1))
            logprob_pieces.append(
                None if logprobs is None else logprobs.view(ids.shape[0], k, -1).transpose(0, 1)
            )

        def k_major(parts: list[torch.Tensor]) -> torch.Tensor:
            return torch.cat(parts, dim=1).reshape(k * prompts.ids.shape[0], -1)

        kept = None if any(part is None for part in logprob_pieces) else k_major(logprob_pieces)
        return k_major(pieces), kept

    def _sample_chunk(
        self, ids: torch.Tensor, mask: torch.Tensor, k: int, routes: RowRoutes | None = None
    ) -> SampledChunk:
        cache = self._shared_prompt_cache(ids, mask, k)  # routed per prompt
        if routes is not None:  # generate keeps every row to the end: each sample under its prompt's adapter
            routes.names = [name for name in routes.names for _ in range(k)]
        ids = self.model.sample(
            ids.repeat_interleave(k, dim=0),
            mask.repeat_interleave(k, dim=0),
            self.sampling,
            past_key_values=cache,
        )
        return ids, None

    def _view(self, view: str) -> contextlib.AbstractContextManager:
        if view == REFERENCE_VIEW:
            return self.model.reference(self.policy)
        if view == BASE_VIEW:
            return self.model.base()
        if view == DEFAULT_POLICY:
            return self.model.policy(self.policy)
        raise ValueError(f"view must be {DEFAULT_POLICY!r}, {REFERENCE_VIEW!r} or BASE_VIEW, got {view!r}")

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
