"""The error boundary every ``marl`` command runs inside, and the command lines it tells the user to type.

Input the user can fix (a :class:`marl.errors.MarlError`: bad flags, files, data, adapters, models,
checkpoints, user functions) ends the program with one line on stderr and exit code 2, the code argparse uses
for bad flags; a run out of memory at the smallest size of a phase (:class:`marl.errors.PhaseMemoryError`)
with one line too and exit code 3. ``--debug`` (or ``MARL_DEBUG=1``) shows its traceback too. Ctrl-C ends it
with one line saying what was kept and how to go on, and exit code 130. Any other exception is a bug and keeps
its traceback.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any

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
    with _ctrl_c_noted() as signalled:
        try:
            yield
        except MarlError as error:
            if _debugging(words):
                raise
            print(f"{prog}: error: {error}", file=sys.stderr)
            # a run out of memory at its smallest sizes has its own code (marl.errors.OUT_OF_MEMORY_EXIT_CODE)
            raise SystemExit(getattr(error, "exit_code", INPUT_ERROR_EXIT_CODE)) from None
        except BaseException as error:
            # Under a launcher, a process waiting in a collective when Ctrl-C comes may see another process
            # leave first (a "connection closed" error) before its own KeyboardInterrupt: that is Ctrl-C too.
            stopped = isinstance(error, KeyboardInterrupt) or (signalled() and isinstance(error, Exception))
            if not stopped or _debugging(words):
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


@contextlib.contextmanager
def _ctrl_c_noted() -> Iterator[Callable[[], bool]]:
    """For the body, a SIGINT handler that raises ``KeyboardInterrupt`` as Python's own does and remembers
    that it ran; yields the question "has Ctrl-C come?". Off the main thread, or where another handler is set,
    nothing changes (and the answer is no)."""
    import signal
    import threading

    received: list[bool] = []
    if (
        threading.current_thread() is not threading.main_thread()
        or signal.getsignal(signal.SIGINT) is not signal.default_int_handler
    ):
        yield lambda: False
        return

    def on_ctrl_c(signum: int, frame: Any) -> None:
        received.append(True)
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, on_ctrl_c)
    try:
        yield lambda: bool(received)
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def command_line(prog: str, words: Sequence[str]) -> str:
    """The command a user types to run ``prog`` with ``words`` (a script's ``prog`` is run with python),
    under the launcher and with the number of processes this process was started with
    (:func:`marl.train.launch.current_launch`: e.g. ``torchrun --nproc_per_node 2 -m marl train-rloo ...``).

    Example:
        >>> command_line("marl evaluate", ["--policy_adapter", "runs/my run"])  # started without a launcher
        "marl evaluate --policy_adapter 'runs/my run'"
    """
    from marl.train.launch import current_launch

    return current_launch().command(prog, sys.argv[0] or prog, list(words))


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
