"""Rows of several policies in one forward and one backward pass (``MultiAdapterModel.routed``): on every
family of the table each row's log-probs, and each policy's adapter gradients, equal those of the same rows
computed alone under the row's own view, in train mode and with gradient checkpointing."""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig

from marl import MultiAdapterModel
from marl.errors import ConfigError
from marl.model.adapters import BASE_VIEW

from support.families import DTYPES, FAMILIES, FAMILY_SPECS, logprob_tolerance

RESPONSE_START = 4
# Rows of two policies and of the base, interleaved, with left padding of two lengths.
ROW_TOKENS = [
    [5, 6, 7, 8, 9, 10, 11],
    [12, 13, 14, 15, 16, 17],
    [5, 6, 7, 8, 9, 10, 11],
    [7, 8, 9, 10, 11, 12, 13],
]
ROW_ADAPTERS = ["first", "second", BASE_VIEW, "second"]


def policy_lora(family: str) -> LoraConfig:
    exclude = list(FAMILY_SPECS[family].lora_exclude_modules) or None
    return LoraConfig(
        r=4, lora_alpha=8, target_modules="all-linear", exclude_modules=exclude, task_type="CAUSAL_LM"
    )


def two_policies(directory, family: str, dtype: torch.dtype = torch.float32, **options) -> MultiAdapterModel:
    model = MultiAdapterModel.from_pretrained(
        directory, policy_name="first", policy_adapter=policy_lora(family), dtype=dtype, **options
    )
    model.add_policy("second", policy_lora(family))
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():  # policies that differ from the base and from each other
        for parameter in model.policy_parameters("first") + model.policy_parameters("second"):
            parameter.copy_(torch.randn(parameter.shape, generator=generator).to(parameter.dtype) * 0.2)
    return model


def left_padded(rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(row) for row in rows)
    ids = torch.zeros((len(rows), width), dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for index, row in enumerate(rows):
        ids[index, width - len(row) :] = torch.tensor(row)
        mask[index, width - len(row) :] = 1
    return ids, mask


def loss_of(logprobs: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """A loss whose weight differs per row, so that a gradient sent to the wrong adapter shows."""
    weights = torch.tensor([1.0, -2.0, 0.5, 3.0])[rows]
    return (logprobs.float().sum(dim=1) * weights).sum()


def routed_pass(
    model: MultiAdapterModel, ids, mask, stacked: bool = False
) -> tuple[torch.Tensor, dict[str, list[torch.Tensor]]]:
    """The rows in one routed pass: PEFT's mixed batch, or (``stacked``) the GPU's stacked LoRA."""
    model.train()
    for policy in ("first", "second"):
        for parameter in model.policy_parameters(policy):
            parameter.grad = None
    with model.routed(ROW_ADAPTERS, stacked=stacked):
        assert stacked == any(hasattr(layer, "_marl_stack") for layer in model.peft_model.modules())
        logprobs = model.token_logprobs(ids, mask, response_start=RESPONSE_START)
        loss_of(logprobs, [0, 1, 2, 3]).backward()
    return logprobs.detach(), gradients(model)


def solo_pass(model: MultiAdapterModel, ids, mask) -> tuple[torch.Tensor, dict[str, list[torch.Tensor]]]:
    """Each view's rows alone, in its own view, the gradients of all views summed (as one loss would)."""
    model.train()
    for policy in ("first", "second"):
        for parameter in model.policy_parameters(policy):
            parameter.grad = None
    logprobs = torch.zeros(ids.shape[0], ids.shape[1] - RESPONSE_START)
    for view in dict.fromkeys(ROW_ADAPTERS):
        rows = [index for index, name in enumerate(ROW_ADAPTERS) if name == view]
        with model.view(view):
            view_logprobs = model.token_logprobs(ids[rows], mask[rows], response_start=RESPONSE_START)
            loss = loss_of(view_logprobs, rows)
            if loss.requires_grad:
                loss.backward()
        logprobs[rows] = view_logprobs.detach().float()
    return logprobs, gradients(model)


def gradients(model: MultiAdapterModel) -> dict[str, list[torch.Tensor]]:
    return {
        policy: [parameter.grad.clone() for parameter in model.policy_parameters(policy)]
        for policy in ("first", "second")
    }


def assert_close(routed, solo, tolerance: float) -> None:
    """Log-probs within ``tolerance``; each adapter gradient within ``tolerance`` of its largest entry (a
    gradient sent to the wrong adapter is off by about its own size: the rows' weights differ)."""
    routed_logprobs, routed_grads = routed
    solo_logprobs, solo_grads = solo
    torch.testing.assert_close(routed_logprobs.float(), solo_logprobs, atol=tolerance, rtol=tolerance)
    for policy in ("first", "second"):
        for routed_grad, solo_grad in zip(routed_grads[policy], solo_grads[policy], strict=True):
            scale = solo_grad.abs().max().clamp(min=1e-6)
            assert (routed_grad.float() - solo_grad.float()).abs().max() / scale <= tolerance


@pytest.mark.parametrize("stacked", [False, True], ids=["peft", "stacked"])
@pytest.mark.parametrize("family", FAMILIES)
def test_routed_rows_equal_each_view_alone(family_dir, family, stacked):
    model = two_policies(family_dir(family), family)
    ids, mask = left_padded(ROW_TOKENS)
    routed = routed_pass(model, ids, mask, stacked)
    solo = solo_pass(model, ids, mask)
    assert_close(routed, solo, tolerance=1e-5)
    # The rows of the base and of each policy really differ: the routing is not a no-op.
    assert not torch.allclose(routed[0][0], routed[0][2])
    assert all(grad.abs().sum() > 0 for grad in routed[1]["first"] + routed[1]["second"] if grad.numel())


@pytest.mark.parametrize("stacked", [False, True], ids=["peft", "stacked"])
@pytest.mark.parametrize("family", ["llama", "qwen2", "gpt2"])
def test_routed_rows_with_gradient_checkpointing(family_dir, family, stacked):
    """The backward pass of a checkpointed layer computes its forward again: still routed."""
    model = two_policies(family_dir(family), family)
    model.enable_gradient_checkpointing()
    ids, mask = left_padded(ROW_TOKENS)
    assert_close(routed_pass(model, ids, mask, stacked), solo_pass(model, ids, mask), tolerance=1e-5)


@pytest.mark.parametrize("stacked", [False, True], ids=["peft", "stacked"])
@pytest.mark.parametrize("dtype", [dtype for dtype in DTYPES if dtype != torch.float32])
def test_routed_rows_in_low_precision(family_dir, dtype, stacked):
    """In bf16 the base's products round where they are stored, and the routed pass adds each LoRA delta into
    the batch's rounded output where the solo pass adds it into its own: the two differ by rounding. Log-probs
    stay within the family table's 4 eps; each gradient, measured against the float32 model's, is no further
    from it than twice the solo pass's own bf16 error (or 8 eps of its largest entry)."""
    ids, mask = left_padded(ROW_TOKENS)
    exact = solo_pass(two_policies(family_dir("llama"), "llama"), ids, mask)
    model = two_policies(family_dir("llama"), "llama", dtype=dtype)
    routed, solo = routed_pass(model, ids, mask, stacked), solo_pass(model, ids, mask)
    torch.testing.assert_close(routed[0], solo[0], atol=logprob_tolerance(dtype), rtol=0)
    eps = torch.finfo(dtype).eps
    for policy in ("first", "second"):
        for exact_grad, routed_grad, solo_grad in zip(
            exact[1][policy], routed[1][policy], solo[1][policy], strict=True
        ):
            scale = exact_grad.abs().max()
            routed_error = (routed_grad.float() - exact_grad).abs().max() / scale
            solo_error = (solo_grad.float() - exact_grad).abs().max() / scale
            assert routed_error <= max(2 * solo_error, 8 * eps)


@pytest.mark.parametrize("stacked", [False, True], ids=["peft", "stacked"])
def test_routed_rows_on_a_4bit_base(family_dir, stacked):
    """A 4-bit base (float32 compute, so that only the routing can differ): the routed LoRA layers wrap
    bitsandbytes' layers, and each row still gets its own view's log-probs and gradients."""
    model = two_policies(family_dir("llama"), "llama", quantization="4bit")
    assert any(type(layer).__name__ == "Linear4bit" for layer in model.peft_model.modules())
    ids, mask = left_padded(ROW_TOKENS)
    assert_close(routed_pass(model, ids, mask, stacked), solo_pass(model, ids, mask), tolerance=1e-5)


def test_routing_restores_the_view_and_the_trainable_flags(family_dir):
    model = two_policies(family_dir("llama"), "llama")
    flags = [parameter.requires_grad for parameter in model.peft_model.parameters()]
    active = model.peft_model.active_adapter
    ids, mask = left_padded(ROW_TOKENS)
    with model.base(), model.routed(ROW_ADAPTERS):
        model.token_logprobs(ids, mask, response_start=RESPONSE_START)
    assert [parameter.requires_grad for parameter in model.peft_model.parameters()] == flags
    assert model.peft_model.active_adapter == active
    with model.reference("first"):  # outside the routed context nothing is routed any more
        base = model.token_logprobs(ids, mask, response_start=RESPONSE_START)
    with model.routed([BASE_VIEW] * 4):
        torch.testing.assert_close(model.token_logprobs(ids, mask, response_start=RESPONSE_START), base)


def test_bad_routes_are_refused_with_the_names(family_dir):
    model = two_policies(family_dir("llama"), "llama")
    ids, mask = left_padded(ROW_TOKENS)
    with (
        pytest.raises(ConfigError, match=r"\['third'\].*'first', 'second'"),
        model.routed(["first", "third"]),
    ):
        pass
    with pytest.raises(ConfigError, match="one adapter name per row"), model.routed([]):
        pass
    with pytest.raises(ValueError, match="same as the number of inputs"), model.routed(["first", "second"]):
        model.token_logprobs(ids, mask, response_start=RESPONSE_START)
