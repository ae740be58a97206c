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
