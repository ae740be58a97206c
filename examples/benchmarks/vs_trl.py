"""marl's RLOOTrainer against TRL's RLOOTrainer on the same jobs: memory and throughput, side by side.

Both systems train a LoRA policy with RLOO on the same base model (same quantization, same ``LoraConfig``),
the same prompts, the same reward adapter, the same k, batch, number of updates, seed, temperature, learning
rate and a fixed completion length. The difference being measured is the one a user sees:

- marl: ONE base model; policy, reference and reward are adapters on it (``marl.MultiAdapterModel``).
- TRL: the policy is the base + ``peft_config`` (TRL already takes the reference by disabling the adapter),
  and the reward is what a TRL user loads: a second copy of the base as ``AutoModelForSequenceClassification``
  with the reward adapter on top (``PeftModel.from_pretrained``), passed in ``reward_funcs``.

Every run is its own process; runs alternate between the systems. Memory is sampled in each run (PSS, RSS and
anonymous RSS, overall and per phase: load, generation, scoring, update; see ``measure.py``); the memory
ratio marl/TRL is the peak PSS above the import baseline. When ``marl.RLOOConfig`` has the field
``share_prompt_prefix``, marl runs both with it on (``marl``) and off (``marl-unshared``).

Setups (``--setup``, a comma list; ``cpu`` = the three CPU setups, each in fp32 and 4-bit):

    cpu-short    bundled SmolLM2-135M-Instruct, 4-word review openings, 16-token completions, k = 4
    cpu-long     the same model, prompts of >= 128 tokens (review snippets as context + an instruction),
                 32-token completions, k = 4
    cpu-long4    the long prompts with 4 prompts x k = 4 per update (closer to RLHF shapes)
    cpu-weights  a Qwen2.5-0.5B-shaped model from a config (random weights, SmolLM2 tokenizer), short prompts
    gpu-0.5b     one CUDA GPU, Qwen2.5-0.5B's shapes from a config (random weights, a tokenizer the benchmark
                 trains itself: built_models.py), bf16, 8 prompts of 256 tokens x k = 8, 256-token completions
    gpu-1.5b     the same with Qwen2.5-1.5B's shapes

The GPU setups compare marl with its three samplers (``marl-graph``: the graph decode, compiled;
``marl-cudagraph``: the same with its step captured in plain CUDA graphs; ``marl``: the eager
static decode, ``marl-generate``: ``generate``) against TRL's RLOOTrainer (``trl``) and GRPOTrainer
(``trl-grpo``), both without vLLM and with ``cache_implementation="static"``. ``--systems hf-generate``
adds transformers' own compiled decode: marl sampling with ``generate``, a static cache and its
``torch.compile(mode="reduce-overhead")`` decode step, which TRL turns off (``hf_generate.py`` says why).
``--dry-run`` shrinks every setup to a tiny model on the CPU and runs each system once: the code path of a GPU
run, checked on a CPU.

Configuration mapping (marl/the classic RLOO trainer -> TRL 1.16, whose RLOO is built on its GRPO loop):

    rloo_k          -> num_generations
    kl_coef         -> beta
    cliprange       -> epsilon
    num_ppo_epochs  -> num_iterations
    response_length -> max_completion_length   (and min_new_tokens = response_length in both)

Commands:

    python examples/benchmarks/vs_trl.py                     # every CPU setup, fp32 and 4-bit, 3 runs each
    python examples/benchmarks/vs_trl.py --setup cpu-long --quantization 4bit --runs 5
    python examples/benchmarks/vs_trl.py --setup cpu-long4 --algorithm grpo   # grpo preset vs GRPOTrainer
    python examples/benchmarks/vs_trl.py --setup gpu         # on a machine with one CUDA GPU
    python examples/benchmarks/vs_trl.py --setup gpu --dry-run --quantization none   # its code path, on a CPU
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the helpers next to this script
from floors import probe_in_subprocess
from measure import MemorySampler, UpdateClock, estimate_minutes, label_calls, mapped_file_memory, summarize
from report_markdown import render_markdown
from setups import (
    DEFAULT_RUN_SECONDS,
    DRY_RUN,
    DRY_RUN_LLAMA,
    GPU_SYSTEMS,
    LLAMA_SETUPS,
    QUANTIZATIONS,
    RANDOM_QWEN2,
    REPO_ROOT,
    RUN_SECONDS,
    SETUP_GROUPS,
    SETUPS,
    BenchConfig,
    compute_floor,
    phase_work_of,
    prepare_model,
    prepare_prompts,
    prepare_reward_adapter,
    prompt_token_range,
    reward_adapter_note,
    trl_sampling_and_objective,
)


def marl_systems() -> tuple[str, ...]:
    """``marl`` (and ``marl-unshared`` when this marl can turn prompt-prefix sharing off, ``marl-generate``
    when its default sampler is not ``generate``: marl sampling with ``--sampler transformers``)."""
    from marl import RLOOConfig

    names = {field.name for field in dataclasses.fields(RLOOConfig)}
    from marl.rollout.samplers import SAMPLERS

    systems = ("marl", "marl-unshared") if "share_prompt_prefix" in names else ("marl",)
    if RLOOConfig(output_dir="x").sampler != "transformers":
        systems = (*systems, "marl-generate")
    if "graph" not in SAMPLERS:
        return systems
    # marl-cudagraph: the graph sampler with its step captured in plain CUDA graphs (--graph_capture)
    return ("marl-graph", *(("marl-cudagraph",) if "graph_capture" in names else ()), *systems)


# marl sampling with transformers' compiled `generate` (hf_generate.py): the system and its sampler's name.
HF_GENERATE = "hf-generate"
# The sampler of each marl system, named even where it is marl's default: the default is the device's
# (graph on a CUDA device, static on a CPU: marl.config.device), and `marl` is the eager static decode.
MARL_SAMPLERS = {
    "marl": "static",
    "marl-unshared": "static",
    "marl-generate": "transformers",
    "marl-graph": "graph",
    "marl-cudagraph": "graph",
    HF_GENERATE: HF_GENERATE,
}
# trl-grpo-cb: GRPOTrainer generating with transformers' continuous batching (use_transformers_continuous_
# batching) instead of `generate` with a static cache: TRL 1.16's other way to sample without vLLM. Neither
# is compiled: TRL builds its GenerationConfig with disable_compile=True (hf_generate.py: only that stops it).
TRL_SYSTEMS = ("trl", "trl-grpo", "trl-grpo-cb")
# --algorithm: marl's preset, and TRL's trainer that `trl` then runs (RLOOTrainer or GRPOTrainer)
ALGORITHMS = ("rloo", "grpo")


# ------------------------------------------------------------------------------------------------------------
# The two workers (each in its own process)


def _torch_setup(config: BenchConfig):
    import torch
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    if config.threads:
        torch.set_num_threads(config.threads)
    if config.device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"setup {config.setup!r} needs a CUDA GPU and none is visible")
    return torch


def _lora_config(config: BenchConfig):
    from peft import LoraConfig

    return LoraConfig(
        r=config.lora_r,
        lora_alpha=config.lora_alpha,
        lora_dropout=config.lora_dropout,
        target_modules=config.lora_target_modules,
        task_type="CAUSAL_LM",
    )


def _timed(owner, attribute: str, seconds: list[float], torch) -> None:
    """``owner.attribute`` timed at every call (CUDA synchronised around it), its seconds to ``seconds``."""
    call = getattr(owner, attribute)
    cuda = torch.cuda.is_available()

    def timed(*args, **kwargs):
        if cuda:
            torch.cuda.synchronize()
        started = time.perf_counter()
        value = call(*args, **kwargs)
        if cuda:
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - started)
        return value

    setattr(owner, attribute, timed)


def sampling_figures(seconds: list[float], config: BenchConfig) -> dict[str, float]:
    """Sampling tokens/s and seconds per decode step (prefill included) of the median sampling call after the
    first (its warm-up and compilation excluded), and the seconds of that first call (what a user waits for
    the first update's completions, compilation included); one call samples one update's completions.

    Example:
        >>> config = BenchConfig("s", "m", "cpu", "float32", 2, 4, 10, 3)
        >>> sampling_figures([9.0, 2.0, 4.0], config)
        {'sampling_tokens_per_s': 26.666666666666668, 'decode_step_ms': 300.0, 'first_sampling_s': 9.0}
    """
    import statistics

    measured = seconds[1:] or seconds
    if not measured:
        return {}
    spent = statistics.median(measured)
    return {
        "sampling_tokens_per_s": config.batch_size * config.response_length / spent,
        "decode_step_ms": 1000 * spent / config.response_length,
        "first_sampling_s": seconds[0],
    }


def _finish(result: dict, sampler: MemorySampler, torch, config: BenchConfig) -> dict:
    result["memory"] = sampler.stop()
    if config.device == "cuda":
        result["cuda_max_allocated_mib"] = torch.cuda.max_memory_allocated() / 2**20
        result["cuda_max_reserved_mib"] = torch.cuda.max_memory_reserved() / 2**20
    return result


def continuous_batching_sizes(config: BenchConfig, longest_prompt: int) -> dict[str, int]:
    """The sizes of transformers' paged cache for ``trl-grpo-cb`` on a CPU, fixed by the run: room for every
    completion of an update at once (its prompt, its response and a block to spare), all their prompts in one
    batch. Sized from the free memory instead, a small share of it can fall below the cache's fixed overhead,
    which depends on the machine and on what else runs there: a negative number of blocks.

    Example:
        >>> config = BenchConfig(setup="dry", model="tiny", device="cpu", dtype="float32",
        ...                      prompts_per_update=2, rloo_k=2, response_length=8, updates=2)
        >>> continuous_batching_sizes(config, longest_prompt=40)
        {'num_blocks': 8, 'max_batch_tokens': 160, 'max_requests_per_batch': 4}
    """
    tokens_per_block = 256  # ContinuousBatchingConfig's page_size
    blocks = -(-(longest_prompt + config.response_length) // tokens_per_block) + 1
    return {
        "num_blocks": config.batch_size * blocks,
        "max_batch_tokens": config.batch_size * longest_prompt,
        "max_requests_per_batch": config.batch_size,
    }


def run_trl(job: dict, sampler: MemorySampler) -> dict:
    """One TRL run: policy = base + peft_config; reward = a separate SequenceClassification copy + PEFT."""
    config = BenchConfig(**job["config"])
    torch = _torch_setup(config)
    import datasets
    from peft import PeftModel
    from transformers import AutoModelForSequenceClassification, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer
    from trl import RLOOConfig as TRLRLOOConfig
    from trl import RLOOTrainer as TRLRLOOTrainer

    from marl.model.quantization import bitsandbytes_config

    model_path, dtype = job["model_path"], getattr(torch, config.dtype)
    bnb = bitsandbytes_config(job["quantization"], dtype)
    device_map = {"": 0} if config.device == "cuda" else None
    tokenizer = AutoTokenizer.from_pretrained(model_path, padding_side="left")
    reward_model = AutoModelForSequenceClassification.from_pretrained(
        model_path, num_labels=1, dtype=dtype, quantization_config=bnb, device_map=device_map
    )
    reward_model = PeftModel.from_pretrained(reward_model, job["reward_adapter"])
    reward_model.eval()
    # TRL sets the pad id only on PreTrainedModel rewards; a PeftModel needs it set by the user.
    reward_model.config.pad_token_id = tokenizer.pad_token_id
    clock, completion_lengths = UpdateClock(), []

    class Measure(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            clock.start = time.perf_counter()

        def on_step_begin(self, args, state, control, **kwargs):
            sampler.push("update")  # the rollout inside labels itself (see below)

        def on_step_end(self, args, state, control, **kwargs):
            sampler.pop()
            clock.tick()
            sampler.mark("after update")

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "completions/mean_length" in logs:
                completion_lengths.append(logs["completions/mean_length"])

    config_class, trainer_class = (
        (GRPOConfig, GRPOTrainer)
        if job["system"] in ("trl-grpo", "trl-grpo-cb") or config.algorithm == "grpo"
        else (TRLRLOOConfig, TRLRLOOTrainer)
    )
    cache = {"cache_implementation": config.cache_implementation} if config.cache_implementation else {}
    if job["system"] == "trl-grpo-cb":
        cache = {"use_transformers_continuous_batching": True}
        if config.device == "cpu":  # on a GPU it takes its share of the free memory, as TRL sizes it
            longest = max(len(tokenizer(prompt)["input_ids"]) for prompt in job["prompts"])
            cache["transformers_continuous_batching_config"] = continuous_batching_sizes(config, longest)
    with tempfile.TemporaryDirectory(prefix="vs-trl-") as output_dir:
        args = config_class(
            output_dir=output_dir,
            max_steps=config.updates,
            per_device_train_batch_size=config.batch_size,
            gradient_accumulation_steps=1,
            **trl_sampling_and_objective(config, seed=config.seed),
            bf16=config.dtype == "bfloat16",
            use_cpu=config.device == "cpu",
            gradient_checkpointing=config.gradient_checkpointing,
            model_init_kwargs={"dtype": dtype, "device_map": device_map},
            logging_steps=1,
            save_strategy="no",
            report_to="none",
            disable_tqdm=True,
            **cache,
        )
        trainer = trainer_class(
            model=model_path,
            reward_funcs=reward_model,
            args=args,
            train_dataset=datasets.Dataset.from_dict({"prompt": job["prompts"]}),
            processing_class=tokenizer,
            reward_processing_classes=tokenizer,
            peft_config=_lora_config(config),
            quantization_config=bnb,
            callbacks=[Measure()],
        )
        checkpoint = mapped_file_memory(model_path)
        sampler.mark("after load")
        sampler.set_base_phase("other")
        sampling_seconds: list[float] = []
        _timed(trainer, "_generate", sampling_seconds, torch)
        labelled = [
            label_calls(sampler, trainer, "_generate_and_score_completions", "scoring"),
            label_calls(sampler, trainer, "_generate", "generation"),
        ]
        trainer.train()
    result = clock.throughput(config.batch_size, config.batch_size * config.response_length)
    result.update(checkpoint_after_load=checkpoint, checkpoint_at_end=mapped_file_memory(model_path))
    result.update(phases_labelled=all(labelled), lengths=completion_lengths)
    result.update(sampling_figures(sampling_seconds, config))
    return _finish(result, sampler, torch, config)


def run_marl(job: dict, sampler: MemorySampler) -> dict:
    """One marl run: one base, the policy/reference/reward as adapters on it."""
    config = BenchConfig(**job["config"])
    torch = _torch_setup(config)
    import datasets
    from transformers import AutoTokenizer

    import marl.train.trainer
    from marl import MultiAdapterModel, RLOOConfig, RLOOTrainer

    if job["system"] == HF_GENERATE:
        from hf_generate import register_sampler

        register_sampler(HF_GENERATE)
    model_path = job["model_path"]
    model = MultiAdapterModel.from_pretrained(
        model_path,
        quantization=None if job["quantization"] == "none" else job["quantization"],
        reward_adapter=job["reward_adapter"],
        policy_adapter=_lora_config(config),
        dtype=getattr(torch, config.dtype),
        device_map={"": 0} if config.device == "cuda" else None,
        gradient_checkpointing=config.gradient_checkpointing,
    )
    tokenizer = AutoTokenizer.from_pretrained(model.name_or_path, padding_side="left")
    sharing = (
        {} if job["share_prompt_prefix"] is None else {"share_prompt_prefix": job["share_prompt_prefix"]}
    )
    with tempfile.TemporaryDirectory(prefix="vs-trl-") as output_dir:
        rloo_config = RLOOConfig(
            output_dir=output_dir,
            algorithm=config.algorithm,
            rloo_k=config.rloo_k,
            per_device_train_batch_size=config.batch_size,
            gradient_accumulation_steps=1,
            num_mini_batches=1,
            num_ppo_epochs=config.num_ppo_epochs,
            total_episodes=config.batch_size * config.updates,
            local_rollout_forward_batch_size=config.batch_size,
            response_length=config.response_length,
            stop_token="none",  # every completion runs to response_length, as TRL's with min_new_tokens
            temperature=config.temperature,
            learning_rate=config.learning_rate,
            lr_scheduler_type="linear",
            warmup_steps=0,
            kl_coef=config.kl_coef,
            cliprange=config.cliprange,
            missing_eos_penalty=None,
            normalize_reward=False,
            normalize_advantage=False,
            seed=config.seed,
            bf16=config.dtype == "bfloat16",
            gradient_checkpointing=config.gradient_checkpointing,
            logging_steps=1,
            num_sample_generations=0,
            save_steps=0,
            report_to=["none"],
            **sharing,
            sampler=MARL_SAMPLERS[job["system"]],
            **({"graph_capture": "cuda_graphs"} if job["system"] == "marl-cudagraph" else {}),
        )
        trainer = RLOOTrainer(
            config=rloo_config,
            model=model,
            tokenizer=tokenizer,
            train_dataset=datasets.Dataset.from_dict({"prompt": job["prompts"]}),
        )
        checkpoint = mapped_file_memory(model_path)
        sampler.mark("after load")
        sampler.set_base_phase("other")
        lengths: set[int] = set()
        sample = trainer.parts.sampler.sample

        def sample_and_count(*args, **kwargs):
            samples = sample(*args, **kwargs)
            lengths.update(samples.response_mask.sum(dim=1).tolist())
            return samples

        trainer.parts.sampler.sample = sample_and_count
        sampling_seconds: list[float] = []
        _timed(trainer.parts.sampler, "sample", sampling_seconds, torch)
        # The rollout (generation, then the policy/reference log-probs and the reward) and the update.
        labelled = [
            label_calls(sampler, marl.train.trainer, "collect_rollout", "scoring"),
            label_calls(sampler, trainer.parts.sampler, "sample", "generation"),
            label_calls(sampler, marl.train.trainer, "update_policies", "update", mark="after update"),
        ]
        history = trainer.train()
    # marl logs every update with `episode` and `eps` (episodes per second since the loop started), so the
    # time at the end of update i is episode_i / eps_i after the start.
    clock = UpdateClock()
    clock.start = 0.0
    clock.update_ends = [record["episode"] / record["eps"] for record in history]
    result = clock.throughput(config.batch_size, config.batch_size * config.response_length)
    result.update(checkpoint_after_load=checkpoint, checkpoint_at_end=mapped_file_memory(model_path))
    result.update(phases_labelled=all(labelled), lengths=sorted(lengths))
    result.update(sampling_figures(sampling_seconds, config))
    result["sampler_path"] = getattr(trainer.parts.sampler, "path", None)
    result["capture_seconds"] = sum(
        getattr(trainer.parts.sampler, "capture_seconds", {}).values()
    )  # cudagraph
    # |sampler log-prob - trainer log-prob| per update (where the sampler keeps its log-probs)
    for name, key in (("mean", "logprob_gap_mean"), ("max", "logprob_gap_max")):
        result[key] = [
            r[f"sampling/sampling_logp_difference/{name}"]
            for r in history
            if f"sampling/sampling_logp_difference/{name}" in r
        ]
    return _finish(result, sampler, torch, config)


def worker_main(job_path: str, result_path: str) -> None:
    job = json.loads(Path(job_path).read_text())
    import torch  # noqa: F401  (the runtime is part of the baseline, the models are not)
    import transformers  # noqa: F401

    import marl  # noqa: F401

    if job["system"] in TRL_SYSTEMS:
        import trl  # noqa: F401
    sampler = MemorySampler()
    worker = run_trl if job["system"] in TRL_SYSTEMS else run_marl
    Path(result_path).write_text(json.dumps(worker(job, sampler)))


# ------------------------------------------------------------------------------------------------------------
# Orchestration


def run_in_subprocess(job: dict, work_dir: Path, label: str) -> dict:
    """Run one measured training in a fresh interpreter and return its JSON result."""
    job_file, result_file = work_dir / f"{label}.job.json", work_dir / f"{label}.result.json"
    job_file.write_text(json.dumps(job))
    command = [sys.executable, str(Path(__file__).resolve()), "--worker", str(job_file), "--result"]
    log_file = work_dir / f"{label}.log"
    before, started = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter()
    with log_file.open("w") as log:
        completed = subprocess.run(
            [*command, str(result_file)], stdout=log, stderr=subprocess.STDOUT, check=False
        )
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if completed.returncode != 0 or not result_file.is_file():
        tail = "\n".join(log_file.read_text().splitlines()[-30:])
        raise RuntimeError(
            f"run {label} failed (exit {completed.returncode}); last lines of {log_file}:\n{tail}"
        )
    result = json.loads(result_file.read_text())
    # CPU seconds of the process: its wall time on an otherwise idle machine (one torch thread).
    result["cpu_seconds"] = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    result["wall_seconds"] = time.perf_counter() - started
    return result


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument(
        "--setup", default="cpu", help=f"comma list of {sorted(SETUPS)} or {sorted(SETUP_GROUPS)}"
    )
    parser.add_argument("--quantization", choices=[*QUANTIZATIONS, "both"], default="both")
    parser.add_argument("--runs", type=int, default=3, help="measured runs per system and configuration")
    parser.add_argument("--systems", default=None, help="comma list (default: marl[,marl-unshared],trl)")
    parser.add_argument(
        "--reward-adapter", default=None, help="reward adapter folder (default: bundled/fresh)"
    )
    parser.add_argument("--work-dir", default=None, help="generated models, adapters, logs (default: temp)")
    parser.add_argument("--output", default=None, help="results markdown (default benchmarks/results/DATE-…)")
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="every setup shrunk to a tiny model on the CPU, one run per system (results in the work dir)",
    )
    for field in dataclasses.fields(BenchConfig):
        if field.name in ("setup", "model"):
            continue
        flag = "--" + field.name.replace("_", "-")
        kind = {"str": str, "int": int, "float": float, "bool": bool}[field.type]
        if kind is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=None)
        else:
            parser.add_argument(flag, type=kind, default=None, help=f"override every setup's {field.name}")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def setup_names(value: str) -> list[str]:
    names = [
        n for part in value.split(",") if part.strip() for n in SETUP_GROUPS.get(part.strip(), [part.strip()])
    ]
    if unknown := [n for n in names if n not in SETUPS]:
        raise SystemExit(
            f"--setup: unknown {unknown}; choose from {sorted(SETUPS)} or {sorted(SETUP_GROUPS)}"
        )
    return names


def build_config(setup: str, args: argparse.Namespace) -> BenchConfig:
    """The setup's config with the command line's overrides; ``--algorithm grpo`` also sets the KL
    coefficient to GRPOConfig's ``beta`` default, 0, unless ``--kl-coef`` is given.

    Example:
        >>> build_config("cpu-long4", parse_args(["--algorithm", "grpo"])).kl_coef
        0.0
    """
    values = dict(SETUPS[setup], setup=setup, **(DRY_RUN if getattr(args, "dry_run", False) else {}))
    if getattr(args, "dry_run", False) and setup in LLAMA_SETUPS:
        values["model"] = DRY_RUN_LLAMA
    for field in dataclasses.fields(BenchConfig):
        override = getattr(args, field.name, None)
        if field.name not in ("setup", "model") and override is not None:
            values[field.name] = override
    if values.get("algorithm", "rloo") not in ALGORITHMS:
        raise SystemExit(f"--algorithm: {values['algorithm']!r} is not one of {list(ALGORITHMS)}")
    if values.get("algorithm") == "grpo" and getattr(args, "kl_coef", None) is None:
        values["kl_coef"] = 0.0  # GRPOConfig's beta
    return BenchConfig(**values)


def run_seconds(setup: str, quantization: str, system: str) -> float:
    return RUN_SECONDS.get((setup, quantization), {}).get(system.split("-")[0], DEFAULT_RUN_SECONDS)


def progress_line(label: str, result: dict) -> str:
    memory = result["memory"]
    above = memory["peak"]["pss"] - memory["baseline"]["pss"]
    updates = ", ".join(f"{s:.1f}" for s in result["update_seconds"])
    return (
        f"  {label}: peak PSS {memory['peak']['pss']:.0f} MiB ({above:.0f} above the imports), "
        f"{result['eps']:.2f} episodes/s, updates {updates} s; process {result['wall_seconds']:.0f} s, "
        f"{result['cpu_seconds']:.0f} CPU s"
    )


def run_block(
    jobs: dict[str, dict], runs: int, work_dir: Path, name: str, failures: list[dict]
) -> list[dict]:
    """``runs`` runs of every system's job, alternating the order, each in its own process. A run that fails
    goes to ``failures`` (system, the end of its log) and the others go on: one system that cannot run on a
    machine (a GPU run that cannot be repeated at will) does not cost the measurements of the rest."""
    systems, measured = list(jobs), []
    for index in range(runs):
        for system in systems if index % 2 == 0 else systems[::-1]:
            label = f"{name}-{system}-{index}"
            try:
                result = run_in_subprocess(jobs[system], work_dir, label)
            except RuntimeError as error:
                failures.append({"system": system, "run": label, "error": str(error)[-3000:]})
                print(f"  {label}: FAILED, see {work_dir / (label + '.log')}", flush=True)
                continue
            measured.append({"system": system, "result": result})
            print(progress_line(label, result), flush=True)
    return measured


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    if args.worker:
        worker_main(args.worker, args.result)
        return
    from marl.environment import machine_description, package_versions

    configs = {setup: build_config(setup, args) for setup in setup_names(args.setup)}
    known = (*marl_systems(), HF_GENERATE, *TRL_SYSTEMS)
    chosen = [s.strip() for s in args.systems.split(",") if s.strip()] if args.systems else None
    if unknown := set(chosen or ()) - set(known):
        raise SystemExit(f"--systems: unknown {sorted(unknown)}; this marl knows {list(known)}")
    systems = {setup: setup_systems(config, known, chosen) for setup, config in configs.items()}
    if args.dry_run:
        args.runs = 1
    if args.runs < 1:
        raise SystemExit("--runs must be at least 1 (3 or more for a median worth quoting)")
    quantizations = QUANTIZATIONS if args.quantization == "both" else (args.quantization,)
    plan = [(setup, q, system) for setup in configs for q in quantizations for system in systems[setup]]
    minutes = estimate_minutes(plan, run_seconds, args.runs)
    print(
        f"estimated time: {minutes:.0f} min for {len(plan) * args.runs} runs (2 cores, one thread)",
        flush=True,
    )
    started = time.perf_counter()
    work_dir = Path(args.work_dir or tempfile.mkdtemp(prefix="marl-vs-trl-"))
    work_dir.mkdir(parents=True, exist_ok=True)
    date = datetime.datetime.now(datetime.UTC)
    machine = machine_description()
    machine.pop("torch threads", None)  # of this parent process; the runs' count is the config's `threads`
    report: dict = {
        "date": date.strftime("%Y-%m-%d %H:%M UTC"),
        "command": "python " + " ".join([os.path.relpath(__file__, REPO_ROOT), *sys.argv[1:]]),
        "machine": machine,
        "versions": package_versions(),
        "systems": [s for s in known if any(s in mine for mine in systems.values())],
        "setups": {},
    }
    name = "-".join(sorted({s.split("-")[0] for s in configs})) if len(configs) > 1 else next(iter(configs))
    if algorithms := sorted({config.algorithm for config in configs.values()} - {"rloo"}):
        name += "-" + "-".join(algorithms)
    results_dir = REPO_ROOT / "benchmarks" / "results"
    output = Path(args.output) if args.output else results_dir / f"{date:%Y-%m-%d}-{name}.md"
    if args.dry_run and not args.output:
        output = work_dir / f"dry-run-{name}.md"
    for setup, config in configs.items():
        model_path = prepare_model(config, work_dir)
        reward_adapter = prepare_reward_adapter(config, model_path, work_dir, args.reward_adapter)
        prompts = prepare_prompts(config, model_path)
        entry = report["setups"][setup] = {
            "config": dataclasses.asdict(config),
            "prompt_tokens": prompt_token_range(model_path, prompts),
            "model_note": "bundled GGUF converted by marl.data.assets"
            if config.model == "smollm2-135m-instruct"
            else "built from a config with random weights"
            + (", a BPE tokenizer trained on generated text" if config.model != RANDOM_QWEN2 else ""),
            "reward_adapter_note": reward_adapter_note(reward_adapter, args.reward_adapter, config),
            "systems": systems[setup],
            "blocks": {},
        }
        for quantization in quantizations:
            block = entry["blocks"][quantization] = {"loadavg": _load_average()}
            print(f"[{setup} {quantization}] load average {block['loadavg']}", flush=True)
            common = dict(quantization=quantization, config=dataclasses.asdict(config), prompts=prompts)
            common.update(model_path=model_path, reward_adapter=reward_adapter)
            jobs = {s: dict(common, system=s, **sharing(s, known)) for s in systems[setup]}
            block["failures"] = []
            block["runs"] = run_block(jobs, args.runs, work_dir, f"{setup}-{quantization}", block["failures"])
            block["summary"] = summarize(block["runs"])
            block["floor"] = compute_floor(config, quantization, model_path, reward_adapter, prompts)
            block["machine_floors"] = probe_in_subprocess(config.threads, config.device)
            block["work"] = phase_work_of(
                config, block["floor"]["base weights (as stored)"], model_path, prompts
            )
            # Written after every block, so that an interrupted benchmark keeps what it measured.
            report["wall_minutes"] = (time.perf_counter() - started) / 60
            (work_dir / "report.json").write_text(json.dumps(report, indent=1))
            print(f"raw results: {work_dir / 'report.json'}", flush=True)
            if {"marl", "trl"} <= set(systems[setup]):
                output.parent.mkdir(parents=True, exist_ok=True)
                output.write_text(render_markdown(report))
                print(f"results: {output}", flush=True)
    blocks = [block for entry in report["setups"].values() for block in entry["blocks"].values()]
    if failed := [failure["run"] for block in blocks for failure in block["failures"]]:
        raise SystemExit(f"{len(failed)} runs failed ({', '.join(failed)}); their logs are in {work_dir}")


def setup_systems(config: BenchConfig, known: Sequence[str], chosen: Sequence[str] | None) -> list[str]:
    """The systems a setup runs: those chosen with --systems; else on a CPU setup marl and TRL's RLOOTrainer,
    and marl with prompt-prefix sharing off too where the setup compares it (and this marl can turn it off);
    on a GPU setup :data:`setups.GPU_SYSTEMS`.

    Example:
        >>> config = BenchConfig("s", "m", "cpu", "float32", 1, 4, 8, 2, compare_sharing=False)
        >>> setup_systems(config, ["marl-graph", "marl", "marl-unshared", "trl", "trl-grpo"], None)
        ['marl', 'trl']
        >>> gpu = BenchConfig("gpu-0.5b", "m", "cuda", "bfloat16", 8, 8, 256, 4)
        >>> known = ["marl-graph", "marl", "marl-unshared", "marl-generate", "trl", "trl-grpo"]
        >>> setup_systems(gpu, known, None)
        ['marl-graph', 'marl', 'marl-generate', 'trl', 'trl-grpo']
    """
    if chosen:
        return list(chosen)
    if config.setup.startswith("gpu"):
        return [s for s in GPU_SYSTEMS if s in known]
    cpu = [s for s in known if s not in ("marl-graph", "marl-cudagraph", "trl-grpo", HF_GENERATE)]
    return [s for s in cpu if s != "marl-unshared" or config.compare_sharing]


def sharing(system: str, known: Sequence[str]) -> dict:
    """``share_prompt_prefix`` for a marl run: off for ``marl-unshared``, on for every other marl system
    (``marl-generate`` differs from ``marl`` in its sampler only); None (the default) when this marl has no
    such switch, and for TRL.

    Example:
        >>> known = ["marl", "marl-unshared", "marl-generate", "trl"]
        >>> [sharing(system, known)["share_prompt_prefix"] for system in known]
        [True, False, True, None]
        >>> sharing("marl", ["marl", "trl"])
        {'share_prompt_prefix': None}
    """
    switch = "marl-unshared" in known and system != "trl"
    return {"share_prompt_prefix": system != "marl-unshared" if switch else None}


def _load_average() -> str:
    path = Path("/proc/loadavg")
    return path.read_text().strip() if path.is_file() else "n/a"


if __name__ == "__main__":
    main()
