"""The documentation cannot rot: the guides' short code blocks run, every internal link resolves, every module
of the package is in the API reference, and (slow) the site builds with ``mkdocs build --strict``.

A code block that takes more than seconds on a CPU, or is a fragment of a larger program, is marked
``<!-- docs-test: skip (long: why) -->`` or ``<!-- docs-test: skip (fragment: why) -->`` on the line before
it; those are listed in ``SKIPPED_BLOCKS`` so that marking one more is a visible change."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
SKIP_MARK = "<!-- docs-test: skip"
# Published into the site at the same paths by docs/hooks.py.
PUBLISHED_DIRS = ("benchmarks/results", "adapters")
SKIPPED_BLOCKS = {
    ("docs/quickstart.md", 1),
    ("docs/guides/rewards.md", 1),
    ("docs/guides/policies.md", 1),
    ("docs/guides/sweeps.md", 2),
    ("docs/guides/coming-from-trl.md", 3),
    ("README.md", 1),
    ("README.md", 2),
}
FENCE = re.compile(r"^```python\n(.*?)^```", flags=re.MULTILINE | re.DOTALL)
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def python_blocks(path: Path) -> list[tuple[int, str, bool]]:
    """``(index from 1, code, marked skipped)`` of every ```python block of ``path``."""
    text = path.read_text()
    blocks = []
    for index, match in enumerate(FENCE.finditer(text), start=1):
        preceding = text[: match.start()].rstrip("\n").rsplit("\n", 1)[-1]
        blocks.append((index, match.group(1), preceding.startswith(SKIP_MARK)))
    return blocks


PAGES = sorted(DOCS.rglob("*.md"))


def test_skipped_blocks_are_listed() -> None:
    marked = {
        (str(path.relative_to(ROOT)), index)
        for path in [*PAGES, ROOT / "README.md"]
        for index, _, skipped in python_blocks(path)
        if skipped
    }
    assert marked == SKIPPED_BLOCKS


@pytest.mark.parametrize(
    "page",
    [page for page in PAGES if any(not skipped for _, _, skipped in python_blocks(page))],
    ids=lambda page: str(page.relative_to(DOCS)),
)
def test_code_blocks_run(page: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A page's short blocks run in order in one namespace, as a reader would paste them."""
    monkeypatch.chdir(tmp_path)
    namespace: dict[str, object] = {"__name__": "__docs__"}
    for index, code, skipped in python_blocks(page):
        if not skipped:
            exec(compile(code, f"{page.relative_to(ROOT)}[block {index}]", "exec"), namespace)


def _link_target(page: Path, link: str, site_root: Path) -> Path | None:
    """The file a relative link of ``page`` points to (``None`` for external links and pure anchors)."""
    target = link.split("#", 1)[0]
    if not target or re.match(r"^[a-z]+:", target):
        return None
    resolved = (page.parent / target).resolve()
    if site_root == DOCS and not resolved.is_relative_to(DOCS):
        return resolved
    relative = resolved.relative_to(site_root) if resolved.is_relative_to(site_root) else None
    if site_root == DOCS and relative is not None:
        for published in PUBLISHED_DIRS:
            if relative.as_posix().startswith(published + "/"):
                return ROOT / relative
    return resolved


@pytest.mark.parametrize(
    "page",
    [*PAGES, ROOT / "README.md", *sorted((ROOT / "adapters").rglob("README.md"))],
    ids=lambda page: str(page.relative_to(ROOT)),
)
def test_internal_links_resolve(page: Path) -> None:
    site_root = DOCS if page.is_relative_to(DOCS) else ROOT
    text = FENCE.sub("", page.read_text())
    broken = [
        link
        for link in LINK.findall(text)
        if (target := _link_target(page, link, site_root)) is not None and not target.exists()
    ]
    assert not broken, f"{page.relative_to(ROOT)} links to missing files: {broken}"


def test_every_module_is_in_the_api_reference() -> None:
    documented = set(re.findall(r"^::: (marl[\w.]*)", _reference_text(), flags=re.MULTILINE))
    modules = {
        ".".join(path.relative_to(ROOT).with_suffix("").parts)
        for path in (ROOT / "marl").rglob("*.py")
        if path.stem not in ("__init__", "__main__") and "apps" not in path.parts
    }
    assert modules - documented == set(), "add these modules to a page of docs/reference/"


def test_every_module_is_on_the_layout_page() -> None:
    layout = (DOCS / "concepts" / "layout.md").read_text()
    unnamed = sorted(
        str(path.relative_to(ROOT))
        for path in (ROOT / "marl").rglob("*.py")
        if path.stem not in ("__init__", "__main__") and not re.search(rf"\b{path.stem}\b", layout)
    )
    assert not unnamed, "name these modules in docs/concepts/layout.md"


def _reference_text() -> str:
    return "\n".join(page.read_text() for page in sorted((DOCS / "reference").glob("*.md")))


def test_readme_stays_short() -> None:
    assert len((ROOT / "README.md").read_text().splitlines()) <= 200


@pytest.mark.slow
def test_site_builds_strict(tmp_path: Path) -> None:
    """Every page of the nav exists, every link and anchor resolves and every API reference renders: mkdocs
    aborts on any warning in strict mode."""
    if importlib.util.find_spec("mkdocs") is None:
        pytest.fail("mkdocs is not installed: pip install -e '.[docs]' (scripts/install.sh dev installs it)")
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},  # Material's banner about a future MkDocs
    )
    assert result.returncode == 0, result.stderr[-4000:]
    assert (tmp_path / "site" / "index.html").is_file()


def test_the_trl_example_runs_on_a_tiny_model(
    tiny_llama_dir: Path, tiny_reward_adapter: Path, tmp_path: Path
):
    """examples/trl_grpo_with_reward_adapter.py, the TRL script of "Coming from TRL", end to end."""
    script = ROOT / "examples" / "trl_grpo_with_reward_adapter.py"
    arguments = ["--model", str(tiny_llama_dir), "--reward_adapter", str(tiny_reward_adapter)]
    arguments += ["--output_dir", str(tmp_path / "run"), "--max_steps", "2", "--max_completion_length", "4"]
    environment = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run(
        [sys.executable, str(script), *arguments],
        capture_output=True,
        text=True,
        env=environment,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert re.search(r"mean reward per step: -?\d+\.\d+, -?\d+\.\d+$", result.stdout.strip())
