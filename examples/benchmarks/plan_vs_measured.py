"""Is the memory planner right? ``marl plan``'s prediction against the measured peak of the same run, per
phase.

For each configuration, one real marl training run (two updates, fixed-length completions) runs in its own
process and its memory is sampled per phase as the benchmark samples it (``measure.MemorySampler``: peak PSS
above the PSS after the imports; load, sampling, scoring, update). The planner is given the same
``RLOOConfig``, the model's ``config.json`` and the prompt length the run really had, and nothing else. A
phase is within the target when |predicted - measured| <= max(15% of measured, 200 MiB).

The configurations: the bundled SmolLM2-135M in fp32, 4-bit and 8-bit, with and without gradient
checkpointing and prefix packing, k 2 to 8, prompts of 32 to 256 tokens and completions of 32 to 128; and
the family table's tiny models (``tests/support/families.py``), whose tensors are a few MB, so that what they
measure is mostly the runtime's own memory; and sweeps of 2 and 4 policies trained at once on one base
(``policies``: ``marl.train.sweep_trainer.SweepTrainer``, the members differing in their seed), planned with
``plan_memory(..., policies=N)``.

    python examples/benchmarks/plan_vs_measured.py            # every configuration (about 15 min on 2 cores)
    python examples/benchmarks/plan_vs_measured.py --only smollm2-4bit
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the helpers next to this script

REPO_ROOT = Path(__file__).resolve().parents[2]
SMOLLM2 = "smollm2-135m-instruct"
REWARD_ADAPTER = str(REPO_ROOT / "adapters" / "smollm2-135m-rotten-tomatoes-reward")
PHASES = ("load", "sampling", "scoring", "update")
MEASURED_PHASE = {"load": "load", "sampling": "generation", "scoring": "scoring", "update": "update"}
RELATIVE_TOLERANCE, ABSOLUTE_TOLERANCE_MIB = 0.15, 200.0


@dataclasses.dataclass(frozen=True)
class Case:
    """One measured configuration."""

    name: str
    model: str = SMOLLM2  # the bundled model, or a family of the tiny table
    quantization: str | None = None
    rloo_k: int = 4
    prompt_tokens: int = 128
    response_length: int = 32
    rows: int = 16  # per_device_train_batch_size = local_rollout_forward_batch_size
    gradient_checkpointing: bool = False
    share_prompt_prefix: bool = True
    policies: int = 1  # > 1: a sweep of that many policies (seeds 0, 1, ...) trained at once on the one base

    def rloo_config(self, output_dir: str, model_path: str):
        return run_config(
            self,
            output_dir,
            model_path,
            reward_adapter=[REWARD_ADAPTER] if self.model == SMOLLM2 else None,
            threads=1,
        )


def run_config(case, output_dir: str, model_path: str, **settings):
    """The ``RLOOConfig`` of a measured run of ``case``: two updates of ``case.rows`` fixed-length
    completions, micro-batch = sampling chunk = ``case.rows``, no samples or checkpoints; ``settings`` add
    what the machine needs (reward adapter, threads, mixed precision)."""
    from marl.config import RLOOConfig

    return RLOOConfig(
        output_dir=output_dir,
        model_name_or_path=model_path,
        quantization=case.quantization,
        rloo_k=case.rloo_k,
        per_device_train_batch_size=case.rows,
        local_rollout_forward_batch_size=case.rows,
        num_mini_batches=1,
        total_episodes=2 * case.rows,
        response_length=case.response_length,
        stop_token="none",
        missing_eos_penalty=None,
        gradient_checkpointing=case.gradient_checkpointing,
        share_prompt_prefix=case.share_prompt_prefix,
        num_sample_generations=0,
        save_steps=0,
        report_to=["none"],
        # The planner's CPU figures are for blocks given back when freed; the default heap keeps them within a
        # phase (marl.cpu.allocator), above what the tensors hold.
        cpu_allocator="maps",
        **settings,
    )


CASES = (
    Case("smollm2-fp32"),
    Case("smollm2-4bit", quantization="4bit"),
    Case("smollm2-8bit", quantization="8bit"),
    Case("smollm2-4bit-checkpointing", quantization="4bit", gradient_checkpointing=True),
    Case("smollm2-fp32-no-packing", share_prompt_prefix=False),
    Case("smollm2-4bit-k8-long", quantization="4bit", rloo_k=8, prompt_tokens=256, response_length=64),
    Case("smollm2-fp32-k2-long-completions", rloo_k=2, prompt_tokens=32, response_length=128, rows=8),
    Case("smollm2-fp32-checkpointing-k8", rloo_k=8, gradient_checkpointing=True, rows=32),
    *(Case(f"tiny-{family}", model=family, rloo_k=4, prompt_tokens=64) for family in
      ("llama", "qwen2", "gemma2", "gpt2", "opt", "phi3")),
    # sweeps (issue 44): every policy's rows in one decode chunk; update micro-batches one policy at a time
    Case("smollm2-4bit-sweep4", quantization="4bit", policies=4),
    Case("smollm2-fp32-sweep2", policies=2),
    Case("tiny-llama-sweep4", model="llama", rloo_k=4, prompt_tokens=64, policies=4),
)  # fmt: skip


def _prompts(tokenizer, tokens: int) -> list[str]:
    """Prompt texts that tokenize to exactly ``tokens`` tokens (one word repeated)."""
    for word in (" the", " a", " and", " movie", "a", "e"):
        text = word * tokens
        if len(tokenizer(text, add_special_tokens=False)["input_ids"]) == tokens:
            return [text] * 64
    raise RuntimeError(f"no repeated word tokenizes to {tokens} tokens")


def count_tensors(owner, attribute: str, phase: str, peaks: dict[str, float]) -> None:
    """Run ``owner.attribute`` under :class:`marl.plan.trace.LiveBytes`: the peak MiB of the tensors it
    makes (the same count the planner makes on the meta device, here on the real run's CPU tensors)."""
    from marl.plan.trace import LiveBytes

    original = getattr(owner, attribute)

    def counted(*args, **kwargs):
        with LiveBytes() as live:
            result = original(*args, **kwargs)
        peaks[phase] = max(peaks.get(phase, 0.0), live.peak / 2**20)
        return result

    setattr(owner, attribute, counted)


def measure(case: Case, model_path: str, tensors: bool = False) -> dict:
    """One training run of ``case`` in this process; its per-phase peaks (MiB above the import baseline).
    With ``tensors``, the peak of the tensors each phase makes instead (counting slows the run and its
    Python objects add to the process's memory, so it is a run of its own)."""
    import torch  # noqa: F401  (the runtime is part of the baseline, the model is not)
    import transformers

    import marl.train.sweep_trainer
    import marl.train.trainer
    from marl.config.sweep import parse_sweep
    from marl.model.loading import load_tokenizer

    transformers.logging.set_verbosity_error()
    from measure import MemorySampler, label_calls

    sampler = MemorySampler()
    import datasets

    from marl import MultiAdapterModel, RLOOTrainer

    with tempfile.TemporaryDirectory(prefix="plan-") as output_dir:
        config = case.rloo_config(output_dir, model_path)
        reward = None if case.model == SMOLLM2 else (lambda prompts, completions, **_: [1.0] * len(prompts))
        tokenizer = load_tokenizer(model_path)
        prompts = datasets.Dataset.from_dict({"prompt": _prompts(tokenizer, case.prompt_tokens)})
        if case.policies == 1:
            model = MultiAdapterModel.from_config(config)
            trainer = RLOOTrainer(config, model, tokenizer, prompts, reward_funcs=reward)
            first, rollout_owner, sample = trainer, marl.train.trainer, "sample"
        else:  # a sweep: the members differ in their seed
            members = parse_sweep([f"seed={','.join(map(str, range(case.policies)))}"], config)
            model = marl.train.sweep_trainer.build_sweep_model([member.config for member in members])
            trainer = marl.train.sweep_trainer.SweepTrainer(
                members, model, tokenizer, prompts, reward_funcs=reward
            )
            first, rollout_owner, sample = trainer.trainers[0], marl.train.sweep_trainer, "sample_routed"
        sampler.mark("after load")
        sampler.set_base_phase("other")
        widths = record_prompt_widths(first)
        tensor_peaks: dict[str, float] = {}
        if tensors:  # the rollout's count includes its sampling
            count_tensors(first.parts.sampler, sample, "sampling", tensor_peaks)
            count_tensors(rollout_owner, "collect_rollout", "rollout", tensor_peaks)
            count_tensors(trainer, "_update", "update", tensor_peaks)
        label_calls(sampler, rollout_owner, "collect_rollout", "scoring")
        label_calls(sampler, first.parts.sampler, sample, "generation")
        label_calls(sampler, marl.train.trainer, "update_policies", "update")
        trainer.train()
    memory = sampler.stop()
    if tensors:
        return {"prompt_length": max(widths), "tensor_mib": tensor_peaks}
    return {
        "prompt_length": max(widths),
        **{
            f"{kind}_mib": {
                phase: memory["phases"][MEASURED_PHASE[phase]][kind] - memory["baseline"][kind]
                for phase in PHASES
            }
            for kind in ("heap", "pss", "anon")
        },
    }


def record_prompt_widths(trainer) -> set[int]:
    """The widths of the prompt batches ``trainer`` samples from, filled in as it runs (the planner is given
    the longest)."""
    widths: set[int] = set()
    batch = trainer.parts.sampler.batch

    def batch_and_measure(*args, **kwargs):
        prompts = batch(*args, **kwargs)
        widths.add(int(prompts.ids.shape[1]))
        return prompts

    trainer.parts.sampler.batch = batch_and_measure
    return widths


def predict(case: Case, model_path: str, prompt_length: int) -> dict:
    from marl.plan import PlanTarget, load_model_config, plan_memory

    config = case.rloo_config("unused", model_path)
    target = PlanTarget(device="cpu", prompt_length=prompt_length)
    plan = plan_memory(config, load_model_config(model_path), target, policies=case.policies)
    return {
        "predicted_mib": {phase.name: phase.total / 2**20 for phase in plan.phases},
        "parts_mib": {phase.name: {k: v / 2**20 for k, v in phase.parts.items()} for phase in plan.phases},
    }


def model_path_of(case: Case, work_dir: Path) -> str:
    if case.model == SMOLLM2:
        from marl.data.assets import resolve_model_path

        return resolve_model_path(SMOLLM2)
    sys.path.insert(0, str(REPO_ROOT / "tests"))
    from support.families import build_family

    directory = work_dir / case.model
    if not (directory / "config.json").is_file():
        build_family(case.model, directory)
    return str(directory)


def within(predicted: float, measured: float) -> bool:
    """The target: |predicted - measured| <= max(15% of measured, 200 MiB).

    >>> within(1100.0, 1000.0), within(1200.0, 1000.0), within(150.0, 20.0)
    (True, False, True)
    """
    return abs(predicted - measured) <= max(RELATIVE_TOLERANCE * measured, ABSOLUTE_TOLERANCE_MIB)


def report(results: list[dict], command: str) -> str:
    import bitsandbytes
    import peft
    import torch
    import transformers

    lines = [
        f"# Memory planner: predicted against measured peaks ({datetime.date.today().isoformat()})",
        "",
        f"Command: `{command}`",
        "",
        f"Machine: {platform.machine()}, {platform.system()}, Python {platform.python_version()}; torch "
        f"{torch.__version__}, transformers {transformers.__version__}, peft {peft.__version__}, "
        f"bitsandbytes {bitsandbytes.__version__}. CPU, float32 compute, one thread.",
        "",
        "Measured: peak PSS above the PSS after the imports, per phase, of a real 2-update training run in",
        "its own process (sampled as `vs_trl.py` samples it). Predicted: `marl.plan.plan_memory` from the",
        "same RLOOConfig, the model's config.json and the run's prompt length. Target per phase: within 15%",
        "or 200 MiB.",
        "",
        "| configuration | prompt | "
        + " | ".join(f"{p} predicted / measured (MiB)" for p in PHASES)
        + " | within |",
        "|---|---|" + "---|" * len(PHASES) + "---|",
    ]
    for result in results:
        cells, ok = [], True
        for phase in PHASES:
            predicted, measured = result["predicted_mib"][phase], result["pss_mib"][phase]
            hit = within(predicted, measured)
            ok &= hit
            cells.append(f"{predicted:.0f} / {measured:.0f}" + ("" if hit else " **miss**"))
        lines.append(f"| {result['case']['name']} | {result['prompt_length']} | " + " | ".join(cells)
                     + f" | {'yes' if ok else '**no**'} |")  # fmt: skip
    hits = sum(within(r["predicted_mib"][p], r["pss_mib"][p]) for r in results for p in PHASES)
    lines += ["", f"{hits} of {len(results) * len(PHASES)} phase peaks within the target.", ""]
    counted = [r for r in results if "tensor_mib" in r]
    if counted:
        lines += [
            "Tensors each phase makes, planned (the phase's traced working set) against counted in a",
            "separate run of the same configuration (`--count_tensors`: `marl.plan.trace.LiveBytes` around",
            "the real trainer's sampler, rollout and update, on its CPU tensors; the rollout's count has",
            "its sampling in it, so it is compared with the larger of the two planned working sets):",
            "",
            "| configuration | sampling planned / counted (MiB) | rollout planned / counted "
            "| update planned / counted |",
            "|---|---|---|---|",
        ]
        for r in counted:
            parts, tensor = r["parts_mib"], r["tensor_mib"]
            sampling = parts["sampling"]["KV cache + sampling"]
            rollout = max(sampling, parts["scoring"]["activations + log-softmax (no grad)"])
            update = parts["update"]["activations + gradients (micro-batch)"]
            cells = [(sampling, tensor["sampling"]), (rollout, tensor["rollout"]), (update, tensor["update"])]
            lines.append(f"| {r['case']['name']} | " + " | ".join(
                f"{a:.0f} / {b:.0f} ({(a - b) / b:+.1%})" for a, b in cells) + " |")  # fmt: skip
        lines.append("")
    return "\n".join(lines)


def add_run_arguments(parser: argparse.ArgumentParser, work_dir: str) -> None:
    """The options every planner-validation script takes."""
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--only", nargs="+", default=None, help="Names of the configurations to run.")
    parser.add_argument("--work_dir", default=work_dir)
    parser.add_argument("--output", default=None, help="Results markdown (default benchmarks/results/...)")
    parser.add_argument(
        "--reuse_measurements",
        action="store_true",
        help="Predict again against the measurements already in --work_dir (after a change to the planner).",
    )


def write_results(results: list[dict], report, output: str | None, name: str, script: str) -> None:
    """The dated results markdown (``report(results, command)``) and its JSON beside it."""
    stamp = datetime.date.today().isoformat()
    path = Path(output or REPO_ROOT / "benchmarks" / "results" / f"{stamp}-{name}.md")
    command = " ".join(["python", f"examples/benchmarks/{script}", *sys.argv[1:]])
    path.write_text(report(results, command))
    path.with_suffix(".json").write_text(json.dumps(results, indent=2) + "\n")
    print(f"results: {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_run_arguments(parser, "runs/plan-vs-measured")
    parser.add_argument(
        "--count_tensors",
        nargs="*",
        default=[],
        help="Also run these configurations once more, counting the tensors each phase makes (LiveBytes).",
    )
    options = parser.parse_args()
    if options.worker:
        job = json.loads(Path(options.worker).read_text())
        result = measure(Case(**job["case"]), job["model_path"], tensors=job.get("tensors", False))
        Path(job["result"]).write_text(json.dumps(result))
        return
    work_dir = Path(options.work_dir)
    work_dir.mkdir(parents=True, exist_ok=True)
    cases = [case for case in CASES if options.only is None or case.name in options.only]
    results = []
    for case in cases:
        model_path = model_path_of(case, work_dir)
        runs = {"": False, ".tensors": True} if case.name in options.count_tensors else {"": False}
        result = {"case": dataclasses.asdict(case)}
        for suffix, tensors in runs.items():
            job_file = work_dir / f"{case.name}{suffix}.job.json"
            result_file = work_dir / f"{case.name}{suffix}.result.json"
            job = {"case": dataclasses.asdict(case), "model_path": model_path, "result": str(result_file),
                   "tensors": tensors}  # fmt: skip
            if not (options.reuse_measurements and result_file.is_file()):
                job_file.write_text(json.dumps(job))
                with (work_dir / f"{case.name}{suffix}.log").open("w") as log:
                    subprocess.run([sys.executable, __file__, "--worker", str(job_file)], stdout=log,
                                   stderr=subprocess.STDOUT, check=True, cwd=REPO_ROOT)  # fmt: skip
            result.update(json.loads(result_file.read_text()))
        result.update(predict(case, model_path, result["prompt_length"]))
        results.append(result)
        print(case.name, {p: [round(result[f"{kind}_mib"][p]) for kind in ("predicted", "heap", "pss")]
                          for p in PHASES}, flush=True)  # fmt: skip
    write_results(results, report, options.output, "memory-plan", "plan_vs_measured.py")


if __name__ == "__main__":
    main()
