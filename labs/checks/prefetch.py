"""Exercise 7.3's check, ``check_units_to_prefetch(units_to_prefetch)``: FSDP's prefetch
decision, called on a table of cases, then plugged into a real FSDP on two ranks.

``units_to_prefetch(order, current, prefetch)`` returns the names of the ``prefetch`` units
that ``order`` (the pass's unit names in the order they ran last step, as recorded) runs right
after ``current``: fewer at the end of ``order``, none when ``prefetch`` is 0 or ``current`` is
not in ``order``. Two ranks call it for every case, in a thread stopped after ``timeout``
seconds, and the answers must equal :func:`labs.fsdp.units_to_prefetch`'s exactly (labs' own,
refused inside the check). Then each rank trains
:class:`~labs.checks.fsdp_practice_cases.ShuffledNet` with FSDP on labs' ring, prefetching one
unit, with the learner's function as ``prefetch_policy`` and with labs': the gathers,
prefetches, frees and reduce-scatters of every step, in order, and the parameters after the
last must be the same.

The cases are in :mod:`labs.checks.fsdp_practice_cases`, beside 7.1's and 7.2's. ``seed=0``
runs the documented cases; any other seed also draws three more calls from
``random.Random(seed)``, and the verdict names them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

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
    largest_difference,
    listed,
    raised,
    report,
    result_types,
    signature_problem,
    validate_check_call,
)
from labs.checks.fsdp_practice_cases import (
    PracticeExercise,
    PrefetchCase,
    PrefetchPlan,
    ShuffledNet,
)
from labs.collectives import Algorithm
from labs.fsdp import FSDP
from labs.launcher import LaunchTimeout, RankError, launch

# --- 7.3, inside each of its two ranks -------------------------------------------------------

#: The real run of 7.3: how many steps ShuffledNet trains (the first records the order, the
#: second and third prefetch from it), how many units ahead, and its learning rate.
PREFETCH_STEPS, PREFETCH_AHEAD, PREFETCH_LR = 3, 1, 0.1
#: What 7.3's two ranks get beyond the calls' own ``timeout``: their start, the real runs.
_PREFETCH_SLACK_S = 20.0


@dataclass
class _PrefetchRun(ThreadCalls):
    """What one rank of 7.3 saw: the table's answers (in the plan's order), how the calls
    ended, and the real runs (each step's observer events, then the full parameters)."""

    returned: list[object] = field(default_factory=list)
    where: str = ""  #: where a call that did not return was stopped
    refused: str = ""  #: the answer-key refusal ('' when no key was called)
    yours: list[list[tuple[str, str]]] = field(default_factory=list)
    labs: list[list[tuple[str, str]]] = field(default_factory=list)
    params: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)


def _calls_in_thread(fn: Callable[..., Any], calls: Sequence[tuple[Any, ...]],
                     timeout: float, run: _PrefetchRun) -> None:
    """Each call of ``fn`` in a thread of this rank, for at most ``timeout`` s in all; a copy
    of ``order`` each time, so that a call that changes it changes no other case."""

    def make_calls() -> None:
        for order, current, prefetch in calls:
            got = fn(list(order), current, prefetch)
            run.returned.append(list(got) if isinstance(got, (list, tuple)) else got)

    run.where = calls_in_thread(make_calls, run, "labs check 7.3", timeout)


def _train(rank: int, policy: Callable[..., Any] | None
           ) -> tuple[list[list[tuple[str, str]]], dict[str, torch.Tensor]]:
    """ShuffledNet under FSDP on labs' ring, prefetching with ``policy`` (None: labs'): every
    step's observer events, (event, unit) in order, and the full parameters at the end."""
    events: list[list[tuple[str, str]]] = []
    model = FSDP(ShuffledNet(), collectives=Algorithm.RING, prefetch=PREFETCH_AHEAD,
                 prefetch_policy=policy,
                 observer=lambda event, unit: events[-1].append((event.value, unit)))
    optimizer = torch.optim.SGD(model.parameters(), lr=PREFETCH_LR)
    for step in range(PREFETCH_STEPS):
        events.append([])
        x = torch.randn(4, 6, generator=torch.Generator().manual_seed(10 * step + rank))
        model(x).square().mean().backward()
        model.finish_gradient_synchronization()
        optimizer.step()
        optimizer.zero_grad()
    params = model.gather_full_params()
    model.remove_hooks()
    return events, params


def _prefetch_rank(rank: int, world_size: int, fn: Callable[..., Any],
                   calls: tuple[tuple[tuple[str, ...], str, int], ...], timeout: float,
                   exercise: str) -> _PrefetchRun:
    """One rank of a 7.3 check: labs' real run, then, with labs' units_to_prefetch refused,
    every call of the table and (when both ranks' calls all returned lists) the real run with
    the learner's function as FSDP's prefetch_policy."""
    run = _PrefetchRun()
    run.labs, theirs = _train(rank, None)
    try:
        with answer_keys_refused(exercise):
            _calls_in_thread(fn, calls, timeout, run)
            lists = all(isinstance(got, list) for got in run.returned)
            both = torch.tensor([int(run.finished and lists)])
            dist.all_reduce(both, op=dist.ReduceOp.MIN)  # train together, or neither
            if both.item():
                run.yours, mine = _train(rank, fn)
                run.params = {name: (mine[name], theirs[name]) for name in theirs}
    except AnswerKeyUsed as refused:
        run.refused = str(refused)
    return run


# --- 7.3, judging ----------------------------------------------------------------------------


def _prefetch_hint(case: PrefetchCase, got: list[Any]) -> str:
    """The most likely mistake behind ``got``, a list of names other than the answer."""
    order, k, want = list(case.order), case.prefetch, case.expected
    if case.current not in order:
        return (f"{case.current!r} is not in order (nothing recorded for it: the first step, or "
                "a unit that did not run): there is nothing to follow, return [].")
    if k == 0 and got:
        return "prefetch 0 means no prefetching at all: return []."
    at = order.index(case.current)
    if got == order[at:at + k] or (got and got[0] == case.current):
        return (f"the list holds {case.current!r} itself, which is computing already (its "
                "all-gather is done): start with the unit after it.")
    if any(name in order[:at] for name in got):
        return ("a unit that ran before current is in the list: the pass ends at the end of "
                "order, so near the end return fewer than prefetch (no wrapping around).")
    if got[:len(want)] == want and len(got) > len(want):
        return (f"{len(got)} unit(s), one too many: at most prefetch = {k}, the ones right "
                "after current.")
    by_name = sorted(order)
    if got == by_name[by_name.index(case.current) + 1:][:k]:
        return ("those follow current in registration (name) order; follow order, the order "
                "the units ran in last step, as recorded.")
    return f"return the (at most {k}) names that follow current in order, in order."


def _judge_table(plan: PrefetchPlan, runs: Sequence[_PrefetchRun], timeout: float) -> str:
    for rank, run in enumerate(runs):
        for case, got in zip(plan.cases, run.returned, strict=False):
            at = f"rank {rank}, {case.describe()}"
            if not isinstance(got, list) or not all(isinstance(n, str) for n in got):
                return (f"{at}: returned {got!r}; return a list of the units' names (str), "
                        "taken from order.")
            if got != case.expected:
                return (f"{at}: returned {got}, expected {case.expected}: "
                        f"{_prefetch_hint(case, got)}")
        if run.finished:
            continue
        at = f"rank {rank}, {plan.cases[len(run.returned)].describe()}"
        if run.error_type:
            return (f"{at}: units_to_prefetch raised {run.error_type}.\n"
                    f"{clean_traceback(run.error, __file__)}")
        return (f"{at}: units_to_prefetch did not return within {timeout:g} s, and was "
                f"stopped{' at ' + run.where if run.where else ''}. A loop that never ends? "
                "The answer is a slice of order.")
    return ""


_REAL_RUN = (f"in a real run (FSDP(ShuffledNet()) on 2 ranks, labs' ring, prefetch="
             f"{PREFETCH_AHEAD}: units registered a, b, c, run c, a, b)")


def _judge_real(runs: Sequence[_PrefetchRun]) -> str:
    for rank, run in enumerate(runs):
        for step, (yours, labs) in enumerate(zip(run.yours, run.labs, strict=True)):
            if yours != labs:
                i = next((i for i, (a, b) in enumerate(zip(yours, labs, strict=False))
                          if a != b), min(len(yours), len(labs)))
                said = [" ".join(e[0]) if e else "" for e in (yours[i:i + 1], labs[i:i + 1])]
                return (f"{_REAL_RUN}, rank {rank}, step {step + 1}, after "
                        f"{listed(' '.join(e) for e in labs[:i]) or 'nothing'}: with your "
                        f"policy FSDP did {said[0] or 'nothing more'}, with labs' "
                        f"{said[1] or 'nothing more'}.")
        for name, (mine, theirs) in run.params.items():
            if not torch.equal(mine, theirs):
                return (f"{_REAL_RUN}, rank {rank}: the prefetches were labs', but parameter "
                        f"{name} differs after {PREFETCH_STEPS} steps: " + largest_difference(
                            mine, theirs, "with labs' policy") + ".")
    return ""


# --- the check -------------------------------------------------------------------------------


def check_units_to_prefetch(
    units_to_prefetch: Callable[..., object],
    seed: int = 0,
    timeout: float = CHECK_TIMEOUT_S,
) -> CheckResult:
    """Exercise 7.3: ``units_to_prefetch(order, current, prefetch)`` must return the names of
    the ``prefetch`` units that ``order`` (a pass's unit names in the order they ran last step,
    as recorded) runs right after ``current``, in that order: fewer at the end of ``order``,
    ``[]`` when ``prefetch`` is 0 or ``current`` is not in ``order``; what
    :func:`labs.fsdp.units_to_prefetch` returns, exactly, on every case. Then, as FSDP's
    ``prefetch_policy`` in a real 2-rank training of ShuffledNet on labs' ring, FSDP must
    gather, prefetch, free and reduce-scatter as with labs' and end with the same parameters.

    A non-zero ``seed`` also runs three more calls (an order of 2 to 8 units, shuffled),
    drawn from ``random.Random(seed)``; the verdict names them."""
    exercise = PracticeExercise.PREFETCH
    validate_check_call(units_to_prefetch, (1,), seed, timeout,
                        example="check_units_to_prefetch(units_to_prefetch)")
    plan = PrefetchPlan.make(seed)

    def verdict(ok: bool, message: str) -> CheckResult:
        return report(CheckResult(exercise.title, ok, message + plan.note()))

    problem = signature_problem(exercise.function, exercise.parameters, units_to_prefetch)
    if problem:
        return verdict(False, problem)
    calls = tuple((case.order, case.current, case.prefetch) for case in plan.cases)
    try:
        runs = launch(_prefetch_rank, 2, args=(units_to_prefetch, calls, timeout,
                                                exercise.value),
                      backend="gloo", timeout=timeout + _PREFETCH_SLACK_S, echo=False,
                      failure_grace=CHECK_FAILURE_GRACE_S, result_types=result_types())
    except RankError as err:
        return verdict(False, answer_key_refusal(err)
                       or f"{_REAL_RUN}: {raised(failing_rank(err))}")
    except LaunchTimeout as err:
        return verdict(False, f"{_REAL_RUN}, rank(s) {listed(err.ranks)} hung: does "
                              f"{exercise.function} wait for something that never comes?")
    refused = next((run.refused for run in runs if run.refused), "")
    wrong = refused or _judge_table(plan, runs, timeout) or _judge_real(runs)
    if wrong:
        return verdict(False, wrong)
    return verdict(True, (
        f"on {len(plan.cases)} calls (the start, middle and end of an order, prefetch 0, "
        "nothing recorded yet, orders other than registration order, forward's and "
        "backward's), every answer was labs' units_to_prefetch's, exactly; plugged into "
        f"FSDP as prefetch_policy {_REAL_RUN}, FSDP gathered, prefetched, freed and "
        f"reduce-scattered as with labs' in each of {PREFETCH_STEPS} steps, and the "
        "parameters ended equal."))
