"""The CPU allocator settings: where glibc serves a tensor's block from, and the heap given back."""

from __future__ import annotations

import ctypes
from pathlib import Path

import pytest
import torch

from marl.config import RLOOConfig
from marl.cpu_allocator import DEFAULT_CPU_ALLOCATOR, release_freed_memory, use_cpu_allocator
from marl.errors import ConfigError


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
                     "fordblks", "keepcost")
    ]  # fmt: skip


def _mapped_bytes() -> int:
    """Bytes glibc holds in blocks that are their own memory maps (``mallinfo2().hblkhd``)."""
    function = ctypes.CDLL(None).mallinfo2
    function.restype = _MallInfo2
    return function().hblkhd


@pytest.fixture
def glibc_allocator():
    try:
        ctypes.CDLL(None).mallinfo2  # noqa: B018
    except AttributeError:
        pytest.skip("needs glibc >= 2.33 (mallinfo2)")
    if not use_cpu_allocator(DEFAULT_CPU_ALLOCATOR):
        pytest.skip("not glibc")
    yield
    use_cpu_allocator(DEFAULT_CPU_ALLOCATOR)


@pytest.mark.parametrize(("setting", "own_map"), [("maps", True), ("heap", False)])
def test_a_2_mib_tensor_is_its_own_map_only_with_maps(glibc_allocator, setting, own_map):
    """maps: a block of 1 MiB or more is a memory map of its own (faulted in afresh, given back when freed);
    heap: it comes from the heap, which reuses what freed tensors left."""
    assert use_cpu_allocator(setting)
    release_freed_memory()  # as between phases: free heap would serve the block under either setting
    before = _mapped_bytes()
    tensor = torch.ones(2**19)  # 2 MiB of float32
    mapped = _mapped_bytes() - before
    del tensor
    assert (mapped >= 2**21) == own_map, f"{setting}: {mapped} bytes mapped for a 2 MiB tensor"


def test_the_settings_can_follow_each_other_in_one_process(glibc_allocator):
    """Each setting fixes both thresholds, so a run with heap after one with maps is not left with maps."""
    for setting, own_map in [("maps", True), ("heap", False), ("maps", True), ("heap", False)]:
        use_cpu_allocator(setting)
        release_freed_memory()
        before = _mapped_bytes()
        tensor = torch.ones(2**19)
        assert (_mapped_bytes() - before >= 2**21) == own_map, setting
        del tensor


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
