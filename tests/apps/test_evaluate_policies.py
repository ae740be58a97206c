"""``marl evaluate`` with several policy folders: every policy samples as it does evaluated alone, the base
once, and the ranking's intervals say which differences the prompts can tell; bad input is one line."""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch

from marl.apps.cli import main
from marl.apps.evaluate import COMPLETIONS_FILE, RESULTS_FILE, EvaluateArguments, run_evaluation
from marl.apps.evaluate.ranking import rank_policies, wilson_interval
from marl.apps.evaluate.scores import ScoredCompletions

from support.tiny import refused, write_jsonl

PROMPTS = ["the movie was", "a dull boring", "an honest story", "the plot falls", "good good great"]
# What each member's run recorded: two settings differ, the others are the same for every member.
MEMBERS = {
    "lr-1e-4": {"learning_rate": 1e-4, "kl_coef": 0.05},
    "lr-3e-4": {"learning_rate": 3e-4, "kl_coef": 0.05},
    "lr-3e-4-kl-0.1": {"learning_rate": 3e-4, "kl_coef": 0.1},
}


def save_policy(base_dir, directory, scale, seed=2, run=None):
    """A policy adapter on ``base_dir`` whose LoRA B matrices are random times ``scale`` (0: the base
    exactly), with the ``rloo_config.json`` a run records when ``run`` is given."""
    from marl.model.multi_adapter import MultiAdapterModel

    model = MultiAdapterModel.from_pretrained(str(base_dir))
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.peft_model.named_parameters():
            if "lora_B" in name:
                parameter.copy_(torch.randn_like(parameter) * scale)
    model.save_policy_adapter(directory)
    if run is not None:
        recorded = {"model_name_or_path": str(base_dir), "quantization": None, "response_length": 6,
                    "temperature": 0.7, "stop_token": "eos", "output_dir": str(directory),
                    "policy_adapter_name": f"policy-{directory.name}", **run}  # fmt: skip
        (directory / "rloo_config.json").write_text(json.dumps(recorded))
    return directory


@pytest.fixture(scope="module")
def sweep(tiny_llama_dir, tiny_reward_adapter, tmp_path_factory):
    root = tmp_path_factory.mktemp("evaluate-policies")
    folder = root / "sweep"
    for index, (name, run) in enumerate(MEMBERS.items()):
        save_policy(tiny_llama_dir, folder / name, 0.0 if index == 0 else 0.4, seed=index, run=run)
    (folder / "curves.png").write_bytes(b"")  # what else a sweep's folder holds is not a member
    return {
        "base": str(tiny_llama_dir),
        "reward": str(tiny_reward_adapter),
        "prompts": str(write_jsonl(root / "prompts.jsonl", [{"text": p} for p in PROMPTS])),
        "sweep": folder,
        "root": root,
    }


def evaluate(setup, policy, output_dir=None):
    return run_evaluation(
        EvaluateArguments(
            policy_adapter=policy,
            reward_adapter=setup["reward"],
            dataset_name=setup["prompts"],
            dataset_split="train",
            prompt_column="text",
            num_prompts=len(PROMPTS),
            batch_size=3,
            output_dir=None if output_dir is None else str(output_dir),
        )
    )


def completions(folder):
    return [json.loads(line) for line in (folder / COMPLETIONS_FILE).read_text().splitlines()]


def test_a_sweeps_folder_ranks_its_members_each_sampled_as_when_evaluated_alone(sweep, tmp_path):
    """The sweep's folder is given alone: its three members are loaded on one base, ranked, and the results
    land in the sweep's folder. Each member's completions and scores are those of its own evaluation (same
    prompts, seeds and sampling), the base's likewise; the differing settings are the two swept ones."""
    folder = sweep["sweep"]
    summary = evaluate(sweep, str(folder))
    results = json.loads((folder / RESULTS_FILE).read_text())
    assert results["settings"]["policy_adapter"] == [str(folder / name) for name in sorted(MEMBERS)]
    assert list(results["policies"]) == sorted(MEMBERS)
    assert results["ranking"] == json.loads(json.dumps(summary["ranking"]))
    rows = completions(folder)
    assert [row["prompt"] for row in rows] == PROMPTS
    for name in MEMBERS:
        alone = evaluate(sweep, str(folder / name), tmp_path / name)
        rows_alone = completions(tmp_path / name)
        assert [row[name]["completion"] for row in rows] == [
            row["policy"]["completion"] for row in rows_alone
        ]
        assert [row["base"]["completion"] for row in rows] == [
            row["base"]["completion"] for row in rows_alone
        ]
        mine = results["policies"][name]
        assert mine["folder"] == str(folder / name) and mine["comparison"] == alone["comparison"]
        for key in ("judge_score", "reward_score", "kl", "length"):
            assert mine[key] == pytest.approx(alone["policy"][key], abs=1e-6)
        assert results["base"]["judge_score"] == pytest.approx(alone["base"]["judge_score"])
    ranking = results["ranking"]
    assert [entry["rank"] for entry in ranking] == [1, 2, 3]
    scores = [entry["judge_score"] for entry in ranking]
    assert scores == sorted(scores, reverse=True)
    for entry in ranking:
        assert entry["settings"] == MEMBERS[entry["name"]]  # not output_dir, policy_adapter_name
        low, high = entry["judge_interval"]
        assert low <= entry["judge_score"] <= high
        halves = entry["wins"] + 0.5 * entry["ties"]
        assert entry["win_interval"] == pytest.approx(list(wilson_interval(halves, len(PROMPTS))))
        assert (entry["gap_to_first"] is None) == (entry["rank"] == 1)
    identity = next(entry for entry in ranking if entry["name"] == "lr-1e-4")  # the base's own function
    assert (identity["ties"], identity["kl"]) == (len(PROMPTS), 0.0)


def test_one_policy_folder_gives_todays_results(sweep, tmp_path):
    """One --policy_adapter is the evaluation of one policy: no ranking, the keys of before."""
    summary = evaluate(sweep, str(sweep["sweep"] / "lr-3e-4"), tmp_path)
    assert set(summary) == {"base", "policy", "comparison"}
    settings = json.loads((tmp_path / RESULTS_FILE).read_text())["settings"]
    assert settings["policy_adapter"] == str(sweep["sweep"] / "lr-3e-4")


def test_the_ranking_tells_a_paired_difference_the_separate_intervals_cannot():
    """Prompts differ far more than policies: B is A less 0.02 on every prompt. Each policy's own judge
    interval overlaps the other's, but the gap to #1 is bootstrapped over the same prompts (paired), so its
    interval excludes 0 (B is < #1); a policy equal to #1 on every prompt is ≈ #1."""
    spread = [float(index % 7) for index in range(60)]

    def scored(judge):
        return ScoredCompletions(completions=["a fine film"] * 60, judge_scores=judge, lengths=[3] * 60)

    ranked = rank_policies(
        {"b": scored([x - 0.02 for x in spread]), "a": scored(spread), "same": scored(list(spread))},
        scored([0.0] * 60),
    )
    by_name = {policy.name: policy for policy in ranked}
    assert by_name["a"].rank == 1 and by_name["b"].rank == 3
    assert by_name["a"].judge_interval[0] < by_name["b"].judge_interval[1]  # the separate ones overlap
    assert by_name["b"].gap_interval[1] < 0 and by_name["b"].tied_with_first is False
    assert by_name["same"].tied_with_first is True and by_name["a"].tied_with_first is None


def test_bad_policy_folders_are_one_line_before_any_model_loads(sweep, family_dir, tmp_path, capsys):
    sweep_folder = sweep["sweep"]
    first = str(sweep_folder / "lr-1e-4")
    other_base = save_policy(family_dir("qwen2"), tmp_path / "qwen2-policy", 0.1)
    unfinished = tmp_path / "unfinished-sweep"
    shutil.copytree(sweep_folder, unfinished)
    shutil.rmtree(unfinished / "lr-3e-4")
    (unfinished / "lr-3e-4").mkdir()
    (unfinished / "lr-3e-4" / "rloo_config.json").write_text("{}")
    hotter = tmp_path / "hotter"
    shutil.copytree(sweep_folder / "lr-3e-4", hotter)
    config = json.loads((hotter / "rloo_config.json").read_text())
    (hotter / "rloo_config.json").write_text(json.dumps({**config, "temperature": 1.5}))
    common = ["--reward_adapter", sweep["reward"], "--dataset_name", sweep["prompts"], "--prompt_column",
              "text", "--num_prompts", "2"]  # fmt: skip
    out = ["--output_dir", str(tmp_path / "out")]
    empty = tmp_path / "empty"
    empty.mkdir()
    cases = {
        "missing": (
            [first, str(tmp_path / "missing")],
            out,
            r"policy adapter folder .*missing does not exist",
        ),
        "not a policy": (
            [first, sweep["prompts"]],
            out,
            r"prompts.jsonl is a file; pass the adapter's folder",
        ),
        "reward adapter": ([first, sweep["reward"]], out, r"sequence-classification \(reward\) adapter"),
        "not a run": (
            [first, str(empty)],
            out,
            r"is not a PEFT adapter \(it has no adapter_config.json\); pass the folder",
        ),
        "other base": ([first, str(other_base)], out, r"were trained on different bases .* separately$"),
        "unfinished": ([str(unfinished)], [], r"member lr-3e-4 has no policy adapter .*not finished"),
        "twice": ([first, first], out, r"names .*lr-1e-4 twice"),
        "no output": ([first, str(hotter)], [], r"several --policy_adapter folders needs --output_dir"),
        "sampling": ([first, str(hotter)], out, r"runs differ in --temperature .*: pass --temperature"),
    }
    for name, (folders, output, expected) in cases.items():
        words = ["evaluate", *(word for folder in folders for word in ("--policy_adapter", folder))]
        line = refused(capsys, main, [*words, *common, *output])
        assert line.startswith("marl evaluate: error: "), (name, line)
        assert re.search(expected, line), (name, line)
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_the_folder_a_real_sweep_writes_is_ranked(tiny_llama_dir, tmp_path):
    """``SweepTrainer``'s own output: its members' run folders are found beside its summary and curves, named
    by their folders, and the swept setting is the one that differs."""
    from transformers import AutoTokenizer

    from marl.apps.cli import evaluate_main
    from marl.config.sweep import parse_sweep
    from marl.train.sweep_trainer import SweepTrainer, build_sweep_model

    from support.runs import count_e, prompt_dataset, tiny_config

    config = tiny_config(tmp_path / "sweep", model_name_or_path=str(tiny_llama_dir), total_episodes=16)
    members = parse_sweep(["learning_rate=1e-2,3e-2"], config)
    model = build_sweep_model([member.config for member in members])
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    SweepTrainer(members, model, tokenizer, prompt_dataset(), reward_funcs=count_e).train()
    prompts = write_jsonl(tmp_path / "held-out.jsonl", [{"text": prompt} for prompt in PROMPTS])
    words = ["--policy_adapter", str(tmp_path / "sweep"), "--reward_fn", "support.runs:count_e",
             "--dataset_name", str(prompts), "--prompt_column", "text", "--batch_size", "3"]  # fmt: skip
    summary = evaluate_main(words)
    names = [member.name for member in members]
    assert sorted(summary["policies"]) == sorted(names)
    assert [entry["rank"] for entry in summary["ranking"]] == [1, 2]
    for entry in summary["ranking"]:
        assert set(entry["settings"]) == {"learning_rate"}
        assert entry["settings"]["learning_rate"] == members[names.index(entry["name"])].config.learning_rate
    results = json.loads((tmp_path / "sweep" / RESULTS_FILE).read_text())
    assert results["settings"]["policy_adapter"] == [str(tmp_path / "sweep" / name) for name in names]
