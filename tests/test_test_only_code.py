"""scripts/test_only_code.py: what it lists, and what it does not, in a small package."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

from scripts_helper import load_script

checker = load_script("test_only_code")


def _write(root: Path, name: str, text: str) -> None:
    path = root / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))


def test_lists_what_only_itself_or_the_tools_use(tmp_path, monkeypatch):
    package = tmp_path / "pkg_unused"
    _write(package, "__init__.py", "")
    _write(package, "core.py", """
        import ast

        def used():
            return 1

        def recursive(n):
            return recursive(n - 1) if n else used()

        def for_tools():
            return 2

        def by_name():
            return 3

        HANDLERS = {"by_name": None}

        class Visitor(ast.NodeVisitor):
            def visit_Name(self, node):
                return node

        class Loader(dict):
            def keys(self):
                return []

        CLASSES = (Visitor, Loader)
    """)
    _write(package, "devtools/__init__.py", "")
    _write(package, "devtools/tool.py", "from pkg_unused.core import for_tools\nfor_tools()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    unused, tools_only = checker.unreferenced(package)
    assert [d.name for d in unused] == ["recursive"]      # its own call does not count
    assert [d.name for d in tools_only] == ["for_tools"]
    sys.modules.pop("pkg_unused.core", None)
    sys.modules.pop("pkg_unused", None)
