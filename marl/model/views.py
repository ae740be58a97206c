"""Adapter views of the one base: which adapter is active, switched by nestable context managers.

A view is the policy (its LoRA active), its reference (adapters disabled, or the frozen copy of its starting
weights), or a reward adapter. Entering a view never changes which parameters train, and leaving it restores
the previous active adapter, every parameter's ``requires_grad`` and every module's train/eval mode exactly,
also when the body raises. :class:`AdapterViews` is the part of
:class:`~marl.model.multi_adapter.MultiAdapterModel` that does this; :func:`adapter_view` and
:func:`inference` do it for any PEFT model (a TRL trainer's, :mod:`marl.integrations.trl`).

Example:
    >>> with model.reference():  # doctest: +SKIP
    ...     ref_logprobs = model.token_logprobs(input_ids, attention_mask, response_start=prompt_len)
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Self

import torch
from peft import PeftModel
from peft.tuners.tuners_utils import BaseTunerLayer
from torch import nn

from marl.errors import ConfigError
from marl.model.records import BASE_VIEW, DEFAULT_POLICY, REFERENCE_VIEW, PolicyAdapter, RewardAdapter
from marl.model.routing import RowRoutes, check_row_adapters, route_rows, routing_problem


@dataclass
class _ViewState:
    active_adapter: str
    adapters_disabled: bool
    requires_grad: list[tuple[nn.Parameter, bool]]
    training: list[tuple[nn.Module, bool]]


class AdapterViews:
    """The adapters on the base (:attr:`policies`, :attr:`rewards`) and the views that switch between them."""

    peft_model: PeftModel
    policies: dict[str, PolicyAdapter]
    rewards: dict[str, RewardAdapter]

    @property
    def adapter_names(self) -> list[str]:
        """Names of every adapter on the base: policies, reference copies, reward adapters."""
        return list(self.peft_model.peft_config)

    @property
    def default_policy(self) -> str:
        """The first policy: what :meth:`policy`, :meth:`reference` and friends use without a name."""
        return next(iter(self.policies))

    @property
    def has_reward_adapter(self) -> bool:
        return bool(self.rewards)

    @property
    def reference_mode(self) -> str:
        """How the default policy's reference is built: ``"base"`` or ``"initial-policy"``."""
        return self.policies[self.default_policy].reference_mode

    def get_policy(self, name: str | None) -> PolicyAdapter:
        name = self.default_policy if name is None else name
        if name not in self.policies:
            raise ConfigError(f"no policy named {name!r} on this model; its policies: {list(self.policies)}")
        return self.policies[name]

    def get_reward(self, name: str | None) -> RewardAdapter:
        if not self.rewards:
            raise ConfigError(
                "no reward adapter is loaded; pass reward_adapter=<PEFT folder from RewardTrainer> to "
                "from_pretrained, or compute rewards with a reward function"
            )
        name = next(iter(self.rewards)) if name is None else name
        if name not in self.rewards:
            raise ConfigError(
                f"no reward adapter named {name!r}; loaded reward adapters: {list(self.rewards)}"
            )
        return self.rewards[name]

    def policy_parameters(self, name: str | None = None) -> list[nn.Parameter]:
        """The trainable tensors of policy ``name`` (default: the first policy): what an optimizer gets.

        Example:
            >>> optimizer = torch.optim.AdamW(model.policy_parameters(), lr=1e-5)  # doctest: +SKIP
        """
        return list(self.get_policy(name).parameters)

    def train(self, mode: bool = True) -> Self:
        """Put the model in train mode (for gradient checkpointing during updates). Returns ``self``."""
        self.peft_model.train(mode)
        return self

    def eval(self) -> Self:
        """Put the model in eval mode. Returns ``self``."""
        return self.train(False)

    def _adapters_disabled(self) -> bool:
        return adapters_disabled(self.peft_model)

    @contextlib.contextmanager
    def _view(self, adapter_name: str | None) -> Iterator[Self]:
        """Activate ``adapter_name`` (``None``: adapters disabled) and restore everything on exit."""
        with adapter_view(self.peft_model, adapter_name):
            yield self

    def use_adapter(self, name: str) -> contextlib.AbstractContextManager[Self]:
        """Context manager: run the body with adapter ``name`` active (``"policy"``, ``"reward"``,
        ``"reference"``).

        Nestable; on exit (also on an exception) the previous active adapter, every parameter's
        ``requires_grad`` and every module's train/eval mode are restored exactly. ``requires_grad`` is not
        changed inside either: only the policy adapter ever trains.

        Example:
            >>> with model.use_adapter("reward"):  # doctest: +SKIP
            ...     hidden = model.peft_model(input_ids).logits
        """
        if name not in self.peft_model.peft_config:
            raise ConfigError(f"no adapter named {name!r}; loaded adapters: {self.adapter_names}")
        return self._view(name)

    def reference(self, policy: str | None = None) -> contextlib.AbstractContextManager[Self]:
        """Context manager: the reference of ``policy`` (default: the first policy): the base with adapters
        disabled, or the frozen copy of the policy's starting weights.

        Example:
            >>> with model.reference():  # doctest: +SKIP
            ...     ref_logprobs = model.token_logprobs(ids, mask, response_start=prompt_length)
        """
        return self._view(self.get_policy(policy).reference_adapter)

    def base(self) -> contextlib.AbstractContextManager[Self]:
        """Context manager: the base with adapters disabled, also where a policy's reference is its frozen
        starting copy.

        Example:
            >>> with model.base():  # doctest: +SKIP
            ...     base_logprobs = model.token_logprobs(ids, mask, response_start=prompt_length)
        """
        return self._view(None)

    def view(self, name: str) -> contextlib.AbstractContextManager[Self]:
        """Context manager: ``"policy"``, ``"reference"`` (however it is built), ``BASE_VIEW`` (the base,
        :meth:`base`) or any adapter name.

        Example:
            >>> with model.view("reference"):  # doctest: +SKIP
            ...     ref_logprobs = model.token_logprobs(ids, mask, response_start=prompt_length)
        """
        if name == DEFAULT_POLICY:
            return self.policy()
        if name == REFERENCE_VIEW:
            return self.reference()
        if name == BASE_VIEW:
            return self.base()
        if name in self.policies:
            return self.policy(name)
        return self.use_adapter(name)

    def policy(self, name: str | None = None) -> contextlib.AbstractContextManager[Self]:
        """Context manager: policy ``name`` (default: the first policy).

        Example:
            >>> with model.policy():  # doctest: +SKIP
            ...     logprobs = model.token_logprobs(ids, mask, response_start=prompt_length)
        """
        return self._view(self.get_policy(name).name)

    @contextlib.contextmanager
    def routed(self, row_adapters: Sequence[str] | RowRoutes, stacked: bool | None = None) -> Iterator[Self]:
        """Context manager: row ``i`` of every forward in the body runs through ``row_adapters[i]``, an
        adapter on the base (a policy, a reference copy, a reward adapter) or ``BASE_VIEW`` for the base
        alone, in train or eval mode, with gradients (:mod:`marl.model.routing`). Run the backward pass
        inside. A :class:`marl.model.routing.RowRoutes` is read at every forward (its first names are
        checked), so that the body may name other rows between passes. Restores what every view restores;
        which parameters train is not changed. ``stacked``: how the LoRA layers route
        (:func:`marl.model.routing.route_rows`; default: stacked on a GPU).

        Example:
            >>> reference = model.get_policy("negative").reference_adapter or BASE_VIEW  # doctest: +SKIP
            >>> with model.routed(["positive", "negative", reference]):  # doctest: +SKIP
            ...     logprobs = model.token_logprobs(ids, mask, response_start=8)
        """
        routes = row_adapters if isinstance(row_adapters, RowRoutes) else None
        names = check_row_adapters(routes.names if routes else row_adapters, self.adapter_names)
        problem = routing_problem(self.peft_model.get_base_model().config)
        if problem is not None:
            raise ConfigError(f"rows of several adapters cannot share a pass on this model: {problem}")
        # Any adapter active enables the adapter layers; the rows' names then decide what each row gets.
        active = next((name for name in names if name != BASE_VIEW), self.default_policy)
        with self._view(active), route_rows(self.peft_model, routes or names, stacked):
            yield self

    def _inference(self) -> contextlib.AbstractContextManager[None]:
        """Eval mode (no dropout) and no grad for the body; train/eval flags restored after."""
        return inference(self.peft_model)


def adapters_disabled(peft_model: PeftModel) -> bool:
    """Whether ``peft_model``'s adapter layers are disabled (inside ``disable_adapter()``)."""
    for module in peft_model.modules():
        if isinstance(module, BaseTunerLayer):
            return module.disable_adapters
    return False


def capture_view(peft_model: PeftModel) -> _ViewState:
    """What a view changes on ``peft_model``: the active adapter, whether adapters are disabled, every
    parameter's ``requires_grad`` and every module's train/eval mode."""
    return _ViewState(
        active_adapter=peft_model.active_adapter,
        adapters_disabled=adapters_disabled(peft_model),
        requires_grad=[(p, p.requires_grad) for p in peft_model.parameters()],
        training=[(m, m.training) for m in peft_model.modules()],
    )


def restore_view(peft_model: PeftModel, state: _ViewState) -> None:
    """Put back exactly what :func:`capture_view` recorded (``set_adapter`` flips ``requires_grad``: the
    recorded flags are restored after it)."""
    tuner = peft_model.base_model
    if state.adapters_disabled:
        tuner.disable_adapter_layers()
    else:
        tuner.enable_adapter_layers()
    peft_model.set_adapter(state.active_adapter)
    if state.adapters_disabled:
        tuner.disable_adapter_layers()
    for parameter, requires_grad in state.requires_grad:
        parameter.requires_grad_(requires_grad)
    for module, training in state.training:
        module.training = training


@contextlib.contextmanager
def adapter_view(peft_model: PeftModel, adapter_name: str | None) -> Iterator[None]:
    """Any PEFT model with adapter ``adapter_name`` active (``None``: adapters disabled) for the body; on
    exit, also on an exception, everything :func:`capture_view` records is restored. Which parameters train is
    not changed inside either: switching must not make a frozen adapter trainable.

    Example:
        >>> with adapter_view(peft_model, "reward"):  # doctest: +SKIP
        ...     hidden = peft_model(input_ids).logits
    """
    state = capture_view(peft_model)
    try:
        tuner = peft_model.base_model
        if adapter_name is None:
            tuner.disable_adapter_layers()
        else:
            tuner.enable_adapter_layers()
            peft_model.set_adapter(adapter_name)
        for parameter, requires_grad in state.requires_grad:
            parameter.requires_grad_(requires_grad)
        yield
    finally:
        restore_view(peft_model, state)


@contextlib.contextmanager
def inference(peft_model: nn.Module) -> Iterator[None]:
    """Eval mode (no dropout) and no grad for the body; every module's train/eval flag restored after."""
    training = [(m, m.training) for m in peft_model.modules()]
    peft_model.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        for module, flag in training:
            module.training = flag
