#!/usr/bin/env python3
"""Functions and classes of the runtime package that nothing in the package uses.

Lists every function, method and class defined in skippy_zmq/ (skippy_zmq/devtools/ excluded)
whose name is referenced nowhere in skippy_zmq/ outside its own definition: such code is reached
only from tests or scripts, or not at all. A name counts as referenced when it appears anywhere
else in the package as a name, an attribute or a string constant (string dispatch, `__all__`),
so the check errs towards silence: a method that shares its name with a used one is not listed.
Not listed: dunder methods, decorated definitions (routes, properties, registered handlers are
reached through the decorator), `main`, methods that override a base class's (uvicorn's
protocol hooks, Jinja's sandbox, PyYAML's loader, pyzmq's authenticator are called by their
framework; this one check imports the module to read the class's MRO) and a node visitor's
`visit_*` methods (found by node type). Names only the dev
tools use are listed apart.

    .venv/bin/python scripts/test_only_code.py            # exit status 1 when anything is listed
"""

from __future__ import annotations

import ast
import importlib
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
PACKAGE = Path(__file__).resolve().parent.parent / "skippy_zmq"


@dataclass(frozen=True)
class Definition:
    name: str
    path: Path
    line: int
    owner: str | None        # the enclosing module-level class, for methods
    inner_references: int   # uses of its own name inside its own body (recursion, self.name)


def references(tree: ast.AST) -> Counter[str]:
    """How often each identifier is used in tree: names, attributes and string constants."""
    found: Counter[str] = Counter()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            found[node.id] += 1
        elif isinstance(node, ast.Attribute):
            found[node.attr] += 1
        elif isinstance(node, ast.alias):
            found[(node.asname or node.name).rpartition(".")[2]] += 1
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.isidentifier():
            found[node.value] += 1
    return found


def definitions(tree: ast.Module, path: Path) -> list[Definition]:
    kinds = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
    owners = {id(child): top.name for top in tree.body if isinstance(top, ast.ClassDef) for child in top.body}
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, kinds) or node.decorator_list or node.name == "main":
            continue
        if node.name.startswith("__") and node.name.endswith("__"):
            continue
        out.append(Definition(node.name, path, node.lineno, owners.get(id(node)), references(node)[node.name]))
    return out


def overrides(d: Definition, package: Path) -> bool:
    """Whether d is a method that a base class of its class also defines (its framework calls it)."""
    if d.owner is None:
        return False
    module = ".".join(d.path.relative_to(package.parent).with_suffix("").parts)
    cls = getattr(importlib.import_module(module.removesuffix(".__init__")), d.owner, None)
    if not isinstance(cls, type):
        return False
    if d.name.startswith("visit_") and hasattr(cls, "generic_visit"):
        return True   # a node visitor's method, found by node type (getattr "visit_" + the type's name)
    return any(d.name in vars(base) for base in cls.__mro__[1:])


def unreferenced(package: Path = PACKAGE) -> tuple[list[Definition], list[Definition]]:
    """(defined in the runtime and used nowhere in the package, used only by the dev tools)."""
    runtime_refs: Counter[str] = Counter()
    tool_refs: Counter[str] = Counter()
    defined: list[Definition] = []
    for path in sorted(package.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        in_tools = package / "devtools" in path.parents
        (tool_refs if in_tools else runtime_refs).update(references(tree))
        if not in_tools:
            defined += definitions(tree, path)
    unused, tools_only = [], []
    for d in defined:
        # A definition's own `def name` is not a reference; its uses inside its body do not count either.
        outside = runtime_refs[d.name] - d.inner_references
        if outside <= 0 and not overrides(d, package):
            (tools_only if tool_refs[d.name] else unused).append(d)
    return unused, tools_only


def main() -> int:
    unused, tools_only = unreferenced()
    root = PACKAGE.parent
    for title, found in (("used nowhere in skippy_zmq/", unused), ("used only by skippy_zmq/devtools/", tools_only)):
        print(f"{title}: {len(found)}")
        for d in found:
            print(f"  {d.path.relative_to(root)}:{d.line}  {d.name}")
    return 1 if unused else 0


if __name__ == "__main__":
    sys.exit(main())
