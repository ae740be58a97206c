"""Two policies and two reward sources on ONE 4-bit base, trained in turn in one process.

A "positive" and a "negative" review policy are two LoRAs on the bundled SmolLM2-135M-Instruct, loaded once in
4-bit. Both learn against the same shipped sentiment reward adapter, with weights +1 and -1, plus a small
fluency function (the share of distinct words in a completion) that keeps either from drifting into
repetition. Then both are evaluated against the base on held-out prompts with VADER, the rule-based gold judge
that no model here was trained on. The memory card at the start shows one base holding every adapter.

    python examples/two_policies.py --output_dir runs/two-policies

The training settings are the one-reward demo's (``marl demo --rewards sentiment``); the results land in
``<output_dir>/two_policies.json`` and each policy's run folder.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

from marl import MultiAdapterModel, RLOOTrainer
from marl.apps.demo import REWARD_ADAPTER_NAME, SHIPPED_ADAPTERS_DIR, DemoArguments, demo_rloo_config
from marl.apps.evaluate import generate_and_score, summarize
from marl.data.assets import EMBEDDED_MODEL_ID
from marl.data.prompts import rotten_tomatoes_prompts
from marl.rewards import EosTerminatedAdapterReward, load_judge

POLICIES = {"positive": 1.0, "negative": -1.0}


def fluency(prompts: list[str], completions: list[str]) -> list[float | None]:
    """The share of distinct words among a completion's words; no judgement of an empty completion."""
    scores: list[float | None] = []
    for completion in completions:
        words = completion.lower().split()
        scores.append(len(set(words)) / len(words) if words else None)
    return scores


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output_dir", default="runs/two-policies")
    parser.add_argument("--fluency_weight", type=float, default=0.5)
    parser.add_argument("--num_eval_prompts", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--total_episodes", type=int, default=DemoArguments.total_episodes)
    options = parser.parse_args()
    started = time.perf_counter()
    output_dir = Path(options.output_dir)
    from transformers import AutoTokenizer

    model = MultiAdapterModel.from_pretrained(
        EMBEDDED_MODEL_ID,
        quantization="4bit",
        policy_name="positive",
        reward_adapters={"sentiment": SHIPPED_ADAPTERS_DIR / REWARD_ADAPTER_NAME},
    )
    model.add_policy("negative")
    print(model.memory_report())
    tokenizer = AutoTokenizer.from_pretrained(model.name_or_path)
    train_prompts = rotten_tomatoes_prompts("train", seed=options.seed)
    eval_prompts = list(
        rotten_tomatoes_prompts("test", seed=options.seed)["prompt"][: options.num_eval_prompts]
    )
    # The one-reward demo's settings: each policy has the sentiment adapter (signed) and the fluency function.
    demo = DemoArguments(seed=options.seed, total_episodes=options.total_episodes, rewards="sentiment")
    # The sentiment adapter scores text + EOS, as it was trained (see
    # marl.rewards.EosTerminatedAdapterReward).
    sentiment = EosTerminatedAdapterReward(model, tokenizer, "sentiment", rows_per_pass=64)

    results = {"settings": {**vars(options), "demo": dataclasses.asdict(demo)}, "policies": {}}
    for policy, sign in POLICIES.items():
        config = dataclasses.replace(
            demo_rloo_config(demo, output_dir / policy, str(SHIPPED_ADAPTERS_DIR / REWARD_ADAPTER_NAME)),
            policy_adapter_name=policy,
            reward_weights=[sign, options.fluency_weight],
        )
        history = RLOOTrainer(
            config, model, tokenizer, train_prompts, reward_funcs=[sentiment, fluency]
        ).train()
        samples = generate_and_score(
            model,
            tokenizer,
            eval_prompts,
            load_judge(None),
            response_length=config.response_length,
            temperature=config.temperature,
            batch_size=100,
            seed=options.seed,
            stop_at_eos=False,
            policy=policy,
        )
        summary = summarize(samples)
        results["policies"][policy] = {
            "reward_weights": config.reward_weights,
            "last_update": history[-1],
            **summary,
        }
        comparison = summary["comparison"]
        print(
            f"{policy}: VADER {summary['base']['judge_score']:+.3f} (base) -> "
            f"{summary['policy']['judge_score']:+.3f}"
            f", adapter {summary['base']['reward_score']:+.3f} -> {summary['policy']['reward_score']:+.3f}, "
            f"VADER win rate over the base {comparison['win_rate']:.1%}, KL {summary['policy']['kl']:.2f}"
        )
    results["memory_card"] = [list(row) for row in model.memory_report().rows()]
    results["seconds"] = round(time.perf_counter() - started, 1)
    (output_dir / "two_policies.json").write_text(json.dumps(results, indent=2) + "\n")
    print(f"results: {output_dir / 'two_policies.json'} ({results['seconds'] / 60:.1f} min)")


if __name__ == "__main__":
    main()
