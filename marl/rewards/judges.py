"""Judges: functions ``f(texts) -> scores`` (higher is better) that evaluate a policy independently of its
reward, so that reward hacking shows as a reward gain without a judge gain. VADER by default, or
``--judge module:function``.

Example:
    >>> CheckedJudge(len, "length")(["ab"])
    Traceback (most recent call last):
    ...
    marl.errors.DataError: length returned a int; it must return a list of 1 numbers, one per completion
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from marl.data.fixed_rules import gold_judge_scores
from marl.rewards.functions import call_user_function, check_scores, import_function


class CheckedJudge:
    """A judge ``fn(texts) -> scores`` (higher is better) whose output is checked on every call.

    Example:
        >>> judge = CheckedJudge(lambda texts: [t.count("!") for t in texts], "excitement")
        >>> judge(["wow!", "ok"])
        [1.0, 0.0]
    """

    def __init__(self, function: Callable[[Sequence[str]], Any], name: str) -> None:
        self.function = function
        self.name = name

    def __call__(self, texts: Sequence[str]) -> list[float]:
        return check_scores(call_user_function(self.function, self.name, list(texts)), len(texts), self.name)


def load_judge(spec: str | None) -> CheckedJudge:
    """Import ``--judge module:function``, called as ``function(texts)``; ``None`` gives the VADER judge.

    Example:
        >>> load_judge(None)(["a wonderful film"])[0] > 0
        True
    """
    if spec is None:
        return CheckedJudge(gold_judge_scores, "the VADER judge")
    return CheckedJudge(import_function(spec, "--judge"), f"judge {spec!r}")
