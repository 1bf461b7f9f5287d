"""What the checks of chapter 9's exercises run, and the answers the parent computes on its
own: the exercises, the cases and what a seed draws, and the references.

* 9.1 (finding a desync): each case is one process group's collective logs, one per rank, as
  ``launch(..., check_collectives=True)`` records them (:class:`labs.collective_check.
  CollectiveCall`: seq, op, shape, dtype, root and the call site ``where``), written by hand
  from one small training script (:func:`program`) that one or more ranks departed from
  (:class:`Fault`). The reference (:func:`expected_desync`) reads the logs column by column:
  it shares no code with :func:`labs.experiments.faults.first_desync`, the chapter's own
  answer.
* 9.2 (one step of a join for uneven data): every rank trains :func:`join_model` on its own
  number of batches. The reference is one process that, at each step, takes the gradient of
  ``mse_loss(model(x), y)`` for each rank that still has a batch, their mean, and a plain SGD
  step (:func:`join_reference`).
"""

from __future__ import annotations

import dataclasses
import enum
import random
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from labs.checks.core import CaseKeys, CheckPlan, and_listed, listed, with_drawn_world_size
from labs.checks.exercises import ExerciseRow
from labs.collective_check import CollectiveCall

#: What 9.1 answers where the logs differ: the 1-based sequence number, then each distinct
#: entry there (None: the log had ended) with the ranks whose log holds it, ascending.
Desync = tuple[int, dict[CollectiveCall | None, tuple[int, ...]]]


class FaultsExercise(ExerciseRow, enum.Enum):
    """The exercises of chapter 9."""

    #: ``find_desync(logs) -> None | (k, sides)``: the first collective at which the ranks'
    #: logs differ, and who issued what there.
    FIND_DESYNC = "9.1"
    #: ``join_step(model, batch, lr) -> bool``: one step of every rank under a join protocol,
    #: ``batch`` None on a rank that has run out.
    JOIN_STEP = "9.2"


# --- 9.1: the training script every log comes from ------------------------------------------


def site(line: int, function: str, code: str) -> str:
    """A call site as :mod:`labs.collective_check` writes it."""
    return f'File "train.py", line {line}, in {function}\n    {code}'


def _entry(op: str, shape: tuple[int, ...] | None, dtype: str | None, root: int | None,
           where: str) -> CollectiveCall:
    """An entry not yet numbered (seq 0): :func:`numbered` gives it its place."""
    return CollectiveCall(0, op, shape, dtype, root, where)


_BROADCAST = site(23, "setup", "dist.broadcast(param, src=source)")
_ENCODER = _entry("all_reduce", (8, 8), "float32", None,
                  site(41, "step", "dist.all_reduce(model.encoder.weight.grad)"))
#: The same shape as the encoder's, one line further: two of them swapped agree in every field
#: but the call site.
_DECODER = _entry("all_reduce", (8, 8), "float32", None,
                  site(42, "step", "dist.all_reduce(model.decoder.weight.grad)"))
_LOSS = _entry("all_reduce", (1,), "float32", None, site(44, "step", "dist.all_reduce(loss)"))
_SAVE = _entry("barrier", None, None, None, site(57, "save_checkpoint", "dist.barrier()"))
#: What one rank issues after everything else, under an ``if rank == 0:``.
_EXTRA = _entry("barrier", None, None, None, site(61, "main", "dist.barrier()"))


def program(steps: int) -> list[CollectiveCall]:
    """What every rank of the script issues, in order, not yet numbered: two broadcasts of the
    initial weights from rank 0, then per step the encoder's and the decoder's gradient
    all-reduces (the same shape) and the loss's, then a barrier before saving: 3 + 3 x steps
    collectives."""
    return [_entry("broadcast", (8, 8), "float32", 0, _BROADCAST),
            _entry("broadcast", (8,), "float32", 0, _BROADCAST),
            *[e for _ in range(steps) for e in (_ENCODER, _DECODER, _LOSS)], _SAVE]


def numbered(entries: Sequence[CollectiveCall]) -> tuple[CollectiveCall, ...]:
    """The log of a rank that issued ``entries``: the k-th has seq k."""
    return tuple(dataclasses.replace(e, seq=k) for k, e in enumerate(entries, 1))


class Fault(enum.Enum):
    """How one rank departs from the script at collective ``seq`` (:class:`Change`)."""

    #: It skipped collective ``seq`` (an ``if`` on something only it saw): its later entries
    #: shift one place earlier.
    SKIP = "skip"
    #: It issued ``seq`` and ``seq + 1``, two all-reduces of one shape, in the other order:
    #: only the call sites tell them apart.
    SWAP = "swap"
    #: Its collective ``seq`` has another shape (a tensor one element short).
    SHAPE = "shape"
    #: Its collective ``seq`` has another dtype (bfloat16 where the others have float32).
    DTYPE = "dtype"
    #: Its collective ``seq`` is a reduce to rank 0 where the others all-reduce (an older
    #: train.py on that rank).
    OP = "op"
    #: Its broadcast ``seq`` comes from src 1 where the others' come from 0.
    ROOT = "root"
    #: Its log ended before collective ``seq``: it died, or hung before issuing it.
    ENDED = "ended"
    #: It issued one collective more at the end.
    EXTRA = "extra"


@dataclass(frozen=True)
class Change:
    """Rank ``rank`` departs from the script by ``fault`` at collective ``seq``."""

    fault: Fault
    rank: int
    seq: int = 0

    def apply(self, entries: list[CollectiveCall]) -> list[CollectiveCall]:
        i = self.seq - 1
        e = entries[i] if 0 <= i < len(entries) else None
        if self.fault is Fault.SKIP:
            return entries[:i] + entries[i + 1:]
        if self.fault is Fault.SWAP:
            return entries[:i] + [entries[i + 1], entries[i]] + entries[i + 2:]
        if self.fault is Fault.ENDED:
            return entries[:i]
        if self.fault is Fault.EXTRA:
            return [*entries, _EXTRA]
        assert e is not None and e.shape is not None
        if self.fault is Fault.SHAPE:
            changed = dataclasses.replace(e, shape=(*e.shape[:-1], e.shape[-1] - 1 or 2))
        elif self.fault is Fault.DTYPE:
            changed = dataclasses.replace(e, dtype="bfloat16")
        elif self.fault is Fault.OP:
            changed = dataclasses.replace(e, op="reduce", root=0, where=e.where.replace(
                "dist.all_reduce(", "dist.reduce(").replace(")", ", dst=0)"))
        else:  # Fault.ROOT
            changed = dataclasses.replace(e, root=1)
        return [*entries[:i], changed, *entries[i + 1:]]

    def describe(self) -> str:
        r, k = self.rank, self.seq
        return {
            Fault.SKIP: f"rank {r} skipped collective {k}",
            Fault.SWAP: f"rank {r} issued collectives {k} and {k + 1}, two all-reduces of one "
                        "shape, in the other order",
            Fault.SHAPE: f"rank {r}'s collective {k} has another shape",
            Fault.DTYPE: f"rank {r}'s collective {k} has another dtype",
            Fault.OP: f"rank {r}'s collective {k} is a reduce, not an all-reduce",
            Fault.ROOT: f"rank {r}'s broadcast {k} comes from another src",
            Fault.ENDED: (f"rank {r} died or hung after collective {k - 1}" if k > 1
                          else f"rank {r} issued no collective at all"),
            Fault.EXTRA: f"rank {r} issued one collective more at the end",
        }[self.fault]


@dataclass(frozen=True)
class DesyncCase:
    """One call of 9.1: every rank's log (``logs[r]``, seq 1, 2, ...), and what happened."""

    what: str
    """What the ranks did, in words: ``rank 2 skipped collective 5``."""
    logs: tuple[tuple[CollectiveCall, ...], ...]

    def describe(self) -> str:
        """``4 ranks, rank 2 skipped collective 5``."""
        return f"{len(self.logs)} ranks, {self.what}"

    @classmethod
    def build(cls, world_size: int, steps: int, *changes: Change) -> DesyncCase:
        """``world_size`` ranks running :func:`program` of ``steps`` steps, with ``changes``."""
        logs = []
        for rank in range(world_size):
            entries = program(steps)
            for change in (c for c in changes if c.rank == rank):
                entries = change.apply(entries)
            logs.append(numbered(entries))
        what = and_listed([c.describe() for c in changes]) if changes else "the logs agree"
        return cls(what, tuple(logs))

    @classmethod
    def empty(cls, world_size: int) -> DesyncCase:
        return cls("every log empty", ((),) * world_size)


#: 9.1's documented cases: from 2 to 8 ranks, one fault of each kind, three sides at once,
#: logs that agree and empty logs.
DESYNC_CASES = (
    DesyncCase.build(2, 2),
    DesyncCase.build(4, 2, Change(Fault.SKIP, 2, 5)),
    DesyncCase.build(3, 2, Change(Fault.SWAP, 1, 6)),
    DesyncCase.build(2, 1, Change(Fault.SHAPE, 1, 3)),
    DesyncCase.build(5, 2, Change(Fault.DTYPE, 3, 5)),
    DesyncCase.build(3, 2, Change(Fault.OP, 0, 4)),
    DesyncCase.build(4, 1, Change(Fault.ROOT, 3, 2)),
    DesyncCase.build(6, 2, Change(Fault.ENDED, 4, 6)),
    DesyncCase.build(7, 1, Change(Fault.EXTRA, 0)),
    DesyncCase.build(8, 2, Change(Fault.SKIP, 2, 4), Change(Fault.SKIP, 5, 4),
                     Change(Fault.SHAPE, 7, 4)),
    DesyncCase.build(2, 1, Change(Fault.ENDED, 1, 1)),
    DesyncCase.empty(3),
)


def _drawn_case(rng: random.Random) -> DesyncCase:
    """2 to 8 ranks, 1 to 3 steps, and one fault (or none) of one rank, where it can happen."""
    n, steps = rng.randint(2, 8), rng.randint(1, 3)
    fault = rng.choice([None, *Fault])
    if fault is None:
        return DesyncCase.build(n, steps)
    length = 3 + 3 * steps
    places = {  # the collectives each fault can change: 1-based, in the script
        Fault.SKIP: range(1, length + 1), Fault.ENDED: range(1, length + 1),
        Fault.SWAP: range(3, length - 1, 3), Fault.ROOT: range(1, 3), Fault.EXTRA: range(0, 1),
        Fault.SHAPE: range(1, length), Fault.DTYPE: range(1, length),
        Fault.OP: range(3, length),
    }[fault]
    return DesyncCase.build(n, steps, Change(fault, rng.randrange(n), rng.choice(places)))


@dataclass(frozen=True)
class DesyncPlan(CheckPlan):
    """What one check of 9.1 runs (a pure function: no world sizes)."""

    drawn: tuple[DesyncCase, ...]

    @classmethod
    def make(cls, seed: int) -> DesyncPlan:
        if seed == 0:
            return cls(seed, (), None, ())
        rng = random.Random(seed)
        return cls(seed, (), None, tuple(_drawn_case(rng) for _ in range(3)))

    @property
    def cases(self) -> tuple[DesyncCase, ...]:
        return (*DESYNC_CASES, *self.drawn)

    def draws(self) -> list[str]:
        return [f"logs of {len(case.logs)} ranks ({case.what})" for case in self.drawn]


def expected_desync(logs: Sequence[Sequence[CollectiveCall]]) -> Desync | None:
    """9.1's answer, column by column: every log padded with None to the longest, the first
    column that holds two different values, and each of its values with the ranks holding
    it."""
    longest = max((len(log) for log in logs), default=0)
    for k in range(1, longest + 1):
        column = [log[k - 1] if k <= len(log) else None for log in logs]
        if any(entry != column[0] for entry in column):
            return k, {entry: tuple(r for r, e in enumerate(column) if e == entry)
                       for entry in dict.fromkeys(column)}
    return None


# --- 9.2: one step of a join ----------------------------------------------------------------

#: 9.2's learning rate, and the rows of every batch.
JOIN_LR, JOIN_ROWS = 0.1, 3
#: The check model: Linear(4, 3), Tanh, Linear(3, 2).
JOIN_WIDTHS = (4, 3, 2)
#: 9.2's tolerance: the ranks add their gradients in the all-reduce's order, the reference in
#: rank order.
JOIN_RTOL, JOIN_ATOL = 1e-5, 1e-6
#: How many batches each rank holds, by world size: one rank short, one rank with none at all
#: (it joins before the first step), every rank alike.
DOCUMENTED_BATCHES = {2: (3, 1), 3: (2, 0, 4), 4: (2, 2, 2, 2)}
_DRAWN_WORLD_SIZES = (5, 6)


def batch_counts(world_size: int) -> tuple[int, ...]:
    """Each rank's number of batches: the documented ones, or on another world size a fixed
    pattern of 0 to 4 (one rank with 2 on a world of 1)."""
    return DOCUMENTED_BATCHES.get(world_size,
                                  tuple((3 * r + 2) % 5 for r in range(world_size)))


def describe_batches(counts: Sequence[int]) -> str:
    """``3 rank(s) holding 2, 0, 4 batch(es)``."""
    return f"{len(counts)} rank(s) holding {listed(counts)} batch(es)"


@dataclass(frozen=True)
class JoinPlan(CheckPlan):
    """What one check of 9.2 runs: the world sizes, and each one's batches per rank."""

    batches: tuple[tuple[int, ...], ...]
    """``batches[i][r]``: how many batches rank r holds on ``world_sizes[i]`` ranks."""
    drawn: tuple[int, ...] = ()
    """The counts the seed drew (for the drawn world size, or, when every candidate was
    passed already, for the last one)."""

    @classmethod
    def make(cls, world_sizes: Sequence[int], seed: int) -> JoinPlan:
        counts = [batch_counts(n) for n in world_sizes]
        if seed == 0:
            return cls(seed, tuple(world_sizes), None, tuple(counts))
        rng = random.Random(seed)
        sizes, extra = with_drawn_world_size(world_sizes, rng, _DRAWN_WORLD_SIZES)
        n = extra or sizes[-1]
        drawn = [rng.randint(0, 4) for _ in range(n)]
        drawn[rng.randrange(n)] = rng.randint(1, 4)  # somebody trains
        counts = counts + [tuple(drawn)] if extra else counts[:-1] + [tuple(drawn)]
        return cls(seed, sizes, extra, tuple(counts), tuple(drawn))

    def counts(self, world_size: int) -> tuple[int, ...]:
        return self.batches[self.world_sizes.index(world_size)]

    def draws(self) -> list[str]:
        return [f"batches {listed(self.drawn)}"]


def join_model() -> nn.Sequential:
    """The check model, the same on every rank (drawn from its own generator, so that the
    global random state neither matters nor changes)."""
    inputs, hidden, outputs = JOIN_WIDTHS
    model = nn.Sequential(nn.Linear(inputs, hidden), nn.Tanh(), nn.Linear(hidden, outputs))
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=generator) * 0.5)
    return model


Batch = tuple[torch.Tensor, torch.Tensor]


def rank_batches(seed: int, counts: Sequence[int]) -> list[list[Batch]]:
    """``batches[r][s]``: rank r's s-th batch ``(x, y)``, x of shape (3, 4), y (3, 2), drawn
    from rank r's own key."""
    keys = CaseKeys.draw(seed, len(counts))
    batches = []
    for rank, count in enumerate(counts):
        mine = []
        for step in range(count):
            generator = keys.generator(step, 0, owner=rank)
            mine.append((torch.randn(JOIN_ROWS, JOIN_WIDTHS[0], generator=generator),
                         torch.randn(JOIN_ROWS, JOIN_WIDTHS[-1], generator=generator)))
        batches.append(mine)
    return batches


class Divisor(enum.Enum):
    """What a step's summed gradient is divided by."""

    #: The ranks that had a batch that step: the mean of their gradients (the answer).
    TRAINING = "training"
    #: The world size, every step: the mean shrinks as ranks run out.
    WORLD = "world"
    #: Nothing: the sum.
    NONE = "none"


def join_reference(batches: Sequence[Sequence[Batch]],
                   divisor: Divisor = Divisor.TRAINING) -> dict[str, torch.Tensor]:
    """One process's training: at step s, the gradient of ``mse_loss(model(x), y)`` for each
    rank's s-th batch, where it has one, summed, divided by ``divisor``, and ``p -= lr * g``.
    Returns the parameters after the last step."""
    model = join_model()
    params = dict(model.named_parameters())
    for step in range(max((len(b) for b in batches), default=0)):
        grads = []
        for x, y in (b[step] for b in batches if step < len(b)):
            model.zero_grad()
            F.mse_loss(model(x), y).backward()
            grads.append({name: p.grad.clone()  # type: ignore[union-attr]
                          for name, p in params.items()})
        by = {Divisor.TRAINING: len(grads), Divisor.WORLD: len(batches), Divisor.NONE: 1}[divisor]
        with torch.no_grad():
            for name, p in params.items():
                p -= JOIN_LR * sum(g[name] for g in grads) / by
    return {name: p.detach().clone() for name, p in params.items()}
