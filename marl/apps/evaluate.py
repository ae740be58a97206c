"""``marl evaluate``: does the trained policy beat its base on held-out prompts, and by honest measures?

For every prompt both the base (the reference view of the same loaded model: adapters disabled) and the policy
sample one completion with the same sampling settings and seeds, through the rollout's default sampler
(:class:`marl.rollout.transformers_sampler.TransformersSampler`), so evaluation samples exactly as training
does. Each completion gets

- the reward adapter's score of prompt + completion + EOS (the ``eos_adapter`` reward kind, see
  :class:`marl.rewards.adapter.EosTerminatedAdapterReward`),
- the judge's score of prompt + completion (VADER by default, independent of every model here; ``--judge
  module:function`` plugs in another),
- its length in tokens (up to and including the first EOS),
- for the policy, its KL to the reference: the sum over completion tokens of ``log p_policy − log p_ref``
  (temperature-scaled, as in training), whose mean estimates KL(policy ‖ reference).

The win rate pairs the two completions of each prompt: a higher judge score wins, a tie counts half. Reward
hacking shows up as a reward-adapter gain without a judge gain.
"""

from __future__ import annotations

import json
import math
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from marl.cpu_threads import check_threads, threads_field
from marl.data.prompts import dataset_name_field
from marl.errors import ConfigError
from marl.model.quantization import parse_quantization
from marl.validation import check_fields, check_seed

if TYPE_CHECKING:
    from collections.abc import Callable

    from transformers import PreTrainedTokenizerBase

    from marl.model.multi_adapter import MultiAdapterModel
    from marl.rewards import CheckedJudge

RESULTS_FILE = "eval_results.json"
COMPLETIONS_FILE = "eval_completions.jsonl"


@dataclass
class EvaluateArguments:
    """Command-line arguments of ``marl evaluate``."""

    policy_adapter: str | None = field(
        default=None,
        metadata={"help": "Policy adapter folder (from train-rloo). Unset: evaluate the base alone."},
    )
    model_name_or_path: str = field(
        default="smollm2-135m-instruct",
        metadata={
            "help": "Base model: the embedded id, a local folder or a hub id already in the local cache."
        },
    )
    reward_adapter: str | None = field(
        default=None,
        metadata={
            "help": "Reward adapter folder, DIR or NAME=DIR (as in train-rloo); its mean score is reported "
            "when given."
        },
    )
    quantization: str | None = field(default=None, metadata={"help": "Load the base in '4bit' or '8bit'."})
    dataset_name: str = dataset_name_field("Held-out prompts")
    dataset_split: str = field(
        default="test",
        metadata={"help": "Split to evaluate on (a single file has no splits: it is read whole)."},
    )
    prompt_column: str = field(default="prompt", metadata={"help": "Column that holds the prompts."})
    num_prompts: int = field(default=200, metadata={"help": "Evaluate on the first this many prompts."})
    response_length: int = field(default=53, metadata={"help": "Maximum new tokens per completion."})
    temperature: float = field(default=0.7, metadata={"help": "Sampling temperature (use the training one)."})
    batch_size: int = field(default=32, metadata={"help": "Prompts per generation batch."})
    seed: int = field(default=0, metadata={"help": "Seed of the sampling (same for base and policy)."})
    stop_at_eos: bool = field(
        default=True,
        metadata={
            "help": "End completions at EOS (as --stop_token eos in training); false: run to the limit."
        },
    )
    judge: str | None = field(
        default=None,
        metadata={"help": "Judge 'module:function' called as function(texts) -> numbers; unset: VADER."},
    )
    threads: int = threads_field()
    output_dir: str | None = field(
        default=None,
        metadata={
            "help": f"Where {RESULTS_FILE} and {COMPLETIONS_FILE} go; default: the policy adapter folder."
        },
    )

    def __post_init__(self) -> None:
        self.quantization = parse_quantization(self.quantization)
        check_fields(self)
        check_seed(self.seed)
        check_threads(self.threads)
        for name in ("num_prompts", "batch_size", "response_length"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name}={getattr(self, name)} must be a positive integer: fix the flag")
        if self.temperature <= 0:
            raise ConfigError(
                f"--temperature={self.temperature} must be > 0: evaluation samples like training"
            )
        if self.output_dir is None and self.policy_adapter is None:
            raise ConfigError("evaluating the base alone needs --output_dir for the results")
        results_dir = Path(self.output_dir or self.policy_adapter)
        if results_dir.exists() and not results_dir.is_dir():
            raise ConfigError(f"{results_dir} is a file; --output_dir must be a folder for {RESULTS_FILE}")


@dataclass
class ModelScores:
    """Mean scores of one model's completions (``None`` where nothing was measured)."""

    reward_score: float | None
    judge_score: float
    length: float
    kl: float | None


@dataclass
class Comparison:
    """Policy vs base under the judge, paired by prompt."""

    win_rate: float
    wins: int
    ties: int
    losses: int


def win_rate(policy_scores: list[float], base_scores: list[float]) -> Comparison:
    """Fraction of prompts where the policy's judge score beats the base's; a tie counts half.

    Example:
        >>> win_rate([0.9, 0.1, 0.5], [0.2, 0.3, 0.5])
        Comparison(win_rate=0.5, wins=1, ties=1, losses=1)
    """
    if len(policy_scores) != len(base_scores) or not policy_scores:
        raise ValueError(
            "win_rate needs the same, non-zero number of policy and base scores (one per prompt)"
        )
    wins = sum(p > b for p, b in zip(policy_scores, base_scores, strict=True))
    ties = sum(p == b for p, b in zip(policy_scores, base_scores, strict=True))
    losses = len(policy_scores) - wins - ties
    return Comparison((wins + 0.5 * ties) / len(policy_scores), wins, ties, losses)


@dataclass
class ScoredCompletions:
    """One model's completions for a list of prompts, with their measurements."""

    completions: list[str] = field(default_factory=list)
    reward_scores: list[float] = field(default_factory=list)
    judge_scores: list[float] = field(default_factory=list)
    lengths: list[int] = field(default_factory=list)
    kls: list[float] = field(default_factory=list)

    def means(self) -> ModelScores:
        return ModelScores(
            reward_score=_mean(self.reward_scores) if self.reward_scores else None,
            judge_score=_mean(self.judge_scores),
            length=_mean(self.lengths),
            kl=_mean(self.kls) if self.kls else None,
        )


def _mean(values: list[float] | list[int]) -> float:
    return float(sum(values) / len(values))


def generate_and_score(
    model: MultiAdapterModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: list[Any],
    judge: CheckedJudge,
    *,
    with_policy: bool = True,
    response_length: int = 53,
    temperature: float = 0.7,
    batch_size: int = 32,
    seed: int = 0,
    progress: bool = True,
    stop_at_eos: bool = True,
    policy: str | None = None,
    after_batch: Callable[[], Any] | None = None,
) -> dict[str, ScoredCompletions]:
    """Sample and measure completions of the base (``"base"``) and, if ``with_policy``, of policy ``policy``
    (default: the model's first policy), keyed ``"policy"``. ``after_batch`` is called after every batch
    (e.g. a :class:`marl.cpu_threads.FreeCoreThreads`).

    Both models see the same prompts in the same batches with the same seed per batch.

    Example:
        >>> from marl.rewards import load_judge
        >>> samples = generate_and_score(model, tokenizer, ["A film"], load_judge(None))  # doctest: +SKIP
        >>> samples["policy"].means().judge_score  # doctest: +SKIP
    """
    import torch
    from tqdm.auto import tqdm

    from marl.algo.tensors import masked_sum
    from marl.data.prompts import prompt_text
    from marl.rewards import RewardParts, RewardSetting, plan_rewards
    from marl.rollout.prompts import prepare_prompts
    from marl.rollout.samplers import SamplerSettings
    from marl.rollout.scoring import Scorer
    from marl.rollout.transformers_sampler import TransformersSampler

    sampler = TransformersSampler(
        model,
        tokenizer,
        # Without a stop token the completions run to the length limit, as in an RLOO run without stop_token.
        SamplerSettings(
            temperature=temperature,
            response_length=response_length,
            stop_at_eos=stop_at_eos,
            rows_per_pass=batch_size,
            policy=policy,
        ),
    )
    scorer = Scorer(model, tokenizer, temperature=temperature, rows_per_pass=batch_size, policy=policy)
    prepared = prepare_prompts(
        [{"prompt": prompt} for prompt in prompts],
        tokenizer,
        "evaluation prompts",
        context_length=getattr(model.config, "max_position_embeddings", None),
        response_length=response_length,
    )
    # The model's first reward adapter (if any) reads each text ending in EOS, as the shipped one was trained.
    first_reward = list(model.rewards)[:1]
    settings = [RewardSetting("eos_adapter", name) for name in first_reward]
    rewards = plan_rewards(settings).build(RewardParts(model, tokenizer, batch_size))
    views = {"base": "reference", "policy": "policy"} if with_policy else {"base": "reference"}
    results = {name: ScoredCompletions() for name in views}
    starts = range(0, len(prompts), batch_size)
    for batch_index, start in enumerate(tqdm(starts, desc="evaluating", unit="batch", disable=not progress)):
        raw_prompts = prompts[start : start + batch_size]
        batch = sampler.batch(prepared[start : start + batch_size])
        for name, view in views.items():
            torch.manual_seed(seed + batch_index)
            # The base is the reference view of the same model (adapters disabled), not a second copy.
            samples = sampler.sample(batch, k=1, view=view)
            record = results[name]
            record.completions.extend(samples.completions)
            record.judge_scores.extend(
                judge([prompt_text(p) + c for p, c in zip(raw_prompts, samples.completions, strict=True)])
            )
            record.lengths.extend(int(n) for n in samples.lengths.tolist())
            for reward in rewards:
                record.reward_scores.extend(reward.score(scorer.scoring_batch(samples)).tolist())
            if name == "policy":
                logprobs, ref_logprobs = scorer.logprobs(samples)
                record.kls.extend(masked_sum(logprobs - ref_logprobs, samples.response_mask).tolist())
        if after_batch is not None:
            after_batch()
    return results


def summarize(samples: dict[str, ScoredCompletions]) -> dict[str, Any]:
    """Means per model and, with a policy, the judge win rate of the policy over the base.

    Example:
        >>> summary = summarize(samples)  # doctest: +SKIP
        >>> summary["comparison"]["win_rate"]  # doctest: +SKIP
    """
    summary: dict[str, Any] = {name: asdict(record.means()) for name, record in samples.items()}
    if "policy" in samples:
        comparison = win_rate(samples["policy"].judge_scores, samples["base"].judge_scores)
        summary["comparison"] = asdict(comparison)
    return summary


def results_table(summary: dict[str, Any], title: str = "Evaluation on held-out prompts"):
    """A rich table of :func:`summarize`'s output: one row per model."""
    from rich.table import Table

    def show(value: float | None, digits: int = 3) -> str:
        return (
            "—"
            if value is None or (isinstance(value, float) and math.isnan(value))
            else f"{value:.{digits}f}"
        )

    table = Table(title=title)
    for column in (
        "model",
        "reward-adapter score",
        "judge score",
        "judge win rate vs base",
        "KL to ref",
        "length",
    ):
        table.add_column(column, justify="left" if column == "model" else "right")
    for name in ("base", "policy"):
        if name not in summary:
            continue
        scores = summary[name]
        win = "—"
        if name == "policy":
            comparison = summary["comparison"]
            win = (
                f"{comparison['win_rate']:.1%} ({comparison['wins']}W {comparison['ties']}T "
                f"{comparison['losses']}L)"
            )
        kl = scores["kl"] if name == "policy" else None
        table.add_row(
            name,
            show(scores["reward_score"]),
            show(scores["judge_score"]),
            win,
            show(kl),
            show(scores["length"], 1),
        )
    return table


def training_run_dataset(policy_adapter: str | None) -> tuple[Path, dict[str, Any]] | None:
    """``(rloo_config.json, its "dataset" record)`` of the run that wrote ``policy_adapter`` (the run folder,
    or one of its ``checkpoint-N`` folders), or ``None`` when there is no such record."""
    from marl.train.run_dir import CONFIG_FILE

    if policy_adapter is None:
        return None
    folder = Path(policy_adapter)
    for config_file in (folder / CONFIG_FILE, folder.parent / CONFIG_FILE):
        if config_file.is_file():
            try:
                dataset = json.loads(config_file.read_text()).get("dataset")
            except (OSError, ValueError, AttributeError):
                return None
            return (config_file, dataset) if isinstance(dataset, dict) and "train_split" in dataset else None
    return None


def are_training_prompts(source: dict[str, Any], run_dataset: dict[str, Any]) -> bool:
    """Whether prompts read from ``source`` (:func:`marl.data.prompts.prompt_source`) are the prompts a run
    trained
    on, as its ``rloo_config.json`` records them: the same dataset and the same split (a whole file is one
    split).

    Example:
        >>> run = {"dataset_name": "p.jsonl", "dataset_path": "/d/p.jsonl", "train_split": None}
        >>> whole_file = {"dataset_name": "p.jsonl", "dataset_path": "/d/p.jsonl", "split": None}
        >>> are_training_prompts(whole_file, run)
        True
        >>> held_out = {"dataset_name": "rotten-tomatoes", "dataset_path": None, "split": "test"}
        >>> are_training_prompts(held_out, {"dataset_name": "rotten-tomatoes", "train_split": "train"})
        False
    """
    where = source["dataset_path"] or source["dataset_name"]
    trained_on = run_dataset.get("dataset_path") or run_dataset.get("dataset_name")
    return where == trained_on and source["split"] == run_dataset["train_split"]


def write_results(
    output_dir: str | Path,
    summary: dict[str, Any],
    samples: dict[str, ScoredCompletions],
    prompts: list[Any],
    settings: dict[str, Any],
) -> Path:
    """Write ``eval_results.json`` (settings + summary) and ``eval_completions.jsonl`` (every completion)."""
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    results_path = output_dir / RESULTS_FILE
    results_path.write_text(json.dumps({"settings": settings, **summary}, indent=2) + "\n")
    with (output_dir / COMPLETIONS_FILE).open("w") as handle:
        for index, prompt in enumerate(prompts):
            row: dict[str, Any] = {"prompt": prompt}
            for name, record in samples.items():
                row[name] = {
                    "completion": record.completions[index],
                    "judge_score": record.judge_scores[index],
                    "reward_score": record.reward_scores[index] if record.reward_scores else None,
                    "length": record.lengths[index],
                    **({"kl": record.kls[index]} if record.kls else {}),
                }
            handle.write(json.dumps(row) + "\n")
    return results_path


def run_evaluation(arguments: EvaluateArguments) -> dict[str, Any]:
    """Load ONE model (base + policy adapter + reward adapter), compare policy and base, print and save.

    Example:
        >>> arguments = EvaluateArguments(policy_adapter="runs/rloo", reward_adapter="adapters/rm")
        >>> run_evaluation(arguments)  # doctest: +SKIP
    """
    from rich.console import Console

    from marl.config import reward_adapter_folders
    from marl.cpu_threads import apply_threads
    from marl.data.prompts import describe_prompt_source, load_prompt_dataset, prompt_source
    from marl.model.build import load_tokenizer
    from marl.model.multi_adapter import MultiAdapterModel
    from marl.rewards import load_judge

    console = Console()
    judge = load_judge(arguments.judge)
    prompts = load_prompt_dataset(
        arguments.dataset_name,
        arguments.dataset_split,
        arguments.prompt_column,
        max_prompts=arguments.num_prompts,
        split_flag="--dataset_split",
    )["prompt"]
    source = prompt_source(arguments.dataset_name, arguments.dataset_split)
    described = describe_prompt_source(source)
    run = training_run_dataset(arguments.policy_adapter)
    # Warned, not refused: scores on the training prompts are a legitimate measurement (of fit, or when no
    # held-out prompts exist); what must not happen is to present them as held-out.
    training_prompts = None if run is None else are_training_prompts(source, run[1])
    if training_prompts:
        print(
            f"warning: the evaluation prompts ({described}) are the prompts the policy was trained on, "
            f"as {run[0]} records: these scores are not held-out scores. For held-out ones pass other "
            "prompts with --dataset_name (a file the run did not train on) or --dataset_split",
            file=sys.stderr,
        )
    start = time.perf_counter()
    model = MultiAdapterModel.from_pretrained(
        arguments.model_name_or_path,
        quantization=arguments.quantization,
        reward_adapters=reward_adapter_folders(
            [arguments.reward_adapter] if arguments.reward_adapter else []
        ),
        policy_adapter=arguments.policy_adapter,
        reference="base",
    )
    tokenizer = load_tokenizer(model.name_or_path)
    governor = apply_threads(arguments.threads, model.device.type)
    samples = generate_and_score(
        model,
        tokenizer,
        prompts,
        judge,
        with_policy=arguments.policy_adapter is not None,
        response_length=arguments.response_length,
        temperature=arguments.temperature,
        batch_size=arguments.batch_size,
        seed=arguments.seed,
        stop_at_eos=arguments.stop_at_eos,
        after_batch=governor,
    )
    summary = summarize(samples)
    settings = {
        **asdict(arguments),
        "dataset_split": source["split"],
        "evaluated_prompts": described,
        "training_prompts": training_prompts,
        "judge": arguments.judge or "vader",
        "num_prompts": len(prompts),
    }
    settings["seconds"] = round(time.perf_counter() - start, 1)
    output_dir = arguments.output_dir or arguments.policy_adapter
    results_path = write_results(output_dir, summary, samples, prompts, settings)
    kind = {True: "training prompts of the run", False: "held-out prompts", None: "prompts"}[training_prompts]
    console.print(results_table(summary, title=f"Evaluation on {len(prompts)} {kind}: {described}"))
    console.print(f"results written to {results_path}")
    return summary
