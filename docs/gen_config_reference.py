"""The configuration reference, generated from the pydantic models (app/config.py, app/batch/config.py).

Run by mkdocs as a hook (mkdocs.yml, `hooks:`): the marker line in docs/reference/configuration.md
becomes one table per model, every field with its type, default and description, so the page
cannot drift from the code. `python3 docs/gen_config_reference.py` prints the same Markdown.
"""

from __future__ import annotations

import html
import re
import sys
import types
import typing
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from pydantic import BaseModel, SecretStr  # noqa: E402

MARKER = "<!-- generated: configuration reference -->"
PAGE = "reference/configuration.md"


def _is_model(tp) -> bool:
    return isinstance(tp, type) and issubclass(tp, BaseModel)


def type_name(tp) -> str:
    """A field's annotation as a reader would write it: `int | None`, `"auto" | "cpu"`, `list[str]`."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is type(None):
        return "None"
    if origin is typing.Literal:
        return " | ".join(f'"{a}"' if isinstance(a, str) else repr(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(type_name(a) for a in args)
    if origin is not None:
        return f"{getattr(origin, '__name__', str(origin))}[{', '.join(type_name(a) for a in args)}]"
    if tp is SecretStr:
        return "str (secret)"
    return getattr(tp, "__name__", str(tp))


def default_of(name: str, field, owner: BaseModel | None = None) -> str:
    """The default as the application sees it: read from the enclosing model's default instance
    (`owner`), since a nested model's default may differ from its class's (the batch pools)."""
    if owner is None and field.is_required():
        return "required"
    value = getattr(owner, name) if owner is not None else field.get_default(call_default_factory=True)
    if isinstance(value, BaseModel):
        return "see its section"
    if name.endswith("bytes") and isinstance(value, int) and value >= 1 << 20 and value % (1 << 20) == 0:
        return f"{value} ({value >> 20} MiB)" if value < 1 << 30 else f"{value} ({value >> 30} GiB)"
    return repr(value)


def bounds_of(field) -> str:
    """The field's numeric constraints (pydantic's ge, gt, le, lt), e.g. `≥ 1, ≤ 10`."""
    out = []
    for m in field.metadata:
        for attr, sign in (("ge", "≥"), ("gt", ">"), ("le", "≤"), ("lt", "<")):
            v = getattr(m, attr, None)
            if v is not None and type(m).__name__ == attr.capitalize():
                out.append(f"{sign} {v}")
    return ", ".join(out)


def _code(text: str) -> str:
    """A code span in a table cell (Python-Markdown's tables leave pipes inside code spans alone)."""
    return "`" + text + "`"


def _cell(text: str) -> str:
    """Table-safe Markdown: outside code spans, pipes escaped and < > & written as entities (`<key>`
    is no HTML tag)."""
    parts = re.split(r"(`[^`]*`)", " ".join(text.split()))
    return "".join(p if p.startswith("`") else html.escape(p, quote=False).replace("|", "\\|") for p in parts)


def walk(model: type[BaseModel], prefix: str = "", skip: tuple = ()):
    """(dotted name, field) for every field of `model` and of the models nested in it, except inside
    the model classes in `skip` (documented on their own)."""
    for name, field in model.model_fields.items():
        yield prefix + name, field
        tp = field.annotation
        if _is_model(tp) and tp not in skip:
            yield from walk(tp, prefix + name + ".", skip)


def _section(title: str, model: type[BaseModel], prefix: str, level: int, skip: tuple,
             owner: BaseModel | None) -> list[str]:
    doc = " ".join((model.__doc__ or "").split())
    lines = [f"{'#' * level} {title}", ""]
    if doc:
        lines += [_cell(doc).replace("\\|", "|"), ""]
    lines += ["| field | type | default | description |", "|---|---|---|---|"]
    nested = []
    for name, field in model.model_fields.items():
        tp = field.annotation
        described = field.description or ""
        if _is_model(tp):
            if tp in skip:
                described = described or "documented above"
            else:
                nested.append((prefix + name, tp, getattr(owner, name) if owner is not None else None))
        kind = type_name(tp) + (f" ({bounds_of(field)})" if bounds_of(field) else "")
        lines.append(f"| `{prefix}{name}` | {_code(kind)} | {_code(default_of(name, field, owner))} | "
                     f"{_cell(described)} |")
    lines.append("")
    for name, tp, value in nested:
        lines += _section(f"`{name}`", tp, name + ".", level + 1, skip, value)
    return lines


def models():
    """(title, model, models documented elsewhere) for each top-level section of the page."""
    from app.batch.config import BatchConfig
    from app.config import AppConfig

    return [("The application (`args:` of serve_config.yaml)", AppConfig, ()),
            ("Batch jobs (`python -m app.batch --config FILE`)", BatchConfig, (AppConfig,))]


def render() -> str:
    lines = []
    for title, model, skip in models():
        lines += _section(title, model, "", 2, skip, model())
    return "\n".join(lines)


def on_page_markdown(markdown, page, config, files):  # mkdocs hook
    if page.file.src_uri == PAGE:
        if MARKER not in markdown:
            raise ValueError(f"{PAGE} lost its marker line {MARKER!r}")
        return markdown.replace(MARKER, render())
    return markdown


if __name__ == "__main__":
    print(render())
