"""``--sweep FIELD=V1,V2``: the grid of settings a sweep trains at once, and what may differ between policies.

A sweep trains several policy LoRAs on ONE base in one process: every update samples all policies' rows in one
batched decode and scores them in the same packed passes, each row routed through its own policy
(:mod:`marl.model.rows`), then runs every policy's update in one loop, one micro-batch per policy at each
micro-batch step (:mod:`marl.train.training_parts`). So a setting may differ between policies only where
the shared passes do not read it: what a policy does with its own rows after they are sampled and scored
(its advantages, its loss, its optimizer and schedule, its data order and initial weights). Everything that
shapes the shared passes (the base, its dtype and quantization, the decode's temperature, lengths and stops,
the batch arithmetic of the update loop, the reward sources) is one setting for the whole sweep.
:data:`SWEEPABLE_FIELDS` lists what may differ, each with why; any other field is refused with the reason.

``--sweep`` is repeatable; the members are the product of the lists in the order given (the last flag varies
fastest). A list of one value is allowed: it sets that field for every member and names it (a scripted grid
keeps its shape). Values are parsed with the field's type: ``true``/``false`` for booleans, ``none`` for an
optional field (an algorithm field then takes its ``--algorithm`` preset's value), ``:`` between the items
of a list (``reward_weights=1:0.5,1:1``).

Example:
    >>> from marl.config import RLOOConfig
    >>> grid = ["learning_rate=1e-4,3e-4", "kl_coef=0.05,0.1"]
    >>> members = parse_sweep(grid, RLOOConfig(output_dir="runs/s"))
    >>> [member.name for member in members]
    ['learning_rate=1e-4,kl_coef=0.05', 'learning_rate=1e-4,kl_coef=0.1', \
'learning_rate=3e-4,kl_coef=0.05', 'learning_rate=3e-4,kl_coef=0.1']
    >>> members[1].config.learning_rate, members[1].config.kl_coef, members[1].config.output_dir
    (0.0001, 0.1, 'runs/s/learning_rate=1e-4,kl_coef=0.1')
    >>> members[1].config.policy_adapter_name
    'policy-learning_rate_1e-4_kl_coef_0_1'
    >>> parse_sweep(["rloo_k=2,4"], RLOOConfig())
    Traceback (most recent call last):
    ...
    marl.errors.ConfigError: --sweep rloo_k: cannot differ between the policies of a sweep: ...
"""

from __future__ import annotations

import dataclasses
import difflib
import itertools
import re
import types
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from marl.config.rloo_config import RLOOConfig
from marl.errors import ConfigError

_ADVANTAGE = "advantages are computed per policy from its own rows' scores"
_LOSS = "each policy's loss is computed on its own rows; the backward pass routes each row to its adapter"
_OPTIMIZER = "each policy has its own optimizer and LR schedule"

SWEEPABLE_FIELDS: dict[str, str] = {
    "seed": "each policy's own prompt order and initial LoRA weights (the decode draws from one random "
    "stream, seeded by the first policy's seed)",
    "learning_rate": _OPTIMIZER,
    "lr_scheduler_type": _OPTIMIZER,
    "warmup_steps": _OPTIMIZER,
    "warmup_ratio": _OPTIMIZER,
    "weight_decay": _OPTIMIZER,
    "max_grad_norm": "each policy's gradient is clipped over its own adapter's parameters",
    "kl_coef": "the reference pass runs when any policy reads it (the base with adapters disabled serves "
    "every row); each policy weighs its own KL",
    "kl_placement": "the policy and reference passes run when any policy reads them; " + _LOSS,
    "cliprange": _LOSS,
    "epsilon_high": _LOSS,
    "loss_type": _LOSS,
    "importance_sampling_level": _LOSS,
    "use_bias_correction_kl": _LOSS,
    "mask_truncated_completions": _LOSS,
    "advantage_estimator": _ADVANTAGE,
    "scale_rewards": _ADVANTAGE,
    "normalize_advantage": _ADVANTAGE,
    "advantage_epsilon": _ADVANTAGE,
    "reward_weights": "every reward source scores every row once; each policy weighs the scores itself",
    "reward_normalization": _ADVANTAGE,
    "missing_eos_penalty": _ADVANTAGE,
    "normalize_reward": _ADVANTAGE,
    "reward_clip_range": _ADVANTAGE,
}

_SHARED_BASE = "the policies share one base model"
_DECODE = "every policy's rows are sampled in one batched decode"
_LOOP = "every policy's rows go through the same update loop: the same epochs, mini-batches and micro-batches"
_PASSES = "every policy's rows are scored in the same packed passes"
_RUN = "the sweep runs its policies as one run"

# Why each other field is one setting for the whole sweep (a field missing here gets a generic reason).
SHARED_FIELDS: dict[str, str] = {
    "output_dir": "each policy writes to OUTPUT_DIR/<its name>, set by the sweep",
    "policy_adapter_name": "each policy's adapter is named after its member, set by the sweep",
    "threads": "one process computes every policy's rows",
    "cpu_allocator": "one process holds every policy's tensors in its C heap",
    "model_name_or_path": _SHARED_BASE,
    "quantization": _SHARED_BASE,
    "bf16": _SHARED_BASE + " in one compute dtype",
    "fp16": _SHARED_BASE + " in one compute dtype",
    "reward_adapter": "every reward source scores every policy's rows in shared passes",
    "policy_adapter": "every policy starts as a fresh LoRA of the same shape on the one base",
    "reference": "every policy's reference is built the same way on the one base",
    "lora_r": "every policy's LoRA is created with one shape (per-policy shapes are not supported yet)",
    "lora_alpha": "every policy's LoRA is created with one shape (per-policy shapes are not supported yet)",
    "lora_target_modules": "every policy's LoRA is created with one shape (per-policy shapes are not "
    "supported yet)",
    "share_prompt_prefix": _PASSES,
    "gradient_checkpointing": _LOOP,
    "parallelism": "a sweep runs in one process",
    "rloo_k": _DECODE + " with k completions per prompt (the groups of the advantages)",
    "algorithm": "a preset sets the PPO epochs and the shared update loop with them; sweep its fields "
    "(kl_coef, loss_type, cliprange, ...) instead",
    "per_device_train_batch_size": _LOOP,
    "gradient_accumulation_steps": _LOOP,
    "num_mini_batches": _LOOP,
    "num_ppo_epochs": _LOOP,
    "total_episodes": _RUN + ": every update trains every policy",
    "num_train_epochs": _RUN + ": every update trains every policy",
    "local_rollout_forward_batch_size": _DECODE + " and the same scoring passes, chunked alike",
    "temperature": _DECODE + " and scored at one temperature",
    "sampler": _DECODE,
    "graph_capture": _DECODE,
    "response_length": _DECODE,
    "stop_token": _DECODE,
    "stop_token_id": _DECODE,
    "max_tool_calling_iterations": "a sweep trains without tools",
    "token_level_kl": "it is the older spelling of kl_placement: sweep kl_placement",
    "logging_steps": _RUN + ", logged together so that the policies' curves line up",
    "report_to": _RUN,
    "num_sample_generations": _RUN,
    "save_steps": _RUN + ": every checkpoint holds every policy at the same update (for resuming)",
    "fit": _RUN + ": the settings it chooses are the loop's, the same for every policy",
    "fit_memory_gb": _RUN,
    "save_minutes": _RUN + ": every checkpoint holds every policy at the same update (for resuming)",
    "save_total_limit": _RUN,
    **dict.fromkeys(
        (
            "vllm_importance_sampling_correction",
            "vllm_importance_sampling_mode",
            "vllm_importance_sampling_clip_max",
            "vllm_importance_sampling_clip_min",
        ),
        "the sampler correction is one setting for the whole sweep (not varied per policy yet)",
    ),
}

# TRL's names of sweepable settings that marl names otherwise.
TRL_NAMES = {"beta": "kl_coef", "epsilon": "cliprange", "num_generations": "rloo_k"}
_NAME_TEXT = re.compile(r"^[A-Za-z0-9_.+:-]+$")


@dataclasses.dataclass(frozen=True)
class SweepMember:
    """One policy of a sweep: ``name`` (readable, folder-safe and unique: ``FIELD=VALUE`` per ``--sweep``
    flag, comma-separated) and its ``config`` (the base config with the member's values, ``output_dir`` =
    the base ``output_dir`` / ``name``, and ``policy_adapter_name`` the base's name followed by ``name`` with
    every character other than letters, digits, ``_`` and ``-`` replaced by ``_``, since an adapter name
    becomes part of the model's module names)."""

    name: str
    config: RLOOConfig


def parse_sweep(specs: Sequence[str], config: RLOOConfig) -> list[SweepMember]:
    """The members of the grid ``specs`` (each ``FIELD=V1,V2,...``) over ``config``, in product order.

    Refused with a one-line :class:`marl.errors.ConfigError` naming the field, why and the fix: a malformed
    spec, an unknown field, a field that cannot differ between policies (:data:`SWEEPABLE_FIELDS`), a field
    given twice, a value repeated in its list, a value its field's type cannot take, and a member whose
    settings the config refuses.

    Example:
        >>> from marl.config import RLOOConfig
        >>> [member.config.seed for member in parse_sweep(["seed=1,2,3"], RLOOConfig())]
        [1, 2, 3]
        >>> parse_sweep(["learning_rate"], RLOOConfig())
        Traceback (most recent call last):
        ...
        marl.errors.ConfigError: --sweep 'learning_rate' is not FIELD=V1,V2,...: write e.g. --sweep \
learning_rate=1e-4,3e-4
    """
    if not specs:
        raise ConfigError("no --sweep given: pass --sweep FIELD=V1,V2 (e.g. --sweep learning_rate=1e-4,3e-4)")
    hints = typing.get_type_hints(RLOOConfig)
    axes: list[tuple[str, list[tuple[str, Any]]]] = []
    for spec in specs:
        field, texts = _split(spec)
        if field in (name for name, _ in axes):
            raise ConfigError(
                f"--sweep {field} is given twice: put all its values in one flag, --sweep {field}=V1,V2,..."
            )
        _check_sweepable(field, hints)  # before the values: a path is no folder name, but that is not why
        _check_folder_names(field, texts)
        values = [(text, parse_value(field, text, hints[field])) for text in texts]
        repeated = sorted({text for text, value in values if [v for _, v in values].count(value) > 1})
        if repeated:
            raise ConfigError(
                f"--sweep {field}: the value(s) {repeated} appear more than once, which would train the same "
                f"policy twice; give each value once (to repeat a setting with other randomness, add --sweep "
                "seed=...)"
            )
        axes.append((field, values))
    members = []
    for combination in itertools.product(*(values for _, values in axes)):
        overrides = {field: value for (field, _), (_, value) in zip(axes, combination, strict=True)}
        name = ",".join(f"{field}={text}" for (field, _), (text, _) in zip(axes, combination, strict=True))
        members.append(SweepMember(name, member_config(config, name, overrides)))
    policies = [member.config.policy_adapter_name for member in members]
    if len(set(policies)) < len(policies):
        raise ConfigError(
            f"--sweep: two members get the same policy adapter name among {policies}; write the values "
            "apart by more than punctuation"
        )
    return members


def member_config(config: RLOOConfig, name: str, overrides: dict[str, Any]) -> RLOOConfig:
    """``config`` with ``overrides``, writing to ``output_dir/name`` with the policy named after ``name``; a
    combination the config refuses is refused naming the member.

    Example:
        >>> from marl.config import RLOOConfig
        >>> member_config(RLOOConfig(output_dir="o"), "kl_coef=0.1", {"kl_coef": 0.1}).output_dir
        'o/kl_coef=0.1'
    """
    if "kl_placement" in overrides:  # token_level_kl is the older spelling of kl_placement and follows it
        overrides = {**overrides, "token_level_kl": overrides["kl_placement"] == "loss"}
    try:
        return dataclasses.replace(
            config,
            **overrides,
            output_dir=str(Path(config.output_dir) / name),
            policy_adapter_name=f"{config.policy_adapter_name}-{re.sub(r'[^A-Za-z0-9_-]', '_', name)}",
        )
    except ConfigError as error:
        raise ConfigError(f"--sweep member {name}: {error}") from None


def _split(spec: str) -> tuple[str, list[str]]:
    field, equals, values = spec.partition("=")
    field = field.strip().removeprefix("--")
    texts = [text.strip() for text in values.split(",")]
    if not equals or not field or not all(texts):
        raise ConfigError(
            f"--sweep {spec!r} is not FIELD=V1,V2,...: write e.g. --sweep learning_rate=1e-4,3e-4"
        )
    return field, texts


def _check_folder_names(field: str, texts: list[str]) -> None:
    bad = [text for text in texts if not _NAME_TEXT.match(text)]
    if bad:
        raise ConfigError(
            f"--sweep {field}: the value(s) {bad} have characters a folder name cannot safely hold; use "
            "letters, digits and . _ + - : (':' separates the items of a list value)"
        )


def _check_sweepable(field: str, hints: dict[str, Any]) -> None:
    if field in SWEEPABLE_FIELDS:
        return
    if field not in hints:
        close = (
            [TRL_NAMES[field]] if field in TRL_NAMES else difflib.get_close_matches(field, list(hints), n=1)
        )
        hint = f"did you mean {close[0]}? " if close else ""
        raise ConfigError(
            f"--sweep {field}: no such setting; {hint}fields a sweep may vary: {', '.join(SWEEPABLE_FIELDS)}"
        )
    why = SHARED_FIELDS.get(field, "the shared passes read it")
    raise ConfigError(
        f"--sweep {field}: cannot differ between the policies of a sweep: {why}. Set --{field} once for "
        "the whole sweep, or run a separate sweep per value"
    )


def parse_value(field: str, text: str, hint: Any) -> Any:
    """``text`` as a value of a field annotated ``hint``.

    Example:
        >>> parse_value("reward_weights", "1:0.5", list[float] | None)
        [1.0, 0.5]
        >>> parse_value("normalize_advantage", "true", bool)
        True
        >>> parse_value("epsilon_high", "none", float | None) is None
        True
        >>> parse_value("learning_rate", "fast", float)
        Traceback (most recent call last):
        ...
        marl.errors.ConfigError: --sweep learning_rate: 'fast' is not a number; write e.g. \
--sweep learning_rate=1e-4,3e-4
    """
    options = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)
    if type(None) in options and text.lower() == "none":
        return None
    (kind,) = [option for option in options if option is not type(None)]
    if typing.get_origin(kind) is list:
        (item,) = typing.get_args(kind)
        return [parse_value(field, part, item) for part in text.split(":")]
    try:
        if kind is bool:
            if text.lower() not in ("true", "false", "1", "0", "yes", "no"):
                raise ValueError(text)
            return text.lower() in ("true", "1", "yes")
        return kind(text)
    except ValueError:
        described = {bool: "true or false", int: "an integer", float: "a number"}.get(kind, str(kind))
        example = {
            "learning_rate": "1e-4,3e-4", "seed": "1,2", "reward_weights": "1:0.5,1:1",
        }.get(field, "V1,V2")  # fmt: skip
        raise ConfigError(
            f"--sweep {field}: {text!r} is not {described}; write e.g. --sweep {field}={example}"
        ) from None
