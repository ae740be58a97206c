"""Bad input through every flag of every subcommand: one ``prog: error: ...`` line that names the problem and
the fix, exit code 2, no traceback, and the output folder untouched.

The sweep runs each command in this process through ``marl.apps.cli.main`` (the console script's function);
the
defects of the issue that introduced it are also checked through ``python -m marl.apps.cli`` in a subprocess,
as a
user runs it (one input per defect; the sweep has the others).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from marl.apps.cli import main
from marl.train.run_dir import plan_start

from support.avx512_bf16 import module_running
from support.tiny import refused, write_jsonl

REPOSITORY = Path(__file__).resolve().parents[2]
PROMPTS = ["the movie was", "a dull boring", "an honest story", "the plot falls"]
NO_REWARD = "<no reward flag>"
NO_DEFAULTS = "<no default flags>"

REWARD_FUNCTIONS = """
def count_e(prompts, completions):
    return [c.count("e") for c in completions]

def short(prompts, completions):
    return [0.0] * (len(completions) - 1)

def words(prompts, completions):
    return ["great"] * len(completions)

def boom(prompts, completions):
    return 1 / 0

def boom_judge(texts):
    raise RuntimeError("judge crashed")

def short_judge(texts):
    return [1.0]

not_callable = 3
"""


@pytest.fixture(scope="module")
def paths(tiny_llama_dir, tiny_reward_adapter, tmp_path_factory) -> dict[str, str]:
    """Every file the sweep points a flag at: good ones, and one bad one of each kind."""
    root = tmp_path_factory.mktemp("bad-input")
    files = root / "files"
    files.mkdir()
    write_jsonl(
        files / "prompts.jsonl", [{"text": prompt, "id": index} for index, prompt in enumerate(PROMPTS)]
    )
    (files / "rewards.py").write_text(REWARD_FUNCTIONS)
    (files / "syntax_error.py").write_text("def f(prompts, completions)\n    return []\n")
    (files / "empty.jsonl").write_text("")
    (files / "malformed.jsonl").write_text('{"text": "a fine film"}\n{"text": \n')
    (files / "ragged.csv").write_text('text,b\n"unclosed,1\nx,2,3,4\n')
    (files / "damaged.parquet").write_text("not parquet")
    # read by one subprocess only: datasets has not yet turned it into its cache (and drawn a bar doing so)
    shutil.copy(files / "prompts.jsonl", files / "unread-prompts.jsonl")
    (files / "prompts.txt").write_text("the movie was\n")
    (files / "numbers.json").write_text("[1, 2, 3]")
    (files / "no-data").mkdir()
    (files / "no-data" / "notes.md").write_text("nothing here")
    (files / "a-file").write_text("")
    pairs = [{"chosen": f"good film {i}", "rejected": f"bad film {i}"} for i in range(8)]
    write_jsonl(files / "pairs.jsonl", pairs)
    write_jsonl(files / "pairs-no-rejected.jsonl", [{"chosen": "good"}] * 4)
    write_jsonl(files / "one-pair.jsonl", pairs[:1])
    write_jsonl(files / "empty-side.jsonl", [{"chosen": "", "rejected": "bad"}] * 4)
    (files / "pairs.txt").write_text("x")
    # Models
    (files / "not-a-model").mkdir()
    shutil.copytree(tiny_llama_dir, files / "bad-config")
    (files / "bad-config" / "config.json").write_text("{oops")
    shutil.copytree(tiny_llama_dir, files / "truncated-weights")
    os.truncate(files / "truncated-weights" / "model.safetensors", 1000)
    # Adapters
    reward = Path(tiny_reward_adapter)
    for name in ("truncated", "bad-json", "no-config", "pickle-only", "ia3", "bias-all"):
        shutil.copytree(reward, files / f"reward-{name}")
    os.truncate(files / "reward-truncated" / "adapter_model.safetensors", 100)
    (files / "reward-bad-json" / "adapter_config.json").write_text("{not json")
    (files / "reward-no-config" / "adapter_config.json").unlink()
    (files / "reward-pickle-only" / "adapter_model.safetensors").rename(
        files / "reward-pickle-only" / "adapter_model.bin"
    )
    for name, change in (("ia3", {"peft_type": "IA3"}), ("bias-all", {"bias": "all"})):
        config_file = files / f"reward-{name}" / "adapter_config.json"
        config_file.write_text(json.dumps({**json.loads(config_file.read_text()), **change}))
    # A real run with a checkpoint after each of its 2 updates; its final adapter is a policy adapter.
    completed = root / "completed"
    main(["train-rloo", *rloo_defaults(files, str(tiny_llama_dir), str(completed)), "--save_steps", "1"])
    # What an earlier run leaves (the sweep's runs start with --overwrite_output_dir over a copy of it).
    previous = root / "previous"
    (previous / "checkpoint-3").mkdir(parents=True)
    (previous / "checkpoint-3" / "trainer_state.json").write_text('{"update": 3}\n')
    (previous / "metrics.jsonl").write_text('{"update": 1}\n{"update": 2}\n{"update": 3}\n')
    (previous / "rloo_config.json").write_text("{}\n")
    (previous / "my-notes.txt").write_text("mine\n")
    # YAML configs
    (files / "bad.yaml").write_text("rloo_k: [2\n")
    (files / "list.yaml").write_text("- rloo_k\n- 2\n")
    (files / "unknown.yaml").write_text("reward-adapter: rm\n")
    (files / "trl.yaml").write_text("beta: 0.1\n")
    (files / "nan.yaml").write_text("temperature: .nan\n")
    (files / "list-for-int.yaml").write_text("lora_r: [2, 4]\n")
    return {
        "files": str(files),
        "base": str(tiny_llama_dir),
        "reward": str(reward),
        "rfn": str(files / "rewards.py"),
        "completed": str(completed),
        "previous": str(previous),
    }


def rloo_defaults(files: Path, base: str, output_dir: str) -> list[str]:
    return [
        "--model_name_or_path", base, "--dataset_name", str(files / "prompts.jsonl"),
        "--prompt_column", "text",
        "--reward_fn", f"{files / 'rewards.py'}:count_e", "--output_dir", output_dir, "--rloo_k", "2",
        "--per_device_train_batch_size", "4", "--total_episodes", "8", "--response_length", "4",
        "--num_ppo_epochs", "1", "--num_sample_generations", "0",
    ]  # fmt: skip


@dataclass
class Case:
    """One bad input: the subcommand, its flags (``{files}``, ``{base}``, ``{reward}``, ``{rfn}``, ``{run}``,
    ``{completed}`` are filled in), the text the error line must contain, and an optional change made to
    ``{run}`` first (it starts as a copy of a real run with checkpoints when ``from_checkpoints``)."""

    command: str
    words: list[str]
    expected: str
    prepare: Callable[[Path], None] | None = None
    from_checkpoints: bool = False
    id: str = field(default="")


def truncate(name: str, size: int = 20) -> Callable[[Path], None]:
    return lambda run: os.truncate(run / "checkpoint-2" / name, size)


def write(name: str, text: str) -> Callable[[Path], None]:
    return lambda run: (run / name).write_text(text)


def remove(name: str) -> Callable[[Path], None]:
    return lambda run: (run / name).unlink()


RLOO = "train-rloo"
CASES = [
    # --- train-rloo: the reward sources
    Case(RLOO, [NO_REWARD], r"no reward: pass --reward_adapter DIR.*--reward_fn"),
    Case(RLOO, ["--reward_fn", "nocolon"], r"'nocolon' must look like 'module:function'"),
    Case(RLOO, ["--reward_fn", "not_a_module:f"], r"could not import 'not_a_module'.*PYTHONPATH"),
    Case(RLOO, ["--reward_fn", "{rfn}:absent"], r"has no attribute 'absent'"),
    Case(RLOO, ["--reward_fn", "{rfn}:not_callable"], r"'not_callable' is a int, not a function"),
    Case(RLOO, ["--reward_fn", "{files}/syntax_error.py:f"], r"could not import .*SyntaxError"),
    Case(RLOO, ["--reward_fn", "{files}/missing.py:f"], r"could not import .*no such file"),
    Case(RLOO, ["--reward_fn", "{rfn}:short"], r"returned 3 scores for 4 completions"),
    Case(RLOO, ["--reward_fn", "{rfn}:words"], r"returned 'great' at position 0.*real numbers"),
    Case(RLOO, ["--reward_fn", "{rfn}:boom"], r"'.*rewards.py:boom' raised ZeroDivisionError.*--debug"),
    Case(RLOO, ["--reward_adapter", "{files}/missing"], r"reward adapter folder .*missing does not exist"),
    Case(RLOO, ["--reward_adapter", "{files}/a-file"], r"a-file is a file; pass the adapter's folder"),
    Case(RLOO, ["--reward_adapter", "{files}/reward-no-config"], r"not a PEFT adapter \(it has no adapter_"),
    Case(RLOO, ["--reward_adapter", "{files}/reward-bad-json"], r"cannot read .*reward-bad-json/adapter_co"),
    Case(RLOO, ["--reward_adapter", "{files}/reward-truncated"], r"weights .*reward-truncated/adapter_model"),
    Case(RLOO, ["--reward_adapter", "{files}/reward-pickle-only"], r"only has pickled weights.*allow_pickle"),
    Case(RLOO, ["--reward_adapter", "{files}/reward-ia3"], r"'IA3' adapter .*only LoRA"),
    Case(RLOO, ["--reward_adapter", "{files}/reward-bias-all"], r"bias='all'.*Use bias='none'"),
    Case(RLOO, ["--reward_adapter", "{completed}"], r"no score head.*SEQ_CLS"),
    Case(RLOO, ["--reward_adapter", "bad name={reward}"], r"'bad name' is not usable"),
    Case(RLOO, ["--reward_adapter", "a={reward}", "a={reward}"], r"two reward adapters are named 'a'"),
    Case(RLOO, ["--reward", "sentiment"], r"--reward 'sentiment' must look like KIND:SPEC"),
    Case(RLOO, ["--reward", "judge:x"], r"--reward 'judge' is not a registered reward source.*'adapter'"),
    Case(RLOO, ["--reward", "eos_adapter:tone"], r"eos_adapter:tone names no reward adapter.*tone=DIR"),
    Case(RLOO, ["--reward", "function:nocolon"], r"'nocolon' must look like 'module:function'"),
    Case(RLOO, ["--reward_weights", "1", "2"], r"2 reward weights for 1 reward sources"),
    Case(RLOO, ["--reward_weights", "nan"], r"--reward_weights=\[nan\] is not a finite number"),
    # --- train-rloo: tools and environments
    Case(RLOO, ["--tool", "{rfn}:not_callable"], r"--tool .*'not_callable' is a int, not a function"),
    Case(RLOO, ["--environment", "{rfn}:absent"], r"--environment .*has no attribute 'absent'"),
    Case(RLOO, ["--max_tool_calling_iterations", "-1"], r"max_tool_calling_iterations=-1 must be >= 0"),
    # --- train-rloo: a sweep of several policies
    Case(RLOO, ["--sweep", "rloo_k=2,4"], r"--sweep rloo_k: cannot differ .*Set --rloo_k once"),
    Case(RLOO, ["--sweep", "learning_rate"], r"--sweep 'learning_rate' is not FIELD=V1,V2"),
    Case(RLOO, ["--sweep", "seed=1,1"], r"--sweep seed: the value\(s\) \['1'\] appear more than once"),
    Case(
        RLOO,
        ["--sweep", "seed=1,2", "--resume_from_checkpoint", "{files}/missing"],
        r"--sweep resumes every policy together: pass --resume_from_checkpoint latest",
    ),
    # --- train-rloo: the data
    Case(RLOO, ["--dataset_name", "{files}/missing.jsonl"], r"no such dataset file or folder"),
    Case(RLOO, ["--dataset_name", "{files}/prompts.txt"], r"unknown dataset file type '\.txt'"),
    Case(RLOO, ["--dataset_name", "{files}/empty.jsonl"], r"cannot read the dataset .*empty\.jsonl"),
    Case(RLOO, ["--dataset_name", "{files}/malformed.jsonl"], r"cannot read the dataset .*malformed\.jsonl"),
    Case(RLOO, ["--dataset_name", "{files}/ragged.csv"], r"cannot read the dataset .*ragged\.csv"),
    Case(RLOO, ["--dataset_name", "{files}/damaged.parquet"], r"cannot read the dataset .*damaged\.parquet"),
    Case(RLOO, ["--dataset_name", "{files}/no-data"], r"holds no dataset file"),
    Case(
        RLOO, ["--dataset_name", "{files}/numbers.json"], r"column 'text' .*numbers\.json' is 1, not a prompt"
    ),
    Case(RLOO, ["--prompt_column", "title"], r"no column 'title'; its columns are \['text', 'id'\]"),
    Case(RLOO, ["--prompt_column", "id"], r"row 0 of column 'id'.*is 0, not a prompt"),
    Case(
        RLOO,
        ["--dataset_name", "rotten-tomatoes", "--prompt_column", "prompt", "--dataset_train_split", "dev"],
        r"splits .*not 'dev'",
    ),
    Case(
        RLOO,
        ["--dataset_name", "rotten-tomatoes", "--prompt_column", "prompt", "--dataset_test_split", "dev"],
        r"splits .*not 'dev': pass one of them with --dataset_test_split$",
    ),
    Case(RLOO, ["--response_length", "300"], r"exceed the model's context of 256 tokens"),
    # --- train-rloo: the model and the policy adapter
    Case(RLOO, ["--model_name_or_path", "{files}/missing"], r"no such model folder: .*missing"),
    Case(RLOO, ["--model_name_or_path", "{files}/a-file"], r"a-file is a file"),
    Case(
        RLOO, ["--model_name_or_path", "{files}/not-a-model"], r"not a model folder: it has no config\.json"
    ),
    Case(RLOO, ["--model_name_or_path", "{files}/bad-config"], r"cannot load the model .*bad-config"),
    Case(RLOO, ["--model_name_or_path", "{files}/truncated-weights"], r"cannot load the model .*truncated"),
    Case(RLOO, ["--quantization", "3bit"], r"quantization='3bit' is unknown.*4bit, 8bit or none"),
    Case(
        RLOO,
        ["--policy_adapter", "{files}/missing"],
        r"policy adapter folder .*missing does not exist; pass the folder that `marl train-rloo` wrote",
    ),
    Case(RLOO, ["--policy_adapter", "{files}/no-data"], r"no-data is not a PEFT adapter.*`marl train-rloo`"),
    Case(
        RLOO,
        ["--policy_adapter", "{reward}"],
        r"sequence-classification \(reward\) adapter: pass it with --reward_adapter .*leave it out",
    ),
    Case(RLOO, ["--policy_adapter_name", "my.policy"], r"'my.policy' is not usable"),
    Case(RLOO, ["--policy_adapter_name", "reference"], r"'reference' is reserved"),
    Case(RLOO, ["--reference", "frozen"], r"reference='frozen' is unknown"),
    Case(RLOO, ["--reference", "initial-policy"], r"needs a starting policy adapter.*--policy_adapter"),
    Case(RLOO, ["--lora_r", "0"], r"lora_r=0 must be a positive integer"),
    Case(RLOO, ["--lora_alpha", "-8"], r"lora_alpha=-8 must be a positive integer"),
    Case(RLOO, ["--lora_target_modules", "attn_proj"], r"\['attn_proj'\]: no such module.*q_proj"),
    Case(RLOO, ["--bf16", "--fp16"], r"bf16 and fp16 are both set"),
    Case(
        RLOO,
        ["--gradient_checkpointing", "maybe"],
        r"--gradient_checkpointing.*got maybe but expected one of yes/no",
    ),
    # --- train-rloo: batch arithmetic and optimisation
    Case(RLOO, ["--rloo_k", "1"], r"rloo_k=1: leave-one-out needs at least 2.*--rloo_k 2"),
    Case(RLOO, ["--rloo_k", "two"], r"--rloo_k: invalid int value: 'two'"),
    Case(RLOO, ["--per_device_train_batch_size", "0"], r"per_device_train_batch_size=0 must be a positive"),
    Case(RLOO, ["--per_device_train_batch_size", "3"], r"not a multiple of rloo_k=2"),
    Case(RLOO, ["--gradient_accumulation_steps", "0"], r"gradient_accumulation_steps=0 must be a positive"),
    Case(RLOO, ["--num_mini_batches", "0"], r"num_mini_batches=0 must be a positive"),
    Case(RLOO, ["--num_ppo_epochs", "0"], r"num_ppo_epochs=0 must be a positive"),
    Case(RLOO, ["--total_episodes", "0"], r"total_episodes=0 must be positive"),
    Case(RLOO, ["--total_episodes", "8.5"], r"--total_episodes: invalid int value: '8.5'"),
    Case(RLOO, ["--local_rollout_forward_batch_size", "0"], r"local_rollout_forward_batch_size=0 must be"),
    Case(RLOO, ["--learning_rate", "-1"], r"must be non-negative"),
    Case(RLOO, ["--learning_rate", "nan"], r"--learning_rate=nan is not a finite number.*5e-05"),
    Case(RLOO, ["--weight_decay", "inf"], r"--weight_decay=inf is not a finite number"),
    Case(RLOO, ["--max_grad_norm", "-1"], r"must be non-negative"),
    Case(RLOO, ["--lr_scheduler_type", "cyclic"], r"unknown lr_scheduler_type 'cyclic'"),
    Case(RLOO, ["--warmup_steps", "-1"], r"warmup_steps must be >= 0"),
    Case(RLOO, ["--warmup_ratio", "1.5"], r"warmup_ratio in \[0, 1\)"),
    Case(RLOO, ["--warmup_ratio", "nan"], r"--warmup_ratio=nan is not a finite number"),
    # --- train-rloo: RLOO settings
    Case(RLOO, ["--kl_coef", "nan"], r"--kl_coef=nan is not a finite number"),
    Case(RLOO, ["--kl_coef", "-0.1"], r"kl_coef=-0.1 must be >= 0"),
    Case(RLOO, ["--cliprange", "0"], r"cliprange=0.0 must be > 0"),
    Case(RLOO, ["--cliprange=-inf"], r"--cliprange=-inf is not a finite number"),
    Case(RLOO, ["--temperature", "nan"], r"--temperature=nan is not a finite number.*--temperature 0.7"),
    Case(RLOO, ["--temperature", "inf"], r"--temperature=inf is not a finite number"),
    Case(RLOO, ["--temperature", "0"], r"temperature=0.0 must be > 0"),
    Case(
        RLOO,
        ["--sampler", "nope"],
        r"--sampler 'nope' is not a registered .*\['graph', 'static', 'transformers'\]",
    ),
    Case(RLOO, ["--response_length", "0"], r"response_length=0 must be a positive integer"),
    Case(RLOO, ["--stop_token", "bos"], r"stop_token='bos' is not supported"),
    Case(RLOO, ["--stop_token", "eos", "--stop_token_id", "1"], r"stop_token and stop_token_id are both set"),
    Case(RLOO, ["--stop_token_id", "-1"], r"stop_token_id=-1 is not a token id"),
    Case(RLOO, ["--stop_token_id", "99999"], r"--stop_token_id 99999 is not a token of this model"),
    Case(
        RLOO, ["--missing_eos_penalty", "1", "--stop_token", "none"], r"missing_eos_penalty is set without a"
    ),
    Case(RLOO, ["--advantage_epsilon", "0"], r"advantage_epsilon=0.0 must be > 0"),
    Case(
        RLOO,
        ["--reward_normalization", "nope"],
        r"--reward_normalization 'nope' is not a registered .*\['per_reward', 'sum'\]",
    ),
    Case(
        RLOO,
        ["--reward_normalization", "per_reward", "--algorithm", "reinforce_pp"],
        r"per_reward is defined for the rloo and grpo advantage estimators.*not for 'reinforce_pp'",
    ),
    Case(RLOO, ["--missing_eos_penalty", "nan", "--stop_token", "eos"], r"--missing_eos_penalty=nan is not"),
    Case(RLOO, ["--normalize_reward", "--reward_clip_range", "0"], r"reward_clip_range=0.0 must be > 0"),
    Case(RLOO, ["--reward_clip_range", "inf"], r"--reward_clip_range=inf is not a finite number"),
    Case(RLOO, ["--token_level_kl", "sometimes"], r"--token_level_kl.*got sometimes"),
    Case(RLOO, ["--normalize_advantage", "sometimes"], r"--normalize_advantage.*got sometimes"),
    Case(RLOO, ["--share_prompt_prefix", "often"], r"--share_prompt_prefix.*got often"),
    Case(RLOO, ["--advantage_estimator", "ppo"], r"'ppo' is not a .*'reinforce_pp', 'rloo'\]"),
    Case(RLOO, ["--algorithm", "ppo"], r"--algorithm 'ppo' is not a preset; pass one of \['rloo', 'grpo'"),
    Case(RLOO, ["--loss_type", "cispo"], r"'cispo' is one of TRL 1.16's losses marl does not implement"),
    Case(RLOO, ["--loss_type", "ppo"], r"--loss_type 'ppo' is not a policy loss"),
    Case(RLOO, ["--importance_sampling_level", "sequence"], r"applies to token-level losses"),
    Case(RLOO, ["--vllm_importance_sampling_mode", "token_clip"], r"'token_clip' is not one of \('token_"),
    Case(RLOO, ["--graph_capture", "cuda_graphs", "--sampler", "static"], r"applies to --sampler graph only"),
    Case(
        RLOO,
        ["--vllm_importance_sampling_clip_min", "3", "--vllm_importance_sampling_clip_max", "2"],
        r"clip_min=3.0 is not below vllm_importance_sampling_clip_max=2.0",
    ),
    Case(
        RLOO,
        ["--vllm_importance_sampling_correction", "--algorithm", "grpo", "--sampler", "transformers"],
        r"--sampler 'transformers' keeps none. Use --sampler static or graph",
    ),
    Case(RLOO, ["--scale_rewards", "group"], r"estimator 'rloo' does not scale rewards"),
    Case(RLOO, ["--algorithm", "dapo", "--stop_token", "none"], r"mask_truncated_completions=true without a"),
    Case(
        RLOO, ["--mask_truncated_completions", "true", "--stop_token", "none"], r"=true without a stop token"
    ),
    Case(RLOO, ["--use_bias_correction_kl", "false"], r"use_bias_correction_kl=False applies to token-level"),
    Case(RLOO, ["--epsilon_high", "0"], r"epsilon_high=0.0 must be > 0"),
    Case(RLOO, ["--kl_placement", "prompt"], r"--kl_placement 'prompt' is not one of"),
    Case(RLOO, ["--token_level_kl", "--kl_placement", "reward"], r"token_level_kl=true puts the KL in"),
    Case(RLOO, ["--parallelism", "fsdp"], r"--parallelism 'fsdp' is not .*\['fsdp2', 'replicated'\]"),
    # --- train-rloo: logging, checkpoints, seed
    Case(RLOO, ["--logging_steps", "0"], r"logging_steps=0 must be a positive integer"),
    Case(RLOO, ["--report_to", "wandbb"], r"unknown report_to \['wandbb'\]"),
    Case(RLOO, ["--report_to", "none", "tensorboard"], r"mixes 'none' with trackers"),
    Case(RLOO, ["--num_sample_generations", "-1"], r"num_sample_generations must be >= 0"),
    Case(RLOO, ["--save_steps", "-1"], r"--save_steps=-1 must be >= 0"),
    Case(RLOO, ["--save_minutes", "-5"], r"--save_minutes=-5.0 must be >= 0 \(0 turns"),
    Case(RLOO, ["--save_total_limit", "0"], r"save_total_limit=0 must be >= 1"),
    Case(RLOO, ["--fit", "always"], r"--fit 'always' is not one of \('auto', 'off'\): pass --fit auto"),
    Case(RLOO, ["--fit_memory_gb", "0"], r"--fit_memory_gb 0.0 must be a positive number of GB"),
    *[
        Case(
            RLOO,
            ["--fit_memory_gb", value],
            rf"error: --fit_memory_gb {value} is not a memory size: pass a number of GB, e\.g\. "
            r"--fit_memory_gb 12, or leave it unset to plan for the GPU's free memory$",
        )
        for value in ("nan", "inf")
    ],
    Case(RLOO, ["--seed", "-1"], r"--seed=-1 is out of range"),
    Case(RLOO, ["--seed", "5000000000"], r"--seed=5000000000 is out of range"),
    Case(RLOO, ["--threads", "-1"], r"--threads=-1 must be >= 0 \(0: follow the free cores"),
    Case(
        RLOO,
        ["--cpu_allocator", "fast"],
        r"--cpu_allocator.*invalid choice: 'fast' \(choose from 'heap', 'maps'\)",
    ),
    Case(RLOO, ["--num_train_epochs", "inf"], r"--num_train_epochs=inf is not a finite number"),
    Case(RLOO, ["--not_a_flag", "3"], r"unknown flags \['--not_a_flag', '3'\].*marl train-rloo --help"),
    # --- train-rloo: TRL's names get a hint with marl's flag (they are not aliases)
    Case(RLOO, ["--num_generations", "4"], r"--num_generations is a TRL name: marl's flag is --rloo_k"),
    Case(RLOO, ["--max-completion-length", "9"], r"--max_completion_length .*flag is --response_length"),
    Case(RLOO, ["--beta", "0.1"], r"--beta is a TRL name: marl's flag is --kl_coef"),
    Case(RLOO, ["--max_steps", "10"], r"--max_steps is a TRL name: marl's flag is --total_episodes"),
    Case(RLOO, ["--top_p", "0.9"], r"--top_p is a TRL name: marl samples with --temperature alone"),
    Case(RLOO, ["--use_peft"], r"--use_peft is a TRL name: marl always trains a LoRA policy adapter"),
    Case(RLOO, ["--lora_dropout", "0.1"], r"--lora_dropout is a TRL name: marl trains without dropout"),
    Case(RLOO, ["--max_length", "64"], r"--max_length is a TRL name: marl's flag is --response_length"),
    Case(RLOO, ["--rlook", "4"], r"unknown flags \['--rlook', '4'\]: --rlook: did you mean --rloo_k\?"),
    Case(RLOO, ["--num_iterations", "2"], r"--num_iterations is a TRL name: marl's flag is --num_ppo_epochs"),
    Case(RLOO, ["--epsilon", "0.3"], r"--epsilon is a TRL name: marl's flag is --cliprange"),
    Case(
        RLOO, ["--max_prompt_length", "64"], r"--max_prompt_length is a TRL name: marl does not cut prompts"
    ),
    Case(RLOO, ["--config", "{files}/trl.yaml"], r"unknown settings \['beta'\]: --beta .*--kl_coef"),
    # --- train-rloo: --config files
    Case(RLOO, ["--config", "{files}/missing.yaml"], r"--config .*missing\.yaml: no such file"),
    Case(RLOO, ["--config", "{files}/bad.yaml"], r"cannot read the config file .*bad\.yaml"),
    Case(RLOO, ["--config", "{files}/list.yaml"], r"list\.yaml must hold a YAML mapping"),
    Case(
        RLOO, ["--config", "{files}/unknown.yaml"], r"unknown settings \['reward-adapter'\].*reward_adapter"
    ),
    Case(RLOO, ["--config", "{files}/nan.yaml"], r"--temperature=nan is not a finite number"),
    Case(RLOO, ["--config", "{files}/list-for-int.yaml"], r"--lora_r=\[2, 4\] is a list, not an integer"),
    Case(RLOO, ["--config"], r"--config needs a YAML file"),
    # --- train-rloo: the output folder, resuming, checkpoints
    Case(
        RLOO, ["--output_dir", "{previous}"], r"already holds a run .*--overwrite_output_dir.*--resume_from"
    ),
    Case(RLOO, ["--output_dir", "{files}/a-file"], r"--output_dir .*a-file is a file"),
    Case(RLOO, ["--output_dir", "{files}/a-file/run"], r"cannot be created: .*a-file is a file"),
    Case(RLOO, ["--resume_from_checkpoint", "latest", "--overwrite_output_dir"], r"pass only one"),
    Case(RLOO, ["--overwrite_output_dir", "always"], r"--overwrite_output_dir.*got always"),
    Case(
        RLOO, ["--resume_from_checkpoint", "{files}/missing"], r"missing is not a checkpoint of this trainer"
    ),
    Case(RLOO, ["--output_dir", "{run}", "--save_steps", "1"], r"already holds a run", from_checkpoints=True),
    Case(
        RLOO,
        ["--output_dir", "{run}", "--resume_from_checkpoint", "latest"],
        r"holds a finished run .*and no checkpoint-N folder.*--overwrite_output_dir",
        prepare=lambda run: [shutil.rmtree(path) for path in run.glob("checkpoint-*")],
        from_checkpoints=True,
    ),
]
CHECKPOINT_CASES = [
    (
        truncate("adapter_model.safetensors"),
        r"cannot read .*checkpoint-2/adapter_model\.safetensors.*damaged",
    ),
    (truncate("optimizer.pt"), r"cannot read .*checkpoint-2/optimizer\.pt"),
    (truncate("rng_state_0.pt"), r"cannot read .*checkpoint-2/rng_state_0\.pt"),
    (remove("checkpoint-2/scheduler.pt"), r"checkpoint-2 is incomplete: scheduler\.pt is missing"),
    (
        write("checkpoint-2/trainer_state.json", "{oops"),
        r"cannot read .*trainer_state\.json.*JSONDecodeError",
    ),
    (write("checkpoint-2/trainer_state.json", '{"update": 2}'), r"trainer_state\.json .*no integer"),
    (write("metrics.jsonl", "not json\n"), r"metrics\.jsonl line 1 is not a metrics record"),
]
CASES += [
    Case(RLOO, ["--output_dir", "{run}", "--resume_from_checkpoint", "latest", "--save_steps", "1"], expected,
         prepare, from_checkpoints=True)
    for prepare, expected in CHECKPOINT_CASES
]  # fmt: skip
CASES += [
    Case(RLOO, ["--output_dir", "{run}", "--resume_from_checkpoint", "latest", *flags], expected,
         from_checkpoints=True)
    for flags, expected in [
        (["--total_episodes", "16"], r"belongs to a run of 2 updates of 4 completions, this config plans 4"),
        (["--lora_r", "4"], r"does not fit this run's policy LoRA.*--lora_r"),
    ]
]  # fmt: skip

REWARD = "train-reward"
CASES += [
    Case(REWARD, [NO_DEFAULTS], r"the following arguments are required: --output_dir"),
    Case(REWARD, ["--output_dir", "{previous}"], r"--output_dir .*previous exists and is not empty"),
    Case(REWARD, ["--output_dir", "{files}/a-file"], r"--output_dir .*a-file is a file"),
    Case(REWARD, ["--model_name_or_path", "{files}/missing"], r"no such model folder"),
    Case(REWARD, ["--model_name_or_path", "{files}/not-a-model"], r"no config\.json"),
    Case(REWARD, ["--model_name_or_path", "{files}/truncated-weights"], r"cannot load the model"),
    Case(REWARD, ["--dataset", "{files}/missing.jsonl"], r"is not 'rotten-tomatoes'.* or an existing file"),
    Case(REWARD, ["--dataset", "{files}/pairs.txt"], r"unsupported extension"),
    Case(REWARD, ["--dataset", "{files}/malformed.jsonl"], r"cannot read the dataset .*malformed\.jsonl"),
    Case(REWARD, ["--dataset", "{files}/pairs-no-rejected.jsonl"], r"lacks the column\(s\) \['rejected'\]"),
    Case(REWARD, ["--dataset", "{files}/one-pair.jsonl"], r"has 1 rows; at least 2 are needed"),
    Case(REWARD, ["--dataset", "{files}/empty-side.jsonl"], r"chosen='': each side must be non-empty"),
    Case(REWARD, ["--eval_fraction", "0"], r"--eval_fraction must be between 0 and 1"),
    Case(REWARD, ["--eval_fraction", "nan"], r"--eval_fraction=nan is not a finite number"),
    Case(REWARD, ["--max_train_pairs", "0"], r"--max_train_pairs must be at least 1"),
    Case(REWARD, ["--max_eval_pairs", "-2"], r"--max_eval_pairs must be at least 1"),
    Case(REWARD, ["--quantization", "2bit"], r"quantization='2bit' is unknown"),
    Case(REWARD, ["--lora_r", "0"], r"--lora_r must be at least 1"),
    Case(REWARD, ["--lora_alpha", "0"], r"--lora_alpha must be at least 1"),
    Case(REWARD, ["--lora_dropout", "1.0"], r"--lora_dropout must be in \[0, 1\)"),
    Case(REWARD, ["--lora_dropout", "nan"], r"--lora_dropout=nan is not a finite number"),
    Case(REWARD, ["--target_modules", "attn_proj"], r"--target_modules \['attn_proj'\]: no such module"),
    Case(REWARD, ["--lora_last_layers", "0"], r"--lora_last_layers must be at least 1"),
    Case(REWARD, ["--lora_last_layers", "9"], r"lora_last_layers must be between 1 and 2"),
    Case(REWARD, ["--num_train_epochs", "0"], r"--num_train_epochs must be > 0"),
    Case(REWARD, ["--num_train_epochs", "inf"], r"--num_train_epochs=inf is not a finite number"),
    Case(REWARD, ["--learning_rate", "-1"], r"--learning_rate >= 0"),
    Case(REWARD, ["--batch_size", "0"], r"--batch_size must be at least 1"),
    Case(REWARD, ["--max_length", "0"], r"--max_length must be at least 1"),
    Case(REWARD, ["--seed", "-3"], r"--seed=-3 is out of range"),
    Case(REWARD, ["--threads", "-2"], r"--threads=-2 must be >= 0"),
    Case(REWARD, ["--gradient_checkpointing", "perhaps"], r"--gradient_checkpointing.*got perhaps"),
    Case(REWARD, ["--config", "{files}/bad.yaml"], r"cannot read the config file"),
    Case(
        REWARD,
        ["--drifted_policy", "{files}/missing"],
        r"--drifted_policy is only used by --dataset rotten-tomatoes-topic or rotten-tomatoes-full",
    ),
    Case(
        REWARD,
        ["--dataset", "rotten-tomatoes-film", "--drifted_policy", "{files}/missing"],
        r"--drifted_policy is only used by .* \(got --dataset rotten-tomatoes-film\)",
    ),
    Case(
        REWARD,
        ["--dataset", "rotten-tomatoes-topic", "--drifted_policy", "{files}/missing"],
        r"policy adapter folder .*missing does not exist",
    ),
    Case(
        REWARD,
        ["--dataset", "rotten-tomatoes-full", "--drifted_policy", "{files}/missing"],
        r"policy adapter folder .*missing does not exist",
    ),
    Case(
        REWARD,
        ["--dataset", "rotten-tomatoes-topic", "--drifted_policy", "{reward}"],
        r"--drifted_policy .* is a sequence-classification \(reward\) adapter: pass a policy's",
    ),
]

EVALUATE = "evaluate"
CASES += [
    Case(EVALUATE, [NO_DEFAULTS], r"evaluating the base alone needs --output_dir"),
    Case(EVALUATE, ["--reward_fns", "m:f"], r"--reward_fns: did you mean --reward_fn\?"),
    Case(EVALUATE, ["--reward_fn", "no_such_module:f"], r"--reward_fn 'no_such_module:f': could not import"),
    Case(
        EVALUATE,
        ["--policy_adapter", "{files}/missing"],
        r"policy adapter folder .*missing does not exist; pass the folder that `marl train-rloo` wrote",
    ),
    Case(EVALUATE, ["--sampler", "vllm"], r"--sampler 'vllm' is not a registered sampler.*'transformers'"),
    Case(EVALUATE, ["--policy_adapter", "{reward}"], r"sequence-classification \(reward\) adapter"),
    Case(EVALUATE, ["--reward_adapter", "{files}/reward-truncated"], r"cannot read the adapter weights"),
    Case(
        EVALUATE, ["--reward_adapter", "{files}/missing"], r"reward adapter folder .*missing does not exist"
    ),
    Case(EVALUATE, ["--reward_adapter", "tone={files}/missing"], r"reward adapter folder .*missing does not"),
    Case(EVALUATE, ["--reward_adapter", "bad name={reward}"], r"'bad name' is not usable"),
    Case(EVALUATE, ["--model_name_or_path", "{files}/missing"], r"no such model folder"),
    Case(EVALUATE, ["--quantization", "16bit"], r"quantization='16bit' is unknown"),
    Case(EVALUATE, ["--dataset_name", "{files}/missing.jsonl"], r"no such dataset file"),
    Case(EVALUATE, ["--dataset_name", "{files}/malformed.jsonl"], r"cannot read the dataset .*malformed"),
    Case(
        EVALUATE,
        ["--dataset_name", "rotten-tomatoes", "--dataset_split", "dev"],
        r"splits .*not 'dev': pass one of them with --dataset_split$",
    ),
    Case(EVALUATE, ["--prompt_column", "title"], r"no column 'title'"),
    Case(EVALUATE, ["--num_prompts", "0"], r"--num_prompts=0 must be a positive integer"),
    Case(EVALUATE, ["--response_length", "0"], r"--response_length=0 must be a positive integer"),
    Case(EVALUATE, ["--batch_size", "-1"], r"--batch_size=-1 must be a positive integer"),
    Case(EVALUATE, ["--temperature", "nan"], r"--temperature=nan is not a finite number"),
    Case(EVALUATE, ["--temperature", "0"], r"--temperature=0.0 must be > 0"),
    Case(EVALUATE, ["--seed", "-1"], r"--seed=-1 is out of range"),
    Case(EVALUATE, ["--threads", "-1"], r"--threads=-1 must be >= 0"),
    Case(EVALUATE, ["--stop_at_eos", "often"], r"--stop_at_eos.*got often"),
    Case(EVALUATE, ["--judge", "vader"], r"--judge 'vader' must look like 'module:function'"),
    Case(EVALUATE, ["--judge", "no_such_judges:score"], r"--judge .*could not import 'no_such_judges'"),
    Case(
        EVALUATE, ["--judge", "{rfn}:boom_judge"], r"judge .*boom_judge' raised RuntimeError: judge crashed"
    ),
    Case(EVALUATE, ["--judge", "{rfn}:short_judge"], r"judge .*short_judge' returned 1 scores for 2"),
    Case(EVALUATE, ["--output_dir", "{files}/a-file"], r"a-file is a file; --output_dir must be a folder"),
]

DEMO = "demo"
CASES += [
    Case(DEMO, ["--output_dir", "{run}"], r"policy already holds a run", prepare=lambda run: shutil.copytree(
        run, run / "policy", ignore=shutil.ignore_patterns("policy"))),
    Case(DEMO, ["--reward_adapter", "{files}/missing-reward"], r"no reward adapter in .*--train_reward"),
    Case(DEMO, ["--total_episodes", "0"], r"total_episodes=0 must be positive"),
    Case(DEMO, ["--reward_normalization", "nope"], r"--reward_normalization 'nope' is not a registered"),
    Case(DEMO, ["--rewards", "sentiment,fluency"], r"unknown reward 'fluency'; pass 'sentiment'"),
    Case(DEMO, ["--rewards", "topic"], r"must name sentiment"),
    Case(DEMO, ["--topic_weight", "-1"], r"--topic_weight=-1.0 must be a positive finite number"),
    Case(
        DEMO,
        ["--reward_adapter", "{reward}", "--rewards", "sentiment,topic", "--topic_reward_adapter", "{files}"],
        r"no on-topic reward adapter in .*--rewards sentiment for the single-reward demo",
    ),
    Case(DEMO, ["--rloo_k", "1"], r"rloo_k=1"),
    Case(DEMO, ["--per_device_train_batch_size", "0"], r"per_device_train_batch_size=0 must be"),
    Case(DEMO, ["--num_mini_batches", "0"], r"num_mini_batches=0 must be"),
    Case(DEMO, ["--num_ppo_epochs", "0"], r"num_ppo_epochs=0 must be"),
    Case(DEMO, ["--learning_rate", "nan"], r"--learning_rate=nan is not a finite number"),
    Case(DEMO, ["--warm_start_epochs", "-1"], r"--warm_start_epochs=-1.0 must be 0 \(no warm start\)"),
    Case(DEMO, ["--kl_coef", "inf"], r"--kl_coef=inf is not a finite number"),
    Case(DEMO, ["--response_length", "0"], r"response_length=0 must be a positive integer"),
    Case(DEMO, ["--temperature", "0"], r"temperature=0.0 must be > 0"),
    Case(DEMO, ["--num_eval_prompts", "0"], r"--num_eval_prompts=0 must be a positive integer"),
    Case(DEMO, ["--seed", "-1"], r"--seed=-1 is out of range"),
    Case(DEMO, ["--threads", "-1"], r"--threads=-1 must be >= 0"),
    Case(DEMO, ["--train_reward", "please"], r"--train_reward.*got please"),
    Case(DEMO, ["--sweep", "rloo_k=4,8"], r"--sweep rloo_k: cannot differ between the policies"),
    Case(DEMO, ["--sweep", "reward_weights=1:0.5,1:1"], r"--sweep reward_weights is not supported"),
    Case(DEMO, ["--warm_start_epochs", "1", "--sweep", "seed=1,2"], r"--sweep with --warm_start_epochs"),
    Case(DEMO, ["--sweep", "seed=1", "--sweep", "seed=2"], r"--sweep seed is given twice"),
    Case(DEMO, ["--output_dir", "{run}", "--sweep", "seed=1,2"], r"seed=2 already holds a run",
         prepare=lambda run: shutil.copytree(run, run / "seed=2", ignore=shutil.ignore_patterns("seed=2"))),
]  # fmt: skip

PLAN = "plan"
CASES += [
    Case(PLAN, ["--device", "tpu"], r"--device 'tpu' is not one of \['cuda', 'cpu'\]"),
    Case(PLAN, ["--memory_gb", "0"], r"--memory_gb 0.0 must be a positive number of GB"),
    Case(PLAN, ["--memory_gb", "nan"], r"--memory_gb=nan is not a finite number\. Pass a real number, or "
         r"leave --memory_gb unset$"),
    Case(PLAN, ["--prompt_length", "0"], r"--prompt_length and --num_processes must be 1 or more"),
    Case(PLAN, ["--num_processes", "0"], r"--prompt_length and --num_processes must be 1 or more"),
    Case(PLAN, ["--compare", "maybe"], r"--compare.*got maybe"),
    Case(PLAN, ["--tool_calls", "sometimes"], r"--tool_calls.*got sometimes"),
    Case(PLAN, ["--model_name_or_path", "{files}/not-a-model"], r"not-a-model is not a model folder"),
    Case(PLAN, ["--model_name_or_path", "{files}/bad-config"], r"cannot read the model config .*bad-config"),
    Case(PLAN, ["--model_name_or_path", "{files}/missing"], r"no such model folder: .*missing"),
    Case(PLAN, ["--rloo_k", "1"], r"rloo_k=1"),
    Case(PLAN, ["--sampler", "vllm"], r"--sampler 'vllm'"),
    Case(PLAN, ["--sweep", "rloo_k=2,4"], r"--sweep rloo_k: cannot differ between the policies of a sweep"),
    Case(PLAN, ["--sweep", "seed=1,2", "--num_processes", "2"], r"--sweep trains its 2 policies in one"),
]  # fmt: skip

for index, case in enumerate(CASES):
    case.id = f"{case.command}-{index:03d}-" + re.sub(r"\W+", "_", " ".join(case.words))[:60]


def command_words(case: Case, paths: dict[str, str], run: Path) -> list[str]:
    """The case's flags after the flags of a command that would work, so that only the case's input is bad."""
    values = {**paths, "run": str(run)}
    words = [word.format_map(values) for word in case.words if word not in (NO_REWARD, NO_DEFAULTS)]
    if NO_DEFAULTS in case.words:
        return words
    files = Path(paths["files"])
    if case.command == RLOO:
        defaults = rloo_defaults(files, paths["base"], str(run))
        if NO_REWARD in case.words or {"--reward_fn", "--reward_adapter", "--reward"} & set(words):
            position = defaults.index("--reward_fn")
            del defaults[position : position + 2]
        if "--output_dir" not in words and "--resume_from_checkpoint" not in words:
            defaults.append("--overwrite_output_dir")  # whatever fails must leave the earlier run as it was
        return [*defaults, *words]
    if case.command == REWARD:
        defaults = ["--model_name_or_path", paths["base"], "--dataset", str(files / "pairs.jsonl")]
        defaults += ["--output_dir", str(run / "reward"), "--quantization", "none", "--max_length", "16"]
        return [*defaults, *words]
    if case.command == EVALUATE:
        defaults = ["--model_name_or_path", paths["base"], "--policy_adapter", paths["completed"]]
        defaults += ["--reward_adapter", paths["reward"], "--dataset_name", str(files / "prompts.jsonl")]
        defaults += ["--prompt_column", "text", "--num_prompts", "2", "--response_length", "3"]
        return [*defaults, "--output_dir", str(run / "evaluation"), *words]
    if case.command == PLAN:
        return ["--model_name_or_path", paths["base"], "--device", "cpu", *words]
    # the demo: a missing reward adapter stops any case that got past its own check, before the real model
    return ["--output_dir", str(run / "demo"), "--reward_adapter", str(files / "missing-reward"), *words]


def snapshot(folder: Path) -> dict[str, bytes]:
    return {
        str(path.relative_to(folder)): path.read_bytes() if path.is_file() else b"<folder>"
        for path in sorted(folder.rglob("*"))
    }


@pytest.mark.parametrize("case", CASES, ids=[case.id for case in CASES])
def test_bad_input_is_one_line_with_the_fix_and_nothing_is_touched(case, paths, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(paths["completed"] if case.from_checkpoints else paths["previous"], run)
    if case.prepare is not None:
        case.prepare(run)
    before = snapshot(run)
    line = refused(capsys, main, [case.command, *command_words(case, paths, run)])
    assert line.startswith(f"marl {case.command}: error: "), line
    assert re.search(case.expected, line), line
    # a command's error names flags, not Python keyword arguments
    assert not re.search(r"(?<![-\w])(reward_adapter|policy_adapter|reward_funcs)=", line), line
    assert snapshot(run) == before


def test_the_sweep_covers_every_flag_of_every_subcommand():
    from dataclasses import fields

    from marl.apps.cli import ScriptArguments
    from marl.apps.demo import DemoArguments
    from marl.apps.evaluate import EvaluateArguments
    from marl.apps.plan import PlanArguments
    from marl.config import RLOOConfig
    from marl.train.reward_training import RewardAdapterArguments

    flags_of = {
        RLOO: [ScriptArguments, RLOOConfig],
        REWARD: [RewardAdapterArguments],
        EVALUATE: [EvaluateArguments],
        DEMO: [DemoArguments],
        PLAN: [PlanArguments],  # its RLOOConfig flags are parsed as train-rloo's
    }
    for command, kinds in flags_of.items():
        swept = {
            word[2:].split("=")[0]
            for case in CASES
            if case.command == command
            for word in case.words
            if word.startswith("--")
        }
        missing = {item.name for kind in kinds for item in fields(kind)} - swept
        assert not missing, f"{command}: no bad-input case for {sorted(missing)}"
    counts = {command: sum(case.command == command for case in CASES) for command in flags_of}
    assert sum(counts.values()) == len(CASES) > 150, counts


def test_evaluate_takes_a_named_reward_adapter_as_train_rloo_does(paths, tmp_path):
    files = Path(paths["files"])
    main([
        "evaluate", "--model_name_or_path", paths["base"], "--policy_adapter", paths["completed"],
        "--reward_adapter", f"tone={paths['reward']}", "--dataset_name", str(files / "prompts.jsonl"),
        "--prompt_column", "text", "--num_prompts", "2", "--response_length", "3",
        "--output_dir", str(tmp_path / "evaluation"),
    ])  # fmt: skip
    results = json.loads((tmp_path / "evaluation" / "eval_results.json").read_text())
    assert results["policy"]["reward_score"] is not None


def test_the_negative_form_of_a_setting_has_its_own_help(capsys):
    with pytest.raises(SystemExit):
        main(["train-rloo", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    negative = text.split("--no_share_prompt_prefix, --no-share-prompt-prefix ")[1]
    assert negative.startswith("Turn --share_prompt_prefix off (as --share_prompt_prefix false); it is on")


# ---------------------------------------------------------------------- --debug, and bugs


def test_debug_shows_the_traceback_of_an_expected_error(capsys, monkeypatch):
    from marl.errors import ConfigError

    with pytest.raises(ConfigError, match="rloo_k=1"):
        main(["train-rloo", "--reward_fn", "m:f", "--rloo_k", "1", "--debug"])
    monkeypatch.setenv("MARL_DEBUG", "1")
    with pytest.raises(ConfigError, match="rloo_k=1"):
        main(["train-rloo", "--reward_fn", "m:f", "--rloo_k", "1"])


def test_an_unexpected_error_keeps_its_traceback(monkeypatch, tmp_path):
    import marl.apps.cli

    def broken(*arguments, **options):
        raise RuntimeError("a bug in marl")

    monkeypatch.setattr(marl.apps.cli, "build_rloo_trainer", broken)
    with pytest.raises(RuntimeError, match="a bug in marl"):
        main(["train-rloo", "--reward_fn", "m:f", "--output_dir", str(tmp_path / "run")])


def test_every_subcommand_and_example_runs_inside_the_error_boundary(capsys):
    for command in ("train-rloo", "train-reward", "evaluate", "demo", "plan"):
        line = refused(capsys, main, [command, "--seed", "-5", "--output_dir", "x"])
        assert (
            line == f"marl {command}: error: --seed=-5 is out of range. Pass a seed between 0 and 2147483647"
        )
    for script in ("train_rloo_adapter.py", "train_reward_adapter.py"):
        result = subprocess.run(
            [sys.executable, str(REPOSITORY / "examples" / script), "--seed", "-5", "--output_dir", "x"],
            capture_output=True,
            text=True,
            env={**os.environ, "PYTHONPATH": str(REPOSITORY)},
        )
        assert result.returncode == 2, result.stderr
        assert "Traceback" not in result.stderr
        assert re.search(r"error: --seed=-5 is out of range", result.stderr), result.stderr


# ------------------------------------------------------------------ the defects, as users see them


def console(*words: str) -> subprocess.CompletedProcess:
    """``marl WORDS`` as the console script runs it (``python -m marl.apps.cli``), in a fresh process, as on
    a CPU with AVX512-BF16 (where bitsandbytes has a notice of its own to log at import), whatever CPU runs
    it."""
    environment = {**os.environ, "PYTHONPATH": str(REPOSITORY), "OMP_NUM_THREADS": "1"}
    environment.pop("MARL_DEBUG", None)
    return subprocess.run(
        module_running("marl.apps.cli", *words), capture_output=True, text=True, env=environment
    )


PROGRESS_FRAME = re.compile(r"\d+%\|.*\| *\d+/\d+ \[")


def assert_one_line_error(
    result: subprocess.CompletedProcess, expected: str, after_loading: bool = False
) -> None:
    """The whole of stderr is the error line: no library notice before it, nor, for a mistake found before any
    work, a progress bar (one found ``after_loading`` the base follows the bars of that work)."""
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    *before, line = result.stderr.splitlines()
    if after_loading:
        before = [frame for frame in before if frame and not PROGRESS_FRAME.search(frame)]
    assert before == [], result.stderr
    assert line.startswith("marl train-rloo: error: ") and re.search(expected, line), result.stderr


DEFECTS = [
    ("A: a damaged checkpoint", ["--resume_from_checkpoint", "latest", "--save_steps", "1"],
     r"cannot read .*checkpoint-2/adapter_model\.safetensors"),
    ("A: a malformed JSONL line", ["--dataset_name", "{files}/malformed.jsonl"], r"malformed\.jsonl"),
    ("D: a truncated adapter file", ["--reward_adapter", "{files}/reward-truncated"],
     r"reward-truncated/adapter_model\.safetensors"),
    ("E: temperature=nan", ["--temperature", "nan"], r"--temperature=nan is not a finite number"),
    ("E: kl_coef=nan", ["--kl_coef", "nan"], r"--kl_coef=nan is not a finite number"),
    ("F: no such model folder", ["--model_name_or_path", "{files}/missing"], r"no such model folder"),
    # refused once the model stack (PEFT, bitsandbytes) is imported
    ("after the imports: a sweep of quantizations", ["--sweep", "quantization=4bit,8bit"],
     r"--sweep quantization: cannot differ .*Set --quantization once"),
    ("after the imports: a --fit budget nothing fits",
     ["--fit", "auto", "--fit_memory_gb", "0.001", "--dataset_name", "{files}/unread-prompts.jsonl"],
     r"--fit auto: nothing fits .* or --fit off to run the settings as typed"),
    ("after loading: a reward adapter without a score head", ["--reward_adapter", "{completed}"],
     r"no score head"),
]  # fmt: skip
# found once the base has loaded: their line follows the loading's progress bars
AFTER_LOADING = ("A: a damaged checkpoint", "after loading: a reward adapter without a score head")


@pytest.mark.slow
@pytest.mark.parametrize(("defect", "flags", "expected"), DEFECTS, ids=[defect[0] for defect in DEFECTS])
def test_defect_through_the_console_script(defect, flags, expected, paths, tmp_path):
    """Each ends with one line and exit code 2, and the run in the output folder is untouched."""
    run = tmp_path / "run"
    shutil.copytree(paths["completed"], run)
    if defect.startswith("A: a damaged checkpoint"):
        os.truncate(run / "checkpoint-2" / "adapter_model.safetensors", 20)
    before = snapshot(run)
    case = Case(RLOO, [*flags, "--output_dir", "{run}"], expected)
    if "--resume_from_checkpoint" not in flags:
        case.words.append("--overwrite_output_dir")
    assert_one_line_error(console(RLOO, *command_words(case, paths, run)), expected, defect in AFTER_LOADING)
    assert snapshot(run) == before


@pytest.mark.slow
def test_defect_c_overwrite_with_a_mistyped_dataset_keeps_the_earlier_run(paths, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(paths["completed"], run)
    before = snapshot(run)
    flags = ["--dataset_name", "{files}/prompts.jsnol", "--output_dir", "{run}", "--overwrite_output_dir"]
    case = Case(RLOO, flags, "")
    assert_one_line_error(console(RLOO, *command_words(case, paths, run)), r"no such dataset file.*jsnol")
    assert snapshot(run) == before


@pytest.mark.slow
def test_defect_h_a_run_that_fails_at_its_first_rollout_leaves_nothing(paths, tmp_path):
    run = tmp_path / "run"
    case = Case(RLOO, ["--reward_fn", "{rfn}:short", "--output_dir", "{run}"], "")
    result = console(RLOO, *command_words(case, paths, run))
    assert_one_line_error(result, r"returned 3 scores for 4", after_loading=True)
    assert not run.exists() or not any(run.iterdir())
    assert not plan_start(run).replace  # the corrected command is not refused
