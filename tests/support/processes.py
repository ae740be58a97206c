"""Launching a test script in one process or in two CPU processes (``torchrun``, gloo), one thread each."""

from __future__ import annotations

import os
import socket
import subprocess
import sys


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_processes(script: str, *arguments: str, processes: int = 2) -> None:
    """``script ARGUMENTS`` on the CPU: plain Python for one process, else under ``torchrun --nproc_per_node
    N`` (gloo); fails the test with the output's tail when the run fails."""
    environment = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    launcher = [sys.executable]
    if processes > 1:
        launcher += [
            "-m", "torch.distributed.run", "--nproc_per_node", str(processes), "--master_addr", "127.0.0.1",
            "--master_port", str(free_port()),
        ]  # fmt: skip
    result = subprocess.run(
        [*launcher, script, *arguments], capture_output=True, text=True, env=environment, timeout=600
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]


def run_two_processes(script: str, *arguments: str) -> None:
    """``script ARGUMENTS`` under ``torchrun --nproc_per_node 2`` on the CPU."""
    run_processes(script, *arguments, processes=2)
