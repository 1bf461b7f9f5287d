"""The checks of chapter 9's exercises: reading a desync from the ranks' collective logs (9.1),
and one step of a join for uneven data (9.2).

* ``check_find_desync(find_desync)``: a pure function, called on a table of logs in a thread
  of one rank started for it (the checking process never runs the learner's code), stopped
  after ``timeout`` seconds; each answer must equal the reference's exactly
  (:func:`labs.checks.faults_cases.expected_desync`). :func:`labs.experiments.faults.
  first_desync` is the library's answer (refused inside the check).
* ``check_join_step(join_step)``: every rank trains the same small model on its own number of
  batches, calling ``join_step(model, batch_or_None, lr)`` until it returns False; every
  rank's parameters must be one process's, which applies at each step the mean gradient of the
  ranks that had a batch. :class:`labs.ddp.DDP` and its ``join()`` are the library's answer
  (refused inside the check).

The cases and references are in :mod:`labs.checks.faults_cases`. ``seed=0`` runs the
documented cases; any other seed also draws more (three sets of logs; one more world size and
its batches), from ``random.Random(seed)``, and the verdict names them.
"""

from __future__ import annotations

import operator
import os
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from labs.checks.answer_keys import AnswerKeyUsed, answer_keys_refused
from labs.checks.core import (
    CHECK_FAILURE_GRACE_S,
    CHECK_TIMEOUT_S,
    CheckResult,
    ThreadCalls,
    and_listed,
    answer_key_refusal,
    calls_in_thread,
    clean_traceback,
    failing_rank,
    largest_difference,
    listed,
    raised,
    report,
    result_types,
    run_check,
    signature_problem,
    validate_check_call,
)
from labs.checks.faults_cases import (
    JOIN_ATOL,
    JOIN_LR,
    JOIN_RTOL,
    Batch,
    Desync,
    DesyncCase,
    DesyncPlan,
    Divisor,
    FaultsExercise,
    JoinPlan,
    describe_batches,
    expected_desync,
    join_model,
    join_reference,
    rank_batches,
)
from labs.collective_check import CollectiveCall
from labs.launcher import LaunchTimeout, RankError, launch

# --- 9.1, reading the learner's answers (in the check's one rank) ----------------------------


@dataclass(frozen=True)
class _Side:
    """One item of the ``sides`` a call of 9.1 returned, as plain data."""

    key: CollectiveCall | None  #: the entry it is keyed by (None: by None, or not an entry)
    key_text: str  #: '' when keyed by an entry or None; else the key, shortened
    key_type: str  #: the type of the key
    ranks: tuple[int, ...]  #: its ranks, when they were a sequence of ints
    ranks_type: str  #: the type of the ranks as returned (tuple is right)
    ranks_text: str  #: '' when the ranks were a sequence of ints; else what they were


@dataclass(frozen=True)
class _Answer:
    """What one call of 9.1 returned: None (``seq`` None), or ``(seq, sides)``."""

    seq: int | None
    sides: tuple[_Side, ...] = ()


def _short(value: object) -> str:
    """A value the learner returned, in a few words: an entry as the verdict writes it."""
    if isinstance(value, CollectiveCall):
        try:
            return _entry_text(value)
        except Exception:  # noqa: BLE001 - an entry the learner built of anything
            pass
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _typed(value: object) -> str:
    return f"{type(value).__name__} {_short(value)}"


def _index(value: object) -> int | None:
    """``value`` as an int (a numpy integer too), or None (a bool, a float, anything else)."""
    if isinstance(value, bool):
        return None
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        return None


def _plain_call(key: CollectiveCall) -> CollectiveCall:
    """A copy of an entry made of plain values only (what a rank can send back)."""
    shape = None if key.shape is None else tuple(int(d) for d in key.shape)
    return CollectiveCall(int(key.seq), str(key.op), shape,
                          None if key.dtype is None else str(key.dtype),
                          None if key.root is None else int(key.root), str(key.where))


def _read_side(key: object, ranks: object) -> _Side:
    plain, key_text = None, ""
    if isinstance(key, CollectiveCall):
        try:
            plain = _plain_call(key)
        except (TypeError, ValueError):
            key_text = _short(key)
    elif key is not None:
        key_text = _short(key)
    numbers = [_index(r) for r in ranks] if isinstance(ranks, (tuple, list)) else [None]
    if None not in numbers:
        return _Side(plain, key_text, type(key).__name__, tuple(numbers),  # type: ignore[arg-type]
                     type(ranks).__name__, "")
    return _Side(plain, key_text, type(key).__name__, (), type(ranks).__name__, _short(ranks))


def _read_answer(value: object) -> _Answer | str:
    """A call's answer as plain data, or why it is not None nor a pair ``(k, sides)``."""
    if value is None:
        return _Answer(None)
    if not isinstance(value, (tuple, list)) or len(value) != 2:
        return (f"returned {_typed(value)}; return None when every log is the same, else a "
                "pair (k, sides).")
    k, sides = _index(value[0]), value[1]
    if k is None:
        return (f"returned k = {_typed(value[0])}; k is the sequence number of a collective, "
                "an int.")
    if not isinstance(sides, Mapping):
        return (f"returned sides = {_typed(sides)}; sides is a dict mapping each distinct k-th "
                "entry to the tuple of ranks that hold it.")
    return _Answer(k, tuple(_read_side(key, ranks) for key, ranks in sides.items()))


@dataclass
class _DesyncRun(ThreadCalls):
    """What the learner's calls of 9.1 gave, in the order of the plan's cases."""

    returned: list[_Answer | str] = field(default_factory=list)


def _run_desync(fn: Callable[..., Any], cases: Sequence[DesyncCase],
                timeout: float) -> tuple[_DesyncRun, str]:
    """Every call in a thread of this rank, for at most ``timeout`` s in all; each gets fresh
    lists (``logs[r]`` a list), so that a call that changes them changes no other case.
    Returns what they gave and, when they did not finish, where the learner's code was."""
    run = _DesyncRun()

    def make_calls() -> None:
        for case in cases:
            run.returned.append(_read_answer(fn([list(log) for log in case.logs])))

    return run, calls_in_thread(make_calls, run, "labs check 9.1", timeout)


#: What the one rank of 9.1 gets beyond the calls' own ``timeout``: its start, and stopping a
#: call that never returns.
_DESYNC_SLACK_S = 10.0


def _desync_rank(rank: int, world_size: int, fn: Callable[..., Any],
                 cases: tuple[DesyncCase, ...], timeout: float,
                 exercise: str) -> tuple[_DesyncRun, str, str]:
    """The one rank of a 9.1 check: every call (:func:`_run_desync`) with labs' own
    first_desync refused. Returns what the calls gave, where a call was stopped ('' when none
    was), and the refusal's message ('' when no answer key was called)."""
    try:
        with answer_keys_refused(exercise):
            run, where = _run_desync(fn, cases, timeout)
    except AnswerKeyUsed as refused:
        return _DesyncRun(), "", str(refused)
    return run, where, ""


# --- 9.1, judging ------------------------------------------------------------------------------


def _entry_text(entry: CollectiveCall | None) -> str:
    """``#5 all_reduce of float32[1] at train.py:44``, or ``None``."""
    if entry is None:
        return "None"
    found = re.match(r'File "([^"]*)", line (\d+)', entry.where)
    at = (f"{os.path.basename(found.group(1))}:{found.group(2)}" if found
          else entry.where.splitlines()[0][:60] if entry.where else "?")
    return f"#{entry.seq} {entry.what()} at {at}"


def _want_text(want: Desync | None) -> str:
    if want is None:
        return "None"
    k, sides = want
    return f"({k}, {{{', '.join(f'{_entry_text(e)}: {r}' for e, r in sides.items())}}})"


def _answer_text(got: _Answer) -> str:
    if got.seq is None:
        return "None"
    items = []
    for s in got.sides:
        ranks = s.ranks_text or (repr(list(s.ranks)) if s.ranks_type == "list" else
                                 repr(s.ranks))
        items.append(f"{s.key_text or _entry_text(s.key)}: {ranks}")
    return f"({got.seq}, {{{', '.join(items)}}})"


_FIELDS = ("op", "shape", "dtype", "root", "where")


def _missed(want: Desync) -> str:
    """Why a learner's loop may see no difference at collective k, or ''."""
    k, sides = want
    if None in sides:
        return (f"at collective {k} the log of rank(s) {listed(sides[None])} had ended: a log "
                "that has ended counts as None there (zip stops at the shortest log: go on to "
                "the end of the longest).")
    entries = [e for e in sides if e is not None]
    fields = [f for f in _FIELDS if len({getattr(e, f) for e in entries}) > 1]
    if fields and set(fields) <= {"root", "where"}:
        named = and_listed([{"where": "where (the call site)", "root": "root"}[f]
                            for f in fields])
        return (f"the entries at collective {k} differ only in {named}: compare whole entries "
                "(==), not op, shape and dtype alone.")
    return ""


def _sides_problem(world_size: int, got: _Answer, want: Desync) -> str:
    """What is wrong with the sides of an answer whose k is right ('' when nothing is)."""
    k, sides = want
    keys = [s for s in got.sides if s.key_text]
    if keys:
        how = ("by rank" if all(s.key_type == "int" for s in keys)
               else f"by {keys[0].key_type} ({keys[0].key_text})")
        return (f"sides is keyed {how}: key each side by the entry the ranks issued as "
                f"collective {k} (log[{k} - 1], a CollectiveCall), or None for the ranks whose "
                "log had ended, and give it the tuple of ranks that hold it.")
    odd = next((s for s in got.sides if s.ranks_text or s.ranks_type != "tuple"), None)
    if odd is not None:
        return (f"the ranks of a side are {odd.ranks_text or 'a ' + odd.ranks_type}: make "
                "them a tuple of ints, ascending (tuple(ranks)).")
    mine = {s.key: s.ranks for s in got.sides}
    if mine == sides and len(mine) == len(got.sides):
        return ""
    if mine.keys() == sides.keys() and all(tuple(sorted(mine[e])) == sides[e] for e in sides):
        return "the ranks of each side must be in ascending order."
    first = next(e for e, ranks in sides.items() if 0 in ranks)
    if len(sides) > 2 and len(mine) == 2 and mine.get(first) == sides[first]:
        rest = [r for r in range(world_size) if r not in sides[first]]
        return (f"every rank that differs from rank 0 is in one side, but ranks {listed(rest)} "
                f"issued {len(sides) - 1} different collectives: each distinct entry is a side "
                "of its own.")
    if None in sides and None not in mine:
        return (f"rank(s) {listed(sides[None])}, whose log had ended, are missing: they are "
                "the side None.")
    return (f"sides maps each distinct entry at collective {k} to the ranks whose k-th entry "
            "equals it: every rank in exactly one side.")


def _desync_problem(world_size: int, got: _Answer, want: Desync | None) -> str:
    """What is wrong with an answer, in words ('' when it is right)."""
    if want is None:
        return ("" if got.seq is None else
                "every log is the same (the same length, equal entries): return None.")
    k = want[0]
    if got.seq is None:
        return _missed(want) or f"the logs differ at collective {k}."
    if got.seq == k - 1:
        return ("k is 1-based: a log's first entry is collective 1 (its seq is 1), so entry "
                "log[i] is collective i + 1.")
    if got.seq > k:
        return _missed(want) or f"the logs already differ at collective {k}: return the first."
    if got.seq < k:
        return f"up to collective {k - 1} every log holds the same entries."
    return _sides_problem(world_size, got, want)


def _judge_desync(plan: DesyncPlan, run: _DesyncRun, timeout: float, where: str) -> str:
    for i, (case, got) in enumerate(zip(plan.cases, run.returned, strict=False)):
        at = f"case {i + 1} ({case.describe()})"
        if isinstance(got, str):
            return f"{at}: {got}"
        want = expected_desync(case.logs)
        wrong = _desync_problem(len(case.logs), got, want)
        if wrong:
            return f"{at}: returned {_answer_text(got)}, expected {_want_text(want)}: {wrong}"
    if run.finished:
        return ""
    at = f"case {len(run.returned) + 1} ({plan.cases[len(run.returned)].describe()})"
    function = FaultsExercise.FIND_DESYNC.function
    if run.error_type:
        return f"{at}: {function} raised {run.error_type}.\n{clean_traceback(run.error, __file__)}"
    return (f"{at}: {function} did not return within {timeout:g} s, and was stopped"
            f"{' at ' + where if where else ''}. A loop that never ends? One pass over the "
            "logs, to the end of the longest, is enough.")


_DESYNC_KINDS = ("a skipped collective (the later entries shift), two all-reduces of one shape "
                 "swapped (only the call sites differ), another shape, dtype, op and root, a "
                 "log that ended early, one collective more at the end, three sides at once, "
                 "logs that agree and empty logs")


def check_find_desync(
    find_desync: Callable[..., object],
    seed: int = 0,
    timeout: float = CHECK_TIMEOUT_S,
) -> CheckResult:
    """Exercise 9.1: ``find_desync(logs)``, ``logs[r]`` the list of
    :class:`~labs.collective_check.CollectiveCall` rank r issued on one group, in order (the
    k-th has seq k), must return None when every log is the same (the same length, equal
    entries), else ``(k, sides)``: k the first 1-based sequence number at which two logs differ
    (a log that has ended counts as None there), ``sides`` a dict mapping each distinct k-th
    entry (a CollectiveCall compared with ==, every field, call site included; None for the
    ranks whose log had ended) to the ranks that hold it, a tuple in ascending order (a list is
    refused). The answer must equal the reference's exactly, on logs of 2 to 8 ranks: 12
    documented cases (a skipped collective, a swap of two same-shape all-reduces, another
    shape, dtype, op and root, a log that ended early, one collective more, three sides at
    once, logs that agree, empty logs). Called in one process started for it (the checking
    process never runs the learner's code); the calls get ``timeout`` seconds in all.

    A non-zero ``seed`` also runs three more sets of logs (2 to 8 ranks, 1 to 3 training steps,
    one fault or none), drawn from ``random.Random(seed)``; the verdict names them."""
    exercise = FaultsExercise.FIND_DESYNC
    validate_check_call(find_desync, (1,), seed, timeout,  # a pure function: no world sizes
                        example="check_find_desync(find_desync)")
    plan = DesyncPlan.make(seed)

    def verdict(ok: bool, message: str) -> CheckResult:
        return report(CheckResult(exercise.title, ok, message + plan.note()))

    problem = signature_problem(exercise.function, exercise.parameters, find_desync)
    if problem:
        return verdict(False, problem)
    try:
        ((run, where, refused),) = launch(
            _desync_rank, 1, args=(find_desync, plan.cases, timeout, exercise.value),
            backend="gloo", timeout=timeout + _DESYNC_SLACK_S, echo=False,
            failure_grace=CHECK_FAILURE_GRACE_S,
            result_types=(*result_types(), CollectiveCall))
    except RankError as err:
        return verdict(False, answer_key_refusal(err) or raised(failing_rank(err)))
    except LaunchTimeout:
        return verdict(False, f"{exercise.function} did not return within {timeout:g} s, and "
                              "its process could not be stopped (a call blocked outside Python?)")
    wrong = refused or _judge_desync(plan, run, timeout, where)
    if wrong:
        return verdict(False, wrong)
    return verdict(True, (
        f"on {len(plan.cases) - len(plan.drawn)} sets of logs of 2 to 8 ranks ({_DESYNC_KINDS}), "
        "every answer was the first 1-based sequence number at which the logs differ, with "
        "each distinct entry there (None for a log that had ended) and the tuple of ranks "
        "holding it, ascending, or None where the logs agree."))


# --- 9.2, inside every rank -------------------------------------------------------------------


@dataclass(frozen=True)
class _JoinRun:
    """What one rank of 9.2 saw: how many calls its loop made, whether the last returned a
    false value (and its type), and its parameters at the end."""

    calls: int
    ended: bool
    last: str  #: what the last call returned, in words ('False', 'None', 'a Tensor')
    params: dict[str, torch.Tensor]


def _returned(value: object) -> tuple[bool, str]:
    """Whether the loop goes on after a call returned ``value`` (as ``while`` reads it), and
    ``value`` in words; a value whose truth cannot be read ends it."""
    words = repr(value) if value is None or isinstance(value, bool) else (
        f"a {type(value).__name__}")
    try:
        return bool(value), words
    except Exception:  # noqa: BLE001 - a tensor of several elements, or the learner's object
        return False, f"{words}, neither True nor False"


def _join_rank(rank: int, world_size: int, join_step: Callable[..., Any], bound: int,
               exercise: str, batches: list[Batch]) -> _JoinRun:
    """``while join_step(model, batch, lr)``, at most ``bound`` calls: this rank's batches in
    order (copies), then None, on the check model; labs' DDP and its join refused."""
    model = join_model()
    calls, ended, last = 0, False, ""
    with answer_keys_refused(exercise):
        while calls < bound:
            batch = batches[calls] if calls < len(batches) else None
            calls += 1
            given = None if batch is None else (batch[0].clone(), batch[1].clone())
            going, last = _returned(join_step(model, given, JOIN_LR))
            if not going:
                ended = True
                break
    return _JoinRun(calls, ended, last,
                    {name: p.detach().clone() for name, p in model.named_parameters()})


# --- 9.2, judging ------------------------------------------------------------------------------


def _far(got: Mapping[str, torch.Tensor], want: Mapping[str, torch.Tensor]) -> str:
    """The first parameter of ``got`` not close to ``want``'s, in words ('' when none)."""
    if set(got) != set(want):
        return f"the model's parameters are {listed(got) or 'none'}, not {listed(want)}"
    for name, w in want.items():
        g = got[name]
        if g.shape != w.shape or g.dtype != w.dtype:
            return f"{name} is {g.dtype}{list(g.shape)}, not {w.dtype}{list(w.shape)}"
        if not torch.allclose(g, w, rtol=JOIN_RTOL, atol=JOIN_ATOL):
            return f"{name}'s " + largest_difference(g, w, "one process's")
    return ""


def _judge_join(seed: int, counts: tuple[int, ...], runs: Sequence[_JoinRun]) -> str:
    at = f"with {describe_batches(counts)}"
    most = max(counts)
    calls, bound = most + 1, most + 3
    for r, run in enumerate(runs):
        if not run.ended:
            return (f"{at}, rank {r}: join_step returned a true value in each of {bound} calls, "
                    "never False. Return False once no rank has a batch left (every rank "
                    "learns it from the same count), so that every rank's loop ends together.")
    for r, run in enumerate(runs):
        if run.calls < calls:
            return (f"{at}, rank {r}: its loop ended at call {run.calls} (join_step returned "
                    f"{run.last}), but rank {counts.index(most)} had {most} batch(es), so every "
                    f"rank must make {calls} calls: return True after each step, also a shadow "
                    "step, and False only once no rank has a batch left.")
        if run.calls > calls:
            return (f"{at}, rank {r}: join_step returned False only at call {run.calls}; every "
                    f"rank had run out after {most} batch(es), so call {calls} must return False "
                    "(no step is left to take).")
    batches = rank_batches(seed, counts)
    want = join_reference(batches)
    wrong = [(r, problem) for r, run in enumerate(runs) if (problem := _far(run.params, want))]
    if not wrong:
        return ""
    r, problem = wrong[0]
    right = [q for q in range(len(runs)) if q not in dict(wrong)]
    if right:
        return (f"{at}: rank(s) {listed(right)} end with one process's parameters, rank {r} "
                f"({counts[r]} batch(es)) does not: {problem}. A rank without a batch must still "
                "apply every update its peers apply (the mean of their gradients), so that every "
                "rank's model stays the same.")
    for divisor, hint in (
            (Divisor.WORLD, "every rank divided the sum of the gradients by the world size: the "
                            "mean is over the ranks that had a batch that step (the sum divided "
                            "by how many still train)"),
            (Divisor.NONE, "every rank applied the sum of the gradients: all_reduce sums; divide "
                           "by how many ranks had a batch that step")):
        if all(not _far(run.params, join_reference(batches, divisor)) for run in runs):
            return f"{at}: {hint}."
    differ = next((q for q, run in enumerate(runs) if _far(run.params, runs[0].params)), None)
    if differ is not None:
        return (f"{at}: the ranks end with different parameters (rank {differ}'s and rank 0's "
                "differ), and none with one process's: every rank must apply the same update, "
                f"at every step. Rank {r}: {problem}.")
    return (f"{at}: every rank ends with the same parameters, but not one process's: {problem}. "
            "Each step, every rank does p -= lr * g, g the mean over the ranks that had a batch "
            "of the gradient of F.mse_loss(model(x), y) (zero the gradients before backward).")


def _join_error(counts: tuple[int, ...], err: RankError) -> str:
    named = failing_rank(err)
    at = f"with {describe_batches(counts)}"
    if named.exc_type == "RankDied":
        return (f"{at}, rank {named.rank} died. gloo ends a process when a message does not fit "
                "the buffer posted to receive it: every rank must all-reduce tensors of the same "
                "size and dtype, a rank without a batch zeros of its gradient's size.")
    hint = (" batch is None on a rank that has run out of data: test for None before "
            "unpacking x, y." if "NoneType" in named.traceback else "")
    return f"{at}, {raised(named, hint)}"


def _join_timeout(counts: tuple[int, ...], err: LaunchTimeout, timeout: float,
                  where: str) -> str:
    return (f"with {describe_batches(counts)}, rank(s) {listed(err.ranks)} hung for "
            f"{timeout:g} s.{where} A rank without a batch must still issue every collective "
            "its peers issue, with zeros in place of its gradient (a shadow step), and every "
            "rank returns False only once no rank has a batch left.")


def check_join_step(
    join_step: Callable[[nn.Module, Batch | None, float], object],
    world_sizes: Sequence[int] = (2, 3, 4),
    seed: int = 0,
    timeout: float = CHECK_TIMEOUT_S,
) -> CheckResult:
    """Exercise 9.2: every rank builds the same model (Linear(4, 3), Tanh, Linear(3, 2)) and
    runs ``while join_step(model, batch, lr)``, ``batch`` its next ``(x, y)`` or None once it
    has run out, ``lr`` 0.1. Every rank must make max(batches) + 1 calls, the last returning
    False, and end with the parameters of one process that, at each step, applies plain SGD
    with the mean over the ranks that had a batch of the gradient of ``F.mse_loss(model(x),
    y)`` (rtol 1e-5, atol 1e-6). Batches per rank: 3, 1 on 2 ranks; 2, 0, 4 on 3 (one rank
    with none at all); 2, 2, 2, 2 on 4. A rank that calls more than max(batches) + 3 times
    fails (join_step never returned False).

    A non-zero ``seed`` also runs one more world size (5 or 6) with batches of 0 to 4 per
    rank, drawn from ``random.Random(seed)``; the verdict names them."""
    exercise = FaultsExercise.JOIN_STEP
    validate_check_call(join_step, world_sizes, seed, timeout,
                        example="check_join_step(join_step)")
    plan = JoinPlan.make(world_sizes, seed)
    return run_check(
        exercise.title, plan, timeout,
        worker=_join_rank,
        args=lambda n: (join_step, max(plan.counts(n)) + 3, exercise.value),
        rank_args=lambda n: [(mine,) for mine in rank_batches(seed, plan.counts(n))],
        judge=lambda n, runs: _judge_join(seed, plan.counts(n), runs),
        explain_error=lambda n, err: _join_error(plan.counts(n), err),
        explain_timeout=lambda n, err, where: _join_timeout(plan.counts(n), err, timeout,
                                                            where),
        passed=(f"on {'; '.join(describe_batches(c) for c in plan.batches)}, every rank called "
                "join_step max(batches) + 1 times, the last returning False, and ended with the "
                "parameters of one process applying at each step the mean gradient of the ranks "
                f"that had a batch (F.mse_loss, plain SGD, lr {JOIN_LR:g}; rtol 1e-5, atol "
                "1e-6)."),
        problem=signature_problem(exercise.function, exercise.parameters, join_step),
    )
