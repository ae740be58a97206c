"""Griffe extension for the API reference: marl's docstrings title their doctests ``Example:`` (the
project's style, run by tests/test_doctests.py); Google-style parsing knows ``Examples:`` as the section whose
``>>>`` lines are code. This renames the title when the docs are built, so every example renders as code."""

from __future__ import annotations

import re
from typing import Any

import griffe

EXAMPLE_TITLE = re.compile(r"^(\s*)Example:\s*$", flags=re.MULTILINE)


class ExamplesSection(griffe.Extension):
    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = EXAMPLE_TITLE.sub(r"\1Examples:", obj.docstring.value)
