"""Torch's CPU threads on a shared machine: as many as the cores that other processes leave free.

Torch splits each operation over its threads and waits for the slowest. When another process takes one of the
cores, the thread on that core runs only part of the time and every operation waits for it, while the other
threads spin, so an update beside one other CPU-bound process takes several times as long as alone
(docs/guides/demo.md). With one thread per free core it runs at the speed of the cores it actually has.

Every command and :class:`marl.RLOOTrainer` take the same ``threads`` setting (:func:`threads_field`): 0, the
default, follows the free cores on CPU; ``N`` fixes torch's thread count at ``N`` and turns the following off.
Within a unit of work too (:meth:`FreeCoreThreads.follow`): a job started mid-update costs that update about
:data:`WITHIN_WORK_SECONDS`, not the rest of it.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, field
from typing import Any

from marl.errors import ConfigError

# A process using less than this share of a core (an editor, a shell, a monitor) does not take a thread away.
IDLE_SHARE = 0.35
# Shorter windows turn the 10 ms resolution of /proc/stat into noise: the measure waits for a longer one.
MIN_WINDOW_SECONDS = 0.2
# Within a unit of work the governor measures again at a forward pass once this long has passed since the last
# measure: a job started mid-update stalls it about this long before the thread count follows.
WITHIN_WORK_SECONDS = 1.0
# The ``threads`` setting that follows the free cores.
FREE_CORES = 0
THREADS_HELP = (
    "CPU threads for torch. 0: on CPU, as many as the cores that other processes leave free, measured again "
    "after every update or batch, and every second within an update (a thread on a core another process "
    "takes stalls every operation); N: exactly N threads, which turns the measuring off."
)


def threads_field() -> Any:
    """The ``threads`` field of every settings dataclass, with one default and one help text."""
    return field(default=FREE_CORES, metadata={"help": THREADS_HELP})


def check_threads(threads: int) -> None:
    """Refuse a negative ``threads`` setting.

    Example:
        >>> check_threads(-1)
        Traceback (most recent call last):
        ...
        marl.errors.ConfigError: --threads=-1 must be >= 0 (0: follow the free cores; N: exactly N threads)
    """
    if threads < 0:
        raise ConfigError(
            f"--threads={threads} must be >= 0 (0: follow the free cores; N: exactly N threads)"
        )


def threads_for_free_cores(cores: int, busy_elsewhere: float) -> int:
    """The thread count for ``cores`` usable cores of which other processes keep ``busy_elsewhere`` busy.

    Example:
        >>> threads_for_free_cores(2, 0.0), threads_for_free_cores(2, 1.0), threads_for_free_cores(2, 3.0)
        (2, 1, 1)
        >>> threads_for_free_cores(8, 0.2)
        8
    """
    taken = math.ceil(max(busy_elsewhere - IDLE_SHARE, 0.0))
    return max(1, cores - taken)


@dataclass(frozen=True)
class CpuSample:
    """Busy seconds of this process's cores (all processes), this process's CPU seconds, and the time."""

    busy_seconds: float
    own_seconds: float
    wall_seconds: float


def sample_cpu(cores: set[int] | None = None) -> CpuSample | None:
    """Read ``/proc/stat`` for ``cores`` (default: the cores this process may run on); ``None`` where there
    is no ``/proc/stat``.

    Example:
        >>> sample = sample_cpu()
        >>> sample is None or sample.busy_seconds >= 0
        True
    """
    if not os.path.exists("/proc/stat") or not hasattr(os, "sched_getaffinity"):
        return None
    cores = cores if cores is not None else os.sched_getaffinity(0)
    ticks_per_second = os.sysconf("SC_CLK_TCK")
    busy = 0
    with open("/proc/stat") as handle:
        for line in handle:
            name, *fields = line.split()
            if not (name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cores):
                continue
            ticks = [int(field) for field in fields]
            idle = ticks[3] + ticks[4]  # idle + iowait
            busy += sum(ticks[:8]) - idle  # user nice system idle iowait irq softirq steal
    return CpuSample(busy / ticks_per_second, time.process_time(), time.perf_counter())


class FreeCoreThreads:
    """Sets torch's thread count, at every call, to the cores other processes left free since the last call,
    never above the count torch had when this was made (its default, ``OMP_NUM_THREADS`` or the user's).

    Call it between units of work (an RLOO update, as a :class:`marl.RLOOTrainer` callback), and let it
    :meth:`follow` a module that every forward pass runs, to measure again within a unit of work: the measure
    is the CPU time of all processes on this process's cores, minus this process's own, over the time since
    the last call. Steal time of a virtual machine counts as another process's. Where ``/proc/stat`` is
    missing (macOS, Windows) it leaves the thread count alone.

    Example:
        >>> threads = FreeCoreThreads()  # doctest: +SKIP
        >>> trainer = RLOOTrainer(config, model, tokenizer, prompts, callbacks=[threads])  # doctest: +SKIP
    """

    def __init__(
        self, measure_seconds: float = 0.5, within_work_seconds: float = WITHIN_WORK_SECONDS
    ) -> None:
        import torch

        self.cores = torch.get_num_threads()
        self.busy_elsewhere = 0.0
        self.within_work_seconds = within_work_seconds
        self._last = sample_cpu()
        if self._last is not None and self.cores > 1:
            time.sleep(measure_seconds)  # a first measure before any work, so that the start is right too

    def __call__(self, *_: object) -> int:
        """Measure now (between units of work); returns the thread count set."""
        return self._measure()

    def _measure(self) -> int:
        import torch

        now = sample_cpu()
        if now is not None and self._last is not None:
            wall = now.wall_seconds - self._last.wall_seconds
            if wall >= MIN_WINDOW_SECONDS:
                busy = now.busy_seconds - self._last.busy_seconds
                others = busy - (now.own_seconds - self._last.own_seconds)
                self.busy_elsewhere = max(others / wall, 0.0)
                self._last = now
                torch.set_num_threads(threads_for_free_cores(self.cores, self.busy_elsewhere))
        return torch.get_num_threads()

    def follow(self, module: Any) -> Any:
        """Measure again (call this governor) at a forward pass of ``module`` (a ``torch.nn.Module`` every
        forward pass runs, such as the input embeddings) once ``within_work_seconds`` have passed since the
        last measure: the thread count follows the free cores within an update too, in every phase (each
        decoded token, each scoring chunk, each micro-batch). Not while ``torch.compile`` traces (nothing to
        measure in a graph). A governor that followed ``module`` before is replaced. Returns the hook's
        handle (``handle.remove()`` stops it).

        Example:
            >>> import torch
            >>> layer = torch.nn.Linear(2, 2)
            >>> governor = FreeCoreThreads(measure_seconds=0.0, within_work_seconds=0.0)
            >>> handle = governor.follow(layer)
            >>> _ = layer(torch.zeros(1, 2))  # measured again here
            >>> handle.remove()
        """
        import torch

        def measure_when_due(*_: object) -> None:
            if torch.compiler.is_compiling() or self._last is None:
                return
            if time.perf_counter() - self._last.wall_seconds >= self.within_work_seconds:
                self._measure()

        previous = getattr(module, "_marl_free_core_threads", None)
        if previous is not None:
            previous.remove()
        handle = module.register_forward_pre_hook(measure_when_due)
        module._marl_free_core_threads = handle
        return handle


def apply_threads(threads: int, device_type: str) -> FreeCoreThreads | None:
    """Apply a ``threads`` setting for work on ``device_type``: ``N > 0`` sets torch's thread count to ``N``;
    0 on CPU sets it to the free cores now and returns the governor to call after every unit of work; 0 on
    an accelerator leaves torch alone.

    Example:
        >>> apply_threads(0, "cuda") is None
        True
    """
    import torch

    check_threads(threads)
    if threads != FREE_CORES:
        torch.set_num_threads(threads)
        return None
    if device_type != "cpu":
        return None
    governor = FreeCoreThreads()
    governor()
    return governor
