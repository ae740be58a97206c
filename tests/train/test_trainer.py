"""RLOOTrainer on tiny real models: ratio check, metrics, checkpoints and resume, guards, reward adapter."""

from __future__ import annotations

import json
import math
import weakref
from pathlib import Path

import datasets
import pytest
import torch
from transformers import AutoTokenizer

from marl import MultiAdapterModel, RLOOTrainer
from marl.algo.metrics import TRL_ROLLOUT_METRICS
from marl.data.prompts import Prompt
from marl.errors import ConfigError, DataError
from marl.rollout.collect import collect_rollout
from marl.train.memory_guard import PHASES, is_measurement
from marl.train.trainer import JUDGED_EVAL_ROWS, update_policies
from marl.train.training_parts import UpdatePart

from support.backward_stack import frames_below, record_backward_stacks
from support.runs import PROMPTS, abstain_on_every_fourth, build, count_e, prompt_dataset, tiny_config

RLOO_METRICS = {
    "eps",
    "objective/kl",
    "objective/entropy",
    "objective/non_score_reward",
    "objective/rlhf_reward",
    "objective/scores",
    "objective/unjudged",
    "objective/zero_spread_groups",
    "policy/approxkl_avg",
    "policy/clipfrac_avg",
    "loss/policy_avg",
    "policy/entropy_avg",
    "val/ratio",
    "val/ratio_var",
    "val/ratio_first",
    "val/num_eos_tokens",
    "lr",
    "episode",
    # the default sampler keeps the log-probs it drew with (tests/rollout/test_sampler_logprobs.py)
    "sampling/sampling_logp_difference/mean",
    "sampling/sampling_logp_difference/max",
    # TRL 1.16 GRPOTrainer's names (no `kl`: this run's KL is in the reward, not the loss)
    *TRL_ROLLOUT_METRICS,
    "entropy",
}


def measured_out(record: dict) -> dict:
    return {key: value for key, value in record.items() if not is_measurement(key)}


def read_metrics(output_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]


def test_first_microbatch_ratio_is_one_and_metrics_are_complete(tiny_llama_dir, tmp_path):
    config = tiny_config(
        tmp_path / "run", stop_token="eos", missing_eos_penalty=1.0, num_sample_generations=3
    )
    config.gradient_checkpointing = True
    # a model loaded without checkpointing: the trainer turns it on
    trainer = build(tiny_llama_dir, config, gradient_checkpointing=False)
    assert trainer.model.peft_model.get_base_model().is_activation_checkpointing
    history = trainer.train()

    # old log-probs come from the rollout's forward pass (2 epochs × 2 mini-batches): two passes compared
    assert len(history) == 3
    for record in history:
        assert abs(record["val/ratio_first"] - 1.0) < 1e-4
    # the policy moved: later micro-batches see ratios away from 1
    assert any(record["val/ratio_var"] > 0 for record in history)

    records = read_metrics(tmp_path / "run")
    assert records == history
    assert [record["update"] for record in records] == [1, 2, 3]
    for record in records:
        count_e_names = {"rewards/count_e", "rewards/count_e/mean", "rewards/count_e/std"}
        peaks = {f"memory/{phase}_peak_mb" for phase in PHASES}
        assert set(record) == RLOO_METRICS | {"update", "skipped_optimizer_steps"} | count_e_names | peaks
        # TRL's names agree with marl's own: the stop token is the EOS, every completion is judged, and the
        # missing-EOS penalty of 1 separates the raw reward from objective/scores
        assert record["completions/clipped_ratio"] == pytest.approx(1 - record["val/num_eos_tokens"] / 16)
        lengths = [record[f"completions/{stat}_length"] for stat in ("min", "mean", "max")]
        assert 1 <= lengths[0] <= lengths[1] <= lengths[2] <= config.response_length
        assert record["rewards/count_e/mean"] == record["rewards/count_e"]
        assert record["objective/unjudged"] == 0
        assert record["objective/scores"] == pytest.approx(
            record["reward"] - record["completions/clipped_ratio"], abs=1e-6
        )
        assert record["objective/entropy"] > 0
        assert record["policy/entropy_avg"] > 0
        assert 0 <= record["val/num_eos_tokens"] <= 16
        assert 0 <= record["policy/clipfrac_avg"] <= 1
        assert record["objective/rlhf_reward"] == pytest.approx(
            record["objective/scores"] + record["objective/non_score_reward"], abs=1e-5
        )
        assert record["objective/non_score_reward"] == pytest.approx(-0.05 * record["objective/kl"], abs=1e-6)
        assert record["skipped_optimizer_steps"] == 0
    assert [record["episode"] for record in records] == [16, 32, 48]
    assert trainer.global_step == 3 * 2 * 2
    # `lr` is the rate the update's last optimizer step used: a linear schedule over all 12 steps gives
    # 1e-2 * (12 - 4) / 12, 1e-2 * (12 - 8) / 12 and 1e-2 * 1 / 12 (not the next update's rate)
    assert [record["lr"] for record in records] == pytest.approx([1e-2 * 9 / 12, 1e-2 * 5 / 12, 1e-2 / 12])

    samples = sorted((tmp_path / "run" / "samples").glob("update_*.jsonl"))
    assert [path.name for path in samples] == [
        "update_000001.jsonl",
        "update_000002.jsonl",
        "update_000003.jsonl",
    ]
    first = json.loads(samples[0].read_text().splitlines()[0])
    assert set(first) == {"prompt", "completion", "score"}
    assert (tmp_path / "run" / "adapter_model.safetensors").is_file()


def test_a_grpo_run_logs_trls_kl_and_entropy_metrics_every_update(tiny_llama_dir, tmp_path):
    config = tiny_config(tmp_path / "run", algorithm="grpo", kl_coef=0.04, stop_token="eos")
    history = build(tiny_llama_dir, config).train()
    assert len(history) == 3
    for record in history:
        # the k3 KL term of the loss: 0 at the first micro-batch step (policy = reference), then not negative
        assert record["kl"] >= 0 and record["entropy"] > 0
        assert set(TRL_ROLLOUT_METRICS) <= set(record)
    assert history[-1]["kl"] > 0  # the policy moved away from the reference


def test_warmup_steps_count_updates_as_in_trls_rloo(tiny_llama_dir, tmp_path):
    """warmup_steps=1 with 2 epochs × 2 mini-batches warms up over the 4 optimizer steps of one update."""
    trainer = build(tiny_llama_dir, tiny_config(tmp_path / "run", warmup_steps=1))
    factors = [trainer.parts.policy_update.scheduler.scheduler.lr_lambdas[0](step) for step in range(6)]
    assert factors[:5] == pytest.approx([0.0, 0.25, 0.5, 0.75, 1.0])
    assert factors[5] < 1.0  # then the linear decay


def test_an_update_that_fails_leaves_the_model_in_eval_mode(tiny_llama_dir, tmp_path):
    trainer = build(tiny_llama_dir, tiny_config(tmp_path / "run"))
    rollout = collect_rollout(
        trainer.parts.sampler, trainer.parts.scorer, trainer.parts.train_prompts[:8], 2, trainer.parts.reward
    )
    with pytest.raises(IndexError):
        part = UpdatePart(
            trainer.parts.policy_update, rollout, torch.zeros(3)
        )  # advantages of the wrong size
        update_policies([part], trainer.phases, update=1)  # fail inside the loop
    assert not any(module.training for module in trainer.model.peft_model.modules())


# RLOOTrainer.train -> the loop -> the update's loops -> one micro-batch -> the parallelism's backward
MAX_FRAMES_TO_BACKWARD = 5


def test_the_policy_loss_backward_is_at_most_five_marl_frames_below_train(
    tiny_llama_dir, tmp_path, monkeypatch
):
    """The loop is visible: from ``RLOOTrainer.train`` to the policy loss's backward (the parallelism's
    included), measured on the stack of every backward pass of a real run (2 epochs x 2 mini-batches x 2
    micro-batches)."""
    stacks = record_backward_stacks(monkeypatch)
    build(tiny_llama_dir, tiny_config(tmp_path / "run", total_episodes=16)).train()
    assert len(stacks) == 8
    for stack in stacks:
        frames = frames_below(stack, "marl/train/trainer.py:train")
        assert len(frames) <= MAX_FRAMES_TO_BACKWARD and frames[-1] == "marl/train/parallel.py:backward", (
            frames
        )


def test_the_c_heap_is_trimmed_between_sampling_and_scoring(tiny_llama_dir, tmp_path, monkeypatch):
    """The sampler's freed cache goes back to the system before scoring, not after the rollout: on CPU the
    heap kept it, fragmented, under scoring's peak (SmolLM2 in 4-bit: 900 MiB with it, 790 without)."""
    import marl.rollout.collect

    trainer = build(tiny_llama_dir, tiny_config(tmp_path / "run"))
    calls: list[str] = []

    def logged(name, call):
        return lambda *args, **kwargs: calls.append(name) or call(*args, **kwargs)

    monkeypatch.setattr(trainer.parts.sampler, "sample", logged("sample", trainer.parts.sampler.sample))
    monkeypatch.setattr(trainer.parts.scorer, "logprobs", logged("score", trainer.parts.scorer.logprobs))
    monkeypatch.setattr(marl.rollout.collect, "release_freed_memory", logged("trim", lambda: None))
    collect_rollout(
        trainer.parts.sampler, trainer.parts.scorer, trainer.parts.train_prompts[:4], 2, trainer.parts.reward
    )
    assert calls == ["sample", "trim", "score", "trim"]  # and once more after scoring, before the update


@pytest.mark.parametrize("setting", ["heap", "maps"])
def test_a_cpu_trainer_applies_its_cpu_allocator_setting(tiny_llama_dir, tmp_path, monkeypatch, setting):
    import marl.train.trainer

    applied: list[str] = []
    monkeypatch.setattr(marl.train.trainer, "use_cpu_allocator", applied.append)
    build(tiny_llama_dir, tiny_config(tmp_path / "run", cpu_allocator=setting))
    assert applied == [setting]


def test_a_micro_batchs_graph_is_gone_before_the_next_forward(tiny_llama_dir, tmp_path):
    """bitsandbytes' int8 matmul on CPU keeps each layer's input on its autograd context, which the backward
    pass does not free: while anything references a micro-batch's graph (its log-probs, its loss), every
    8-bit layer's input stays alive (380 MiB on SmolLM2-135M's update). The update lets go of the graph
    before the next micro-batch's forward: no input an 8-bit layer saw with gradients on outlives it."""
    import bitsandbytes as bnb

    trainer = build(tiny_llama_dir, tiny_config(tmp_path / "run", quantization="8bit", total_episodes=32))
    compute, layer_inputs, forwards = trainer.parts.scorer.completion_logprobs, [], []

    def keep_input(module, args):
        if torch.is_grad_enabled():
            layer_inputs.append(weakref.ref(args[0]))

    int8_layers = [m for m in trainer.model.peft_model.modules() if isinstance(m, bnb.nn.Linear8bitLt)]
    assert int8_layers
    for layer in int8_layers:
        layer.register_forward_pre_hook(keep_input)

    def watched(*args, **kwargs):
        if torch.is_grad_enabled():
            assert all(previous() is None for previous in layer_inputs), "a micro-batch's graph outlived it"
            forwards.append(True)
        return compute(*args, **kwargs)

    trainer.parts.scorer.completion_logprobs = watched
    trainer.train()
    assert len(forwards) == 2 * 2 * 2 * 2  # updates x epochs x mini-batches x micro-batches
    assert len(layer_inputs) == len(forwards) * len(int8_layers)


def test_reinforce_setting_uses_ratio_one_exactly(tiny_llama_dir, tmp_path):
    config = tiny_config(tmp_path / "run", num_ppo_epochs=1, num_mini_batches=1, total_episodes=16)
    history = build(tiny_llama_dir, config).train()
    assert history[0]["val/ratio"] == 1.0
    assert history[0]["val/ratio_var"] == 0.0
    assert history[0]["policy/clipfrac_avg"] == 0.0


def test_resume_reproduces_the_uninterrupted_run(tiny_llama_dir, tmp_path):
    full_dir, resumed_dir = tmp_path / "full", tmp_path / "resumed"
    config = tiny_config(full_dir, total_episodes=64, save_steps=2, save_total_limit=1)
    build(tiny_llama_dir, config).train()
    uninterrupted = read_metrics(full_dir)
    assert [path.name for path in sorted(full_dir.glob("checkpoint-*"))] == ["checkpoint-4"]  # pruned to 1
    assert not list(full_dir.glob(".checkpoint-*"))

    # the same run, checkpointed at update 2 and interrupted there
    interrupted = tiny_config(resumed_dir, total_episodes=64, save_steps=2)
    build(tiny_llama_dir, interrupted).train()
    for path in resumed_dir.glob("checkpoint-4"):
        for file in path.iterdir():
            file.unlink()
        path.rmdir()
    (resumed_dir / "metrics.jsonl").write_text(
        "".join(
            json.dumps(record) + "\n" for record in read_metrics(resumed_dir)[:3]
        )  # crashed after update 3
    )

    trainer = build(tiny_llama_dir, tiny_config(resumed_dir, total_episodes=64, save_steps=2))
    trainer.train(resume_from_checkpoint=True)
    resumed = read_metrics(resumed_dir)
    assert [record["update"] for record in resumed] == [1, 2, 3, 4]
    for expected, actual in zip(uninterrupted, resumed, strict=True):
        assert measured_out(actual) == measured_out(expected)


def test_resume_errors_are_clear(tiny_llama_dir, tmp_path):
    trainer = build(tiny_llama_dir, tiny_config(tmp_path / "run"))
    with pytest.raises(FileNotFoundError, match="not a checkpoint"):
        trainer.train(resume_from_checkpoint=tmp_path)
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").write_text('{"update": 1}\n')
    with pytest.raises(FileExistsError, match=r"already holds a run.*Choose another output_dir"):
        trainer.train()
    assert (tmp_path / "run" / "metrics.jsonl").read_text() == '{"update": 1}\n'


def test_resume_with_no_checkpoint_yet_starts_from_the_beginning(tiny_llama_dir, tmp_path, capsys):
    """A run stopped before its first checkpoint: resume_from_checkpoint=True runs it from the beginning and
    replaces what the stopped run had written, with the result of an uninterrupted run."""
    build(tiny_llama_dir, tiny_config(tmp_path / "full", total_episodes=32)).train()
    stopped = tmp_path / "stopped"
    stopped.mkdir()
    (stopped / "rloo_config.json").write_text("{}")
    (stopped / "metrics.jsonl").write_text('{"update": 1, "episode": 16.0}\n{"upd')  # cut off by a kill
    build(tiny_llama_dir, tiny_config(stopped, total_episodes=32)).train(resume_from_checkpoint=True)
    assert "no checkpoint yet: the run starts from the beginning" in capsys.readouterr().err
    full, restarted = read_metrics(tmp_path / "full"), read_metrics(stopped)
    assert [measured_out(record) for record in restarted] == [measured_out(record) for record in full]
    assert (stopped / "adapter_model.safetensors").read_bytes() == (
        tmp_path / "full" / "adapter_model.safetensors"
    ).read_bytes()


@pytest.mark.parametrize("token_level_kl", [False, True])
def test_a_reward_function_that_abstains_on_some_completions_still_trains(
    tiny_llama_dir, tmp_path, recwarn, token_level_kl
):
    config = tiny_config(tmp_path / "run", token_level_kl=token_level_kl, normalize_advantage=True)
    trainer = build(tiny_llama_dir, config, reward_fn=abstain_on_every_fourth)
    before = [parameter.detach().clone() for parameter in trainer.model.policy_parameters()]
    history = trainer.train()
    assert not [w for w in recwarn if issubclass(w.category, RuntimeWarning)]
    assert [record["skipped_optimizer_steps"] for record in history] == [0, 0, 0]
    assert [record["objective/unjudged"] for record in history] == [4, 4, 4]  # 4 of 16 per update
    for record in history:
        assert "val/ratio" in record and math.isfinite(record["loss/policy_avg"])
        assert math.isfinite(record["objective/scores"]) and math.isfinite(record["objective/rlhf_reward"])
        assert record["objective/rlhf_reward"] == pytest.approx(
            record["objective/scores"] + record["objective/non_score_reward"], abs=1e-5
        )
    after = trainer.model.policy_parameters()
    assert any(not torch.equal(old, new) for old, new in zip(before, after, strict=True))
    assert all(torch.isfinite(parameter).all() for parameter in after)


def test_an_update_where_nothing_was_judged_is_skipped_and_training_continues(tiny_llama_dir, tmp_path):
    calls = []

    def silent_at_first(prompts, completions):
        calls.append(1)
        return [None] * len(completions) if len(calls) == 1 else count_e(prompts, completions)

    trainer = build(tiny_llama_dir, tiny_config(tmp_path / "run"), reward_fn=silent_at_first)
    before = [parameter.detach().clone() for parameter in trainer.model.policy_parameters()]
    with pytest.warns(RuntimeWarning, match="no reward source judged any of its completions"):
        history = trainer.train()
    assert [record["skipped_optimizer_steps"] for record in history] == [4, 4, 4]
    assert [record["objective/unjudged"] for record in history] == [16, 0, 0]
    assert math.isnan(history[0]["objective/scores"]) and "val/ratio" not in history[0]
    assert "val/ratio" in history[1]
    assert trainer.global_step == 12
    after = trainer.model.policy_parameters()
    assert any(not torch.equal(old, new) for old, new in zip(before, after, strict=True))
    assert all(math.isfinite(value) for value in after[0].flatten().tolist())


def test_non_finite_loss_skips_the_step_and_training_continues(tiny_llama_dir, tmp_path):
    calls = []

    def overflowing(prompts, completions):
        # finite rewards whose leave-one-out difference overflows float32: an infinite advantage and loss
        calls.append(1)
        if len(calls) == 1:
            return [3e38] + [-3e38] * (len(completions) - 1)
        return count_e(prompts, completions)

    trainer = build(tiny_llama_dir, tiny_config(tmp_path / "run"), reward_fn=overflowing)
    with pytest.warns(RuntimeWarning, match="non-finite loss"):
        history = trainer.train()
    # the steps whose mini-batch held an overflowing sample (1 to all 4 of update 1) are skipped, no others
    assert 1 <= history[0]["skipped_optimizer_steps"] <= 4
    assert history[-1]["skipped_optimizer_steps"] == history[0]["skipped_optimizer_steps"]
    assert all(math.isfinite(record["loss/policy_avg"]) for record in history[1:])
    for parameter in trainer.model.policy_parameters():
        assert torch.isfinite(parameter).all()


def test_token_level_kl_changes_training(tiny_llama_dir, tmp_path):
    weights = {}
    for token_level in (False, True):
        config = tiny_config(tmp_path / str(token_level), token_level_kl=token_level, kl_coef=0.5)
        trainer = build(tiny_llama_dir, config)
        history = trainer.train()
        weights[token_level] = torch.cat([p.detach().flatten() for p in trainer.model.policy_parameters()])
    # same rollout at update 1 (same seed), different losses from then on
    assert not torch.equal(weights[False], weights[True])
    assert history[0]["objective/rlhf_reward"] == pytest.approx(
        history[0]["objective/scores"] + history[0]["objective/non_score_reward"], abs=1e-5
    )


@pytest.mark.parametrize(
    ("reward_fn", "error", "message"),
    [
        (lambda prompts, completions: [1.0], DataError, "returned 1 scores for 8 completions"),
        (lambda prompts, completions: ["good"] * len(completions), DataError, "must be real numbers"),
        (lambda prompts, completions: None, DataError, "one per completion"),
    ],
)
def test_reward_fn_output_is_validated(tiny_llama_dir, tmp_path, reward_fn, error, message):
    config = tiny_config(tmp_path / "run", per_device_train_batch_size=4, gradient_accumulation_steps=1)
    trainer = build(tiny_llama_dir, config, reward_fn=reward_fn)
    with pytest.raises(error, match=message):
        trainer.train()


def test_reward_fn_is_called_as_trl_calls_it_with_the_dataset_columns(tiny_llama_dir, tmp_path):
    calls = []

    def record(prompts, completions, completion_ids, trainer_state, answer, **kwargs):
        calls.append((prompts, completions, completion_ids, trainer_state, answer, kwargs))
        # TRL's logging keywords: a column of the sample table, a metric of the update
        kwargs["log_extra"]("reversed", [text[::-1] for text in answer])
        kwargs["log_metric"]("answer_length", sum(len(text) for text in answer) / len(answer))
        return [0.0] * len(completions)

    conversations = datasets.Dataset.from_list(
        [{"prompt": [{"role": "user", "content": text}], "answer": text[::-1]} for text in PROMPTS[:4]]
    )
    config = tiny_config(tmp_path / "run", total_episodes=32, num_sample_generations=2)
    trainer = build(tiny_llama_dir, config, reward_fn=record, dataset=conversations)
    trainer.train()
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    # the optimizer steps done before each update's rollout, as TRL's state.global_step counts them
    steps = trainer.parts.sizes.optimizer_steps_per_update
    assert steps > 1 and [call[3].global_step for call in calls] == [0, steps]
    assert {call[3].max_steps for call in calls} == {trainer.parts.sizes.total_optimizer_steps}
    for prompts, completions, completion_ids, _, answer, kwargs in calls:
        assert len(prompts) == 16 and set(kwargs) == {"log_extra", "log_metric"}  # no other column
        # conversations as message lists, completions as the assistant's reply (TRL's shapes)
        assert all(prompt[0]["role"] == "user" for prompt in prompts)
        assert all(completion[0]["role"] == "assistant" for completion in completions)
        # each row's column value is its own prompt's, repeated for its k completions, k-major
        assert answer == [prompt[0]["content"][::-1] for prompt in prompts]
        assert prompts[:8] == prompts[8:]
        texts = tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
        assert texts == [completion[0]["content"] for completion in completions]
    # what it logged: the metric under its name, each update's mean; the column beside each sample
    metrics = read_metrics(tmp_path / "run")
    assert [m["answer_length"] for m in metrics] == [sum(map(len, c[4])) / len(c[4]) for c in calls]
    table = (tmp_path / "run" / "samples" / "update_000001.jsonl").read_text().splitlines()
    rows = [json.loads(line) for line in table]
    assert rows and [row["reversed"] for row in rows] == [text[::-1] for text in calls[0][4][: len(rows)]]
    # the run's reward function is on record beside its settings
    (recorded,) = json.loads((tmp_path / "run" / "rloo_config.json").read_text())["rewards"]
    assert recorded["kind"] == "function" and recorded["function"].endswith(":" + record.__qualname__)


def test_dataset_and_reward_validation(tiny_llama_dir, tmp_path):
    config = tiny_config(tmp_path / "run", model_name_or_path=str(tiny_llama_dir))
    torch.manual_seed(0)
    model = MultiAdapterModel.from_config(config)
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    with pytest.raises(ValueError, match=r"no 'prompt' or 'input_ids' column.*rename_column"):
        RLOOTrainer(
            config, model, tokenizer, datasets.Dataset.from_dict({"text": ["a"]}), reward_funcs=count_e
        )
    with pytest.raises(ValueError, match="empty"):
        RLOOTrainer(
            config, model, tokenizer, datasets.Dataset.from_dict({"prompt": []}), reward_funcs=count_e
        )
    long_prompt = " ".join(["movie"] * 300)
    with pytest.raises(ValueError, match=r"exceed the model's context of 256 tokens.*--response_length"):
        RLOOTrainer(config, model, tokenizer, prompt_dataset([long_prompt, "short"]), reward_funcs=count_e)
    with pytest.raises(ValueError, match="must be a string or a list"):
        RLOOTrainer(
            config, model, tokenizer, datasets.Dataset.from_dict({"prompt": [[1, 2]]}), reward_funcs=count_e
        )
    with pytest.raises(ValueError, match="no reward adapter and no reward function"):
        RLOOTrainer(config, model, tokenizer, prompt_dataset())
    ids_only = datasets.Dataset.from_dict({"input_ids": [[5, 6, 7], [8, 9]]})
    trainer = RLOOTrainer(config, model, tokenizer, ids_only, reward_funcs=count_e)
    assert [list(prompt.ids) for prompt in trainer.parts.train_prompts] == [[5, 6, 7], [8, 9]]


def save_reward_adapter(model_dir: Path, directory: Path) -> Path:
    """A SEQ_CLS LoRA + score head on the tiny base, saved the way TRL's RewardTrainer saves one."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForSequenceClassification

    torch.manual_seed(1)
    classifier = AutoModelForSequenceClassification.from_pretrained(model_dir, num_labels=1)
    peft_model = get_peft_model(classifier, LoraConfig(task_type="SEQ_CLS", r=4, lora_alpha=8))
    with torch.no_grad():
        for name, parameter in peft_model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(std=0.1)  # a trained-looking adapter, not the identity
    peft_model.save_pretrained(directory)
    return directory


def reward_state(model: MultiAdapterModel) -> dict[str, bytes]:
    state = {
        name: parameter.detach().cpu().numpy().tobytes()
        for name, parameter in model.peft_model.named_parameters()
        if ".reward." in name
    }
    for name, parameter in model.rewards["reward"].head.named_parameters():
        state[f"score_head.{name}"] = parameter.detach().cpu().numpy().tobytes()
    return state


@pytest.mark.parametrize("quantization", [None, "4bit"])
def test_reward_adapter_and_head_are_byte_identical_after_training(tiny_llama_dir, tmp_path, quantization):
    adapter = save_reward_adapter(tiny_llama_dir, tmp_path / "reward")
    config = tiny_config(
        tmp_path / "run",
        quantization=quantization,
        reward_adapter=str(adapter),
        total_episodes=32,
        stop_token="eos",
    )
    trainer = build(tiny_llama_dir, config, reward_fn=None)
    assert trainer.model.quantization == quantization
    before = reward_state(trainer.model)
    policy_before = [parameter.detach().clone() for parameter in trainer.model.policy_parameters()]
    history = trainer.train()
    assert reward_state(trainer.model) == before
    policy_after = trainer.model.policy_parameters()
    assert any(not torch.equal(old, new) for old, new in zip(policy_before, policy_after, strict=True))
    scores = [record["objective/scores"] for record in history]
    assert all(math.isfinite(score) for score in scores)
    assert len(set(scores)) > 1  # the reward adapter really scores the completions


def test_tensorboard_tracker_and_eval_samples(tiny_llama_dir, tmp_path):
    config = tiny_config(
        tmp_path / "run", total_episodes=16, report_to="tensorboard", num_sample_generations=1
    )
    config.model_name_or_path = str(tiny_llama_dir)
    torch.manual_seed(0)
    model = MultiAdapterModel.from_config(config)
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    held_out = prompt_dataset(["held out one", "held out two"])
    trainer = RLOOTrainer(
        config, model, tokenizer, prompt_dataset(), eval_dataset=held_out, reward_funcs=count_e
    )
    trainer.train()
    assert list((tmp_path / "run").rglob("events.out.tfevents.*"))
    rows = [
        json.loads(line)
        for line in (tmp_path / "run" / "samples" / "update_000001.jsonl").read_text().splitlines()
    ]
    assert [row["prompt"] for row in rows] == ["held out one", "held out two"]
    assert all(row["score"] == row["completion"].count("e") for row in rows)


def test_a_judge_scores_the_held_out_samples_without_touching_training(tiny_llama_dir, tmp_path):
    held_out = prompt_dataset([f"held out {i}" for i in range(40)])
    seen: list[str] = []

    def judge(texts):
        seen.extend(texts)
        return [float(text.count("o")) for text in texts]

    def run(output_dir, judge):
        config = tiny_config(output_dir, num_sample_generations=3, logging_steps=2)
        config.model_name_or_path = str(tiny_llama_dir)
        torch.manual_seed(0)
        model = MultiAdapterModel.from_config(config)
        tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
        trainer = RLOOTrainer(
            config, model, tokenizer, prompt_dataset(), held_out, reward_funcs=count_e, judge=judge
        )
        trainer.train()
        return read_metrics(output_dir)

    judged, plain = run(tmp_path / "judged", judge), run(tmp_path / "plain", None)
    # A sample table at every update (3 updates / 3 generations): each logged with the held-out means.
    assert [r["update"] for r in judged] == [1, 2, 3] and [r["update"] for r in plain] == [2, 3]
    assert len(seen) == 3 * JUDGED_EVAL_ROWS
    assert all(text.startswith("held out ") for text in seen)
    first = seen[:JUDGED_EVAL_ROWS]
    assert judged[0]["eval/judge_score"] == pytest.approx(sum(t.count("o") for t in first) / len(first))
    for with_judge, without in zip(judged[1:], plain, strict=True):  # the training RNG is not disturbed
        assert "eval/score" in with_judge and "eval/judge_score" not in without
        assert with_judge["objective/scores"] == without["objective/scores"]
        assert with_judge["objective/kl"] == pytest.approx(without["objective/kl"], abs=1e-6)


def test_a_judge_needs_held_out_prompts_and_functions_are_checked_first(tmp_path):
    config = tiny_config(tmp_path / "run", num_sample_generations=1)
    with pytest.raises(ConfigError, match="pass eval_dataset"):
        RLOOTrainer(config, None, None, prompt_dataset(), reward_funcs=count_e, judge=len)
    config.num_sample_generations = 0
    with pytest.raises(ConfigError, match="num_sample_generations > 0"):
        RLOOTrainer(config, None, None, prompt_dataset(), prompt_dataset(), reward_funcs=count_e, judge=len)
    with pytest.raises(ConfigError, match=r"callbacks entry 3 is not a function.*callback\(state, metrics\)"):
        RLOOTrainer(config, None, None, prompt_dataset(), reward_funcs=count_e, callbacks=[3])
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("architecture", ["llama", "gpt_neox"])
def test_shared_prompt_prefill_samples_like_repeated_prompts(tiny_model_factory, tmp_path, architecture):
    """Each prompt is prefilled once for its k samples; at a near-zero temperature sampling is greedy, so the
    completions must equal those of generate() on the prompts repeated k times (k-major)."""
    model_dir = tiny_model_factory(architecture)
    config = tiny_config(tmp_path / "run", temperature=1e-4, response_length=5, stop_token="none")
    trainer = build(model_dir, config)  # no stop token: compared with generate() run to the limit
    torch.manual_seed(0)  # the random policy below, whatever loading drew from the generator
    with torch.no_grad():
        for name, parameter in trainer.model.peft_model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(std=0.2)  # a policy that differs from the base
    prompts = trainer.parts.sampler.batch(
        [Prompt((5, 6, 7, 8), ""), Prompt((9, 10), ""), Prompt((11, 12, 13), "")]
    )
    prompt_ids, prompt_mask = prompts.ids, prompts.mask
    shared = trainer.parts.sampler.sample(prompts, k=3).response_ids
    with trainer.model.policy(), torch.no_grad():
        repeated = trainer.model.peft_model.generate(
            input_ids=prompt_ids.repeat(3, 1),
            attention_mask=prompt_mask.repeat(3, 1),
            max_new_tokens=5,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=trainer.parts.sampler.sampling.pad_token_id,
        )[:, prompt_ids.shape[1] :]
    assert shared.shape == (9, 5)
    assert torch.equal(shared, repeated)


def test_missing_eos_penalty_and_eos_count_agree(tiny_llama_dir, tmp_path):
    def zero(prompts, completions):
        return [0.0] * len(completions)

    config = tiny_config(
        tmp_path / "run", stop_token="eos", missing_eos_penalty=1.0, response_length=40, temperature=2.0
    )
    history = build(tiny_llama_dir, config, reward_fn=zero).train()
    # every completion without EOS scores −1, every completion with EOS scores 0
    for record in history:
        assert record["objective/scores"] == pytest.approx(-(16 - record["val/num_eos_tokens"]) / 16)
    assert sum(record["val/num_eos_tokens"] for record in history) > 0
