"""The metrics marl logs under TRL 1.16 ``GRPOTrainer``'s names, against TRL's own computation.

Rollout metrics (completion lengths, clipped ratio, reward, reward_std, per-function mean and std,
frac_reward_zero_std): a real ``GRPOTrainer`` step on a tiny model, whose reward functions record the
completions TRL generated; marl's record is built from those same completions (cut by marl's own
:meth:`Samples.from_responses`) and rewards, shaped as the trainer shapes them, reduced as the trainer reduces
them, and its metrics must equal what TRL's ``log`` wrote. The tiny models get extra terminators in their
generation config so that some completions end and others reach the length limit.

``kl`` and ``entropy``: TRL's ``_compute_loss`` runs on several micro-batches of fixed per-token inputs (its
per-token log-prob method returns them, on that instance only, as in ``test_trl_parity.py``), and the mean of
what it logged must equal what marl's update record gives for the same micro-batches.

Over processes: records of a batch split over three processes, combined by ``sum_over_processes`` (a fake
gather that hands it every process's values), give the metrics of the whole batch on one process.
"""

from __future__ import annotations

import math
import shutil
import warnings
from types import SimpleNamespace

import pytest
import torch
from accelerate import Accelerator
from datasets import Dataset

from marl.algo.advantages import configured_estimator
from marl.algo.losses import LossSettings, policy_loss
from marl.algo.metrics import (
    TRL_ROLLOUT_METRICS,
    RolloutStats,
    UpdateStats,
    rollout_metrics,
    update_metrics,
)
from marl.algo.shaping import shape_rollout
from marl.config import RLOOConfig
from marl.data.prompts import Prompt, PromptBatch
from marl.rewards.weighted import weighted_total
from marl.rollout.completions import Rollout, Samples
from marl.train.parallel import record_values, sum_over_processes

trl = pytest.importorskip("trl")
if trl.__version__ != "1.16.0":
    pytest.skip(f"parity pinned to TRL 1.16.0, found {trl.__version__}", allow_module_level=True)

K, LENGTH = 4, 6
PROMPTS = ["a b", "c d", "e f", "g h"]
WEIGHTS = [1.0, 0.5]
# Ids 3..42 end a completion too: with LENGTH tokens, some completions end and some reach the limit.
EXTRA_TERMINATORS = list(range(3, 43))
TOLERANCE = 1e-5


def length_on_cd(prompts, completions, completion_ids, **_):
    """Judges only prompt "c d": the completion's length."""
    return [
        float(len(ids)) if prompt == "c d" else None
        for prompt, ids in zip(prompts, completion_ids, strict=True)
    ]


def flat_or_varied(prompts, completions, completion_ids, **_):
    """Prompt "a b": 2 for all (a group with zero std); "g h": the first id; else not judged."""
    return [
        2.0 if prompt == "a b" else float(ids[0]) if prompt == "g h" else None
        for prompt, ids in zip(prompts, completion_ids, strict=True)
    ]


REWARD_FUNCS = (length_on_cd, flat_or_varied)


def with_extra_terminators(model_dir, directory):
    """A copy of ``model_dir`` whose generation config ends completions at EXTRA_TERMINATORS too."""
    from transformers import GenerationConfig

    shutil.copytree(model_dir, directory)
    generation = GenerationConfig.from_pretrained(directory)
    ids = generation.eos_token_id if isinstance(generation.eos_token_id, list) else [generation.eos_token_id]
    generation.eos_token_id = [*ids, *EXTRA_TERMINATORS]
    generation.save_pretrained(directory)
    return directory


def trl_step(model_dir, tmp_path, seen: list):
    """One real GRPOTrainer step; ``seen`` gets each reward call's prompts and completion ids. Returns the
    trainer and the metrics its ``log`` wrote."""
    from trl import GRPOConfig, GRPOTrainer

    def recording(function):
        def record(prompts, completions, completion_ids, **kwargs):
            seen.append((function.__name__, list(prompts), [list(ids) for ids in completion_ids]))
            return function(prompts, completions, completion_ids, **kwargs)

        record.__name__ = function.__name__
        return record

    args = GRPOConfig(
        output_dir=str(tmp_path / "trl"),
        report_to="none",
        use_cpu=True,
        per_device_train_batch_size=K * len(PROMPTS),
        num_generations=K,
        max_completion_length=LENGTH,
        max_steps=1,
        logging_steps=1,
        beta=0.0,
        reward_weights=WEIGHTS,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TRL warns about the prompt no function judged
        trainer = GRPOTrainer(
            model=str(model_dir),
            reward_funcs=[recording(function) for function in REWARD_FUNCS],
            args=args,
            train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
        )
        trainer.train()
    return trainer, next(record for record in trainer.state.log_history if "reward" in record)


def prompt_major_to_k_major(rows: list, k: int) -> list:
    """TRL's row ``i * k + j`` (sample j of prompt i) to marl's row ``j * P + i``."""
    prompts = len(rows) // k
    return [rows[i * k + j] for j in range(k) for i in range(prompts)]


def marl_rollout(trainer, prompts: list[str], completion_ids: list[list[int]]) -> Rollout:
    """marl's rollout of TRL's completions (k-major), cut at the same terminators, scored by the same
    functions."""
    tokenizer = trainer.processing_class
    pad = tokenizer.pad_token_id
    batch = PromptBatch.of([Prompt((5,), text) for text in prompts[::K]], pad_token_id=pad)
    k_major_ids = prompt_major_to_k_major(completion_ids, K)
    responses = torch.tensor([ids + [pad] * (LENGTH - len(ids)) for ids in k_major_ids])
    terminators = tuple(trainer.eos_token_ids)
    samples = Samples.from_responses(
        batch,
        K,
        responses,
        stop_token_ids=terminators,
        eos_token_ids=terminators,
        pad_token_id=pad,
        tokenizer=tokenizer,
    )
    k_major_prompts = prompt_major_to_k_major(prompts, K)
    per_function = [
        [math.nan if value is None else value for value in function(k_major_prompts, [], k_major_ids)]
        for function in REWARD_FUNCS
    ]
    sources = torch.tensor(per_function).t()
    fields = {name: getattr(samples, name) for name in Samples.__dataclass_fields__}
    return Rollout(
        **fields,
        logprobs=torch.zeros(responses.shape),
        scores=weighted_total(sources, WEIGHTS),
        source_scores=sources,
    )


def same(ours: float, theirs: float | None) -> bool:
    """TRL's ``log`` writes None where the value is NaN."""
    if theirs is None:
        return math.isnan(ours)
    return abs(ours - theirs) <= TOLERANCE * max(1.0, abs(theirs))


@pytest.mark.parametrize("family", ["llama", "llama3"])  # one terminator, pad != eos; three, pad == eos
def test_rollout_metrics_equal_what_trl_grpo_trainer_logs_for_the_same_completions(
    family, family_dir, tmp_path
):
    model_dir = with_extra_terminators(family_dir(family), tmp_path / "model")
    seen: list = []
    trainer, logged = trl_step(model_dir, tmp_path, seen)
    _, prompts, completion_ids = seen[0]
    lengths = [len(ids) for ids in completion_ids]
    ended = [ids[-1] in trainer.eos_token_ids for ids in completion_ids]
    # the comparison covers both kinds of completion, and TRL's pad rule (a completion whose last token is
    # the pad id counts as ended) does not apply: marl ends completions at the terminators only
    assert any(ended) and not all(ended)
    pad = trainer.processing_class.pad_token_id
    assert (
        all(ids[-1] != pad for ids, end in zip(completion_ids, ended, strict=True) if not end)
        or pad in trainer.eos_token_ids
    )
    assert min(lengths) < LENGTH

    rollout = marl_rollout(trainer, prompts, completion_ids)
    config = RLOOConfig(algorithm="grpo", rloo_k=K, kl_coef=0.0)
    shaped = shape_rollout(config, rollout, WEIGHTS, configured_estimator("grpo", "group"), gather=None)
    stats = sum_over_processes(RolloutStats.of(rollout, shaped, k=K), Accelerator(cpu=True))
    ours = rollout_metrics(stats, [function.__name__ for function in REWARD_FUNCS])

    names = [*TRL_ROLLOUT_METRICS]
    names += [f"rewards/{function.__name__}/{stat}" for function in REWARD_FUNCS for stat in ("mean", "std")]
    for name in names:
        assert same(ours[name], logged[name]), (name, ours[name], logged[name])
    assert 0 < logged["frac_reward_zero_std"] < 1  # "a b" is flat, "c d" and "g h" vary, "e f" is unjudged
    assert 0 < logged["completions/clipped_ratio"] < 1


def test_terminated_lengths_are_zero_when_no_completion_ended_as_trl_logs_them():
    zero = torch.zeros(4, 3)
    rollout = SimpleNamespace(
        logprobs=zero,
        ref_logprobs=None,
        response_mask=torch.ones(4, 3, dtype=torch.bool),
        contains_eos=torch.zeros(4, dtype=torch.bool),
        contains_stop=torch.zeros(4, dtype=torch.bool),
        scores=torch.ones(4),
        source_scores=torch.ones(4, 1),
    )
    config = RLOOConfig(algorithm="grpo", rloo_k=2, kl_coef=0.0)
    shaped = shape_rollout(config, rollout, [1.0], configured_estimator("grpo", "group"), gather=None)
    metrics = rollout_metrics(RolloutStats.of(rollout, shaped, k=2), ["f"])
    assert metrics["completions/clipped_ratio"] == 1.0
    assert metrics["completions/mean_length"] == metrics["completions/max_length"] == 3.0
    for stat in ("mean", "min", "max"):
        assert metrics[f"completions/{stat}_terminated_length"] == 0.0
    assert metrics["frac_reward_zero_std"] == 1.0 and metrics["reward_std"] == 0.0


ROWS = 4


def micro_batch(seed: int):
    """Per-token log-probs (new, old, reference), entropies, advantages and a mask with rows of different
    lengths (one fully masked, as ``mask_truncated_completions`` leaves a truncated completion)."""
    generator = torch.Generator().manual_seed(seed)
    new = -torch.rand(ROWS, LENGTH, generator=generator) * 3
    old = new + 0.3 * torch.randn(ROWS, LENGTH, generator=generator)
    ref = new + 0.5 * torch.randn(ROWS, LENGTH, generator=generator)
    entropy = torch.rand(ROWS, LENGTH, generator=generator) * 4
    advantages = torch.randn(ROWS, generator=generator)
    lengths = torch.randint(1, LENGTH + 1, (ROWS,), generator=generator)
    lengths[seed % ROWS] = 0
    mask = torch.arange(LENGTH).unsqueeze(0) < lengths.unsqueeze(1)
    return new, old, ref, entropy, advantages, mask


def trl_logged_kl_and_entropy(trainer, batches) -> dict[str, float]:
    """TRL's ``_compute_loss`` on each micro-batch, then the mean of each logged list (as its ``log``)."""
    trainer.model.eval()
    mode = "eval"
    trainer._metrics[mode].clear()
    for new, old, ref, entropy, advantages, mask in batches:
        trainer._get_per_token_logps_and_entropies = lambda *a, new=new, entropy=entropy, **k: (
            new,
            entropy,
            None,
        )
        ids = torch.ones(ROWS, LENGTH, dtype=torch.long)
        inputs = {
            "prompt_ids": ids[:, :2],
            "prompt_mask": torch.ones(ROWS, 2, dtype=torch.long),
            "completion_ids": ids,
            "completion_mask": mask.long(),
            "advantages": advantages,
            "num_items_in_batch": mask.sum(),
            "old_per_token_logps": old,
            "ref_per_token_logps": ref,
        }
        with torch.no_grad():
            trainer._compute_loss(trainer.model, inputs)
    return {name: sum(values) / len(values) for name, values in trainer._metrics[mode].items()}


@pytest.mark.parametrize(
    ("loss_type", "level", "bias_correction"),
    [
        ("grpo", "token", True),
        ("dapo", "token", False),
        ("grpo", "sequence", True),
        ("bnpo", "sequence", False),
    ],
)
def test_kl_and_entropy_equal_what_trl_grpo_trainer_logs(
    tiny_llama_dir, tmp_path, loss_type, level, bias_correction
):
    from trl import GRPOConfig, GRPOTrainer

    settings = dict(
        loss_type=loss_type,
        importance_sampling_level=level,
        use_bias_correction_kl=bias_correction,
        beta=0.04,
    )
    args = GRPOConfig(
        output_dir=str(tmp_path / "trl"),
        report_to="none",
        use_cpu=True,
        per_device_train_batch_size=ROWS,
        num_generations=2,
        max_completion_length=LENGTH,
        **settings,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = GRPOTrainer(
            model=str(tiny_llama_dir),
            reward_funcs=length_on_cd,
            args=args,
            train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
        )
    batches = [micro_batch(seed) for seed in range(3)]
    theirs = trl_logged_kl_and_entropy(trainer, batches)

    config = RLOOConfig(
        algorithm="grpo",
        loss_type=loss_type,
        importance_sampling_level=level,
        use_bias_correction_kl=bias_correction,
        kl_coef=0.04,
        response_length=LENGTH,
    )
    stats = UpdateStats()
    for new, old, ref, entropy, advantages, mask in batches:
        out, _ = policy_loss(
            LossSettings.from_config(config), new, old, ref, advantages, mask, num_items=mask.sum()
        )
        stats.add(out, entropy, mask, mask)
    ours = update_metrics(sum_over_processes(stats, Accelerator(cpu=True)))
    for name in ("kl", "entropy"):
        assert abs(ours[name] - theirs[name]) <= TOLERANCE, (name, ours[name], theirs[name])
    assert ours["kl"] > 0


def test_no_kl_is_logged_without_a_kl_term_in_the_loss():
    new, old, ref, entropy, advantages, mask = micro_batch(0)
    stats = UpdateStats()
    config = RLOOConfig(algorithm="grpo", kl_coef=0.0)
    out, _ = policy_loss(
        LossSettings.from_config(config), new, old, ref, advantages, mask, num_items=mask.sum()
    )
    stats.add(out, entropy, mask)
    assert "kl" not in update_metrics(sum_over_processes(stats, Accelerator(cpu=True)))


class Processes:
    """accelerate's gather as seen by one of several processes whose records are ``records``: every
    process's :func:`record_values`, concatenated in process order."""

    def __init__(self, records: list) -> None:
        self.records, self.num_processes, self.device = records, len(records), torch.device("cpu")

    def gather(self, tensor: torch.Tensor) -> torch.Tensor:
        assert torch.equal(tensor, record_values(self.records[0]))  # the calling process is process 0
        return torch.cat([record_values(record) for record in self.records])


def split_rollout(
    rollout: SimpleNamespace, prompts: list[int], k: int, total_prompts: int
) -> SimpleNamespace:
    """The k-major rows of ``prompts`` (a process's share: whole groups, as marl splits a batch)."""
    rows = torch.tensor([j * total_prompts + i for j in range(k) for i in prompts])
    return SimpleNamespace(
        **{name: None if value is None else value[rows] for name, value in vars(rollout).items()}
    )


def test_metrics_over_processes_equal_the_metrics_of_the_whole_batch_on_one_process():
    k, total_prompts, length = 2, 6, 5
    generator = torch.Generator().manual_seed(3)
    rows = k * total_prompts
    lengths = torch.randint(2, length, (rows,), generator=generator)
    lengths[[0, 11]] = torch.tensor([1, length])  # the shortest on process 0, the longest on process 2
    ended = torch.rand(rows, generator=generator) < 0.6
    ended[lengths == length] = False
    scores = torch.randint(0, 3, (rows,), generator=generator).float()
    scores[[2, 5]] = math.nan
    rollout = SimpleNamespace(
        ref_logprobs=None,
        logprobs=-torch.rand(rows, length, generator=generator),
        response_mask=torch.arange(length).unsqueeze(0) < lengths.unsqueeze(1),
        contains_eos=ended,
        contains_stop=ended,
        scores=scores,
        source_scores=scores.unsqueeze(1),
    )
    config = RLOOConfig(algorithm="grpo", rloo_k=k, kl_coef=0.0)
    estimator = configured_estimator("grpo", "group")

    def stats_of(part):
        return RolloutStats.of(part, shape_rollout(config, part, [1.0], estimator, gather=None), k=k)

    whole = rollout_metrics(sum_over_processes(stats_of(rollout), Accelerator(cpu=True)), ["f"])
    shares = [[0, 1], [2, 3, 4], [5]]
    records = [stats_of(split_rollout(rollout, share, k, total_prompts)) for share in shares]
    # one process's shortest and longest completions are not the batch's: min and max must cross processes
    assert records[0].length_min == 1 and records[0].length_max < length == records[2].length_max
    combined = rollout_metrics(sum_over_processes(records[0], Processes(records)), ["f"])
    for name in [*TRL_ROLLOUT_METRICS, "rewards/f/mean", "rewards/f/std"]:
        assert combined[name] == pytest.approx(whole[name], rel=1e-12, nan_ok=True), name

    # the update's micro-batch steps: each step's token mean over every process's tokens, then their mean
    first, second = UpdateStats(), UpdateStats()
    for stats, seed in ((first, 0), (first, 1), (second, 2), (second, 3)):
        new, old, ref, entropy, advantages, mask = micro_batch(seed)
        config = RLOOConfig(algorithm="grpo", kl_coef=0.1)
        out, _ = policy_loss(
            LossSettings.from_config(config), new, old, ref, advantages, mask, num_items=mask.sum()
        )
        stats.add(out, entropy, mask)
    batches = [micro_batch(seed) for seed in range(4)]
    expected = [
        (masked(batches[m][3], batches[m][5]) + masked(batches[m + 2][3], batches[m + 2][5]))
        / (batches[m][5].sum() + batches[m + 2][5].sum())
        for m in range(2)
    ]
    update = update_metrics(sum_over_processes(first, Processes([first, second])))
    assert update["entropy"] == pytest.approx(float(sum(expected)) / 2, rel=1e-6)


def masked(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return torch.where(mask, values, 0.0).sum()
