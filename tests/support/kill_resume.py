"""Kill ``marl train-rloo`` with SIGKILL at chosen or random moments, resume it with the documented
command, and compare the result with an uninterrupted run.

``tests/train/test_kill_resume.py`` runs a handful of trials in CI. More trials, by hand::

    OMP_NUM_THREADS=1 python tests/support/kill_resume.py --trials 40 --seed 0

A trial runs the real ``python -m marl.apps.cli train-rloo`` in a subprocess on a tiny model with a reward
function
from a file and a checkpoint after every update, and kills it either

- at an exact moment: when the process is about to perform the N-th file operation whose path contains a given
  text (an audit hook, installed in the child through a ``sitecustomize`` module on its ``PYTHONPATH``, sends
  the SIGKILL; e.g. the operations on ``.checkpoint-1.tmp`` are the first checkpoint being written), or
- after a random delay, measured from the start of the process, in its start-up or in its updates (timed on
  an uninterrupted run).

It then runs the same command with ``--resume_from_checkpoint latest``, killing that too in some trials,
and finally requires the adapter file to be byte-identical to the uninterrupted run's, ``metrics.jsonl`` to
hold one record per update equal to the uninterrupted run's in every field but ``eps``, and no staging file
to be left.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPOSITORY = Path(__file__).resolve().parents[2]
PROMPTS = [
    "the movie was",
    "a dull boring",
    "an honest story",
    "the plot falls",
    "review of the",
    "good good",
]
UPDATES = 6
# File operations on the staging folder while checkpoint 1 is written (found with the hook's count mode): the
# old staging folder removed, three folder creations, adapter_config.json, the weights renamed into place,
# trainer_state.json, and the staging folder renamed to checkpoint-1. The torch files emit no audit event.
FIRST_CHECKPOINT_EVENTS = 8
KILL_HOOK = """
import os, signal, sys

_spec = os.environ.get("MARL_TEST_KILL_AT")
_signal = int(os.environ.get("MARL_TEST_KILL_SIGNAL", signal.SIGKILL))
if _spec and _signal == signal.SIGINT:
    # A process started from a shell's background job inherits SIGINT ignored, and Python then keeps it
    # ignored: the Ctrl-C under test would never arrive. A terminal's Ctrl-C reaches a foreground run.
    signal.signal(signal.SIGINT, signal.default_int_handler)
if _spec:
    _needle, _count = _spec.rsplit(":", 1)
    _left = [int(_count)]
    _events = ("open", "os.mkdir", "os.rename", "os.remove", "os.rmdir", "shutil.rmtree")

    def _kill_at(event, args):
        if event in _events and any(_needle in str(arg) for arg in args[:2]):
            _left[0] -= 1
            if _left[0] == 0:
                if os.environ.get("MARL_TEST_KILL_LAUNCHER"):  # Ctrl-C in a terminal reaches the launcher,
                    os.kill(os.getppid(), _signal)  # which passes it on to every process it started
                else:
                    os.kill(os.getpid(), _signal)

    sys.addaudithook(_kill_at)
"""


@dataclass(frozen=True)
class Kill:
    """When to kill: at the ``count``-th file operation whose path contains ``needle``, or after ``delay``
    seconds; with ``signal`` (SIGINT is Ctrl-C)."""

    needle: str | None = None
    count: int = 1
    delay: float | None = None
    signal: int = signal.SIGKILL

    def __str__(self) -> str:
        return f"at op {self.count} on {self.needle!r}" if self.needle else f"after {self.delay:.2f} s"


def make_world(root: Path) -> dict[str, Path]:
    """A tiny base model, a prompt file and a reward-function file under ``root``."""
    sys.path.insert(0, str(REPOSITORY / "tests"))
    from support.tiny import save_tiny_model, write_jsonl

    root.mkdir(parents=True, exist_ok=True)
    base = root / "base"
    if not (base / "config.json").exists():
        save_tiny_model(base)
    prompts = write_jsonl(root / "prompts.jsonl", [{"text": prompt} for prompt in PROMPTS])
    reward = root / "rewards.py"
    reward.write_text("def count_e(prompts, completions):\n    return [c.count('e') for c in completions]\n")
    hook = root / "hook"
    hook.mkdir(exist_ok=True)
    (hook / "sitecustomize.py").write_text(KILL_HOOK)
    return {"base": base, "prompts": prompts, "reward": reward, "hook": hook}


def command(world: dict[str, Path], output_dir: Path) -> list[str]:
    """The run every trial makes: 6 updates of 4 completions, a checkpoint after each."""
    return [
        "train-rloo",
        "--model_name_or_path", str(world["base"]),
        "--dataset_name", str(world["prompts"]),
        "--prompt_column", "text",
        "--reward_fn", f"{world['reward']}:count_e",
        "--output_dir", str(output_dir),
        "--rloo_k", "2",
        "--per_device_train_batch_size", "4",
        "--total_episodes", str(4 * UPDATES),
        "--response_length", "6",
        "--num_ppo_epochs", "2",
        "--learning_rate", "3e-3",
        "--num_sample_generations", "3",
        "--save_steps", "1",
        "--seed", "7",
    ]  # fmt: skip


def start_cli(
    world: dict[str, Path],
    words: list[str],
    kill: Kill | None = None,
    launcher: list[str] | None = None,
    environment: dict[str, str] | None = None,
) -> subprocess.Popen:
    """Start ``python -m marl.apps.cli WORDS`` in a fresh process with one torch thread; ``launcher``: the
    words that start ``marl`` instead (e.g. ``torchrun --nproc_per_node 2 -m marl``), in a session of its own;
    with ``MARL_TEST_KILL_LAUNCHER`` in ``environment`` the kill goes to the launcher, as a terminal's Ctrl-C
    does."""
    environment = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([str(world["hook"]), str(REPOSITORY)]),
        **(environment or {}),
    }
    environment.pop("MARL_TEST_KILL_AT", None)
    if kill is not None and kill.needle is not None:
        environment["MARL_TEST_KILL_AT"] = f"{kill.needle}:{kill.count}"
        environment["MARL_TEST_KILL_SIGNAL"] = str(int(kill.signal))
    return subprocess.Popen(
        [*(launcher or [sys.executable, "-m", "marl.apps.cli"]), *words],
        env=environment,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=launcher is not None,
    )


def run_cli(
    world: dict[str, Path], words: list[str], kill: Kill | None = None
) -> subprocess.CompletedProcess:
    """``python -m marl.apps.cli WORDS`` in a fresh process with one torch thread, optionally killed."""
    process = start_cli(world, words, kill)
    if kill is not None and kill.delay is not None:
        try:
            process.wait(timeout=kill.delay)
        except subprocess.TimeoutExpired:
            process.send_signal(kill.signal)
    stdout, stderr = process.communicate(timeout=600)
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)


def metrics_without_eps(output_dir: Path) -> list[dict]:
    """The metrics two runs of one command on CPU agree on: without eps and the measured memory peaks."""
    from marl.train.memory_guard import is_measurement

    records = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]
    return [{key: value for key, value in record.items() if not is_measurement(key)} for record in records]


@dataclass
class Outcome:
    kills: list[str]
    killed: int
    identical: bool
    problem: str = ""


def trial(world: dict[str, Path], reference: Path, output_dir: Path, kills: list[Kill]) -> Outcome:
    """Run, kill as ``kills`` say (the first kill hits the first run, later ones hit the resumed runs), resume
    until a run finishes, and compare with ``reference``."""
    words = command(world, output_dir)
    killed, described = 0, []
    result = run_cli(world, words, kills[0])
    for attempt, kill in enumerate([*kills[1:], None]):
        if result.returncode == -signal.SIGKILL:
            killed += 1
            described.append(str(kills[attempt]))
        elif result.returncode != 0:
            return Outcome(
                described, killed, False, f"exit code {result.returncode}: {result.stderr[-2000:]}"
            )
        else:
            break  # it finished before the kill
        result = run_cli(world, [*words, "--resume_from_checkpoint", "latest"], kill)
    if result.returncode != 0:
        return Outcome(described, killed, False, f"exit code {result.returncode}: {result.stderr[-2000:]}")
    problems = []
    if (output_dir / "adapter_model.safetensors").read_bytes() != (
        reference / "adapter_model.safetensors"
    ).read_bytes():
        problems.append("the final adapter differs")
    if metrics_without_eps(output_dir) != metrics_without_eps(reference):
        problems.append("metrics.jsonl differs")
    leftovers = sorted(path.name for path in output_dir.iterdir() if path.name.startswith("."))
    if leftovers:
        problems.append(f"leftover files {leftovers}")
    return Outcome(described, killed, not problems, "; ".join(problems))


def random_kills(rng: random.Random, output_dir: Path, timing: tuple[float, float]) -> list[Kill]:
    """One to three kills, each at a random moment: of the start-up, of the updates (``timing``: when the
    uninterrupted run wrote its first metrics record, and when it ended), of the first checkpoint's writing,
    or at a random file operation in the output folder."""
    first_update, end = timing
    kills = []
    for _ in range(rng.choice([1, 1, 2, 3])):
        kind = rng.random()
        if kind < 0.2:
            kills.append(Kill(delay=rng.uniform(0.2, first_update)))
        elif kind < 0.6:
            kills.append(Kill(delay=rng.uniform(first_update - 0.5, end)))
        elif kind < 0.8:
            kills.append(Kill(needle=".checkpoint-1.tmp", count=rng.randint(1, FIRST_CHECKPOINT_EVENTS)))
        else:
            kills.append(Kill(needle=f"{output_dir.name}/", count=rng.randint(1, 70)))
    return kills


def timed_run(world: dict[str, Path], output_dir: Path) -> tuple[float, float]:
    """Run the command uninterrupted; return when its first metrics record appeared and when it ended."""
    started = time.perf_counter()
    process = start_cli(world, command(world, output_dir))
    first_update = None
    while process.poll() is None:
        if first_update is None and (output_dir / "metrics.jsonl").exists():
            first_update = time.perf_counter() - started
        time.sleep(0.01)
    _, stderr = process.communicate()
    if process.returncode != 0:
        raise SystemExit(f"the uninterrupted run failed:\n{stderr}")
    return first_update, time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--root", type=Path, default=None, help="work folder (default: a temporary one)")
    arguments = parser.parse_args()
    root = arguments.root or Path(tempfile.mkdtemp(prefix="marl-kill-"))
    world = make_world(root)
    timing = timed_run(world, root / "reference")
    print(
        f"uninterrupted run: first update after {timing[0]:.1f} s, done after {timing[1]:.1f} s", flush=True
    )
    rng = random.Random(arguments.seed)
    outcomes = []
    for index in range(arguments.trials):
        output_dir = root / f"trial-{index}"
        outcome = trial(world, root / "reference", output_dir, random_kills(rng, output_dir, timing))
        outcomes.append(outcome)
        status = "identical" if outcome.identical else f"DIFFERENT: {outcome.problem}"
        kills_text = ", ".join(outcome.kills) or "finished first"
        print(f"trial {index}: {outcome.killed} kill(s) ({kills_text}): {status}", flush=True)
    killed = [outcome for outcome in outcomes if outcome.killed]
    print(
        f"{len(outcomes)} trials, {len(killed)} killed at least once, "
        f"{sum(outcome.killed for outcome in outcomes)} kills in all; identical to the uninterrupted run: "
        f"{sum(outcome.identical for outcome in outcomes)} of {len(outcomes)}"
    )
    if not all(outcome.identical for outcome in outcomes):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
