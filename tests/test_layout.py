"""The layout of ``labs`` keeps its imports pointing one way, checked on the source with ``ast``.

The modules a learner reads sit at the top of ``labs/``; what serves them is grouped in
subpackages (``checks``, ``experiments``, ``viz``, ``bench``, ``grading``) and imports the
library, never the other way round. Four rules, each shown failing on a made-up package at
the end of this file:

1. a top-level module imports none of the machinery, at module level, inside a function or
   under ``TYPE_CHECKING`` (``labs/__main__.py``, the command line, is the top of it all and
   may);
2. no cycle among the modules' module-level imports (the imports that run when a module is
   first imported; ``TYPE_CHECKING`` ones never run);
3. no function-level import that only dodges a cycle: none at all of ``labs`` in a top-level
   module, and none anywhere whose target imports the importer back at module level;
4. no module over 600 lines (a module a reader can hold; split by object).
"""

from __future__ import annotations

import ast
import enum
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

LABS = Path(__file__).resolve().parent.parent / "labs"
#: The subpackages that serve the library: it never imports them.
MACHINERY = ("checks", "experiments", "viz", "bench", "grading")
#: The command line: it runs the machinery, and nothing imports it.
ENTRY_POINTS = ("__main__",)
MAX_LINES = 600


class Scope(enum.Enum):
    """Where an import statement sits, which says when it runs."""

    MODULE = "at module level"  #: when the module is first imported
    FUNCTION = "inside a function"  #: when the function is called
    TYPE_CHECKING = "under TYPE_CHECKING"  #: never (only a type checker reads it)


@dataclass(frozen=True)
class Import:
    """One module of the package importing another (``target``) from line ``line``."""

    source: str
    target: str
    line: int
    scope: Scope

    def __str__(self) -> str:
        return f"{self.source}:{self.line} imports {self.target} {self.scope.value}"


def modules(root: Path) -> dict[str, Path]:
    """Dotted name -> file of every module of the package in ``root`` (a directory named as
    the package); a package's ``__init__.py`` is the package's own name."""
    found = {}
    for path in sorted(root.rglob("*.py")):
        parts = [root.name, *path.relative_to(root).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _is_type_checking(test: ast.expr) -> bool:
    return ast.unparse(test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING")


def _statements(body: list[ast.stmt], scope: Scope) -> Iterator[tuple[ast.stmt, Scope]]:
    """Every statement under ``body`` with the scope it runs in (a class body runs where the
    class statement does; a def's body when called)."""
    for node in body:
        yield node, scope
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            inner = Scope.TYPE_CHECKING if scope is Scope.TYPE_CHECKING else Scope.FUNCTION
            yield from _statements(node.body, inner)
        elif isinstance(node, ast.If) and _is_type_checking(node.test):
            yield from _statements(node.body, Scope.TYPE_CHECKING)
            yield from _statements(node.orelse, scope)
        else:
            for field in ("body", "orelse", "finalbody", "handlers", "cases"):
                children = getattr(node, field, None)
                if isinstance(children, list):
                    yield from _statements([c for c in children if isinstance(c, ast.AST)],
                                           scope)


def imports(root: Path) -> list[Import]:
    """Every import of one of the package's modules by another, with its scope."""
    names = modules(root)
    found = []
    for source, path in names.items():
        package = source if path.name == "__init__.py" else source.rpartition(".")[0]
        for node, scope in _statements(ast.parse(path.read_text()).body, Scope.MODULE):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: up from this module's package
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([base] if base else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in names else base
                           for a in node.names]
            for target in dict.fromkeys(targets):
                if target == root.name or target.startswith(root.name + "."):
                    found.append(Import(source, target, node.lineno, scope))
    return found


def top_level(root: Path) -> list[str]:
    """The modules a learner reads: the package itself and each module file at its top, but
    the entry points."""
    return [name for name, path in modules(root).items()
            if path.parent == root and path.stem not in ENTRY_POINTS]


def machinery_imports(root: Path) -> list[str]:
    """Rule 1: a top-level module importing a machinery subpackage, in any scope."""
    library = set(top_level(root))
    below = tuple(f"{root.name}.{m}" for m in MACHINERY)
    return [str(i) for i in imports(root)
            if i.source in library and (i.target in below or i.target.startswith(
                tuple(b + "." for b in below)))]


def _ancestors(name: str) -> list[str]:
    """``a.b.c`` -> ``["a", "a.b"]``: the packages Python imports before ``a.b.c``."""
    parts = name.split(".")
    return [".".join(parts[:k]) for k in range(1, len(parts))]


def _graph(root: Path) -> dict[str, set[str]]:
    """Module -> the modules it imports at module level, with the target's packages that are
    not already the importer's own (importing ``labs.checks.core`` runs ``labs/checks``'s
    ``__init__`` first)."""
    graph: dict[str, set[str]] = {name: set() for name in modules(root)}
    for i in imports(root):
        if i.scope is not Scope.MODULE:
            continue
        mine = {i.source, *_ancestors(i.source)}
        graph[i.source].update(t for t in (*_ancestors(i.target), i.target)
                               if t in graph and t not in mine)
    return graph


def _reaches(graph: dict[str, set[str]], start: str, goal: str) -> bool:
    seen, todo = set(), [start]
    while todo:
        name = todo.pop()
        if name == goal:
            return True
        if name not in seen:
            seen.add(name)
            todo.extend(graph.get(name, ()))
    return False


def cycles(root: Path) -> list[list[str]]:
    """Rule 2: the strongly connected components of the module-level import graph that hold
    more than one module, or one that imports itself (each sorted; Tarjan's algorithm)."""
    graph = _graph(root)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(name: str) -> None:
        index[name] = low[name] = len(index)
        stack.append(name)
        for target in sorted(graph[name]):
            if target not in index:
                visit(target)
                low[name] = min(low[name], low[target])
            elif target in stack:
                low[name] = min(low[name], index[target])
        if low[name] == index[name]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == name:
                    break
            if len(component) > 1 or name in graph[name]:
                found.append(sorted(component))

    for name in sorted(graph):
        if name not in index:
            visit(name)
    return found


def dodging_imports(root: Path) -> list[str]:
    """Rule 3: a function-level import of the package in a top-level module, or anywhere one
    whose target imports the importer back (so that at module level it would be a cycle)."""
    library = set(top_level(root))
    graph = _graph(root)
    found = []
    for i in imports(root):
        if i.scope is not Scope.FUNCTION:
            continue
        if i.source in library:
            found.append(f"{i} (a top-level module imports the package at module level only)")
        elif i.target in graph and _reaches(graph, i.target, i.source):
            found.append(f"{i} (it imports {i.source} back: a cycle put off until the call)")
    return found


def oversized(root: Path, limit: int = MAX_LINES) -> list[str]:
    """Rule 4: modules over ``limit`` lines."""
    found = []
    for name, path in modules(root).items():
        lines = len(path.read_text().splitlines())
        if lines > limit:
            found.append(f"{name}: {lines} lines")
    return found


# --- the rules on labs --------------------------------------------------------------------------


def test_the_library_never_imports_the_machinery():
    assert machinery_imports(LABS) == []


def test_no_import_cycles():
    assert cycles(LABS) == []


def test_no_function_level_import_dodges_a_cycle():
    assert dodging_imports(LABS) == []


def test_every_module_fits_a_reader():
    assert oversized(LABS) == []


def test_the_rules_see_the_whole_library():
    """The checker finds labs' modules and their imports (an empty scan would pass anything)."""
    names = modules(LABS)
    assert {"labs", "labs.collectives", "labs.viz.widgets", "labs.checks.core"} <= set(names)
    assert "labs.collectives" in top_level(LABS) and "labs.__main__" not in top_level(LABS)
    assert "labs.experiments.timing" not in top_level(LABS)
    found = imports(LABS)
    assert any(i.source == "labs.experiments.timing" and i.target == "labs.collectives"
               and i.scope is Scope.MODULE for i in found)
    assert any(i.source == "labs" and i.target == "labs.launcher" for i in found)


# --- each rule fails on a made-up package -------------------------------------------------------


def _package(root: Path, files: dict[str, str]) -> Path:
    """A package ``toy`` under ``root`` with ``files`` (path -> source) and empty
    ``__init__.py`` files for every directory."""
    package = root / "toy"
    for name, source in files.items():
        path = package / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(source)
    for directory in [package, *(p for p in package.rglob("*") if p.is_dir())]:
        (directory / "__init__.py").touch()
    return package


CLEAN = {
    "p2p.py": "import torch\n",
    "collectives.py": "from toy.p2p import torch\n\ndef later():\n    import math\n",
    "checks/core.py": "from toy import collectives\n",
    "checks/ring.py": "from toy.checks.core import collectives\n\n"
                      "def later():\n    from toy.collectives import torch\n",
    "__main__.py": "from toy.checks import ring\n",
}


def test_a_clean_package_passes_every_rule(tmp_path):
    toy = _package(tmp_path, CLEAN)
    assert machinery_imports(toy) == [] and cycles(toy) == []
    assert dodging_imports(toy) == [] and oversized(toy) == []


@pytest.mark.parametrize(("rule", "files", "expected"), [
    (machinery_imports, {"memory.py": "def check():\n    from toy.checks.core import x\n"},
     ["toy.memory:2 imports toy.checks.core inside a function"]),
    (machinery_imports, {"cost.py": "from toy.experiments import timing\n",
                         "experiments/timing.py": ""},
     ["toy.cost:1 imports toy.experiments.timing at module level"]),
    (machinery_imports, {"tables.py": "from typing import TYPE_CHECKING\n"
                                      "if TYPE_CHECKING:\n    import toy.viz.plots\n"},
     ["toy.tables:3 imports toy.viz.plots under TYPE_CHECKING"]),
    (machinery_imports, {"__init__.py": "from . import grading\n", "grading/grade.py": ""},
     ["toy:1 imports toy.grading at module level"]),
    (cycles, {"cost.py": "from toy.experiments.fit import fit\n",
              "experiments/fit.py": "from toy import cost\n"},
     [["toy.cost", "toy.experiments.fit"]]),
    (cycles, {"a.py": "import toy.b\n", "b.py": "from toy.c import x\n",
              "c.py": "from .a import y\n"},
     [["toy.a", "toy.b", "toy.c"]]),
    (cycles, {"memory.py": "from toy.checks.core import verdict\n",
              "checks/__init__.py": "from toy.checks.ring import check\n",
              "checks/ring.py": "from toy.memory import held\n"},
     [["toy.checks", "toy.checks.ring", "toy.memory"]]),
    (dodging_imports, {"memory.py": "def check():\n    from toy.launcher import x\n",
                       "launcher.py": "X = 1\n"},
     ["toy.memory:2 imports toy.launcher inside a function (a top-level module imports the "
      "package at module level only)"]),
    (dodging_imports, {"viz/a.py": "def f():\n    from toy.viz.b import g\n",
                       "viz/b.py": "from toy.viz import a\n"},
     ["toy.viz.a:2 imports toy.viz.b inside a function (it imports toy.viz.a back: a cycle "
      "put off until the call)"]),
    (oversized, {"fsdp.py": "x = 1\n" * (MAX_LINES + 1)},
     [f"toy.fsdp: {MAX_LINES + 1} lines"]),
], ids=["function-level", "module-level", "type-checking", "package-init", "cycle-of-two",
        "relative-cycle-of-three", "through-a-package-init", "lazy-in-library",
        "lazy-cycle-in-machinery", "too-long"])
def test_each_rule_fails_on_a_made_up_package(tmp_path, rule, files, expected):
    toy = _package(tmp_path, {**CLEAN, **files})
    assert rule(toy) == expected


def test_the_rules_leave_what_they_allow_alone(tmp_path):
    """What is allowed stays allowed: the entry point running the machinery, a subpackage
    importing the library lazily where nothing imports it back, an import only a type
    checker reads forming a loop, a module of exactly the limit."""
    toy = _package(tmp_path, {
        **CLEAN,
        "__main__.py": "from toy.viz import plots\nfrom toy.grading import grade\n",
        "viz/plots.py": "def draw():\n    from toy.collectives import torch\n",
        "link.py": "import typing\nif typing.TYPE_CHECKING:\n    from toy.p2p import x\n",
        "p2p.py": "from toy import link\n",
        "zero.py": "x = 1\n" * MAX_LINES,
    })
    assert machinery_imports(toy) == [] and cycles(toy) == []
    assert dodging_imports(toy) == [] and oversized(toy) == []
