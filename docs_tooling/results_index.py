"""The results landing table, generated from the dated results files (``benchmarks/results/YYYY-MM-DD-*.md``)
when the site is built: one row per file, newest first, with its date, the device it ran on, what it measured
(its title) and, for the benchmark files with a summary table, the headline ratios. The files own the figures;
pages link here or to a file instead of keeping a copy.

The same facts (each file's date, kind and device) serve ``tests/test_docs.py``'s checks that no page calls a
result "latest" when a newer file of its kind exists, or says a thing "has not run" that a file records.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
MARKER = "<!-- results-table -->"
DATED = re.compile(r"^(\d{4}-\d{2}-\d{2})-(.+)\.md$")
# A file measured on a GPU says so in its name; the cards it names are the ones it ran on.
GPU_NAME = re.compile(r"gpu|cuda")
CARD = re.compile(r"\b(?:NVIDIA )?((?:H|A|L)\d{2,3}S?|RTX \d{4})\b")
TITLE_DATE = re.compile(r"\s*\((\d{4}-\d{2}-\d{2})[^)]*\)\s*$")


class ResultsFile(NamedTuple):
    """One dated results file: what the landing table shows of it."""

    path: Path
    date: str
    kind: str  # the name after the date, e.g. "cpu-long4-heap" or "gpu-h200"
    device: str  # "CPU" or "GPU (H100, H200)"
    title: str
    headline: str

    @property
    def on_gpu(self) -> bool:
        return self.device.startswith("GPU")


def read_results(folder: Path = RESULTS) -> list[ResultsFile]:
    """Every dated Markdown file of ``folder``, newest first (by date, then name)."""
    files = []
    for path in folder.glob("*.md"):
        match = DATED.match(path.name)
        if match is None:
            continue
        date, kind = match.groups()
        text = path.read_text()
        title = next((line[2:].strip() for line in text.splitlines() if line.startswith("# ")), kind)
        title = TITLE_DATE.sub("", title)
        device = "CPU"
        if GPU_NAME.search(kind):
            cards = sorted(set(CARD.findall(text)))
            device = f"GPU ({', '.join(cards)})" if cards else "GPU"
        files.append(ResultsFile(path, date, kind, device, title, _headline(text)))
    return sorted(files, key=lambda item: (item.date, item.path.name), reverse=True)


def _headline(text: str) -> str:
    """The summary table's marl/TRL ratios of a benchmark file against TRL (columns found by their header);
    empty for other files."""
    if "\n## Summary" not in text:
        return ""
    summary = text.split("\n## Summary", 1)[1].split("\n## ", 1)[0]
    lines = [line for line in summary.splitlines() if line.startswith("|")]
    header = [cell.strip() for cell in lines[0].strip("|").split("|")]
    speed, memory = header.index("marl / TRL episodes/s"), header.index("marl / TRL memory")
    parts = []
    for line in lines[2:]:
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        ratios = f"{cells[speed]}× TRL's episodes/s at {cells[memory]}× its memory"
        parts.append(f"{cells[0]} {cells[1]}: {ratios}")
    return "; ".join(parts)


def results_markdown(link_prefix: str) -> str:
    """The landing table; ``link_prefix`` leads from the page that shows it to ``benchmarks/results/``."""
    rows = [
        "| date | device | what was measured | headline | file |",
        "|---|---|---|---|---|",
    ]
    for item in read_results():
        title = item.title.replace("|", "\\|")
        link = f"[{item.path.name}]({link_prefix}{item.path.name})"
        rows.append(f"| {item.date} | {item.device} | {title} | {item.headline} | {link} |")
    return "\n".join(rows) + "\n"
