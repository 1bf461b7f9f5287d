"""Shared by the tools/make_chNN.py scripts: cell builders, nbval tags, and the writer.

The chapters are kept as scripts so that they can be regenerated and reviewed as plain text;
`make notebooks` runs every script, then executes the notebooks in place.
"""

from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

CHECK = ["nbval-check-output"]  # nbval --nbval-lax compares these cells' outputs
IGNORE = ["nbval-ignore-output"]  # timings, random ids: never compared
HIDE = ["hide-input"]  # plotting and plumbing: folded away in the rendered book


def md(text: str) -> nbformat.NotebookNode:
    return new_markdown_cell(text.strip())


def code(text: str, tags: list[str] | None = None) -> nbformat.NotebookNode:
    cell = new_code_cell(text.strip())
    if tags:
        cell.metadata["tags"] = tags
    return cell


def write_notebook(cells: list[nbformat.NotebookNode], name: str) -> None:
    """Write notebooks/<name> (source cells only, no outputs)."""
    nb = new_notebook(cells=cells)
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3",
                                 "language": "python"}
    nb.metadata["language_info"] = {"name": "python"}
    Path(__file__).resolve().parents[1].joinpath("notebooks", name).write_text(
        nbformat.writes(nb)
    )
