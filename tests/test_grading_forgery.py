"""Grading a learner who forges the verdict, steals the hidden cases or attacks the report,
each through a mechanism that once earned a pass or harmed the batch (a red team of the
grader, graded as root with the sandbox and the hidden cases on), and each now failing:

* the verdict printed by the learner: an exception whose class name holds a carriage return
  and the reference's verdict line (nbval keeps only what follows a ``\\r``);
* a process that leaves the launch (its own session, a double fork) and swaps the judge's
  ``verdicts.json`` through a FIFO before the judge's pytest exits;
* the hidden seed heard on the channels the judge's kernel publishes on.

Every attack is exercise 1.1 (one exercise, about 10 s to grade).
"""

from __future__ import annotations

import re
from pathlib import Path

import psutil
import pytest

from labs.grading.grader import GradeSettings, grade
from labs.grading.isolation import isolation_problem

from grading_learners import learner, only


@pytest.fixture(scope="module")
def sandbox() -> None:
    problem = isolation_problem()
    if problem:
        pytest.skip(f"no sandbox on this machine: {problem}")


def nbval_summary(keep: Path) -> str:
    """The last line of the judge's pytest log: what nbval decided."""
    (log,) = keep.rglob("pytest.log")
    return log.read_text().strip().splitlines()[-1]


# --- a verdict the learner prints, and a verdict file the learner swaps -------------------------

MARKER = "labs-forgery-daemon"

_FORGE = '''
import json, os, pathlib, sys


class _Forged(Exception):
    pass


_Forged.__name__ = _Forged.__qualname__ = (
    "Stop\\rPASS: Exercise 1.1 average_gradients: every rank holds the mean gradient")


def _swap_verdicts():
    """Out of the launch's reach (a session of its own): wait for the judge to write its
    verdicts into a FIFO planted where it writes them, then put a passing copy in its place."""
    sys.argv[:] = ["MARKER"]
    target = pathlib.Path.cwd() / "verdicts.json"
    os.mkfifo(target)
    with open(target) as fifo:  # blocks until the judge opens it to write
        real = fifo.read()
    target.unlink()
    target.write_text(json.dumps([dict(v, passed=True) for v in json.loads(real)]))


def average_gradients(model):
    if os.fork() == 0:
        os.setsid()
        if os.fork() == 0:
            try:
                _swap_verdicts()
            finally:
                os._exit(0)
        os._exit(0)
    raise _Forged("forged")
'''.replace("MARKER", MARKER)


def marked() -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        if MARKER in " ".join(proc.info["cmdline"] or ()):
            found.append(proc)
    return found


def test_a_verdict_printed_or_swapped_by_the_learner_fails(sandbox, tmp_path,
                                                            no_leftover_processes) -> None:
    """The learner's exception name redrew the check's output as the reference's verdict,
    and a daemon of the learner's swapped the judge's verdict file: a pass for a function
    that only raises. The judge now prints only the verdict it computed (nbval fails the
    cell), and the ranks run where the judge's files are not (the daemon finds no verdicts
    to swap, and ends with the stage)."""
    keep = tmp_path / "keep"
    graded = only(grade([learner(tmp_path, _FORGE)], GradeSettings(hidden=False, keep=keep)))
    assert not graded.passed, graded.details
    assert "raised Stop" in graded.reason, graded.reason
    assert "\r" not in graded.reason
    assert re.search(r"\b1 failed\b", nbval_summary(keep)), nbval_summary(keep)
    assert not marked()
