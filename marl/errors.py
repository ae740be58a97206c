"""The errors marl raises for input a user can fix: bad settings, files, data, adapters, models.

Each message names the problem, the file or setting involved, and the fix. Every one derives from
:class:`MarlError`, so the commands can print such errors as one line without a traceback while any other
exception (a bug) keeps its traceback. Each also derives from the built-in type a library user would catch
(``ValueError``, ``FileNotFoundError``).

Example:
    >>> issubclass(AdapterError, MarlError) and issubclass(AdapterError, ValueError)
    True
"""

from __future__ import annotations


class MarlError(Exception):
    """Input marl cannot use; the message says what, where, and how to fix it."""


class ConfigError(MarlError, ValueError):
    """A setting (a config field or a command-line flag) that cannot work."""


class DataError(MarlError, ValueError):
    """A dataset or a user function (reward function, judge) that cannot be used."""


class AdapterError(MarlError, ValueError):
    """An adapter folder, or an adapter setting, that marl cannot use."""


class ModelError(MarlError, ValueError):
    """A base model that marl cannot load or cannot train exactly."""


class MissingPathError(MarlError, FileNotFoundError):
    """A file or folder the user named does not exist."""


class RunFolderError(MarlError, FileExistsError):
    """An output folder that holds an earlier run which the new run would mix with or overwrite."""


class CheckpointError(MarlError, ValueError):
    """A checkpoint that cannot be resumed from: damaged, incomplete, or written by another run setting."""


# The exit code of a run that ran out of memory at the smallest size of a phase: not 2 (bad input), not 1 (a
# bug), so that a script can tell "needs a larger card or smaller settings" from the others.
OUT_OF_MEMORY_EXIT_CODE = 3


class PhaseMemoryError(MarlError, MemoryError):
    """A phase of the run ran out of memory at every size tried (:mod:`marl.train.memory_guard`).

    Attributes:
        phase: ``sampling``, ``scoring`` or ``update``.
        tried: the sizes tried, as flags, first to last.
        checkpoint: where the last completed update was saved (set by the trainer), if anywhere.
        advice: what ``marl plan`` advises (set by the command).
    """

    exit_code = OUT_OF_MEMORY_EXIT_CODE

    def __init__(self, phase: str, tried: list[str], reason: str) -> None:
        super().__init__(phase, tried, reason)
        self.phase, self.tried, self.reason = phase, tried, reason
        self.checkpoint: str | None = None
        self.advice: str = ""

    def __str__(self) -> str:
        kept = (
            f"The last completed update is in {self.checkpoint}: resume it with --resume_from_checkpoint "
            "latest and smaller settings."
            if self.checkpoint
            else "No update was completed, so nothing was saved: run again with smaller settings."
        )
        advice = self.advice or "marl plan with the same flags and --memory_gb lists settings that fit"
        return (
            f"out of memory in the {self.phase} phase at every size tried ({'; '.join(self.tried)}): "
            f"{self.reason}. {kept} {advice}"
        )
