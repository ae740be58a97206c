"""One base model hosting the policies, their references and the rewards as views: ``MultiAdapterModel``.

PPO-style RLHF keeps four models in memory (policy, reference, reward, value); RLOO needs no value model,
and here the other three share ONE set of base weights (optionally 4-bit NF4 or 8-bit through bitsandbytes):

* a policy    = base + a trainable LoRA adapter (``"policy"`` by default; any number of named policies)
* its reference = base with adapters disabled, or a frozen copy ``"<policy>-reference"`` of its starting
  adapter
* a reward    = base + a frozen LoRA adapter (``"reward"`` by default; any number of named ones) + its frozen
  float32 score head ``Linear(hidden, 1)``

Views are switched with nestable context managers (:mod:`marl.model.views`); log-probs, reward scores and
sampling run under the active view (:mod:`marl.model.forward`). Building the model (:mod:`marl.model.build`)
reads and checks every adapter before the base loads and refuses anything that would move the shared base.

Example:
    >>> model = MultiAdapterModel.from_pretrained(  # doctest: +SKIP
    ...     "smollm2-135m-instruct", quantization="4bit", reward_adapter="adapters/sentiment-reward")
    >>> scores = model.compute_reward_score(input_ids, attention_mask)  # doctest: +SKIP
    >>> with model.reference():  # doctest: +SKIP
    ...     ref_logprobs = model.token_logprobs(input_ids, attention_mask, response_start=prompt_len)
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from peft import LoraConfig

# process_memory reads the process's memory after the imports above, before any model loads: the baseline of
# the measured peaks the run logs beside its memory plan.
from marl.model import adapters, build, process_memory, records  # noqa: F401
from marl.model.forward import (
    ForwardPasses,
    enable_gradient_checkpointing,
    position_ids_from_mask,
    reward_read_positions,
    without_autocast,
)
from marl.model.memory import MemoryReport, build_memory_report
from marl.model.packing import check_packing
from marl.model.records import LoadedModel, PolicyAdapter, RewardAdapter

if TYPE_CHECKING:
    from marl.config.rloo_config import RLOOConfig

__all__ = ["MultiAdapterModel", "position_ids_from_mask", "reward_read_positions", "without_autocast"]


class MultiAdapterModel(ForwardPasses):
    """Policies, their references and rewards as adapter views of ONE base causal LM.

    Build it with :meth:`from_pretrained` (or :meth:`from_config`); add more adapters with :meth:`add_policy`
    and :meth:`add_reward_adapter`. The underlying ``peft.PeftModel`` is :attr:`peft_model`; an optimizer gets
    :meth:`policy_parameters`. The model starts in eval mode; call ``model.train()`` before an update so that
    gradient checkpointing (if enabled) is active. Every dropout is off: the rollout and the update must
    compute the same function. Every policy's tensors are trainable, always (a view never flips a flag); an
    optimizer over one policy's parameters leaves the others bit-identical.

    Example:
        >>> model = MultiAdapterModel.from_pretrained("base", reward_adapter="reward")  # doctest: +SKIP
        >>> with model.use_adapter("reward"):  # doctest: +SKIP
        ...     ...
    """

    def __init__(self, loaded: LoadedModel):
        self.peft_model = loaded.peft_model
        self.name_or_path = loaded.name_or_path
        self.quantization = loaded.quantization
        self.dtype = loaded.dtype
        self.logit_head = loaded.logit_head
        self.policies: dict[str, PolicyAdapter] = dict(loaded.policies)
        self.rewards: dict[str, RewardAdapter] = dict(loaded.rewards)

    # ------------------------------------------------------------------ building

    @classmethod
    def from_pretrained(
        cls,
        model_name_or_path: str | os.PathLike,
        *,
        quantization: str | None = None,
        reward_adapter: str | os.PathLike | None = None,
        reward_adapters: Mapping[str, str | os.PathLike] | None = None,
        policy_adapter: LoraConfig | str | os.PathLike | None = None,
        policy_name: str = records.DEFAULT_POLICY,
        reference: str = "auto",
        dtype: torch.dtype | None = None,
        device_map: str | dict[str, Any] | torch.device | None = None,
        gradient_checkpointing: bool = False,
        allow_pickle: bool = False,
        trust_remote_code: bool = False,
    ) -> MultiAdapterModel:
        """Load a causal LM once and attach a policy (trainable), its reference and the rewards (frozen).

        Args:
            model_name_or_path: a local model folder, a hub id already in the local cache, or the embedded
                model id ``"smollm2-135m-instruct"`` (see ``marl.data.assets.resolve_model_path``).
            quantization: ``None`` (compute dtype), ``"4bit"`` (NF4 with double quantization) or ``"8bit"``
                (LLM.int8), through bitsandbytes (see :mod:`marl.model.quantization`).
            reward_adapter: a PEFT folder written by TRL's ``RewardTrainer`` with a LoRA ``peft_config``
                (task ``SEQ_CLS``: LoRA on inner layers + score head), or by ``marl train-reward``; it becomes
                the reward adapter ``"reward"``. Optional: rewards may come from functions instead.
            reward_adapters: several reward adapters by name, ``{"sentiment": DIR1, "fluency": DIR2}``
                (instead of ``reward_adapter``).
            policy_adapter: ``None`` (fresh LoRA, see :func:`marl.config.model.policy_lora_config`), a
                ``LoraConfig``, or a PEFT adapter folder to continue training (loaded trainable). A fresh LoRA
                draws its initial weights from torch's generator: seed it first (``transformers.set_seed``;
                :meth:`from_config` does) for a run that can be repeated.
            policy_name: the name of that policy (more can be added with :meth:`add_policy`).
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
        bad adapter folders, and names that are reserved or used twice. Refused after loading: a model whose
        forward computes its logits in a way marl does not reproduce, or that computes differently in train
        and eval mode with dropout off, or whose rotary frequencies depend on the batch (dynamic NTK,
        longrope).

        Example:
            >>> model = MultiAdapterModel.from_pretrained("smollm2-135m-instruct")  # doctest: +SKIP
            >>> model.reference_mode  # doctest: +SKIP
            'base'
        """
        loaded = build.load(
            model_name_or_path,
            quantization=quantization,
            policy_adapter=policy_adapter,
            policy_name=policy_name,
            reference=reference,
            reward_adapters=records.named_reward_adapters(reward_adapter, reward_adapters),
            dtype=dtype,
            device_map=device_map,
            gradient_checkpointing=gradient_checkpointing,
            allow_pickle=allow_pickle,
            trust_remote_code=trust_remote_code,
        )
        return cls(loaded)

    @classmethod
    def from_config(cls, config: RLOOConfig, **overrides: Any) -> MultiAdapterModel:
        """The model that ``config``'s model fields describe, built after seeding every random generator with
        ``config.seed``: a fresh policy LoRA draws its initial weights from them, so the same config builds
        the same policy (a run started again from the beginning starts from the same weights). The compute
        dtype follows the mixed-precision flag (without one, the default of :mod:`marl.model.quantization`).

        ``overrides`` go to :meth:`from_pretrained` (e.g. ``device_map=...``).

        Example:
            >>> config = RLOOConfig(model_name_or_path="path/to/base", quantization="4bit")  # doctest: +SKIP
            >>> model = MultiAdapterModel.from_config(config)  # doctest: +SKIP
        """
        from accelerate.utils import set_seed

        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(config.mixed_precision)
        arguments: dict[str, Any] = dict(
            quantization=config.quantization,
            reward_adapters=config.reward_adapter_folders(),
            policy_adapter=config.policy_adapter
            if config.policy_adapter is not None
            else config.policy_lora_config(),
            policy_name=config.policy_adapter_name,
            reference=config.reference,
            dtype=dtype,
        )
        arguments.update(overrides)
        set_seed(config.seed)
        return cls.from_pretrained(config.model_name_or_path, **arguments)

    def add_policy(
        self,
        name: str,
        adapter: LoraConfig | str | os.PathLike | None = None,
        *,
        reference: str = "auto",
        allow_pickle: bool = False,
    ) -> PolicyAdapter:
        """Add a trainable policy ``name``: a fresh LoRA (``None`` or a ``LoraConfig``) or a saved adapter
        folder, with its own reference (as in :meth:`from_pretrained`).

        Example:
            >>> model.add_policy("negative")  # doctest: +SKIP
            >>> with model.policy("negative"):  # doctest: +SKIP
            ...     ...
        """
        policy = build.attach_policy(
            self.peft_model,
            name,
            adapter,
            reference=reference,
            allow_pickle=allow_pickle,
            policies=self.policies,
        )
        self.policies[name] = policy
        return policy

    def add_reward_adapter(
        self, name: str, directory: str | os.PathLike, *, allow_pickle: bool = False
    ) -> RewardAdapter:
        """Add a frozen reward adapter ``name`` (LoRA + score head) from a PEFT ``SEQ_CLS`` folder.

        Example:
            >>> model.add_reward_adapter("fluency", "adapters/fluency-reward")  # doctest: +SKIP
        """
        reward = build.attach_reward_adapter(
            self.peft_model,
            name,
            directory,
            allow_pickle=allow_pickle,
            base_name_or_path=self.name_or_path,
            dtype=self.dtype,
            policies=self.policies,
        )
        self.rewards[name] = reward
        return reward

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

    @functools.cached_property
    def packing_problem(self) -> str | None:
        """Why this model cannot compute a prompt once for its completions (:mod:`marl.model.packing`), or
        ``None`` when it can; probed once."""
        return check_packing(self)

    def enable_gradient_checkpointing(self) -> None:
        """Recompute activations in the backward pass (non-reentrant, with no input-gradient hook:
        :func:`marl.model.forward.enable_gradient_checkpointing`); active in train mode."""
        enable_gradient_checkpointing(self.peft_model.get_base_model())

    def save_policy_adapter(self, directory: str | os.PathLike, name: str | None = None) -> None:
        """Write policy ``name`` (default: the first) alone as a standard PEFT folder
        (``adapter_config.json`` + ``adapter_model.safetensors``), loadable with
        ``PeftModel.from_pretrained(base, directory)``.

        Example:
            >>> model.save_policy_adapter("runs/final-adapter")  # doctest: +SKIP
        """
        adapters.save_adapter(self.peft_model, self.get_policy(name).name, Path(directory), self.name_or_path)

    def memory_report(self, policy: str | Sequence[str] | None = None) -> MemoryReport:
        """What each part costs in memory, and what separate model copies would cost (the "memory card"),
        with the training state of ``policy`` (default: the first policy), or of several policies trained
        together.

        Example:
            >>> print(model.memory_report())  # doctest: +SKIP
        """
        return build_memory_report(self, policy)
