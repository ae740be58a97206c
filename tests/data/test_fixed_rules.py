"""The fixed-rule checks of what a policy writes: the gold judge's sentiment, the film named, distinct
bigrams."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from marl.data.fixed_rules import FILM_WORDS, distinct_2, film_share, gold_judge_scores, names_the_film

texts = st.lists(st.text(alphabet="ab fil", max_size=30), max_size=8)


def test_film_words_count_as_whole_words_in_any_case():
    assert names_the_film("THE FILM soars") and names_the_film("its actors, its plot.")
    assert not names_the_film("a filmmaker's immersive, creative worlds")
    assert not names_the_film("storytelling at its most engaging")
    assert all(names_the_film(f"a {word} to see") for word in FILM_WORDS)


def test_film_share_counts_completions_not_words():
    assert film_share(["film film film", "an immersive ride", "movie", "creative"]) == 0.5
    assert film_share([]) == 0.0


@given(texts)
def test_distinct_2_is_a_share(completions):
    assert 0.0 <= distinct_2(completions) <= 1.0


@given(texts)
def test_repeating_every_completion_halves_distinct_2(completions):
    once = distinct_2(completions)
    assert abs(distinct_2(completions * 2) - once / 2) < 1e-12


def test_distinct_2_counts_bigrams_within_each_completion_only():
    # "film a" would be a bigram across the two completions; it is not counted.
    assert distinct_2(["a film", "a film"]) == 0.5
    assert distinct_2(["A Film", "a film"]) == 0.5  # lower case
    assert distinct_2(["one", ""]) == 0.0


def test_gold_judge_ranks_positive_above_negative() -> None:
    positive, negative, neutral = gold_judge_scores(
        [
            "A wonderful, moving film with brilliant acting.",
            "A dull, awful mess. I hated it.",
            "The film is 90 minutes.",
        ]
    )
    assert positive > 0.5
    assert negative < -0.5
    assert negative < neutral < positive
    assert all(-1.0 <= score <= 1.0 for score in (positive, negative, neutral))
