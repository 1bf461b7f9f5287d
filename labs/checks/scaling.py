"""Exercise 5.3's check, ``check_crossover_batch(crossover_batch)``: the per-rank batch above
which N ranks of data parallelism train more samples per second than one rank, a pure function,
checked in one process started for it (the checking process never runs the learner's code).

``crossover_batch(alpha, bandwidth, model_bytes, world_size, per_sample_s, fixed_s)`` returns
b*: one rank's step computes for ``T1(b) = c b + f``, N ranks add the ring all-reduce of the
gradients after backward, ``R = 2(N-1)(alpha + S/(N bw))``, and N ranks are faster for every
``b > b*`` (``b* = 0`` when they are faster at any batch). Called once per case; the calls get
``timeout`` seconds in all. :func:`labs.cost_model.crossover_batch` is the library's answer
(refused inside the check).

An answer is a number: an int or a float, or anything ``float()`` turns into one (a NumPy
scalar, a one-element tensor), but not a bool or a string; it must be finite and within
``rtol = 1e-6`` of the reference (``atol = 1e-9`` near 0). The cases, the reference and the
usual wrong formulas are in :mod:`labs.checks.scaling_cases`. ``seed=0`` runs the documented
cases; any other seed also draws three more from ``random.Random(seed)``, and the verdict
names them.
"""

from __future__ import annotations

import dataclasses
import math
import reprlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

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
    raised,
    report,
    result_types,
    signature_problem,
    validate_check_call,
)
from labs.checks.scaling_cases import (
    ATOL,
    CROSSOVER_CASES,
    MISTAKES,
    RTOL,
    CrossoverCase,
    CrossoverPlan,
    Formula,
    ScalingExercise,
    expected_crossover,
)
from labs.launcher import LaunchTimeout, RankError, launch

# --- calling the learner's function (in the check's one rank) ----------------------------------


def _as_number(value: object) -> float | str:
    """What a call returned, as a float, or why it is not a finite number."""
    what = "None" if value is None else f"{reprlib.repr(value)} ({type(value).__name__})"
    if value is None or isinstance(value, (bool, str, bytes)):
        return (f"returned {what}; return b* as a number, a float (0.0 when N ranks are "
                "faster at every batch).")
    try:
        number = float(value)  # type: ignore[arg-type]
    # RuntimeError: a tensor of many elements; OverflowError: an int beyond a float's range.
    except (TypeError, ValueError, RuntimeError, OverflowError):
        return f"returned {what}, which float() cannot make one number of; return b* as a float."
    if not math.isfinite(number):
        return (f"returned {number}, not a finite number: b* is a batch, 0 or more, finite for "
                "every case (c > 0).")
    return number


@dataclass
class _CrossoverRun(ThreadCalls):
    """What the learner's calls of 5.3 gave, filled in by the thread that makes them, in the
    order of the plan's cases."""

    returned: list[float | str] = field(default_factory=list)


def _run_calls(fn: Callable[..., Any], plan: CrossoverPlan, timeout: float
               ) -> tuple[_CrossoverRun, str]:
    """Makes every call of the plan in a thread of this process, for at most ``timeout``
    seconds in all; returns what they gave and, when they did not finish, where the learner's
    code was when it was stopped."""
    run = _CrossoverRun()

    def make_calls() -> None:
        for case in plan.cases:
            run.returned.append(_as_number(fn(*case.arguments)))

    return run, calls_in_thread(make_calls, run, "labs check 5.3", timeout)


#: What the one rank of 5.3 gets beyond the calls' own ``timeout``: its start, and stopping a
#: call that never returns.
_CROSSOVER_SLACK_S = 10.0


def _crossover_rank(rank: int, world_size: int, fn: Callable[..., Any], plan: CrossoverPlan,
                    timeout: float, exercise: str) -> tuple[_CrossoverRun, str, str]:
    """The one rank of a 5.3 check: every call of the plan (:func:`_run_calls`) with labs' own
    crossover_batch refused. Returns what the calls gave, where a call was stopped ('' when
    none was), and the refusal's message ('' when no answer key was called)."""
    try:
        with answer_keys_refused(exercise):
            run, where = _run_calls(fn, plan, timeout)
    except AnswerKeyUsed as refused:
        return _CrossoverRun(), "", str(refused)
    return run, where, ""


# --- judging -----------------------------------------------------------------------------------


def _close(got: float, want: float) -> bool:
    return math.isclose(got, want, rel_tol=RTOL, abs_tol=ATOL)


def _number(x: float) -> str:
    """A value of a verdict: enough digits to show a difference of ``RTOL``."""
    return f"{x:.10g}"


def _crossover_hint(case: CrossoverCase, got: float, want: float) -> str:
    """The most likely mistake behind ``got``, a wrong answer for ``case``."""
    if got < 0:
        unclamped = Formula.NO_CLAMP.value(case)
        rest = "" if _close(got, unclamped) else (
            f" (and even before the clamp, this case's value is {_number(unclamped)})")
        return Formula.NO_CLAMP.hint(case) + rest
    for mistake in MISTAKES:
        value = mistake.value(case)
        if not _close(value, want) and _close(got, value):
            return mistake.hint(case)
    if want > 0 and got == int(got) and int(got) in (math.floor(want), math.ceil(want)):
        return ("b* is where the two throughputs meet, a real number: return it as it is, not "
                "rounded to a whole batch.")
    return (f"one rank's step takes T1 = c b + f; N ranks of b samples each take T1 + R, R = "
            f"2(N-1)(alpha + S/(N bw)) = {case.allreduce_s:g} s here. At b*, N ranks' N b / "
            "(T1 + R) samples per second equal one rank's b / T1: solve that for b (0 when N "
            "ranks are faster at every batch).")


def _judge(plan: CrossoverPlan, run: _CrossoverRun, timeout: float, where: str) -> str:
    for case, got in zip(plan.cases, run.returned, strict=False):
        if isinstance(got, str):
            return f"{case.describe()}: {got}"
        want = expected_crossover(case)
        if not _close(got, want):
            return (f"{case.describe()}: returned {_number(got)}, expected {_number(want)}: "
                    f"{_crossover_hint(case, got, want)}")
    if run.finished:
        return ""
    case = plan.cases[len(run.returned)]
    function = ScalingExercise.CROSSOVER_BATCH.function
    if run.error_type:
        return (f"{case.describe()}: {function} raised {run.error_type}.\n"
                f"{clean_traceback(run.error, __file__)}")
    return (f"{case.describe()}: {function} did not return within {timeout:g} s, and was "
            f"stopped{' at ' + where if where else ''}. A loop that never ends? b* solves an "
            "equation linear in b: it needs no search.")


# --- the check ---------------------------------------------------------------------------------


def check_crossover_batch(
    crossover_batch: Callable[..., object],
    seed: int = 0,
    timeout: float = CHECK_TIMEOUT_S,
) -> CheckResult:
    """Exercise 5.3: ``crossover_batch(alpha, bandwidth, model_bytes, world_size, per_sample_s,
    fixed_s)`` must return b*, the per-rank batch above which N = ``world_size`` ranks train
    more samples per second than one rank, when the ring all-reduce of the ``model_bytes`` of
    gradients starts after backward: one rank's step takes ``T1(b) = c b + f`` (``c`` =
    ``per_sample_s``, ``f`` = ``fixed_s``), N ranks' ``T1(b) + R``, ``R = 2(N-1)(alpha +
    S/(N bw))``, and b* is 0 when N ranks are faster at every batch. Each answer must be a
    finite number (an int, a float, or what ``float()`` makes one of, not a bool or a
    string) within ``rtol = 1e-6`` of the reference (``atol = 1e-9`` near 0). Called once per
    case, in one process started for it (the checking process never runs the learner's
    code); the calls get ``timeout`` seconds in all.

    A non-zero ``seed`` also runs three more cases (links of 1 us to 5 ms and 1 to 400 GB/s,
    models of 1 MB to 10 GB, 2 to 1024 ranks, b* from 0 to 1e6), drawn from
    ``random.Random(seed)``; the verdict names them."""
    exercise = ScalingExercise.CROSSOVER_BATCH
    # A pure function: no world sizes to pass, (1,) stands for "no ranks" in the validation.
    validate_check_call(crossover_batch, (1,), seed, timeout,
                        example="check_crossover_batch(crossover_batch)")
    plan = CrossoverPlan.make(seed)

    def verdict(ok: bool, message: str) -> CheckResult:
        return report(CheckResult(exercise.title, ok, message + plan.note()))

    problem = signature_problem(exercise.function, exercise.parameters, crossover_batch)
    if problem:
        return verdict(False, problem)
    try:
        # One rank, not this process: the checking process never runs the learner's code.
        ((run, where, refused),) = launch(
            _crossover_rank, 1, args=(crossover_batch, dataclasses.replace(plan, seed=0),
                                      timeout, exercise.value),  # its cases; the seed stays here
            backend="gloo", timeout=timeout + _CROSSOVER_SLACK_S, echo=False,
            failure_grace=CHECK_FAILURE_GRACE_S, result_types=result_types())
    except RankError as err:
        return verdict(False, answer_key_refusal(err) or raised(failing_rank(err)))
    except LaunchTimeout:
        return verdict(False, f"{exercise.function} did not return within {timeout:g} s, and "
                              "its process could not be stopped (a call blocked outside Python?)")
    if refused:
        return verdict(False, refused)
    wrong = _judge(plan, run, timeout, where)
    if wrong:
        return verdict(False, wrong)
    sizes = and_listed([str(n) for n in sorted({case.world_size for case in CROSSOVER_CASES})])
    return verdict(True, (
        f"on N = {sizes} ranks, where S/bw dominates and where alpha does, with alpha = 0, "
        "and with a fixed cost that outlasts the all-reduce (b* = 0), every answer is the "
        "per-rank batch b* above which N ranks' N b / (T1 + R) samples per second beat one "
        "rank's b / T1 (T1 = c b + f, R = 2(N-1)(alpha + S/(N bw)), the ring all-reduce after "
        f"backward), within rtol = {RTOL:g} (atol = {ATOL:g})."))
