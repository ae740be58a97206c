"""Building a :class:`~marl.model.multi_adapter.MultiAdapterModel`: one base, loaded once, and its named
adapters.

Every adapter folder is checked before the base is loaded (it is the slow part), and every adapter setting
that
would train or rewrite the shared base is refused then (:func:`marl.model.adapters.check_keeps_base_fixed`).
After
each adapter is attached, only the policies' own tensors are trainable, every dropout is off, and (once, after
loading) probes prove that the chunked log-prob head reproduces the model's forward and that train mode
computes what eval mode computes (:mod:`marl.model.families`).

Adapter names: policies and reward adapters share one namespace on the base. ``reference`` names the view of
a policy's reference, and the frozen copy of policy ``P``'s starting weights (when it is its reference) is the
adapter ``P-reference``; neither can be used as a name.
"""

from __future__ import annotations

import copy
import os
import re
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from peft.utils import get_peft_model_state_dict, set_peft_model_state_dict
from torch import nn
from transformers import AutoModelForCausalLM

from marl.errors import AdapterError, ConfigError, ModelError
from marl.model import adapters
from marl.model.adapters import REFERENCE_MODES
from marl.model.families import (
    check_logit_head,
    check_static_rotary,
    check_train_matches_eval,
    disable_dropout,
)
from marl.model.quantization import (
    bitsandbytes_config,
    default_compute_dtype,
    parse_quantization,
    prepare_quantized_base,
)

if TYPE_CHECKING:
    from marl.model.multi_adapter import MultiAdapterModel

REFERENCE_VIEW = "reference"
REFERENCE_SUFFIX = "-reference"
DEFAULT_POLICY = "policy"
DEFAULT_REWARD = "reward"
# PEFT stores adapters in module dictionaries (no dots) and uses "__base__" for "no adapter".
_ADAPTER_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_-]*$")

PolicySpec = LoraConfig | str | os.PathLike | None


def reference_adapter_name(policy: str) -> str:
    """The adapter that holds policy ``policy``'s starting weights when they are its reference.

    Example:
        >>> reference_adapter_name("policy")
        'policy-reference'
    """
    return f"{policy}{REFERENCE_SUFFIX}"


# Default policy LoRA. r=16 with alpha=32 (scale 2) on every linear layer of the blocks: RL fine-tuning
# moves far fewer bits than SFT (one scalar reward per completion), and low ranks are known to match full
# fine-tuning for policy-gradient RL, so r=16 leaves ample headroom while keeping the trainable state at
# ~0.5 % of a 7B model. alpha = 2r is the common QLoRA setting and keeps the learning rate transferable
# when r changes by small factors. Dropout is 0: RL training switches every dropout off anyway (the rollout
# and the update must compute the same function).
DEFAULT_LORA_R = 16
DEFAULT_LORA_ALPHA = 32
DEFAULT_LORA_DROPOUT = 0.0
DEFAULT_TARGET_MODULES = "all-linear"


def default_policy_lora_config() -> LoraConfig:
    """The LoRA used when ``policy_adapter=None``: r=16, alpha=32, no dropout, all linear layers of the
    blocks.

    Example:
        >>> default_policy_lora_config().r
        16
    """
    return LoraConfig(
        r=DEFAULT_LORA_R,
        lora_alpha=DEFAULT_LORA_ALPHA,
        lora_dropout=DEFAULT_LORA_DROPOUT,
        target_modules=DEFAULT_TARGET_MODULES,
        bias="none",
        task_type="CAUSAL_LM",
    )


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
    info: adapters.RewardHead
    pad_token_id: int


def check_adapter_name(name: str, taken: list[str], role: str) -> None:
    """Refuse a name that is not a plain identifier, is reserved, or is already used on this base."""
    if not isinstance(name, str) or not _ADAPTER_NAME.match(name) or name == "__base__":
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
            f"{role} name {name!r} is already used on this base (adapters: {taken}); choose another"
        )


@dataclass
class PolicySource:
    """A checked policy adapter to attach: a fresh ``LoraConfig`` or a saved adapter folder."""

    lora_config: LoraConfig | None
    directory: Path | None
    state: dict[str, torch.Tensor]

    @classmethod
    def check(cls, adapter: PolicySpec, allow_pickle: bool) -> PolicySource:
        if adapter is not None and not isinstance(adapter, (LoraConfig, str, os.PathLike)):
            raise TypeError(
                "policy_adapter must be None (fresh LoRA), a peft.LoraConfig, or a PEFT adapter folder; got "
                f"{type(adapter).__name__}"
            )
        if isinstance(adapter, (str, os.PathLike)):
            directory = Path(adapter)
            config = adapters.read_adapter_config(directory, role="policy")
            state = adapters.load_adapter_state(
                adapters.adapter_weights_file(directory, allow_pickle=allow_pickle, role="policy")
            )
            if str(config.get("task_type")) == "SEQ_CLS":
                raise AdapterError(
                    f"--policy_adapter {directory} is a sequence-classification (reward) adapter: pass "
                    f"it with --reward_adapter {directory}, and give --policy_adapter a causal-LM adapter, "
                    "or leave it out for a fresh LoRA"
                )
            adapters.check_keeps_base_fixed(config, f"policy adapter {directory}")
            return cls(None, directory, state)
        lora_config = copy.deepcopy(adapter) if adapter is not None else default_policy_lora_config()
        adapters.check_keeps_base_fixed(lora_config.to_dict(), "policy LoraConfig")
        lora_config.task_type = lora_config.task_type or "CAUSAL_LM"
        lora_config.inference_mode = False
        return cls(lora_config, None, {})

    @property
    def starts_as_identity(self) -> bool:
        """A fresh LoRA with zero-initialised B matrices computes exactly the base."""
        return self.lora_config is not None and self.lora_config.init_lora_weights in (True, "gaussian")


@dataclass
class RewardFolder:
    """A checked reward adapter folder: its configuration and tensors, read before the base loads."""

    directory: Path
    config: dict[str, Any]
    state: dict[str, torch.Tensor]

    @classmethod
    def check(cls, directory: str | os.PathLike, allow_pickle: bool) -> RewardFolder:
        directory = Path(directory)
        config = adapters.read_adapter_config(directory, role="reward")
        adapters.check_keeps_base_fixed(config, f"reward adapter {directory}")
        state = adapters.load_adapter_state(
            adapters.adapter_weights_file(directory, allow_pickle=allow_pickle, role="reward")
        )
        return cls(directory, config, state)


def named_reward_adapters(
    reward_adapter: str | os.PathLike | None, reward_adapters: Mapping[str, str | os.PathLike] | None
) -> dict[str, str | os.PathLike]:
    """``reward_adapter=DIR`` is ``reward_adapters={"reward": DIR}``; giving both is an error."""
    if reward_adapter is not None and reward_adapters:
        raise ConfigError("pass either reward_adapter=DIR or reward_adapters={name: DIR, ...}, not both")
    if reward_adapter is not None:
        return {DEFAULT_REWARD: reward_adapter}
    return dict(reward_adapters or {})


def load_multi_adapter_model(
    cls: type[MultiAdapterModel],
    model_name_or_path: str | os.PathLike,
    *,
    quantization: str | None,
    policy_adapter: PolicySpec,
    policy_name: str,
    reference: str,
    reward_adapters: dict[str, str | os.PathLike],
    dtype: torch.dtype | None,
    device_map: Any,
    gradient_checkpointing: bool,
    allow_pickle: bool,
    trust_remote_code: bool,
) -> MultiAdapterModel:
    """The body of :meth:`MultiAdapterModel.from_pretrained` (see there for the arguments)."""
    quantization = parse_quantization(quantization)
    if reference not in REFERENCE_MODES:
        raise ConfigError(f"reference must be one of {REFERENCE_MODES}, got {reference!r}")
    names: list[str] = []
    for name, role in [(policy_name, "policy"), *((name, "reward adapter") for name in reward_adapters)]:
        check_adapter_name(name, names, role)
        names.append(name)
    # Every adapter is checked before the (possibly slow) base load.
    policy = PolicySource.check(policy_adapter, allow_pickle)
    rewards = {
        name: RewardFolder.check(directory, allow_pickle) for name, directory in reward_adapters.items()
    }

    from marl.data.assets import resolve_model_path

    path = resolve_model_path(str(model_name_or_path))
    compute_dtype = dtype or default_compute_dtype()
    if device_map is None and torch.cuda.is_available():
        device_map = {"": torch.cuda.current_device()}
    base = load_pretrained(
        AutoModelForCausalLM,
        path,
        dtype=compute_dtype,
        trust_remote_code=trust_remote_code,
        quantization_config=bitsandbytes_config(quantization, compute_dtype),
        **({"device_map": device_map} if device_map is not None else {}),
    )
    check_static_rotary(base)
    base = prepare_quantized_base(base, quantization)
    # The first policy wraps the base in a PeftModel; every later adapter is added to it.
    if policy.directory is not None:
        adapters.check_lora_targets(base, policy.state, policy.directory, role="policy")
        peft_model = PeftModel.from_pretrained(
            base, str(policy.directory), adapter_name=policy_name, is_trainable=True
        )
    else:
        adapters.check_target_modules(base, policy.lora_config.target_modules, "--lora_target_modules")
        peft_model = get_peft_model(base, policy.lora_config, adapter_name=policy_name)
    model = cls(peft_model, name_or_path=path, quantization=quantization, dtype=compute_dtype)
    register_policy(model, policy_name, policy, reference)
    for name, folder in rewards.items():
        attach_reward_adapter(model, name, folder)
    if gradient_checkpointing:
        model.enable_gradient_checkpointing()
    check_logit_head(base, model._backbone(), model.logit_head)
    check_train_matches_eval(base)
    return model


def attach_policy(
    model: MultiAdapterModel, name: str, adapter: PolicySpec, reference: str, allow_pickle: bool
) -> None:
    """Add policy ``name`` to a loaded model (see :meth:`MultiAdapterModel.add_policy`)."""
    if reference not in REFERENCE_MODES:
        raise ConfigError(f"reference must be one of {REFERENCE_MODES}, got {reference!r}")
    check_adapter_name(name, model.adapter_names, "policy")
    policy = PolicySource.check(adapter, allow_pickle)
    if policy.directory is not None:
        base = model.peft_model.get_base_model()
        adapters.check_lora_targets(base, policy.state, policy.directory, role="policy")
        model.peft_model.load_adapter(str(policy.directory), adapter_name=name, is_trainable=True)
    else:
        model.peft_model.add_adapter(name, policy.lora_config)
    register_policy(model, name, policy, reference)


def register_policy(model: MultiAdapterModel, name: str, policy: PolicySource, reference: str) -> None:
    """Record the just-attached policy ``name``, add its reference copy if needed, and settle the flags."""
    parameters = [p for n, p in model.peft_model.named_parameters() if f".{name}." in n and "lora_" in n]
    if not parameters:
        raise AdapterError(f"policy adapter {name!r} has no LoRA parameters; check its target_modules")
    mode = reference
    if reference == "auto":
        mode = "base" if policy.starts_as_identity else "initial-policy"
    if mode == "initial-policy":
        _add_frozen_copy(model.peft_model, name, reference_adapter_name(name))
    model.policies[name] = PolicyAdapter(name, parameters, mode)
    _settle(model)


def attach_reward_adapter(model: MultiAdapterModel, name: str, folder: RewardFolder) -> None:
    """Load a checked SEQ_CLS reward adapter's LoRA into the model (frozen, compute dtype) and its score head
    into a frozen float32 Linear; record where its score is read."""
    peft_model = model.peft_model
    base = peft_model.get_base_model()
    hidden_size = base.get_output_embeddings().weight.shape[1]
    head = adapters.read_reward_head(folder.state, folder.directory, hidden_size)
    recorded_base = folder.config.get("base_model_name_or_path")
    if recorded_base and not adapters.same_model(recorded_base, model.name_or_path):
        warnings.warn(
            f"reward adapter {folder.directory} was trained on {recorded_base!r} but is loaded on "
            f"{model.name_or_path!r}; its scores are only meaningful on the base it was trained on",
            stacklevel=3,
        )
    lora_state = adapters.lora_tensors(folder.state)
    adapters.check_lora_targets(base, lora_state, folder.directory, role="reward")
    try:
        config = LoraConfig.from_pretrained(str(folder.directory))
    except Exception as error:
        raise AdapterError(
            f"reward adapter {folder.directory}: {adapters.ADAPTER_CONFIG_NAME} is not a LoRA configuration "
            "this "
            f"peft version reads ({type(error).__name__}: {error})"
        ) from error
    config.task_type = "CAUSAL_LM"
    config.modules_to_save = None
    config.inference_mode = True
    config.init_lora_weights = False  # the saved weights replace the initial values
    peft_model.add_adapter(name, config)
    result = set_peft_model_state_dict(peft_model, lora_state, adapter_name=name)
    if result.unexpected_keys:
        raise AdapterError(
            f"reward adapter {folder.directory}: weights that match no module of this base: "
            f"{result.unexpected_keys[:5]}"
        )
    missing = [key for key in result.missing_keys if f".{name}." in key and "lora_" in key]
    if missing:
        raise AdapterError(
            f"reward adapter {folder.directory} is incomplete: no weights for {missing[:5]}; re-save it"
        )
    for parameter_name, parameter in peft_model.named_parameters():
        if f".{name}." in parameter_name:
            parameter.data = parameter.data.to(model.dtype)

    device = base.get_output_embeddings().weight.device
    # float32: bf16 would round scores to about three digits before the leave-one-out differences.
    score_head = nn.Linear(hidden_size, 1, bias=head.has_bias, dtype=torch.float32, device=device)
    with torch.no_grad():
        score_head.weight.copy_(head.weight)
        if head.bias is not None:
            score_head.bias.copy_(head.bias)
    score_head.requires_grad_(False)
    score_head.eval()
    pad_token_id = head.pad_token_id
    if pad_token_id is None:
        pad_token_id = _tokenizer_pad_token_id(model.name_or_path)
    model.rewards[name] = RewardAdapter(name, score_head, head, pad_token_id)
    _settle(model)


def _settle(model: MultiAdapterModel) -> None:
    """After adding an adapter: only policy tensors train, no dropout anywhere, the first policy active."""
    trainable = {id(p) for policy in model.policies.values() for p in policy.parameters}
    _check_only_policies_train(model.peft_model, trainable)
    for parameter in model.peft_model.parameters():
        parameter.requires_grad_(id(parameter) in trainable)
    model.peft_model.set_adapter(model.default_policy)
    # set_adapter marks the active adapter trainable: restore the policies-only rule.
    for parameter in model.peft_model.parameters():
        parameter.requires_grad_(id(parameter) in trainable)
    disable_dropout(model.peft_model)
    model.peft_model.eval()


def _add_frozen_copy(peft_model: PeftModel, source: str, target: str) -> None:
    """Add adapter ``target`` holding the exact current weights of adapter ``source``."""
    config = copy.deepcopy(peft_model.peft_config[source])
    config.inference_mode = True
    # The copy's initial values are overwritten below; no initialisation needs to run.
    config.init_lora_weights = False
    peft_model.add_adapter(target, config)
    state = get_peft_model_state_dict(peft_model, adapter_name=source)
    result = set_peft_model_state_dict(peft_model, state, adapter_name=target)
    if result.unexpected_keys:
        raise RuntimeError(
            f"copying adapter {source!r} to {target!r} left keys unused: {result.unexpected_keys[:5]}"
        )


def load_pretrained(auto_class: Any, path: str, **options: Any) -> Any:
    """``auto_class.from_pretrained(path, **options)`` (a model or a tokenizer); a folder it cannot load (no
    weights, damaged weights, a config.json that is not JSON or names an unknown architecture, a hub id that
    is not in the local cache) is named in the error."""
    from safetensors import SafetensorError

    what = "tokenizer" if "Tokenizer" in auto_class.__name__ else "model"
    try:
        return auto_class.from_pretrained(path, **options)
    except (OSError, ValueError, SafetensorError) as error:
        raise ModelError(
            f"cannot load the {what} {path} ({type(error).__name__}: {error}). Pass a folder that "
            "save_pretrained wrote (config.json, complete weights and the tokenizer), or a hub id "
            "that is in the local cache"
        ) from error


def load_tokenizer(path: str) -> Any:
    """The tokenizer of the base model at ``path`` (a folder or a cached hub id)."""
    from transformers import AutoTokenizer

    return load_pretrained(AutoTokenizer, path)


def _tokenizer_pad_token_id(path: str) -> int:
    """The padding id TRL's ``RewardTrainer`` would have used with this base's tokenizer (pad, else EOS)."""
    from marl.model.generation import pad_token_id

    try:
        tokenizer = load_tokenizer(path)
    except ModelError as error:
        raise ModelError(
            f"a reward adapter does not record its padding token ({adapters.REWARD_READING_FILE}) and "
            f"{error}. "
            f'Add {adapters.REWARD_READING_FILE} with {{"pad_token_id": ID}} to the adapter folder'
        ) from error
    return pad_token_id(tokenizer)


def _check_only_policies_train(peft_model: PeftModel, trainable: set[int]) -> None:
    """Every tensor that PEFT made trainable must belong to a policy adapter: a trainable base tensor would
    move the reward and the reference too."""
    foreign = [
        name for name, p in peft_model.named_parameters() if p.requires_grad and id(p) not in trainable
    ]
    if foreign:
        raise AdapterError(
            f"the policy adapter would train {len(foreign)} tensor(s) outside its LoRA weights, e.g. "
            f"{foreign[:3]}; the shared base (and so the reward and the reference) would move with them. "
            "Train "
            "only adapter weights (LoraConfig with bias='none' and no trainable base modules)"
        )
