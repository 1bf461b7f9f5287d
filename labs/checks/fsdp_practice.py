"""Exercise checks for chapter 7: clipping a gradient held as FSDP's shards (7.1, on real
ranks) and finding where a new shard's elements lie in a checkpoint saved on another number
of ranks (7.2, a pure function, checked in the learner's process).

* 7.1 ``clip_shards_(grads, max_norm)``: ``grads`` is this rank's list of 1-D gradient shards,
  one per FSDP unit (rank r holds elements ``[r*k, (r+1)*k)`` of each unit's zero-padded flat
  gradient). It returns the L2 norm ``T`` of the FULL gradient and, when ``max_norm / (T +
  1e-6) < 1``, scales every shard by that factor in place: what
  ``torch.nn.utils.clip_grad_norm_`` does on one process. ``T = sqrt(sum_r s_r)``, ``s_r``
  being rank r's sum of squares: one all-reduce of one number, 2(N-1)/N·4 bytes per rank in
  fp32, where gathering the gradient would send (N-1)/N·S and hold all S bytes on every rank.
  The check compares the returned norm and every rank's shards with clip_grad_norm_ on the
  whole gradient (rtol = 1e-5, atol = 1e-6). Inside every rank each collective and send is
  counted at its ring cost (:func:`labs.checks.watch.counted_collectives`): a rank may make
  one all-reduce of at most :data:`MAX_REDUCED` numbers and send no more than that costs;
  all-gathers are refused.
* 7.2 ``shard_pieces(numel, saved_world_size, world_size, rank)``: the pieces ``(saved_rank,
  start, stop)``, offsets inside saved rank ``saved_rank``'s shard of ``k_old = ceil(numel /
  saved_world_size)`` elements, whose concatenation is this rank's new shard's real
  elements, flat ``[rank*k_new, min((rank+1)*k_new, numel))``, ``k_new = ceil(numel /
  world_size)``: one piece per saved rank that holds some, none empty, ``[]`` for a shard of
  padding only. Called for every rank of every case; a call that does not return within
  ``timeout`` is stopped.

The cases and references are in :mod:`labs.checks.fsdp_practice_cases`. ``seed=0`` runs the
documented cases; any other seed also draws hidden ones from ``random.Random(seed)`` (7.1:
one more world size, 5 or 6, and another gradient; 7.2: two more resharding cases), and the
verdict names them.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import math
import numbers
import operator
import re
import sys
import threading
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, NoReturn

import torch
from torch.distributed import distributed_c10d

from labs.checks.answer_keys import AnswerKeyUsed, answer_keys_refused
from labs.checks.collectives import CollectiveUsedError
from labs.checks.core import (
    CHECK_FAILURE_GRACE_S,
    CHECK_TIMEOUT_S,
    CheckResult,
    answer_key_refusal,
    case_noted,
    clean_traceback,
    failed_case,
    failing_rank,
    listed,
    raised,
    report,
    result_types,
    run_check,
    signature_problem,
    validate_check_call,
)
from labs.checks.fsdp_practice_cases import (
    ATOL,
    EPS,
    RTOL,
    ClipCase,
    ClipPlan,
    ClipReference,
    Piece,
    PiecesCase,
    PiecesPlan,
    PracticeExercise,
    clip_reference,
    expected_pieces,
    rank_shards,
)
from labs.checks.watch import GROUP_METHODS, Kind, counted_collectives, patched
from labs.checks.zero_cases import shard_of
from labs.launcher import LaunchTimeout, RankError, launch

#: The most numbers a rank of 7.1 may all-reduce: "one number" (the sum of squares), with
#: room for a learner who reduces a few (one per unit's, say) in the same call.
MAX_REDUCED = 4
_F64 = 8  #: bytes per element of the widest dtype 7.1 lets a rank all-reduce in


# --- 7.1, inside every rank ------------------------------------------------------------------


def _refuse_all_gather(*args: Any, **kwargs: Any) -> NoReturn:
    raise CollectiveUsedError(
        "Exercise 7.1: no all-gather: gathering the gradient puts every rank's shards on every "
        "rank, the N-fold memory that FSDP removes, and sends (N-1)/N·S bytes, when the norm "
        "needs one number from each rank: the sum of the squares of its shards. All-reduce "
        "that number (2(N-1)/N·4 bytes)")


def _refusals() -> dict[str, Callable[..., NoReturn]]:
    """Every all-gather method of ProcessGroup, replaced by a refusal."""
    return {name: _refuse_all_gather for name, kind in GROUP_METHODS.items()
            if kind is Kind.ALL_GATHER}


@contextlib.contextmanager
def _counted_all_reduces() -> Iterator[list[int]]:
    """Inside: each all-reduce method of ProcessGroup appends the numel it reduces to the list
    yielded, then runs (enter it inside :func:`counted_collectives`, which counts its bytes)."""
    group = distributed_c10d.ProcessGroup
    calls: list[int] = []

    def counting(original: Callable[..., Any]) -> Callable[..., Any]:
        def call(self: Any, tensors: Any, *args: Any, **kwargs: Any) -> Any:
            given = tensors if isinstance(tensors, (list, tuple)) else [tensors]
            calls.append(sum(t.numel() for t in given if isinstance(t, torch.Tensor)))
            return original(self, tensors, *args, **kwargs)

        return call

    with patched((group, name, counting(getattr(group, name)))
                 for name, kind in GROUP_METHODS.items()
                 if kind is Kind.ALL_REDUCE and hasattr(group, name)):
        yield calls


@dataclass(frozen=True)
class _ClipCall:
    """One call of 7.1's function on one rank."""

    returned: float | None  #: the norm it returned, as a float (None when not a number)
    returned_type: str
    shards: tuple[torch.Tensor, ...]  #: copies, after the call, of the shards it was given
    replaced: tuple[int, ...]  #: indices whose list entry now holds another tensor
    length: int  #: len(grads) after the call
    sent: float  #: bytes sent (ring costs, see labs.checks.watch)
    all_reduces: tuple[int, ...]  #: the numel of each all-reduce it made


def _number(value: object) -> float | None:
    """A norm returned as a one-element tensor or a real number, as a float; else None."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return float(value.detach().reshape(()))
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        return float(value)
    return None


def _clip_rank(rank: int, world_size: int, fn: Callable[..., Any],
               cases: tuple[ClipCase, ...], shards_given: list[list[torch.Tensor]]
               ) -> list[_ClipCall]:
    """Calls the learner's function once per case with this rank's shards (drawn by the
    parent: ``shards_given[index]``, the rank never gets the seed), collectives watched."""
    results = []
    with counted_collectives(_refusals()) as traffic, _counted_all_reduces() as reduces, \
            answer_keys_refused(PracticeExercise.CLIP_SHARDS.value):
        for index, case in enumerate(cases):
            shards = shards_given[index]  # 1-D, k each
            given = list(shards)
            traffic.sent = 0.0
            reduces.clear()
            with case_noted(index):
                returned = fn(given, case.max_norm)
            results.append(_ClipCall(
                _number(returned), type(returned).__name__,
                tuple(s.detach().clone() for s in shards),
                tuple(i for i, s in enumerate(shards) if i >= len(given) or given[i] is not s),
                len(given), traffic.sent, tuple(reduces)))
    return results


# --- 7.1, judging ----------------------------------------------------------------------------


def _isclose(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=RTOL, abs_tol=ATOL)


def _factor(got: torch.Tensor, orig: torch.Tensor) -> float | None:
    """The one factor that scales ``orig`` closest to ``got`` (least squares), None when
    ``orig`` is all zeros (a rank of padding only: any factor fits)."""
    norm2 = float(orig.double().pow(2).sum())
    return float((got.double() * orig.double()).sum()) / norm2 if norm2 else None


def _first_wrong(got: Sequence[torch.Tensor], want: Sequence[torch.Tensor]) -> str:
    """The first element of the first shard that is not close to its clipped value."""
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        far = ~torch.isclose(g, w, rtol=RTOL, atol=ATOL)
        if far.any():
            j = int(far.nonzero()[0, 0])
            return (f"grads[{i}][{j}] is {float(g[j]):g}, expected {float(w[j]):g} (clipped "
                    "like every other element).")
    return "every element is close to its clipped value, but not all by one factor."


def _rank_text(factors: Sequence[tuple[int, float]]) -> str:
    return ", ".join(f"rank {r} by {f:.4g}" for r, f in factors)


def _factor_problem(ref: ClipReference, case: ClipCase, factor: float,
                    n: int) -> str:
    """Why every rank scaling by ``factor`` is wrong (they agree, but not with the reference)."""
    total, want = ref.total, ref.factor
    if want < 1 and _isclose(factor, 1.0):
        return (f"the shards are unchanged, but the full gradient's norm {total:.6g} is above "
                f"max_norm {case.max_norm:g}: scale every shard in place by max_norm / (total + "
                f"1e-6) = {want:.4g} (g.mul_(factor)); g = g * factor makes a new tensor that "
                "the caller never sees.")
    if factor > 1 and not _isclose(factor, want):
        return (f"the ranks scaled the gradient UP, by {factor:.4g}: clip_grad_norm_ only "
                f"shrinks it, by min(1, max_norm / (total + 1e-6)) = {want:.4g} here (the norm "
                f"{total:.6g} is {'below' if want == 1 else 'above'} max_norm {case.max_norm:g}).")
    guesses = [(case.max_norm / (total * total + EPS),
                "you divided by the sum of squares: take its square root first")]
    if n > 1:  # on one rank the sum of the ranks' norms is the norm
        guesses.append((case.max_norm / (sum(ref.local_norms) + EPS),
                        "you divided by the sum of the ranks' norms: the norm of the full "
                        "gradient is the square root of the sum of every rank's squares"))
    hint = next((why for value, why in guesses if _isclose(factor, min(1.0, value))), "")
    return (f"every rank scaled its shards by {factor:.4g}, but clip_grad_norm_ scales by "
            f"min(1, max_norm / (total + 1e-6)) = {want:.4g}, total = {total:.6g} being the norm "
            f"of the full gradient{': ' + hint if hint else ''}.")


def _norm_problem(ref: ClipReference, r: int, got: float, n: int) -> str:
    """Why rank r's returned norm ``got`` is wrong ('' when right)."""
    total = ref.total
    if _isclose(got, total):
        return ""
    guesses = [(ref.local_norms[r], "the norm of this rank's own shards: every rank must "
                "return the norm of the FULL gradient, sqrt of the all-reduced sum of squares"),
               (total * total, "the sum of squares: return its square root"),
               (sum(ref.local_norms), "the sum of the ranks' norms: the norm of the full "
                "gradient is sqrt of the sum of every rank's squares"),
               (ref.factor, "the clipping factor: return the total norm, as clip_grad_norm_ "
                "does (before clipping)"),
               (total * ref.factor, "the norm after clipping: return the norm before it, as "
                "clip_grad_norm_ does")]
    hint = next((why for value, why in guesses if _isclose(got, value)
                 and (n > 1 or "own shards" not in why)), "")
    return (f"rank {r}: returned {got:.6g}, but the norm of the full gradient is {total:.6g}"
            f"{' (' + hint + ')' if hint else ''}.")


def _judge_clip_case(n: int, index: int, case: ClipCase, seed: int,
                     calls: Sequence[_ClipCall]) -> str:
    ref = clip_reference(seed, n, index, case)
    for r, call in enumerate(calls):
        if call.returned is None:
            return (f"rank {r}: returned {call.returned_type}; return the total norm of the "
                    "full gradient (a 0-d tensor or a float), as clip_grad_norm_ does.")
        if call.length != len(case.units):
            return (f"rank {r}: grads held {len(case.units)} shard(s) and now holds "
                    f"{call.length}: leave the list as it is, and scale its tensors in place.")
        if call.replaced:
            return (f"rank {r}: grads[{call.replaced[0]}] was replaced by another tensor: scale "
                    "the shard in place (g.mul_(factor)); the optimizer holds these tensors, "
                    "not the list.")
        for i, shard in enumerate(call.shards):
            k = ref.grads[i].numel() // n
            if shard.shape != (k,):
                return (f"rank {r}: grads[{i}] now has shape {tuple(shard.shape)}; it is a "
                        f"shard of k = {k} element(s): scale it in place, keep its shape.")
    factors: list[tuple[int, float]] = []
    for r, call in enumerate(calls):
        orig = torch.cat([shard_of(g, n, r) for g in ref.grads])  # this rank's, concatenated
        got = torch.cat(call.shards)
        factor = _factor(got, orig)
        scaled = orig if factor is None else orig * factor
        if not torch.allclose(got, scaled.to(got.dtype), rtol=RTOL, atol=ATOL):
            return f"rank {r}: its shards were not all scaled by one factor: " + _first_wrong(
                call.shards, [shard_of(g, n, r) for g in ref.clipped])
        if factor is not None:
            factors.append((r, factor))
    if factors and any(not _isclose(f, factors[0][1]) for _, f in factors):
        own = all(_isclose(f, min(1.0, case.max_norm / (ref.local_norms[r] + EPS)))
                  for r, f in factors)
        return (f"the ranks scaled their shards by different factors: {_rank_text(factors)}"
                f"{' (each by max_norm over the norm of its OWN shards)' if own else ''}. "
                "clip_grad_norm_ scales the whole gradient by one factor, min(1, max_norm / "
                f"(total + 1e-6)) = {ref.factor:.4g}, total = {ref.total:.6g} being the norm of "
                "the FULL gradient: all-reduce each rank's sum of squares, so that every rank "
                "gets the same total, and only then scale.")
    if factors and not _isclose(factors[0][1], ref.factor):
        return _factor_problem(ref, case, factors[0][1], n)
    for r, call in enumerate(calls):
        assert call.returned is not None
        problem = _norm_problem(ref, r, call.returned, n)
        if problem:
            return problem
    return _judge_traffic(n, calls)


def _judge_traffic(n: int, calls: Sequence[_ClipCall]) -> str:
    """One all-reduce of at most MAX_REDUCED numbers per rank, and no other bytes sent."""
    if n == 1:
        return ""
    bound = 2 * (n - 1) / n * MAX_REDUCED * _F64
    for r, call in enumerate(calls):
        if len(call.all_reduces) > 1:
            return (f"rank {r}: the values are right, but it made {len(call.all_reduces)} "
                    "all-reduces (of " + listed(call.all_reduces) + " element(s)): add up the "
                    "squares of all this rank's shards first and all-reduce that one number: "
                    "one collective, one latency.")
        if sum(call.all_reduces) > MAX_REDUCED:
            return (f"rank {r}: the values are right, but it all-reduced "
                    f"{sum(call.all_reduces)} elements: the norm needs one number from each "
                    "rank, the sum of the squares of its shards, not the gradient: 2(N-1)/N·4 "
                    "bytes instead of 2(N-1)/N·S.")
        if call.sent > bound:
            return (f"rank {r}: the values are right, but it sent {call.sent:g} bytes, more than "
                    f"one all-reduce of {MAX_REDUCED} numbers ({bound:g} bytes in float64): the "
                    "norm needs one number from each rank, the sum of the squares of its "
                    "shards; all-reduce that, and send nothing else.")
    return ""


def _judge_clip(plan: ClipPlan, n: int, results: Sequence[list[_ClipCall]]) -> str:
    """What is wrong in the first failing case, in the plan's order."""
    for index, case in enumerate(plan.cases):
        wrong = _judge_clip_case(n, index, case, plan.seed,
                                 [per_rank[index] for per_rank in results])
        if wrong:
            return f"with {n} rank(s), {case.describe()}: {wrong}"
    return ""


def _clip_error(plan: ClipPlan, n: int, err: RankError) -> str:
    named = failing_rank(err)
    if err.exc_type == "RankDied":
        return (f"with {n} rank(s), rank {named.rank} died. gloo ends a process when a message "
                "does not fit the buffer posted to receive it: every rank must all-reduce a "
                "tensor of the same size and dtype (one number).")
    case = failed_case(named.traceback, plan.cases)
    where = f"with {n} rank(s), {case.describe()}" if case else f"with {n} rank(s)"
    if err.exc_type == CollectiveUsedError.__name__:
        refused = re.search(r"Exercise 7\.1: no all-gather.*", named.traceback)
        return f"{where}: {refused.group(0) if refused else str(err).splitlines()[0]}."
    return f"{where}: {raised(named)}"


def _clip_timeout(n: int, err: LaunchTimeout, timeout: float, where: str) -> str:
    return (f"with {n} rank(s), rank(s) {listed(err.ranks)} hung for {timeout:g} s.{where} A "
            "rank waits forever in a collective that a peer never makes: every rank must make "
            "the same one all-reduce in every call, even a rank whose shards are only padding "
            "(its sum of squares is 0) and even when the norm is below max_norm.")


# --- 7.2, calling the learner's function (in the check's one rank) ----------------------------


class _Stopped(BaseException):
    """Raised inside the thread running the learner's calls when their time is up (a
    BaseException, so that the learner's ``except Exception`` does not swallow it)."""


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
class _PiecesRun:
    """What the learner's calls of 7.2 gave, filled in by the thread that makes them, in the
    order of :func:`_calls`."""

    returned: list[list[Piece] | str] = field(default_factory=list)
    error_type: str = ""  #: the exception of the call that raised ('' when none did)
    error: str = ""  #: its traceback
    finished: bool = False


def _calls(plan: PiecesPlan) -> list[tuple[PiecesCase, int]]:
    """Every call a check of 7.2 makes: each rank of the new world size of each case."""
    return [(case, rank) for case in plan.cases for rank in range(case.world_size)]


def _stop(thread: threading.Thread) -> str:
    """Where ``thread`` is, in the learner's code (a ``File ..., line ...`` line, or ''), then
    stop it: raise :class:`_Stopped` in it at its next bytecode (a call blocked inside C code
    is not stopped; the thread is a daemon and ends with the process)."""
    frame = sys._current_frames().get(thread.ident or -1)
    frames = [f for f in traceback.extract_stack(frame) if __file__ != f.filename] if frame else []
    where = (clean_traceback(f'  File "{frames[-1].filename}", line {frames[-1].lineno}, in '
                             f"{frames[-1].name}", __file__).strip() if frames else "")
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread.ident or 0),
                                               ctypes.py_object(_Stopped))
    return where


def _run_pieces(fn: Callable[..., Any], plan: PiecesPlan, timeout: float) -> tuple[_PiecesRun,
                                                                                   str]:
    """Makes every call of the plan in a thread of this process, for at most ``timeout``
    seconds in all; returns what they gave and, when they did not finish, where the learner's
    code was when it was stopped."""
    run = _PiecesRun()

    def make_calls() -> None:
        try:
            for case, rank in _calls(plan):
                run.returned.append(_as_pieces(
                    fn(case.numel, case.saved_world_size, case.world_size, rank)))
            run.finished = True
        except _Stopped:
            pass
        except BaseException as exc:  # the learner's error, whatever it is, is the verdict
            run.error_type = type(exc).__name__
            run.error = "".join(traceback.format_exception(exc))

    thread = threading.Thread(target=make_calls, name="labs check 7.2", daemon=True)
    thread.start()
    thread.join(timeout)
    where = ""
    if thread.is_alive():
        where = _stop(thread)
        thread.join(1.0)
    return run, where


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


# --- the checks ------------------------------------------------------------------------------


def check_clip_shards_(
    clip_shards_: Callable[..., object],
    world_sizes: Sequence[int] = (1, 2, 3, 4),
    seed: int = 0,
    timeout: float = CHECK_TIMEOUT_S,
) -> CheckResult:
    """Exercise 7.1: ``clip_shards_(grads, max_norm)``, with ``grads`` this rank's list of 1-D
    gradient shards (one per FSDP unit, elements ``[r*k, (r+1)*k)`` of its zero-padded flat
    gradient), must return the L2 norm ``T`` of the full gradient and scale every shard in
    place by ``max_norm / (T + 1e-6)`` when that is below 1: on every rank, what
    ``torch.nn.utils.clip_grad_norm_`` returns and does on the whole gradient in one process
    (rtol = 1e-5, atol = 1e-6). Each rank may make one all-reduce of at most 4 numbers and
    send nothing else; all-gathers are refused inside the check.

    A non-zero ``seed`` also runs one more world size (5 or 6) and another gradient, drawn
    from ``random.Random(seed)``; the verdict names them."""
    exercise = PracticeExercise.CLIP_SHARDS
    validate_check_call(clip_shards_, world_sizes, seed, timeout,
                        example="check_clip_shards_(clip_shards_)")
    plan = ClipPlan.make(world_sizes, seed)
    cases = "; ".join(case.describe() for case in plan.cases[:len(plan.cases) - len(plan.drawn)])
    return run_check(
        exercise.title, plan, timeout,
        worker=_clip_rank,
        args=lambda n: (clip_shards_, plan.cases),
        rank_args=lambda n: [([rank_shards(seed, n, index, case, r)
                               for index, case in enumerate(plan.cases)],) for r in range(n)],
        judge=lambda n, results: _judge_clip(plan, n, results),
        explain_error=lambda n, err: _clip_error(plan, n, err),
        explain_timeout=lambda n, err, where: _clip_timeout(n, err, timeout, where),
        passed=(f"on {listed(plan.world_sizes)} rank(s), for {cases}, every rank returned the "
                "norm of the full gradient and scaled its shards by min(1, max_norm / (norm + "
                "1e-6)), as torch.nn.utils.clip_grad_norm_ does on the whole gradient in one "
                "process (rtol = 1e-5, atol = 1e-6); no rank made more than one all-reduce of "
                "a few numbers, or sent anything else."),
        problem=signature_problem(exercise.function, exercise.parameters, clip_shards_),
    )


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
