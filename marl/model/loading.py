"""The only loader: a base model, loaded once, and its named adapters, returned as a plain record.

Every base marl uses is loaded here (:func:`load_base`): the RLOO model's causal LM (:func:`load`) and the
sequence classifier that reward training puts a LoRA on. Every adapter folder is read once, before the base is
loaded (it is the slow part), and every adapter setting that would train or rewrite the shared base is refused
then (:func:`marl.model.adapters.check_keeps_base_fixed`). After each adapter is attached, only the policies'
own tensors are trainable, every dropout is off, and (once, after loading) probes prove that the chunked
log-prob head reproduces the model's forward and that train mode computes what eval mode computes
(:mod:`marl.model.families`).

This module knows nothing of :class:`~marl.model.multi_adapter.MultiAdapterModel`: it returns what it loaded
(:class:`LoadedModel`, with the adapter records of :mod:`marl.model.adapters`) and the model stores it.
"""

from __future__ import annotations

import copy
import os
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from peft.utils import get_peft_model_state_dict, set_peft_model_state_dict
from torch import nn
from transformers import AutoModelForCausalLM

from marl.config.model import check_reference_mode, parse_quantization, policy_lora_config
from marl.errors import AdapterError, ModelError
from marl.model import adapters
from marl.model.adapters import PolicyAdapter, RewardAdapter, check_adapter_name, reference_adapter_name
from marl.model.families import (
    LogitHead,
    backbone,
    check_logit_head,
    check_static_rotary,
    check_train_matches_eval,
    disable_dropout,
)
from marl.model.forward import enable_gradient_checkpointing
from marl.model.quantization import bitsandbytes_config, default_compute_dtype, prepare_quantized_base

PolicySpec = LoraConfig | str | os.PathLike | None


@dataclass
class LoadedModel:
    """What :func:`load` returns: the PEFT model with every adapter attached and settled,
    and the records the model keeps (policies first-added first: the first is the default)."""

    peft_model: PeftModel
    name_or_path: str
    quantization: str | None
    dtype: torch.dtype
    logit_head: LogitHead
    policies: dict[str, PolicyAdapter]
    rewards: dict[str, RewardAdapter]


@dataclass
class PolicySource:
    """A checked policy adapter to attach: a fresh ``LoraConfig`` or a saved adapter folder."""

    lora_config: LoraConfig | None
    folder: adapters.AdapterFolder | None

    @classmethod
    def check(cls, adapter: PolicySpec, allow_pickle: bool) -> PolicySource:
        if adapter is not None and not isinstance(adapter, (LoraConfig, str, os.PathLike)):
            raise TypeError(
                "policy_adapter must be None (fresh LoRA), a peft.LoraConfig, or a PEFT adapter folder; got "
                f"{type(adapter).__name__}"
            )
        if isinstance(adapter, (str, os.PathLike)):
            remedy = (
                f"pass it with --reward_adapter {adapter}, and give --policy_adapter a causal-LM adapter, or "
                "leave it out for a fresh LoRA"
            )
            folder = adapters.read_policy_folder(
                adapter, allow_pickle=allow_pickle, flag="--policy_adapter", remedy=remedy
            )
            return cls(None, folder)
        lora_config = copy.deepcopy(adapter) if adapter is not None else policy_lora_config()
        adapters.check_keeps_base_fixed(lora_config.to_dict(), "policy LoraConfig")
        lora_config.task_type = lora_config.task_type or "CAUSAL_LM"
        lora_config.inference_mode = False
        return cls(lora_config, None)

    @property
    def starts_as_identity(self) -> bool:
        """A fresh LoRA with zero-initialised B matrices computes exactly the base."""
        return self.lora_config is not None and self.lora_config.init_lora_weights in (True, "gaussian")


def read_reward_folder(directory: str | os.PathLike, allow_pickle: bool) -> adapters.AdapterFolder:
    """Read a reward adapter folder (once) and refuse settings that would move the shared base."""
    folder = adapters.read_adapter_folder(directory, allow_pickle=allow_pickle, role="reward")
    adapters.check_keeps_base_fixed(folder.config, f"reward adapter {folder.directory}")
    return folder


def load_base(
    auto_class: Any,
    path: str,
    *,
    quantization: str | None,
    dtype: torch.dtype,
    device_map: Any = None,
    frozen_float32: bool = False,
    **options: Any,
) -> nn.Module:
    """Load the base at ``path`` with ``auto_class`` (a causal LM, or a reward-training classifier), quantized
    or not (``frozen_float32``: :func:`marl.model.quantization.prepare_quantized_base`), frozen, on
    ``device_map`` (default: the current CUDA device if any, else CPU); ``options`` go to from_pretrained."""
    quantization = parse_quantization(quantization)
    if device_map is None and torch.cuda.is_available():
        device_map = {"": torch.cuda.current_device()}
    base = load_pretrained(
        auto_class,
        path,
        dtype=dtype,
        quantization_config=bitsandbytes_config(quantization, dtype),
        **({"device_map": device_map} if device_map is not None else {}),
        **options,
    )
    return prepare_quantized_base(base, quantization, frozen_float32=frozen_float32)


def load(
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
) -> LoadedModel:
    """Load a causal LM once with its first policy and its reward adapters (the arguments of
    :meth:`MultiAdapterModel.from_pretrained`)."""
    quantization = parse_quantization(quantization)
    check_reference_mode(reference)
    names: list[str] = []
    for name, role in [(policy_name, "policy"), *((name, "reward adapter") for name in reward_adapters)]:
        check_adapter_name(name, names, role)
        names.append(name)
    # Every adapter folder is read and checked before the (possibly slow) base load, and only then.
    policy = PolicySource.check(policy_adapter, allow_pickle)
    folders = {
        name: read_reward_folder(directory, allow_pickle) for name, directory in reward_adapters.items()
    }

    from marl.data.assets import resolve_model_path

    path = resolve_model_path(str(model_name_or_path))
    compute_dtype = dtype or default_compute_dtype()
    base = load_base(
        AutoModelForCausalLM,
        path,
        quantization=quantization,
        dtype=compute_dtype,
        device_map=device_map,
        trust_remote_code=trust_remote_code,
    )
    check_static_rotary(base)
    # The first policy wraps the base in a PeftModel; every later adapter is added to it.
    if policy.folder is not None:
        adapters.check_lora_targets(base, policy.folder.state, policy.folder.directory, role="policy")
        peft_model = wrap_with_peft(base, _saved_policy_config(policy.folder), adapter_name=policy_name)
        _load_saved_lora(peft_model, policy_name, policy.folder, policy.folder.state)
    else:
        adapters.check_target_modules(base, policy.lora_config.target_modules, "--lora_target_modules")
        peft_model = wrap_with_peft(base, policy.lora_config, adapter_name=policy_name)
    policies = {policy_name: _register_policy(peft_model, policy_name, policy, reference, {})}
    rewards: dict[str, RewardAdapter] = {}
    for name, folder in folders.items():
        rewards[name] = attach_reward_lora(
            peft_model, name, folder, base_name_or_path=path, dtype=compute_dtype
        )
    _settle(peft_model, list(policies.values()))
    if gradient_checkpointing:
        enable_gradient_checkpointing(base)
    logit_head = LogitHead.of(base)
    check_logit_head(base, backbone(base), logit_head)
    check_train_matches_eval(base)
    return LoadedModel(peft_model, path, quantization, compute_dtype, logit_head, policies, rewards)


def attach_policy(
    peft_model: PeftModel,
    name: str,
    adapter: PolicySpec,
    *,
    reference: str,
    allow_pickle: bool,
    policies: Mapping[str, PolicyAdapter],
) -> PolicyAdapter:
    """Add policy ``name`` to a loaded model beside ``policies`` (:meth:`MultiAdapterModel.add_policy`)."""
    check_reference_mode(reference)
    check_adapter_name(name, list(peft_model.peft_config), "policy")
    policy = PolicySource.check(adapter, allow_pickle)
    if policy.folder is not None:
        base = peft_model.get_base_model()
        adapters.check_lora_targets(base, policy.folder.state, policy.folder.directory, role="policy")
        peft_model.add_adapter(name, _saved_policy_config(policy.folder))
        _load_saved_lora(peft_model, name, policy.folder, policy.folder.state)
    else:
        peft_model.add_adapter(name, policy.lora_config)
    return _register_policy(peft_model, name, policy, reference, policies)


def _register_policy(
    peft_model: PeftModel,
    name: str,
    policy: PolicySource,
    reference: str,
    policies: Mapping[str, PolicyAdapter],
) -> PolicyAdapter:
    """The record of the just-attached policy ``name``; adds its reference copy if needed, settles flags."""
    parameters = [p for n, p in peft_model.named_parameters() if f".{name}." in n and "lora_" in n]
    if not parameters:
        raise AdapterError(f"policy adapter {name!r} has no LoRA parameters; check its target_modules")
    mode = reference
    if reference == "auto":
        mode = "base" if policy.starts_as_identity else "initial-policy"
    if mode == "initial-policy":
        _add_frozen_copy(peft_model, name, reference_adapter_name(name))
    record = PolicyAdapter(name, parameters, mode)
    _settle(peft_model, [*policies.values(), record])
    return record


def attach_reward_adapter(
    peft_model: PeftModel,
    name: str,
    directory: str | os.PathLike,
    *,
    allow_pickle: bool,
    base_name_or_path: str,
    dtype: torch.dtype,
    policies: Mapping[str, PolicyAdapter],
) -> RewardAdapter:
    """Add reward adapter ``name`` from ``directory`` to a loaded model (see
    :meth:`MultiAdapterModel.add_reward_adapter`)."""
    check_adapter_name(name, list(peft_model.peft_config), "reward adapter")
    folder = read_reward_folder(directory, allow_pickle)
    reward = attach_reward_lora(peft_model, name, folder, base_name_or_path=base_name_or_path, dtype=dtype)
    _settle(peft_model, list(policies.values()))
    return reward


def attach_reward_lora(
    peft_model: PeftModel,
    name: str,
    folder: adapters.AdapterFolder,
    *,
    base_name_or_path: str,
    dtype: torch.dtype,
    pad_token_id: int | None = None,
) -> RewardAdapter:
    """Load a read SEQ_CLS reward adapter's LoRA into the model as adapter ``name`` (frozen, ``dtype``) and
    its score head into a frozen float32 Linear; record where its score is read: the folder's padding id,
    else ``pad_token_id``, else the base tokenizer's. Which adapter is active and which tensors train is left
    to the caller (PEFT's ``add_adapter`` may change both)."""
    base = peft_model.get_base_model()
    hidden_size = base.get_output_embeddings().weight.shape[1]
    head = adapters.read_reward_head(folder, hidden_size)
    recorded_base = folder.config.get("base_model_name_or_path")
    if recorded_base and not adapters.same_model(recorded_base, base_name_or_path):
        warnings.warn(
            f"reward adapter {folder.directory} was trained on {recorded_base!r} but is loaded on "
            f"{base_name_or_path!r}; its scores are only meaningful on the base it was trained on",
            stacklevel=4,  # the caller of from_pretrained / add_reward_adapter
        )
    lora_state = adapters.lora_tensors(folder.state)
    adapters.check_lora_targets(base, lora_state, folder.directory, role="reward")
    config = folder.lora_config()
    config.task_type = "CAUSAL_LM"
    config.modules_to_save = None
    config.inference_mode = True
    config.init_lora_weights = False  # the saved weights replace the initial values
    peft_model.add_adapter(name, config)
    _load_saved_lora(peft_model, name, folder, lora_state)
    for parameter_name, parameter in peft_model.named_parameters():
        if f".{name}." in parameter_name:
            parameter.data = parameter.data.to(dtype)

    device = base.get_output_embeddings().weight.device
    # float32: bf16 would round scores to about three digits before the leave-one-out differences.
    score_head = nn.Linear(hidden_size, 1, bias=head.has_bias, dtype=torch.float32, device=device)
    with torch.no_grad():
        score_head.weight.copy_(head.weight)
        if head.bias is not None:
            score_head.bias.copy_(head.bias)
    score_head.requires_grad_(False)
    score_head.eval()
    if head.pad_token_id is not None:
        pad_token_id = head.pad_token_id
    elif pad_token_id is None:
        pad_token_id = _tokenizer_pad_token_id(base_name_or_path)
    return RewardAdapter(name, score_head, head, pad_token_id)


def _saved_policy_config(folder: adapters.AdapterFolder) -> LoraConfig:
    """The LoRA configuration of a saved policy adapter, to train on: its weights come from the folder already
    read, so PEFT neither initialises them nor opens the folder again."""
    config = folder.lora_config()
    config.inference_mode = False
    config.init_lora_weights = False
    return config


def _load_saved_lora(
    peft_model: PeftModel, name: str, folder: adapters.AdapterFolder, state: dict[str, torch.Tensor]
) -> None:
    """Copy an adapter folder's tensors (already read) into adapter ``name``; every saved tensor must find its
    module and every LoRA module of the adapter its tensor."""
    result = set_peft_model_state_dict(peft_model, state, adapter_name=name)
    if result.unexpected_keys:
        raise AdapterError(
            f"{folder.role} adapter {folder.directory}: weights that match no module of this base: "
            f"{result.unexpected_keys[:5]}"
        )
    missing = [key for key in result.missing_keys if f".{name}." in key and "lora_" in key]
    if missing:
        raise AdapterError(
            f"{folder.role} adapter {folder.directory} is incomplete: no weights for {missing[:5]}; "
            "re-save it"
        )


def _settle(peft_model: PeftModel, policies: list[PolicyAdapter]) -> None:
    """After adding an adapter: only policy tensors train, no dropout anywhere, the first policy active."""
    trainable = {id(p) for policy in policies for p in policy.parameters}
    _check_only_policies_train(peft_model, trainable)
    for parameter in peft_model.parameters():
        parameter.requires_grad_(id(parameter) in trainable)
    peft_model.set_adapter(policies[0].name)
    # set_adapter marks the active adapter trainable: restore the policies-only rule.
    for parameter in peft_model.parameters():
        parameter.requires_grad_(id(parameter) in trainable)
    disable_dropout(peft_model)
    peft_model.eval()


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
    from marl.model.sampling import pad_token_id

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
            "Train only adapter weights (LoraConfig with bias='none' and no trainable base modules)"
        )


def wrap_with_peft(base: Any, lora_config: Any, **kwargs: Any) -> PeftModel:
    """``peft.get_peft_model`` without the deprecation notice PEFT's own constructor raises (it reads
    transformers' ``is_gradient_checkpointing``), which no marl setting or user can change."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "`is_gradient_checkpointing` is deprecated", FutureWarning)
        return get_peft_model(base, lora_config, **kwargs)
