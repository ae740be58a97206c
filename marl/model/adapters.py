"""Adapters on the one base: their names, their folders on disk, the checks that keep the shared base fixed,
and the records of the adapters a loaded model carries.

Names: policies and reward adapters share one namespace on the base. ``reference`` names the view of a
policy's reference, and the frozen copy of policy ``P``'s starting weights (when it is its reference) is the
adapter ``P-reference``; neither can be used as a name. Unnamed reward adapters are named by
:func:`marl.config.model.name_reward_adapters`.

Folders: a PEFT adapter folder holds ``adapter_config.json`` and ``adapter_model.safetensors``. A reward
adapter (``task_type: SEQ_CLS``, as TRL's ``RewardTrainer`` writes it) also holds its score head through
``modules_to_save``, and adapters made by ``marl train-reward`` record where their score is read in
:data:`REWARD_READING_FILE`. Everything here runs before (or without) the base model: a bad folder fails
before any weights are loaded.

Example:
    >>> check_keeps_base_fixed({"bias": "none", "init_lora_weights": True}, "policy adapter")
    >>> check_adapter_name("policy-reference", [], "policy")
    Traceback (most recent call last):
    ...
    marl.errors.ConfigError: policy name 'policy-reference' is reserved: ...
"""

from __future__ import annotations

import copy
import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

# the default policy's name, beside the names reserved here
from marl.config.model import DEFAULT_POLICY as DEFAULT_POLICY
from marl.config.model import name_reward_adapters
from marl.errors import AdapterError, ConfigError, MissingPathError

if TYPE_CHECKING:
    import torch
    from peft import LoraConfig, PeftModel
    from torch import nn

ADAPTER_CONFIG_NAME = "adapter_config.json"
SAFETENSORS_WEIGHTS_NAME = "adapter_model.safetensors"
PICKLE_WEIGHTS_NAME = "adapter_model.bin"
# Where a reward adapter made by marl records the padding id its training used, i.e. where its score is read.
REWARD_READING_FILE = "marl_reward.json"

# LoRA initialisations that rewrite the base weights they attach to (PEFT's PiSSA, OLoRA, CorDA, LoftQ,
# LoRA-GA). On a shared base that would change the reward and the reference too.
_BASE_REWRITING_INITS = ("pissa", "olora", "corda", "loftq", "lora_ga")

# Score-head keys written by PEFT for a SEQ_CLS adapter (modules_to_save): the head is ``score`` (Llama,
# Qwen2, GPT-NeoX, Mistral, ...) or ``classifier``; some PEFT versions keep the ``modules_to_save.<adapter>``
# infix.
_HEAD_KEY = re.compile(
    r"^base_model\.model\.(?P<head>score|classifier)(?:\.modules_to_save\.[^.]+)?\.(?P<part>weight|bias)$"
)
_LORA_KEY = re.compile(
    r"^base_model\.model\.(?P<module>.+)\.(?P<part>lora_A|lora_B|lora_embedding_A|lora_embedding_B)\.weight$"
)


# Where an adapter folder of each role comes from: the hint of an error about a folder that is not one.
_WRITTEN_BY = {
    "reward": "pass the folder that `marl train-reward` (or TRL's RewardTrainer with a LoRA peft_config, "
    "task_type='SEQ_CLS') wrote",
    "policy": "pass the folder that `marl train-rloo` wrote (its --output_dir) or another PEFT causal-LM "
    "LoRA folder (save_pretrained)",
}


def read_adapter_config(directory: Path, *, role: str) -> dict[str, Any]:
    """The parsed ``adapter_config.json`` of a LoRA adapter folder, or an error naming what is wrong.

    Example:
        >>> read_adapter_config(Path("/nonexistent"), role="reward")
        Traceback (most recent call last):
        ...
        marl.errors.MissingPathError: reward adapter folder /nonexistent does not exist; ...
    """
    if not directory.exists():
        raise MissingPathError(f"{role} adapter folder {directory} does not exist; {_WRITTEN_BY[role]}")
    if not directory.is_dir():
        raise AdapterError(f"{role} adapter {directory} is a file; pass the adapter's folder instead")
    config_file = directory / ADAPTER_CONFIG_NAME
    if not config_file.is_file():
        raise AdapterError(
            f"{directory} is not a PEFT adapter (it has no {ADAPTER_CONFIG_NAME}); {_WRITTEN_BY[role]}"
        )
    config = _read_json(config_file, what=f"the {role} adapter's configuration")
    if config.get("peft_type") != "LORA":
        raise AdapterError(
            f"{role} adapter {directory} is a {config.get('peft_type')!r} adapter ({config_file}); only LoRA "
            "adapters are supported"
        )
    return config


def adapter_weights_file(directory: Path, *, allow_pickle: bool, role: str) -> Path:
    """The weights file of an adapter folder: safetensors, or a pickle only when ``allow_pickle``."""
    safetensors_file = directory / SAFETENSORS_WEIGHTS_NAME
    if safetensors_file.is_file():
        return safetensors_file
    pickle_file = directory / PICKLE_WEIGHTS_NAME
    if pickle_file.is_file():
        if not allow_pickle:
            raise AdapterError(
                f"{role} adapter {directory} only has pickled weights ({PICKLE_WEIGHTS_NAME}); loading a "
                "pickle can run arbitrary code. Re-save it as safetensors, or pass allow_pickle=True if you "
                "trust its source"
            )
        return pickle_file
    raise AdapterError(
        f"{role} adapter {directory} has {ADAPTER_CONFIG_NAME} but no weights ({SAFETENSORS_WEIGHTS_NAME}); "
        "the save did not finish or the folder was copied partially"
    )


def load_adapter_state(weights_file: Path) -> dict[str, torch.Tensor]:
    """The tensors of an adapter folder's weights file (:func:`adapter_weights_file`: found, and a pickle only
    where allowed), on CPU, read by PEFT's own ``load_peft_weights``; a damaged file is named in the error."""
    from peft import load_peft_weights

    try:
        # the folder holds this file (checked): PEFT reads it and never looks for one on a hub
        return load_peft_weights(str(weights_file.parent), device="cpu")
    except Exception as error:
        raise AdapterError(
            f"cannot read the adapter weights {weights_file} ({type(error).__name__}: {error}); the file is "
            "damaged or incomplete: save the adapter again"
        ) from error


@dataclass(frozen=True)
class AdapterFolder:
    """An adapter folder read once, before the base loads: its configuration, its tensors and (for a reward
    adapter made by ``marl train-reward``) the padding id its score is read after. Everything that attaching
    the adapter needs comes from here, so the folder is never opened a second time."""

    directory: Path
    role: str
    config: dict[str, Any]
    state: dict[str, torch.Tensor]
    pad_token_id: int | None = None

    def lora_config(self) -> LoraConfig:
        """The folder's ``adapter_config.json`` as a ``peft.LoraConfig`` (what ``LoraConfig.from_pretrained``
        builds, from the configuration already read)."""
        from peft import LoraConfig

        settings = {key: value for key, value in self.config.items() if key != "runtime_config"}
        try:
            return LoraConfig.from_peft_type(**LoraConfig.check_kwargs(**settings))
        except Exception as error:
            raise AdapterError(
                f"{self.role} adapter {self.directory}: {ADAPTER_CONFIG_NAME} is not a LoRA configuration "
                f"this peft version reads ({type(error).__name__}: {error})"
            ) from error


def read_adapter_folder(directory: str | os.PathLike, *, allow_pickle: bool, role: str) -> AdapterFolder:
    """Read an adapter folder of ``role`` (``"policy"`` or ``"reward"``) once: its configuration, its weights
    and, for a reward adapter, its reading record (:data:`REWARD_READING_FILE`).

    Example:
        >>> read_adapter_folder("/nonexistent", allow_pickle=False, role="policy")
        Traceback (most recent call last):
        ...
        marl.errors.MissingPathError: policy adapter folder /nonexistent does not exist; ...
    """
    directory = Path(directory)
    config = read_adapter_config(directory, role=role)
    state = load_adapter_state(adapter_weights_file(directory, allow_pickle=allow_pickle, role=role))
    pad_token_id = read_reward_pad_token_id(directory) if role == "reward" else None
    return AdapterFolder(directory, role, config, state, pad_token_id)


def read_policy_folder(
    directory: str | os.PathLike, *, allow_pickle: bool, flag: str, remedy: str
) -> AdapterFolder:
    """Read the causal-LM policy adapter folder given by ``flag`` (once), and refuse a reward
    (sequence-classification) adapter, with ``remedy`` as the fix, and settings that would move the shared
    base."""
    folder = read_adapter_folder(directory, allow_pickle=allow_pickle, role="policy")
    if str(folder.config.get("task_type")) == "SEQ_CLS":
        raise AdapterError(
            f"{flag} {folder.directory} is a sequence-classification (reward) adapter: {remedy}"
        )
    check_keeps_base_fixed(folder.config, f"policy adapter {folder.directory}")
    return folder


def check_keeps_base_fixed(config: dict[str, Any], role: str) -> None:
    """Refuse adapter settings that would train or rewrite the base that every view shares.

    ``bias="all"`` or ``"lora_only"`` trains (and saves) the base layers' biases; PiSSA, OLoRA, CorDA, LoftQ
    and LoRA-GA initialisations rewrite the base weights; layer replication changes the base's structure. On
    one shared base each of these would move the reward and the reference along with the policy.

    Example:
        >>> check_keeps_base_fixed({"bias": "all"}, "policy LoraConfig")
        Traceback (most recent call last):
        ...
        marl.errors.AdapterError: policy LoraConfig has bias='all': it trains the base model's bias terms, ...
    """
    bias = config.get("bias", "none")
    if bias not in (None, "none"):
        raise AdapterError(
            f"{role} has bias={bias!r}: it trains the base model's bias terms, which the reward and the "
            "reference share with the policy. Use bias='none' (or lora_bias=True for a bias inside the "
            "adapter)"
        )
    init = config.get("init_lora_weights", True)
    if isinstance(init, str) and init.startswith(_BASE_REWRITING_INITS):
        raise AdapterError(
            f"{role} has init_lora_weights={init!r}, an initialisation that rewrites the base weights, which "
            "the reward and the reference share. Use the default initialisation, or convert the adapter to "
            "a plain LoRA first (PEFT's save_pretrained(..., path_initial_model_for_weight_conversion=...))"
        )
    if config.get("layer_replication"):
        raise AdapterError(
            f"{role} uses layer_replication, which changes the shared base's layers; remove it for marl"
        )


@dataclass(frozen=True)
class RewardHead:
    """A reward adapter's score head, reduced to one score per sequence, and where that score is read.

    ``weight`` is ``[1, hidden]`` (a 2-label head becomes its log-odds ``w1 − w0``, ``b1 − b0``);
    ``pad_token_id``
    is the padding id the adapter's training used, ``None`` when the folder does not record it (the caller
    then
    uses the base tokenizer's, as transformers and TRL do).
    """

    weight: torch.Tensor
    bias: torch.Tensor | None
    key: str
    num_labels: int
    pad_token_id: int | None

    @property
    def has_bias(self) -> bool:
        return self.bias is not None


def read_reward_head(folder: AdapterFolder, hidden_size: int) -> RewardHead:
    """Find and check the score head among a reward adapter's tensors."""
    state, directory = folder.state, folder.directory
    head_tensors: dict[str, torch.Tensor] = {}
    head_keys: list[str] = []
    for key, tensor in state.items():
        match = _HEAD_KEY.match(key)
        if match:
            if match["part"] in head_tensors:
                raise AdapterError(
                    f"reward adapter {directory} has two score-head {match['part']}s: {[*head_keys, key]}"
                )
            head_tensors[match["part"]] = tensor
            head_keys.append(key)
    if "weight" not in head_tensors:
        raise AdapterError(
            f"reward adapter {directory} has no score head (no key like 'base_model.model.score.weight'). A "
            "reward adapter must be trained as a sequence classifier: LoraConfig(task_type='SEQ_CLS') saves "
            "the head through modules_to_save"
        )
    weight = head_tensors["weight"].float()
    if weight.dim() != 2 or weight.shape[1] != hidden_size:
        raise AdapterError(
            f"reward adapter {directory}: score head has shape {tuple(weight.shape)} but this base has "
            f"hidden size {hidden_size}; the adapter was trained on a different base model. Load it with the "
            "base it was trained on"
        )
    num_labels = weight.shape[0]
    if num_labels not in (1, 2):
        raise AdapterError(
            f"reward adapter {directory}: score head has {num_labels} labels; a reward model has 1 (or 2, "
            "read as the log-odds of the second label over the first)"
        )
    bias = head_tensors.get("bias")
    bias = None if bias is None else bias.float().reshape(-1)
    if num_labels == 2:
        # The log-odds of "preferred" (label 1) over label 0: what a softmax over the two labels compares.
        weight = weight[1:] - weight[:1]
        bias = None if bias is None else bias[1:] - bias[:1]
    return RewardHead(
        weight=weight,
        bias=bias,
        key=head_keys[0],
        num_labels=num_labels,
        pad_token_id=folder.pad_token_id,
    )


def lora_tensors(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """An adapter's tensors without its score head."""
    return {key: tensor for key, tensor in state.items() if not _HEAD_KEY.match(key)}


def write_reward_reading(directory: Path, pad_token_id: int, pad_token: str | None) -> None:
    """Record in a reward adapter folder the padding id its training used: its score is read at the last token
    that is not that id (the rule of transformers' sequence classifiers)."""
    record = {
        "pad_token_id": int(pad_token_id),
        "pad_token": pad_token,
        "score_read_at": "the last token that is not pad_token_id (transformers' sequence classifiers)",
    }
    (directory / REWARD_READING_FILE).write_text(json.dumps(record, indent=2) + "\n")


def read_reward_pad_token_id(directory: Path) -> int | None:
    """The padding id recorded by :func:`write_reward_reading`, or ``None`` when the folder has no record."""
    record_file = directory / REWARD_READING_FILE
    if not record_file.is_file():
        return None
    record = _read_json(record_file, what="the reward adapter's reading record")
    pad_token_id = record.get("pad_token_id")
    if not isinstance(pad_token_id, int) or isinstance(pad_token_id, bool):
        raise AdapterError(f"{record_file} has no integer 'pad_token_id'; fix or delete the file")
    return pad_token_id


def check_lora_targets(base: Any, lora_state: dict[str, torch.Tensor], directory: Path, *, role: str) -> None:
    """Every LoRA tensor must land on an existing layer of this base with matching in/out features."""
    modules = dict(base.named_modules())
    missing: list[str] = []
    for key, tensor in lora_state.items():
        match = _LORA_KEY.match(key)
        if match is None:
            continue
        module = modules.get(match["module"])
        if module is None:
            missing.append(match["module"])
            continue
        in_features = getattr(module, "in_features", None)
        out_features = getattr(module, "out_features", None)
        if match["part"] == "lora_A" and in_features is not None and tensor.shape[1] != in_features:
            raise AdapterError(
                f"{role} adapter {directory}: {key} expects {tensor.shape[1]} input features but "
                f"{match['module']} has {in_features}; the adapter was trained on a different base model"
            )
        if match["part"] == "lora_B" and out_features is not None and tensor.shape[0] != out_features:
            raise AdapterError(
                f"{role} adapter {directory}: {key} expects {tensor.shape[0]} output features but "
                f"{match['module']} has {out_features}; the adapter was trained on a different base model"
            )
    if missing:
        raise AdapterError(
            f"{role} adapter {directory} targets modules that do not exist in this base: "
            f"{sorted(set(missing))[:5]}; it was trained on a different architecture. Load it with the base "
            "it was trained on"
        )


def check_target_modules(model: Any, target_modules: Any, flag: str) -> None:
    """Every name in ``target_modules`` must name layers of ``model``, as PEFT matches them (the full module
    name or a dotted suffix of it). ``None`` (PEFT's default for the architecture), ``all-linear`` and PEFT's
    regular-expression strings are left to PEFT."""
    from torch import nn

    if target_modules is None or isinstance(target_modules, str):
        return
    names = [name for name, _ in model.named_modules()]
    missing = sorted(
        target for target in target_modules if not any(n == target or n.endswith(f".{target}") for n in names)
    )
    if missing:
        linear = sorted(
            {
                name.rsplit(".", 1)[-1]
                for name, module in model.named_modules()
                if isinstance(module, nn.Linear)
            }
        )
        raise AdapterError(
            f"{flag} {missing}: no such module in this base. Its linear layers are {linear}: pass some of "
            "those, or all-linear"
        )


def same_model(recorded: str, loaded: str) -> bool:
    """Whether the base an adapter records is the base it is loaded on (paths resolved, else names)."""
    if recorded == loaded:
        return True
    recorded_path, loaded_path = Path(recorded), Path(loaded)
    if recorded_path.exists() and loaded_path.exists():
        return recorded_path.resolve() == loaded_path.resolve()
    return recorded_path.name == loaded_path.name


def save_adapter(
    peft_model: PeftModel,
    adapter_name: str,
    directory: Path,
    base_name_or_path: str,
    state: dict[str, Any] | None = None,
) -> None:
    """Write one adapter of ``peft_model`` as a standard PEFT folder (config + safetensors), loadable with
    ``PeftModel.from_pretrained(base, directory)``. ``state``: its tensors when they were gathered already
    (a sharded model's), else read from ``peft_model``."""
    from peft.utils import get_peft_model_state_dict
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    config = copy.deepcopy(peft_model.peft_config[adapter_name])
    config.inference_mode = True
    config.base_model_name_or_path = base_name_or_path
    config.save_pretrained(str(directory))
    if state is None:
        state = get_peft_model_state_dict(peft_model, adapter_name=adapter_name)
    state = {key: tensor.detach().to("cpu").contiguous() for key, tensor in state.items()}
    # The weights last, and renamed into place: a folder with the weights file holds a complete adapter even
    # if the process is killed while saving (a run's output folder counts as finished by that file).
    staging = directory / f".{SAFETENSORS_WEIGHTS_NAME}.tmp"
    save_file(state, str(staging), metadata={"format": "pt"})
    os.replace(staging, directory / SAFETENSORS_WEIGHTS_NAME)


def _read_json(path: Path, *, what: str) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise AdapterError(
            f"cannot read {what} {path} ({type(error).__name__}: {error}); the file is damaged: restore or "
            "re-save it"
        ) from error
    if not isinstance(value, dict):
        raise AdapterError(f"{path} holds a {type(value).__name__}, not a JSON object; restore or re-save it")
    return value


# ------------------------------------------------------------------ names and records

REFERENCE_VIEW = "reference"
# The base with adapters disabled, whatever a policy's reference is; PEFT's own name for "no adapter", which
# no adapter may take (check_adapter_name).
BASE_VIEW = "__base__"
REFERENCE_SUFFIX = "-reference"
# PEFT stores adapters in module dictionaries (no dots) and uses "__base__" for "no adapter".
_ADAPTER_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_-]*$")


def reference_adapter_name(policy: str) -> str:
    """The adapter that holds policy ``policy``'s starting weights when they are its reference.

    Example:
        >>> reference_adapter_name("policy")
        'policy-reference'
    """
    return f"{policy}{REFERENCE_SUFFIX}"


@dataclass
class PolicyAdapter:
    """A trainable policy on the base: its LoRA tensors and how its reference is built (``"base"``: adapters
    disabled; ``"initial-policy"``: the frozen copy of its starting weights)."""

    name: str
    parameters: list[nn.Parameter]
    reference_mode: str

    @property
    def reference_adapter(self) -> str | None:
        return reference_adapter_name(self.name) if self.reference_mode == "initial-policy" else None


@dataclass
class RewardAdapter:
    """A frozen reward on the base: its LoRA (the adapter ``name``), its float32 score head, what was read
    from the head, and the padding id that decides where its score is read."""

    name: str
    head: nn.Linear
    info: RewardHead
    pad_token_id: int


def check_adapter_name(
    name: str, taken: list[str], role: str, reserved: Mapping[str, str] | None = None
) -> None:
    """Refuse a name that is not a plain identifier, is reserved (marl's own, or ``reserved``: name -> what
    takes it, e.g. another library's adapters), or is already used on this base (``taken``: its adapters)."""
    if not isinstance(name, str) or not _ADAPTER_NAME.match(name) or name == BASE_VIEW:
        raise ConfigError(
            f"{role} name {name!r} is not usable: use letters, digits, '_' and '-' (no dots or spaces)"
        )
    if name == REFERENCE_VIEW or name.endswith(REFERENCE_SUFFIX):
        raise ConfigError(
            f"{role} name {name!r} is reserved: 'reference' names a policy's reference view and '<policy>"
            f"{REFERENCE_SUFFIX}' its frozen starting copy. Choose another name"
        )
    if name in taken:
        raise ConfigError(
            f"{role} name {name!r} is already used on this base (adapters: {sorted(set(taken))}); choose "
            "another"
        )
    if reserved and name in reserved:
        raise ConfigError(f"{role} name {name!r} is reserved: {reserved[name]}. Choose another name")


def named_reward_adapters(
    reward_adapter: str | os.PathLike | None, reward_adapters: Mapping[str, str | os.PathLike] | None
) -> dict[str, str | os.PathLike]:
    """``reward_adapter=DIR`` is one unnamed reward adapter (named by
    :func:`marl.config.model.name_reward_adapters`); giving both is an error."""
    if reward_adapter is not None and reward_adapters:
        raise ConfigError("pass either reward_adapter=DIR or reward_adapters={name: DIR, ...}, not both")
    if reward_adapter is not None:
        return name_reward_adapters([(None, reward_adapter)])
    return dict(reward_adapters or {})
