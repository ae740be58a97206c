"""Train a reward adapter: a LoRA plus a score head on a (optionally 4-bit) base, from preference pairs.

The adapter is what ``MultiAdapterModel.from_pretrained(..., reward_adapter=DIR)`` loads as the frozen reward.
It is trained with TRL's ``RewardTrainer`` (Bradley-Terry loss ``-log sigmoid(r(chosen) - r(rejected))``) on a
``AutoModelForSequenceClassification`` view of the base with ``num_labels=1``; the PEFT config has
``task_type="SEQ_CLS"``, so PEFT saves the freshly trained ``score`` head through ``modules_to_save`` next to
the LoRA weights.

Input format. Plain-text pairs are scored as plain text followed by the tokenizer's EOS token (what
RewardTrainer does), which is what the RL loop scores: the prompt followed by the completion, ending in EOS
when the policy stopped. The score is read AT that EOS, as ``MultiAdapterModel.compute_reward_score``
reads it; for a tokenizer whose pad token is its EOS token (SmolLM2), training pads with another special token
so that the EOS is not mistaken for padding. Conversational pairs (lists of ``{"role", "content"}``
messages) go through the tokenizer's chat template.

After training, this module scores every held-out pair itself and reports the pairwise accuracy, the fraction
of pairs with ``score(chosen) > score(rejected)``, before and after training.

Model-written pairs (the on-topic, on-film and praise pairs of :mod:`marl.data.continuation_pairs`) take
their model-written sides from :func:`model_continuer`: a model's own
continuations of text openings, sampled as an RLOO rollout samples them. Two models write them: the base with
its adapters off (the ``reference`` view), i.e. the text a policy starts from, and optionally a trained policy
adapter on that base (the ``policy`` view), i.e. the text a policy drifts into. Each opening is a plain-text
prompt, sampled at the rollouts' temperature by the default sampler, with no stop token, and cut to the number
of tokens of the real continuation it stands against, so that length is no cue.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from marl.cpu.threads import apply_threads
from marl.data.continuation_pairs import FILM_DATASET, PRAISE_DATASET, TOPIC_DATASET
from marl.data.preferences import check_preference_pairs, describe_preference_data, load_preference_data
from marl.errors import ConfigError, DataError, ModelError
from marl.model.adapters import check_target_modules, write_reward_reading
from marl.model.quantization import default_compute_dtype
from marl.train.reward_settings import (
    SUMMARY_FILE,
    RewardAdapterArguments,
    RewardTrainingSettings,
    provenance,
    write_report,
)
from marl.train.trl_trainers import (
    check_output_dir,
    free_core_callbacks,
    save_adapter_folder,
    train_in_compute_dtype,
)

if TYPE_CHECKING:
    import datasets
    import torch


# ------------------------------------------------------------------------------------------------------------
# Model


def _load_reward_base(path: str, quantization: str | None, dtype: torch.dtype):
    """The base as a one-label sequence classifier (through :func:`marl.model.loading.load_base`, the one base
    loader) and its tokenizer, padding with a token other than EOS."""
    from transformers import AutoModelForSequenceClassification

    from marl.model.loading import load_base, load_tokenizer

    tokenizer = load_tokenizer(path)
    _pad_with_a_token_other_than_eos(tokenizer)
    # Its score head trains (PEFT's modules_to_save): float32 beside a quantized base, as PEFT prepares it.
    model = load_base(
        AutoModelForSequenceClassification,
        path,
        quantization=quantization,
        dtype=dtype,
        num_labels=1,
        frozen_float32=True,
    )
    # The classifier pools at the last token that is not padding; it needs to know which id that is.
    # Gradient checkpointing, if asked for, is switched on by RewardTrainer (activation_checkpointing).
    model.config.pad_token_id = tokenizer.pad_token_id
    return model, tokenizer


def _pad_with_a_token_other_than_eos(tokenizer) -> None:
    # The classifier pools at the last token that is not the pad id. With pad == eos (SmolLM2) the EOS that
    # ends every text would count as padding and the score would be read one token earlier, while the RL loop
    # (MultiAdapterModel.compute_reward_score) reads it AT the EOS, the last attended token. Padding with
    # another special token makes training read where RL reads. Which token pads does not matter otherwise:
    # padded positions are masked out.
    if tokenizer.pad_token is not None and tokenizer.pad_token_id != tokenizer.eos_token_id:
        return
    candidates = [tokenizer.unk_token, *tokenizer.all_special_tokens]
    for token in candidates:
        if token is not None and tokenizer.convert_tokens_to_ids(token) != tokenizer.eos_token_id:
            tokenizer.pad_token = token
            return
    raise ModelError(
        "the tokenizer's only special token is its EOS token, so the reward could not be read at the EOS "
        "that ends each text; add a pad token to the tokenizer (tokenizer.add_special_tokens({'pad_token': "
        "...}) and save it with the base) and train again"
    )


def _lora_placement(model, target_modules: str | list[str], last_layers: int | None) -> dict[str, Any]:
    import torch

    check_target_modules(model, target_modules, "--target_modules")
    if last_layers is None:
        return {"target_modules": target_modules}
    num_layers = model.config.get_text_config().num_hidden_layers
    if not 1 <= last_layers <= num_layers:
        raise ConfigError(
            f"lora_last_layers must be between 1 and {num_layers} for this model, got {last_layers}"
        )
    if target_modules == "all-linear":
        # PEFT only restricts layers for explicit module names, so spell "all-linear" out as the names of the
        # Linear layers inside the transformer blocks (the score head sits outside them).
        target_modules = sorted(
            {
                name.rsplit(".", 1)[-1]
                for name, module in model.named_modules()
                if isinstance(module, torch.nn.Linear) and ".layers." in name
            }
        )
    elif isinstance(target_modules, str):
        raise ConfigError("lora_last_layers needs target_modules as a list of module names or 'all-linear'")
    return {
        "target_modules": list(target_modules),
        "layers_to_transform": list(range(num_layers - last_layers, num_layers)),
    }


# ------------------------------------------------------------------------------------------------------------
# Evaluation


def pairwise_accuracy(model, tokenized_pairs, pad_token_id: int, batch_size: int = 32) -> float:
    """Fraction of pairs whose chosen side scores strictly higher than the rejected side.

    ``tokenized_pairs`` rows carry ``chosen_ids`` and ``rejected_ids`` (as RewardTrainer prepares them);
    ``model`` is a sequence-classification model with one label. Runs in eval mode without gradients and
    restores the model's train/eval mode afterwards.

    Example:
        >>> pairwise_accuracy(model, trainer.eval_dataset, tokenizer.pad_token_id)  # doctest: +SKIP
        0.84
    """
    import torch
    from torch.nn.utils.rnn import pad_sequence
    from tqdm.auto import tqdm

    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    wins = 0
    try:
        with torch.no_grad():
            starts = range(0, len(tokenized_pairs), batch_size)
            for start in tqdm(starts, desc="Scoring held-out pairs", unit="batch", leave=False):
                rows = tokenized_pairs[start : start + batch_size]
                sequences = [torch.tensor(ids) for ids in rows["chosen_ids"] + rows["rejected_ids"]]
                input_ids = pad_sequence(sequences, batch_first=True, padding_value=pad_token_id).to(device)
                lengths = torch.tensor([len(ids) for ids in sequences], device=device)
                attention_mask = (
                    torch.arange(input_ids.shape[1], device=device)[None] < lengths[:, None]
                ).long()
                scores = model(input_ids=input_ids, attention_mask=attention_mask).logits.squeeze(-1).float()
                chosen, rejected = scores.chunk(2)
                wins += int((chosen > rejected).sum())
    finally:
        model.train(was_training)
    return wins / len(tokenized_pairs)


# ------------------------------------------------------------------------------------------------------------
# Training


def train_reward_adapter(
    model_name_or_path: str,
    train_pairs: datasets.Dataset,
    eval_pairs: datasets.Dataset,
    output_dir: str | os.PathLike,
    *,
    dtype: torch.dtype | None = None,
    logging_steps: int = 5,
    data_description: str | None = None,
    command: str | None = None,
    **settings: Any,
) -> dict[str, Any]:
    """Train a LoRA + score-head reward adapter with TRL's RewardTrainer and save it as a PEFT folder.

    ``output_dir`` receives ``adapter_config.json`` (``task_type: SEQ_CLS``), ``adapter_model.safetensors``
    (LoRA weights and ``base_model.model.score.weight``), ``training_summary.json`` (the returned metrics) and
    a README. No optimizer state or checkpoints are kept. ``model_name_or_path`` may be the embedded id
    ``smollm2-135m-instruct``; the adapter records the name as given as its base. ``settings``: the fields of
    :class:`RewardTrainingSettings` (quantization, LoRA, optimisation, seed, threads), checked there.

    Returns a dict with ``eval_accuracy`` (held-out pairwise accuracy after training),
    ``eval_accuracy_before``, pair counts, the final training loss, wall time and the settings used.

    Example:
        >>> from marl.train.reward_training import load_preference_data, train_reward_adapter
        >>> train, held_out = load_preference_data("rotten-tomatoes", max_train_pairs=512)
        >>> metrics = train_reward_adapter("smollm2-135m-instruct", train, held_out, "rm")  # doctest: +SKIP
        >>> metrics["eval_accuracy"]  # doctest: +SKIP
        0.8
    """
    import torch
    from peft import LoraConfig, TaskType
    from trl import RewardConfig, RewardTrainer

    from marl.data.assets import resolve_model_path

    settings = RewardTrainingSettings(**settings)
    check_preference_pairs(train_pairs, "train_pairs")
    check_preference_pairs(eval_pairs, "eval_pairs")
    output_dir = check_output_dir(output_dir)

    started = time.perf_counter()
    dtype = dtype or default_compute_dtype()
    torch.manual_seed(settings.seed)  # the score head is freshly initialised when the base is loaded
    model, tokenizer = _load_reward_base(resolve_model_path(model_name_or_path), settings.quantization, dtype)
    governor = apply_threads(settings.threads, model.device.type)
    peft_config = LoraConfig(
        task_type=TaskType.SEQ_CLS,
        r=settings.lora_r,
        lora_alpha=settings.lora_alpha,
        lora_dropout=settings.lora_dropout,
        **_lora_placement(model, settings.lora_targets, settings.lora_last_layers),
    )
    with tempfile.TemporaryDirectory(prefix="marl-reward-") as scratch:
        config = RewardConfig(
            output_dir=scratch,
            num_train_epochs=settings.num_train_epochs,
            learning_rate=settings.learning_rate,
            per_device_train_batch_size=settings.batch_size,
            max_length=settings.max_length,
            seed=settings.seed,
            activation_checkpointing=settings.gradient_checkpointing,
            bf16=dtype == torch.bfloat16,
            logging_steps=logging_steps,
            save_strategy="no",
            eval_strategy="no",
            report_to="none",
            push_to_hub=False,
        )
        trainer = RewardTrainer(
            model=model,
            args=config,
            train_dataset=train_pairs,
            eval_dataset=eval_pairs,
            processing_class=tokenizer,
            peft_config=peft_config,
            callbacks=free_core_callbacks(governor),
        )
        train_in_compute_dtype(trainer.model, dtype)
        for name, pairs in (("training", trainer.train_dataset), ("held-out", trainer.eval_dataset)):
            if len(pairs) == 0:
                raise DataError(
                    f"every {name} pair has a side longer than max_length={settings.max_length} tokens: "
                    "raise --max_length"
                )
        pad_id = tokenizer.pad_token_id
        accuracy_before = pairwise_accuracy(trainer.model, trainer.eval_dataset, pad_id)
        train_output = trainer.train()
        accuracy_after = pairwise_accuracy(trainer.model, trainer.eval_dataset, pad_id)
        peft_model = trainer.model

    save_adapter_folder(peft_model, output_dir, model_name_or_path)
    # Where the score is read depends on the padding id used in training: record it with the adapter.
    write_reward_reading(output_dir, tokenizer.pad_token_id, tokenizer.pad_token)

    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    summary = {
        "base_model": model_name_or_path,
        "quantization": settings.quantization or "none",
        "compute_dtype": str(dtype).removeprefix("torch."),
        "data": data_description or "preference pairs given by the caller",
        "train_pairs_given": len(train_pairs),
        "train_pairs_used": len(trainer.train_dataset),
        "eval_pairs_given": len(eval_pairs),
        "eval_pairs_used": len(trainer.eval_dataset),
        "eval_accuracy_before": accuracy_before,
        "eval_accuracy": accuracy_after,
        "train_loss_first_logged": losses[0] if losses else None,
        "train_loss_last_logged": losses[-1] if losses else None,
        "train_loss_mean": train_output.training_loss,
        "optimizer_steps": trainer.state.global_step,
        "wall_time_s": round(time.perf_counter() - started, 1),
        "settings": dataclasses.asdict(settings),
        "command": command,
        **provenance(),
        "torch_threads": torch.get_num_threads(),
    }
    write_report(output_dir, summary)
    return summary


# ------------------------------------------------------------------------------------------------------------
# Model-written pairs

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
    ``quantization``, and the PEFT folder ``policy_adapter`` when
    given) once, on its first call, and samples its continuation of each opening at the rollouts' default
    temperature (:class:`marl.RLOOConfig`), seeded per batch from ``seed``, with ``threads`` torch threads as
    ``--threads`` sets them (:func:`marl.cpu.threads.apply_threads`). Without ``policy_adapter`` the base
    writes (adapters off); with it, that policy does. Called with ``instruction=TEXT``, it continues each
    opening as the start of the model's chat answer to the user message ``TEXT`` (the tokenizer's chat
    template), and the returned text is that answer's continuation.

    Example:
        >>> continue_like = model_continuer("smollm2-135m-instruct", quantization="4bit", seed=0)
        >>> continue_like(["The film is"], [" a quiet triumph of craft"])  # doctest: +SKIP
        [' a great example of how']
    """
    view = "reference" if policy_adapter is None else "policy"

    @functools.cache
    def load() -> tuple[Any, Any, Any]:
        from marl.model.loading import load_tokenizer
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


# ------------------------------------------------------------------------------------------------------------
# Command line


def run(arguments: RewardAdapterArguments, command: str | None = None) -> dict[str, Any]:
    """Load the data named by ``arguments`` and train; what ``main`` does after parsing.

    Example:
        >>> run(RewardAdapterArguments(output_dir="rm", max_train_pairs=256))  # doctest: +SKIP
    """
    check_output_dir(arguments.output_dir)  # before the data, whose on-topic pairs take minutes to sample
    continue_like = drift_like = None
    # Model-written sides are sampled from the base the adapter is trained on, loaded as it will be.
    sampling = dict(quantization=arguments.quantization, seed=arguments.seed, threads=arguments.threads)
    if arguments.dataset in (TOPIC_DATASET, FILM_DATASET, PRAISE_DATASET):
        # The on-topic pairs set real continuations against the base's own, the on-film and the praise
        # pairs the base's against the base's.
        continue_like = model_continuer(arguments.model_name_or_path, **sampling)
    if arguments.drifted_policy is not None:
        drift_like = model_continuer(
            arguments.model_name_or_path, policy_adapter=arguments.drifted_policy, **sampling
        )
    train_pairs, eval_pairs = load_preference_data(
        arguments.dataset,
        eval_fraction=arguments.eval_fraction,
        max_train_pairs=arguments.max_train_pairs,
        max_eval_pairs=arguments.max_eval_pairs,
        seed=arguments.seed,
        continue_like=continue_like,
        drift_like=drift_like,
    )
    del continue_like, drift_like  # the models that wrote the pairs' text, not needed to train
    description = describe_preference_data(
        arguments.dataset, arguments.eval_fraction, arguments.seed, arguments.drifted_policy
    )
    return train_reward_adapter(
        arguments.model_name_or_path,
        train_pairs,
        eval_pairs,
        arguments.output_dir,
        data_description=description,
        command=command,
        **arguments.training_settings(),
    )


def parse_arguments(argv: list[str] | None = None) -> RewardAdapterArguments:
    """Parse command-line arguments (the program's own when ``argv`` is None) into RewardAdapterArguments."""
    from transformers import HfArgumentParser

    (arguments,) = HfArgumentParser(RewardAdapterArguments).parse_args_into_dataclasses(args=argv)
    return arguments


__all__ = [
    "SUMMARY_FILE",
    "RewardAdapterArguments",
    "RewardTrainingSettings",
    "load_preference_data",
    "pairwise_accuracy",
    "parse_arguments",
    "run",
    "train_reward_adapter",
]
