"""The reference solutions, read from the chapters' notebooks.

The checker tests run the very code the book shows in its solution dropdowns and the grader
builds its reference from, not a copy that could drift from it. :func:`solution` executes a
solution into the calling test module's namespace: the module's imports are what the
notebook's setup cells provide, and the classes and functions it defines belong to that
module, as its other answers do. :func:`reference` runs a whole chapter, setup cells
included, in a namespace of its own, as the grader's kernel does: what the check contract
(``test_check_contract.py``) hands every check. Both travel to the ranks by value, as a
notebook's functions do (:func:`send_by_value`).
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path
from typing import Any

import cloudpickle

from labs.checks.exercises import ExerciseSpec
from labs.grading.notebook import CellTag, Chapter, cell_exercise, has_tag, read_notebook

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"


def send_by_value(module_name: str) -> None:
    """The functions and classes of test module ``module_name`` travel to the ranks by value,
    as a notebook's do, instead of by reference: a rank then never imports the test module,
    which reads notebooks with nbformat when it is imported (about a second of CPU per rank
    on 2 cores, more than the rank's own work in most checks)."""
    cloudpickle.register_pickle_by_value(sys.modules[module_name])


def solution(notebook: str, exercise: str, name: str, namespace: dict[str, Any]) -> Any:
    """Run the cells tagged ``solution`` of ``exercise`` in ``notebook`` into ``namespace``
    (pass ``globals()``) and return what they define as ``name``."""
    nb = read_notebook(NOTEBOOKS / notebook)
    sources = [cell.source for cell in nb.cells if cell.cell_type == "code"
               and cell_exercise(cell) == exercise and has_tag(cell, CellTag.SOLUTION)]
    if not sources:
        raise LookupError(f"{notebook} has no solution cell for exercise {exercise}.")
    for source in sources:
        exec(compile(source, f"{notebook} (solution of {exercise})", "exec"), namespace)
    if name not in namespace:
        raise LookupError(f"the solution of {exercise} in {notebook} does not define {name}.")
    return namespace[name]


@functools.cache
def chapter_namespace(notebook: str) -> dict[str, Any]:
    """What chapter ``notebook`` (a stem: ``05_ddp``) defines once its setup cells and every
    reference solution have run, in the notebook's order, in a namespace of its own (as the
    grader's kernel runs them). What it defines travels to the ranks by value: its module name
    is no importable module."""
    chapter = Chapter.load(NOTEBOOKS / f"{notebook}.ipynb")
    namespace: dict[str, Any] = {"__name__": f"reference of {notebook}"}
    for index in (*chapter.setup, *(i for ex in chapter.exercises for i in ex.solutions)):
        exec(compile(chapter.nb.cells[index].source, f"{notebook}.ipynb, cell {index}", "exec"),
             namespace)
    return namespace


def reference(row: ExerciseSpec) -> Any:
    """The notebook's solution of exercise ``row``: what its check cell passes."""
    return chapter_namespace(row.notebook)[row.learner_name]
