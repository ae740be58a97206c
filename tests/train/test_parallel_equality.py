"""Two CPU processes (gloo, torchrun) against one process on the concatenated batch, for each parallelism:
the policy and reference log-probs and the reward adapter's scores of each process's rows, the first step's
gradient and the policy adapter after 2 updates are the same (fp32), and under ``fsdp2`` each process holds
half of the base's parameter bytes, measured on its local shards (driver: tests/support/parallel_run.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from support.processes import run_processes

DRIVER = str(Path(__file__).resolve().parents[1] / "support" / "parallel_run.py")
# Measured on the tiny Llama: log-probs, scores and gradients agreed to 0.0 / 6e-8; the adapter after two
# AdamW steps (lr 1e-2) to 1.6e-6 in weights of up to 0.12 (the gradients are reduced in another order).
EXACT_TOLERANCE = 1e-5
GRADIENT_TOLERANCE = 1e-6
ADAPTER_TOLERANCE = 1e-5
# bf16 autocast against fp32, measured under fsdp2 on the tiny Llama: log-probs and scores within 4.9e-3, the
# first gradient within 7.5e-3 of its norm, the adapter after two AdamW steps within 1.3e-2 of its norm (AdamW
# steps each weight by about lr whatever its gradient's size, so a gradient near 0 rounded to the other sign
# moves a weight by 2 lr: 42 of 8192 weights did).
BF16_TOLERANCE = 1e-2
BF16_RELATIVE_TOLERANCE = 5e-2


def run(
    model_dir: Path, reward_dir: Path, parallelism: str, output_dir: Path, processes: int, options: str = ""
) -> list[dict]:
    output_dir.mkdir(parents=True)
    arguments = [str(model_dir), str(reward_dir), str(output_dir), parallelism, options]
    run_processes(DRIVER, *arguments, processes=processes)
    return [json.loads((output_dir / f"report_{rank}.json").read_text()) for rank in range(processes)]


def difference(report: dict, expected: dict, key: str) -> torch.Tensor:
    """``report[key]`` less ``expected[key]`` (on the report's rows for per-row values)."""
    rows = report["rows"] if key in ("logprobs", "ref_logprobs", "scores") else slice(None)
    return torch.tensor(report[key]) - torch.tensor(expected[key])[rows]


@pytest.fixture(scope="module")
def one_process(tiny_llama_dir, tiny_reward_adapter, tmp_path_factory) -> dict:
    output = tmp_path_factory.mktemp("one") / "run"
    return run(tiny_llama_dir, tiny_reward_adapter, "replicated", output, processes=1)[0]


@pytest.mark.slow
@pytest.mark.parametrize("parallelism", ["replicated", "fsdp2"])
def test_two_processes_equal_one_process_on_the_concatenated_batch(
    parallelism, one_process, tiny_llama_dir, tiny_reward_adapter, tmp_path
):
    reports = run(tiny_llama_dir, tiny_reward_adapter, parallelism, tmp_path / "run", processes=2)
    assert one_process["world"] == 1 and all(report["world"] == 2 for report in reports)
    assert sorted(reports[0]["rows"] + reports[1]["rows"]) == list(range(8))
    for report in reports:
        rows = report["rows"]
        for key in ("logprobs", "ref_logprobs", "scores"):
            expected = torch.tensor(one_process[key])[rows]
            assert torch.allclose(torch.tensor(report[key]), expected, rtol=0, atol=EXACT_TOLERANCE), key
        gradient, expected = torch.tensor(report["gradient"]), torch.tensor(one_process["gradient"])
        assert expected.norm() > 1e-2
        assert (gradient - expected).abs().max() <= GRADIENT_TOLERANCE
        adapter, expected = torch.tensor(report["adapter"]), torch.tensor(one_process["adapter"])
        # process 1 started from another policy: equality means process 0's was broadcast
        assert (adapter - expected).abs().max() <= ADAPTER_TOLERANCE
        held = report["bytes_held"] / one_process["bytes_held"]
        if parallelism == "fsdp2":
            # measured: 0.5 exactly on the tiny Llama (every sharded dimension is even)
            assert 0.45 <= held <= 0.55, report["bytes_held"]
        else:
            assert held == 1.0


@pytest.mark.slow
def test_bf16_mixed_precision_under_fsdp2_is_within_its_tolerance_of_fp32(
    one_process, tiny_llama_dir, tiny_reward_adapter, tmp_path
):
    reports = run(tiny_llama_dir, tiny_reward_adapter, "fsdp2", tmp_path / "run", processes=2, options="bf16")
    for report in reports:
        assert report["mixed_precision"] == "bf16" and report["world"] == 2
        for key in ("logprobs", "ref_logprobs", "scores"):
            gap = difference(report, one_process, key).abs().max()
            assert 0 < gap <= BF16_TOLERANCE, (key, gap)  # computed in bf16, close to fp32
        for key in ("gradient", "adapter"):
            relative = difference(report, one_process, key).norm() / torch.tensor(one_process[key]).norm()
            assert relative <= BF16_RELATIVE_TOLERANCE, (key, relative)
        assert 0.45 <= report["bytes_held"] / report["bytes_before"] <= 0.55


@pytest.fixture(scope="module")
def tied_model(tmp_path_factory) -> tuple[Path, Path]:
    from support.tiny import save_reward_adapter, save_tiny_model

    root = tmp_path_factory.mktemp("tied")
    model_dir = save_tiny_model(root / "model", tie_word_embeddings=True)
    return model_dir, save_reward_adapter(model_dir, root / "reward")


@pytest.mark.slow
def test_tied_embeddings_and_gradient_checkpointing_under_fsdp2_equal_one_process(tied_model, tmp_path):
    """A base whose LM head is its input embeddings, with gradient checkpointing in the sharded run only:
    the same log-probs, scores, gradient and adapter as one process without checkpointing. The tied tensor
    stays whole and tied on every process (FSDP2 would gather the backbone's shard of it only inside the
    backbone's forward, and the head runs after it); everything else is halved."""
    model_dir, reward_dir = tied_model
    expected = run(model_dir, reward_dir, "replicated", tmp_path / "one", processes=1)[0]
    reports = run(model_dir, reward_dir, "fsdp2", tmp_path / "run", processes=2, options="checkpointing")
    assert expected["tied"] and not expected["gradient_checkpointing"]
    for report in reports:
        assert report["tied"] and report["gradient_checkpointing"] and report["world"] == 2
        for key in ("logprobs", "ref_logprobs", "scores"):
            assert difference(report, expected, key).abs().max() <= EXACT_TOLERANCE, key
        assert difference(report, expected, "gradient").abs().max() <= GRADIENT_TOLERANCE
        assert difference(report, expected, "adapter").abs().max() <= ADAPTER_TOLERANCE
        assert 0.5 < report["bytes_held"] / expected["bytes_held"] < 0.75  # the embeddings stay whole


@pytest.mark.slow
def test_a_4bit_base_sharded_over_two_processes_equals_one_process(
    tiny_llama_dir, tiny_reward_adapter, tmp_path
):
    """FSDP-QLoRA on CPU: the 4-bit weights, packed in float32 (the compute dtype), are sharded by FSDP2; the
    same log-probs, scores, gradient and adapter as one process with the same 4-bit base, and each process
    holds half of the packed weights (the quantization constants, kept on each layer, stay whole, and the
    memory card counts them)."""
    expected = run(tiny_llama_dir, tiny_reward_adapter, "replicated", tmp_path / "one", 1, "4bit")[0]
    reports = run(tiny_llama_dir, tiny_reward_adapter, "fsdp2", tmp_path / "run", processes=2, options="4bit")
    assert expected["constant_bytes"] > 0  # a 4-bit base
    for report in reports:
        for key in ("logprobs", "ref_logprobs", "scores"):
            assert difference(report, expected, key).abs().max() <= EXACT_TOLERANCE, key
        assert difference(report, expected, "gradient").abs().max() <= GRADIENT_TOLERANCE
        assert difference(report, expected, "adapter").abs().max() <= ADAPTER_TOLERANCE
        assert report["constant_bytes"] == expected["constant_bytes"]
        whole = expected["bytes_held"] - expected["constant_bytes"]  # the packed weights and the rest
        held = report["bytes_held"] - report["constant_bytes"]  # what the memory card counts, less them
        assert 0.45 <= held / whole <= 0.55, (held, whole)
