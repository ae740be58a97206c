"""How a run was launched (``marl.train.launch``): the launcher read from the environment each launcher sets,
the command that starts the same launch again, the refusal of ``--parallelism fsdp2`` in one process, what
``rloo_config.json`` and a refused resume say, and ``--help`` naming every registered parallelism. The slow
test interrupts a real ``torchrun`` run of 2 processes as a terminal's Ctrl-C does and resumes it with the
command it printed, typed as printed.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys

import pytest

from marl.apps.cli import train_rloo_main
from marl.apps.train_rloo import parse_train_rloo_args
from marl.errors import ConfigError
from marl.train.launch import ACCELERATE, PYTHON, TORCHRUN, Launch, check_sharded_launch, current_launch
from marl.train.parallel import PARALLELISMS

from support.kill_resume import Kill, command, make_world, start_cli
from support.processes import free_port
from support.tiny import refused

# What each launcher puts in the environment of the processes it starts (read from torch's elastic agent and
# accelerate's launchers).
TORCHRUN_2 = {"TORCHELASTIC_RUN_ID": "none", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "RANK": "0"}
ACCELERATE_2 = {**TORCHRUN_2, "ACCELERATE_MIXED_PRECISION": "no", "ACCELERATE_USE_CPU": "False"}
ACCELERATE_CPU_1 = {"ACCELERATE_MIXED_PRECISION": "no", "ACCELERATE_USE_CPU": "True"}


@pytest.mark.parametrize(
    "environ, launcher, processes",
    [
        ({}, PYTHON, 1),
        (TORCHRUN_2, TORCHRUN, 2),
        (ACCELERATE_2, ACCELERATE, 2),
        (ACCELERATE_CPU_1, ACCELERATE, 1),
    ],
)
def test_the_launcher_is_read_from_the_environment_it_sets(environ, launcher, processes):
    launch = current_launch(environ)
    assert (launch.launcher, launch.processes) == (launcher, processes)


def test_the_printed_command_starts_the_same_launch():
    flags = ["--output_dir", "runs/my run"]
    assert current_launch(TORCHRUN_2).command("marl train-rloo", "/x/marl/__main__.py", flags) == (
        "torchrun --nproc_per_node 2 -m marl train-rloo --output_dir 'runs/my run'"
    )
    two_machines = {**TORCHRUN_2, "WORLD_SIZE": "4"}
    assert current_launch(two_machines).command_words("train_rloo_adapter.py", "examples/t.py") == [
        "torchrun", "--nnodes", "2", "--nproc_per_node", "2", "examples/t.py",
    ]  # fmt: skip
    assert current_launch(ACCELERATE_2).command("marl train-rloo", "x", []) == (
        "accelerate launch --num_processes 2 -m marl train-rloo"
    )
    assert Launch(PYTHON, 1, 1).command("train_rloo_adapter.py", "examples/t.py", flags) == (
        "python examples/t.py --output_dir 'runs/my run'"
    )


@pytest.mark.parametrize(
    "environ, says",
    [({}, "started without a launcher"), (ACCELERATE_CPU_1, "'accelerate launch --cpu' always starts one")],
)
def test_fsdp2_in_one_process_is_refused_in_one_line(environ, says):
    with pytest.raises(ConfigError) as error:
        check_sharded_launch("fsdp2", 1, environ)
    message = str(error.value)
    assert "\n" not in message and says in message and "torchrun --nproc_per_node N" in message
    check_sharded_launch("fsdp2", 2, environ)
    check_sharded_launch("replicated", 1, environ)


def test_train_rloo_refuses_fsdp2_in_one_process_before_the_model_loads(tiny_llama_dir, tmp_path, capsys):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "a"}\n{"prompt": "b"}\n')
    rewards = tmp_path / "rewards.py"
    rewards.write_text("def ones(prompts, completions):\n    return [1.0] * len(completions)\n")
    words = ["--model_name_or_path", str(tiny_llama_dir), "--dataset_name", str(prompts), "--reward_fn",
             f"{rewards}:ones", "--output_dir", str(tmp_path / "run"), "--parallelism", "fsdp2"]  # fmt: skip
    line = refused(capsys, train_rloo_main, words)
    assert "--parallelism fsdp2 shards the base over the launched processes, but this run has one" in line
    assert not (tmp_path / "run").exists()


def test_evaluate_launched_as_several_processes_is_refused_in_one_line(monkeypatch, tmp_path, capsys):
    from marl.apps.cli import evaluate_main

    for name, value in TORCHRUN_2.items():
        monkeypatch.setenv(name, value)
    line = refused(capsys, evaluate_main, ["--output_dir", str(tmp_path / "out")])
    assert "marl evaluate runs in one process, but torchrun started 2" in line
    assert not (tmp_path / "out").exists()


def test_help_text_of_parallelism_names_every_registered_one(capsys):
    with pytest.raises(SystemExit):
        parse_train_rloo_args(["--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    section = help_text[help_text.index("--parallelism PARALLELISM How") :][:600]
    for name in PARALLELISMS:
        assert f"'{name}'" in section, name


@pytest.mark.parametrize(
    "launcher, relaunch",
    [
        ("torchrun", "torchrun --nproc_per_node 2 -m marl train-rloo"),
        ("accelerate launch", "accelerate launch --num_processes 2"),
    ],
)
def test_a_resume_with_another_number_of_processes_names_the_launch_to_use(launcher, relaunch, tmp_path):
    from marl.errors import CheckpointError
    from marl.train.checkpoints import Checkpoint, check_resumable

    (tmp_path / "rloo_config.json").write_text(json.dumps({"launcher": launcher, "world_size": 2}))
    state = {"world_size": 2, "batch_size": 8, "num_total_batches": 3}
    saved = Checkpoint(tmp_path / "checkpoint-1", state, {}, {}, {}, {}, None)
    with pytest.raises(CheckpointError) as error:
        check_resumable(saved, world_size=1, planned=(8, 3), adapter_shapes={})
    assert "was written by 2 processes but this run has 1" in str(error.value)
    assert f"{relaunch} ... (the launcher the run used)" in str(error.value)


# ---------------------------------------------------------------------- Ctrl-C under torchrun, resumed


@pytest.mark.slow
def test_ctrl_c_under_torchrun_prints_one_line_and_its_command_resumes_the_run(tmp_path):
    world = make_world(tmp_path / "world")
    output_dir = tmp_path / "run"
    words = command(world, output_dir)  # 3 updates of 8 completions over 2 processes, a checkpoint after each
    # torchrun reads its --master_addr / --master_port from these: the printed command runs as printed
    ports = {"PET_MASTER_ADDR": "127.0.0.1", "PET_MASTER_PORT": str(free_port()), "CUDA_VISIBLE_DEVICES": ""}
    torchrun = (
        [shutil.which("torchrun")]
        if shutil.which("torchrun")
        else [sys.executable, "-m", "torch.distributed.run"]
    )
    # Ctrl-C as a terminal sends it (to the launcher, which passes it on) as checkpoint 2 starts to be written
    process = start_cli(
        world, words, Kill(needle=".checkpoint-2.tmp", signal=signal.SIGINT),
        launcher=[*torchrun, "--nproc_per_node", "2", "-m", "marl"],
        environment={**ports, "MARL_TEST_KILL_LAUNCHER": "1"},
    )  # fmt: skip
    _, stderr = process.communicate(timeout=600)
    lines = [line for line in stderr.splitlines() if "marl train-rloo: interrupted: " in line]
    assert len(lines) == 1, stderr[-3000:]
    assert "[rank" not in stderr, stderr[-3000:]  # no process of marl's printed a traceback
    # torchrun's own process prints its SignalException after marl's line: the launcher's, not marl's
    tracebacks = stderr.count("Traceback (most recent call last)")
    assert tracebacks == 0 or (tracebacks == 1 and "elastic.multiprocessing.api.SignalException" in stderr)
    assert f"after 2 of 3 updates; last checkpoint {output_dir / 'checkpoint-1'}" in lines[0]
    resume = lines[0].split("Resume with: ", 1)[1]
    assert resume.startswith("torchrun --nproc_per_node 2 -m marl train-rloo ")
    assert resume.endswith("--resume_from_checkpoint latest")
    recorded = json.loads((output_dir / "rloo_config.json").read_text())
    assert (recorded["launcher"], recorded["world_size"]) == ("torchrun", 2)
    typed = shlex.split(resume)
    resumed = subprocess.run(
        [*torchrun, *typed[1:]], capture_output=True, text=True, timeout=600,
        env={**os.environ, **ports, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    metrics = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]
    assert [record["update"] for record in metrics] == [1, 2, 3]
