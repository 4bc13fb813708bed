"""No import circle among loomrl's modules (lazy imports inside functions count, and so do imports for type checking
only: a circle through them is a circle in the design, even if Python never runs it). The layers between packages are import-linter's contract in pyproject.toml (`make lint`); this finds circles
inside a package too, which a layers contract cannot see."""

from __future__ import annotations

import sys

import grimp


def import_circles(package: str) -> list[list[str]]:
    """The strongly connected groups of more than one module in `package`'s import graph (Tarjan's algorithm)."""
    graph = grimp.build_graph(package, cache_dir=None, exclude_type_checking_imports=False)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for imported in graph.find_modules_directly_imported_by(module):
            if imported not in index:
                visit(imported)
                low[module] = min(low[module], low[imported])
            elif imported in on_stack:
                low[module] = min(low[module], index[imported])
        if low[module] == index[module]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == module:
                    break
            if len(group) > 1:
                circles.append(sorted(group))

    for module in sorted(graph.modules):
        if module not in index:
            visit(module)
    return circles


def test_loomrl_has_no_import_circle():
    assert import_circles("loomrl") == []


def test_circles_through_lazy_and_type_checking_imports_are_found(tmp_path, monkeypatch):
    package = tmp_path / "circled"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from circled import b\n")
    (package / "b.py").write_text("def f():\n    from circled import a\n\n    return a\n")
    (package / "c.py").write_text("from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n    from circled import d\n")
    (package / "d.py").write_text("from circled import c\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("circled", None)
    assert sorted(import_circles("circled")) == [["circled.a", "circled.b"], ["circled.c", "circled.d"]]
