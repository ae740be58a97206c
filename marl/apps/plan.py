"""``marl plan``: will this run fit? The predicted peak of every phase, from the flags of ``train-rloo`` and
the model's ``config.json`` alone (no weights read, nothing downloaded), and the changes that would make it
fit ``--memory_gb``.

Example:
    >>> from marl.apps.cli import plan_main
    >>> plan = plan_main(["--model_name_or_path", "Qwen/Qwen2.5-0.5B", "--memory_gb", "8"])  # doctest: +SKIP
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from marl.errors import ConfigError
from marl.validation import check_fields

if TYPE_CHECKING:
    from marl.config import RLOOConfig
    from marl.plan.planner import MemoryPlan


@dataclass
class PlanArguments:
    """Flags of ``marl plan`` beyond :class:`marl.RLOOConfig` (whose flags are ``train-rloo``'s)."""

    prompt_length: int = field(
        default=512, metadata={"help": "Tokens of the longest prompt of a batch (the planner reads no data)."}
    )
    device: str = field(default="cuda", metadata={"help": "Where the run trains: 'cuda' or 'cpu'."})
    memory_gb: float | None = field(
        default=None,
        metadata={
            "help": "Memory of the GPU (or of the machine with --device cpu) in GB; when the run would not "
            "fit, the changes that make it fit are planned and listed."
        },
    )
    num_processes: int = field(default=1, metadata={"help": "Processes (GPUs) of the run."})
    compare: bool = field(
        default=False,
        metadata={
            "help": "Also plan the same job as TRL's RLOOTrainer with a peft_config and as PPO with four "
            "models would hold it (the planner's models of those systems)."
        },
    )

    def __post_init__(self) -> None:
        check_fields(self)
        from marl.plan.planner import DEVICES

        if self.device not in DEVICES:
            raise ConfigError(
                f"--device {self.device!r} is not one of {list(DEVICES)}: pass --device cuda or cpu"
            )
        if self.prompt_length < 1 or self.num_processes < 1:
            raise ConfigError("--prompt_length and --num_processes must be 1 or more")
        if self.memory_gb is not None and not self.memory_gb > 0:
            raise ConfigError(f"--memory_gb {self.memory_gb} must be a positive number of GB, e.g. 12")


def run_plan(arguments: PlanArguments, config: RLOOConfig) -> MemoryPlan:
    """Plan ``config`` as ``arguments`` say, print the plan (and the changes that fit), return it."""
    from marl.plan.advice import changes_that_fit
    from marl.plan.planner import PlanTarget, load_model_config, plan_memory
    from marl.plan.report import changes_text

    model_config = load_model_config(config.model_name_or_path)
    target = PlanTarget(
        device=arguments.device,
        memory_gb=arguments.memory_gb,
        prompt_length=arguments.prompt_length,
        num_processes=arguments.num_processes,
    )
    plan = plan_memory(config, model_config, target)
    print(plan)
    if arguments.compare:
        for system in ("trl-rloo", "ppo"):
            print()
            print(plan_memory(config, model_config, target, system=system))
    if plan.fits is False:
        print()
        print(changes_text(changes_that_fit(config, model_config, target)))
    return plan
