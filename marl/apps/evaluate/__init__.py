"""``marl evaluate``, one program in one folder: the command and the policy folders it reads
(:mod:`~marl.apps.evaluate.command`), sampling, scoring and what it writes (:mod:`~marl.apps.evaluate.scores`)
and the ranking of several policies with its 95% intervals (:mod:`~marl.apps.evaluate.ranking`)."""

from marl.apps.evaluate.command import EvaluateArguments, fill_from_training_run, run_evaluation
from marl.apps.evaluate.scores import COMPLETIONS_FILE, RESULTS_FILE, generate_and_score, summarize, win_rate

__all__ = [
    "COMPLETIONS_FILE",
    "RESULTS_FILE",
    "EvaluateArguments",
    "fill_from_training_run",
    "generate_and_score",
    "run_evaluation",
    "summarize",
    "win_rate",
]
