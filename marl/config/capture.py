"""How ``--sampler graph`` captures its decode step on a GPU (``--graph_capture``): the field, its choices and
its check, in one place.

- ``compile``: ``torch.compile(mode="reduce-overhead", fullgraph=True)``, inductor's fused kernels replayed in
  CUDA graphs; each row bucket is compiled first (about a minute for marl's buckets on the cards measured);
- ``cuda_graphs``: the eager decode step captured as it is in one ``torch.cuda.CUDAGraph`` per row bucket and
  cache length, no inductor: a capture costs a few eager steps, a replay launches the eager step's kernels
  without Python (a small model's decode step is bound by those launches, not by what fusion saves).

Example:
    >>> from types import SimpleNamespace
    >>> check_graph_capture(SimpleNamespace(graph_capture="cuda_graphs", sampler="static"))
    Traceback (most recent call last):
    ...
    marl.errors.ConfigError: --graph_capture cuda_graphs applies to --sampler graph only (this run samples ...
"""

from __future__ import annotations

from dataclasses import field
from typing import Any

from marl.errors import ConfigError

GRAPH_CAPTURES = ("compile", "cuda_graphs")
DEFAULT_GRAPH_CAPTURE = "compile"
GRAPH_CAPTURE_HELP = (
    "How --sampler graph captures its decode step on a GPU: 'compile' (torch.compile with "
    "mode='reduce-overhead': inductor's kernels in CUDA graphs, each row bucket compiled first) or "
    "'cuda_graphs' (the eager step captured in one torch.cuda.CUDAGraph per row bucket and cache length, no "
    "inductor: seconds to capture, no fusion). A capture that fails decodes eager, with the reason logged. "
    "On a CPU both decode eager."
)


def graph_capture_field() -> Any:
    """The ``graph_capture`` field of :class:`marl.RLOOConfig`."""
    return field(
        default=DEFAULT_GRAPH_CAPTURE, metadata={"help": GRAPH_CAPTURE_HELP, "choices": GRAPH_CAPTURES}
    )


def check_graph_capture(config: Any) -> None:
    """Refuse a ``graph_capture`` other than the default for a sampler that captures nothing (the flag would
    do nothing); an unset sampler is the device's, ``graph`` on a CUDA device (:mod:`marl.config.device`).
    Its choices are checked with every field's (:func:`marl.config.checks.check_fields`)."""
    if config.graph_capture != DEFAULT_GRAPH_CAPTURE and config.sampler not in (None, "graph"):
        raise ConfigError(
            f"--graph_capture {config.graph_capture} applies to --sampler graph only (this run samples with "
            f"--sampler {config.sampler}). Add --sampler graph, or drop --graph_capture"
        )
