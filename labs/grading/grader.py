"""Grade learners' notebooks: the learner's code, the reference's checks, compared by nbval.

For every exercise of a learner's notebook, in two stages, each in its own kernel, its own
folder and its own sandbox, and each within one deadline (``GradeSettings.timeout``):

1. **Collect.** A fresh kernel runs the reference's ``setup`` cells, the reference solutions of
   the exercises before this one, then the learner's cells for this exercise (see
   :func:`labs.grading.notebook.learner_cells`), and pickles the functions the checks take,
   in the stage folder ``collect/``, the only folder of the machine it may write. The
   learner's stored outputs are never read, and the grader keeps at most
   :data:`MAX_OUTPUT_BYTES` of what the kernel prints.
2. **Judge.** The grader makes a new folder ``judge/`` and copies into it only the exercise's
   own pickles (:func:`labs.grading.submission.carry`: regular files, no links, capped). Another
   fresh kernel, which never runs a learner's cell, imports the check functions (or runs the
   ``setup`` cells: :func:`judge_prelude`), takes the learner's functions *sealed* (never
   unpickled there: :class:`labs.grading.submission.Sealed`), and runs the reference's check
   cells, once as written and once with ``seed=`` (hidden cases drawn at grading time), under
   ``pytest --nbval-lax`` against the outputs stored in the reference. The checks run the
   learner's functions in their ranks, whose results come back as plain data
   (:mod:`labs.plain_results`). A sanitizer reduces both sides to the verdict
   (``PASS: Exercise 2.1``), because the hidden run's message names its cases.

So printing a fake verdict, editing stored outputs, redefining or monkeypatching the checker
or ``launch`` in a cell, replacing the export, or planting files in the first stage's folder
changes nothing the judge sees. Each exercise is graded on its own: the other exercises' code
comes from the reference, so one broken exercise fails only itself, and anything that goes
wrong inside one exercise is that exercise's FAIL, never the end of the batch. Processes
started by a stage are killed when it ends (:mod:`labs.grading.sandbox`).

Both stages' kernels (and the ranks they start) run in a sandbox
(:mod:`labs.grading.isolation`): no privilege, the Python environment read-only, only their
stage folder writable, their own loopback, limits. Inside the checks, the library's own
solution of the exercise is refused (:mod:`labs.checks.answer_keys`). ``grade`` refuses to
start where no sandbox can be made, unless the instructor asks for
``isolation=Isolation.NONE`` (``--no-isolation``), and the report then says so.
"""

from __future__ import annotations

import enum
import json
import random
import re
import shutil
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import ipykernel.kernelspec
import nbformat
from jupyter_client import AsyncKernelManager
from jupyter_client.kernelspec import KernelSpec, KernelSpecManager
from nbclient import NotebookClient
from nbclient.exceptions import CellTimeoutError, DeadKernelError
from tqdm.auto import tqdm

from labs.grading import submission
from labs.grading.handout import METADATA_KEY, load_chapters
from labs.grading.isolation import Isolation, Limits, isolated, isolation_problem
from labs.grading.notebook import Chapter, ExerciseCells, GradingError, learner_cells
from labs.grading.sandbox import MAX_OUTPUT_BYTES, Deadline, ProcessSweep, run_capped
from labs.grading.submission import UnsafeFile, keep_files, read_left

#: The course's reference notebooks (this checkout's notebooks/).
DEFAULT_REFERENCE_DIR = Path(__file__).resolve().parents[2] / "notebooks"
#: Seconds each stage of one exercise may take before it is stopped and the exercise fails.
DEFAULT_TIMEOUT_S = 300.0
#: Both the reference output and the judged output are cut down to this before nbval compares.
VERDICT_REGEX = r"(?s)^(PASS|FAIL): (Exercise \d+\.\d+)\b.*"
VERDICT_REPLACE = r"\1: \2"
_REASON_WIDTH = 110
#: Ends the report of a grading run without a sandbox.
NO_ISOLATION_NOTE = ("graded WITHOUT isolation (--no-isolation): the learners' code ran with "
                     "the grader's rights, beside the reference notebooks")
#: The hidden cases' seed is drawn from 1 .. HIDDEN_SEEDS - 1.
HIDDEN_SEEDS = 10**12
_ANSI = re.compile(r"(\x1b|#x1B)\[[0-9;]*m")  # junit XML writes ESC as "#x1B"
_CURRENT_ENV = "labs-grading-current-env"
_SOCKETS = "kernel-socket"  # prefix of the stage-1 kernel's ipc socket files (not kept)
_LEARNER = "labs_grading_learner"  # cell metadata key marking the learner's cells in stage 1
#: What a learner's kernel and its ranks may use (:class:`labs.grading.isolation.Limits`).
LIMITS = Limits()
#: The stage folders of one exercise: stage 1's (the learner's kernel writes there) and the
#: judge's, made new after stage 1 ended, holding only what the grader copied across.
COLLECT, JUDGE = "collect", "judge"


class Result(enum.Enum):
    """The grade of one exercise."""

    PASS = "PASS"
    """Every check cell printed the reference's verdict, visible and hidden cases."""
    FAIL = "FAIL"
    """Anything else: a wrong answer, an error, a hang, a missing function."""


@dataclass(frozen=True)
class GradeSettings:
    """What ``python -m labs.grading grade`` parses its flags into."""

    reference_dir: Path = DEFAULT_REFERENCE_DIR
    seed: int | None = None
    """Seed of the hidden cases; None draws one (reported, so a failure can be rerun)."""
    timeout: float = DEFAULT_TIMEOUT_S
    hidden: bool = True
    """Also run every check with ``seed=`` (hidden cases)."""
    keep: Path | None = None
    """Keep the generated notebooks, pickles and nbval reports here (for debugging)."""
    isolation: Isolation = Isolation.SANDBOX
    """Run the learner's code in a sandbox (:mod:`labs.grading.isolation`), or, with
    ``Isolation.NONE``, with the grader's own rights."""

    def __post_init__(self) -> None:
        if not self.timeout > 0:
            raise GradingError(f"timeout must be a positive number of seconds, got "
                               f"{self.timeout!r}.")
        if self.seed is not None and (isinstance(self.seed, bool) or self.seed <= 0):
            raise GradingError(f"seed must be a positive int (0 means no hidden cases: use "
                               f"--no-hidden), got {self.seed!r}.")


@dataclass(frozen=True)
class ExerciseGrade:
    exercise: str
    title: str
    result: Result
    reason: str
    """One line for the table."""
    details: str = ""
    """The full story: every check's verdict, or the error and its traceback."""
    seconds: float = 0.0
    checks: tuple[dict[str, object], ...] = ()

    @property
    def passed(self) -> bool:
        return self.result is Result.PASS


@dataclass(frozen=True)
class NotebookGrade:
    path: Path
    chapter: str
    exercises: tuple[ExerciseGrade, ...]

    @property
    def score(self) -> int:
        return sum(e.passed for e in self.exercises)


@dataclass(frozen=True)
class Report:
    seed: int | None
    notebooks: tuple[NotebookGrade, ...] = field(default=())
    isolation: Isolation = Isolation.SANDBOX

    @property
    def score(self) -> int:
        return sum(n.score for n in self.notebooks)

    @property
    def total(self) -> int:
        return sum(len(n.exercises) for n in self.notebooks)

    @property
    def passed(self) -> bool:
        return self.score == self.total

    def table(self) -> str:
        rows = [(str(n.path), e.exercise, e.result.value, _clip(e.reason))
                for n in self.notebooks for e in n.exercises]
        lines = _columns(("notebook", "exercise", "result", "reason"), rows)
        if len(self.notebooks) > 1:
            lines += ["", *_columns(("notebook", "score"),
                                    [(str(n.path), f"{n.score}/{len(n.exercises)}")
                                     for n in self.notebooks])]
        seed = (f"hidden cases drawn with seed {self.seed}; rerun them with --seed "
                f"{self.seed}" if self.seed else "no hidden cases")
        lines += ["", f"total: {self.score}/{self.total} exercises passed ({seed})"]
        if self.isolation is Isolation.NONE:
            lines.append(NO_ISOLATION_NOTE)
        return "\n".join(lines)

    def to_json(self) -> dict[str, object]:
        return {
            "seed": self.seed, "passed": self.score, "total": self.total,
            "isolation": self.isolation.value,
            "notebooks": [{
                "path": str(n.path), "chapter": n.chapter, "passed": n.score,
                "total": len(n.exercises),
                "exercises": [{
                    "exercise": e.exercise, "title": e.title, "result": e.result.value,
                    "reason": e.reason, "details": e.details, "seconds": round(e.seconds, 2),
                    "checks": list(e.checks),
                } for e in n.exercises],
            } for n in self.notebooks],
        }


def _clip(text: str) -> str:
    line = text.strip().splitlines()[0] if text.strip() else ""
    return line if len(line) <= _REASON_WIDTH else line[:_REASON_WIDTH - 3] + "..."


def _columns(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h)
              for i, h in enumerate(header)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return [fmt.format(*header).rstrip(), fmt.format(*("-" * w for w in widths)),
            *(fmt.format(*r).rstrip() for r in rows)]


# --- which reference does a learner's notebook belong to --------------------------------------


def match_chapter(path: Path, chapters: Sequence[Chapter]) -> Chapter:
    """The reference chapter of a learner's notebook: named in the metadata a release stamps,
    else by file name. Raises GradingError (before anything runs) when neither tells."""
    by_name = {c.name: c for c in chapters}
    if not path.is_file():
        raise GradingError(f"{path}: no such file.")
    if path.suffix != ".ipynb":
        raise GradingError(f"{path}: not a notebook (expected a .ipynb file).")
    try:
        stamped = json.loads(path.read_text()).get("metadata", {}).get(METADATA_KEY, {})
        name = stamped.get("chapter") if isinstance(stamped, dict) else None
    except (ValueError, UnicodeDecodeError, AttributeError):
        name = None  # unreadable: graded as a broken notebook if its file name tells
    if name in by_name:
        return by_name[name]
    if path.name in by_name:
        return by_name[path.name]
    raise GradingError(
        f"{path}: cannot tell which chapter it is: its metadata names none and its file name "
        f"is none of {', '.join(by_name)}. Rename it to its chapter's file name.")


def grade(paths: Sequence[Path], settings: GradeSettings, *, progress: bool = False) -> Report:
    """Grade learners' notebooks against the reference notebooks; see the module docstring."""
    if not paths:
        raise GradingError("give at least one learner notebook to grade.")
    chapters = load_chapters(settings.reference_dir)
    plan = [(Path(p), match_chapter(Path(p), chapters)) for p in paths]  # before any process
    if settings.isolation is Isolation.SANDBOX:
        problem = isolation_problem()
        if problem:
            raise GradingError(
                f"grading runs every learner's code in a sandbox, and this machine cannot "
                f"make one: {problem}. Grade where it can, or pass --no-isolation to grade "
                "without it (the learners' code then runs with your rights, beside the "
                "reference notebooks; the report says so).")
    # From a trillion values: a rank gets only its own inputs, drawn one-way from the seed, and
    # must not find the seed by trying every value (labs.checks.core.CaseKeys).
    seed = None if not settings.hidden else settings.seed or random.SystemRandom().randrange(
        1, HIDDEN_SEEDS)
    root = Path(tempfile.mkdtemp(prefix="labs-grading-"))
    total = sum(len(c.exercises) for _, c in plan)
    graded = []
    try:
        with tqdm(total=total, disable=not progress, unit="exercise", file=sys.stderr) as bar:
            for index, (path, chapter) in enumerate(plan):
                grades = []
                learner = _read_learner(path)
                for ex in chapter.exercises:
                    bar.set_postfix_str(f"{path.name} {ex.exercise}")
                    work = root / f"{index:03d}" / ex.exercise
                    grades.append(_grade_safely(chapter, learner, ex, seed, settings, work))
                    bar.update()
                graded.append(NotebookGrade(path, chapter.name, tuple(grades)))
    finally:
        try:
            if settings.keep is not None:
                keep_files(root, settings.keep)
        finally:
            shutil.rmtree(root, ignore_errors=True)
    return Report(seed, tuple(graded), settings.isolation)


def _grade_safely(chapter: Chapter, learner: nbformat.NotebookNode | str, ex: ExerciseCells,
                  seed: int | None, settings: GradeSettings, work: Path) -> ExerciseGrade:
    """:func:`grade_exercise`, with anything that goes wrong in it (whatever the learner's
    notebook did to its stage's folder) that exercise's FAIL, so that the batch goes on."""
    start = time.perf_counter()
    try:
        work.mkdir(parents=True)
        return grade_exercise(chapter, learner, ex, seed, settings.timeout, work,
                              settings.isolation)
    except Exception as err:  # noqa: BLE001 - one learner's notebook never stops the batch
        reason = f"the grader could not grade this exercise ({type(err).__name__}: {err})"
        return ExerciseGrade(ex.exercise, ex.title, Result.FAIL, reason, reason,
                             time.perf_counter() - start)


def _read_learner(path: Path) -> nbformat.NotebookNode | str:
    """The learner's notebook, or why it cannot be read (then every exercise fails)."""
    try:
        return nbformat.read(path, as_version=4)
    except Exception as err:  # noqa: BLE001 - a damaged file fails the notebook, not the run
        return f"the notebook cannot be read ({type(err).__name__}: {err})"


def grade_exercise(chapter: Chapter, learner: nbformat.NotebookNode | str, ex: ExerciseCells,
                   seed: int | None, timeout: float, work: Path,
                   isolation: Isolation = Isolation.SANDBOX) -> ExerciseGrade:
    """Collect the learner's functions for one exercise, then judge them."""
    start = time.perf_counter()

    def fail(reason: str, details: str = "", checks: tuple[dict[str, object], ...] = ()
             ) -> ExerciseGrade:
        return ExerciseGrade(ex.exercise, ex.title, Result.FAIL, reason, details or reason,
                             time.perf_counter() - start, checks)

    if isinstance(learner, str):
        return fail(learner)
    cells = learner_cells(learner, ex.exercise)
    if not cells:
        return fail(f"no cell of the notebook is tagged solution/exercise-{ex.exercise}: write "
                    "your code in the exercise's cell (keep its tags).")
    with ProcessSweep() as sweep, Deadline(timeout, sweep) as deadline:
        problem = _collect(chapter, ex, cells, timeout, work, isolation)
    if deadline.passed:
        return fail(_too_long(timeout))
    if problem:
        return fail(*problem)
    with ProcessSweep():  # _judge's pytest has the stage's deadline
        verdict = _judge(chapter, ex, seed, timeout, work, isolation)
    passed, reason, details, checks = verdict
    if not passed:
        return fail(reason, details, checks)
    return ExerciseGrade(ex.exercise, ex.title, Result.PASS, reason, details,
                         time.perf_counter() - start, checks)


def _too_long(timeout: float) -> str:
    return (f"your code did not finish within {timeout:g} s, the limit of the whole stage that "
            "runs your cells (a loop that never ends, or a long call at the top level of a "
            "cell?)")


class _CappedClient(NotebookClient):
    """A NotebookClient that keeps at most :data:`MAX_OUTPUT_BYTES` of the kernel's outputs
    (errors included, cut short), and notes that it dropped the rest."""

    kept_bytes = 0
    dropped = False

    def output(self, outs: list[nbformat.NotebookNode], msg: dict[str, object],
               display_id: str | None, cell_index: int) -> nbformat.NotebookNode | None:
        size = len(json.dumps(msg.get("content", {}), default=str))
        if self.kept_bytes + size > MAX_OUTPUT_BYTES:
            self.dropped = True
            if msg.get("msg_type") != "error":
                return None
            content = msg["content"]
            assert isinstance(content, dict)
            content["traceback"] = [str(line)[:2000] for line in content.get("traceback", [])][
                -20:]
            content["evalue"] = str(content.get("evalue", ""))[:2000]
        self.kept_bytes += size
        return super().output(outs, msg, display_id, cell_index)


# --- stage 1: run the learner's cells, export their functions ---------------------------------


class _CurrentEnvSpecs(KernelSpecManager):
    """Kernels run this interpreter (the one with ``labs``), whatever kernels are installed;
    with a ``sandbox`` folder, inside a sandbox whose scratch folder it is."""

    def __init__(self, sandbox: Path | None = None, **kwargs: object) -> None:
        super().__init__(**kwargs)
        self.sandbox = sandbox

    def get_kernel_spec(self, kernel_name: str) -> KernelSpec:
        if kernel_name == _CURRENT_ENV:
            spec = dict(ipykernel.kernelspec.get_kernel_dict())
            if self.sandbox is not None:
                spec["argv"] = isolated(spec["argv"], scratch=self.sandbox)
            return self.kernel_spec_class(resource_dir=ipykernel.kernelspec.RESOURCES, **spec)
        return super().get_kernel_spec(kernel_name)


def _code(source: str, **metadata: object) -> nbformat.NotebookNode:
    cell = nbformat.v4.new_code_cell(source)
    cell.metadata.update(metadata)
    return cell


def _notebook(cells: list[nbformat.NotebookNode]) -> nbformat.NotebookNode:
    nb = nbformat.v4.new_notebook(cells=cells)
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3",
                                 "language": "python"}
    return nb


def _collect(chapter: Chapter, ex: ExerciseCells, cells: list[str], timeout: float,
             work: Path, isolation: Isolation = Isolation.SANDBOX) -> tuple[str, str] | None:
    """Stage 1, in the stage folder ``work/collect`` (the only folder its sandbox may write).
    Returns (reason, details) when the learner's functions cannot be had."""
    stage = work / COLLECT
    stage.mkdir()
    nb_cells = [_code(s) for s in chapter.sources(chapter.setup)]
    for other in chapter.exercises:
        if other.exercise == ex.exercise:
            nb_cells += [_code(s, **{_LEARNER: True}) for s in cells]
            break
        nb_cells += [_code(s) for s in chapter.sources(other.solutions)]
    nb_cells.append(_code(
        "import labs.grading.submission as _labs_grading\n"
        f"_labs_grading.export(globals(), {ex.submitted!r}, {str(stage)!r})"))
    nb = _notebook(nb_cells)
    # ipc: a local socket file rather than TCP (ipykernel warns about unencrypted TCP). The
    # socket files and the connection file live in the stage folder, which a sandboxed
    # kernel sees at the same path: the grader reaches it there, with no network between.
    sandbox = stage if isolation is Isolation.SANDBOX else None
    km = AsyncKernelManager(kernel_name=_CURRENT_ENV,
                            kernel_spec_manager=_CurrentEnvSpecs(sandbox=sandbox),
                            transport="ipc", ip=str(stage / _SOCKETS),
                            connection_file=str(stage / "kernel.json"))
    client = _CappedClient(nb, km=km, timeout=int(timeout), allow_errors=True,
                           resources={"metadata": {"path": str(stage)}})
    try:
        client.execute()
    except CellTimeoutError:
        return _too_long(timeout), ""
    except DeadKernelError as err:
        return ("the kernel died while running your cells (exit(), os._exit(), a crash, or "
                f"a limit of the sandbox: {LIMITS.words()})", str(err))
    finally:
        nbformat.write(nb, work / "collect.ipynb")  # the grader's folder, not the stage's
    cell_error = _first_error(c for c in nb.cells if c.metadata.get(_LEARNER))
    index = submission.read_index(stage, ex.submitted)
    broken = [n for n in ex.submitted if not index[n].get("ok")]
    if not broken:
        return None  # an error after the definitions does not matter: the checks decide
    why = "; ".join(str(index[n]["error"]) for n in broken)
    if client.dropped:
        why += f" (your cells printed more than {MAX_OUTPUT_BYTES >> 20} MiB: the rest was dropped)"
    if cell_error:
        hint = f" (the sandbox's limits: {LIMITS.words()})" if cell_error[0].startswith(
            "MemoryError") else ""
        return f"{why} Your cell raised {cell_error[0]}{hint}", cell_error[1]
    return why, ""


def _first_error(cells: object) -> tuple[str, str] | None:
    for cell in cells:  # type: ignore[attr-defined]
        for out in cell.get("outputs", []):
            if out.get("output_type") == "error":
                head = f"{out.get('ename')}: {out.get('evalue')}"
                return head, _ANSI.sub("", "\n".join(out.get("traceback", [])))
    return None


# --- stage 2: the reference checks on the collected functions, under nbval --------------------


def _judge(chapter: Chapter, ex: ExerciseCells, seed: int | None, timeout: float,
           work: Path, isolation: Isolation = Isolation.SANDBOX
           ) -> tuple[bool, str, str, tuple[dict[str, object], ...]]:
    """Stage 2, in a stage folder ``work/judge`` made now, holding the judge's notebook and
    only the exercise's exported functions, carried from stage 1's folder by the grader.
    Returns (passed, reason, details, per-check verdicts)."""
    stage = work / JUDGE
    stage.mkdir()
    submission.carry(work / COLLECT, stage, ex.submitted)
    verdicts = "verdicts.json"
    # The kernel guards itself from the ranks first (labs.grading.guard), then imports.
    cells = [_code("import labs.grading.guard as _labs_guard\n"
                   f"_labs_guard.guard_judge_kernel({str(stage / 'judge.ipynb')!r})")]
    cells += [_code(s) for s in judge_prelude(chapter, ex)]
    cells.append(_code(
        "import labs.grading.submission as _labs_grading\n"
        f"globals().update(_labs_grading.load({str(stage)!r}, {ex.submitted!r}))\n"
        "_labs_grading_verdicts = []"))
    for index, call in zip(ex.checks, ex.calls, strict=True):
        expected = chapter.nb.cells[index].outputs
        runs = [call.call_source] + ([call.with_seed(seed)] if seed else [])
        for source in runs:
            cell = _code(f"_labs_grading_verdicts.append({source})",
                         tags=["nbval-check-output"])
            cell.outputs = [nbformat.from_dict(dict(o)) for o in expected]
            cell.execution_count = len(cells)  # nbval refuses outputs of a cell never run
            cells.append(cell)
    cells.append(_code(
        f"_labs_grading.write_verdicts(_labs_grading_verdicts, {str(stage / verdicts)!r})"))
    nbformat.write(_notebook(cells), stage / "judge.ipynb")
    (stage / "sanitize.cfg").write_text(
        f"[verdict]\nregex: {VERDICT_REGEX}\nreplace: {VERDICT_REPLACE}\n")
    (stage / "pytest.ini").write_text("[pytest]\n")
    # -P: the stage folder is not on pytest's path; --noconftest: no conftest.py is read;
    # labs.grading.guard: pytest, not dumpable, so that no rank can trace it.
    command = [
        sys.executable, "-P", "-m", "labs.grading.guard", "judge.ipynb", "-q", "-p",
        "no:cacheprovider", "--noconftest", "-c", "pytest.ini", "--rootdir", ".", "--nbval-lax",
        "--nbval-current-env", f"--nbval-cell-timeout={int(timeout)}",
        "--nbval-sanitize-with", "sanitize.cfg", "--junitxml", "junit.xml",
    ]
    if isolation is Isolation.SANDBOX:  # nbval's kernel too: it runs the learner's functions
        command = isolated(command, scratch=stage)
    returncode, log = run_capped(command, stage, timeout)
    (work / "pytest.log").write_text(log)
    if returncode is None:
        return (False, f"the checks did not finish within {timeout:g} s", "", ())
    checks = _read_verdicts(stage, verdicts)
    failures = _junit_failures(stage)
    details = "\n\n".join(str(c["message"]) for c in checks)
    if returncode == 0 and checks and all(c["passed"] for c in checks):
        return True, f"{len(checks)} check(s) passed", details, checks
    failed = [c for c in checks if not c["passed"]]
    if failed:
        return False, str(failed[0]["message"]), "\n\n".join(
            f"{'PASS' if c['passed'] else 'FAIL'}: {c['message']}" for c in checks), checks
    if failures:
        return False, _last_error_line(failures[0]), "\n\n".join(failures), checks
    return False, (f"the checks did not run (pytest exit code {returncode}): "
                   f"{_clip(log)}"), log, checks


def _read_verdicts(stage: Path, name: str) -> tuple[dict[str, object], ...]:
    """The verdicts the judge's last cell wrote, each ``{"exercise", "passed", "message"}``;
    () when the file is missing, unsafe or not that JSON."""
    try:
        raw = json.loads(read_left(stage, name))
    except (UnsafeFile, ValueError, UnicodeDecodeError):
        return ()
    if not isinstance(raw, list) or not all(
            isinstance(c, dict) and isinstance(c.get("passed"), bool) for c in raw):
        return ()
    return tuple({"exercise": str(c.get("exercise", "")), "passed": c["passed"],
                  "message": str(c.get("message", ""))} for c in raw)


def judge_prelude(chapter: Chapter, ex: ExerciseCells) -> list[str]:
    """What the judging kernel runs before the check cells.

    The check cells need their check functions and nothing else, as a rule: then one import
    from :mod:`labs.checks` replaces the chapter's setup cells, which also import plotting and
    widget libraries (about 2.5 s of a kernel's time per exercise). A check that is not
    importable from there, or a call that reads another name (a constant defined in a setup
    cell), gets the setup cells."""
    import labs.checks  # noqa: PLC0415 - torch and the checks, only when judging

    functions = sorted({call.function for call in ex.calls})
    others = {n for call in ex.calls for n in call.names} - {*functions, *ex.submitted}
    if others or not all(hasattr(labs.checks, f) for f in functions):
        return chapter.sources(chapter.setup)
    return [f"from labs.checks import {', '.join(functions)}"]


def _junit_failures(stage: Path) -> list[str]:
    try:
        root = ET.fromstring(read_left(stage, "junit.xml"))
    except (UnsafeFile, ET.ParseError):
        return []
    texts = []
    for case in root.iter("testcase"):
        for bad in (*case.findall("failure"), *case.findall("error")):
            texts.append(_ANSI.sub("", bad.text or bad.get("message", "")))
    return texts


def _last_error_line(text: str) -> str:
    """The ``SomeError: why`` line of a traceback, else the first line."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    errors = [ln for ln in lines if re.match(r"^[A-Za-z_.]*(Error|Exception|Interrupt)\b", ln)]
    return errors[-1] if errors else (lines[0] if lines else "the check cell failed")
