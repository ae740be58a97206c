"""``marl train-rloo``: its flags beyond :class:`marl.RLOOConfig`, their parsing and the trainer they build.

Everything that needs no model is checked before any model loads, so that a typo fails at once: the flags and
the registry names of the config (right after parsing), then the output folder and the data.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from marl.apps.flags import argv_words, parse_flags
from marl.config.checks import check_fields
from marl.data.prompts import dataset_name_field
from marl.errors import ConfigError, DataError

if TYPE_CHECKING:
    import datasets

    from marl.config.rloo_config import RLOOConfig
    from marl.rewards.reward_kinds import RewardSetting


@dataclass
class ScriptArguments:
    """Flags of ``train-rloo`` beyond :class:`marl.RLOOConfig`: data, rewards, tools, output folder."""

    dataset_name: str = dataset_name_field()
    dataset_train_split: str = field(default="train", metadata={"help": "Split to train on."})
    dataset_test_split: str | None = field(
        default=None,
        metadata={
            "help": "Split of held-out prompts for the periodic sample tables (default: training prompts)."
        },
    )
    prompt_column: str = field(default="prompt", metadata={"help": "Column that holds the prompts."})
    reward_fn: list[str] | None = field(
        default=None,
        metadata={
            "help": "Reward function(s) 'module:function' (or 'file.py:function') called as TRL calls them: "
            "keywords prompts, completions, completion_ids, trainer_state and every other dataset column, "
            "returning one number (or None) per completion; with or instead of --reward_adapter, weighted by "
            "--reward_weights. Repeat the flag for several."
        },
    )
    reward: list[str] | None = field(
        default=None,
        metadata={
            "help": "A reward source of any registered kind as KIND:SPEC (kinds: adapter, eos_adapter, "
            "function, and any added with marl.rewards.register_reward_kind). An adapter kind's SPEC is a "
            "--reward_adapter name, which it then reads instead of the default 'adapter' kind, e.g. "
            "--reward_adapter sentiment=DIR --reward eos_adapter:sentiment. Repeat the flag for several; "
            "weighted by --reward_weights after the --reward_adapter and --reward_fn sources."
        },
    )
    tool: list[str] | None = field(
        default=None,
        metadata={
            "help": "A tool the policy may call, 'module:function' (or 'file.py:function'), as TRL's tools: "
            "a plain (sync or async) function with type hints and a docstring, its result added to the "
            "conversation and masked out of the loss. Repeat the flag for several; the chat template must "
            "support tool calls; --max_tool_calling_iterations bounds the turns."
        },
    )
    environment: str | None = field(
        default=None,
        metadata={
            "help": "An environment 'module:Factory' (or 'file.py:Factory'), as TRL's environment_factory: "
            "a callable making one environment per rollout (reset() starts it, its public methods are its "
            "tools, get_reward() is a reward source of weight 1 named after its class), or a dict of such "
            "callables by name, chosen by each example's 'environment' column."
        },
    )
    overwrite_output_dir: bool = field(
        default=False,
        metadata={
            "help": "Replace the previous run in --output_dir (its metrics, checkpoints and adapter); it is "
            "deleted once the new run has finished its first update, and kept if the new run stops before."
        },
    )
    sweep: list[str] | None = field(
        default=None,
        metadata={
            "help": "Train several policies at once on the one base: FIELD=V1,V2,... (repeat the flag for a "
            "grid: the members are the product of the lists). Each policy writes to OUTPUT_DIR/<its "
            "name>; what may differ: marl.config.sweep.SWEEPABLE_FIELDS (learning_rate, seed, kl_coef, "
            "reward_weights, ...)."
        },
    )
    resume_from_checkpoint: str | None = field(
        default=None,
        metadata={
            "help": "Continue the run in --output_dir from this checkpoint folder, or 'latest' (a "
            "run stopped before its first checkpoint then starts from the beginning)."
        },
    )

    def __post_init__(self) -> None:
        check_fields(self)


def parse_train_rloo_args(
    argv: Sequence[str] | None = None, prog: str = "marl train-rloo", device: str | None = None
) -> tuple[ScriptArguments, RLOOConfig]:
    """Parse ``train-rloo`` flags (and ``--config file.yaml``) into script arguments and an ``RLOOConfig``
    whose unset device settings are chosen for ``device`` (``"cuda"`` or ``"cpu"``; ``None``: the device
    the run will train on; :mod:`marl.config.device`).

    ``--reward-adapter`` and every other flag also work with dashes instead of underscores.

    Example:
        >>> script, config = parse_train_rloo_args(["--reward-adapter", "rm", "--rloo_k", "4"], device="cuda")
        >>> config.reward_adapter, config.rloo_k, config.bf16, config.gradient_checkpointing
        (['rm'], 4, True, True)
    """
    from marl.config.device import Device, resolve_device_settings
    from marl.config.rloo_config import RLOOConfig

    script, config = parse_flags([ScriptArguments, RLOOConfig], prog, argv_words(argv))
    resolve_device_settings(config, Device.current() if device is None else Device.named(device))
    # an environment may own the reward (get_reward); the trainer refuses a run with no reward source at all
    if not script.reward_fn and not config.reward_adapter and not script.reward and not script.environment:
        raise ConfigError(
            "no reward: pass --reward_adapter DIR (a reward LoRA from `marl train-reward`) and/or "
            "--reward_fn module:function (or --reward KIND:SPEC, or an --environment with get_reward)"
        )
    reward_settings(script, config)  # a bad --reward fails here, before any work
    # Every registry name (advantage estimator, sampler, parallelism) is resolved before any work; imported
    # here, after the flags, so that --help does not load torch.
    from marl.train.training_parts import check_components

    check_components(config)
    if script.sweep and (script.tool or script.environment):
        raise ConfigError("--sweep trains without tools: drop --sweep, or --tool and --environment")
    if script.sweep:
        from marl.train.sweep_trainer import check_sweep_configs

        if script.resume_from_checkpoint not in (None, "latest"):
            raise ConfigError(
                "--sweep resumes every policy together: pass --resume_from_checkpoint latest, not one folder"
            )

        check_sweep_configs([member.config for member in sweep_members(script, config)])
    return script, config


def sweep_members(script: ScriptArguments, config: RLOOConfig) -> list[Any]:
    """The members of ``--sweep`` over ``config`` (:func:`marl.config.sweep.parse_sweep`).

    Example:
        >>> script, config = parse_train_rloo_args(["--reward_adapter", "rm", "--sweep", "seed=1,2"])
        >>> [member.name for member in sweep_members(script, config)]
        ['seed=1', 'seed=2']
    """
    from marl.config.sweep import parse_sweep

    members = parse_sweep(script.sweep or [], config)
    for member in members:  # a member is a copy of the config: keep the record of the device's choices
        member.config.chosen_for_device = dict(config.chosen_for_device)
    return members


def build_rloo_trainer(script: ScriptArguments, config: RLOOConfig, command: str | None = None):
    """Check everything (output folder, data, reward functions, ONE model with its adapters, the trainer's own
    checks), print the memory card, and return the trainer. Nothing is written: the run writes into its output
    folder only once it has done its first update (see :mod:`marl.train.run_dir`).

    Example:
        >>> script, config = parse_train_rloo_args(["--reward_adapter", "rm", "--output_dir", "runs/a"])
        >>> trainer = build_rloo_trainer(script, config)  # doctest: +SKIP
        >>> trainer.train(**train_arguments(script))  # doctest: +SKIP
    """
    from marl.config.device import describe_choices
    from marl.data.assets import resolve_model_path
    from marl.data.prompts import load_prompt_dataset
    from marl.train.run_dir import plan_start

    # The checks that need no model come first, and before torch is imported, so that a typo fails at once.
    arguments = train_arguments(script)
    members = sweep_members(script, config) if script.sweep else []
    for folder in [member.config.output_dir for member in members] or [config.output_dir]:
        plan_start(  # train() repeats this check before it starts
            folder, arguments["resume_from_checkpoint"], overwrite=arguments["overwrite_output_dir"]
        )
    train_dataset = load_prompt_dataset(
        script.dataset_name, script.dataset_train_split, script.prompt_column, seed=config.seed
    )
    eval_dataset = None
    if script.dataset_test_split is not None:
        eval_dataset = load_prompt_dataset(
            script.dataset_name,
            script.dataset_test_split,
            script.prompt_column,
            seed=config.seed,
            split_flag="--dataset_test_split",
        )
    resolve_model_path(config.model_name_or_path)

    import torch
    from accelerate import PartialState
    from rich.console import Console

    from marl.model.loading import load_tokenizer
    from marl.model.multi_adapter import MultiAdapterModel
    from marl.plan.fit import fit_run
    from marl.rewards import RewardParts, plan_rewards
    from marl.train.launch import check_sharded_launch
    from marl.train.trainer import RLOOTrainer

    # Planned before the model loads, so that a --reward_fn typo fails at once.
    rewards = plan_rewards(reward_settings(script, config))
    tools = tool_arguments(script, train_dataset)  # and a --tool or --environment typo
    # Created before the model so that, without a GPU, every launched process joins one CPU group (a default
    # state would set itself up as a single process and the trainer would refuse the mismatch).
    state = PartialState(cpu=not torch.cuda.is_available())
    check_sharded_launch(config.parallelism, state.num_processes)  # before the model loads
    # --fit auto: the memory settings chosen from the plan, before the model loads (they decide how it loads)
    box = None
    if tools:  # a template without tool calls and plain-text prompts are refused before the model loads
        from marl.rollout.toolbox import ToolBox, check_tool_dataset, prepare_tool_template

        check_tool_dataset(train_dataset, script.dataset_name)
        prepare_tool_template(load_tokenizer(resolve_model_path(config.model_name_or_path)))
        box = ToolBox(**tools)  # --fit counts the prompts as rendered with the tools, and the later turns
    members_configs = [m.config for m in members]
    fit = fit_run(config, train_dataset, state.device, state.num_processes, members_configs, box)
    if fit is not None and state.is_main_process:
        for line in fit.lines():
            print(f"marl: {line}", file=sys.stderr)
    if members:
        from marl.train.sweep_trainer import SweepTrainer, build_sweep_model

        model = build_sweep_model([member.config for member in members])
    else:
        model = MultiAdapterModel.from_config(config)
    tokenizer = load_tokenizer(model.name_or_path)
    trainer = (SweepTrainer if members else RLOOTrainer)(
        members or config,
        model,
        tokenizer,
        train_dataset,
        eval_dataset,
        reward_funcs=rewards.build(RewardParts(model, tokenizer, config.local_rollout_forward_batch_size)),
        dataset_source=dataset_record(script),
        **tools,
    )
    for run in trainer.trainers if members else [trainer]:
        run.fit_record = None if fit is None else fit.record()  # rloo_config.json records what --fit chose
    if state.is_main_process:
        console = Console()
        if command:
            console.print(f"[bold]{command}[/bold]")
        console.print(describe_choices(config.chosen_for_device, trainer.model.device.type), markup=False)
        console.print(memory_card_with_plan(trainer))
    return trainer


def memory_card_with_plan(trainer: Any) -> Any:
    """The model's memory card with the run's predicted peak per phase (:mod:`marl.plan`); a sweep's
    (``SweepTrainer``) counts every policy's training state and plans all its policies together."""
    import dataclasses

    from marl.plan.planner import plan_for_trainer
    from marl.train.checkpoints import rng_state, set_rng_state

    runs = getattr(trainer, "trainers", [trainer])  # a sweep's policies, each as a run

    def planned() -> tuple[dict[str, int], dict[str, int]]:
        drawn = rng_state()  # planning draws from torch's generator; a retry's plan must not move the run's
        plan = plan_for_trainer(runs[0], policies=len(runs))
        set_rng_state(drawn)
        peaks = {phase.name: phase.total for phase in plan.phases if phase.name != "load"}
        # max_memory_allocated does not see the CUDA runtime
        outside = plan.target.runtime_bytes if plan.target.device == "cuda" else 0
        return peaks, {name: peak - outside for name, peak in peaks.items()}

    # the run logs its measured peaks beside these (a sweep's phases run under its first policy's guard),
    # planned again at the sizes in force after a retry
    peaks, runs[0].phases.planned = planned()
    runs[0].phases.replan = lambda: planned()[1]
    card = trainer.model.memory_report([run.parts.policy for run in runs])
    return dataclasses.replace(card, predicted_peaks=peaks)


ADAPTER_KINDS = ("adapter", "eos_adapter")  # the kinds whose spec is a --reward_adapter name


def reward_settings(script: ScriptArguments, config: RLOOConfig) -> list[RewardSetting]:
    """The reward sources of a ``train-rloo`` command, in the order of ``--reward_weights``: each
    ``--reward_adapter`` (read as the ``adapter`` kind unless a ``--reward`` entry names it), each
    ``--reward_fn``, then each ``--reward KIND:SPEC``.

    Example:
        >>> words = ["--reward_adapter", "tone=rm", "--reward_adapter", "topic=tm"]
        >>> script, config = parse_train_rloo_args([*words, "--reward", "eos_adapter:topic"])
        >>> [tuple(setting) for setting in reward_settings(script, config)]
        [('adapter', 'tone'), ('eos_adapter', 'topic')]
    """
    from marl.rewards.reward_kinds import RewardSetting, parse_reward_setting

    chosen = [parse_reward_setting(text) for text in script.reward or []]
    adapters = list(config.reward_adapter_folders())
    for setting in chosen:
        if setting.kind in ADAPTER_KINDS and setting.spec not in adapters:
            raise ConfigError(
                f"--reward {setting.kind}:{setting.spec} names no reward adapter; the --reward_adapter names "
                f"are {adapters} (name one with --reward_adapter {setting.spec}=DIR)"
            )
    read_by_choice = {setting.spec for setting in chosen if setting.kind in ADAPTER_KINDS}
    return [
        *(RewardSetting("adapter", name) for name in adapters if name not in read_by_choice),
        *(RewardSetting("function", spec) for spec in script.reward_fn or []),
        *chosen,
    ]


def tool_arguments(script: ScriptArguments, train_dataset: datasets.Dataset) -> dict[str, Any]:
    """The ``tools`` and ``environment_factory`` keywords of :class:`marl.RLOOTrainer` that ``--tool`` and
    ``--environment`` ask for (``{}`` without them), imported and checked as the trainer checks them
    (:class:`marl.rollout.toolbox.ToolBox`: each tool described to the model, each environment made once),
    a dict of environments against the ``environment`` column of ``train_dataset``.

    Example:
        >>> import datasets
        >>> script = ScriptArguments(environment="string:digits")
        >>> tool_arguments(script, datasets.Dataset.from_dict({"prompt": ["a"]}))
        Traceback (most recent call last):
        ...
        marl.errors.DataError: --environment 'string:digits': 'digits' is a str, not a callable making ...
    """
    from marl.rewards.functions import import_function, import_object
    from marl.rollout.toolbox import ENVIRONMENT_COLUMN, ToolBox, check_tool

    arguments: dict[str, Any] = {}
    if script.tool:
        arguments["tools"] = [import_function(spec, "--tool") for spec in script.tool]
        for spec, tool in zip(script.tool, arguments["tools"], strict=True):
            check_tool(tool, f"--tool {spec}")
    if script.environment:
        spec = script.environment
        factory = import_object(spec, "--environment", "Factory")
        entries = factory.values() if isinstance(factory, dict) else [factory]
        if not all(callable(entry) for entry in entries):
            raise DataError(
                f"--environment {spec!r}: {spec.rpartition(':')[2]!r} is a {type(factory).__name__}, not a "
                "callable making an environment (e.g. its class) or a dict of them by name"
            )
        try:
            box = ToolBox(environment_factory=factory)
        except ConfigError as error:
            raise ConfigError(f"--environment {spec!r}: {error}") from error
        column = (
            train_dataset[ENVIRONMENT_COLUMN] if ENVIRONMENT_COLUMN in train_dataset.column_names else None
        )
        names = column if column is not None else [None] * len(train_dataset)
        box.check_examples(
            [{ENVIRONMENT_COLUMN: name} for name in names], f"--environment {spec!r}: the prompts,"
        )
        arguments["environment_factory"] = factory
    return arguments


def dataset_record(script: ScriptArguments) -> dict[str, Any]:
    """Where the run's prompts came from, for ``rloo_config.json``: the dataset (and its absolute path when
    local), the splits really read (``None``: a whole file; a test split of ``None`` with no test prompts)
    and the prompt column.

    Example:
        >>> record = dataset_record(ScriptArguments(dataset_test_split="test"))
        >>> record["dataset_name"], record["train_split"], record["test_split"], record["prompt_column"]
        ('rotten-tomatoes', 'train', 'test', 'prompt')
    """
    from marl.data.prompts import prompt_source

    train = prompt_source(script.dataset_name, script.dataset_train_split)
    test_split = script.dataset_test_split
    return {
        "dataset_name": train["dataset_name"],
        "dataset_path": train["dataset_path"],
        "train_split": train["split"],
        "test_split": None if test_split is None else prompt_source(script.dataset_name, test_split)["split"],
        "prompt_column": script.prompt_column,
    }


def train_arguments(script: ScriptArguments) -> dict[str, Any]:
    """The arguments of ``RLOOTrainer.train`` that the output-folder flags ask for.

    Example:
        >>> train_arguments(ScriptArguments(resume_from_checkpoint="latest"))
        {'resume_from_checkpoint': True, 'overwrite_output_dir': False}
    """
    resume = script.resume_from_checkpoint
    return {
        "resume_from_checkpoint": True if resume == "latest" else resume,
        "overwrite_output_dir": script.overwrite_output_dir,
    }
