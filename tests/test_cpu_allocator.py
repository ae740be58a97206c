"""The CPU allocator settings: where glibc serves a tensor's block from, and the heap given back."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
from pathlib import Path

import pytest

from marl.config import RLOOConfig
from marl.cpu.allocator import release_freed_memory, use_cpu_allocator
from marl.errors import ConfigError

# A fresh interpreter: in a process that has trained, a block can come from a free chunk inside the heap
# under either setting (the trim gives such pages back but keeps the chunk), so the test would read nothing.
_PROBE = """
import ctypes, sys
import torch
from marl.cpu.allocator import release_freed_memory, use_cpu_allocator

class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd",
                "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]

mallinfo2 = ctypes.CDLL(None).mallinfo2
mallinfo2.restype = MallInfo2
for setting in sys.argv[1:]:
    assert use_cpu_allocator(setting)
    release_freed_memory()  # as between phases
    before = mallinfo2().hblkhd  # bytes in blocks that are their own memory maps
    tensor = torch.ones(2**19)  # 2 MiB of float32
    print(setting, mallinfo2().hblkhd - before >= 2**21)
    del tensor
"""


def _own_maps(*settings: str) -> list[tuple[str, bool]]:
    """For each setting in turn, in one fresh process: whether a new 2 MiB tensor was its own memory map."""
    try:
        ctypes.CDLL(None).mallinfo2  # noqa: B018
    except AttributeError:
        pytest.skip("needs glibc >= 2.33 (mallinfo2)")
    root = Path(__file__).resolve().parents[1]
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    output = subprocess.run(
        [sys.executable, "-c", _PROBE, *settings], capture_output=True, text=True, check=True, env=environment
    ).stdout
    return [(setting, flag == "True") for setting, flag in (line.split() for line in output.splitlines())]


def test_a_2_mib_tensor_is_its_own_map_only_with_maps():
    """maps: a block of 1 MiB or more is a memory map of its own (faulted in afresh, given back when freed);
    heap: it comes from the heap, which reuses what freed tensors left."""
    assert _own_maps("maps") == [("maps", True)]
    assert _own_maps("heap") == [("heap", False)]


def test_the_settings_can_follow_each_other_in_one_process():
    """Each setting fixes both thresholds, so a run with heap after one with maps is not left with maps."""
    settings = ["maps", "heap", "maps", "heap"]
    assert _own_maps(*settings) == [(setting, setting == "maps") for setting in settings]


def test_an_unknown_setting_is_refused_by_the_config_and_the_function():
    assert RLOOConfig().cpu_allocator == "heap"
    with pytest.raises(
        ConfigError, match=r"--cpu_allocator='fast' is not a choice. Use one of \('heap', 'maps'\)"
    ):
        RLOOConfig(cpu_allocator="fast")
    with pytest.raises(ValueError, match="unknown CPU allocator setting"):
        use_cpu_allocator("fast")


def _anonymous_mib() -> float:
    status = Path("/proc/self/status").read_text().splitlines()
    return next(int(line.split()[1]) for line in status if line.startswith("RssAnon:")) / 1024


@pytest.mark.skipif(not Path("/proc/self/status").is_file(), reason="reads /proc (Linux)")
def test_freed_heap_memory_goes_back_to_the_system():
    if not release_freed_memory():
        pytest.skip("not glibc")
    # 64 KiB blocks come from the heap (below glibc's mmap threshold); the last one pins the heap's top.
    blocks = [bytearray(64 * 1024) for _ in range(400)]
    pin = bytearray(64 * 1024)
    held = _anonymous_mib()
    del blocks[:]
    freed = _anonymous_mib()
    release_freed_memory()
    assert freed > held - 5  # freed blocks below the top stay resident
    assert _anonymous_mib() < freed - 15
    del pin
