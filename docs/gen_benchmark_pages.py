"""The site's Benchmarks section, made from benchmarks/RESULTS.md and benchmarks/results/ (mkdocs hook).

RESULTS.md stays the one source: its preamble becomes the section's overview, each `## ` topic a
page of its own, and every dated detail page under benchmarks/results/ a page under "Detail pages",
so a page added there appears in the navigation without editing mkdocs.yml.
"""

from __future__ import annotations

import re
from pathlib import Path

from mkdocs.structure.files import File

ROOT = Path(__file__).resolve().parent.parent
SUMMARY = ROOT / "benchmarks" / "RESULTS.md"
DETAILS = ROOT / "benchmarks" / "results"
NAV_KEY = "Benchmarks"


def _slug(title: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", title.lower().replace("'", "")).strip("-")


def _title(text: str) -> str:
    return text.split("\n", 1)[0].lstrip("#").strip()


def split_summary(text: str) -> tuple[str, list[tuple[str, str]]]:
    """RESULTS.md -> (preamble, [(topic title, topic Markdown with its own H1)]), code fences respected."""
    preamble, topics, cur, fence = [], [], None, False
    for line in text.split("\n"):
        if line.startswith("```"):
            fence = not fence
        if not fence and line.startswith("## "):
            cur = [line[1:]]
            topics.append(cur)
            continue
        if cur is None:
            preamble.append(line)
        else:
            cur.append(line[1:] if not fence and re.match(r"^###+ ", line) else line)
    return "\n".join(preamble), [(_title(t[0]), "\n".join(t)) for t in topics]


def pages() -> dict[str, str]:
    """Site path -> Markdown for every page of the section, in navigation order."""
    preamble, topics = split_summary(SUMMARY.read_text())
    index = [preamble.rstrip(), "", "## Topics", ""]
    out: dict[str, str] = {}
    for title, body in topics:
        uri = f"benchmarks/{_slug(title)}.md"
        out[uri] = body
        index.append(f"- [{title}]({uri.removeprefix('benchmarks/')})")
    out = {"benchmarks/index.md": "\n".join(index) + "\n"} | out
    for path in sorted(DETAILS.glob("*.md")):
        # detail pages point back to the summary, which the site shows as the section's overview
        out[f"benchmarks/results/{path.name}"] = path.read_text().replace("(../RESULTS.md)", "(../index.md)")
    return out


def nav() -> list:
    """Overview, the topics in RESULTS.md's order, then the detail pages by date, newest first."""
    entries, details = [], []
    for uri, text in pages().items():
        if "/results/" in uri:
            date = Path(uri).name[:10]
            title = re.sub(r"\s*\(20\d\d-\d\d-\d\d[^)]*\)", "", _title(text)).replace("`", "")
            details.append({f"{date}: {title}": uri})
        else:
            entries.append({"Overview" if uri.endswith("index.md") else _title(text): uri})
    return entries + [{"Detail pages": sorted(details, key=lambda d: next(iter(d))[:10], reverse=True)}]


def on_config(config):  # mkdocs hook: fill the Benchmarks entry of the navigation
    for entry in config.nav or []:
        if isinstance(entry, dict) and NAV_KEY in entry:
            entry[NAV_KEY] = nav()
            return config
    raise ValueError(f"mkdocs.yml's nav has no {NAV_KEY!r} entry to fill")


def on_files(files, config):  # mkdocs hook: the generated pages join the site's files
    for uri, text in pages().items():
        files.append(File.generated(config, uri, content=text))
    return files
