"""``marl plan`` as a user runs it: the plan from a model folder's config.json, the verdict against
``--memory_gb``, the changes that fit, and the other systems with ``--compare``."""

from __future__ import annotations

import re
import shutil

import pytest

from marl.apps.cli import main, plan_main


@pytest.fixture(scope="module")
def config_folder(tiny_llama_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("plan-config")
    shutil.copy(tiny_llama_dir / "config.json", folder / "config.json")
    return str(folder)


FLAGS = ["--device", "cpu", "--prompt_length", "32", "--response_length", "8", "--rloo_k", "4",
         "--per_device_train_batch_size", "16", "--local_rollout_forward_batch_size", "16"]  # fmt: skip


def _peak_gb(text: str) -> float:
    value, unit = re.search(r"predicted peak: ([\d.]+) (GB|MB|kB)", text).groups()
    return float(value) * {"GB": 1.0, "MB": 1e-3, "kB": 1e-6}[unit]


def test_plan_prints_every_phase_and_the_peak(config_folder, capsys):
    main(["plan", "--model_name_or_path", config_folder, *FLAGS])
    out = capsys.readouterr().out
    for phase in ("load", "sampling", "scoring", "update"):
        assert re.search(rf"^  {phase} +[\d.]+ (GB|MB)", out, re.MULTILINE), out
    assert "predicted peak:" in out and "fits" not in out


def test_a_run_that_does_not_fit_gets_the_changes_that_do(config_folder, capsys):
    main(["plan", "--model_name_or_path", config_folder, *FLAGS])
    peak = _peak_gb(capsys.readouterr().out)
    budget = (peak - 0.02) / 0.9  # just too small for the run as it is
    main(["plan", "--model_name_or_path", config_folder, *FLAGS, "--memory_gb", f"{budget:.4f}"])
    out = capsys.readouterr().out
    assert "does NOT fit" in out
    assert "changes that bring it under the budget" in out or "no single change" in out


def test_compare_plans_trl_and_ppo_as_the_planner_models_them(config_folder, capsys):
    main(["plan", "--model_name_or_path", config_folder, *FLAGS, "--compare"])
    out = capsys.readouterr().out
    blocks = out.split("memory plan (")[1:]
    assert [block.split(")")[0] for block in blocks] == [
        "marl",
        "TRL RLOOTrainer + peft_config (planner's model",
        "PPO, four copies (planner's model",
    ]
    peaks = [_peak_gb(block) for block in blocks]
    assert peaks[0] < peaks[1] < peaks[2]


def _progress(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("marl plan: ")]


def _plan_flags(model: str, *more: str):
    from marl.apps.flags import parse_flags
    from marl.apps.plan import PlanArguments
    from marl.config import RLOOConfig

    return parse_flags(
        [PlanArguments, RLOOConfig], "marl plan", ["--model_name_or_path", model, *FLAGS, *more]
    )


def test_plan_says_on_stderr_which_plan_it_makes_and_stdout_holds_the_plan_alone(config_folder, capsys):
    plan = plan_main(["--model_name_or_path", config_folder, *FLAGS])
    captured = capsys.readouterr()
    assert captured.out == f"{plan}\n"  # the plan as before, nothing else
    assert _progress(captured.err) == [
        f"marl plan: [1/1] planning the run as given ({config_folder})",
        "marl plan: chosen for the cpu device: bf16 off: a CPU computes in float32; fp16 off: a CPU "
        "computes in float32; gradient_checkpointing off: a CPU (activations sit in the machine's memory); "
        "sampler static: a CPU (finished rows leave the decode every step); give a flag (e.g. --bf16 true) "
        "to choose otherwise",
    ]
    main(["plan", "--model_name_or_path", config_folder, *FLAGS, "--compare"])
    err = [line for line in _progress(capsys.readouterr().err) if "chosen for the" not in line]
    assert [line.split("]")[0] for line in err] == ["marl plan: [1/3", "marl plan: [2/3", "marl plan: [3/3"]
    assert err[1].endswith("as trl-rloo") and err[2].endswith("as ppo")


@pytest.fixture(scope="module")
def embedding_heavy_folder(tmp_path_factory):
    """A config-only model whose base is mostly its (untied) embeddings: quantization hardly shrinks it."""
    from transformers import LlamaConfig

    folder = tmp_path_factory.mktemp("embedding-heavy")
    LlamaConfig(
        vocab_size=100_000, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
    ).save_pretrained(folder)  # fmt: skip
    return str(folder)


def test_when_nothing_fits_the_closest_setting_its_excess_and_the_bases_share_are_named(
    embedding_heavy_folder, capsys
):
    from marl.model.memory import format_bytes
    from marl.plan.advice import _candidates, advice_text, advise
    from marl.plan.planner import PlanTarget, load_model_config, plan_memory

    _, config = _plan_flags(embedding_heavy_folder)
    model_config = load_model_config(embedding_heavy_folder)
    base = plan_memory(config, model_config, PlanTarget(device="cpu", prompt_length=32)).resident[
        "base weights"
    ]
    memory_gb = 1.1 * base / 0.9 / 1e9  # usable: the base and a tenth more; the runtime alone is more
    plan = plan_main(["--model_name_or_path", embedding_heavy_folder, *FLAGS, "--memory_gb", f"{memory_gb}"])
    captured = capsys.readouterr()
    target = plan.target
    advice = advise(config, model_config, target, plan)
    closest = advice.closest
    assert closest is not None and closest.plan.target.num_processes == 1 and not closest.plan.fits
    assert all(change.plan.target.num_processes > 1 for change in advice.fitting)  # only more GPUs fit
    budget = plan.budget_bytes
    # stdout: the plan, then the advice; its last lines name the closest setting, its excess, the base's share
    assert captured.out == f"{plan}\n\n{advice_text(advice)}\n"
    closest_line, share_line = captured.out.splitlines()[-2:]
    assert closest_line.startswith(f"nothing tried on 1 process fits; closest: {closest.flags} needs ")
    assert (
        f"{format_bytes(closest.plan.peak - budget)} over the {format_bytes(budget)} usable" in closest_line
    )
    closest_base = closest.plan.resident["base weights"]
    assert closest_base > budget / 2
    quantization, dtype = closest.plan.settings["quantization"], closest.plan.settings["dtype"]
    kind = dtype if quantization == "none" else quantization.replace("bit", "-bit")
    assert share_line.strip().startswith(f"the {kind} base alone takes")
    assert f"alone takes {format_bytes(closest_base)} of the {format_bytes(budget)} usable" in share_line
    # stderr: one line per plan made, each change tried named
    err = captured.err
    for flags, *_ in _candidates(config, target):
        assert f"planning with {flags}\n" in err
    assert "it does not fit" in err and "planning together" in err


def test_the_bases_share_is_said_only_when_it_takes_most_of_the_usable_memory(config_folder):
    from marl.plan.advice import Change, closest_text
    from marl.plan.planner import PlanTarget, load_model_config, plan_memory

    _, config = _plan_flags(config_folder)
    model_config = load_model_config(config_folder)
    base = plan_memory(config, model_config, PlanTarget(device="cpu")).resident["base weights"]
    for share, said in ((0.25, False), (0.75, True)):
        target = PlanTarget(device="cpu", prompt_length=32, memory_gb=base / share / 0.9 / 1e9)
        text = closest_text(Change("(the run as given)", "", plan_memory(config, model_config, target)))
        assert ("base alone takes" in text) == said, text
        assert text.startswith("nothing tried on 1 process fits; closest: (the run as given) needs")


# Qwen2.5-1.5B-Instruct's config.json, as its model card's files give it (the planner reads nothing else).
QWEN25_1_5B = dict(
    hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
    num_key_value_heads=2, vocab_size=151936, max_position_embeddings=32768, rope_theta=1000000.0,
    rms_norm_eps=1e-6, tie_word_embeddings=True, bos_token_id=151643, eos_token_id=151645,
)  # fmt: skip
NEWCOMER = ["--quantization", "4bit", "--algorithm", "grpo", "--response_length", "256", "--device", "cuda",
            "--memory_gb", "24"]  # fmt: skip


@pytest.mark.slow
def test_the_newcomers_grpo_run_on_a_24_gb_card_fits_with_the_cuda_defaults(tmp_path, capsys):
    """The run of docs/guides/coming-from-trl.md on a Qwen2.5-1.5B base, nothing else given: bf16 and gradient
    checkpointing, chosen for the CUDA device, make it fit; without them (the defaults before) it did not."""
    from transformers import Qwen2Config

    from marl.apps.flags import parse_flags
    from marl.apps.plan import PlanArguments
    from marl.config import RLOOConfig
    from marl.plan.planner import PlanTarget, load_model_config, plan_memory

    Qwen2Config(**QWEN25_1_5B).save_pretrained(tmp_path)
    plan = plan_main(["--model_name_or_path", str(tmp_path), *NEWCOMER])
    captured = capsys.readouterr()
    assert plan.fits is True, captured.out
    assert plan.settings["gradient_checkpointing"] is True and "cast to bfloat16 (autocast)" in str(plan)
    assert "chosen for the cuda device: bf16 on" in captured.err
    assert "gradient_checkpointing on" in captured.err
    without = ["--bf16", "false", "--gradient_checkpointing", "false"]  # the defaults before
    words = ["--model_name_or_path", str(tmp_path), *NEWCOMER, *without]
    _, config = parse_flags([PlanArguments, RLOOConfig], "marl plan", words)
    before = plan_memory(config, load_model_config(str(tmp_path)), PlanTarget(device="cuda", memory_gb=24))
    assert before.fits is False and before.peak > plan.peak
