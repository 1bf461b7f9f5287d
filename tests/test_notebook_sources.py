"""Each chapter's source, ``notebooks/NN_name.md`` (a MyST Markdown notebook), agrees with
its executed ``notebooks/NN_name.ipynb``, which nbval, the grader and the book read.

An edit of one file that never reached the other (the .md edited and not re-executed, or the
.ipynb edited in a Jupyter without jupytext) fails here, cell by cell, with what to run.
"""

from __future__ import annotations

import copy
from pathlib import Path

import jupytext
import nbformat
import pytest

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"
CHAPTERS = sorted(NOTEBOOKS.glob("*.ipynb"))
#: Cell metadata a front end writes for itself (scroll state, run times), not the author.
FRONT_END_KEYS = {"collapsed", "scrolled", "execution", "ExecuteTime", "trusted"}


def cell_label(index: int, cell: nbformat.NotebookNode) -> str:
    first = cell.source.strip().splitlines()[0][:60] if cell.source.strip() else "(empty)"
    return f"cell {index} ({cell.cell_type}: {first!r})"


def disagreements(md: nbformat.NotebookNode, ipynb: nbformat.NotebookNode) -> list[str]:
    """How two notebooks differ in their cells' types, sources, tags and other options."""
    problems = []
    if len(md.cells) != len(ipynb.cells):
        problems.append(f"the .md has {len(md.cells)} cells, the .ipynb {len(ipynb.cells)}")
    for index, (a, b) in enumerate(zip(md.cells, ipynb.cells, strict=False)):
        label = cell_label(index, b)
        if a.cell_type != b.cell_type:
            problems.append(f"{label}: a {a.cell_type} cell in the .md")
        elif a.source != b.source:
            problems.append(f"{label}: its source differs")
        meta_a, meta_b = ({k: v for k, v in c.metadata.items() if k not in FRONT_END_KEYS}
                          for c in (a, b))
        if meta_a.get("tags", []) != meta_b.get("tags", []):
            problems.append(f"{label}: tags {meta_a.get('tags', [])} in the .md, "
                            f"{meta_b.get('tags', [])} in the .ipynb")
        elif meta_a != meta_b:
            problems.append(f"{label}: options {meta_a} in the .md, {meta_b} in the .ipynb")
    return problems


def test_there_are_chapters():
    assert len(CHAPTERS) >= 7, CHAPTERS


@pytest.mark.parametrize("ipynb", CHAPTERS, ids=[p.stem for p in CHAPTERS])
def test_a_chapter_source_and_its_executed_notebook_agree(ipynb):
    md = ipynb.with_suffix(".md")
    assert md.exists(), (f"{ipynb.name} has no source {md.name}: run "
                         f"jupytext --set-formats ipynb,md:myst {ipynb}")
    stored = nbformat.read(ipynb, as_version=4)
    assert stored.metadata.get("jupytext", {}).get("formats") == "ipynb,md:myst", (
        f"{ipynb.name} is not paired with its .md: run jupytext --set-formats ipynb,md:myst")
    problems = disagreements(jupytext.read(md), stored)
    assert not problems, (f"{md.name} and {ipynb.name} disagree: " + "; ".join(problems)
                          + f". Run make chapter NB={ipynb.stem.split('_')[0]}, which syncs the "
                          "two (from the one edited last) and re-executes the chapter.")


def test_every_source_has_its_executed_notebook():
    orphans = [md.name for md in NOTEBOOKS.glob("*.md") if not md.with_suffix(".ipynb").exists()]
    assert not orphans, f"{orphans}: run make chapter NB=NN to create and execute the .ipynb"


def test_a_pair_that_disagrees_is_caught():
    """The comparison above fails on a source edit, a changed tag and a changed option."""
    md = jupytext.read(NOTEBOOKS / "01_toy_allreduce.md")
    ipynb = nbformat.read(NOTEBOOKS / "01_toy_allreduce.ipynb", as_version=4)
    assert disagreements(md, ipynb) == []
    edited = copy.deepcopy(md)
    code = [i for i, c in enumerate(edited.cells) if c.cell_type == "code"]
    edited.cells[code[0]].source += "\nprint('an edit')"
    edited.cells[code[1]].metadata["tags"] = ["nbval-ignore-output"]
    solution = next(i for i, c in enumerate(edited.cells) if "mystnb" in c.metadata)
    edited.cells[solution].metadata["mystnb"] = {"code_prompt_show": "Show code"}
    problems = disagreements(edited, ipynb)
    assert len(problems) == 3, problems
    assert "source differs" in problems[0] and "tags" in problems[1]
    assert "options" in problems[2]
    fewer = copy.deepcopy(md)
    del fewer.cells[-1]
    assert disagreements(fewer, ipynb)[0] == (
        f"the .md has {len(md.cells) - 1} cells, the .ipynb {len(md.cells)}")
