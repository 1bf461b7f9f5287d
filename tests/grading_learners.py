"""Learners' notebooks for the grading attack tests: chapter 1's released copy with exercise
1.1 (one exercise, about 10 s to grade) written as a test wants it."""

from __future__ import annotations

from pathlib import Path

import nbformat

from labs.grading.handout import load_chapters, release_notebook
from labs.grading.report import ExerciseGrade, Report

REFERENCE = Path(__file__).resolve().parents[1] / "notebooks"
TOY = "01_toy_allreduce.ipynb"
CHAPTER = next(c for c in load_chapters(REFERENCE) if c.name == TOY)
SOLUTION = CHAPTER.exercise("1.1").solutions[0]
RIGHT = CHAPTER.nb.cells[SOLUTION].source + "\n"
WRONG = """
def average_gradients(model):
    for param in model.parameters():
        if param.grad is not None:
            dist.all_reduce(param.grad)  # sums; never divides
"""


def learner(directory: Path, *cells: str, name: str = TOY) -> Path:
    """A learner's copy of chapter 1 whose exercise 1.1 is ``cells`` (the first one in the
    solution cell, the others untagged cells right after it)."""
    nb = release_notebook(CHAPTER)
    nb.cells[SOLUTION].source = cells[0]
    for offset, source in enumerate(cells[1:], start=1):
        nb.cells.insert(SOLUTION + offset, nbformat.v4.new_code_cell(source))
    path = directory / name
    nbformat.write(nb, path)
    return path


def only(report: Report) -> ExerciseGrade:
    (graded,) = report.notebooks[0].exercises
    return graded
