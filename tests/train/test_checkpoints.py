"""The files of a checkpoint read back as the run that resumes needs them: the fp16 loss scaler's state,
and the optimizer state placed where a stepped optimizer holds it."""

from __future__ import annotations

import os
from typing import Any

import datasets
import pytest
import torch
from transformers import AutoTokenizer

from marl import RLOOTrainer
from marl.errors import CheckpointError
from marl.model.multi_adapter import MultiAdapterModel
from marl.train import checkpoints

from support.tiny import tiny_rloo_config

TRAINER_STATE = {name: 1 for name in checkpoints.TRAINER_STATE_FIELDS}
DEVICES = [
    "cpu",
    # needs CUDA: on the CPU every tensor is on the CPU, so a misplaced `step` cannot show
    pytest.param("cuda", marks=pytest.mark.cuda),
]


def stepped_optimizer(model: MultiAdapterModel) -> tuple[torch.optim.Optimizer, Any]:
    """The trainer's optimizer and a schedule after one real step on the policy's parameters."""
    parameters = model.policy_parameters()
    optimizer = torch.optim.AdamW(parameters, lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    sum((parameter * parameter).sum() + parameter.sum() for parameter in parameters).backward()
    optimizer.step()
    scheduler.step()
    return optimizer, scheduler


def overflowed_scaler() -> torch.amp.GradScaler:
    """A real loss scaler that met one overflowing step (its scale backed off from 2**16 to 2**15) and then
    one good step (its growth tracker counts it)."""
    scaler = torch.amp.GradScaler("cpu")
    parameter = torch.nn.Parameter(torch.ones(2))
    optimizer = torch.optim.SGD([parameter], lr=0.1)
    for loss in [(parameter * torch.tensor([float("inf"), 1.0])).sum(), parameter.sum()]:
        optimizer.zero_grad()
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
    assert scaler.get_scale() == 2.0**15 and scaler.state_dict()["_growth_tracker"] == 1
    return scaler


def write(folder, model, optimizer, scheduler, **scaler) -> None:
    """A complete checkpoint of one process; ``scaler=`` passes a loss scaler."""
    checkpoints.write_checkpoint(
        folder,
        model=model,
        policy=model.default_policy,
        optimizer=optimizer,
        scheduler=scheduler,
        trainer_state=TRAINER_STATE,
        **scaler,
    )
    checkpoints.write_rng_state(folder, 0)


@pytest.fixture(scope="module")
def cpu_model(tiny_llama_dir) -> MultiAdapterModel:
    return MultiAdapterModel.from_pretrained(tiny_llama_dir)


def test_the_loss_scaler_state_is_saved_and_restored(cpu_model, tmp_path):
    scaler = overflowed_scaler()
    write(tmp_path, cpu_model, *stepped_optimizer(cpu_model), scaler=scaler)
    assert torch.load(tmp_path / checkpoints.SCALER_FILE) == scaler.state_dict()

    saved = checkpoints.read_checkpoint(tmp_path, 0, torch.device("cpu"))
    resumed = torch.amp.GradScaler("cpu")  # what accelerate builds for an fp16 run: the initial scale 2**16
    checkpoints.restore_loss_scaler(saved, resumed)
    assert resumed.state_dict() == scaler.state_dict()
    assert resumed.scale(torch.tensor(1.0)).item() == 2.0**15  # the next loss is scaled as it would have been


def test_a_checkpoint_without_scaler_state_resumes_at_the_initial_scale_with_a_warning(cpu_model, tmp_path):
    write(tmp_path, cpu_model, *stepped_optimizer(cpu_model))  # a run without fp16, or an older checkpoint
    assert not (tmp_path / checkpoints.SCALER_FILE).exists()
    saved = checkpoints.read_checkpoint(tmp_path, 0, torch.device("cpu"))
    assert saved.scaler is None
    resumed = torch.amp.GradScaler("cpu")
    with pytest.warns(RuntimeWarning, match=r"holds no loss-scaler state \(scaler\.pt\).*restarts at 65536"):
        checkpoints.restore_loss_scaler(saved, resumed)
    assert resumed.get_scale() == 2.0**16
    checkpoints.restore_loss_scaler(saved, None)  # a run without a scaler has nothing to restore


def test_a_damaged_scaler_file_is_named(cpu_model, tmp_path):
    write(tmp_path, cpu_model, *stepped_optimizer(cpu_model), scaler=overflowed_scaler())
    os.truncate(tmp_path / checkpoints.SCALER_FILE, 10)
    with pytest.raises(CheckpointError, match=r"cannot read .*scaler\.pt.*damaged"):
        checkpoints.read_checkpoint(tmp_path, 0, torch.device("cpu"))


@pytest.mark.parametrize("device", DEVICES)
def test_resumed_optimizer_state_is_placed_as_in_a_stepped_optimizer(tiny_llama_dir, tmp_path, device):
    """AdamW keeps its `step` counters on the CPU (unless fused or capturable) and its moments beside the
    parameters; a resumed optimizer must hold them there too (a `step` on the GPU costs a sync per step)."""
    model = MultiAdapterModel.from_pretrained(tiny_llama_dir, device_map={"": device})
    stepped, scheduler = stepped_optimizer(model)
    write(tmp_path, model, stepped, scheduler)
    saved = checkpoints.read_checkpoint(tmp_path, 0, torch.device(device))
    resumed = torch.optim.AdamW(model.policy_parameters(), lr=1e-3)
    resumed.load_state_dict(saved.optimizer)
    for parameter in model.policy_parameters():
        assert stepped.state[parameter]["step"].device == torch.device("cpu")
        assert resumed.state[parameter].keys() == stepped.state[parameter].keys()
        for key, expected in stepped.state[parameter].items():
            actual = resumed.state[parameter][key]
            assert (key, actual.device, actual.dtype) == (key, expected.device, expected.dtype)
            assert torch.equal(actual.cpu(), expected.cpu())


def train_fp16(model_dir, output_dir, device, *, resume=None, after_update=None) -> RLOOTrainer:
    """A 2-update fp16 run with a checkpoint after each update; ``after_update(trainer, update)`` runs after
    each update."""
    config = tiny_rloo_config(
        output_dir,
        model_name_or_path=str(model_dir),
        fp16=True,
        total_episodes=8,
        learning_rate=1e-3,
        save_steps=1,
        seed=3,
    )
    model = MultiAdapterModel.from_config(config, device_map={"": device})
    prompts = datasets.Dataset.from_dict({"prompt": ["the movie", "a film about", "review:", "good"]})
    trainer = RLOOTrainer(
        config,
        model,
        AutoTokenizer.from_pretrained(model_dir),
        prompts,
        reward_funcs=lambda prompts, completions: [float(text.count("e")) for text in completions],
    )
    if after_update is not None:
        trainer.parts.callbacks.append(lambda state, metrics: after_update(trainer, state.update))
    trainer.train(resume_from_checkpoint=resume)
    return trainer


@pytest.mark.cuda  # accelerate makes fp16 loss scalers only on GPUs
def test_an_fp16_run_resumes_with_its_loss_scale(tiny_llama_dir, tmp_path):
    """The scale after update 1 is in checkpoint-1, and a run resumed from there goes on from it: the second
    checkpoint of the resumed run holds the scaler state of the uninterrupted run's second checkpoint (before
    the fix it restarted at 2**16)."""

    def lower_the_scale(trainer, update):
        if update == 1:  # as if overflows had backed it off: 2**16 -> 2**9
            trainer.parts.parallelism.accelerator.scaler.update(new_scale=512.0)

    device = torch.device("cuda", torch.cuda.current_device())
    train_fp16(tiny_llama_dir, tmp_path / "full", device, after_update=lower_the_scale)
    scaler_files = [tmp_path / "full" / f"checkpoint-{update}" / checkpoints.SCALER_FILE for update in (1, 2)]
    assert torch.load(scaler_files[0])["scale"] == 512.0

    resumed = train_fp16(tiny_llama_dir, tmp_path / "resumed", device, resume=scaler_files[0].parent)
    assert torch.load(tmp_path / "resumed" / "checkpoint-2" / checkpoints.SCALER_FILE) == torch.load(
        scaler_files[1]
    )
    for parameter in resumed.parts.policy_update.parameters:
        assert resumed.parts.policy_update.optimizer.state[parameter]["step"].device == torch.device("cpu")
