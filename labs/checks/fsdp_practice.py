"""Exercise 7.1's check, ``check_clip_shards_(clip_shards_)``: clipping a gradient held as
FSDP's shards, on real ranks. (Chapter 7's other exercises: 7.2 is checked in
:mod:`labs.checks.checkpoint`, 7.3 in :mod:`labs.checks.prefetch`.)

``clip_shards_(grads, max_norm)``: ``grads`` is this rank's list of 1-D gradient shards, one
per FSDP unit (rank r holds elements ``[r*k, (r+1)*k)`` of each unit's zero-padded flat
gradient). It returns the L2 norm ``T`` of the FULL gradient and, when ``max_norm / (T +
1e-6) < 1``, scales every shard by that factor in place: what
``torch.nn.utils.clip_grad_norm_`` does on one process. ``T = sqrt(sum_r s_r)``, ``s_r`` being
rank r's sum of squares: one all-reduce of one number, 2(N-1)/N·4 bytes per rank in fp32,
where gathering the gradient would send (N-1)/N·S and hold all S bytes on every rank. The
check compares the returned norm and every rank's shards with clip_grad_norm_ on the whole
gradient (rtol = 1e-5, atol = 1e-6). Inside every rank each collective and send is counted at
its ring cost (:func:`labs.checks.watch.counted_collectives`): a rank may make one all-reduce
of at most :data:`MAX_REDUCED` numbers and send no more than that costs; all-gathers are
refused.

The cases and references are in :mod:`labs.checks.fsdp_practice_cases`. ``seed=0`` runs the
documented cases; any other seed also draws one more world size (5 or 6) and another gradient
from ``random.Random(seed)``, and the verdict names them.
"""

from __future__ import annotations

import contextlib
import math
import numbers
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

import torch
from torch.distributed import distributed_c10d

from labs.checks.answer_keys import answer_keys_refused
from labs.checks.collectives import CollectiveUsedError
from labs.checks.core import (
    CHECK_TIMEOUT_S,
    CheckResult,
    case_noted,
    failed_case,
    failing_rank,
    listed,
    raised,
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
    PracticeExercise,
    clip_reference,
    rank_shards,
)
from labs.checks.watch import GROUP_METHODS, Kind, counted_collectives, patched
from labs.checks.zero_cases import shard_of
from labs.launcher import LaunchTimeout, RankError

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


# --- the check -------------------------------------------------------------------------------


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

