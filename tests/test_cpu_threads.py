"""Torch threads follow the cores that other processes leave free."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from marl.cpu_threads import IDLE_SHARE, FreeCoreThreads, sample_cpu, threads_for_free_cores


@given(st.integers(1, 64), st.floats(0, 128), st.floats(0, 128))
def test_threads_stay_in_range_and_fall_as_other_processes_take_cores(cores, busy, more_busy):
    threads = threads_for_free_cores(cores, busy)
    assert 1 <= threads <= cores
    assert threads_for_free_cores(cores, busy + more_busy) <= threads
    if busy <= IDLE_SHARE:
        assert threads == cores


@pytest.mark.skipif(sample_cpu() is None, reason="needs /proc/stat")
def test_a_busy_process_is_seen_and_our_own_work_is_not():
    threads_before = torch.get_num_threads()
    try:
        governor = FreeCoreThreads(measure_seconds=0.1)
        spinner = subprocess.Popen(
            [sys.executable, "-c", "import time\nend = time.time() + 3\nwhile time.time() < end: pass"]
        )
        try:
            time.sleep(1.5)
            governor()
        finally:
            spinner.wait()
        assert governor.busy_elsewhere > 0.5
        governor()  # from here on, without the spinner
        time.sleep(1.0)
        governor()
        background = governor.busy_elsewhere
        end = time.process_time() + 1.0
        while time.process_time() < end:  # this process's own work is not another process's
            pass
        governor()
        assert governor.busy_elsewhere < background + 0.6
    finally:
        torch.set_num_threads(threads_before)
