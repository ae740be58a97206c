"""Reward functions written for TRL run unchanged in marl: the reward-function examples of TRL 1.16's GRPO
documentation (docs/source/grpo_trainer.md, "Using a custom reward function", examples 1-5) and TRL's own
shipped reward functions, scored by TRL's ``GRPOTrainer._calculate_rewards`` on a real tiny ``GRPOTrainer``
and by marl's rollout path (prompts with their dataset columns through ``prepare_prompts``, completions
through ``Samples.from_responses`` and ``Scorer.scoring_batch``, then ``WeightedRewards``), on the same
completion ids. The rewards must be equal, row for row (marl's rows are k-major, TRL's prompt-major)."""

from __future__ import annotations

import asyncio
import math
import re

import pytest
import torch

# --- TRL's documented examples (docs/source/grpo_trainer.md), as a TRL user writes them -------------------


def reward_len(completions, **kwargs):  # Example 1: a length reward
    return [-abs(20 - len(completion)) for completion in completions]


def format_reward_func(completions, **kwargs):  # Example 2: a format reward on conversational data
    pattern = r"^<think>.*?</think><answer>.*?</answer>$"
    completion_contents = [completion[0]["content"] for completion in completions]
    matches = [re.match(pattern, content) for content in completion_contents]
    return [1.0 if match else 0.0 for match in matches]


def reward_func(completions, ground_truth, **kwargs):  # Example 3: accuracy against a dataset column
    matches = [re.search(r"\\boxed\{(.*?)\}", completion) for completion in completions]
    contents = [match.group(1) if match else "" for match in matches]
    return [1.0 if c == gt else 0.0 for c, gt in zip(contents, ground_truth, strict=True)]


def math_reward_func(prompts, completions, task, **kwargs):  # Example 4: None where it does not judge
    return [float(len(c) % 3) if t == "math" else None for c, t in zip(completions, task, strict=True)]


async def async_reward_func(prompts, completions, **kwargs):  # Example 5: an async reward function
    await asyncio.sleep(0.01)
    return [1.0 if completion else 0.0 for completion in completions]


def accuracy(completions, answer, **kwargs):  # the common conversational accuracy reward
    return [float(answer_ in c[0]["content"]) for c, answer_ in zip(completions, answer, strict=True)]


def progress(completions, trainer_state, completion_ids, **kwargs):  # shaped by the trainer's state
    return [trainer_state.global_step + len(ids) / 10 for ids in completion_ids]


PLAIN = [
    {"prompt": "Solve 2x + 3 = 7. Solution:", "ground_truth": "2", "task": "math"},
    {"prompt": "Write a sum function.", "ground_truth": "5", "task": "code"},
]
CONVERSATIONAL = [
    {"prompt": [{"role": "user", "content": "What is (1 + 2) * 4?"}], "answer": "12", "task": "math"},
    {"prompt": [{"role": "user", "content": "What is 3 * 3?"}], "answer": "9", "task": "code"},
]
# k = 2 completions per prompt, prompt-major (TRL's order): prompt 0's two, then prompt 1's two.
COMPLETIONS = [
    "<think>1+2=3</think><answer>12</answer>",
    r" The solution is \boxed{2}.",
    r" The solution is \boxed{6}.",
    "It is 9, I think",
]


def trl_rewards(model_dir, tokenizer, rows, completion_ids, functions):
    """TRL's own ``_calculate_rewards`` of a real tiny ``GRPOTrainer`` (prompt-major rows)."""
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from marl.data.prompts import is_conversation

    config = GRPOConfig(
        output_dir="unused", use_cpu=True, report_to="none", num_generations=2, per_device_train_batch_size=2,
        max_completion_length=8, bf16=False,
    )  # fmt: skip
    trainer = GRPOTrainer(
        model=str(model_dir),
        reward_funcs=functions,
        args=config,
        train_dataset=Dataset.from_list(rows),
        processing_class=tokenizer,
    )
    inputs = [row for row in rows for _ in range(2)]
    prompts = [row["prompt"] for row in inputs]
    texts = tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
    conversational = is_conversation(prompts[0])
    completions = [[{"role": "assistant", "content": t}] for t in texts] if conversational else texts
    return trainer._calculate_rewards(inputs, prompts, completions, completion_ids)


def marl_rewards(model_dir, tokenizer, rows, completion_ids, functions):
    """marl's rollout path on the same completions (k-major rows); returns them prompt-major."""
    from transformers import TrainerState

    from marl.model.multi_adapter import MultiAdapterModel
    from marl.rewards import FunctionReward, WeightedRewards
    from marl.rollout.prompts import PromptBatch, prepare_prompts
    from marl.rollout.records import Samples
    from marl.rollout.scoring import Scorer

    prompts = prepare_prompts(rows, tokenizer, "prompts", context_length=None, response_length=8)
    width = max(len(ids) for ids in completion_ids)  # padding after each EOS, as a sampler leaves it
    order = [2 * prompt + sample for sample in range(2) for prompt in range(len(rows))]  # k-major rows
    responses = torch.tensor(
        [completion_ids[i] + [tokenizer.pad_token_id] * (width - len(completion_ids[i])) for i in order]
    )
    samples = Samples.from_responses(
        PromptBatch.of(prompts, tokenizer.pad_token_id),
        2,
        responses,
        stop_token_ids=(tokenizer.eos_token_id,),
        eos_token_ids=(tokenizer.eos_token_id,),
        pad_token_id=tokenizer.pad_token_id,
        tokenizer=tokenizer,
    )
    scorer = Scorer(MultiAdapterModel.from_pretrained(str(model_dir)), tokenizer, temperature=1.0)
    reward = WeightedRewards([FunctionReward(function) for function in functions])
    per_source = reward.score(scorer.scoring_batch(samples, TrainerState())).per_source
    return per_source[torch.tensor([order.index(row) for row in range(len(order))])]


@pytest.mark.parametrize(
    ("rows", "functions"),
    [
        (PLAIN, [reward_len, reward_func, math_reward_func, async_reward_func, progress]),
        (CONVERSATIONAL, [format_reward_func, accuracy, math_reward_func, async_reward_func, progress]),
    ],
    ids=["plain", "conversational"],
)
def test_trl_documented_reward_functions_score_as_in_trl(tiny_llama_dir, rows, functions):
    from trl.rewards import get_soft_overlong_punishment, think_format_reward

    from marl.model.build import load_tokenizer

    tokenizer = load_tokenizer(str(tiny_llama_dir))
    completion_ids = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in COMPLETIONS]
    # Those shorter than the longest end at EOS (their ids include it, as in TRL); the longest is truncated.
    longest = max(len(ids) for ids in completion_ids)
    completion_ids = [ids + [tokenizer.eos_token_id] * (len(ids) < longest) for ids in completion_ids]
    functions = [*functions, get_soft_overlong_punishment(max_completion_len=12, soft_punish_cache=6)]
    if rows is CONVERSATIONAL:
        functions.append(think_format_reward)
    expected = trl_rewards(tiny_llama_dir, tokenizer, rows, completion_ids, functions)
    got = marl_rewards(tiny_llama_dir, tokenizer, rows, completion_ids, functions)
    torch.testing.assert_close(got, expected, equal_nan=True, rtol=0, atol=0)
    assert torch.isnan(expected).any() and (expected[~torch.isnan(expected)] != 0).any()  # the data bites
    # Each column reached the function that reads it: the accuracy rewards are not all equal.
    assert len(set(expected[:, 1].tolist())) == 2


def test_a_parameter_no_keyword_fills_is_one_line_naming_it():
    from marl.errors import DataError
    from marl.rewards import FunctionReward

    def needs_answer(completions, answer):
        return [0.0] * len(completions)

    with pytest.raises(DataError, match=r"reward function 'needs_answer' has a parameter 'answer'"):
        FunctionReward(needs_answer)(["p"], ["c"])


def test_older_marl_functions_keep_working():
    from marl.rewards import FunctionReward

    assert FunctionReward(lambda p, c: [len(x) for x in c])(["p"], ["abc"]) == [3.0]
    assert FunctionReward(lambda prompts, texts: [len(x) for x in texts])(["p"], ["ab"]) == [2.0]
    assert FunctionReward(lambda prompts, completions: [math.nan])(["p"], ["ab"]) == [None]


def test_async_functions_of_one_batch_are_awaited_together():
    from marl.rewards.calls import RewardCall, run_reward_functions

    running, overlap = [], []

    async def slow(completions, **kwargs):
        running.append(1)
        await asyncio.sleep(0.05)
        overlap.append(len(running))
        return [1.0] * len(completions)

    outputs = run_reward_functions([slow, slow], RewardCall(["p"], ["c"]), ["a", "b"])
    assert outputs == [[1.0], [1.0]] and overlap == [2, 2]
