"""Exercise checks: run the learner's function on real ranks and print a deterministic verdict.

Every check follows the same shape: build inputs whose right answer the parent can compute
on its own, launch the learner's function on several world sizes, compare, and explain the
most likely mistake when the answer is wrong. The verdict's first line is ``PASS: ...`` or
``FAIL: ...`` and depends only on the learner's code and the check's seed.

Exercise 1.1 lives here; the checks of chapters 2-4 (``check_ring_all_reduce``,
``check_ring_reduce_scatter``, ``check_ring_all_gather``, ``check_composed_all_reduce``) live in
:mod:`labs.checks_collectives` and are importable from here too.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from labs.launch import LaunchTimeout, RankError, launch

#: How long one check launch may run before the learner's code is declared hung.
CHECK_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class CheckResult:
    """The verdict of one exercise check."""

    exercise: str
    passed: bool
    message: str

    def __str__(self) -> str:
        return f"{'PASS' if self.passed else 'FAIL'}: {self.exercise}: {self.message}"


def _report(result: CheckResult) -> CheckResult:
    print(result)
    return result


# --- Exercise 1.1: average_gradients(model) ---------------------------------------------------


class _CheckModel(nn.Module):
    """Two trainable layers and one frozen parameter (its .grad stays None)."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(3, 4)
        self.second = nn.Linear(4, 2)
        self.frozen = nn.Parameter(torch.zeros(2), requires_grad=False)


def _check_gradients(rank: int, seed: int) -> dict[str, torch.Tensor]:
    """The gradients rank ``rank`` starts from: different on every rank, known to the parent."""
    generator = torch.Generator().manual_seed(seed * 1000 + rank)
    return {
        name: torch.randn(p.shape, generator=generator)
        for name, p in _CheckModel().named_parameters()
        if p.requires_grad
    }


def _run_average_gradients(
    rank: int, world_size: int, average_gradients: Callable[[nn.Module], object], seed: int
) -> dict[str, torch.Tensor | None]:
    model = _CheckModel()
    for name, grad in _check_gradients(rank, seed).items():
        model.get_parameter(name).grad = grad.clone()
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
    a frozen parameter's ``.grad`` must stay ``None``."""
    name = "Exercise 1.1 average_gradients"
    for world_size in world_sizes:
        try:
            results = launch(
                _run_average_gradients, world_size, args=(average_gradients, seed),
                timeout=timeout, echo=False, backend="gloo",  # CPU tensors, even on GPU boxes
            )
        except RankError as err:
            hint = (
                " Parameters with requires_grad=False have .grad None: skip them."
                if "NoneType" in str(err) else ""
            )
            return _report(CheckResult(
                name, False,
                f"with {world_size} rank(s), rank {err.rank} raised {err.exc_type}.{hint}\n"
                f"{err.remote_traceback}",
            ))
        except LaunchTimeout as err:
            return _report(CheckResult(
                name, False,
                f"with {world_size} rank(s), rank(s) {err.ranks} hung: every rank must call "
                "all_reduce on the same parameters, in the same order.",
            ))
        starts = [_check_gradients(rank, seed) for rank in range(world_size)]
        verdict = _judge_average(starts, results)
        if verdict:
            return _report(CheckResult(name, False, f"with {world_size} rank(s), {verdict}"))
    sizes = ", ".join(map(str, world_sizes))
    return _report(CheckResult(
        name, True, f"every rank holds the mean gradient on {sizes} rank(s)."
    ))


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
            return f"rank {rank}: {param}.grad is not the mean over ranks."
    return ""


# --- Exercises 2.1-4.2: the collectives, in labs.checks_collectives ----------------------------

#: Re-exported here so that notebooks import every check from one place.
_COLLECTIVE_CHECKS = (
    "check_ring_all_reduce", "check_ring_reduce_scatter", "check_ring_all_gather",
    "check_composed_all_reduce", "CollectiveUsedError", "Exercise",
)


def __getattr__(name: str) -> object:
    # Imported on first use rather than at the top: labs.checks_collectives imports
    # CheckResult from this module, so an eager import here would be circular.
    if name in _COLLECTIVE_CHECKS:
        from labs import checks_collectives

        return getattr(checks_collectives, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
