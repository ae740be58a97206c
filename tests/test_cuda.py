"""The GPU path: what CPU runs cannot show. Marked ``cuda``; skipped where torch sees no CUDA device.

``bash scripts/gpu-check.sh`` runs these with the slow tests and the benchmark's GPU setup, and writes a dated
results file. On CUDA the dtypes users run are bf16 and fp16 (mixed precision); each test states what it
checks in them:

- a short 4-bit and 8-bit training run keeps prefix packing on and trains (no skipped step, finite metrics);
- an fp16 run killed after a checkpoint and resumed ends with the same adapter and the same metrics as an
  uninterrupted one (the loss scaler's state travels with the checkpoint);
- the family table's exactness tests run on CUDA in bf16 and fp16 (``tests/test_families.py``, parametrized
  over devices).
"""

from __future__ import annotations

import pytest
import torch
from kill_resume import Kill, command, make_world, metrics_without_eps, run_cli
from test_trainer import build, tiny_config

pytestmark = [pytest.mark.cuda, pytest.mark.slow]


@pytest.mark.parametrize("quantization", ["4bit", "8bit"])
def test_short_quantized_bf16_run_on_cuda_keeps_packing_on_and_trains(tiny_llama_dir, tmp_path, quantization):
    config = tiny_config(tmp_path / "run", quantization=quantization, bf16=True, total_episodes=32)
    trainer = build(tiny_llama_dir, config)
    assert trainer.model.device.type == "cuda"
    assert trainer.sampler.share_prompt_prefix, "prefix packing switched itself off on CUDA in bf16"
    before = [parameter.detach().clone() for parameter in trainer.policy_parameters]
    history = trainer.train()
    assert trainer.state.skipped_optimizer_steps == 0
    assert all(torch.isfinite(torch.tensor(record["objective/rlhf_reward"])) for record in history)
    assert history[0]["val/ratio_first"] == pytest.approx(1.0, abs=1e-2)
    moved = max(
        float((p.detach() - b).abs().max()) for p, b in zip(trainer.policy_parameters, before, strict=True)
    )
    assert moved > 0


def test_fp16_run_killed_after_a_checkpoint_resumes_to_the_uninterrupted_result(tmp_path):
    world = make_world(tmp_path / "world")
    fp16 = ["--fp16", "true"]
    reference = tmp_path / "uninterrupted"
    finished = run_cli(world, [*command(world, reference), *fp16])
    assert finished.returncode == 0, finished.stderr[-3000:]

    killed = tmp_path / "killed"
    # killed as checkpoint 3 starts to be written: checkpoints 1 and 2 hold the scaler's state
    first = run_cli(world, [*command(world, killed), *fp16], Kill(needle=".checkpoint-3.tmp"))
    assert first.returncode != 0
    resumed = run_cli(world, [*command(world, killed), *fp16, "--resume_from_checkpoint", "latest"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]

    assert metrics_without_eps(killed) == metrics_without_eps(reference)
    adapter = "adapter_model.safetensors"
    assert (killed / adapter).read_bytes() == (reference / adapter).read_bytes()
