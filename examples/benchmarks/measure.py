"""What the marl-vs-TRL benchmark measures, and the arithmetic it reports: memory sampled per phase, the
throughput clock, the physical floor, medians and ratios, the time estimate.

The sampler reads ``/proc/self/status`` (RSS, anonymous RSS and the kernel's peak RSS ``VmHWM``) every 20 ms,
and ``/proc/self/smaps_rollup`` (PSS: a physical page counts once, however many mappings or processes hold
it) whenever RSS makes a new high of its phase (by 8 MiB), at every phase boundary and at least twice a
second. The rollup walks the page tables (about 17 ms at 0.5 GiB), so it is read only when it can change a
peak. Per phase it keeps the peak while the phase ran and the largest rise within one pass through it.

Example:
    >>> parse_proc_fields("Rss:  2048 kB\\nPss:  1024 kB\\n")
    {'Rss': 2.0, 'Pss': 1.0}
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import statistics
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

MEMORY_KINDS = ("pss", "rss", "anon")  # what the reports compare
SAMPLED_KINDS = (*MEMORY_KINDS, "heap")  # what the sampler records (the C heap in use: plan_vs_measured.py)
LOAD_PHASE = "load"
OTHER_PHASE = "other"
# Display order of the phases a run labels (anything else follows).
PHASES = (LOAD_PHASE, "generation", "scoring", "update", OTHER_PHASE)

# ------------------------------------------------------------------------------------------------------------
# Pure arithmetic


def parse_proc_fields(text: str) -> dict[str, float]:
    """The ``Name: N kB`` fields of /proc/self/status or /proc/self/smaps_rollup, in MiB.

    Example:
        >>> parse_proc_fields("VmHWM:\\t  4096 kB\\nName:\\tpython3\\n")
        {'VmHWM': 4.0}
    """
    fields = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 3 and parts[0].endswith(":") and parts[2] == "kB":
            fields[parts[0][:-1]] = int(parts[1]) / 1024
    return fields


def rollout_kv_tokens(prompt_tokens: int, num_prompts: int, rloo_k: int, response_length: int) -> int:
    """Tokens whose keys/values a rollout must hold when each prompt is cached once for its k samples.

    Example:
        >>> rollout_kv_tokens(prompt_tokens=8, num_prompts=4, rloo_k=4, response_length=16)
        288
    """
    return num_prompts * (prompt_tokens + rloo_k * response_length)


def memory_floor(
    base_weight_bytes: float, policy_adapter_bytes: float, frozen_adapter_bytes: float, kv_bytes: int
) -> dict[str, float]:
    """What training must hold at least: base as stored, policy LoRA with AdamW, frozen adapters, KV cache.

    ``policy_adapter_bytes`` counts the trainable adapter with its gradients and AdamW's two moments.

    Example:
        >>> memory_floor(1000.0, 160.0, 20.0, 30)["total"]
        1210.0
    """
    parts = {
        "base weights (as stored)": float(base_weight_bytes),
        "policy adapter + grads + AdamW": float(policy_adapter_bytes),
        "frozen adapters (reward LoRA + head)": float(frozen_adapter_bytes),
        "KV cache bound (prefix shared)": float(kv_bytes),
    }
    parts["total"] = sum(parts.values())
    return parts


def spread(values: Sequence[float]) -> dict[str, float]:
    """Median, min and max of a list of measurements.

    Example:
        >>> spread([3.0, 1.0, 2.0])
        {'median': 2.0, 'min': 1.0, 'max': 3.0}
    """
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def ratio(numerator: float, denominator: float) -> float:
    """numerator / denominator, NaN when the denominator is zero (a failed peer run must not read as a win).

    Example:
        >>> ratio(1.0, 4.0)
        0.25
    """
    return numerator / denominator if denominator else float("nan")


def flat_metrics(result: Mapping[str, Any]) -> dict[str, float]:
    """The numbers of one run's result that the summary compares, flattened to ``name -> value`` (MiB, /s).

    ``pss_above_baseline`` is the peak PSS minus the PSS after the imports: the memory ratio of the report.
    Per phase: ``<phase>_pss_above_baseline`` (peak PSS while the phase ran) and the same for anonymous RSS.

    Example:
        >>> memory = {"baseline": {"pss": 400.0, "rss": 450.0, "anon": 300.0},
        ...           "peak": {"pss": 900.0, "rss": 1000.0, "anon": 700.0}, "vmhwm": 1010.0,
        ...           "phases": {"update": {"pss": 850.0, "rss": 950.0, "anon": 650.0}},
        ...           "points": {"after load": [{"pss": 700.0, "rss": 800.0, "anon": 500.0}]}}
        >>> flat = flat_metrics({"eps": 2.0, "tokens_per_s": 32.0, "memory": memory})
        >>> [flat[f"{name}pss_above_baseline"] for name in ("", "update_", "after load_")]
        [500.0, 450.0, 300.0]
    """
    memory = result["memory"]
    baseline = memory["baseline"]
    flat = {"eps": result["eps"], "tokens_per_s": result["tokens_per_s"], "peak_rss_vmhwm": memory["vmhwm"]}
    for kind in MEMORY_KINDS:
        flat[f"peak_{kind}"] = memory["peak"][kind]
        flat[f"{kind}_above_baseline"] = memory["peak"][kind] - baseline[kind]
        for phase, peaks in memory["phases"].items():
            flat[f"{phase}_{kind}_above_baseline"] = peaks[kind] - baseline[kind]
        for phase, rise in memory.get("rises", {}).items():
            flat[f"{phase}_{kind}_rise"] = rise[kind]
        for point, samples in memory["points"].items():
            flat[f"{point}_{kind}_above_baseline"] = samples[-1][kind] - baseline[kind]
    for phase, seconds in memory.get("seconds", {}).items():
        flat[f"{phase}_seconds"] = seconds
    copied = ("cuda_max_allocated_mib", "cuda_max_reserved_mib", "cpu_seconds", "wall_seconds")
    for key in (*copied, "sampling_tokens_per_s", "decode_step_ms"):
        if key in result:
            flat[key] = result[key]
    return flat


def summarize(runs: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, dict[str, float]]]:
    """Per system, the spread of every metric over its runs (``runs``: dicts with ``system`` and ``result``).

    Example:
        >>> runs = [{"system": "trl", "result": {"eps": e}} for e in (1.0, 3.0, 2.0)]
        >>> summarize(runs)["trl"]["eps"]
        {'median': 2.0, 'min': 1.0, 'max': 3.0}
    """
    values: dict[str, dict[str, list[float]]] = {}
    for run in runs:
        result = run["result"]
        flat = flat_metrics(result) if "memory" in result else result
        mine = values.setdefault(run["system"], {})
        for name, value in flat.items():
            if isinstance(value, (int, float)):
                mine.setdefault(name, []).append(float(value))
    return {system: {name: spread(v) for name, v in metrics.items()} for system, metrics in values.items()}


def estimate_minutes(plan: Sequence[tuple[str, str, str]], seconds_per_run: Callable[..., float], runs: int):
    """Minutes the benchmark takes: every (setup, quantization, system) of ``plan`` ``runs`` times.

    Example:
        >>> estimate_minutes([("a", "none", "marl"), ("a", "none", "trl")], lambda *key: 30.0, runs=3)
        3.0
    """
    return runs * sum(seconds_per_run(*key) for key in plan) / 60


# ------------------------------------------------------------------------------------------------------------
# Measurement (inside the worker processes)


def read_status() -> dict[str, float]:
    return parse_proc_fields(Path("/proc/self/status").read_text())


def read_memory() -> dict[str, float]:
    """PSS, RSS and anonymous RSS of this process now (one read of /proc/self/smaps_rollup) and the C heap's
    bytes in use, in MiB."""
    rollup = parse_proc_fields(Path("/proc/self/smaps_rollup").read_text())
    return {"pss": rollup["Pss"], "rss": rollup["Rss"], "anon": rollup["Anonymous"], "heap": heap_in_use()}


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
                     "fordblks", "keepcost")
    ]  # fmt: skip


@functools.cache
def _mallinfo2():
    try:
        function = ctypes.CDLL(None).mallinfo2
    except AttributeError:  # not glibc >= 2.33
        return None
    function.restype = _MallInfo2
    return function


def heap_in_use() -> float:
    """MiB the C allocator has handed out and not taken back (glibc ``mallinfo2``: bytes in use in every
    arena plus mmapped blocks), NaN without glibc. CPU tensors are allocated there, so this is the allocator
    statistic of the tensors alive (with the runtime's own allocations), without the freed memory glibc keeps
    (which RSS and PSS include)."""
    function = _mallinfo2()
    if function is None:
        return float("nan")
    info = function()
    return (info.uordblks + info.hblkhd) / 2**20


def mapped_file_memory(directory: str) -> dict[str, float]:
    """RSS and PSS of this process's maps of the files under ``directory`` (a checkpoint), in MiB.

    RSS counts a page once per map that holds it; PSS once, split among the maps (of every process) that
    hold it. Two models mapping the same checkpoint show RSS twice the PSS.
    """
    rss = pss = 0.0
    current = None
    prefix = str(Path(directory).resolve())
    for line in Path("/proc/self/smaps").read_text().splitlines():
        fields = line.split()
        if not fields[0].endswith(":"):
            current = fields[5] if len(fields) >= 6 else None
        elif current and current.startswith(prefix) and fields[0] in ("Rss:", "Pss:"):
            if fields[0] == "Rss:":
                rss += int(fields[1]) / 1024
            else:
                pss += int(fields[1]) / 1024
    return {"rss": rss, "pss": pss}


def reset_peak_rss() -> bool:
    """Reset the kernel's peak-RSS mark (``VmHWM``) so that it covers only what follows."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


class MemorySampler:
    """Peak PSS, RSS and anonymous RSS of this process, overall and per phase, sampled in a daemon thread.

    Phases nest: ``with sampler.phase("scoring"):`` (or :meth:`push`/:meth:`pop`) labels what runs inside,
    and the innermost label gets the samples. :meth:`mark` records a point (e.g. ``"after load"``).
    """

    def __init__(self, interval: float = 0.02, pss_interval: float = 0.5, pss_step: float = 8.0) -> None:
        self.pss_step = pss_step  # MiB of new RSS high in a phase that trigger a PSS read
        self.baseline = read_memory()
        self.peak = dict(self.baseline)
        self.phases: dict[str, dict[str, float]] = {}
        self.rises: dict[str, dict[str, float]] = {}  # largest rise within one pass through a phase
        self.points: dict[str, list[dict[str, float]]] = {}
        self._stack = [LOAD_PHASE]
        self.seconds: dict[str, float] = {}  # wall seconds per phase, the innermost phase only
        self._switched = time.perf_counter()
        self._passes: list[tuple[dict[str, float], dict[str, float]]] = []  # (start, peak) of open phases
        self._interval, self._pss_interval = interval, pss_interval
        self._last_pss = 0.0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            self.sample()

    def _record(self, phase: str, values: Mapping[str, float]) -> None:
        peaks = self.phases.setdefault(phase, {kind: 0.0 for kind in SAMPLED_KINDS})
        for kind, value in values.items():
            peaks[kind] = max(peaks[kind], value)
            self.peak[kind] = max(self.peak[kind], value)
            for _, peak in self._passes:
                peak[kind] = max(peak.get(kind, value), value)

    def sample(self, full: bool = False) -> dict[str, float]:
        """One sample: RSS and anonymous RSS always, PSS when it may set a new peak (or ``full``)."""
        with self._lock:
            phase = self._stack[-1]
            status = read_status()
            values = {"rss": status["VmRSS"], "anon": status["RssAnon"], "heap": heap_in_use()}
            phase_peak_rss = self.phases.get(phase, {}).get("rss", 0.0)
            now = time.perf_counter()
            new_high = values["rss"] > phase_peak_rss + self.pss_step
            if full or new_high or now - self._last_pss > self._pss_interval:
                values = read_memory()
                self._last_pss = now
            self._record(phase, values)
            return values

    def _charge(self) -> None:
        """The wall time since the last phase change goes to the phase that was innermost."""
        now = time.perf_counter()
        phase = self._stack[-1]
        self.seconds[phase] = self.seconds.get(phase, 0.0) + now - self._switched
        self._switched = now

    def push(self, phase: str) -> None:
        start = self.sample(full=True)
        with self._lock:
            self._charge()
            self._stack.append(phase)
            self._passes.append((start, dict(start)))

    def pop(self) -> None:
        self.sample(full=True)  # a phase often peaks just before it returns
        with self._lock:
            if len(self._stack) > 1:
                self._charge()
                phase = self._stack.pop()
                start, peak = self._passes.pop()
                rise = self.rises.setdefault(phase, {kind: 0.0 for kind in SAMPLED_KINDS})
                for kind in SAMPLED_KINDS:
                    rise[kind] = max(rise[kind], peak[kind] - start[kind])

    def set_base_phase(self, phase: str) -> None:
        """Label everything outside a labelled phase from now on (``"load"`` until the model is built)."""
        self.sample(full=True)
        with self._lock:
            self._charge()
            self._stack[0] = phase

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        self.push(name)
        try:
            yield
        finally:
            self.pop()

    def mark(self, point: str) -> dict[str, float]:
        values = self.sample(full=True)
        self.points.setdefault(point, []).append(values)
        return values

    def stop(self) -> dict[str, Any]:
        """Stop sampling; the baseline, the peaks, the per-phase peaks, the points and ``VmHWM`` (MiB)."""
        self._stop.set()
        self._thread.join()
        self.sample(full=True)
        return {
            "baseline": self.baseline,
            "peak": self.peak,
            "vmhwm": read_status()["VmHWM"],
            "phases": self.phases,
            "rises": self.rises,
            "points": self.points,
            "seconds": self.seconds,
        }


def label_calls(sampler: MemorySampler, owner: Any, attribute: str, phase: str, mark: str | None = None):
    """Run ``owner.attribute(...)`` inside ``sampler.phase(phase)`` (and ``sampler.mark(mark)`` after it).

    Returns whether ``owner`` has that attribute: a renamed method leaves its time in the enclosing phase.
    """
    original = getattr(owner, attribute, None)
    if original is None:
        return False

    @functools.wraps(original)
    def labelled(*args, **kwargs):
        with sampler.phase(phase):
            result = original(*args, **kwargs)
        if mark:
            sampler.mark(mark)
        return result

    setattr(owner, attribute, labelled)
    return True


class UpdateClock:
    """Timestamps at the end of every update; throughput is measured over the updates after the first."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.update_ends: list[float] = []

    def tick(self) -> None:
        self.update_ends.append(time.perf_counter())

    def throughput(self, episodes_per_update: int, tokens_per_update: int) -> dict[str, Any]:
        if len(self.update_ends) < 2:
            raise RuntimeError(
                f"need 2 or more updates to exclude the warm-up, got {len(self.update_ends)}: raise --updates"
            )
        timed_updates = len(self.update_ends) - 1
        seconds = self.update_ends[-1] - self.update_ends[0]
        durations = [
            b - a for a, b in zip([self.start, *self.update_ends[:-1]], self.update_ends, strict=True)
        ]
        return {
            "eps": episodes_per_update * timed_updates / seconds,
            "tokens_per_s": tokens_per_update * timed_updates / seconds,
            "update_seconds": durations,
        }
