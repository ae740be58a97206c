"""The results file of the marl-vs-TRL benchmark: a report dict (see ``vs_trl.py``) rendered as markdown."""

from __future__ import annotations

import statistics
from typing import Any

from floors import efficiency_rows, floor_seconds
from measure import PHASES, ratio

MIB = 2**20
CONFIG_MAPPING = (
    ("rloo_k", "num_generations"),
    ("kl_coef", "beta"),
    ("cliprange", "epsilon"),
    ("num_ppo_epochs", "num_iterations"),
    ("response_length", "max_completion_length (+ generation_kwargs min_new_tokens)"),
    ("per_device_train_batch_size (completions per update)", "per_device_train_batch_size"),
    ("gradient_accumulation_steps / num_mini_batches = 1", "gradient_accumulation_steps = 1"),
    ("total_episodes = updates x batch", "max_steps = updates"),
)
MEASUREMENT_NOTES = (
    "Every run is its own process. PSS (proportional set size, `/proc/self/smaps_rollup`) counts a physical "
    "page once however many mappings hold it, and splits a page that other processes also map among them; "
    "RSS counts a page once per mapping (two models mapping one checkpoint count it twice); anonymous RSS is "
    "what the process allocated itself. A thread samples RSS and anonymous RSS every 20 ms and PSS whenever "
    "RSS makes a new high of the phase (by 8 MiB), at the end of every phase and at least twice a second; "
    "peak RSS is the kernel's exact mark (`VmHWM`). 'Above the imports' subtracts what the process held "
    "after importing torch, transformers, marl (and trl) and before loading any model. Phases: load (model "
    "and trainer built), generation (sampling), scoring (the rest of the rollout: log-probs under policy and "
    "reference, reward), update (forward, backward and optimizer step), other (the rest of the loop); "
    "'after update' is the memory held right after each update (the last one is shown). Throughput counts "
    "the updates after the first (warm-up excluded), from a timestamp at the end of every update (TRL: "
    "`TrainerCallback.on_step_end`; marl: `episode / eps` of every update in metrics.jsonl)."
)


def _fmt(values: dict[str, float] | None, digits: int) -> str:
    if not values:
        return "–"
    return f"{values['median']:.{digits}f} ({values['min']:.{digits}f}–{values['max']:.{digits}f})"


def _median(summary: dict, system: str, metric: str) -> float:
    return summary.get(system, {}).get(metric, {}).get("median", float("nan"))


def _memory_metric(config: dict[str, Any]) -> tuple[str, str]:
    if config["device"] == "cuda":
        return "cuda_max_allocated_mib", "peak CUDA memory allocated (MiB)"
    return "pss_above_baseline", "peak PSS above the imports (MiB)"


def headline(report: dict[str, Any]) -> list[str]:
    """One row per setup and quantization: the memory and throughput ratios and marl's distance to its
    floor."""
    marls = [s for s in report["systems"] if s.startswith("marl")]
    lines = [
        "| setup | quantization | "
        + " | ".join(f"{s} / TRL memory" for s in marls)
        + " | "
        + " | ".join(f"{s} / TRL episodes/s" for s in marls)
        + " | marl / floor |",
        "|---|---|" + "---|" * (2 * len(marls) + 1),
    ]
    for setup, entry in report["setups"].items():
        metric, _ = _memory_metric(entry["config"])
        for quantization, block in entry["blocks"].items():
            summary = block.get("summary", {})
            trl_memory, trl_eps = _median(summary, "trl", metric), _median(summary, "trl", "eps")
            memory = [f"{ratio(_median(summary, s, metric), trl_memory):.2f}" for s in marls]
            eps = [f"{ratio(_median(summary, s, 'eps'), trl_eps):.2f}" for s in marls]
            floor = ratio(_median(summary, "marl", metric), block["floor"]["total"] / MIB)
            lines.append(f"| {setup} | {quantization} | " + " | ".join(memory + eps) + f" | {floor:.2f} |")
    return lines


def results_table(entry: dict[str, Any], systems: list[str]) -> list[str]:
    metric, label = _memory_metric(entry["config"])
    rows = [
        (label, metric, 0),
        ("peak PSS (MiB)", "peak_pss", 0),
        ("peak RSS, VmHWM (MiB)", "peak_rss_vmhwm", 0),
    ]
    rows += [("peak anonymous RSS above the imports (MiB)", "anon_above_baseline", 0)]
    rows += [("episodes/s", "eps", 2), ("generated tokens/s", "tokens_per_s", 1)]
    lines = [
        "| quantization | metric | " + " | ".join(systems) + " | marl/TRL | floor | marl/floor |",
        "|---|---|" + "---|" * (len(systems) + 3),
    ]
    for quantization, block in entry["blocks"].items():
        summary = block.get("summary", {})
        floor = block["floor"]["total"] / MIB
        for name, key, digits in rows:
            cells = [_fmt(summary.get(s, {}).get(key), digits) for s in systems]
            versus = ratio(_median(summary, "marl", key), _median(summary, "trl", key))
            floor_cells = "| |"
            if key == metric:
                floor_cells = f"{floor:.0f} | {ratio(_median(summary, 'marl', key), floor):.2f} |"
            lines.append(
                f"| {quantization} | {name} | " + " | ".join(cells) + f" | {versus:.2f} | {floor_cells}"
            )
    return lines


def phase_table(entry: dict[str, Any], systems: list[str]) -> list[str]:
    """Medians over runs: PSS / anonymous RSS above the imports held after load and after the last update;
    per phase, the peak PSS above the imports while it ran and (in brackets) its largest rise in one pass."""
    points, phases = ("after load", "after update"), [p for p in PHASES if p != "load"]
    columns = [points[0], *phases, points[1]]
    lines = [
        "| quantization | system | " + " | ".join(columns) + " |",
        "|---|---|" + "---|" * len(columns),
    ]
    for quantization, block in entry["blocks"].items():
        summary = block.get("summary", {})
        for system in systems:
            mine = summary.get(system, {})
            cells = []
            for column in columns:
                pss = mine.get(f"{column}_pss_above_baseline")
                second = mine.get(
                    f"{column}_anon_above_baseline" if column in points else f"{column}_pss_rise"
                )
                if not (pss and second):
                    cells.append("–")
                elif column in points:
                    cells.append(f"{pss['median']:.0f} / {second['median']:.0f}")
                else:
                    cells.append(f"{pss['median']:.0f} (+{second['median']:.0f})")
            lines.append(f"| {quantization} | {system} | " + " | ".join(cells) + " |")
    return lines


def checkpoint_table(entry: dict[str, Any], systems: list[str]) -> list[str]:
    """Median RSS and PSS of the maps of the checkpoint file, after load and at the end of the run."""
    lines = [
        "| quantization | system | after load: RSS / PSS (MiB) | at the end: RSS / PSS (MiB) |",
        "|---|---|---|---|",
    ]
    for quantization, block in entry["blocks"].items():
        for system in systems:
            results = [r["result"] for r in block["runs"] if r["system"] == system]
            cells = []
            for moment in ("checkpoint_after_load", "checkpoint_at_end"):
                rss = statistics.median(r[moment]["rss"] for r in results) if results else float("nan")
                pss = statistics.median(r[moment]["pss"] for r in results) if results else float("nan")
                cells.append(f"{rss:.0f} / {pss:.0f}")
            lines.append(f"| {quantization} | {system} | " + " | ".join(cells) + " |")
    return lines


def floor_table(entry: dict[str, Any]) -> list[str]:
    blocks = list(entry["blocks"].values())
    lines = ["| part | " + " | ".join(entry["blocks"]) + " |", "|---|" + "---|" * len(blocks)]
    for part in blocks[0]["floor"]:
        lines.append(f"| {part} | " + " | ".join(f"{b['floor'][part] / MIB:.1f} MiB" for b in blocks) + " |")
    # TRL holds the same tensors plus the reward model's own copy of the base.
    trl = [b["floor"]["total"] + b["floor"]["base weights (as stored)"] for b in blocks]
    lines.append(
        "| TRL's floor (+ the reward model's own base) | "
        + " | ".join(f"{f / MIB:.1f} MiB" for f in trl)
        + " |"
    )
    best = [f"{ratio(b['floor']['total'], f):.2f}" for b, f in zip(blocks, trl, strict=True)]
    lines.append("| best possible marl/TRL (floor / TRL's floor) | " + " | ".join(best) + " |")
    return lines


def efficiency_table(entry: dict[str, Any], systems: list[str]) -> list[str]:
    """Per phase of one update (medians over runs, the warm-up update included): seconds, the floor of this
    machine (probed in the same run and thread count) and the achieved FLOP/s and weight bytes/s."""
    lines = []
    updates = entry["config"]["updates"]
    for quantization, block in entry["blocks"].items():
        floors, work = block.get("machine_floors"), block.get("work")
        if not floors or not work:
            continue
        lines += [
            f"{quantization}: probes {floors['flops_per_s'] / 1e9:.1f} GFLOP/s, "
            f"{floors['bytes_per_s'] / 1e9:.1f} GB/s ({floors.get('kind', 'fp32 matmul, copy')}); "
            "floors per update: "
            + ", ".join(f"{part} {floor_seconds(w, floors):.2f} s" for part, w in work.items()),
            "",
            "| system | phase | s / update | floor s | × floor | GFLOP/s | weight GB/s |",
            "|---|---|---|---|---|---|---|",
        ]
        for system in systems:
            mine = block.get("summary", {}).get(system, {})
            seconds = {
                phase: mine[f"{phase}_seconds"]["median"] / updates
                for phase in ("generation", "scoring", "update")
                if f"{phase}_seconds" in mine
            }
            for phase, spent, floor, gflops, gbytes in efficiency_rows(work, floors, seconds):
                lines.append(
                    f"| {system} | {phase} | {spent:.2f} | {floor:.2f} | {spent / floor:.1f} | "
                    f"{gflops:.1f} | {gbytes:.2f} |"
                )
        lines.append("")
    return lines


def sampling_table(entry: dict[str, Any], systems: list[str]) -> list[str]:
    """Per system (medians over runs of the median sampling call after the first): sampling tokens/s, the
    seconds of one decode step (one sampling call / completion length, prefill included) against its floor
    (the weights as stored read once / the probed bandwidth), and tokens/s against TRL's RLOOTrainer."""
    steps = entry["config"]["response_length"]
    lines = [
        "| quantization | system | sampling tokens/s | × TRL | decode step ms | floor ms | × floor | path |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for quantization, block in entry["blocks"].items():
        summary, floors, work = block.get("summary", {}), block.get("machine_floors"), block.get("work")
        if not floors or not work:
            continue
        floor_ms = 1000 * work["decode"]["bytes"] / steps / floors["bytes_per_s"]
        trl = _median(summary, "trl", "sampling_tokens_per_s")
        for system in systems:
            tokens = _median(summary, system, "sampling_tokens_per_s")
            step = _median(summary, system, "decode_step_ms")
            # the decode path marl's sampler logged (compiled+graphs, eager, ...), per run
            paths = {r["result"].get("sampler_path") for r in block["runs"] if r["system"] == system}
            path = ", ".join(sorted(p for p in paths if p)) or "–"
            lines.append(
                f"| {quantization} | {system} | {tokens:.0f} | {ratio(tokens, trl):.2f} | {step:.2f} | "
                f"{floor_ms:.2f} | {ratio(step, floor_ms):.1f} | {path} |"
            )
    return lines


def runs_table(entry: dict[str, Any]) -> list[str]:
    gpu = entry["config"]["device"] == "cuda"
    lines = [
        "| quantization | order | system | peak PSS | above imports | VmHWM | peak anon | "
        + ("CUDA max allocated | " if gpu else "")
        + "episodes/s | update seconds |",
        "|---|---|---|---|---|---|---|" + ("---|" if gpu else "") + "---|---|",
    ]
    for quantization, block in entry["blocks"].items():
        for order, run in enumerate(block["runs"]):
            r, memory = run["result"], run["result"]["memory"]
            cuda = f"{r['cuda_max_allocated_mib']:.0f} | " if gpu else ""
            lines.append(
                f"| {quantization} | {order + 1} | {run['system']} | {memory['peak']['pss']:.0f} | "
                f"{memory['peak']['pss'] - memory['baseline']['pss']:.0f} | {memory['vmhwm']:.0f} | "
                f"{memory['peak']['anon']:.0f} | {cuda}{r['eps']:.2f} | "
                + ", ".join(f"{s:.1f}" for s in r["update_seconds"])
                + " |"
            )
    return lines


def _length_check(entry: dict[str, Any]) -> str:
    runs = [run for block in entry["blocks"].values() for run in block["runs"]]
    trl = sorted({v for r in runs if r["system"].startswith("trl") for v in r["result"]["lengths"]})
    marl = sorted({v for r in runs if r["system"].startswith("marl") for v in r["result"]["lengths"]})
    return (
        f"Every completion has exactly {entry['config']['response_length']} tokens (TRL: `min_new_tokens = "
        "max_completion_length`; marl: no stop token); checked: TRL's logged `completions/mean_length` took "
        f"the values {trl}, marl's completion lengths the values {marl}."
    )


def _failures(entry: dict[str, Any]) -> list[str]:
    """The runs that failed (not in any table above), each with the last line of its log."""
    lines = []
    for quantization, block in entry["blocks"].items():
        for failure in block.get("failures", []):
            last = failure["error"].strip().splitlines()[-1] if failure["error"].strip() else ""
            lines.append(f"- {quantization}, {failure['system']} (`{failure['run']}`) failed: `{last}`")
    return ["", "Runs that failed:", "", *lines] if lines else []


def render_markdown(report: dict[str, Any]) -> str:
    systems = report["systems"]
    grpo = all(entry["config"].get("algorithm") == "grpo" for entry in report["setups"].values())
    trainer = "GRPOTrainer (marl --algorithm grpo)" if grpo else "RLOOTrainer"
    lines = [
        f"# marl vs TRL {trainer} ({report['date']})",
        "",
        "Command:",
        "",
        "```",
        report["command"],
        "```",
        "",
        f"Wall time of the whole benchmark: {report.get('wall_minutes', float('nan')):.1f} min.",
        "",
        "## Machine and versions",
        "",
        "| | |",
        "|---|---|",
        *[f"| {k} | {v} |" for k, v in report["machine"].items()],
        *[f"| {k} | {v} |" for k, v in report["versions"].items()],
        "",
        "## Summary (ratios of the medians; memory: peak PSS above the imports, or CUDA memory on a GPU)",
        "",
        *headline(report),
    ]
    for setup, entry in report["setups"].items():
        config = entry["config"]
        low, high = entry["prompt_tokens"]
        lines += [
            "",
            f"## {setup}",
            "",
            f"`{config['model']}` ({entry['model_note']}), {config['dtype']} compute on {config['device']}; "
            f"prompts of {low}–{high} tokens, {config['prompts_per_update']} prompts × k = "
            f"{config['rloo_k']} = {config['prompts_per_update'] * config['rloo_k']} completions of "
            f"{config['response_length']} tokens per update, {config['updates']} updates; reward adapter: "
            f"{entry['reward_adapter_note']}. "
            "Load average before each block: "
            + "; ".join(f"{q}: `{b['loadavg']}`" for q, b in entry["blocks"].items()),
            "",
            "Median over runs, min–max in brackets; floor: see below.",
            "",
            *results_table(entry, entry.get("systems", systems)),
            "",
            "Memory by phase (MiB above the imports, medians): PSS / anonymous RSS held after load and after "
            "the last update; per phase, the peak PSS while it ran (+ its largest rise within one pass: what "
            "the phase itself added, the peak also carries what earlier phases left allocated).",
            "",
            *phase_table(entry, entry.get("systems", systems)),
            "",
            "Pages of the checkpoint file held through its maps (RSS counts a page once per map, PSS once; "
            "PSS is also split with other processes that map the same file):",
            "",
            *checkpoint_table(entry, entry.get("systems", systems)),
            "",
            "Time against this machine's floors (per update; see `floors.py`):",
            "",
            *efficiency_table(entry, entry.get("systems", systems)),
            "Sampling against the floor of a decode step (medians; the first update, with its warm-up and "
            "compilation, left out):",
            "",
            *sampling_table(entry, entry.get("systems", systems)),
            "",
            "Physical floor (tensors only; the interpreter and libraries are in the import baseline):",
            "",
            *floor_table(entry),
            "",
            _length_check(entry),
            *_failures(entry),
        ]
    setups = list(report["setups"].values())
    fields = list(setups[0]["config"])
    lines += [
        "",
        "## Shared configuration",
        "",
        "| field | " + " | ".join(report["setups"]) + " |",
        "|---|" + "---|" * len(setups),
        *[f"| {f} | " + " | ".join(str(e["config"][f]) for e in setups) + " |" for f in fields],
        "",
        "Quantization: NF4 with double quantisation, compute dtype = dtype, from "
        "`marl.model.quantization.bitsandbytes_config` (both systems). Reward normalisation, advantage "
        "normalisation: off; missing-EOS penalty: none (both).",
        "",
        "Configuration mapping (marl → TRL 1.16 `RLOOConfig`):",
        "",
        "| marl | TRL |",
        "|---|---|",
        *[f"| `{a}` | `{b}` |" for a, b in CONFIG_MAPPING],
        "",
        "## How it is measured",
        "",
        MEASUREMENT_NOTES,
        "",
        "## Every run (MiB, episodes/s, seconds)",
    ]
    for setup, entry in report["setups"].items():
        lines += ["", f"### {setup}", "", *runs_table(entry)]
    return "\n".join(lines) + "\n"
