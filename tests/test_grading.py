"""Grading: release stubs every solution, and grading fails exactly what is wrong.

The fast tests read notebooks and build reports without starting anything. The end-to-end
tests grade real notebooks with real kernels, nbval and real ranks (about 10 s per exercise
graded): released stubs, the reference solutions, one injected bug per exercise, cheats
(edited outputs, a printed verdict, a redefined checker, a monkeypatched checker or launcher),
and broken notebooks (a syntax error, a crash, a hang), and check that no process is left.
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys
import time
from pathlib import Path

import nbformat
import psutil
import pytest

from labs.checks.exercises import EXERCISES
from labs.grading.__main__ import EXIT_USAGE, main
from labs.grading.grader import VERDICT_REGEX, VERDICT_REPLACE, GradeSettings, grade, match_chapter
from labs.grading.handins import read_hand_in
from labs.grading.handout import METADATA_KEY, load_chapters, release, release_notebook, stub_source
from labs.grading.isolation import isolation_problem
from labs.grading.notebook import (
    CellTag,
    Chapter,
    GradingError,
    cell_exercise,
    has_tag,
    learner_cells,
    parse_check,
)
from labs.grading.report import HIDDEN_FAILED, ExerciseGrade, NotebookGrade, Report, Result
from labs.grading.sandbox import ProcessSweep, is_subreaper

ROOT = Path(__file__).resolve().parents[1]
REFERENCE = ROOT / "notebooks"
#: The reference notebooks with exercises (the appendix has none: release skips it).
CHAPTERS = {c.name: c for c in load_chapters(REFERENCE) if c.exercises}
#: Every exercise, in the book's order (the registry is held against the notebooks' tags in
#: test_check_contract.py).
ALL_EXERCISES = [e.id for e in EXERCISES]
SEED = 11  # hidden cases of the end-to-end runs: fixed, so a failure here can be rerun


def chapter_of(exercise: str) -> Chapter:
    return next(c for c in CHAPTERS.values() if any(e.exercise == exercise for e in c.exercises))


def solution_indices(chapter: Chapter, exercise: str) -> tuple[int, ...]:
    return chapter.exercise(exercise).solutions


def learner_copy(chapter: Chapter, answers: dict[int, str] | None = None,
                 reference_answers: bool = True) -> nbformat.NotebookNode:
    """A learner's notebook: the released copy, with the reference answers typed into the
    stubs (unless ``reference_answers`` is False) and then ``answers`` by cell index."""
    nb = release_notebook(chapter)
    if reference_answers:
        for ex in chapter.exercises:
            for i in ex.solutions:
                nb.cells[i].source = chapter.nb.cells[i].source
    for i, source in (answers or {}).items():
        nb.cells[i].source = source
    return nb


def write(nb: nbformat.NotebookNode, directory: Path, name: str) -> Path:
    path = directory / name
    nbformat.write(nb, path)
    return path


def grades(report: Report) -> list[dict[str, str]]:
    return [{e.exercise: e.result.value for e in n.exercises} for n in report.notebooks]


# --- reference notebooks: every exercise is tagged the way the grader reads it ----------------


def test_every_exercise_of_the_book_is_found():
    found = [e.exercise for c in CHAPTERS.values() for e in c.exercises]
    assert found == ALL_EXERCISES
    for chapter in CHAPTERS.values():
        assert chapter.setup, f"{chapter.name} has no setup cell"
        for ex in chapter.exercises:
            assert ex.title, f"exercise {ex.exercise} has no '## Exercise N.M: title' heading"
            assert ex.submitted and all(c.function.startswith("check_") for c in ex.calls)


@pytest.mark.parametrize("tags, error", [
    (["check"], "tag it either 'solution' or 'check'"),
    (["solution", "check", "exercise-9.1"], "tag it either"),
    (["setup", "exercise-9.1"], "a setup cell belongs to no exercise"),
    (["solution", "exercise-9"], "exercise ids look like"),
])
def test_a_mistagged_reference_cell_is_named(tmp_path, tags, error):
    nb = copy.deepcopy(CHAPTERS["01_toy_allreduce.ipynb"].nb)
    nb.cells[-2].metadata["tags"] = tags  # any code cell will do
    nb.cells[-2].cell_type = "code"
    with pytest.raises(GradingError, match=error):
        Chapter.load(write(nb, tmp_path, "bad.ipynb"))


def test_an_exercise_without_a_check_is_refused(tmp_path):
    chapter = CHAPTERS["01_toy_allreduce.ipynb"]
    nb = copy.deepcopy(chapter.nb)
    del nb.cells[chapter.exercise("1.1").checks[0]]
    with pytest.raises(GradingError, match="needs at least one 'solution' and one 'check'"):
        Chapter.load(write(nb, tmp_path, "bad.ipynb"))


@pytest.mark.parametrize("source", ["print('PASS')", "x = check_a(f)\ny = 1", "check_a()",
                                    "result = average(f)", "check_a(f"])
def test_a_check_cell_must_be_one_check_call_naming_the_function(source):
    with pytest.raises(GradingError):
        parse_check(source, "here")


def test_the_hidden_run_of_a_check_only_changes_its_seed():
    call = parse_check("result = check_x(f, world_sizes=(1, 2), seed=0)", "here")
    assert call.submitted == ("f",)
    assert call.with_seed(42) == "check_x(f, world_sizes=(1, 2), seed=42)"


def test_the_sanitizer_keeps_the_verdict_and_nothing_else():
    import re
    reduce = lambda s: re.sub(VERDICT_REGEX, VERDICT_REPLACE, s)  # noqa: E731
    assert reduce("PASS: Exercise 2.1 ring: fine [seed 3 drew 7]\n") == "PASS: Exercise 2.1"
    assert reduce("FAIL: Exercise 2.1 ring: rank 1\nTraceback\n") == "FAIL: Exercise 2.1"
    assert reduce("PASS: Exercise 2.11 x") != reduce("PASS: Exercise 2.1 x")
    assert reduce("something else") == "something else"


# --- the learner's cells -----------------------------------------------------------------------


def test_the_learners_cells_include_cells_they_added_before_the_check():
    chapter = CHAPTERS["04_all_gather.ipynb"]
    nb = learner_copy(chapter)
    first = chapter.exercise("4.1").solutions[0]
    nb.cells.insert(first + 1, nbformat.v4.new_code_cell("HELPER = 1"))
    nb.cells.insert(first, nbformat.v4.new_code_cell("BEFORE = 1"))  # before: not theirs
    cells = learner_cells(nb, "4.1")
    assert cells[1] == "HELPER = 1" and "BEFORE = 1" not in cells
    assert cells[0] == chapter.nb.cells[first].source
    assert "HELPER = 1" not in learner_cells(nb, "4.2")
    assert len(learner_cells(nb, "4.2")) == len(chapter.exercise("4.2").solutions)


# --- release -----------------------------------------------------------------------------------


def test_a_stub_keeps_the_signature_and_raises_naming_the_exercise():
    source = ('import math\n\ndef f(x, n: int = 2) -> int:\n    """Doc."""\n'
              '    secret = math.pi\n    return secret\n\nclass C:\n    def go(self):\n'
              '        return 42\n\nANSWER = 42\n')
    stub = stub_source(source, "7.2")
    assert "secret" not in stub and "42" not in stub and "import math" in stub
    assert "def f(x, n: int=2) -> int:" in stub and '"""Doc."""' in stub
    namespace: dict[str, object] = {}
    exec(compile(stub, "stub", "exec"), namespace)
    for call in (lambda: namespace["f"](1), lambda: namespace["C"]().go()):
        with pytest.raises(NotImplementedError, match=r"^Exercise 7\.2: write (f|C\.go)\(\)"):
            call()


def test_a_stub_of_a_cell_that_defines_nothing_raises():
    with pytest.raises(NotImplementedError, match="Exercise 7.3"):
        exec(stub_source("total = 1 + 1", "7.3"), {})


@pytest.mark.parametrize("name", sorted(CHAPTERS))
def test_release_stubs_solutions_clears_outputs_and_keeps_the_rest(name):
    chapter = CHAPTERS[name]
    released = release_notebook(chapter)
    assert released.metadata[METADATA_KEY] == {"chapter": name}
    assert "widgets" not in released.metadata and "jupytext" not in released.metadata
    solutions = {i for ex in chapter.exercises for i in ex.solutions}
    assert len(released.cells) == len(chapter.nb.cells)
    for i, (ref, rel) in enumerate(zip(chapter.nb.cells, released.cells, strict=True)):
        assert rel.get("id") == ref.get("id")
        if rel.cell_type == "code":
            assert rel.outputs == [] and rel.execution_count is None
        if i in solutions:
            ex = cell_exercise(ref)
            assert f"NotImplementedError('Exercise {ex}: write" in rel.source
            assert has_tag(rel, CellTag.SOLUTION) and cell_exercise(rel) == ex
            assert "hide-input" not in rel.metadata["tags"] and "mystnb" not in rel.metadata
            # indented lines are the answer, except the method signatures a stub keeps
            body = [ln.strip() for ln in ref.source.splitlines()
                    if ln.startswith("    ") and ln.strip() and '"""' not in ln
                    and not ln.strip().startswith("def ")]
            assert not any(line in rel.source for line in body), "a solution line leaked"
        else:
            timing = ("execution",)  # when the reference last ran: an output, cleared too
            assert rel.source == ref.source
            assert rel.metadata == {k: v for k, v in ref.metadata.items() if k not in timing}


def test_release_writes_every_chapter_and_refuses_to_overwrite(tmp_path, capsys):
    assert main(["release", str(tmp_path)]) == 0
    assert sorted(p.name for p in tmp_path.glob("*.ipynb")) == sorted(CHAPTERS)
    assert "stubbed: 4.1, 4.2" in capsys.readouterr().out
    assert main(["release", str(tmp_path)]) == EXIT_USAGE
    assert "pass --force" in capsys.readouterr().err
    assert main(["release", str(tmp_path), "--force"]) == 0
    assert main(["release", str(REFERENCE)]) == EXIT_USAGE
    assert "overwrite the solutions" in capsys.readouterr().err
    with pytest.raises(GradingError, match="no such directory"):
        release(tmp_path / "missing", tmp_path / "out")


# --- which chapter, and bad input before anything starts --------------------------------------


def test_a_learner_notebook_is_matched_by_its_stamp_then_by_its_name(tmp_path):
    chapters = list(CHAPTERS.values())

    def matched(path: Path) -> Chapter | str:
        return match_chapter(read_hand_in(path, REFERENCE), chapters)

    renamed = write(release_notebook(CHAPTERS["03_reduce_scatter.ipynb"]), tmp_path, "bob.ipynb")
    assert matched(renamed).name == "03_reduce_scatter.ipynb"
    plain = copy.deepcopy(CHAPTERS["02_allreduce_algorithms.ipynb"].nb)
    named = write(plain, tmp_path, "02_allreduce_algorithms.ipynb")
    assert matched(named).name == "02_allreduce_algorithms.ipynb"
    assert "cannot tell which chapter" in matched(write(plain, tmp_path, "mine.ipynb"))


@pytest.mark.parametrize("args, error", [
    (["missing.ipynb"], "no such file"),
    (["01_toy_allreduce.ipynb", "--timeout", "0"], "timeout must be a positive"),
    (["01_toy_allreduce.ipynb", "--check-timeout", "-1"], "check_timeout must be a positive"),
    (["01_toy_allreduce.ipynb", "--seed", "0"], "--no-hidden"),
    (["01_toy_allreduce.ipynb", "--reference", "nowhere"], "no such directory"),
])
def test_bad_input_is_refused_before_any_process_starts(tmp_path, monkeypatch, capsys, args,
                                                         error, refuse_processes):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "notes.txt").write_text("hi")
    (tmp_path / "stray.ipynb").write_text(nbformat.writes(nbformat.v4.new_notebook()))
    write(release_notebook(CHAPTERS["01_toy_allreduce.ipynb"]), tmp_path,
          "01_toy_allreduce.ipynb")
    with refuse_processes():
        assert main(["grade", *args]) == EXIT_USAGE
    assert error in capsys.readouterr().err


# --- the report --------------------------------------------------------------------------------


def test_the_report_has_a_row_per_exercise_a_total_and_json():
    report = Report(5, (
        NotebookGrade(Path("a/01.ipynb"), "01.ipynb", (
            ExerciseGrade("1.1", "t", Result.PASS, "ok"),)),
        NotebookGrade(Path("b/04.ipynb"), "04.ipynb", (
            ExerciseGrade("4.1", "t", Result.FAIL, "with 2 rank(s), rank 1 hung\ntraceback"),
            ExerciseGrade("4.2", "t", Result.PASS, "ok"))),
    ))
    table = report.table()
    assert "b/04.ipynb  4.1       FAIL    with 2 rank(s), rank 1 hung" in table
    assert "traceback" not in table and "b/04.ipynb  1/2" in table
    assert "total: 2/3 exercises passed" in table and "--seed 5" in table
    data = report.to_json()
    assert (data["passed"], data["total"], data["seed"]) == (2, 3, 5)
    assert data["notebooks"][1]["exercises"][0]["result"] == "FAIL"
    assert not report.passed


# --- processes ---------------------------------------------------------------------------------


def test_the_sweep_kills_what_a_stage_started_orphans_included():
    with ProcessSweep() as sweep:
        # The shell starts a grandchild and exits at once: the grandchild is an orphan.
        subprocess.run(["sh", "-c", "sleep 300 >/dev/null 2>&1 &"], check=True)
        time.sleep(0.2)
        orphans = [p for p in psutil.Process().children(recursive=True)
                   if p.pid not in sweep.before]
        assert orphans, "the orphan was not re-parented to us (no subreaper?)"
    assert sweep.killed
    assert not [p for p in psutil.Process().children(recursive=True)
                if p.pid not in sweep.before and p.status() != psutil.STATUS_ZOMBIE]
    # Outside the block orphans go to init again: a test session or a notebook kernel that
    # graded something must not collect zombies it never waits for.
    assert not is_subreaper()
    subprocess.run(["sh", "-c", "sleep 0.2 >/dev/null 2>&1 &"], check=True)
    assert not [p for p in psutil.Process().children(recursive=True)
                if p.pid not in sweep.before]


# --- end to end: real kernels, nbval, real ranks -----------------------------------------------


@pytest.fixture(scope="module")
def sandbox_here():
    """Grading runs learners' code in a sandbox; where this machine cannot make one, the
    end-to-end tests skip and say why (tests/test_grading_isolation.py tests the refusal)."""
    problem = isolation_problem()
    if problem:
        pytest.skip(f"grading needs a sandbox, and this machine cannot make one: {problem}")


@pytest.fixture
def no_leftovers(sandbox_here):
    """Fails the test if grading left a process running under pytest."""
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    yield
    left = [p for p in psutil.Process().children(recursive=True)
            if p.pid not in before and p.status() != psutil.STATUS_ZOMBIE]
    assert not left, f"grading left processes behind: {[(p.pid, p.name()) for p in left]}"


def test_release_covers_every_exercise_of_the_book(tmp_path):
    assert main(["release", str(tmp_path)]) == 0
    chapters = [Chapter.load(p) for p in sorted(tmp_path.glob("*.ipynb"))]
    assert [e.exercise for c in chapters for e in c.exercises] == ALL_EXERCISES


#: The gradings `make test` runs, one per behaviour; every other in `make test-slow`, which CI
#: runs too: released stubs scoring zero and each chapter's full marks are slow.
#: make test grades one mutation, in chapter 1 (one exercise, the quickest chapter to grade);
#: "and every other exercise of the chapter passes" is shown by the slow ones (4.2: 40 s).
FAST_MUTATION = "1.1"


def per_chapter(names: list[str], fast: set[str]) -> list[object]:
    """Parameters, with every one not in ``fast`` marked slow."""
    return [n if n in fast else pytest.param(n, marks=pytest.mark.slow) for n in names]


# One grading per chapter (not one for the whole book), so that test workers share them; all in
# make test-slow: make test grades a wrong answer end to end (the mutation of FAST_MUTATION)
# and reads the JSON report (test_the_report_has_a_row_per_exercise_a_total_and_json).
@pytest.mark.parametrize("name", per_chapter(sorted(CHAPTERS), set()))
def test_released_stubs_score_zero_on_every_exercise(tmp_path, no_leftovers, capsys, name):
    """Through the command line, with --json and no path: the report goes to stdout instead of
    the table."""
    path = write(release_notebook(CHAPTERS[name]), tmp_path, name)
    code = main(["grade", str(path), "--seed", str(SEED), "--json"])
    data = json.loads(capsys.readouterr().out)  # the whole of stdout is the JSON report
    assert code == 1 and data["passed"] == 0
    assert data["total"] == len(CHAPTERS[name].exercises)
    for ex in data["notebooks"][0]["exercises"]:
        assert "NotImplementedError" in ex["reason"], ex


def builds_on_another(chapter: Chapter) -> bool:
    return any(chapter.builds_on(e) for e in chapter.exercises)


# Through the command line, for the chapters of one exercise and those whose exercises build on
# each other (4.2 calls the learner's 4.1: a bug in 4.1 fails both); in the other chapters of
# several, every reference answer passes in the mutation grading that leaves its group alone.
@pytest.mark.parametrize("name", per_chapter(
    sorted(n for n, c in CHAPTERS.items() if len(c.exercises) == 1 or builds_on_another(c)),
    set()))
def test_the_reference_solutions_score_full_marks(tmp_path, no_leftovers, capsys, name):
    path = write(learner_copy(CHAPTERS[name]), tmp_path, name)
    out = tmp_path / "report.json"
    code = main(["grade", str(path), "--seed", str(SEED), "--json", str(out)])
    table = capsys.readouterr().out
    assert code == 0, table
    data = json.loads(out.read_text())
    total = len(CHAPTERS[name].exercises)
    assert (data["passed"], data["total"], data["seed"]) == (total, total, SEED)
    for ex in (e for n in data["notebooks"] for e in n["exercises"]):
        checks = ex["instructor"]["checks"]
        assert len(checks) == 2 * len(CHAPTERS[name].exercise(ex["exercise"]).calls)
        assert [c["hidden"] for c in checks[:2]] == [False, True]
        assert f"seed {SEED}" in checks[1]["message"], checks  # the hidden cases ran
    assert f"total: {total}/{total} exercises passed (hidden cases drawn with seed {SEED}" in table


#: One injected bug per exercise of the registry: exercise -> (the line as the reference writes
#: it, the bug).
MUTATIONS = {
    "1.1": ("param.grad /= world_size", "pass  # forgot to divide"),
    "2.1": ("mine += incoming", "mine.copy_(incoming)"),
    "3.1": ("partial = arriving + own", "partial = arriving"),
    "4.1": ("chunk(rank).copy_(shard.reshape(-1))", "pass"),
    "4.2": ("tensor.copy_(total.view_as(tensor))", "return total.view_as(tensor)"),
    "5.1": ("p.grad /= world_size", "pass  # forgot to divide"),
    "5.2": ("async_op=True)", "async_op=False)"),
    "5.3": ("share = allreduce / (n - 1)", "share = allreduce"),
    "6.1": ("m.mul_(beta)", "m.mul_(0.0)"),
    "6.2": ("out = x @ weight.T + bias", "out = x @ weight + bias"),
    "6.3": ("return ring_reduce_scatter(padded) / world_size",
            "return ring_reduce_scatter(padded)"),
    "6.4": ("grad_shards[param] = ring_reduce_scatter(padded) / world_size",
            "grad_shards[param] = ring_reduce_scatter(padded)"),
    "6.5": ("(grad_out.T @ x)", "(x.T @ grad_out)"),
    "7.1": ("total = squares[0].sqrt()", "total = squares[0]"),
    "7.2": ("end = min(stop, (saved_rank + 1) * k_old)", "end = (saved_rank + 1) * k_old"),
    "7.3": ("after = order.index(current) + 1", "after = order.index(current)"),
    "8.1": ("ring_all_reduce(shard, group=cross_group)", "pass  # forgot the other nodes"),
    "8.2": ("return out + b2", "return out"),
    "9.1": ("return index + 1, {", "return index, {"),
    "9.2": ("flat /= still", "flat /= dist.get_world_size()"),
}


def test_every_exercise_has_one_mutation():
    assert list(MUTATIONS) == ALL_EXERCISES


def mutation_groups() -> list[tuple[str, ...]]:
    """The exercises broken together in one grading: each chapter's exercises, alternately in
    two groups (its 1st, 3rd, ...; its 2nd, 4th, ...). So every exercise fails once, with its
    own bug, and passes once, its reference answer beside its neighbours' bugs: two gradings
    of a chapter instead of one per exercise (chapter 6's five took 150 s each)."""
    groups = []
    for chapter in dict.fromkeys(chapter_of(e).name for e in ALL_EXERCISES):
        ids = [e.exercise for e in CHAPTERS[chapter].exercises]
        groups += [tuple(ids[start::2]) for start in (0, 1) if ids[start::2]]
    return groups


def fails_with(chapter: Chapter, broken: tuple[str, ...]) -> set[str]:
    """The exercises a grading with ``broken``'s bugs fails: those, and those that build on
    them (their checks run the learner's own earlier answer)."""
    return {e.exercise for e in chapter.exercises if e.exercise in broken
            or any(dep.exercise in broken for dep in chapter.builds_on(e))}


def test_every_exercise_is_broken_in_one_group_and_passes_in_another():
    groups = mutation_groups()
    assert sorted(e for g in groups for e in g) == sorted(ALL_EXERCISES)
    for exercise in ALL_EXERCISES:
        chapter = chapter_of(exercise)
        siblings = [e.exercise for e in chapter.exercises]
        if len(siblings) > 1 and not builds_on_another(chapter):  # graded right elsewhere
            assert any(exercise not in fails_with(chapter, g) and set(g) <= set(siblings)
                       for g in groups), exercise


# An exercise without a mutation fails test_every_exercise_has_one_mutation (not collection).
@pytest.mark.parametrize("broken", [
    pytest.param(g, marks=() if FAST_MUTATION in g else pytest.mark.slow)
    for g in mutation_groups()
], ids=["+".join(g) for g in mutation_groups()])
def test_a_bug_in_one_exercise_fails_exactly_that_exercise(tmp_path, no_leftovers, broken):
    chapter = chapter_of(broken[0])
    edits: dict[int, str] = {}
    for exercise in broken:
        line, bug = MUTATIONS.get(exercise, ("", ""))
        index = next(i for i in solution_indices(chapter, exercise)
                     if line in chapter.nb.cells[i].source)
        edits[index] = edits.get(index, chapter.nb.cells[index].source).replace(line, bug)
    path = write(learner_copy(chapter, edits), tmp_path, chapter.name)
    report = grade([path], GradeSettings(seed=SEED))  # hidden cases on: the right answers
    failing = fails_with(chapter, broken)
    expected = {e.exercise: "FAIL" if e.exercise in failing else "PASS"  # pass those too
                for e in chapter.exercises}
    assert grades(report) == [expected], report.table()
    for right in (e for n in report.notebooks for e in n.exercises if e.exercise not in failing):
        assert f"seed {SEED}" in right.checks[1]["message"], right.checks  # hidden ran


@pytest.mark.slow  # two gradings of chapter 1; make test grades its mutation with hidden cases
def test_an_answer_fitted_to_the_documented_cases_fails_the_hidden_ones(tmp_path, no_leftovers):
    """Exercise 1.1's documented cases stop at 4 ranks; a seed adds 5 or 6. An answer that
    divides by at most 4 passes the first and must fail the grade through the second."""
    chapter = CHAPTERS["01_toy_allreduce.ipynb"]
    line = "param.grad /= world_size"
    index = next(i for i in solution_indices(chapter, "1.1")
                 if line in chapter.nb.cells[i].source)
    fitted = chapter.nb.cells[index].source.replace(line, "param.grad /= min(world_size, 4)")
    path = write(learner_copy(chapter, {index: fitted}), tmp_path, chapter.name)
    assert grades(grade([path], GradeSettings(hidden=False))) == [{"1.1": "PASS"}]
    report = grade([path], GradeSettings(seed=SEED))
    assert grades(report) == [{"1.1": "FAIL"}], report.table()
    graded = report.notebooks[0].exercises[0]
    assert graded.reason == HIDDEN_FAILED  # the learner is not told the hidden case ...
    assert f"seed {SEED}" in graded.details and "world size" in graded.details  # ... the
    assert graded.checks[1]["hidden"] and not graded.checks[1]["passed"]  # instructor is


@pytest.mark.slow  # make test's budget (13 s)
def test_edited_outputs_showing_pass_do_not_pass(tmp_path, no_leftovers):
    chapter = CHAPTERS["01_toy_allreduce.ipynb"]
    nb = learner_copy(chapter, reference_answers=False)  # stubs ...
    for ref, cell in zip(chapter.nb.cells, nb.cells, strict=True):
        if cell.cell_type == "code":  # ... with every output of the reference pasted in
            cell.outputs = copy.deepcopy(ref.outputs)
            cell.execution_count = ref.execution_count
    check = chapter.exercise("1.1").checks[0]
    assert nb.cells[check].outputs[0]["text"].startswith("PASS: Exercise 1.1")
    report = grade([write(nb, tmp_path, chapter.name)], GradeSettings(hidden=False))
    assert grades(report) == [{"1.1": "FAIL"}]


WRONG_1_1 = """
def average_gradients(model):
    for param in model.parameters():
        if param.grad is not None:
            dist.all_reduce(param.grad)  # sums; never divides
"""
PASS_LINE = ("PASS: Exercise 1.1 average_gradients: every rank holds the mean gradient on "
             "1, 2, 3, 4 rank(s).")  # the reference's stored verdict, word for word
#: Cheats: (name, code added to the solution cell, replacement of the check cell or None).
CHEATS = [
    ("prints a verdict", "", f"print({PASS_LINE!r})"),
    ("redefines the checker", f"""
def check_average_gradients(fn, **kwargs):
    print({PASS_LINE!r})
""", None),
    ("monkeypatches the checker", f"""
import labs.checks
labs.checks.CheckResult.__str__ = lambda self: {PASS_LINE!r}
""", None),
    ("monkeypatches launch", """
import labs.checks.toy
from labs import launch as _real_launch

def _launch_that_divides(fn, world_size, *args, **kwargs):
    results = _real_launch(fn, world_size, *args, **kwargs)
    return [{k: None if v is None else v / world_size for k, v in r.items()} for r in results]

labs.checks.toy.launch = _launch_that_divides
""", None),
]


def naive_nbval(chapter: Chapter, nb: nbformat.NotebookNode, tmp_path: Path) -> int:
    """What nbval alone does with a learner's notebook: run the learner's own cells (setup,
    exercise, check) and compare the check cell with the reference output. Exit code."""
    ex = chapter.exercises[0]
    cells = [copy.deepcopy(nb.cells[i]) for i in (*chapter.setup, *ex.solutions, *ex.checks)]
    for cell in cells:
        cell.outputs = []
    cells[-1].outputs = copy.deepcopy(chapter.nb.cells[ex.checks[0]].outputs)
    cells[-1].execution_count = 1  # nbval refuses stored outputs of a cell never run
    trimmed = nbformat.v4.new_notebook(cells=cells, metadata=nb.metadata)
    path = write(trimmed, tmp_path, "naive.ipynb")
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--nbval-lax",
         "--nbval-current-env", str(path), "--rootdir", str(tmp_path)],
        cwd=tmp_path, capture_output=True, check=False).returncode


@pytest.mark.parametrize("name, added, check_source", [
    # make test-slow: make test refuses a forged PASS (test_edited_outputs_showing_pass_do_not_pass)
    # and runs every judge attack (test_grading_attacks.py); these are more cheats of that kind
    pytest.param(*c, marks=pytest.mark.slow) for c in CHEATS
], ids=[c[0] for c in CHEATS])
def test_a_cheat_that_fools_nbval_alone_does_not_pass(tmp_path, no_leftovers, name, added,
                                                      check_source):
    chapter = CHAPTERS["01_toy_allreduce.ipynb"]
    ex = chapter.exercise("1.1")
    answers = {ex.solutions[0]: WRONG_1_1 + added}
    if check_source is not None:
        answers[ex.checks[0]] = check_source
    nb = learner_copy(chapter, answers)
    assert naive_nbval(chapter, nb, tmp_path) == 0, "the cheat does not even fool nbval alone"
    report = grade([write(nb, tmp_path, chapter.name)], GradeSettings(hidden=False))
    assert grades(report) == [{"1.1": "FAIL"}], report.table()
    assert "SUM" in report.notebooks[0].exercises[0].reason  # the real check's diagnosis


HANGS_IN_THE_RANKS = """
def ring_all_gather(shard, numel):
    while True:
        pass
"""


@pytest.mark.slow  # make test has a hung cell (below) and checks of hung ranks (test_checks)
def test_a_hanging_exercise_is_cut_off_and_the_rest_is_graded(tmp_path, no_leftovers):
    chapter = CHAPTERS["04_all_gather.ipynb"]
    first = chapter.exercise("4.1").solutions[0]
    nb = learner_copy(chapter, {first: HANGS_IN_THE_RANKS})
    report = grade([write(nb, tmp_path, chapter.name)], GradeSettings(hidden=False))
    # 4.2's all-reduce calls the learner's 4.1 all-gather: it hangs too, and is graded to its
    # own verdict within its own limit
    assert grades(report) == [{"4.1": "FAIL", "4.2": "FAIL"}], report.table()
    assert all("hung" in e.reason for e in report.notebooks[0].exercises), report.table()


@pytest.mark.parametrize("source, reason", [
    # a stage cut off at its limit is in make test as test_grading_attacks'
    # test_a_stage_has_one_deadline_not_one_per_cell (an 8 s limit, not this 20 s wait)
    pytest.param("while True:\n    pass\n", "did not finish within 20 s", marks=pytest.mark.slow),
    ("import os\nos._exit(3)\n", "the kernel died"),
    pytest.param("def average_gradients(model)\n    pass\n", "SyntaxError",
                 marks=pytest.mark.slow),  # an error in a cell; the crash is in make test
], ids=["top-level loop", "kernel crash", "syntax error"])
def test_a_broken_cell_fails_its_exercise_within_the_limit(tmp_path, no_leftovers, source,
                                                           reason):
    chapter = CHAPTERS["01_toy_allreduce.ipynb"]
    nb = learner_copy(chapter, {chapter.exercise("1.1").solutions[0]: source})
    start = time.monotonic()
    report = grade([write(nb, tmp_path, chapter.name)], GradeSettings(hidden=False, timeout=20))
    assert time.monotonic() - start < 60
    assert grades(report) == [{"1.1": "FAIL"}]
    assert reason in report.notebooks[0].exercises[0].reason, report.table()


@pytest.mark.slow  # make test's mutation (a check printing FAIL against PASS) shows it live too
def test_nbval_decides_a_check_printing_pass_fails_against_a_reference_expecting_fail(
        tmp_path, no_leftovers):
    """Shows the comparison with the reference's stored output is live: here the reference
    (altered) expects a FAIL verdict, so a right answer, whose check prints PASS, fails."""
    chapter = CHAPTERS["01_toy_allreduce.ipynb"]
    reference = copy.deepcopy(chapter.nb)
    check = reference.cells[chapter.exercise("1.1").checks[0]]
    check.outputs[0]["text"] = check.outputs[0]["text"].replace("PASS:", "FAIL:", 1)
    ref_dir = tmp_path / "reference"
    ref_dir.mkdir()
    write(reference, ref_dir, chapter.name)
    learner = write(learner_copy(chapter), tmp_path, chapter.name)
    report = grade([learner], GradeSettings(reference_dir=ref_dir, hidden=False))
    assert grades(report) == [{"1.1": "FAIL"}]
    assert report.notebooks[0].exercises[0].checks[0]["passed"] is True  # the check said PASS
