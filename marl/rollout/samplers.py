"""Samplers: what draws the completions of a rollout, chosen by name (``--sampler``), and marl's three.

A sampler turns prompts into k completions each under a view of the model; everything after that (log-probs,
packing, reward rows) is the :class:`marl.rollout.scoring.Scorer`'s, so a faster sampler (a static-cache
decode, an inference engine) is a class with :class:`Sampler`'s three methods plus one
:func:`register_sampler` call. The trainer builds it as ``get_sampler(config.sampler)(model, tokenizer,
settings)`` and calls :meth:`Sampler.policy_weights_changed` whenever the policy adapter's weights change, so
that a sampler holding its own copy of them can refresh it. Each sampler draws from exactly
``softmax(logits / T)`` and cuts every completion after its stop token
(:meth:`marl.rollout.completions.Samples.from_responses`); the same seed draws the same completions with each
(up to floating-point rounding of the logits):

- ``transformers`` (:class:`TransformersSampler`): ``generate`` on the training model, the stream-exact
  reference;
- ``static`` (:class:`StaticSampler`): a decode loop over a static KV cache, built for rollouts;
- ``graph`` (:class:`GraphSampler`): the static-cache decode in fixed row buckets, its decode step compiled
  once per bucket and captured in CUDA graphs on a GPU.

Example:
    >>> get_sampler("transformers").__name__
    'TransformersSampler'
    >>> settings = SamplerSettings(temperature=0.7, response_length=16, stop_at_eos=True)
    >>> settings.rows_per_pass, settings.policy
    (64, None)
    >>> sampler = get_sampler("static")(model, tokenizer, settings)  # doctest: +SKIP
    >>> samples = sampler.sample(sampler.batch(prompts), k=4)  # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

from marl.config.device import DEFAULT_GRAPH_CAPTURE
from marl.data.prompts import Prompt, PromptBatch
from marl.errors import ConfigError, DataError
from marl.model.adapters import BASE_VIEW, DEFAULT_POLICY, REFERENCE_VIEW
from marl.model.families import prompt_cache_can_be_shared
from marl.model.forward import position_ids_from_mask
from marl.model.graph_decode import BucketedDecoder, CapturedStep, capture_cuda_graphs, compile_problem
from marl.model.rows import RowRoutes
from marl.model.sampling import (
    SamplingSettings,
    eos_token_ids,
    pad_token_id,
    stacked_logprobs,
    static_decode_problem,
)
from marl.registry import Registry
from marl.rollout.completions import Samples

if TYPE_CHECKING:
    from marl.model.multi_adapter import MultiAdapterModel

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SamplerSettings:
    """What every sampler is told.

    Attributes:
        temperature, response_length: sample from ``softmax(logits / temperature)``, at most
            ``response_length`` new tokens per completion.
        stop_at_eos: end completions at any of the model's end-of-sequence ids; ``stop_token_id`` ends them at
            that id instead; neither: every completion runs to ``response_length``.
        rows_per_pass: sampled rows per chunk of generation.
        autocast: a context manager factory for mixed precision (e.g. ``accelerator.autocast``).
        policy: the policy adapter that samples (default: the model's first policy); its reference is the
            ``"reference"`` view.
        synced_processes: every process takes part in every forward pass (a sharded base): each keeps
            running them until the rows of every process have stopped
            (:class:`marl.model.sampling.SamplingSettings`).
        graph_capture: how ``--sampler graph`` captures its decode step on a GPU
            (:mod:`marl.config.device`); the other samplers capture nothing.
    """

    temperature: float
    response_length: int
    stop_at_eos: bool = False
    stop_token_id: int | None = None
    rows_per_pass: int = 64
    autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
    policy: str | None = None
    synced_processes: bool = False
    graph_capture: str = DEFAULT_GRAPH_CAPTURE


class Sampler(Protocol):
    """Draws completions. Built as ``factory(model, tokenizer, settings)`` (:func:`register_sampler`); marl
    reads these three methods and, only where present, the optional: ``settings`` (a :class:`SamplerSettings`
    read at each :meth:`sample`, whose ``rows_per_pass`` the guard halves when sampling runs out of memory;
    without it that error ends the run), ``keeps_logprobs`` and ``fallback_reason`` (read by the sampler
    correction, :func:`check_keeps_logprobs`), ``sample_routed`` on the factory (a sweep's policies)."""

    def batch(self, prompts: Sequence[Prompt]) -> PromptBatch:
        """``prompts`` left-padded on the sampler's device, ready for :meth:`sample`."""
        ...

    def sample(self, prompts: PromptBatch, k: int, *, view: str = "policy") -> Samples:
        """``k`` completions of every prompt under ``view`` (``"policy"``, ``"reference"`` or the base with
        adapters disabled, :data:`marl.model.adapters.BASE_VIEW`), k-major (row
        ``j * P + i`` is sample ``j`` of prompt ``i``), cut after their stop token and decoded."""
        ...

    def policy_weights_changed(self) -> None:
        """The policy adapter's weights changed (after every optimizer step the trainer took, and after it
        loaded a checkpoint): a sampler that holds its own copy of them refreshes it before it samples
        again."""
        ...


# What a chunk's decode returns: completion ids [rows, T] and the log-prob each token was drawn with (float32
# [rows, T]), or None where the decode does not keep them.
SampledChunk = tuple[torch.Tensor, torch.Tensor | None]


class TransformersSampler:
    """Samples completions with ``generate`` on the model itself (a :class:`Sampler`).

    It samples with :meth:`marl.MultiAdapterModel.sample` (exactly ``softmax(logits / T)``, see
    :mod:`marl.model.sampling`) under the policy or the reference view of the one shared base, prefilling
    each prompt once for its k samples. It reads the live adapter weights, so it has nothing to refresh when
    the policy changes.

    Args:
        model: the multi-adapter model.
        tokenizer: its tokenizer (pad token, EOS, decoding).
        settings: a :class:`SamplerSettings`.

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


class StaticSampler(TransformersSampler):
    """Samples with :meth:`marl.MultiAdapterModel.sample_static` (a :class:`Sampler`).

    Each prompt is prefilled once; its cache is repeated for its k samples inside a ``StaticCache`` sized
    prompt + response, then every step runs the model on the unfinished rows only and draws from exactly
    ``softmax(logits / T)`` (:func:`marl.model.sampling.sample_static`). Rows are chunked and ordered as
    :class:`TransformersSampler` chunks and orders them and the random stream is consumed as ``generate``
    consumes it, so the same seed gives the same completions as ``--sampler transformers``. A model whose
    cache holds other states than attention keys and values (Falcon-H1's Mamba layers) samples with
    ``generate``; the reason is logged once, when the sampler is built.

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


# Row buckets of every size from rows_per_pass down to 1, for two cache lengths, fit under this limit.
_RECOMPILE_LIMIT = 32


def capture_step(step: Callable) -> Callable:
    """``step`` compiled for CUDA graphs: one graph per input shape, a graph break an error."""
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, _RECOMPILE_LIMIT)
    return torch.compile(step, mode="reduce-overhead", fullgraph=True, dynamic=False)


class GraphSampler(StaticSampler):
    """Samples with a :class:`marl.model.graph_decode.BucketedDecoder` (a :class:`Sampler`).

    ``static`` drops finished rows every step, so its shapes change every step and it can never be captured;
    that is what makes it fastest on a CPU, where each row costs compute and a kernel launch costs little. On
    a GPU a small decode step is bound by kernel launches; ``graph`` keeps every shape fixed and compiles the
    model call of the decode step with ``torch.compile(mode="reduce-overhead", fullgraph=True,
    dynamic=False)``: one compilation and one CUDA graph per row bucket, traced with the policy adapter active
    and replayed across updates (the optimizer changes the LoRA weights in place, and the graph reads them
    where they live). Sampling runs outside the graph with the random stream of ``generate``.

    Which path it takes, logged once when it first samples (:attr:`path`):

    - ``compiled+graphs``: a CUDA device; bf16, fp16, fp32, 4-bit and 8-bit bases alike;
    - ``eager+graphs``: a CUDA device with ``--graph_capture cuda_graphs``: the eager step captured in plain
      CUDA graphs (:mod:`marl.model.graph_decode`; seconds instead of a compilation, no fused kernels), each
      capture's seconds logged; the rows of several policies (a sweep) decode with the static decode;
    - ``eager``: a CPU (compiling the step there costs more than it saves; CUDA graphs need a CUDA device), a
      model whose sliding-window cache layers count their fill in a Python int (a compiled step would be
      compiled again at every token, a captured one would read a stale count), or a compilation or capture
      that failed (its error is logged); the reference and base views always decode eager (the compiled step
      is traced with the policy adapter active);
    - ``generate``: a model whose cache holds states other than attention keys and values (as ``static``);
    - ``static``: a base sharded over processes (``--parallelism fsdp2``), whose processes must keep running
      forward passes together until every one's rows have stopped.

    The rows of several policies sampled together (:meth:`TransformersSampler.sample_routed`, a sweep) go
    through the compiled step too: its LoRA layers are stacked (:mod:`marl.model.rows`) and read each
    slot's adapter from a buffer of the decode, so every policy shares one graph per bucket. Without a
    compiled step they decode with the static decode (logged once).

    Args:
        model: the multi-adapter model.
        tokenizer: its tokenizer.
        settings: a :class:`SamplerSettings`.
        compile_step: how the decode step is compiled or captured: ``"auto"`` (on CUDA
            ``settings.graph_capture``, eager on a CPU), ``"compile"`` (:func:`capture_step`),
            ``"cuda_graphs"`` (plain CUDA graphs, :mod:`marl.model.graph_decode`), ``None`` (eager) or a
            function of the step (e.g. ``torch.compile`` with another backend).

    Attributes:
        path: ``"compiled+graphs"``, ``"eager+graphs"``, ``"compiled"``, ``"eager"``, ``"static"`` or
            ``"generate"``.
        path_reason: why (logged once, when the sampler first samples).
        decoder: the bucketed decoder (``None`` on the ``static`` and ``generate`` paths).
        capture_seconds: on the ``eager+graphs`` path, the seconds of each capture by (rows, cache length),
            each also logged.
    """

    def __init__(
        self,
        model: MultiAdapterModel,
        tokenizer: Any,
        settings: SamplerSettings,
        compile_step: str | Callable[[Callable], Callable] | None = "auto",
    ) -> None:
        super().__init__(model, tokenizer, settings)
        self.decoder: BucketedDecoder | None = None
        self._logged = self._logged_routing = False
        if self.fallback_reason is not None:
            self.path, self.path_reason = "generate", self.fallback_reason
            return
        if settings.synced_processes:
            self.path = "static"
            self.path_reason = (
                "a base sharded over processes runs every forward pass on every process until all have "
                "stopped, which the static decode does"
            )
            return
        if compile_step == "auto":  # the user's --graph_capture on a GPU, eager on a CPU
            compile_step = settings.graph_capture if model.device.type == "cuda" else None
        plain = compile_step == "cuda_graphs"
        compile_step = {"compile": capture_step, "cuda_graphs": capture_cuda_graphs(self._captured)}.get(
            compile_step, compile_step
        )
        from transformers import StaticCache

        problem = compile_problem(
            StaticCache(config=model.peft_model.get_base_model().config, max_cache_len=8)
        )
        if compile_step is None:
            captured = settings.graph_capture == "cuda_graphs"
            self.path, self.path_reason = (
                "eager",
                problem
                or f"the decode step is not {'captured' if captured else 'compiled'} on {model.device}"
                + (" (CUDA graphs need a CUDA device)" if captured else ""),
            )
        elif problem is not None:
            compile_step, self.path, self.path_reason = None, "eager", problem
        elif compile_step is capture_step:
            self.path = "compiled+graphs"
            self.path_reason = (
                "torch.compile(mode='reduce-overhead', fullgraph=True), one CUDA graph per bucket"
            )
        elif plain:
            self.path = "eager+graphs"
            self.path_reason = (
                "the eager decode step captured in plain CUDA graphs (torch.cuda.CUDAGraph, no inductor), "
                "one per row bucket and cache length"
            )
        else:
            self.path, self.path_reason = (
                "compiled",
                "the decode step compiled with fullgraph=True, per bucket",
            )
        self.decoder = BucketedDecoder(
            model.peft_model, max(1, settings.rows_per_pass), compile_step, on_fallback=self._compile_failed
        )
        # a compiled step reads each row's adapter from a device buffer: only the stacked LoRA layers can
        self.stacked_routing = compile_step is not None or None
        self.capture_seconds: dict[tuple[int, int], float] = {}  # (rows, cache length) -> seconds

    def _captured(self, rows: int, length: int, seconds: float) -> None:
        self.capture_seconds[(rows, length)] = seconds
        logger.info(
            "--sampler graph captured the decode step of %d rows at cache length %d in %.2f s",
            rows, length, seconds,
        )  # fmt: skip

    def _generate_routed(
        self, prompts: PromptBatch, k: int, view: str, policies: list[str]
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Rows of several policies (a sweep): the compiled step, its LoRA layers stacked so that each slot
        reads its adapter from the decode's buffer; without a compiled step, the static decode."""
        decoder = self.decoder
        # plain CUDA graphs are recorded for one view: rows of several adapters decode with the static decode
        step = None if decoder is None else decoder.compiled_step
        if step is None or isinstance(step, CapturedStep):
            return StaticSampler._generate(self, prompts, k, view, policies)
        if not self._logged_routing:
            self._logged_routing = True
            logger.info("--sampler graph decodes the rows of several policies %s, stacked", self.path)

        def sample_chunk(ids: torch.Tensor, mask: torch.Tensor, copies: int, routes: Any) -> SampledChunk:
            steps: list[torch.Tensor] = []
            with self.model._inference():
                responses = decoder.sample(
                    ids, mask, self.sampling, copies, compiled=routes is not None, routes=routes,
                    token_logprobs=steps,
                )  # fmt: skip
            return responses, stacked_logprobs(steps, *responses.shape, responses.device)

        return self._in_chunks(prompts, k, view, sample_chunk, policies)

    def _compile_failed(self, error: BaseException) -> None:
        doing = "capturing" if self.path == "eager+graphs" else "compiling"
        self.path, self.path_reason = (
            "eager",
            f"{doing} the decode step failed: {type(error).__name__}: {error}",
        )
        logger.warning("--sampler graph decodes eager from now on: %s", self.path_reason)

    def _generate(
        self, prompts: PromptBatch, k: int, view: str, policies: list[str] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if policies is not None:
            return self._generate_routed(prompts, k, view, policies)
        if not self._logged:
            self._logged = True
            logger.info("--sampler graph decodes %s: %s", self.path, self.path_reason)
        if self.decoder is None:
            return super()._generate(prompts, k, view)
        decoder = self.decoder

        def sample_chunk(ids: torch.Tensor, mask: torch.Tensor, copies: int, routes: None) -> SampledChunk:
            steps: list[torch.Tensor] = []
            with self.model._inference():
                responses = decoder.sample(
                    ids, mask, self.sampling, copies, compiled=view == DEFAULT_POLICY, token_logprobs=steps
                )
            return responses, stacked_logprobs(steps, *responses.shape, responses.device)

        return self._in_chunks(prompts, k, view, sample_chunk)


SamplerFactory = Callable[["MultiAdapterModel", Any, SamplerSettings], Sampler]

SAMPLERS: Registry[SamplerFactory] = Registry(
    "sampler",
    "--sampler",
    "marl.rollout.samplers.register_sampler",
    {"transformers": TransformersSampler, "static": StaticSampler, "graph": GraphSampler},
)


def register_sampler(name: str, factory: SamplerFactory) -> None:
    """Make ``factory`` the sampler named ``name`` (``--sampler name``); a name is registered once.

    Example:
        >>> register_sampler("mine", TransformersSampler)
        >>> get_sampler("mine") is TransformersSampler
        True
        >>> del SAMPLERS["mine"]
    """
    SAMPLERS.register(name, factory)


def check_keeps_logprobs(name: str, sampler: Any) -> None:
    """Refuse ``sampler`` (the factory registered as ``name``, or the sampler it built for the model) where it
    keeps no log-probs (its ``keeps_logprobs``; unset: none), which the sampler correction reads.

    Example:
        >>> check_keeps_logprobs("static", StaticSampler)
        >>> check_keeps_logprobs("transformers", TransformersSampler)
        Traceback (most recent call last):
        ...
        marl.errors.ConfigError: --vllm_importance_sampling_correction reads the log-prob the sampler drew ...
    """
    if getattr(sampler, "keeps_logprobs", False):
        return
    reason = getattr(sampler, "fallback_reason", None)
    raise ConfigError(
        "--vllm_importance_sampling_correction reads the log-prob the sampler drew each token with, but "
        f"--sampler {name!r} keeps none{f' for this model ({reason})' if reason else ''}. Use --sampler "
        "static or graph (a registered sampler: set keeps_logprobs = True on it where it keeps them), or "
        "drop --vllm_importance_sampling_correction"
    )


def get_sampler(name: str) -> SamplerFactory:
    """The factory of the sampler named ``name``.

    Example:
        >>> get_sampler("nope")
        Traceback (most recent call last):
        ...
        marl.errors.ConfigError: --sampler 'nope' is not a registered sampler; pass one of ...
    """
    return SAMPLERS.lookup(name)
