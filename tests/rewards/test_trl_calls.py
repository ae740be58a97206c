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


def trl_rewards(model_dir, tokenizer, rows, completion_ids, functions, with_trainer=False):
    """TRL's own ``_calculate_rewards`` of a real tiny ``GRPOTrainer`` (prompt-major rows); with
    ``with_trainer``, also the trainer (what the functions logged is in its pending logs)."""
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
    rewards = trainer._calculate_rewards(inputs, prompts, completions, completion_ids)
    return (rewards, trainer) if with_trainer else rewards


def marl_rewards(model_dir, tokenizer, rows, completion_ids, functions, with_batch=False):
    """marl's rollout path on the same completions (k-major rows); returns them prompt-major (with
    ``with_batch``, also the scored batch and the k-major row of each prompt-major row)."""
    from transformers import TrainerState

    from marl.data.prompts import PromptBatch, prepare_prompts
    from marl.model.multi_adapter import MultiAdapterModel
    from marl.rewards import FunctionReward, WeightedRewards
    from marl.rollout.completions import Samples
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
    batch = scorer.scoring_batch(samples, TrainerState())
    per_source = reward.score(batch).per_source
    rows_of = [order.index(row) for row in range(len(order))]
    return (
        (per_source[torch.tensor(rows_of)], batch, rows_of)
        if with_batch
        else per_source[torch.tensor(rows_of)]
    )


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

    from marl.model.loading import load_tokenizer

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
    from marl.rewards.trl_calls import RewardCall, run_reward_functions

    running, overlap = [], []

    async def slow(completions, **kwargs):
        running.append(1)
        await asyncio.sleep(0.05)
        overlap.append(len(running))
        return [1.0] * len(completions)

    outputs = run_reward_functions([slow, slow], RewardCall(["p"], ["c"]), ["a", "b"])
    assert outputs == [[1.0], [1.0]] and overlap == [2, 2]


def test_a_partial_of_an_async_callable_object_is_awaited_as_trl_awaits_it():
    """TRL's is_async_callable unwraps a functools.partial before it reads the object's ``__call__``: such a
    reward is awaited, not taken for a list."""
    import functools

    from marl.rewards.trl_calls import RewardCall, run_reward_functions

    class Scaled:
        async def __call__(self, completions, scale, **kwargs):
            await asyncio.sleep(0)
            return [scale * len(completion) for completion in completions]

    outputs = run_reward_functions(
        [functools.partial(Scaled(), scale=2.0)], RewardCall(["p"], ["abc"]), ["s"]
    )
    assert outputs == [[6.0]]


def logging_reward(completions, log_extra, log_metric, **kwargs):
    """A reward function using TRL's logging keywords: a column for the completions table, two metrics."""
    texts = [c if isinstance(c, str) else c[0]["content"] for c in completions]
    lengths = [len(text) for text in texts]
    log_extra("length", lengths)
    log_extra("first_word", [text.split()[0] if text.split() else "" for text in texts])
    log_metric("length/mean", sum(lengths) / len(lengths))
    log_metric("length/max", max(lengths))
    return [float(length) for length in lengths]


async def async_logging_reward(completions, log_metric, **kwargs):
    log_metric("length/mean", 1.0)  # the same name from a second function: TRL averages all its values
    return [1.0] * len(completions)


@pytest.mark.parametrize("rows", [PLAIN, CONVERSATIONAL], ids=["plain", "conversational"])
def test_what_reward_functions_log_is_recorded_as_trl_records_it(tiny_llama_dir, rows):
    """TRL keeps log_extra columns for its completions table and log_metric values, averaged per name, for
    the step's metrics; marl puts the same columns in its sample table rows and logs the same means under the
    same names."""
    from marl.model.loading import load_tokenizer
    from marl.rewards.trl_calls import logged_metric_means
    from marl.train.run_dir import sample_rows

    tokenizer = load_tokenizer(str(tiny_llama_dir))
    completion_ids = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in COMPLETIONS]
    functions = [logging_reward, async_logging_reward]
    expected, trainer = trl_rewards(
        tiny_llama_dir, tokenizer, rows, completion_ids, functions, with_trainer=True
    )
    got, batch, rows_of = marl_rewards(
        tiny_llama_dir, tokenizer, rows, completion_ids, functions, with_batch=True
    )
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    # the metrics: TRL's pending values, averaged as TRL's step does (sum over processes / count)
    trl_metrics = {name: sum(values) / len(values) for name, values in trainer._pending_metrics.items()}
    assert logged_metric_means([batch.reward_log.metric_sums()]) == trl_metrics
    assert set(trl_metrics) == {"length/mean", "length/max"}
    # the columns: TRL's pending columns (prompt-major) are marl's sample-table columns row for row
    table = sample_rows(
        batch.prompts, batch.completions, [0.0] * len(batch.completions), batch.reward_log.extra
    )
    trl_extra = dict(trainer._pending_extra_logs)
    assert set(trl_extra) == {"length", "first_word"}
    for column, values in trl_extra.items():
        assert [table[row][column] for row in rows_of] == values
    assert len(set(trl_extra["length"])) > 1  # the column differs between rows: the order is checked


def test_a_logged_column_must_have_one_value_per_completion():
    from marl.errors import DataError
    from marl.rewards import FunctionReward

    def short(completions, log_extra, **kwargs):
        log_extra("length", [1])
        return [0.0] * len(completions)

    with pytest.raises(
        DataError, match=r"reward function 'short' called log_extra\('length', ...\) with 1 values"
    ):
        FunctionReward(short)(["p", "q"], ["a", "b"])


def test_where_the_tokenizer_parses_responses_functions_get_the_parsed_reply_as_in_trl(family_dir):
    """TRL 1.16 hands reward functions a conversation's completion parsed by its ``parse_response`` when the
    tokenizer has a response template (reasoning split from the content): marl hands them the same message,
    from the prompt ids TRL's own trainer tokenises."""
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer
    from trl.chat_template_utils import parse_response, qwen3_template

    from marl.model.loading import load_tokenizer

    model_dir = family_dir("qwen2")  # ChatML, as the Qwen3 response template reads it
    tokenizer = load_tokenizer(str(model_dir))
    tokenizer.response_template = qwen3_template
    texts = ["<think>1+2=3, 3*4</think>It is 12", "12", "<think>3*3</think>9", "nine"]  # each ends at EOS
    completion_ids = [
        tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id] for text in texts
    ]
    received = []

    def keep(completions, **kwargs):
        received.extend(completions)
        return [0.0] * len(completions)

    config = GRPOConfig(
        output_dir="unused", use_cpu=True, report_to="none", num_generations=2, per_device_train_batch_size=2,
        max_completion_length=8, bf16=False,
    )  # fmt: skip
    trainer = GRPOTrainer(
        model=str(model_dir), reward_funcs=[keep], args=config,
        train_dataset=Dataset.from_list(CONVERSATIONAL), processing_class=tokenizer,
    )  # fmt: skip
    prompts = [row["prompt"] for row in CONVERSATIONAL for _ in range(2)]
    prompt_ids = trainer._tokenize_prompts(prompts)[0]
    expected = [
        [parse_response(tokenizer, ids, prefix=prefix)]
        for prefix, ids in zip(prompt_ids, completion_ids, strict=True)
    ]
    assert expected[0][0]["reasoning_content"] == "1+2=3, 3*4" and expected[0][0]["content"] == "It is 12"
    marl_rewards(model_dir, tokenizer, CONVERSATIONAL, completion_ids, [keep])
    order = [2 * prompt + sample for sample in range(2) for prompt in range(len(CONVERSATIONAL))]
    assert [received[order.index(row)] for row in range(len(order))] == expected


def test_logging_errors_name_the_function_and_the_fix():
    from types import SimpleNamespace

    from marl.errors import DataError
    from marl.rewards import FunctionReward
    from marl.rewards.trl_calls import RewardLog
    from marl.train.training_parts import reward_function_metrics

    def not_a_number(completions, log_metric, **kwargs):
        log_metric("length", "long")
        return [0.0] * len(completions)

    def own_column(completions, log_extra, **kwargs):
        log_extra("score", [1.0] * len(completions))
        return [0.0] * len(completions)

    with pytest.raises(
        DataError, match=r"reward function 'not_a_number' called log_metric\('length', 'long'\)"
    ):
        FunctionReward(not_a_number)(["p"], ["a"])
    with pytest.raises(DataError, match=r"reward function 'own_column' called log_extra\('score', ...\)"):
        FunctionReward(own_column)(["p"], ["a"])
    # a metric named as one of marl's own is refused where the update's metrics are put together
    log = RewardLog(rows=1)
    log.log_metric_for("reward function 'f'")("objective/kl", 1.0)
    with pytest.raises(
        DataError, match=r"'objective/kl' with log_metric, which is one of marl's own metrics"
    ):
        reward_function_metrics(SimpleNamespace(reward_log=log), {"objective/kl": 0.1, "lr": 1e-3})
    assert reward_function_metrics(SimpleNamespace(reward_log=log), {"lr": 1e-3}) == {"objective/kl": 1.0}


class LengthJudge:  # a callable object, one of the reward forms TRL names
    def __call__(self, completions, **kwargs):
        return [float(len(completion)) for completion in completions]


def test_a_reward_function_is_named_as_trl_names_it(tmp_path):
    """``--reward_fn path/file.py:fn`` logs ``rewards/fn`` (not the path), a ``functools.partial`` and a
    callable object are named by TRL's own ``get_callable_name``."""
    import functools

    from trl.trainer.utils import get_callable_name

    from marl.rewards import FunctionReward, WeightedRewards, load_reward_fn
    from marl.train.run_dir import reward_record

    (tmp_path / "my_rewards.py").write_text(
        "def brevity(completions, **kwargs):\n    return [1.0] * len(completions)\n"
    )
    loaded = load_reward_fn(f"{tmp_path / 'my_rewards.py'}:brevity")
    assert loaded.name == get_callable_name(loaded.function) == "brevity"
    forms = [reward_len, functools.partial(functools.partial(reward_func, ground_truth=["1"])), LengthJudge()]
    assert [FunctionReward(form).name for form in forms] == [get_callable_name(form) for form in forms]
    assert [FunctionReward(form).name for form in forms] == ["reward_len", "reward_func", "LengthJudge"]
    weighted = WeightedRewards([loaded, FunctionReward(forms[1])], [1.0, 1.0])
    assert weighted.names == ["brevity", "reward_func"]  # the metrics rewards/brevity, rewards/reward_func
    assert [record["function"] for record in reward_record(weighted)] == [
        f"{loaded.function.__module__}:brevity",
        f"{__name__}:reward_func",  # the function a partial wraps, not functools:partial
    ]
