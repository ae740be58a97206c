"""Tool calls through TRL 1.16's own ``GRPOTrainer`` and through marl, with one scripted policy.

The script (``tests/support/tool_agents.py``) writes every turn from the row's context: some rows answer at
once, some call one tool or two, one calls an unknown tool, one a tool that raises, one runs into the length
limit and one asks for a tool result that does not fit; so rows stop at different turns. First what TRL
itself makes of it (the tool mask, the turns, the errors, the tool metrics); then marl on the same model, the
same ``GRPOConfig`` (``rloo_config_from_trl``) and the same LoRA policy, its sampler the same script: the
completion ids, the tool mask, every reward source, the advantages and the loss of the update must equal
TRL's within 1e-6 (fp32), on the Qwen2.5 (Hermes) and the Llama-3.1 templates, with plain tools and with an
environment owning the reward; and marl on two processes (``fsdp2``, driver
``tests/support/tool_parity_run.py``), each on its share of the prompts, against TRL on the whole batch, the
process whose rows stop first decoding on in step with the other. marl's rows are k-major (row
``j * P + i``), TRL's prompt-major.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from support.processes import run_processes
from support.tool_agents import (
    MAX_COMPLETION_LENGTH,
    SETUPS,
    TASKS,
    TEMPLATES,
    TOOL_TEMPLATES,
    K,
    examples,
    marl_tool_run,
    save_tool_model,
    trl_tool_run,
)

trl = pytest.importorskip("trl")
if trl.__version__ != "1.16.0":  # the parity is pinned to the version "Coming from TRL" names
    pytest.skip(f"parity pinned to TRL 1.16.0, found {trl.__version__}", allow_module_level=True)

TOLERANCE = 1e-6
ENVIRONMENT_NAMES = ("calculator", "notepad")  # the examples' environment column, in turn
DRIVER = str(Path(__file__).resolve().parents[1] / "support" / "tool_parity_run.py")
# Every split of these over two processes leaves one process more turns to decode than the other.
TWO_PROCESS_TASKS = ("answer", "one-call", "two-calls", "long")
# TRL's metrics of the rollout that marl logs under the same names
TOOL_METRICS = (
    "tools/call_frequency",
    "tools/failure_frequency",
    "completions/mean_length",
    "completions/min_length",
    "completions/max_length",
    "completions/clipped_ratio",
    "completions/mean_terminated_length",
)
# The assistant turns of each task's two rows (TRL's prompt-major order: sample 0, then sample 1); on Qwen's
# template the second row of "two-calls" makes both calls in one turn.
TURNS = {
    "answer": (1, 1),
    "one-call": (2, 2),
    "two-calls": (3, 3),
    "fail": (2, 2),
    "long": (2, 1),  # the second row's echo result does not fit: it ends with its call, without the result
}


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("tool-models")
    return {name: save_tool_model(name, root / name) for name in TEMPLATES}


@pytest.fixture(scope="module")
def trl_runs(model_dirs, tmp_path_factory):
    """TRL's run of each (template, setup), made once."""
    made: dict = {}

    def run(template: str, setup: str, tasks: tuple[str, ...] = TASKS, **settings) -> dict:
        key = (template, setup, tasks, tuple(sorted(settings.items())))
        if key not in made:
            output = tmp_path_factory.mktemp(f"trl-{template}-{setup}")
            rows = examples(tasks, ENVIRONMENT_NAMES if setup == "environments" else ())
            made[key] = trl_tool_run(
                model_dirs[template], rows, output_dir=output, **SETUPS[setup], **settings
            )
        return made[key]

    return run


def runs_of(mask: list[int], value: int) -> list[tuple[int, int]]:
    """The (start, end) spans of ``mask`` equal to ``value``."""
    spans, start = [], None
    for index, flag in enumerate([*mask, None]):
        if flag == value and start is None:
            start = index
        elif flag != value and start is not None:
            spans.append((start, index))
            start = None
    return spans


@pytest.mark.parametrize("template", TEMPLATES)
def test_trl_masks_the_tool_results_and_its_rows_stop_at_different_turns(template, trl_runs):
    run = trl_runs(template, "tools")
    tokenizer = run["trainer"].processing_class
    eos = tokenizer.eos_token_id
    for row, (ids, mask, messages) in enumerate(
        zip(run["completion_ids"], run["tool_mask"], run["completions"], strict=True)
    ):
        task, sample = TASKS[row // K], row % K
        turns = [message for message in messages if message["role"] == "assistant"]
        results = [message for message in messages if message["role"] == "tool"]
        expected_turns = TURNS[task][sample]
        if template == "qwen2" and task == "two-calls" and sample == 1:
            expected_turns = 2
        assert len(turns) == expected_turns, (task, sample)
        # the model's spans are its turns; between them, the tools' results in the template's format
        model_spans, tool_spans = runs_of(mask, 1), runs_of(mask, 0)
        assert len(model_spans) == len(turns) and len(tool_spans) == len(turns) - 1
        marker = TOOL_TEMPLATES[template].result_marker
        shown = [tokenizer.decode(ids[start:end], skip_special_tokens=False) for start, end in tool_spans]
        assert all(text.count(marker) >= 1 for text in shown)
        assert sum(text.count(marker) for text in shown) == len(results)
        assert all(str(message["content"]) in "".join(shown) for message in results)
        for _, end in model_spans[:-1]:
            assert ids[end - 1] == eos  # every turn that called a tool closed with the eos
        truncated = task == "long" and sample == 0
        assert len(ids) == MAX_COMPLETION_LENGTH if truncated else ids[-1] == eos
    lengths = [sum(mask) for mask in run["tool_mask"]]
    assert run["metrics"]["completions/mean_length"] == pytest.approx(sum(lengths) / len(lengths))
    assert run["metrics"]["completions/max_length"] == max(lengths)
    assert max(lengths) < MAX_COMPLETION_LENGTH  # the longest row counts its model tokens only


@pytest.mark.parametrize("template", TEMPLATES)
def test_trl_answers_a_raising_tool_and_an_unknown_tool_with_an_error_and_counts_the_failures(
    template, trl_runs
):
    run = trl_runs(template, "tools")
    fail = [run["completions"][TASKS.index("fail") * K + sample] for sample in range(K)]
    assert [messages[1]["content"] for messages in fail] == [
        "{'error': 'Tool multiply not found.'}",
        "{'error': 'division by zero'}",
    ]
    # calls: one-call 1 + 1, two-calls 2 + 2, fail 1 + 1, long 1 + 1 (the echo call that did not fit counts)
    rows = K * len(TASKS)
    assert run["metrics"]["tools/call_frequency"] == pytest.approx(10 / rows)
    assert run["metrics"]["tools/failure_frequency"] == pytest.approx(2 / 10)


@pytest.mark.parametrize("template", TEMPLATES)
def test_trl_scores_the_environment_by_what_its_tools_were_called_with(template, trl_runs):
    run = trl_runs(template, "environment")
    for row, messages in enumerate(run["completions"]):
        adds = [message for message in messages if message["role"] == "tool" and message["name"] == "add"]
        start = row // K  # examples() starts task i's calculator at i
        total = int(adds[-1]["content"]) if adds else start
        assert run["rewards"]["Calculator"][row] == pytest.approx(total / 10 + len(adds)), row
        assert run["rewards"]["environment_calls_reward"][row] == len(adds) / 2, row
    assert run["metrics"]["rewards/Calculator/std"] > 0


def largest_difference(ours: list, theirs: list) -> float:
    """The largest absolute difference; NaN (not judged) equals only NaN."""
    ours, theirs = torch.tensor(ours, dtype=torch.float64), torch.tensor(theirs, dtype=torch.float64)
    assert ours.shape == theirs.shape and torch.equal(ours.isnan(), theirs.isnan())
    return float((ours - theirs).nan_to_num(0.0).abs().max())


def assert_same_rows(ours: dict, theirs: dict, rows: list[int] | None = None) -> None:
    """marl's rows (in TRL's order) equal TRL's ``rows`` (default: all): ids, tool masks, every reward source,
    the advantages."""
    rows = list(range(len(theirs["completion_ids"]))) if rows is None else rows
    assert ours["completion_ids"] == [theirs["completion_ids"][row] for row in rows]
    assert ours["tool_mask"] == [theirs["tool_mask"][row] for row in rows]
    assert sorted(ours["rewards"]) == sorted(theirs["rewards"])
    for name, values in theirs["rewards"].items():
        assert largest_difference(ours["rewards"][name], [values[row] for row in rows]) <= TOLERANCE, name
    assert largest_difference(ours["advantages"], [theirs["advantages"][row] for row in rows]) <= TOLERANCE


@pytest.mark.parametrize("setup", ["tools", "environment"])
@pytest.mark.parametrize("template", TEMPLATES)
def test_marl_tool_rollout_and_update_equal_trl(template, setup, model_dirs, trl_runs, tmp_path):
    pytest.importorskip("marl.rollout.tool_calls")
    theirs = trl_runs(template, setup)
    ours = marl_tool_run(model_dirs[template], examples(), output_dir=tmp_path, **SETUPS[setup])
    assert ours["examples"] == [row // K for row in range(K * len(TASKS))]
    assert_same_rows(ours, theirs)
    assert ours["completions"] == theirs["completions"]  # the turns as reward functions get them
    assert abs(ours["loss"] - theirs["loss"]) <= TOLERANCE
    # turn 1 samples each prompt once for its k rows; every later turn, the rows still calling tools
    turns = max(len(runs_of(mask, 1)) for mask in ours["tool_mask"])
    assert ours["sampler_calls"][0] == (len(TASKS), K)
    assert [k for _, k in ours["sampler_calls"][1:]] == [1] * (turns - 1)
    assert theirs["metrics"]["kl"] > 1e-3  # the policy is away from its reference: the KL term counts
    for name in (*TOOL_METRICS, "kl", "entropy"):
        expected = pytest.approx(theirs["metrics"][name], rel=TOLERANCE, abs=TOLERANCE)
        assert ours["metrics"][name] == expected, name


def test_marl_picks_each_examples_environment_as_trl_does(model_dirs, trl_runs, tmp_path):
    pytest.importorskip("marl.rollout.tool_calls")
    theirs = trl_runs("qwen2", "environments")
    rows = examples(TASKS, ENVIRONMENT_NAMES)
    ours = marl_tool_run(model_dirs["qwen2"], rows, output_dir=tmp_path, **SETUPS["environments"])
    # a notepad row is offered no add: its call of add fails, and Calculator does not judge it
    notepad = [row for row in range(K * len(TASKS)) if rows[row // K]["environment"] == "notepad"]
    assert all(math.isnan(theirs["rewards"]["Calculator"][row]) for row in notepad)
    assert any("Tool add not found" in str(theirs["completions"][row]) for row in notepad)
    assert_same_rows(ours, theirs)
    assert ours["completions"] == theirs["completions"]
    assert abs(ours["loss"] - theirs["loss"]) <= TOLERANCE


def test_marl_stops_at_the_tool_calling_iterations_trl_stops_at(model_dirs, trl_runs, tmp_path):
    pytest.importorskip("marl.rollout.tool_calls")
    theirs = trl_runs("qwen2", "tools", max_tool_calling_iterations=1)
    ours = marl_tool_run(
        model_dirs["qwen2"], examples(), output_dir=tmp_path, max_tool_calling_iterations=1, **SETUPS["tools"]
    )
    assert ours["config"].max_tool_calling_iterations == 1  # rloo_config_from_trl carried it
    first = TASKS.index("two-calls") * K  # its second call is made but never answered
    assert theirs["completions"][first][-1].get("tool_calls")
    assert_same_rows(ours, theirs)
    assert abs(ours["loss"] - theirs["loss"]) <= TOLERANCE


@pytest.mark.slow
def test_marl_on_two_processes_equals_trl_on_the_whole_batch(model_dirs, trl_runs, tmp_path):
    pytest.importorskip("marl.rollout.tool_calls")
    theirs = trl_runs("llama3", "environment", TWO_PROCESS_TASKS)
    run_processes(
        DRIVER, str(model_dirs["llama3"]), str(tmp_path), "fsdp2", "environment", *TWO_PROCESS_TASKS
    )
    reports = [json.loads((tmp_path / f"report_{rank}.json").read_text()) for rank in range(2)]
    assert [report["world"] for report in reports] == [2, 2]
    assert sorted(reports[0]["examples"] + reports[1]["examples"]) == sorted(
        row // K for row in range(K * len(TWO_PROCESS_TASKS))
    )
    for report in reports:
        rows = [example * K + sample for example in dict.fromkeys(report["examples"]) for sample in range(K)]
        assert_same_rows(report, theirs, rows)
        for name in ("tools/call_frequency", "tools/failure_frequency"):  # over both processes
            assert report["metrics"][name] == pytest.approx(theirs["metrics"][name], abs=TOLERANCE)
    # one process's rows stop turns before the other's; it decodes on with them (a row it throws away)
    turns = [max(len(runs_of(mask, 1)) for mask in report["tool_mask"]) for report in reports]
    assert turns[0] != turns[1]
    assert len(reports[0]["sampler_calls"]) == len(reports[1]["sampler_calls"]) == max(turns)
    # each process's loss is its tokens' share over both processes' tokens, as TRL's on each of two processes
    assert abs(sum(report["loss"] for report in reports) / 2 - theirs["loss"]) <= TOLERANCE
