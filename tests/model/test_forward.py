"""Chunked float32 log-probs and entropies against the full log-softmax."""

from __future__ import annotations

import pytest
import torch

from marl.model.forward import entropy_from_logits, logprobs_from_hidden, selective_log_softmax


def _reference(logits: torch.Tensor, tokens: torch.Tensor, temperature: float):
    log_probs = torch.log_softmax(logits.double() / temperature, dim=-1)
    chosen = log_probs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    entropy = -(log_probs.exp() * log_probs).sum(-1)
    return chosen.float(), entropy.float()


@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.3])
@pytest.mark.parametrize("chunk_size", [None, 1, 7, 1000])
def test_matches_full_log_softmax(temperature, chunk_size):
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, 50, generator=generator) * 4
    tokens = torch.randint(0, 50, (3, 5), generator=generator)
    expected_logprobs, expected_entropy = _reference(logits, tokens, temperature)
    logprobs = selective_log_softmax(logits, tokens, temperature, chunk_size=chunk_size)
    entropy = entropy_from_logits(logits, temperature, chunk_size=chunk_size)
    assert logprobs.shape == tokens.shape and entropy.shape == tokens.shape
    torch.testing.assert_close(logprobs, expected_logprobs, rtol=0, atol=1e-5)
    torch.testing.assert_close(entropy, expected_entropy, rtol=0, atol=1e-5)


def test_low_precision_logits_are_upcast_to_float32():
    logits = (torch.randn(4, 6, 40) * 10).to(torch.bfloat16)
    tokens = torch.randint(0, 40, (4, 6))
    logprobs = selective_log_softmax(logits, tokens, 0.7)
    assert logprobs.dtype == torch.float32
    expected, _ = _reference(logits.float(), tokens, 0.7)
    torch.testing.assert_close(logprobs, expected, rtol=0, atol=1e-5)
    assert entropy_from_logits(logits).dtype == torch.float32


def test_gradient_matches_full_log_softmax():
    """The blog's example: logits [1, 2, 1, 1], action 1: d logp / d logits = onehot - softmax."""
    logits = torch.tensor([[1.0, 2.0, 1.0, 1.0]], requires_grad=True)
    selective_log_softmax(logits, torch.tensor([1]), chunk_size=1).sum().backward()
    expected = torch.tensor([[-0.1749, 0.5246, -0.1749, -0.1749]])
    torch.testing.assert_close(logits.grad, expected, rtol=0, atol=1e-4)


def test_uniform_entropy_is_log_vocab():
    entropy = entropy_from_logits(torch.zeros(2, 3, 8), temperature=0.5)
    torch.testing.assert_close(entropy, torch.full((2, 3), torch.log(torch.tensor(8.0)).item()))


def test_extreme_logits_stay_finite():
    logits = torch.tensor([[1e4, -1e4, 0.0]])
    assert torch.isfinite(selective_log_softmax(logits, torch.tensor([1]))).all()
    assert torch.isfinite(entropy_from_logits(logits)).all()


def test_bad_inputs_are_rejected():
    with pytest.raises(ValueError, match="temperature must be > 0"):
        selective_log_softmax(torch.zeros(1, 3), torch.zeros(1, dtype=torch.long), temperature=0)
    with pytest.raises(ValueError, match="tokens must have the shape"):
        selective_log_softmax(torch.zeros(2, 3), torch.zeros(3, dtype=torch.long))


def test_token_logprobs_entropy_is_detached_while_logprobs_keep_their_graph(tiny_llama_dir) -> None:
    from marl import MultiAdapterModel

    model = MultiAdapterModel.from_pretrained(str(tiny_llama_dir))
    ids = torch.randint(3, 300, (2, 6))
    with model.policy():
        logprobs, entropy = model.token_logprobs(
            ids, torch.ones_like(ids), response_start=2, with_entropy=True
        )
    assert logprobs.requires_grad
    assert not entropy.requires_grad
    assert torch.isfinite(entropy).all() and (entropy > 0).all()


@pytest.mark.parametrize("recompute", [False, True])
def test_the_entropy_comes_from_the_log_probs_own_head_products(recompute):
    """One LM head product per chunk in the forward (the entropy reads the same logits), one more per chunk in
    the backward pass with ``recompute``; the log-probs, entropies and gradients are those of the full
    softmax either way."""
    torch.manual_seed(0)
    head = torch.nn.Linear(8, 50, bias=False)
    hidden = torch.randn(10, 8, requires_grad=True)
    targets = torch.randint(0, 50, (10,))
    products = []
    head.register_forward_hook(lambda module, args, output: products.append(args[0].shape[0]))
    logprobs, entropy = logprobs_from_hidden(
        hidden, targets, head, 0.7, chunk_size=4, with_entropy=True, recompute=recompute
    )
    assert products == [4, 4, 2]
    logprobs.sum().backward()
    assert sorted(products) == sorted([4, 4, 2] * (2 if recompute else 1))  # the backward pass: any order
    reference_hidden = hidden.detach().clone().requires_grad_(True)
    full = torch.log_softmax(head(reference_hidden) / 0.7, dim=-1)
    full.gather(-1, targets[:, None]).sum().backward()
    torch.testing.assert_close(logprobs, full.gather(-1, targets[:, None]).squeeze(-1).detach())
    torch.testing.assert_close(entropy, -(full.exp() * full).sum(-1).detach())
    torch.testing.assert_close(hidden.grad, reference_hidden.grad)
    assert not entropy.requires_grad
