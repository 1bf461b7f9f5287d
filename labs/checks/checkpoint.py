"""Exercise 7.2's check, ``check_shard_pieces(shard_pieces)``: where a new shard's elements
lie in a checkpoint saved on another number of ranks, a pure function, checked in one process
started for it (the checking process never runs the learner's code).

``shard_pieces(numel, saved_world_size, world_size, rank)`` returns the pieces ``(saved_rank,
start, stop)``, offsets inside saved rank ``saved_rank``'s shard of ``k_old = ceil(numel /
saved_world_size)`` elements, whose concatenation is this rank's new shard's real elements,
flat ``[rank*k_new, min((rank+1)*k_new, numel))``, ``k_new = ceil(numel / world_size)``: one
piece per saved rank that holds some, none empty, ``[]`` for a shard of padding only. Called
for every rank of every case; a call that does not return within ``timeout`` is stopped.
:func:`labs.checkpoint.shard_pieces` is the library's answer (refused inside the check).

The cases and references are in :mod:`labs.checks.fsdp_practice_cases`, beside 7.1's.
``seed=0`` runs the documented cases; any other seed also draws two more resharding cases from
``random.Random(seed)``, and the verdict names them.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from labs.checks.answer_keys import AnswerKeyUsed, answer_keys_refused
from labs.checks.core import (
    CHECK_FAILURE_GRACE_S,
    CHECK_TIMEOUT_S,
    CheckResult,
    ThreadCalls,
    answer_key_refusal,
    calls_in_thread,
    clean_traceback,
    failing_rank,
    raised,
    report,
    result_types,
    signature_problem,
    validate_check_call,
)
from labs.checks.fsdp_practice_cases import (
    Piece,
    PiecesCase,
    PiecesPlan,
    PracticeExercise,
    expected_pieces,
)
from labs.launcher import LaunchTimeout, RankError, launch

# --- 7.2, calling the learner's function (in the check's one rank) ----------------------------


def _as_pieces(value: object) -> list[Piece] | str:
    """What a call returned, as pieces, or why it is not a list of pieces."""
    # A dict or a set would iterate in an order of its own (or over keys): not a list.
    if value is None or isinstance(value, (str, bytes, dict, set, frozenset)) or not hasattr(
            value, "__iter__"):
        return (f"returned {type(value).__name__}; return a list of (saved_rank, start, stop) "
                "tuples, in order ([] when this rank's shard is only padding).")
    pieces: list[Piece] = []
    for i, item in enumerate(value):  # type: ignore[attr-defined]
        try:
            if isinstance(item, (str, bytes)) or len(item) != 3 or any(
                    isinstance(v, bool) for v in item):
                raise TypeError
            q, a, b = (operator.index(v) for v in item)
        except TypeError:
            return (f"piece {i} is {item!r}; each piece is a tuple (saved_rank, start, stop) of "
                    "three ints.")
        pieces.append((q, a, b))
    return pieces


@dataclass
class _PiecesRun(ThreadCalls):
    """What the learner's calls of 7.2 gave, filled in by the thread that makes them, in the
    order of :func:`_calls`."""

    returned: list[list[Piece] | str] = field(default_factory=list)


def _calls(plan: PiecesPlan) -> list[tuple[PiecesCase, int]]:
    """Every call a check of 7.2 makes: each rank of the new world size of each case."""
    return [(case, rank) for case in plan.cases for rank in range(case.world_size)]


def _run_pieces(fn: Callable[..., Any], plan: PiecesPlan, timeout: float) -> tuple[_PiecesRun,
                                                                                   str]:
    """Makes every call of the plan in a thread of this process, for at most ``timeout``
    seconds in all; returns what they gave and, when they did not finish, where the learner's
    code was when it was stopped."""
    run = _PiecesRun()

    def make_calls() -> None:
        for case, rank in _calls(plan):
            run.returned.append(_as_pieces(
                fn(case.numel, case.saved_world_size, case.world_size, rank)))

    return run, calls_in_thread(make_calls, run, "labs check 7.2", timeout)


#: What the one rank of 7.2 gets beyond the calls' own ``timeout``: its start, and stopping a
#: call that never returns.
_PIECES_SLACK_S = 10.0


def _pieces_rank(rank: int, world_size: int, fn: Callable[..., Any], plan: PiecesPlan,
                 timeout: float, exercise: str) -> tuple[_PiecesRun, str, str]:
    """The one rank of a 7.2 check: every call of the plan (:func:`_run_pieces`) with labs'
    own shard_pieces refused. Returns what the calls gave, where a call was stopped ('' when
    none was), and the refusal's message ('' when no answer key was called)."""
    try:
        with answer_keys_refused(exercise):
            run, where = _run_pieces(fn, plan, timeout)
    except AnswerKeyUsed as refused:
        return _PiecesRun(), "", str(refused)
    return run, where, ""


# --- 7.2, judging ----------------------------------------------------------------------------


def _ranges_text(elements: Sequence[int]) -> str:
    """Flat element indices, as runs ``[a, b)``."""
    runs: list[list[int]] = []
    for e in elements:
        if runs and runs[-1][1] == e:
            runs[-1][1] += 1
        else:
            runs.append([e, e + 1])
    return ", ".join(f"[{a}, {b})" for a, b in runs) or "none"


def _pieces_hint(case: PiecesCase, rank: int, got: list[Piece]) -> str:
    """The most likely mistake behind ``got``, rank ``rank``'s wrong pieces."""
    k_old, want = case.k_old, expected_pieces(case, rank)
    lo, hi = rank * case.k_new, min((rank + 1) * case.k_new, case.numel)
    as_local = [(q, a - q * k_old, b - q * k_old) for q, a, b in got]
    if got and as_local == want:
        return ("start and stop are offsets into the flat vector; a piece wants offsets inside "
                "saved rank saved_rank's shard: subtract saved_rank * k_old.")
    empty = [p for p in got if p[1] >= p[2]]
    if empty:
        rest = "" if [p for p in got if p[1] < p[2]] != want else " (the other pieces are right)"
        return (f"piece {empty[0]} is empty (start >= stop): leave out a saved rank that holds "
                f"none of this rank's elements{rest}.")
    outside = [p for p in got if not (0 <= p[0] < case.saved_world_size and 0 <= p[1]
                                      and p[2] <= k_old)]
    if outside:
        return (f"piece {outside[0]} is not inside a saved shard: saved ranks are 0 to "
                f"{case.saved_world_size - 1}, each holding k_old = ceil(numel / "
                f"saved_world_size) = {k_old} elements, so 0 <= start < stop <= {k_old}.")
    elements = [q * k_old + i for q, a, b in got for i in range(a, b)]
    shard = (f"this rank's new shard holds flat elements [{lo}, {hi})" if lo < hi else
             f"this rank's new shard is padding only (rank * k_new = {lo} >= numel): return []")
    if elements == list(range(lo, hi)):
        return ("the pieces hold the right elements, but split differently: return one piece "
                "per saved rank that holds some of them, in order.")
    if elements and max(elements) >= case.numel:
        q = max(elements) // k_old
        return (f"the pieces reach flat element {max(elements)}, but the vector has {case.numel} "
                f"(elements {case.numel} and on are padding): saved rank {q}'s real elements "
                f"end at offset min(k_old, numel - {q} * k_old) = "
                f"{min(k_old, case.numel - q * k_old)}, and the new shard ends at min((rank + "
                f"1) * k_new, numel); {shard}.")
    return (f"the pieces cover flat elements {_ranges_text(elements)}; {shard} (k_new = "
            f"ceil(numel / world_size) = {case.k_new}).")


def _judge_pieces(plan: PiecesPlan, run: _PiecesRun, timeout: float, where: str) -> str:
    calls = _calls(plan)
    for (case, rank), got in zip(calls, run.returned, strict=False):
        at = f"{case.describe()}, rank {rank}"
        if isinstance(got, str):
            return f"{at}: {got}"
        want = expected_pieces(case, rank)
        if got != want:
            return f"{at}: returned {got}, expected {want}: {_pieces_hint(case, rank, got)}"
    if run.finished:
        return ""
    case, rank = calls[len(run.returned)]
    at = f"{case.describe()}, rank {rank}"
    if run.error_type:
        return (f"{at}: shard_pieces raised {run.error_type}.\n"
                f"{clean_traceback(run.error, __file__)}")
    return (f"{at}: shard_pieces did not return within {timeout:g} s, and was stopped"
            f"{' at ' + where if where else ''}. A loop that never ends? Each step must move "
            "its start on, to the end of the saved shard it is in or to the end of this rank's "
            "shard.")


# --- the check -------------------------------------------------------------------------------


def check_shard_pieces(
    shard_pieces: Callable[..., object],
    seed: int = 0,
    timeout: float = CHECK_TIMEOUT_S,
) -> CheckResult:
    """Exercise 7.2: ``shard_pieces(numel, saved_world_size, world_size, rank)`` must return
    the pieces ``(saved_rank, start, stop)``, ``start`` and ``stop`` offsets inside saved rank
    ``saved_rank``'s shard of ``k_old = ceil(numel / saved_world_size)`` elements, whose
    concatenation in order is exactly this rank's new shard's real elements: flat elements
    ``[rank*k_new, min((rank+1)*k_new, numel))``, ``k_new = ceil(numel / world_size)``. One
    piece per saved rank that holds some of them, no empty piece, ``[]`` for a shard of
    padding only. Called for every rank of every case, in one process started for it (the
    checking process never runs the learner's code); the calls get ``timeout`` seconds in
    all.

    A non-zero ``seed`` also runs two more cases (a numel up to 60, saved on and loaded on 1
    to 8 ranks), drawn from ``random.Random(seed)``; the verdict names them."""
    exercise = PracticeExercise.SHARD_PIECES
    # A pure function: no world sizes to pass, (1,) stands for "no ranks" in the validation.
    validate_check_call(shard_pieces, (1,), seed, timeout,
                        example="check_shard_pieces(shard_pieces)")
    plan = PiecesPlan.make(seed)

    def verdict(ok: bool, message: str) -> CheckResult:
        return report(CheckResult(exercise.title, ok, message + plan.note()))

    problem = signature_problem(exercise.function, exercise.parameters, shard_pieces)
    if problem:
        return verdict(False, problem)
    try:
        # One rank, not this process: the checking process never runs the learner's code.
        ((run, where, refused),) = launch(
            _pieces_rank, 1, args=(shard_pieces, dataclasses.replace(plan, seed=0), timeout,
                                   exercise.value),  # its cases; the seed stays here
            backend="gloo", timeout=timeout + _PIECES_SLACK_S, echo=False,
            failure_grace=CHECK_FAILURE_GRACE_S, result_types=result_types())
    except RankError as err:
        return verdict(False, answer_key_refusal(err) or raised(failing_rank(err)))
    except LaunchTimeout:
        return verdict(False, f"{exercise.function} did not return within {timeout:g} s, and "
                              "its process could not be stopped (a call blocked outside Python?)")
    if refused:
        return verdict(False, refused)
    wrong = _judge_pieces(plan, run, timeout, where)
    if wrong:
        return verdict(False, wrong)
    cases = "; ".join(case.draw_text() for case in plan.cases[:len(plan.cases) -
                                                               len(plan.drawn)])
    return verdict(True, (
        f"for {cases}, every rank's pieces (saved_rank, start, stop), offsets inside saved "
        "rank saved_rank's shard of k_old = ceil(numel / saved_world_size) elements, "
        "concatenate to exactly its new shard's real elements, flat [rank*k_new, "
        "min((rank+1)*k_new, numel)), one piece per saved rank, none empty, [] for a shard of "
        "padding only."))
