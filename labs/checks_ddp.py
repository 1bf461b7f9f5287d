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
them.
"""

from __future__ import annotations

import contextlib
import enum
import inspect
import random
import re
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.distributed import distributed_c10d

from labs.checks import (
    CASE_NOTE,
    CHECK_FAILURE_GRACE_S,
    CHECK_TIMEOUT_S,
    CheckResult,
    clean_traceback,
    explain_hang,
    failing_rank,
    report,
    validate_run_arguments,
)
from labs.launcher import LaunchTimeout, RankError, launch

#: Samples in the check's batch: lcm(1..8), so every world size up to 8 gets an equal shard.
BATCH = 840
#: The largest world size the checks accept (the batch must split equally).
MAX_CHECK_WORLD_SIZE = 8
STEPS = 3
_LR, _MOMENTUM = 0.1, 0.9
#: Tolerances of every comparison with the single-process reference (fp32 sums in another
#: order differ in the last bits; a sum instead of a mean differs by a factor N).
RTOL, ATOL = 1e-4, 1e-6
_MIB = 2**20
#: The documented bucket caps of check 5.2, in bytes: one parameter per bucket, a cap that
#: a bucket reaches exactly (it closes at >=), and one bucket for everything.
_DOCUMENTED_CAPS = (1, 400, 25 * _MIB)


class DDPExercise(enum.Enum):
    """The exercises of chapter 5 that these checks run."""

    #: ``SimpleDDP(module)``: broadcast, then average every gradient after backward.
    SIMPLE_DDP = "5.1"
    #: ``BucketedDDP(module, bucket_cap_mb)``: buckets all-reduced during backward.
    BUCKETED_DDP = "5.2"

    @property
    def class_name(self) -> str:
        return {DDPExercise.SIMPLE_DDP: "SimpleDDP",
                DDPExercise.BUCKETED_DDP: "BucketedDDP"}[self]

    @property
    def check_name(self) -> str:
        return {DDPExercise.SIMPLE_DDP: "check_simple_ddp",
                DDPExercise.BUCKETED_DDP: "check_bucketed_ddp"}[self]

    @property
    def title(self) -> str:
        return f"Exercise {self.value} {self.class_name}"

    @property
    def arguments(self) -> tuple[str, ...]:
        """The constructor's arguments, as the check passes them (positionally)."""
        return ("module",) if self is DDPExercise.SIMPLE_DDP else ("module", "bucket_cap_mb")

    @property
    def drawn_world_sizes(self) -> tuple[int, ...]:
        """A non-zero seed adds one of these (the documented sizes stop at 4, or at 3)."""
        return (5, 6) if self is DDPExercise.SIMPLE_DDP else (4, 5)


# --- the check model ---------------------------------------------------------------------------


@dataclass(frozen=True)
class _Widths:
    """Widths of the check model: inputs I, hidden H, outputs O."""

    inputs: int = 8
    hidden: int = 16
    outputs: int = 4

    def describe(self) -> str:
        return f"widths {self.inputs} -> {self.hidden} -> {self.outputs}"


#: A non-zero seed draws every width from these; none holds a documented width, so every
#: parameter's shape differs from the documented case.
_DRAWN_INPUTS = (5, 6, 7, 9, 10, 11)
_DRAWN_HIDDEN = (10, 11, 12, 13, 14, 15, 17, 18, 19, 20)
_DRAWN_OUTPUTS = (2, 3, 5, 6)


class _CheckNet(nn.Module):
    """The check model (see the module docstring): tied weights, a frozen parameter, a buffer,
    and a parameter registered first whose gradient is ready first."""

    def __init__(self, widths: _Widths) -> None:
        super().__init__()
        self.gain = nn.Parameter(1.0 + 0.1 * torch.randn(widths.outputs))
        self.frozen = nn.Parameter(0.1 * torch.randn(widths.hidden), requires_grad=False)
        self.first = nn.Linear(widths.inputs, widths.hidden)
        self.middle = nn.Linear(widths.hidden, widths.hidden)
        self.tied = nn.Linear(widths.hidden, widths.hidden)
        self.tied.weight = self.middle.weight  # one parameter, used twice
        self.head = nn.Linear(widths.hidden, widths.outputs)
        self.register_buffer("scale", 1.0 + 0.5 * torch.rand(widths.hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.first(x) * self.scale + self.frozen)
        h = torch.tanh(self.middle(h))
        h = torch.tanh(self.tied(h))
        return self.head(h) * self.gain


def _init_seed(seed: int, rank: int) -> int:
    return 1000 * seed + rank + 1


def _build_net(widths: _Widths, init_seed: int) -> _CheckNet:
    """The check model initialised from ``init_seed``, leaving the caller's RNG as it was."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(init_seed)
        return _CheckNet(widths)


def _batch(seed: int, widths: _Widths) -> tuple[torch.Tensor, torch.Tensor]:
    """The full batch: inputs (BATCH, I) and targets (BATCH, O)."""
    generator = torch.Generator().manual_seed(7919 * seed + 17)
    x = torch.randn(BATCH, widths.inputs, generator=generator)
    y = torch.randn(BATCH, widths.outputs, generator=generator)
    return x, y


def _shard(tensor: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    per = BATCH // world_size
    return tensor[rank * per:(rank + 1) * per]


def _loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(output, target)


class _SGD:
    """``torch.optim.SGD(lr=0.1, momentum=0.9)`` written out. torch.optim is not used: building
    its first optimizer imports torch._dynamo, seconds in every freshly forked rank."""

    def __init__(self, module: nn.Module) -> None:
        self.params = list(module.parameters())
        self.momentum: dict[int, torch.Tensor] = {}

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    @torch.no_grad()
    def step(self) -> None:
        for i, p in enumerate(self.params):
            if p.grad is None:
                continue
            if i in self.momentum:
                self.momentum[i].mul_(_MOMENTUM).add_(p.grad)
            else:
                self.momentum[i] = p.grad.detach().clone()
            p.add_(self.momentum[i], alpha=-_LR)


def _snapshot(module: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter (tied ones once) and buffer, by name, copied."""
    return {name: t.detach().clone()
            for name, t in [*module.named_parameters(), *module.named_buffers()]}


# --- the bucket rule ---------------------------------------------------------------------------


class _Rule(enum.Enum):
    """The bucket rule of exercise 5.2 and the mistakes a learner makes with it."""

    RIGHT = "right"
    """Trainable parameters in reverse registration order; close a bucket at >= the cap."""
    REGISTRATION_ORDER = "registration order"
    """Walks the parameters in registration order, not the order backward produces them."""
    STRICTLY_MORE = "strictly more"
    """Closes a bucket only once it holds more than the cap (> instead of >=)."""
    BEFORE_APPEND = "before append"
    """Closes a bucket before the parameter that would overflow it, not after."""
    ELEMENTS = "elements"
    """Compares the cap with a count of elements instead of bytes."""
    FROZEN_INCLUDED = "frozen included"
    """Buckets the frozen parameters too, which never get a gradient."""

    @property
    def hint(self) -> str:
        return {
            _Rule.REGISTRATION_ORDER: "these are the buckets of module.parameters() in "
            "registration order; walk them in REVERSE (reversed(list(...))), the order in "
            "which backward produces their gradients.",
            _Rule.STRICTLY_MORE: "these buckets close only once they hold MORE than the cap; "
            "close a bucket once it holds bucket_cap_mb * 2**20 bytes or more (>=).",
            _Rule.BEFORE_APPEND: "these buckets close before a parameter that would overflow "
            "them; append the parameter first, then close the bucket if it holds "
            "bucket_cap_mb * 2**20 bytes or more.",
            _Rule.ELEMENTS: "these buckets count elements, not bytes; a bucket's size is "
            "sum(p.numel() * p.element_size()) bytes, compared with bucket_cap_mb * 2**20.",
            _Rule.FROZEN_INCLUDED: "these buckets include the frozen parameter; bucket only "
            "parameters with requires_grad=True (a frozen one never gets a gradient).",
        }.get(self, "")


def _bucket_numels(sizes: Sequence[tuple[int, bool]], cap_bytes: int, rule: _Rule = _Rule.RIGHT,
                   element_size: int = 4) -> list[int]:
    """The numel of each bucket, in bucket order, for parameters of ``(numel, trainable)`` in
    registration order: walk the trainable ones in reverse, append each to the open bucket,
    close it once it holds ``cap_bytes`` or more. ``rule`` makes one of the usual mistakes."""
    chosen = [numel for numel, trainable in sizes if trainable or rule is _Rule.FROZEN_INCLUDED]
    if rule is not _Rule.REGISTRATION_ORDER:
        chosen.reverse()
    unit = 1 if rule is _Rule.ELEMENTS else element_size
    buckets: list[int] = []
    open_ = 0  # elements in the open bucket
    for numel in chosen:
        if rule is _Rule.BEFORE_APPEND:  # closes a bucket only when the next one overflows it
            if open_ and (open_ + numel) * unit > cap_bytes:
                buckets.append(open_)
                open_ = 0
            open_ += numel
            continue
        open_ += numel
        if (open_ * unit > cap_bytes if rule is _Rule.STRICTLY_MORE
                else open_ * unit >= cap_bytes):
            buckets.append(open_)
            open_ = 0
    if open_:
        buckets.append(open_)
    return buckets


def _parameter_sizes(widths: _Widths) -> list[tuple[int, bool]]:
    """``(numel, trainable)`` of the check model's parameters in registration order."""
    net = _build_net(widths, 0)
    return [(p.numel(), p.requires_grad) for p in net.parameters()]


def _describe_cap(cap_bytes: int) -> str:
    return f"{cap_bytes // _MIB} MiB" if cap_bytes % _MIB == 0 else f"{cap_bytes} B"


# --- what a check runs ---------------------------------------------------------------------------


@dataclass(frozen=True)
class _Case:
    """One run of 3 steps inside every rank: the wrapper built with this cap (5.2), or with
    the module alone (5.1, ``cap_bytes`` None)."""

    cap_bytes: int | None

    @property
    def bucket_cap_mb(self) -> float:
        assert self.cap_bytes is not None
        return self.cap_bytes / _MIB  # exact: a power-of-two scaling

    def describe(self) -> str:
        if self.cap_bytes is None:
            return ""
        return (f"bucket cap {_describe_cap(self.cap_bytes)} "
                f"(bucket_cap_mb = {self.cap_bytes} / 2**20)")


@dataclass(frozen=True)
class _Plan:
    """What one check runs: world sizes, the model's widths, the cases in every launch."""

    exercise: DDPExercise
    seed: int
    world_sizes: tuple[int, ...]
    drawn_world_size: int | None
    widths: _Widths
    cases: tuple[_Case, ...]
    drawn_cap: int | None

    @classmethod
    def make(cls, exercise: DDPExercise, world_sizes: Sequence[int], seed: int) -> _Plan:
        sizes = tuple(world_sizes)
        caps = _DOCUMENTED_CAPS if exercise is DDPExercise.BUCKETED_DDP else (None,)
        if seed == 0:
            return cls(exercise, seed, sizes, None, _Widths(), tuple(map(_Case, caps)), None)
        rng = random.Random(seed)
        spare = [n for n in exercise.drawn_world_sizes if n not in sizes]
        extra = rng.choice(spare) if spare else None
        widths = _Widths(rng.choice(_DRAWN_INPUTS), rng.choice(_DRAWN_HIDDEN),
                         rng.choice(_DRAWN_OUTPUTS))
        drawn_cap = None
        if exercise is DDPExercise.BUCKETED_DDP:
            total = sum(n for n, trainable in _parameter_sizes(widths) if trainable)
            drawn_cap = 4 * rng.randint(total // 8, total // 2)  # a few buckets
            caps = (*caps, drawn_cap)
        return cls(exercise, seed, sizes + ((extra,) if extra else ()), extra, widths,
                   tuple(map(_Case, caps)), drawn_cap)

    def note(self) -> str:
        if self.seed == 0:
            return ""
        drawn = [f"world size {self.drawn_world_size}"] if self.drawn_world_size else []
        drawn.append(self.widths.describe())
        if self.drawn_cap is not None:
            drawn.append(f"bucket cap {_describe_cap(self.drawn_cap)}")
        what = ", ".join(drawn[:-1]) + " and " + drawn[-1] if len(drawn) > 1 else drawn[0]
        return f" [seed {self.seed} drew {what}; pass seed={self.seed} to rerun]"


# --- inside every rank ---------------------------------------------------------------------------


class _Phase(enum.Enum):
    """Where a rank is in a training step when a collective is made."""

    SETUP = "setup"
    """Building the wrapper, zeroing gradients, the optimizer step."""
    FORWARD = "forward"
    """Inside ``wrapper(x)``."""
    BACKWARD = "backward"
    """Inside ``loss.backward()``: only the learner's gradient hooks run here."""
    FINISH = "finish"
    """Inside ``finish_gradient_synchronization()``."""


@dataclass(frozen=True)
class _AllReduce:
    """One all-reduce a rank made during a step."""

    numel: int
    async_op: bool | None
    """The ``async_op`` it was made with (None when made without AllreduceOptions)."""
    phase: _Phase
    waited_in_backward: bool
    """True when ``work.wait()`` was called on it before ``loss.backward()`` returned."""
    waited: bool
    """True when its work was waited for (or its future taken) before the step ended."""


@dataclass
class _Launched:
    """An all-reduce as the rank sees it while the step runs (mutable: waits come later)."""

    numel: int
    async_op: bool | None
    phase: _Phase
    work: Any = None
    waited_in_backward: bool = False
    waited: bool = False

    def freeze(self) -> _AllReduce:
        return _AllReduce(self.numel, self.async_op, self.phase, self.waited_in_backward,
                          self.waited)


@dataclass
class _Log:
    """The all-reduces of the current step, and the phase the step is in."""

    phase: _Phase = _Phase.SETUP
    calls: list[_Launched] = field(default_factory=list)


@contextlib.contextmanager
def _watched_all_reduces() -> Iterator[_Log]:
    """Inside: every ``ProcessGroup.allreduce`` (what ``dist.all_reduce`` calls, however the
    learner reached it) is logged with its numel, its ``async_op`` and the phase, and every
    ``Work.wait`` (``synchronize``, ``get_future``) on one of them is noted, with whether
    backward was still running. Restored on exit."""
    log = _Log()
    group_class, work_class = distributed_c10d.ProcessGroup, distributed_c10d.Work
    saved = [(owner, name, getattr(owner, name)) for owner, name in (
        (group_class, "allreduce"), (group_class, "allreduce_coalesced"),
        (work_class, "wait"), (work_class, "synchronize"), (work_class, "get_future"))]

    def logged(original: Callable[..., Any]) -> Callable[..., Any]:
        def allreduce(self: Any, tensors: Any, *args: Any, **kwargs: Any) -> Any:
            listed = tensors if isinstance(tensors, (list, tuple)) else [tensors]
            opts = args[0] if args else kwargs.get("opts")
            async_op = getattr(opts, "asyncOp", None)  # None: called without options
            call = _Launched(sum(t.numel() for t in listed), async_op, log.phase)
            log.calls.append(call)
            call.work = original(self, tensors, *args, **kwargs)
            return call.work

        return allreduce

    def watched(original: Callable[..., Any], blocks: bool) -> Callable[..., Any]:
        def wait(self: Any, *args: Any, **kwargs: Any) -> Any:
            # A wait made by dist.all_reduce itself: it was called with async_op=False (how
            # torch 2.4 shows it: its AllreduceOptions have no asyncOp).
            by_torch = sys._getframe(1).f_globals.get("__name__") == distributed_c10d.__name__
            for call in log.calls:
                if call.work is self:
                    call.waited = True
                    call.waited_in_backward |= blocks and log.phase is _Phase.BACKWARD
                    if by_torch and call.async_op is None:
                        call.async_op = False
            return original(self, *args, **kwargs)

        return wait

    try:
        for owner, name, original in saved:
            setattr(owner, name, logged(original) if owner is group_class
                    else watched(original, blocks=name != "get_future"))
        yield log
    finally:
        for owner, name, original in reversed(saved):
            setattr(owner, name, original)


@dataclass(frozen=True)
class _StepRecord:
    """What a rank saw in one step: gradients after synchronising (None where ``.grad`` was
    None), every parameter and buffer after the optimizer step, the all-reduces made."""

    grads: dict[str, torch.Tensor | None]
    state: dict[str, torch.Tensor]
    all_reduces: tuple[_AllReduce, ...]


@dataclass(frozen=True)
class _CaseRecord:
    """One case on one rank: the state right after the wrapper was built, then each step."""

    problem: str
    initial: dict[str, torch.Tensor]
    steps: tuple[_StepRecord, ...]


def _train(rank: int, world_size: int, wrapper_class: type, exercise: DDPExercise,
           case: _Case, widths: _Widths, seed: int, log: _Log) -> _CaseRecord:
    net = _build_net(widths, _init_seed(seed, rank))
    x, y = (_shard(t, rank, world_size) for t in _batch(seed, widths))
    log.phase, log.calls = _Phase.SETUP, []
    wrapper = (wrapper_class(net) if case.cap_bytes is None
               else wrapper_class(net, case.bucket_cap_mb))
    module = getattr(wrapper, "module", None)
    if not isinstance(module, nn.Module):
        return _CaseRecord(
            f"{exercise.class_name}(module) must keep the model it wraps as self.module "
            f"(got {type(module).__name__}).", {}, ())
    initial = _snapshot(module)
    optimizer = _SGD(module)
    steps = []
    for _ in range(STEPS):
        optimizer.zero_grad()
        log.calls = []
        log.phase = _Phase.FORWARD
        loss = _loss(wrapper(x), y)
        log.phase = _Phase.BACKWARD
        loss.backward()
        log.phase = _Phase.FINISH
        wrapper.finish_gradient_synchronization()
        log.phase = _Phase.SETUP
        grads = {name: None if p.grad is None else p.grad.detach().clone()
                 for name, p in module.named_parameters()}
        optimizer.step()
        steps.append(_StepRecord(grads, _snapshot(module),
                                 tuple(call.freeze() for call in log.calls)))
    return _CaseRecord("", initial, tuple(steps))


def _rank_run(rank: int, world_size: int, wrapper_class: type, exercise: DDPExercise,
              cases: tuple[_Case, ...], widths: _Widths, seed: int) -> list[_CaseRecord]:
    """Runs every case on this rank with the all-reduces watched."""
    records = []
    with _watched_all_reduces() as log:
        for index, case in enumerate(cases):
            try:
                records.append(_train(rank, world_size, wrapper_class, exercise, case, widths,
                                      seed, log))
            except BaseException as exc:
                if hasattr(exc, "add_note"):  # Python 3.11+; without it the case goes unnamed
                    exc.add_note(f"{CASE_NOTE} {index}")
                raise
    return records


# --- the single-process reference ----------------------------------------------------------------


@dataclass(frozen=True)
class _Reference:
    """One process on the full batch, from rank 0's initialisation: the state before the first
    step, and after each step the gradients (trainable parameters) and the state."""

    initial: dict[str, torch.Tensor]
    grads: tuple[dict[str, torch.Tensor], ...]
    states: tuple[dict[str, torch.Tensor], ...]

    @classmethod
    def make(cls, widths: _Widths, seed: int) -> _Reference:
        net = _build_net(widths, _init_seed(seed, 0))
        x, y = _batch(seed, widths)
        optimizer = _SGD(net)
        initial, grads, states = _snapshot(net), [], []
        for _ in range(STEPS):
            optimizer.zero_grad()
            _loss(net(x), y).backward()
            grads.append({n: p.grad.clone() for n, p in net.named_parameters() if p.requires_grad})
            optimizer.step()
            states.append(_snapshot(net))
        return cls(initial, tuple(grads), tuple(states))

    def before(self, step: int) -> dict[str, torch.Tensor]:
        return self.initial if step == 0 else self.states[step - 1]


def _local_grads(widths: _Widths, seed: int, state: dict[str, torch.Tensor], rank: int,
                 world_size: int) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s own gradients, from ``state``, before any averaging."""
    net = _build_net(widths, 0)
    with torch.no_grad():
        for name, t in [*net.named_parameters(), *net.named_buffers()]:
            t.copy_(state[name])
    x, y = (_shard(t, rank, world_size) for t in _batch(seed, widths))
    _loss(net(x), y).backward()
    return {n: p.grad for n, p in net.named_parameters() if p.requires_grad}


# --- judging values ------------------------------------------------------------------------------


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.allclose(a, b, rtol=RTOL, atol=ATOL)


def _what(name: str) -> str:
    if name == "frozen":
        return "the frozen parameter 'frozen'"
    if name == "scale":
        return "the buffer 'scale'"
    return f"'{name}'"


def _judge_initial(plan: _Plan, reference: _Reference, records: Sequence[_CaseRecord]) -> str:
    """After construction every rank must hold rank 0's initial parameters and buffers."""
    n = len(records)
    owns = {0: reference.initial}
    for name, want in reference.initial.items():
        for r, record in enumerate(records):
            got = record.initial[name]
            if _close(got, want):
                continue
            if r not in owns:
                owns[r] = _snapshot(_build_net(plan.widths, _init_seed(plan.seed, r)))
            if r > 0 and _close(got, owns[r][name]):
                also = {"frozen": " (frozen parameters too: every rank must start from the "
                                  "same model)",
                        "scale": " (buffers too: module.buffers(), used in forward)"}
                return (f"rank {r} still has its own initial values of {_what(name)}: "
                        "broadcast every parameter and buffer from rank 0 in __init__"
                        f"{also.get(name, '')}, e.g. dist.broadcast(t, src=0).")
            if r == 0 and n > 1:
                return (f"rank 0's {_what(name)} changed in __init__: rank 0 is the source of "
                        "the broadcast (src=0), its values must stay as they are.")
            return (f"rank {r}'s {_what(name)} after __init__ is neither rank 0's nor its own: "
                    "broadcast every parameter and buffer from rank 0 (src=0), in place.")
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
    disagree = [q for q, other in enumerate(others) if other is not None
                and not _close(got, other)]
    if disagree:
        return (f"ranks disagree: rank {r} and rank {disagree[0]} hold different {name}.grad; "
                "every rank must end with the same mean.")
    return f"rank {r}: {name}.grad is not the mean over ranks of the ranks' gradients."


def _judge_step(plan: _Plan, reference: _Reference, records: Sequence[_CaseRecord],
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
                return _local_grads(plan.widths, plan.seed, state, r, n)[name]

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
                        "touched): leave parameters with requires_grad=False alone.")
            disagree = [q for q, other in enumerate(records)
                        if not _close(got, other.steps[step].state[name])]
            if disagree:
                return (f"ranks disagree: rank {r} and rank {disagree[0]} hold different "
                        f"{_what(name)} after the optimizer step, though the gradients were "
                        "right.")
            return (f"rank {r}: {_what(name)} differs from one process after the optimizer "
                    "step, though the gradients were right: change only p.grad, and leave "
                    "the update to the optimizer.")
    return ""


# --- judging the all-reduces of 5.2 --------------------------------------------------------------


def _numels(values: Sequence[int]) -> str:
    return ", ".join(map(str, values))


def _judge_overlap(calls: Sequence[_AllReduce]) -> str:
    """Every all-reduce must be launched asynchronously from a hook, and none waited for while
    backward still runs."""
    if not calls:
        return ""
    late = [c for c in calls if c.phase is not _Phase.BACKWARD]
    if late:
        where = ("in finish_gradient_synchronization(), after loss.backward() returned"
                 if all(c.phase is _Phase.FINISH for c in late) else
                 "outside loss.backward()")
        late_numels = _numels([c.numel for c in late])
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


def _judge_buckets(sizes: Sequence[tuple[int, bool]], case: _Case,
                   calls: Sequence[_AllReduce]) -> str:
    assert case.cap_bytes is not None
    expected = _bucket_numels(sizes, case.cap_bytes)
    got = [c.numel for c in calls]
    if got == expected:
        return ""
    want = (f"expected {len(expected)} all-reduce(s) of {_numels(expected)} elements in this "
            f"order (one per bucket: the trainable parameters in reverse registration order, "
            f"a bucket closed once it holds bucket_cap_mb * 2**20 = {case.cap_bytes} "
            f"byte{'s' if case.cap_bytes > 1 else ''} or more), got {len(got)} of "
            f"{_numels(got) or 'none'}")
    for rule in _Rule:
        if rule is not _Rule.RIGHT and _bucket_numels(sizes, case.cap_bytes, rule) == got:
            return f"{want}: {rule.hint}"
    if sorted(got) == sorted(expected):
        return (f"{want}: the right buckets, launched out of bucket order. A bucket that is "
                "full early (here 'gain', whose gradient backward produces first although it "
                "sits in the last bucket) must wait until every bucket before it has been "
                "launched: all ranks must make their collectives in the same order.")
    return f"{want}."


def _judge_case(plan: _Plan, reference: _Reference, sizes: Sequence[tuple[int, bool]],
                case: _Case, records: Sequence[_CaseRecord]) -> str:
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
                      judge: Callable[[Sequence[_AllReduce]], str]) -> str:
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


def _where(n: int, case: _Case | None) -> str:
    described = case.describe() if case is not None else ""
    return f"with {n} rank(s), {described}" if described else f"with {n} rank(s)"


def _explain_error(plan: _Plan, n: int, err: RankError) -> str:
    named = failing_rank(err)
    rank, tb = named.rank, named.traceback
    found = re.search(re.escape(CASE_NOTE) + r" (\d+)", tb)
    case = plan.cases[int(found.group(1))] if found else None
    hint = next((h for key, h in _ERROR_HINTS if key in tb), "")
    return (f"{_where(n, case)}: rank {rank} raised {err.exc_type}.{hint}\n"
            f"{clean_traceback(tb, __file__)}")


def _explain_timeout(n: int, err: LaunchTimeout, timeout: float) -> str:
    verdict, where = explain_hang(n, err, timeout)
    if verdict is not None:
        return verdict
    ranks = ", ".join(map(str, err.ranks))
    return (f"with {n} rank(s), rank(s) {ranks} hung for {timeout:g} s.{where} A rank waits "
            "forever in a collective that a peer never makes: every rank must make the same "
            "collectives (broadcasts in __init__, one all-reduce per parameter or bucket) in "
            "the same order.")


# --- the checks ------------------------------------------------------------------------------


def _validate(exercise: DDPExercise, wrapper_class: object, world_sizes: object, seed: object,
              timeout: object) -> None:
    if not isinstance(wrapper_class, type):
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
    plan = _Plan.make(exercise, world_sizes, seed)

    def fail(message: str) -> CheckResult:
        return report(CheckResult(exercise.title, False, message + plan.note()))

    problem = _interface_problem(exercise, wrapper_class)
    if problem:
        return fail(problem)
    reference = _Reference.make(plan.widths, seed)
    sizes = _parameter_sizes(plan.widths)
    for n in plan.world_sizes:
        try:
            # gloo even where there are GPUs: the check model lives on the CPU.
            results = launch(_rank_run, n, args=(wrapper_class, exercise, plan.cases,
                                                 plan.widths, seed),
                             backend="gloo", timeout=timeout, echo=False,
                             failure_grace=CHECK_FAILURE_GRACE_S)
        except RankError as err:
            return fail(_explain_error(plan, n, err))
        except LaunchTimeout as err:
            return fail(_explain_timeout(n, err, timeout))
        for index, case in enumerate(plan.cases):
            wrong = _judge_case(plan, reference, sizes, case,
                                [per_rank[index] for per_rank in results])
            if wrong:
                return fail(wrong)
    ranks = ", ".join(map(str, plan.world_sizes))
    message = (f"parameters match one process on the full batch on {ranks} rank(s), after "
               f"each of {STEPS} steps (tied weights, a frozen parameter and a buffer "
               "included)")
    if exercise is DDPExercise.BUCKETED_DDP:
        caps = [_describe_cap(c.cap_bytes) for c in plan.cases if c.cap_bytes is not None]
        counts = [str(len(_bucket_numels(sizes, c.cap_bytes))) for c in plan.cases
                  if c.cap_bytes is not None]
        message = (f"parameters match one process on the full batch on {ranks} rank(s); "
                   f"bucket caps of {_and(caps)} gave {_and(counts)} all-reduces per step, in "
                   "bucket order, all launched asynchronously during backward")
    return report(CheckResult(exercise.title, True, f"{message}.{plan.note()}"))


def _and(items: Sequence[str]) -> str:
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


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
