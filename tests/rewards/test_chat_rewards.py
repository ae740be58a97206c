"""Conversational prompts are scored as TRL 1.16 scores them with a reward model.

TRL's ``RLOOTrainer`` / ``GRPOTrainer`` (``_calculate_rewards``, reward-model branch) give a reward model the
prompt's messages followed by ``{"role": "assistant", "content": completion}``, rendered whole through the
chat template by ``trl.data_utils.apply_chat_template`` and tokenised without special tokens; that is also how
``RewardTrainer`` renders conversational pairs. Here marl's rollout, ``EosTerminatedAdapterReward`` and
``RewardAdapterFunction`` are checked against exactly that call, read by transformers + PEFT
(``AutoModelForSequenceClassification`` + ``PeftModel.from_pretrained``), on every family of
``tests/support/families.py`` (plain, ChatML and Llama-3 chat templates).
"""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, PeftModel
from transformers import AutoModelForSequenceClassification, AutoTokenizer
from trl.data_utils import apply_chat_template, is_conversational

from marl import MultiAdapterModel, RewardAdapterFunction
from marl.data.prompts import prepare_prompts
from marl.model.rows import attention_window
from marl.model.sampling import pad_token_id
from marl.rewards import AdapterReward, EosTerminatedAdapterReward
from marl.rollout.samplers import SamplerSettings, TransformersSampler
from marl.rollout.scoring import Scorer

from support.families import FAMILIES, FAMILY_SPECS
from support.tiny import save_reward_adapter

CLASSIFIER_FAMILIES = [name for name in FAMILIES if FAMILY_SPECS[name].sequence_classification]
CONVERSATIONS = [
    [{"role": "user", "content": "write a short review of this movie"}],
    [
        {"role": "system", "content": "an honest story, well told"},
        {"role": "user", "content": "the movie was great"},
    ],
    [
        {"role": "user", "content": "review of the film"},
        {"role": "assistant", "content": "a small delight"},
        {"role": "user", "content": "and the plot?"},
    ],
]
K = 3


def trl_reward_texts(tokenizer, prompts: list, completions: list[str]) -> list[str]:
    """The texts TRL 1.16's RLOOTrainer gives a reward model for conversational prompts (its ``_generate``
    wraps each decoded completion as an assistant message; ``_calculate_rewards`` renders prompt + it)."""
    messages = [[{"role": "assistant", "content": text}] for text in completions]
    assert is_conversational({"prompt": prompts[0]})
    return [
        apply_chat_template({"messages": prompt + completion}, tokenizer)["text"]
        for prompt, completion in zip(prompts, messages, strict=True)
    ]


def transformers_reward(base_dir, adapter_dir, tokenizer, texts: list[str]) -> torch.Tensor:
    """The reward model as transformers + PEFT compute it on ``texts``, tokenised and padded as TRL does."""
    classifier = AutoModelForSequenceClassification.from_pretrained(
        base_dir, num_labels=1, dtype=torch.float32
    )
    classifier.config.pad_token_id = pad_token_id(tokenizer)  # what TRL's RewardTrainer sets
    reference = PeftModel.from_pretrained(classifier, str(adapter_dir)).eval()
    inputs = tokenizer(
        text=texts, return_tensors="pt", padding=True, padding_side="right", add_special_tokens=False
    )
    with torch.no_grad():
        return reference(**inputs).logits[:, 0]


def load_model(base_dir, adapter_dir, family: str) -> MultiAdapterModel:
    policy = LoraConfig(
        r=4,
        lora_alpha=8,
        target_modules="all-linear",
        exclude_modules=list(FAMILY_SPECS[family].lora_exclude_modules) or None,
        task_type="CAUSAL_LM",
    )
    return MultiAdapterModel.from_pretrained(base_dir, reward_adapter=adapter_dir, policy_adapter=policy)


@pytest.mark.parametrize("family", CLASSIFIER_FAMILIES)
def test_rollout_scores_conversations_as_trl_renders_them(family, family_dir, tmp_path):
    base_dir = family_dir(family)
    adapter = save_reward_adapter(base_dir, tmp_path / "reward")
    tokenizer = AutoTokenizer.from_pretrained(base_dir)
    model = load_model(base_dir, adapter, family)
    sampler = TransformersSampler(
        model, tokenizer, SamplerSettings(temperature=1.0, response_length=8, stop_at_eos=True)
    )
    scorer = Scorer(model, tokenizer, temperature=1.0)
    prompts = prepare_prompts(
        [{"prompt": conversation} for conversation in CONVERSATIONS],
        tokenizer,
        "prompts",
        context_length=None,
        response_length=8,
    )
    torch.manual_seed(0)
    samples = sampler.sample(sampler.batch(prompts), K)
    batch = scorer.scoring_batch(samples)
    ours = AdapterReward(model).score(batch)

    conversations = CONVERSATIONS * K  # k-major, as the rollout
    texts = trl_reward_texts(tokenizer, conversations, samples.completions)
    theirs = transformers_reward(base_dir, adapter, tokenizer, texts)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)

    # Each prompt's k rows were computed with their shared prefix once, where the model allows packing (no
    # layers with state, no sliding window shorter than the packed rows).
    chunks = list(batch.chunks)
    assert len(chunks) == 1
    packed = chunks[0][3]
    if scorer.share_prompt_prefix and attention_window(model.config) is None:
        assert packed is not None and packed.input_ids.shape[0] == len(CONVERSATIONS)
    elif not scorer.share_prompt_prefix:
        assert packed is None

    # The demo's scorer reads conversations the same way (its EOS is the template's turn end).
    eos_terminated = EosTerminatedAdapterReward(model, tokenizer).score(batch)
    torch.testing.assert_close(eos_terminated, theirs, rtol=0, atol=1e-5)


@pytest.mark.parametrize("family", ["llama", "llama3", "qwen2"])
def test_reward_adapter_function_reads_conversations_as_trl(family, family_dir, tmp_path):
    """TRL passes conversational completions as message lists; a text completion of a conversation (how
    marl hands completions over) is read as the same assistant message."""
    base_dir = family_dir(family)
    adapter = save_reward_adapter(base_dir, tmp_path / "reward")
    tokenizer = AutoTokenizer.from_pretrained(base_dir)
    completions = [" a lovely charming film ", "dull", "the plot falls apart"]
    with pytest.warns(DeprecationWarning, match="marl.integrations.trl.reward_adapter_function"):
        reward = RewardAdapterFunction(str(base_dir), str(adapter), name="sentiment")
    theirs = transformers_reward(
        base_dir, adapter, tokenizer, trl_reward_texts(tokenizer, CONVERSATIONS, completions)
    )
    as_messages = reward(CONVERSATIONS, [[{"role": "assistant", "content": text}] for text in completions])
    torch.testing.assert_close(torch.tensor(as_messages), theirs, rtol=0, atol=1e-5)
    torch.testing.assert_close(torch.tensor(reward(CONVERSATIONS, completions)), theirs, rtol=0, atol=1e-5)


def test_prefix_sharing_checks_the_tokens_the_rows_share(family_dir):
    """A rendered conversation is tokenised whole: the prefix its rows share is what their tokens share,
    and a group whose rows share no token is computed unshared."""
    base_dir = family_dir("llama")
    tokenizer = AutoTokenizer.from_pretrained(base_dir)
    model = load_model(base_dir, save_reward_adapter(base_dir, base_dir.parent / "shared-reward"), "llama")
    scorer = Scorer(model, tokenizer, temperature=1.0)
    rows = [[5, 6, 7, 8], [5, 6, 9], [20, 21], [20, 21]]
    ids, mask, packed = scorer.shared_prefix_rows(rows, torch.tensor([0, 0, 1, 1]))
    assert packed is not None
    # group 0 shares [5, 6]; group 1's rows are equal, and each keeps its last token as its completion
    assert packed.input_ids.tolist() == [[5, 6, 7, 8, 9, 0], [20, 21, 0, 21, 0, 0]]
    torch.testing.assert_close(
        model.compute_reward_score(ids, mask, packed=packed), model.compute_reward_score(ids, mask)
    )
    ids, mask, packed = scorer.shared_prefix_rows([[5, 6], [7, 8]], torch.tensor([0, 0]))
    assert packed is None
    assert ids.tolist() == [[5, 6], [7, 8]]
