"""``--algorithm``: presets of the estimator, the loss and their defaults, as TRL's trainers and the papers
define them, overridable field by field.

Every field a preset sets defaults to ``None`` ("unset") in :class:`marl.RLOOConfig`; a value given on the
command line, in the ``--config`` YAML file or in Python is therefore told apart from a default, and wins.
:func:`resolve_algorithm` (run when the config is built) fills every unset field from the preset, then the
defaults that follow from the loss: ``importance_sampling_level="token"`` and ``use_bias_correction_kl=True``
(TRL 1.16's defaults) for a token-level loss. After that the config holds concrete values, which
``dataclasses.replace(config, algorithm=...)`` keeps as given: build a new config to switch presets.
``scale_rewards`` is taken from a preset only with that preset's own estimator.

=============  ==============  ===========  ==================================================================
algorithm      estimator       loss_type    other settings (TRL field names where TRL has the setting)
=============  ==============  ===========  ==================================================================
rloo           rloo            sequence     kl_placement=reward, kl_coef=0.05, cliprange=0.2,
                                            num_ppo_epochs=4, response_length=53 (TRL v0.21 RLOOConfig's)
grpo           grpo            dapo         scale_rewards=group, kl_placement=loss, kl_coef=0 (beta),
                                            cliprange=0.2, num_ppo_epochs=1, response_length=512
                                            (max_completion_length) (TRL 1.16 GRPOConfig's defaults)
dr_grpo        grpo            dr_grpo      scale_rewards=none, otherwise as grpo
dapo           grpo            dapo         epsilon_high=0.28, mask_truncated_completions=true, else as grpo
gspo           grpo            grpo         importance_sampling_level=sequence, cliprange=3e-4,
                                            epsilon_high=4e-4, otherwise as grpo
reinforce_pp   reinforce_pp    bnpo         kl_placement=reward, kl_coef=0.01, cliprange=0.2,
                                            num_ppo_epochs=1, response_length=53
=============  ==============  ===========  ==================================================================

Example:
    >>> from types import SimpleNamespace
    >>> unset = {name: None for name in PRESET_FIELDS}
    >>> settings = SimpleNamespace(**unset, algorithm="dapo", token_level_kl=False)
    >>> settings.epsilon_high = 0.3  # given: wins over the preset's 0.28
    >>> resolve_algorithm(settings)
    >>> settings.loss_type, settings.epsilon_high, settings.mask_truncated_completions, settings.kl_coef
    ('dapo', 0.3, True, 0.0)
"""

from __future__ import annotations

from dataclasses import field
from typing import Any

from marl.errors import ConfigError

SEQUENCE_LOSS = "sequence"
KL_PLACEMENTS = ("reward", "loss")
# Completion lengths: TRL 1.16's GRPOConfig max_completion_length for the GRPO family; TRL v0.11-v0.21
# RLOOConfig's response_length for the presets that follow that trainer.
GRPO_RESPONSE_LENGTH = 512
RLOO_RESPONSE_LENGTH = 53

_GRPO = dict(
    advantage_estimator="grpo",
    scale_rewards="group",
    loss_type="dapo",
    kl_placement="loss",
    kl_coef=0.0,
    cliprange=0.2,
    num_ppo_epochs=1,
    mask_truncated_completions=False,
    response_length=GRPO_RESPONSE_LENGTH,
)
PRESETS: dict[str, dict[str, Any]] = {
    "rloo": dict(
        advantage_estimator="rloo",
        loss_type=SEQUENCE_LOSS,
        kl_placement="reward",
        kl_coef=0.05,
        cliprange=0.2,
        num_ppo_epochs=4,
        mask_truncated_completions=False,
        response_length=RLOO_RESPONSE_LENGTH,
    ),
    "grpo": _GRPO,
    "dr_grpo": _GRPO | dict(loss_type="dr_grpo", scale_rewards="none"),
    "dapo": _GRPO | dict(epsilon_high=0.28, mask_truncated_completions=True),
    "gspo": _GRPO
    | dict(loss_type="grpo", importance_sampling_level="sequence", cliprange=3e-4, epsilon_high=4e-4),
    "reinforce_pp": dict(
        advantage_estimator="reinforce_pp",
        loss_type="bnpo",
        kl_placement="reward",
        kl_coef=0.01,
        cliprange=0.2,
        num_ppo_epochs=1,
        mask_truncated_completions=False,
        response_length=RLOO_RESPONSE_LENGTH,
    ),
}

HELP = {
    "algorithm": f"Preset of estimator, loss and defaults: one of {', '.join(PRESETS)} "
    "(marl.config.algorithms); every field it sets can be given explicitly and then wins.",
    "advantage_estimator": "Advantage estimator by its registered name (marl.algo.advantages): 'rloo' "
    "(leave-one-out), 'grpo' (group mean, --scale_rewards), 'reinforce_pp' (batch mean and std). "
    "Default: from --algorithm.",
    "scale_rewards": "GRPO's advantage scale: 'group' (std of the prompt's completions), 'batch' (std of the "
    "whole batch) or 'none' (TRL's scale_rewards). Default: from --algorithm.",
    "loss_type": "Policy loss: 'sequence' (TRL v0.21 RLOO's clipped sequence ratio) or TRL 1.x's token-level "
    "'grpo', 'bnpo', 'dr_grpo', 'dapo' (TRL's loss_type). Default: from --algorithm.",
    "cliprange": "Lower clip range ε of the ratio (TRL's epsilon). Default: from --algorithm.",
    "epsilon_high": "Upper clip range (TRL's epsilon_high, DAPO's clip-higher); unset: --cliprange. "
    "Default: from --algorithm.",
    "importance_sampling_level": "Ratio of a token-level loss: 'token', or 'sequence' (GSPO: the mean "
    "per-token log-ratio of the completion). Default: 'token' (gspo: 'sequence').",
    "mask_truncated_completions": "Leave completions without the stop token out of the loss (TRL's "
    "mask_truncated_completions; needs a stop token). Default: from --algorithm.",
    "kl_coef": "Weight of the KL penalty against the reference (TRL's beta). Default: from --algorithm.",
    "kl_placement": "'reward': the sequence KL is folded into the reward (RLOO); 'loss': the per-token k3 KL "
    "is added to the loss (TRL GRPO's beta term). Default: from --algorithm.",
    "use_bias_correction_kl": "Multiply the k3 KL term of a token-level loss by the importance ratio (TRL's "
    "use_bias_correction_kl). Default: true with a token-level loss.",
    "num_ppo_epochs": "Passes over each rollout (TRL's num_iterations); 1 epoch and 1 mini-batch is plain "
    "REINFORCE. Default: from --algorithm.",
    "response_length": "Maximum new tokens per completion (TRL's max_completion_length). Default: from "
    f"--algorithm: {GRPO_RESPONSE_LENGTH} for the GRPO family (TRL 1.16's GRPOConfig), "
    f"{RLOO_RESPONSE_LENGTH} for rloo and reinforce_pp (TRL v0.21's RLOOConfig).",
}
PRESET_FIELDS = tuple(name for name in HELP if name != "algorithm")


def algorithm_field(name: str) -> Any:
    """The ``RLOOConfig`` field ``name`` of the algorithm settings: unset (``None``) unless it is
    ``algorithm``, with its help text."""
    return field(default="rloo" if name == "algorithm" else None, metadata={"help": HELP[name]})


def resolve_algorithm(settings: Any) -> None:
    """Fill ``settings``' unset algorithm fields from the ``--algorithm`` preset, then those that follow from
    the loss; ``token_level_kl=True`` (the older flag) means ``kl_placement="loss"``. See the module
    docstring."""
    if settings.algorithm not in PRESETS:
        raise ConfigError(
            f"--algorithm {settings.algorithm!r} is not a preset; pass one of {list(PRESETS)}, or set "
            "--advantage_estimator and --loss_type yourself under --algorithm rloo"
        )
    if settings.token_level_kl:
        if settings.kl_placement == "reward":
            raise ConfigError(
                "token_level_kl=true puts the KL in the loss but kl_placement='reward' folds it into the "
                "reward. Drop --token_level_kl (it means --kl_placement loss)"
            )
        settings.kl_placement = "loss"
    preset = PRESETS[settings.algorithm]
    own_estimator = settings.advantage_estimator in (None, preset["advantage_estimator"])
    for name in PRESET_FIELDS:
        if getattr(settings, name) is None and (name != "scale_rewards" or own_estimator):
            setattr(settings, name, preset.get(name))
    if settings.loss_type != SEQUENCE_LOSS:
        if settings.importance_sampling_level is None:
            settings.importance_sampling_level = "token"
        if settings.use_bias_correction_kl is None:
            settings.use_bias_correction_kl = True
    settings.token_level_kl = settings.kl_placement == "loss"


def check_algorithm_settings(settings: Any) -> None:
    """Refuse settings that cannot hold whatever the loss (names of losses and estimators are checked by
    :func:`marl.train.training_parts.check_components`).

    Example:
        >>> from types import SimpleNamespace
        >>> check_algorithm_settings(SimpleNamespace(kl_placement="prompt", kl_coef=0.0, cliprange=0.2,
        ...                                          epsilon_high=None))
        Traceback (most recent call last):
        ...
        marl.errors.ConfigError: --kl_placement 'prompt' is not one of ('reward', 'loss'). Use ...
    """
    if settings.kl_placement not in KL_PLACEMENTS:
        raise ConfigError(
            f"--kl_placement {settings.kl_placement!r} is not one of {KL_PLACEMENTS}. Use --kl_placement "
            "reward (KL folded into the reward) or --kl_placement loss (k3 term in the loss)"
        )
    if settings.kl_coef < 0:
        raise ConfigError(f"kl_coef={settings.kl_coef} must be >= 0. Set --kl_coef 0 to train without KL")
    if settings.cliprange <= 0:
        raise ConfigError(f"cliprange={settings.cliprange} must be > 0. Use e.g. --cliprange 0.2")
    if not getattr(settings, "advantage_epsilon", 1.0) > 0:
        raise ConfigError(f"advantage_epsilon={settings.advantage_epsilon} must be > 0. Use e.g. 1e-4")
    if settings.epsilon_high is not None and settings.epsilon_high <= 0:
        raise ConfigError(
            f"epsilon_high={settings.epsilon_high} must be > 0. Leave it unset for --cliprange's value"
        )
