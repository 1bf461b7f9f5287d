"""``python -m labs.bench grading``: what the sandbox costs a grading run, and what grading
the book costs.

Two rows per measure, with and without :mod:`labs.grading.isolation`: starting a process
(``python -c pass``: the sandbox's own start-up, median of ``--repeats``), and grading the
reference solutions of one chapter (``--chapter``, visible cases only, one run each: a grade
starts two kernels per exercise, each in its own sandbox).

``--book`` instead grades the whole book twice, as a class's hand-in is graded (sandbox and
hidden cases on): the released stubs, then every reference answer, with ``--busy N``
processes spinning on the CPU meanwhile and ``--graders G`` graders side by side (each
grading the same notebooks), and prints per chapter the exercises passed and the seconds per
exercise of the slowest grader.
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


def _book(folder: Path, answers: bool) -> list[Path]:
    """The learner's copy of every chapter with exercises: stubs, or the reference answers."""
    import nbformat

    from labs.grading.grader import DEFAULT_REFERENCE_DIR
    from labs.grading.handout import load_chapters, release_notebook

    paths = []
    for chapter in load_chapters(DEFAULT_REFERENCE_DIR):
        if not chapter.exercises:
            continue
        nb = release_notebook(chapter)
        if answers:
            for ex in chapter.exercises:
                for i in ex.solutions:
                    nb.cells[i].source = chapter.nb.cells[i].source
        folder.mkdir(parents=True, exist_ok=True)
        nbformat.write(nb, folder / chapter.name)
        paths.append(folder / chapter.name)
    return paths


def book_rows(answers: bool, busy: int, graders: int, seed: int) -> list[list[str]]:
    """Grade the book (``answers`` or stubs) with ``graders`` graders side by side and ``busy``
    CPU burners, through the command line; one row per chapter and a total."""
    import json

    with tempfile.TemporaryDirectory(prefix="labs-bench-") as folder:
        burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
                   for _ in range(busy)]
        try:
            runs = []
            for g in range(graders):
                paths = _book(Path(folder) / f"grader{g}", answers)
                report = Path(folder) / f"report{g}.json"
                runs.append((report, time.perf_counter(), subprocess.Popen(
                    [sys.executable, "-m", "labs.grading", "grade", *map(str, paths),
                     "--seed", str(seed), "--json", str(report)],
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)))
            reports = []
            for report, _, proc in runs:
                proc.wait()
                reports.append(json.loads(report.read_text()))
        finally:
            for proc in burners:
                proc.kill()
                proc.wait()
    rows = []
    for index, notebook in enumerate(reports[0]["notebooks"]):
        exercises = [n["notebooks"][index]["exercises"] for n in reports]
        passed = min(sum(e["result"] == "PASS" for e in ex) for ex in exercises)
        seconds = max(sum(e["seconds"] for e in ex) for ex in exercises)
        count = len(exercises[0])
        rows.append([notebook["chapter"], f"{passed}/{count}", f"{seconds / count:.1f}"])
    total = sum(len(n["exercises"]) for n in reports[0]["notebooks"])
    seconds = max(sum(e["seconds"] for n in r["notebooks"] for e in n["exercises"])
                  for r in reports)
    rows.append(["the book", f"{min(r['passed'] for r in reports)}/{total}",
                 f"{seconds / total:.1f}"])
    return rows


def add_grading_parser(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("grading", help="what the grading sandbox costs")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--chapter", default="04_all_gather.ipynb",
                        help="the reference notebook whose solutions are graded")
    parser.add_argument("--book", action="store_true",
                        help="grade the whole book's stubs and reference answers instead")
    parser.add_argument("--busy", type=int, default=0,
                        help="with --book: CPU burners running meanwhile")
    parser.add_argument("--graders", type=int, default=1,
                        help="with --book: graders side by side")
    parser.add_argument("--seed", type=int, default=11, help="with --book: the hidden cases")
    parser.add_argument("--only", choices=("stubs", "answers"),
                        help="with --book: grade only the released stubs or only the answers")


def grading_main(opts: argparse.Namespace) -> None:
    from labs.grading.isolation import isolation_problem

    problem = isolation_problem()
    if problem:
        print(f"no sandbox on this machine: {problem}")
        return
    if opts.book:
        kinds = {"stubs": (False,), "answers": (True,), None: (False, True)}[opts.only]
        for answers in kinds:
            what = "reference answers" if answers else "released stubs"
            print(f"{what}, {opts.graders} grader(s) side by side, {opts.busy} CPU burner(s):")
            print(format_table(["chapter", "passed", "s / exercise"],
                               book_rows(answers, opts.busy, opts.graders, opts.seed)))
            print()
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
