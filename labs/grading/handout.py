"""Release: the learner's copies of the reference notebooks, with every solution stubbed.

Each ``solution`` cell becomes a stub that keeps the signatures (and docstrings) of the
functions and classes it defines and raises ``NotImplementedError("Exercise 2.1: ...")``; all
outputs and saved widget states are cleared; every other cell, tag and id is left as it is,
so the grader can find the learner's code by the same tags. The copy is stamped with the name
of its reference notebook (``metadata.labs.chapter``).
"""

from __future__ import annotations

import ast
import copy
from dataclasses import dataclass
from pathlib import Path

import nbformat

from labs.grading.notebook import CellTag, Chapter, GradingError, cell_exercise, has_tag

#: Cell tags and metadata that exist only to fold the reference solution away in the book.
_BOOK_ONLY_TAGS = ("hide-input",)
_BOOK_ONLY_METADATA = ("mystnb",)
#: Where a released copy records its chapter: ``nb.metadata[METADATA_KEY]["chapter"]``.
METADATA_KEY = "labs"


def _todo(exercise: str, what: str) -> str:
    return f"Exercise {exercise}: write {what}, then run the check cell below."


def _raise_todo(message: str) -> ast.Raise:
    call = ast.Call(ast.Name("NotImplementedError", ast.Load()), [ast.Constant(message)], [])
    return ast.Raise(exc=call, cause=None)


def _docstring(node: ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) -> list[ast.stmt]:
    first = node.body[0] if node.body else None
    is_doc = (isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
              and isinstance(first.value.value, str))
    return [first] if is_doc and first is not None else []


def _stub_function(node: ast.FunctionDef | ast.AsyncFunctionDef, exercise: str,
                   owner: str = "") -> ast.stmt:
    stub = copy.deepcopy(node)
    name = f"{owner}.{node.name}" if owner else node.name
    stub.body = [*_docstring(node), _raise_todo(_todo(exercise, f"{name}()"))]
    return stub


def _stub_class(node: ast.ClassDef, exercise: str) -> ast.stmt:
    stub = copy.deepcopy(node)
    methods: list[ast.stmt] = [
        _stub_function(item, exercise, node.name) for item in node.body
        if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef))
    ]
    stub.body = [*_docstring(node), *methods] or [ast.Pass()]
    return stub


def stub_source(source: str, exercise: str) -> str:
    """The learner's version of a solution cell.

    Imports stay; each function and class keeps its signature and docstring and raises
    ``NotImplementedError`` naming the exercise; everything else (helpers' bodies, constants,
    top-level statements) is the answer and is dropped. A cell that defines nothing raises."""
    try:
        tree = ast.parse(source)
    except SyntaxError as err:
        raise GradingError(f"exercise {exercise}: the solution cell does not parse: {err}") from err
    body: list[ast.stmt] = []
    for node in tree.body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            body.append(node)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            body.append(_stub_function(node, exercise))
        elif isinstance(node, ast.ClassDef):
            body.append(_stub_class(node, exercise))
    if not any(isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
               for n in body):
        body.append(_raise_todo(_todo(exercise, "this cell")))
    header = f"# Exercise {exercise}: your code here (replace the NotImplementedError)."
    return header + "\n" + ast.unparse(ast.Module(body=body, type_ignores=[])) + "\n"


def release_notebook(chapter: Chapter) -> nbformat.NotebookNode:
    """The learner's copy of one reference chapter."""
    nb = copy.deepcopy(chapter.nb)
    nb.metadata.pop("widgets", None)  # saved widget views are outputs too
    # The reference is paired with its MyST source; a learner's copy is one plain notebook
    # (paired, a Jupyter with jupytext would write a .md beside it at every save).
    nb.metadata.pop("jupytext", None)
    nb.metadata[METADATA_KEY] = {"chapter": chapter.name}
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        cell.outputs = []
        cell.execution_count = None
        cell.metadata.pop("execution", None)
        if has_tag(cell, CellTag.SOLUTION):
            exercise = cell_exercise(cell)
            assert exercise is not None  # Chapter.load checked it
            cell.source = stub_source(cell.source, exercise)
            cell.metadata["tags"] = [t for t in cell.metadata["tags"] if t not in _BOOK_ONLY_TAGS]
            for key in _BOOK_ONLY_METADATA:
                cell.metadata.pop(key, None)
    return nb


@dataclass(frozen=True)
class Released:
    """One learner notebook written by :func:`release`."""

    path: Path
    exercises: tuple[str, ...]


def release(reference_dir: Path, out_dir: Path, *, force: bool = False) -> list[Released]:
    """Write the learner's copy of every reference notebook in ``reference_dir`` that has
    exercises to ``out_dir`` (same file names). Refuses to overwrite unless ``force``."""
    chapters = load_chapters(reference_dir)
    out_dir = Path(out_dir)
    if out_dir.resolve() == Path(reference_dir).resolve():
        raise GradingError("OUT_DIR is the reference directory: releasing there would "
                           "overwrite the solutions. Choose another directory.")
    clashes = [c.name for c in chapters if c.exercises and (out_dir / c.name).exists()]
    if clashes and not force:
        raise GradingError(f"{out_dir} already holds {', '.join(clashes)}; pass --force to "
                           "overwrite them, or choose an empty directory.")
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for chapter in chapters:
        if not chapter.exercises:
            continue  # an appendix, say: nothing for a learner to do
        target = out_dir / chapter.name
        nbformat.write(release_notebook(chapter), target)
        written.append(Released(target, tuple(e.exercise for e in chapter.exercises)))
    return written


def load_chapters(reference_dir: Path) -> list[Chapter]:
    """Every reference notebook of a directory, validated (sorted by file name)."""
    reference_dir = Path(reference_dir)
    if not reference_dir.is_dir():
        raise GradingError(f"{reference_dir}: no such directory of reference notebooks; pass "
                           "--reference with the course's notebooks/ directory.")
    paths = sorted(reference_dir.glob("*.ipynb"))
    if not paths:
        raise GradingError(f"{reference_dir} holds no notebooks (*.ipynb).")
    chapters = [Chapter.load(p) for p in paths]
    seen: dict[str, str] = {}
    for chapter in chapters:
        for ex in chapter.exercises:
            if ex.exercise in seen:
                raise GradingError(f"exercise {ex.exercise} appears in both "
                                   f"{seen[ex.exercise]} and {chapter.name}.")
            seen[ex.exercise] = chapter.name
    return chapters
