"""The book's pages, read from ``_toc.yml``: the tests that open rendered pages take their lists
from here, so a new chapter is one line in the table of contents, not one in every test."""

from __future__ import annotations

from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]


def toc_files(caption: str, toc: Path = ROOT / "_toc.yml", sections: bool = True) -> list[str]:
    """The files listed under the part ``caption`` of the table of contents, in book order
    (with ``sections``, each chapter's section pages after it)."""
    parts = yaml.safe_load(toc.read_text())["parts"]
    found = [part for part in parts if part.get("caption") == caption]
    if len(found) != 1:
        raise ValueError(f"{toc.name} has {len(found)} parts captioned {caption!r}")
    entries = found[0]["chapters"]
    if not sections:
        return [entry["file"] for entry in entries]
    return [page for entry in entries for page in _pages(entry)]


def _pages(entry: dict) -> list[str]:
    """A chapter's file, then those of its sections (a chapter may run over several pages)."""
    return [entry["file"], *(page for section in entry.get("sections", ())
                             for page in _pages(section))]


#: The rendered chapter pages (``notebooks/NN_name.html``), in book order, a chapter's
#: sections (its later pages) after it.
CHAPTER_PAGES = [f"{name}.html" for name in toc_files("Chapters")]
#: Each chapter's first page: the one that holds its panel, exercises and summary.
CHAPTER_FIRST_PAGES = [f"{entry}.html" for entry in toc_files("Chapters", sections=False)]
