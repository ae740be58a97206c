"""The package's shape: each layer imports only from itself and the layers below, no import cycles, small
modules. These are the rules that keep each extension point a one-file change (docs/concepts/layout.md)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "marl"

# Lowest first. A module may import from its own layer and the layers before it.
LAYERS = [
    ("marl.errors", "marl.environment", "marl.registry", "marl.cpu"),
    ("marl.config",),
    ("marl.data",),
    ("marl.model",),
    ("marl.algo",),
    ("marl.rewards",),
    ("marl.rollout",),
    # marl's pieces inside other libraries' trainers (TRL's): above the rewards and the rollout they reuse
    ("marl.integrations",),
    ("marl.train",),
    ("marl.plan",),
    ("marl.apps", "marl.__main__"),
]
# The root of the package holds its face (`__init__`, `__main__`) and the few modules every layer shares;
# every concern is a sub-package.
MAX_ROOT_MODULES = 5
MAX_LINES = 600


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def layer_of(name: str) -> int:
    if name == "marl":
        return len(LAYERS)  # the package's lazy public names may point anywhere
    for index, prefixes in enumerate(LAYERS):
        if any(name == prefix or name.startswith(prefix + ".") for prefix in prefixes):
            return index
    raise AssertionError(f"{name} is in no layer of tests/test_layout.py: add it to LAYERS")


def _is_type_checking(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def marl_imports(path: Path, module: str) -> list[tuple[str, bool]]:
    """``(imported marl module, only for a type checker)`` for every import, inside functions and under ``if
    TYPE_CHECKING:`` included."""
    tree = ast.parse(path.read_text())
    found: list[tuple[str, bool]] = []

    def visit(node: ast.AST, type_only: bool) -> None:
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("marl"):
            for alias in node.names:
                candidate = f"{node.module}.{alias.name}"
                found.append((candidate if candidate in MODULES else node.module, type_only))
        elif isinstance(node, ast.Import):
            found.extend((alias.name, type_only) for alias in node.names if alias.name.startswith("marl"))
        for child in ast.iter_child_nodes(node):
            visit(child, type_only or _is_type_checking(node))

    visit(tree, False)
    return [(name, type_only) for name, type_only in found if name != module]


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_point_down(module: str) -> None:
    upward = [
        name
        for name, type_only in marl_imports(MODULES[module], module)
        # an annotation may name a record of a higher layer; the cycle check still counts that import
        if name != "marl" and not type_only and layer_of(name) > layer_of(module)
    ]
    assert not upward, f"{module} imports from a higher layer: {upward}"


def test_no_import_cycles() -> None:
    graph = {
        module: {name for name, _ in marl_imports(path, module) if name in MODULES and name != "marl"}
        for module, path in MODULES.items()
    }
    visiting: list[str] = []
    done: set[str] = set()

    def walk(module: str) -> None:
        if module in visiting:
            cycle = [*visiting[visiting.index(module) :], module]
            raise AssertionError("import cycle: " + " -> ".join(cycle))
        if module in done:
            return
        visiting.append(module)
        for name in sorted(graph[module]):
            # a package's __init__ importing its own submodules is how re-exports work, not a cycle
            if module != name.rpartition(".")[0]:
                walk(name)
        visiting.pop()
        done.add(module)

    for module in sorted(graph):
        walk(module)


def test_the_root_holds_few_modules() -> None:
    face = {"__init__.py", "__main__.py"}
    root = sorted(path.name for path in PACKAGE.glob("*.py") if path.name not in face)
    assert len(root) <= MAX_ROOT_MODULES, f"marl/ holds {root} at its root: move a concern into a sub-package"


@pytest.mark.parametrize("module", sorted(MODULES))
def test_modules_stay_small(module: str) -> None:
    lines = len(MODULES[module].read_text().splitlines())
    assert lines <= MAX_LINES, f"{module} has {lines} lines; split it along what it does (limit {MAX_LINES})"


# Modules by concept, not by a line cap: a concern that grows past this is split along what it does.
MAX_MODULES = 90
# A date or an issue number in a comment goes stale where nobody looks; link a dated results file by path.
RESULTS_LINK = re.compile(r"benchmarks/results/[\w.-]+")
STALE = re.compile(r"\b20\d\d-[01]\d-[0-3]\d\b|\b[Ii]ssues? #?\d+\b|(?<![\w&])#\d{2,}\b")


def test_the_package_has_few_modules() -> None:
    modules = [path for path in PACKAGE.rglob("*.py") if path.name not in ("__init__.py", "__main__.py")]
    assert len(modules) <= MAX_MODULES, f"marl/ has {len(modules)} modules: merge what is one concept"


def test_no_module_basename_means_two_things() -> None:
    names: dict[str, list[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        if path.name not in ("__init__.py", "__main__.py"):
            names.setdefault(path.name, []).append(str(path.relative_to(PACKAGE.parent)))
    repeated = {name: paths for name, paths in names.items() if len(paths) > 1}
    assert not repeated, f"one name for different concepts: {repeated}"


@pytest.mark.parametrize("module", sorted(MODULES))
def test_comments_cite_no_dates_or_issue_numbers(module: str) -> None:
    stale = [
        f"{number}: {line.strip()}"
        for number, line in enumerate(MODULES[module].read_text().splitlines(), start=1)
        if STALE.search(RESULTS_LINK.sub("", line))
    ]
    assert not stale, f"{module} cites a date or an issue number (link a results file instead): {stale}"
