"""What marl does around a TRL trainer that trains an adapter on a (optionally 4-bit) base: the reward
adapter (:mod:`marl.train.reward_training`) and the policy warm start (:mod:`marl.train.warm_start`)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from marl.errors import RunFolderError
from marl.model.adapters import ADAPTER_CONFIG_NAME, SAFETENSORS_WEIGHTS_NAME

if TYPE_CHECKING:
    import torch

    from marl.cpu.threads import FreeCoreThreads

# What an adapter folder keeps: everything else PEFT or the trainer might write is left out.
ADAPTER_FILES = (ADAPTER_CONFIG_NAME, SAFETENSORS_WEIGHTS_NAME)


def free_core_callbacks(governor: FreeCoreThreads | None) -> list[Any] | None:
    """Trainer callbacks that set the torch thread count to the free cores after every optimizer step
    (``governor`` from :func:`marl.cpu.threads.apply_threads`; none when it is ``None``)."""
    from transformers import TrainerCallback

    if governor is None:
        return None

    class FollowFreeCores(TrainerCallback):
        def on_step_end(self, *_: Any, **__: Any) -> None:
            governor()

    return [FollowFreeCores()]


def train_in_compute_dtype(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Cast the trainable weights to ``dtype``: for quantized bases TRL's trainers cast them to bfloat16,
    expecting bf16 autocast, while marl trains them in the compute dtype of the activations (float32 on
    CPU), as the RL update does."""
    for parameter in model.parameters():
        if parameter.requires_grad and parameter.dtype != dtype:
            parameter.data = parameter.data.to(dtype)


def save_adapter_folder(peft_model: Any, output_dir: Path, base_name: str) -> None:
    """Write ``peft_model``'s adapter as the :data:`ADAPTER_FILES` of ``output_dir``, recording the base as
    the caller named it (e.g. the embedded id, not a path that only exists on this machine); the files are
    written aside first, so a folder never holds half of them."""
    peft_model.peft_config["default"].base_model_name_or_path = base_name
    output_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".saving-", dir=output_dir) as staging:
        # Embeddings are not trained; saying so also stops PEFT from looking the base up online to decide.
        peft_model.save_pretrained(staging, safe_serialization=True, save_embedding_layers=False)
        for name in ADAPTER_FILES:
            os.replace(Path(staging) / name, output_dir / name)


def check_output_dir(output_dir: str | os.PathLike) -> Path:
    """``output_dir`` as a path, refused if it is a file or a folder that is not empty (nothing the user had
    there is overwritten)."""
    output_dir = Path(output_dir)
    if output_dir.exists() and not output_dir.is_dir():
        raise RunFolderError(f"--output_dir {output_dir} is a file: pass a folder")
    if output_dir.exists() and any(output_dir.iterdir()):
        raise RunFolderError(
            f"--output_dir {output_dir} exists and is not empty; choose a new output_dir or empty it first"
        )
    return output_dir
