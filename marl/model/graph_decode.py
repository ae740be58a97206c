"""A decode loop that CUDA graphs can capture: fixed row buckets, finished rows masked, one compiled step per
bucket.

:class:`BucketedDecoder` decodes like :func:`marl.model.sampling.sample_static` (each prompt prefilled
once into a static cache, its keys and values repeated for its ``copies`` samples, then one token per step)
but every tensor the decode step reads has a FIXED shape and address:

- rows run in a bucket of a power-of-two size (:func:`row_buckets`); a row that stops stays in its slot and
  decodes the pad token from then on (its output is ignored), so the shapes do not change when a row ends;
  when the live rows fit the next smaller bucket they are compacted into its first slots;
- the key/value buffers of every layer are allocated once for the largest bucket; the cache of a smaller
  bucket is a view of their first rows, so compaction is a copy and no buffer moves;
- the step's inputs (token, attention mask, position) live in preallocated buffers that are written in place;
- the prompt width is padded on the left to a power of two (:func:`width_bucket`), so a new batch of prompts
  mostly reuses the cache length, hence the compiled steps, of the batches before it;
- rows of several policies (a sweep) keep each slot's adapter position in a buffer that moves with the rows
  (:meth:`marl.model.rows.RowRoutes.follow`): the stacked LoRA layers of a GPU read it in place, so one
  compiled step per bucket serves every policy.

The decode step (the model call) can be compiled (``compile_step``): once per bucket, with the adapter view
active when it is traced; the adapter weights are read where they live, so a policy updated in place by the
optimizer needs no new compilation. It can instead be captured as it is, eager, in plain CUDA graphs
(:class:`CapturedStep`, below), one per bucket and cache length. Sampling stays OUTSIDE the compiled
step: each step draws ``torch.multinomial(softmax(logits / T), 1)`` over all rows of the chunk, finished
ones included, exactly as ``generate`` and the ``static`` decode consume the random stream: with the same
seed and rows it draws the same tokens as they do (up to floating-point rounding of the logits, which a
bucket of other size or a compiled kernel may change in the last bits).

Plain CUDA graphs (``--graph_capture cuda_graphs``, :class:`CapturedStep`): no inductor, one
``torch.cuda.CUDAGraph`` per set of input buffers (a row bucket at a cache length). A small model's decode
step on a GPU is bound by kernel launches: hundreds of them, each a few microseconds of Python and dispatch
for microseconds of work. A CUDA graph replays the recorded kernels with one launch. The decoder keeps every
input of the step (token, attention mask, position, the static cache's keys, values and fill counter) in a
buffer of fixed address, so a graph recorded once reads them in place at every replay, and so are the weights:
the optimizer updates the LoRA weights in place, so a graph stays valid across updates (nothing in the step
makes a new parameter tensor).

Capturing one graph: a few eager steps on a side stream first (lazy initialisation: cuBLAS handles and
workspaces, marl's stacked routing tensors), the cache's fill counters put back after each (a step advances
them; it writes the keys and values of the position it decodes, which the real step writes again, the same),
then one recorded step. Every graph allocates from one memory pool (``torch.cuda.graph_pool_handle``), and
autocast's cache of cast weights is off while recording: a cached bfloat16 copy of a float32 LoRA weight
would be read by every replay, stale after the first update.

What the step's code checks on values does not sync inside a capture: transformers' mask functions skip
their data-dependent shortcuts while a CUDA stream captures (``is_tracing`` counts stream capture), and a
static cache's decode mask is materialised anyway (``allow_is_causal_skip`` is off for a compileable cache
at one query token). Anything else that syncs (``.item()``, a copy from the host) makes the capture raise;
the decoder then decodes eager and its owner logs why (:meth:`BucketedDecoder._run_compiled`).

Example:
    >>> row_buckets(24)
    (32, 16, 8, 4, 2, 1)
    >>> width_bucket(5), width_bucket(17), width_bucket(300)
    (16, 32, 512)
    >>> captured = CapturedStep(lambda ids, mask, positions, cache: ids)  # doctest: +SKIP
    >>> logits = captured(ids, mask, positions, cache)  # first call: captures, then replays  # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import torch
from torch import nn

from marl.model.adapters import BASE_VIEW
from marl.model.rows import RowRoutes
from marl.model.sampling import DecodeStep, SamplingSettings, _forward_step, drawn_logprobs

# Layers whose fill is a Python int (sliding windows) are read as a constant by a compiled step: it would be
# compiled again at every token, so models with them decode eager (:func:`compile_problem`).
_PYTHON_COUNTERS = ("cumulative_length_int",)
WARMUP_STEPS = 3  # eager steps before recording, as torch.cuda.make_graphed_callables runs


def row_buckets(rows: int) -> tuple[int, ...]:
    """The bucket sizes a chunk of ``rows`` rows decodes in, largest first: powers of two.

    Example:
        >>> row_buckets(1), row_buckets(8)
        ((1,), (8, 4, 2, 1))
    """
    largest = 1 << max(0, (rows - 1).bit_length())
    return tuple(largest >> shift for shift in range(largest.bit_length()))


def width_bucket(width: int, smallest: int = 16) -> int:
    """The cache columns a prompt width is padded to: the next power of two, at least ``smallest``."""
    return max(smallest, 1 << max(0, (width - 1).bit_length()))


def compile_problem(cache: Any) -> str | None:
    """Why a compiled step over ``cache`` would be compiled again at every token, or ``None``."""
    counted = sorted({type(layer).__name__ for layer in cache.layers if hasattr(layer, _PYTHON_COUNTERS[0])})
    if counted:
        return (
            f"its {counted} cache layers count their fill in a Python int, which a compiled step reads as "
            "a constant"
        )
    return None


class _Buffers:
    """The preallocated state of one cache length: key/value buffers of the largest bucket, one cache object
    per bucket viewing their first rows, and the step's input buffers."""

    def __init__(self, config: Any, template: Any, rows: int, length: int, device: torch.device) -> None:
        from transformers import StaticCache

        self.length = length
        self.full = StaticCache(config=config, max_cache_len=length)
        for layer, filled in zip(self.full.layers, template.layers, strict=True):
            layer.lazy_initialization(
                filled.keys[:1].expand(rows, -1, -1, -1), filled.values[:1].expand(rows, -1, -1, -1)
            )
        self.ids = torch.zeros(rows, 1, dtype=torch.long, device=device)
        self.positions = torch.zeros(rows, 1, dtype=torch.long, device=device)
        self.mask = torch.ones(rows, length, dtype=torch.long, device=device)
        self.routes = torch.full((rows,), -1, dtype=torch.long, device=device)  # each slot's adapter position
        self.caches = {bucket: self._view(config, bucket) for bucket in row_buckets(rows)}
        self.route_views = {bucket: self.routes[:bucket] for bucket in row_buckets(rows)}
        for view in self.route_views.values():
            torch._dynamo.mark_static_address(view)

    def _view(self, config: Any, bucket: int) -> Any:
        from transformers import StaticCache

        cache = StaticCache(config=config, max_cache_len=self.length)
        for layer, full in zip(cache.layers, self.full.layers, strict=True):
            layer.__dict__.update(full.__dict__)  # the one cumulative_length tensor, shared by every bucket
            layer.keys, layer.values, layer.batch_size = full.keys[:bucket], full.values[:bucket], bucket
            torch._dynamo.mark_static_address(layer.keys)
            torch._dynamo.mark_static_address(layer.values)
        return cache

    def inputs(self, bucket: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.ids[:bucket], self.mask[:bucket], self.positions[:bucket]

    def load_prompts(self, prefilled: Any, copies: int) -> None:
        """The prompts' keys and values, each repeated for its samples, into the first rows; fill counters."""
        for layer, filled in zip(self.full.layers, prefilled.layers, strict=True):
            rows = filled.keys.shape[0] * copies
            layer.keys[:rows].copy_(filled.keys.repeat_interleave(copies, dim=0))
            layer.values[:rows].copy_(filled.values.repeat_interleave(copies, dim=0))
            layer.cumulative_length.copy_(filled.cumulative_length)
            for name in _PYTHON_COUNTERS:
                if hasattr(filled, name):
                    setattr(layer, name, getattr(filled, name))
        self.sync_counters(self.full)

    def sync_counters(self, source: Any) -> None:
        """Python-int fill counters of ``source``'s layers copied to every bucket's layers."""
        for name in _PYTHON_COUNTERS:
            for index, layer in enumerate(source.layers):
                if hasattr(layer, name):
                    for cache in (self.full, *self.caches.values()):
                        setattr(cache.layers[index], name, getattr(layer, name))

    def compact(self, slots: torch.Tensor) -> None:
        """Rows ``slots`` moved to the first ``len(slots)`` rows of every buffer."""
        kept = slots.numel()
        for layer in self.full.layers:
            layer.keys[:kept].copy_(layer.keys.index_select(0, slots))
            layer.values[:kept].copy_(layer.values.index_select(0, slots))
        for buffer in (self.ids, self.positions, self.mask, self.routes):
            buffer[:kept].copy_(buffer.index_select(0, slots))


class BucketedDecoder:
    """Samples like :func:`marl.model.sampling.sample_static`, in fixed-shape buckets.

    Args:
        peft_model: the model; the caller chooses the adapter view, eval mode and ``torch.no_grad``.
        max_rows: the most rows one call decodes (the sampler's rows per pass).
        compile_step: ``None`` (the step runs eager) or a function that compiles the decode step, e.g.
            ``lambda step: torch.compile(step, mode="reduce-overhead", fullgraph=True, dynamic=False)``, or
            captures it (:func:`capture_cuda_graphs`: plain CUDA graphs, dropped
            with the buffers they read).

    Attributes:
        buckets: the row buckets, largest first.
        steps_per_bucket: how many decode steps ran in each bucket (for reports).
        compactions: every move of the live rows to a smaller bucket, ``(from, to)``.
    """

    def __init__(
        self,
        peft_model: nn.Module,
        max_rows: int,
        compile_step: Callable[[Callable], Callable] | None = None,
        on_fallback: Callable[[BaseException], None] | None = None,
    ) -> None:
        self.peft_model = peft_model
        self.buckets = row_buckets(max_rows)
        self.eager_step = _forward_step(peft_model)
        self.compiled_step = None if compile_step is None else compile_step(self.eager_step)
        self.on_fallback = on_fallback
        self.steps_per_bucket: dict[int, int] = {}
        self.compactions: list[tuple[int, int]] = []
        self._buffers: _Buffers | None = None

    def _run_compiled(self, *inputs: Any) -> torch.Tensor:
        """The compiled step; if compiling it fails, the eager step from now on (``on_fallback`` is told)."""
        if self.compiled_step is None:
            return self.eager_step(*inputs)
        torch.compiler.cudagraph_mark_step_begin()
        try:
            return self.compiled_step(*inputs)
        except Exception as error:  # any failure to compile: the eager step
            self.compiled_step = None
            if self.on_fallback is not None:
                self.on_fallback(error)
            return self.eager_step(*inputs)

    def _drop_buffers(self) -> None:
        """Free the buffers (before allocating others); graphs captured over them are dropped first."""
        if isinstance(self.compiled_step, CapturedStep):
            self.compiled_step.forget()
        self._buffers = None

    def _buffers_for(self, template: Any, length: int, device: torch.device) -> _Buffers:
        if self._buffers is None or self._buffers.length != length:
            self._drop_buffers()
            config = self.peft_model.get_base_model().config
            self._buffers = _Buffers(config, template, self.buckets[0], length, device)
        return self._buffers

    def sample(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        settings: SamplingSettings,
        copies: int = 1,
        compiled: bool = True,
        scores: list[torch.Tensor] | None = None,
        routes: RowRoutes | None = None,
        token_logprobs: list[torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """``copies`` completions of each left-padded prompt, prompt-major, as
        :func:`marl.model.sampling.sample_static` returns them (``scores`` and ``token_logprobs``
        likewise); ``compiled=False``
        runs the eager step even where a compiled one exists (another adapter view). ``routes``: the
        adapter of each prompt, read by the routing the caller installed (:meth:`MultiAdapterModel.routed`);
        the decode then names each slot after its prompt."""
        from transformers import StaticCache

        prompts, width = input_ids.shape
        rows, steps = prompts * copies, settings.max_new_tokens
        if rows > self.buckets[0]:  # more samples of one prompt than rows per pass: larger buckets
            self._drop_buffers()
            self.buckets = row_buckets(rows)
        device = input_ids.device
        padded = width_bucket(width)
        input_ids = nn.functional.pad(input_ids, (padded - width, 0), value=settings.pad_token_id)
        attention_mask = nn.functional.pad(attention_mask, (padded - width, 0), value=0)
        positions = (attention_mask.long().cumsum(dim=1) - 1).clamp(min=0)
        prefilled = StaticCache(config=self.peft_model.get_base_model().config, max_cache_len=padded + steps)
        logits = self.eager_step(input_ids, attention_mask, positions, prefilled)[:, -1].float()
        logits = logits.repeat_interleave(copies, dim=0)
        buffers = self._buffers_for(prefilled, padded + steps, device)
        buffers.load_prompts(prefilled, copies)
        del prefilled

        bucket = next(size for size in reversed(self.buckets) if size >= rows)
        row_names: list[str] = []
        if routes is not None:  # each slot after its prompt; the slots past the rows decode the base
            row_names = [routes.names[row // copies] for row in range(rows)]
            buffers.routes.fill_(-1)
            buffers.routes[:rows].copy_(routes.index(device).repeat_interleave(copies))
            routes.follow(row_names + [BASE_VIEW] * (bucket - rows), buffers.route_views[bucket])
        buffers.ids.fill_(settings.pad_token_id)
        buffers.mask.fill_(1)
        buffers.mask[:rows, :padded].copy_(attention_mask.repeat_interleave(copies, dim=0))
        buffers.positions.zero_()
        buffers.positions[:rows, 0].copy_(positions[:, -1].repeat_interleave(copies) + 1)
        step = self._run_compiled if compiled and self.compiled_step is not None else self.eager_step

        stop_ids = torch.tensor(settings.stop_token_ids, dtype=torch.long, device=device)
        completions = torch.full((rows, steps), settings.pad_token_id, dtype=torch.long, device=device)
        probs = torch.full((rows, logits.shape[-1]), 1.0 / logits.shape[-1], device=device)
        live_rows = torch.arange(rows, device=device)  # rows still decoding, in the order of their slots
        live_slots = torch.arange(rows, device=device)
        for index in range(steps):
            scaled = logits / settings.temperature
            probs[live_rows] = torch.softmax(scaled, dim=-1)
            if scores is not None:
                scores.append(torch.zeros_like(probs).index_copy_(0, live_rows, scaled))
            drawn = torch.multinomial(probs, num_samples=1).squeeze(1)
            completions[live_rows, index] = drawn[live_rows]
            if token_logprobs is not None:
                token_logprobs.append(drawn_logprobs(probs, drawn))
            if index == steps - 1:
                break
            stopped = torch.isin(drawn[live_rows], stop_ids)
            buffers.ids[live_slots, 0] = drawn[live_rows]
            if bool(stopped.any()):
                running = ~stopped
                buffers.ids[live_slots[stopped], 0] = settings.pad_token_id
                live_rows, live_slots = live_rows[running], live_slots[running]
                if live_rows.numel() == 0:
                    break
                smaller = next(size for size in reversed(self.buckets) if size >= live_rows.numel())
                if smaller < bucket:
                    buffers.compact(live_slots)
                    live_slots = torch.arange(live_rows.numel(), device=device)
                    buffers.ids[live_rows.numel() : smaller].fill_(settings.pad_token_id)
                    buffers.sync_counters(buffers.caches[bucket])
                    self.compactions.append((bucket, smaller))
                    bucket = smaller
                    if routes is not None:
                        slot_names = [row_names[row] for row in live_rows.tolist()]
                        buffers.routes[live_rows.numel() : smaller].fill_(-1)
                        padding = [BASE_VIEW] * (smaller - len(slot_names))
                        routes.follow(slot_names + padding, buffers.route_views[bucket])
            cache = buffers.caches[bucket]
            ids, mask, positions_now = buffers.inputs(bucket)
            out = step(ids, mask, positions_now, cache)
            self.steps_per_bucket[bucket] = self.steps_per_bucket.get(bucket, 0) + 1
            logits = out[:, -1].float().index_select(0, live_slots)
            buffers.positions.add_(1)
        return completions


# ------------------------------------------------------------------ the step in CUDA graphs


class Capture(NamedTuple):
    """One recorded step: the graph, the tensor its replays write the logits to, the seconds it took."""

    graph: torch.cuda.CUDAGraph
    logits: torch.Tensor
    seconds: float


@contextlib.contextmanager
def _no_cast_cache() -> Iterator[None]:
    """Autocast as it is, without its cache of cast weights (a recorded graph would read a cached copy)."""
    if not torch.is_autocast_enabled("cuda"):
        yield
        return
    with torch.autocast("cuda", dtype=torch.get_autocast_dtype("cuda"), cache_enabled=False):
        yield


class CapturedStep:
    """``step`` captured in one CUDA graph per input buffers, replayed at every later call with them.

    Args:
        step: the eager decode step ``(ids [A, 1], mask [A, S], positions [A, 1], cache) -> logits``; every
            call with the same buffers must pass tensors of the same address (the decoder's buffers).
        on_capture: told ``(rows, cache length, seconds)`` after each capture (the sampler logs it).

    Attributes:
        captures: the recorded graphs by ``(rows, cache length, input addresses)``.
    """

    def __init__(self, step: DecodeStep, on_capture: Callable[[int, int, float], None] | None = None) -> None:
        self.step = step
        self.on_capture = on_capture
        self.captures: dict[tuple, Capture] = {}
        self._pool: Any = None

    def forget(self) -> None:
        """Drop every graph: the buffers they read were freed (the decoder made buffers of another length)."""
        self.captures.clear()

    def __call__(self, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, cache: Any) -> Any:
        key = (ids.shape[0], mask.shape[1], ids.data_ptr(), mask.data_ptr(), positions.data_ptr(), id(cache))
        capture = self.captures.get(key)
        if capture is None:
            capture = self.captures[key] = self._capture(ids, mask, positions, cache)
            if self.on_capture is not None:
                self.on_capture(ids.shape[0], mask.shape[1], capture.seconds)
        capture.graph.replay()
        return capture.logits

    def _capture(self, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, cache: Any) -> Capture:
        started = time.perf_counter()
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        counters = [layer.cumulative_length.clone() for layer in cache.layers]

        def put_back_counters() -> None:
            for layer, counter in zip(cache.layers, counters, strict=True):
                layer.cumulative_length.copy_(counter)

        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        try:
            with torch.cuda.stream(side), _no_cast_cache():
                for _ in range(WARMUP_STEPS):
                    self.step(ids, mask, positions, cache)
                    put_back_counters()
        finally:
            torch.cuda.current_stream().wait_stream(side)
            put_back_counters()
        graph = torch.cuda.CUDAGraph()
        # thread_local: another thread's CUDA calls (a data loader's pinned copies) do not break the capture
        with _no_cast_cache(), torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            logits = self.step(ids, mask, positions, cache)
        torch.cuda.synchronize()
        return Capture(graph, logits, time.perf_counter() - started)


def capture_cuda_graphs(on_capture: Callable[[int, int, float], None] | None = None) -> Callable:
    """A ``compile_step`` for :class:`BucketedDecoder`: the step captured in plain
    CUDA graphs (:class:`CapturedStep`), ``on_capture`` told each capture's seconds."""

    def capture(step: DecodeStep) -> CapturedStep:
        return CapturedStep(step, on_capture)

    return capture
