"""Where a decode step of ``--sampler graph`` spends its time on a GPU, per row bucket, for each way of
running it: ``eager`` (nothing captured), ``cuda_graphs`` (the eager step captured in plain CUDA graphs,
``--graph_capture cuda_graphs``) and ``compile`` (``torch.compile(mode="reduce-overhead")``, the default).

For each GPU setup's shapes (Qwen2.5-0.5B and 1.5B, random weights built on the card, bf16, the policy LoRA
of marl's default: r 16 on every linear layer, sampled under bf16 autocast as the trainer samples), each
bucket of rows (64, 32, 16, 8, 1: every row decodes every step, no stop token) and a 256-token prompt, one
:class:`marl.model.graph_decode.BucketedDecoder` per mode samples twice; from the second call (the first
compiles or captures):

- setup s: how much longer the first call took (compilation or capture), and its first step alone;
- step ms: the median time of one decode step (CUDA events around the model call: a replay, or the eager
  step's launches);
- iteration ms: the wall time of one full decode iteration: the step plus what runs outside it (softmax,
  multinomial, the index writes into the fixed buffers, the per-step ``bool(stopped.any())`` host sync),
  so "outside ms" = iteration - step is the sampling ops' share;
- for ``compile``: inductor's cudagraph skips (``counters["inductor"]``) and the reasons it logged.

Then a check that only a card can make: a decoder captured in CUDA graphs samples, the policy's LoRA weights
change in place (as an optimizer step changes them), and it samples again: the fraction of its tokens equal
to an eager decoder's for the same seed (1.0: the replays read the new weights).

The graph modes decode 256 new tokens (a cache of 512 columns, the GPU setups' shape); ``eager`` 32 (288
columns: launch-bound, its step hardly depends on the cache length) to fit the time. Measurements run most
telling first (the 0.5B shape's 64-row bucket eager, captured and compiled, its other buckets eager and
captured, the 1.5B shape likewise, the other compilations last) and stop before one whose estimate would
overrun ``--budget-s``; the dated results (.md, .json) are written after each.

    python examples/benchmarks/decode_capture.py --output-dir DIR               # on a GPU (about 2 min)
    python examples/benchmarks/decode_capture.py --output-dir DIR --dry-run     # tiny, eager only, CPU
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from built_models import random_model

STARTED = time.monotonic()
MODES = ("eager", "cuda_graphs", "compile")
SHAPES = {"gpu-0.5b": "qwen2.5-0.5b-shaped", "gpu-1.5b": "qwen2.5-1.5b-shaped"}
ROWS = (64, 32, 16, 8, 1)
PROMPT_TOKENS, NEW_TOKENS, EAGER_NEW_TOKENS, CHECK_NEW_TOKENS = 256, 256, 32, 16
# Seconds one measurement takes on a card (0.5B shape; the first compilation of a bucket took about a minute).
ESTIMATE_S = {"eager": 4, "cuda_graphs": 5, "compile": 60}
DRY_RUN = dict(shape="tiny-qwen2-shaped", rows=(4, 1), prompt_tokens=16, new_tokens=8, check_new_tokens=4)


def plan(setups: list[str], rows: tuple[int, ...], cuda: bool) -> list[tuple[str, str, int]]:
    """``(setup, mode, rows)`` in the order they run: per setup its largest bucket eager, captured and
    compiled, then every other bucket eager and captured; the other compilations last. Without CUDA: eager
    only.

    Example:
        >>> [f"{setup} {mode} {rows}" for setup, mode, rows in plan(["a", "b"], (2, 1), cuda=True)]
        ['a eager 2', 'a cuda_graphs 2', 'a compile 2', 'a eager 1', 'a cuda_graphs 1', 'b eager 2', \
'b cuda_graphs 2', 'b compile 2', 'b eager 1', 'b cuda_graphs 1', 'a compile 1', 'b compile 1']
        >>> plan(["a"], (2, 1), cuda=False)
        [('a', 'eager', 2), ('a', 'eager', 1)]
    """
    if not cuda:
        return [(setup, "eager", count) for setup in setups for count in rows]
    first = [
        (setup, mode, count)
        for setup in setups
        for count in rows
        for mode in ("eager", "cuda_graphs", "compile")
        if mode != "compile" or count == rows[0]
    ]
    return first + [(setup, "compile", count) for setup in setups for count in rows[1:]]


class StepClock:
    """A decode step timed at every call: CUDA events around it (no sync) on a GPU, the wall clock on a CPU;
    the first step of each sample call starts :attr:`loop_started` (after a sync), the very first is timed
    alone (compilation or capture included). A prefill (more than one token) passes untimed."""

    def __init__(self, step: Any, torch: Any, cuda: bool) -> None:
        self.step, self.torch, self.cuda = step, torch, cuda
        self.first_step_s: float | None = None
        self.spans: list[Any] = []
        self.loop_started: float | None = None

    def sync(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize()

    def __call__(self, ids: Any, *rest: Any) -> Any:
        if ids.shape[1] != 1:
            return self.step(ids, *rest)
        if self.loop_started is None:
            self.sync()
            self.loop_started = time.perf_counter()
        if self.first_step_s is None:
            out = self.step(ids, *rest)
            self.sync()
            self.first_step_s = time.perf_counter() - self.loop_started
            return out
        if not self.cuda:
            started = time.perf_counter()
            out = self.step(ids, *rest)
            self.spans.append(time.perf_counter() - started)
            return out
        start, end = (self.torch.cuda.Event(enable_timing=True) for _ in range(2))
        start.record()
        out = self.step(ids, *rest)
        end.record()
        self.spans.append((start, end))
        return out

    def step_ms(self) -> float:
        self.sync()
        spans = [s * 1e3 if isinstance(s, float) else s[0].elapsed_time(s[1]) for s in self.spans]
        return statistics.median(spans) if spans else float("nan")


class SkipLog(logging.Handler):
    """Inductor's logged reasons for skipping CUDA graphs (its ``cudagraphs`` log artifact)."""

    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if "skip" in message.lower() or "rerecord" in message.lower():
            self.messages.append(message[:300])


def measure(model: Any, mode: str, rows: int, shape: dict, torch: Any, cuda: bool) -> dict[str, Any]:
    """Two sample calls of a fresh decoder of ``rows`` rows in ``mode``; see the module's docstring."""
    from torch._dynamo.utils import counters

    from marl.model.graph_decode import BucketedDecoder, capture_cuda_graphs
    from marl.model.sampling import SamplingSettings
    from marl.rollout.samplers import capture_step

    factory = {"eager": None, "cuda_graphs": capture_cuda_graphs(), "compile": capture_step}[mode]
    failures: list[BaseException] = []
    decoder = BucketedDecoder(model, rows, factory, on_fallback=failures.append)
    clock = StepClock(decoder.compiled_step or decoder.eager_step, torch, cuda)
    if decoder.compiled_step is None:
        decoder.eager_step = clock
    else:
        decoder.compiled_step = clock
    new_tokens = shape["eager_new_tokens"] if mode == "eager" else shape["new_tokens"]
    settings = SamplingSettings(0.7, new_tokens, (), pad_token_id=1)
    ids = torch.randint(2, shape["vocab"], (1, shape["prompt_tokens"]), device=model.device)
    skips_before = dict(counters["inductor"])
    seconds = []  # of each sample call; the second's decode loop is measured
    for _ in range(2):
        clock.loop_started, clock.spans = None, []
        started = time.perf_counter()
        decoder.sample(ids, torch.ones_like(ids), settings, copies=rows)
        clock.sync()
        ended = time.perf_counter()
        seconds.append(ended - started)
    steps = len(clock.spans)  # the model calls of the second loop, from its first to the end
    step_ms = clock.step_ms()
    iteration_ms = 1e3 * (ended - clock.loop_started) / max(steps, 1)
    cudagraph = {
        key: value - skips_before.get(key, 0)
        for key, value in counters["inductor"].items()
        if "cudagraph" in key and value != skips_before.get(key, 0)
    }
    return {
        "rows": rows, "mode": mode, "cache_length": shape["prompt_tokens"] + new_tokens,
        "setup_s": seconds[0] - seconds[1], "first_step_s": clock.first_step_s, "step_ms": step_ms,
        "iteration_ms": iteration_ms, "outside_step_ms": iteration_ms - step_ms, "steps": steps,
        "fell_back": [f"{type(e).__name__}: {str(e)[:300]}" for e in failures],
        "inductor_cudagraph_counters": cudagraph,
    }  # fmt: skip


def update_check(model: Any, rows: int, shape: dict, torch: Any) -> dict[str, Any]:
    """A captured decoder samples, the LoRA weights change in place, it samples again: its tokens against an
    eager decoder's for the same seed (both after the change)."""
    from marl.model.graph_decode import BucketedDecoder, capture_cuda_graphs
    from marl.model.sampling import SamplingSettings

    failures: list[BaseException] = []
    captured = BucketedDecoder(model, rows, capture_cuda_graphs(), on_fallback=failures.append)
    eager = BucketedDecoder(model, rows)
    settings = SamplingSettings(0.7, shape["check_new_tokens"], (), pad_token_id=1)
    ids = torch.randint(2, shape["vocab"], (1, shape["prompt_tokens"]), device=model.device)

    def draw(decoder: BucketedDecoder) -> Any:
        torch.manual_seed(7)
        return decoder.sample(ids, torch.ones_like(ids), settings, copies=rows)

    before = draw(captured)
    with torch.no_grad():  # an optimizer step: in place
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.add_(torch.randn_like(parameter) * 0.05)
    after, reference = draw(captured), draw(eager)
    return {
        "rows": rows,
        "same_tokens_as_eager_after_update": float((after == reference).float().mean()),
        "tokens_changed_by_update": float((before != reference).float().mean()),
        "captures": len(captured.compiled_step.captures) if captured.compiled_step is not None else 0,
        "fell_back": [f"{type(e).__name__}: {str(e)[:300]}" for e in failures],
    }


def markdown(record: dict[str, Any]) -> str:
    """The results as a markdown section: one row per measurement, then the update check."""
    lines = [
        "| setup | rows | mode | cache | setup s | first step s | step ms | iteration ms | outside step ms "
        "| floor ms | inductor cudagraph counters | fell back |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for m in record["measurements"]:
        floor = record["floors_ms"].get(m["setup"])
        lines.append(
            f"| {m['setup']} | {m['rows']} | {m['mode']} | {m['cache_length']} | {m['setup_s']:.2f} "
            f"| {m['first_step_s']:.2f} | {m['step_ms']:.2f} | {m['iteration_ms']:.2f} "
            f"| {m['outside_step_ms']:.2f} | {'–' if floor is None else f'{floor:.2f}'} "
            f"| {json.dumps(m['inductor_cudagraph_counters']) if m['mode'] == 'compile' else '–'} "
            f"| {'; '.join(m['fell_back']) or '–'} |"
        )
    if record["skipped"]:
        lines += ["", "Not measured: " + ", ".join(record["skipped"]) + "."]
    if record["skip_reasons"]:
        lines += ["", "Inductor's logged cudagraph skips:", ""] + [f"- {r}" for r in record["skip_reasons"]]
    if record.get("update_check"):
        lines += [
            "",
            f"Captured decode after an in-place LoRA update: `{json.dumps(record['update_check'])}`",
        ]
    return "\n".join(lines)


def write(record: dict[str, Any], out: Path, report: Path | None) -> None:
    record["markdown"] = markdown(record)
    record["wall_s"] = time.monotonic() - STARTED
    name = f"{record['date']}-decode-capture{'-dry-run' if record['dry_run'] else ''}"
    title = f"# The decode step of `--sampler graph` per bucket and capture mode ({record['date']})"
    header = [
        title,
        "",
        f"Command: `{record['command']}`",
        "",
        f"Card: {record['machine'].get('gpu', 'cpu')}",
    ]
    versions = ", ".join(f"{k} {v}" for k, v in record["versions"].items())
    (out / f"{name}.md").write_text("\n".join([*header, "", record["markdown"], "", versions]) + "\n")
    for path in (out / f"{name}.json", *([report] if report else [])):
        path.write_text(json.dumps(record, indent=1))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    from marl.config.model import policy_lora_config
    from marl.environment import machine_description, package_versions
    from marl.model.loading import wrap_with_peft

    cuda = torch.cuda.is_available() and not args.dry_run
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    setups = args.setups.split(",")
    unknown = sorted(set(setups) - set(SHAPES))
    if unknown:
        raise SystemExit(f"--setups: unknown {unknown}; the setups are {list(SHAPES)}")
    rows = DRY_RUN["rows"] if args.dry_run else tuple(int(r) for r in args.rows.split(","))
    shape = dict(prompt_tokens=PROMPT_TOKENS, new_tokens=NEW_TOKENS, eager_new_tokens=EAGER_NEW_TOKENS,
                 check_new_tokens=CHECK_NEW_TOKENS)  # fmt: skip
    if args.dry_run:
        tiny = DRY_RUN["new_tokens"]
        shape.update(prompt_tokens=DRY_RUN["prompt_tokens"], new_tokens=tiny, eager_new_tokens=tiny,
                     check_new_tokens=DRY_RUN["check_new_tokens"])  # fmt: skip
    record: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d"), "dry_run": args.dry_run,
        "command": "python examples/benchmarks/decode_capture.py " + " ".join(argv or sys.argv[1:]),
        "machine": machine_description(), "versions": package_versions(), "measurements": [],
        "floors_ms": {}, "skipped": [] if cuda else ["cuda_graphs and compile (no CUDA device: eager only)"],
        "skip_reasons": [],
    }  # fmt: skip
    skip_log = SkipLog()
    if cuda:
        torch._logging.set_logs(cudagraphs=True)
        logging.getLogger("torch._inductor.cudagraph_utils.__cudagraphs").addHandler(skip_log)
        logging.getLogger("torch._inductor.cudagraph_trees").addHandler(skip_log)
    models: dict[str, Any] = {}
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if cuda else torch.autocast("cpu", enabled=False)
    for setup, mode, count in plan(setups, rows, cuda):
        left = args.budget_s - (time.monotonic() - STARTED)
        if cuda and left < ESTIMATE_S[mode] * (1 if setup == "gpu-0.5b" else 2):
            record["skipped"].append(f"{setup} {mode} {count} rows (budget)")
            continue
        if setup not in models:
            name = DRY_RUN["shape"] if args.dry_run else SHAPES[setup]
            base = random_model(name, "bfloat16" if cuda else "float32", "cuda" if cuda else "cpu")
            models[setup] = wrap_with_peft(base, policy_lora_config()).eval()
            shape["vocab"] = base.config.vocab_size
            if cuda:
                from floors import probe_cuda

                weights = sum(p.numel() * p.element_size() for p in base.parameters())
                record["floors_ms"][setup] = 1e3 * weights / probe_cuda(torch)["bytes_per_s"]
        print(f"decode capture: {setup} {mode} {count} rows ({left:.0f} s left)", flush=True)
        with torch.no_grad(), autocast:
            result = measure(models[setup], mode, count, shape, torch, cuda)
            if cuda and mode == "cuda_graphs" and count == rows[0] and "update_check" not in record:
                record["update_check"] = update_check(models[setup], count, shape, torch)
        record["measurements"].append({"setup": setup, **result})
        record["skip_reasons"] = list(dict.fromkeys(skip_log.messages))
        write(record, out, Path(args.report) if args.report else None)
        print(f"decode capture: {json.dumps(result)}", flush=True)
    write(record, out, Path(args.report) if args.report else None)
    return 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output-dir", required=True, help="where the dated results (.md, .json) go")
    parser.add_argument("--report", default=None, help="also write the raw record here (the GPU sequence)")
    parser.add_argument("--setups", default="gpu-0.5b,gpu-1.5b", help=f"comma list of {list(SHAPES)}")
    parser.add_argument("--rows", default=",".join(map(str, ROWS)), help="the row buckets, largest first")
    parser.add_argument("--budget-s", type=float, default=115.0, help="no measurement starts past this")
    parser.add_argument("--dry-run", action="store_true", help="a tiny model on the CPU, eager only")
    return parser.parse_args(argv)


if __name__ == "__main__":
    sys.exit(main())
