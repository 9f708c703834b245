"""The package's modules as source: every ``feedline/**/*.py`` with its module name and its
parsed syntax tree, for the tests that read the code itself (test_errors, test_layering)."""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "feedline"


@dataclass(frozen=True)
class Module:
    name: str  # feedline.producer.sender
    path: Path
    tree: ast.Module
    is_package: bool  # an __init__.py: relative imports start from the module itself

    @property
    def rel(self) -> str:
        return str(self.path.relative_to(ROOT))


@cache
def modules() -> tuple[Module, ...]:
    """Every Python module of the package, sorted by name (the symlinked top-level
    ``producer/``, ``broker/``, ``consumer/`` folders are the same files: not walked)."""
    out = []
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        if is_package:
            parts.pop()
        out.append(Module(".".join(parts), path, ast.parse(path.read_text(), str(path)),
                          is_package))
    assert len(out) > 100, f"only {len(out)} modules under {PACKAGE}"
    return tuple(out)


@cache
def extension_modules() -> frozenset[str]:
    """The C extensions' module names (``PyInit_<name>`` in a C file of the package)."""
    out = set()
    for path in PACKAGE.rglob("*.c"):
        package = ".".join(path.parent.relative_to(ROOT).parts)
        out |= {f"{package}.{n}" for n in re.findall(r"PyInit_(\w+)", path.read_text())}
    return frozenset(out)
