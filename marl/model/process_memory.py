"""What this process holds at its peak, phase by phase: the measure the run logs beside the memory plan.

On CUDA it is ``torch.cuda.max_memory_allocated`` (the caching allocator's tensors; the plan's CUDA runtime
is outside it), reset at the start of each phase. On CPU it is the process's peak resident memory (Linux's
``VmHWM``, reset through ``/proc/self/clear_refs``) above what the process held once torch, transformers and
PEFT were imported (:data:`IMPORTS_RSS_BYTES`, read when this module is first imported, which
:mod:`marl.model.multi_adapter` does before any model loads): the measure the planner's CPU validation uses
(``examples/benchmarks/plan_vs_measured.py``, there as PSS sampled by a thread), read here at no cost. Where
neither is available (another OS) the measure is ``None``.

Example:
    >>> device = torch.device("cpu")
    >>> reset_peak(device)
    >>> peak = peak_bytes(device)
    >>> peak is None or peak >= 0
    True
"""

from __future__ import annotations

import contextlib
import gc
from pathlib import Path

import torch

_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")
# Writing "5" to clear_refs resets the peak resident set size (VmHWM) to the current one (Linux >= 4.0).
_RESET_PEAK_RSS = "5"


def _status_bytes(field: str) -> int | None:
    """A ``kB`` field of ``/proc/self/status`` in bytes; ``None`` where there is no such file."""
    try:
        for line in _STATUS.read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


IMPORTS_RSS_BYTES = _status_bytes("VmRSS")


def reset_peak(device: torch.device) -> None:
    """Start a new peak: from now on :func:`peak_bytes` reports the largest amount held after this call."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    # where it cannot be reset the peak counts from the process's start: still an upper bound
    with contextlib.suppress(OSError):
        _CLEAR_REFS.write_text(_RESET_PEAK_RSS)


def peak_bytes(device: torch.device) -> int | None:
    """The most this process held on ``device`` since :func:`reset_peak`: allocated tensors on CUDA, the
    resident set above :data:`IMPORTS_RSS_BYTES` on CPU (``None`` where it cannot be read)."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    peak = _status_bytes("VmHWM")
    if peak is None or IMPORTS_RSS_BYTES is None:
        return None
    return max(0, peak - IMPORTS_RSS_BYTES)


def free_cached(device: torch.device) -> None:
    """Give back what an interrupted phase left: unreachable tensors, then the CUDA allocator's free blocks
    (or the C heap's, on CPU)."""
    from marl.cpu.allocator import release_freed_memory

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    else:
        release_freed_memory()
