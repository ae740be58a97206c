"""Every ``Example:`` block in marl runs: the examples of the pure modules execute and check their output;
examples that need a loaded model are marked ``# doctest: +SKIP`` where they stand."""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import pytest

import marl

MODULES = sorted(info.name for info in pkgutil.walk_packages(marl.__path__, prefix="marl."))


@pytest.mark.parametrize("module_name", MODULES)
def test_examples_run(module_name):
    module = importlib.import_module(module_name)
    flags = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
    result = doctest.testmod(module, optionflags=flags, verbose=False)
    assert result.failed == 0, (
        f"{result.failed} example(s) of {module_name} failed (run python -m doctest -v)"
    )


def test_the_pure_modules_have_examples_that_really_run():
    """A module whose every example is skipped would pass above without checking anything."""
    for module_name in (
        "marl.algo.advantages",
        "marl.algo.losses",
        "marl.algo.shaping",
        "marl.algo.tensors",
        "marl.model.forward",
        "marl.algo.metrics",
        "marl.model.adapters",
        "marl.model.sampling",
    ):
        finder = doctest.DocTestFinder()
        examples = [
            example
            for test in finder.find(importlib.import_module(module_name))
            for example in test.examples
            if not example.options.get(doctest.SKIP)
        ]
        assert len(examples) >= 3, module_name
