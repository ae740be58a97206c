"""The parallelism extension point: lookup by name, the builder's check of every registry name, and a
parallelism registered from outside the package running a real training."""

from __future__ import annotations

import datasets
import pytest
import torch
from transformers import AutoTokenizer

from marl import MultiAdapterModel, RLOOConfig, RLOOTrainer
from marl.errors import ConfigError
from marl.train.parallel import PARALLELISMS, ReplicatedParallelism, get_parallelism, register_parallelism
from marl.train.training_parts import build_training_parts, check_components

from support.tiny import tiny_rloo_config


class CountingParallelism(ReplicatedParallelism):
    """The replicated parallelism, counting the backward passes (where gradients are averaged) the trainer
    asks for."""

    def __init__(self, model, config) -> None:
        super().__init__(model, config)
        self.backward_passes = 0

    def backward(self, loss) -> None:
        self.backward_passes += 1
        super().backward(loss)


@pytest.fixture
def counting_parallelism():
    register_parallelism("counting", CountingParallelism)
    yield "counting"
    del PARALLELISMS["counting"]


def test_an_unknown_parallelism_is_refused_with_the_known_names():
    with pytest.raises(ConfigError, match=r"--parallelism 'nope' .*\['fsdp2', 'replicated'\]"):
        get_parallelism("nope")
    assert get_parallelism("replicated") is ReplicatedParallelism


@pytest.mark.parametrize("field", ["advantage_estimator", "sampler", "parallelism"])
def test_check_components_refuses_a_bad_registry_name_before_any_model_work(field):
    # The model folder does not exist: nothing may try to read it.
    config = RLOOConfig(model_name_or_path="no/such-model", **{field: "nope"})
    with pytest.raises(ConfigError, match=f"--{field} '?nope"):
        check_components(config)
    # The builder checks first: neither the model nor the tokenizer nor the prompts are touched.
    with pytest.raises(ConfigError, match=f"--{field} '?nope"):
        build_training_parts(config, model=None, tokenizer=None, train_dataset=None)


def test_a_parallelism_registered_outside_the_package_runs_every_optimizer_step(
    tiny_llama_dir, tmp_path, counting_parallelism
):
    config = tiny_rloo_config(
        tmp_path / "run", model_name_or_path=str(tiny_llama_dir), parallelism=counting_parallelism,
        gradient_accumulation_steps=2, num_mini_batches=2, num_ppo_epochs=2, total_episodes=32,
        response_length=4,
    )  # fmt: skip
    prompts = datasets.Dataset.from_dict({"prompt": ["the movie", "a film", "review:", "good"]})
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    model = MultiAdapterModel.from_config(config)
    trainer = RLOOTrainer(config, model, tokenizer, prompts, reward_funcs=lambda p, c: [len(x) for x in c])
    assert isinstance(trainer.parts.parallelism, CountingParallelism)
    history = trainer.train()
    assert [record["update"] for record in history] == [1, 2]
    # 2 updates × 2 epochs × 2 mini-batches, none skipped; each step accumulates 2 micro-batches, and every
    # micro-batch's backward goes through the parallelism (which averages its gradients over processes)
    assert trainer.global_step == 8 and trainer.state.skipped_optimizer_steps == 0
    assert trainer.parts.parallelism.backward_passes == 16


@pytest.mark.parametrize("name", ["ddp", "fsdp2"])
def test_the_accelerate_configs_load_and_name_a_registered_parallelism(name):
    import re
    from pathlib import Path

    from accelerate.commands.config.config_args import load_config_from_file

    path = Path(__file__).resolve().parents[2] / "examples" / "accelerate" / f"{name}.yaml"
    config = load_config_from_file(str(path))
    assert config.num_processes >= 2 and config.num_machines == 1
    # the launch command in the file's comment names a registered --parallelism
    named = re.findall(r"--parallelism ([a-z0-9_-]+) ", path.read_text())
    assert named and all(get_parallelism(value) for value in named)


def test_an_8bit_base_is_refused_under_fsdp2_saying_what_bitsandbytes_does_not_allow():
    from marl.train.parallel import ShardedParallelism

    class QuantizedRecord:  # what check_model reads: the loaded model's quantization
        quantization = "8bit"

    with pytest.raises(ConfigError, match=r"cannot shard an 8bit .*\(CB, SCB\) on the Int8Params tensor"):
        ShardedParallelism.check_model(None, QuantizedRecord())


def test_4bit_weights_packed_in_uint8_are_refused_under_fsdp2(tiny_llama_dir):
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    from marl.train.parallel import ShardedParallelism

    settings = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_compute_dtype=torch.float32)  # uint8 storage
    base = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, quantization_config=settings)

    class Loaded:  # a model someone loaded with bitsandbytes' default storage
        quantization, peft_model = "4bit", base

    refused = r"cannot shard 4-bit weights packed in torch.uint8: .*quant_storage"
    with pytest.raises(ConfigError, match=refused):
        ShardedParallelism.check_model(None, Loaded())
