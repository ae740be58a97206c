"""A model's own continuations of text openings, sampled as an RLOO rollout samples them: the model-written
sides of the on-topic reward's pairs (:mod:`marl.data.continuation_pairs`).

Two models write them: the base with its adapters off (the ``reference`` view), i.e. the text a policy
starts from, and optionally a trained policy adapter on that base (the ``policy`` view), i.e. the text a
policy drifts into. Each opening is a plain-text prompt, sampled at the rollouts' temperature by the default
sampler, with no stop token, and cut to the number of tokens of the real continuation it stands against, so
that length is no cue.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

# A real continuation longer than this is matched by this many sampled tokens (pairs are at most 64 tokens).
MAX_SAMPLED_TOKENS = 48
ROWS_PER_PASS = 64


def model_continuer(
    model_name_or_path: str,
    *,
    quantization: str | None,
    seed: int,
    threads: int = 0,
    policy_adapter: str | None = None,
) -> Callable[[Sequence[str], Sequence[str]], list[str]]:
    """A ``continue_like(openings, continuations)`` function
    (:data:`marl.data.continuation_pairs.ContinueLike`) that loads ``model_name_or_path`` (with
    ``quantization``, and the PEFT folder ``policy_adapter`` when given) once, on its first call, and samples
    its continuation of each opening at the rollouts' default temperature (:class:`marl.RLOOConfig`), seeded
    per batch from ``seed``, with ``threads`` torch threads as ``--threads`` sets them
    (:func:`marl.cpu.threads.apply_threads`). Without ``policy_adapter`` the base writes (adapters off); with
    it, that policy does. Called with ``instruction=TEXT``, it continues each opening as the start of the
    model's chat answer to the user message ``TEXT`` (the tokenizer's chat template), and the returned text is
    that answer's continuation.

    Example:
        >>> continue_like = model_continuer("smollm2-135m-instruct", quantization="4bit", seed=0)
        >>> continue_like(["The film is"], [" a quiet triumph of craft"])  # doctest: +SKIP
        [' a great example of how']
    """
    view = "reference" if policy_adapter is None else "policy"

    @functools.cache
    def load() -> tuple[Any, Any, Any]:
        from marl.cpu.threads import apply_threads
        from marl.model.build import load_tokenizer
        from marl.model.multi_adapter import MultiAdapterModel

        model = MultiAdapterModel.from_pretrained(
            model_name_or_path, quantization=quantization, policy_adapter=policy_adapter, reference="base"
        )
        return model, load_tokenizer(model.name_or_path), apply_threads(threads, model.device.type)

    def continue_like(
        openings: Sequence[str], continuations: Sequence[str], instruction: str | None = None
    ) -> list[str]:
        import torch

        from marl.config.device import device_sampler
        from marl.config.rloo_config import RLOOConfig
        from marl.data.prompts import prepare_text_prompts
        from marl.rollout.samplers import SamplerSettings, get_sampler

        # Loaded once, for the training and the held-out pairs alike.
        model, tokenizer, governor = load()
        lengths = [
            min(len(tokenizer(text, add_special_tokens=False)["input_ids"]), MAX_SAMPLED_TOKENS)
            for text in continuations
        ]
        if instruction is not None:  # the opening begins the model's answer to the instruction
            openings = [
                [{"role": "user", "content": instruction}, {"role": "assistant", "content": opening}]
                for opening in openings
            ]
        prompts = prepare_text_prompts(
            openings, tokenizer, "review openings", model=model, response_length=MAX_SAMPLED_TOKENS
        )
        make_sampler = get_sampler(device_sampler(model.device.type))
        sampled: list[str] = []
        for batch_index, start in enumerate(range(0, len(prompts), ROWS_PER_PASS)):
            batch_lengths = lengths[start : start + ROWS_PER_PASS]
            # Each batch samples only as many tokens as its longest real continuation.
            settings = SamplerSettings(
                temperature=RLOOConfig.temperature,
                response_length=max(batch_lengths),
                rows_per_pass=ROWS_PER_PASS,
            )
            sampler = make_sampler(model, tokenizer, settings)
            torch.manual_seed(seed + batch_index)
            batch = sampler.batch(prompts[start : start + ROWS_PER_PASS])
            samples = sampler.sample(batch, k=1, view=view)
            for ids, length in zip(samples.response_ids, batch_lengths, strict=True):
                sampled.append(tokenizer.decode(ids[:length], skip_special_tokens=True))
            if governor is not None:
                governor()
        return sampled

    return continue_like
