"""What the instructor gives ``grade``: notebooks and folders of them, read as the grader
reads anything a learner made, often as root.

A hand-in is a regular file the learner gave, and nothing else. Before the grader reads a
byte of it (:func:`read_hand_in`), it is refused, as that notebook's failure, when it is a
link (which could name a host file the grader would read as root, or the reference notebook
itself), a FIFO (which would block the grader), a device or a folder, a file with other names
(a hard link), the reference notebook by another path, or larger than
:data:`MAX_NOTEBOOK_BYTES`. A folder is searched for ``*.ipynb`` without following a link
(:func:`hand_ins`); a link found there is refused the same way. A notebook is read as JSON
into the little the grader uses (:func:`parse_notebook`: each cell's type, source and tags,
the chapter a release stamped), and why one cannot be read never quotes its bytes.
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import nbformat

from labs.grading.notebook import GradingError

#: The most bytes of one notebook the grader reads: a chapter's notebook with its outputs
#: and figures is under 2 MiB.
MAX_NOTEBOOK_BYTES = 32 << 20
#: The most notebooks one folder may hold (a class's worth, many times over).
MAX_HAND_INS = 10_000
_NOTEBOOK = ".ipynb"


@dataclass(frozen=True)
class HandIn:
    """One notebook to grade: where it was found, and its cells, or why it cannot be read."""

    path: Path
    notebook: nbformat.NotebookNode | None = None
    problem: str = ""


def hand_ins(paths: Sequence[Path], reference_dir: Path) -> list[HandIn]:
    """The notebooks ``paths`` name, in order: a file is one hand-in, a folder every
    ``*.ipynb`` under it (sorted, links not followed). Raises :class:`GradingError` before
    anything is read when a path does not exist (the instructor's typo, not a learner's
    hand-in) or when nothing is left to grade."""
    if not paths:
        raise GradingError("give at least one learner notebook (or a folder of them) to grade.")
    found: list[Path] = []
    for path in map(Path, paths):
        if not os.path.lexists(path):
            raise GradingError(f"{path}: no such file or folder.")
        if path.is_dir() and not path.is_symlink():
            found += _notebooks_in(path)
        else:
            found.append(path)
    if not found:
        raise GradingError(f"no notebook (*{_NOTEBOOK}) in {', '.join(map(str, paths))}.")
    reference = _reference_files(reference_dir)
    return [read_hand_in(p, reference_dir, reference) for p in found]


def _notebooks_in(folder: Path) -> list[Path]:
    """Every ``*.ipynb`` under ``folder``, links to files included (refused when read) and
    links to folders not entered, at most :data:`MAX_HAND_INS`."""
    found = []
    for parent, dirs, files in os.walk(folder, followlinks=False):
        dirs.sort()
        for name in sorted(files + [d for d in dirs if os.path.islink(os.path.join(parent, d))]):
            if name.endswith(_NOTEBOOK) and not name.startswith("."):
                found.append(Path(parent) / name)
        dirs[:] = [d for d in dirs if not d.startswith(".")
                   and not os.path.islink(os.path.join(parent, d))]
        if len(found) > MAX_HAND_INS:
            raise GradingError(f"{folder}: more than {MAX_HAND_INS} notebooks; grade it in "
                               "parts.")
    return found


def _reference_files(reference_dir: Path) -> set[tuple[int, int]]:
    """(device, inode) of every file of the reference folder: a hand-in must be none of them."""
    files = set()
    for entry in Path(reference_dir).rglob("*"):
        try:
            info = entry.stat(follow_symlinks=False)
        except OSError:
            continue
        if stat.S_ISREG(info.st_mode):
            files.add((info.st_dev, info.st_ino))
    return files


def read_hand_in(path: Path, reference_dir: Path,
                 reference: Iterable[tuple[int, int]] = ()) -> HandIn:
    """The hand-in at ``path``, read only when it is a regular file of its own of at most
    :data:`MAX_NOTEBOOK_BYTES` that is not the reference (see the module docstring); its
    problem otherwise."""
    if path.suffix != _NOTEBOOK:
        return HandIn(path, problem=f"not a notebook (expected a {_NOTEBOOK} file)")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as err:
        if os.path.islink(path):
            return HandIn(path, problem="a link, not a notebook: hand in the notebook itself")
        return HandIn(path, problem=f"cannot be opened ({err.strerror})")
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            return HandIn(path, problem="not a regular file (a FIFO, a device or a folder)")
        if info.st_nlink > 1:
            return HandIn(path, problem=f"a file with {info.st_nlink} names (hard links): "
                                        "hand in a copy of the notebook")
        if (info.st_dev, info.st_ino) in set(reference) or _inside(path, reference_dir):
            return HandIn(path, problem="the reference notebook, not a learner's")
        if info.st_size > MAX_NOTEBOOK_BYTES:
            return HandIn(path, problem=f"larger than {MAX_NOTEBOOK_BYTES >> 20} MiB "
                                        f"({info.st_size} bytes): clear its outputs")
        with os.fdopen(os.dup(fd), "rb") as handle:
            data = handle.read(MAX_NOTEBOOK_BYTES + 1)
    finally:
        os.close(fd)
    if len(data) > MAX_NOTEBOOK_BYTES:
        return HandIn(path, problem=f"larger than {MAX_NOTEBOOK_BYTES >> 20} MiB")
    try:
        return HandIn(path, parse_notebook(data))
    except GradingError as err:
        return HandIn(path, problem=str(err))


def _inside(path: Path, folder: Path) -> bool:
    try:
        return Path(os.path.realpath(path)).is_relative_to(Path(folder).resolve())
    except OSError:
        return False


def parse_notebook(data: bytes) -> nbformat.NotebookNode:
    """A notebook's cells (type, source, tags) and its release stamp from its bytes; raises
    :class:`GradingError` saying why not, without quoting them."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise GradingError(f"not a notebook: not UTF-8 text (at byte {err.start})") from None
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as err:
        raise GradingError(f"not a notebook: not JSON (line {err.lineno}, column "
                           f"{err.colno})") from None
    except RecursionError:
        raise GradingError("not a notebook: its JSON is nested too deep") from None
    if not isinstance(raw, dict) or not isinstance(raw.get("cells"), list):
        raise GradingError("not a notebook: no list of cells")
    if raw.get("nbformat") != 4:
        raise GradingError(f"not a notebook of format 4 (it says {_kind(raw.get('nbformat'))}): "
                           "save it with Jupyter 4 or later")
    cells = []
    for index, cell in enumerate(raw["cells"]):
        if not isinstance(cell, dict) or cell.get("cell_type") not in ("code", "markdown",
                                                                       "raw"):
            raise GradingError(f"not a notebook: cell {index} is not a notebook cell")
        source = cell.get("source", "")
        if isinstance(source, list) and all(isinstance(s, str) for s in source):
            source = "".join(source)
        if not isinstance(source, str):
            raise GradingError(f"not a notebook: cell {index}'s source is not text")
        metadata = cell.get("metadata")
        tags = metadata.get("tags", []) if isinstance(metadata, dict) else []
        if not (isinstance(tags, list) and all(isinstance(t, str) for t in tags)):
            tags = []
        cells.append({"cell_type": cell["cell_type"], "source": source,
                      "metadata": {"tags": tags}, **({"outputs": [], "execution_count": None}
                                                    if cell["cell_type"] == "code" else {})})
    metadata = raw.get("metadata")
    stamp = metadata.get("labs") if isinstance(metadata, dict) else None
    chapter = stamp.get("chapter") if isinstance(stamp, dict) else None
    labs_stamp = {"chapter": chapter} if isinstance(chapter, str) else {}
    return nbformat.from_dict({"cells": cells, "metadata": {"labs": labs_stamp},
                               "nbformat": 4, "nbformat_minor": 5})


def _kind(value: Any) -> str:
    return repr(value) if isinstance(value, (int, float)) or value is None else "something else"
