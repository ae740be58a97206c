"""Where the static sampler's decode step spends its time on this machine, against its floors, and what
``torch.compile`` gives it.

The shapes are the ``cpu-long4`` setup's: SmolLM2-135M with the policy LoRA (r = 16, all linear layers),
4 prompts of 140 tokens, k = 4 (16 rows), 32 new tokens with no stop token, so every row decodes every step
(the floor's assumption). In one process at one torch thread (``--threads``), for each quantization:

* the floors of one decode step (``floors.py``): FLOPs / matmul throughput and weight bytes / bandwidth,
  probed in a fresh interpreter at the same thread count, and the model's own linear layers timed alone at
  the decode shapes (what the matmul library reaches at 16 rows: the floor that this CPU can actually give);
* the median decode step of :func:`marl.model.sampling.sample_static` and, from ``torch.profiler``, how
  it splits into the linear layers, bitsandbytes' dequantization (quantized bases), the attention kernel, the
  other operators of the forward (norms, rotary, LoRA additions, cache writes), Python and dispatch, and the
  draw of the next token;
* the same loop with the decode step compiled (``torch.compile``, ``--compile_mode``, with an empty
  inductor cache): the first step (compilation) and the median step after it, and whether it drew the same
  tokens.

    python examples/benchmarks/decode_profile.py --quantization none 4bit
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from floors import floor_seconds, probe_in_subprocess

REPO_ROOT = Path(__file__).resolve().parents[2]
PROMPTS, PROMPT_LENGTH, K, STEPS = 4, 140, 4, 32
LINEAR_OPS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::linear", "aten::matmul"}
DRAW_OPS = {"aten::exponential_", "aten::_softmax", "aten::argmax", "aten::div", "aten::multinomial"}


def load_model(quantization: str | None):
    import torch
    from peft import LoraConfig

    from marl import MultiAdapterModel
    from marl.data.assets import resolve_model_path

    torch.manual_seed(0)
    model = MultiAdapterModel.from_pretrained(
        resolve_model_path("smollm2-135m-instruct"),
        quantization=quantization,
        policy_adapter=LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", task_type="CAUSAL_LM"),
    )
    model.peft_model.eval()
    return model


def decode_loop(model, step, seed: int = 1) -> tuple[float, list[float], object]:
    """One ``sample_static`` call with ``step`` as its decode step: (seconds, per-step seconds, tokens)."""
    import torch

    from marl.model.sampling import SamplingSettings, sample_static

    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(100, 40000, (PROMPTS, PROMPT_LENGTH), generator=generator)
    step_seconds: list[float] = []

    def timed(*args):
        started = time.perf_counter()
        logits = step(*args)
        step_seconds.append(time.perf_counter() - started)
        return logits

    torch.manual_seed(seed)
    started = time.perf_counter()
    with torch.no_grad(), model.policy():
        tokens = sample_static(
            model.peft_model, ids, torch.ones_like(ids), SamplingSettings(0.7, STEPS, (), 0), K, timed
        )
    return time.perf_counter() - started, step_seconds, tokens


def linear_layers_alone(model, rows: int, repeats: int = 20) -> float:
    """Seconds of one pass of ``rows`` tokens through every linear layer of the model, each timed alone (LoRA
    layers through their own forward, the output layer included): what the matmul library gives at these
    shapes, with no other operator around."""
    import torch
    from torch import nn

    total = 0.0
    with torch.no_grad(), model.policy():
        base = model.peft_model.get_base_model()
        for name, module in base.named_modules():
            is_lora = hasattr(module, "lora_A")
            if not (is_lora or isinstance(module, nn.Linear)) or ".lora_" in name or "base_layer" in name:
                continue
            features = module.in_features
            x = torch.randn(rows, features)
            module(x)
            started = time.perf_counter()
            for _ in range(repeats):
                module(x)
            total += (time.perf_counter() - started) / repeats
    return total


def profile_steps(model) -> dict[str, float]:
    """Milliseconds per decode step, by part (see the module docstring), from one profiled loop."""
    from torch.profiler import ProfilerActivity, profile, record_function

    from marl.model.sampling import _forward_step

    inner = _forward_step(model.peft_model)

    def labelled(*args):
        with record_function("decode_step"):
            return inner(*args)

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        _, step_seconds, _ = decode_loop(model, labelled)
    events = list(prof.events())
    steps = [event for event in events if event.name == "decode_step"]
    first = min(event.time_range.start for event in steps)
    parts: dict[str, float] = defaultdict(float)
    for event in events:
        is_kernel = event.name.startswith(("aten::", "bitsandbytes::"))
        if not is_kernel or event.time_range.start < first:
            continue
        parent, in_step = event.cpu_parent, False
        while parent is not None:
            in_step = in_step or parent.name == "decode_step"
            parent = parent.cpu_parent
        self_ms = event.self_cpu_time_total / 1e3
        if not in_step:
            parts["draw of the next token and loop bookkeeping"] += self_ms
        elif event.name.startswith("bitsandbytes::"):
            parts["bitsandbytes (dequantization, its matmul wrapper)"] += self_ms
        elif event.name in LINEAR_OPS:
            parts["linear layers (matmul)"] += self_ms
        elif "scaled_dot_product" in event.name:
            parts["attention kernel"] += self_ms
        else:
            parts["other operators of the forward"] += self_ms
    in_ops = sum(value for key, value in parts.items() if not key.startswith("draw"))
    parts["Python, modules and dispatch"] = sum(event.cpu_time_total for event in steps) / 1e3 - in_ops
    return {key: value / len(steps) for key, value in parts.items()} | {
        "profiled step (wall)": statistics.median(step_seconds) * 1e3
    }


def measure(quantization: str | None, compile_mode: str | None, floors: dict[str, float]) -> dict:
    import torch

    from marl.model.sampling import _forward_step

    model = load_model(quantization)
    card = model.memory_report()  # the parameter count and the weights as stored, 4-bit packing included
    rows = PROMPTS * K
    step_work = {"flops": 2 * card.base_parameters * rows, "bytes": card.base_bytes}
    eager = _forward_step(model.peft_model)
    decode_loop(model, eager)  # warm-up
    loops = [decode_loop(model, eager) for _ in range(3)]
    steps = [statistics.median(step_seconds) for _, step_seconds, _ in loops]
    result = {
        "quantization": quantization or "none",
        "floor_ms": floor_seconds(step_work, floors) * 1e3,
        "flop_floor_ms": step_work["flops"] / floors["flops_per_s"] * 1e3,
        "byte_floor_ms": step_work["bytes"] / floors["bytes_per_s"] * 1e3,
        "linear_alone_ms": linear_layers_alone(model, rows) * 1e3,
        "eager_step_ms": [s * 1e3 for s in steps],
        "eager_loop_s": [seconds for seconds, _, _ in loops],
        "parts_ms": profile_steps(model),
    }
    if compile_mode:
        compiled = torch.compile(eager, mode=None if compile_mode == "default" else compile_mode)
        try:
            first_loop = decode_loop(model, compiled)
            again = [decode_loop(model, compiled) for _ in range(2)]
        except Exception as error:  # report what compile does here, whatever it is
            result["compile_error"] = f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"
        else:
            result["compile_first_step_s"] = first_loop[1][0]
            result["compiled_step_ms"] = [statistics.median(s) * 1e3 for _, s, _ in again]
            result["compiled_same_tokens"] = bool(torch.equal(again[-1][2], loops[-1][2]))
    return result


def report(results: list[dict], floors: dict[str, float], options, command: str) -> str:
    from marl.environment import machine_description, package_versions

    lines = [
        f"# The static sampler's decode step against its floors ({datetime.date.today()})",
        "",
        f"Command: `{command}`",
        "",
        f"Shapes: SmolLM2-135M + policy LoRA (r 16, all linear layers), {PROMPTS} prompts of {PROMPT_LENGTH}"
        f" tokens × k = {K} = {PROMPTS * K} rows, {STEPS} new tokens, no stop token; {options.threads} torch"
        f" thread(s). Probes: {floors['flops_per_s'] / 1e9:.1f} GFLOP/s (fp32 matmul), "
        f"{floors['bytes_per_s'] / 1e9:.1f} GB/s (copy).",
        "",
        "| quantization | floor (FLOPs; bytes) ms | linear layers alone ms | eager step ms (3 loops) "
        "| × floor | compiled step ms | compile s | same tokens |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        eager = statistics.median(r["eager_step_ms"])
        compiled = (
            f"{statistics.median(r['compiled_step_ms']):.0f}"
            if "compiled_step_ms" in r
            else r.get("compile_error", "–")
        )
        lines.append(
            f"| {r['quantization']} | {r['floor_ms']:.0f} "
            f"({r['flop_floor_ms']:.0f}; {r['byte_floor_ms']:.0f}) "
            f"| {r['linear_alone_ms']:.0f} | {eager:.0f} ({min(r['eager_step_ms']):.0f}–"
            f"{max(r['eager_step_ms']):.0f}) | {eager / r['floor_ms']:.2f} | {compiled} "
            f"| {r.get('compile_first_step_s', float('nan')):.0f} | {r.get('compiled_same_tokens', '–')} |"
        )
    lines += ["", "Where one eager decode step goes (`torch.profiler`, self time per step, ms):", ""]
    wall = "profiled step (wall)"
    parts = [p for p in dict.fromkeys(part for r in results for part in r["parts_ms"]) if p != wall] + [wall]
    lines.append("| part | " + " | ".join(r["quantization"] for r in results) + " |")
    lines.append("|---|" + "---|" * len(results))
    for part in parts:
        lines.append(f"| {part} | " + " | ".join(f"{r['parts_ms'].get(part, 0):.1f}" for r in results) + " |")
    machine = machine_description()
    versions = package_versions()
    lines += ["", "Machine: " + ", ".join(f"{k} {v}" for k, v in machine.items()), ""]
    lines += ["Versions: " + ", ".join(f"{k} {v}" for k, v in versions.items()), ""]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--quantization", nargs="+", default=["none", "4bit"], choices=["none", "4bit", "8bit"]
    )
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--compile_mode", default="default", help="torch.compile mode, or '' to skip compile")
    parser.add_argument("--output", default=None, help="results markdown (default benchmarks/results/...)")
    options = parser.parse_args()
    # A cold compile, as a user's first run gets it: not inductor's on-disk cache of an earlier run.
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="decode-profile-inductor-")
    import torch
    import transformers

    transformers.logging.set_verbosity_error()
    torch.set_num_threads(options.threads)
    floors = probe_in_subprocess(options.threads)
    results = []
    for quantization in options.quantization:
        results.append(
            measure(None if quantization == "none" else quantization, options.compile_mode, floors)
        )
        print(results[-1], flush=True)
    command = "python examples/benchmarks/decode_profile.py " + " ".join(sys.argv[1:])
    text = report(results, floors, options, command)
    output = Path(
        options.output or REPO_ROOT / f"benchmarks/results/{datetime.date.today()}-decode-profile.md"
    )
    output.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
