"""The scripts of ``examples/benchmarks``, imported in tests as they import each other (their folder first on
``sys.path``). On leaving, the folder and every module loaded from it go away: no test sees another's."""

from __future__ import annotations

import contextlib
import importlib
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

BENCHMARKS = Path(__file__).resolve().parents[2] / "examples" / "benchmarks"


@contextlib.contextmanager
def benchmark_modules(*names: str) -> Iterator[dict[str, ModuleType]]:
    """``{name: module}`` for each script of ``names`` while the block runs."""
    sys.path.insert(0, str(BENCHMARKS))
    try:
        yield {name: importlib.import_module(name) for name in names}
    finally:
        sys.path.remove(str(BENCHMARKS))
        for name, module in list(sys.modules.items()):
            if Path(getattr(module, "__file__", None) or "/").parent == BENCHMARKS:
                del sys.modules[name]
