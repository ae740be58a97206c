"""The GPU table of issue 61 as one resumable sequence: each system of each stage is one process of
``vs_trl.py`` (or ``sweep.py``), and the results are written after every one, so a time-out loses nothing.

Stages, most important first (the order of the issue):

    capture        the decode step per row bucket: eager, plain CUDA graphs and torch.compile's
                   reduce-overhead, capture or compilation seconds, step and full decode iteration ms
                   (``decode_capture.py``)
    0.5b-bf16      marl ``graph`` (compiled, then captured in plain CUDA graphs: ``marl-cudagraph``), TRL
                   GRPOTrainer (``generate``, static cache), marl ``static``, TRL GRPOTrainer with
                   transformers' continuous batching, marl sampling with transformers' compiled ``generate``
                   (``hf-generate``); Qwen2.5-0.5B's shapes, bf16, GRPO, 8 prompts x k = 8, 256-token
                   prompts and completions
    1.5b-bf16      the same at Qwen2.5-1.5B's shapes
    0.5b-4bit      marl ``graph``, TRL GRPOTrainer, marl ``static``, the base in 4-bit
    1.5b-4bit      the same at 1.5B
    8b-4bit        Llama-3.1-8B's shapes (random weights built on the card), 4-bit, gradient checkpointing,
                   a reward LoRA + score head, GRPO: marl ``graph`` and TRL GRPOTrainer, and ``marl plan``'s
                   prediction for the same flags
    sweep-4        4 policies on one base, ``--sampler graph``, against one ``graph`` run (``sweep.py``)
    0.5b-bf16-x3, 1.5b-bf16-x3   two more runs of every bf16 system (3 in all)

One call of this on a GPU has about 9 minutes: ``--budget-s`` stops before a process whose estimate
(:attr:`Stage.seconds`) would not end in time, and stops a process that overruns. The next run resumes
with the first system not done: ``--resume FILE`` (default: the newest ``benchmarks/results/*-gpu-sequence
.json``) names what is done. ``--dry-run`` runs exactly this sequence on tiny models on the CPU.

    python examples/benchmarks/gpu_sequence.py --output-dir "$OUT"           # on a GPU: from where it stopped
    python examples/benchmarks/gpu_sequence.py --output-dir /tmp/x --dry-run  # the same steps, tiny, on a CPU
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO_ROOT = HERE.parents[1]
RESULTS_DIR = REPO_ROOT / "benchmarks" / "results"
SUFFIX = "gpu-sequence"
# Published decode step of vLLM on an H100 PCIe (vLLM PR #53060, 2026-08): Qwen2.5-0.5B bf16 at 32 rows,
# 1.5-2B models at 1 row (3.2-3.5 ms): the anchor each decode step is put beside.
VLLM_STEP_MS = {"gpu-0.5b": 2.15, "gpu-1.5b": 3.2}


@dataclasses.dataclass(frozen=True)
class Stage:
    """One block of the table: a setup, a quantization and its systems, each one process."""

    name: str
    setup: str
    quantization: str
    systems: tuple[str, ...]
    seconds: int  # estimated seconds of one system's process on the card (imports, build, 3 updates)
    runs: int = 1
    script: str = "vs_trl"  # "sweep": one graph run and the sweep of 4; "decode_capture": the step per bucket
    plan: bool = False  # also `marl plan` for the same flags


# a system added later goes after those a committed results file already holds (hf-generate last), so the
# file resumes as it did
_BF16 = ("marl-graph", "marl-cudagraph", "trl-grpo", "marl", "trl-grpo-cb", "hf-generate")
_4BIT = ("marl-graph", "trl-grpo", "marl")
STAGES = (
    Stage("capture", "gpu-0.5b", "none", ("decode-capture",), seconds=120, script="decode_capture"),
    Stage("0.5b-bf16", "gpu-0.5b", "none", _BF16, seconds=100),
    Stage("1.5b-bf16", "gpu-1.5b", "none", _BF16, seconds=120),
    Stage("0.5b-4bit", "gpu-0.5b", "4bit", _4BIT, seconds=120),
    Stage("1.5b-4bit", "gpu-1.5b", "4bit", _4BIT, seconds=140),
    Stage("8b-4bit", "gpu-8b", "4bit", ("marl-graph", "trl-grpo"), seconds=240, plan=True),
    Stage("sweep-4", "gpu-0.5b", "none", ("sweep",), seconds=420, script="sweep"),
    Stage("0.5b-bf16-x3", "gpu-0.5b", "none", _BF16, seconds=180, runs=2),
    Stage("1.5b-bf16-x3", "gpu-1.5b", "none", _BF16, seconds=220, runs=2),
)


def steps(done: dict[str, dict]) -> list[tuple[Stage, str]]:
    """Every (stage, system) of :data:`STAGES` in order that ``done`` (stage -> system -> record) lacks.

    Example:
        >>> todo = steps({"capture": {"decode-capture": {}}, "0.5b-bf16": {"marl-graph": {}, "trl-grpo": {}}})
        >>> [f"{stage.name} {system}" for stage, system in todo[:4]]
        ['0.5b-bf16 marl-cudagraph', '0.5b-bf16 marl', '0.5b-bf16 trl-grpo-cb', '0.5b-bf16 hf-generate']
    """
    return [(s, system) for s in STAGES for system in s.systems if system not in done.get(s.name, {})]


def command(stage: Stage, system: str, work_dir: Path, dry_run: bool) -> list[str]:
    """The process of one system of ``stage``: its script with the stage's flags (GRPO, k = 8, ...)."""
    common = ["--setup", stage.setup, "--quantization", stage.quantization, "--work-dir", str(work_dir)]
    common += ["--runs", str(stage.runs), "--output", str(work_dir / f"{system}.md")]
    if stage.script == "decode_capture":  # its own budget, inside the stage's estimate
        line = [sys.executable, str(HERE / "decode_capture.py"), "--output-dir", str(work_dir)]
        line += ["--report", str(work_dir / "report.json"), "--budget-s", str(stage.seconds - 5)]
    elif stage.script == "sweep":
        line = [sys.executable, str(HERE / "sweep.py"), *common, "--policies", "4", "--sampler", "graph"]
    else:
        line = [sys.executable, str(HERE / "vs_trl.py"), *common, "--systems", system, "--algorithm", "grpo"]
    return [*line, "--dry-run"] if dry_run else line


def plan_command(config: dict[str, Any], model_path: str, reward_adapter: str) -> list[str]:
    """``marl plan`` for the flags of a vs_trl run's config (the 8B stage).

    Example:
        >>> config = dict(rloo_k=8, prompts_per_update=8, response_length=256, context_tokens=256,
        ...               dtype="bfloat16", device="cuda", lora_r=16, algorithm="grpo")
        >>> " ".join(plan_command(config, "m", "r")[3:8])
        'plan --model_name_or_path m --reward_adapter r'
    """
    line = [sys.executable, "-m", "marl", "plan", "--model_name_or_path", model_path]
    line += ["--reward_adapter", reward_adapter, "--quantization", "4bit", "--gradient_checkpointing", "true"]
    line += ["--algorithm", config["algorithm"], "--rloo_k", str(config["rloo_k"])]
    line += ["--per_device_train_batch_size", str(config["prompts_per_update"] * config["rloo_k"])]
    line += [
        "--response_length",
        str(config["response_length"]),
        "--prompt_length",
        str(config["context_tokens"]),
    ]
    line += ["--lora_r", str(config["lora_r"]), "--device", config["device"]]
    return [*line, "--bf16", "true"] if config["dtype"] == "bfloat16" else line


def read_record(path: Path | None) -> dict[str, Any]:
    """What a results file of this sequence holds (``{"stages": {}}`` for none)."""
    if path is None or not path.is_file():
        return {"stages": {}}
    return json.loads(path.read_text())


def newest_record() -> Path | None:
    found = sorted(RESULTS_DIR.glob(f"*-{SUFFIX}.json"))
    return found[-1] if found else None


def system_entry(report: dict[str, Any], stage: Stage, system: str) -> dict[str, Any]:
    """One system's figures from a script's ``report.json``: its runs, the card's probed floors, the work
    of a decode step, the config (``decode_capture.py``'s: its measurements and their markdown)."""
    if stage.script == "decode_capture":
        return {
            "runs": report["measurements"], "failures": [], "capture": report["markdown"],
            "machine": report.get("machine"), "versions": report.get("versions"),
        }  # fmt: skip
    entry = report["setups"][stage.setup]
    block = entry["blocks"][stage.quantization]
    return {
        "runs": [
            run["result"] for run in block["runs"] if run["system"] == system or stage.script == "sweep"
        ],
        "failures": [failure["error"][-1500:] for failure in block.get("failures", [])],
        "machine_floors": block.get("machine_floors"),
        "work": block.get("work"),
        "comparison": block.get("comparison"),
        "config": entry["config"],
        "machine": report.get("machine"),
        "versions": report.get("versions"),
    }


def _median(values: list[float]) -> float:
    values = sorted(v for v in values if v is not None)
    return values[len(values) // 2] if values else float("nan")


def table(record: dict[str, Any]) -> list[str]:
    """The markdown table of every system measured so far (medians over its runs)."""
    lines = [
        "| stage | system | runs | episodes/s | sampling tok/s | decode step ms | floor ms | vLLM ms | first "
        "sampling s | peak allocated MiB | log-prob gap mean / max | path | date, card |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for stage in (s for s in STAGES if s.script != "decode_capture"):  # its own table (render)
        for system, entry in record["stages"].get(stage.name, {}).items():
            runs, config = entry.get("runs", []), entry.get("config") or {}
            floors, work = entry.get("machine_floors") or {}, entry.get("work") or {}
            floor = "–"
            if floors.get("bytes_per_s") and work.get("decode"):
                seconds = work["decode"]["bytes"] / config["response_length"] / floors["bytes_per_s"]
                floor = f"{1000 * seconds:.2f}"
            gaps = [g for run in runs for g in run.get("logprob_gap_mean", [])]
            gap_max = [g for run in runs for g in run.get("logprob_gap_max", [])]
            gap = f"{_median(gaps):.1e} / {max(gap_max):.1e}" if gaps else "–"
            paths = sorted({run.get("sampler_path") or "–" for run in runs})
            cells = [
                stage.name, system, str(len(runs)),
                f"{_median([r.get('eps') for r in runs]):.2f}",
                f"{_median([r.get('sampling_tokens_per_s') for r in runs]):.0f}",
                f"{_median([r.get('decode_step_ms') for r in runs]):.2f}", floor,
                str(VLLM_STEP_MS.get(stage.setup, "–")),
                f"{_median([r.get('first_sampling_s') for r in runs]):.1f}",
                f"{_median([r.get('cuda_max_allocated_mib') for r in runs]):.0f}", gap, ", ".join(paths),
                f"{entry.get('date', '?')}, {(entry.get('machine') or {}).get('gpu', 'cpu')}",
            ]  # fmt: skip
            if entry.get("failures") and not runs:
                cells[3:12] = ["failed"] + ["–"] * 8
            lines.append("| " + " | ".join(cells) + " |")
    return lines


def render(record: dict[str, Any]) -> str:
    lines = [f"# marl on one GPU against TRL GRPOTrainer: the sequence of issue 61 ({record['date']})", ""]
    lines += ["Command: `bash scripts/gpu-sequence.sh` (this file's stages; each system one process).", ""]
    lines += table(record)
    todo = steps(record["stages"])
    lines += ["", f"Not yet run: {', '.join(f'{s.name} {x}' for s, x in todo) or 'nothing'}."]
    for stage_name, systems in record["stages"].items():
        for system, entry in systems.items():
            if entry.get("plan"):
                lines += [
                    "",
                    f"`marl plan` for {stage_name} ({system}'s flags):",
                    "",
                    "```",
                    entry["plan"],
                    "```",
                ]
            if entry.get("capture"):
                card = (entry.get("machine") or {}).get("gpu", "cpu")
                lines += ["", f"{stage_name} ({entry.get('date', '?')}, {card}):", "", entry["capture"]]
            if entry.get("comparison"):
                lines += ["", f"{stage_name}: `{json.dumps(entry['comparison'])}`"]
            for failure in entry.get("failures", []):
                lines += ["", f"{stage_name} {system} failed:", "", "```", failure.strip()[-1200:], "```"]
    return "\n".join(lines) + "\n"


def run(args: argparse.Namespace) -> int:
    started = time.monotonic()
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    date = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d")
    record = read_record(None if args.dry_run else Path(args.resume) if args.resume else newest_record())
    record["date"] = date
    name = f"{date}-{SUFFIX}{'-dry-run' if args.dry_run else ''}"
    json_path, md_path = out / f"{name}.json", out / f"{name}.md"
    todo = steps(record["stages"])
    if args.stages:
        chosen = args.stages.split(",")
        if unknown := set(chosen) - {stage.name for stage in STAGES}:
            raise SystemExit(
                f"--stages: unknown {sorted(unknown)}; the stages are {[s.name for s in STAGES]}"
            )
        todo = [(stage, system) for stage, system in todo if stage.name in chosen]
    if args.systems:
        systems, known = args.systems.split(","), {system for stage in STAGES for system in stage.systems}
        if unknown := set(systems) - known:
            raise SystemExit(f"--systems: unknown {sorted(unknown)}; the systems are {sorted(known)}")
        todo = [(stage, system) for stage, system in todo if system in systems]
    for stage, system in todo:
        left = args.budget_s - (time.monotonic() - started)
        if not args.dry_run and left < stage.seconds:
            print(
                f"gpu sequence: {left:.0f} s left, {stage.name} {system} needs about {stage.seconds} s: stop"
            )
            break
        work_dir = Path(args.work_dir) / stage.name
        print(f"gpu sequence: {stage.name} {system} ({left:.0f} s left)", flush=True)
        report_file = work_dir / "report.json"
        report_file.unlink(missing_ok=True)
        try:
            limit = None if args.dry_run else left
            subprocess.run(command(stage, system, work_dir, args.dry_run), timeout=limit, check=False)
        except subprocess.TimeoutExpired:
            print(f"gpu sequence: {stage.name} {system} stopped at the budget", flush=True)
        if not report_file.is_file():  # stopped before its first block: not done, the next run retries
            break
        entry = system_entry(json.loads(report_file.read_text()), stage, system)
        entry["date"] = date
        if stage.plan and entry["runs"]:
            setup = json.loads(report_file.read_text())["setups"][stage.setup]
            model, adapter = _built_paths(work_dir)
            planned = subprocess.run(plan_command(setup["config"], model, adapter), capture_output=True,
                                     text=True, check=False, cwd=REPO_ROOT)  # fmt: skip
            entry["plan"] = (planned.stdout + planned.stderr)[-3000:]
        record["stages"].setdefault(stage.name, {})[system] = entry
        json_path.write_text(json.dumps(record, indent=1))
        md_path.write_text(render(record))
        print(f"gpu sequence: results in {md_path}", flush=True)
    failed = [
        f"{s} {x}" for s, systems in record["stages"].items() for x, e in systems.items() if not e["runs"]
    ]
    return 1 if args.dry_run and failed else 0


def _built_paths(work_dir: Path) -> tuple[str, str]:
    """The model folder and reward adapter vs_trl.py built in ``work_dir``."""
    adapter = next(work_dir.glob("reward-adapter-*"))
    return str(work_dir / adapter.name.removeprefix("reward-adapter-")), str(adapter)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--output-dir", required=True, help="where the dated results (.md, .json) are written"
    )
    parser.add_argument("--work-dir", default="/tmp/marl-gpu-sequence", help="built models, logs")
    parser.add_argument("--budget-s", type=float, default=480.0, help="seconds this command may run")
    parser.add_argument("--resume", default=None, help="results JSON of earlier runs (default: newest)")
    parser.add_argument(
        "--stages", default=None, help="comma list: only these stages (default: all, in order)"
    )
    parser.add_argument(
        "--systems", default=None, help="comma list: only these systems of the stages (default: all)"
    )
    parser.add_argument("--dry-run", action="store_true", help="every step on tiny models on the CPU")
    return parser.parse_args(argv)


if __name__ == "__main__":
    sys.exit(run(parse_args()))
