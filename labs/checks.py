"""Exercise checks: run the learner's function on real ranks and print a deterministic verdict.

Every check follows the same shape: build inputs whose right answer the parent can compute
on its own, launch the learner's function on several world sizes, compare, and explain the
most likely mistake when the answer is wrong. The verdict's first line is ``PASS: ...`` or
``FAIL: ...`` and depends only on the learner's code and the check's seed.

``seed=0`` runs the documented cases. Any other seed also draws hidden cases from
``random.Random(seed)`` (for exercise 1.1: one more world size and other layer widths), and the
verdict names what it drew, so that a grader's verdict can be rerun by hand.

Exercise 1.1 lives here; the checks of chapters 2-4 (``check_ring_all_reduce``,
``check_ring_reduce_scatter``, ``check_ring_all_gather``, ``check_composed_all_reduce``) live in
:mod:`labs.checks_collectives`, those of chapter 5 (``check_simple_ddp``, ``check_bucketed_ddp``)
in :mod:`labs.checks_ddp`, those of chapter 6 (``check_sharded_sgd_step``,
``check_fsdp_linear_forward``, ``check_reduce_scatter_grad``) in :mod:`labs.checks_zero`, and all
are importable from here too.
"""

from __future__ import annotations

import inspect
import math
import random
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from labs.launcher import MAX_WORLD_SIZE, LaunchTimeout, RankError, RankFailure, launch

#: How long one check launch may run before the learner's code is declared hung.
CHECK_TIMEOUT_S = 10.0
#: Once a rank of a check has failed, how long the others get to report: ranks that fail the
#: same way, late on a busy machine, are then all seen, and the verdict (the lowest of them,
#: :func:`failing_rank`) is the same every run. The launcher stops waiting as soon as every
#: rank has reported.
CHECK_FAILURE_GRACE_S = 3.0


@dataclass(frozen=True)
class CheckResult:
    """The verdict of one exercise check."""

    exercise: str
    passed: bool
    message: str

    def __str__(self) -> str:
        return f"{'PASS' if self.passed else 'FAIL'}: {self.exercise}: {self.message}"


def report(result: CheckResult) -> CheckResult:
    """Print the verdict (what the learner reads in the notebook) and return it."""
    print(result)
    return result


#: Tagged onto an exception raised by the learner's code inside a check, so the parent knows
#: which case it was; :func:`clean_traceback` drops the line again.
CASE_NOTE = "[labs check] case"


def clean_traceback(text: str, check_module: str) -> str:
    """The learner's part of a rank's traceback: the frames of ``check_module`` (a check
    module's ``__file__``) and the case note dropped. The launcher names a notebook cell as
    IPython does (``Cell In[5], line 3``); a cell path it could not name (it holds the
    kernel's pid) is made stable, so that a verdict is the same on every run."""
    lines, keep = [], True
    for line in text.splitlines():
        if line.startswith("  File "):
            keep = check_module not in line
        elif not line.startswith("    "):
            keep = True
        if keep and not line.startswith(CASE_NOTE):
            lines.append(line)
    return re.sub(r'"[^"]*ipykernel_\d+[/\\][^"]*"', '"<notebook cell>"', "\n".join(lines))


def failing_rank(err: RankError) -> RankFailure:
    """The failure a check's verdict names. Ranks that fail the same way at once: the lowest,
    so that the verdict is the same on every run (but never one that only lost the peer that
    failed first)."""
    same = sorted((f for f in err.secondary if f.exc_type == err.exc_type and f.rank < err.rank
                   and not f.peer_lost), key=lambda f: f.rank)
    return same[0] if same else err.failure


def explain_hang(n: int, err: LaunchTimeout, timeout: float) -> tuple[str | None, str]:
    """Read a check's :class:`~labs.launcher.LaunchTimeout`: ``(verdict, where)``. ``verdict``
    is the whole explanation when the ranks were still joining the group (a busy machine, not
    the learner's bug), else None; ``where`` names the first learner frame a hung rank was
    waiting at (" Rank r was waiting at ..." or "")."""
    stacks = [err.stacks.get(r, "") for r in err.ranks]
    if any(stacks) and all("_join_group" in s for s in stacks if s):
        return (f"with {n} rank(s), the ranks were still starting after {timeout:g} s; the "
                "machine may be busy: pass a larger timeout=."), ""
    for r in err.ranks:
        frames = [line.strip() for line in err.stacks.get(r, "").splitlines()
                  if not any(part in line for part in ("/torch/", "/labs/", "<frozen "))]
        if frames:
            cell = re.sub(r'"[^"]*ipykernel_\d+[/\\][^"]*"', '"<notebook cell>"', frames[0])
            return None, f" Rank {r} was waiting at {cell}."
    return None, ""


def validate_run_arguments(world_sizes: object, seed: object, timeout: object, *,
                           max_world_size: int = MAX_WORLD_SIZE, why: str = "") -> None:
    """Refuse a check's ``world_sizes``, ``seed`` or ``timeout`` before any process starts,
    saying what to pass instead. ``why`` explains ``max_world_size`` when it is a check's own."""
    if (isinstance(world_sizes, (str, bytes)) or not isinstance(world_sizes, Sequence)
            or not world_sizes):
        raise TypeError(f"world_sizes must be a non-empty tuple of ints, e.g. (1, 2, 3), got "
                        f"{world_sizes!r}.")
    for n in world_sizes:
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= max_world_size:
            raise ValueError(f"each world size must be an int in 1..{max_world_size}{why}, "
                             f"got {n!r}.")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed must be an int (0 for the documented cases), got {seed!r}.")
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not (
            0 < timeout < math.inf):
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}.")


def validate_check_call(fn: object, world_sizes: object, seed: object, timeout: object) -> None:
    """:func:`validate_run_arguments`, and ``fn`` must be the learner's function itself."""
    if not callable(fn):
        raise TypeError(f"pass the function itself, e.g. check(my_function), not its result "
                        f"(got {type(fn).__name__}).")
    validate_run_arguments(world_sizes, seed, timeout)


def signature_problem(function: str, parameters: Sequence[str], fn: Callable[..., Any]) -> str:
    """Why ``fn`` cannot be called as ``function(*parameters)``, or "" when it can (or when
    its signature cannot be read: the ranks then try it)."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin without a signature: let the ranks try it
        return ""
    try:
        signature.bind(*parameters)
    except TypeError:
        params = ", ".join(parameters)
        return (f"{function} must accept {len(parameters)} argument(s), ({params}); its "
                f"signature is {signature}. Write def {function}({params}): ...")
    return ""


#: Case inputs are integers in [1, 9]: sums over at most 32 ranks are exact in float32, and a
#: sum over some of the ranks is smaller than the sum over all of them in every element.
_LOW, _HIGH = 1, 10


def _mix(*parts: int) -> int:
    value = 0x9E3779B9
    for part in parts:
        value = (value * 1_000_003 + part + 7) % (1 << 61)
    return value


def case_values(seed: int, n: int, index: int, who: int, numel: int) -> torch.Tensor:
    """``numel`` integers in [1, 9] as float32 (1-D), a pure function of its arguments, so
    that the parent and the ranks draw the same inputs: case ``index`` of world size ``n``,
    for ``who`` (a rank, or a negative number for tensors no single rank owns)."""
    generator = torch.Generator().manual_seed(_mix(seed, n, index, who))
    return torch.randint(_LOW, _HIGH, (numel,), generator=generator).to(torch.float32)


def first_difference(got: torch.Tensor, expected: torch.Tensor, what: str) -> str:
    """The first element (1-D index) where ``got`` differs from ``expected``, in words."""
    i = int((got != expected).nonzero()[0, 0])
    return f"element {i} is {float(got[i]):g}, expected {float(expected[i]):g} ({what})"


def ranks_text(ranks: Sequence[int]) -> str:
    return ", ".join(map(str, ranks))


# --- Exercise 1.1: average_gradients(model) ---------------------------------------------------


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
class _AveragePlan:
    """What check 1.1 runs: the world sizes and the check model's widths."""

    seed: int
    world_sizes: tuple[int, ...]
    drawn_world_size: int | None
    widths: _Widths

    @classmethod
    def make(cls, world_sizes: Sequence[int], seed: int) -> _AveragePlan:
        sizes = tuple(world_sizes)
        if seed == 0:
            return cls(seed, sizes, None, _Widths())
        rng = random.Random(seed)
        spare = [n for n in _DRAWN_WORLD_SIZES if n not in sizes]
        extra = rng.choice(spare) if spare else None
        widths = _Widths(rng.randint(*_DRAWN_INPUTS), rng.randint(*_DRAWN_HIDDEN),
                         rng.randint(*_DRAWN_OUTPUTS))
        return cls(seed, sizes + ((extra,) if extra else ()), extra, widths)

    def note(self) -> str:
        if self.seed == 0:
            return ""
        extra = f"world size {self.drawn_world_size} and " if self.drawn_world_size else ""
        return (f" [seed {self.seed} drew {extra}{self.widths.describe()}; "
                f"pass seed={self.seed} to rerun]")


class _CheckModel(nn.Module):
    """Two trainable layers and one frozen parameter (its .grad stays None)."""

    def __init__(self, widths: _Widths = _Widths()) -> None:
        super().__init__()
        self.first = nn.Linear(widths.inputs, widths.hidden)
        self.second = nn.Linear(widths.hidden, widths.outputs)
        self.frozen = nn.Parameter(torch.zeros(widths.outputs), requires_grad=False)


def _check_gradients(rank: int, seed: int, widths: _Widths) -> dict[str, torch.Tensor]:
    """The gradients rank ``rank`` starts from: different on every rank, known to the parent."""
    generator = torch.Generator().manual_seed(seed * 1000 + rank)
    return {
        name: torch.randn(p.shape, generator=generator)
        for name, p in _CheckModel(widths).named_parameters()
        if p.requires_grad
    }


def _run_average_gradients(
    rank: int, world_size: int, average_gradients: Callable[[nn.Module], object], seed: int,
    widths: _Widths,
) -> dict[str, torch.Tensor | None]:
    model = _CheckModel(widths)
    for name, grad in _check_gradients(rank, seed, widths).items():
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
    a frozen parameter's ``.grad`` must stay ``None``.

    A non-zero ``seed`` also runs one more world size (5 or 6) and a check model with other
    layer widths, both drawn from ``random.Random(seed)``; the verdict names them."""
    if not callable(average_gradients):
        raise TypeError(f"pass the function itself, e.g. check_average_gradients("
                        f"average_gradients), not its result (got "
                        f"{type(average_gradients).__name__}).")
    validate_run_arguments(world_sizes, seed, timeout)
    name = "Exercise 1.1 average_gradients"
    plan = _AveragePlan.make(world_sizes, seed)

    def verdict(passed: bool, message: str) -> CheckResult:
        return report(CheckResult(name, passed, message + plan.note()))

    for world_size in plan.world_sizes:
        try:
            results = launch(
                _run_average_gradients, world_size,
                args=(average_gradients, seed, plan.widths),
                timeout=timeout, echo=False, backend="gloo",  # CPU tensors, even on GPU boxes
                failure_grace=CHECK_FAILURE_GRACE_S,
            )
        except RankError as err:
            named = failing_rank(err)
            hint = (
                " Parameters with requires_grad=False have .grad None: skip them."
                if "NoneType" in named.traceback else ""
            )
            return verdict(
                False,
                f"with {world_size} rank(s), rank {named.rank} raised {named.exc_type}.{hint}\n"
                f"{clean_traceback(named.traceback, __file__)}",
            )
        except LaunchTimeout as err:
            starting, where = explain_hang(world_size, err, timeout)
            return verdict(
                False,
                starting or f"with {world_size} rank(s), rank(s) {list(err.ranks)} hung for "
                f"{timeout:g} s.{where} Every rank must call all_reduce on the same parameters, "
                "in the same order.",
            )
        starts = [_check_gradients(rank, seed, plan.widths) for rank in range(world_size)]
        wrong = _judge_average(starts, results)
        if wrong:
            return verdict(False, f"with {world_size} rank(s), {wrong}")
    sizes = ", ".join(map(str, plan.world_sizes))
    return verdict(True, f"every rank holds the mean gradient on {sizes} rank(s).")


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


#: Exercises 5.1-5.2, re-exported from labs.checks_ddp in the same way.
_DDP_CHECKS = ("check_simple_ddp", "check_bucketed_ddp")
#: Exercises 6.1-6.3, re-exported from labs.checks_zero in the same way.
_ZERO_CHECKS = ("check_sharded_sgd_step", "check_fsdp_linear_forward", "check_reduce_scatter_grad")


def __getattr__(name: str) -> object:
    # Imported on first use rather than at the top: labs.checks_collectives and
    # labs.checks_ddp (and labs.checks_zero) import CheckResult from this module, so an eager
    # import would be circular.
    if name in _COLLECTIVE_CHECKS:
        from labs import checks_collectives

        return getattr(checks_collectives, name)
    if name in _DDP_CHECKS:
        from labs import checks_ddp

        return getattr(checks_ddp, name)
    if name in _ZERO_CHECKS:
        from labs import checks_zero

        return getattr(checks_zero, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
