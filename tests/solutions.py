"""The reference solutions, read from the chapters' notebooks.

The checker tests run the very code the book shows in its solution dropdowns and the grader
builds its reference from, not a copy that could drift from it. A solution is executed into
the calling test module's namespace: the module's imports are what the notebook's setup
cells provide, and the classes and functions it defines belong to that module, so the ranks
that ``launch`` starts find them by importing it, as they find the module's other answers.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from labs.grading.notebook import CellTag, cell_exercise, has_tag, read_notebook

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"


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
