"""The book's pages, read from ``_toc.yml``: the tests that open rendered pages take their lists
from here, so a new chapter is one line in the table of contents, not one in every test."""

from __future__ import annotations

from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]


def toc_files(caption: str, toc: Path = ROOT / "_toc.yml") -> list[str]:
    """The files listed under the part ``caption`` of the table of contents, in book order."""
    parts = yaml.safe_load(toc.read_text())["parts"]
    found = [part for part in parts if part.get("caption") == caption]
    if len(found) != 1:
        raise ValueError(f"{toc.name} has {len(found)} parts captioned {caption!r}")
    return [entry["file"] for entry in found[0]["chapters"]]


#: The rendered chapter pages (``notebooks/NN_name.html``), in book order.
CHAPTER_PAGES = [f"{name}.html" for name in toc_files("Chapters")]
