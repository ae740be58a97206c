"""``marl evaluate``, one program in one folder: the command (:mod:`~marl.apps.evaluate.run`), the
policy folders it reads (:mod:`~marl.apps.evaluate.folders`), sampling and scoring
(:mod:`~marl.apps.evaluate.scores`), the ranking of several policies (:mod:`~marl.apps.evaluate.ranking`)
and what it writes (:mod:`~marl.apps.evaluate.report`)."""

from marl.apps.evaluate.report import COMPLETIONS_FILE, RESULTS_FILE
from marl.apps.evaluate.run import EvaluateArguments, fill_from_training_run, run_evaluation
from marl.apps.evaluate.scores import generate_and_score, summarize, win_rate

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
