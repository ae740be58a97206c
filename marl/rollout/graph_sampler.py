"""The ``graph`` sampler (``--sampler graph``): the static-cache decode in fixed row buckets, its decode step
compiled once per bucket and captured in CUDA graphs on a GPU.

``static`` drops finished rows every step, so its shapes change every step and it can never be captured;
that is what makes it fastest on a CPU, where each row costs compute and a kernel launch costs little. On a
GPU a small decode step is bound by kernel launches; ``graph`` keeps every shape fixed
(:class:`marl.model.graph_decode.BucketedDecoder`) and compiles the model call of the decode step with
``torch.compile(mode="reduce-overhead", fullgraph=True, dynamic=False)``: one compilation and one CUDA graph
per row bucket, traced with the policy adapter active and replayed across updates (the optimizer changes the
LoRA weights in place, and the graph reads them where they live). Sampling runs outside the graph with the
random stream of ``generate``, so the same seed draws the same completions as ``static`` and
``transformers`` (up to floating-point rounding of the logits); ``transformers`` stays the stream-exact
reference.

Which path it takes, logged once when it first samples (:attr:`GraphSampler.path`):

- ``compiled+graphs``: a CUDA device; bf16, fp16, fp32, 4-bit and 8-bit bases alike;
- ``eager+graphs``: a CUDA device with ``--graph_capture cuda_graphs``: the eager step captured in plain CUDA
  graphs (:mod:`marl.model.graph_decode`; seconds instead of a compilation, no fused kernels), each
  capture's seconds logged; the rows of several policies (a sweep) decode with the static decode;
- ``eager``: a CPU (compiling the step there costs more than it saves; CUDA graphs need a CUDA device), a
  model whose sliding-window cache layers count their fill in a Python int (a compiled step would be
  compiled again at every token, a captured one would read a stale count), or a compilation or capture that
  failed (its error is logged); the reference and base views always decode eager (the
  compiled step is traced with the policy adapter active);
- ``generate``: a model whose cache holds states other than attention keys and values (as ``static``);
- ``static``: a base sharded over processes (``--parallelism fsdp2``), whose processes must keep running
  forward passes together until every one's rows have stopped.

The rows of several policies sampled together
(:meth:`~marl.rollout.transformers_sampler.TransformersSampler.sample_routed`, a sweep) go through the
compiled step too: its LoRA layers are stacked (:mod:`marl.model.rows`) and read each slot's adapter
from a buffer of the decode, so every policy shares one graph per bucket. Without a compiled step they
decode with the static decode (logged once).

Example:
    >>> sampler = GraphSampler(model, tokenizer, SamplerSettings(0.7, 16))  # doctest: +SKIP
    >>> samples = sampler.sample(sampler.batch(prompts), k=4)  # doctest: +SKIP
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from marl.model.adapters import DEFAULT_POLICY
from marl.model.graph_decode import BucketedDecoder, CapturedStep, capture_cuda_graphs, compile_problem
from marl.model.sampling import stacked_logprobs
from marl.rollout.static_sampler import StaticSampler
from marl.rollout.transformers_sampler import SampledChunk

if TYPE_CHECKING:
    from marl.model.multi_adapter import MultiAdapterModel
    from marl.rollout.prompts import PromptBatch
    from marl.rollout.sampler_settings import SamplerSettings

logger = logging.getLogger(__name__)

# Row buckets of every size from rows_per_pass down to 1, for two cache lengths, fit under this limit.
_RECOMPILE_LIMIT = 32


def capture_step(step: Callable) -> Callable:
    """``step`` compiled for CUDA graphs: one graph per input shape, a graph break an error."""
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, _RECOMPILE_LIMIT)
    return torch.compile(step, mode="reduce-overhead", fullgraph=True, dynamic=False)


class GraphSampler(StaticSampler):
    """Samples with a :class:`marl.model.graph_decode.BucketedDecoder` (a
    :class:`marl.rollout.samplers.Sampler`).

    Args:
        model: the multi-adapter model.
        tokenizer: its tokenizer.
        settings: a :class:`marl.rollout.samplers.SamplerSettings`.
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
