"""Does an on-topic reward adapter pay for naming the film? Its mean score on held-out completions that name
the film (``marl.data.fixed_rules.names_the_film``, the demo's fixed word list) against those that do not.

The completions come from ``eval_completions.jsonl`` files that ``marl demo`` writes (the base's and the
policy's completion of each held-out prompt). Each text is the prompt and its completion followed by the EOS
token, read where marl reads the adapter: at the last token that is not the padding id recorded in the
adapter's ``marl_reward.json``, with the base loaded in 4-bit as the demo loads it.

    python examples/benchmarks/topic_reward_probe.py adapters/smollm2-135m-rotten-tomatoes-topic-reward \\
        runs/demo-seed0/policy/eval_completions.jsonl runs/demo-seed1/policy/eval_completions.jsonl
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path


def read_completions(files: list[str]) -> list[tuple[str, str, str]]:
    """``(model, prompt, completion)`` for the base's and the policy's completion of every prompt."""
    rows = []
    for file in files:
        for line in Path(file).read_text().splitlines():
            record = json.loads(line)
            rows += [(model, record["prompt"], record[model]["completion"]) for model in ("base", "policy")]
    return rows


def load_adapter_scorer(adapter: str):
    """``score(text) -> float``: the reward adapter folder ``adapter`` on the 4-bit base, reading ``text``
    + EOS at the last token that is not the padding id of the adapter's ``marl_reward.json``, as marl does."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from marl.data.assets import resolve_model_path
    from marl.model.quantization import bitsandbytes_config

    path = resolve_model_path("smollm2-135m-instruct")
    tokenizer = AutoTokenizer.from_pretrained(path)
    base = AutoModelForSequenceClassification.from_pretrained(
        path,
        num_labels=1,
        quantization_config=bitsandbytes_config("4bit", torch.float32),
        dtype=torch.float32,
    )
    model = PeftModel.from_pretrained(base, adapter).eval()
    base.config.pad_token_id = json.loads((Path(adapter) / "marl_reward.json").read_text())["pad_token_id"]

    def score(text: str) -> float:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        with torch.no_grad():
            return float(model(input_ids=torch.tensor([ids])).logits[0, 0])

    return score


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("adapter", help="An on-topic reward adapter folder (marl train-reward).")
    parser.add_argument("completions", nargs="+", help="eval_completions.jsonl files of marl demo runs.")
    options = parser.parse_args()

    import torch

    from marl.data.fixed_rules import names_the_film

    torch.set_num_threads(1)
    score = load_adapter_scorer(options.adapter)
    scores: dict[tuple[str, bool], list[float]] = {}
    for model_name, prompt, completion in read_completions(options.completions):
        scores.setdefault((model_name, names_the_film(completion)), []).append(score(prompt + completion))
    print(f"adapter: {options.adapter}")
    print("| completions of | naming the film: n, mean score | not naming it: n, mean score | difference |")
    print("|---|---|---|---|")
    for model_name in ("base", "policy"):
        named, other = scores.get((model_name, True), []), scores.get((model_name, False), [])
        difference = statistics.mean(named) - statistics.mean(other) if named and other else float("nan")
        print(
            f"| {model_name} | {len(named)}, {statistics.mean(named) if named else float('nan'):.3f} | "
            f"{len(other)}, {statistics.mean(other) if other else float('nan'):.3f} | {difference:+.3f} |"
        )
    every_score = [score for group in scores.values() for score in group]
    print(f"standard deviation of all {len(every_score)} scores: {statistics.pstdev(every_score):.3f}")


if __name__ == "__main__":
    main()
