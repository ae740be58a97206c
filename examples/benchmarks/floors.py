"""How far each phase of an update is from what this machine can do: probes of its matrix-multiply throughput
and memory bandwidth (run in the worker, at its thread count, before the model loads), and the work of each
phase counted from the model's parameter count and the update's shapes.

A phase's floor is the larger of its FLOPs / throughput and its bytes / bandwidth (weights read once per
forward pass; activations and the KV cache are left out, so the floor is a lower bound). Decode reads every
weight once per step; prefill, scoring and the update are compute-bound at these shapes.

Example:
    >>> work = phase_work(params=100, weight_bytes=400, prompt_tokens=10, prompts=2, rows=8, steps=4)
    >>> work["decode"], work["update fwd+bwd"]["flops"]
    ({'flops': 6400, 'bytes': 1600}, 41600)
    >>> floor_seconds({"flops": 100.0, "bytes": 50.0}, {"flops_per_s": 10.0, "bytes_per_s": 10.0})
    10.0
"""

from __future__ import annotations

import time
from typing import Any


def probe(torch: Any, size: int = 1024, megabytes: int = 256, repeats: int = 5) -> dict[str, float]:
    """Best-of-``repeats`` float32 matmul FLOP/s (``size`` square) and copy bandwidth (bytes read + written
    per second, a ``megabytes`` tensor) at the current thread count."""
    a, b = torch.randn(size, size), torch.randn(size, size)
    torch.mm(a, b)
    best_mm = min(_timed(lambda: torch.mm(a, b)) for _ in range(repeats))
    source = torch.ones(megabytes * 2**20 // 4)
    target = torch.empty_like(source)
    target.copy_(source)
    best_copy = min(_timed(lambda: target.copy_(source)) for _ in range(repeats))
    return {
        "flops_per_s": 2 * size**3 / best_mm,
        "bytes_per_s": 2 * source.numel() * 4 / best_copy,
        "kind": "fp32 matmul, copy",
    }


def probe_cuda(torch: Any, size: int = 8192, megabytes: int = 1024, repeats: int = 10) -> dict[str, float]:
    """Best-of-``repeats`` bf16 matmul FLOP/s (``size`` square) and copy bandwidth (bytes read + written per
    second, a ``megabytes`` tensor) of the current CUDA device, timed with CUDA events."""
    a = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
    source = torch.ones(megabytes * 2**20 // 2, device="cuda", dtype=torch.bfloat16)
    target = torch.empty_like(source)

    def best(call) -> float:
        call()
        times = []
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            call()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1000)
        return min(times)

    return {
        "flops_per_s": 2 * size**3 / best(lambda: torch.mm(a, b)),
        "bytes_per_s": 2 * source.numel() * 2 / best(lambda: target.copy_(source)),
        "kind": "bf16 matmul, CUDA copy",
    }


def probe_in_subprocess(threads: int, device: str = "cpu") -> dict[str, float]:
    """:func:`probe` (:func:`probe_cuda` for ``device="cuda"``) in a fresh interpreter with ``threads`` torch
    threads (the runs' thread count), so that neither this process's nor a run's memory carries the probe's
    buffers."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    code = (
        f"import json, sys, torch; sys.path.insert(0, {str(Path(__file__).parent)!r}); "
        f"torch.set_num_threads({threads or 0} or torch.get_num_threads()); "
        "from floors import probe, probe_cuda; "
        + ("print(json.dumps(probe_cuda(torch)))" if device == "cuda" else "print(json.dumps(probe(torch)))")
    )
    completed = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(completed.stdout.strip().splitlines()[-1])


def _timed(call) -> float:
    started = time.perf_counter()
    call()
    return time.perf_counter() - started


def phase_work(
    params: int, weight_bytes: int, prompt_tokens: int, prompts: int, rows: int, steps: int
) -> dict[str, dict[str, int]]:
    """FLOPs and weight bytes of each phase of one update: 2 FLOPs per parameter per token forward, 6 with
    the backward pass (+2 for the forward that gradient checkpointing recomputes). Prompts are computed once
    each (prefix sharing) in prefill, scoring (policy, reference, reward: 3 passes) and the update."""
    completion_tokens = rows * steps
    once = prompts * prompt_tokens + completion_tokens  # tokens of one pass with the prompts shared
    return {
        "prefill": {"flops": 2 * params * prompts * prompt_tokens, "bytes": weight_bytes},
        "decode": {"flops": 2 * params * completion_tokens, "bytes": weight_bytes * steps},
        "scoring": {"flops": 3 * 2 * params * once, "bytes": 3 * weight_bytes},
        "update fwd+bwd": {"flops": 8 * params * once, "bytes": 3 * weight_bytes},
    }


def floor_seconds(work: dict[str, float], floors: dict[str, float]) -> float:
    """Seconds a phase needs at least on this machine."""
    return max(work["flops"] / floors["flops_per_s"], work["bytes"] / floors["bytes_per_s"])


def efficiency_rows(
    work: dict[str, dict[str, int]], floors: dict[str, float], seconds: dict[str, float]
) -> list[tuple[str, float, float, float, float]]:
    """``(phase, seconds, floor seconds, achieved GFLOP/s, achieved GB/s)`` of the measured phases; the
    measured generation covers prefill and decode together."""
    measured = {
        "generation (prefill + decode)": (seconds.get("generation"), ("prefill", "decode")),
        "scoring": (seconds.get("scoring"), ("scoring",)),
        "update fwd+bwd": (seconds.get("update"), ("update fwd+bwd",)),
    }
    rows = []
    for name, (spent, parts) in measured.items():
        if not spent:
            continue
        floor = sum(floor_seconds(work[part], floors) for part in parts)
        flops = sum(work[part]["flops"] for part in parts)
        moved = sum(work[part]["bytes"] for part in parts)
        rows.append((name, spent, floor, flops / spent / 1e9, moved / spent / 1e9))
    return rows
