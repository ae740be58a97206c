"""``marl evaluate``: does the trained policy beat its base on held-out prompts, and by honest measures?

ONE model is loaded (base + policy adapter + reward adapter); base and policy sample the same prompts and each
completion is scored (:mod:`marl.apps.evaluate.scores`: reward adapter, judge, length, KL to the reference);
the means, the judge win rate of the policy over the base and every completion are printed and written.
Prompts the policy was trained on are evaluated with a warning, never shown as held-out.

The policy folders it is given are run folders, or a sweep's folder whose member folders are runs; what each
run recorded (its ``rloo_config.json``) fills the unset sampling settings, and several policies are checked,
before any model loads, to be evaluable on one base with one way of sampling, then ranked
(:mod:`marl.apps.evaluate.ranking`).

Example:
    >>> policy_labels(["runs/sweep/lr-1e-4", "runs/sweep/lr-3e-4"])
    ['lr-1e-4', 'lr-3e-4']
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from marl.apps.evaluate.ranking import differing_settings, rank_policies, ranking_table
from marl.apps.evaluate.scores import (
    COMPLETIONS_FILE,
    RESULTS_FILE,
    ScoredCompletions,
    generate_and_score,
    results_table,
    summarize,
    win_rate,
    write_results,
)
from marl.config.checks import check_fields, check_seed
from marl.cpu.threads import check_threads, threads_field
from marl.data.prompts import dataset_name_field
from marl.errors import AdapterError, ConfigError
from marl.model.quantization import parse_quantization

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

# Names a policy's label may not take: the other keys of a row of eval_completions.jsonl.
RESERVED_LABELS = ("base", "prompt", "")


def run_record(folder: str | Path) -> dict[str, Any]:
    """What the run that wrote the policy folder ``folder`` (its run folder, or one of its ``checkpoint-N``
    folders) recorded in its ``rloo_config.json``; ``{}`` when there is no readable record."""
    from marl.train.run_dir import CONFIG_FILE

    folder = Path(folder)
    for config_file in (folder / CONFIG_FILE, folder.parent / CONFIG_FILE):
        if config_file.is_file():
            try:
                record = json.loads(config_file.read_text())
            except (OSError, ValueError):
                return {}
            return record if isinstance(record, dict) else {}
    return {}


def sweep_members(folder: Path) -> list[Path]:
    """The member run folders of a sweep's folder, in name order: its sub-folders that hold a run's record or
    a policy adapter; ``[]`` when ``folder`` is a policy folder itself or holds no run. A member without its
    adapter (an unfinished run) is refused."""
    from marl.model.adapters import ADAPTER_CONFIG_NAME as CONFIG_NAME
    from marl.train.run_dir import CONFIG_FILE

    if not folder.is_dir() or (folder / CONFIG_NAME).is_file():
        return []
    members = sorted(
        sub
        for sub in folder.iterdir()
        if sub.is_dir() and ((sub / CONFIG_NAME).is_file() or (sub / CONFIG_FILE).is_file())
    )
    for member in members:
        if not (member / CONFIG_NAME).is_file():
            raise AdapterError(
                f"--policy_adapter {folder}: its member {member.name} has no policy adapter ({CONFIG_NAME}): "
                "its run has not finished. Finish or resume it, or pass the finished members with "
                "--policy_adapter DIR each"
            )
    return members


def policy_folders(given: Sequence[str]) -> list[str]:
    """The policy folders of ``--policy_adapter`` (each repeat of the flag): a folder as given, or a sweep's
    folder replaced by its members (:func:`sweep_members`). A folder named twice is refused.

    Example:
        >>> policy_folders(["runs/a", "runs/b"])  # folders that do not exist are checked when loaded
        ['runs/a', 'runs/b']
    """
    folders: list[str] = []
    for text in given:
        members = sweep_members(Path(text))
        folders.extend([str(member) for member in members] or [text])
    seen: dict[Path, str] = {}
    for folder in folders:
        resolved = Path(folder).resolve()
        if resolved in seen:
            raise ConfigError(
                f"--policy_adapter names {folder} twice ({seen[resolved]}): name each policy folder once"
            )
        seen[resolved] = folder
    return folders


def policy_labels(folders: Sequence[str]) -> list[str]:
    """How the results name each policy: its folder's name, or its whole path where names repeat (or would
    be mistaken for another key of the results)."""
    names = [Path(folder).name for folder in folders]
    return [
        str(Path(folder).resolve()) if names.count(name) > 1 or name in RESERVED_LABELS else name
        for folder, name in zip(folders, names, strict=True)
    ]


def check_one_base(folders: Sequence[str]) -> None:
    """Refuse policies trained on different bases (each adapter's ``adapter_config.json`` records its base):
    a ranking samples every policy on the one base that is loaded. Folders that are not policies are refused
    here, before any model loads."""
    from marl.model.adapters import read_policy_folder, same_model

    remedy = "pass it with --reward_adapter, and give --policy_adapter the folders of policies"
    bases = {
        folder: read_policy_folder(folder, allow_pickle=False, flag="--policy_adapter", remedy=remedy).config
        for folder in folders
    }
    first_folder = folders[0]
    first = bases[first_folder].get("base_model_name_or_path")
    for folder, config in bases.items():
        base = config.get("base_model_name_or_path")
        if first and base and not same_model(base, first):
            raise AdapterError(
                f"--policy_adapter {first_folder} and {folder} were trained on different bases ({first!r}, "
                f"{base!r}): a ranking samples every policy on one base. Evaluate them separately"
            )


def check_same_settings(values: dict[str, Any], flag: str) -> None:
    """Refuse several policies whose runs sampled differently (``values``: policy folder → the run's value of
    the setting of ``flag``) when the flag is unset: every policy of a ranking is sampled one way.

    Example:
        >>> check_same_settings({"runs/a": 0.7, "runs/b": 1.0}, "--temperature")
        Traceback (most recent call last):
        ...
        marl.errors.ConfigError: the policies' runs differ in --temperature (runs/a: 0.7, runs/b: 1.0): ...
    """
    if len({json.dumps(value, default=str) for value in values.values()}) <= 1:
        return
    differing = ", ".join(f"{folder}: {value}" for folder, value in values.items())
    if flag == "--model_name_or_path":
        raise ConfigError(
            f"the policies' runs trained on different bases ({differing}): a ranking samples every policy "
            "on one base. Evaluate them separately"
        )
    raise ConfigError(
        f"the policies' runs differ in {flag} ({differing}): pass {flag} to sample every policy the same way"
    )


def rank_and_report(
    samples: Mapping[str, ScoredCompletions], folders: Mapping[str, str], title: str, judge: str = "vader"
) -> tuple[dict[str, ScoredCompletions], dict[str, Any], Any]:
    """From :func:`marl.apps.evaluate.scores.generate_and_score`'s ``samples`` of the policies ``folders``
    (adapter name → the policy folder), keyed ``"base"`` and by adapter name: the samples keyed by each
    policy's label (:func:`policy_labels`), the summary written as
    ``eval_results.json`` (``base``; ``policies`` with each one's means, win rate over the base and folder;
    ``ranking``, best first) and the ranking's table (:mod:`marl.apps.evaluate.ranking`)."""
    labels = dict(zip(folders, policy_labels(list(folders.values())), strict=True))
    base = samples["base"]
    by_label = {labels[name]: samples[name] for name in folders}
    runs = {labels[name]: run_record(folder) for name, folder in folders.items()}
    ranked = rank_policies(by_label, base, differing_settings(runs))
    summary: dict[str, Any] = {
        "base": asdict(base.means()),
        "policies": {
            labels[name]: {
                "folder": folder,
                **asdict(by_label[labels[name]].means()),
                "comparison": asdict(win_rate(by_label[labels[name]].judge_scores, base.judge_scores)),
            }
            for name, folder in folders.items()
        },
        "ranking": [asdict(policy) | {"tied_with_first": policy.tied_with_first} for policy in ranked],
    }
    return {"base": base, **by_label}, summary, ranking_table(ranked, base, title=title, judge=judge)


@dataclass
class EvaluateArguments:
    """Command-line arguments of ``marl evaluate``."""

    policy_adapter: list[str] | None = field(
        default=None,
        metadata={
            "help": "Policy adapter folder (from train-rloo). Repeat the flag, or pass a sweep's folder (its "
            "member folders are runs), to rank several policies on the same prompts. Unset: evaluate the "
            "base alone."
        },
    )
    model_name_or_path: str | None = field(
        default=None,
        metadata={
            "help": "Base model: the embedded id, a local folder or a hub id already in the local cache. "
            "Unset: the training run's (its rloo_config.json), else smollm2-135m-instruct."
        },
    )
    reward_adapter: list[str] | None = field(
        default=None,
        metadata={
            "help": "Reward adapter folder(s), DIR or NAME=DIR (as in train-rloo); each one's mean score is "
            "reported. Repeat the flag for several."
        },
    )
    reward_fn: list[str] | None = field(
        default=None,
        metadata={
            "help": "Reward function(s) 'module:function' (or 'file.py:function'), called as in training and "
            "as TRL calls them (the dataset's other columns among the keywords); each one's mean is "
            "reported. Repeat the flag for several."
        },
    )
    quantization: str | None = field(
        default=None, metadata={"help": "Load the base in '4bit' or '8bit'. Unset: the training run's."}
    )
    dataset_name: str = dataset_name_field("Held-out prompts")
    dataset_split: str = field(
        default="test",
        metadata={"help": "Split to evaluate on (a single file has no splits: it is read whole)."},
    )
    prompt_column: str = field(default="prompt", metadata={"help": "Column that holds the prompts."})
    num_prompts: int = field(default=200, metadata={"help": "Evaluate on the first this many prompts."})
    response_length: int | None = field(
        default=None,
        metadata={"help": "Maximum new tokens per completion. Unset: the training run's, else 53."},
    )
    temperature: float | None = field(
        default=None, metadata={"help": "Sampling temperature. Unset: the training run's, else 0.7."}
    )
    batch_size: int = field(default=32, metadata={"help": "Prompts per generation batch."})
    seed: int = field(default=0, metadata={"help": "Seed of the sampling (same for base and policy)."})
    stop_at_eos: bool | None = field(
        default=None,
        metadata={
            "help": "End completions at EOS (as --stop_token eos in training); false: run to the limit. "
            "Unset: as the training run did, else true."
        },
    )
    judge: str | None = field(
        default=None,
        metadata={"help": "Judge 'module:function' called as function(texts) -> numbers; unset: VADER."},
    )
    sampler: str | None = field(
        default=None,
        metadata={
            "help": "Sampler by name, as train-rloo's --sampler (a name registered with register_sampler). "
            "Default: as train-rloo chooses for the device (graph on a CUDA device, static on a CPU)."
        },
    )
    threads: int = threads_field()
    output_dir: str | None = field(
        default=None,
        metadata={
            "help": f"Where {RESULTS_FILE} and {COMPLETIONS_FILE} go; default: the policy adapter folder."
        },
    )

    def __post_init__(self) -> None:
        for name in ("policy_adapter", "reward_adapter", "reward_fn"):  # one given in Python as a string
            if isinstance(getattr(self, name), (str, os.PathLike)):
                setattr(self, name, [str(getattr(self, name))])
        self.quantization = parse_quantization(self.quantization)
        check_fields(self)
        check_seed(self.seed)
        check_threads(self.threads)
        for name in ("num_prompts", "batch_size", "response_length"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ConfigError(f"--{name}={getattr(self, name)} must be a positive integer: fix the flag")
        if self.temperature is not None and self.temperature <= 0:
            raise ConfigError(
                f"--temperature={self.temperature} must be > 0: evaluation samples like training"
            )
        if self.output_dir is None and not self.policy_adapter:
            raise ConfigError("evaluating the base alone needs --output_dir for the results")
        if self.output_dir is None and len(self.policy_adapter) > 1:
            raise ConfigError(
                "ranking several --policy_adapter folders needs --output_dir for the results (a sweep's "
                "folder, given alone, holds them)"
            )
        results_dir = Path(self.output_dir or self.policy_adapter[0])
        if results_dir.exists() and not results_dir.is_dir():
            raise ConfigError(f"{results_dir} is a file; --output_dir must be a folder for {RESULTS_FILE}")


# What ``marl evaluate`` takes from the training run's rloo_config.json when unset, and its own defaults.
RUN_SETTINGS = {
    "model_name_or_path": ("model_name_or_path", "smollm2-135m-instruct"),
    "quantization": ("quantization", None),
    "response_length": ("response_length", 53),
    "temperature": ("temperature", 0.7),
    "stop_at_eos": ("stop_token", True),
}


def fill_from_training_run(
    arguments: EvaluateArguments, folders: Sequence[str] | None = None
) -> dict[str, Any]:
    """Fill ``arguments``' unset sampling and model settings from the training run's ``rloo_config.json``
    (so that evaluation samples as the run did: its base, length, temperature and stop), else with
    ``marl evaluate``'s defaults; returns those taken from the run. With several policy ``folders`` (default:
    ``--policy_adapter``'s), their runs must agree on each unset setting
    (:func:`check_same_settings`).

    Example:
        >>> arguments = EvaluateArguments(output_dir="out")  # no policy: no run to read
        >>> fill_from_training_run(arguments), arguments.response_length, arguments.stop_at_eos
        ({}, 53, True)
    """
    if folders is None:
        folders = policy_folders(arguments.policy_adapter or [])
    runs = [run_record(folder) for folder in folders] or [{}]
    taken = {}
    for name, (key, default) in RUN_SETTINGS.items():
        if getattr(arguments, name) is not None:
            continue
        values = []
        for run in runs:
            value = run.get(key, default)
            if name == "stop_at_eos" and key in run:
                # a run whose stop_token is "none" (or None: no stop token) ran to the limit
                value = run[key] == "eos"
            values.append(value)
        if len(folders) > 1:
            check_same_settings(dict(zip(folders, values, strict=True)), f"--{name}")
        if key in runs[0]:
            taken[name] = values[0]
        setattr(arguments, name, values[0])
    return taken


def training_run_dataset(policy_adapter: str | None) -> tuple[Path, dict[str, Any]] | None:
    """``(rloo_config.json, its "dataset" record)`` of the run that wrote ``policy_adapter`` (the run folder,
    or one of its ``checkpoint-N`` folders), or ``None`` when there is no such record."""
    from marl.train.run_dir import CONFIG_FILE

    if policy_adapter is None:
        return None
    folder = Path(policy_adapter)
    for config_file in (folder / CONFIG_FILE, folder.parent / CONFIG_FILE):
        if config_file.is_file():
            dataset = run_record(folder).get("dataset")
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


def check_one_process() -> None:
    """Refuse a launch of several processes: ``marl evaluate`` samples on one process and has no sharded
    mode, so each launched process would sample every prompt and write the same files."""
    from marl.train.launch import current_launch

    launch = current_launch()
    if launch.processes > 1:
        raise ConfigError(
            f"marl evaluate runs in one process, but {launch.launcher} started {launch.processes}: each "
            "would sample every prompt and write the same results. Run it without a launcher: "
            "marl evaluate ..."
        )


def run_evaluation(arguments: EvaluateArguments) -> dict[str, Any]:
    """Load ONE model (base + policy adapter + reward adapter), compare policy and base, print and save. With
    several policy folders, each is added to the one base, every policy samples the same prompts as the
    others, the base samples them once, and the policies are ranked (:mod:`marl.apps.evaluate.ranking`).

    Example:
        >>> arguments = EvaluateArguments(policy_adapter="runs/rloo", reward_adapter="adapters/rm")
        >>> run_evaluation(arguments)  # doctest: +SKIP
    """
    from rich.console import Console

    from marl.config.model import reward_adapter_folders
    from marl.cpu.threads import apply_threads
    from marl.data.fixed_rules import check_gold_judge
    from marl.data.prompts import describe_prompt_source, load_prompt_dataset, prompt_source
    from marl.model.loading import load_tokenizer
    from marl.model.multi_adapter import MultiAdapterModel
    from marl.rewards import load_judge
    from marl.rollout.samplers import get_sampler

    console = Console()
    check_one_process()
    folders = policy_folders(arguments.policy_adapter or [])
    several = len(folders) > 1
    if several:  # every folder is a policy of one base, before anything loads
        check_one_base(folders)
    taken = fill_from_training_run(arguments, folders)
    if taken:
        print(f"as the training run did (its rloo_config.json): {taken}", file=sys.stderr)
    if arguments.sampler is not None:
        get_sampler(arguments.sampler)  # an unknown name fails before any work
    judge = load_judge(arguments.judge)
    if arguments.judge is None:  # VADER is in the demo extra: without it, stop before the model loads
        check_gold_judge()
    from marl.rewards import load_reward_fn

    for spec in arguments.reward_fn or []:  # a typo fails before any model loads
        load_reward_fn(spec)
    dataset = load_prompt_dataset(
        arguments.dataset_name,
        arguments.dataset_split,
        arguments.prompt_column,
        max_prompts=arguments.num_prompts,
        split_flag="--dataset_split",
    )
    prompts = dataset["prompt"]
    # The other columns go to the reward functions, one row per prompt (as TRL passes them).
    columns = [{name: row[name] for name in dataset.column_names if name != "prompt"} for row in dataset]
    source = prompt_source(arguments.dataset_name, arguments.dataset_split)
    described = describe_prompt_source(source)
    runs = [run for run in map(training_run_dataset, folders) if run is not None]
    # Warned, not refused: scores on the training prompts are a legitimate measurement (of fit, or when no
    # held-out prompts exist); what must not happen is to present them as held-out.
    trained_on = [str(config_file) for config_file, run in runs if are_training_prompts(source, run)]
    training_prompts = bool(trained_on) if runs else None
    if trained_on:
        records = f"{trained_on[0]} records" if len(trained_on) == 1 else f"{', '.join(trained_on)} record"
        print(
            f"warning: the evaluation prompts ({described}) are the prompts the policy was trained on, "
            f"as {records}: these scores are not held-out scores. For held-out ones pass other "
            "prompts with --dataset_name (a file the run did not train on) or --dataset_split",
            file=sys.stderr,
        )
    start = time.perf_counter()
    names = [f"policy{index}" for index in range(len(folders))] if several else ["policy"]
    model = MultiAdapterModel.from_pretrained(
        arguments.model_name_or_path,
        quantization=arguments.quantization,
        reward_adapters=reward_adapter_folders(arguments.reward_adapter or []),
        policy_adapter=folders[0] if folders else None,
        policy_name=names[0],
        reference="base",
    )
    for name, folder in zip(names[1:], folders[1:], strict=True):  # each policy a LoRA on the one base
        model.add_policy(name, folder, reference="base")
    tokenizer = load_tokenizer(model.name_or_path)
    governor = apply_threads(arguments.threads, model.device.type)
    samples = generate_and_score(
        model,
        tokenizer,
        prompts,
        judge,
        with_policy=bool(folders),
        response_length=arguments.response_length,
        temperature=arguments.temperature,
        batch_size=arguments.batch_size,
        seed=arguments.seed,
        stop_at_eos=arguments.stop_at_eos,
        after_batch=governor,
        sampler=arguments.sampler,
        reward_names=list(model.rewards) if len(model.rewards) > 1 else None,
        reward_functions=arguments.reward_fn or (),
        columns=columns,
        policies=names if several else None,
    )
    settings = {
        **asdict(arguments),
        "policy_adapter": folders if several else (folders[0] if folders else None),
        "dataset_split": source["split"],
        "evaluated_prompts": described,
        "training_prompts": training_prompts,
        "judge": arguments.judge or "vader",
        "num_prompts": len(prompts),
    }
    settings["seconds"] = round(time.perf_counter() - start, 1)
    output_dir = arguments.output_dir or arguments.policy_adapter[0]
    kind = {True: "training prompts of the run", False: "held-out prompts", None: "prompts"}[training_prompts]
    title = f"Evaluation on {len(prompts)} {kind}: {described}"
    if several:  # the results name each policy by its folder
        folder_of = dict(zip(names, folders, strict=True))
        samples, summary, table = rank_and_report(samples, folder_of, title, judge=settings["judge"])
    else:
        summary = summarize(samples)
        table = results_table(summary, title=title, judge=settings["judge"])
    results_path = write_results(output_dir, summary, samples, prompts, settings)
    console.print(table)
    console.print(f"results written to {results_path}")
    return summary
