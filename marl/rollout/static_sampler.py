"""The ``static`` sampler (``--sampler static``): a decode loop over a static KV cache, built for rollouts.

Each prompt is prefilled once; its cache is repeated for its k samples inside a ``StaticCache`` sized prompt
+ response, then every step runs the model on the unfinished rows only and draws from exactly
``softmax(logits / T)`` (:func:`marl.model.sampling.sample_static`). Rows are chunked and ordered as the
``transformers`` sampler chunks and orders them and the random stream is consumed as ``generate`` consumes
it, so the same seed gives the same completions as ``--sampler transformers`` (up to floating-point rounding
of the logits).

A model whose cache holds other states than attention keys and values (Falcon-H1's Mamba layers) samples with
``generate``; the reason is logged once, when the sampler is built.

Example:
    >>> sampler = StaticSampler(model, tokenizer, SamplerSettings(0.7, 16))  # doctest: +SKIP
    >>> samples = sampler.sample(sampler.batch(prompts), k=4)  # doctest: +SKIP
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch

from marl.model.sampling import stacked_logprobs, static_decode_problem
from marl.rollout.transformers_sampler import SampledChunk, TransformersSampler

if TYPE_CHECKING:
    from marl.model.multi_adapter import MultiAdapterModel
    from marl.model.rows import RowRoutes
    from marl.rollout.prompts import PromptBatch
    from marl.rollout.sampler_settings import SamplerSettings

logger = logging.getLogger(__name__)


class StaticSampler(TransformersSampler):
    """Samples with :meth:`marl.MultiAdapterModel.sample_static` (:class:`marl.rollout.samplers.Sampler`).

    Attributes:
        fallback_reason: why this model samples with ``generate`` instead (``None``: it does not).
        keeps_logprobs: True, except where the model samples with ``generate``.
    """

    keeps_logprobs = True

    def __init__(self, model: MultiAdapterModel, tokenizer: Any, settings: SamplerSettings) -> None:
        super().__init__(model, tokenizer, settings)
        self.fallback_reason = static_decode_problem(model.peft_model.get_base_model())
        self.keeps_logprobs = self.fallback_reason is None
        if self.fallback_reason is not None:
            logger.warning("--sampler static samples with generate for this model: %s", self.fallback_reason)

    def _generate(
        self, prompts: PromptBatch, k: int, view: str, policies: list[str] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Completion ids ``[k * P, response_length]``, k-major, in the transformers sampler's chunks (routed
        per prompt with ``policies``: finished rows leave the batch and the routes follow the rows left), and
        the log-prob each token was drawn with."""
        if self.fallback_reason is not None:
            return super()._generate(prompts, k, view, policies)

        def sample_chunk(
            ids: torch.Tensor, mask: torch.Tensor, k: int, routes: RowRoutes | None
        ) -> SampledChunk:
            steps: list[torch.Tensor] = []
            responses = self.model.sample_static(
                ids, mask, self.sampling, copies=k, routes=routes, token_logprobs=steps
            )
            return responses, stacked_logprobs(steps, *responses.shape, responses.device)

        return self._in_chunks(prompts, k, view, sample_chunk, policies)
