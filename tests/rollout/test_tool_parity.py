"""Tool calls through TRL 1.16's own ``GRPOTrainer`` and through marl, with one scripted policy.

The script (``tests/support/tool_agents.py``) writes every turn from the row's context: some rows answer at
once, some call one tool or two, one calls an unknown tool, one a tool that raises, one runs into the length
limit and one asks for a tool result that does not fit; so rows stop at different turns. First what TRL
itself makes of it (the tool mask, the turns, the errors, the tool metrics); then marl on the same model, the
same ``GRPOConfig`` (``rloo_config_from_trl``) and the same LoRA policy, its sampler the same script: the
completion ids, the tool mask, every reward source, the advantages and the loss of the update must equal
TRL's within 1e-6 (fp32), on the Qwen2.5 (Hermes) and the Llama-3.1 templates, with plain tools and with an
environment owning the reward. marl's rows are k-major (row ``j * P + i``), TRL's prompt-major.
"""

from __future__ import annotations

import pytest

from support.tool_agents import (
    ENVIRONMENT_TOOLS,
    MAX_COMPLETION_LENGTH,
    TASKS,
    TEMPLATES,
    TOOL_TEMPLATES,
    TOOLS,
    Calculator,
    K,
    examples,
    save_tool_model,
    trl_tool_run,
)

trl = pytest.importorskip("trl")
if trl.__version__ != "1.16.0":  # the parity is pinned to the version "Coming from TRL" names
    pytest.skip(f"parity pinned to TRL 1.16.0, found {trl.__version__}", allow_module_level=True)

TOLERANCE = 1e-6
SETUPS = {
    "tools": dict(tools=TOOLS),
    "environment": dict(tools=ENVIRONMENT_TOOLS, environment_factory=Calculator),
}
# The assistant turns of each task's two rows (TRL's prompt-major order: sample 0, then sample 1); on Qwen's
# template the second row of "add-twice" makes both calls in one turn.
TURNS = {
    "answer": (1, 1),
    "add": (2, 2),
    "add-twice": (3, 3),
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

    def run(template: str, setup: str) -> dict:
        if (template, setup) not in made:
            output = tmp_path_factory.mktemp(f"trl-{template}-{setup}")
            made[template, setup] = trl_tool_run(
                model_dirs[template], examples(), output_dir=output, **SETUPS[setup]
            )
        return made[template, setup]

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
        if template == "qwen2" and task == "add-twice" and sample == 1:
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
    # calls: add 1 + 1, add-twice 2 + 2, fail 1 + 1, long 1 + 1 (the echo call that did not fit counts too)
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
    assert run["metrics"]["rewards/Calculator/std"] > 0
