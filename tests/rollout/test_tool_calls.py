"""The tool-calling rollout beyond what TRL's run shows: rows whose environments give them prompts of their
own (turn 1 then samples each row alone, and nothing packs them by prompt), the tools' results out of the
loss's tokens, and the sample table's turns."""

from __future__ import annotations

import itertools
import warnings

import pytest
import torch
from datasets import Dataset
from transformers import AutoTokenizer

from marl import MultiAdapterModel, RLOOConfig, RLOOTrainer
from marl.algo.tensors import model_tokens
from marl.rollout.tool_calls import conversation_text

from support.tool_agents import TOOLS, examples, register_scripted_sampler, save_tool_model


class Attempts:
    """Each reset tells its attempt number: the k rows of one prompt read different prompts."""

    numbers = itertools.count()

    def reset(self, **example) -> str:
        return f" Attempt {next(Attempts.numbers)}."

    def note(self, text: str) -> str:
        """Notes a text down.

        Args:
            text: The text.
        """
        return text


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tool_model("qwen2", tmp_path_factory.mktemp("tool-calls") / "qwen2")


def rollout_of(model_dir, tmp_path, share_prompt_prefix: bool, **tool_arguments):
    config = RLOOConfig(
        output_dir=str(tmp_path / f"run-{share_prompt_prefix}"),
        model_name_or_path=str(model_dir),
        sampler=register_scripted_sampler(),
        rloo_k=2,
        per_device_train_batch_size=6,
        response_length=256,
        share_prompt_prefix=share_prompt_prefix,
        kl_coef=0.05,
    )
    model = MultiAdapterModel.from_config(config)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = RLOOTrainer(
            config,
            model,
            AutoTokenizer.from_pretrained(model_dir),
            Dataset.from_list(examples(("answer", "one-call", "two-calls"))),
            reward_funcs=lambda completions, **_: [float(len(c)) for c in completions],
            **tool_arguments,
        )
    torch.manual_seed(0)
    Attempts.numbers = itertools.count()  # both runs' rows read the same prompts
    return trainer, trainer.rollout()


def test_rows_with_prompts_of_their_own_are_sampled_and_scored_each_on_its_own(model_dir, tmp_path):
    trainer, rollout = rollout_of(model_dir, tmp_path, True, tools=TOOLS[:1], environment_factory=Attempts)
    assert trainer.parts.sampler.calls[0] == (6, 1)  # turn 1: every row alone, its prompt its own
    assert not rollout.prompts_shared() and trainer.parts.scorer.pack(rollout) is None
    _, unpacked = rollout_of(model_dir, tmp_path, False, tools=TOOLS[:1], environment_factory=Attempts)
    for name in ("logprobs", "ref_logprobs"):
        ours, theirs = getattr(rollout, name), getattr(unpacked, name)
        assert torch.allclose(ours[rollout.response_mask], theirs[unpacked.response_mask], atol=1e-5)


def test_the_tools_results_are_in_the_completion_but_not_among_the_models_tokens(model_dir, tmp_path):
    trainer, rollout = rollout_of(model_dir, tmp_path, True, tools=TOOLS)
    assert trainer.parts.sampler.calls[0] == (3, 2)  # turn 1: each prompt once for its k rows
    called = rollout.tool_calls > 0
    assert called.any() and not called.all()
    results = rollout.response_mask & ~model_tokens(rollout)
    assert torch.equal(results.any(dim=1), called)  # a row's results sit between its turns
    assert torch.equal(rollout.model_mask, model_tokens(rollout))
    table = [conversation_text(turns) for turns in rollout.turns]
    assert all(("\ntool " in text) == bool(c) for text, c in zip(table, called.tolist(), strict=True))


def test_a_reward_adapter_reads_the_conversation_as_trl_renders_it_for_a_reward_model(model_dir, tmp_path):
    """TRL 1.16 renders ``{"messages": prompt + completion}`` through its own ``apply_chat_template`` for a
    reward model, the completion being every turn and tool message."""
    from trl.data_utils import apply_chat_template

    trainer, rollout = rollout_of(model_dir, tmp_path, True, tools=TOOLS)
    tokenizer = trainer.tokenizer
    rows = trainer.parts.scorer.reward_rows(rollout)
    for row, turns in enumerate(rollout.turns):
        example = {"messages": [*rollout.prompt_messages[row], *turns]}
        text = apply_chat_template(example, tokenizer)["text"]
        assert rows[row] == tokenizer(text, add_special_tokens=False)["input_ids"]
    assert any(len(turns) > 1 for turns in rollout.turns)  # tool messages among them
