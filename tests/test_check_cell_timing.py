"""A cell whose output nbval compares reads no clock.

``make test`` runs nbval on whatever machine a learner has, usually one busy with other work,
so a verdict that compares two timings can come out the other way there. A fresh clone's CI
failed so on chapter 7's "prefetch 1 at least 1.3 times as fast as prefetch 0", the fifth such
cell. A check cell (``nbval-check-output``) prints counts, bytes, bits and closed forms; a
verdict on a measured time lives in an ``nbval-ignore-output`` cell beside it.

The rule is read from the cell's source: it names none of the attributes labs' timing
results carry (``measured``, ``median``, ``speedup``, ``detected_s``, ...) nor a name ending
in ``_ms``. A cell whose ``.measured`` values are counts of messages and bytes, not times,
says so with the tag ``counts-only``.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

NOTEBOOKS = sorted((Path(__file__).parent.parent / "notebooks").glob("*.ipynb"))
CHECKED = "nbval-check-output"
COUNTS = "counts-only"
#: What labs' timing results call a time: a measured step, its spread, a ratio of two.
TIMING = re.compile(
    r"\.(measured\w*|median|speedup\w*|detected_s|delayed|within|from_first_start|ratio|"
    r"elapsed\w*|seconds)\b|\w+_ms\b|\bms\[")


def timing_reads(cells: list[dict]) -> list[str]:
    """Where check cells of a notebook (its ``cells``, as JSON) read a measured time."""
    found = []
    for index, cell in enumerate(cells):
        tags = cell.get("metadata", {}).get("tags", [])
        if cell["cell_type"] != "code" or CHECKED not in tags:
            continue
        source = "".join(cell["source"])
        found += [f"cell {index} reads {m.group()!r}" for m in TIMING.finditer(source)
                  if not (COUNTS in tags and m.group() == ".measured")]
    return found


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_check_cells_read_no_timing(path):
    found = timing_reads(json.loads(path.read_text())["cells"])
    assert not found, (
        f"{path.name}: {'; '.join(found)}. nbval compares a check cell on every machine at any "
        "load: move the timing verdict into an nbval-ignore-output cell beside it.")


def test_chapter_7s_prefetch_verdict_is_refused():
    """The cell that failed a fresh clone's CI on 2026-12-02, as it was stored."""
    old = {"cell_type": "code", "metadata": {"tags": [CHECKED]}, "source":
           'print(f"prefetch 1 at least 1.3 times as fast as prefetch 0: '
           '{p0.measured >= 1.3 * p1.measured}")\n'}
    counted = {"cell_type": "code", "metadata": {"tags": [CHECKED]},
               "source": "print(all(r.across == r.expected_across for r in rows))"}
    ignored = dict(old, metadata={"tags": ["nbval-ignore-output"]})
    traffic = {"cell_type": "code", "metadata": {"tags": [CHECKED, COUNTS]},
               "source": "sent = {n: row.measured for row in traffic}\nprint(row.median)"}
    assert timing_reads([old, counted, ignored, traffic]) == [
        "cell 0 reads '.measured'", "cell 0 reads '.measured'", "cell 3 reads '.median'"]
