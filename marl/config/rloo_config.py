"""``RLOOConfig``: every setting of an RLOO run in one dataclass that ``HfArgumentParser`` turns into a CLI.

Field names and meanings follow the RLOO trainer that TRL users know (v0.11–v0.21); the model fields
describe the one shared base and its adapters. Settings that cannot work are rejected when the config is
built, with an error that names the problem and the fix. Checks that need the dataset or the model run in
``RLOOTrainer``.

Where completions end: unset, ``stop_token`` is ``"eos"``: a completion ends at the tokenizer's EOS and at
every terminator of the generation config, as TRL stops. ``"none"`` asks for fixed-length completions (every
one runs to ``response_length``; ``marl demo`` uses it). ``stop_token_id`` alone ends completions at that id
only.

Checkpoints: one is written every ``save_steps`` updates and, besides, at the end of the first update that
ends ``save_minutes`` or more after the last checkpoint (or the start): by default a crash loses at most about
10 minutes and one update.

Example:
    >>> config = RLOOConfig(rloo_k=4, per_device_train_batch_size=8, total_episodes=64)
    >>> sizes = config.batch_sizes(world_size=1, dataset_length=100)
    >>> sizes.local_batch_size, sizes.prompts_per_process, sizes.num_total_batches
    (8, 2, 8)
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from marl.config.algorithms import algorithm_field, check_algorithm_settings, resolve_algorithm
from marl.config.batch_sizes import (
    FIT_MEMORY_NOT_FINITE,
    BatchSizes,
    batch_sizes,
    check_batch_settings,
    check_fit_settings,
    fit_field,
    fit_memory_field,
)
from marl.config.checks import check_fields, check_seed
from marl.config.device import check_graph_capture, device_field, graph_capture_field
from marl.config.model import (
    DEFAULT_LORA_ALPHA,
    DEFAULT_LORA_R,
    DEFAULT_POLICY,
    DEFAULT_TARGET_MODULES,
    check_reference_mode,
    parse_quantization,
    policy_lora_config,
    reward_adapter_folders,
)
from marl.config.sampler_correction import (
    check_sampler_correction,
    clip_max_field,
    clip_min_field,
    correction_field,
    mode_field,
)
from marl.cpu.allocator import cpu_allocator_field
from marl.cpu.threads import check_threads, threads_field
from marl.errors import ConfigError

if TYPE_CHECKING:
    from peft import LoraConfig


# Trackers that accelerate can log to ("none" turns trackers off; metrics.jsonl is always written).
REPORT_TO_CHOICES = (
    "none", "all", "tensorboard", "wandb", "trackio", "aim", "comet_ml", "mlflow", "clearml", "dvclive",
    "swanlab",
)  # fmt: skip
SCHEDULER_CHOICES = (
    "linear", "cosine", "cosine_with_restarts", "polynomial", "constant", "constant_with_warmup",
    "inverse_sqrt",
)  # fmt: skip

# --save_minutes: checkpoints by time besides those by updates (the module docstring).
DEFAULT_SAVE_MINUTES = 10.0
SAVE_MINUTES_HELP = (
    "Also checkpoint after the first update that ends this many minutes after the last checkpoint (or the "
    "start); 0 turns checkpoints by time off. With the default a crash loses at most about 10 minutes and "
    "one update. Pruned with the others (--save_total_limit)."
)


def save_minutes_field() -> Any:
    """The ``save_minutes`` field of :class:`marl.RLOOConfig`, with its default and help text."""
    return field(default=DEFAULT_SAVE_MINUTES, metadata={"help": SAVE_MINUTES_HELP})


def check_save_settings(save_steps: int, save_minutes: float, save_total_limit: int | None) -> None:
    """Refuse checkpoint settings that cannot work, one line each, before anything loads.

    Example:
        >>> check_save_settings(save_steps=-2, save_minutes=10, save_total_limit=None)
        Traceback (most recent call last):
        ...
        marl.errors.ConfigError: --save_steps=-2 must be >= 0 (0 turns checkpoints by updates off). Set ...
    """
    if save_steps < 0:
        raise ConfigError(
            f"--save_steps={save_steps} must be >= 0 (0 turns checkpoints by updates off). "
            "Set it to 0 or more"
        )
    if not save_minutes >= 0:  # NaN too
        raise ConfigError(
            f"--save_minutes={save_minutes} must be >= 0 (0 turns checkpoints by time off). "
            f"Set it to 0 or more, e.g. --save_minutes {DEFAULT_SAVE_MINUTES:g}"
        )
    if save_total_limit is not None and save_total_limit < 1:
        raise ConfigError(
            f"--save_total_limit={save_total_limit} must be >= 1. Leave it unset to keep all checkpoints"
        )


# --stop_token: 'eos' ends a completion at the EOS (and the generation config's terminators); 'none' does not.
STOP_TOKEN_CHOICES = ("eos", "none")


def resolve_stop_token(settings: Any) -> None:
    """Unset ``stop_token``: ``"eos"``, or ``"none"`` when ``stop_token_id`` names the stop id instead.

    Example:
        >>> from types import SimpleNamespace
        >>> settings = SimpleNamespace(stop_token=None, stop_token_id=None, missing_eos_penalty=None)
        >>> resolve_stop_token(settings)
        >>> settings.stop_token, has_stop_token(settings)
        ('eos', True)
    """
    if settings.stop_token is None:
        settings.stop_token = "eos" if settings.stop_token_id is None else "none"


def has_stop_token(settings: Any) -> bool:
    """Whether completions end at a stop token (the EOS or ``stop_token_id``), not only at the limit."""
    return settings.stop_token == "eos" or settings.stop_token_id is not None


def check_stop_settings(settings: Any) -> None:
    """Refuse stop settings that cannot work, naming the fix.

    Example:
        >>> from types import SimpleNamespace
        >>> settings = SimpleNamespace(stop_token="</s>", stop_token_id=None, missing_eos_penalty=None)
        >>> check_stop_settings(settings)
        Traceback (most recent call last):
        ...
        marl.errors.ConfigError: stop_token='</s>' is not supported. Use --stop_token eos (the default), ...
    """
    if settings.stop_token not in STOP_TOKEN_CHOICES:
        raise ConfigError(
            f"stop_token={settings.stop_token!r} is not supported. Use --stop_token eos (the default), "
            "--stop_token none or --stop_token_id ID"
        )
    if settings.stop_token_id is not None and settings.stop_token_id < 0:
        raise ConfigError(
            f"stop_token_id={settings.stop_token_id} is not a token id. Pass a token id of the tokenizer"
        )
    if settings.stop_token == "eos" and settings.stop_token_id is not None:
        raise ConfigError("stop_token and stop_token_id are both set. Set only one of them")
    if settings.missing_eos_penalty is not None and not has_stop_token(settings):
        raise ConfigError(
            "missing_eos_penalty is set without a stop token: all would count as missing EOS. Add "
            "--stop_token eos (or --stop_token_id ID)"
        )


@dataclass
class RLOOConfig:
    """Configuration of :class:`marl.RLOOTrainer` (RLOO fields) and of the shared base model (model fields).

    Example:
        >>> from transformers import HfArgumentParser
        >>> (config,) = HfArgumentParser(RLOOConfig).parse_args_into_dataclasses(["--rloo_k", "4"])
        >>> config.rloo_k, config.kl_coef
        (4, 0.05)
    """

    # what a NaN or infinite value of these fields is told (marl.config.checks.check_fields)
    NOT_FINITE: ClassVar[dict[str, str]] = {"fit_memory_gb": FIT_MEMORY_NOT_FINITE}

    # --- run ---
    output_dir: str = field(
        default="rloo-output",
        metadata={"help": "Folder for metrics.jsonl, samples, checkpoints and the final policy adapter."},
    )
    seed: int = field(default=42, metadata={"help": "Seed of the data order, sampling and initialisation."})
    threads: int = threads_field()
    cpu_allocator: str = cpu_allocator_field()

    # --- model: one base, adapters as views (read by MultiAdapterModel.from_config) ---
    model_name_or_path: str = field(
        default="smollm2-135m-instruct",
        metadata={
            "help": "Base model: the embedded id, a local folder, or a hub id already in the local cache."
        },
    )
    quantization: str | None = field(
        default=None,
        metadata={
            "help": "Load the base in '4bit' (NF4) or '8bit' through bitsandbytes; unset for no quantization."
        },
    )
    reward_adapter: list[str] | None = field(
        default=None,
        metadata={
            "help": "Reward adapter folder(s), each a frozen LoRA + score head (a PEFT SEQ_CLS adapter): "
            "DIR, or NAME=DIR to name it (its mean is logged as rewards/NAME). Repeat the flag for several."
        },
    )
    reward_weights: list[float] | None = field(
        default=None,
        metadata={
            "help": "One weight per reward source, in order: the reward adapters, then the reward functions. "
            "The reward is the weighted sum. Default: 1 each."
        },
    )
    reward_normalization: str = field(
        default="sum",
        metadata={
            "help": "'sum': the estimator sees the weighted sum of the raw scores (TRL's default). "
            "'per_reward' (GDPO): each source normalised within the prompt's group first, the weighted sum "
            "of those, then the advantages z-scored over the batch; rloo and grpo estimators only "
            "(marl.algo.shaping)."
        },
    )
    policy_adapter: str | None = field(
        default=None,
        metadata={
            "help": "Start the policy from this PEFT adapter folder (e.g. an SFT adapter), not a new LoRA."
        },
    )
    policy_adapter_name: str = field(
        default=DEFAULT_POLICY,
        metadata={"help": "Name of the policy adapter that trains (a model may hold several policies)."},
    )
    reference: str = field(
        default="auto",
        metadata={
            "help": "KL reference: 'base' (adapters disabled), 'initial-policy' (frozen copy of the starting "
            "policy adapter), or 'auto' (initial-policy when --policy_adapter is given, else base)."
        },
    )
    lora_r: int = field(default=DEFAULT_LORA_R, metadata={"help": "Rank of a new policy LoRA."})
    lora_alpha: int = field(
        default=DEFAULT_LORA_ALPHA, metadata={"help": "Scaling alpha of a new policy LoRA."}
    )
    lora_target_modules: list[str] = field(
        default_factory=lambda: [DEFAULT_TARGET_MODULES],
        metadata={
            "help": "Modules of a new policy LoRA: 'all-linear' or module names such as q_proj v_proj."
        },
    )
    share_prompt_prefix: bool = field(
        default=True,
        metadata={
            "help": "Compute each prompt once for its k completions in every forward pass: the scoring "
            "passes and, when per_device_train_batch_size is a multiple of rloo_k, the update. False "
            "computes every row in full. The numbers are the same up to float rounding."
        },
    )
    gradient_checkpointing: bool | None = device_field("gradient_checkpointing")
    bf16: bool | None = device_field("bf16")
    fp16: bool | None = device_field("fp16")
    parallelism: str = field(
        default="replicated",
        metadata={
            "help": "How the run is spread over the launched processes (marl.train.parallel): 'replicated' "
            "(every process holds the whole base and samples its own prompts; gradients are averaged), "
            "'fsdp2' (the base sharded over the processes with FSDP2: each holds about 1/N of it; needs 2 or "
            "more processes) or a name registered with marl.train.parallel.register_parallelism."
        },
    )

    # --- batch arithmetic ---
    rloo_k: int = field(default=2, metadata={"help": "Completions sampled per prompt (k >= 2)."})
    algorithm: str = algorithm_field("algorithm")
    advantage_estimator: str | None = algorithm_field("advantage_estimator")
    scale_rewards: str | None = algorithm_field("scale_rewards")
    per_device_train_batch_size: int = field(
        default=8, metadata={"help": "Completions per micro-batch of the update, per process."}
    )
    gradient_accumulation_steps: int = field(
        default=1, metadata={"help": "Micro-batches accumulated into one optimizer step."}
    )
    num_mini_batches: int = field(
        default=1, metadata={"help": "Mini-batches (optimizer steps) per PPO epoch."}
    )
    num_ppo_epochs: int | None = algorithm_field("num_ppo_epochs")
    total_episodes: int | None = field(
        default=None,
        metadata={"help": "Completions to train on in total; default num_train_epochs × len(train_dataset)."},
    )
    num_train_epochs: float = field(
        default=3.0, metadata={"help": "Used only when total_episodes is unset (see there)."}
    )
    local_rollout_forward_batch_size: int = field(
        default=64,
        metadata={"help": "Rows per chunk of the rollout's generation and no-grad forward passes."},
    )
    fit: str = fit_field()
    fit_memory_gb: float | None = fit_memory_field()

    # --- optimisation ---
    learning_rate: float = field(
        default=5e-5, metadata={"help": "AdamW learning rate of the policy adapter."}
    )
    lr_scheduler_type: str = field(
        default="linear",
        metadata={"help": f"Schedule over all optimizer steps: one of {', '.join(SCHEDULER_CHOICES)}."},
    )
    warmup_steps: int = field(
        default=0, metadata={"help": "Warm-up optimizer steps (overrides warmup_ratio)."}
    )
    warmup_ratio: float = field(
        default=0.0, metadata={"help": "Warm-up as a fraction of all optimizer steps."}
    )
    weight_decay: float = field(default=0.0, metadata={"help": "AdamW weight decay."})
    max_grad_norm: float = field(
        default=1.0, metadata={"help": "Clip the policy gradient to this global norm; 0 disables clipping."}
    )

    # --- RLOO ---
    loss_type: str | None = algorithm_field("loss_type")
    kl_coef: float | None = algorithm_field("kl_coef")
    kl_placement: str | None = algorithm_field("kl_placement")
    use_bias_correction_kl: bool | None = algorithm_field("use_bias_correction_kl")
    cliprange: float | None = algorithm_field("cliprange")
    epsilon_high: float | None = algorithm_field("epsilon_high")
    importance_sampling_level: str | None = algorithm_field("importance_sampling_level")
    mask_truncated_completions: bool | None = algorithm_field("mask_truncated_completions")
    vllm_importance_sampling_correction: bool = correction_field()
    vllm_importance_sampling_mode: str = mode_field()
    vllm_importance_sampling_clip_max: float | None = clip_max_field()
    vllm_importance_sampling_clip_min: float | None = clip_min_field()
    temperature: float = field(
        default=0.7, metadata={"help": "Sampling temperature; log-probs use the same temperature."}
    )
    sampler: str | None = device_field("sampler")
    graph_capture: str = graph_capture_field()
    response_length: int | None = algorithm_field("response_length")
    stop_token: str | None = field(
        default=None,
        metadata={
            "help": "'eos' (the default, as TRL): a completion ends at the tokenizer's EOS and every "
            "terminator of the generation config. 'none': no stop token, every completion runs to "
            "--response_length. Unset with --stop_token_id: only that id ends a completion."
        },
    )
    stop_token_id: int | None = field(
        default=None, metadata={"help": "A completion ends at this token id (instead of the EOS)."}
    )
    missing_eos_penalty: float | None = field(
        default=None,
        metadata={"help": "Subtract this from the score of completions that do not contain the stop token."},
    )
    max_tool_calling_iterations: int | None = field(
        default=None,
        metadata={
            "help": "With tools (--tool, --environment): the most tool-calling turns of one completion; "
            "unset: until a turn calls no tool or --response_length is reached (TRL's field and default)."
        },
    )
    normalize_reward: bool = field(
        default=False,
        metadata={
            "help": "Z-score the scores over the judged completions of the whole batch (all processes), then "
            "clip to ±reward_clip_range."
        },
    )
    reward_clip_range: float = field(default=10.0, metadata={"help": "Clip range of normalised scores."})
    normalize_advantage: bool = field(
        default=False,
        metadata={
            "help": "Z-score the advantages over the whole batch (all processes); completions without an "
            "advantage (unjudged, or without a judged sibling) keep 0."
        },
    )
    advantage_epsilon: float = field(
        default=1e-8, metadata={"help": "Added to the std --normalize_advantage divides by (TRL 1.16: 1e-4)."}
    )
    token_level_kl: bool = field(
        default=False, metadata={"help": "The older spelling of --kl_placement loss (set from it)."}
    )

    # --- logging and checkpoints ---
    logging_steps: int = field(default=1, metadata={"help": "Log metrics every this many updates."})
    report_to: list[str] = field(
        default_factory=lambda: ["none"],
        metadata={"help": f"Trackers for the metrics: {', '.join(REPORT_TO_CHOICES)}."},
    )
    num_sample_generations: int = field(
        default=10, metadata={"help": "Sample tables printed and saved over the run; 0 disables them."}
    )
    save_steps: int = field(default=500, metadata={"help": "Checkpoint every this many updates; 0 disables."})
    save_minutes: float = save_minutes_field()
    save_total_limit: int | None = field(
        default=None, metadata={"help": "Keep at most this many checkpoints (oldest removed first)."}
    )

    def __post_init__(self) -> None:
        if isinstance(self.report_to, str):
            self.report_to = [self.report_to]
        if isinstance(self.lora_target_modules, str):
            self.lora_target_modules = [self.lora_target_modules]
        if isinstance(self.reward_adapter, str | os.PathLike):
            self.reward_adapter = [str(self.reward_adapter)]
        self.quantization = parse_quantization(self.quantization)
        resolve_stop_token(self)  # unset: the EOS, as TRL always stops
        resolve_algorithm(self)
        # bf16, fp16 and gradient_checkpointing stay unset until the device is known (marl.config.device).
        self.chosen_for_device: dict[str, str] = {}
        self._validate()

    def _validate(self) -> None:
        def fail(problem: str, fix: str) -> None:
            raise ConfigError(f"{problem}. {fix}")

        check_fields(self)
        check_seed(self.seed)
        check_threads(self.threads)
        check_batch_settings(self)
        for name in (
            "local_rollout_forward_batch_size",
            "response_length",
            "logging_steps",
            "lora_r",
            "lora_alpha",
        ):
            if getattr(self, name) < 1:
                fail(f"{name}={getattr(self, name)} must be a positive integer", f"Set --{name} to 1 or more")
        if self.learning_rate < 0 or self.weight_decay < 0 or self.max_grad_norm < 0:
            fail(
                "learning_rate, weight_decay and max_grad_norm must be non-negative", "Fix the negative value"
            )
        if self.lr_scheduler_type not in SCHEDULER_CHOICES:
            fail(f"unknown lr_scheduler_type {self.lr_scheduler_type!r}", f"Use one of {SCHEDULER_CHOICES}")
        if self.warmup_steps < 0 or not 0.0 <= self.warmup_ratio < 1.0:
            fail(
                "warmup_steps must be >= 0 and warmup_ratio in [0, 1)", "Fix --warmup_steps / --warmup_ratio"
            )
        check_algorithm_settings(self)
        check_sampler_correction(self)
        if self.temperature <= 0:
            fail(
                f"temperature={self.temperature} must be > 0 (sampling is required)",
                "Use e.g. --temperature 0.7",
            )
        check_stop_settings(self)
        check_graph_capture(self)
        if self.normalize_reward and self.reward_clip_range <= 0:
            fail(f"reward_clip_range={self.reward_clip_range} must be > 0", "Use e.g. --reward_clip_range 10")
        check_reference_mode(self.reference)
        if self.reference == "initial-policy" and self.policy_adapter is None:
            fail(
                "reference='initial-policy' needs a starting policy adapter",
                "Pass --policy_adapter DIR, or use --reference base",
            )
        if self.bf16 and self.fp16:
            fail("bf16 and fp16 are both set", "Choose one mixed-precision type")
        unknown = [name for name in self.report_to if name not in REPORT_TO_CHOICES]
        if unknown:
            fail(f"unknown report_to {unknown}", f"Use any of {REPORT_TO_CHOICES}")
        if "none" in self.report_to and len(self.report_to) > 1:
            fail(
                f"report_to={self.report_to} mixes 'none' with trackers", "Use either 'none' or tracker names"
            )
        if self.num_sample_generations < 0:
            fail("num_sample_generations must be >= 0", "Use 0 to disable the sample tables")
        if self.max_tool_calling_iterations is not None and self.max_tool_calling_iterations < 0:
            fail(
                f"max_tool_calling_iterations={self.max_tool_calling_iterations} must be >= 0",
                "Leave --max_tool_calling_iterations unset for no limit",
            )
        check_save_settings(self.save_steps, self.save_minutes, self.save_total_limit)
        check_fit_settings(self)

    @property
    def has_stop_token(self) -> bool:
        """Whether completions end at a stop token (the EOS or ``stop_token_id``), not only at the limit."""
        return has_stop_token(self)

    @property
    def trackers(self) -> list[str]:
        """Tracker names for ``Accelerator(log_with=...)``; empty when reporting is off."""
        return [] if self.report_to == ["none"] else list(self.report_to)

    @property
    def mixed_precision(self) -> str:
        """``"bf16"``, ``"fp16"`` or ``"no"``, as ``accelerate.Accelerator`` expects."""
        return "bf16" if self.bf16 else "fp16" if self.fp16 else "no"

    def batch_sizes(self, world_size: int, dataset_length: int) -> BatchSizes:
        """Derived batch arithmetic for ``world_size`` processes and a dataset of ``dataset_length`` prompts.

        Example:
            >>> config = RLOOConfig(per_device_train_batch_size=4, num_mini_batches=2, total_episodes=100)
            >>> sizes = config.batch_sizes(world_size=2, dataset_length=10)
            >>> sizes.prompts_per_update, sizes.num_total_batches, sizes.total_optimizer_steps
            (8, 7, 56)
        """
        return batch_sizes(self, world_size, dataset_length)

    def policy_lora_config(self) -> LoraConfig:
        """The ``peft.LoraConfig`` of a new policy adapter built from the ``lora_*`` fields.

        Example:
            >>> RLOOConfig(lora_r=8).policy_lora_config().r
            8
        """
        targets = self.lora_target_modules
        return policy_lora_config(
            self.lora_r,
            self.lora_alpha,
            DEFAULT_TARGET_MODULES if targets == [DEFAULT_TARGET_MODULES] else list(targets),
        )

    def reward_adapter_folders(self) -> dict[str, str]:
        """The reward adapters by name (see :func:`marl.config.model.reward_adapter_folders`).

        Example:
            >>> RLOOConfig(reward_adapter=["rm", "fluency=adapters/fluency"]).reward_adapter_folders()
            {'reward': 'rm', 'fluency': 'adapters/fluency'}
        """
        return reward_adapter_folders(self.reward_adapter or [])
