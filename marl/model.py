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
import json
import logging
import os
import re
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from peft import LoraConfig, PeftModel, get_peft_model, prepare_model_for_kbit_training
from peft.tuners.tuners_utils import BaseTunerLayer
from peft.utils import get_peft_model_state_dict, set_peft_model_state_dict
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import AutoModelForCausalLM, BitsAndBytesConfig

from marl.logprobs import DEFAULT_CHUNK_SIZE, entropy_from_logits, selective_log_softmax

if TYPE_CHECKING:
    from marl.memory import MemoryReport

QUANTIZATION_MODES = (None, "4bit", "8bit")
REFERENCE_MODES = ("auto", "base", "initial-policy")

ADAPTER_CONFIG_NAME = "adapter_config.json"
SAFETENSORS_WEIGHTS_NAME = "adapter_model.safetensors"
PICKLE_WEIGHTS_NAME = "adapter_model.bin"

# Default policy LoRA. r=16 with alpha=32 (scale 2) on every linear layer of the blocks: RL fine-tuning
# moves far fewer bits than SFT (one scalar reward per completion), and low ranks are known to match full
# fine-tuning for policy-gradient RL, so r=16 leaves ample headroom while keeping the trainable state at
# ~0.5 % of a 7B model. alpha = 2r is the common QLoRA setting and keeps the learning rate transferable
# when r changes by small factors. Dropout is 0 on purpose: the old log-probs come from an eval-mode pass
# and the update from a train-mode pass, and with dropout the ratio at the first mini-batch would not be 1.
DEFAULT_LORA_R = 16
DEFAULT_LORA_ALPHA = 32
DEFAULT_LORA_DROPOUT = 0.0
DEFAULT_TARGET_MODULES = "all-linear"

# Score-head keys written by PEFT for a SEQ_CLS adapter (modules_to_save): the head is ``score`` (Llama,
# Qwen2, GPT-NeoX, Mistral, ...) or ``classifier``; some PEFT versions keep the
# ``modules_to_save.<adapter>`` infix.
_HEAD_KEY = re.compile(
    r"^base_model\.model\.(?P<head>score|classifier)(?:\.modules_to_save\.[^.]+)?\.(?P<part>weight|bias)$"
)
_LORA_KEY = re.compile(
    r"^base_model\.model\.(?P<module>.+)\.(?P<part>lora_A|lora_B|lora_embedding_A|lora_embedding_B)\.weight$"
)


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


def default_compute_dtype() -> torch.dtype:
    """bfloat16 on CUDA, float32 elsewhere (CPU bf16 matmuls are slow and imprecise)."""
    return torch.bfloat16 if torch.cuda.is_available() else torch.float32


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


@dataclass
class RewardHeadInfo:
    """What was read from a reward adapter's score head."""

    key: str
    num_labels: int
    has_bias: bool


class MultiAdapterModel:
    """The policy, the reference and the reward as adapter views of ONE base causal LM.

    Build it with :meth:`from_pretrained`. The underlying ``peft.PeftModel`` is :attr:`peft_model`; the
    optimizer gets :meth:`policy_parameters`. The model starts in eval mode; call ``model.train()`` before
    an update so that gradient checkpointing (if enabled) is active.

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
        reward_head_info: RewardHeadInfo | None = None,
    ) -> None:
        self.peft_model = peft_model
        self.name_or_path = name_or_path
        self.quantization = quantization
        self.dtype = dtype
        self.reference_mode = reference_mode
        self._policy_parameters = policy_parameters
        self.score_head = score_head
        self.reward_head_info = reward_head_info

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
                (LLM.int8), through bitsandbytes. Quantized bases go through
                ``prepare_model_for_kbit_training`` before the policy adapter is attached.
            reward_adapter: a PEFT directory written by TRL's ``RewardTrainer`` with a LoRA ``peft_config``
                (task ``SEQ_CLS``: LoRA on inner layers + score head). Optional: without it,
                :meth:`compute_reward_score` is unavailable and rewards must come from elsewhere.
            policy_adapter: ``None`` (fresh LoRA, see :func:`default_policy_lora_config`), a
                ``LoraConfig``, or a PEFT adapter directory to continue training (loaded trainable).
            reference: ``"base"`` (adapters disabled), ``"initial-policy"`` (frozen copy of the policy
                adapter's starting weights) or ``"auto"``: base when the policy starts as the identity
                (fresh LoRA with zero-initialised B), initial-policy otherwise (e.g. an SFT adapter).
            dtype: compute dtype; default bfloat16 on CUDA, float32 on CPU.
            device_map: passed to ``from_pretrained``; default: the current CUDA device if there is one,
                else CPU.
            gradient_checkpointing: recompute activations in the backward pass (non-reentrant) to save
                memory; active in train mode.
            allow_pickle: accept adapters stored only as pickled ``adapter_model.bin`` (unpickling can run
                code, so only for sources you trust).
            trust_remote_code: passed to ``from_pretrained``.

        Example:
            >>> model = MultiAdapterModel.from_pretrained("smollm2-135m-instruct", quantization="4bit")
            >>> model.reference_mode
            'base'
        """
        if quantization not in QUANTIZATION_MODES:
            raise ValueError(f"quantization must be one of {QUANTIZATION_MODES}, got {quantization!r}")
        if reference not in REFERENCE_MODES:
            raise ValueError(f"reference must be one of {REFERENCE_MODES}, got {reference!r}")
        if policy_adapter is not None and not isinstance(policy_adapter, (LoraConfig, str, os.PathLike)):
            raise TypeError(
                "policy_adapter must be None (fresh LoRA), a peft.LoraConfig, or a PEFT adapter directory; "
                f"got {type(policy_adapter).__name__}"
            )
        # Validate adapter directories before the (possibly slow) base load.
        policy_dir = None
        if isinstance(policy_adapter, (str, os.PathLike)):
            policy_dir = Path(policy_adapter)
            policy_config = _read_adapter_config(policy_dir, role="policy")
            _adapter_weights_file(policy_dir, allow_pickle=allow_pickle, role="policy")
            if str(policy_config.get("task_type")) == "SEQ_CLS":
                raise ValueError(
                    f"policy_adapter {policy_dir} is a sequence-classification (reward) adapter; pass it as "
                    "reward_adapter=..., and give policy_adapter a causal-LM adapter or None for a fresh LoRA"
                )
        reward_dir = None
        if reward_adapter is not None:
            reward_dir = Path(reward_adapter)
            _read_adapter_config(reward_dir, role="reward")
            _adapter_weights_file(reward_dir, allow_pickle=allow_pickle, role="reward")

        from marl.assets import resolve_model_path

        path = resolve_model_path(str(model_name_or_path))
        compute_dtype = dtype or default_compute_dtype()
        if device_map is None and torch.cuda.is_available():
            device_map = {"": torch.cuda.current_device()}
        load_kwargs: dict[str, Any] = {"dtype": compute_dtype, "trust_remote_code": trust_remote_code}
        if device_map is not None:
            load_kwargs["device_map"] = device_map
        if quantization == "4bit":
            load_kwargs["quantization_config"] = BitsAndBytesConfig(
                load_in_4bit=True,
                bnb_4bit_quant_type="nf4",
                bnb_4bit_use_double_quant=True,
                bnb_4bit_compute_dtype=compute_dtype,
            )
        elif quantization == "8bit":
            load_kwargs["quantization_config"] = BitsAndBytesConfig(load_in_8bit=True)
        base = AutoModelForCausalLM.from_pretrained(path, **load_kwargs)

        if quantization == "4bit":
            _keep_4bit_layers_differentiable_on_cpu(base)
        if quantization == "8bit":
            _silence_int8_cast_notice()
        if quantization is not None:
            # Freezes the base and upcasts its non-quantized parameters (norms, embeddings) to float32.
            base = prepare_model_for_kbit_training(base, use_gradient_checkpointing=False)
        else:
            base.requires_grad_(False)
        if gradient_checkpointing:
            # Non-reentrant checkpointing needs no input-gradient hook, for quantized and plain bases alike.
            base.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})

        # Policy adapter (trainable).
        if policy_dir is not None:
            peft_model = PeftModel.from_pretrained(
                base, str(policy_dir), adapter_name=cls.POLICY_ADAPTER, is_trainable=True
            )
            starts_as_identity = False
        else:
            lora_config = (
                copy.deepcopy(policy_adapter) if policy_adapter is not None else default_policy_lora_config()
            )
            if lora_config.task_type is None:
                lora_config.task_type = "CAUSAL_LM"
            lora_config.inference_mode = False
            peft_model = get_peft_model(base, lora_config, adapter_name=cls.POLICY_ADAPTER)
            starts_as_identity = lora_config.init_lora_weights in (True, "gaussian")
        policy_parameters = [p for p in peft_model.parameters() if p.requires_grad]
        if not policy_parameters:
            raise ValueError("the policy adapter has no trainable parameters; check its target_modules")

        reference_mode = reference
        if reference == "auto":
            reference_mode = "base" if starts_as_identity else "initial-policy"
        if reference_mode == "initial-policy":
            _add_frozen_copy(peft_model, cls.POLICY_ADAPTER, cls.REFERENCE_ADAPTER)

        score_head = None
        head_info = None
        if reward_dir is not None:
            score_head, head_info = _attach_reward_adapter(
                peft_model,
                reward_dir,
                cls.REWARD_ADAPTER,
                compute_dtype,
                base_path=path,
                allow_pickle=allow_pickle,
            )

        # Only the policy trains: adding adapters may have flipped requires_grad flags.
        policy_ids = {id(p) for p in policy_parameters}
        for parameter in peft_model.parameters():
            parameter.requires_grad_(id(parameter) in policy_ids)
        peft_model.set_adapter(cls.POLICY_ADAPTER)
        peft_model.eval()
        return cls(
            peft_model,
            name_or_path=path,
            quantization=quantization,
            dtype=compute_dtype,
            reference_mode=reference_mode,
            policy_parameters=policy_parameters,
            score_head=score_head,
            reward_head_info=head_info,
        )

    # ------------------------------------------------------------------ attributes

    @property
    def config(self):
        """The base model's ``transformers`` config."""
        return self.peft_model.get_base_model().config

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

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        base = self.peft_model.get_base_model()
        logits = base.get_output_embeddings()(hidden)
        softcap = getattr(self.config, "final_logit_softcapping", None)
        if softcap:
            logits = torch.tanh(logits / softcap) * softcap
        return logits

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
            logits = self._logits(flat_hidden[start : start + step])
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
        """One float32 score per row: the score head on the hidden state at the last real token, under
        ``reward``.

        The last real token is the last position with ``attention_mask == 1`` (left or right padding). The
        attention mask decides, not ``pad_token_id``: when pad == eos, an EOS that ends a completion is a real
        token (mask 1) and the score is read AT the EOS. (A transformers SequenceClassification model finds
        the last token from ``input_ids != pad_token_id`` and would read one token earlier in that case.)
        Runs in eval mode without grad; the active adapter and modes are restored after.

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
            last = last_token_index(attention_mask).to(hidden.device)
            pooled = hidden[rows, last].to(
                device=self.score_head.weight.device, dtype=self.score_head.weight.dtype
            )
            return self.score_head(pooled).squeeze(-1).float()

    def generate(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, **generation_kwargs: Any
    ) -> torch.Tensor:
        """``generate`` under the policy, in eval mode, without grad. Returns prompt + completion ids.

        Example:
            >>> out = model.generate(ids, mask, max_new_tokens=16, do_sample=True, temperature=0.7)
        """
        with self.policy(), self._inference():
            return self.peft_model.generate(
                input_ids=input_ids, attention_mask=attention_mask, **generation_kwargs
            )

    def save_policy_adapter(self, directory: str | os.PathLike) -> None:
        """Write the policy adapter alone as a standard PEFT directory (``adapter_config.json`` +
        ``adapter_model.safetensors``), loadable with ``PeftModel.from_pretrained(base, directory)``.

        Example:
            >>> model.save_policy_adapter("runs/final-adapter")
        """
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        state = get_peft_model_state_dict(self.peft_model, adapter_name=self.POLICY_ADAPTER)
        state = {key: tensor.detach().to("cpu").contiguous() for key, tensor in state.items()}
        save_file(state, str(directory / SAFETENSORS_WEIGHTS_NAME), metadata={"format": "pt"})
        config = copy.deepcopy(self.peft_model.peft_config[self.POLICY_ADAPTER])
        config.inference_mode = True
        config.base_model_name_or_path = self.name_or_path
        config.save_pretrained(str(directory))

    def memory_report(self) -> MemoryReport:
        """What each part costs in memory, and what separate model copies would cost (the "memory card").

        Example:
            >>> print(model.memory_report())
        """
        from marl.memory import build_memory_report

        return build_memory_report(self)


# ---------------------------------------------------------------------- adapter helpers


class _DropInt8CastNotice(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("MatMul8bitLt: inputs will be cast")


def _silence_int8_cast_notice() -> None:
    """LLM.int8 computes in float16 and logs that it casts the inputs, on every layer of every forward. The
    cast is the documented behaviour of 8-bit mode, so the notice is dropped (once per process)."""
    logger = logging.getLogger("bitsandbytes.autograd._functions")
    if not any(isinstance(f, _DropInt8CastNotice) for f in logger.filters):
        logger.addFilter(_DropInt8CastNotice())


def _keep_4bit_layers_differentiable_on_cpu(model: nn.Module) -> None:
    """Stop bitsandbytes from repacking 4-bit weights into its CPU inference layout.

    On CPUs with AVX512-BF16, the first eval-mode no-grad forward of a ``Linear4bit`` repacks its weight
    for a fast inference kernel and keeps it that way; later forwards then use that kernel, which has no
    backward (gradients to earlier layers are lost, and a layer with a bias fails). Here every view of the
    one base is used both for scoring (no grad) and for the policy update (grad), so the repacking must not
    happen.
    """
    import bitsandbytes as bnb

    for module in model.modules():
        if isinstance(module, bnb.nn.Linear4bit):
            module.support_avx512bf16_for_cpu = False


def _read_adapter_config(directory: Path, *, role: str) -> dict[str, Any]:
    if not directory.exists():
        raise FileNotFoundError(
            f"{role} adapter directory {directory} does not exist; pass the directory that "
            "save_pretrained / RewardTrainer.save_model wrote"
        )
    if not directory.is_dir():
        raise NotADirectoryError(
            f"{role} adapter {directory} is a file; pass the adapter's directory instead"
        )
    config_file = directory / ADAPTER_CONFIG_NAME
    if not config_file.is_file():
        raise ValueError(
            f"{directory} is not a PEFT adapter: it has no {ADAPTER_CONFIG_NAME}. Save the {role} model "
            f"with a "
            "peft LoraConfig (e.g. RewardTrainer(..., peft_config=LoraConfig(task_type='SEQ_CLS')))"
        )
    with config_file.open() as handle:
        config = json.load(handle)
    if config.get("peft_type") != "LORA":
        raise ValueError(
            f"{role} adapter {directory} is a {config.get('peft_type')!r} adapter; only LoRA adapters are "
            f"supported"
        )
    return config


def _adapter_weights_file(directory: Path, *, allow_pickle: bool, role: str) -> Path:
    safetensors_file = directory / SAFETENSORS_WEIGHTS_NAME
    if safetensors_file.is_file():
        return safetensors_file
    pickle_file = directory / PICKLE_WEIGHTS_NAME
    if pickle_file.is_file():
        if not allow_pickle:
            raise ValueError(
                f"{role} adapter {directory} only has pickled weights ({PICKLE_WEIGHTS_NAME}); loading a "
                f"pickle can "
                "run arbitrary code. Re-save it as safetensors, or pass allow_pickle=True if you trust its "
                "source"
            )
        return pickle_file
    raise ValueError(
        f"{role} adapter {directory} has {ADAPTER_CONFIG_NAME} but no weights ({SAFETENSORS_WEIGHTS_NAME}); "
        "the save did not finish or the directory was copied partially"
    )


def _load_adapter_state(weights_file: Path) -> dict[str, torch.Tensor]:
    if weights_file.suffix == ".safetensors":
        return load_file(str(weights_file), device="cpu")
    return torch.load(weights_file, map_location="cpu", weights_only=True)


def _add_frozen_copy(peft_model: PeftModel, source: str, target: str) -> None:
    """Add adapter ``target`` holding the exact current weights of adapter ``source``."""
    config = copy.deepcopy(peft_model.peft_config[source])
    config.inference_mode = True
    # The copy's initial values are overwritten below; an initialisation that rewrites base weights (PiSSA,
    # ...) must not run a second time.
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
    adapter_name: str,
    dtype: torch.dtype,
    *,
    base_path: str,
    allow_pickle: bool,
) -> tuple[nn.Linear, RewardHeadInfo]:
    """Validate a SEQ_CLS reward adapter, load its LoRA into ``peft_model`` and its head into a frozen
    Linear."""
    raw_config = _read_adapter_config(directory, role="reward")
    state = _load_adapter_state(_adapter_weights_file(directory, allow_pickle=allow_pickle, role="reward"))
    base = peft_model.get_base_model()
    hidden_size = base.get_output_embeddings().weight.shape[1]

    head_tensors: dict[str, torch.Tensor] = {}
    head_keys: list[str] = []
    for key in state:
        match = _HEAD_KEY.match(key)
        if match:
            if match["part"] in head_tensors:
                raise ValueError(
                    f"reward adapter {directory} has two score-head {match['part']}s: {[*head_keys, key]}"
                )
            head_tensors[match["part"]] = state[key]
            head_keys.append(key)
    if "weight" not in head_tensors:
        raise ValueError(
            f"reward adapter {directory} has no score head (no key like 'base_model.model.score.weight'). A "
            f"reward "
            "adapter must be trained as a sequence classifier: LoraConfig(task_type='SEQ_CLS') saves the "
            "head "
            "through modules_to_save"
        )
    weight = head_tensors["weight"]
    if weight.dim() != 2 or weight.shape[1] != hidden_size:
        raise ValueError(
            f"reward adapter {directory}: score head has shape {tuple(weight.shape)} but this base has "
            f"hidden size "
            f"{hidden_size}; the adapter was trained on a different base model. Load it with the base it was "
            f"trained on ({raw_config.get('base_model_name_or_path')!r})"
        )
    num_labels = weight.shape[0]
    if num_labels not in (1, 2):
        raise ValueError(
            f"reward adapter {directory}: score head has {num_labels} labels; a reward model has 1 (or 2, "
            f"where "
            "the last label is read as 'preferred')"
        )
    if num_labels == 2:
        warnings.warn(
            f"reward adapter {directory} has a 2-label head; using the last label's logit as the reward",
            stacklevel=3,
        )
    bias = head_tensors.get("bias")

    recorded_base = raw_config.get("base_model_name_or_path")
    if recorded_base and not _same_model(recorded_base, base_path):
        warnings.warn(
            f"reward adapter {directory} was trained on {recorded_base!r} but is loaded on {base_path!r}; "
            f"its "
            "scores are only meaningful on the base it was trained on",
            stacklevel=3,
        )

    lora_state = {key: tensor for key, tensor in state.items() if key not in head_keys}
    _check_lora_targets(base, lora_state, directory)

    config = LoraConfig.from_pretrained(str(directory))
    config.task_type = "CAUSAL_LM"
    config.modules_to_save = None
    config.inference_mode = True
    peft_model.add_adapter(adapter_name, config)
    result = set_peft_model_state_dict(peft_model, lora_state, adapter_name=adapter_name)
    if result.unexpected_keys:
        raise ValueError(
            f"reward adapter {directory}: weights that match no module of this base: "
            f"{result.unexpected_keys[:5]}"
        )
    missing = [key for key in result.missing_keys if f".{adapter_name}." in key and "lora_" in key]
    if missing:
        raise ValueError(
            f"reward adapter {directory} is incomplete: no weights for {missing[:5]}; re-save it"
        )
    for name, parameter in peft_model.named_parameters():
        if f".{adapter_name}." in name:
            parameter.data = parameter.data.to(dtype)
            parameter.requires_grad_(False)

    head = nn.Linear(
        hidden_size, 1, bias=bias is not None, dtype=dtype, device=base.get_output_embeddings().weight.device
    )
    with torch.no_grad():
        head.weight.copy_(weight[-1:])
        if bias is not None:
            head.bias.copy_(bias.reshape(-1)[-1:])
    head.requires_grad_(False)
    head.eval()
    return head, RewardHeadInfo(key=head_keys[0], num_labels=num_labels, has_bias=bias is not None)


def _same_model(recorded: str, loaded: str) -> bool:
    if recorded == loaded:
        return True
    recorded_path, loaded_path = Path(recorded), Path(loaded)
    if recorded_path.exists() and loaded_path.exists():
        return recorded_path.resolve() == loaded_path.resolve()
    return recorded_path.name == loaded_path.name


def _check_lora_targets(base: nn.Module, lora_state: dict[str, torch.Tensor], directory: Path) -> None:
    """Every LoRA tensor must land on an existing Linear of this base with matching in/out features."""
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
            raise ValueError(
                f"reward adapter {directory}: {key} expects {tensor.shape[1]} input features but "
                f"{match['module']} has {in_features}; the adapter was trained on a different base model"
            )
        if match["part"] == "lora_B" and out_features is not None and tensor.shape[0] != out_features:
            raise ValueError(
                f"reward adapter {directory}: {key} expects {tensor.shape[0]} output features but "
                f"{match['module']} has {out_features}; the adapter was trained on a different base model"
            )
    if missing:
        raise ValueError(
            f"reward adapter {directory} targets modules that do not exist in this base: "
            f"{sorted(set(missing))[:5]}; "
            "it was trained on a different architecture. Load it with the base it was trained on"
        )
