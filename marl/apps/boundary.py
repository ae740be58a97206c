"""The error boundary every ``marl`` command runs inside, and the command lines it tells the user to type.

Input the user can fix (a :class:`marl.errors.MarlError`: bad flags, files, data, adapters, models,
checkpoints, user functions) ends the program with one line on stderr and exit code 2, the code argparse uses
for bad flags. ``--debug`` (or ``MARL_DEBUG=1``) shows its traceback too. Ctrl-C ends it with one line saying
what was kept and how to go on, and exit code 130. Any other exception is a bug and keeps its traceback.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import sys
from collections.abc import Callable, Iterator, Sequence

from marl.errors import MarlError

# argparse's exit code for a command line it cannot use; marl uses it for every error in the input.
INPUT_ERROR_EXIT_CODE = 2
# What a shell reports for a program stopped by Ctrl-C (128 + SIGINT).
INTERRUPTED_EXIT_CODE = 130
DEBUG_FLAG = "--debug"
DEBUG_ENVIRONMENT_VARIABLE = "MARL_DEBUG"


def argv_words(argv: Sequence[str] | None) -> list[str]:
    """The words of a command: ``argv``, or the process's own arguments when ``None``.

    Example:
        >>> argv_words(("--seed", "1"))
        ['--seed', '1']
    """
    return list(sys.argv[1:] if argv is None else argv)


def _debugging(words: Sequence[str]) -> bool:
    return DEBUG_FLAG in words or os.environ.get(DEBUG_ENVIRONMENT_VARIABLE, "") not in ("", "0")


@contextlib.contextmanager
def error_boundary(
    prog: str, words: Sequence[str], interrupted: Callable[[], str] | None = None
) -> Iterator[None]:
    """Turn a :class:`~marl.errors.MarlError` raised inside into ``prog: error: message`` on stderr and exit
    code 2, and Ctrl-C into ``prog: interrupted ...`` (the line ``interrupted()`` returns: what was kept and
    how to go on) and exit code 130, unless ``words`` hold ``--debug`` or ``MARL_DEBUG`` is set; any other
    exception passes through.

    Example:
        >>> from marl.errors import ConfigError
        >>> with error_boundary("marl demo", []):
        ...     raise ConfigError("rloo_k=1 is too small. Set --rloo_k 2 or more")
        Traceback (most recent call last):
        ...
        SystemExit: 2
    """
    try:
        yield
    except MarlError as error:
        if _debugging(words):
            raise
        print(f"{prog}: error: {error}", file=sys.stderr)
        raise SystemExit(INPUT_ERROR_EXIT_CODE) from None
    except KeyboardInterrupt:
        if _debugging(words):
            raise
        # Under a launcher every process gets the signal; one line is enough.
        if os.environ.get("RANK", "0") == "0":
            line = (
                interrupted()
                if interrupted is not None
                else f"nothing was saved. Run the same command again: {command_line(prog, words)}"
            )
            print(f"\n{prog}: interrupted: {line}", file=sys.stderr)
        raise SystemExit(INTERRUPTED_EXIT_CODE) from None


def command_line(prog: str, words: Sequence[str]) -> str:
    """The command a user types to run ``prog`` with ``words`` (a script's ``prog`` is run with python).

    Example:
        >>> command_line("marl evaluate", ["--policy_adapter", "runs/my run"])
        "marl evaluate --policy_adapter 'runs/my run'"
    """
    program = prog if prog.startswith("marl ") else f"python {shlex.quote(sys.argv[0] or prog)}"
    return " ".join([program, *([shlex.join(words)] if words else [])])


def resume_words(words: Sequence[str]) -> list[str]:
    """``words`` with ``--resume_from_checkpoint latest`` in place of any resume or overwrite flag.

    Example:
        >>> resume_words(["--output_dir", "run", "--overwrite-output-dir", "--resume_from_checkpoint=x"])
        ['--output_dir', 'run', '--resume_from_checkpoint', 'latest']
    """
    replaced = ("--resume_from_checkpoint", "--overwrite_output_dir")
    kept: list[str] = []
    skipping = False
    for word in words:
        name = word.split("=", 1)[0].replace("-", "_") if word.startswith("--") else None
        if name is not None:
            skipping = name in [flag.replace("-", "_") for flag in replaced]
            if skipping:
                continue
        elif skipping:  # the value of a replaced flag
            skipping = False
            continue
        kept.append(word)
    return [*kept, "--resume_from_checkpoint", "latest"]
