"""Peak memory of a TRL ``GRPOTrainer`` run scoring with a reward adapter two ways, side by side in one run:
TRL's separately loaded reward model (``AutoModelForSequenceClassification`` + ``PeftModel.from_pretrained``)
and marl's reward function on the policy's own PeftModel (:mod:`marl.integrations.trl`).

Each (load, way) is its own process, the two ways alternating: the bundled SmolLM2-135M-Instruct,
a LoRA policy, a random reward LoRA + score head written by this script, ``--steps`` GRPO steps of
``--prompts`` prompts x 2 completions of 16 tokens. Memory: the peak PSS above the PSS after the imports
(``measure.MemorySampler``). The target (issue 59): marl's peak <= the separate model's peak minus 80% of
the separate reward model's weight bytes (parameters and buffers as stored, counted in that run).

The loads (``--loads``): ``none`` (fp32), ``4bit`` (NF4 computing in fp32), and ``bf16`` (the fp32
checkpoint loaded in bf16 with ``bf16=True``, as a GPU user loads it). On a CPU transformers maps an fp32
load's weights from the checkpoint file, so the separate model's copy shares the policy's pages; a 4-bit or
bf16 load converts the weights, so each copy is its own memory.

Usage::

    python examples/benchmarks/trl_reward_adapter_memory.py \
        --output benchmarks/results/DATE-trl-reward-adapter-memory.md
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

WAYS = ("separate", "marl")
LOADS = ("none", "4bit", "bf16")
MIB = 2**20
PROMPTS = [
    "The film",
    "This movie is",
    "I watched it and",
    "The plot",
    "A review:",
    "The actors",
    "Overall",
    "It",
]


def worker(args: argparse.Namespace) -> dict:
    """One run in this process: build, train ``args.steps`` steps, return the memory it took."""
    import torch
    from datasets import Dataset
    from measure import MemorySampler
    from peft import LoraConfig, PeftModel, get_peft_model, prepare_model_for_kbit_training
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from marl.integrations.trl import reward_adapter_function
    from marl.model.quantization import bitsandbytes_config

    torch.set_num_threads(2)
    sampler = MemorySampler()
    quantized = args.load == "4bit"
    options = {"dtype": torch.bfloat16 if args.load == "bf16" else torch.float32}
    if quantized:
        options["quantization_config"] = bitsandbytes_config(args.load, torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(args.base)
    base = AutoModelForCausalLM.from_pretrained(args.base, **options)
    if quantized:
        base = prepare_model_for_kbit_training(base, use_gradient_checkpointing=False)
    torch.manual_seed(0)
    policy = get_peft_model(base, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear"))
    reward_bytes = 0
    if args.way == "marl":
        reward, processing_class = reward_adapter_function(policy, args.adapter, tokenizer), None
    else:
        classifier = AutoModelForSequenceClassification.from_pretrained(args.base, num_labels=1, **options)
        # the second copy of the base as stored (4-bit: the packed weights), before the adapter is added
        reward_bytes = sum(
            t.numel() * t.element_size() for t in [*classifier.parameters(), *classifier.buffers()]
        )
        reward, processing_class = PeftModel.from_pretrained(classifier, args.adapter), tokenizer
    config = GRPOConfig(
        output_dir=tempfile.mkdtemp(), use_cpu=True, report_to="none", num_generations=2,
        per_device_train_batch_size=args.prompts * 2, max_completion_length=16, bf16=args.load == "bf16",
        seed=0, max_steps=args.steps, save_strategy="no", disable_tqdm=True, logging_steps=1,
    )  # fmt: skip
    trainer = GRPOTrainer(
        model=policy,
        reward_funcs=[reward],
        reward_processing_classes=[processing_class],
        args=config,
        train_dataset=Dataset.from_dict({"prompt": PROMPTS[: args.prompts] * 4}),
        processing_class=tokenizer,
    )
    sampler.mark("after load")
    sampler.push("train")
    trainer.train()
    sampler.pop()
    sampler.stop()
    above = sampler.peak["pss"] - sampler.baseline["pss"]
    rewards = [entry["reward"] for entry in trainer.state.log_history if "reward" in entry]
    return {"pss_above_imports_mib": above, "reward_model_bytes": reward_bytes, "rewards": rewards}


def write_adapter(base: str, directory: Path) -> None:
    """A reward adapter in RewardTrainer's layout (SEQ_CLS LoRA r=16 + score head), random weights."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForSequenceClassification

    torch.manual_seed(1)
    classifier = AutoModelForSequenceClassification.from_pretrained(base, num_labels=1, dtype=torch.float32)
    config = LoraConfig(task_type="SEQ_CLS", r=16, target_modules="all-linear", init_lora_weights=False)
    get_peft_model(classifier, config).save_pretrained(directory)


def versions() -> dict[str, str]:
    from importlib.metadata import version

    names = ("torch", "transformers", "peft", "trl", "bitsandbytes", "accelerate")
    return {"python": platform.python_version(), **{name: version(name) for name in names}}


def render(results: dict, command: str, seconds: float) -> str:
    lines = [
        "# TRL GRPOTrainer: a separate reward model vs marl's reward adapter on the policy "
        f"({time.strftime('%Y-%m-%d')})",
        "",
        "Command:",
        "",
        f"```\n{command}\n```",
        "",
        f"Machine: 2-core CPU VM, no GPU. Wall time of the whole benchmark: {seconds / 60:.1f} min.",
        "Versions: " + ", ".join(f"{name} {value}" for name, value in versions().items()) + ".",
        "",
        "Peak PSS above the PSS after the imports, one process per run. Target: marl <= separate - 0.8 x the "
        "separate reward model's weight bytes.",
        "",
        "| load | separate reward model (MiB) | marl reward function (MiB) | saved (MiB) "
        "| reward model weights (MiB) | target met |",
        "|---|---|---|---|---|---|",
    ]
    for load in results:
        separate, ours = results[load]["separate"], results[load]["marl"]
        weights = separate["reward_model_bytes"] / MIB
        saved = separate["pss_above_imports_mib"] - ours["pss_above_imports_mib"]
        theirs_mib, ours_mib = separate["pss_above_imports_mib"], ours["pss_above_imports_mib"]
        met = ours_mib <= theirs_mib - 0.8 * weights
        lines.append(
            f"| {load} | {theirs_mib:.0f} | {ours_mib:.0f} | {saved:.0f} | {weights:.0f} "
            f"| {'yes' if met else 'no'} |"
        )
    lines += ["", "Logged rewards per step (the two ways score the same completions):", ""]
    for load in results:
        for way in WAYS:
            rewards = ", ".join(f"{r:.4f}" for r in results[load][way]["rewards"])
            lines.append(f"- {load}, {way}: {rewards}")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=2, help="prompts per step (2 completions each)")
    parser.add_argument("--output", type=Path, help="the markdown results file to write")
    parser.add_argument(
        "--loads",
        default="none,4bit",
        help=f"comma-separated loads of the base to run, of {', '.join(LOADS)}",
    )
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--way", choices=WAYS, help=argparse.SUPPRESS)
    parser.add_argument("--load", choices=LOADS, help=argparse.SUPPRESS)
    parser.add_argument("--base", help=argparse.SUPPRESS)
    parser.add_argument("--adapter", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args)))
        return
    loads = args.loads.split(",")
    unknown = sorted(set(loads) - set(LOADS))
    if unknown:
        parser.error(f"--loads: unknown {', '.join(unknown)}; choose from {', '.join(LOADS)}")
    from marl.data.assets import EMBEDDED_MODEL_ID, resolve_model_path

    start = time.perf_counter()
    base = resolve_model_path(EMBEDDED_MODEL_ID)
    adapter = Path(tempfile.mkdtemp()) / "reward"
    write_adapter(base, adapter)
    results: dict = {}
    for load in loads:
        for way in WAYS:
            command = [sys.executable, __file__, "--worker", "--way", way, "--load", load]
            command += ["--base", base, "--adapter", str(adapter), "--steps", str(args.steps)]
            command += ["--prompts", str(args.prompts)]
            output = subprocess.run(command, capture_output=True, text=True, check=True).stdout
            results.setdefault(load, {})[way] = json.loads(output.strip().splitlines()[-1])
            print(load, way, results[load][way], flush=True)
    invocation = "python " + " ".join([Path(__file__).relative_to(Path.cwd()).as_posix(), *sys.argv[1:]])
    report = render(results, invocation, time.perf_counter() - start)
    if args.output:
        args.output.write_text(report)
    print(report)


if __name__ == "__main__":
    main()
