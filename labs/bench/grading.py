"""``python -m labs.bench grading``: what the sandbox costs a grading run.

Two rows per measure, with and without :mod:`labs.grading.isolation`: starting a process
(``python -c pass``: the sandbox's own start-up, median of ``--repeats``), and grading the
reference solutions of one chapter (``--chapter``, visible cases only, one run each: a grade
starts two kernels per exercise, each in its own sandbox).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from labs.tables import format_table

# labs.grading (nbclient, nbformat...) is imported where it is used: it is an optional part of
# labs (pyproject's "grading" extra), and the other benchmarks must run without it.


def start_seconds(sandboxed: bool, repeats: int) -> float:
    """Median seconds to run ``python -c pass``, in a fresh sandbox each time or not."""
    from labs.grading.isolation import isolated

    times = []
    with tempfile.TemporaryDirectory(prefix="labs-bench-") as scratch:
        for _ in range(repeats):
            command = [sys.executable, "-c", "pass"]
            if sandboxed:
                command = isolated(command, scratch=Path(scratch))
            start = time.perf_counter()
            subprocess.run(command, check=True)
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def grade_seconds(chapter_name: str, sandboxed: bool) -> tuple[float, int, int]:
    """(seconds, exercises passed, exercises) to grade one chapter's reference solutions."""
    import nbformat

    from labs.grading.grader import DEFAULT_REFERENCE_DIR, GradeSettings, grade
    from labs.grading.handout import load_chapters, release_notebook
    from labs.grading.isolation import Isolation

    chapter = next(c for c in load_chapters(DEFAULT_REFERENCE_DIR) if c.name == chapter_name)
    nb = release_notebook(chapter)
    for ex in chapter.exercises:
        for i in ex.solutions:
            nb.cells[i].source = chapter.nb.cells[i].source
    with tempfile.TemporaryDirectory(prefix="labs-bench-") as folder:
        path = Path(folder) / chapter_name
        nbformat.write(nb, path)
        start = time.perf_counter()
        isolation = Isolation.SANDBOX if sandboxed else Isolation.NONE
        report = grade([path], GradeSettings(hidden=False, isolation=isolation))
        return time.perf_counter() - start, report.score, report.total


def add_grading_parser(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("grading", help="what the grading sandbox costs")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--chapter", default="04_all_gather.ipynb",
                        help="the reference notebook whose solutions are graded")


def grading_main(opts: argparse.Namespace) -> None:
    from labs.grading.isolation import isolation_problem

    problem = isolation_problem()
    if problem:
        print(f"no sandbox on this machine: {problem}")
        return
    rows = []
    for sandboxed in (False, True):
        rows.append(["python -c pass", "sandbox" if sandboxed else "none",
                     f"{start_seconds(sandboxed, opts.repeats):.3f}",
                     f"median of {opts.repeats}"])
    for sandboxed in (False, True):
        seconds, passed, total = grade_seconds(opts.chapter, sandboxed)
        rows.append([f"grade {opts.chapter} ({passed}/{total} passed)",
                     "sandbox" if sandboxed else "none",
                     f"{seconds:.1f}", "one run"])
    print(format_table(["what", "isolation", "seconds", ""], rows))
