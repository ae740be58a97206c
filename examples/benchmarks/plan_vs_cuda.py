"""Is the memory planner right on a GPU? ``marl plan``'s prediction against
``torch.cuda.max_memory_allocated`` of the same run, per phase, for Qwen2.5-0.5B- and 1.5B-shaped bases.

The bases have the published shapes of those models (``plan_table.SHAPES``), random weights (no checkpoint
can be downloaded), saved in bfloat16 and loaded through the real ``from_pretrained`` path; the tokenizer is
the family table's byte-level BPE (its ids are a subset of the model's vocabulary, so every logit row still
has the full width). A reward adapter (LoRA + score head) made on the same base scores every completion.

For each configuration one real marl training run (two updates, fixed-length completions, bf16 mixed
precision) runs in its own process. Per phase (load, sampling, scoring, update) it records the peak of
``torch.cuda.max_memory_allocated`` and ``max_memory_reserved`` while the phase ran, and once at the end the
memory the process holds on the card outside PyTorch's allocator (CUDA context, kernels, library handles:
``mem_get_info`` used less ``memory_reserved``). The planner is given the same ``RLOOConfig``, the base's
``config.json`` and the run's prompt length, and nothing else. Its prediction less its runtime part is
compared with the allocated peak (the target: within 15% or 200 MiB), and its runtime part with the memory
outside the allocator.

    python examples/benchmarks/plan_vs_cuda.py                 # every configuration (about 11 min on an H100)
    python examples/benchmarks/plan_vs_cuda.py --only qwen2.5-0.5b-4bit
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the helpers next to this script

from plan_table import SHAPES
from plan_vs_measured import (
    PHASES,
    _prompts,
    add_run_arguments,
    record_prompt_widths,
    run_config,
    within,
    write_results,
)

REPO_ROOT = Path(__file__).resolve().parents[2]
MiB = 2**20


@dataclasses.dataclass(frozen=True)
class CudaCase:
    """One measured configuration on the GPU."""

    name: str
    shape: str  # a key of plan_table.SHAPES
    quantization: str | None = "4bit"
    rloo_k: int = 4
    prompt_tokens: int = 256
    response_length: int = 128
    rows: int = 8  # per_device_train_batch_size = local_rollout_forward_batch_size
    gradient_checkpointing: bool = False
    share_prompt_prefix: bool = True

    def rloo_config(self, output_dir: str, model_path: str, reward_path: str):
        return run_config(self, output_dir, model_path, reward_adapter=[reward_path], bf16=True)


CASES = (
    CudaCase("qwen2.5-0.5b-4bit", "Qwen2.5-0.5B"),
    CudaCase("qwen2.5-0.5b-8bit", "Qwen2.5-0.5B", quantization="8bit"),
    CudaCase("qwen2.5-0.5b-bf16", "Qwen2.5-0.5B", quantization=None),
    CudaCase("qwen2.5-0.5b-bf16-no-packing", "Qwen2.5-0.5B", quantization=None, share_prompt_prefix=False),
    CudaCase("qwen2.5-0.5b-4bit-checkpointing-long", "Qwen2.5-0.5B", gradient_checkpointing=True,
             prompt_tokens=512, response_length=256),
    CudaCase("qwen2.5-1.5b-4bit-long", "Qwen2.5-1.5B", prompt_tokens=512, response_length=256),
    CudaCase("qwen2.5-1.5b-4bit-checkpointing-k8", "Qwen2.5-1.5B", gradient_checkpointing=True, rloo_k=8,
             rows=16),
    CudaCase("qwen2.5-1.5b-bf16", "Qwen2.5-1.5B", quantization=None),
)  # fmt: skip


class CudaPhasePeaks:
    """Per-phase peaks of the caching allocator: a phase entered inside another closes the outer one's
    stretch, so each byte of a peak counts in the phase that was running when it was reached."""

    def __init__(self) -> None:
        import torch

        self.torch = torch
        self.stack = ["other"]
        self.peaks: dict[str, dict[str, float]] = {}
        self.at_entry: dict[str, float] = {}  # the least allocated when the phase was entered
        torch.cuda.reset_peak_memory_stats()

    def _close_stretch(self) -> None:
        cuda, phase = self.torch.cuda, self.stack[-1]
        peak = self.peaks.setdefault(phase, {"allocated": 0.0, "reserved": 0.0})
        peak["allocated"] = max(peak["allocated"], cuda.max_memory_allocated() / MiB)
        peak["reserved"] = max(peak["reserved"], cuda.max_memory_reserved() / MiB)
        cuda.reset_peak_memory_stats()

    @contextlib.contextmanager
    def phase(self, name: str):
        self.torch.cuda.synchronize()
        self._close_stretch()
        allocated = self.torch.cuda.memory_allocated() / MiB
        self.at_entry[name] = min(self.at_entry.get(name, allocated), allocated)
        self.stack.append(name)
        try:
            yield
        finally:
            self.torch.cuda.synchronize()
            self._close_stretch()
            self.stack.pop()

    def mark(self, _label: str) -> None:
        """(``measure.label_calls`` marks events; peaks need none.)"""


def build_base(case: CudaCase, directory: Path) -> tuple[str, str]:
    """The random ``case.shape`` base in bfloat16 with the family tokenizer, and a reward adapter on it."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    sys.path.insert(0, str(REPO_ROOT / "tests"))
    from support.families import build_family_tokenizer
    from support.tiny import save_reward_adapter

    base, reward = directory / case.shape, directory / f"{case.shape}-reward"
    if not (reward / "adapter_config.json").is_file():
        tokenizer = build_family_tokenizer(with_bos=False)
        values = dict(SHAPES[case.shape])
        config = AutoConfig.for_model(
            values.pop("model_type"),
            **values,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
            bos_token_id=tokenizer.eos_token_id,
            dtype="bfloat16",
        )
        torch.manual_seed(0)
        # random initialisation of 1.5B parameters takes minutes on a CPU
        with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
            model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        model.generation_config.pad_token_id = tokenizer.pad_token_id
        model.generation_config.eos_token_id = tokenizer.eos_token_id
        model.save_pretrained(base)
        tokenizer.save_pretrained(base)
        del model
        save_reward_adapter(base, reward)
    return str(base), str(reward)


def measure(case: CudaCase, model_path: str, reward_path: str) -> dict:
    """One training run of ``case`` in this process; its per-phase allocator peaks (MiB)."""
    import datasets
    import torch
    import transformers
    from measure import label_calls

    import marl.train.trainer
    from marl import MultiAdapterModel, RLOOTrainer
    from marl.model.loading import load_tokenizer

    transformers.logging.set_verbosity_error()
    torch.cuda.init()
    peaks = CudaPhasePeaks()
    with tempfile.TemporaryDirectory(prefix="plan-cuda-") as output_dir:
        config = case.rloo_config(output_dir, model_path, reward_path)
        with peaks.phase("load"):
            model = MultiAdapterModel.from_config(config)
        tokenizer = load_tokenizer(model.name_or_path)
        trainer = RLOOTrainer(
            config,
            model,
            tokenizer,
            datasets.Dataset.from_dict({"prompt": _prompts(tokenizer, case.prompt_tokens)}),
        )
        assert trainer.parts.parallelism.device.type == "cuda", "the run is not on the GPU"
        widths = record_prompt_widths(trainer)
        label_calls(peaks, marl.train.trainer, "collect_rollout", "scoring")
        label_calls(peaks, trainer.parts.sampler, "sample", "sampling")
        label_calls(peaks, marl.train.trainer, "update_policies", "update")
        trainer.train()
        torch.cuda.synchronize()
        free, total = torch.cuda.mem_get_info()
        outside = (total - free - torch.cuda.memory_reserved()) / MiB
    return {
        "prompt_length": max(widths),
        "allocated_mib": {phase: peaks.peaks[phase]["allocated"] for phase in PHASES},
        "reserved_mib": {phase: peaks.peaks[phase]["reserved"] for phase in PHASES},
        "at_entry_mib": {phase: peaks.at_entry[phase] for phase in PHASES},
        "outside_allocator_mib": outside,
        "device": torch.cuda.get_device_name(),
        "versions": _versions(),
    }


def _versions() -> str:
    import bitsandbytes
    import peft
    import torch
    import transformers

    return (
        f"Python {platform.python_version()}; torch {torch.__version__}, transformers "
        f"{transformers.__version__}, peft {peft.__version__}, bitsandbytes {bitsandbytes.__version__}"
    )


def predict(case: CudaCase, model_path: str, reward_path: str, prompt_length: int) -> dict:
    import torch

    from marl.plan import PlanTarget, load_model_config, plan_memory

    config = case.rloo_config("unused", model_path, reward_path)
    target = PlanTarget(device="cuda", prompt_length=prompt_length, compute_dtype=torch.bfloat16)
    plan = plan_memory(config, load_model_config(model_path), target)
    return {
        "predicted_mib": {phase.name: phase.total / MiB for phase in plan.phases},
        "runtime_mib": target.runtime_bytes / MiB,
        "parts_mib": {phase.name: {k: v / MiB for k, v in phase.parts.items()} for phase in plan.phases},
    }


def report(results: list[dict], command: str) -> str:
    device = results[0]["device"] if results else "?"
    versions = results[0]["versions"] if results else _versions()  # those of the machine that measured
    lines = [
        f"# Memory planner on a GPU: predicted against measured peaks ({datetime.date.today().isoformat()})",
        "",
        f"Command: `{command}`",
        "",
        f"Machine: {device}; {versions}. bf16 mixed precision, one process.",
        "",
        "Measured: `torch.cuda.max_memory_allocated` while each phase of a real 2-update training run",
        "ran, in its own process; predicted: `marl.plan.plan_memory` from the same RLOOConfig, the base's",
        "config.json and the run's prompt length, less the planner's runtime part (which the allocator",
        "does not see).",
        "Target per phase: within 15% or 200 MiB. Bases: random weights in the published shapes.",
        "",
        "| configuration | prompt | "
        + " | ".join(f"{p} predicted / allocated (MiB)" for p in PHASES)
        + " | within | reserved at the peak phase | outside the allocator |",
        "|---|---|" + "---|" * len(PHASES) + "---|---|---|",
    ]
    hits = 0
    for result in results:
        cells, ok = [], True
        for phase in PHASES:
            predicted = result["predicted_mib"][phase] - result["runtime_mib"]
            measured = result["allocated_mib"][phase]
            hit = within(predicted, measured)
            ok &= hit
            hits += hit
            cells.append(f"{predicted:.0f} / {measured:.0f}" + ("" if hit else " **miss**"))
        reserved = max(result["reserved_mib"].values())
        lines.append(
            f"| {result['case']['name']} | {result['prompt_length']} | " + " | ".join(cells)
            + f" | {'yes' if ok else '**no**'} | {reserved:.0f} | {result['outside_allocator_mib']:.0f} |"
        )  # fmt: skip
    runtime = results[0]["runtime_mib"] if results else 0
    lines += [
        "",
        f"{hits} of {len(results) * len(PHASES)} phase peaks within the target. The planner's runtime part "
        f"is {runtime:.0f} MiB (`CUDA_RUNTIME_BYTES`); the last column is what the process held on the card "
        "outside the allocator at the end of its run.",
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_run_arguments(parser, "runs/plan-vs-cuda")
    parser.add_argument("--build", help=argparse.SUPPRESS)
    options = parser.parse_args()
    if options.build:  # a process of its own: the one that measures must be the only one on the card
        case_name, work_dir = options.build.split(":", 1)
        build_base(next(case for case in CASES if case.name == case_name), Path(work_dir))
        return
    if options.worker:
        job = json.loads(Path(options.worker).read_text())
        result = measure(CudaCase(**job["case"]), job["model_path"], job["reward_path"])
        Path(job["result"]).write_text(json.dumps({"case": job["case"], **result}))
        return
    work_dir = Path(options.work_dir)
    work_dir.mkdir(parents=True, exist_ok=True)
    cases = [case for case in CASES if options.only is None or case.name in options.only]
    results = []
    for case in cases:
        model_path, reward_path = str(work_dir / case.shape), str(work_dir / f"{case.shape}-reward")
        job_file, result_file = work_dir / f"{case.name}.job.json", work_dir / f"{case.name}.result.json"
        job = {"case": dataclasses.asdict(case), "model_path": model_path, "reward_path": reward_path,
               "result": str(result_file)}  # fmt: skip
        log_file = work_dir / f"{case.name}.log"
        if not (options.reuse_measurements and result_file.is_file()):
            job_file.write_text(json.dumps(job))
            with log_file.open("w") as log:
                for step in (["--build", f"{case.name}:{work_dir}"], ["--worker", str(job_file)]):
                    finished = subprocess.run([sys.executable, __file__, *step], stdout=log,
                                              stderr=subprocess.STDOUT, cwd=REPO_ROOT)  # fmt: skip
                    if finished.returncode != 0:
                        break
            if finished.returncode != 0:
                print(case.name, "failed:", log_file.read_text()[-3000:], flush=True)
                continue
        elif not (Path(model_path) / "config.json").is_file():
            build_base(case, work_dir)  # the planner reads the base's config.json and the adapter's config
        result = json.loads(result_file.read_text())
        if result["case"] != dataclasses.asdict(case):
            raise SystemExit(f"{result_file} was measured with other settings than {case.name} has now: "
                             "run it again without --reuse_measurements")  # fmt: skip
        result.update(predict(case, model_path, reward_path, result["prompt_length"]))
        results.append(result)
        print(case.name, {p: [round(result["predicted_mib"][p] - result["runtime_mib"]),
                              round(result["allocated_mib"][p])] for p in PHASES},
              f"outside {result['outside_allocator_mib']:.0f}", flush=True)  # fmt: skip
    write_results(results, report, options.output, "memory-plan-cuda", "plan_vs_cuda.py")


if __name__ == "__main__":
    main()
