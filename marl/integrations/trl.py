"""A reward adapter on the policy's own base as a reward function for TRL's ``GRPOTrainer``/``RLOOTrainer``.

TRL scores completions with a reward adapter made by its ``RewardTrainer`` (LoRA + score head) by loading it
as a second model, ``AutoModelForSequenceClassification`` + ``PeftModel.from_pretrained``: a whole second
copy of the base weights. :func:`reward_adapter_function` loads the adapter onto the PEFT model the trainer
trains instead, as one more frozen adapter beside TRL's ``"default"`` policy adapter, and returns a reward
function in TRL's convention that scores with it. The reference is unchanged: ``disable_adapter()`` turns
every adapter off, the reward adapter included, and TRL's ``"ref"`` copy is another adapter.

Construction order (TRL 1.16): build the function **before** the trainer, from the ``PeftModel`` the trainer
is then given as ``model`` (no ``peft_config``). The other order does not work: with a ``peft_config`` the
trainer creates its PEFT model inside ``__init__``, and ``GRPOTrainer`` refuses to be built without a reward
source, so there is no trainer to attach to when the adapter is the only reward; appending to a built
trainer's ``reward_funcs`` would also have to keep ``reward_func_names``, ``reward_processing_classes`` and
``reward_weights`` in step by hand. Passed in ``reward_funcs`` like any function, it takes part in
``reward_weights`` and ``multi_objective_aggregation`` as TRL's own functions do.

This is marl's one way into TRL's trainers. :class:`RewardAdapterFunction` (``marl.RewardAdapterFunction``) is
deprecated: it scores the same way, but holds the adapter on a
:class:`~marl.model.multi_adapter.MultiAdapterModel` of its own, a second base.

Example:
    >>> model = get_peft_model(AutoModelForCausalLM.from_pretrained(base), LoraConfig(r=16))  # doctest: +SKIP
    >>> reward = reward_adapter_function(model, "reward-adapter", tokenizer)  # doctest: +SKIP
    >>> trainer = GRPOTrainer(model=model, reward_funcs=reward, args=GRPOConfig(...), ...)  # doctest: +SKIP
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping
from typing import Any

import torch
from peft import PeftModel
from torch.distributed.tensor import DTensor
from transformers import AutoTokenizer

from marl.data.prompts import reward_model_ids
from marl.errors import ConfigError, ModelError
from marl.model import adapters, loading
from marl.model.adapters import RewardAdapter, check_adapter_name
from marl.model.forward import capture_view, restore_view, reward_scores
from marl.model.multi_adapter import MultiAdapterModel
from marl.model.rows import PackedRows
from marl.model.sampling import pad_token_id
from marl.rewards.adapter import padded_chunks, score_chunks

# Adapter names TRL's trainers give adapters on the PEFT model: the policy, and the frozen copy of its
# starting weights that they add as the reference when handed a PeftModel with beta != 0.
TRL_ADAPTER_NAMES = {
    "default": "TRL's trainers train the policy adapter under that name",
    "ref": "TRL's trainers add the frozen copy of the policy's starting weights under that name",
}
# Where a sharded launch says so before any model is prepared: accelerate's launcher and plugins set these.
_FSDP_ENV = "ACCELERATE_USE_FSDP"
_DEEPSPEED_ENV, _ZERO_STAGE_ENV = "ACCELERATE_USE_DEEPSPEED", "ACCELERATE_DEEPSPEED_ZERO_STAGE"


class TrainerRewardAdapter:
    """A reward adapter on a TRL trainer's PEFT model, called as TRL calls reward functions.

    ``reward(prompts=..., completions=..., **kwargs)`` returns one float per completion (it judges every
    one). Each ``prompt + completion`` is read as TRL reads it for a reward model
    (:func:`marl.data.prompts.reward_model_text`: a plain prompt followed by the completion; a conversation
    with the completion as the assistant's reply through the chat template and ``chat_template_kwargs``),
    tokenised whole without special tokens and without truncation, ``rows_per_pass`` rows per forward pass,
    left-padded (as marl's own adapter rewards: :func:`marl.rewards.adapter.score_chunks`); ``append_eos``
    ends each row with EOS, for an adapter trained on texts ending in EOS. The score is read where a
    transformers sequence classifier reads it (the last token that is not the padding id the adapter was
    trained with).

    Each call runs in eval mode without gradient; the active adapter (the policy), every ``requires_grad``
    flag and every module's train/eval mode are restored after, also when it raises
    (:func:`marl.model.forward.reward_scores`). Build it with :func:`reward_adapter_function`.
    """

    def __init__(
        self,
        peft_model: PeftModel,
        reward: RewardAdapter,
        tokenizer: Any,
        rows_per_pass: int,
        chat_template_kwargs: Mapping[str, Any] | None,
        *,
        append_eos: bool = False,
    ) -> None:
        self.peft_model = peft_model
        self.reward = reward
        self.tokenizer = tokenizer
        self.rows_per_pass = rows_per_pass
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        self.append_eos = append_eos
        self.__name__ = reward.name  # TRL logs rewards/<__name__>/mean

    @property
    def device(self) -> torch.device:
        return self.peft_model.get_base_model().get_input_embeddings().weight.device

    def compute_reward_score(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        name: str | None = None,
        packed: PackedRows | None = None,
    ) -> torch.Tensor:
        """Float32 scores of token rows (the :class:`marl.rewards.adapter.RewardScorer` protocol)."""
        return reward_scores(self.peft_model, self.reward, input_ids, attention_mask, packed)

    def check_unsharded(self) -> None:
        """Refuse a call once the trainer has sharded the base the reward adapter reads."""
        problem = sharding_problem(self.peft_model)
        if problem is not None:
            raise ConfigError(_sharded_message(problem))

    def __call__(self, prompts: list[Any], completions: list[Any], **kwargs: Any) -> list[float]:
        self.check_unsharded()
        rows = [
            reward_model_ids(self.tokenizer, prompt, completion, self.chat_template_kwargs)
            for prompt, completion in zip(prompts, completions, strict=True)
        ]
        if self.append_eos:
            rows = [[*row, self.tokenizer.eos_token_id] for row in rows]
        device = self.device
        chunks = padded_chunks(rows, pad_token_id(self.tokenizer), self.rows_per_pass, device)
        return score_chunks(self, self.reward.name, chunks, len(rows), device).tolist()


def reward_adapter_function(
    model: PeftModel,
    adapter_dir: str | os.PathLike,
    tokenizer: Any,
    *,
    name: str = "reward",
    rows_per_pass: int = 64,
    chat_template_kwargs: Mapping[str, Any] | None = None,
    allow_pickle: bool = False,
) -> TrainerRewardAdapter:
    """Load the reward adapter folder ``adapter_dir`` onto ``model`` (the ``PeftModel`` to hand to TRL's
    trainer) as frozen adapter ``name`` and return its reward function; see the module docstring for the
    order.

    Args:
        model: the policy as a ``peft.PeftModel`` with LoRA adapters (``get_peft_model``; for QLoRA, the
            4-bit base after ``prepare_model_for_kbit_training``), not yet given to the trainer.
        adapter_dir: a PEFT ``SEQ_CLS`` LoRA folder with its score head, as TRL's ``RewardTrainer`` (with a
            LoRA ``peft_config``) or ``marl train-reward`` writes it, trained on this base.
        tokenizer: the policy's tokenizer (the trainer's ``processing_class``).
        name: the adapter's name on the model and the reward's name in TRL's logs.
        rows_per_pass: completions per forward pass.
        chat_template_kwargs: the trainer config's ``chat_template_kwargs``, for conversational prompts.
        allow_pickle: accept an adapter stored only as a pickle (``adapter_model.bin``).

    Refused, each in one line and before the base is touched: a model that is not a PEFT model (or a trainer:
    the function comes first), policy adapters that are not LoRA or that would train the shared base, a
    folder that is not a reward adapter, an adapter for another base (its shapes do not fit), and a sharded
    launch (FSDP, DeepSpeed ZeRO-3). The adapter's LoRA tensors take the dtype of the policy's own LoRA
    tensors (float32 on a 16-bit base, as PEFT loads a separate reward model); its head is float32.

    Example:
        >>> reward = reward_adapter_function(model, "adapters/sentiment", tokenizer)  # doctest: +SKIP
        >>> reward(prompts=["The film"], completions=[" was great"])  # doctest: +SKIP
        [1.93]
    """
    check_policy_model(model)
    problem = sharding_problem(model)
    if problem is not None:
        raise ConfigError(_sharded_message(problem))
    check_adapter_name(name, list(model.peft_config), "reward adapter", reserved=TRL_ADAPTER_NAMES)
    folder = loading.read_reward_folder(adapter_dir, allow_pickle)
    base = model.get_base_model()
    lora_dtype = next((p.dtype for n, p in model.named_parameters() if "lora_" in n), torch.float32)
    # PEFT's add_adapter may switch the active adapter and freeze tensors it does not know (a policy's
    # modules_to_save): the trainer must find its model exactly as the user built it.
    state = capture_view(model)
    try:
        reward = loading.attach_reward_lora(
            model,
            name,
            folder,
            base_name_or_path=str(getattr(base.config, "_name_or_path", "")),
            dtype=lora_dtype,
            pad_token_id=pad_token_id(tokenizer),
        )
    except BaseException:
        if name in model.peft_config:
            model.delete_adapter(name)
        raise
    finally:
        restore_view(model, state)
    return TrainerRewardAdapter(model, reward, tokenizer, rows_per_pass, chat_template_kwargs)


class RewardAdapterFunction(TrainerRewardAdapter):
    """Deprecated: use :func:`reward_adapter_function`, which loads the adapter onto the trainer's own PEFT
    model. This one holds the adapter on a :class:`~marl.model.multi_adapter.MultiAdapterModel`: pass one (it
    gets the adapter as ``name`` unless it already has it), or a base model name/folder to load one, a second
    base beside the trainer's. It scores as :class:`TrainerRewardAdapter` does, plain prompts and
    conversations alike; ``append_eos=True`` ends each text with EOS.

    Example:
        >>> sentiment = RewardAdapterFunction(model, "adapters/rm", name="sentiment")  # doctest: +SKIP
        >>> sentiment(["The film"], [" was great"])  # doctest: +SKIP
        [1.93]
    """

    def __init__(
        self,
        base_or_model: Any,
        adapter_dir: str | None = None,
        *,
        name: str = "reward",
        quantization: str | None = None,
        append_eos: bool = False,
        rows_per_pass: int = 64,
    ) -> None:
        warnings.warn(
            "marl.RewardAdapterFunction is deprecated: use marl.integrations.trl.reward_adapter_function, "
            "which loads the reward adapter onto the policy's own PeftModel instead of a second base",
            DeprecationWarning,
            stacklevel=2,
        )
        if isinstance(base_or_model, MultiAdapterModel):
            model = base_or_model
            if name not in model.rewards:
                if adapter_dir is None:
                    raise ConfigError(f"the model has no reward adapter {name!r}: pass adapter_dir")
                model.add_reward_adapter(name, adapter_dir)
        else:
            if adapter_dir is None:
                raise ConfigError("pass the reward adapter folder: RewardAdapterFunction(base, adapter_dir)")
            model = MultiAdapterModel.from_pretrained(
                base_or_model, quantization=quantization, reward_adapters={name: adapter_dir}
            )
        self.model, self.name = model, name
        tokenizer = AutoTokenizer.from_pretrained(model.name_or_path)
        super().__init__(
            model.peft_model, model.rewards[name], tokenizer, rows_per_pass, None, append_eos=append_eos
        )

    def check_unsharded(self) -> None:
        """Nothing to refuse: the base is this function's own, which no trainer shards."""


def check_policy_model(model: Any) -> None:
    """Refuse what cannot carry a reward adapter beside the policy: a trainer (the function is built before
    it), a model that is not a PEFT model, adapters other than LoRA, and policy adapters that train or
    rewrite the base the reward reads (:func:`marl.model.adapters.check_keeps_base_fixed`).

    Example:
        >>> check_policy_model(torch.nn.Linear(2, 2))
        Traceback (most recent call last):
        ...
        marl.errors.ModelError: reward_adapter_function(model=...) got a Linear, not a PEFT model: ...
    """
    if hasattr(model, "reward_funcs") and hasattr(model, "model"):
        raise ConfigError(
            f"reward_adapter_function got a {type(model).__name__}: build the reward function before the "
            "trainer, from the PeftModel you then pass as GRPOTrainer(model=..., reward_funcs=[...])"
        )
    if not isinstance(model, PeftModel):
        raise ModelError(
            f"reward_adapter_function(model=...) got a {type(model).__name__}, not a PEFT model: wrap the "
            "policy first, model = peft.get_peft_model(model, LoraConfig(...)), and pass that model to the "
            "trainer without peft_config"
        )
    for adapter, config in model.peft_config.items():
        if config.peft_type != "LORA":
            raise ModelError(
                f"the model's adapter {adapter!r} is a {config.peft_type} adapter; a reward adapter is LoRA "
                "and PEFT keeps adapters of one kind on a model: train the policy with a LoraConfig"
            )
        adapters.check_keeps_base_fixed(config.to_dict(), f"the model's adapter {adapter!r}")


def sharding_problem(model: torch.nn.Module) -> str | None:
    """The sharding that would split the base the policy and the reward adapter share, or ``None``.

    The launch environment says so before the trainer prepares the model (accelerate sets
    ``ACCELERATE_USE_FSDP``, or ``ACCELERATE_USE_DEEPSPEED`` with ``ACCELERATE_DEEPSPEED_ZERO_STAGE=3``);
    the parameters say so after (FSDP2 ``DTensor`` s, FSDP1 flat parameters, ZeRO-3's ``ds_id``).

    Example:
        >>> sharding_problem(torch.nn.Linear(2, 2)) is None  # a plain module, launched unsharded
        True
    """
    if os.environ.get(_FSDP_ENV, "false").lower() in ("true", "1"):
        return "FSDP (accelerate: ACCELERATE_USE_FSDP)"
    deepspeed = os.environ.get(_DEEPSPEED_ENV, "false").lower() in ("true", "1")
    if deepspeed and os.environ.get(_ZERO_STAGE_ENV) == "3":
        return "DeepSpeed ZeRO-3 (accelerate: ACCELERATE_DEEPSPEED_ZERO_STAGE=3)"
    for parameter in model.parameters():
        if isinstance(parameter, DTensor) or type(parameter).__name__ == "FlatParameter":
            return "FSDP (the model's parameters are sharded)"
        if hasattr(parameter, "ds_id"):
            return "DeepSpeed ZeRO-3 (the model's parameters are partitioned)"
    return None


def _sharded_message(problem: str) -> str:
    return (
        f"the reward adapter reads the policy's own base, which {problem} splits over the processes; the "
        "reward passes would see a shard. Train with plain data parallelism (DDP, DeepSpeed ZeRO-1/2) or "
        "load the reward model separately"
    )
