"""The grader's report: a grade per exercise, per notebook and for the batch, and how any
text a learner's code made is shown in it.

Two readers, two views. An exercise's :attr:`ExerciseGrade.reason` is what a learner may be
shown: one line, the verdict of the documented cases (what the learner's own notebook shows),
or only that a hidden case failed, never which one, nor the seed that drew it, since a
learner told those could fit an answer to them. :attr:`ExerciseGrade.details` and the
per-check verdicts are the instructor's: every check's message, hidden cases included, each
marked as such; the JSON report keeps them under ``"instructor"``.

Every string that reaches the report from a learner (an exception's name and message, a
file's name, what the export said) may hold a carriage return, an escape sequence, a
right-to-left override, a lone surrogate or a character that looks like another. Each is
escaped where the report is made (:func:`shown`), so the terminal table, the JSON and any file
written from them show the characters' codes, and a name of a file shows only ASCII
(:func:`shown_name`: a ``∕`` (U+2215) in a name cannot pass for a folder's ``/``).
"""

from __future__ import annotations

import enum
import unicodedata
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from labs.grading.isolation import Isolation

#: The table's reason column is cut to this width.
REASON_WIDTH = 110
#: Ends the report of a grading run without a sandbox.
NO_ISOLATION_NOTE = ("graded WITHOUT isolation (--no-isolation): the learners' code ran with "
                     "the grader's rights, beside the reference notebooks")
#: A learner's reason when the documented cases passed and a hidden one did not.
HIDDEN_FAILED = ("the documented cases pass, but a hidden case failed (cases drawn at grading "
                 "time, which your notebook does not run): test your code on other sizes and "
                 "world sizes than the check cell's")
_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _code(char: str) -> str:
    point = ord(char)
    if char in _NAMED:
        return _NAMED[char]
    if point < 0x100:
        return f"\\x{point:02x}"
    return f"\\u{point:04x}" if point < 0x10000 else f"\\U{point:08x}"


def shown(text: object, *, lines: bool = False, ascii_only: bool = False) -> str:
    """``text`` as the report shows it: printable characters as they are, every other one
    (controls, ``\\r``, escape sequences, format characters such as a right-to-left override
    or a zero-width space, lone surrogates, private and unassigned code points, line and
    paragraph separators, spaces other than the ASCII one) as its code, ``\\x1b``. ``lines``
    keeps newlines (a traceback); ``ascii_only`` writes every non-ASCII character as its code
    (:func:`shown_name`)."""
    out = []
    for char in str(text):
        point = ord(char)
        if 0x20 <= point < 0x7F or (lines and char == "\n"):
            out.append(char)
            continue
        category = unicodedata.category(char)
        hidden = category[0] in "CZ"  # Cc Cf Cs Co Cn, Zs Zl Zp (outside ASCII's space)
        out.append(_code(char) if ascii_only or hidden else char)
    return "".join(out)


def shown_name(path: object) -> str:
    """A file's name as the report shows it: ASCII only, every other character its code
    (a name that cannot be decoded keeps its bytes as ``\\udcXX``)."""
    return shown(path, ascii_only=True)


def first_line(text: str, width: int = REASON_WIDTH) -> str:
    """The first line of ``text`` that is not empty, escaped, cut to ``width``."""
    line = next((ln for ln in str(text).splitlines() if ln.strip()), "").strip()
    line = shown(line)
    return line if len(line) <= width else line[:width - 3] + "..."


class Result(enum.Enum):
    """The grade of one exercise."""

    PASS = "PASS"
    """Every check cell printed the reference's verdict, visible and hidden cases."""
    FAIL = "FAIL"
    """Anything else: a wrong answer, an error, a hang, a missing function."""


@dataclass(frozen=True)
class ExerciseGrade:
    exercise: str
    title: str
    result: Result
    reason: str
    """What the learner may be shown, escaped: the first problem in the documented cases, or
    :data:`HIDDEN_FAILED`."""
    details: str = ""
    """The instructor's full story, escaped: every check's verdict (hidden cases marked), or
    the error and its traceback."""
    seconds: float = 0.0
    checks: tuple[dict[str, object], ...] = ()
    """Each check run's ``exercise``, ``passed``, ``hidden`` and ``message`` (the
    instructor's)."""

    @property
    def passed(self) -> bool:
        return self.result is Result.PASS


@dataclass(frozen=True)
class NotebookGrade:
    path: Path
    chapter: str
    exercises: tuple[ExerciseGrade, ...]
    problem: str = ""
    """Why the notebook could not be graded at all (then it has no exercises and fails)."""

    @property
    def score(self) -> int:
        return sum(e.passed for e in self.exercises)

    @property
    def passed(self) -> bool:
        return not self.problem and self.score == len(self.exercises)


@dataclass(frozen=True)
class Report:
    seed: int | None
    notebooks: tuple[NotebookGrade, ...] = field(default=())
    isolation: Isolation = Isolation.SANDBOX
    check_timeout: float | None = None
    """The seconds each check's ranks had (``--check-timeout``), when the grader set it."""

    @property
    def score(self) -> int:
        return sum(n.score for n in self.notebooks)

    @property
    def total(self) -> int:
        return sum(len(n.exercises) for n in self.notebooks)

    @property
    def passed(self) -> bool:
        return all(n.passed for n in self.notebooks)

    def table(self) -> str:
        """The instructor's terminal view: a row per exercise (a notebook that could not be
        graded: one row saying why), the scores, the seed."""
        rows = []
        for n in self.notebooks:
            if n.problem:
                rows.append((shown_name(n.path), "-", Result.FAIL.value, first_line(n.problem)))
            rows += [(shown_name(n.path), e.exercise, e.result.value, first_line(e.reason))
                     for e in n.exercises]
        lines = _columns(("notebook", "exercise", "result", "reason"), rows)
        if len(self.notebooks) > 1:
            lines += ["", *_columns(("notebook", "score"),
                                    [(shown_name(n.path), f"{n.score}/{len(n.exercises)}")
                                     for n in self.notebooks])]
        seed = (f"hidden cases drawn with seed {self.seed}; rerun them with --seed "
                f"{self.seed}" if self.seed else "no hidden cases")
        lines += ["", f"total: {self.score}/{self.total} exercises passed ({seed})"]
        if self.check_timeout is not None:
            lines.append(f"each check's ranks had {self.check_timeout:g} s (--check-timeout)")
        if self.isolation is Isolation.NONE:
            lines.append(NO_ISOLATION_NOTE)
        return "\n".join(lines)

    def to_json(self) -> dict[str, object]:
        """The whole report as JSON data: per exercise what the learner may be shown
        (``reason``) and, under ``instructor``, the details and every check's verdict."""
        return {
            "seed": self.seed, "passed": self.score, "total": self.total,
            "isolation": self.isolation.value, "check_timeout": self.check_timeout,
            "notebooks": [{
                "path": shown_name(n.path), "chapter": n.chapter, "passed": n.score,
                "total": len(n.exercises), "problem": n.problem,
                "exercises": [{
                    "exercise": e.exercise, "title": e.title, "result": e.result.value,
                    "reason": e.reason, "seconds": round(e.seconds, 2),
                    "instructor": {"details": e.details, "checks": list(e.checks)},
                } for e in n.exercises],
            } for n in self.notebooks],
        }


def _columns(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h)
              for i, h in enumerate(header)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return [fmt.format(*header).rstrip(), fmt.format(*("-" * w for w in widths)),
            *(fmt.format(*r).rstrip() for r in rows)]
