"""Module layout: the package's folders are layered (a folder imports only the folders below it),
no import cycle among skippy_zmq modules (lazy imports inside functions included), and every
distribution the package imports at run time is declared in setup.cfg's install_requires."""

from __future__ import annotations

import ast
import configparser
import gc
import importlib.metadata
import re
import sys
from pathlib import Path

from conftest import REPO

PACKAGE = REPO / "skippy_zmq"


def module_names() -> dict[str, Path]:
    names = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(REPO).with_suffix("").parts
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return names


def _type_checking_only(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def _nearest(dotted: str, modules: dict[str, Path]) -> str | None:
    """The module a dotted name lives in (`skippy_zmq.protocol.wire.Kind` -> `skippy_zmq.protocol.wire`), if ours."""
    while dotted and dotted not in modules:
        dotted = dotted.rpartition(".")[0]
    return dotted or None


def _edges(tree: ast.AST, package: str, modules: dict[str, Path]) -> set[str]:
    """The modules an import statement anywhere in `tree` loads, TYPE_CHECKING blocks skipped.

    `from pkg import sub` is an edge to pkg.sub only: a submodule's implicit import of its
    parent package is not an edge, or every package that imports its submodules would be a cycle.
    """
    found: set[str | None] = set()
    stack = [tree]
    while stack:
        node = stack.pop()
        if _type_checking_only(node):
            continue
        if isinstance(node, ast.Import):
            found.update(_nearest(a.name, modules) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([node.module] if node.module else []))
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.add(sub if sub in modules else _nearest(base, modules))
        stack.extend(ast.iter_child_nodes(node))
    return {m for m in found if m is not None}


def import_graph() -> dict[str, set[str]]:
    """Module -> the skippy_zmq modules it imports (at the top or inside functions)."""
    modules = module_names()
    graph = {}
    # No collection inside ast.parse: on CPython 3.11.7 a finalizer that formats a traceback (which
    # parses too) run by a collection mid-parse raises "AST constructor recursion depth mismatch";
    # earlier tests on this worker leave such garbage (orbax's failed restores' tasks).
    gc.collect()
    gc.disable()
    try:
        for name, path in modules.items():
            package = name if path.name == "__init__.py" else name.rpartition(".")[0]
            graph[name] = _edges(ast.parse(path.read_text()), package, modules) - {name}
    finally:
        gc.enable()
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a path a -> b -> ... -> a, or None."""
    state: dict[str, int] = {}   # 1 on the current path, 2 done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start)):
            return cycle
    return None


# Edges tolerated for now, each with its owner's reason; test_tolerated_edges_still_exist makes sure
# an entry is deleted once the edge is gone.
TOLERATED: set[tuple[str, str]] = set()


def test_no_import_cycle_among_skippy_modules():
    graph = import_graph()
    for a, b in TOLERATED:
        graph[a].discard(b)
    assert {"skippy_zmq.cli", "skippy_zmq.ops.launch", "skippy_zmq.devtools.harness", "skippy_zmq.api.main"} <= set(graph)
    assert "skippy_zmq.ops.launch" in graph["skippy_zmq.devtools.harness"]
    assert "skippy_zmq.stage.factory" in graph["skippy_zmq.stage.loop"]
    cycle = find_cycle(graph)
    assert cycle is None, " -> ".join(cycle)


def test_find_cycle_reports_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


# The package's folders, lowest first: each may import only itself and the folders before it, so
# the folders form no loop and a reader can learn them in this order. Why this order:
#   files       reading untrusted files (checks, the GGUF layout), private folders, fetching: no deps
#   sampling    logits -> token, numpy only
#   config      every frozen dataclass and the topology loader
#   kv          the prefix KV store (bytes keyed by token prefixes; its settings are config's CacheConfig)
#   protocol    message frames, sockets, CURVE keys and ZAP (needs the topology's parties)
#   text        vocabularies, tokenizers, chat templates, grammar constraints, the output side
#   model       the JAX decoder, rope, quantised weights and kernels, the runner
#   checkpoint  model files -> our checkpoint (reads text's tokenizer, writes model's weights)
#   ops         launching processes, their lifetime, memory placement and layer planning
#   stage       one stage process: the worker (messages in, messages out) and its socket loop
#   cluster     hosts that join a driver: tokens, weight transfer, the worker that runs stages (it
#               starts stage processes and reads checkpoints; the driver's engine and API start it)
#   engine      the driver's scheduler, speculation, prefix index, the socket pipeline, local engines
#   api         the HTTP server and the API shapes it speaks
#   devtools    test and bench tooling (harness, chaos, soak, random models, bench suites)
#   cli         the command line (the package root's entry point)
LAYERS = ["files", "sampling", "config", "kv", "protocol", "text", "model", "checkpoint", "ops", "stage",
          "cluster", "engine", "api", "devtools", "cli"]
# The package root holds only the entry point; everything else lives in a folder by concern.
ROOT_MODULES = {"skippy_zmq", "skippy_zmq.cli"}


def folder_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def layer_violations(graph: dict[str, set[str]]) -> list[str]:
    """`a -> b` for every import of a folder at or above the importer's own layer (other than itself)."""
    rank = {name: i for i, name in enumerate(LAYERS)}
    bad = []
    for module, targets in sorted(graph.items()):
        here = folder_of(module)
        for target in sorted(targets):
            there = folder_of(target)
            if there and there != here and (here not in rank or there not in rank or rank[there] >= rank[here]):
                bad.append(f"{module} -> {target}")
    return bad


def test_folders_import_only_the_folders_below_them():
    graph = import_graph()
    assert {folder_of(m) for m in graph} - {""} == set(LAYERS), "a folder is missing from LAYERS (or gone)"
    assert layer_violations(graph) == []


def test_layer_violations_names_an_upward_import():
    graph = {"skippy_zmq.text.tokenizer": {"skippy_zmq.api.server", "skippy_zmq.files.filecheck"},
             "skippy_zmq.files.filecheck": set()}
    assert layer_violations(graph) == ["skippy_zmq.text.tokenizer -> skippy_zmq.api.server"]


def test_the_package_root_holds_only_the_entry_point():
    assert {m for m in module_names() if m.count(".") < 1 or (m.count(".") == 1 and not
            (PACKAGE / m.split(".")[1]).is_dir())} == ROOT_MODULES


def test_serving_code_never_imports_the_dev_tools():
    graph = import_graph()
    users = sorted(m for m, targets in graph.items() if any(t.startswith("skippy_zmq.devtools") for t in targets))
    assert all(m.startswith("skippy_zmq.devtools") or m == "skippy_zmq.cli" for m in users), users


def test_tolerated_edges_still_exist():
    graph = import_graph()
    assert [edge for edge in TOLERATED if edge[1] not in graph[edge[0]]] == []


# ---------------------------------------------------------------- run-time dependencies

# Imports of distributions that install_requires leaves out on purpose: module -> (the extra that
# declares its distribution, that distribution). Each is imported only inside the tool that needs it.
OPTIONAL_IMPORTS = {
    "matplotlib": ("bench", "matplotlib"),        # bench/plots.py, only where find_spec finds it
    "llama_cpp": ("peers", "llama-cpp-python"),   # bench: the llama.cpp peer, where installed
    "openai": ("test", "openai"),                 # soak.py's client, run from the dev venv (scripts/soak.sh)
}
# Declared but never imported by name: jax loads jaxlib, its backend.
IMPORTED_INDIRECTLY = {"jaxlib"}


def _normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requirements() -> dict[str, set[str]]:
    """setup.cfg: "install_requires" and every extra -> the distribution names it declares."""
    cfg = configparser.ConfigParser(interpolation=None)
    cfg.read(REPO / "setup.cfg")
    sections = {"install_requires": cfg["options"]["install_requires"], **cfg["options.extras_require"]}
    return {key: {_normalise(re.match(r"[A-Za-z0-9][A-Za-z0-9._-]*", line.strip()).group())
                  for line in value.splitlines() if line.strip()}
            for key, value in sections.items()}


def _guards_imports(node: ast.AST) -> bool:
    """A try that catches ImportError: what its body imports is optional."""
    return isinstance(node, ast.Try) and any(
        h.type is not None and re.search(r"\b(ImportError|ModuleNotFoundError)\b", ast.unparse(h.type))
        for h in node.handlers)


def third_party_imports(source: str, guarded: bool = False) -> set[str]:
    """Top-level names of the modules `source` imports anywhere (inside functions too) other than
    the stdlib's and ours; TYPE_CHECKING blocks skipped, and guarded (try / except ImportError)
    imports unless `guarded`."""
    found: set[str] = set()
    stack: list[ast.AST] = [ast.parse(source)]
    while stack:
        node = stack.pop()
        if _type_checking_only(node):
            continue
        if not guarded and _guards_imports(node):
            stack.extend([*node.handlers, *node.orelse, *node.finalbody])
            continue
        if isinstance(node, ast.Import):
            found.update(alias.name.partition(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.partition(".")[0])
        stack.extend(ast.iter_child_nodes(node))
    return found - set(sys.stdlib_module_names) - {"__future__", "skippy_zmq"}


def package_imports(guarded: bool = False) -> dict[str, list[str]]:
    """Third-party module -> the skippy_zmq files that import it (see third_party_imports)."""
    users: dict[str, list[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        for module in third_party_imports(path.read_text(), guarded):
            users.setdefault(module, []).append(str(path.relative_to(REPO)))
    return users


def test_third_party_imports_skip_the_stdlib_type_checking_and_guarded_imports():
    source = """
import os, numpy.linalg
from yaml import safe_load
from . import wire
if TYPE_CHECKING:
    import torch
def f():
    import zmq
    try:
        import jsonschema
    except ImportError:
        import httpx
"""
    assert third_party_imports(source) == {"numpy", "yaml", "zmq", "httpx"}
    assert third_party_imports(source, guarded=True) == {"numpy", "yaml", "zmq", "httpx", "jsonschema"}


def test_every_run_time_import_is_declared_in_install_requires():
    declared = requirements()
    distributions = importlib.metadata.packages_distributions()
    undeclared = {}
    for module, users in package_imports().items():
        if module in OPTIONAL_IMPORTS:
            extra, dist = OPTIONAL_IMPORTS[module]
            assert _normalise(dist) in declared[extra], f"{module}: {dist} is not in the {extra} extra"
            continue
        names = {_normalise(d) for d in distributions.get(module, [])}
        if not names & declared["install_requires"]:
            undeclared[module] = (sorted(names) or "not installed", users)
    assert undeclared == {}, undeclared


def test_every_install_require_is_imported():
    """A declared distribution nothing imports (safetensors once) is a dependency for nothing."""
    distributions = importlib.metadata.packages_distributions()
    imported = {_normalise(d) for module in package_imports(guarded=True) for d in distributions.get(module, [])}
    assert requirements()["install_requires"] - imported - IMPORTED_INDIRECTLY == set()


# ---------------------------------------------------------------- sizes

MAX_FILE_LINES = 500       # a module a reader can hold (STYLE.md: about 400, never over 500)
MAX_FUNCTION_LINES = 50    # a function a reader can see whole
# Files and functions over the caps for now, each with its reason; test_oversized_still_over makes
# sure an entry is deleted once it fits.
OVERSIZED_FILES: set[str] = set()
OVERSIZED_FUNCTIONS: set[str] = set()


def file_lines() -> dict[str, int]:
    """Every module of the package (dev tools included) -> its line count."""
    return {str(p.relative_to(REPO)): len(p.read_text().splitlines()) for p in sorted(PACKAGE.rglob("*.py"))}


def function_lines() -> dict[str, int]:
    """`path:name` -> lines (decorators not counted) of every function and method of the runtime
    package (devtools/ left out: bench suites are scripts); a name seen twice in a file keeps its longest."""
    found: dict[str, int] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        if "devtools" in path.relative_to(PACKAGE).parts:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                key = f"{path.relative_to(REPO)}:{node.name}"
                found[key] = max(found.get(key, 0), node.end_lineno - node.lineno + 1)
    return found


def test_no_file_is_over_500_lines():
    over = {name: n for name, n in file_lines().items() if n > MAX_FILE_LINES and name not in OVERSIZED_FILES}
    assert over == {}


def test_no_runtime_function_is_over_50_lines():
    over = {name: n for name, n in function_lines().items()
            if n > MAX_FUNCTION_LINES and name not in OVERSIZED_FUNCTIONS}
    assert over == {}


def test_oversized_still_over():
    assert {f for f in OVERSIZED_FILES if file_lines().get(f, 0) <= MAX_FILE_LINES} == set()
    assert {f for f in OVERSIZED_FUNCTIONS if function_lines().get(f, 0) <= MAX_FUNCTION_LINES} == set()
