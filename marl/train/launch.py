"""How this run's processes were launched, read from the environment the launcher set: ``torchrun``,
``accelerate launch`` or a plain ``python`` / ``marl`` command. ``rloo_config.json`` records it, and the
resume command that an interrupted run prints starts with it, so that the command typed as printed starts
the same number of processes (a checkpoint written by N processes is refused by fewer).

Example:
    >>> launch = current_launch({"TORCHELASTIC_RUN_ID": "x", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"})
    >>> launch.launcher, launch.processes
    ('torchrun', 2)
    >>> launch.command_words("marl train-rloo", "/usr/bin/marl")
    ['torchrun', '--nproc_per_node', '2', '-m', 'marl', 'train-rloo']
"""

from __future__ import annotations

import os
import shlex
from collections.abc import Mapping
from dataclasses import dataclass

from marl.errors import ConfigError

TORCHRUN, ACCELERATE, PYTHON = "torchrun", "accelerate launch", "python"


@dataclass(frozen=True)
class Launch:
    """``launcher`` (``"torchrun"``, ``"accelerate launch"`` or ``"python"``: no launcher), ``processes`` in
    all and ``per_machine`` on each machine; ``cpu``: ``accelerate launch --cpu``."""

    launcher: str
    processes: int
    per_machine: int
    cpu: bool = False

    def command_words(self, prog: str, script: str) -> list[str]:
        """The words that start this launch of ``prog`` (``"marl train-rloo"``, or a script's name run as
        ``script``), before its flags.

        Example:
            >>> Launch(PYTHON, 1, 1).command_words("marl train-rloo", "marl")
            ['marl', 'train-rloo']
            >>> Launch(ACCELERATE, 4, 4).command_words("train_rloo_adapter.py", "examples/train.py")
            ['accelerate', 'launch', '--num_processes', '4', 'examples/train.py']
        """
        module = prog.split() if prog.startswith("marl ") else None
        if self.launcher == PYTHON:
            return module or ["python", script]
        program = ["-m", *module] if module else [script]
        if self.launcher == TORCHRUN:
            machines = self.processes // max(self.per_machine, 1)
            nodes = ["--nnodes", str(machines)] if machines > 1 else []
            return ["torchrun", *nodes, "--nproc_per_node", str(self.per_machine), *program]
        cpu = ["--cpu"] if self.cpu else []
        return ["accelerate", "launch", *cpu, "--num_processes", str(self.processes), *program]

    def command(self, prog: str, script: str, words: list[str]) -> str:
        """The whole command line, quoted for a shell."""
        return shlex.join([*self.command_words(prog, script), *words])


def current_launch(environ: Mapping[str, str] | None = None) -> Launch:
    """The launch of this process, from ``environ`` (default: ``os.environ``): ``accelerate launch`` sets
    ``ACCELERATE_MIXED_PRECISION`` in every process it starts, ``torchrun`` sets ``TORCHELASTIC_RUN_ID``.

    Example:
        >>> current_launch({})
        Launch(launcher='python', processes=1, per_machine=1, cpu=False)
    """
    environ = os.environ if environ is None else environ
    processes = int(environ.get("WORLD_SIZE", "1"))
    per_machine = int(environ.get("LOCAL_WORLD_SIZE", str(processes)))
    if "ACCELERATE_MIXED_PRECISION" in environ:
        cpu = environ.get("ACCELERATE_USE_CPU", "false").lower() in ("1", "true", "yes")
        return Launch(ACCELERATE, processes, per_machine, cpu)
    if "TORCHELASTIC_RUN_ID" in environ:
        return Launch(TORCHRUN, processes, per_machine)
    return Launch(PYTHON, processes, per_machine)


def check_sharded_launch(parallelism: str, processes: int, environ: Mapping[str, str] | None = None) -> None:
    """Refuse ``--parallelism fsdp2`` in a run of one process: there is nothing to shard the base over, and
    the run would train an unsharded base while the command asked for a sharded one. ``accelerate launch
    --cpu`` starts one process whatever ``--num_processes`` says.

    Example:
        >>> check_sharded_launch("fsdp2", 1, {})
        Traceback (most recent call last):
        ...
        marl.errors.ConfigError: --parallelism fsdp2 shards the base over the launched processes, but ...
    """
    if parallelism != "fsdp2" or processes > 1:
        return
    launch = current_launch(environ)
    how = {
        ACCELERATE: "accelerate launch started one process ('accelerate launch --cpu' always starts one; "
        "on CPU use torchrun)",
        TORCHRUN: "torchrun started one process",
        PYTHON: "it was started without a launcher",
    }[launch.launcher]
    raise ConfigError(
        f"--parallelism fsdp2 shards the base over the launched processes, but this run has one process: "
        f"{how}. Launch N processes with `torchrun --nproc_per_node N -m marl train-rloo ...` (CPU or GPUs) "
        "or `accelerate launch --num_processes N ...` (GPUs), or use --parallelism replicated"
    )
