"""The rewards of ``marl demo``: which reward adapters it trains against, with which weights and KL
coefficient, and the sentiment adapter's recipe (``marl demo --train_reward`` runs it again).

- ``sentiment``: the shipped sentiment adapter (fresh vs rotten snippets of the same movie);
- ``topic``: the shipped on-film adapter (the base model's continuation of a review opening when told it reads
  a film review vs its continuation of the bare opening,
  :func:`marl.data.continuation_pairs.build_film_pairs`), a second LoRA + score head on the same loaded base.

With both, the on-topic weight is measured at the start unless given: base completions of training prompts
are scored by both adapters, and the weight makes the on-topic scores spread :data:`TOPIC_SPREAD_SHARE` times
as widely as the sentiment scores (:func:`balancing_weight`).
"""

from __future__ import annotations

import json
import math
import shlex
import statistics
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from marl.errors import ConfigError, MissingPathError

# The repository's adapters/ folder (this file is marl/apps/demo/rewards.py).
SHIPPED_ADAPTERS_DIR = Path(__file__).resolve().parents[3] / "adapters"
SENTIMENT_ADAPTER_NAME = "smollm2-135m-rotten-tomatoes-reward"
TOPIC_ADAPTER_NAME = "smollm2-135m-rotten-tomatoes-film-reward"
REWARD_CHOICES = ("sentiment", "topic")
# The reward adapters' names inside the model: the sentiment adapter keeps the name a bare folder gets.
ADAPTER_NAMES = {"sentiment": "reward", "topic": "topic"}
# Base completions of training prompts scored to measure the on-topic weight.
WEIGHT_PROBE_PROMPTS = 64
# Half the sentiment scores' spread: at equal spreads the on-film reward took over the advantages once the
# policy found the film, and the text collapsed (benchmarks/results/2026-11-25-two-reward-demo.md).
TOPIC_SPREAD_SHARE = 0.5
# KL coefficient by number of rewards: with two, the one-reward value let the text collapse into a template
# both rewards pay for (benchmarks/results/2026-11-25-two-reward-demo.md; one reward:
# benchmarks/results/2026-11-22-demo-tuning.md).
DEMO_KL_COEF = {1: 0.15, 2: 0.3}
KL_COEF_HELP = f"{DEMO_KL_COEF[1]} with one reward, {DEMO_KL_COEF[2]} with two"
# Completions per prompt by number of rewards, episodes per update unchanged: with two, k=8 keeps the film
# and the variety on every seed (benchmarks/results/2026-11-26-demo-front.md).
DEMO_RLOO_K = {1: 4, 2: 8}
RLOO_K_HELP = f"{DEMO_RLOO_K[1]} with one reward, {DEMO_RLOO_K[2]} with two"


def parse_rewards(value: str) -> tuple[str, ...]:
    """The rewards of ``--rewards``: comma-separated names from :data:`REWARD_CHOICES`, each once, sentiment
    included.

    Example:
        >>> parse_rewards("sentiment, topic")
        ('sentiment', 'topic')
        >>> parse_rewards("sentiment,fluency")
        Traceback (most recent call last):
        ...
        marl.errors.ConfigError: --rewards='sentiment,fluency': unknown reward 'fluency'; pass 'sentiment' ...
    """
    names = tuple(name.strip() for name in value.split(","))
    fix = "pass 'sentiment' (one reward) or 'sentiment,topic' (both)"
    for name in names:
        if name not in REWARD_CHOICES:
            raise ConfigError(f"--rewards={value!r}: unknown reward {name!r}; {fix}")
    if len(set(names)) != len(names) or "sentiment" not in names:
        raise ConfigError(f"--rewards={value!r} must name sentiment, and each reward once; {fix}")
    return names


def check_topic_weight(weight: float | None) -> None:
    """``--topic_weight`` is unset (measured) or a positive finite number.

    Example:
        >>> check_topic_weight(-1.0)
        Traceback (most recent call last):
        ...
        marl.errors.ConfigError: --topic_weight=-1.0 must be a positive finite number; ...
    """
    if weight is not None and not (math.isfinite(weight) and weight > 0):
        raise ConfigError(
            f"--topic_weight={weight} must be a positive finite number; leave it out to have it measured"
        )


def chosen_rewards(rewards: str, topic_reward_adapter: str) -> tuple[str, ...]:
    """The rewards of ``--rewards``, checked against the folders they need before any work."""
    names = parse_rewards(rewards)
    if "topic" in names and not (Path(topic_reward_adapter) / "adapter_config.json").is_file():
        raise MissingPathError(
            f"no on-topic reward adapter in {topic_reward_adapter}. Pass --topic_reward_adapter DIR, or "
            "--rewards sentiment for the single-reward demo"
        )
    return names


def reward_adapter_entries(rewards: Sequence[str], folders: dict[str, str]) -> list[str]:
    """``--reward_adapter`` entries of the demo's rewards: the sentiment folder bare (named ``reward``, as in
    the single-reward demo), the others as ``NAME=DIR``.

    Example:
        >>> reward_adapter_entries(("sentiment", "topic"), {"sentiment": "a/s", "topic": "a/t"})
        ['a/s', 'topic=a/t']
    """
    return [
        folders[name] if ADAPTER_NAMES[name] == "reward" else f"{ADAPTER_NAMES[name]}={folders[name]}"
        for name in rewards
    ]


def balancing_weight(reference: Sequence[float], other: Sequence[float]) -> float:
    """The weight that gives ``other`` the standard deviation of ``reference`` (both measured on the same
    completions); 1.0 if either does not vary (no ratio of spreads to match, and a weight of 0 would drop
    ``other``), or if ``other`` varies so little that the ratio overflows.

    Example:
        >>> balancing_weight([0.0, 2.0, 4.0], [1.0, 2.0, 3.0])
        2.0
        >>> balancing_weight([0.0, 1.0], [0.0, 1e-310])
        1.0
    """
    spread, reference_spread = statistics.pstdev(other), statistics.pstdev(reference)
    if spread > 0 and reference_spread > 0 and math.isfinite(reference_spread / spread):
        return reference_spread / spread
    return 1.0


def measure_topic_weight(
    model: Any, tokenizer: Any, prompts: Sequence[str], **sampling: Any
) -> dict[str, Any]:
    """Score base completions of ``prompts`` with both adapters and weigh them (:func:`topic_weighing`).

    Example:
        >>> measure_topic_weight(model, tokenizer, prompts[:64], response_length=20)  # doctest: +SKIP
        {'weight': 0.65, ...}
    """
    from marl.apps.evaluate.scores import generate_and_score
    from marl.rewards import load_judge

    names = [ADAPTER_NAMES["sentiment"], ADAPTER_NAMES["topic"]]
    samples = generate_and_score(
        model,
        tokenizer,
        list(prompts),
        load_judge(None),
        with_policy=False,
        batch_size=len(prompts),
        progress=False,
        reward_names=names,
        **sampling,
    )["base"].reward_scores_by_name
    return topic_weighing(samples[names[0]], samples[names[1]])


def topic_weighing(sentiment: Sequence[float], topic: Sequence[float]) -> dict[str, Any]:
    """The on-topic weight from both adapters' scores of the same completions, :data:`TOPIC_SPREAD_SHARE`
    times the balancing weight (rounded to 3 decimals, as printed), with the spreads and the correlation.

    Example:
        >>> topic_weighing([0.0, 2.0, 4.0], [1.0, 2.0, 3.0])["weight"]
        1.0
    """
    import numpy as np

    return {
        "weight": round(TOPIC_SPREAD_SHARE * balancing_weight(sentiment, topic), 3),
        "completions": len(sentiment),
        "sentiment_std": statistics.pstdev(sentiment),
        "topic_std": statistics.pstdev(topic),
        "correlation": float(np.corrcoef(sentiment, topic)[0, 1]),
    }


def weigh_rewards(
    model: Any,
    tokenizer: Any,
    probe_prompts: Sequence[str],
    topic_weight: float | None,
    say: Callable[[str], Any] = print,
    **sampling: Any,
) -> dict[str, Any]:
    """The demo's reward weights, ``[1, w]`` for sentiment and on-topic: ``w = topic_weight`` if given, else
    measured on base completions of ``probe_prompts`` (:func:`measure_topic_weight`); ``say`` tells how.

    Example:
        >>> weigh_rewards(None, None, [], 0.5, say=lambda line: None)["weights"]
        [1.0, 0.5]
    """
    if topic_weight is not None:
        weighing: dict[str, Any] = {"weight": float(topic_weight), "how": "--topic_weight"}
    else:
        weighing = {**measure_topic_weight(model, tokenizer, probe_prompts, stop_at_eos=False, **sampling)}
        weighing["how"] = "measured"
        say(
            f"on-topic weight {weighing['weight']:.3f}: on base completions of {len(probe_prompts)} training "
            f"prompts the sentiment scores spread {weighing['sentiment_std']:.3f} (std) and the on-topic "
            f"scores {weighing['topic_std']:.3f}, so this weight makes the on-topic scores spread "
            f"{TOPIC_SPREAD_SHARE:g}× as widely (the two rewards correlate {weighing['correlation']:+.2f} "
            "there)"
        )
    weighing["weights"] = [1.0, float(weighing["weight"])]
    say(f"reward = 1 × sentiment + {weighing['weight']:.3f} × on-topic")
    return weighing


def reward_means_by_name(samples: dict[str, Any]) -> dict[str, dict[str, float]]:
    """Mean score of each reward adapter (``ScoredCompletions.reward_scores_by_name``) per model.

    Example:
        >>> from marl.apps.evaluate.scores import ScoredCompletions
        >>> reward_means_by_name({"base": ScoredCompletions(reward_scores_by_name={"topic": [1.0, 2.0]})})
        {'topic': {'base': 1.5}}
    """
    names = next(iter(samples.values())).reward_scores_by_name
    return {
        name: {
            model: statistics.fmean(record.reward_scores_by_name[name]) for model, record in samples.items()
        }
        for name in names
    }


def reward_recipe_flags(shipped_dir: Path = SHIPPED_ADAPTERS_DIR / SENTIMENT_ADAPTER_NAME) -> list[str]:
    """The flags the shipped reward adapter was trained with (from its ``training_summary.json``), minus
    ``--output_dir``; empty (the training defaults) if the summary is missing.

    Example:
        >>> reward_recipe_flags(Path("/nonexistent"))
        []
    """
    summary_file = shipped_dir / "training_summary.json"
    if not summary_file.is_file():
        return []
    command = json.loads(summary_file.read_text()).get("command") or ""
    words = shlex.split(command)
    flags = words[next((i for i, word in enumerate(words) if word.startswith("--")), len(words)) :]
    kept: list[str] = []
    skip_value = False
    for word in flags:
        if skip_value:
            skip_value = False
        elif word in ("--output_dir", "--output-dir"):
            skip_value = True
        elif not word.startswith(("--output_dir=", "--output-dir=")):
            kept.append(word)
    return kept


def rebuild_sentiment_adapter(output_dir: Path) -> str:
    """Train the sentiment adapter again with its recipe into ``output_dir/reward``; returns that folder."""
    from marl.train.reward_training import parse_arguments, run

    reward_dir = output_dir / "reward"
    flags = [*reward_recipe_flags(), "--output_dir", str(reward_dir)]
    run(parse_arguments(flags), command=shlex.join(["marl", "train-reward", *flags]))
    return str(reward_dir)
