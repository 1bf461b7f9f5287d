"""Grade learners' notebooks: the learner's code, the reference's checks, compared by nbval.

For every exercise of a learner's notebook, in two stages, each in its own kernel, its own
folder and its own sandbox, and each within one deadline (``GradeSettings.timeout``):

1. **Collect.** A fresh kernel runs the reference's ``setup`` cells, the learner's cells of the
   earlier exercises this one builds on (4.2's all-reduce calls the learner's own 4.1
   all-gather: :meth:`labs.grading.notebook.Chapter.builds_on`; no reference solution ever
   runs where a learner's code runs), then the learner's cells for this exercise (see
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
   learner's functions in their ranks, in a sandbox of their own that cannot reach the
   judge's files, network or kernel (:func:`labs.grading.guard.ranks_apart`), and their
   results come back as plain data (:mod:`labs.plain_results`). A check cell prints only the
   verdict the check returned (:func:`labs.grading.submission.judged`), never a word of the
   learner's, and a sanitizer reduces the reference's output to its verdict (``PASS:
   Exercise 2.1``), because the hidden run's message names its cases. The grade is the
   verdicts the judge's kernel wrote, which nbval must agree with.

So printing a fake verdict, editing stored outputs, redefining or monkeypatching the checker
or ``launch`` in a cell, replacing the export, or planting files in the first stage's folder
changes nothing the judge sees. Anything that goes wrong inside one exercise is that
exercise's FAIL, and anything wrong with one hand-in (:mod:`labs.grading.handins`) that
notebook's, never the end of the batch. Processes started by a stage are killed when it ends
(:mod:`labs.grading.sandbox`), and so are stages that write more than
:data:`labs.grading.sandbox.MAX_STAGE_BYTES` into their folder.

Both stages' kernels (and the ranks they start) run in a sandbox
(:mod:`labs.grading.isolation`): no privilege, the Python environment read-only, only their
stage folder writable, their own loopback, limits. Inside the checks, the library's own
solution of the exercise is refused (:mod:`labs.checks.answer_keys`). ``grade`` refuses to
start where no sandbox can be made, unless the instructor asks for
``isolation=Isolation.NONE`` (``--no-isolation``), and the report then says so.
"""

from __future__ import annotations

import json
import random
import re
import shutil
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import ipykernel.kernelspec
import nbformat
import zmq
from jupyter_client import AsyncKernelManager
from jupyter_client.asynchronous import AsyncKernelClient
from jupyter_client.kernelspec import KernelSpec, KernelSpecManager
from nbclient import NotebookClient
from nbclient.exceptions import CellTimeoutError, DeadKernelError
from tqdm.auto import tqdm

from labs.grading import submission
from labs.grading.handins import HandIn, hand_ins
from labs.grading.handout import METADATA_KEY, load_chapters
from labs.grading.isolation import Isolation, Limits, isolated, isolation_problem
from labs.grading.notebook import Chapter, ExerciseCells, GradingError, learner_cells
from labs.grading.report import (
    HIDDEN_FAILED,
    ExerciseGrade,
    NotebookGrade,
    Report,
    Result,
    first_line,
    shown,
)
from labs.grading.sandbox import (
    MAX_OUTPUT_BYTES,
    MAX_STAGE_BYTES,
    Deadline,
    DiskWatch,
    ProcessSweep,
    run_capped,
)
from labs.grading.submission import UnsafeFile, keep_files, read_left

#: The course's reference notebooks (this checkout's notebooks/).
DEFAULT_REFERENCE_DIR = Path(__file__).resolve().parents[2] / "notebooks"
#: Seconds each stage of one exercise may take before it is stopped and the exercise fails.
DEFAULT_TIMEOUT_S = 300.0
#: Both the reference output and the judged output are cut down to this before nbval compares.
VERDICT_REGEX = r"(?s)^(PASS|FAIL): (Exercise \d+\.\d+)\b.*"
VERDICT_REPLACE = r"\1: \2"
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


@dataclass(frozen=True)
class GradeSettings:
    """What ``python -m labs.grading grade`` parses its flags into."""

    reference_dir: Path = DEFAULT_REFERENCE_DIR
    seed: int | None = None
    """Seed of the hidden cases; None draws one (reported, so a failure can be rerun)."""
    timeout: float = DEFAULT_TIMEOUT_S
    """Seconds each stage of an exercise may take (its kernel, its checks, their ranks)."""
    check_timeout: float | None = None
    """Seconds a check's ranks may run once every one of them has joined its group, passed
    to every check as ``timeout=``; None keeps each check's own (10 s). On a machine busy with
    other work a larger value keeps a right answer from being read as a hang; the report
    records it."""
    hidden: bool = True
    """Also run every check with ``seed=`` (hidden cases)."""
    keep: Path | None = None
    """Keep the generated notebooks, pickles and nbval reports here (for debugging)."""
    isolation: Isolation = Isolation.SANDBOX
    """Run the learner's code in a sandbox (:mod:`labs.grading.isolation`), or, with
    ``Isolation.NONE``, with the grader's own rights."""

    def __post_init__(self) -> None:
        for name in ("timeout", "check_timeout"):
            value = getattr(self, name)
            if value is None and name == "check_timeout":
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
                    0 < value < float("inf")):
                raise GradingError(f"{name} must be a positive number of seconds, got "
                                   f"{value!r}.")
        if self.seed is not None and (isinstance(self.seed, bool) or self.seed <= 0):
            raise GradingError(f"seed must be a positive int (0 means no hidden cases: use "
                               f"--no-hidden), got {self.seed!r}.")


# --- which reference does a learner's notebook belong to --------------------------------------


def match_chapter(hand_in: HandIn, chapters: Sequence[Chapter]) -> Chapter | str:
    """The reference chapter of a learner's notebook: named in the metadata a release stamps,
    else by file name; else why it cannot be graded (that notebook's failure)."""
    if hand_in.problem or hand_in.notebook is None:
        return hand_in.problem or "the notebook cannot be read"
    by_name = {c.name: c for c in chapters}
    stamped = hand_in.notebook.metadata.get(METADATA_KEY, {}).get("chapter")
    if isinstance(stamped, str) and stamped in by_name:
        return by_name[stamped]
    if hand_in.path.name in by_name:
        return by_name[hand_in.path.name]
    return ("cannot tell which chapter it is: its metadata names none and its file name is "
            f"none of {', '.join(by_name)}. Rename it to its chapter's file name.")


def grade(paths: Sequence[Path], settings: GradeSettings, *, progress: bool = False) -> Report:
    """Grade learners' notebooks (files, or folders of them) against the reference
    notebooks; see the module docstring."""
    chapters = load_chapters(settings.reference_dir)
    plan = [(h, match_chapter(h, chapters))  # before any process
            for h in hand_ins(paths, settings.reference_dir)]
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
    total = sum(len(c.exercises) for _, c in plan if isinstance(c, Chapter))
    graded = []
    try:
        with tqdm(total=total, disable=not progress, unit="exercise", file=sys.stderr) as bar:
            for index, (hand_in, chapter) in enumerate(plan):
                if not isinstance(chapter, Chapter):
                    graded.append(NotebookGrade(hand_in.path, "", (), problem=shown(chapter)))
                    continue
                grades = []
                for ex in chapter.exercises:
                    bar.set_postfix_str(f"{index + 1}/{len(plan)} {ex.exercise}")
                    work = root / f"{index:03d}" / ex.exercise
                    grades.append(_grade_safely(chapter, hand_in, ex, seed, settings, work))
                    bar.update()
                graded.append(NotebookGrade(hand_in.path, chapter.name, tuple(grades)))
    finally:
        try:
            if settings.keep is not None:
                keep_files(root, settings.keep)
        finally:
            shutil.rmtree(root, ignore_errors=True)
    return Report(seed, tuple(graded), settings.isolation, settings.check_timeout)


def _grade_safely(chapter: Chapter, hand_in: HandIn, ex: ExerciseCells, seed: int | None,
                  settings: GradeSettings, work: Path) -> ExerciseGrade:
    """:func:`grade_exercise`, with anything that goes wrong in it (whatever the learner's
    notebook did to its stage's folder) that exercise's FAIL, so that the batch goes on."""
    start = time.perf_counter()
    try:
        work.mkdir(parents=True)
        return grade_exercise(chapter, hand_in, ex, seed, settings, work)
    except Exception as err:  # noqa: BLE001 - one learner's notebook never stops the batch
        reason = shown(f"the grader could not grade this exercise ({type(err).__name__}: {err})")
        return ExerciseGrade(ex.exercise, ex.title, Result.FAIL, reason, reason,
                             time.perf_counter() - start)


def grade_exercise(chapter: Chapter, hand_in: HandIn, ex: ExerciseCells, seed: int | None,
                   settings: GradeSettings, work: Path) -> ExerciseGrade:
    """Collect the learner's functions for one exercise, then judge them."""
    start = time.perf_counter()

    def fail(reason: str, details: str = "", checks: tuple[dict[str, object], ...] = ()
             ) -> ExerciseGrade:
        return ExerciseGrade(ex.exercise, ex.title, Result.FAIL, shown(reason, lines=True),
                             shown(details or reason, lines=True), time.perf_counter() - start,
                             checks)

    assert hand_in.notebook is not None  # match_chapter gave a chapter
    cells = learner_cells(hand_in.notebook, ex.exercise)
    if not cells:
        return fail(f"no cell of the notebook is tagged solution/exercise-{ex.exercise}: write "
                    "your code in the exercise's cell (keep its tags).")
    earlier = [c for dep in chapter.builds_on(ex)
               for c in learner_cells(hand_in.notebook, dep.exercise)]
    timeout = settings.timeout
    with ProcessSweep() as sweep, Deadline(timeout, sweep) as deadline, \
            DiskWatch(work, MAX_STAGE_BYTES, sweep) as disk:
        problem = _collect(chapter, ex, earlier + cells, timeout, work, settings.isolation)
    if disk.exceeded:
        return fail(disk.words())
    if deadline.passed:
        return fail(_too_long(timeout))
    if problem:
        return fail(*problem)
    with ProcessSweep() as sweep, DiskWatch(work, MAX_STAGE_BYTES, sweep) as disk:
        verdict = _judge(chapter, ex, seed, settings, work)  # pytest has the stage's deadline
    if disk.exceeded:
        return fail(disk.words())
    passed, reason, details, checks = verdict
    if not passed:
        return fail(reason, details, checks)
    return ExerciseGrade(ex.exercise, ex.title, Result.PASS, reason, shown(details, lines=True),
                         time.perf_counter() - start, checks)


def _too_long(timeout: float) -> str:
    return (f"your code did not finish within {timeout:g} s, the limit of the whole stage that "
            "runs your cells (a loop that never ends, or a long call at the top level of a "
            "cell?)")


class _BoundedKernelClient(AsyncKernelClient):
    """The grader's end of a learner's kernel, whose output socket (iopub) queues at most
    :data:`_QUEUED_MESSAGES` messages and takes none over :data:`_MAX_MESSAGE_BYTES`, so that a
    kernel that prints without end cannot make the grader hold it all while
    :class:`_CappedClient` keeps only :data:`MAX_OUTPUT_BYTES` of it. What does not fit is
    output, dropped; the replies the grader waits for come on the other sockets, unbounded."""

    def connect_iopub(self, identity: bytes | None = None) -> zmq.Socket:
        bounds = {zmq.RCVHWM: _QUEUED_MESSAGES, zmq.MAXMSGSIZE: _MAX_MESSAGE_BYTES}
        for option, value in bounds.items():  # a context's options go to its new sockets
            self.context.setsockopt(option, value)
        try:
            return super().connect_iopub(identity=identity)
        finally:
            for option in bounds:
                self.context.sockopts.pop(option, None)


#: How many messages of a learner's kernel the grader's sockets queue, and how large one may be.
_QUEUED_MESSAGES = 64
_MAX_MESSAGE_BYTES = 8 << 20


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
    """Stage 1, in the stage folder ``work/collect`` (the only folder its sandbox may write):
    the chapter's setup cells, then the learner's ``cells`` (those of the exercises this one
    builds on, then its own). Returns (reason, details) when the learner's functions cannot
    be had."""
    stage = work / COLLECT
    stage.mkdir()
    nb_cells = [_code(s) for s in chapter.sources(chapter.setup)]
    nb_cells += [_code(s, **{_LEARNER: True}) for s in cells]
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
                            connection_file=str(stage / "kernel.json"),
                            client_class=f"{__name__}._BoundedKernelClient")
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


def _judge(chapter: Chapter, ex: ExerciseCells, seed: int | None, settings: GradeSettings,
           work: Path) -> tuple[bool, str, str, tuple[dict[str, object], ...]]:
    """Stage 2, in a stage folder ``work/judge`` made now, holding the judge's notebook and
    only the exercise's exported functions, carried from stage 1's folder by the grader.
    Returns (passed, the learner's reason, the instructor's details, per-check verdicts)."""
    stage = work / JUDGE
    stage.mkdir()
    submission.carry(work / COLLECT, stage, ex.submitted)
    verdicts = "verdicts.json"
    sandboxed = settings.isolation is Isolation.SANDBOX
    # The kernel guards itself from the ranks first (labs.grading.guard), then imports.
    cells = [_code("import labs.grading.guard as _labs_guard\n"
                   f"_labs_guard.guard_judge_kernel({str(stage / 'judge.ipynb')!r}, "
                   f"sandboxed={sandboxed})")]
    cells += [_code(s) for s in judge_prelude(chapter, ex)]
    cells.append(_code(
        "import labs.grading.submission as _labs_grading\n"
        f"globals().update(_labs_grading.load({str(stage)!r}, {ex.submitted!r}))\n"
        "_labs_grading_verdicts = []"))
    timeout = {} if settings.check_timeout is None else {"timeout": settings.check_timeout}
    hidden_cells: set[int] = set()
    runs: list[bool] = []  # per check run: hidden?
    for index, call in zip(ex.checks, ex.calls, strict=True):
        expected = chapter.nb.cells[index].outputs
        sources = [(call.with_keywords(**timeout), False)]
        if seed:
            sources.append((call.with_keywords(seed=seed, **timeout), True))
        for source, hidden in sources:
            cell = _code(f"_labs_grading_verdicts.append(_labs_grading.judged(lambda: {source}))",
                         tags=["nbval-check-output"])
            cell.outputs = [nbformat.from_dict(dict(o)) for o in expected]
            cell.execution_count = len(cells)  # nbval refuses outputs of a cell never run
            if hidden:
                hidden_cells.add(len(cells))
            runs.append(hidden)
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
        "--nbval-current-env", f"--nbval-cell-timeout={int(settings.timeout)}",
        "--nbval-sanitize-with", "sanitize.cfg", "--junitxml", "junit.xml",
    ]
    if sandboxed:  # nbval's kernel too: it runs the learner's functions (in its ranks)
        command = isolated(command, scratch=stage)
    returncode, log = run_capped(command, stage, settings.timeout)
    (work / "pytest.log").write_text(log)
    if returncode is None:
        return (False, f"the checks did not finish within {settings.timeout:g} s", "", ())
    checks = tuple(dict(c, hidden=hidden) for c, hidden in zip(_read_verdicts(stage, verdicts),
                                                                runs, strict=False))
    details = "\n\n".join(f"{'PASS' if c['passed'] else 'FAIL'}"
                           f"{' [a hidden case, for the instructor]' if c['hidden'] else ''}: "
                           f"{c['message']}" for c in checks)
    if returncode == 0 and len(checks) == len(runs) and all(c["passed"] for c in checks):
        return True, f"{len(checks)} check(s) passed", details, checks
    visible = [c for c in checks if not c["passed"] and not c["hidden"]]
    if visible:
        return False, str(visible[0]["message"]), details, checks
    if any(not c["passed"] for c in checks):
        return False, HIDDEN_FAILED, details, checks
    failures = _junit_failures(stage)
    if failures:
        cell, text = failures[0]
        reason = HIDDEN_FAILED if cell in hidden_cells else (
            f"the check could not run: {_last_error_line(text)}")
        return False, reason, "\n\n".join(t for _, t in failures), checks
    return False, (f"the checks did not run (pytest exit code {returncode}): "
                   f"{first_line(log)}"), log, checks


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
                  "message": shown(c.get("message", ""), lines=True)} for c in raw)


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


def _junit_failures(stage: Path) -> list[tuple[int, str]]:
    """(the judge notebook's cell index, its failure's text) of each failed cell."""
    try:
        root = ET.fromstring(read_left(stage, "junit.xml"))
    except (UnsafeFile, ET.ParseError):
        return []
    texts = []
    for case in root.iter("testcase"):
        cell = re.fullmatch(r"Cell (\d+)", case.get("name", ""))
        for bad in (*case.findall("failure"), *case.findall("error")):
            texts.append((int(cell.group(1)) if cell else -1,
                          _ANSI.sub("", bad.text or bad.get("message", ""))))
    return texts


def _last_error_line(text: str) -> str:
    """The ``SomeError: why`` line of a traceback, else the first line."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    errors = [ln for ln in lines if re.match(r"^[A-Za-z_.]*(Error|Exception|Interrupt)\b", ln)]
    return errors[-1] if errors else (lines[0] if lines else "the check cell failed")
