"""One base model hosting the policies, their references and the rewards as views: ``MultiAdapterModel``.

PPO-style RLHF keeps four models in memory (policy, reference, reward, value); RLOO needs no value model,
and here the other three share ONE set of base weights (optionally 4-bit NF4 or 8-bit through bitsandbytes):

* a policy = base + a trainable LoRA adapter (``"policy"`` by default; any number of named policies)
* its reference = base with adapters disabled, or a frozen copy ``"<policy>-reference"`` of its start
* a reward = base + a frozen LoRA adapter (``"reward"`` by default; any number) + a float32 score head

Views are nestable context managers that restore everything they change on exit; log-probs, reward scores
and sampling run under the active view (:mod:`marl.model.forward`). Loading (:mod:`marl.model.loading`) reads
and checks every adapter before the base loads and refuses anything that would move the shared base.

Example:
    >>> model = MultiAdapterModel.from_pretrained(  # doctest: +SKIP
    ...     "smollm2-135m-instruct", quantization="4bit", reward_adapter="adapters/sentiment-reward")
    >>> scores = model.compute_reward_score(input_ids, attention_mask)  # doctest: +SKIP
    >>> with model.reference():  # doctest: +SKIP
    ...     ref_logprobs = model.token_logprobs(input_ids, attention_mask, response_start=prompt_len)
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Self

import torch
from peft import LoraConfig
from torch import nn

from marl.errors import ConfigError

# process_memory reads the process's memory here, after torch and peft, before any model: the peaks' baseline
from marl.model import adapters, loading, process_memory  # noqa: F401
from marl.model.adapters import BASE_VIEW, REFERENCE_VIEW, PolicyAdapter, RewardAdapter
from marl.model.families import LogitHead
from marl.model.forward import (
    adapter_view,
    adapters_disabled,
    enable_gradient_checkpointing,
    hidden_states,
    inference,
    logprobs_from_hidden,
    reward_scores,
)
from marl.model.loading import LoadedModel
from marl.model.memory import MemoryReport, build_memory_report
from marl.model.rows import (
    PackedRows,
    RowRoutes,
    check_packing,
    check_row_adapters,
    route_rows,
    routing_problem,
)
from marl.model.sampling import SamplingSettings, sample, sample_static

if TYPE_CHECKING:
    from marl.config.rloo_config import RLOOConfig


class MultiAdapterModel:
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
        self.logit_head: LogitHead = loaded.logit_head
        self.policies: dict[str, PolicyAdapter] = dict(loaded.policies)
        self.rewards: dict[str, RewardAdapter] = dict(loaded.rewards)

    @classmethod
    def from_pretrained(
        cls,
        model_name_or_path: str | os.PathLike,
        *,
        quantization: str | None = None,
        reward_adapter: str | os.PathLike | None = None,
        reward_adapters: Mapping[str, str | os.PathLike] | None = None,
        policy_adapter: LoraConfig | str | os.PathLike | None = None,
        policy_name: str = adapters.DEFAULT_POLICY,
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
        loaded = loading.load(
            model_name_or_path,
            quantization=quantization,
            policy_adapter=policy_adapter,
            policy_name=policy_name,
            reference=reference,
            reward_adapters=adapters.named_reward_adapters(reward_adapter, reward_adapters),
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
        policy = loading.attach_policy(
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
        reward = loading.attach_reward_adapter(
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
    def adapter_names(self) -> list[str]:
        """Names of every adapter on the base: policies, reference copies, reward adapters."""
        return list(self.peft_model.peft_config)

    @property
    def default_policy(self) -> str:
        """The first policy: what :meth:`policy`, :meth:`reference` and friends use without a name."""
        return next(iter(self.policies))

    @property
    def has_reward_adapter(self) -> bool:
        return bool(self.rewards)

    @property
    def reference_mode(self) -> str:
        """How the default policy's reference is built: ``"base"`` or ``"initial-policy"``."""
        return self.policies[self.default_policy].reference_mode

    def get_policy(self, name: str | None) -> PolicyAdapter:
        name = self.default_policy if name is None else name
        if name not in self.policies:
            raise ConfigError(f"no policy named {name!r} on this model; its policies: {list(self.policies)}")
        return self.policies[name]

    def get_reward(self, name: str | None) -> RewardAdapter:
        if not self.rewards:
            raise ConfigError(
                "no reward adapter is loaded; pass reward_adapter=<PEFT folder from RewardTrainer> to "
                "from_pretrained, or compute rewards with a reward function"
            )
        name = next(iter(self.rewards)) if name is None else name
        if name not in self.rewards:
            raise ConfigError(
                f"no reward adapter named {name!r}; loaded reward adapters: {list(self.rewards)}"
            )
        return self.rewards[name]

    def policy_parameters(self, name: str | None = None) -> list[nn.Parameter]:
        """The trainable tensors of policy ``name`` (default: the first policy): what an optimizer gets.

        Example:
            >>> optimizer = torch.optim.AdamW(model.policy_parameters(), lr=1e-5)  # doctest: +SKIP
        """
        return list(self.get_policy(name).parameters)

    def train(self, mode: bool = True) -> Self:
        """Put the model in train mode (for gradient checkpointing during updates). Returns ``self``."""
        self.peft_model.train(mode)
        return self

    def eval(self) -> Self:
        """Put the model in eval mode. Returns ``self``."""
        return self.train(False)

    @functools.cached_property
    def packing_problem(self) -> str | None:
        """Why this model cannot compute a prompt once for its completions (:mod:`marl.model.rows`), or
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

    @property
    def gradient_checkpointing(self) -> bool:
        """Whether activations are recomputed in the backward pass (in train mode)."""
        return bool(self.peft_model.get_base_model().is_activation_checkpointing)

    # ------------------------------------------------------------------ views

    def _adapters_disabled(self) -> bool:
        return adapters_disabled(self.peft_model)

    @contextlib.contextmanager
    def _view(self, adapter_name: str | None) -> Iterator[Self]:
        """Activate ``adapter_name`` (``None``: adapters disabled) and restore everything on exit."""
        with adapter_view(self.peft_model, adapter_name):
            yield self

    def use_adapter(self, name: str) -> contextlib.AbstractContextManager[Self]:
        """Context manager: run the body with adapter ``name`` active (``"policy"``, ``"reward"``,
        ``"reference"``).

        Nestable; on exit (also on an exception) the previous active adapter, every parameter's
        ``requires_grad`` and every module's train/eval mode are restored exactly. ``requires_grad`` is not
        changed inside either: only the policy adapter ever trains.

        Example:
            >>> with model.use_adapter("reward"):  # doctest: +SKIP
            ...     hidden = model.peft_model(input_ids).logits
        """
        if name not in self.peft_model.peft_config:
            raise ConfigError(f"no adapter named {name!r}; loaded adapters: {self.adapter_names}")
        return self._view(name)

    def reference(self, policy: str | None = None) -> contextlib.AbstractContextManager[Self]:
        """Context manager: the reference of ``policy`` (default: the first policy): the base with adapters
        disabled, or the frozen copy of the policy's starting weights.

        Example:
            >>> with model.reference():  # doctest: +SKIP
            ...     ref_logprobs = model.token_logprobs(ids, mask, response_start=prompt_length)
        """
        return self._view(self.get_policy(policy).reference_adapter)

    def base(self) -> contextlib.AbstractContextManager[Self]:
        """Context manager: the base with adapters disabled, also where a policy's reference is its frozen
        starting copy.

        Example:
            >>> with model.base():  # doctest: +SKIP
            ...     base_logprobs = model.token_logprobs(ids, mask, response_start=prompt_length)
        """
        return self._view(None)

    def view(self, name: str) -> contextlib.AbstractContextManager[Self]:
        """Context manager: ``"policy"``, ``"reference"`` (however it is built), ``BASE_VIEW`` (the base,
        :meth:`base`) or any adapter name.

        Example:
            >>> with model.view("reference"):  # doctest: +SKIP
            ...     ref_logprobs = model.token_logprobs(ids, mask, response_start=prompt_length)
        """
        if name == adapters.DEFAULT_POLICY:
            return self.policy()
        if name == REFERENCE_VIEW:
            return self.reference()
        if name == BASE_VIEW:
            return self.base()
        if name in self.policies:
            return self.policy(name)
        return self.use_adapter(name)

    def policy(self, name: str | None = None) -> contextlib.AbstractContextManager[Self]:
        """Context manager: policy ``name`` (default: the first policy).

        Example:
            >>> with model.policy():  # doctest: +SKIP
            ...     logprobs = model.token_logprobs(ids, mask, response_start=prompt_length)
        """
        return self._view(self.get_policy(name).name)

    @contextlib.contextmanager
    def routed(self, row_adapters: Sequence[str] | RowRoutes, stacked: bool | None = None) -> Iterator[Self]:
        """Context manager: row ``i`` of every forward in the body runs through ``row_adapters[i]``, an
        adapter on the base (a policy, a reference copy, a reward adapter) or ``BASE_VIEW`` for the base
        alone, in train or eval mode, with gradients (:mod:`marl.model.rows`). Run the backward pass
        inside. A :class:`marl.model.rows.RowRoutes` is read at every forward (its first names are
        checked), so that the body may name other rows between passes. Restores what every view restores;
        which parameters train is not changed. ``stacked``: how the LoRA layers route
        (:func:`marl.model.rows.route_rows`; default: stacked on a GPU).

        Example:
            >>> reference = model.get_policy("negative").reference_adapter or BASE_VIEW  # doctest: +SKIP
            >>> with model.routed(["positive", "negative", reference]):  # doctest: +SKIP
            ...     logprobs = model.token_logprobs(ids, mask, response_start=8)
        """
        routes = row_adapters if isinstance(row_adapters, RowRoutes) else None
        names = check_row_adapters(routes.names if routes else row_adapters, self.adapter_names)
        problem = routing_problem(self.peft_model.get_base_model().config)
        if problem is not None:
            raise ConfigError(f"rows of several adapters cannot share a pass on this model: {problem}")
        # Any adapter active enables the adapter layers; the rows' names then decide what each row gets.
        active = next((name for name in names if name != BASE_VIEW), self.default_policy)
        with self._view(active), route_rows(self.peft_model, routes or names, stacked):
            yield self

    def _inference(self) -> contextlib.AbstractContextManager[None]:
        """Eval mode (no dropout) and no grad for the body; train/eval flags restored after."""
        return inference(self.peft_model)

    # ------------------------------------------------------------------ forward passes under the active view

    def _hidden_states(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        return hidden_states(self.peft_model, input_ids, attention_mask, position_ids)

    def _logprobs(
        self,
        hidden: torch.Tensor,
        targets: torch.Tensor,
        temperature: float,
        with_entropy: bool,
        chunk_size: int | None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Log-probs (and entropies) of ``targets`` ``[B, T]`` predicted by ``hidden`` ``[B, T, H]``."""
        batch, steps = targets.shape
        result = logprobs_from_hidden(
            hidden.reshape(batch * steps, -1),
            targets.reshape(-1).to(hidden.device),
            self.logit_head,
            temperature,
            chunk_size=chunk_size,
            with_entropy=with_entropy,
            # trading compute for memory: with checkpointing on, no chunk's logits wait for the backward pass
            recompute=self.gradient_checkpointing,
        )
        if with_entropy:
            return result[0].reshape(batch, steps), result[1].reshape(batch, steps)
        return result.reshape(batch, steps)

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
        time (default 1024), so no full ``[B, T, V]`` float32 tensor exists; with gradient checkpointing on,
        no chunk's logits are kept for the backward pass either
        (:func:`marl.model.forward.logprobs_from_hidden`). Gradients flow if grad is enabled. No masking is
        applied: the caller masks padding. Positions follow the attention mask (as ``generate``), so left
        padding does not shift them.

        Returns ``logprobs`` ``[B, T - response_start]``, and with ``with_entropy=True`` also the entropy
        of the temperature-scaled distribution at each of those positions (detached: it is a metric).

        Example:
            >>> with model.policy():  # doctest: +SKIP
            ...     logprobs = model.token_logprobs(ids, mask, response_start=8, temperature=0.7)
        """
        length = input_ids.shape[1]
        if not 0 < response_start < length:
            raise ValueError(
                f"response_start must be in [1, {length - 1}] for sequences of length {length}, got "
                f"{response_start}"
            )
        hidden = self._hidden_states(input_ids, attention_mask)[:, response_start - 1 : -1]
        return self._logprobs(hidden, input_ids[:, response_start:], temperature, with_entropy, chunk_size)

    def packed_token_logprobs(
        self,
        packed: PackedRows,
        *,
        temperature: float = 1.0,
        with_entropy: bool = False,
        chunk_size: int | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """:meth:`token_logprobs` of every completion of ``packed`` (rows grouped by prompt, see
        :mod:`marl.model.rows`): the same numbers up to float rounding, each prompt computed once. Returns
        ``[R, T]`` in the order the rows were packed in."""
        hidden = self._hidden_states(packed.input_ids, packed.attention_mask, packed.position_ids)
        flat = hidden.reshape(-1, hidden.shape[-1])
        targets = packed.input_ids.reshape(-1)[packed.completion_slots]
        return self._logprobs(flat[packed.predictors], targets, temperature, with_entropy, chunk_size)

    def compute_reward_score(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        name: str | None = None,
        packed: PackedRows | None = None,
    ) -> torch.Tensor:
        """One float32 score per row under reward adapter ``name`` (default: the first one): its score head
        on the final hidden state where a transformers sequence classifier reads it
        (:func:`marl.model.forward.reward_read_positions`), with the padding id the reward adapter was trained
        with.

        That padding id is the one ``marl train-reward`` recorded in the adapter folder, else the base
        tokenizer's pad token (its EOS when it has none), which is what TRL's ``RewardTrainer`` uses. With
        pad == eos a completion ending in EOS is therefore read at the token before its EOS, as the adapter
        was trained. Left or right padding: masked positions are padding. Runs in eval mode without grad; the
        active adapter and modes are restored after. The head runs in float32, under autocast too (the
        backbone keeps the caller's mixed precision). ``packed``: the same rows packed by prompt
        (:mod:`marl.model.rows`), to compute each prompt once; the scores are the same.

        Example:
            >>> scores = model.compute_reward_score(ids, mask)  # doctest: +SKIP
        """
        return reward_scores(self.peft_model, self.get_reward(name), input_ids, attention_mask, packed)

    def sample(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        settings: SamplingSettings,
        past_key_values: Any = None,
    ) -> torch.Tensor:
        """Sample completions from ``softmax(logits / temperature)`` under the ACTIVE view, in eval mode
        without grad; returns ``[batch, settings.max_new_tokens]`` completion ids. The model's own generation
        config (a repetition penalty, top-k, ...) does not apply: see :func:`marl.model.sampling.sample`.

        Example:
            >>> with model.policy():  # doctest: +SKIP
            ...     completions = model.sample(ids, mask, SamplingSettings(0.7, 16, (eos,), pad))
        """
        with self._inference():
            return sample(self.peft_model, input_ids, attention_mask, settings, past_key_values)

    def sample_static(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        settings: SamplingSettings,
        copies: int = 1,
        routes: RowRoutes | None = None,
        token_logprobs: list[torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """:meth:`sample` over a static KV cache, each prompt prefilled once for its ``copies`` samples
        (prompt-major rows, see :func:`marl.model.sampling.sample_static`), in eval mode without grad.
        ``routes``: inside :meth:`routed` with these routes, one name per prompt: each prompt's rows decode
        under its own adapter. ``token_logprobs``: receives each step's log-prob of the drawn tokens.

        Example:
            >>> with model.policy():  # doctest: +SKIP
            ...     rows = model.sample_static(ids, mask, SamplingSettings(0.7, 16, (eos,), pad), copies=4)
        """
        with self._inference():
            return sample_static(
                self.peft_model, input_ids, attention_mask, settings, copies, routes=routes,
                token_logprobs=token_logprobs,
            )  # fmt: skip
