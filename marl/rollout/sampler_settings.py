"""What every sampler is told (:class:`SamplerSettings`), apart from the registry of samplers
(:mod:`marl.rollout.samplers`) that imports each of them.

Example:
    >>> settings = SamplerSettings(temperature=0.7, response_length=16, stop_at_eos=True)
    >>> settings.rows_per_pass, settings.policy
    (64, None)
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

from marl.config.device import DEFAULT_GRAPH_CAPTURE


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
