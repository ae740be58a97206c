"""MultiAdapterModel on tiny real models: loading, reward parity with transformers+PEFT, views, log-probs,
saving."""

from __future__ import annotations

import contextlib
import gc
import json
import shutil
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

from marl.errors import ConfigError
from marl.model.forward import position_ids_from_mask, reward_read_positions
from marl.model.multi_adapter import MultiAdapterModel
from marl.model.sampling import SamplingSettings

from support.families import FAMILIES, FAMILY_SPECS
from support.tiny import TINY_ARCHITECTURES, build_tiny_tokenizer, train_reward_adapter_with_trl

QUANTIZATIONS = (None, "8bit", "4bit")


@pytest.fixture(scope="session")
def llama_model(tiny_llama_dir, reward_adapter_factory) -> MultiAdapterModel:
    """A shared unquantized llama MultiAdapterModel with a reward adapter; tests must leave it as they
    found it."""
    return MultiAdapterModel.from_pretrained(tiny_llama_dir, reward_adapter=reward_adapter_factory("llama"))


def padded_batch(side: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of different lengths, padded with the tiny tokenizer's pad id 0 (eos is 1, so pad != eos)."""
    rows = [[5, 6, 7, 8, 9, 1], [12, 40, 7], [9, 8, 7, 6, 1]]
    width = max(len(row) for row in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, row in enumerate(rows):
        span = slice(width - len(row), width) if side == "left" else slice(0, len(row))
        ids[i, span] = torch.tensor(row)
        mask[i, span] = 1
    return ids, mask


def reference_sequence_classifier(base_dir: Path, adapter_dir: Path):
    model = AutoModelForSequenceClassification.from_pretrained(base_dir, num_labels=1, dtype=torch.float32)
    return PeftModel.from_pretrained(model, str(adapter_dir)).eval()


@contextlib.contextmanager
def moved_policy(model: MultiAdapterModel):
    """Random policy LoRA B matrices for the body (the policy differs from the base), restored after."""
    with torch.no_grad():
        lora_b = [p for n, p in model.peft_model.named_parameters() if "lora_B.policy" in n]
        saved = [p.clone() for p in lora_b]
        for p in lora_b:
            p.normal_(std=0.05)
    try:
        yield
    finally:
        with torch.no_grad():
            for p, value in zip(lora_b, saved, strict=True):
                p.copy_(value)


def full_softmax_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float) -> torch.Tensor:
    return (
        torch.log_softmax(logits.float() / temperature, dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    )


# ---------------------------------------------------------------------- helpers


def test_reward_read_positions_follow_transformers_rule():
    """The last token that is not the padding id, whatever the padding side; masked positions are padding."""
    ids = torch.tensor([[0, 0, 5, 6], [5, 6, 7, 0], [5, 0, 0, 0], [5, 6, 7, 8], [5, 6, 2, 2]])
    mask = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 1, 1], [1, 1, 1, 0]])
    assert reward_read_positions(ids, mask, pad_token_id=0).tolist() == [3, 2, 0, 3, 2]
    # pad == eos == 2: an EOS that ends the text is padding to the classifier, read one token earlier
    assert reward_read_positions(ids, mask, pad_token_id=2).tolist() == [3, 2, 0, 3, 1]


def test_position_ids_skip_left_padding():
    assert position_ids_from_mask(torch.tensor([[0, 0, 1, 1, 1]])).tolist() == [[0, 0, 0, 1, 2]]


# ---------------------------------------------------------------------- reward parity


def test_reward_adapter_was_really_trained(reward_adapter_factory):
    state = load_file(str(reward_adapter_factory("llama") / "adapter_model.safetensors"))
    lora_b = [tensor for key, tensor in state.items() if "lora_B" in key]
    assert lora_b and any(tensor.abs().max() > 0 for tensor in lora_b)
    assert "base_model.model.score.weight" in state


@pytest.mark.parametrize("architecture", TINY_ARCHITECTURES)
@pytest.mark.parametrize("side", ["left", "right"])
def test_reward_score_matches_sequence_classification_model(
    architecture, side, tiny_model_factory, reward_adapter_factory
):
    base_dir, adapter_dir = tiny_model_factory(architecture), reward_adapter_factory(architecture)
    model = MultiAdapterModel.from_pretrained(base_dir, reward_adapter=adapter_dir)
    reference = reference_sequence_classifier(base_dir, adapter_dir)
    ids, mask = padded_batch(side)
    scores = model.compute_reward_score(ids, mask)
    with torch.no_grad():
        expected = reference(input_ids=ids, attention_mask=mask).logits.squeeze(-1)
    assert scores.dtype == torch.float32 and scores.shape == (3,)
    torch.testing.assert_close(scores, expected, rtol=0, atol=1e-5)
    # The adapter matters: the same head on the bare base gives other numbers.
    with model.use_adapter("reward"), model.peft_model.disable_adapter(), torch.no_grad():
        hidden = model._hidden_states(ids, mask)
        read_at = reward_read_positions(ids, mask, model.rewards["reward"].pad_token_id)
        bare = model.rewards["reward"].head(hidden[torch.arange(3), read_at]).squeeze(-1)
    assert (bare - scores).abs().max() > 1e-4


def test_reward_score_reads_eos_when_it_is_a_real_token(llama_model):
    """With pad != eos an EOS is a real token: the score is read at the EOS itself."""
    ids = torch.tensor([[5, 6, 7, 1]])
    with_eos = llama_model.compute_reward_score(ids, torch.ones_like(ids))
    eos_masked = llama_model.compute_reward_score(ids, torch.tensor([[1, 1, 1, 0]]))
    without_eos = llama_model.compute_reward_score(ids[:, :3], torch.ones(1, 3, dtype=torch.long))
    torch.testing.assert_close(eos_masked, without_eos, rtol=0, atol=1e-6)
    assert (with_eos - without_eos).abs().item() > 1e-6


def test_reward_score_is_independent_of_padding_amount(llama_model):
    ids = torch.tensor([[5, 6, 7, 8]])
    alone = llama_model.compute_reward_score(ids, torch.ones_like(ids))
    padded = torch.cat([torch.zeros(1, 3, dtype=torch.long), ids], dim=1)
    left = llama_model.compute_reward_score(padded, (padded != 0).long())
    torch.testing.assert_close(alone, left, rtol=0, atol=1e-5)


# ---------------------------------------------------------------------- architectures x quantization


@pytest.mark.parametrize("quantization", QUANTIZATIONS)
@pytest.mark.parametrize("architecture", TINY_ARCHITECTURES)
def test_load_score_switch_and_train_step(
    architecture, quantization, tiny_model_factory, reward_adapter_factory
):
    model = MultiAdapterModel.from_pretrained(
        tiny_model_factory(architecture),
        quantization=quantization,
        reward_adapter=reward_adapter_factory(architecture),
    )
    base = model.peft_model.get_base_model()
    if quantization == "4bit":
        assert base.is_loaded_in_4bit
    elif quantization == "8bit":
        assert base.is_loaded_in_8bit
    assert model.adapter_names == ["policy", "reward"] and model.reference_mode == "base"
    ids, mask = padded_batch("left")
    scores = model.compute_reward_score(ids, mask)
    assert scores.shape == (3,) and torch.isfinite(scores).all()

    reward_before = {n: p.detach().clone() for n, p in model.peft_model.named_parameters() if ".reward." in n}
    head_before = model.rewards["reward"].head.weight.detach().clone()
    optimizer = torch.optim.AdamW(model.policy_parameters(), lr=1e-2)
    model.train()
    with model.policy():
        logprobs = model.token_logprobs(ids, mask, response_start=2)
    (-logprobs.mean()).backward()
    # A fresh LoRA has B = 0, so only the B matrices get a gradient at the first step.
    named = {id(p): n for n, p in model.peft_model.named_parameters()}
    lora_b = [p for p in model.policy_parameters() if "lora_B" in named[id(p)]]
    assert lora_b and all(p.grad is not None and p.grad.abs().sum() > 0 for p in lora_b)
    optimizer.step()
    model.eval()
    for name, parameter in model.peft_model.named_parameters():
        if ".reward." in name:
            assert torch.equal(parameter, reward_before[name])
    assert torch.equal(model.rewards["reward"].head.weight, head_before)
    with model.policy(), torch.no_grad():
        updated = model.token_logprobs(ids, mask, response_start=2)
    with model.reference(), torch.no_grad():
        reference = model.token_logprobs(ids, mask, response_start=2)
    assert (updated - logprobs.detach()).abs().max() > 1e-4
    assert (updated - reference).abs().max() > 1e-4
    with model.policy():
        completions = model.sample(ids, mask, SamplingSettings(1.0, 3, (), pad_token_id=0))
    assert completions.shape == (3, 3)


# ---------------------------------------------------------------------- views


def _snapshot(model: MultiAdapterModel):
    return (
        model.peft_model.active_adapter,
        model._adapters_disabled(),
        [(n, p.requires_grad) for n, p in model.peft_model.named_parameters()],
        [(n, m.training) for n, m in model.peft_model.named_modules()],
    )


def test_views_nest_and_restore_everything_on_exceptions(llama_model):
    model = llama_model
    model.train()
    try:
        # A mixed state the views must restore exactly: one module in eval, the rest training.
        model.peft_model.get_base_model().model.layers[0].eval()
        before = _snapshot(model)
        with pytest.raises(RuntimeError, match="boom"), model.use_adapter("reward"):
            assert model.peft_model.active_adapter == "reward"
            with model.reference():
                assert model._adapters_disabled()
                with model.policy():
                    assert model.peft_model.active_adapter == "policy" and not model._adapters_disabled()
                    raise RuntimeError("boom")
        assert _snapshot(model) == before
        with model.use_adapter("reward"):
            with model.reference():
                pass
            assert not model._adapters_disabled() and model.peft_model.active_adapter == "reward"
            # requires_grad never changes inside a view: a frozen adapter never becomes trainable.
            trainable = {n for n, p in model.peft_model.named_parameters() if p.requires_grad}
            assert trainable and all(".policy." in n for n in trainable)
        assert _snapshot(model) == before
    finally:
        model.eval()


def test_use_adapter_rejects_unknown_names(llama_model):
    with pytest.raises(ValueError, match="no adapter named 'value'"):
        llama_model.use_adapter("value")


def test_scoring_runs_in_eval_without_grad_and_restores_train_mode(llama_model):
    model = llama_model
    model.train()
    try:
        ids, mask = padded_batch("right")
        scores = model.compute_reward_score(ids, mask)
        assert not scores.requires_grad
        assert all(m.training for m in model.peft_model.modules())
        assert model.peft_model.active_adapter == "policy"
    finally:
        model.eval()


def test_reference_base_equals_the_plain_base_model(llama_model, tiny_llama_dir):
    ids, mask = padded_batch("right")
    plain = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = plain(input_ids=ids, attention_mask=mask, position_ids=position_ids_from_mask(mask)).logits
    expected = full_softmax_logprobs(logits[:, 1:-1], ids[:, 2:], 1.0)
    with llama_model.reference(), torch.no_grad():
        got = llama_model.token_logprobs(ids, mask, response_start=2)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)


# ---------------------------------------------------------------------- log-probs


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("chunk_size", [None, 1, 5])
def test_token_logprobs_match_full_log_softmax(llama_model, temperature, chunk_size):
    ids, mask = padded_batch("left")
    # Give the policy non-zero LoRA weights so the policy view differs from the base.
    with moved_policy(llama_model), llama_model.policy(), torch.no_grad():
        logits = llama_model.peft_model(
            input_ids=ids, attention_mask=mask, position_ids=position_ids_from_mask(mask)
        ).logits
        logprobs, entropy = llama_model.token_logprobs(
            ids, mask, response_start=3, temperature=temperature, with_entropy=True, chunk_size=chunk_size
        )
    scaled = logits[:, 2:-1].float() / temperature
    expected = full_softmax_logprobs(logits[:, 2:-1], ids[:, 3:], temperature)
    expected_entropy = -(scaled.softmax(-1) * scaled.log_softmax(-1)).sum(-1)
    assert logprobs.dtype == torch.float32 and logprobs.shape == (3, ids.shape[1] - 3)
    torch.testing.assert_close(logprobs, expected, rtol=0, atol=1e-5)
    torch.testing.assert_close(entropy, expected_entropy, rtol=0, atol=1e-5)


def test_token_logprobs_rejects_bad_response_start(llama_model):
    ids, mask = padded_batch("left")
    with pytest.raises(ValueError, match="response_start"):
        llama_model.token_logprobs(ids, mask, response_start=0)
    with pytest.raises(ValueError, match="response_start"):
        llama_model.token_logprobs(ids, mask, response_start=ids.shape[1])


# ---------------------------------------------------------------------- policy adapters and reference


def test_initial_policy_reference_from_an_adapter_directory(tiny_llama_dir, tmp_path):
    start = MultiAdapterModel.from_pretrained(
        tiny_llama_dir, policy_adapter=LoraConfig(r=4, init_lora_weights=False)
    )
    start.save_policy_adapter(tmp_path / "sft")
    model = MultiAdapterModel.from_pretrained(tiny_llama_dir, policy_adapter=tmp_path / "sft")
    assert model.reference_mode == "initial-policy"
    assert set(model.adapter_names) == {"policy", "policy-reference"}
    ids, mask = padded_batch("right")
    with model.policy(), torch.no_grad():
        policy_before = model.token_logprobs(ids, mask, response_start=1)
    with model.reference(), torch.no_grad():
        reference_before = model.token_logprobs(ids, mask, response_start=1)
    with start.policy(), torch.no_grad():
        saved_policy = start.token_logprobs(ids, mask, response_start=1)
    torch.testing.assert_close(reference_before, policy_before, rtol=0, atol=0)
    torch.testing.assert_close(policy_before, saved_policy, rtol=0, atol=1e-6)

    optimizer = torch.optim.SGD(model.policy_parameters(), lr=0.5)
    with model.policy():
        (-model.token_logprobs(ids, mask, response_start=1).mean()).backward()
    optimizer.step()
    with model.reference(), torch.no_grad():
        reference_after = model.token_logprobs(ids, mask, response_start=1)
    with model.policy(), torch.no_grad():
        policy_after = model.token_logprobs(ids, mask, response_start=1)
    torch.testing.assert_close(reference_after, reference_before, rtol=0, atol=0)
    assert (policy_after - policy_before).abs().max() > 1e-3


def test_reference_modes(tiny_llama_dir):
    explicit = MultiAdapterModel.from_pretrained(tiny_llama_dir, reference="initial-policy")
    assert explicit.reference_mode == "initial-policy" and "policy-reference" in explicit.adapter_names
    with pytest.raises(ValueError, match="reference must be one of"):
        MultiAdapterModel.from_pretrained(tiny_llama_dir, reference="sft")


def test_default_policy_lora_covers_all_linear_layers(llama_model):
    lora_modules = {
        n.split(".lora_A")[0] for n, _ in llama_model.peft_model.named_parameters() if "lora_A.policy" in n
    }
    projections = {name.rsplit(".", 1)[-1] for name in lora_modules}
    assert projections == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    config = llama_model.peft_model.peft_config["policy"]
    assert (config.r, config.lora_alpha, config.lora_dropout) == (16, 32, 0.0)


def test_save_policy_adapter_round_trip(llama_model, tiny_llama_dir, tmp_path):
    with moved_policy(llama_model):
        llama_model.save_policy_adapter(tmp_path / "out")
        ids, mask = padded_batch("right")
        with llama_model.policy(), torch.no_grad():
            expected = llama_model.peft_model(input_ids=ids, attention_mask=mask).logits
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        "adapter_config.json",
        "adapter_model.safetensors",
    ]
    keys = load_file(str(tmp_path / "out" / "adapter_model.safetensors")).keys()
    assert keys and not any("reward" in k or "score" in k for k in keys)
    base = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    loaded = PeftModel.from_pretrained(base, str(tmp_path / "out")).eval()
    with torch.no_grad():
        torch.testing.assert_close(
            loaded(input_ids=ids, attention_mask=mask).logits, expected, rtol=0, atol=1e-6
        )


@pytest.mark.parametrize("use_dora", [False, True])
def test_a_saved_policy_adapter_is_read_once_and_computes_what_peft_loads(
    tiny_llama_dir, tmp_path, monkeypatch, use_dora
):
    """marl reads a policy folder once (its checks need the tensors before the base loads) and hands PEFT the
    tensors it read: PEFT's own folder reader is never called, and the policy, as the first adapter and as one
    added later, computes the logits of ``PeftModel.from_pretrained`` on the same folder."""
    import peft.peft_model

    base = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    torch.manual_seed(5)
    saved = get_peft_model(base, LoraConfig(r=4, target_modules="all-linear", use_dora=use_dora))
    with torch.no_grad():
        for name, parameter in saved.named_parameters():
            if "lora_B" in name:
                parameter.normal_(std=0.1)
    saved.save_pretrained(tmp_path / "policy")
    ids, mask = padded_batch("right")
    reference = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32), str(tmp_path / "policy")
    ).eval()
    with torch.no_grad():
        expected = reference(input_ids=ids, attention_mask=mask).logits

    def read_again(*args, **kwargs):
        raise AssertionError("PEFT opened the adapter folder a second time")

    monkeypatch.setattr(peft.peft_model, "load_peft_weights", read_again)
    model = MultiAdapterModel.from_pretrained(tiny_llama_dir, policy_adapter=tmp_path / "policy")
    model.add_policy("second", tmp_path / "policy")
    for name in ("policy", "second"):
        with model.policy(name), torch.no_grad():
            logits = model.peft_model(input_ids=ids, attention_mask=mask).logits
        torch.testing.assert_close(logits, expected, rtol=0, atol=1e-6)
    assert all(parameter.requires_grad for parameter in model.policy_parameters())


def test_policy_adapter_rejects_reward_adapters(tiny_llama_dir, reward_adapter_factory):
    with pytest.raises(ValueError, match="pass it with --reward_adapter"):
        MultiAdapterModel.from_pretrained(tiny_llama_dir, policy_adapter=reward_adapter_factory("llama"))


# ---------------------------------------------------------------------- reward adapter validation


def _copy_adapter(source: Path, target: Path) -> Path:
    shutil.copytree(source, target)
    return target


def _edit_weights(directory: Path, edit) -> None:
    file = directory / "adapter_model.safetensors"
    state = load_file(str(file))
    edit(state)
    save_file(state, str(file))


def test_reward_validation_missing_directory(tiny_llama_dir, tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        MultiAdapterModel.from_pretrained(tiny_llama_dir, reward_adapter=tmp_path / "nope")


def test_reward_validation_not_a_peft_adapter(tiny_llama_dir):
    with pytest.raises(ValueError, match="not a PEFT adapter"):
        MultiAdapterModel.from_pretrained(tiny_llama_dir, reward_adapter=tiny_llama_dir)


def test_reward_validation_no_score_head(tiny_llama_dir, llama_model, tmp_path):
    llama_model.save_policy_adapter(tmp_path / "causal")
    with pytest.raises(ValueError, match="no score head"):
        MultiAdapterModel.from_pretrained(tiny_llama_dir, reward_adapter=tmp_path / "causal")


def test_reward_validation_head_size_mismatch(tiny_llama_dir, reward_adapter_factory, tmp_path):
    adapter = _copy_adapter(reward_adapter_factory("llama"), tmp_path / "wide")
    _edit_weights(adapter, lambda s: s.__setitem__("base_model.model.score.weight", torch.zeros(1, 96)))
    with pytest.raises(ValueError, match="hidden size 64"):
        MultiAdapterModel.from_pretrained(tiny_llama_dir, reward_adapter=adapter)


def test_reward_validation_targets_missing_in_base(tiny_model_factory, reward_adapter_factory):
    with pytest.raises(ValueError, match="do not exist in this base"):
        MultiAdapterModel.from_pretrained(
            tiny_model_factory("gpt_neox"), reward_adapter=reward_adapter_factory("llama"), reference="base"
        )


def test_reward_validation_lora_shape_mismatch(tiny_llama_dir, reward_adapter_factory, tmp_path):
    adapter = _copy_adapter(reward_adapter_factory("llama"), tmp_path / "shape")
    key = "base_model.model.model.layers.0.mlp.down_proj.lora_A.weight"
    _edit_weights(adapter, lambda s: s.__setitem__(key, torch.zeros(4, 256)))
    with pytest.raises(ValueError, match="input features"):
        MultiAdapterModel.from_pretrained(tiny_llama_dir, reward_adapter=adapter)


def test_reward_validation_other_base_warns(tiny_llama_dir, reward_adapter_factory, tmp_path):
    adapter = _copy_adapter(reward_adapter_factory("llama"), tmp_path / "other")
    config_file = adapter / "adapter_config.json"
    config = json.loads(config_file.read_text())
    config["base_model_name_or_path"] = "someone/another-model"
    config_file.write_text(json.dumps(config))
    with pytest.warns(UserWarning, match="was trained on 'someone/another-model'"):
        MultiAdapterModel.from_pretrained(tiny_llama_dir, reward_adapter=adapter)


def test_reward_validation_pickle_needs_opt_in(tiny_llama_dir, reward_adapter_factory, tmp_path, llama_model):
    adapter = _copy_adapter(reward_adapter_factory("llama"), tmp_path / "pickled")
    state = load_file(str(adapter / "adapter_model.safetensors"))
    torch.save(state, adapter / "adapter_model.bin")
    (adapter / "adapter_model.safetensors").unlink()
    with pytest.raises(ValueError, match="allow_pickle=True"):
        MultiAdapterModel.from_pretrained(tiny_llama_dir, reward_adapter=adapter)
    model = MultiAdapterModel.from_pretrained(tiny_llama_dir, reward_adapter=adapter, allow_pickle=True)
    ids, mask = padded_batch("right")
    torch.testing.assert_close(
        model.compute_reward_score(ids, mask), llama_model.compute_reward_score(ids, mask), rtol=0, atol=1e-6
    )


def test_reward_two_label_head_reads_the_log_odds(tiny_llama_dir, reward_adapter_factory, tmp_path):
    """A 2-label head scores the log-odds of label 1 over label 0, as a softmax over the two labels compares
    them: equal to transformers' logits[:, 1] - logits[:, 0] of the same adapter."""
    adapter = _copy_adapter(reward_adapter_factory("llama"), tmp_path / "two")
    key = "base_model.model.score.weight"
    torch.manual_seed(0)
    _edit_weights(adapter, lambda s: s.__setitem__(key, torch.cat([torch.randn(1, 64), s[key]])))
    model = MultiAdapterModel.from_pretrained(tiny_llama_dir, reward_adapter=adapter)
    assert model.rewards["reward"].info.num_labels == 2
    classifier = AutoModelForSequenceClassification.from_pretrained(tiny_llama_dir, num_labels=2)
    reference = PeftModel.from_pretrained(classifier, str(adapter)).eval()
    ids, mask = padded_batch("right")
    with torch.no_grad():
        logits = reference(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(
        model.compute_reward_score(ids, mask), logits[:, 1] - logits[:, 0], rtol=0, atol=1e-5
    )


def test_reward_head_is_frozen_and_outside_the_optimizer(llama_model):
    head = llama_model.rewards["reward"].head
    assert not any(p.requires_grad for p in head.parameters())
    policy_ids = {id(p) for p in llama_model.policy_parameters()}
    assert not any(id(p) in policy_ids for p in head.parameters())
    assert head.weight.dtype == llama_model.dtype


def test_compute_reward_score_without_adapter_explains(tiny_llama_dir):
    model = MultiAdapterModel.from_pretrained(tiny_llama_dir)
    assert not model.has_reward_adapter
    with pytest.raises(ConfigError, match="reward_adapter="):
        model.compute_reward_score(*padded_batch("left"))


def test_bad_arguments_fail_early(tiny_llama_dir):
    with pytest.raises(ValueError, match="quantization must be one of"):
        MultiAdapterModel.from_pretrained(tiny_llama_dir, quantization="nf4")
    with pytest.raises(TypeError, match="policy_adapter must be"):
        MultiAdapterModel.from_pretrained(tiny_llama_dir, policy_adapter=16)


# ---------------------------------------------------------------------- one copy of the base


def test_base_weights_exist_once(tiny_llama_dir, reward_adapter_factory):
    model = MultiAdapterModel.from_pretrained(
        tiny_llama_dir,
        reward_adapter=reward_adapter_factory("llama"),
        policy_adapter=LoraConfig(r=4, init_lora_weights=False),
    )
    assert set(model.adapter_names) == {"policy", "policy-reference", "reward"}
    storages = {}
    for name, parameter in model.peft_model.named_parameters():
        if "lora_" in name:
            continue
        pointer = parameter.untyped_storage().data_ptr()
        assert pointer not in storages, f"{name} shares storage with {storages[pointer]}"
        storages[pointer] = name
    base = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
    assert len(storages) == len(list(base.parameters()))
    ids, mask = padded_batch("left")
    model.compute_reward_score(ids, mask)
    with model.reference(), torch.no_grad():
        model.token_logprobs(ids, mask, response_start=2)
    del base
    gc.collect()


def test_memory_report_counts_the_reward_head(llama_model):
    report = llama_model.memory_report()
    assert report.score_head_bytes == 64 * 4  # Linear(64, 1) without bias, float32
    assert set(report.adapter_bytes) == {"policy", "reward"}
    assert "score head" in str(report)


# ---------------------------------------------------------------------- options


@pytest.mark.parametrize(
    ("family", "quantization"), [*((name, None) for name in FAMILIES), ("llama", "4bit")]
)
def test_gradient_checkpointing_gives_the_same_gradients(family, quantization, family_dir):
    ids, mask = padded_batch("left")
    gradients = []
    exclude = list(FAMILY_SPECS[family].lora_exclude_modules) or None
    for checkpointing in (False, True):
        model = MultiAdapterModel.from_pretrained(
            family_dir(family),
            quantization=quantization,
            gradient_checkpointing=checkpointing,
            policy_adapter=LoraConfig(
                r=4, init_lora_weights=False, target_modules="all-linear", exclude_modules=exclude
            ),
            reference="base",
        )
        assert model.peft_model.get_base_model().is_activation_checkpointing == checkpointing
        # no input-gradient hook: non-reentrant checkpointing needs none; a compiled decode cannot trace it
        embeddings = model.peft_model.get_base_model().get_input_embeddings()
        assert not embeddings(ids).requires_grad
        torch.manual_seed(0)
        with torch.no_grad():
            for p in model.policy_parameters():
                p.normal_(std=0.05)
        model.train()
        with model.policy():
            model.token_logprobs(ids, mask, response_start=2).sum().backward()
        gradients.append(torch.cat([p.grad.flatten() for p in model.policy_parameters()]))
    torch.testing.assert_close(gradients[1], gradients[0], rtol=1e-4, atol=1e-6)


def test_bfloat16_compute_dtype(tiny_llama_dir, reward_adapter_factory):
    model = MultiAdapterModel.from_pretrained(
        tiny_llama_dir, dtype=torch.bfloat16, reward_adapter=reward_adapter_factory("llama")
    )
    # the score head runs in float32 whatever the compute dtype: bf16 would round scores to ~3 digits
    assert model.dtype == torch.bfloat16 and model.rewards["reward"].head.weight.dtype == torch.float32
    ids, mask = padded_batch("right")
    assert model.compute_reward_score(ids, mask).dtype == torch.float32
    with model.reference(), torch.no_grad():
        assert model.token_logprobs(ids, mask, response_start=2).dtype == torch.float32


def test_score_head_runs_in_float32_under_autocast(tiny_llama_dir, tiny_reward_adapter):
    """Mixed precision runs the rollout under autocast, where an ``nn.Linear`` computes in bf16: the score
    head must not, or every score is rounded to bf16 (steps of 0.0625 around 12). The score equals the float32
    head applied, outside autocast, to the hidden state it read."""
    model = MultiAdapterModel.from_pretrained(tiny_llama_dir, reward_adapter=tiny_reward_adapter)
    head = model.rewards["reward"].head
    torch.manual_seed(0)
    with torch.no_grad():  # scores of several units, where bf16 steps are 1/32 or coarser
        head.weight.normal_(std=10.0 / head.weight.shape[1] ** 0.5)
    pooled = []
    hook = head.register_forward_hook(lambda module, inputs, output: pooled.append(inputs[0].detach()))
    ids, mask = padded_batch("left")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        scores = model.compute_reward_score(ids, mask)
    hook.remove()
    (hidden,) = pooled
    assert hidden.dtype == torch.float32
    expected = torch.nn.functional.linear(hidden, head.weight, head.bias).squeeze(-1)
    assert scores.abs().max() > 4
    torch.testing.assert_close(scores.float(), expected, rtol=1e-6, atol=1e-6)
    assert scores.dtype == torch.float32


# ---------------------------------------------------------------------- process memory

_MEMORY_PROBE = """
import ctypes, gc, json, sys
import torch
from peft import LoraConfig
from marl.model.multi_adapter import MultiAdapterModel

def memory(model_dir):
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    anonymous = next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("RssAnon")) * 1024
    mapped, current = 0, None
    for line in open("/proc/self/smaps"):
        fields = line.split()
        if not fields[0].endswith(":"):
            current = fields[5] if len(fields) >= 6 else None
        elif fields[0] == "Rss:" and current and current.startswith(model_dir):
            mapped += int(fields[1]) * 1024
    return anonymous, mapped

model_dir, quantization, reward_dir = sys.argv[1], sys.argv[2] or None, sys.argv[3]
ids = torch.tensor([[5, 6, 7, 8]])
mask = torch.ones_like(ids)
anonymous_before, mapped_before = memory(model_dir)
model = MultiAdapterModel.from_pretrained(
    model_dir, quantization=quantization, reward_adapter=reward_dir,
    policy_adapter=LoraConfig(r=8, init_lora_weights=False),
)
with torch.no_grad():
    for view in (model.policy(), model.reference()):
        with view:
            model.token_logprobs(ids, mask, response_start=1)
model.compute_reward_score(ids, mask)
anonymous_after, mapped_after = memory(model_dir)
report = model.memory_report()
print(json.dumps({"anonymous": anonymous_after - anonymous_before, "mapped": mapped_after - mapped_before,
                  "base": report.base_bytes, "total": report.total_bytes}))
"""


@pytest.fixture(scope="module")
def medium_llama(tmp_path_factory) -> tuple[Path, Path]:
    """A 21M-parameter llama (85 MB in float32): big enough for process memory to show one copy or three."""
    from transformers import LlamaConfig

    directory = tmp_path_factory.mktemp("medium-llama")
    tokenizer = build_tiny_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=512,
        intermediate_size=1024,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=8,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=1,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory, train_reward_adapter_with_trl(directory, tmp_path_factory.mktemp("medium-reward"))


@pytest.mark.slow
@pytest.mark.parametrize("quantization", [None, "4bit"])
def test_process_memory_after_load_is_one_base(quantization, medium_llama, tmp_path):
    """Growth of resident memory (anonymous + pages of the checkpoint mapped by the model) after loading the
    base with policy, reference and reward adapters, and using all three, stays near ONE base.

    Separate copies would need 3x the base. transformers reads the checkpoint through mmap: an unquantized
    base stays those mapped pages, a quantized one keeps none of them (its growth is all anonymous).
    """
    import subprocess
    import sys

    model_dir, reward_dir = medium_llama
    probe = tmp_path / "probe.py"
    probe.write_text(_MEMORY_PROBE)
    result = subprocess.run(
        [sys.executable, str(probe), str(model_dir), quantization or "", str(reward_dir)],
        capture_output=True,
        text=True,
        check=True,
    )
    numbers = json.loads(result.stdout.strip().splitlines()[-1])
    growth = numbers["anonymous"] + numbers["mapped"]
    if quantization is not None:
        assert numbers["mapped"] == 0, numbers
    # Quantizing stages float32 weights that the allocator may keep (measured up to 1.5x the card under load);
    # 2x the card is still well below the 3 bases + adapters that separate copies hold.
    upper = (1.5 if quantization is None else 2.0) * numbers["total"]
    assert upper < 3 * numbers["base"] + (numbers["total"] - numbers["base"])
    assert 0.8 * numbers["base"] < growth < upper, numbers


# ---------------------------------------------------------------------- the bundled model


@pytest.mark.slow
def test_bundled_smollm2_in_4bit_loads_scores_and_switches(tmp_path):
    from transformers import AutoTokenizer

    from marl.data.assets import EMBEDDED_MODEL_ID, resolve_model_path

    base_dir = Path(resolve_model_path(EMBEDDED_MODEL_ID))
    reward_dir = train_reward_adapter_with_trl(base_dir, tmp_path / "reward")
    model = MultiAdapterModel.from_pretrained(
        EMBEDDED_MODEL_ID, quantization="4bit", reward_adapter=reward_dir
    )
    assert model.peft_model.get_base_model().is_loaded_in_4bit
    tokenizer = AutoTokenizer.from_pretrained(model.name_or_path)
    tokenizer.padding_side = "left"
    batch = tokenizer(["a wonderful, moving film", "dull"], return_tensors="pt", padding=True)
    scores = model.compute_reward_score(batch["input_ids"], batch["attention_mask"])
    assert scores.shape == (2,) and torch.isfinite(scores).all()
    before = _snapshot(model)
    with model.use_adapter("reward"), model.reference(), torch.no_grad():
        ref = model.token_logprobs(batch["input_ids"], batch["attention_mask"], response_start=1)
    assert _snapshot(model) == before
    with model.policy(), torch.no_grad():
        policy = model.token_logprobs(batch["input_ids"], batch["attention_mask"], response_start=1)
    torch.testing.assert_close(policy, ref, rtol=0, atol=1e-5)  # fresh LoRA: policy == base at the start
    report = model.memory_report()
    assert report.base_bytes < 0.5 * report.base_parameters * 4  # well under float32 size
    with model.policy():
        completions = model.sample(
            batch["input_ids"], batch["attention_mask"], SamplingSettings(0.7, 4, (), 2)
        )
    assert completions.shape == (2, 4)


def test_reward_validation_incomplete_adapter(tiny_llama_dir, reward_adapter_factory, tmp_path):
    adapter = _copy_adapter(reward_adapter_factory("llama"), tmp_path / "incomplete")
    _edit_weights(adapter, lambda s: s.pop("base_model.model.model.layers.1.mlp.up_proj.lora_B.weight"))
    with pytest.raises(ValueError, match="is incomplete"):
        MultiAdapterModel.from_pretrained(tiny_llama_dir, reward_adapter=adapter)


def test_reward_head_bias_and_modules_to_save_keys(
    tiny_llama_dir, reward_adapter_factory, tmp_path, llama_model
):
    """The head is found by its exact key (also PEFT's modules_to_save form) and its bias is applied."""
    adapter = _copy_adapter(reward_adapter_factory("llama"), tmp_path / "biased")

    def rename_and_add_bias(state):
        state["base_model.model.score.modules_to_save.default.weight"] = state.pop(
            "base_model.model.score.weight"
        )
        state["base_model.model.score.modules_to_save.default.bias"] = torch.tensor([0.75])

    _edit_weights(adapter, rename_and_add_bias)
    model = MultiAdapterModel.from_pretrained(tiny_llama_dir, reward_adapter=adapter)
    assert model.rewards["reward"].info.has_bias
    ids, mask = padded_batch("right")
    torch.testing.assert_close(
        model.compute_reward_score(ids, mask),
        llama_model.compute_reward_score(ids, mask) + 0.75,
        rtol=0,
        atol=1e-6,
    )


def test_sample_restores_train_mode_and_adapter(llama_model):
    llama_model.train()
    try:
        with llama_model.use_adapter("reward"):
            out = llama_model.sample(*padded_batch("left"), SamplingSettings(0.7, 2, (), pad_token_id=0))
            assert llama_model.peft_model.active_adapter == "reward"
        assert out.shape[1] == 2 and not out.requires_grad
        assert all(m.training for m in llama_model.peft_model.modules())
    finally:
        llama_model.eval()
