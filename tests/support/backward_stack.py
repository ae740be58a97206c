"""How deep the policy loss's backward pass sits below a trainer's ``train``: a spy on
``torch.autograd.backward`` (every ``Tensor.backward`` goes through it) records the marl frames of every call,
outermost first, as ``path:function``; the parallelism's ``backward`` is one of them."""

from __future__ import annotations

import inspect
from pathlib import Path

import torch

import marl

PACKAGE = Path(marl.__file__).resolve().parent


def record_backward_stacks(monkeypatch) -> list[list[str]]:
    """Patch ``torch.autograd.backward`` to record, at every call, the marl frames on the stack (outermost
    first); returns the list the records go to."""
    stacks: list[list[str]] = []
    real = torch.autograd.backward

    def spy(*args, **kwargs):
        frames = []
        for frame in reversed(inspect.stack(context=0)):
            path = Path(frame.filename).resolve()
            if path.is_relative_to(PACKAGE):
                frames.append(f"{path.relative_to(PACKAGE.parent)}:{frame.function}")
        stacks.append(frames)
        return real(*args, **kwargs)

    monkeypatch.setattr(torch.autograd, "backward", spy)
    return stacks


def frames_below(stack: list[str], entry: str) -> list[str]:
    """The frames of ``stack`` from ``entry`` (e.g. ``marl/train/trainer.py:train``) down to the backward."""
    assert entry in stack, f"{entry} is not on the backward's stack: {stack}"
    return stack[stack.index(entry) :]
