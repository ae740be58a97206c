"""Two CPU processes (gloo) train one policy: prompts are sharded, metrics gathered, weights stay in sync."""

from __future__ import annotations

import json
import os
import textwrap

import pytest

from support.processes import run_two_processes

SCRIPT = textwrap.dedent(
    """
    import json, os, sys
    import datasets, torch
    from transformers import AutoTokenizer
    from marl import MultiAdapterModel, RLOOConfig, RLOOTrainer
    from marl.train import parallel

    torch.set_num_threads(1)
    model_dir, output_dir = sys.argv[1], sys.argv[2]
    rank = int(os.environ["RANK"])
    seen, lengths = [], []

    def reward_fn(prompts, completions, completion_ids, log_metric, **kwargs):
        # an offset per process: the gathered mean of the scores shows whether both processes were counted
        seen.extend(prompts)
        lengths.append([len(ids) for ids in completion_ids])  # this process's completions of the update
        log_metric("rank", float(rank))  # logged as the mean over both processes, as TRL averages it
        if rank == 1:
            log_metric("rank_1_only", 7.0)  # a name one process logs: the other must not wait for it
        return [completion.count("e") + 100.0 * rank for completion in completions]

    config = RLOOConfig(
        output_dir=output_dir, model_name_or_path=model_dir, rloo_k=2, per_device_train_batch_size=4,
        gradient_accumulation_steps=2, num_ppo_epochs=2, total_episodes=32, learning_rate=1e-2,
        response_length=6, lora_r=4, lora_alpha=8, stop_token="eos", num_sample_generations=0, seed=0,
    )
    torch.manual_seed(rank)  # different initialisations: the trainer must start all processes from rank 0's
    model = MultiAdapterModel.from_config(config)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = datasets.Dataset.from_dict({"prompt": [f"prompt number {i}" for i in range(16)]})
    trainer = RLOOTrainer(config, model, tokenizer, prompts, reward_funcs=reward_fn)
    trainer.train()
    weights = torch.cat([parallel.full(p).detach().flatten() for p in model.policy_parameters()])
    report = {"rank": rank, "world": trainer.parts.parallelism.num_processes, "prompts": sorted(set(seen)),
              "weights": weights.tolist(), "episode": trainer.episode, "lengths": lengths}
    with open(os.path.join(output_dir, f"report_{rank}.json"), "w") as handle:
        json.dump(report, handle)
    """
)


@pytest.mark.slow
def test_two_process_cpu_run(tiny_llama_dir, tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    output_dir = tmp_path / "run"
    run_two_processes(str(script), str(tiny_llama_dir), str(output_dir))

    reports = [json.loads((output_dir / f"report_{rank}.json").read_text()) for rank in (0, 1)]
    assert all(report["world"] == 2 for report in reports)
    # each process sampled its own prompts; together they cover the 16 prompts (2 updates × 8)
    assert set(reports[0]["prompts"]).isdisjoint(reports[1]["prompts"])
    assert len(reports[0]["prompts"]) + len(reports[1]["prompts"]) == 16
    # gradients are averaged: both processes end with the same policy
    assert reports[0]["weights"] == reports[1]["weights"]

    records = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]
    assert [record["update"] for record in records] == [1, 2]  # written once, by the main process
    assert [record["episode"] for record in records] == [16, 32]  # 8 completions per process per update
    for record in records:
        # process 0 scores lie in [0, 6], process 1 in [100, 106]: a mean near 50 counts both
        assert 45 < record["objective/scores"] < 60
        assert 0 <= record["val/num_eos_tokens"] <= 16
        assert record["rank"] == 0.5 and record["rank_1_only"] == 7.0  # what reward functions logged
        # TRL's names over both processes: the reward's spread spans the offset, lengths are every process's
        assert record["reward_std"] > 40
        both = reports[0]["lengths"][record["update"] - 1] + reports[1]["lengths"][record["update"] - 1]
        assert record["completions/min_length"] == min(both) and record["completions/max_length"] == max(both)
        assert record["completions/mean_length"] == pytest.approx(sum(both) / len(both))
    assert (output_dir / "adapter_model.safetensors").is_file()


@pytest.mark.slow
def test_train_rloo_script_under_torchrun_uses_both_processes(tiny_llama_dir, tmp_path):
    # The script creates its accelerate state before loading the model; on a machine without a GPU that state
    # must be a CPU process group, or the second process would be dropped (and the trainer refuses the run).
    reward_file = tmp_path / "reward.py"
    reward_file.write_text(
        "def count_e(prompts, completions):\n    return [c.count('e') for c in completions]\n"
    )
    prompts_file = tmp_path / "prompts.jsonl"
    prompts_file.write_text("".join(json.dumps({"prompt": f"prompt number {i}"}) + "\n" for i in range(8)))
    output_dir = tmp_path / "run"
    script = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "train_rloo_adapter.py")
    run_two_processes(
        script, "--model_name_or_path", str(tiny_llama_dir), "--reward_fn", f"{reward_file}:count_e",
        "--dataset_name", str(prompts_file), "--rloo_k", "2", "--per_device_train_batch_size", "4",
        "--num_ppo_epochs", "1", "--total_episodes", "16", "--response_length", "6",
        "--output_dir", str(output_dir),
    )  # fmt: skip
    records = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]
    # 2 processes × 4 completions per update: the episode count grows by 8, and 16 episodes take 2 updates
    assert [record["episode"] for record in records] == [8.0, 16.0]


NORMALISATION_SCRIPT = textwrap.dedent(
    """
    import json, math, os, sys
    import datasets, torch
    from transformers import AutoTokenizer
    from marl import MultiAdapterModel, RLOOConfig, RLOOTrainer
    from marl.algo.losses import clipped_policy_loss
    from marl.algo.shaping import shape_rewards
    from marl.algo.tensors import masked_sum
    from marl.train import parallel
    from marl.rollout.completions import Rollout, Samples

    torch.set_num_threads(1)
    model_dir, output_dir = sys.argv[1], sys.argv[2]
    rank = int(os.environ["RANK"])
    config = RLOOConfig(output_dir=output_dir, model_name_or_path=model_dir, rloo_k=2, lora_r=4, lora_alpha=8,
                        per_device_train_batch_size=4, total_episodes=8, num_sample_generations=0)
    model = MultiAdapterModel.from_config(config)
    with torch.no_grad():  # a policy away from the reference, the same on both processes
        for parameter in model.policy_parameters():
            values = torch.sin(torch.arange(parameter.numel(), dtype=torch.float32))
            parameter.copy_(values.view_as(parameter))
    prompts = datasets.Dataset.from_dict({"prompt": ["a", "b"]})
    trainer = RLOOTrainer(config, model, AutoTokenizer.from_pretrained(model_dir), prompts,
                          reward_funcs=lambda p, c: [0.0] * len(c))

    # One rollout of 4 prompts x k=2, k-major (row j * 4 + prompt); process r holds prompts 2r and 2r + 1.
    # Process 1's scores are far higher, and one of its completions is not judged.
    prompt_ids = torch.tensor([[5, 6], [7, 8], [9, 10], [11, 12]]).repeat(2, 1)
    response_ids = torch.arange(8 * 3).view(8, 3) % 29 + 1
    scores = torch.tensor([0.1, 0.7, 5.0, 9.0, 0.4, 0.2, math.nan, 6.5])
    samples = Samples(
        prompt_texts=["p"] * 8, prompt_messages=[None] * 8, completions=["c"] * 8,
        prompt_ids=prompt_ids, prompt_mask=torch.ones_like(prompt_ids),
        response_ids=response_ids, response_mask=torch.ones(8, 3, dtype=torch.bool),
        contains_stop=torch.ones(8, dtype=torch.bool), contains_eos=torch.ones(8, dtype=torch.bool),
        prompt_index=torch.arange(4).repeat(2),
    )
    logprobs, ref_logprobs = trainer.parts.scorer.logprobs(samples)
    whole = Rollout(**vars(samples), logprobs=logprobs, ref_logprobs=ref_logprobs, scores=scores,
                    source_scores=scores[:, None])
    local_rows = torch.tensor([2 * rank, 2 * rank + 1, 4 + 2 * rank, 4 + 2 * rank + 1])
    local = whole.select(local_rows)
    local.prompt_index = torch.arange(2).repeat(2)

    def gradient(rollout, advantages):
        trainer.parts.policy_update.optimizer.zero_grad(set_to_none=True)
        with model.policy():
            new_logprobs = trainer.parts.scorer.completion_logprobs(rollout, None)
        new = masked_sum(new_logprobs, rollout.response_mask)
        # the gradients are averaged over processes in the backward pass
        trainer.parts.parallelism.backward(clipped_policy_loss(new, new.detach(), advantages, 0.2).loss)
        return [parallel.full(parameter.grad) for parameter in trainer.parts.policy_update.parameters]

    def flat(gradients):
        return torch.cat([g.flatten() for g in gradients])

    model.train()
    report = {}
    for flag in ("normalize_reward", "normalize_advantage"):
        config.normalize_reward = flag == "normalize_reward"
        config.normalize_advantage = flag == "normalize_advantage"
        one_process = shape_rewards(  # what one process computes on the whole rollout
            whole.scores, whole.logprobs, whole.ref_logprobs, whole.response_mask, whole.contains_stop,
            k=2, kl_coef=config.kl_coef, normalize_reward=config.normalize_reward,
            normalize_advantage=config.normalize_advantage,
        )
        # both processes compute the whole rollout: the average of the two equal gradients is the whole's
        concatenated = flat(gradient(whole, one_process.advantages)).clone()
        two_processes = trainer.shaped_rewards(local)
        averaged = flat(gradient(local, two_processes.advantages))
        advantage_difference = two_processes.advantages - one_process.advantages[local_rows]
        report[flag] = {
            "advantage_difference": float(advantage_difference.abs().max()),
            "relative_gradient_difference": float((averaged - concatenated).norm() / concatenated.norm()),
            "gradient_norm": float(concatenated.norm()),
        }
    with open(os.path.join(output_dir, f"normalisation_{rank}.json"), "w") as handle:
        json.dump(report, handle)
    """
)


@pytest.mark.slow
def test_normalisation_over_two_processes_equals_one_process_on_the_concatenated_rollout(
    tiny_llama_dir, tmp_path
):
    """normalize_reward / normalize_advantage standardise with the statistics of every process: 2 processes
    give the advantages and the averaged gradient of 1 process on the concatenated rollout (also with a
    completion no source judged)."""
    script = tmp_path / "normalisation.py"
    script.write_text(NORMALISATION_SCRIPT)
    output_dir = tmp_path / "run"
    output_dir.mkdir()
    run_two_processes(str(script), str(tiny_llama_dir), str(output_dir))
    for rank in (0, 1):
        report = json.loads((output_dir / f"normalisation_{rank}.json").read_text())
        for flag in ("normalize_reward", "normalize_advantage"):
            assert report[flag]["gradient_norm"] > 1e-3
            # float32 rounding only: the statistics sum the same values in another order (1e-7 in an
            # advantage, 1e-4 in the gradient). Per-process statistics, on this rollout with the unjudged
            # score set to 3.0, gave relative gradient differences of 12.6 (normalize_reward) and 2.3
            # (normalize_advantage).
            assert report[flag]["advantage_difference"] <= 1e-5, (rank, flag, report[flag])
            assert report[flag]["relative_gradient_difference"] <= 1e-3, (rank, flag, report[flag])
