"""mkdocs hooks.

- The dated results files (``benchmarks/results/``) and the shipped adapters' recipes
  (``adapters/*/README.md``) are published as they are, at the same paths in the site, so the site links to
  the files the benchmark scripts write instead of keeping a second copy that could drift. They stay out of
  the search index: the results landing page lists them, and a search for a topic should find a guide first.
- Two pages are filled in at build time from their owners, so that they cannot rot: the configuration
  reference from ``RLOOConfig``'s fields, the results landing table from the dated results files.
"""

from __future__ import annotations

import sys
from pathlib import Path

from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parents[1]
# `mkdocs build` runs from its console script, whose folder is not the repository: the tooling imports itself.
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from docs_tooling import config_reference, results_index  # noqa: E402

PUBLISHED = {"benchmarks/results": "benchmarks/results", "adapters": "adapters"}
# The pages a newcomer's search should find first, boosted over the rest (Material's search `boost`).
GUIDE_PREFIXES = ("guides/", "installation.md", "quickstart.md")


def on_files(files: Files, config) -> Files:
    for source, target in PUBLISHED.items():
        for path in sorted((ROOT / source).rglob("*")):
            if path.suffix in {".md", ".png", ".json"} and path.name != "adapter_config.json":
                uri = f"{target}/{path.relative_to(ROOT / source).as_posix()}"
                files.append(File.generated(config, uri, abs_src_path=str(path)))
    return files


def on_page_markdown(markdown: str, page, config, files) -> str:
    uri = page.file.src_uri
    if uri.startswith(tuple(f"{target}/" for target in PUBLISHED.values())):
        page.meta["search"] = {"exclude": True}
    elif uri.startswith(GUIDE_PREFIXES):
        page.meta.setdefault("search", {"boost": 2})
    if uri == "reference/configuration.md":
        markdown = markdown.replace(config_reference.MARKER, config_reference.configuration_markdown())
    elif uri == "results/index.md":
        table = results_index.results_markdown("../benchmarks/results/")
        markdown = markdown.replace(results_index.MARKER, table)
    return markdown
