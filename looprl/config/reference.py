"""The configuration reference, generated from the schema so that it cannot drift.

`markdown()` walks `Config` (schema.py) and writes one table per section: each field's
dotted name (`train.lr`), its type (a `Literal` as its allowed values, with the bounds
its `Field` sets), its default (a `default_factory` called) and its description. A
nested section (`model.lora`) gets a row that points to a table of its own. The docs
site builds its "Configuration reference" page from it (docs/hooks.py); nothing
generated is checked in. It does not describe the rules across sections
(validation.py): those fail with their own messages.
"""

from __future__ import annotations

import inspect
import re
import types
import typing
from dataclasses import dataclass

import annotated_types
from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from looprl.config.base import Section
from looprl.config.schema import Config

_BOUNDS = (
    (annotated_types.Ge, "ge", ">="),
    (annotated_types.Gt, "gt", ">"),
    (annotated_types.Le, "le", "<="),
    (annotated_types.Lt, "lt", "<"),
)


@dataclass(frozen=True)
class Row:
    """One field of a section, as the reference shows it (plain text, not markdown)."""

    name: str  # dotted: "train.lr"
    type: str  # "float", "'auto' | 'float32'", "int | None"; "section" for a nested one
    bounds: str  # ">= 0, <= 1", or ""
    default: str  # Python's repr of the default; "required" when there is none
    description: str


@dataclass(frozen=True)
class SectionDoc:
    name: str  # dotted: "model.lora"
    doc: str  # the field's description and the section class's docstring, if any
    rows: list[Row]


def sections(model: type[BaseModel] = Config, prefix: str = "") -> list[SectionDoc]:
    """Every section under `model`, depth first: a section's table, then its nested ones."""
    found: list[SectionDoc] = []
    for name, field in model.model_fields.items():
        section = _section_class(field)
        if section is None:
            continue
        dotted = prefix + name
        docs = [field.description or "", inspect.cleandoc(section.__dict__.get("__doc__") or "")]
        rows = [
            _row(dotted + "." + sub, subfield) for sub, subfield in section.model_fields.items()
        ]
        found.append(SectionDoc(dotted, "\n\n".join(d for d in docs if d), rows))
        found += sections(section, dotted + ".")
    return found


def leaf_names(model: type[BaseModel] = Config) -> list[str]:
    """The dotted name of every field that is not itself a section."""
    return [row.name for s in sections(model) for row in s.rows if row.type != "section"]


def markdown() -> str:
    """The reference page, in the docs site's Markdown."""
    out = [
        "# Configuration reference",
        "",
        "Every field of the config, generated from its schema (`looprl/config/`) when the",
        "docs are built, so it matches the code. Each section is a YAML mapping; a field is",
        "set in a YAML file or as a dotted override (`looprl train train.lr=2e-5`), see",
        "[Configuration](../configuration.md). Types are Python's: `'a' | 'b'` lists the",
        "allowed values, `None` is YAML's `null`. Rules that involve several fields are",
        "checked when the config loads, and a broken one names the fields.",
    ]
    for section in sections():
        out += ["", f"## {section.name}", ""]
        for paragraph in re.split(r"\n\s*\n", section.doc) if section.doc else []:
            out += [_escape(paragraph), ""]
        out += ["| field | type | default | description |", "|---|---|---|---|"]
        for row in section.rows:
            if row.type == "section":
                type_cell = "section"
                default_cell = f"see [{row.name}](#{slug(row.name)})"
            else:
                type_cell = _code(row.type) + (f", {_escape(row.bounds)}" if row.bounds else "")
                default_cell = _code(row.default)
            cells = [_code(row.name), type_cell, default_cell, _escape(row.description)]
            out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out) + "\n"


def type_name(annotation: object) -> str:
    """A readable type: `int | None`, `list[str]`, `'auto' | 'float32'` for a Literal."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Literal:
        return " | ".join(repr(arg) for arg in args)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(type_name(arg) for arg in args)
    if origin is typing.Annotated:
        return type_name(args[0])
    if origin is not None:
        return f"{origin.__name__}[{', '.join(type_name(arg) for arg in args)}]"
    if annotation is type(None):
        return "None"
    if annotation is typing.Any:
        return "Any"
    return getattr(annotation, "__name__", str(annotation))


def slug(heading: str) -> str:
    """The anchor MkDocs gives a heading (Python-Markdown's toc): lowercase, punctuation
    dropped, spaces to '-'."""
    text = re.sub(r"[^\w\s-]", "", heading).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def _row(name: str, field: FieldInfo) -> Row:
    section = _section_class(field)
    if section is not None:
        doc = field.description or inspect.cleandoc(section.__dict__.get("__doc__") or "")
        return Row(name, "section", "", "", doc.split("\n\n")[0])
    bounds = ", ".join(
        f"{symbol} {getattr(item, attr)}"
        for kind, attr, symbol in _BOUNDS
        for item in field.metadata
        if isinstance(item, kind)
    )
    default = field.get_default(call_default_factory=True)
    shown = "required" if default is PydanticUndefined else repr(default)
    return Row(name, type_name(field.annotation), bounds, shown, field.description or "")


def _section_class(field: FieldInfo) -> type[Section] | None:
    annotation = field.annotation
    if isinstance(annotation, type) and issubclass(annotation, Section):
        return annotation
    return None


def _code(text: str) -> str:
    """`text` as a Markdown code span, whatever backticks it holds (a pipe inside a code
    span does not split a table cell)."""
    fence = "`" * (max((len(run) for run in re.findall(r"`+", text)), default=0) + 1)
    pad = " " if text.startswith("`") or text.endswith("`") else ""
    return f"{fence}{pad}{text}{pad}{fence}"


def _escape(text: str) -> str:
    """Plain text as Markdown, on one line (a table cell): the characters Markdown and HTML
    would read escaped outside `code spans`, which are kept; paragraphs joined by <br>."""
    parts = re.split(r"(`[^`]*`)", text)
    for i in range(0, len(parts), 2):
        part = parts[i].replace("\\", "\\\\").replace("&", "&amp;").replace("<", "&lt;")
        parts[i] = re.sub(r"([*_\[\]|#])", r"\\\1", part)
    paragraphs = re.split(r"\n\s*\n", "".join(parts))
    return "<br><br>".join(" ".join(p.split()) for p in paragraphs)
