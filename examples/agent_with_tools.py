"""An agent with tools on one base: the bundled SmolLM2-135M-Instruct calls a calculator, rewarded by the
calculator itself and by a reward adapter on the policy's own base.

Each prompt asks for a sum or a product ("What is 17 + 25?", "What is 6 times 7?"). Every completion gets its
own ``Calculator`` environment, whose methods ``add(a, b)`` and ``multiply(a, b)`` are the policy's tools: the
policy (a LoRA on the base) writes a tool call, the tool's result is appended to the conversation, and the
policy answers. The reward has two sources:

- the environment's ``get_reward()`` (logged as ``rewards/Calculator``, weight 1): 1 when the completion
  called the operation the question asks for with the question's two numbers, else 0;
- the shipped reward adapter ``adapters/smollm2-135m-rotten-tomatoes-reward`` (``rewards/reward``), a LoRA
  with a score head on the same base as the policy and its reference. It scores how positive a film review
  sounds, so here it only shows where a judge of the answers sits (train one for your task with
  ``marl train-reward``); ``--adapter_weight`` keeps it smaller than the calculator's reward.

The bundled model lacks two things an agent needs:

- a chat template with tool calls: its ChatML template has none, so the tokenizer gets TRL's
  ``trl.chat_template_utils.qwen2_5_chat_template``, ChatML with Qwen2.5's Hermes-format tool calls
  (``<tool_call>{"name": ..., "arguments": ...}</tool_call>``, the results in ``<tool_response>``);
- the habit of calling tools: a 135M model that never saw a tool call does not write one, and RL cannot
  reinforce what it never samples. So a short warm start comes first: ``--warm_start_steps`` supervised steps
  on the policy LoRA, on conversations about other numbers in which the assistant calls the tool and then
  answers (the loss on the assistant's tokens only).

Then GRPO (k=2, no KL term, as TRL's default) for a few updates. Offline, on the CPU (a few minutes on 2
cores; what it shows: benchmarks/results/2026-12-02-agent-with-tools.md):

    python examples/agent_with_tools.py --output_dir runs/agent-with-tools

The run folder holds ``metrics.jsonl`` (``tools/call_frequency``, ``tools/failure_frequency``,
``rewards/Calculator``, ``rewards/reward``), ``training_curves.png`` and the sample tables
``samples/update_N.jsonl``, which show each turn: the tool calls, the tools' results and the answers.
"""

from __future__ import annotations

import argparse
import random
import time
from collections.abc import Callable, Collection
from typing import Any

import torch
from datasets import Dataset
from transformers import AutoTokenizer
from trl.chat_template_utils import qwen2_5_chat_template

from marl import MultiAdapterModel, RLOOConfig, RLOOTrainer
from marl.apps.demo import SHIPPED_ADAPTERS_DIR
from marl.data.assets import EMBEDDED_MODEL_ID
from marl.data.prompts import left_pad

REWARD_ADAPTER = SHIPPED_ADAPTERS_DIR / "smollm2-135m-rotten-tomatoes-reward"
SYSTEM = "You are a calculator. First call the tool for the question, then answer with its result."
OPERATIONS = {"add": ("{a} + {b}", lambda a, b: a + b), "multiply": ("{a} times {b}", lambda a, b: a * b)}
NUM_QUESTIONS = 64  # the training prompts; the warm start's demonstrations are other questions
WARM_START_BATCH, WARM_START_LR = 4, 1e-3
NUM_SAMPLE_TABLES = 4


class Calculator:
    """One completion's calculator: its tools are ``add`` and ``multiply``; its reward is whether the
    completion called the operation asked for with the question's two numbers (in either order)."""

    def reset(self, operation: str, a: int, b: int, **example: Any) -> None:
        self.asked = [(operation, a, b), (operation, b, a)]
        self.calls: list[tuple[str, Any, Any]] = []  # as the model wrote them, right or not

    def add(self, a: int, b: int) -> int:
        """Add two integers.

        Args:
            a: The first integer.
            b: The second integer.

        Returns:
            The sum of a and b.
        """
        self.calls.append(("add", a, b))
        return a + b

    def multiply(self, a: int, b: int) -> int:
        """Multiply two integers.

        Args:
            a: The first integer.
            b: The second integer.

        Returns:
            The product of a and b.
        """
        self.calls.append(("multiply", a, b))
        return a * b

    def get_reward(self) -> float:
        return float(any(call in self.asked for call in self.calls))


def questions(count: int, seed: int, exclude: Collection[tuple] = ()) -> list[dict[str, Any]]:
    """``count`` distinct questions, sums of two-digit numbers and products of small ones in turn, as
    examples: the conversation in ``prompt`` and the columns ``Calculator.reset`` reads."""
    rng, rows, seen = random.Random(seed), [], set(exclude)
    while len(rows) < count:
        operation = list(OPERATIONS)[len(rows) % len(OPERATIONS)]
        a, b = (
            (rng.randint(10, 99), rng.randint(10, 99)) if operation == "add" else rng.sample(range(2, 13), 2)
        )
        if (operation, a, b) in seen:
            continue
        seen.add((operation, a, b))
        question = f"What is {OPERATIONS[operation][0].format(a=a, b=b)}?"
        prompt = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
        rows.append({"prompt": prompt, "operation": operation, "a": a, "b": b})
    return rows


def demonstration(example: dict[str, Any]) -> list[dict[str, Any]]:
    """The conversation the warm start teaches: the tool call the question needs, its result, the answer."""
    operation, a, b = example["operation"], example["a"], example["b"]
    text, compute = OPERATIONS[operation]
    call = {"type": "function", "function": {"name": operation, "arguments": {"a": a, "b": b}}}
    return [
        *example["prompt"],
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "name": operation, "content": str(compute(a, b))},
        {"role": "assistant", "content": f"{text.format(a=a, b=b)} is {compute(a, b)}."},
    ]


def demonstration_ids(
    tokenizer: Any, messages: list[dict], tools: list[Callable]
) -> tuple[list[int], list[bool]]:
    """A demonstration's ids as the rollout renders them, and which of them the model writes (its two
    turns, each through its end-of-turn token; not the prompt or the tool's result)."""

    def render(upto: int, generation_prompt: bool) -> list[int]:
        ids = tokenizer.apply_chat_template(
            messages[:upto],
            tools=tools,
            add_generation_prompt=generation_prompt,
            tokenize=True,
            return_dict=False,
        )
        if generation_prompt:
            return ids
        return ids[: len(ids) - ids[::-1].index(tokenizer.eos_token_id)]  # through the turn's end token

    prompt, call, result, answer = render(2, True), render(3, False), render(4, True), render(5, False)
    written = [False] * len(answer)
    for start, end in [(len(prompt), len(call)), (len(result), len(answer))]:
        written[start:end] = [True] * (end - start)
    return answer, written


def warm_start(model: MultiAdapterModel, tokenizer: Any, examples: list[dict], steps: int) -> list[float]:
    """``steps`` supervised AdamW steps of the policy LoRA on demonstrations of ``examples``, a few at a
    time; returns the losses."""
    calculator = Calculator()
    tools = [calculator.add, calculator.multiply]  # as the rollout describes them to the model
    rows = [demonstration_ids(tokenizer, demonstration(example), tools) for example in examples]
    batch_size = min(WARM_START_BATCH, len(rows))
    optimizer = torch.optim.AdamW(model.policy_parameters(), lr=WARM_START_LR)
    losses = []
    model.train()
    with model.policy():
        for step in range(steps):
            batch = [rows[(step * batch_size + i) % len(rows)] for i in range(batch_size)]
            input_ids, attention_mask = left_pad([ids for ids, _ in batch], tokenizer.pad_token_id)
            written, _ = left_pad([[int(w) for w in mask] for _, mask in batch], 0)
            start = int(written.argmax(dim=1).min())  # no logits for the prompt, which is not learned
            logprobs = model.token_logprobs(input_ids, attention_mask, response_start=start)
            targets = written[:, start:].float()
            loss = -(logprobs * targets).sum() / targets.sum()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
    model.eval()
    return losses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output_dir", default="runs/agent-with-tools")
    parser.add_argument("--total_episodes", type=int, default=48, help="completions trained on")
    parser.add_argument("--per_device_train_batch_size", type=int, default=8, help="completions per update")
    parser.add_argument("--response_length", type=int, default=80, help="tokens of a whole conversation")
    parser.add_argument("--warm_start_steps", type=int, default=3, help="supervised steps, 4 examples each")
    parser.add_argument("--warm_start_examples", type=int, default=12)
    parser.add_argument("--adapter_weight", type=float, default=0.2, help="weight of rewards/reward")
    parser.add_argument("--seed", type=int, default=0)
    options = parser.parse_args()
    started = time.perf_counter()

    config = RLOOConfig(
        output_dir=options.output_dir,
        model_name_or_path=EMBEDDED_MODEL_ID,
        reward_adapter=[str(REWARD_ADAPTER)],
        reward_weights=[options.adapter_weight],  # the calculator's get_reward comes after it, weight 1
        algorithm="grpo",
        # the advantage is not divided by each group's std: where the calculator's rewards of a group tie,
        # that would blow the adapter's small differences up to a full advantage, whatever its weight
        scale_rewards="none",
        rloo_k=2,
        per_device_train_batch_size=options.per_device_train_batch_size,
        total_episodes=options.total_episodes,
        response_length=options.response_length,
        max_tool_calling_iterations=2,
        learning_rate=2e-4,
        num_sample_generations=NUM_SAMPLE_TABLES,
        save_steps=0,
        seed=options.seed,
    )
    model = MultiAdapterModel.from_config(config)
    tokenizer = AutoTokenizer.from_pretrained(model.name_or_path)
    tokenizer.chat_template = qwen2_5_chat_template  # ChatML with Hermes-format tool calls

    train = questions(NUM_QUESTIONS, seed=options.seed)
    taken = {(row["operation"], row["a"], row["b"]) for row in train}
    demonstrated = questions(options.warm_start_examples, seed=options.seed + 1, exclude=taken)
    losses = warm_start(model, tokenizer, demonstrated, options.warm_start_steps)
    if losses:
        print(f"warm start: {len(losses)} steps, loss {losses[0]:.3f} -> {losses[-1]:.3f}")

    trainer = RLOOTrainer(
        config,
        model,
        tokenizer,
        Dataset.from_list(train),
        reward_funcs=["reward"],  # the reward adapter; the environment's get_reward is added after it
        environment_factory=Calculator,
    )
    history = trainer.train()
    for record in history:
        print(
            f"update {record['update']}: tool calls per completion {record['tools/call_frequency']:.2f}, "
            f"calculator {record['rewards/Calculator']:.2f}, reward adapter {record['rewards/reward']:+.2f}"
        )
    print(f"done in {(time.perf_counter() - started) / 60:.1f} min")


if __name__ == "__main__":
    main()
