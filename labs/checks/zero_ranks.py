"""Exercises 6.1-6.3 inside every rank: the inputs each rank is given, the calls of the
learner's function with the collectives counted and what it allocates tracked, and what each
call leaves behind. :mod:`labs.checks.zero` judges what the ranks send back.

Each call runs under ``torch.no_grad()`` (as an optimizer step and an inference forward run)
inside an :class:`~labs.memory.AllocationTracker`, which tells which storages made during the
call are still alive after it, read once every case has run (:func:`settle`: gloo lets go of
a finished collective's tensors a little after ``wait()`` returns). Each collective (and each
send of :mod:`labs.collectives`) is counted at its ring cost
(:func:`labs.checks.watch.counted_collectives`); exercise 6.3 refuses all-reduces outright.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, NoReturn

import torch
from torch import nn

from labs.checks.answer_keys import answer_keys_refused
from labs.checks.collectives import CollectiveUsedError
from labs.checks.core import case_noted
from labs.checks.watch import GROUP_METHODS, Kind, Traffic, counted_collectives
from labs.checks.zero_cases import (
    BETA,
    LR,
    STEPS,
    Case,
    ZeroExercise,
    linear_inputs,
    rank_grad,
    shard_of,
    start_param,
    step_grad,
)
from labs.memory import AllocationTracker
from labs.zero import shard_numel

# --- inside every rank ---------------------------------------------------------------------------


def _refuse_all_reduce(*args: Any, **kwargs: Any) -> NoReturn:
    raise CollectiveUsedError(
        "Exercise 6.3: no all-reduce: it would leave the full mean on every rank, twice the "
        "traffic of a reduce-scatter (2(N-1)/N·S instead of (N-1)/N·S) and N times the memory "
        "of the shard. Reduce-scatter the zero-padded gradient (labs.collectives."
        "ring_reduce_scatter, or torch's reduce-scatter) and divide by N")


def refusals(exercise: ZeroExercise) -> dict[str, Callable[..., NoReturn]]:
    """The ProcessGroup methods an exercise refuses: 6.3 every all-reduce, the others none."""
    if exercise is not ZeroExercise.REDUCE_SCATTER_GRAD:
        return {}
    return {name: _refuse_all_reduce for name, kind in GROUP_METHODS.items()
            if kind is Kind.ALL_REDUCE}


@dataclass(frozen=True)
class Call:
    """One call of the learner's function on one rank."""

    problem: str
    """What is wrong that needs no reference ('' when nothing)."""
    returned: torch.Tensor | None  #: a copy of what it returned, when a tensor
    returned_type: str
    returned_storage: int  #: bytes of the storage behind the returned tensor
    state: tuple[torch.Tensor, ...]
    """Copies after the call: 6.1 the parameters then the momentum shards, 6.2 the shard, 6.3
    the gradient."""
    sent: float  #: bytes sent (ring costs, see labs.checks.watch)
    all_reduced: int  #: elements all-reduced
    held: int = 0
    """Bytes of the storages made during the call that are still alive once every case has
    run (at their current size: a storage shrunk with ``resize_(0)`` is free), the returned
    tensor's aside."""


#: What a call made: its tracker, which still counts (by weak reference) the storages made
#: during the call, the returned tensor's aside.
_Made = AllocationTracker
#: gloo's worker threads drop the tensors of a finished collective a little after wait()
#: returns: a rank looks this many times, 10 ms apart, before it counts what is alive as held.
SETTLE_LOOKS = 100


def _measured(call: Callable[[], object], traffic: Traffic,
              state: Callable[[], Sequence[torch.Tensor]], keep: bool = True
              ) -> tuple[Call, _Made]:
    """Runs ``call`` under no_grad and an AllocationTracker, with the traffic counted."""
    traffic.sent, traffic.all_reduced = 0.0, 0
    with torch.no_grad(), AllocationTracker() as made:
        returned = call()
    tensor = returned if keep and isinstance(returned, torch.Tensor) else None
    if tensor is not None:
        made.untrack([tensor])  # the result is the caller's to keep
    return Call("", None if tensor is None else tensor.detach().clone(),
                 type(returned).__name__,
                 0 if tensor is None else tensor.untyped_storage().nbytes(),
                 tuple(t.detach().clone() for t in state()), traffic.sent,
                 traffic.all_reduced), made


def settle(made: Sequence[AllocationTracker]) -> None:
    """Gives gloo's finished work, and tensors in reference cycles, a chance to go, before
    ``made``'s live bytes are read (exercises 6.4 and 6.5 settle so too)."""
    for look in range(SETTLE_LOOKS):
        if not any(m.live_bytes for m in made):
            return
        if look == 5:
            gc.collect()  # 0.3 s in a rank, so not before gloo had its chance
        time.sleep(0.01)


def rank_inputs(exercise: ZeroExercise, seed: int, n: int, rank: int,
                 cases: tuple[Case, ...]) -> list[tuple[Any, ...]]:
    """What rank ``rank`` is given, case by case, drawn here in the parent: 6.1 the starting
    parameters and each step's gradients (the same on every rank), 6.2 its own shard of the
    padded weights and the input x, 6.3 its own gradient. A rank never gets the seed, so it
    cannot draw another rank's inputs."""
    given: list[tuple[Any, ...]] = []
    for index, case in enumerate(cases):
        if exercise is ZeroExercise.SHARDED_STEP:
            given.append((
                [start_param(seed, n, index, i, s) for i, s in enumerate(case.shapes)],
                [[step_grad(seed, n, index, step, i, s) for i, s in enumerate(case.shapes)]
                 for step in range(STEPS)]))
        elif exercise is ZeroExercise.FSDP_FORWARD:
            padded, x = linear_inputs(seed, n, index, case)
            given.append((shard_of(padded, n, rank).clone(), x))
        else:
            given.append((rank_grad(seed, n, index, rank, case),))
    return given


def _run_step(fn: Callable[..., Any], rank: int, n: int, case: Case, given: tuple[Any, ...],
              traffic: Traffic, inputs: list[object]) -> list[tuple[Call, _Made]]:
    starts, grads = given
    params = [nn.Parameter(start) for start in starts]
    momenta = [torch.zeros(shard_numel(p.numel(), n)) for p in params]  # 1-D, k elements each
    inputs.append(params)
    calls = []
    for step in range(STEPS):
        for i, p in enumerate(params):
            p.grad = grads[step][i].clone()
        given, places = list(momenta), [p.data_ptr() for p in params]
        call, made = _measured(lambda given=given: fn(params, given, LR, BETA), traffic,
                               state=lambda: [*params, *momenta], keep=False)
        replaced = [i for i, m in enumerate(momenta) if i >= len(given) or given[i] is not m]
        moved = [i for i, p in enumerate(params) if p.data_ptr() != places[i]]
        for p in params:
            p.grad = None  # a gradient the learner replaced is not state kept between steps
        if replaced:
            call = replace(call, problem=(
                f"momentum_shards[{replaced[0]}] was replaced by another tensor; update the "
                "tensor the list holds in place (m.mul_(beta).add_(g_shard)): the rank keeps "
                "it between steps."))
        elif moved:
            call = replace(call, problem=(
                f"parameter {moved[0]} was re-pointed at a new tensor (p.data = ...); copy "
                "the gathered values into it in place (p.copy_(...)), so that whoever holds "
                "the parameter sees them."))
        calls.append((call, made))  # and on: a rank that stopped would leave its peers waiting
    return calls


def _run_forward(fn: Callable[..., Any], rank: int, n: int, case: Case, given: tuple[Any, ...],
                 traffic: Traffic, inputs: list[object]) -> list[tuple[Call, _Made]]:
    (out_features, in_features), _ = case.shapes
    shard, x = given  # shard: 1-D, k elements
    inputs.extend((shard, x))
    return [_measured(lambda: fn(shard, in_features, out_features, x), traffic,
                      state=lambda: [shard])]


def _run_grad(fn: Callable[..., Any], rank: int, n: int, case: Case, given: tuple[Any, ...],
              traffic: Traffic, inputs: list[object]) -> list[tuple[Call, _Made]]:
    (grad,) = given
    inputs.append(grad)
    return [_measured(lambda: fn(grad), traffic, state=lambda: [grad])]


def rank_run(rank: int, world_size: int, fn: Callable[..., Any], exercise: ZeroExercise,
              cases: tuple[Case, ...], given: list[tuple[Any, ...]]) -> list[list[Call]]:
    """Runs every case on this rank with the collectives watched, then counts what each call
    left alive (at the end, when gloo has let go of the tensors of finished collectives).
    ``given``: this rank's inputs, case by case (:func:`rank_inputs`)."""
    run = {ZeroExercise.SHARDED_STEP: _run_step, ZeroExercise.FSDP_FORWARD: _run_forward,
           ZeroExercise.REDUCE_SCATTER_GRAD: _run_grad}[exercise]
    results = []
    inputs: list[object] = []  # alive until the end: what the learner hangs on them is held
    with counted_collectives(refusals(exercise)) as traffic, \
            answer_keys_refused(exercise.value):
        for index, case in enumerate(cases):
            with case_noted(index):
                results.append(run(fn, rank, world_size, case, given[index], traffic, inputs))
    settle([made for calls in results for _, made in calls])
    return [[replace(call, held=made.live_bytes) for call, made in calls] for calls in results]
