"""``marl evaluate`` on a tiny model: win rate, KL to the reference, and the JSON it writes."""

from __future__ import annotations

import json

import pytest
import torch

from marl.apps.evaluate import COMPLETIONS_FILE, RESULTS_FILE, EvaluateArguments, run_evaluation, win_rate
from marl.model.adapters import BASE_VIEW

from support.tiny import write_jsonl

PROMPTS = ["the movie was", "a dull boring", "an honest story", "the plot falls", "good good great"]


def test_win_rate_counts_ties_as_half():
    comparison = win_rate([1.0, 0.0, 0.5, 0.2], [0.0, 1.0, 0.5, 0.1])
    assert (comparison.wins, comparison.ties, comparison.losses) == (2, 1, 1)
    assert comparison.win_rate == pytest.approx(2.5 / 4)
    with pytest.raises(ValueError, match="one per prompt"):
        win_rate([1.0], [1.0, 2.0])


def save_policy_adapter(base_dir, directory, scale):
    """A policy adapter whose LoRA B matrices are random times ``scale`` (0 gives the base model exactly)."""
    from marl.model.multi_adapter import MultiAdapterModel

    model = MultiAdapterModel.from_pretrained(str(base_dir))
    torch.manual_seed(2)
    with torch.no_grad():
        for name, parameter in model.peft_model.named_parameters():
            if "lora_B" in name:
                parameter.copy_(torch.randn_like(parameter) * scale)
    model.save_policy_adapter(directory)
    return directory


@pytest.fixture(scope="module")
def eval_setup(tiny_llama_dir, tiny_reward_adapter, tmp_path_factory):
    root = tmp_path_factory.mktemp("evaluate")
    prompts = write_jsonl(root / "prompts.jsonl", [{"text": p} for p in PROMPTS])
    return {
        "base": str(tiny_llama_dir),
        "prompts": str(prompts),
        "reward": str(tiny_reward_adapter),
        "identity_policy": str(save_policy_adapter(tiny_llama_dir, root / "identity", 0.0)),
        "trained_policy": str(save_policy_adapter(tiny_llama_dir, root / "trained", 0.3)),
        "root": root,
    }


def evaluate(setup, policy, output_dir, **overrides):
    arguments = EvaluateArguments(
        policy_adapter=policy,
        model_name_or_path=setup["base"],
        reward_adapter=setup["reward"],
        dataset_name=setup["prompts"],
        dataset_split="train",
        prompt_column="text",
        num_prompts=len(PROMPTS),
        response_length=6,
        batch_size=3,
        output_dir=str(output_dir),
        **overrides,
    )
    return run_evaluation(arguments)


def test_policy_equal_to_base_ties_everywhere_with_zero_kl(eval_setup, tmp_path):
    summary = evaluate(eval_setup, eval_setup["identity_policy"], tmp_path)
    # Same seeds and the same distribution give the same samples: every prompt is a tie, KL is exactly 0.
    assert summary["comparison"] == {"win_rate": 0.5, "wins": 0, "ties": len(PROMPTS), "losses": 0}
    assert summary["policy"]["kl"] == 0.0
    assert summary["policy"]["reward_score"] == pytest.approx(summary["base"]["reward_score"], abs=1e-5)


def test_results_json_and_completions_file(eval_setup, tmp_path):
    summary = evaluate(eval_setup, eval_setup["trained_policy"], tmp_path)
    results = json.loads((tmp_path / RESULTS_FILE).read_text())
    assert results["settings"]["num_prompts"] == len(PROMPTS)
    assert results["settings"]["judge"] == "vader"
    assert results["policy"] == summary["policy"] and results["comparison"] == summary["comparison"]
    assert set(results["base"]) == {"reward_score", "judge_score", "length", "kl", "reward_scores_by_name"}
    assert results["base"]["kl"] is None
    rows = [json.loads(line) for line in (tmp_path / COMPLETIONS_FILE).read_text().splitlines()]
    assert [row["prompt"] for row in rows] == PROMPTS
    # The means in the JSON are the means of the per-prompt rows.
    for name in ("base", "policy"):
        for key in ("judge_score", "reward_score", "length"):
            mean = sum(row[name][key] for row in rows) / len(rows)
            assert results[name][key] == pytest.approx(mean)
    assert results["policy"]["kl"] == pytest.approx(sum(row["policy"]["kl"] for row in rows) / len(rows))
    assert results["policy"]["kl"] != 0.0
    assert all(1 <= row["policy"]["length"] <= 6 for row in rows)


def test_custom_judge_is_used(eval_setup, tmp_path, monkeypatch):
    (tmp_path / "length_judge.py").write_text("def judge(texts):\n    return [len(t) for t in texts]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    summary = evaluate(eval_setup, eval_setup["trained_policy"], tmp_path / "out", judge="length_judge:judge")
    rows = [json.loads(line) for line in (tmp_path / "out" / COMPLETIONS_FILE).read_text().splitlines()]
    assert rows[0]["policy"]["judge_score"] == len(rows[0]["prompt"] + rows[0]["policy"]["completion"])
    assert (
        json.loads((tmp_path / "out" / RESULTS_FILE).read_text())["settings"]["judge"] == "length_judge:judge"
    )
    assert 0.0 <= summary["comparison"]["win_rate"] <= 1.0


def test_base_alone_needs_an_output_dir():
    with pytest.raises(ValueError, match="--output_dir"):
        EvaluateArguments(policy_adapter=None)


def test_reward_scorer_reads_every_text_at_an_appended_eos(eval_setup):
    from transformers import AutoTokenizer

    from marl.model.multi_adapter import MultiAdapterModel
    from marl.rewards import EosTerminatedAdapterReward

    model = MultiAdapterModel.from_pretrained(eval_setup["base"], reward_adapter=eval_setup["reward"])
    tokenizer = AutoTokenizer.from_pretrained(model.name_or_path)
    scorer = EosTerminatedAdapterReward(model, tokenizer, rows_per_pass=2)
    scores = scorer.score_texts(
        ["the movie", "a dull", "an honest"], [" was great", " boring film", " story"]
    )
    ids = tokenizer("a dull boring film", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    expected = model.compute_reward_score(torch.tensor([ids]), torch.ones(1, len(ids), dtype=torch.long))
    assert scores[1] == pytest.approx(expected.item(), abs=1e-5)
    # Left padding inside a batch does not change a row's score.
    assert scorer.score_texts(["a dull"], [" boring film"])[0] == pytest.approx(float(scores[1]), abs=1e-5)


def test_evaluate_works_with_a_tokenizer_without_pad_token(family_dir, eval_setup, tmp_path):
    """Llama-3 style tokenizers have no pad token: evaluation pads with the EOS, as the trainer does, and
    stops at any of the model's terminators."""
    base = family_dir("llama3")
    policy = save_policy_adapter(base, tmp_path / "policy", 0.3)
    summary = run_evaluation(
        EvaluateArguments(
            policy_adapter=str(policy),
            model_name_or_path=str(base),
            dataset_name=eval_setup["prompts"],
            dataset_split="train",
            prompt_column="text",
            num_prompts=len(PROMPTS),
            response_length=6,
            batch_size=3,
            output_dir=str(tmp_path / "eval"),
        )
    )
    assert 0.0 <= summary["comparison"]["win_rate"] <= 1.0
    assert 1.0 <= summary["policy"]["length"] <= 6.0


def test_the_sampler_flag_picks_a_registered_sampler(eval_setup, tmp_path):
    """``--sampler`` reaches the registry: a test-only sampler registered from outside marl samples every
    completion of the evaluation, and the results equal the default sampler's (it wraps it)."""
    from marl.rollout.samplers import SAMPLERS, TransformersSampler, register_sampler

    calls: list[str] = []

    class CountingSampler(TransformersSampler):
        def sample(self, prompts, k, *, view="policy"):
            calls.append(view)
            return super().sample(prompts, k, view=view)

    register_sampler("counting", CountingSampler)
    try:
        counted = evaluate(eval_setup, eval_setup["trained_policy"], tmp_path / "counted", sampler="counting")
    finally:
        del SAMPLERS["counting"]
    batches = -(-len(PROMPTS) // 3)
    assert calls == [BASE_VIEW, "policy"] * batches
    assert counted == evaluate(eval_setup, eval_setup["trained_policy"], tmp_path / "default")


def test_a_policy_started_from_an_adapter_is_measured_against_the_base_and_its_start(eval_setup, tmp_path):
    """With a frozen copy of its starting adapter as reference, the base is still the base (adapters
    disabled), and the start is measured too: here the start is the trained adapter and the policy is still
    equal to it, so the policy ties its start everywhere, and the base's completions are those of a model
    whose reference is the base."""
    from marl.apps.evaluate.scores import generate_and_score, summarize
    from marl.model.loading import load_tokenizer
    from marl.model.multi_adapter import MultiAdapterModel
    from marl.rewards import load_judge

    start = save_policy_adapter(eval_setup["base"], tmp_path / "start", 3.0)

    def run(reference):
        model = MultiAdapterModel.from_pretrained(
            eval_setup["base"],
            policy_adapter=str(start),
            reward_adapter=eval_setup["reward"],
            reference=reference,
        )
        tokenizer = load_tokenizer(eval_setup["base"])
        judge = load_judge(f"{__name__}:length_judge")
        samples = generate_and_score(
            model, tokenizer, PROMPTS, judge, response_length=6, batch_size=3, progress=False
        )
        return samples, summarize(samples)

    started, summary = run("initial-policy")
    plain, _ = run("base")
    assert list(started) == ["base", "reference", "policy"] and list(plain) == ["base", "policy"]
    assert started["base"].completions == plain["base"].completions
    assert started["reference"].completions == started["policy"].completions == plain["policy"].completions
    assert started["base"].completions != started["policy"].completions
    assert summary["comparison_to_reference"]["ties"] == len(PROMPTS)
    assert summary["reference_comparison"] == summary["comparison"]
    assert started["policy"].kls == [0.0] * len(PROMPTS)


def length_judge(texts):
    return [float(len(text)) for text in texts]


def test_reward_functions_and_several_reward_adapters_are_each_reported(eval_setup, tmp_path, monkeypatch):
    """``marl evaluate --reward_adapter A --reward_adapter B --reward_fn F``: both adapters (the second no
    longer replaces the first) and the function, which reads a dataset column as TRL passes it, each get
    their mean and their score per completion; the table names the judge."""
    from marl.apps.cli import evaluate_main

    rows = [{"text": prompt, "answer": len(prompt)} for prompt in PROMPTS]
    prompts = write_jsonl(tmp_path / "answers.jsonl", rows)
    (tmp_path / "column_reward.py").write_text(
        "def matches(prompts, completions, answer, trainer_state, **kwargs):\n"
        "    assert trainer_state.global_step == 0\n"
        "    return [float(a == len(p)) - len(c) / 100 for p, c, a in zip(prompts, completions, answer)]\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    words = [
        "--policy_adapter", eval_setup["trained_policy"], "--model_name_or_path", eval_setup["base"],
        "--reward_adapter", f"one={eval_setup['reward']}", "--reward_adapter", f"two={eval_setup['reward']}",
        "--reward_fn", "column_reward:matches", "--dataset_name", str(prompts), "--prompt_column", "text",
        "--num_prompts", str(len(PROMPTS)), "--response_length", "6", "--batch_size", "3",
        "--output_dir", str(tmp_path / "out"),
    ]  # fmt: skip
    summary = evaluate_main(words)
    assert list(summary["policy"]["reward_scores_by_name"]) == ["one", "two", "column_reward:matches"]
    lines = (tmp_path / "out" / COMPLETIONS_FILE).read_text().splitlines()
    completions = [json.loads(line)["policy"] for line in lines]
    # the column reached the function: 1 minus a length term, never the 0-minus of a mismatched answer
    expected = [1.0 - len(row["completion"]) / 100 for row in completions]
    assert [row["reward_scores"]["column_reward:matches"] for row in completions] == pytest.approx(expected)
    one, two = (summary["policy"]["reward_scores_by_name"][name] for name in ("one", "two"))
    assert one == pytest.approx(two) and one == pytest.approx(summary["policy"]["reward_score"])


def test_unset_sampling_settings_come_from_the_training_run(eval_setup, tmp_path):
    """A policy folder whose rloo_config.json says how the run sampled (its base, length, temperature, no
    stop token): evaluation samples the same way unless a flag says otherwise."""
    import shutil

    run = tmp_path / "run"
    shutil.copytree(eval_setup["trained_policy"], run)
    recorded = {"model_name_or_path": eval_setup["base"], "quantization": None, "response_length": 3,
                "temperature": 1.3, "stop_token": "none"}  # fmt: skip
    (run / "rloo_config.json").write_text(json.dumps(recorded))
    arguments = EvaluateArguments(
        policy_adapter=str(run), dataset_name=eval_setup["prompts"], dataset_split="train",
        prompt_column="text", num_prompts=len(PROMPTS), batch_size=3, output_dir=str(tmp_path / "out"),
    )  # fmt: skip
    run_evaluation(arguments)
    settings = json.loads((tmp_path / "out" / RESULTS_FILE).read_text())["settings"]
    assert (settings["response_length"], settings["temperature"], settings["stop_at_eos"]) == (3, 1.3, False)
    assert settings["model_name_or_path"] == eval_setup["base"]
    rows = [json.loads(line) for line in (tmp_path / "out" / COMPLETIONS_FILE).read_text().splitlines()]
    assert all(row["policy"]["length"] == 3 for row in rows)  # no stop token: every completion runs to 3
    given = EvaluateArguments(policy_adapter=str(run), response_length=4, output_dir=str(tmp_path / "o2"))
    from marl.apps.evaluate import fill_from_training_run

    taken = fill_from_training_run(given)
    assert taken == {"model_name_or_path": eval_setup["base"], "quantization": None, "temperature": 1.3,
                     "stop_at_eos": False}  # fmt: skip
    assert given.response_length == 4
