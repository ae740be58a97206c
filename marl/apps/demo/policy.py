"""The demo's starting policy: a LoRA first fine-tuned on what positive critics wrote about the RL prompts'
movies (the supervised step of the classic RLHF recipe, :mod:`marl.train.trl_trainers`), which RLOO then
trains against the reward adapters with a frozen copy of it as the KL reference.

Started from a fresh LoRA instead (``--warm_start_epochs 0``), the policy finds the reward adapter's taste
for an upbeat storytelling register before it finds reviews, and VADER's win rate and the variety of the text
trade against each other through the KL (``benchmarks/results/2026-11-25-two-reward-demo.md``). Started from
critics' text, it already writes reviews, which name the film.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from marl.errors import ConfigError

if TYPE_CHECKING:
    from marl.config.rloo_config import RLOOConfig

WARM_START_FOLDER = "warm-start"
# Fresh (positive) snippets only; chosen by measurement against all snippets (results file, section 6).
WARM_START_LABEL = 1
WARM_START_LEARNING_RATE = 3e-4
# One epoch on one free core (measured beside another demo); on two, scaled by the measured ratio of the
# demo's seconds per RL completion (marl.apps.demo.run), not measured alone.
WARM_START_SECONDS_PER_EPOCH = {1: 238.0, 2: 238.0 * 0.49 / 0.80}
# RLOO's learning rate: a warm-started LoRA (both factors non-zero) moves several times faster per step than
# a fresh one (B = 0), measured on seed 0 (results file, section 6).
DEMO_LEARNING_RATE = {True: 3e-4, False: 1e-3}
LEARNING_RATE_HELP = f"{DEMO_LEARNING_RATE[True]:g} after a warm start, {DEMO_LEARNING_RATE[False]:g} without"


def rl_learning_rate(warm_start_epochs: float, learning_rate: float | None) -> float:
    """The demo's RLOO learning rate: ``learning_rate`` if given, else the one for a warm-started (epochs
    > 0) or a fresh policy LoRA; negative epochs are refused.

    Example:
        >>> rl_learning_rate(0.0, None), rl_learning_rate(1.0, None), rl_learning_rate(1.0, 5e-4)
        (0.001, 0.0003, 0.0005)
    """
    if warm_start_epochs < 0:
        raise ConfigError(f"--warm_start_epochs={warm_start_epochs} must be 0 (no warm start) or more")
    return DEMO_LEARNING_RATE[warm_start_epochs > 0] if learning_rate is None else learning_rate


def warm_start_demo_policy(
    output_dir: Path, config: RLOOConfig, epochs: float, log: Callable[[str], Any] = print
) -> str:
    """Fine-tune the policy LoRA of ``config`` (the demo's RLOO config) for ``epochs`` on the fresh snippets
    of the seed's RL movies, each split into its opening (an RL prompt) and the rest cut to the completion
    length, on the 4-bit embedded base; saved in ``output_dir/warm-start``, whose path it returns."""
    from marl.data.assets import EMBEDDED_MODEL_ID
    from marl.data.prompts import rotten_tomatoes_warm_start
    from marl.train.trl_trainers import warm_start_policy

    log("[bold]2/4[/bold] warm-starting the policy LoRA on critics' text (supervised)")
    folder = output_dir / WARM_START_FOLDER
    summary = warm_start_policy(
        EMBEDDED_MODEL_ID,
        rotten_tomatoes_warm_start(seed=config.seed, label=WARM_START_LABEL),
        folder,
        lora_config=config.policy_lora_config(),
        quantization=config.quantization,
        learning_rate=WARM_START_LEARNING_RATE,
        num_train_epochs=epochs,
        max_completion_tokens=config.response_length,
        seed=config.seed,
        threads=config.threads,
    )
    log(
        f"warm start: {summary['examples']} fresh critic snippets of the RL movies, "
        f"{summary['optimizer_steps']} steps, mean loss {summary['train_loss_mean']:.2f}, "
        f"{summary['wall_time_s']:.0f} s ({folder})"
    )
    return str(folder)
