"""A reward adapter as a reward function for TRL's trainers (``reward_funcs``), scored by the same loop as
marl's own adapter rewards (:func:`marl.rewards.adapter.score_chunks`).

Example:
    >>> from trl import GRPOTrainer  # doctest: +SKIP
    >>> sentiment = RewardAdapterFunction("base", "adapters/rm", name="sentiment")  # doctest: +SKIP
    >>> GRPOTrainer(model=..., reward_funcs=[sentiment], ...)  # doctest: +SKIP
"""

from __future__ import annotations

from typing import Any

from marl.data.prompts import reward_model_ids
from marl.errors import ConfigError
from marl.model.sampling import pad_token_id
from marl.rewards.adapter import padded_chunks, score_chunks


class RewardAdapterFunction:
    """A reward adapter as a reward function for TRL's ``GRPOTrainer`` / ``RLOOTrainer`` (``reward_funcs``).

    Scores ``prompt + completion`` (a conversation through the chat template) tokenised as TRL tokenises the
    texts for a reward model (no special tokens added; ``append_eos=True`` ends each text with EOS, for an
    adapter trained on texts ending in EOS), read where the adapter was trained to be read. The adapter lives
    on a :class:`~marl.model.multi_adapter.MultiAdapterModel`: pass one (it gets the adapter as ``name``
    unless it already has it), or a base model name/folder to load one.

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
        # Imported here so that importing marl.rewards does not load peft and transformers.
        from transformers import AutoTokenizer

        from marl.model.multi_adapter import MultiAdapterModel

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
        self.model = model
        self.name = self.__name__ = name  # TRL labels its rewards/<name> metrics with __name__
        self.tokenizer = AutoTokenizer.from_pretrained(model.name_or_path)
        self.append_eos = append_eos
        self.rows_per_pass = rows_per_pass

    def __call__(self, prompts: list[Any], completions: list[Any], **kwargs: Any) -> list[float]:
        rows = [
            reward_model_ids(self.tokenizer, prompt, completion)
            for prompt, completion in zip(prompts, completions, strict=True)
        ]
        if self.append_eos:
            rows = [[*row, self.tokenizer.eos_token_id] for row in rows]
        device = self.model.device
        chunks = padded_chunks(rows, pad_token_id(self.tokenizer), self.rows_per_pass, device)
        return score_chunks(self.model, self.name, chunks, len(rows), device).tolist()
