"""The GPU check of ``--fit auto`` and the out-of-memory retry (issue 57), in one process, a few minutes:

A. the card capped (``torch.cuda.set_per_process_memory_fraction``) below what the typed settings need by the
   plan: ``marl train-rloo`` with ``--fit auto`` (the default) chooses settings under the cap and finishes;
B. the typed settings with ``--fit off`` and the cap lifted; after update 1 the cap comes down between the
   update's planned peak at the typed micro-batch and at half of it: the update runs out of memory for real,
   is retried at half the micro-batch, and the run finishes.

Each run's measured peak per phase is written beside the plan's. The model is a Qwen2.5-0.5B-shaped Qwen2 with
random weights and a tokenizer built here (:mod:`built_models`), so nothing is downloaded.

    python examples/benchmarks/fit_check.py --output benchmarks/results/DATE-fit-check.md
    python examples/benchmarks/fit_check.py --dry-run --output /tmp/fit.md  # CPU: the flow on a tiny model

``--dry-run`` (CPU, no cap to set): A plans for ``--fit_memory_gb`` at the same place, B's error comes from
the test hook (``MARL_TEST_OUT_OF_MEMORY``) at update 2's first update forward pass instead of a real one.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from built_models import build_model, build_prompts

from marl.apps.cli import train_rloo_main

UPDATES = 3
# (shape, dtype, prompts' tokens, response tokens, k, typed micro-batch, rollout rows per chunk)
GPU = ("qwen2.5-0.5b-shaped", "bfloat16", 128, 128, 4, 32, 64)
DRY_RUN = ("tiny-qwen2-shaped", "float32", 16, 8, 2, 8, 8)
REWARD = "def count_a(prompts, completions):\n    return [float(c.count('a')) for c in completions]\n"


def words(work: Path, model: str, shape: tuple, output: str, *extra: str) -> list[str]:
    _, dtype, _, response, k, micro, rows = shape
    return [
        "--model_name_or_path", model, "--dataset_name", str(work / "prompts.jsonl"),
        "--reward_fn", f"{work / 'reward.py'}:count_a", "--output_dir", str(work / output),
        "--rloo_k", str(k), "--per_device_train_batch_size", str(micro),
        "--total_episodes", str(micro * UPDATES),
        "--response_length", str(response), "--local_rollout_forward_batch_size", str(rows),
        "--num_sample_generations", "0", "--save_steps", "0", "--save_minutes", "0", "--num_ppo_epochs", "2",
        *(["--bf16"] if dtype == "bfloat16" else []), "--overwrite_output_dir", *extra,
    ]  # fmt: skip


def plan_of(arguments: list[str], device: str, prompt_tokens: int, **changes):
    from marl.apps.cli import parse_train_rloo_args
    from marl.plan.planner import PlanTarget, load_model_config, plan_memory, with_changes

    _, config = parse_train_rloo_args(arguments)
    config = with_changes(config, **changes)
    return plan_memory(
        config, load_model_config(config.model_name_or_path), PlanTarget(device, prompt_length=prompt_tokens)
    )


def peaks(trainer) -> dict:
    guard = trainer.phases
    return {
        phase: {
            "measured_mb": guard.largest.get(phase, 0) / 1e6,
            "plan_mb": (guard.planned or {}).get(phase, 0) / 1e6,
        }
        for phase in ("sampling", "scoring", "update")
    }


def cap(device: str, tensor_bytes: float) -> None:
    """Let this process's CUDA allocator hold at most ``tensor_bytes``."""
    import torch

    total = torch.cuda.get_device_properties(device).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, tensor_bytes / total), torch.cuda.current_device())


def free(trainer=None) -> None:
    import torch

    del trainer
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def run_checks(work: Path, dry_run: bool) -> dict:
    import torch

    shape = DRY_RUN if dry_run else GPU
    device = "cpu" if dry_run else "cuda"
    name, dtype, prompt_tokens, _, k, micro, _ = shape
    work.mkdir(parents=True, exist_ok=True)
    model = build_model(name, dtype, work / "model", device="cpu")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    prompts = build_prompts(tokenizer, count=micro // k * UPDATES, tokens=prompt_tokens)
    (work / "prompts.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    (work / "reward.py").write_text(REWARD)
    runtime = 0 if dry_run else 800 * 2**20  # the CUDA runtime: outside the allocator the cap limits
    results: dict = {"device": torch.cuda.get_device_name() if not dry_run else "cpu (dry run)"}

    # A: capped below the typed settings' plan; --fit auto chooses settings that fit under the cap
    typed = plan_of(words(work, model, shape, "a"), device, prompt_tokens)
    target = plan_of(
        words(work, model, shape, "a"), device, prompt_tokens,
        per_device_train_batch_size=micro // 4, gradient_accumulation_steps=4, gradient_checkpointing=True,
    )  # fmt: skip
    cap_bytes = (target.peak + typed.peak) / 2 - runtime  # the typed settings do not fit, micro // 4 does
    results["A"] = {"typed_plan_mb": typed.peak / 1e6, "cap_mb": cap_bytes / 1e6}
    extra = ["--fit_memory_gb", f"{(cap_bytes + runtime) / 0.9 / 1e9:.6f}"] if dry_run else []
    if not dry_run:
        cap(device, cap_bytes)
    started = time.perf_counter()
    try:
        trainer = train_rloo_main(words(work, model, shape, "a", *extra))
        results["A"].update(finished=True, fit=trainer.fit_record, peaks=peaks(trainer))
    except SystemExit as exit:  # a refusal or an error line, already printed
        results["A"].update(finished=False, exit_code=exit.code)
        trainer = None
    results["A"]["seconds"] = time.perf_counter() - started
    free(trainer)

    # B: typed settings that fit; after update 1 the cap comes down between the update at micro and micro // 2
    if not dry_run:
        torch.cuda.set_per_process_memory_fraction(1.0, torch.cuda.current_device())
    update_full = plan_of(words(work, model, shape, "b"), device, prompt_tokens).phase("update").total
    update_half = plan_of(
        words(work, model, shape, "b"), device, prompt_tokens,
        per_device_train_batch_size=micro // 2, gradient_accumulation_steps=2,
    ).phase("update").total  # fmt: skip
    lowered = (update_full + update_half) / 2 - runtime
    results["B"] = {
        "update_plan_mb": update_full / 1e6,
        "half_plan_mb": update_half / 1e6,
        "cap_mb": lowered / 1e6,
    }
    if dry_run:  # update 2's first update forward pass (update 1 takes 2 epochs of one micro-batch)
        os.environ["MARL_TEST_OUT_OF_MEMORY"] = "update:3"
    from marl.apps.train_rloo import build_rloo_trainer, parse_train_rloo_args, train_arguments

    script, config = parse_train_rloo_args(words(work, model, shape, "b", "--fit", "off"))
    trainer = build_rloo_trainer(script, config)
    if not dry_run:
        trainer.parts.callbacks.append(lambda state, metrics: state.update == 1 and cap(device, lowered))
    started = time.perf_counter()
    try:
        trainer.train(**train_arguments(script))
        results["B"].update(finished=True, changes=trainer.phases.changes, peaks=peaks(trainer))
    except Exception as error:  # the check reports any failure
        results["B"].update(finished=False, error=f"{type(error).__name__}: {error}"[:500])
    finally:
        os.environ.pop("MARL_TEST_OUT_OF_MEMORY", None)
    results["B"]["seconds"] = time.perf_counter() - started
    results["B"]["retried"] = bool(results["B"].get("changes"))
    return results


def report(results: dict, command: str) -> str:
    lines = [
        f"# --fit auto and the out-of-memory retry on {results['device']}",
        "",
        f"Command: `{command}`",
        "",
    ]
    for part, title in (
        ("A", "A. capped below the typed plan, --fit auto"),
        ("B", "B. cap lowered after update 1"),
    ):
        lines += [f"## {title}", "", "```json", json.dumps(results[part], indent=2), "```", ""]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="CPU, a tiny model: the flow only")
    parser.add_argument("--work", type=Path, default=Path("fit-check-work"))
    parser.add_argument("--output", default=None)
    arguments = parser.parse_args()
    results = run_checks(arguments.work, arguments.dry_run)
    text = report(results, "python " + " ".join(sys.argv))
    if arguments.output:
        Path(arguments.output).write_text(text)
    print(text)
    ok = results["A"].get("finished") and results["B"].get("finished") and results["B"]["retried"]
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
