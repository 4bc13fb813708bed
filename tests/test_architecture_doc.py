"""docs/architecture.md names every module of loomrl/, and every file it names exists (so the page moves with the
code). A module counts as named when its path is, or its file name is in its folder's row of the folders table."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "loomrl"
DOC = (ROOT / "docs" / "architecture.md").read_text()


def folder_rows(doc: str) -> dict[str, str]:
    """The folders table's rows by the folders they name first (`runtime/`, or several: `store/`, `metrics/`)."""
    rows = {}
    for line in doc.splitlines():
        if line.startswith("| `") or line.startswith("| the base"):
            head = line.split("|")[1]
            for folder in re.findall(r"`([\w]+)/`", head) or ["."]:
                rows[folder] = line
    return rows


def unnamed(doc: str) -> list[str]:
    rows = folder_rows(doc)
    out = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if path.name == "__init__.py" and rel != "__init__.py" or rel == "__init__.py":
            continue
        top = rel.split("/")[0] if "/" in rel else "."
        if f"`{rel}`" in doc or f"`{path.name}`" in rows.get(top, "") or ("/" not in rel and f"`{rel}`" in doc):
            continue
        out.append(rel)
    return out


def missing(doc: str) -> list[str]:
    names = set(re.findall(r"`([\w./]+\.py)`", doc)) | set(re.findall(r"\b((?:[\w]+/)+[\w]+\.py)\b", doc))
    files = {p.name for p in PACKAGE.rglob("*.py")}
    out = []
    for name in sorted(names):
        if "/" not in name:
            if name not in files:
                out.append(name)
        elif not any((base / name).exists() for base in (PACKAGE, ROOT)):
            out.append(name)
    return out


def test_every_module_is_named_and_every_named_file_exists():
    assert unnamed(DOC) == []
    assert missing(DOC) == []


def test_the_checks_see_a_module_left_out_and_a_file_that_moved():
    assert "runtime/stopping.py" in unnamed(DOC.replace("`stopping.py`", "stopping"))
    assert missing(DOC + "\n`runtime/backend.py`\n") == ["runtime/backend.py"]
