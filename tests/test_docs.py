"""The documentation keeps up with the code: every configuration field is described, the generated
reference lists each one, the README stays short with the two commands in it,
and the results pages link only to pages the site builds."""

import importlib.util
import re
from pathlib import Path

import pytest

from app.batch.config import BatchConfig
from app.config import AppConfig

ROOT = Path(__file__).resolve().parent.parent


def _generator():
    spec = importlib.util.spec_from_file_location("gen_config_reference", ROOT / "docs" / "gen_config_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


GEN = _generator()
# every field once: the batch config embeds AppConfig whole, which the first walk covers
FIELDS = [(f"AppConfig.{name}", name, field) for name, field in GEN.walk(AppConfig)] + \
         [(f"BatchConfig.{name}", name, field) for name, field in GEN.walk(BatchConfig, skip=(AppConfig,))]


def test_the_walk_reaches_nested_models():
    names = {label for label, _, _ in FIELDS}
    assert {"AppConfig.llm.max_model_len", "AppConfig.placement.policy", "AppConfig.media.video_fps",
            "BatchConfig.media_pool.max_size", "BatchConfig.app", "BatchConfig.chunk_rows"} <= names
    assert not any(label.startswith("BatchConfig.app.") for label in names)


@pytest.mark.parametrize("label,name,field", FIELDS, ids=[label for label, _, _ in FIELDS])
def test_every_config_field_has_a_description(label, name, field):
    assert (field.description or "").strip(), f"{label} has no description: add Field(..., description=...)"


def test_the_generated_reference_lists_every_field_with_its_type_and_default():
    page = GEN.render()
    for label, name, _field in FIELDS:
        rows = [line for line in page.splitlines() if line.startswith(f"| `{name}` |")]
        assert len(rows) == 1, f"{label}: expected one row in the generated reference, found {len(rows)}"
        # | `name` | `type` | `default` | description |
        assert re.fullmatch(r"\| `[^`]+` \| `[^`]+` \| `[^`]*` \| \S.* \|", rows[0]), rows[0]


def test_the_reference_page_keeps_its_marker():
    page = (ROOT / "docs" / GEN.PAGE).read_text()
    assert GEN.MARKER in page


def test_readme_is_short_and_starts_with_the_two_commands():
    readme = (ROOT / "README.md").read_bytes()
    assert len(readme) <= 12 * 1024, f"README.md is {len(readme)} bytes; the limit is 12 KB"
    text = readme.decode()
    assert "make serve" in text and "make test" in text
    first_screen = "\n".join(text.splitlines()[:30])
    assert "make serve" in first_screen and "make test" in first_screen


def test_module_docstrings_are_at_most_twelve_lines():
    # the why in about ten lines; figures live in benchmarks/RESULTS.md and benchmarks/results/
    import ast
    too_long = []
    for path in sorted((ROOT / "app").rglob("*.py")):
        name = path.relative_to(ROOT).as_posix()
        doc = ast.get_docstring(ast.parse(path.read_text()))
        if doc and len(doc.splitlines()) > 12:
            too_long.append(f"{name}: {len(doc.splitlines())} lines")
    assert not too_long, "module docstrings over 12 lines: " + ", ".join(too_long)


def test_results_pages_link_only_to_pages_the_site_builds():
    """mkdocs --strict (CI) refuses a link to a .md file that is not a page; benchmarks/results/'s raw
    folders are not pages, so a detail page names their files as paths instead of linking them."""
    results = ROOT / "benchmarks" / "results"
    bad = []
    for page in [ROOT / "benchmarks" / "RESULTS.md", *sorted(results.glob("*.md"))]:
        for target in re.findall(r"\]\(([^)#\s]+\.md)(?:#[^)]*)?\)", page.read_text()):
            if "://" in target:
                continue
            resolved = (page.parent / target).resolve()
            is_page = resolved == (ROOT / "benchmarks" / "RESULTS.md") or resolved.parent == results
            if not (is_page and resolved.exists()):
                bad.append(f"{page.relative_to(ROOT)} -> {target}")
    assert not bad, "links the site cannot resolve:\n" + "\n".join(bad)
