"""One base model hosting the policy, the reference and the reward as views: ``MultiAdapterModel``.

PPO-style RLHF keeps four models in memory (policy, reference, reward, value); RLOO needs no value model,
and here the other three share ONE set of base weights (optionally 4-bit NF4 or 8-bit through bitsandbytes):

* policy    = base + trainable LoRA adapter ``"policy"``
* reference = base with adapters disabled, or a frozen copy ``"reference"`` of the policy's starting adapter
* reward    = base + frozen LoRA adapter ``"reward"`` + frozen score head ``Linear(hidden, 1)`` beside it

Views are switched with nestable context managers that restore the previous active adapter, every parameter's
``requires_grad`` and every module's train/eval mode on exit, also when the body raises.

Example:
    >>> model = MultiAdapterModel.from_pretrained("smollm2-135m-instruct", quantization="4bit",
    ...                                           reward_adapter="adapters/sentiment-reward")
    >>> scores = model.compute_reward_score(input_ids, attention_mask)
    >>> with model.reference():
    ...     ref_logprobs = model.token_logprobs(input_ids, attention_mask, response_start=prompt_len)
"""

from __future__ import annotations

import contextlib
import copy
import os
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from peft.tuners.tuners_utils import BaseTunerLayer
from peft.utils import get_peft_model_state_dict, set_peft_model_state_dict
from torch import nn
from transformers import AutoModelForCausalLM

from marl import adapters
from marl.errors import AdapterError, ConfigError, ModelError
from marl.families import LogitHead, check_logit_head, check_train_matches_eval, disable_dropout
from marl.logprobs import DEFAULT_CHUNK_SIZE, entropy_from_logits, selective_log_softmax
from marl.quantization import (
    bitsandbytes_config,
    default_compute_dtype,
    parse_quantization,
    prepare_quantized_base,
)
from marl.sampling import SamplingSettings, sample

if TYPE_CHECKING:
    from marl.memory import MemoryReport

REFERENCE_MODES = ("auto", "base", "initial-policy")

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


def last_token_index(attention_mask: torch.Tensor) -> torch.Tensor:
    """Index of the last position with ``attention_mask == 1`` in each row (works for left and right padding).

    Example:
        >>> last_token_index(torch.tensor([[0, 1, 1], [1, 1, 0]]))
        tensor([2, 1])
    """
    if attention_mask.dim() != 2:
        raise ValueError(f"attention_mask must be [batch, time], got shape {tuple(attention_mask.shape)}")
    real = attention_mask.bool()
    if not real.any(dim=1).all():
        raise ValueError("a row of attention_mask has no real token; every sequence needs at least one token")
    length = attention_mask.shape[1]
    return (length - 1) - real.flip(dims=[1]).int().argmax(dim=1)


def reward_read_positions(
    input_ids: torch.Tensor, attention_mask: torch.Tensor, pad_token_id: int
) -> torch.Tensor:
    """Where a sequence classifier reads each row's score: the last token that is not ``pad_token_id``, once
    every masked position holds that id. This is the rule of transformers' ``*ForSequenceClassification``
    (and so of TRL's ``RewardTrainer``): when pad == eos, a final EOS counts as padding and the score is read
    at the token before it.

    Example:
        >>> ids = torch.tensor([[0, 5, 6, 2], [5, 6, 7, 8]])
        >>> mask = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]])
        >>> reward_read_positions(ids, mask, pad_token_id=2)  # pad == eos == 2: row 0 is read before its EOS
        tensor([2, 3])
    """
    ids = input_ids.masked_fill(attention_mask == 0, pad_token_id)
    positions = torch.arange(ids.shape[1], device=ids.device)
    return (positions * (ids != pad_token_id).long()).argmax(dim=1)


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions counted over real tokens only, as ``generate`` does, so a left-padded row sees the same
    positions as the unpadded one (padding gets position 0; it is masked anyway)."""
    return (attention_mask.long().cumsum(dim=1) - 1).clamp(min=0)


@dataclass
class _ViewState:
    active_adapter: str
    adapters_disabled: bool
    requires_grad: list[tuple[nn.Parameter, bool]]
    training: list[tuple[nn.Module, bool]]


class MultiAdapterModel:
    """The policy, the reference and the reward as adapter views of ONE base causal LM.

    Build it with :meth:`from_pretrained`. The underlying ``peft.PeftModel`` is :attr:`peft_model`; the
    optimizer gets :meth:`policy_parameters`. The model starts in eval mode; call ``model.train()`` before
    an update so that gradient checkpointing (if enabled) is active. Every dropout is off: the rollout and the
    update must compute the same function.

    Example:
        >>> model = MultiAdapterModel.from_pretrained("path/to/base", reward_adapter="path/to/reward")
        >>> with model.use_adapter("reward"):
        ...     ...
    """

    POLICY_ADAPTER = "policy"
    REWARD_ADAPTER = "reward"
    REFERENCE_ADAPTER = "reference"

    def __init__(
        self,
        peft_model: PeftModel,
        *,
        name_or_path: str,
        quantization: str | None,
        dtype: torch.dtype,
        reference_mode: str,
        policy_parameters: list[nn.Parameter],
        score_head: nn.Linear | None = None,
        reward_head_info: adapters.RewardHead | None = None,
        reward_pad_token_id: int | None = None,
    ) -> None:
        self.peft_model = peft_model
        self.name_or_path = name_or_path
        self.quantization = quantization
        self.dtype = dtype
        self.reference_mode = reference_mode
        self._policy_parameters = policy_parameters
        self.score_head = score_head
        self.reward_head_info = reward_head_info
        self.reward_pad_token_id = reward_pad_token_id
        base = peft_model.get_base_model()
        self.logit_head = LogitHead.of(base)

    # ------------------------------------------------------------------ loading

    @classmethod
    def from_pretrained(
        cls,
        model_name_or_path: str | os.PathLike,
        *,
        quantization: str | None = None,
        reward_adapter: str | os.PathLike | None = None,
        policy_adapter: LoraConfig | str | os.PathLike | None = None,
        reference: str = "auto",
        dtype: torch.dtype | None = None,
        device_map: str | dict[str, Any] | torch.device | None = None,
        gradient_checkpointing: bool = False,
        allow_pickle: bool = False,
        trust_remote_code: bool = False,
    ) -> MultiAdapterModel:
        """Load a causal LM once and attach the policy (trainable), the reference and the reward (frozen).

        Args:
            model_name_or_path: a local model folder, a hub id already in the local cache, or the embedded
                model id ``"smollm2-135m-instruct"`` (see ``marl.assets.resolve_model_path``).
            quantization: ``None`` (compute dtype), ``"4bit"`` (NF4 with double quantization) or ``"8bit"``
                (LLM.int8), through bitsandbytes (see :mod:`marl.quantization`).
            reward_adapter: a PEFT folder written by TRL's ``RewardTrainer`` with a LoRA ``peft_config``
                (task ``SEQ_CLS``: LoRA on inner layers + score head), or by ``marl train-reward``. Optional:
                without it, :meth:`compute_reward_score` is unavailable and rewards must come from elsewhere.
            policy_adapter: ``None`` (fresh LoRA, see :func:`default_policy_lora_config`), a
                ``LoraConfig``, or a PEFT adapter folder to continue training (loaded trainable).
            reference: ``"base"`` (adapters disabled), ``"initial-policy"`` (frozen copy of the policy
                adapter's starting weights) or ``"auto"``: base when the policy starts as the identity
                (fresh LoRA with zero-initialised B), initial-policy otherwise (e.g. an SFT adapter).
            dtype: compute dtype; default bfloat16 on a CUDA device that supports it, float32 elsewhere.
            device_map: passed to ``from_pretrained``; default: the current CUDA device if there is one,
                else CPU.
            gradient_checkpointing: recompute activations in the backward pass (non-reentrant) to save
                memory; active in train mode.
            allow_pickle: accept adapters stored only as pickled ``adapter_model.bin`` (unpickling can run
                code, so only for sources you trust).
            trust_remote_code: passed to ``from_pretrained``.

        Refused with an error, before the base is loaded: adapters that would train or rewrite the shared base
        (``bias`` other than ``"none"``, PiSSA/OLoRA/CorDA/LoftQ/LoRA-GA initialisations, layer replication),
        and bad adapter folders. Refused after loading: a model whose forward computes its logits in a way
        marl does not reproduce, or that computes differently in train and eval mode with dropout off.

        Example:
            >>> model = MultiAdapterModel.from_pretrained("smollm2-135m-instruct", quantization="4bit")
            >>> model.reference_mode
            'base'
        """
        quantization = parse_quantization(quantization)
        if reference not in REFERENCE_MODES:
            raise ConfigError(f"reference must be one of {REFERENCE_MODES}, got {reference!r}")
        if policy_adapter is not None and not isinstance(policy_adapter, (LoraConfig, str, os.PathLike)):
            raise TypeError(
                "policy_adapter must be None (fresh LoRA), a peft.LoraConfig, or a PEFT adapter folder; "
                f"got {type(policy_adapter).__name__}"
            )
        # Every adapter is validated before the (possibly slow) base load.
        policy_dir = None
        if isinstance(policy_adapter, (str, os.PathLike)):
            policy_dir = Path(policy_adapter)
            policy_config = adapters.read_adapter_config(policy_dir, role="policy")
            adapters.load_adapter_state(
                adapters.adapter_weights_file(policy_dir, allow_pickle=allow_pickle, role="policy")
            )
            if str(policy_config.get("task_type")) == "SEQ_CLS":
                raise AdapterError(
                    f"policy_adapter {policy_dir} is a sequence-classification (reward) adapter; pass it as "
                    "reward_adapter=..., and give policy_adapter a causal-LM adapter or None for a fresh LoRA"
                )
            adapters.check_keeps_base_fixed(policy_config, f"policy adapter {policy_dir}")
        else:
            lora_config = copy.deepcopy(policy_adapter) if policy_adapter is not None else None
            lora_config = lora_config or default_policy_lora_config()
            adapters.check_keeps_base_fixed(lora_config.to_dict(), "policy LoraConfig")
        reward = None
        if reward_adapter is not None:
            reward_dir = Path(reward_adapter)
            reward_config = adapters.read_adapter_config(reward_dir, role="reward")
            adapters.check_keeps_base_fixed(reward_config, f"reward adapter {reward_dir}")
            reward_state = adapters.load_adapter_state(
                adapters.adapter_weights_file(reward_dir, allow_pickle=allow_pickle, role="reward")
            )
            reward = (reward_dir, reward_config, reward_state)

        from marl.assets import resolve_model_path

        path = resolve_model_path(str(model_name_or_path))
        compute_dtype = dtype or default_compute_dtype()
        if device_map is None and torch.cuda.is_available():
            device_map = {"": torch.cuda.current_device()}
        base = AutoModelForCausalLM.from_pretrained(
            path,
            dtype=compute_dtype,
            trust_remote_code=trust_remote_code,
            quantization_config=bitsandbytes_config(quantization, compute_dtype),
            **({"device_map": device_map} if device_map is not None else {}),
        )
        base = prepare_quantized_base(base, quantization)

        if policy_dir is not None:
            peft_model = PeftModel.from_pretrained(
                base, str(policy_dir), adapter_name=cls.POLICY_ADAPTER, is_trainable=True
            )
            starts_as_identity = False
        else:
            if lora_config.task_type is None:
                lora_config.task_type = "CAUSAL_LM"
            lora_config.inference_mode = False
            peft_model = get_peft_model(base, lora_config, adapter_name=cls.POLICY_ADAPTER)
            starts_as_identity = lora_config.init_lora_weights in (True, "gaussian")
        policy_parameters = [p for p in peft_model.parameters() if p.requires_grad]
        if not policy_parameters:
            raise AdapterError("the policy adapter has no trainable parameters; check its target_modules")

        reference_mode = reference
        if reference == "auto":
            reference_mode = "base" if starts_as_identity else "initial-policy"
        if reference_mode == "initial-policy":
            _add_frozen_copy(peft_model, cls.POLICY_ADAPTER, cls.REFERENCE_ADAPTER)

        score_head = head = reward_pad = None
        if reward is not None:
            score_head, head = _attach_reward_adapter(
                peft_model, *reward, cls.REWARD_ADAPTER, compute_dtype, path
            )
            reward_pad = head.pad_token_id
            if reward_pad is None:
                reward_pad = _tokenizer_pad_token_id(path, trust_remote_code)

        _check_only_policy_trains(peft_model, policy_parameters, cls.POLICY_ADAPTER)
        # Only the policy trains: adding adapters may have flipped requires_grad flags.
        policy_ids = {id(p) for p in policy_parameters}
        for parameter in peft_model.parameters():
            parameter.requires_grad_(id(parameter) in policy_ids)
        peft_model.set_adapter(cls.POLICY_ADAPTER)
        disable_dropout(peft_model)
        model = cls(
            peft_model,
            name_or_path=path,
            quantization=quantization,
            dtype=compute_dtype,
            reference_mode=reference_mode,
            policy_parameters=policy_parameters,
            score_head=score_head,
            reward_head_info=head,
            reward_pad_token_id=reward_pad,
        )
        if gradient_checkpointing:
            model.enable_gradient_checkpointing()
        peft_model.eval()
        check_logit_head(base, model._backbone(), model.logit_head)
        check_train_matches_eval(base)
        return model

    # ------------------------------------------------------------------ attributes

    @property
    def config(self):
        """The base model's ``transformers`` config."""
        return self.peft_model.get_base_model().config

    @property
    def generation_config(self):
        """The base model's own ``GenerationConfig`` (its end-of-sequence ids; sampling ignores the rest)."""
        return self.peft_model.get_base_model().generation_config

    @property
    def device(self) -> torch.device:
        """Device of the input embeddings (where ``input_ids`` should live)."""
        return self.peft_model.get_base_model().get_input_embeddings().weight.device

    @property
    def has_reward_adapter(self) -> bool:
        return self.score_head is not None

    @property
    def adapter_names(self) -> list[str]:
        """Names of the adapters in :attr:`peft_model` (``policy``, and ``reference`` / ``reward`` if
        present)."""
        return list(self.peft_model.peft_config)

    def policy_parameters(self) -> list[nn.Parameter]:
        """The trainable parameters of the policy adapter: what the optimizer gets.

        Example:
            >>> optimizer = torch.optim.AdamW(model.policy_parameters(), lr=1e-5)
        """
        return list(self._policy_parameters)

    def train(self, mode: bool = True) -> MultiAdapterModel:
        """Put the model in train mode (needed for gradient checkpointing during updates). Returns
        ``self``."""
        self.peft_model.train(mode)
        return self

    def eval(self) -> MultiAdapterModel:
        """Put the model in eval mode. Returns ``self``."""
        return self.train(False)

    @property
    def gradient_checkpointing(self) -> bool:
        """Whether activations are recomputed in the backward pass (in train mode)."""
        return bool(self.peft_model.get_base_model().is_activation_checkpointing)

    def enable_gradient_checkpointing(self) -> None:
        """Recompute activations in the backward pass (non-reentrant, so no input-gradient hook is needed for
        quantized and plain bases alike); active in train mode."""
        base = self.peft_model.get_base_model()
        if not base.is_activation_checkpointing:
            base.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})

    # ------------------------------------------------------------------ adapter views

    def _capture_view(self) -> _ViewState:
        return _ViewState(
            active_adapter=self.peft_model.active_adapter,
            adapters_disabled=self._adapters_disabled(),
            requires_grad=[(p, p.requires_grad) for p in self.peft_model.parameters()],
            training=[(m, m.training) for m in self.peft_model.modules()],
        )

    def _restore_view(self, state: _ViewState) -> None:
        tuner = self.peft_model.base_model
        if state.adapters_disabled:
            tuner.disable_adapter_layers()
        else:
            tuner.enable_adapter_layers()
        self.peft_model.set_adapter(state.active_adapter)
        if state.adapters_disabled:
            tuner.disable_adapter_layers()
        for parameter, requires_grad in state.requires_grad:
            parameter.requires_grad_(requires_grad)
        for module, training in state.training:
            module.training = training

    def _adapters_disabled(self) -> bool:
        for module in self.peft_model.modules():
            if isinstance(module, BaseTunerLayer):
                return module.disable_adapters
        return False

    @contextlib.contextmanager
    def _view(self, adapter_name: str | None) -> Iterator[MultiAdapterModel]:
        """Activate ``adapter_name`` (``None``: adapters disabled) and restore everything on exit."""
        state = self._capture_view()
        try:
            tuner = self.peft_model.base_model
            if adapter_name is None:
                tuner.disable_adapter_layers()
            else:
                tuner.enable_adapter_layers()
                self.peft_model.set_adapter(adapter_name)
            # Views never change which parameters train: switching must not make a frozen adapter trainable.
            for parameter, requires_grad in state.requires_grad:
                parameter.requires_grad_(requires_grad)
            yield self
        finally:
            self._restore_view(state)

    def use_adapter(self, name: str) -> contextlib.AbstractContextManager[MultiAdapterModel]:
        """Context manager: run the body with adapter ``name`` active (``"policy"``, ``"reward"``,
        ``"reference"``).

        Nestable; on exit (also on an exception) the previous active adapter, every parameter's
        ``requires_grad`` and every module's train/eval mode are restored exactly. ``requires_grad`` is not
        changed inside either: only the policy adapter ever trains.

        Example:
            >>> with model.use_adapter("reward"):
            ...     hidden = model.peft_model(input_ids).logits
        """
        if name not in self.peft_model.peft_config:
            raise ValueError(f"no adapter named {name!r}; loaded adapters: {self.adapter_names}")
        return self._view(name)

    def reference(self) -> contextlib.AbstractContextManager[MultiAdapterModel]:
        """Context manager: the reference policy (base with adapters disabled, or the frozen
        ``"reference"`` copy).

        Example:
            >>> with model.reference():
            ...     ref_logprobs = model.token_logprobs(ids, mask, response_start=prompt_length)
        """
        if self.reference_mode == "base":
            return self._view(None)
        return self._view(self.REFERENCE_ADAPTER)

    def view(self, name: str) -> contextlib.AbstractContextManager[MultiAdapterModel]:
        """Context manager: ``"policy"``, ``"reference"`` (however it is built) or any adapter name.

        Example:
            >>> with model.view("reference"):
            ...     ref_logprobs = model.token_logprobs(ids, mask, response_start=prompt_length)
        """
        if name == "policy":
            return self.policy()
        if name == "reference":
            return self.reference()
        return self.use_adapter(name)

    def policy(self) -> contextlib.AbstractContextManager[MultiAdapterModel]:
        """Context manager: the policy adapter (what is trained).

        Example:
            >>> with model.policy():
            ...     logprobs = model.token_logprobs(ids, mask, response_start=prompt_length)
        """
        return self._view(self.POLICY_ADAPTER)

    @contextlib.contextmanager
    def _inference(self) -> Iterator[None]:
        """Eval mode (no dropout) and no grad for the body; train/eval flags restored after."""
        training = [(m, m.training) for m in self.peft_model.modules()]
        self.peft_model.eval()
        try:
            with torch.no_grad():
                yield
        finally:
            for module, flag in training:
                module.training = flag

    # ------------------------------------------------------------------ computations

    def _backbone(self) -> nn.Module:
        base = self.peft_model.get_base_model()
        return getattr(base, base.base_model_prefix)

    def _hidden_states(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Last hidden state (after the final norm) of the active view, skipping the LM head."""
        output = self._backbone()(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids_from_mask(attention_mask),
            use_cache=False,
        )
        return output.last_hidden_state

    def token_logprobs(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        *,
        response_start: int,
        temperature: float = 1.0,
        with_entropy: bool = False,
        chunk_size: int | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Float32 log-probs of ``input_ids[:, response_start:]``, each given its prefix, under the ACTIVE
        view.

        Pick the view with :meth:`policy` / :meth:`reference`. Logits are divided by ``temperature`` (use the
        sampling temperature). The LM head and the float32 log-softmax run ``chunk_size`` token positions at a
        time (default 1024), so no full ``[B, T, V]`` float32 tensor exists. Gradients flow if grad is
        enabled. No masking is applied: the caller masks padding. Positions follow the attention mask (as
        ``generate``), so left padding does not shift them.

        Returns ``logprobs`` ``[B, T - response_start]``, and with ``with_entropy=True`` also the entropy
        of the temperature-scaled distribution at each of those positions (detached: it is a metric).

        Example:
            >>> with model.policy():
            ...     logprobs = model.token_logprobs(ids, mask, response_start=8, temperature=0.7)
        """
        length = input_ids.shape[1]
        if not 0 < response_start < length:
            raise ValueError(
                f"response_start must be in [1, {length - 1}] for sequences of length {length}, got "
                f"{response_start}"
            )
        hidden = self._hidden_states(input_ids, attention_mask)[:, response_start - 1 : -1]
        targets = input_ids[:, response_start:]
        batch, steps = targets.shape
        flat_hidden = hidden.reshape(batch * steps, -1)
        flat_targets = targets.reshape(-1)
        step = chunk_size or DEFAULT_CHUNK_SIZE
        logprob_pieces, entropy_pieces = [], []
        for start in range(0, flat_hidden.shape[0], step):
            logits = self.logit_head(flat_hidden[start : start + step])
            chunk_targets = flat_targets[start : start + step].to(logits.device)
            logprob_pieces.append(selective_log_softmax(logits, chunk_targets, temperature, chunk_size=step))
            if with_entropy:
                # A metric only: without a graph its float32 [chunk, vocab] intermediates are freed at once
                # instead of living until the backward pass.
                with torch.no_grad():
                    entropy_pieces.append(entropy_from_logits(logits, temperature, chunk_size=step))
        logprobs = torch.cat(logprob_pieces).reshape(batch, steps)
        if with_entropy:
            return logprobs, torch.cat(entropy_pieces).reshape(batch, steps)
        return logprobs

    def compute_reward_score(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """One float32 score per row under ``reward``: the score head on the final hidden state where a
        transformers sequence classifier reads it (:func:`reward_read_positions`), with the padding id the
        reward adapter was trained with.

        That padding id is the one ``marl train-reward`` recorded in the adapter folder, else the base
        tokenizer's pad token (its EOS when it has none), which is what TRL's ``RewardTrainer`` uses. With
        pad == eos a completion ending in EOS is therefore read at the token before its EOS, as the adapter
        was trained. Left or right padding: masked positions are padding. Runs in eval mode without grad; the
        active adapter and modes are restored after. The head runs in float32.

        Example:
            >>> scores = model.compute_reward_score(batch["input_ids"], batch["attention_mask"])
            >>> scores.shape
            torch.Size([8])
        """
        if self.score_head is None:
            raise RuntimeError(
                "no reward adapter is loaded; pass reward_adapter=<PEFT dir from RewardTrainer> to "
                "from_pretrained, or compute rewards with a reward function"
            )
        with self.use_adapter(self.REWARD_ADAPTER), self._inference():
            hidden = self._hidden_states(input_ids, attention_mask)
            rows = torch.arange(hidden.shape[0], device=hidden.device)
            read_at = reward_read_positions(input_ids, attention_mask, self.reward_pad_token_id)
            pooled = hidden[rows, read_at.to(hidden.device)]
            pooled = pooled.to(device=self.score_head.weight.device, dtype=torch.float32)
            return self.score_head(pooled).squeeze(-1)

    def sample(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        settings: SamplingSettings,
        past_key_values: Any = None,
    ) -> torch.Tensor:
        """Sample completions from ``softmax(logits / temperature)`` under the ACTIVE view, in eval mode
        without grad; returns ``[batch, settings.max_new_tokens]`` completion ids. The model's own generation
        config (a repetition penalty, top-k, ...) does not apply: see :func:`marl.sampling.sample`.

        Example:
            >>> with model.policy():
            ...     completions = model.sample(ids, mask, SamplingSettings(0.7, 16, (eos,), pad))
        """
        with self._inference():
            return sample(self.peft_model, input_ids, attention_mask, settings, past_key_values)

    def save_policy_adapter(self, directory: str | os.PathLike) -> None:
        """Write the policy adapter alone as a standard PEFT folder (``adapter_config.json`` +
        ``adapter_model.safetensors``), loadable with ``PeftModel.from_pretrained(base, directory)``.

        Example:
            >>> model.save_policy_adapter("runs/final-adapter")
        """
        adapters.save_adapter(self.peft_model, self.POLICY_ADAPTER, Path(directory), self.name_or_path)

    def memory_report(self) -> MemoryReport:
        """What each part costs in memory, and what separate model copies would cost (the "memory card").

        Example:
            >>> print(model.memory_report())
        """
        from marl.memory import build_memory_report

        return build_memory_report(self)


# ---------------------------------------------------------------------- building the views


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


def _attach_reward_adapter(
    peft_model: PeftModel,
    directory: Path,
    raw_config: dict[str, Any],
    state: dict[str, torch.Tensor],
    adapter_name: str,
    dtype: torch.dtype,
    base_path: str,
) -> tuple[nn.Linear, adapters.RewardHead]:
    """Load a checked SEQ_CLS reward adapter's LoRA into ``peft_model`` (frozen, compute dtype) and its score
    head into a frozen float32 Linear."""
    base = peft_model.get_base_model()
    hidden_size = base.get_output_embeddings().weight.shape[1]
    head = adapters.read_reward_head(state, directory, hidden_size)
    recorded_base = raw_config.get("base_model_name_or_path")
    if recorded_base and not adapters.same_model(recorded_base, base_path):
        warnings.warn(
            f"reward adapter {directory} was trained on {recorded_base!r} but is loaded on {base_path!r}; "
            "its "
            "scores are only meaningful on the base it was trained on",
            stacklevel=3,
        )
    lora_state = adapters.lora_tensors(state)
    adapters.check_lora_targets(base, lora_state, directory)

    try:
        config = LoraConfig.from_pretrained(str(directory))
    except Exception as error:
        raise AdapterError(
            f"reward adapter {directory}: {adapters.ADAPTER_CONFIG_NAME} is not a LoRA configuration this "
            "peft "
            f"version reads ({type(error).__name__}: {error})"
        ) from error
    config.task_type = "CAUSAL_LM"
    config.modules_to_save = None
    config.inference_mode = True
    config.init_lora_weights = False  # the saved weights replace the initial values
    peft_model.add_adapter(adapter_name, config)
    result = set_peft_model_state_dict(peft_model, lora_state, adapter_name=adapter_name)
    if result.unexpected_keys:
        raise AdapterError(
            f"reward adapter {directory}: weights that match no module of this base: "
            f"{result.unexpected_keys[:5]}"
        )
    missing = [key for key in result.missing_keys if f".{adapter_name}." in key and "lora_" in key]
    if missing:
        raise AdapterError(
            f"reward adapter {directory} is incomplete: no weights for {missing[:5]}; re-save it"
        )
    for name, parameter in peft_model.named_parameters():
        if f".{adapter_name}." in name:
            parameter.data = parameter.data.to(dtype)
            parameter.requires_grad_(False)

    device = base.get_output_embeddings().weight.device
    # float32: bf16 would round scores to about three digits before the leave-one-out differences.
    score_head = nn.Linear(hidden_size, 1, bias=head.has_bias, dtype=torch.float32, device=device)
    with torch.no_grad():
        score_head.weight.copy_(head.weight)
        if head.bias is not None:
            score_head.bias.copy_(head.bias)
    score_head.requires_grad_(False)
    score_head.eval()
    return score_head, head


def _tokenizer_pad_token_id(path: str, trust_remote_code: bool) -> int:
    """The padding id TRL's ``RewardTrainer`` would have used with this base's tokenizer (pad, else EOS)."""
    from transformers import AutoTokenizer

    from marl.sampling import pad_token_id

    try:
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except Exception as error:
        raise ModelError(
            f"the reward adapter does not record its padding token ({adapters.REWARD_READING_FILE}) and the "
            f"tokenizer of {path} cannot be loaded to find it ({type(error).__name__}: {error}). Add "
            f'{adapters.REWARD_READING_FILE} with {{"pad_token_id": ID}} to the adapter folder'
        ) from error
    return pad_token_id(tokenizer)


def _check_only_policy_trains(
    peft_model: PeftModel, policy_parameters: list[nn.Parameter], policy_name: str
) -> None:
    """Every trainable tensor must belong to the policy adapter: a trainable base tensor would move the reward
    and the reference too."""
    names = {id(parameter): name for name, parameter in peft_model.named_parameters()}
    foreign = [names[id(p)] for p in policy_parameters if f".{policy_name}." not in names[id(p)]]
    if foreign:
        raise AdapterError(
            f"the policy adapter would train {len(foreign)} tensor(s) of the shared base, e.g. "
            f"{foreign[:3]}; "
            "the reward and the reference would move with them. Train only adapter weights (LoraConfig with "
            "bias='none' and no trainable base modules)"
        )
