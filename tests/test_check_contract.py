"""The check contract: what every exercise check does alike, tested once over the registry
(:mod:`labs.checks.exercises`), one row at a time.

* The registry and the book agree: every cell tagged ``exercise-N.M`` has a row, every row
  has its tagged cells in its own chapter, and each check cell calls the row's check on the
  row's learner name (shown failing on a registry missing a row and on a notebook tagging an
  exercise the registry lacks).
* The notebook's reference solution passes, here with a seed: the verdict names what the seed
  drew and how to rerun it (the documented verdict of seed 0 is the stored output of the
  chapter's check cell, which nbval compares in ``make test``).
* Wrong arguments are refused before any process starts: a ``TypeError`` or ``ValueError``
  for what is not a function (a class), a seed, a timeout or world sizes, and a FAIL verdict
  for a function or class that cannot be called with the exercise's arguments.
* A rank that hangs gets the hang verdict: which ranks, for how long, where the learner's
  code waited, and the check's explanation of what every rank must do.
* Calling one of the exercise's answer keys (:mod:`labs.checks.answer_keys`) fails with the
  one-line refusal, under any name, and the key is given back afterwards.

What each check prints for its own wrong answers is in its chapter's ``test_checks_*``.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import shutil
import time
from pathlib import Path

import nbformat
import pytest
import torch
import torch.distributed as dist
from torch import nn

import labs.checks
from labs.checks.answer_keys import (
    AnswerKeyUsed,
    answer_key,
    answer_keys_refused,
    refusal_message,
    refused_function,
)
from labs.checks.core import CheckPlan
from labs.checks.exercises import BY_ID, EXERCISES, ExerciseSpec, Form, spec
from labs.grading.handout import load_chapters
from labs.grading.notebook import cell_exercise, read_notebook

from solutions import NOTEBOOKS, reference, send_by_value

send_by_value(__name__)
pytestmark = pytest.mark.usefixtures("no_leftover_processes")

ROWS = pytest.mark.parametrize("row", EXERCISES, ids=[e.id for e in EXERCISES])
#: The seed of the contract's hidden cases (it draws 2 to 6 ranks, the fewest of seeds 1-11).
SEED = 1
#: How long a hanging answer waits before the verdict.
HANG_S = 3


def takes_world_sizes(row: ExerciseSpec) -> bool:
    """Whether the row's check runs on world sizes (5.3's, 7.2's, 7.3's and 9.1's call a pure
    function in a thread, on ranks of their own)."""
    return "world_sizes" in inspect.signature(row.check_function()).parameters


def few_ranks(row: ExerciseSpec, world_sizes: tuple[int, ...]) -> dict[str, object]:
    """The keyword that runs the row's check on ``world_sizes``, where it takes one."""
    return {"world_sizes": world_sizes} if takes_world_sizes(row) else {}


# --- the registry and the book ----------------------------------------------------------------


def tag_disagreements(notebooks: Path, rows: tuple[ExerciseSpec, ...]) -> list[str]:
    """Where the ``exercise-N.M`` cell tags of the notebooks in ``notebooks`` and ``rows``
    disagree, in words ([] when they agree), as the grader reads the tags."""
    tagged: dict[str, set[str]] = {}
    for path in sorted(notebooks.glob("*.ipynb")):
        for cell in read_notebook(path).cells:
            exercise = cell_exercise(cell)
            if exercise is not None:
                tagged.setdefault(exercise, set()).add(path.stem)
    by_id = {row.id: row for row in rows}
    problems = [f"{', '.join(sorted(stems))} tag exercise-{exercise}, which has no row in the "
                "registry" for exercise, stems in tagged.items() if exercise not in by_id]
    for row in rows:
        stems = tagged.get(row.id, set())
        if stems != {row.notebook}:
            where = ", ".join(sorted(stems)) or "no notebook"
            problems.append(f"exercise {row.id} belongs to {row.notebook}, but {where} tags "
                            f"cells {row.tag}")
    return problems


def test_the_registry_and_the_notebooks_tags_agree():
    assert tag_disagreements(NOTEBOOKS, EXERCISES) == []
    tagged = [ex.exercise for chapter in load_chapters(NOTEBOOKS) for ex in chapter.exercises]
    assert tagged == [row.id for row in EXERCISES]  # the registry is in the book's order


def test_a_registry_missing_a_row_disagrees_with_the_notebooks():
    missing = tuple(row for row in EXERCISES if row.id != "6.4")
    assert tag_disagreements(NOTEBOOKS, missing) == [
        "06_zero_fsdp tag exercise-6.4, which has no row in the registry"]


def test_a_notebook_tagging_an_exercise_the_registry_lacks_disagrees(tmp_path):
    for path in NOTEBOOKS.glob("*.ipynb"):
        shutil.copy(path, tmp_path)
    nb = nbformat.read(tmp_path / "04_all_gather.ipynb", as_version=4)
    for cell in nb.cells:
        tags = cell.get("metadata", {}).get("tags", [])
        cell.setdefault("metadata", {})["tags"] = [
            "exercise-4.3" if tag == "exercise-4.2" else tag for tag in tags]
    nbformat.write(nb, tmp_path / "04_all_gather.ipynb")
    assert tag_disagreements(tmp_path, EXERCISES) == [
        "04_all_gather tag exercise-4.3, which has no row in the registry",
        "exercise 4.2 belongs to 04_all_gather, but no notebook tags cells exercise-4.2"]


def test_each_check_cell_calls_its_rows_check_with_its_learner_name():
    for chapter in load_chapters(NOTEBOOKS):
        for ex in chapter.exercises:
            row = spec(ex.exercise)
            assert chapter.path.stem == row.notebook
            assert [(call.function, call.submitted) for call in ex.calls] == [
                (row.check, (row.learner_name,))], ex


def test_the_package_exports_every_rows_check_and_no_other():
    exported = {name for name in labs.checks.__all__ if name.startswith("check_")}
    assert exported == {row.check for row in EXERCISES}
    for row in EXERCISES:
        assert getattr(labs.checks, row.check) is row.check_function()
        assert row.check_function().__module__ == row.module


@ROWS
def test_the_rows_hidden_cases_are_drawn_by_a_plan(row):
    module, _, name = row.hidden_cases.rpartition(".")
    plan = getattr(importlib.import_module(module), name)
    assert issubclass(plan, CheckPlan) and callable(plan.make)
    assert inspect.signature(row.check_function()).parameters["seed"].default == 0


def test_a_row_is_looked_up_by_its_id():
    assert spec("6.4") is BY_ID["6.4"] and spec("6.4").title == "Exercise 6.4 zero2_grad_hook"
    assert spec("2.1").signature == "ring_all_reduce(tensor)"
    with pytest.raises(KeyError, match="no exercise '0.1'; the exercises are 1.1, 2.1"):
        spec("0.1")


# --- the reference passes, and a seed names what it drew ----------------------------------------


#: The reference's pass with a seed is one mechanism of the contract (a check on ranks, or a pure
#: function in a thread): three rows in make test; the rest in make test-slow, where the grader
#: also runs every reference on its hidden cases (test_grading.py).
FAST_REFERENCE = ("1.1", "7.2", "9.1")


@pytest.mark.parametrize("row", [e if e.id in FAST_REFERENCE
                                 else pytest.param(e, marks=pytest.mark.slow)
                                 for e in EXERCISES], ids=[e.id for e in EXERCISES])
def test_the_reference_passes_the_hidden_cases_and_the_verdict_names_them(row, capsys):
    check = row.check_function()
    result = check(reference(row), **few_ranks(row, (1,)), seed=SEED)
    assert result.passed, result.message
    assert f"[seed {SEED} drew " in result.message
    assert result.message.endswith(f"; pass seed={SEED} to rerun]")
    assert capsys.readouterr().out == f"PASS: {row.title}: {result.message}\n"


# --- wrong arguments: refused before any process starts ----------------------------------------


def takes_seven(a, b, c, d, e, f, g):
    """No exercise's function takes seven arguments."""


class BuiltWithSeven:
    """No exercise's class is built with seven arguments."""

    def __init__(self, a, b, c, d, e, f, g):
        pass

    def finish_gradient_synchronization(self):
        pass


#: Arguments every check refuses, with the error.
BAD_ARGUMENTS = [({"seed": "1"}, TypeError), ({"seed": 1.0}, TypeError),
                 ({"timeout": 0}, ValueError), ({"timeout": -1}, ValueError)]
#: World sizes every check that runs on ranks refuses.
BAD_WORLD_SIZES = [(3, TypeError), ((), TypeError), ((0,), ValueError), ((2, 0), ValueError),
                   ((1000,), ValueError)]


@ROWS
def test_wrong_arguments_are_refused_before_any_process_starts(row, refuse_processes):
    check, right = row.check_function(), reference(row)
    # Not the learner's function: its result (not callable); not the class: an instance, a
    # function.
    not_written = ([None, nn.Linear(1, 1), takes_seven] if row.form is Form.CLASS
                   else [None, 3])
    with refuse_processes():
        for wrong in not_written:
            with pytest.raises(TypeError, match="pass the (function|class) itself"):
                check(wrong)
        bad = BAD_ARGUMENTS + ([({"world_sizes": w}, e) for w, e in BAD_WORLD_SIZES]
                               if takes_world_sizes(row) else [])
        for kwargs, error in bad:
            with pytest.raises(error, match="seed|timeout|world_sizes|world size"):
                check(right, **kwargs)


@ROWS
def test_code_that_cannot_be_called_so_fails_before_any_process_starts(row, refuse_processes,
                                                                       capsys):
    parameters = ", ".join(row.parameters)
    with refuse_processes():
        if row.form is Form.CLASS:
            result = row.check_function()(BuiltWithSeven)
            expected = f"{row.function} must be built as {row.function}({parameters})"
        else:
            result = row.check_function()(takes_seven)
            expected = (f"{row.function} must accept {len(row.parameters)} argument(s), "
                        f"({parameters})")
    assert not result.passed
    assert result.message.startswith(expected), result.message
    assert capsys.readouterr().out == f"FAIL: {row.title}: {result.message}\n"


# --- a hang -------------------------------------------------------------------------------------


def deadlock(*args):
    """Every rank waits for a message from its right neighbour, which never sends one."""
    dist.recv(torch.zeros(1), src=(dist.get_rank() + 1) % dist.get_world_size())


class DeadlockedWrapper:
    """A wrapper whose construction waits as :func:`deadlock` does."""

    def __init__(self, *args):
        deadlock()

    def finish_gradient_synchronization(self):
        pass


def never_returns(*args):
    """For 5.3, 7.2, 7.3 and 9.1, which call the learner's function in a thread: a loop that never
    ends."""
    while True:
        time.sleep(0.01)


RING_HANG = ("Every send needs a matching receive: on a ring, post the receive (dist.irecv) before "
             "waiting on the send, or use dist.batch_isend_irecv for each step")
#: What each check's hang verdict says every rank must do (or, 5.3, 7.2, 7.3 and 9.1, what to
#: look for).
HANG_HINTS = {
    "1.1": "Every rank must call all_reduce on the same parameters, in the same order.",
    "2.1": RING_HANG,
    "3.1": RING_HANG,
    "4.1": RING_HANG,
    "4.2": RING_HANG,
    "5.1": "every rank must make the same collectives (broadcasts in __init__, one all-reduce "
           "per parameter or bucket) in the same order.",
    "5.2": "every rank must make the same collectives (broadcasts in __init__, one all-reduce "
           "per parameter or bucket) in the same order.",
    "5.3": "A loop that never ends?",
    "6.1": "every rank must make an all-gather of every tensor, in the same order, even a rank "
           "whose shard is only padding.",
    "6.2": "every rank must make an all-gather of every tensor, in the same order, even a rank "
           "whose shard is only padding.",
    "6.3": "every rank must make a reduce-scatter of every tensor, in the same order, even a "
           "rank whose shard is only padding.",
    "6.4": "every rank must reduce-scatter every parameter's gradient, in the hook, even a rank "
           "whose shard is only padding.",
    "6.5": "every rank must make the all-gather and the reduce-scatter, in the same order, even "
           "a rank whose shard is only padding.",
    "7.1": "every rank must make the same one all-reduce in every call, even a rank whose "
           "shards are only padding",
    "7.2": "A loop that never ends?",
    "7.3": "A loop that never ends?",
    "8.1": "every rank of node_group must make the same reduce-scatter and all-gather, every "
           "rank of cross_group the same all-reduce",
    "8.2": "every rank must make the same one all-reduce in every call, even a rank that holds "
           "no hidden feature.",
    "9.1": "A loop that never ends?",
    "9.2": "A rank without a batch must still issue every collective its peers issue, with "
           "zeros in place of its gradient",
}


#: The hang verdict is the contract's one mechanism (a check on ranks, or a pure function in a
#: thread): two rows in make test, the rest's exercise-specific hints in make test-slow.
FAST_HANG = ("2.1", "7.2")


@pytest.mark.parametrize("row", [e if e.id in FAST_HANG
                                 else pytest.param(e, marks=pytest.mark.slow)
                                 for e in EXERCISES], ids=[e.id for e in EXERCISES])
def test_a_hang_gets_the_hang_verdict(row, capsys):
    check = row.check_function()
    if not takes_world_sizes(row):  # one process, the calls in a thread it stops
        result = check(never_returns, timeout=1)
        assert f"{row.function} did not return within 1 s, and was stopped at File" in (
            result.message)
        assert "in never_returns" in result.message
    else:
        answer = DeadlockedWrapper if row.form is Form.CLASS else deadlock
        result = check(answer, world_sizes=(2,), timeout=HANG_S)
        assert result.message.startswith("with 2 rank(s)"), result.message
        assert f"rank(s) 0, 1 hung for {HANG_S} s. Rank 0 was waiting at File" in result.message
        assert "in deadlock" in result.message
    assert not result.passed
    assert HANG_HINTS[row.id] in result.message
    assert capsys.readouterr().out.startswith(f"FAIL: {row.title}: ")


# --- the answer keys: refused inside the check, given back after --------------------------------


def calls_the_key(*args, key):
    """The exercise's answer key, called instead of written (it raises before it reads any
    argument)."""
    answer_key(key)()


class _WrapsTheKey:
    key = ""

    def __init__(self, *args):
        answer_key(self.key)()

    def finish_gradient_synchronization(self):
        pass


def key_user(row: ExerciseSpec, key: str) -> object:
    """What the learner would hand in if they called ``key`` instead of writing ``row``."""
    if row.form is Form.CLASS:
        return type("WrapsTheKey", (_WrapsTheKey,), {"key": key})
    return functools.partial(calls_the_key, key=key)


@ROWS
def test_an_answer_key_is_refused_in_the_check_and_given_back(row, capsys):
    key = row.answer_keys[0]
    code = refused_function(key).__code__
    result = row.check_function()(key_user(row, key), **few_ranks(row, (1,)))
    assert str(result) == f"FAIL: {row.title}: {refusal_message(row.id, key)}"
    assert capsys.readouterr().out == f"{result}\n"
    assert refused_function(key).__code__ is code


def fresh(key: str) -> object:
    """``key`` looked up again through importlib, as a learner's ``import_module`` would (every
    key is ``labs.<module>.<name>[.<method>]``)."""
    parts = key.split(".")
    return functools.reduce(getattr, parts[2:], importlib.import_module(".".join(parts[:2])))


@ROWS
def test_each_answer_key_is_refused_under_any_name_and_given_back(row):
    exercise, keys = row.id, row.answer_keys
    aliases = {key: answer_key(key) for key in keys}  # references kept from before
    codes = {key: refused_function(key).__code__ for key in keys}
    with pytest.raises(AnswerKeyUsed) as sticky:
        with answer_keys_refused(exercise):
            for key in keys:
                for how in (aliases[key], fresh(key)):
                    with pytest.raises(AnswerKeyUsed) as refused:
                        how()  # the stub raises before it reads any argument
                    assert str(refused.value) == refusal_message(exercise, key)
                    assert f"exercise {exercise} asks you to write this" in str(refused.value)
                    assert f"`{key}` is its answer key" in str(refused.value)
    assert str(sticky.value) == refusal_message(exercise, keys[0])  # the first one called
    for key in keys:
        assert refused_function(key).__code__ is codes[key], key
