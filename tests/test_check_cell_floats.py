"""A cell whose output nbval compares carries no float that another CPU could print otherwise.

nbval compares the stored output of every cell tagged ``nbval-check-output``, text and
``glue`` records alike, on whatever machine runs ``make test``. A float32 sum's last digits
depend on the order the CPU's kernels add in (vector widths differ between machines), so a
check cell prints verdicts, counts and exact values only; a measured float is printed or glued
in a cell tagged ``nbval-ignore-output`` beside it. (On 4e1e6f0 chapter 7's check cell glued
the clipping factors, and nbval failed on another CPU: ``'0.07810755506861378' ==
'0.07810754779590585'``.)

The rule: a check cell's text and ``glue`` records carry no non-integer float, unless the cell
is tagged ``exact-floats``. With that tag its author states that every float it shows is the
same on every CPU to the digits shown: integers and closed forms computed in Python, float32
constants, element-wise operations, or values whose exact decimals end well before the digits
printed. Exercise ids (``6.4``, from any notebook's ``exercise-N.M`` tags) are not floats.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

NOTEBOOKS = sorted((Path(__file__).parent.parent / "notebooks").glob("*.ipynb"))
CHECKED = "nbval-check-output"
EXACT = "exact-floats"
#: A decimal number not part of a longer token (a version 2.13.0, a hex 0x3f, a name v1.2).
FLOAT = re.compile(r"(?<![\w.])[-+]?\d+\.\d+(?:[eE][-+]?\d+)?(?![\w.])")
GLUE_MIME = "application/papermill.record/text/plain"


def exercise_ids(cells: list[dict]) -> set[str]:
    tags = (t for c in cells for t in c.get("metadata", {}).get("tags", []))
    return {t.removeprefix("exercise-") for t in tags if t.startswith("exercise-")}


def non_integer(token: str) -> bool:
    return float(token) != int(float(token))


def machine_floats(cells: list[dict], ids: set[str]) -> list[str]:
    """Where check cells of a notebook (its ``cells``, as JSON) carry a float the rule refuses."""
    found = []
    for index, cell in enumerate(cells):
        tags = cell.get("metadata", {}).get("tags", [])
        if cell["cell_type"] != "code" or CHECKED not in tags or EXACT in tags:
            continue
        for output in cell.get("outputs", []):
            data = output.get("data", {})
            if GLUE_MIME in data:
                record = "".join(data[GLUE_MIME])
                if FLOAT.fullmatch(record.strip()) and non_integer(record):
                    found.append(f"cell {index} glues {record}")
                continue
            text = "".join(output.get("text", "")) + "".join(data.get("text/plain", ""))
            found += [f"cell {index} prints {m.group()}" for m in FLOAT.finditer(text)
                      if m.group().lstrip("+-") not in ids and non_integer(m.group())]
    return found


ALL_IDS = exercise_ids([c for p in NOTEBOOKS for c in json.loads(p.read_text())["cells"]])


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_check_cells_carry_no_machine_dependent_float(path):
    found = machine_floats(json.loads(path.read_text())["cells"], ALL_IDS)
    assert not found, (
        f"{path.name}: {'; '.join(found)}. A check cell's output is compared by nbval on every "
        "machine: print a verdict there, and print or glue the measured value in an "
        f"nbval-ignore-output cell (or tag the cell {EXACT!r} if every float it prints is exact).")


def cell(source: str, tags: list[str], outputs: list[dict]) -> dict:
    return {"cell_type": "code", "source": source, "metadata": {"tags": tags}, "outputs": outputs}


def glued(value: str) -> dict:
    return {"output_type": "display_data", "data": {GLUE_MIME: value},
            "metadata": {"scrapbook": {"name": "x"}}}


def printed(text: str) -> dict:
    return {"output_type": "stream", "name": "stdout", "text": text}


def test_chapter_7s_old_clipping_cell_is_refused():
    """The cell that failed nbval on another CPU (4e1e6f0's chapter 7), as it was stored."""
    old = cell('glue("clip_factor", clip_reports[0].factor, display=False)', [CHECKED],
               [printed("with the all-reduced norm every rank applies one factor: True\n"),
                glued("0.07810755506861378")])
    assert machine_floats([old], set()) == ["cell 0 glues 0.07810755506861378"]


def test_what_the_rule_refuses_and_allows():
    ids = {"6.4"}
    cells = [
        cell("", [CHECKED], [printed("loss at step 60: 0.638\n")]),          # refused
        cell("", [CHECKED], [glued("0.5")]),                                 # refused
        cell("", [CHECKED, EXACT], [printed("4.00 / 2.00 = 2.0 ratio 5.5\n"), glued("5.5")]),
        cell("", [CHECKED], [printed("PASS: Exercise 6.4: 16,640 bytes, 2.0 x, torch 2.13.0\n"),
                             glued("3"), glued("2.0")]),
        cell("", ["nbval-ignore-output"], [printed("0.123\n"), glued("0.125")]),
    ]
    assert machine_floats(cells, ids) == ["cell 0 prints 0.638", "cell 1 glues 0.5"]
