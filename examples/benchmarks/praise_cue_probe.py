"""Does the base write more positive text when asked to? The probe behind ``rotten-tomatoes-praise``.

A reward trained on pairs the base writes both sides of (asked one way for the chosen side, another way for
the rejected) can only learn sentiment if the two requests change the sentiment of what the base writes. This
probe continues the openings of the ``reward`` movies' snippets
(``marl.data.assets.split_rotten_tomatoes(0)``, the movies the reward pairs come from, not the RL or held-out
prompts) under each request, sampled as the pairs are (``marl.train.reward_training.model_continuer``), and
scores opening + continuation with VADER: the mean, and how often one request's text beats another's for the
same opening (ties count half).

    python examples/benchmarks/praise_cue_probe.py --openings 160
"""

from __future__ import annotations

import argparse
import statistics

from marl.data.continuation_pairs import FILM_REVIEW_CUE, OPENING_WORDS, PAN_INSTRUCTION, PRAISE_INSTRUCTION

# Each request: (text before the opening, chat instruction whose answer the opening begins).
REQUESTS = {
    "bare opening": ("", None),
    "film cue": (FILM_REVIEW_CUE, None),
    "rave cue": ("A critic's rave review of the film: ", None),
    "scathing cue": ("A critic's scathing review of the film: ", None),
    "chat: glowing": ("", PRAISE_INSTRUCTION),
    "chat: scathing": ("", PAN_INSTRUCTION),
    "chat: positive": ("", "Write a positive movie review."),
    "chat: negative": ("", "Write a negative movie review."),
}
CONTRASTS = [
    ("rave cue", "scathing cue"),
    ("film cue", "bare opening"),
    ("chat: glowing", "chat: scathing"),
    ("chat: positive", "chat: negative"),
    ("chat: glowing", "bare opening"),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--openings", type=int, default=160)
    parser.add_argument("--threads", type=int, default=0)
    arguments = parser.parse_args()

    from marl.data import assets
    from marl.data.continuation_pairs import shuffled_snippet_rows
    from marl.data.fixed_rules import gold_judge_scores
    from marl.train.reward_training import model_continuer

    rows = shuffled_snippet_rows(assets.split_rotten_tomatoes(seed=0)["reward"], OPENING_WORDS, 0)
    rows = rows[: arguments.openings]
    openings = [" ".join(words[:OPENING_WORDS]) for words, _, _ in rows]
    real = [" " + " ".join(words[OPENING_WORDS:]) for words, _, _ in rows]
    continue_like = model_continuer(
        "smollm2-135m-instruct", quantization="4bit", seed=0, threads=arguments.threads
    )
    scores = {}
    print(f"| request | VADER mean | positive share | negative share | ({len(openings)} openings)")
    print("|---|---|---|---|")
    for name, (cue, instruction) in REQUESTS.items():
        texts = continue_like([cue + opening for opening in openings], real, instruction=instruction)
        scores[name] = gold_judge_scores([o + t for o, t in zip(openings, texts, strict=True)])
        positive = sum(score > 0.05 for score in scores[name]) / len(openings)
        negative = sum(score < -0.05 for score in scores[name]) / len(openings)
        print(f"| {name} | {statistics.mean(scores[name]):+.3f} | {positive:.2f} | {negative:.2f} |")
    print("\n| chosen request | rejected request | chosen more positive under VADER |\n|---|---|---|")
    for chosen, rejected in CONTRASTS:
        pairs = list(zip(scores[chosen], scores[rejected], strict=True))
        wins = sum((a > b) + 0.5 * (a == b) for a, b in pairs) / len(pairs)
        print(f"| {chosen} | {rejected} | {wins:.1%} |")


if __name__ == "__main__":
    main()
