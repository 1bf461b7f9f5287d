"""What the checks of chapters 2-4 run: the exercises, the cases of a world size (the tensor
shapes, the drawn ones included) and each rank's input, drawn from that rank's own key
(:class:`~labs.checks.core.CaseKeys`): the parent draws every rank's, a rank only its own.

The documented cases of world size N, in this order: numel N and a 2-D tensor of shape
(3, 2N) (the all-gather has no 2-D case), 300, then the awkward ones: numel 1, N-1, a prime
that N does not divide, and 301. A non-zero seed adds three numels and one world size (up to
6), drawn from ``random.Random(seed)``. The last case of every world size is numel 65536,
whose bytes the kernel counts (:data:`TRAFFIC_NUMEL`).
"""

from __future__ import annotations

import enum
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from labs.checks.core import CaseKeys, CheckPlan, keyed_values, listed, with_drawn_world_size
from labs.checks.exercises import spec
from labs.collectives import Collective, shard_bounds

_BIG_NUMELS = (300, 301)  #: a few hundred elements: one divisible by N <= 6, one not
#: The last case of every world size: large enough (256 KiB of float32) that the bytes a rank
#: writes, as the kernel counts them, are its messages' payloads, not their headers.
TRAFFIC_NUMEL = 1 << 16
_DRAWN_NUMELS = 3
_DRAWN_MAX_NUMEL = 400
_DRAWN_MAX_WORLD = 6


class Exercise(enum.Enum):
    """The exercises of chapters 2-4 that these checks run."""

    #: ``ring_all_reduce(tensor)``: sums ``tensor`` over all ranks, in place, by ring.
    RING_ALL_REDUCE = "2.1"
    #: ``ring_reduce_scatter(tensor) -> Tensor``: chunk r of the flattened sum, input unchanged.
    RING_REDUCE_SCATTER = "3.1"
    #: ``ring_all_gather(shard, numel) -> Tensor``: every rank's shard in rank order.
    RING_ALL_GATHER = "4.1"
    #: ``all_reduce(tensor)``: in place, a reduce-scatter followed by an all-gather.
    COMPOSED_ALL_REDUCE = "4.2"

    @property
    def function(self) -> str:
        return spec(self.value).function

    @property
    def title(self) -> str:
        return spec(self.value).title

    @property
    def collective(self) -> Collective:
        return {
            Exercise.RING_ALL_REDUCE: Collective.ALL_REDUCE,
            Exercise.RING_REDUCE_SCATTER: Collective.REDUCE_SCATTER,
            Exercise.RING_ALL_GATHER: Collective.ALL_GATHER,
            Exercise.COMPOSED_ALL_REDUCE: Collective.ALL_REDUCE,
        }[self]

    @property
    def parameters(self) -> tuple[str, ...]:
        return spec(self.value).parameters

    @property
    def phases(self) -> int:
        """Ring passes: 2 for an all-reduce (reduce-scatter, then all-gather), else 1."""
        return 2 if self.collective is Collective.ALL_REDUCE else 1

    def builds(self, name: str) -> bool:
        """True when the torch.distributed function ``name`` is the collective being built."""
        stem = {Collective.ALL_REDUCE: "all_reduce", Collective.REDUCE_SCATTER: "reduce_scatter",
                Collective.ALL_GATHER: "all_gather"}[self.collective]
        return name.replace("_", "").startswith(stem.replace("_", ""))


@dataclass(frozen=True)
class Case:
    """One input shape; the values follow from (seed, world size, case index, rank)."""

    shape: tuple[int, ...]
    traffic: bool = False
    """The last case, whose bytes the kernel counts (:data:`TRAFFIC_NUMEL`): its values are
    judged like any other's, its traffic by that count."""

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def uneven(self, world_size: int) -> bool:
        """True when numel does not divide by N (some chunks longer, or empty)."""
        return self.numel % world_size != 0

    def describe(self) -> str:
        if len(self.shape) == 1:
            return f"numel {self.numel}"
        return f"a 2-D tensor of shape {tuple(self.shape)} (numel {self.numel})"


def _prime_above(n: int) -> int:
    """The smallest prime >= 2n+3: larger than n, so n (>= 2) does not divide it."""
    p = 2 * n + 3
    while any(p % d == 0 for d in range(2, math.isqrt(p) + 1)):
        p += 1
    return p


@dataclass(frozen=True)
class Plan(CheckPlan):
    """What one check runs: the world sizes and, per world size, the cases."""

    drawn_numels: tuple[int, ...]

    @classmethod
    def make(cls, world_sizes: Sequence[int], seed: int) -> Plan:
        if seed == 0:
            return cls(seed, tuple(world_sizes), None, ())
        rng = random.Random(seed)
        numels = tuple(rng.randint(1, _DRAWN_MAX_NUMEL) for _ in range(_DRAWN_NUMELS))
        sizes, extra = with_drawn_world_size(world_sizes, rng, range(2, _DRAWN_MAX_WORLD + 1))
        return cls(seed, sizes, extra, numels)

    def cases(self, exercise: Exercise, n: int) -> tuple[Case, ...]:
        """Divisible sizes first (N, 2-D, 300), then the awkward ones (1, N-1, a prime, 301),
        then the drawn ones, duplicates dropped, and last the traffic case."""
        shapes: list[tuple[int, ...]] = [(n,)]
        if exercise is not Exercise.RING_ALL_GATHER:
            shapes.append((3, 2 * n))
        shapes += [(_BIG_NUMELS[0],), (1,), (n - 1,), (_prime_above(n),), (_BIG_NUMELS[1],)]
        shapes += [(k,) for k in self.drawn_numels]
        unique = dict.fromkeys(s for s in shapes if math.prod(s) > 0)
        return (*(Case(s) for s in unique), Case((TRAFFIC_NUMEL,), traffic=True))

    def draws(self) -> list[str]:
        return [f"numels {listed(self.drawn_numels)}"]


def rank_input(keys: CaseKeys, index: int, rank: int, case: Case) -> torch.Tensor:
    """Rank ``rank``'s tensor (all-reduce, reduce-scatter)."""
    return keyed_values(keys, index, 0, case.numel, owner=rank).view(case.shape)


def gather_shard(keys: CaseKeys, n: int, index: int, rank: int, case: Case) -> torch.Tensor:
    """Chunk ``rank`` (``shard_bounds``) of the tensor the all-gather ranks hold together."""
    bounds = shard_bounds(case.numel, n)
    return keyed_values(keys, index, 1, bounds[rank + 1] - bounds[rank], owner=rank)


def gather_full(keys: CaseKeys, n: int, index: int, case: Case) -> torch.Tensor:
    """The tensor whose chunks the all-gather ranks hold (rank i holds chunk i)."""
    return torch.cat([gather_shard(keys, n, index, r, case) for r in range(n)])
