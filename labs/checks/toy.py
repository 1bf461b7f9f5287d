"""Exercise 1.1's check, ``check_average_gradients(average_gradients)``: the learner's
function averages the gradients of a small two-layer model (with one frozen parameter) across
the ranks; the parent computes the average on its own and compares.

``seed=0`` runs the documented world sizes and widths; any other seed also draws one more
world size and other layer widths from ``random.Random(seed)``, and the verdict names them.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from labs.checks.answer_keys import answer_keys_refused
from labs.checks.core import (
    CHECK_TIMEOUT_S,
    CaseKeys,
    CheckPlan,
    CheckResult,
    failing_rank,
    largest_difference,
    listed,
    raised,
    run_check,
    signature_problem,
    validate_check_call,
    with_drawn_world_size,
)
from labs.checks.exercises import spec
from labs.launcher import LaunchTimeout, RankError, launch

# --- Exercise 1.1: average_gradients(model) ---------------------------------------------------

#: Its row of the exercise registry: title, signature, answer keys.
_EXERCISE = spec("1.1")

#: A non-zero seed adds one of these world sizes (the documented ones stop at 4).
_DRAWN_WORLD_SIZES = (5, 6)
#: Ranges a non-zero seed draws the layer widths from: each excludes the documented width, so
#: every parameter shape differs from the documented case.
_DRAWN_INPUTS, _DRAWN_HIDDEN, _DRAWN_OUTPUTS = (4, 8), (5, 9), (3, 6)


@dataclass(frozen=True)
class _Widths:
    """Layer widths of the check model: ``first = Linear(inputs, hidden)``,
    ``second = Linear(hidden, outputs)``, and a frozen parameter of ``outputs`` elements."""

    inputs: int = 3
    hidden: int = 4
    outputs: int = 2

    def describe(self) -> str:
        return (f"layers Linear({self.inputs}, {self.hidden}), "
                f"Linear({self.hidden}, {self.outputs})")


@dataclass(frozen=True)
class AveragePlan(CheckPlan):
    """What check 1.1 runs: the world sizes and the check model's widths."""

    widths: _Widths

    @classmethod
    def make(cls, world_sizes: Sequence[int], seed: int) -> AveragePlan:
        if seed == 0:
            return cls(seed, tuple(world_sizes), None, _Widths())
        rng = random.Random(seed)
        sizes, extra = with_drawn_world_size(world_sizes, rng, _DRAWN_WORLD_SIZES)
        widths = _Widths(rng.randint(*_DRAWN_INPUTS), rng.randint(*_DRAWN_HIDDEN),
                         rng.randint(*_DRAWN_OUTPUTS))
        return cls(seed, sizes, extra, widths)

    def draws(self) -> list[str]:
        return [self.widths.describe()]


class _CheckModel(nn.Module):
    """Two trainable layers and one frozen parameter (its .grad stays None)."""

    def __init__(self, widths: _Widths = _Widths()) -> None:
        super().__init__()
        self.first = nn.Linear(widths.inputs, widths.hidden)
        self.second = nn.Linear(widths.hidden, widths.outputs)
        self.frozen = nn.Parameter(torch.zeros(widths.outputs), requires_grad=False)


def _check_gradients(rank: int, keys: CaseKeys, widths: _Widths) -> dict[str, torch.Tensor]:
    """The gradients rank ``rank`` starts from: drawn from its own key (the parent holds every
    rank's keys, a rank only its own), so different on every rank and known to the parent."""
    generator = keys.generator(0, 0, owner=rank)
    return {
        name: torch.randn(p.shape, generator=generator)
        for name, p in _CheckModel(widths).named_parameters()
        if p.requires_grad
    }


def _run_average_gradients(
    rank: int, world_size: int, average_gradients: Callable[[nn.Module], object],
    widths: _Widths, keys: CaseKeys,
) -> dict[str, torch.Tensor | None]:
    model = _CheckModel(widths)
    for name, grad in _check_gradients(rank, keys, widths).items():
        model.get_parameter(name).grad = grad.clone()
    with answer_keys_refused(_EXERCISE.id):
        average_gradients(model)
    return {
        name: None if p.grad is None else p.grad.detach().clone()
        for name, p in model.named_parameters()
    }


def check_average_gradients(
    average_gradients: Callable[[nn.Module], object],
    world_sizes: Sequence[int] = (1, 2, 3, 4),
    seed: int = 0,
    timeout: float = CHECK_TIMEOUT_S,
) -> CheckResult:
    """Exercise 1.1: after ``average_gradients(model)`` every rank's ``p.grad`` must hold the
    mean over ranks of the gradients they started with, for every trainable parameter, and
    a frozen parameter's ``.grad`` must stay ``None``.

    A non-zero ``seed`` also runs one more world size (5 or 6) and a check model with other
    layer widths, both drawn from ``random.Random(seed)``; the verdict names them."""
    validate_check_call(average_gradients, world_sizes, seed, timeout,
                        example="check_average_gradients(average_gradients)")
    plan = AveragePlan.make(world_sizes, seed)

    def judge(n: int, results: Sequence[dict[str, torch.Tensor | None]]) -> str:
        keys = CaseKeys.draw(seed, n)
        starts = [_check_gradients(rank, keys, plan.widths) for rank in range(n)]
        wrong = _judge_average(starts, results)
        return f"with {n} rank(s), {wrong}" if wrong else ""

    return run_check(
        _EXERCISE.title, plan, timeout,
        worker=_run_average_gradients,
        args=lambda n: (average_gradients, plan.widths),
        rank_args=lambda n: CaseKeys.draw(seed, n).per_rank(),
        judge=judge,
        explain_error=_explain_error,
        explain_timeout=lambda n, err, where: _explain_timeout(n, err, timeout, where),
        passed=f"every rank holds the mean gradient on {listed(plan.world_sizes)} rank(s).",
        # Looked up in this module at each call: a learner's cell that patches
        # labs.checks.toy.launch changes what this check runs (the grader runs it afresh).
        launcher=launch,
        problem=signature_problem(_EXERCISE.function, _EXERCISE.parameters, average_gradients),
    )


def _explain_error(n: int, err: RankError) -> str:
    named = failing_rank(err)
    hint = (" Parameters with requires_grad=False have .grad None: skip them."
            if "NoneType" in named.traceback else "")
    return f"with {n} rank(s), {raised(named, hint)}"


def _explain_timeout(n: int, err: LaunchTimeout, timeout: float, where: str) -> str:
    return (f"with {n} rank(s), rank(s) {listed(err.ranks)} hung for {timeout:g} s.{where} Every "
            "rank must call all_reduce on the same parameters, in the same order.")


def _judge_average(
    starts: list[dict[str, torch.Tensor]], results: Sequence[dict[str, torch.Tensor | None]]
) -> str:
    """The first thing wrong with the ranks' gradients, or '' when they are right."""
    world_size = len(starts)
    for rank, got in enumerate(results):
        if got.get("frozen") is not None:
            return f"rank {rank}: the frozen parameter got a gradient; leave .grad None alone."
        for param, start in starts[rank].items():
            mean = sum(s[param] for s in starts) / world_size
            grad = got[param]
            if grad is None:
                return f"rank {rank}: {param}.grad is None; average it in place, do not drop it."
            if torch.allclose(grad, mean, rtol=1e-5, atol=1e-6):
                continue
            if world_size > 1 and torch.allclose(grad, mean * world_size, rtol=1e-5, atol=1e-6):
                return (
                    f"rank {rank}: {param}.grad holds the SUM over ranks, {world_size}x the "
                    "mean. all_reduce sums; divide by dist.get_world_size() afterwards."
                )
            if torch.allclose(grad, start, rtol=1e-5, atol=1e-6):
                return (
                    f"rank {rank}: {param}.grad is unchanged, still this rank's own gradient. "
                    "Call dist.all_reduce(p.grad) for each parameter (it works in place)."
                )
            return (f"rank {rank}: {param}.grad is not the mean over ranks: " + largest_difference(
                grad, mean, "the mean of the gradients the ranks started with") + ".")
    return ""
