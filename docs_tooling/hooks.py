"""mkdocs hook: the dated results files (``benchmarks/results/``) and the shipped adapters' recipes
(``adapters/*/README.md``) are published as they are, at the same paths in the site, so the site links
to the files the benchmark scripts write instead of keeping a second copy that could drift."""

from __future__ import annotations

from pathlib import Path

from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parents[1]
PUBLISHED = {"benchmarks/results": "benchmarks/results", "adapters": "adapters"}


def on_files(files: Files, config) -> Files:
    for source, target in PUBLISHED.items():
        for path in sorted((ROOT / source).rglob("*")):
            if path.suffix in {".md", ".png", ".json"} and path.name != "adapter_config.json":
                uri = f"{target}/{path.relative_to(ROOT / source).as_posix()}"
                files.append(File.generated(config, uri, abs_src_path=str(path)))
    return files
