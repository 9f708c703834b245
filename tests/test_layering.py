"""Which way the imports go (docs/architecture.md, "The rooms"), read from the source.

Every module of the package is parsed with ``ast``: every import (at the top, inside
functions, under ``TYPE_CHECKING``), every ``importlib.import_module("feedline...")``, and the
module names in the lazy-export tables of ``feedline/__init__.py`` and
``feedline/consumer/__init__.py``. Then:

- the kernel's base (``feedline/*.py`` but ``__init__``/``__main__``) imports no room;
  ``feedline.protocol`` (the wire) imports only the base, ``feedline.transport`` (link,
  client loop, hand-over) the base and the protocol;
- ``feedline.exact`` (exact delivery) imports only the base and the protocol,
  ``feedline.producer`` the kernel (base, protocol, transport) and ``exact``;
- ``feedline.serving`` imports only ``exact`` and the kernel;
- ``feedline.broker`` imports only ``serving``, ``exact`` and the kernel;
- ``feedline.consumer`` imports ``serving``, ``producer``, ``exact`` and the kernel, never
  ``broker``;
- a module outside ``feedline.exact`` imports it through the package (``from feedline.exact
  import Cursor``), never one of its modules;
- only ``commands`` (and the facade: ``feedline/__init__.py``, ``feedline/__main__.py``)
  imports ``commands``, and nothing imports the facade;
- no two modules import each other, directly or around a circle.

A failure names the file, the line and the import.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from tests.support import ROOT
from tests.support.package_source import Module, extension_modules, modules

KERNEL, FACADE = "kernel", "facade"
# The kernel's own rooms: the protocol above its base, the transport above the protocol.
KERNEL_ROOMS = ("protocol", "transport")
COMPONENTS = ("exact", "serving", "producer", "broker", "consumer", "commands")
LOW = {KERNEL, *KERNEL_ROOMS}
# What each room may import besides itself.
ALLOWED = {
    KERNEL: {KERNEL},
    "protocol": {KERNEL},
    "transport": {KERNEL, "protocol"},
    "exact": {KERNEL, "protocol"},
    "serving": {*LOW, "exact"},
    "producer": {*LOW, "exact"},
    "broker": {*LOW, "serving", "exact"},
    "consumer": {*LOW, "serving", "producer", "exact"},
    "commands": {*LOW, *COMPONENTS},
    FACADE: {*LOW, *COMPONENTS},
}
# name -> module tables whose string values are imports (resolved on first use)
LAZY_TABLES = {"feedline": "_EXPORTS", "feedline.consumer": "_LAZY",
               "feedline.commands.main": "COMMANDS"}


@dataclass(frozen=True)
class Import:
    source: Module
    target: str  # a module of the package
    line: int
    text: str

    def __str__(self) -> str:
        return f"{self.source.rel}:{self.line}: {self.text}"


def room(name: str) -> str:
    parts = name.split(".")
    if name in ("feedline", "feedline.__main__"):
        return FACADE
    if len(parts) > 1 and parts[1] in (*KERNEL_ROOMS, *COMPONENTS):
        return parts[1]
    return KERNEL


def _resolve(name: str, known: set[str]) -> str | None:
    """The package's module ``name`` names, or the closest package above it; None outside."""
    while name:
        if name in known:
            return name
        name = name.rpartition(".")[0]
    return None


def imports_of(mod: Module, known: set[str]) -> list[Import]:
    """Every import of the package's modules that ``mod`` makes."""
    out = []

    def add(target: str, node: ast.AST, text: str) -> None:
        resolved = _resolve(target, known)
        if resolved is not None and resolved != mod.name:
            out.append(Import(mod, resolved, getattr(node, "lineno", 0), text))

    package = mod.name if mod.is_package else mod.name.rpartition(".")[0]
    for node in ast.walk(mod.tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name, node, ast.unparse(node))
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package, up level - 1
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, *([base] if base else [])])
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                add(sub if sub in known else base, node, ast.unparse(node))
        elif (isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(
                node.func, "id", "")) == "import_module" and node.args
              and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            add(node.args[0].value, node, ast.unparse(node))
        elif (isinstance(node, (ast.Assign, ast.AnnAssign)) and mod.name in LAZY_TABLES
              and any(isinstance(t, ast.Name) and t.id == LAZY_TABLES[mod.name]
                      for t in (node.targets if isinstance(node, ast.Assign)
                                else [node.target]))):
            assert isinstance(node.value, ast.Dict), f"{mod.rel}: {LAZY_TABLES[mod.name]}"
            for k, v in zip(node.value.keys, node.value.values, strict=True):
                assert isinstance(v, ast.Constant) and isinstance(v.value, str)
                name = k.value if isinstance(k, ast.Constant) else "?"
                add(v.value, v, f"{LAZY_TABLES[mod.name]}[{name!r}] = {v.value!r}")
    return out


def all_imports() -> list[Import]:
    known = {m.name for m in modules()} | extension_modules()
    return [i for m in modules() for i in imports_of(m, known)]


def test_the_reader_sees_the_imports_it_must_judge() -> None:
    """Claim: the reader finds imports of every kind (top level, in a function, under
    TYPE_CHECKING, lazy tables), so the rules below judge real edges."""
    edges = {(i.source.name, i.target) for i in all_imports()}
    assert ("feedline.producer.sender", "feedline.protocol.wire") in edges  # top level
    assert ("feedline", "feedline.consumer.remote") in edges  # _EXPORTS, and TYPE_CHECKING
    assert ("feedline.consumer", "feedline.consumer.queue_input") in edges  # _LAZY
    assert ("feedline.__main__", "feedline.commands.main") in edges
    assert ("feedline.commands.main", "feedline.broker.cli") in edges  # COMMANDS
    assert len(edges) > 300, len(edges)


def test_every_import_goes_down_the_layers() -> None:
    bad = []
    for i in all_imports():
        src, dst = room(i.source.name), room(i.target)
        if dst == src and src != FACADE:
            continue
        if dst == FACADE:
            bad.append(f"{i}  ({src} imports the facade `feedline`: import the module that "
                       "defines the name)")
        elif dst not in ALLOWED[src]:
            bad.append(f"{i}  ({src} -> {dst})")
    assert not bad, "imports against the layering (docs/architecture.md):\n" + "\n".join(bad)


def test_exact_delivery_is_used_through_its_package() -> None:
    """Outside ``feedline.exact`` the product names the package, never its modules (the
    facade's lazy table aside: it maps names to the package too)."""
    bad = [str(i) for i in all_imports()
           if room(i.target) == "exact" and i.target != "feedline.exact"
           and room(i.source.name) != "exact"]
    assert not bad, "import feedline.exact's names from the package:\n" + "\n".join(bad)


def test_no_import_cycles() -> None:
    """Claim: the graph of imports between the package's modules has no circle (Tarjan's
    strongly connected components; each circle is printed with the imports that close it)."""
    graph: dict[str, list[Import]] = defaultdict(list)
    for i in all_imports():
        graph[i.source.name].append(i)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []

    def visit(v: str) -> None:  # recursive: the graph is a few hundred modules deep at most
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for e in graph[v]:
            if e.target not in index:
                visit(e.target)
                low[v] = min(low[v], low[e.target])
            elif e.target in on_stack:
                low[v] = min(low[v], index[e.target])
        if low[v] == index[v]:
            scc = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                scc.append(w)
                if w == v:
                    break
            if len(scc) > 1:
                circles.append(sorted(scc))

    for m in modules():
        if m.name not in index:
            visit(m.name)
    described = []
    for scc in circles:
        members = set(scc)
        described.append(" <-> ".join(scc) + "\n  " + "\n  ".join(
            str(e) for v in scc for e in graph[v] if e.target in members))
    assert not circles, "import cycles:\n" + "\n".join(described)


def _imports_of_tests(path: Path) -> list[tuple[int, str]]:
    """The ``tests...`` modules a file imports, with their lines (imports anywhere in it, and
    ``from tests import X`` as ``tests.X``)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 \
                and node.module.split(".")[0] == "tests":
            if node.module == "tests":
                out += [(node.lineno, f"tests.{a.name}") for a in node.names]
            else:
                out.append((node.lineno, node.module))
        elif isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names if a.name.split(".")[0] == "tests"]
    return out


def test_tests_import_helpers_only_from_tests_support() -> None:
    """Test modules share code through ``tests/support/`` and never import one another;
    benchmarks, fuzz harnesses, examples and the package import nothing of ``tests/`` outside
    ``tests/support/`` (a test module is free to change without breaking a harness)."""
    files = [p for d in ("tests", "fuzz", "benchmarks", "examples", "feedline", "deploy")
             for p in (ROOT / d).rglob("*.py")]
    assert len(files) > 200, len(files)
    bad = [f"{p.relative_to(ROOT)}:{line}: imports {mod}" for p in files
           for line, mod in _imports_of_tests(p)
           if not (mod == "tests.support" or mod.startswith("tests.support."))]
    assert not bad, "\n".join(bad)


def test_test_folders_mirror_the_package() -> None:
    """Test modules live in folders by what they test (tests/broker/, tests/exact/, ...); only
    this one, about the whole tree, sits at the top."""
    top = sorted(p.name for p in (ROOT / "tests").glob("test_*.py"))
    assert top == ["test_layering.py"], top
    folders = {p.parent.name for p in (ROOT / "tests").rglob("test_*.py")} - {"tests"}
    assert {"broker", "consumer", "producer", "exact", "protocol", "transport"} <= folders, \
        folders
