"""A sharded run (``--parallelism fsdp2``, 2 CPU processes) killed after its second checkpoint (of 4)
resumes to the adapter and the metrics of the run that was never stopped."""

from __future__ import annotations

import json
import textwrap

import pytest

from marl.train.memory_guard import is_measurement

from support.processes import run_two_processes

SCRIPT = textwrap.dedent(
    """
    import os, sys
    import datasets, torch
    from transformers import AutoTokenizer
    from marl import MultiAdapterModel, RLOOConfig, RLOOTrainer

    torch.set_num_threads(1)
    model_dir, output_dir, stop_after, resume = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4] == "1"
    config = RLOOConfig(
        output_dir=output_dir, model_name_or_path=model_dir, rloo_k=2, per_device_train_batch_size=4,
        num_ppo_epochs=2, num_mini_batches=2, total_episodes=64, learning_rate=1e-2, response_length=6,
        lora_r=4, lora_alpha=8, num_sample_generations=0, save_steps=1, seed=0, parallelism="fsdp2",
    )

    def die_after(state, metrics):
        # the update after `stop_after` is done, its checkpoint not yet written: as a kill there
        if stop_after and state.update == stop_after + 1:
            os._exit(3)

    model = MultiAdapterModel.from_config(config)
    prompts = datasets.Dataset.from_dict({"prompt": [f"prompt number {i}" for i in range(16)]})
    trainer = RLOOTrainer(config, model, AutoTokenizer.from_pretrained(model_dir), prompts,
                          reward_funcs=lambda p, c: [c_.count("e") for c_ in c], callbacks=[die_after])
    trainer.train(resume_from_checkpoint=True if resume else None)
    """
)


def metrics(folder):
    records = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    return [{key: value for key, value in record.items() if not is_measurement(key)} for record in records]


@pytest.mark.slow
def test_a_killed_sharded_run_resumes_to_the_uninterrupted_adapter(tiny_llama_dir, tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    run_two_processes(str(script), str(tiny_llama_dir), str(whole), "0", "0")
    with pytest.raises(AssertionError):  # process exits 3 after the 2nd checkpoint
        run_two_processes(str(script), str(tiny_llama_dir), str(killed), "2", "0")
    assert sorted(p.name for p in killed.glob("checkpoint-*")) == ["checkpoint-1", "checkpoint-2"]
    checkpoint = killed / "checkpoint-2"
    # the adapter is one PEFT folder; the optimizer's shards and the RNG states are one file per process
    assert (checkpoint / "adapter_model.safetensors").is_file() and (
        checkpoint / "adapter_config.json"
    ).is_file()
    assert {p.name for p in checkpoint.glob("optimizer*.pt")} == {"optimizer_0.pt", "optimizer_1.pt"}
    assert {p.name for p in checkpoint.glob("rng_state_*.pt")} == {"rng_state_0.pt", "rng_state_1.pt"}
    run_two_processes(str(script), str(tiny_llama_dir), str(killed), "0", "1")

    adapter = "adapter_model.safetensors"
    assert (killed / adapter).read_bytes() == (whole / adapter).read_bytes()
    assert metrics(killed) == metrics(whole)
