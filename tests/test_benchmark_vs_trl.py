"""The pure parts of the marl-vs-TRL benchmark harness: floor sum, KV tokens, throughput clock, summary."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import pytest

_SCRIPT = Path(__file__).resolve().parents[1] / "examples" / "benchmarks" / "vs_trl.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("vs_trl", _SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["vs_trl"] = module  # dataclasses look their module up by name
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        del sys.modules["vs_trl"]


def test_kv_tokens_store_each_prompt_once(bench):
    tokens = bench.rollout_kv_tokens(prompt_tokens=8, num_prompts=4, rloo_k=4, response_length=16)
    assert tokens == 4 * 8 + 4 * 4 * 16
    unshared = 4 * 4 * (8 + 16)  # the prompt repeated for each of the k samples
    assert tokens < unshared


def test_memory_floor_sums_its_parts(bench):
    floor = bench.memory_floor(
        base_weight_bytes=100.0, policy_adapter_bytes=48.0, frozen_adapter_bytes=7.0, kv_bytes=5
    )
    assert floor["policy adapter + grads + AdamW"] == 48.0
    assert floor["total"] == 100.0 + 48.0 + 7.0 + 5
    assert len(floor) == 5


def test_clock_excludes_the_first_update(bench):
    clock = bench.UpdateClock()
    clock.start = 0.0
    clock.update_ends = [100.0, 110.0, 130.0]  # warm-up 100 s, then 10 s and 20 s
    result = clock.throughput(episodes_per_update=16, tokens_per_update=256)
    assert result["eps"] == pytest.approx(2 * 16 / 30)
    assert result["tokens_per_s"] == pytest.approx(2 * 256 / 30)
    assert result["update_seconds"] == [100.0, 10.0, 20.0]
    clock.update_ends = [5.0]
    with pytest.raises(RuntimeError, match="--updates"):
        clock.throughput(16, 256)


def test_summary_gives_median_spread_and_a_nan_ratio_for_a_zero_peer(bench):
    runs = [
        {"system": system, "quantization": "none", "result": {"eps": eps, "peak_rss_mib": mem}}
        for system, eps, mem in [
            ("marl", 3.0, 10.0),
            ("trl", 1.0, 40.0),
            ("marl", 1.0, 30.0),
            ("trl", 2.0, 20.0),
            ("marl", 2.0, 20.0),
            ("trl", 3.0, 30.0),
        ]
    ]
    summary = bench.summarize(runs, "none")
    assert summary["marl"]["eps"] == {"median": 2.0, "min": 1.0, "max": 3.0}
    assert summary["trl"]["peak_rss_mib"] == {"median": 30.0, "min": 20.0, "max": 40.0}
    medians = {system: summary[system]["peak_rss_mib"]["median"] for system in ("marl", "trl")}
    assert bench.ratio(medians["marl"], medians["trl"]) == pytest.approx(2 / 3)
    assert math.isnan(bench.ratio(1.0, 0.0))
