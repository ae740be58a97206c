"""The eager decode step captured in plain CUDA graphs (``--graph_capture cuda_graphs``): no inductor, one
``torch.cuda.CUDAGraph`` per set of input buffers (a row bucket at a cache length).

A small model's decode step on a GPU is bound by kernel launches: hundreds of them, each a few microseconds
of Python and dispatch for microseconds of work. A CUDA graph replays the recorded kernels with one launch.
:class:`marl.model.graph_decode.BucketedDecoder` keeps every input of the step (token, attention mask,
position, the static cache's keys, values and fill counter) in a buffer of fixed address, so a graph
recorded once reads them in place at every replay, and so are the weights: the optimizer updates the LoRA
weights in place, so a graph stays valid across updates (nothing in the step makes a new parameter tensor).

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
    >>> captured = CapturedStep(lambda ids, mask, positions, cache: ids)  # doctest: +SKIP
    >>> logits = captured(ids, mask, positions, cache)  # first call: captures, then replays  # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import torch

from marl.model.static_decode import DecodeStep

WARMUP_STEPS = 3  # eager steps before recording, as torch.cuda.make_graphed_callables runs


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
    """A ``compile_step`` for :class:`marl.model.graph_decode.BucketedDecoder`: the step captured in plain
    CUDA graphs (:class:`CapturedStep`), ``on_capture`` told each capture's seconds."""

    def capture(step: DecodeStep) -> CapturedStep:
        return CapturedStep(step, on_capture)

    return capture
