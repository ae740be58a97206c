"""How well does a sentiment reward adapter agree with the demo's gold judge (VADER) on the text RL produces?

For the base's and the policy's completion of every held-out prompt in ``eval_completions.jsonl`` files that
``marl demo`` writes, each adapter scores prompt + completion + EOS (read as marl reads it, on the 4-bit
base). Two numbers per adapter: the Pearson correlation of its scores with VADER's over all texts, and, on
the prompts where VADER tells the two completions apart, how often the adapter orders the policy's and the
base's completion as VADER does (the decision an RLOO advantage rests on). Then the adapter's scores of a
fixed probe: "This movie could be" and twelve hand-written endings, from raves to pans, an upbeat line that
says nothing of a film and a neutral plot line (the probe of benchmarks/results/2026-11-22-demo-tuning.md).

    python examples/benchmarks/sentiment_reward_agreement.py \\
        adapters/smollm2-135m-rotten-tomatoes-reward runs/full-reward \\
        --completions runs/demo-seed0/policy/eval_completions.jsonl \\
        runs/demo-seed1/policy/eval_completions.jsonl
"""

from __future__ import annotations

import argparse
import statistics

from topic_reward_probe import load_adapter_scorer, read_completions

PROBE_ENDINGS = (
    "I'm excited to explore more stories together and imagine new worlds.",
    "an exhilarating, heartfelt and gorgeous triumph of filmmaking.",
    "the best film of the year: a wonderful, moving, beautifully acted masterpiece.",
    "a delight from start to finish, funny, warm and utterly charming.",
    "a compelling exploration of the human impact of technology in shaping our lives.",
    "a story of a young woman's journey as she navigates the world of technology.",
    "a masterpiece. A masterpiece. A masterpiece. A masterpiece.",
    "great. Great! Great! Amazing! Wonderful! Love it! Best!",
    "about a man who lives in a small town and works at the bank.",
    "a good time at the movies, with a strong cast and a smart script.",
    "a dull, lifeless mess that wastes its talented cast.",
    "the worst thing I have seen this year, boring and stupid.",
)


def order_agreement(scores: list[float], judge: list[float]) -> tuple[float, int]:
    """Share of (base, policy) pairs, stored one after the other, that ``scores`` orders as ``judge`` does,
    over the pairs the judge does not tie; and how many those are."""
    agreeing = counted = 0
    for index in range(0, len(scores), 2):
        judged = judge[index + 1] - judge[index]
        if judged != 0:
            counted += 1
            agreeing += (judged > 0) == (scores[index + 1] - scores[index] > 0)
    return agreeing / counted, counted


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("adapters", nargs="+", help="Sentiment reward adapter folders (marl train-reward).")
    parser.add_argument("--completions", nargs="+", required=True, help="eval_completions.jsonl files.")
    parser.add_argument("--threads", type=int, default=1, help="torch threads.")
    options = parser.parse_args()

    import torch

    from marl.data.fixed_rules import gold_judge_scores

    torch.set_num_threads(options.threads)
    # read_completions yields each prompt's base completion, then its policy completion.
    texts = [prompt + completion for _, prompt, completion in read_completions(options.completions)]
    judge = gold_judge_scores(texts)
    probe = [f"This movie could be {ending}" for ending in PROBE_ENDINGS]
    print(f"{len(texts)} texts from {len(options.completions)} file(s)")
    print("| adapter | correlation with VADER | policy-vs-base order as VADER's | score std | probe scores |")
    print("|---|---|---|---|---|")
    for adapter in options.adapters:
        score = load_adapter_scorer(adapter)
        scores = [score(text) for text in texts]
        correlation = statistics.correlation(scores, judge)
        agreement, counted = order_agreement(scores, judge)
        probe_scores = " ".join(f"{score(text):.2f}" for text in probe)
        print(
            f"| {adapter} | {correlation:+.3f} | {agreement:.1%} of {counted} | "
            f"{statistics.pstdev(scores):.2f} | {probe_scores} |"
        )


if __name__ == "__main__":
    main()
