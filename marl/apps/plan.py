"""``marl plan``: will this run fit? The predicted peak of every phase, from the flags of ``train-rloo`` and
the model's ``config.json`` alone (no weights read, nothing downloaded), and the changes that would make it
fit ``--memory_gb``.

Example:
    >>> from marl.apps.cli import plan_main
    >>> plan = plan_main(["--model_name_or_path", "Qwen/Qwen2.5-0.5B", "--memory_gb", "8"])  # doctest: +SKIP
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from marl.config.checks import check_fields
from marl.errors import ConfigError

if TYPE_CHECKING:
    from marl.config.rloo_config import RLOOConfig
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
    sweep: list[str] | None = field(
        default=None,
        metadata={
            "help": "Plan a sweep as train-rloo --sweep trains it: FIELD=V1,V2[,...], repeatable; its "
            "policies (the product of the lists) train at once on the one base."
        },
    )
    tool_calls: bool = field(
        default=False,
        metadata={
            "help": "The run calls tools (train-rloo --tool or --environment): plan its later turns too, "
            "each row decoding after the longest conversation the limits allow (--prompt_length, counted "
            "with the tools' descriptions, plus --response_length)."
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
    """Plan ``config`` as ``arguments`` say, print the plan (and the changes that fit, or how far the closest
    setting is) on stdout, return it. Each plan takes seconds on a large model (its phases are traced), so a
    line on stderr says which plan is being made, numbered against those of its kind."""
    from marl.config.device import Device, describe_choices, resolve_device_settings
    from marl.model.memory import format_bytes
    from marl.plan.advice import advice_text, advise
    from marl.plan.planner import PlanTarget, load_model_config, plan_memory

    # The run's own defaults for that device (train-rloo chooses the same on it), unless given.
    chosen = resolve_device_settings(config, Device.named(arguments.device))
    policies = 1
    if arguments.sweep:  # the members' settings differ only where memory does not (marl.config.sweep)
        from marl.config.sweep import parse_sweep

        policies = len(parse_sweep(arguments.sweep, config))
        if policies > 1 and arguments.num_processes > 1:
            raise ConfigError(
                f"--sweep trains its {policies} policies in one process: plan it with --num_processes 1"
            )
    model_config = load_model_config(config.model_name_or_path)
    target = PlanTarget(
        device=arguments.device,
        memory_gb=arguments.memory_gb,
        prompt_length=arguments.prompt_length,
        num_processes=arguments.num_processes,
        tool_turns=arguments.tool_calls,
    )
    systems = ("trl-rloo", "ppo") if arguments.compare else ()
    sweep = f"the sweep of {policies} policies" if policies > 1 else "the run"
    progress(f"[1/{1 + len(systems)}] planning {sweep} as given ({config.model_name_or_path})")
    if chosen:
        progress(describe_choices(chosen, arguments.device))
    plan = plan_memory(config, model_config, target, policies=policies)
    print(plan)
    if policies > 1:
        progress(f"planning one of its policies alone (the {policies} runs one after another)")
        alone = plan_memory(config, model_config, target)
        print(
            f"the {policies} policies as runs one after another: predicted peak {format_bytes(alone.peak)} "
            f"({alone.peak_phase}), each run loading the base again"
        )
    for number, system in enumerate(systems, start=2):
        progress(f"[{number}/{1 + len(systems)}] planning the same run as {system}")
        print()
        print(plan_memory(config, model_config, target, system=system))
    if plan.fits is False:
        progress("it does not fit: planning the changes that could make it fit")
        print()
        print(advice_text(advise(config, model_config, target, plan, progress, policies=policies)))
    return plan


def progress(line: str) -> None:
    """One progress line of ``marl plan`` on stderr (stdout holds the plan alone)."""
    print(f"marl plan: {line}", file=sys.stderr, flush=True)
