"""Torch threads follow the cores that other processes leave free."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from marl.cpu import threads as cpu_threads
from marl.cpu.threads import IDLE_SHARE, CpuSample, FreeCoreThreads, sample_cpu, threads_for_free_cores


@given(st.integers(1, 64), st.floats(0, 128), st.floats(0, 128))
def test_threads_stay_in_range_and_fall_as_other_processes_take_cores(cores, busy, more_busy):
    threads = threads_for_free_cores(cores, busy)
    assert 1 <= threads <= cores
    assert threads_for_free_cores(cores, busy + more_busy) <= threads
    if busy <= IDLE_SHARE:
        assert threads == cores


@pytest.fixture
def restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_the_governor_counts_other_processes_only_and_never_exceeds_the_start(monkeypatch, restore_threads):
    torch.set_num_threads(2)
    # (busy seconds of all processes, this process's CPU seconds, wall seconds)
    samples = iter(
        [
            CpuSample(100.0, 10.0, 0.0),  # made
            CpuSample(102.0, 11.0, 1.0),  # 2 busy core-seconds in 1 s, 1 of them ours: another process took 1
            CpuSample(104.0, 13.0, 2.0),  # 2 busy core-seconds, both ours: the cores are free again
            CpuSample(104.0, 13.0, 2.05),  # too short a window to measure: nothing changes
            CpuSample(104.5, 13.0, 3.0),  # half a core elsewhere since the last measured sample
        ]
    )
    monkeypatch.setattr(cpu_threads, "sample_cpu", lambda: next(samples))
    monkeypatch.setattr(cpu_threads.time, "sleep", lambda seconds: None)
    governor = FreeCoreThreads()
    assert governor.cores == 2
    assert governor() == 1 and governor.busy_elsewhere == pytest.approx(1.0)
    assert governor() == 2 and governor.busy_elsewhere == pytest.approx(0.0)
    assert governor() == 2 and governor.busy_elsewhere == pytest.approx(0.0)
    assert governor() == 1 and governor.busy_elsewhere == pytest.approx(0.5)


def test_without_proc_stat_the_thread_count_is_left_alone(monkeypatch, restore_threads):
    torch.set_num_threads(2)
    monkeypatch.setattr(cpu_threads, "sample_cpu", lambda: None)
    assert FreeCoreThreads()() == 2


@pytest.mark.skipif(sample_cpu() is None, reason="needs /proc/stat")
def test_proc_stat_is_read_in_seconds():
    first = sample_cpu()
    end = first.own_seconds + 0.3
    while cpu_threads.time.process_time() < end:  # this process's own work shows as busy time
        pass
    second = sample_cpu()
    assert second.busy_seconds - first.busy_seconds >= 0.2
    assert (
        second.busy_seconds - first.busy_seconds
        <= len(cpu_threads.os.sched_getaffinity(0)) * (second.wall_seconds - first.wall_seconds) + 0.05
    )
