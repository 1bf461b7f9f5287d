"""What the checks of chapter 5 run, and the answers the parent computes on its own: the check
model (see :mod:`labs.checks.ddp`), its batch and its optimizer, the cases and what a seed
draws, one process trained on the full batch (the oracle of the whole chapter), and the
bucket rule of exercise 5.2 with the usual mistakes made with it.
"""

from __future__ import annotations

import enum
import hashlib
import random
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from labs.checks.core import CheckPlan, with_drawn_world_size
from labs.checks.exercises import spec

#: Samples in the check's batch: lcm(1..8), so every world size up to 8 gets an equal shard.
BATCH = 840
#: The largest world size the checks accept (the batch must split equally).
MAX_CHECK_WORLD_SIZE = 8
#: SGD steps each case trains.
STEPS = 3
_LR, _MOMENTUM = 0.1, 0.9
MIB = 2**20
#: The documented bucket caps of check 5.2, in bytes: one parameter per bucket, a cap that
#: a bucket reaches exactly (it closes at >=), and one bucket for everything.
_DOCUMENTED_CAPS = (1, 400, 25 * MIB)


class DDPExercise(enum.Enum):
    """The exercises of chapter 5 that these checks run."""

    #: ``SimpleDDP(module)``: broadcast, then average every gradient after backward.
    SIMPLE_DDP = "5.1"
    #: ``BucketedDDP(module, bucket_cap_mb)``: buckets all-reduced during backward.
    BUCKETED_DDP = "5.2"

    @property
    def class_name(self) -> str:
        return spec(self.value).function

    @property
    def check_name(self) -> str:
        return spec(self.value).check

    @property
    def title(self) -> str:
        return spec(self.value).title

    @property
    def arguments(self) -> tuple[str, ...]:
        """The constructor's arguments, as the check passes them (positionally)."""
        return spec(self.value).parameters

    @property
    def drawn_world_sizes(self) -> tuple[int, ...]:
        """A non-zero seed adds one of these (the documented sizes stop at 4, or at 3)."""
        return (5, 6) if self is DDPExercise.SIMPLE_DDP else (4, 5)


# --- the check model ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Widths:
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


class CheckNet(nn.Module):
    """The check model (see :mod:`labs.checks.ddp`): tied weights, a frozen parameter, a buffer,
    and a parameter registered first whose gradient is ready first."""

    def __init__(self, widths: Widths) -> None:
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


def init_seed(seed: int, rank: int) -> int:
    """The seed of rank ``rank``'s initial model: one-way (BLAKE2b), so that a rank given its
    own cannot work out the check's seed, nor another rank's."""
    digest = hashlib.blake2b(f"ddp-init {seed} {rank}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % (1 << 62)


def build_net(widths: Widths, init_seed: int) -> CheckNet:
    """The check model initialised from ``init_seed``, leaving the caller's RNG as it was."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(init_seed)
        return CheckNet(widths)


def full_batch(seed: int, widths: Widths) -> tuple[torch.Tensor, torch.Tensor]:
    """The full batch: inputs (BATCH, I) and targets (BATCH, O)."""
    generator = torch.Generator().manual_seed(7919 * seed + 17)
    x = torch.randn(BATCH, widths.inputs, generator=generator)
    y = torch.randn(BATCH, widths.outputs, generator=generator)
    return x, y


def batch_shard(tensor: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    per = BATCH // world_size
    return tensor[rank * per:(rank + 1) * per]


def check_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(output, target)


class SGD:
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


def snapshot(module: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter (tied ones once) and buffer, by name, copied."""
    return {name: t.detach().clone()
            for name, t in [*module.named_parameters(), *module.named_buffers()]}


# --- the bucket rule ---------------------------------------------------------------------------


class Rule(enum.Enum):
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
            Rule.REGISTRATION_ORDER: "these are the buckets of module.parameters() in "
            "registration order; walk them in REVERSE (reversed(list(...))), the order in "
            "which backward produces their gradients.",
            Rule.STRICTLY_MORE: "these buckets close only once they hold MORE than the cap; "
            "close a bucket once it holds bucket_cap_mb * 2**20 bytes or more (>=).",
            Rule.BEFORE_APPEND: "these buckets close before a parameter that would overflow "
            "them; append the parameter first, then close the bucket if it holds "
            "bucket_cap_mb * 2**20 bytes or more.",
            Rule.ELEMENTS: "these buckets count elements, not bytes; a bucket's size is "
            "sum(p.numel() * p.element_size()) bytes, compared with bucket_cap_mb * 2**20.",
            Rule.FROZEN_INCLUDED: "these buckets include the frozen parameter; bucket only "
            "parameters with requires_grad=True (a frozen one never gets a gradient).",
        }.get(self, "")


def bucket_numels(sizes: Sequence[tuple[int, bool]], cap_bytes: int, rule: Rule = Rule.RIGHT,
                   element_size: int = 4) -> list[int]:
    """The numel of each bucket, in bucket order, for parameters of ``(numel, trainable)`` in
    registration order: walk the trainable ones in reverse, append each to the open bucket,
    close it once it holds ``cap_bytes`` or more. ``rule`` makes one of the usual mistakes."""
    chosen = [numel for numel, trainable in sizes if trainable or rule is Rule.FROZEN_INCLUDED]
    if rule is not Rule.REGISTRATION_ORDER:
        chosen.reverse()
    unit = 1 if rule is Rule.ELEMENTS else element_size
    buckets: list[int] = []
    open_ = 0  # elements in the open bucket
    for numel in chosen:
        if rule is Rule.BEFORE_APPEND:  # closes a bucket only when the next one overflows it
            if open_ and (open_ + numel) * unit > cap_bytes:
                buckets.append(open_)
                open_ = 0
            open_ += numel
            continue
        open_ += numel
        if (open_ * unit > cap_bytes if rule is Rule.STRICTLY_MORE
                else open_ * unit >= cap_bytes):
            buckets.append(open_)
            open_ = 0
    if open_:
        buckets.append(open_)
    return buckets


def parameter_sizes(widths: Widths) -> list[tuple[int, bool]]:
    """``(numel, trainable)`` of the check model's parameters in registration order."""
    net = build_net(widths, 0)
    return [(p.numel(), p.requires_grad) for p in net.parameters()]


def describe_cap(cap_bytes: int) -> str:
    return f"{cap_bytes // MIB} MiB" if cap_bytes % MIB == 0 else f"{cap_bytes} B"


# --- what a check runs ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    """One run of 3 steps inside every rank: the wrapper built with this cap (5.2), or with
    the module alone (5.1, ``cap_bytes`` None)."""

    cap_bytes: int | None

    @property
    def bucket_cap_mb(self) -> float:
        assert self.cap_bytes is not None
        return self.cap_bytes / MIB  # exact: a power-of-two scaling

    def describe(self) -> str:
        if self.cap_bytes is None:
            return ""
        return (f"bucket cap {describe_cap(self.cap_bytes)} "
                f"(bucket_cap_mb = {self.cap_bytes} / 2**20)")


@dataclass(frozen=True)
class Plan(CheckPlan):
    """What one check runs: world sizes, the model's widths, the cases in every launch."""

    exercise: DDPExercise
    widths: Widths
    cases: tuple[Case, ...]
    drawn_cap: int | None

    @classmethod
    def make(cls, exercise: DDPExercise, world_sizes: Sequence[int], seed: int) -> Plan:
        caps = _DOCUMENTED_CAPS if exercise is DDPExercise.BUCKETED_DDP else (None,)
        if seed == 0:
            return cls(seed, tuple(world_sizes), None, exercise, Widths(),
                       tuple(map(Case, caps)), None)
        rng = random.Random(seed)
        sizes, extra = with_drawn_world_size(world_sizes, rng, exercise.drawn_world_sizes)
        widths = Widths(rng.choice(_DRAWN_INPUTS), rng.choice(_DRAWN_HIDDEN),
                        rng.choice(_DRAWN_OUTPUTS))
        drawn_cap = None
        if exercise is DDPExercise.BUCKETED_DDP:
            total = sum(n for n, trainable in parameter_sizes(widths) if trainable)
            drawn_cap = 4 * rng.randint(total // 8, total // 2)  # a few buckets
            caps = (*caps, drawn_cap)
        return cls(seed, sizes, extra, exercise, widths, tuple(map(Case, caps)), drawn_cap)

    def draws(self) -> list[str]:
        drawn = [self.widths.describe()]
        if self.drawn_cap is not None:
            drawn.append(f"bucket cap {describe_cap(self.drawn_cap)}")
        return drawn


# --- the single-process reference ----------------------------------------------------------------


@dataclass(frozen=True)
class Reference:
    """One process on the full batch, from rank 0's initialisation: the state before the first
    step, and after each step the gradients (trainable parameters) and the state."""

    initial: dict[str, torch.Tensor]
    grads: tuple[dict[str, torch.Tensor], ...]
    states: tuple[dict[str, torch.Tensor], ...]

    @classmethod
    def make(cls, widths: Widths, seed: int) -> Reference:
        net = build_net(widths, init_seed(seed, 0))
        x, y = full_batch(seed, widths)
        optimizer = SGD(net)
        initial, grads, states = snapshot(net), [], []
        for _ in range(STEPS):
            optimizer.zero_grad()
            check_loss(net(x), y).backward()
            grads.append({n: p.grad.clone() for n, p in net.named_parameters() if p.requires_grad})
            optimizer.step()
            states.append(snapshot(net))
        return cls(initial, tuple(grads), tuple(states))

    def before(self, step: int) -> dict[str, torch.Tensor]:
        return self.initial if step == 0 else self.states[step - 1]


def local_grads(widths: Widths, seed: int, state: dict[str, torch.Tensor], rank: int,
                 world_size: int) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s own gradients, from ``state``, before any averaging."""
    net = build_net(widths, 0)
    with torch.no_grad():
        for name, t in [*net.named_parameters(), *net.named_buffers()]:
            t.copy_(state[name])
    x, y = (batch_shard(t, rank, world_size) for t in full_batch(seed, widths))
    check_loss(net(x), y).backward()
    return {n: p.grad for n, p in net.named_parameters() if p.requires_grad}
