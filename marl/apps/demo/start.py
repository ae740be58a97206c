"""What ``marl demo`` does before it trains, for one policy and for a sweep alike.

:func:`start_demo` checks the run folders and the demo's extra, rebuilds the reward adapter when asked, reads
the prompts and makes the RLOO config and the warm start; once the model is loaded, :func:`demo_rewards`
weighs the two rewards and builds the reward to train against."""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from marl.apps.demo import policy as demo_policy
from marl.apps.demo.arguments import demo_rloo_config
from marl.apps.demo.rewards import (
    WEIGHT_PROBE_PROMPTS,
    chosen_rewards,
    rebuild_sentiment_adapter,
    reward_adapter_entries,
    weigh_rewards,
)
from marl.apps.demo.verdict import TARGET_EVAL_PROMPTS
from marl.errors import MissingPathError

if TYPE_CHECKING:
    from marl.apps.demo.arguments import DemoArguments

DEMO_SUMMARY_FILE = "demo_summary.json"
# Measured with the defaults on a 2-core x86-64 CPU (docs/guides/demo.md), by free cores: 2 = the
# demo alone (seed 0), 1 = another process holding the other core (seeds 1 and 2). Loading (with the one-off
# model conversion), seconds per training completion (sample tables included), and the final evaluation.
MEASURED_LOAD_SECONDS = 25.0
MEASURED_SECONDS_PER_COMPLETION = {1: 0.80, 2: 0.49}
MEASURED_EVAL_SECONDS = {1: 150.0, 2: 100.0}


def expected_seconds(arguments: DemoArguments, threads: int, policies: int = 1) -> float:
    """The demo's expected duration with ``threads`` free cores, scaled from the measured run by the number
    of completions trained on and evaluated (a rebuilt reward adapter not counted); ``policies`` trained at
    once (``--sweep``) each count their completions, and evaluate beside the one base.

    Example:
        >>> from marl.apps.demo.run import DemoArguments
        >>> round(expected_seconds(DemoArguments(), threads=2) / 60)
        15
    """
    cores = min(max(threads, 1), 2)
    length = arguments.response_length / 20
    per_completion = MEASURED_SECONDS_PER_COMPLETION[cores]
    evaluation = MEASURED_EVAL_SECONDS[cores] * length * arguments.num_eval_prompts / TARGET_EVAL_PROMPTS
    evaluation *= (1 + policies) / 2  # measured: the base and one policy
    if arguments.warm_start_epochs > 0:  # the warm start, and its completions measured with the others'
        evaluation *= 1.5
        evaluation += demo_policy.WARM_START_SECONDS_PER_EPOCH[cores] * arguments.warm_start_epochs
    training = per_completion * length * arguments.total_episodes * policies
    return MEASURED_LOAD_SECONDS + training + evaluation


def duration_line(arguments: DemoArguments, policies: int = 1) -> str:
    """The threads the demo runs with and its expected duration, as it prints them at the start."""
    import torch

    threads = torch.get_num_threads()
    how = "--threads" if arguments.threads else "the free cores, measured again after every update"
    minutes = {cores: expected_seconds(arguments, cores, policies) / 60 for cores in (threads, 2, 1)}
    return (
        f"{threads} torch thread(s) ({how}); expected duration about {minutes[threads]:.0f} min (measured: "
        f"{minutes[2]:.0f} min on 2 free cores, {minutes[1]:.0f} min on 1)"
    )


def _default_output_dir() -> Path:
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    return Path("marl-demo") / f"run-{stamp}"


@dataclass
class DemoStart:
    """What the demo has before its model loads: its folder, reward adapters, prompts and RLOO config."""

    output_dir: Path
    reward_adapter: str
    reward_names: tuple[str, ...]
    adapter_entries: list[str]
    train_prompts: Any
    eval_prompts: list[str]
    config: Any


def start_demo(arguments: DemoArguments, console: Any, sweep_names: list[str] | None = None) -> DemoStart:
    """Check the run folders (``<output_dir>/policy``, or one folder per sweep member in ``sweep_names``), the
    demo's extra and the reward adapter; rebuild the sentiment adapter when asked; read the prompts; make the
    RLOO config (writing to ``<output_dir>/policy``, or to ``<output_dir>`` whose members' folders a sweep
    adds) and the warm start when asked."""
    from marl.data.fixed_rules import check_gold_judge
    from marl.data.prompts import rotten_tomatoes_prompts
    from marl.train.curves import pyplot
    from marl.train.run_dir import plan_start

    output_dir = Path(arguments.output_dir) if arguments.output_dir else _default_output_dir()
    for name in sweep_names or ["policy"]:
        plan_start(output_dir / name)
    # The demo's judge and curves come from its extra: without it, stop now rather than after training.
    check_gold_judge()
    pyplot()
    if not arguments.train_reward and not (Path(arguments.reward_adapter) / "adapter_config.json").is_file():
        raise MissingPathError(
            f"no reward adapter in {arguments.reward_adapter}. Run `marl demo --train_reward` to build one, "
            "or pass --reward_adapter DIR"
        )
    reward_names = chosen_rewards(arguments.rewards, arguments.topic_reward_adapter)
    adapters = "a reward adapter" if len(reward_names) == 1 else f"{len(reward_names)} reward adapters"
    policies = f", {len(sweep_names)} policies at once" if sweep_names else ""
    console.rule(
        f"[bold]marl demo[/bold]: RLOO on SmolLM2-135M-Instruct (4-bit) with {adapters}{policies}, offline"
    )

    if arguments.train_reward:
        console.print(
            "[bold]1/4[/bold] rebuilding the reward adapter (Rotten Tomatoes fresh vs rotten pairs)"
        )
        reward_adapter = rebuild_sentiment_adapter(output_dir)
    else:
        reward_adapter = arguments.reward_adapter
        console.print(f"[bold]1/4[/bold] reward adapter: {reward_adapter}")

    train_prompts = rotten_tomatoes_prompts("train", seed=arguments.seed)
    eval_prompts = rotten_tomatoes_prompts("test", seed=arguments.seed)["prompt"][
        : arguments.num_eval_prompts
    ]
    folders = {"sentiment": reward_adapter, "topic": arguments.topic_reward_adapter}
    adapter_entries = reward_adapter_entries(reward_names, folders)
    config = demo_rloo_config(
        arguments,
        output_dir if sweep_names else output_dir / "policy",
        adapter_entries if len(adapter_entries) > 1 else reward_adapter,
    )
    if arguments.warm_start_epochs > 0:
        config.policy_adapter = demo_policy.warm_start_demo_policy(
            output_dir, config, arguments.warm_start_epochs, console.print
        )
    return DemoStart(
        output_dir, reward_adapter, reward_names, adapter_entries, train_prompts, eval_prompts, config
    )


def demo_rewards(
    start: DemoStart, configs: list[Any], model: Any, tokenizer: Any, arguments: DemoArguments, say: Any
) -> tuple[dict[str, Any] | None, Any]:
    """The on-film weight (measured on base completions, or ``--topic_weight``; set on every config in
    ``configs``) and the reward to train against: each adapter read as it was trained, text + EOS."""
    from marl.rewards import RewardParts, RewardSetting, plan_rewards

    weighing = None
    config = configs[0]
    if "topic" in start.reward_names:
        weighing = weigh_rewards(
            model,
            tokenizer,
            start.train_prompts["prompt"][:WEIGHT_PROBE_PROMPTS],
            arguments.topic_weight,
            say,
            response_length=config.response_length,
            temperature=config.temperature,
            seed=arguments.seed,
        )
        for each in configs:
            each.reward_weights = weighing["weights"]
    # The reward adapter scores every completion as it was trained, text + EOS: read at the last word of a
    # completion cut off by the length limit, it rewards stopping early over what the text says.
    rewards = plan_rewards(RewardSetting("eos_adapter", name) for name in config.reward_adapter_folders())
    return weighing, rewards.build(RewardParts(model, tokenizer, config.local_rollout_forward_batch_size))
