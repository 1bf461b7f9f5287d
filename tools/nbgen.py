"""Shared by the tools/make_chNN.py scripts: cell builders, nbval tags, and the writer.

The chapters are kept as scripts so that they can be regenerated and reviewed as plain text;
`make notebooks` runs every script, then executes the notebooks in place.

Grading reads three roles from cell tags (see :mod:`labs.grading.notebook`): ``setup(...)``
for the imports the exercises need, ``solution(..., "N.M")`` for the reference answer of
exercise N.M, ``check(..., "N.M")`` for the ``check_*`` call that grades it. The tag strings
come from that module so that they are spelled in one place.
"""

import re
from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

from labs.grading.notebook import CellTag, exercise_tag

# nbval --nbval-lax compares these cells' outputs, on whatever machine runs the tests. So a
# CHECK cell prints nothing that depends on the machine: no timings, and no last digits of a
# float32 result that went through a matrix product or a reduction (their rounding depends on
# the CPU's BLAS kernels; the same notebook gave 4.2e-07 on one CPU and 1.5e-07 on another).
# Print such numbers in an IGNORE cell and check a bound on them in the CHECK cell after it.
CHECK = ["nbval-check-output"]
IGNORE = ["nbval-ignore-output"]  # timings, random ids: never compared
HIDE = ["hide-input"]  # plotting and plumbing: folded away in the rendered book
#: Labels of a solution's dropdown in the rendered book (myst-nb reads them from the cell's
#: "mystnb" metadata; without them the dropdown says "Show code cell source").
SOLUTION_PROMPTS = {"code_prompt_show": "Show solution", "code_prompt_hide": "Hide solution"}


def md(text: str) -> nbformat.NotebookNode:
    return new_markdown_cell(text.strip())


def code(text: str, tags: list[str] | None = None) -> nbformat.NotebookNode:
    cell = new_code_cell(text.strip())
    if tags:
        cell.metadata["tags"] = tags
    return cell


def setup(text: str) -> nbformat.NotebookNode:
    """The chapter's imports: everything its solution and check cells need. The grader runs
    these cells before the learner's code."""
    return code(text, [CellTag.SETUP.value])


def solution(text: str, exercise: str) -> nbformat.NotebookNode:
    """The reference answer to exercise ``"N.M"``: folded into a "Show solution" dropdown in
    the book, replaced by a stub in the learner's released copy."""
    cell = code(text, [CellTag.SOLUTION.value, exercise_tag(exercise), *HIDE])
    cell.metadata["mystnb"] = dict(SOLUTION_PROMPTS)
    return cell


def check(text: str, exercise: str) -> nbformat.NotebookNode:
    """The ``check_*`` call grading exercise ``"N.M"``; nbval compares its verdict."""
    return code(text, [*CHECK, CellTag.CHECK.value, exercise_tag(exercise)])


def write_notebook(cells: list[nbformat.NotebookNode], name: str) -> None:
    """Write notebooks/<name> (source cells only, no outputs).

    Cell ids are ``<stem>-<index>``: regenerating a chapter changes only the ids of cells
    that moved, instead of drawing fresh random ids for every cell."""
    stem = re.sub(r"[^A-Za-z0-9_-]", "-", Path(name).stem)
    for index, cell in enumerate(cells):
        cell.id = f"{stem}-{index:03d}"
    nb = new_notebook(cells=cells)
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3",
                                 "language": "python"}
    nb.metadata["language_info"] = {"name": "python"}
    nbformat.validate(nb)  # ids must be unique, 1-64 characters of [A-Za-z0-9-_]
    Path(__file__).resolve().parents[1].joinpath("notebooks", name).write_text(
        nbformat.writes(nb)
    )
