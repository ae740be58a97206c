"""How a CPU run keeps the memory that freed tensors leave in the C heap (glibc; elsewhere nothing changes).

A CPU training step allocates and frees gigabytes of activations. Where glibc serves them from decides both
the speed and the peak:

- ``heap`` (the default): blocks up to 32 MiB come from the heap, which keeps what they free and hands it to
  the next tensor: the thresholds glibc's own adjustment reaches in any PyTorch process once a large block was
  freed, and how TRL and other PyTorch programs run.
- ``maps``: every block of 1 MiB or more is its own memory map, given back when freed. The peak is closer to
  what the tensors hold, but every page of every new block is faulted in again.

``heap`` is the default because faulting every activation in again cost a CPU update more time than the heap's
higher peak costs memory (docs/results/benchmarks.md, benchmarks/results/2026-11-26-cpu-grpo-heap.md).
With either setting the trainer gives the heap back between phases (:func:`release_freed_memory`), so the
memory held between updates is the same; a sweep's update also gives it back after each policy's micro-batch
(:func:`marl.train.trainer.update_policies`). The memory planner's CPU figures are validated with ``maps``
(``examples/benchmarks/plan_vs_measured.py``); with ``heap`` a phase can hold more than planned.

Example:
    >>> use_cpu_allocator("heap") in (True, False)
    True
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import field
from typing import Any

CPU_ALLOCATORS = ("heap", "maps")
DEFAULT_CPU_ALLOCATOR = "heap"
CPU_ALLOCATOR_HELP = (
    "How a CPU run keeps the memory of freed tensors (glibc). heap: the C heap reuses it within a phase, "
    "as glibc does by default (fastest); maps: blocks of 1 MiB or more are their own memory maps, given "
    "back when freed (a lower peak, but every new block is faulted in again: an update measured 1.4x "
    "slower). Both give the heap back between phases. Ignored on GPU."
)
# The setting the memory planner's CPU figures model (marl.plan.planner).
PLANNED_CPU_ALLOCATOR = "maps"
# glibc's mallopt parameter numbers (malloc.h).
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
MiB = 2**20
# (map threshold, trim threshold) per setting. heap: where glibc's dynamic adjustment ends on 64-bit (the map
# threshold rises to the largest block freed, at most 32 MiB, and the trim threshold to twice that). maps:
# 1 MiB, and glibc's default trim threshold (128 KiB). Setting them fixes them and turns the adjustment off,
# so that either setting can follow the other in one process.
_THRESHOLDS = {"heap": (32 * MiB, 64 * MiB), "maps": (MiB, 128 * 1024)}


def cpu_allocator_field() -> Any:
    """The ``cpu_allocator`` field of a settings dataclass: one default, one help text, its choices (checked
    by :func:`marl.config.checks.check_fields` and by the command line)."""
    return field(
        default=DEFAULT_CPU_ALLOCATOR, metadata={"help": CPU_ALLOCATOR_HELP, "choices": CPU_ALLOCATORS}
    )


@functools.cache
def _glibc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # noqa: B018  (only glibc has it)
        libc.malloc_trim  # noqa: B018
        libc.mallopt  # noqa: B018
    except (OSError, AttributeError):
        return None
    return libc


def use_cpu_allocator(setting: str) -> bool:
    """Apply ``setting`` (one of :data:`CPU_ALLOCATORS`) to the whole process, from the next allocation on;
    returns whether it could (glibc only).

    Example:
        >>> use_cpu_allocator("maps") in (True, False)
        True
        >>> use_cpu_allocator(DEFAULT_CPU_ALLOCATOR) in (True, False)
        True
    """
    if setting not in CPU_ALLOCATORS:
        raise ValueError(f"unknown CPU allocator setting {setting!r}: use one of {CPU_ALLOCATORS}")
    libc = _glibc()
    if libc is None:
        return False
    map_threshold, trim_threshold = _THRESHOLDS[setting]
    return bool(libc.mallopt(_M_MMAP_THRESHOLD, map_threshold)) and bool(
        libc.mallopt(_M_TRIM_THRESHOLD, trim_threshold)
    )


def release_freed_memory() -> bool:
    """Give the memory that freed CPU tensors left in the C heap back to the operating system; returns
    whether it could (glibc only).

    The heap keeps what freed tensors held, in the middle as well as at the top: after a training step on
    CPU, most of the process's anonymous memory can be free heap that no tensor uses. ``malloc_trim`` returns
    it quickly; the trainer calls it between phases.

    Example:
        >>> release_freed_memory() in (True, False)
        True
    """
    libc = _glibc()
    if libc is None:
        return False
    libc.malloc_trim(0)
    return True


def unplanned_allocator(allocator: str) -> str | None:
    """Why a CPU run's measured peaks are not compared with the plan: it used another ``--cpu_allocator``
    than the plan models (``None`` when it did not).

    Example:
        >>> unplanned_allocator("maps") is None
        True
    """
    if allocator == PLANNED_CPU_ALLOCATOR:
        return None
    return (
        f"not compared with the plan, which models --cpu_allocator {PLANNED_CPU_ALLOCATOR}: this run used "
        f"--cpu_allocator {allocator}, whose C heap also keeps the blocks freed within a phase"
    )
