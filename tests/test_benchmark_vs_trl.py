"""The pure parts of the marl-vs-TRL benchmark harness (examples/benchmarks): floor, KV tokens, memory
parsing and sampling, throughput clock, summaries, the time estimate, prompts and the results file; the
learning comparison's job configs of both systems."""

from __future__ import annotations

import doctest
import math
import mmap
from pathlib import Path

import pytest

from support.benchmark_scripts import benchmark_modules

_MODULES = ("measure", "setups", "report_markdown", "vs_trl", "learning_report", "learning_vs_trl")


@pytest.fixture(scope="module")
def modules():
    """The benchmark's modules, imported from their folder as the script imports them."""
    with benchmark_modules(*_MODULES) as imported:
        yield imported


@pytest.fixture(scope="module")
def measure(modules):
    return modules["measure"]


def test_examples_of_the_helpers_run(modules):
    for name, module in modules.items():
        result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
        assert result.failed == 0, name
    assert doctest.testmod(modules["measure"]).attempted >= 8


def test_kv_tokens_store_each_prompt_once(measure):
    tokens = measure.rollout_kv_tokens(prompt_tokens=8, num_prompts=4, rloo_k=4, response_length=16)
    assert tokens == 4 * 8 + 4 * 4 * 16
    unshared = 4 * 4 * (8 + 16)  # the prompt repeated for each of the k samples
    assert tokens < unshared


def test_memory_floor_sums_its_parts(measure):
    floor = measure.memory_floor(
        base_weight_bytes=100.0, policy_adapter_bytes=48.0, frozen_adapter_bytes=7.0, kv_bytes=5
    )
    assert floor["policy adapter + grads + AdamW"] == 48.0
    assert floor["total"] == 100.0 + 48.0 + 7.0 + 5
    assert len(floor) == 5


def test_proc_fields_parse_a_smaps_rollup(measure):
    text = (
        "56356eeee000-7fffd968d000 ---p 00000000 00:00 0                          [rollup]\n"
        "Rss:              536040 kB\n"
        "Pss:              465132 kB\n"
        "Pss_Anon:         395072 kB\n"
        "Anonymous:        395072 kB\n"
        "Swap:                  0 kB\n"
    )
    fields = measure.parse_proc_fields(text)
    assert fields["Rss"] == 536040 / 1024 and fields["Pss"] == 465132 / 1024
    assert fields["Anonymous"] == fields["Pss_Anon"] and fields["Swap"] == 0.0
    assert len(fields) == 5  # the header line is no field


@pytest.mark.skipif(not Path("/proc/self/smaps_rollup").is_file(), reason="reads /proc (Linux)")
def test_sampler_gives_a_phase_its_own_peak(measure):
    sampler = measure.MemorySampler(interval=0.01)
    with sampler.phase("update"):
        # A fresh anonymous map, every page written: new resident memory whatever the heap already holds
        # (a bytearray may reuse freed pages that are still resident).
        block = mmap.mmap(-1, 64 * 2**20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        block.write(b"\x01" * len(block))
        sampler.mark("inside")
        block.close()
    sampler.set_base_phase("other")
    sampler.mark("after update")
    memory = sampler.stop()
    baseline = memory["baseline"]
    assert memory["phases"]["update"]["anon"] - baseline["anon"] > 48
    assert memory["phases"]["update"]["pss"] - baseline["pss"] > 48
    assert memory["points"]["inside"][0]["pss"] - memory["points"]["after update"][0]["pss"] > 48
    assert memory["peak"]["pss"] >= memory["phases"]["update"]["pss"]
    assert memory["rises"]["update"]["anon"] > 48 and "other" not in memory["rises"]
    assert memory["vmhwm"] >= memory["peak"]["rss"] - 1


def test_label_calls_wraps_what_exists_and_skips_what_does_not(measure):
    class Job:
        def work(self, value):
            return value * 2

    job = Job()
    sampler = measure.MemorySampler(interval=1.0)
    assert measure.label_calls(sampler, job, "work", "update", mark="after update")
    assert not measure.label_calls(sampler, job, "renamed", "update")
    assert job.work(21) == 42
    memory = sampler.stop()
    assert "update" in memory["phases"] and len(memory["points"]["after update"]) == 1


def test_clock_excludes_the_first_update(measure):
    clock = measure.UpdateClock()
    clock.start = 0.0
    clock.update_ends = [100.0, 110.0, 130.0]  # warm-up 100 s, then 10 s and 20 s
    result = clock.throughput(episodes_per_update=16, tokens_per_update=256)
    assert result["eps"] == pytest.approx(2 * 16 / 30)
    assert result["tokens_per_s"] == pytest.approx(2 * 256 / 30)
    assert result["update_seconds"] == [100.0, 10.0, 20.0]
    clock.update_ends = [5.0]
    with pytest.raises(RuntimeError, match="--updates"):
        clock.throughput(16, 256)


def _result(eps: float, peak_pss: float, baseline_pss: float = 400.0) -> dict:
    """A run's result as the workers write it (MiB, episodes/s)."""
    memory = {
        "baseline": {"pss": baseline_pss, "rss": baseline_pss + 50, "anon": baseline_pss - 100},
        "peak": {"pss": peak_pss, "rss": peak_pss + 300, "anon": peak_pss - 150},
        "vmhwm": peak_pss + 310,
        "phases": {
            phase: {"pss": peak_pss - 10 * i, "rss": peak_pss, "anon": peak_pss - 200}
            for i, phase in enumerate(("load", "generation", "scoring", "update", "other"))
        },
        "rises": {
            phase: {"pss": 50.0, "rss": 60.0, "anon": 40.0} for phase in ("generation", "scoring", "update")
        },
        "points": {
            "after load": [{"pss": baseline_pss + 200, "rss": baseline_pss + 250, "anon": baseline_pss}],
            "after update": [{"pss": peak_pss - 100, "rss": peak_pss, "anon": peak_pss - 200}] * 2,
        },
    }
    checkpoint = {"rss": 513.0, "pss": 513.0}
    return {
        "eps": eps,
        "tokens_per_s": 16 * eps,
        "update_seconds": [10.0, 8.0, 8.0],
        "memory": memory,
        "checkpoint_after_load": checkpoint,
        "checkpoint_at_end": checkpoint,
        "lengths": [16] if eps else [],
    }


def _runs() -> list[dict]:
    return [
        {"system": system, "result": _result(eps, pss)}
        for system, eps, pss in [
            ("marl", 3.0, 1000.0),
            ("trl", 1.0, 1400.0),
            ("marl", 1.0, 1200.0),
            ("trl", 2.0, 1800.0),
            ("marl", 2.0, 1100.0),
            ("trl", 3.0, 1600.0),
        ]
    ]


def test_summary_gives_median_spread_per_metric_and_phase(measure):
    summary = measure.summarize(_runs())
    assert summary["marl"]["eps"] == {"median": 2.0, "min": 1.0, "max": 3.0}
    assert summary["trl"]["pss_above_baseline"] == {"median": 1200.0, "min": 1000.0, "max": 1400.0}
    assert summary["marl"]["update_pss_above_baseline"]["median"] == 1100.0 - 30 - 400
    assert summary["marl"]["after load_pss_above_baseline"]["median"] == 200.0
    assert summary["marl"]["update_pss_rise"]["median"] == 50.0
    assert summary["marl"]["after update_pss_above_baseline"]["median"] == 1100.0 - 100 - 400
    medians = {s: summary[s]["pss_above_baseline"]["median"] for s in ("marl", "trl")}
    assert measure.ratio(medians["marl"], medians["trl"]) == pytest.approx(700 / 1200)
    assert math.isnan(measure.ratio(1.0, 0.0))


def test_estimate_adds_every_run(modules):
    vs_trl = modules["vs_trl"]
    plan = [
        (s, q, system)
        for s in ("cpu-short", "cpu-long")
        for q in ("none", "4bit")
        for system in ("marl", "trl")
    ]
    minutes = modules["measure"].estimate_minutes(plan, vs_trl.run_seconds, runs=3)
    table = modules["setups"].RUN_SECONDS
    expected = 3 * sum(table[(s, q)][system] for s, q, system in plan) / 60
    assert minutes == pytest.approx(expected)
    assert vs_trl.run_seconds("cpu-long", "none", "marl-unshared") == table[("cpu-long", "none")]["marl"]


def test_setup_groups_expand_and_unknown_names_stop(modules):
    vs_trl = modules["vs_trl"]
    assert vs_trl.setup_names("cpu") == ["cpu-short", "cpu-long", "cpu-long4", "cpu-weights"]
    assert vs_trl.setup_names("cpu-long,gpu") == ["cpu-long", "gpu-0.5b", "gpu-1.5b"]
    with pytest.raises(SystemExit, match="unknown"):
        vs_trl.setup_names("cpu-huge")


def test_sharing_is_passed_only_where_marl_has_the_switch(modules):
    sharing = modules["vs_trl"].sharing
    with_switch = ("marl", "marl-unshared", "marl-generate", "trl")
    assert sharing("marl", with_switch) == {"share_prompt_prefix": True}
    assert sharing("marl-unshared", with_switch) == {"share_prompt_prefix": False}
    # marl-generate differs from marl in its sampler only: its scoring and update share prompts too
    assert sharing("marl-generate", with_switch) == {"share_prompt_prefix": True}
    assert sharing("trl", with_switch) == {"share_prompt_prefix": None}
    assert sharing("marl", ("marl", "trl")) == {"share_prompt_prefix": None}


def test_every_marl_system_names_its_sampler(modules):
    """marl's default sampler is the device's (graph on a CUDA device): a system that did not name its own
    would change what it measures with the card."""
    vs_trl = modules["vs_trl"]
    assert set(vs_trl.marl_systems()) <= set(vs_trl.MARL_SAMPLERS)
    assert vs_trl.MARL_SAMPLERS["marl"] == vs_trl.MARL_SAMPLERS["marl-unshared"] == "static"


def test_long_prompts_reach_their_length_with_whole_snippets(modules):
    setups = modules["setups"]
    snippets = [f"review number {i} says the film is fine" for i in range(40)]
    prompts = setups.build_context_prompts(snippets, 3, 40, lambda text: len(text.split()))
    assert len(prompts) == 3 and all(len(p.split()) >= 40 for p in prompts)
    assert all(p.startswith(setups.CONTEXT_HEAD) and p.endswith(setups.CONTEXT_TAIL) for p in prompts)
    assert len({p for p in prompts}) == 3  # every prompt has its own snippets
    with pytest.raises(ValueError, match="too few"):
        setups.build_context_prompts(snippets[:2], 3, 40, lambda text: len(text.split()))


def test_results_file_has_ratios_phases_floor_and_every_run(modules):
    runs = _runs()
    floor = modules["measure"].memory_floor(500 * 2**20, 75 * 2**20, 6 * 2**20, 13 * 2**20)
    config = dataclasses_config(modules["setups"])
    report = {
        "date": "2026-11-22 08:00 UTC",
        "command": "python examples/benchmarks/vs_trl.py",
        "wall_minutes": 12.0,
        "machine": {"cores": "2"},
        "versions": {"marl": "0.1.0"},
        "systems": ["marl", "trl"],
        "setups": {
            "cpu-short": {
                "config": config,
                "prompt_tokens": [4, 11],
                "model_note": "bundled",
                "reward_adapter_note": "bundled",
                "blocks": {
                    "none": {
                        "loadavg": "0.1",
                        "runs": runs,
                        "summary": modules["measure"].summarize(runs),
                        "floor": floor,
                    }
                },
            }
        },
    }
    text = modules["report_markdown"].render_markdown(report)
    assert "| cpu-short | none | 0.58 | 1.00 | 1.18 |" in text  # 700 / 1200 PSS, 2 / 2 eps, 700 / 594 floor
    assert (
        "| none | marl | 200 / 100 | 690 (+50) |" in text
    )  # after load: PSS / anon; generation: peak (+rise)
    assert "| total | 594.0 MiB |" in text
    assert text.count("| none | ") >= 6 + 2 + 2 + 6  # results, phases, checkpoint maps, every run


def dataclasses_config(setups) -> dict:
    import dataclasses

    return dataclasses.asdict(setups.BenchConfig(setup="cpu-short", **setups.SETUPS["cpu-short"]))


@pytest.mark.parametrize("algorithm", ["rloo", "grpo"])
def test_learning_jobs_of_both_systems_agree_on_every_mapped_field(modules, algorithm, tmp_path):
    pytest.importorskip("trl")
    learning = modules["learning_vs_trl"]
    job = learning.Job("trl", 3, str(tmp_path), total_episodes=256, algorithm=algorithm)
    _, ours, _ = learning.demo_settings(job)
    theirs = learning.trl_config(job, ours)
    assert type(theirs).__name__ == {"rloo": "RLOOConfig", "grpo": "GRPOConfig"}[algorithm]
    same = [(a, b) for a, b in learning.CONFIG_MAPPING[algorithm] if a.isidentifier() and b.isidentifier()]
    assert len(same) == {"rloo": 8, "grpo": 14}[algorithm]
    for marl_field, trl_field in same:
        assert getattr(ours, marl_field) == getattr(theirs, trl_field), (marl_field, trl_field)
    rollout = ours.per_device_train_batch_size * ours.num_mini_batches
    assert theirs.generation_batch_size == rollout and theirs.steps_per_generation == ours.num_mini_batches
    assert theirs.max_steps // theirs.steps_per_generation * rollout == ours.total_episodes == 256
    assert theirs.seed == ours.seed == 3 and theirs.generation_kwargs == {"min_new_tokens": 20}
    assert ours.kl_coef == 0.15  # the demo's β in both, whatever the preset's own default
    assert [(Path(folder) / "adapter_config.json").is_file() for folder in ours.reward_adapter] == [True]
    if algorithm == "grpo":
        assert (ours.loss_type, ours.scale_rewards, ours.kl_placement) == ("dapo", "group", "loss")


@pytest.mark.parametrize("free_mib", [64, 100_000])
def test_the_cpu_continuous_batching_cache_fits_whatever_memory_is_free(modules, monkeypatch, free_mib):
    """``trl-grpo-cb`` on a CPU (its dry run) generates with the sizes the run fixes, as TRL makes the config,
    with little or much memory free as transformers reads it; a share of the free memory fails with little."""
    pytest.importorskip("trl")
    import torch
    from transformers import GenerationConfig
    from transformers.generation import ContinuousBatchingConfig
    from transformers.generation.continuous_batching import cache

    vs_trl = modules["vs_trl"]
    config = vs_trl.build_config("gpu-0.5b", vs_trl.parse_args(["--setup", "gpu-0.5b", "--dry-run"]))
    from built_models import random_model  # the dry run's model, as the benchmark builds it

    model = random_model(config.model, config.dtype, "cpu").eval()
    used = 2**30
    monkeypatch.setattr(
        cache, "get_device_and_memory_breakdown",
        lambda: (torch.device("cpu"), used + free_mib * 2**20, used, used),
    )  # fmt: skip
    torch.manual_seed(0)
    prompts = [torch.randint(3, 1000, (24,)).tolist() for _ in range(config.batch_size)]
    generation = GenerationConfig(max_new_tokens=config.response_length, do_sample=True, eos_token_id=None)

    def generate(sizes: dict) -> dict:
        # TRL's default share applies to the footprint check only once the sizes are fixed
        cb_config = ContinuousBatchingConfig(**{"max_memory_percent": 0.5, **sizes})
        return model.generate_batch(
            prompts, generation_config=generation, continuous_batching_config=cb_config, progress_bar=False
        )

    outputs = generate(vs_trl.continuous_batching_sizes(config, longest_prompt=24))
    assert [len(output.generated_tokens) for output in outputs.values()] == [config.response_length] * len(
        prompts
    )
    if free_mib < 100:
        with pytest.raises(ValueError, match="Invalid values"):
            generate({"max_memory_percent": 0.01})  # the sizing this replaced
