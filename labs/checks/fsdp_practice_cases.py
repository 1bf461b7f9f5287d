"""What the checks of chapter 7's exercises run, and the answers the parent computes on its
own: the exercises, the cases and what a seed draws, each case's inputs (a pure function of
the case, so that the parent and the ranks agree on them), and the references.

Both exercises use FSDP's layout (chapter 6): a unit's parameters are flattened into one
vector of ``numel`` elements, zero-padded to ``N * k``, ``k = ceil(numel / N)``, and rank r
holds elements ``[r*k, (r+1)*k)``.

* 7.1 (clipping across shards): every rank holds its shard of each unit's flat gradient. The
  reference is ``torch.nn.utils.clip_grad_norm_`` on the whole gradient in one process: the
  norm ``T`` of the full gradient, and every element scaled by ``min(1, max_norm / (T +
  1e-6))``. One case is :class:`~labs.models.TiedNet`'s gradient, clipped through
  ``model.parameters()``: the tied weight counted once, the frozen layer without a gradient.
* 7.2 (resharding a checkpoint): a flat vector saved as ``saved_world_size`` shards of
  ``k_old`` elements is loaded on ``world_size`` ranks of ``k_new``. The reference maps every
  element of the new shard to the saved shard and offset that hold it, one by one, and
  merges the runs: it shares no code with :mod:`labs.checkpoint`, the chapter's own answer.
* 7.3 (the prefetch decision): the names of the units to all-gather ahead when a unit starts
  computing, from the order its pass recorded in the last step. The reference is
  :func:`labs.fsdp.units_to_prefetch`, the code labs' FSDP runs; a real run trains
  :class:`ShuffledNet`, whose units run in another order than they were registered in.
"""

from __future__ import annotations

import enum
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from labs.checks.core import CheckPlan, case_values, listed, with_drawn_world_size
from labs.checks.exercises import ExerciseRow
from labs.checks.zero_cases import pad_flat, shard_of
from labs.fsdp import units_to_prefetch
from labs.models import TiedNet

#: ``(saved_rank, start, stop)``: elements ``[start, stop)`` of saved rank ``saved_rank``'s shard.
Piece = tuple[int, int, int]

#: 7.1's tolerance: the ranks sum their squares in another order than clip_grad_norm_, which
#: takes each tensor's norm and then the norm of the norms.
RTOL, ATOL = 1e-5, 1e-6
#: The ``eps`` of torch.nn.utils.clip_grad_norm_: the factor is max_norm / (total + EPS).
EPS = 1e-6
#: TiedNet(vocab, dim) of 7.1's model case: units hidden (dim*dim + dim = 12 elements) and the
#: root, holding the embedding that the output layer shares (vocab*dim = 15).
TIED_VOCAB, TIED_DIM = 5, 3
_DRAWN_WORLD_SIZES = (5, 6)


class PracticeExercise(ExerciseRow, enum.Enum):
    """The exercises of chapter 7 that these checks run."""

    #: ``clip_shards_(grads, max_norm) -> total norm``: clip_grad_norm_ across FSDP's shards.
    CLIP_SHARDS = "7.1"
    #: ``shard_pieces(numel, saved_world_size, world_size, rank) -> [(saved_rank, start,
    #: stop), ...]``: where a new shard's elements lie in a checkpoint saved on another N.
    SHARD_PIECES = "7.2"
    #: ``units_to_prefetch(order, current, prefetch) -> [name, ...]``: which units' all-gathers
    #: FSDP starts when unit ``current`` starts computing.
    PREFETCH = "7.3"


# --- 7.1: clipping across shards -------------------------------------------------------------


@dataclass(frozen=True)
class ClipCase:
    """One gradient set of 7.1: the numel of each unit's flat gradient, and ``max_norm``."""

    units: tuple[int, ...]
    max_norm: float
    tied: bool = False
    """The units are TiedNet's (:data:`TIED_VOCAB`, :data:`TIED_DIM`), and the reference
    clips ``model.parameters()``."""

    @classmethod
    def tiednet(cls, max_norm: float) -> ClipCase:
        hidden, embed = _tiednet_units(TiedNet(TIED_VOCAB, TIED_DIM, seed=0))
        return cls((sum(p.numel() for p in hidden), sum(p.numel() for p in embed)), max_norm,
                   tied=True)

    def describe(self) -> str:
        if self.tied:
            return (f"TiedNet({TIED_VOCAB}, {TIED_DIM})'s gradient (units of {self.units[0]} "
                    f"and {self.units[1]} elements: the tied weight once, the frozen layer "
                    f"none), max_norm {self.max_norm:g}")
        sizes = listed(self.units)
        return f"units of {sizes} element(s), max_norm {self.max_norm:g}"


def _tiednet_units(model: TiedNet) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """TiedNet's trainable parameters as labs.fsdp groups them: the hidden layer's unit, and
    the root unit holding the embedding weight, which the head shares (the frozen layer is
    in no flat vector)."""
    return [model.hidden.weight, model.hidden.bias], [model.embed.weight]


#: 7.1's documented cases: gradients clipped with units that 2, 3 and 4 do not divide; the
#: model case; a norm below max_norm (nothing changes); a unit smaller than N (on 3 and 4
#: ranks, some ranks hold only padding).
CLIP_CASES = (ClipCase((12, 7, 1), 1.0), ClipCase.tiednet(2.0), ClipCase((5, 3), 100.0),
              ClipCase((2,), 0.5))


@dataclass(frozen=True)
class ClipPlan(CheckPlan):
    """What one check of 7.1 runs: the world sizes and the gradient sets of every launch."""

    drawn: tuple[ClipCase, ...]

    @classmethod
    def make(cls, world_sizes: Sequence[int], seed: int) -> ClipPlan:
        if seed == 0:
            return cls(seed, tuple(world_sizes), None, ())
        rng = random.Random(seed)
        sizes, extra = with_drawn_world_size(world_sizes, rng, _DRAWN_WORLD_SIZES)
        units = tuple(rng.randint(1, 40) for _ in range(rng.randint(1, 3)))
        return cls(seed, sizes, extra, (ClipCase(units, rng.choice((0.5, 4.0, 1000.0))),))

    @property
    def cases(self) -> tuple[ClipCase, ...]:
        return (*CLIP_CASES, *self.drawn)

    def draws(self) -> list[str]:
        return [case.describe() for case in self.drawn]


def unit_grads(seed: int, n: int, index: int, case: ClipCase) -> tuple[torch.Tensor, ...]:
    """Each unit's full flat gradient, zero-padded to N*k (1-D, float32): integers in [-4, 4],
    so that every sum of squares is exact in float32."""
    return tuple(pad_flat(case_values(seed, n, index, 200 + u, numel) - 5, n)
                 for u, numel in enumerate(case.units))


def rank_shards(seed: int, n: int, index: int, case: ClipCase, rank: int) -> list[torch.Tensor]:
    """Rank r's shards, one per unit (1-D, k = ceil(numel / N) elements each), the tensors its
    call of 7.1 receives."""
    return [shard_of(g, n, rank).clone() for g in unit_grads(seed, n, index, case)]


@dataclass(frozen=True)
class ClipReference:
    """One process's clip_grad_norm_ on the whole gradient of a 7.1 case."""

    grads: tuple[torch.Tensor, ...]  #: per unit, the padded flat gradient before clipping
    clipped: tuple[torch.Tensor, ...]  #: the same after clipping (the padding stays zero)
    total: float  #: the norm of the full gradient, as clip_grad_norm_ returned it
    factor: float  #: min(1, max_norm / (total + 1e-6)): what every element was scaled by
    local_norms: tuple[float, ...]  #: per rank, the norm of its own shards alone


def clip_reference(seed: int, n: int, index: int, case: ClipCase) -> ClipReference:
    """``torch.nn.utils.clip_grad_norm_`` in one process, on the unpadded gradients: loose
    tensors, or TiedNet's parameters (``model.parameters()`` yields the tied weight once, and
    the frozen layer, whose ``.grad`` is None, adds nothing)."""
    grads = unit_grads(seed, n, index, case)
    if case.tied:
        model = TiedNet(TIED_VOCAB, TIED_DIM, seed=0)
        units = _tiednet_units(model)
        params: list[nn.Parameter] = list(model.parameters())
    else:
        units = tuple([nn.Parameter(torch.zeros(numel))] for numel in case.units)
        params = [p for unit in units for p in unit]
    for unit, grad in zip(units, grads, strict=True):
        pieces = grad.split([*(p.numel() for p in unit), grad.numel() - sum(
            p.numel() for p in unit)])
        for p, piece in zip(unit, pieces, strict=False):  # the last piece: padding
            p.grad = piece.clone().view_as(p)
    total = float(torch.nn.utils.clip_grad_norm_(params, case.max_norm))
    clipped = tuple(pad_flat(torch.cat([p.grad.reshape(-1) for p in unit  # type: ignore[union-attr]
                                        ]), n) for unit in units)
    local = tuple(float(torch.cat([shard_of(g, n, r) for g in grads]).norm()) for r in range(n))
    return ClipReference(grads, clipped, total, min(1.0, case.max_norm / (total + EPS)), local)


# --- 7.2: which saved pieces make a new shard -----------------------------------------------


@dataclass(frozen=True)
class PiecesCase:
    """A flat vector of ``numel`` elements saved on ``saved_world_size`` ranks, loaded on
    ``world_size``."""

    numel: int
    saved_world_size: int
    world_size: int

    @property
    def k_old(self) -> int:
        """Elements per saved shard: ceil(numel / saved_world_size)."""
        return math.ceil(self.numel / self.saved_world_size)

    @property
    def k_new(self) -> int:
        """Elements per new shard: ceil(numel / world_size)."""
        return math.ceil(self.numel / self.world_size)

    def describe(self) -> str:
        return (f"numel {self.numel} saved on {self.saved_world_size} rank(s) (k_old = "
                f"{self.k_old}) and loaded on {self.world_size} (k_new = {self.k_new})")

    def draw_text(self) -> str:
        """In short: ``numel 10, 4 -> 2 rank(s)``."""
        return f"numel {self.numel}, {self.saved_world_size} -> {self.world_size} rank(s)"


#: 7.2's documented cases: N down (4 -> 2, 4 -> 1), up (2 -> 4, 3 -> 5), numels that do not
#: divide, numel < N (new shards of padding only), N unchanged, and both N dividing numel.
PIECES_CASES = (PiecesCase(10, 4, 2), PiecesCase(10, 4, 1), PiecesCase(10, 2, 4),
                PiecesCase(7, 3, 5), PiecesCase(3, 2, 4), PiecesCase(1, 3, 2),
                PiecesCase(12, 4, 3), PiecesCase(5, 2, 2))


#: A hidden case of 7.2 of a real model's size: a unit of 2^30 to 2^40 elements (1 to 1000
#: billion), saved and loaded on 1 to 64 ranks.
_MODEL_NUMELS = (1 << 30, 1 << 40)
_MODEL_WORLD_SIZES = 64
#: Up to this numel the expected pieces are found element by element.
_BRUTE_FORCE_NUMEL = 10_000


@dataclass(frozen=True)
class PiecesPlan(CheckPlan):
    """What one check of 7.2 runs (in the learner's process: no ranks, no world sizes)."""

    drawn: tuple[PiecesCase, ...]

    @classmethod
    def make(cls, seed: int) -> PiecesPlan:
        if seed == 0:
            return cls(seed, (), None, ())
        rng = random.Random(seed)
        drawn: list[PiecesCase] = []
        # One small case (an off-by-one shows there), then two of a real model's size: too
        # many possible inputs for a table computed beforehand from labs' answer to cover.
        model = (*_MODEL_NUMELS, _MODEL_WORLD_SIZES)
        for low, high, ranks in ((1, 60, 8), model, model):
            while True:
                case = PiecesCase(rng.randint(low, high), rng.randint(1, ranks),
                                  rng.randint(1, ranks))
                if case.saved_world_size != case.world_size:
                    drawn.append(case)
                    break
        return cls(seed, (), None, tuple(drawn))

    @property
    def cases(self) -> tuple[PiecesCase, ...]:
        return (*PIECES_CASES, *self.drawn)

    def draws(self) -> list[str]:
        return [case.draw_text() for case in self.drawn]


def expected_pieces(case: PiecesCase, rank: int) -> list[Piece]:
    """The pieces of rank ``rank``'s new shard: by brute force for a small case (below), else
    as the saved shards ``q`` that the new shard ``[rank*k_new, min((rank+1)*k_new, numel))``
    overlaps, each cut to the overlap."""
    if case.numel <= _BRUTE_FORCE_NUMEL:
        return _pieces_by_element(case, rank)
    start, stop = rank * case.k_new, min((rank + 1) * case.k_new, case.numel)
    if start >= stop:
        return []
    pieces = []
    for q in range(start // case.k_old, (stop - 1) // case.k_old + 1):
        first, last = q * case.k_old, (q + 1) * case.k_old  # saved shard q, flat
        pieces.append((q, max(start, first) - first, min(stop, last) - first))
    return pieces


def _pieces_by_element(case: PiecesCase, rank: int) -> list[Piece]:
    """The pieces by brute force: each real element ``e`` of the new shard lies at offset
    ``e - q*k_old`` of saved rank ``q = e // k_old``; consecutive elements of one saved rank
    make one piece."""
    pieces: list[list[int]] = []
    for e in range(rank * case.k_new, min((rank + 1) * case.k_new, case.numel)):
        q, offset = divmod(e, case.k_old)
        if pieces and pieces[-1][0] == q and pieces[-1][2] == offset:
            pieces[-1][2] += 1
        else:
            pieces.append([q, offset, offset + 1])
    return [(q, a, b) for q, a, b in pieces]


# --- 7.3: the prefetch decision ----------------------------------------------------------------


@dataclass(frozen=True)
class PrefetchCase:
    """One call of 7.3: the recorded ``order`` of a pass, the unit starting, ``prefetch``."""

    order: tuple[str, ...]
    current: str
    prefetch: int
    what: str = ""
    """What the order is, in words (e.g. a backward's, recorded), for the verdict."""

    def describe(self) -> str:
        what = f" ({self.what})" if self.what else ""
        return (f"order {list(self.order)}{what}, current {self.current!r}, prefetch "
                f"{self.prefetch}")

    @property
    def expected(self) -> list[str]:
        """labs' answer: what its FSDP prefetches (:func:`labs.fsdp.units_to_prefetch`)."""
        return units_to_prefetch(list(self.order), self.current, self.prefetch)


_FOUR = ("0", "1", "2", "3")
#: A forward that runs units "2", "0", "1", "3" (registered 0, 1, 2, 3), and its backward.
_SHUFFLED, _SHUFFLED_BACK = ("2", "0", "1", "3"), ("3", "1", "0", "2")

#: 7.3's documented cases: the start, the middle and the end of an order (fewer than k units
#: left, none after the last), k = 0, nothing recorded yet (the first step), a unit that did
#: not run last step, orders that differ from registration order, forward's and backward's,
#: and a backward that is not forward reversed (unit "0" runs twice: forward records "0", "1";
#: its second call's backward comes first).
PREFETCH_CASES = (
    PrefetchCase(_FOUR, "0", 1), PrefetchCase(_FOUR, "1", 2), PrefetchCase(_FOUR, "2", 3),
    PrefetchCase(_FOUR, "3", 1), PrefetchCase(_FOUR, "1", 0),
    PrefetchCase((), "0", 1, "the first step: nothing recorded"),
    PrefetchCase(("0", "1"), "2", 1, "unit '2' did not run last step"),
    PrefetchCase(_SHUFFLED, "2", 1, "a forward, registered 0, 1, 2, 3"),
    PrefetchCase(_SHUFFLED, "1", 2, "a forward, registered 0, 1, 2, 3"),
    PrefetchCase(_SHUFFLED_BACK, "1", 2, "its backward"),
    PrefetchCase(("0", "1"), "0", 1, "the backward of a forward that runs 0, 1, 0"),
    PrefetchCase(("root", "embed", "blocks.0", "blocks.1", "head"), "root", 2,
                 "the root unit runs first"),
)


#: The parts of the unit names 7.3's hidden cases draw.
_PARTS = ("blocks", "layers", "encoder.layer", "decoder.layers")
_LAYERS = ("attn", "mlp", "self_attn", "ffn", "norm")


@dataclass(frozen=True)
class PrefetchPlan(CheckPlan):
    """What one check of 7.3 runs: the calls (its real run, on 2 ranks, is the same for every
    seed)."""

    drawn: tuple[PrefetchCase, ...]

    @classmethod
    def make(cls, seed: int) -> PrefetchPlan:
        if seed == 0:
            return cls(seed, (), None, ())
        rng = random.Random(seed)
        drawn = []
        for _ in range(3):
            # A model's unit names, drawn now (blocks.17.attn, ...), up to 48 units in a
            # shuffled order: no table computed beforehand from labs' answer holds them.
            names = [f"{rng.choice(_PARTS)}.{i}.{rng.choice(_LAYERS)}"
                     for i in rng.sample(range(1000), rng.randint(2, 48))]
            order = rng.sample(names, len(names))
            stranger = f"{rng.choice(_PARTS)}.1000.{rng.choice(_LAYERS)}"
            current = rng.choice([*order, stranger])  # sometimes a unit not in it
            drawn.append(PrefetchCase(tuple(order), current, rng.randint(1, 4)))
        return cls(seed, (), None, tuple(drawn))

    @property
    def cases(self) -> tuple[PrefetchCase, ...]:
        return (*PREFETCH_CASES, *self.drawn)

    def draws(self) -> list[str]:
        return [f"an order of {len(c.order)} units ({c.order[0]!r}, ...), current "
                f"{c.current!r}, prefetch {c.prefetch}" for c in self.drawn]


class ShuffledNet(nn.Module):
    """7.3's real run: three linear layers registered ``a``, ``b``, ``c`` (three FSDP units)
    whose forward runs ``c``, ``a``, ``b``: prefetching must follow the recorded order, not
    the registration order."""

    def __init__(self, width: int = 6) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.c = (nn.Linear(width, width) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(torch.tanh(self.c(x)))))
