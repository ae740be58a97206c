"""Several policies trained at once on one base (``SweepTrainer``, ``marl train-rloo --sweep``): a sweep of
one policy is its own run bit for bit; in a sweep's update each policy's loss and gradients are its solo
run's, bit for bit (fp32 and bf16); an adapter learns only from its own rows; a resumed sweep ends with the
uninterrupted sweep's adapters; the command runs a grid and refuses what cannot differ."""

from __future__ import annotations

import copy
import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch
from peft import LoraConfig
from safetensors.torch import load_file
from transformers import AutoTokenizer

from marl import MultiAdapterModel
from marl.algo.metrics import TRL_ROLLOUT_METRICS, UpdateStats
from marl.apps.cli import parse_train_rloo_args, train_rloo_main
from marl.config.sweep import parse_sweep
from marl.errors import ConfigError
from marl.rollout.scoring import Scorer
from marl.train.curves import CURVES_FILE, SUMMARY_FILE
from marl.train.memory_guard import is_measurement
from marl.train.sweep_trainer import SweepTrainer, build_sweep_model
from marl.train.trainer import RLOOTrainer, update_policies
from marl.train.training_parts import UpdatePart

from support.backward_stack import frames_below, record_backward_stacks
from support.families import FAMILIES, FAMILY_SPECS, logprob_tolerance
from support.runs import PROMPTS, build, count_e, prompt_dataset, tiny_config

ADAPTER = "adapter_model.safetensors"


def read_metrics(folder: Path) -> list[dict]:
    records = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    return [{key: value for key, value in record.items() if not is_measurement(key)} for record in records]


def sweep(model_dir: Path, specs: list[str], output_dir: Path, **settings) -> SweepTrainer:
    config = tiny_config(output_dir, model_name_or_path=str(model_dir), **settings)
    members = parse_sweep(specs, config)
    model = build_sweep_model([member.config for member in members])
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return SweepTrainer(members, model, tokenizer, prompt_dataset(), reward_funcs=count_e)


def test_a_sweep_of_one_policy_is_its_own_run_bit_for_bit(tiny_llama_dir, tmp_path):
    """The rloo preset (policy and reference passes, 2 epochs × 2 mini-batches × 2 accumulation steps): the
    sweep's loop, decode, scoring and update with one policy are the single run's."""
    build(tiny_llama_dir, tiny_config(tmp_path / "solo")).train()
    trainer = sweep(tiny_llama_dir, ["learning_rate=1e-2"], tmp_path / "sweep")
    trainer.train()
    member = tmp_path / "sweep" / "learning_rate=1e-2"
    solo, swept = read_metrics(tmp_path / "solo"), read_metrics(member)
    assert len(solo) == 3 and swept == solo
    assert set(TRL_ROLLOUT_METRICS) | {"entropy"} <= set(swept[0])  # TRL's names in the member's record too
    assert (member / ADAPTER).read_bytes() == (tmp_path / "solo" / ADAPTER).read_bytes()
    assert (tmp_path / "sweep" / SUMMARY_FILE).is_file() and (tmp_path / "sweep" / CURVES_FILE).is_file()


def test_a_sweeps_policy_loss_backward_is_at_most_five_marl_frames_below_its_train(
    tiny_llama_dir, tmp_path, monkeypatch
):
    """A sweep runs the trainer's loop: from ``SweepTrainer.train`` to each policy's backward (the
    parallelism's included) as many marl frames as from ``RLOOTrainer.train`` in a run."""
    stacks = record_backward_stacks(monkeypatch)
    sweep(tiny_llama_dir, ["learning_rate=1e-2,2e-2"], tmp_path / "sweep", total_episodes=16).train()
    assert len(stacks) == 2 * 8  # two policies, 2 epochs x 2 mini-batches x 2 micro-batches each
    for stack in stacks:
        frames = frames_below(stack, "marl/train/sweep_trainer.py:train")
        assert len(frames) <= 5 and frames[-1] == "marl/train/parallel.py:backward", frames
        assert "marl/train/trainer.py:train_policies" in frames  # the trainer's own loop


def test_a_member_of_a_sweep_of_two_is_not_its_solo_run_one_random_stream(tiny_llama_dir, tmp_path):
    """What the claim "each policy gets exactly its solo gradients" does not say: the update of the same rows
    is the solo run's (the tests below), but the rows are not: both policies' tokens are drawn from one random
    stream, so a member of a sweep of two samples other completions than its own run would (by design: the
    Sweeps guide's "Randomness")."""
    build(tiny_llama_dir, tiny_config(tmp_path / "solo", learning_rate=2e-2)).train()
    sweep(tiny_llama_dir, ["learning_rate=1e-2,2e-2"], tmp_path / "sweep").train()
    solo, swept = read_metrics(tmp_path / "solo"), read_metrics(tmp_path / "sweep" / "learning_rate=2e-2")
    assert len(solo) == len(swept) == 3
    # other completions from the first update on
    assert swept[0]["objective/scores"] != solo[0]["objective/scores"]


def test_a_sweeps_memory_card_counts_every_policys_training_state(tiny_llama_dir, tmp_path):
    """Three policies: the card's training state is the three optimizers' (each policy's own card's, summed),
    and its predicted peaks are those of the sweep planned with its three policies, not one run's."""
    from marl.apps.train_rloo import memory_card_with_plan
    from marl.plan.planner import plan_for_trainer

    trainer = sweep(tiny_llama_dir, ["learning_rate=1e-2,2e-2,3e-2"], tmp_path / "sweep")
    card = memory_card_with_plan(trainer)
    alone = [trainer.model.memory_report(run.parts.policy) for run in trainer.trainers]
    assert card.optimizer_state_bytes == sum(report.optimizer_state_bytes for report in alone)
    assert card.trainable_parameters == 3 * alone[0].trainable_parameters
    assert "3 policies" in str(card)
    swept, one = plan_for_trainer(trainer.trainers[0], policies=3), plan_for_trainer(trainer.trainers[0])
    assert card.predicted_peaks == {phase.name: phase.total for phase in swept.phases if phase.name != "load"}
    assert card.predicted_peaks["update"] > one.phases[-1].total


def test_an_adapter_learns_only_from_its_own_rows(tiny_llama_dir, tmp_path):
    """The second policy weighs the reward by 0 and has no KL: its rows' advantages and loss gradients are 0,
    so AdamW leaves its adapter exactly as it started; the first policy's rows (in the same decode, scoring
    passes and update loop) train the first adapter. A gradient routed to the wrong adapter would move it."""
    trainer = sweep(tiny_llama_dir, ["reward_weights=1,0"], tmp_path, kl_coef=0.0)
    start = {
        member.config.policy_adapter_name: [p.detach().clone() for p in trainer.model.policy_parameters(name)]
        for member, name in zip(trainer.members, [t.parts.policy for t in trainer.trainers], strict=True)
    }
    trainer.train()
    learning, idle = (trainer.trainers[0].parts.policy, trainer.trainers[1].parts.policy)
    assert any(
        not torch.equal(before, after)
        for before, after in zip(start[learning], trainer.model.policy_parameters(learning), strict=True)
    )
    for before, after in zip(start[idle], trainer.model.policy_parameters(idle), strict=True):
        assert torch.equal(before, after)
    idle_metrics = read_metrics(tmp_path / "reward_weights=0")
    assert all(record["objective/scores"] == 0.0 for record in idle_metrics)
    assert read_metrics(tmp_path / "reward_weights=1")[0]["objective/scores"] > 0


def family_lora(family: str) -> LoraConfig:
    exclude = list(FAMILY_SPECS[family].lora_exclude_modules) or None
    return LoraConfig(
        r=4, lora_alpha=8, target_modules="all-linear", exclude_modules=exclude, task_type="CAUSAL_LM"
    )


def gradients(model: MultiAdapterModel, policies: list[str]) -> dict[str, list[torch.Tensor]]:
    return {
        name: [
            p.grad.clone() if p.grad is not None else torch.zeros_like(p)
            for p in model.policy_parameters(name)
        ]
        for name in policies
    }


STAT_FIELDS = [field.name for field in dataclasses.fields(UpdateStats) if field.compare]


def solo_model(
    directory: Path, family: str, name: str, weights: list[torch.Tensor], dtype
) -> MultiAdapterModel:
    """A base holding policy ``name`` alone (a single run's model), with ``weights`` as its adapter."""
    model = MultiAdapterModel.from_pretrained(
        directory, policy_name=name, policy_adapter=family_lora(family), dtype=dtype
    )
    with torch.no_grad():
        for parameter, weight in zip(model.policy_parameters(name), weights, strict=True):
            parameter.copy_(weight)
    return model


def update_parts(trainers, rollouts, policies: list[int]) -> list[UpdatePart]:
    """Each policy's share of the update: its own copy of its rollout, advantages drawn per policy."""
    made = []
    for index, trainer, rollout in zip(policies, trainers, rollouts, strict=True):
        generator = torch.Generator().manual_seed(index)
        advantages = torch.randn(rollout.response_ids.shape[0], generator=generator)
        made.append(UpdatePart(trainer.parts.policy_update, copy.deepcopy(rollout), advantages))
    return made


def accumulated(guard, model: MultiAdapterModel, parts: list[UpdatePart], minis: list[torch.Tensor]):
    """The gradients the update loop (:func:`update_policies`) accumulates over one mini-batch, each part's
    rows in the order ``minis`` gives, read at the optimizer step (which is not taken)."""
    grads = {}
    for part, rows in zip(parts, minis, strict=True):

        def keep(loss_finite: bool, policy: str = part.step.policy) -> bool:
            assert loss_finite
            grads.update(gradients(model, [policy]))
            return False

        part.step.shuffled_rows = lambda rollout, rows=rows: rows
        part.step.optimizer_step = keep
    update_policies(parts, guard, update=1)
    assert not model.peft_model.training and set(grads) == {part.step.policy for part in parts}
    return grads


def assert_sweep_update_is_each_policys_solo_update(directory: Path, tmp_path: Path, family: str, **settings):
    """One mini-batch of two policies (different adapters, different settings: the KL folded into the reward
    or in the loss, different clip ranges), two micro-batch steps of accumulation in the sweep's loop (policy
    0's micro-batch, policy 1's, policy 0's, policy 1's), against each policy's mini-batch on a base that
    holds that policy alone, as its own run: the same loss and metric sums and the same adapter gradients,
    bit for bit. Policy 0's gradient of its first micro-batch survives policy 1's view and backward pass."""
    dtype = torch.bfloat16 if settings.get("bf16") else None
    config = tiny_config(
        tmp_path,
        model_name_or_path=str(directory),
        num_ppo_epochs=1,
        num_mini_batches=1,
        gradient_accumulation_steps=2,
        total_episodes=8,
        **settings,
    )
    members = parse_sweep(["kl_placement=reward,loss", "cliprange=0.2,0.1"], config)[::3]  # 2 members
    policies = [member.config.policy_adapter_name for member in members]
    model = MultiAdapterModel.from_pretrained(
        directory, policy_name=policies[0], policy_adapter=family_lora(family), dtype=dtype
    )
    model.add_policy(policies[1], family_lora(family))
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():  # policies that differ from the base and from each other
        for parameter in model.policy_parameters(policies[0]) + model.policy_parameters(policies[1]):
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.2)
    weights = {name: [p.detach().clone() for p in model.policy_parameters(name)] for name in policies}
    tokenizer = AutoTokenizer.from_pretrained(directory)
    prompts = prompt_dataset(PROMPTS[:4])
    trainer = SweepTrainer(members, model, tokenizer, prompts, reward_funcs=count_e)
    torch.manual_seed(0)
    rollouts = trainer._rollouts()
    assert [rollout.response_ids.shape[0] for rollout in rollouts] == [8, 8]
    # whole prompt groups (k-major rows), in another order for each policy; two micro-batches of 4 rows
    minis = [torch.tensor([0, 4, 1, 5, 2, 6, 3, 7]), torch.tensor([3, 7, 0, 4, 2, 6, 1, 5])]

    swept = update_parts(trainer.trainers, rollouts, [0, 1])
    sweep_grads = accumulated(trainer.trainers[0].phases, model, swept, minis)
    for index, (member, name) in enumerate(zip(members, policies, strict=True)):
        alone = solo_model(directory, family, name, weights[name], dtype)
        run = RLOOTrainer(member.config, alone, tokenizer, prompts, reward_funcs=count_e)
        solo = update_parts([run], [rollouts[index]], [index])
        assert solo[0].advantages.equal(swept[index].advantages)
        solo_grads = accumulated(run.phases, alone, solo, [minis[index]])
        for field in STAT_FIELDS:
            assert torch.equal(
                torch.as_tensor(getattr(swept[index].stats, field)),
                torch.as_tensor(getattr(solo[0].stats, field)),
            ), field
        assert any(grad.abs().sum() > 0 for grad in solo_grads[name])
        for together, by_itself in zip(sweep_grads[name], solo_grads[name], strict=True):
            assert together.dtype == by_itself.dtype and torch.equal(together, by_itself)


# Every family with its prompts packed (what differs between families), and the llama control unshared.
JOINT_CASES = [(family, True) for family in FAMILIES] + [("llama", False)]


@pytest.mark.parametrize(
    ("family", "share_prompt_prefix"),
    JOINT_CASES,
    ids=[f"{family}-{'packed' if packed else 'unshared'}" for family, packed in JOINT_CASES],
)
def test_each_policys_loss_and_gradients_in_the_sweep_update_are_its_solo_runs(
    family_dir, tmp_path, family, share_prompt_prefix
):
    """fp32, every family: see :func:`assert_sweep_update_is_each_policys_solo_update`."""
    assert_sweep_update_is_each_policys_solo_update(
        family_dir(family), tmp_path, family, share_prompt_prefix=share_prompt_prefix
    )


@pytest.mark.parametrize("family", ["llama", "qwen2", "gpt2"])
def test_each_policys_bf16_loss_and_gradients_in_the_sweep_update_are_its_solo_runs(
    family_dir, tmp_path, family
):
    """bf16 weights and bf16 autocast (``--bf16``), prompts packed: bit for bit as in fp32 (each policy's
    micro-batch runs in its own view, as in its own run, whatever the dtype)."""
    assert_sweep_update_is_each_policys_solo_update(family_dir(family), tmp_path, family, bf16=True)


def test_the_sweep_update_gives_the_heap_back_after_each_policys_micro_batch(
    family_dir, tmp_path, monkeypatch
):
    """On CPU, after each policy's micro-batch of a sweep (2 policies x 2 micro-batch steps: 4 times), and
    never in a single run's update; the gradients stay each policy's solo ones."""
    released = []
    monkeypatch.setattr("marl.train.trainer.release_freed_memory", lambda: released.append(True))
    assert_sweep_update_is_each_policys_solo_update(family_dir("llama"), tmp_path, "llama")
    assert len(released) == 4  # the two solo updates of the check above released nothing


# Every family in fp32 with a reward function, three in bf16 (weights and autocast), and the tiny llama with a
# reward adapter (its LoRA and score head).
SHARED_PROMPT_CASES = (
    [(family, False, torch.float32) for family in FAMILIES]
    + [(family, False, torch.bfloat16) for family in ("llama", "qwen2", "gpt2")]
    + [("llama", True, torch.float32)]
)


@pytest.mark.parametrize(
    ("family", "reward_adapter", "dtype"),
    SHARED_PROMPT_CASES,
    ids=[
        family + ("-reward-adapter" if adapter else "") + ("-bf16" if dtype == torch.bfloat16 else "")
        for family, adapter, dtype in SHARED_PROMPT_CASES
    ],
)
def test_policies_on_the_same_prompts_compute_each_prompt_once_in_the_reference_and_reward_passes(
    family_dir, tiny_llama_dir, tiny_reward_adapter, tmp_path, monkeypatch, family, reward_adapter, dtype
):
    """A grid on one seed: every policy draws the same prompts, so the reference pass (the base) and the
    reward rows group each prompt's rows of EVERY policy (one prompt computed for all of them, where prompts
    are packed at all); the policy pass keeps its groups per policy. Against the same rollout scored policy
    by policy: the same completions and policy log-probs bit for bit, reference log-probs and scores to float
    rounding (bf16: the family table's log-prob tolerance)."""
    directory = tiny_llama_dir if reward_adapter else family_dir(family)
    settings = dict(reward_adapter=str(tiny_reward_adapter)) if reward_adapter else {}
    if dtype == torch.bfloat16:
        settings["bf16"] = True
    config = tiny_config(tmp_path, model_name_or_path=str(directory), **settings)
    members = parse_sweep(["learning_rate=1e-2,3e-2"], config)
    if reward_adapter:
        model = build_sweep_model([member.config for member in members])
    else:  # the family's own LoRA targets
        policies = [member.config.policy_adapter_name for member in members]
        model = MultiAdapterModel.from_pretrained(
            directory, policy_name=policies[0], policy_adapter=family_lora(family), dtype=dtype
        )
        model.add_policy(policies[1], family_lora(family))
    tokenizer = AutoTokenizer.from_pretrained(directory)
    reward_funcs = None if reward_adapter else count_e
    trainer = SweepTrainer(members, model, tokenizer, prompt_dataset(), reward_funcs=reward_funcs)
    groups_seen = []  # (what was scored, prompt groups)
    logprobs, scoring_batch = Scorer.logprobs, Scorer.scoring_batch

    def spied_logprobs(scorer, samples, passes=None, row_policies=None):
        name = "reference" if passes is not None and not passes.policy else "policy"
        groups_seen.append((name, int(samples.prompt_index.max()) + 1))
        return logprobs(scorer, samples, passes, row_policies)

    def spied_scoring_batch(scorer, samples, trainer_state=None):
        groups_seen.append(("reward", int(samples.prompt_index.max()) + 1))
        return scoring_batch(scorer, samples, trainer_state)

    monkeypatch.setattr(Scorer, "logprobs", spied_logprobs)
    monkeypatch.setattr(Scorer, "scoring_batch", spied_scoring_batch)
    torch.manual_seed(0)
    shared = trainer._rollouts()
    prompts_per_policy = int(shared[0].prompt_index.max()) + 1
    # both policies' rows of a prompt in one packed sequence: not where that passes a sliding window
    merged = [torch.cat([getattr(part, name) for part in shared]) for name in ("prompt_mask", "response_ids")]
    if trainer.trainers[0].parts.scorer.can_pack(*merged, torch.cat([part.prompt_index for part in shared])):
        assert sorted(groups_seen) == sorted(
            [
                ("policy", 2 * prompts_per_policy),
                ("reference", prompts_per_policy),
                ("reward", prompts_per_policy),
            ]
        )
    else:  # not packed together: nothing shared
        assert sorted(groups_seen) == [("policy", 2 * prompts_per_policy), ("reward", 2 * prompts_per_policy)]
    monkeypatch.setattr("marl.rollout.collect.shared_prompt_index", lambda samples, members: None)
    torch.manual_seed(0)
    alone = trainer._rollouts()
    for together, apart in zip(shared, alone, strict=True):
        assert torch.equal(together.response_ids, apart.response_ids)
        assert torch.equal(together.logprobs, apart.logprobs)
        if dtype == torch.bfloat16:
            tolerance = logprob_tolerance(dtype)
            torch.testing.assert_close(together.ref_logprobs, apart.ref_logprobs, rtol=0, atol=tolerance)
        else:
            torch.testing.assert_close(together.ref_logprobs, apart.ref_logprobs, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(together.source_scores, apart.source_scores, rtol=1e-5, atol=1e-5)


def test_a_resumed_sweep_ends_with_the_uninterrupted_sweeps_adapters(tiny_llama_dir, tmp_path):
    """Killed while checkpoint 4 was being written (the first policy's saved, the second's not) after update
    4 of 6: ``resume_from_checkpoint=True`` resumes EVERY policy from update 2, the latest both have, and the
    adapters and metrics end as in the uninterrupted sweep."""
    specs = ["learning_rate=1e-2,3e-2"]
    settings = dict(total_episodes=96, save_steps=2)
    sweep(tiny_llama_dir, specs, tmp_path / "full", **settings).train()
    shutil.copytree(tmp_path / "full", tmp_path / "killed")  # the same run, then cut short below
    first, second = (tmp_path / "killed" / name for name in ("learning_rate=1e-2", "learning_rate=3e-2"))
    for folder in (first, second):
        for name in (ADAPTER, "checkpoint-6"):
            path = folder / name
            if path.is_dir():
                for file in path.iterdir():
                    file.unlink()
                path.rmdir()
            else:
                path.unlink()
        records = (folder / "metrics.jsonl").read_text().splitlines()
        (folder / "metrics.jsonl").write_text("\n".join(records[:4]) + "\n")
    for file in (second / "checkpoint-4").iterdir():
        file.unlink()
    (second / "checkpoint-4").rmdir()

    resumed = sweep(tiny_llama_dir, specs, tmp_path / "killed", **settings)
    resumed.train(resume_from_checkpoint=True)
    for name in ("learning_rate=1e-2", "learning_rate=3e-2"):
        full, again = tmp_path / "full" / name, tmp_path / "killed" / name
        assert load_file(again / ADAPTER).keys() == load_file(full / ADAPTER).keys()
        assert (again / ADAPTER).read_bytes() == (full / ADAPTER).read_bytes()
        assert read_metrics(again) == read_metrics(full)


def write_command_files(tmp_path: Path) -> tuple[Path, Path]:
    rewards = tmp_path / "rewards.py"
    rewards.write_text(
        "def count_e(prompts, completions, **kwargs):\n"
        "    return [float(c.count('e')) for c in completions]\n"
    )
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": prompt}) + "\n" for prompt in PROMPTS))
    return rewards, prompts


def test_the_command_trains_a_grid_and_refuses_what_cannot_differ(tiny_llama_dir, tmp_path, capsys):
    rewards, prompts = write_command_files(tmp_path)
    words = [
        "--model_name_or_path", str(tiny_llama_dir), "--reward_fn", f"{rewards}:count_e",
        "--dataset_name", str(prompts), "--output_dir", str(tmp_path / "grid"), "--rloo_k", "2",
        "--per_device_train_batch_size", "4", "--response_length", "6", "--lora_r", "4",
        "--total_episodes", "8", "--num_sample_generations", "0", "--save_steps", "0",
    ]  # fmt: skip
    with pytest.raises(ConfigError, match=r"--sweep temperature: cannot differ .*Set --temperature once"):
        parse_train_rloo_args([*words, "--sweep", "temperature=0.7,1.0"])
    with pytest.raises(ConfigError, match=r"--sweep kl_coef is given twice"):
        parse_train_rloo_args([*words, "--sweep", "kl_coef=0.1,0.2", "--sweep", "kl_coef=0.3"])

    train_rloo_main([*words, "--sweep", "learning_rate=1e-3,1e-2", "--sweep", "kl_coef=0.05,0.1"])
    names = [f"learning_rate={lr},kl_coef={kl}" for lr in ("1e-3", "1e-2") for kl in ("0.05", "0.1")]
    for name in names:
        folder = tmp_path / "grid" / name
        assert (folder / ADAPTER).is_file() and (folder / "adapter_config.json").is_file()
        settings = json.loads((folder / "rloo_config.json").read_text())
        assert (
            settings["output_dir"] == str(folder)
            and settings["model"]["policy"] == settings["policy_adapter_name"]
        )
        assert len(read_metrics(folder)) == 2
    table = (tmp_path / "grid" / SUMMARY_FILE).read_text()
    assert all(name in table for name in names) and "learning_rate" in table and "kl_coef" in table
    assert (tmp_path / "grid" / CURVES_FILE).is_file()
    out = capsys.readouterr().out
    assert "sweep of 4 policies" in out


@pytest.mark.slow  # three runs of the real command, each in a new process
def test_a_sweep_killed_while_one_policy_checkpoints_resumes_to_the_uninterrupted_sweep(tmp_path):
    """SIGKILL while the second policy writes its third checkpoint (the first policy's is complete): the
    documented command ``--resume_from_checkpoint latest`` resumes both from update 2 in a new process, and
    every policy ends with the uninterrupted sweep's adapter bytes and metrics."""
    from support.kill_resume import Kill, command, make_world, metrics_without_eps, run_cli

    world = make_world(tmp_path / "world")
    grid = ["--sweep", "learning_rate=3e-3,1e-2"]
    names = ["learning_rate=3e-3", "learning_rate=1e-2"]
    reference = run_cli(world, [*command(world, tmp_path / "reference"), *grid])
    assert reference.returncode == 0, reference.stderr[-3000:]
    words = [*command(world, tmp_path / "run"), *grid]
    killed = run_cli(world, words, Kill(needle=f"{names[1]}/.checkpoint-3.tmp", count=2))
    assert killed.returncode == -9, killed.stderr[-3000:]
    saved = [sorted(p.name for p in (tmp_path / "run" / name).glob("checkpoint-*")) for name in names]
    assert saved == [["checkpoint-1", "checkpoint-2", "checkpoint-3"], ["checkpoint-1", "checkpoint-2"]]
    resumed = run_cli(world, [*words, "--resume_from_checkpoint", "latest"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    for name in names:
        run, full = tmp_path / "run" / name, tmp_path / "reference" / name
        assert (run / ADAPTER).read_bytes() == (full / ADAPTER).read_bytes()
        assert metrics_without_eps(run) == metrics_without_eps(full)
        assert not [path.name for path in run.iterdir() if path.name.startswith(".")]
