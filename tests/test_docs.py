"""The documentation cannot rot: the guides' short code blocks run, every internal link resolves, every module
of the package is in the API reference, and (slow) the site builds with ``mkdocs build --strict``.

A code block that takes more than seconds on a CPU, or is a fragment of a larger program, is marked
``<!-- docs-test: skip (long: why) -->`` or ``<!-- docs-test: skip (fragment: why) -->`` on the line before
it; those are listed in ``SKIPPED_BLOCKS`` so that marking one more is a visible change."""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from marl.config import RLOOConfig

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
SKIP_MARK = "<!-- docs-test: skip"
# Published into the site at the same paths by docs_tooling/hooks.py.
PUBLISHED_DIRS = ("benchmarks/results", "adapters")
SKIPPED_BLOCKS = {
    ("docs/quickstart.md", 1),
    ("docs/guides/rewards.md", 1),
    ("docs/guides/policies.md", 1),
    ("docs/guides/sweeps.md", 2),
    ("docs/guides/train-on-one-gpu.md", 1),
    ("docs/guides/coming-from-trl.md", 3),
    ("docs/guides/agents-with-tools.md", 3),
    ("docs/guides/agents-with-tools.md", 4),
    ("README.md", 1),
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


def _registries() -> list[tuple[str, str | None]]:
    """``(register function, flag)`` of every :class:`marl.registry.Registry` the package creates, read from
    its ``Registry(what, flag, register_with, ...)`` call; each register function must be defined in marl."""
    import ast

    found, defined = [], set()
    for path in sorted((ROOT / "marl").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef):
                defined.add(node.name)
            if (
                isinstance(node, ast.Call)
                and getattr(node.func, "id", None) == "Registry"
                and len(node.args) >= 3
            ):
                flag, register_with = (ast.literal_eval(argument) for argument in node.args[1:3])
                found.append((register_with.rpartition(".")[2], flag))
    assert {function for function, _ in found} <= defined, found
    return found


def test_the_layout_page_names_every_sub_package_and_registry() -> None:
    """The layout page is a map: every sub-package, and every extension point's register function with the
    flag that chooses among its names (not the modules, which move)."""
    layout = (DOCS / "concepts" / "layout.md").read_text()
    packages = sorted(
        f"{path.parent.relative_to(ROOT).as_posix()}/" for path in (ROOT / "marl").rglob("*/__init__.py")
    )
    assert [package for package in packages if f"`{package}`" not in layout] == []
    registries = _registries()
    assert len(registries) >= 5, registries
    unnamed = [
        (function, flag)
        for function, flag in registries
        if f"`{function}`" not in layout or (flag is not None and f"`{flag}" not in layout)
    ]
    assert not unnamed, "name these register functions and their flags in docs/concepts/layout.md"


def _reference_text() -> str:
    return "\n".join(page.read_text() for page in sorted((DOCS / "reference").glob("*.md")))


README_MAX_WORDS = 900


def test_readme_stays_short() -> None:
    """The README is a first page; the figures and the details live in the documentation."""
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 200
    assert len(text.split()) <= README_MAX_WORDS, f"{len(text.split())} words (wc -w): move details to docs/"


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


# --- the site's structure ---------------------------------------------------------------------------------

ANY_FENCE = re.compile(r"^```.*?^```", flags=re.MULTILINE | re.DOTALL)
LONG_PAGE_WORDS = 800  # a page this long gets sections, so that its contents panel is not empty


def _prose(path: Path) -> str:
    """A page without its code blocks and inline code."""
    return re.sub(r"`[^`\n]*`", "", ANY_FENCE.sub("", path.read_text()))


def _h1s(path: Path) -> list[str]:
    return [
        line[2:].strip() for line in ANY_FENCE.sub("", path.read_text()).splitlines() if line.startswith("# ")
    ]


def _nav_entries() -> list[tuple[str, str]]:
    """``(label, page)`` of every labelled page of mkdocs.yml's nav."""
    import yaml

    entries: list[tuple[str, str]] = []

    def walk(items: list) -> None:
        for item in items:
            if isinstance(item, dict):
                for label, value in item.items():
                    if isinstance(value, list):
                        walk(value)
                    else:
                        entries.append((label, value))

    walk(yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"])
    return entries


@pytest.mark.parametrize("page", PAGES, ids=lambda page: str(page.relative_to(DOCS)))
def test_one_h1_per_page(page: Path) -> None:
    assert len(_h1s(page)) == 1, f"{page.relative_to(ROOT)} has the H1s {_h1s(page)}: one title a page"


def test_page_titles_are_the_navigation_labels() -> None:
    """The home page's title is the site's name; every other page's H1 is its label in the navigation."""
    differ = [
        (label, _h1s(DOCS / page)[0].replace("`", ""))
        for label, page in _nav_entries()
        if page != "index.md" and _h1s(DOCS / page)[0].replace("`", "") != label
    ]
    assert not differ, f"(nav label, page title) pairs that differ: {differ}"


@pytest.mark.parametrize(
    "page",
    [page for page in PAGES if page.parent.name in ("guides", "results", "concepts")],
    ids=lambda page: str(page.relative_to(DOCS)),
)
def test_long_pages_have_sections(page: Path) -> None:
    words, sections = len(_prose(page).split()), len(re.findall(r"^## ", _prose(page), flags=re.MULTILINE))
    assert words <= LONG_PAGE_WORDS or sections >= 2, (
        f"{words} words and {sections} sections: add ## headings"
    )


def test_build_tooling_is_not_published() -> None:
    published = sorted(
        str(path.relative_to(DOCS)) for path in DOCS.rglob("*") if path.is_file() and path.suffix != ".md"
    )
    assert published == [], (
        f"docs/ publishes every file it holds; move these out (docs_tooling/): {published}"
    )


def test_the_theme_fetches_no_web_fonts() -> None:
    import yaml

    theme = yaml.safe_load((ROOT / "mkdocs.yml").read_text())["theme"]
    assert theme.get("font") is False, (
        "theme.font: false, or every page fetches fonts from a third-party host"
    )


@pytest.mark.parametrize(
    "page", sorted((DOCS / "guides").glob("*.md")), ids=lambda page: str(page.relative_to(DOCS))
)
def test_guides_naming_a_flag_link_the_configuration_reference(page: Path) -> None:
    fields = {item.name for item in dataclasses.fields(RLOOConfig)}
    named = {flag for flag in re.findall(r"--(\w+)", page.read_text()) if flag in fields}
    assert not named or "reference/configuration.md" in page.read_text(), (
        f"{page.relative_to(ROOT)} names {sorted(named)[:5]}...: link ../reference/configuration.md"
    )


def test_the_home_page_answers_a_newcomer_in_one_click() -> None:
    """Install, the exact command, will it fit, GPU speed, resume, two GPUs, metrics, the difference from TRL:
    each has its page, linked from the home page."""
    home = (DOCS / "index.md").read_text()
    answers = [
        "installation.md",
        "guides/train-on-one-gpu.md",
        "guides/will-it-fit.md",
        "results/index.md",
        "guides/bad-input-and-resuming.md",
        "guides/multi-gpu.md",
        "guides/metrics.md",
        "guides/coming-from-trl.md",
    ]
    assert [page for page in answers if f"]({page})" not in home] == []


# --- generated pages and the figures' one owner -----------------------------------------------------------


def _tooling():
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from docs_tooling import config_reference, results_index

    return config_reference, results_index


def test_the_configuration_reference_lists_every_field_readably() -> None:
    config_reference, _ = _tooling()
    page = config_reference.configuration_markdown()
    missing = [item.name for item in dataclasses.fields(RLOOConfig) if f"| `--{item.name}` |" not in page]
    assert missing == []
    for unreadable in ("lambda", "field(", "<function", "threads_field", "MISSING"):
        assert unreadable not in page
    assert "`beta`" in page and "`num_generations`" in page  # TRL's names where they differ
    marker = config_reference.MARKER
    assert marker in (DOCS / "reference" / "configuration.md").read_text()


def test_the_results_table_lists_every_dated_file() -> None:
    _, results_index = _tooling()
    table = results_index.results_markdown("")
    dated = sorted(path.name for path in (ROOT / "benchmarks" / "results").glob("20*.md"))
    assert [name for name in dated if f"]({name})" not in table] == []
    assert results_index.MARKER in (DOCS / "results" / "index.md").read_text()


LATEST = re.compile(r"\blatest\b", flags=re.IGNORECASE)
DATE = re.compile(r"\b(\d{4}-\d{2}-\d{2})\b")
# "not run" claims: "has not run", "not yet run", "not run on a GPU yet" (not "not run again").
NOT_RUN = re.compile(r"\bnot (?:yet )?run\b(?! again)", flags=re.IGNORECASE)
ON_GPU = re.compile(r"\b(?:GPU|CUDA|H100|H200)\b")
TOPICS = ("graph", "bf16", "fp16", "4-bit", "8-bit", "sweep")


def _sentences(path: Path) -> list[str]:
    text = re.sub(r"\s+", " ", ANY_FENCE.sub("", path.read_text()))
    return re.split(r"(?<=[.;:|])\s", text)


def _claim_pages() -> list[Path]:
    return [*PAGES, ROOT / "README.md"]


def test_no_page_calls_an_older_result_latest() -> None:
    """A sentence that calls a dated result "latest" names the newest date of the results files of its device
    (CPU or GPU, as the sentence says; any when it says neither)."""
    _, results_index = _tooling()
    files = results_index.read_results()
    wrong = []
    for page in _claim_pages():
        for sentence in _sentences(page):
            if not LATEST.search(re.sub(r"`[^`]*`", "", sentence)) or not DATE.search(sentence):
                continue
            kind = [f for f in files if ON_GPU.search(sentence) is not None and f.on_gpu]
            kind = kind or [f for f in files if "CPU" in sentence and not f.on_gpu] or files
            newest = max(f.date for f in kind)
            if max(DATE.findall(sentence)) != newest:
                wrong.append(f"{page.relative_to(ROOT)}: {sentence[:120]!r} (newest: {newest})")
    assert not wrong, "\n".join(wrong)


def test_no_page_says_not_run_of_what_a_results_file_records() -> None:
    """A sentence that says something has not run on a GPU fails when a GPU results file has a line naming
    every topic of the sentence (the graph decode, bf16, 4-bit, a sweep...); with no topic, any GPU file
    does."""
    _, results_index = _tooling()
    gpu_lines = [
        line for f in results_index.read_results() if f.on_gpu for line in f.path.read_text().splitlines()
    ]
    wrong = []
    for page in _claim_pages():
        for sentence in _sentences(page):
            if not NOT_RUN.search(sentence) or not ON_GPU.search(sentence):
                continue
            topics = [topic for topic in TOPICS if topic in sentence]
            if any(all(topic in line for topic in topics) for line in gpu_lines):
                wrong.append(f"{page.relative_to(ROOT)}: {sentence[:160]!r} (topics {topics})")
    assert not wrong, "\n".join(wrong)


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
