"""Each row of a batch through its own adapter, with gradients: the rows of several policies (and of their
references) in one forward (and backward) pass over the shared base. A sweep routes its decode and its
scoring passes this way; its update runs each policy's micro-batch in that policy's own view instead
(:mod:`marl.train.joint_update` says why).

PEFT routes rows by name with ``model(..., adapter_names=[...])``: every LoRA layer runs the base product once
for the whole batch and adds each adapter's delta to its own rows only (``LoraLayer._mixed_batch_forward``;
``"__base__"`` rows get no delta). PEFT refuses that argument in training mode, because a LoRA dropout
drawn for a mixed batch would differ from the dropout of each adapter's own batch. marl switches every dropout
off at load (and checks it), so a routed batch computes, row for row, what each row's own view computes; the
gradient of a row's loss reaches its own adapter only, since the other adapters never see that row.

Some families flatten the batch before a layer (OPT's MLP takes ``[rows * tokens, hidden]``): a 2-D input
whose first dimension is a multiple of the rows gets each row's name once per token, in the row-major order of
that flattening. Mixture-of-experts layers send a permuted subset of tokens to each expert, which no per-row
name can follow: such models are refused.

:func:`route_rows` passes the names to every LoRA layer through forward pre-hooks, as PEFT's own
``adapter_names`` path does, and keeps them until the context exits. The hooks read a :class:`RowRoutes` at
every call, so a decode whose finished rows leave the batch names its remaining rows before each step. The
caller runs the backward pass inside the context: a layer under gradient checkpointing computes its forward
again during the backward pass, and that second forward must be routed the same way.

Example:
    >>> with model.routed(["positive", "negative", BASE_VIEW]):  # doctest: +SKIP
    ...     logprobs = model.token_logprobs(ids, mask, response_start=8)
    ...     (logprobs.sum(dim=1) * advantages).mean().backward()
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

from peft.tuners.lora import LoraLayer
from peft.utils.other import AuxiliaryTrainingWrapper
from torch import nn

from marl.errors import ConfigError
from marl.model.records import BASE_VIEW


def check_row_adapters(row_adapters: Sequence[str], known: Sequence[str]) -> list[str]:
    """``row_adapters`` as a list, after checking that each is an adapter on the base or ``BASE_VIEW``.

    Example:
        >>> check_row_adapters(("a", "__base__", "a"), known=["a", "b"])
        ['a', '__base__', 'a']
        >>> check_row_adapters(["c"], known=["a", "b"])  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        marl.errors.ConfigError: rows routed to ['c'], which is no adapter on this base; its adapters: ...
    """
    names = list(row_adapters)
    if not names:
        raise ConfigError("no rows to route: pass one adapter name per row of the batch")
    unknown = sorted(set(names) - set(known) - {BASE_VIEW})
    if unknown:
        raise ConfigError(
            f"rows routed to {unknown}, which is no adapter on this base; its adapters: {list(known)} "
            f"(or {BASE_VIEW!r} for the base alone)"
        )
    return names


def routing_problem(config: Any) -> str | None:
    """Why rows of this model cannot be routed per row, or ``None``.

    Example:
        >>> from transformers import LlamaConfig, MixtralConfig
        >>> routing_problem(LlamaConfig()) is None
        True
        >>> routing_problem(MixtralConfig())
        'its mixture-of-experts layers (8 experts) compute a permuted subset of the tokens in each expert'
    """
    experts = getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None)
    if experts:
        return (
            f"its mixture-of-experts layers ({experts} experts) compute a permuted subset of the tokens in "
            "each expert"
        )
    return None


def per_input_row(row_adapters: list[str], inputs: int) -> list[str]:
    """The names for a layer input of ``inputs`` rows: one per row, or, for a batch flattened to
    ``[rows * tokens, hidden]``, each row's name once per token (a count that fits neither is left for PEFT to
    refuse).

    Example:
        >>> per_input_row(["a", "b"], 4)
        ['a', 'a', 'b', 'b']
    """
    if inputs != len(row_adapters) and inputs % len(row_adapters) == 0:
        tokens = inputs // len(row_adapters)
        return [name for name in row_adapters for _ in range(tokens)]
    return row_adapters


class RowRoutes:
    """The adapter name of each row of the next forward passes; :attr:`names` may be replaced between passes
    (a decode names the rows still decoding before each step).

    Example:
        >>> routes = RowRoutes(["a", "b", "a"])
        >>> routes.names = [routes.names[row] for row in (0, 2)]
        >>> routes.names
        ['a', 'a']
    """

    def __init__(self, names: Sequence[str]) -> None:
        self.names = list(names)


def _routed_layers(model: nn.Module) -> list[nn.Module]:
    return [module for module in model.modules() if isinstance(module, LoraLayer | AuxiliaryTrainingWrapper)]


@contextlib.contextmanager
def route_rows(model: nn.Module, row_adapters: list[str] | RowRoutes) -> Iterator[None]:
    """Every forward of ``model``'s LoRA layers in the body runs row ``i`` of its batch through
    ``row_adapters[i]`` (the adapters must be enabled: a layer with adapters disabled computes the base for
    every row); a :class:`RowRoutes` is read at every call. A layer called with another number of rows
    raises PEFT's error naming both counts."""
    routes = row_adapters if isinstance(row_adapters, RowRoutes) else RowRoutes(row_adapters)

    def pass_row_adapters(
        module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        inputs, names = args[0], routes.names
        names = per_input_row(names, inputs.shape[0]) if inputs.dim() == 2 else names
        return args, {**kwargs, "adapter_names": names}

    handles = [
        layer.register_forward_pre_hook(pass_row_adapters, with_kwargs=True)
        for layer in _routed_layers(model)
    ]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
