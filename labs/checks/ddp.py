"""Exercise checks for chapter 5: the learner's data-parallel wrappers, trained on real ranks.

Exercise 5.1 is ``SimpleDDP(module)`` (broadcast at construction, average every gradient in
``finish_gradient_synchronization``), exercise 5.2 is ``BucketedDDP(module, bucket_cap_mb)``
(the same, with gradients packed into buckets whose all-reduces are launched asynchronously
from gradient hooks while backward still runs). Both checks use the same check model, built
with a different initialisation on every rank, so a missing broadcast shows:

* ``gain`` (O,): a trainable parameter registered first but used last (its gradient is ready
  first in backward, although it sits in the last bucket);
* ``frozen`` (H,): ``requires_grad=False``, so its ``.grad`` must stay ``None``;
* ``first = Linear(I, H)``, ``middle = Linear(H, H)``, ``tied = Linear(H, H)`` whose weight
  *is* ``middle.weight`` (one parameter used twice), ``head = Linear(H, O)``;
* a buffer ``scale`` (H,) used in forward.

Each rank gets an equal shard of a fixed batch of 840 samples (840 = lcm(1..8), so any world
size up to 8 divides it) and runs 3 SGD steps (momentum 0.9) through the learner's wrapper:
forward, ``loss.backward()``, ``finish_gradient_synchronization()``, ``optimizer.step()``.
After every step every rank's gradients and parameters must match one process trained on the
full batch (``torch.allclose`` with rtol=1e-4, atol=1e-6), the oracle of the whole chapter.

For 5.2 every ``ProcessGroup.allreduce`` call inside the ranks is also recorded (at the
ProcessGroup level, so ``from torch.distributed import all_reduce`` is seen too) with the
``async_op`` it was made with and the phase of the step it was made in, and ``Work.wait`` is
watched, so the check can hold the answer to the bucket rule, the order of the launches, and
the overlap with backward. Everything patched is restored on exit.

``seed=0`` runs the documented cases; any other seed also draws, from ``random.Random(seed)``,
one more world size, other layer widths and (for 5.2) another bucket cap; the verdict names
them. The check model, the cases and the reference are in :mod:`labs.checks.ddp_cases`; the
watch on the all-reduces in :mod:`labs.checks.watch`.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from labs.checks.answer_keys import answer_keys_refused
from labs.checks.core import (
    CHECK_TIMEOUT_S,
    CheckResult,
    and_listed,
    case_noted,
    failed_case,
    failing_rank,
    is_class,
    largest_difference,
    listed,
    raised,
    run_check,
    validate_run_arguments,
)
from labs.checks.ddp_cases import (
    BATCH,
    MAX_CHECK_WORLD_SIZE,
    SGD,
    STEPS,
    Case,
    DDPExercise,
    Plan,
    Reference,
    Rule,
    Widths,
    batch_shard,
    bucket_numels,
    build_net,
    check_loss,
    describe_cap,
    full_batch,
    init_seed,
    local_grads,
    parameter_sizes,
    snapshot,
)
from labs.checks.watch import AllReduce, AllReduceLog, Phase, watched_all_reduces
from labs.launcher import LaunchTimeout, RankError

#: Tolerances of every comparison with the single-process reference (fp32 sums in another
#: order differ in the last bits; a sum instead of a mean differs by a factor N).
RTOL, ATOL = 1e-4, 1e-6


# --- inside every rank ---------------------------------------------------------------------------


@dataclass(frozen=True)
class _StepRecord:
    """What a rank saw in one step: gradients after synchronising (None where ``.grad`` was
    None), every parameter and buffer after the optimizer step, the all-reduces made."""

    grads: dict[str, torch.Tensor | None]
    state: dict[str, torch.Tensor]
    all_reduces: tuple[AllReduce, ...]


@dataclass(frozen=True)
class _CaseRecord:
    """One case on one rank: the state right after the wrapper was built, then each step."""

    problem: str
    initial: dict[str, torch.Tensor]
    steps: tuple[_StepRecord, ...]


def _rank_inputs(widths: Widths, seed: int, rank: int, world_size: int
                 ) -> tuple[int, torch.Tensor, torch.Tensor]:
    """What rank ``rank`` is given, drawn here in the parent: the seed of its own initial
    model (one-way: no other rank's, nor the check's seed, follows from it) and its own rows
    of the batch. Rank 0's model reaches the others only by the learner's broadcast, and the
    other rows only by the learner's all-reduce."""
    # Copies: a view would carry its whole storage, the other ranks' rows too, to the rank.
    x, y = (batch_shard(t, rank, world_size).clone() for t in full_batch(seed, widths))
    return init_seed(seed, rank), x, y


def _train(rank: int, world_size: int, wrapper_class: type, exercise: DDPExercise,
           case: Case, widths: Widths, given: tuple[int, torch.Tensor, torch.Tensor],
           log: AllReduceLog) -> _CaseRecord:
    own_seed, x, y = given
    net = build_net(widths, own_seed)
    log.phase, log.calls = Phase.SETUP, []
    wrapper = (wrapper_class(net) if case.cap_bytes is None
               else wrapper_class(net, case.bucket_cap_mb))
    module = getattr(wrapper, "module", None)
    if not isinstance(module, nn.Module):
        return _CaseRecord(
            f"{exercise.class_name}(module) must keep the model it wraps as self.module "
            f"(got {type(module).__name__}).", {}, ())
    initial = snapshot(module)
    optimizer = SGD(module)
    steps = []
    for _ in range(STEPS):
        optimizer.zero_grad()
        log.calls = []
        log.phase = Phase.FORWARD
        loss = check_loss(wrapper(x), y)
        log.phase = Phase.BACKWARD
        loss.backward()
        log.phase = Phase.FINISH
        wrapper.finish_gradient_synchronization()
        log.phase = Phase.SETUP
        grads = {name: None if p.grad is None else p.grad.detach().clone()
                 for name, p in module.named_parameters()}
        optimizer.step()
        steps.append(_StepRecord(grads, snapshot(module), log.frozen()))
    return _CaseRecord("", initial, tuple(steps))


def _rank_run(rank: int, world_size: int, wrapper_class: type, exercise: DDPExercise,
              cases: tuple[Case, ...], widths: Widths,
              given: tuple[int, torch.Tensor, torch.Tensor]) -> list[_CaseRecord]:
    """Runs every case on this rank with the all-reduces watched and labs' own wrappers
    refused; ``given`` is this rank's own (:func:`_rank_inputs`)."""
    records = []
    with watched_all_reduces() as log, answer_keys_refused(exercise.value):
        for index, case in enumerate(cases):
            with case_noted(index):
                records.append(_train(rank, world_size, wrapper_class, exercise, case, widths,
                                      given, log))
    return records


# --- judging values ------------------------------------------------------------------------------


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.allclose(a, b, rtol=RTOL, atol=ATOL)


def _what(name: str) -> str:
    if name == "frozen":
        return "the frozen parameter 'frozen'"
    if name == "scale":
        return "the buffer 'scale'"
    return f"'{name}'"


def _judge_initial(plan: Plan, reference: Reference, records: Sequence[_CaseRecord]) -> str:
    """After construction every rank must hold rank 0's initial parameters and buffers."""
    n = len(records)
    owns = {0: reference.initial}
    for name, want in reference.initial.items():
        for r, record in enumerate(records):
            got = record.initial[name]
            if _close(got, want):
                continue
            if r not in owns:
                owns[r] = snapshot(build_net(plan.widths, init_seed(plan.seed, r)))
            if r > 0 and _close(got, owns[r][name]):
                also = {"frozen": " (frozen parameters too: every rank must start from the "
                                  "same model)",
                        "scale": " (buffers too: module.buffers(), used in forward)"}
                return (f"rank {r} still has its own initial values of {_what(name)}: "
                        "broadcast every parameter and buffer from rank 0 in __init__"
                        f"{also.get(name, '')}, e.g. dist.broadcast(t, src=0).")
            if r == 0 and n > 1:
                return (f"rank 0's {_what(name)} changed in __init__: " + largest_difference(
                    got, want, "its value before __init__") + ". Rank 0 is the source of the "
                    "broadcast (src=0), its values must stay as they are.")
            return (f"rank {r}'s {_what(name)} after __init__ is neither rank 0's nor its own: "
                    + largest_difference(got, want, "rank 0's") + ". Broadcast every parameter "
                    "and buffer from rank 0 (src=0), in place.")
    return ""


def _judge_grad(n: int, r: int, name: str, got: torch.Tensor | None, mean: torch.Tensor,
                own: Callable[[], torch.Tensor], others: Sequence[torch.Tensor | None]) -> str:
    """Why rank r's ``name.grad`` is not the mean over ranks, or ''."""
    if got is None:
        return (f"rank {r}: {name}.grad is None after finish_gradient_synchronization(); "
                "write the mean into p.grad, do not drop it.")
    if _close(got, mean):
        return ""
    if n > 1 and _close(got, mean * n):
        return (f"rank {r}: {name}.grad holds the SUM over ranks ({n} x the mean): all_reduce "
                "sums; divide by the world size.")
    if n > 1 and _close(got, own()):
        return (f"rank {r}: {name}.grad is unchanged, still this rank's own gradient: "
                "all-reduce it (every rank, every trainable parameter) and divide by the world "
                "size.")
    if n > 1 and _close(got, mean / n):
        return (f"rank {r}: {name}.grad holds the mean divided by {n} again: divide the sum by "
                "the world size once.")
    divisor = next((k for k in range(2, 2 * n + 1) if k != n and _close(got, mean * n / k)), 0)
    if n > 1 and divisor:
        return (f"rank {r}: {name}.grad holds the sum over ranks divided by {divisor}, not by "
                f"the world size {n}: divide by dist.get_world_size().")
    values = largest_difference(got, mean, "the mean over ranks")
    disagree = [q for q, other in enumerate(others) if other is not None
                and not _close(got, other)]
    if disagree:
        return (f"ranks disagree: rank {r} and rank {disagree[0]} hold different {name}.grad "
                f"(rank {r}'s {values}); every rank must end with the same mean.")
    return f"rank {r}: {name}.grad is not the mean over ranks of the ranks' gradients: {values}."


def _judge_step(plan: Plan, reference: Reference, records: Sequence[_CaseRecord],
                step: int) -> str:
    """Gradients after synchronising, then parameters after the optimizer step."""
    n = len(records)
    names = list(records[0].steps[step].grads)
    for name in names:
        grads = [record.steps[step].grads.get(name) for record in records]
        for r, got in enumerate(grads):
            if name not in reference.grads[step]:
                if got is not None:
                    return (f"rank {r}: the frozen parameter '{name}' got a .grad (frozen "
                            "parameter touched): parameters with requires_grad=False have "
                            ".grad None; skip them.")
                continue

            def own(r: int = r, name: str = name) -> torch.Tensor:
                state = reference.before(step)
                return local_grads(plan.widths, plan.seed, state, r, n)[name]

            wrong = _judge_grad(n, r, name, got, reference.grads[step][name], own, grads)
            if wrong:
                return wrong
    for name, want in reference.states[step].items():
        for r, record in enumerate(records):
            got = record.steps[step].state[name]
            if _close(got, want):
                continue
            if name == "frozen":
                return (f"rank {r}: the frozen parameter 'frozen' changed (frozen parameter "
                        "touched): " + largest_difference(
                            got, want, "its value before the step") + ". Leave parameters with "
                        "requires_grad=False alone.")
            values = largest_difference(got, want, "one process's")
            disagree = [q for q, other in enumerate(records)
                        if not _close(got, other.steps[step].state[name])]
            if disagree:
                return (f"ranks disagree: rank {r} and rank {disagree[0]} hold different "
                        f"{_what(name)} after the optimizer step, though the gradients were "
                        f"right (rank {r}'s {values}).")
            return (f"rank {r}: {_what(name)} differs from one process after the optimizer "
                    f"step, though the gradients were right: {values}. Change only p.grad, "
                    "and leave the update to the optimizer.")
    return ""


# --- judging the all-reduces of 5.2 --------------------------------------------------------------


def _judge_overlap(calls: Sequence[AllReduce]) -> str:
    """Every all-reduce must be launched asynchronously from a hook, and none waited for while
    backward still runs."""
    if not calls:
        return ""
    late = [c for c in calls if c.phase is not Phase.BACKWARD]
    if late:
        where = ("in finish_gradient_synchronization(), after loss.backward() returned"
                 if all(c.phase is Phase.FINISH for c in late) else
                 "outside loss.backward()")
        late_numels = listed([c.numel for c in late])
        count = (f"all {len(calls)} all-reduces" if len(late) == len(calls)
                 else f"{len(late)} of the {len(calls)} all-reduces ({late_numels} elements)")
        return (f"{count} were made {where}: no overlap, the communication waits for the "
                "whole backward pass. Launch each bucket's all-reduce from the hook of "
                "p.register_post_accumulate_grad_hook, as soon as the bucket is full.")
    blocking = [c for c in calls if c.async_op is False]
    if blocking:
        return (f"the all-reduce of {blocking[0].numel} elements was blocking "
                "(async_op=False), made inside the gradient hook: backward stops until it is "
                "done, so nothing overlaps (no overlap). Call dist.all_reduce(buffer, "
                "async_op=True), keep the work, and wait for it in "
                "finish_gradient_synchronization().")
    waited = [c for c in calls if c.waited_in_backward]
    if waited:
        return (f"the all-reduce of {waited[0].numel} elements was waited for (work.wait()) "
                "while backward was still running: backward stops until it is done, so "
                "nothing overlaps (no overlap). Wait for the works in "
                "finish_gradient_synchronization().")
    never = [c for c in calls if not c.waited]
    if never:
        return (f"the all-reduce of {never[0].numel} elements was never waited for: until "
                "work.wait() returns, the bucket may still be half reduced. Call wait() on "
                "every bucket's work in finish_gradient_synchronization(), before reading it.")
    return ""


def _judge_buckets(sizes: Sequence[tuple[int, bool]], case: Case,
                   calls: Sequence[AllReduce]) -> str:
    assert case.cap_bytes is not None
    expected = bucket_numels(sizes, case.cap_bytes)
    got = [c.numel for c in calls]
    if got == expected:
        return ""
    want = (f"expected {len(expected)} all-reduce(s) of {listed(expected)} elements in this "
            f"order (one per bucket: the trainable parameters in reverse registration order, "
            f"a bucket closed once it holds bucket_cap_mb * 2**20 = {case.cap_bytes} "
            f"byte{'s' if case.cap_bytes > 1 else ''} or more), got {len(got)} of "
            f"{listed(got) or 'none'}")
    for rule in Rule:
        if rule is not Rule.RIGHT and bucket_numels(sizes, case.cap_bytes, rule) == got:
            return f"{want}: {rule.hint}"
    if sorted(got) == sorted(expected):
        return (f"{want}: the right buckets, launched out of bucket order. A bucket that is "
                "full early (here 'gain', whose gradient backward produces first although it "
                "sits in the last bucket) must wait until every bucket before it has been "
                "launched: all ranks must make their collectives in the same order.")
    return f"{want}."


def _judge_case(plan: Plan, reference: Reference, sizes: Sequence[tuple[int, bool]],
                case: Case, records: Sequence[_CaseRecord]) -> str:
    """The first thing wrong with one case, or ''. In order: the wrapper, the broadcast, then
    for 5.2 on 2+ ranks when the all-reduces were made and waited for (an all-reduce never
    waited for is a race, whose values vary from run to run), the values after every step,
    and last the buckets (a wrong bucket rule still gives the right values)."""
    n = len(records)
    where = _where(n, case)
    problem = next((r.problem for r in records if r.problem), "")
    if problem:
        return f"{where}: {problem}"
    wrong = _judge_initial(plan, reference, records)
    if wrong:
        return f"{where}, after __init__: {wrong}"
    watched = plan.exercise is DDPExercise.BUCKETED_DDP and n > 1  # 1 rank may skip them
    if watched:
        wrong = _first_wrong_call(where, records, _judge_overlap)
        if wrong:
            return wrong
    for step in range(STEPS):
        wrong = _judge_step(plan, reference, records, step)
        if wrong:
            return f"{where}, step {step + 1}: {wrong}"
    if watched:
        return _first_wrong_call(where, records, lambda c: _judge_buckets(sizes, case, c))
    return ""


def _first_wrong_call(where: str, records: Sequence[_CaseRecord],
                      judge: Callable[[Sequence[AllReduce]], str]) -> str:
    """``judge`` on every step's all-reduces of every rank: the first problem, located."""
    for step in range(STEPS):
        for r, record in enumerate(records):
            wrong = judge(record.steps[step].all_reduces)
            if wrong:
                return f"{where}, step {step + 1}: rank {r}: {wrong}"
    return ""


# --- judging failures ---------------------------------------------------------------------------


_ERROR_HINTS = (
    ("doesn't require gradient", " Register hooks only on parameters with requires_grad=True: "
                                 "a frozen parameter never gets a gradient."),
    ("'NoneType' object has no attribute 'wait'",
     " A bucket's all-reduce was never launched: every bucket must be full, and launched from "
     "the hooks, before finish_gradient_synchronization() waits for it."),
    ("NoneType", " Parameters with requires_grad=False have .grad None: skip them."),
)


def _where(n: int, case: Case | None) -> str:
    described = case.describe() if case is not None else ""
    return f"with {n} rank(s), {described}" if described else f"with {n} rank(s)"


def _explain_error(plan: Plan, n: int, err: RankError) -> str:
    named = failing_rank(err)
    case = failed_case(named.traceback, plan.cases)
    hint = next((h for key, h in _ERROR_HINTS if key in named.traceback), "")
    return f"{_where(n, case)}: {raised(named, hint)}"


def _explain_timeout(n: int, err: LaunchTimeout, timeout: float, where: str) -> str:
    return (f"with {n} rank(s), rank(s) {listed(err.ranks)} hung for {timeout:g} s.{where} A rank "
            "waits forever in a collective that a peer never makes: every rank must make the "
            "same collectives (broadcasts in __init__, one all-reduce per parameter or bucket) "
            "in the same order.")


# --- the checks ------------------------------------------------------------------------------


def _validate(exercise: DDPExercise, wrapper_class: object, world_sizes: object, seed: object,
              timeout: object) -> None:
    if not is_class(wrapper_class):
        raise TypeError(f"pass the class itself, e.g. {exercise.check_name}("
                        f"{exercise.class_name}), not an instance or a function (got "
                        f"{type(wrapper_class).__name__}).")
    validate_run_arguments(world_sizes, seed, timeout, max_world_size=MAX_CHECK_WORLD_SIZE,
                           why=f" (the check's batch of {BATCH} splits equally)")


def _interface_problem(exercise: DDPExercise, wrapper_class: type) -> str:
    if not callable(getattr(wrapper_class, "finish_gradient_synchronization", None)):
        return (f"{exercise.class_name} has no method finish_gradient_synchronization(self); "
                "the training loop calls it after loss.backward().")
    try:
        signature = inspect.signature(wrapper_class)
    except (TypeError, ValueError):  # no signature to read: let the ranks try it
        return ""
    try:
        signature.bind(*exercise.arguments)
    except TypeError:
        arguments = ", ".join(exercise.arguments)
        return (f"{exercise.class_name} must be built as {exercise.class_name}({arguments}); "
                f"its signature is {signature}. Write def __init__(self, {arguments}): ...")
    return ""


def _check(exercise: DDPExercise, wrapper_class: type, world_sizes: Sequence[int], seed: int,
           timeout: float) -> CheckResult:
    _validate(exercise, wrapper_class, world_sizes, seed, timeout)
    plan = Plan.make(exercise, world_sizes, seed)

    reference = Reference.make(plan.widths, seed)
    sizes = parameter_sizes(plan.widths)

    def judge(n: int, results: Sequence[list[_CaseRecord]]) -> str:
        for index, case in enumerate(plan.cases):
            wrong = _judge_case(plan, reference, sizes, case,
                                [per_rank[index] for per_rank in results])
            if wrong:
                return wrong
        return ""

    return run_check(
        exercise.title, plan, timeout,
        worker=_rank_run,
        args=lambda n: (wrapper_class, exercise, plan.cases, plan.widths),
        rank_args=lambda n: [(_rank_inputs(plan.widths, seed, r, n),) for r in range(n)],
        judge=judge,
        explain_error=lambda n, err: _explain_error(plan, n, err),
        explain_timeout=lambda n, err, where: _explain_timeout(n, err, timeout, where),
        passed=_passed(plan, sizes),
        problem=_interface_problem(exercise, wrapper_class),
    )


def _passed(plan: Plan, sizes: Sequence[tuple[int, bool]]) -> str:
    ranks = listed(plan.world_sizes)
    if plan.exercise is DDPExercise.SIMPLE_DDP:
        return (f"parameters match one process on the full batch on {ranks} rank(s), after "
                f"each of {STEPS} steps (tied weights, a frozen parameter and a buffer "
                "included).")
    caps = [c.cap_bytes for c in plan.cases if c.cap_bytes is not None]
    counts = [str(len(bucket_numels(sizes, cap))) for cap in caps]
    return (f"parameters match one process on the full batch on {ranks} rank(s); bucket caps "
            f"of {and_listed([describe_cap(cap) for cap in caps])} gave {and_listed(counts)} "
            "all-reduces per step, in bucket order, all launched asynchronously during "
            "backward.")


def check_simple_ddp(
    simple_ddp_class: type,
    world_sizes: Sequence[int] = (1, 2, 3, 4),
    seed: int = 0,
    timeout: float = CHECK_TIMEOUT_S,
) -> CheckResult:
    """Exercise 5.1: ``SimpleDDP(module)`` must broadcast every parameter and buffer from rank
    0, forward to ``module``, and make ``finish_gradient_synchronization()`` replace each
    trainable parameter's ``.grad`` by its mean over ranks (frozen parameters keep ``.grad``
    None). Trained 3 SGD steps on equal shards of one batch, every rank must match one
    process trained on the whole batch after every step (rtol=1e-4, atol=1e-6).

    A non-zero ``seed`` also runs one more world size (5 or 6) and a check model with other
    widths, both drawn from ``random.Random(seed)``; the verdict names them."""
    return _check(DDPExercise.SIMPLE_DDP, simple_ddp_class, world_sizes, seed, timeout)


def check_bucketed_ddp(
    bucketed_ddp_class: type,
    world_sizes: Sequence[int] = (1, 2, 3),
    seed: int = 0,
    timeout: float = CHECK_TIMEOUT_S,
) -> CheckResult:
    """Exercise 5.2: ``BucketedDDP(module, bucket_cap_mb)`` must match one process like 5.1,
    and on 2 or more ranks make, in each step, exactly one all-reduce per bucket, in bucket
    order, each launched with ``async_op=True`` from a gradient hook while ``loss.backward()``
    still runs, and none waited for before backward returns.

    The bucket rule: walk the trainable parameters of ``module.parameters()`` in REVERSE
    registration order, append each to the open bucket, and close the bucket once it holds
    ``bucket_cap_mb * 2**20`` bytes or more (a tiny cap gives one parameter per bucket, a huge
    one a single bucket). The documented caps are 1 B, 400 B (reached exactly by a bucket)
    and 25 MiB.

    A non-zero ``seed`` also runs one more world size (4 or 5), a check model with other
    widths, and another bucket cap, all drawn from ``random.Random(seed)``; the verdict names
    them."""
    return _check(DDPExercise.BUCKETED_DDP, bucketed_ddp_class, world_sizes, seed, timeout)
