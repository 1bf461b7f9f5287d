"""How a reference notebook marks its exercises, and how the grader reads those marks.

A chapter notebook in ``notebooks/`` is the instructor's reference. Four cell tags tell the
grader what is what; nothing else about a chapter is known to the grading code, so a new
chapter's exercises are graded as soon as its cells carry the tags:

* ``setup``: cells the exercises and their checks need (imports, constants). They run before
  the learner's code when grading.
* ``solution`` + ``exercise-N.M``: the reference solution of exercise N.M (one or more cells).
  Released copies replace each one by a stub.
* ``check`` + ``exercise-N.M``: one call to a ``check_*`` function of :mod:`labs.checks`; the
  output stored in the reference is the verdict a right answer prints.

The learner's code for exercise N.M is every cell of their copy tagged
``solution``/``exercise-N.M``, plus any untagged code cell they added between the first such
cell and the exercise's check cell (a split cell, a helper).
"""

from __future__ import annotations

import ast
import enum
import re
from dataclasses import dataclass, field
from pathlib import Path

import nbformat

#: Prefix of the tag naming a cell's exercise: ``exercise-2.1``.
EXERCISE_TAG_PREFIX = "exercise-"
_EXERCISE_ID = re.compile(r"^\d+\.\d+$")
_HEADING = re.compile(r"^#+\s*Exercise\s+(\d+\.\d+)\s*[:.]?\s*(.*)$", re.MULTILINE)
#: Check functions are recognised by name; their ``seed`` keyword draws the hidden cases.
CHECK_PREFIX = "check_"


class CellTag(enum.Enum):
    """The role of a cell in a reference notebook, stored as a Jupyter cell tag."""

    SETUP = "setup"
    """Needed by the exercises and checks: run before the learner's code when grading."""
    SOLUTION = "solution"
    """The reference answer to an exercise; a stub in the learner's copy."""
    CHECK = "check"
    """One call to a ``check_*`` function; its stored output is the expected verdict."""


class GradingError(ValueError):
    """A notebook the grader cannot use; the message says what to change."""


def exercise_tag(exercise: str) -> str:
    """The tag of exercise ``"2.1"``: ``"exercise-2.1"``."""
    if not _EXERCISE_ID.match(exercise):
        raise GradingError(f"exercise ids look like '2.1', got {exercise!r}.")
    return EXERCISE_TAG_PREFIX + exercise


def tags(cell: nbformat.NotebookNode) -> list[str]:
    return list(cell.get("metadata", {}).get("tags", []))


def cell_exercise(cell: nbformat.NotebookNode) -> str | None:
    """The exercise id a cell's tags name, or None."""
    ids = [t[len(EXERCISE_TAG_PREFIX):] for t in tags(cell) if t.startswith(EXERCISE_TAG_PREFIX)]
    return ids[0] if ids else None


def has_tag(cell: nbformat.NotebookNode, tag: CellTag) -> bool:
    return tag.value in tags(cell)


@dataclass(frozen=True)
class CheckCall:
    """The one ``check_*(...)`` call of a check cell."""

    function: str
    """Name of the check function, e.g. ``check_ring_all_reduce``."""
    submitted: tuple[str, ...]
    """Notebook names passed to it: the functions the learner writes."""
    call_source: str
    """The call expression alone (no assignment), as source."""
    names: tuple[str, ...] = ()
    """Every name the call reads: the check function, the learner's functions, and any
    other name it passes (a constant from a setup cell, say)."""

    def with_seed(self, seed: int) -> str:
        """Source of the same call drawing the hidden cases of ``seed``."""
        return self.with_keywords(seed=seed)

    def with_keywords(self, **values: int | float) -> str:
        """Source of the same call with these keyword arguments (``seed=``, ``timeout=``),
        replacing any it gave."""
        call = ast.parse(self.call_source, mode="eval").body
        assert isinstance(call, ast.Call)
        call.keywords = [k for k in call.keywords if k.arg not in values]
        call.keywords += [ast.keyword(arg=name, value=ast.Constant(value))
                          for name, value in values.items()]
        return ast.unparse(call)


def parse_check(source: str, where: str) -> CheckCall:
    """Read a check cell: exactly one statement, a ``check_*`` call (its result may be
    assigned), whose positional arguments are the learner's functions by name."""
    try:
        body = ast.parse(source).body
    except SyntaxError as err:
        raise GradingError(f"{where}: the check cell does not parse: {err}.") from err
    value = None
    if len(body) == 1 and isinstance(body[0], (ast.Assign, ast.Expr)):
        value = body[0].value
    call_ok = (isinstance(value, ast.Call) and isinstance(value.func, ast.Name)
               and value.func.id.startswith(CHECK_PREFIX))
    if not call_ok:
        raise GradingError(
            f"{where}: a check cell holds one call to a {CHECK_PREFIX}* function, such as "
            f"`result = check_ring_all_reduce(my_ring_all_reduce)`; got:\n{source}")
    assert isinstance(value, ast.Call) and isinstance(value.func, ast.Name)
    names = tuple(a.id for a in value.args if isinstance(a, ast.Name))
    if not names:
        raise GradingError(f"{where}: the check call passes no notebook function by name.")
    read = tuple(dict.fromkeys(n.id for n in ast.walk(value) if isinstance(n, ast.Name)))
    return CheckCall(value.func.id, names, ast.unparse(value), read)


@dataclass(frozen=True)
class ExerciseCells:
    """Where one exercise lives in a notebook (cell indices)."""

    exercise: str
    """The id, ``"2.1"``."""
    title: str
    """From the ``## Exercise 2.1: ...`` heading above it; empty when there is none."""
    solutions: tuple[int, ...]
    checks: tuple[int, ...]
    calls: tuple[CheckCall, ...] = field(compare=False)

    @property
    def submitted(self) -> tuple[str, ...]:
        """The names the checks take from the learner's code, in order, once each."""
        return tuple(dict.fromkeys(n for c in self.calls for n in c.submitted))


@dataclass(frozen=True)
class Chapter:
    """A reference notebook read for grading: its setup cells and its exercises."""

    path: Path
    nb: nbformat.NotebookNode = field(compare=False, repr=False)
    setup: tuple[int, ...]
    exercises: tuple[ExerciseCells, ...]

    @property
    def name(self) -> str:
        return self.path.name

    def exercise(self, exercise: str) -> ExerciseCells:
        for ex in self.exercises:
            if ex.exercise == exercise:
                return ex
        known = ", ".join(e.exercise for e in self.exercises)
        raise GradingError(f"{self.name} has no exercise {exercise} (it has {known}).")

    def sources(self, indices: tuple[int, ...]) -> list[str]:
        return [self.nb.cells[i].source for i in indices]

    def builds_on(self, exercise: ExerciseCells) -> tuple[ExerciseCells, ...]:
        """The earlier exercises of this chapter whose answers ``exercise``'s reference
        solution uses (4.2's all-reduce calls 4.1's all-gather): the names it reads that their
        reference solutions define."""
        read = {n.id for s in self.sources(exercise.solutions) for n in ast.walk(_parsed(s))
                if isinstance(n, ast.Name)}
        earlier = self.exercises[:self.exercises.index(exercise)]
        return tuple(ex for ex in earlier
                     if read & {n for s in self.sources(ex.solutions) for n in _defined(s)})

    @classmethod
    def load(cls, path: Path) -> Chapter:
        """Read and validate a reference notebook; raise GradingError naming the cell."""
        nb = read_notebook(path)
        setup: list[int] = []
        found: dict[str, dict[str, list[int]]] = {}
        titles = _heading_titles(nb)
        for index, cell in enumerate(nb.cells):
            where = f"{path.name}, cell {index}"
            exercise = cell_exercise(cell)
            roles = [t for t in CellTag if has_tag(cell, t)]
            if cell.cell_type != "code":
                if roles or exercise:
                    raise GradingError(f"{where}: only code cells carry grading tags.")
                continue
            if CellTag.SETUP in roles:
                if exercise or len(roles) > 1:
                    raise GradingError(f"{where}: a setup cell belongs to no exercise.")
                setup.append(index)
                continue
            graded = [r for r in roles if r is not CellTag.SETUP]
            if not graded and not exercise:
                continue
            if len(graded) != 1 or exercise is None:
                raise GradingError(
                    f"{where}: tag it either 'solution' or 'check', and 'exercise-N.M' "
                    f"(it has tags {tags(cell)}).")
            exercise_tag(exercise)  # validates the id
            found.setdefault(exercise, {"solution": [], "check": []})[graded[0].value].append(
                index)
        exercises = []
        for exercise, cells in found.items():
            if not cells["solution"] or not cells["check"]:
                raise GradingError(
                    f"{path.name}: exercise {exercise} needs at least one 'solution' and one "
                    f"'check' cell (it has {len(cells['solution'])} and "
                    f"{len(cells['check'])}).")
            if max(cells["solution"]) > min(cells["check"]):
                raise GradingError(
                    f"{path.name}: exercise {exercise}'s solution cells must come before its "
                    "check cells.")
            calls = tuple(parse_check(nb.cells[i].source, f"{path.name}, cell {i}")
                          for i in cells["check"])
            exercises.append(ExerciseCells(exercise, titles.get(exercise, ""),
                                           tuple(cells["solution"]), tuple(cells["check"]),
                                           calls))
        return cls(path, nb, tuple(setup), tuple(exercises))


def _parsed(source: str) -> ast.Module:
    try:
        return ast.parse(source)
    except SyntaxError:
        return ast.Module(body=[], type_ignores=[])


def _defined(source: str) -> set[str]:
    """The names a cell defines at its top level (functions, classes, assignments)."""
    names = set()
    for node in _parsed(source).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {t.id for t in targets if isinstance(t, ast.Name)}
    return names


def _heading_titles(nb: nbformat.NotebookNode) -> dict[str, str]:
    titles = {}
    for cell in nb.cells:
        if cell.cell_type == "markdown":
            for match in _HEADING.finditer(cell.source):
                titles[match.group(1)] = match.group(2).strip()
    return titles


def read_notebook(path: Path) -> nbformat.NotebookNode:
    """Read a notebook, or raise GradingError saying why it cannot be read."""
    if not path.is_file():
        raise GradingError(f"{path}: no such notebook.")
    if path.suffix != ".ipynb":
        raise GradingError(f"{path}: not a notebook (expected a .ipynb file).")
    try:
        return nbformat.read(path, as_version=4)
    except Exception as err:  # nbformat raises several types for a damaged file
        raise GradingError(f"{path}: cannot read it as a notebook ({err}).") from err


def learner_cells(nb: nbformat.NotebookNode, exercise: str) -> list[str]:
    """The sources of the learner's cells for ``exercise``, in notebook order.

    Cells tagged ``solution``/``exercise-N.M`` count wherever they are; an untagged code cell
    counts when it lies between the first of them and the exercise's check cell (or the next
    cell of another exercise, when the check cell was deleted)."""
    picked: list[str] = []
    inside = False
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        owner = cell_exercise(cell)
        if owner == exercise and has_tag(cell, CellTag.SOLUTION):
            picked.append(cell.source)
            inside = True
        elif owner is not None or any(has_tag(cell, t) for t in CellTag):
            inside = False  # its check cell, a setup cell or another exercise's cell
        elif inside:
            picked.append(cell.source)
    return picked
