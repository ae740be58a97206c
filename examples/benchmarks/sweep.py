"""A sweep of N policies trained at once on one base against the N runs one after another: episodes/s, the
decode phase and peak memory, for N = 1, 2, 4 and 8 (issue 44).

- ``sweep-N``: ONE process trains N policies at once (``marl.train.sweep_trainer.SweepTrainer``; the members
  differ in their seed, ``--sweep seed=0,1,...``, or with ``--swept learning_rate`` in their learning rate on
  one seed, so that they draw the same prompts and the reward and reference passes compute each prompt once
  for all of them): every update samples all policies' rows in one batched decode, scores them in the same
  passes and runs each policy's micro-batches in one loop.
- ``run``: one process trains one policy (``marl.RLOOTrainer``). N runs one after another are N such
  processes: their episodes/s is one run's (each trains the same shapes), their time N runs' (each loads
  the base again: shown with the loads too), their peak memory one run's.

Setups are vs_trl.py's (``cpu-long4`` by default: the bundled SmolLM2-135M-Instruct, prompts of at least 128
tokens, 4 prompts x k = 4 per update and policy, 32-token completions; each sweep member trains these shapes),
in fp32 and 4-bit. Every run is its own process; its memory is sampled as vs_trl.py samples it
(``measure.py``: peak PSS above the imports, per phase: generation, scoring, update) and each phase is put
beside its floor on this machine (``floors.py``: a sweep's decode reads the weights once per step for every
policy's rows, its FLOPs grow with the rows).

    python examples/benchmarks/sweep.py                                  # cpu-long4, fp32 and 4-bit, 3 runs
    python examples/benchmarks/sweep.py --policies 1,4 --quantization 4bit --runs 5
    python examples/benchmarks/sweep.py --dry-run                        # a tiny model, one run of each

Results: ``benchmarks/results/DATE-sweep-SETUP.md`` (a dry run: in the work folder).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the helpers next to this script
from floors import efficiency_rows, phase_work, probe_in_subprocess
from measure import MemorySampler, UpdateClock, label_calls, ratio, summarize
from setups import (
    DRY_RUN,
    QUANTIZATIONS,
    REPO_ROOT,
    SETUPS,
    BenchConfig,
    compute_floor,
    prepare_model,
    prepare_prompts,
    prepare_reward_adapter,
    prompt_token_range,
)

POLICY_COUNTS = (1, 2, 4, 8)
SWEPT_SETTINGS = ("seed", "learning_rate")
DRY_RUN_POLICY_COUNTS = (1, 2)


def rloo_config(config: BenchConfig, job: dict, output_dir: str):
    """The run's ``marl.RLOOConfig``: vs_trl.py's marl run (fixed-length completions, one micro-batch per
    update) on the job's base, quantization and reward adapter."""
    from marl import RLOOConfig

    return RLOOConfig(
        output_dir=output_dir,
        model_name_or_path=job["model_path"],
        quantization=None if job["quantization"] == "none" else job["quantization"],
        reward_adapter=[job["reward_adapter"]],
        rloo_k=config.rloo_k,
        per_device_train_batch_size=config.batch_size,
        gradient_accumulation_steps=1,
        num_mini_batches=1,
        num_ppo_epochs=config.num_ppo_epochs,
        total_episodes=config.batch_size * config.updates,
        local_rollout_forward_batch_size=config.batch_size,
        response_length=config.response_length,
        stop_token="none",  # every completion runs to response_length
        temperature=config.temperature,
        learning_rate=config.learning_rate,
        kl_coef=config.kl_coef,
        cliprange=config.cliprange,
        missing_eos_penalty=None,
        seed=config.seed,
        lora_r=config.lora_r,
        lora_alpha=config.lora_alpha,
        lora_target_modules=[config.lora_target_modules],
        gradient_checkpointing=config.gradient_checkpointing,
        bf16=config.dtype == "bfloat16",
        logging_steps=1,
        num_sample_generations=0,
        save_steps=0,
        report_to=["none"],
        **({"sampler": job["sampler"]} if job.get("sampler") else {}),
    )


def run_job(job: dict, sampler: MemorySampler) -> dict:
    """One measured process: a sweep of ``job["policies"]`` policies, or one run (system ``"run"``)."""
    import datasets
    import torch
    import transformers

    import marl.train.sweep_trainer
    import marl.train.trainer
    from marl import MultiAdapterModel, RLOOTrainer
    from marl.config.sweep import parse_sweep

    config = BenchConfig(**job["config"])
    transformers.logging.set_verbosity_error()
    if config.threads:
        torch.set_num_threads(config.threads)
    if config.device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"setup {config.setup!r} needs a CUDA GPU and none is visible")
    prompts = datasets.Dataset.from_dict({"prompt": job["prompts"]})
    with tempfile.TemporaryDirectory(prefix="sweep-bench-") as output_dir:
        base = rloo_config(config, job, output_dir)
        if job["system"] == "run":
            model = MultiAdapterModel.from_config(base)
            tokenizer = transformers.AutoTokenizer.from_pretrained(model.name_or_path)
            trainer = RLOOTrainer(base, model, tokenizer, prompts)
            first, rollout_owner, sample = trainer, marl.train.trainer, "sample"
        else:
            members = parse_sweep([member_spec(job.get("swept", "seed"), base, job["policies"])], base)
            model = marl.train.sweep_trainer.build_sweep_model([member.config for member in members])
            tokenizer = transformers.AutoTokenizer.from_pretrained(model.name_or_path)
            trainer = marl.train.sweep_trainer.SweepTrainer(members, model, tokenizer, prompts)
            first, rollout_owner, sample = trainer.trainers[0], marl.train.sweep_trainer, "sample_routed"
        sampler.mark("after load")
        sampler.set_base_phase("other")
        # the rollout (generation inside it, then the log-probs and the rewards) and the update
        labelled = [
            label_calls(sampler, rollout_owner, "collect_rollout", "scoring"),
            label_calls(sampler, first.parts.sampler, sample, "generation"),
            label_calls(sampler, marl.train.trainer, "update_policies", "update", mark="after update"),
        ]
        history = trainer.train()
    records = history if job["system"] == "run" else next(iter(history.values()))
    clock = UpdateClock()  # the first policy's `episode / eps`: the seconds since the loop started
    clock.start = 0.0
    clock.update_ends = [record["episode"] / record["eps"] for record in records]
    policies = 1 if job["system"] == "run" else job["policies"]
    result = clock.throughput(
        policies * config.batch_size, policies * config.batch_size * config.response_length
    )
    result.update(phases_labelled=all(labelled), policies=policies)
    result["memory"] = sampler.stop()
    if config.device == "cuda":
        result["cuda_max_allocated_mib"] = torch.cuda.max_memory_allocated() / 2**20
    return result


def worker_main(job_path: str, result_path: str) -> None:
    job = json.loads(Path(job_path).read_text())
    import torch  # noqa: F401  (the runtime is part of the baseline, the models are not)
    import transformers  # noqa: F401

    import marl  # noqa: F401

    sampler = MemorySampler()
    Path(result_path).write_text(json.dumps(run_job(job, sampler)))


def run_in_subprocess(job: dict, work_dir: Path, label: str) -> dict:
    """One measured process; its JSON result, or ``RuntimeError`` with the end of its log."""
    job_file, result_file, log_file = (work_dir / f"{label}.{kind}" for kind in ("job.json", "json", "log"))
    job_file.write_text(json.dumps(job))
    started = time.perf_counter()
    with log_file.open("w") as log:
        command = [sys.executable, str(Path(__file__).resolve()), "--worker", str(job_file), "--result"]
        done = subprocess.run([*command, str(result_file)], stdout=log, stderr=subprocess.STDOUT, check=False)
    if done.returncode != 0 or not result_file.is_file():
        tail = "\n".join(log_file.read_text().splitlines()[-30:])
        raise RuntimeError(f"run {label} failed (exit {done.returncode}); last lines of {log_file}:\n{tail}")
    result = json.loads(result_file.read_text())
    result["wall_seconds"] = time.perf_counter() - started
    return result


# ------------------------------------------------------------------------------------------------------------
# The comparison


# The peak memory each device's comparison reads: on a CPU the process's (PSS above the imports), on a GPU the
# card's (the peak the caching allocator handed out).
MEMORY_METRICS = {"cpu": ("pss_above_baseline", "peak PSS above imports"),
                  "cuda": ("cuda_max_allocated_mib", "peak CUDA memory allocated")}  # fmt: skip


def compare(
    summary: dict, counts: Sequence[int], episodes: int, updates: int, device: str = "cpu"
) -> list[dict[str, float]]:
    """Per N, the sweep against N runs one after another, from the medians of ``summary``
    (:func:`measure.summarize`) of runs of ``episodes`` episodes per policy in ``updates`` updates:
    episodes/s of each (the training loop, then with the loads: N runs load the base N times) and their
    ratio, the generation seconds per update of each and their ratio, and the peak memory of ``device``
    (:data:`MEMORY_METRICS`).

    Example:
        >>> run = {"eps": {"median": 2.0}, "generation_seconds": {"median": 6.0},
        ...        "pss_above_baseline": {"median": 500.0}, "load_seconds": {"median": 4.0}}
        >>> four = {"eps": {"median": 4.0}, "generation_seconds": {"median": 8.0},
        ...         "pss_above_baseline": {"median": 600.0}, "load_seconds": {"median": 5.0}}
        >>> row = compare({"run": run, "sweep-4": four}, [4], episodes=16, updates=2)[0]
        >>> row["speed-up"], row["decode speed-up"], row["memory ratio"], round(row["speed-up with loads"], 3)
        (2.0, 3.0, 1.2, 2.286)
    """

    def median(system: str, metric: str) -> float:
        return summary.get(system, {}).get(metric, {}).get("median", float("nan"))

    def with_load(system: str, policies: int) -> float:
        total = policies * episodes  # every policy's episodes, after the load(s)
        loads = (policies if system == "run" else 1) * median(system, "load_seconds")
        return ratio(total, loads + total / median(system, "eps"))

    memory = MEMORY_METRICS[device][0]
    rows = []
    for count in counts:
        sweep = f"sweep-{count}"
        generation = {system: median(system, "generation_seconds") for system in ("run", sweep)}
        rows.append({
            "policies": count,
            "sweep episodes/s": median(sweep, "eps"),
            "runs episodes/s": median("run", "eps"),
            "speed-up": ratio(median(sweep, "eps"), median("run", "eps")),
            "speed-up with loads": ratio(with_load(sweep, count), with_load("run", count)),
            "sweep generation s/update": generation[sweep] / updates,
            "runs generation s/update": count * generation["run"] / updates,
            "decode speed-up": ratio(count * generation["run"], generation[sweep]),
            "sweep peak MiB": median(sweep, memory),
            "run peak MiB": median("run", memory),
            "memory ratio": ratio(median(sweep, memory), median("run", memory)),
        })  # fmt: skip
    return rows


_SWEPT_LINES = {
    "seed": "The sweep's members differ in their seed: each draws its own prompts.",
    "learning_rate": "The sweep's members differ in their learning rate, on one seed: they draw the same "
    "prompts, and the reward and reference passes compute each prompt once for all of them.",
}


def render(report: dict) -> str:
    """The results file: per setup and quantization, the comparison table and each phase against its floor."""
    lines = [f"# A sweep of N policies on one base against N runs one after another ({report['date']})", ""]
    lines += [f"Command: `{report['command']}`", "", f"Machine: {report['machine']}", ""]
    lines += [f"Versions: {report['versions']}", ""]
    for setup, entry in report["setups"].items():
        config = entry["config"]
        memory = MEMORY_METRICS[config["device"]][1]
        lines += [f"## {setup}", ""]
        shape = (
            f"{config['prompts_per_update']} prompts x k = {config['rloo_k']} per update and policy, "
            f"{config['response_length']}-token completions, prompts of {entry['prompt_tokens']} tokens, "
            f"{config['updates']} updates (the first is warm-up), {config['threads'] or 'all'} threads."
        )
        lines += [shape, "", _SWEPT_LINES[report.get("swept", "seed")], ""]
        for quantization, block in entry["blocks"].items():
            lines += [f"### {quantization}", ""]
            lines += ["| N | sweep episodes/s | N runs episodes/s | speed-up | speed-up with the loads | "
                      f"generation s/update sweep / runs | decode speed-up | {memory} MiB "
                      "sweep / run | memory ratio |", "|" + "---|" * 9]  # fmt: skip
            for row in block["comparison"]:
                lines.append(
                    f"| {row['policies']} | {row['sweep episodes/s']:.2f} | {row['runs episodes/s']:.2f} | "
                    f"{row['speed-up']:.2f}x | {row['speed-up with loads']:.2f}x | "
                    f"{row['sweep generation s/update']:.1f} / {row['runs generation s/update']:.1f} | "
                    f"{row['decode speed-up']:.2f}x | {row['sweep peak MiB']:.0f} / "
                    f"{row['run peak MiB']:.0f} | {row['memory ratio']:.2f} |"
                )
            lines += ["", "Each phase against its floor (seconds per update, median run):", ""]
            lines += ["| system | phase | seconds | floor | GFLOP/s | GB/s |", "|---|---|---|---|---|---|"]
            for system, rows in block["floors"].items():
                for phase, spent, floor, gflops, gbps in rows:
                    lines.append(
                        f"| {system} | {phase} | {spent:.2f} | {floor:.2f} | {gflops:.1f} | {gbps:.1f} |"
                    )
            if block["failures"]:
                lines += ["", "Failed runs: " + ", ".join(failure["run"] for failure in block["failures"])]
            lines.append("")
    return "\n".join(lines) + "\n"


def floors_of(block: dict, config: BenchConfig, weight_bytes: float, params: int, prompt_tokens: int) -> dict:
    """Per system, each measured phase's seconds per update (median run) beside its floor: a sweep's work is
    that of all its policies' rows, its decode reading the weights once per step for all of them."""
    floors, out = block["machine_floors"], {}
    for system, metrics in block["summary"].items():
        policies = 1 if system == "run" else int(system.split("-")[1])
        work = phase_work(
            params=params, weight_bytes=int(weight_bytes), prompt_tokens=prompt_tokens,
            prompts=policies * config.prompts_per_update, rows=policies * config.batch_size,
            steps=config.response_length,
        )  # fmt: skip
        seconds = {
            phase: metrics[f"{phase}_seconds"]["median"] / config.updates
            for phase in ("generation", "scoring", "update")
            if f"{phase}_seconds" in metrics
        }
        out[system] = efficiency_rows(work, floors, seconds)
    return out


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--setup", default="cpu-long4", choices=sorted(SETUPS))
    parser.add_argument("--quantization", choices=[*QUANTIZATIONS, "both"], default="both")
    parser.add_argument("--policies", default=None, help=f"comma list of N (default {POLICY_COUNTS})")
    parser.add_argument("--runs", type=int, default=3, help="measured runs of each system")
    parser.add_argument("--updates", type=int, default=None, help="override the setup's updates (2 or more)")
    parser.add_argument(
        "--sampler", default=None,
        help="--sampler of every run and sweep (default marl's); a sweep samples through the sampler's "
        "sample_routed (graph's: its compiled step on a GPU, the static decode on a CPU)",
    )  # fmt: skip
    parser.add_argument(
        "--swept", choices=SWEPT_SETTINGS, default="seed",
        help="what the members differ in: seed (each draws its own prompts) or learning_rate (one seed: the "
        "same prompts, each computed once for all policies in the reward and reference passes)",
    )  # fmt: skip
    parser.add_argument("--work-dir", default=None, help="models, logs and raw results (default: temp)")
    parser.add_argument("--output", default=None, help="results markdown (default benchmarks/results/…)")
    parser.add_argument("--dry-run", action="store_true", help="a tiny model, N = 1 and 2, one run of each")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def member_spec(swept: str, base: Any, policies: int) -> str:
    """The ``--sweep`` spec of a sweep of ``policies`` members: ``seed``, the base's seed and the next ones;
    ``learning_rate``, the base's rate times 1, 2, ... on the base's seed (the members draw the same prompts).

    Example:
        >>> from types import SimpleNamespace
        >>> base = SimpleNamespace(seed=0, learning_rate=1e-5)
        >>> member_spec("seed", base, 3), member_spec("learning_rate", base, 3)
        ('seed=0,1,2', 'learning_rate=1e-05,2e-05,3e-05')
    """
    if swept == "seed":
        return "seed=" + ",".join(str(base.seed + index) for index in range(policies))
    return "learning_rate=" + ",".join(f"{base.learning_rate * (index + 1):g}" for index in range(policies))


def policy_counts(args: argparse.Namespace) -> list[int]:
    """The N of ``--policies`` (default 1, 2, 4, 8; a dry run 1, 2).

    Example:
        >>> policy_counts(parse_args(["--policies", "1,4"])), policy_counts(parse_args(["--dry-run"]))
        ([1, 4], [1, 2])
    """
    if args.policies is None:
        return list(DRY_RUN_POLICY_COUNTS if args.dry_run else POLICY_COUNTS)
    counts = [int(part) for part in args.policies.split(",") if part.strip()]
    if not counts or min(counts) < 1:
        raise SystemExit(f"--policies {args.policies!r}: a comma list of policy counts of 1 or more")
    return counts


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    if args.worker:
        worker_main(args.worker, args.result)
        return
    from marl.environment import machine_description, package_versions

    counts = policy_counts(args)
    config = BenchConfig(**dict(SETUPS[args.setup], setup=args.setup, **(DRY_RUN if args.dry_run else {})))
    if args.updates is not None:
        config = dataclasses.replace(config, updates=args.updates)
    runs = 1 if args.dry_run else args.runs
    if runs < 1:
        raise SystemExit("--runs must be at least 1 (3 or more for a median worth quoting)")
    quantizations = QUANTIZATIONS if args.quantization == "both" else (args.quantization,)
    work_dir = Path(args.work_dir or tempfile.mkdtemp(prefix="marl-sweep-"))
    work_dir.mkdir(parents=True, exist_ok=True)
    date = datetime.datetime.now(datetime.UTC)
    output = (
        Path(args.output)
        if args.output
        else REPO_ROOT / "benchmarks" / "results" / f"{date:%Y-%m-%d}-sweep-{args.setup}.md"
    )
    if args.dry_run and not args.output:
        output = work_dir / f"dry-run-sweep-{args.setup}.md"
    model_path = prepare_model(config, work_dir)
    reward_adapter = prepare_reward_adapter(config, model_path, work_dir, None)
    # every policy of a sweep draws its prompts from the same list, in its own seed's order
    prompts = prepare_prompts(config, model_path)
    tokens = prompt_token_range(model_path, prompts)
    report: dict = {
        "date": date.strftime("%Y-%m-%d %H:%M UTC"),
        "command": "python " + " ".join([os.path.relpath(__file__, REPO_ROOT), *sys.argv[1:]]),
        "machine": machine_description(),
        "versions": package_versions(),
        "swept": args.swept,
        "setups": {args.setup: {"config": dataclasses.asdict(config), "prompt_tokens": tokens, "blocks": {}}},
    }
    systems = ["run", *(f"sweep-{count}" for count in counts)]
    for quantization in quantizations:
        block = report["setups"][args.setup]["blocks"][quantization] = {"runs": [], "failures": []}
        common = dict(config=dataclasses.asdict(config), quantization=quantization, model_path=model_path,
                      reward_adapter=reward_adapter, prompts=prompts, sampler=args.sampler,
                      swept=args.swept)  # fmt: skip
        for index in range(runs):
            for system in systems if index % 2 == 0 else systems[::-1]:
                label = f"{args.setup}-{quantization}-{system}-{index}"
                policies = 1 if system == "run" else int(system.split("-")[1])
                try:
                    result = run_in_subprocess(
                        dict(common, system=system, policies=policies), work_dir, label
                    )
                except RuntimeError as error:
                    block["failures"].append({"system": system, "run": label, "error": str(error)[-3000:]})
                    print(f"  {label}: FAILED, see {work_dir / (label + '.log')}", flush=True)
                    continue
                block["runs"].append({"system": system, "result": result})
                print(f"  {label}: {result['eps']:.2f} episodes/s", flush=True)
        block["summary"] = summarize(block["runs"])
        block["comparison"] = compare(
            block["summary"], counts, config.batch_size * config.updates, config.updates, config.device
        )
        block["machine_floors"] = probe_in_subprocess(config.threads, config.device)
        floor = compute_floor(config, quantization, model_path, reward_adapter, prompts)
        params, prompt_tokens = _model_size(model_path, prompts)
        block["floors"] = floors_of(block, config, floor["base weights (as stored)"], params, prompt_tokens)
        (work_dir / "report.json").write_text(json.dumps(report, indent=1))
        output.parent.mkdir(parents=True, exist_ok=True)
        output.write_text(render(report))
        print(f"results: {output}", flush=True)
    failed = [
        failure["run"]
        for block in report["setups"][args.setup]["blocks"].values()
        for failure in block["failures"]
    ]
    if failed:
        raise SystemExit(f"{len(failed)} runs failed ({', '.join(failed)}); their logs are in {work_dir}")


def _model_size(model_path: str, prompts: list[str]) -> tuple[int, int]:
    """The base's parameter count (a meta-device model) and the mean prompt length in tokens."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_path))
    lengths = [len(ids) for ids in AutoTokenizer.from_pretrained(model_path)(prompts)["input_ids"]]
    return sum(parameter.numel() for parameter in model.parameters()), round(sum(lengths) / len(lengths))


if __name__ == "__main__":
    main()
