"""Write docs/configuration.md from the config package: every section and field of a recipe, its type, its default and
its documentation (the docstring under each field in loomrl/config/). tests/test_config_reference.py checks that the
file is current; run this after changing a field:

    python scripts/config_reference.py
"""

from __future__ import annotations

import sys
import types
import typing
from pathlib import Path
from typing import Any

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from loomrl.config import RunConfig

OUT = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"

HEADER = """# Configuration reference

Every field a recipe (YAML) or a `section.field=value` override can set, by section: its type, its default, and what it
does. Generated from the docstrings in `loomrl/config/` by `scripts/config_reference.py` (a test keeps it current);
`load_config` refuses an unknown field with the closest names, and a field that was renamed or retired with what
replaced it. What the machine or the run's environment must allow is checked when a run starts
(`loomrl/runtime/checks.py`).
"""


def model_of(annotation: Any) -> tuple[type[BaseModel] | None, bool, bool]:
    """(the section model an annotation holds, whether it may be None, whether it is a dict of them by name)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation, False, False
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        models = [a for a in args if isinstance(a, type) and issubclass(a, BaseModel)]
        if len(models) == 1 and type(None) in args:
            return models[0], True, False
    if origin is dict and len(args) == 2 and isinstance(args[1], type) and issubclass(args[1], BaseModel):
        return args[1], False, True
    return None, False, False


def type_name(annotation: Any) -> str:
    text = str(annotation) if not isinstance(annotation, type) else annotation.__name__
    return (text.replace("typing.", "").replace("NoneType", "None").replace("pathlib.", "")
            .replace("Literal[", "one of [").replace("'", ""))


def default_of(field: Any) -> str:
    if field.default is not PydanticUndefined:
        value = field.default
    elif field.default_factory is not None:
        value = field.default_factory()
    else:
        return "(required)"
    if isinstance(value, BaseModel):
        return "(section)"
    return f"`{value!r}`" if value not in ([], {}) else f"`{value}`"


def cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def section(model: type[BaseModel], dotted: str, level: int, note: str = "") -> list[str]:
    out = [f"{'#' * level} `{dotted}`{note}", ""]
    doc = (model.__doc__ or "").strip()
    if doc and doc != (BaseModel.__doc__ or "").strip():
        out += [" ".join(doc.split()), ""]
    rows, subsections = [], []
    for name, field in model.model_fields.items():
        sub, optional, by_name = model_of(field.annotation)
        if sub is not None:
            where = f"{dotted}.{name}" + (".<name>" if by_name else "")
            extra = " (optional: absent unless set)" if optional else " (one per name)" if by_name else ""
            if field.description:
                rows.append(f"| `{name}` | section{extra.replace(' (', ', ').rstrip(')')} | | {cell(field.description)} |")
            subsections += section(sub, where, level + 1, extra)
            continue
        rows.append(f"| `{name}` | {cell(type_name(field.annotation))} | {cell(default_of(field))} | "
                    f"{cell(field.description or '')} |")
    if rows:
        out += ["| field | type | default | what it does |", "|---|---|---|---|", *rows, ""]
    return out + subsections


def reference() -> str:
    lines = [HEADER, "## The run", ""]
    top_rows, sections = [], []
    for name, field in RunConfig.model_fields.items():
        sub, optional, _ = model_of(field.annotation)
        if sub is None:
            top_rows.append(f"| `{name}` | {cell(type_name(field.annotation))} | {cell(default_of(field))} | "
                            f"{cell(field.description or '')} |")
        else:
            sections += section(sub, name, 2, " (optional: absent unless set)" if optional else "")
    lines += ["| field | type | default | what it does |", "|---|---|---|---|", *top_rows, ""]
    return "\n".join(lines + sections).rstrip() + "\n"


if __name__ == "__main__":
    OUT.write_text(reference())
    print(f"wrote {OUT}", file=sys.stderr)
