"""Griffe extension for the API reference, so that marl's docstrings render as written:

- their doctests are titled ``Example:`` (the project's style, run by tests/test_doctests.py), while
  Google-style parsing knows ``Examples:`` as the section whose ``>>>`` lines are code: the title is renamed;
- they name other objects with Sphinx roles (``:func:`name```, ``:class:`~marl.x.Name```), which Markdown
  would print as they are: each becomes inline code of the name (``~`` keeps the last part, as Sphinx does).
"""

from __future__ import annotations

import re
from typing import Any

import griffe

EXAMPLE_TITLE = re.compile(r"^(\s*)Example:\s*$", flags=re.MULTILINE)
SPHINX_ROLE = re.compile(r":(?:mod|func|class|meth|attr|data|exc|obj):`(~?)([^`]+)`")


def _role_as_code(match: re.Match[str]) -> str:
    shortened, name = match.groups()
    return f"`{name.rsplit('.', 1)[-1] if shortened else name}`"


class MarlDocstrings(griffe.Extension):
    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            text = EXAMPLE_TITLE.sub(r"\1Examples:", obj.docstring.value)
            obj.docstring.value = SPHINX_ROLE.sub(_role_as_code, text)
