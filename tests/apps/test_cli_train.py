"""``marl train-rloo`` / ``marl train-reward`` end to end on tiny models, and the errors of bad input."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from marl.apps.cli import main, train_rloo_main

from support.tiny import refused, save_reward_adapter, write_jsonl

PROMPTS = ["the movie was", "a dull boring", "an honest story", "the plot falls"]


@pytest.fixture(scope="module")
def setup(tiny_llama_dir, tiny_reward_adapter, tmp_path_factory):
    root = tmp_path_factory.mktemp("cli-train")
    prompts = write_jsonl(root / "prompts.jsonl", [{"text": p} for p in PROMPTS])
    return {
        "base": str(tiny_llama_dir),
        "prompts": str(prompts),
        "reward": str(tiny_reward_adapter),
        "root": root,
    }


def rloo_flags(setup, output_dir, *extra):
    return [
        "--model_name_or_path",
        setup["base"],
        "--dataset_name",
        setup["prompts"],
        "--prompt_column",
        "text",
        "--output_dir",
        str(output_dir),
        "--rloo_k",
        "2",
        "--per_device_train_batch_size",
        "4",
        "--total_episodes",
        "8",
        "--response_length",
        "5",
        "--num_ppo_epochs",
        "1",
        "--num_sample_generations",
        "0",
        "--learning_rate",
        "1e-3",
        *extra,
    ]


def test_two_updates_write_a_loadable_adapter_and_metrics(setup, tmp_path, capsys):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from marl.model.multi_adapter import MultiAdapterModel

    output = tmp_path / "run"
    main(["train-rloo", *rloo_flags(setup, output, "--reward-adapter", setup["reward"])])
    printed = capsys.readouterr().out
    assert "marl train-rloo --model_name_or_path" in printed  # the command, then the memory card
    # the settings chosen for the device (a CPU here) are said at the start and recorded with the run
    assert "chosen for the cpu device: bf16 off" in unwrapped_lines(printed)
    settings = json.loads((output / "rloo_config.json").read_text())
    assert (settings["bf16"], settings["fp16"], settings["gradient_checkpointing"]) == (False, False, False)
    assert settings["chosen_for_device"]["gradient_checkpointing"].startswith("off: a CPU")
    records = [json.loads(line) for line in (output / "metrics.jsonl").read_text().splitlines()]
    assert [record["episode"] for record in records] == [4.0, 8.0]
    assert all("objective/scores" in record and "objective/kl" in record for record in records)
    # A standard PEFT folder: plain peft loads it onto the base, and so does MultiAdapterModel.
    base = AutoModelForCausalLM.from_pretrained(setup["base"])
    policy = PeftModel.from_pretrained(base, str(output))
    assert any(
        "lora_B" in name and parameter.abs().sum() > 0 for name, parameter in policy.named_parameters()
    )
    reloaded = MultiAdapterModel.from_pretrained(setup["base"], policy_adapter=str(output), reference="base")
    assert reloaded.reference_mode == "base"

    # A second run into the same folder is refused; --overwrite_output_dir replaces the run.
    assert re.search(
        "already holds a run",
        refused(capsys, train_rloo_main, rloo_flags(setup, output, "--reward_adapter", setup["reward"])),
    )
    (output / "my-notes.txt").write_text("keep")
    train_rloo_main(rloo_flags(setup, output, "--reward_adapter", setup["reward"], "--overwrite_output_dir"))
    assert len((output / "metrics.jsonl").read_text().splitlines()) == 2
    assert (output / "my-notes.txt").read_text() == "keep"


def unwrapped(text: str) -> str:
    return "".join(text.split())


def unwrapped_lines(text: str) -> str:
    """``text`` with the console's line wrapping undone (words kept apart)."""
    return " ".join(text.split())


def test_a_run_names_its_outputs_and_evaluate_says_what_it_evaluated(setup, tmp_path, capsys):
    """train-rloo ends with a line naming the adapter folder, draws its curves, records its prompts and keeps
    the last --save_total_limit checkpoints; `marl evaluate` on the run's own training file says so, and does
    not call those prompts held-out."""
    output = tmp_path / "run"
    flags = ["--reward_adapter", setup["reward"], "--save_steps", "1", "--save_total_limit", "1"]
    main(["train-rloo", *rloo_flags(setup, output, *flags)])
    printed = capsys.readouterr().out
    curves = output / "training_curves.png"
    assert printed.rstrip().splitlines()[-1] == (
        f"Done: policy adapter 'policy' written to {output}; training curves in {curves}"
    )
    assert curves.read_bytes().startswith(b"\x89PNG")
    assert sorted(path.name for path in output.glob("checkpoint-*")) == ["checkpoint-2"]
    recorded = json.loads((output / "rloo_config.json").read_text())["dataset"]
    assert recorded == {
        "dataset_name": setup["prompts"],
        "dataset_path": str(Path(setup["prompts"]).resolve()),
        "train_split": None,  # one file has no splits: all of it was trained on
        "test_split": None,
        "prompt_column": "text",
        "train_prompts": len(PROMPTS),
        "eval_prompts": None,
    }

    evaluate = ["evaluate", "--model_name_or_path", setup["base"], "--prompt_column", "text"]
    evaluate += ["--num_prompts", "4", "--response_length", "4", "--batch_size", "4"]
    for policy in (output, output / "checkpoint-2"):  # the run folder, and a checkpoint of the run
        results = tmp_path / f"eval-{policy.name}"
        main(
            [
                *evaluate,
                "--policy_adapter",
                str(policy),
                "--dataset_name",
                setup["prompts"],
                "--output_dir",
                str(results),
            ]
        )
    captured = capsys.readouterr()
    # rich wraps the table title at the terminal width, paths included: compare without whitespace
    out, err = unwrapped(captured.out), " ".join(captured.err.split())
    whole_file = f"the whole file {recorded['dataset_path']}"
    assert "held-out" not in out
    assert out.count(unwrapped(f"Evaluation on 4 training prompts of the run: {whole_file}")) == 2
    warning = (
        f"warning: the evaluation prompts ({whole_file} (a file has no splits)) are the prompts the policy "
        f"was trained on, as {output / 'rloo_config.json'} records"
    )
    assert err.count(warning) == 2
    settings = json.loads((tmp_path / "eval-run" / "eval_results.json").read_text())["settings"]
    assert settings["dataset_split"] is None and settings["training_prompts"] is True

    other = write_jsonl(tmp_path / "other.jsonl", [{"text": "a lovely film"}, {"text": "the ending"}])
    main(
        [
            *evaluate,
            "--policy_adapter",
            str(output),
            "--dataset_name",
            str(other),
            "--output_dir",
            str(results),
        ]
    )
    captured = capsys.readouterr()
    assert "warning" not in captured.err
    title = f"Evaluation on 2 held-out prompts: the whole file {other.resolve()}"
    assert unwrapped(title) in unwrapped(captured.out)


def test_reward_function_instead_of_an_adapter(setup, tmp_path, monkeypatch, capsys):
    (tmp_path / "my_rewards.py").write_text(
        "def count_e(prompts, completions):\n"
        "    return [c.count('e') for c in completions]\n"
        "def one_short(prompts, completions):\n"
        "    return [0.0] * (len(completions) - 1)\n"
        "def words(prompts, completions):\n"
        "    return ['great'] * len(completions)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    output = tmp_path / "run"
    train_rloo_main(rloo_flags(setup, output, "--reward_fn", "my_rewards:count_e"))
    assert len((output / "metrics.jsonl").read_text().splitlines()) == 2
    assert re.search(
        "'my_rewards:one_short' returned 3 scores for 4 completions",
        refused(
            capsys,
            train_rloo_main,
            rloo_flags(setup, tmp_path / "short", "--reward_fn", "my_rewards:one_short"),
        ),
    )
    assert re.search(
        r"'my_rewards:words' returned 'great'.*numbers",
        refused(
            capsys, train_rloo_main, rloo_flags(setup, tmp_path / "words", "--reward_fn", "my_rewards:words")
        ),
    )
    assert re.search(
        "could not import 'not_a_module'",
        refused(
            capsys,
            train_rloo_main,
            rloo_flags(setup, tmp_path / "missing", "--reward_fn", "not_a_module:score"),
        ),
    )


def test_bad_data_fails_before_the_model_loads(setup, tmp_path, capsys):
    assert re.search(
        r"no column 'prompt'.*\['text'\].*--prompt_column",
        refused(
            capsys,
            train_rloo_main,
            rloo_flags(
                setup, tmp_path / "a", "--reward_adapter", setup["reward"], "--prompt_column", "prompt"
            ),
        ),
    )
    text_file = tmp_path / "prompts.txt"
    text_file.write_text("the movie was\n")
    assert re.search(
        r"unknown dataset file type '\.txt'",
        refused(
            capsys,
            train_rloo_main,
            rloo_flags(
                setup, tmp_path / "b", "--reward_adapter", setup["reward"], "--dataset_name", str(text_file)
            ),
        ),
    )


def test_reward_adapter_of_another_base_is_refused(setup, tmp_path, capsys):
    from transformers import AutoModelForCausalLM, LlamaConfig

    from support.tiny import build_tiny_tokenizer

    tokenizer = build_tiny_tokenizer()
    other_config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    other_base = tmp_path / "other-base"
    AutoModelForCausalLM.from_config(other_config).save_pretrained(other_base)
    tokenizer.save_pretrained(other_base)
    other_reward = save_reward_adapter(str(other_base), tmp_path / "other-reward")
    assert re.search(
        "different base model",
        refused(
            capsys,
            train_rloo_main,
            rloo_flags(setup, tmp_path / "run", "--reward_adapter", str(other_reward)),
        ),
    )


@pytest.mark.slow
def test_train_reward_command_writes_an_adapter_that_rloo_loads(setup, tmp_path):
    from marl.model.multi_adapter import MultiAdapterModel

    pairs = tmp_path / "pairs.jsonl"
    rows = [{"chosen": "good good great wonderful", "rejected": "awful bad worse worst"}] * 16
    pairs.write_text("".join(json.dumps(row) + "\n" for row in rows))
    output = tmp_path / "reward"
    main(
        [
            "train-reward",
            "--model_name_or_path",
            setup["base"],
            "--dataset",
            str(pairs),
            "--output_dir",
            str(output),
            "--quantization",
            "none",
            "--batch_size",
            "4",
        ]
    )
    model = MultiAdapterModel.from_pretrained(setup["base"], reward_adapter=str(output))
    assert model.has_reward_adapter
