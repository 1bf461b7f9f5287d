"""What the checks of chapter 8's exercises run, and the answers the parent computes on its
own: the exercises, the node layouts and cases a seed draws, each case's inputs (a pure
function of the case, so that the parent and the ranks agree on them), and the references.

* 8.1 (hierarchical all-reduce): N ranks in nodes of g consecutive ranks. The reference is the
  sum of every rank's input, added up here: it shares no code with
  :func:`labs.collectives.hierarchical_all_reduce`, the chapter's own answer. The most a rank
  may send across nodes is the hierarchical closed form, 2(n-1)/n of its chunk of S/g
  (:func:`cross_node_bound`).
* 8.2 (a Megatron MLP's forward, one rank's share): the reference is the unsplit MLP
  ``gelu(x W1^T + b1) W2^T + b2`` in one process, in float64.
"""

from __future__ import annotations

import enum
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from labs.checks.core import CheckPlan, case_values, with_drawn_world_size
from labs.checks.exercises import ExerciseRow
from labs.collectives import shard_bounds
from labs.grid import GridLayout, node_layout

#: 8.1's inputs are integers in [1, 9] (:func:`labs.checks.core.case_values`): every sum is
#: exact in float32 whatever the order of the additions, so the check compares exactly.
#: 8.2's tolerance: the ranks add the hidden features in slices, then the slices' sums.
MLP_RTOL, MLP_ATOL = 1e-5, 1e-5
_DRAWN_HIER_WORLD_SIZES = (6,)
_DRAWN_MLP_WORLD_SIZES = (3,)
_F32 = 4  #: bytes per element of the checks' tensors (float32)


class TopologyExercise(ExerciseRow, enum.Enum):
    """The exercises of chapter 8 that these checks run."""

    #: ``hierarchical_all_reduce_(tensor, node_group, cross_group)``: the sum over every rank,
    #: in place, by reduce-scatter in the node, all-reduce across nodes, all-gather in the node.
    HIERARCHICAL_ALL_REDUCE = "8.1"
    #: ``tp_mlp_forward(x, w1, b1, w2, b2) -> output``: one rank of a column-then-row
    #: parallel MLP, forward only, with one all-reduce.
    TP_MLP_FORWARD = "8.2"


# --- 8.1: the hierarchical all-reduce ---------------------------------------------------------


@dataclass(frozen=True)
class Layout:
    """``world_size`` ranks in nodes of ``node_size`` consecutive ranks: global rank r is on
    node r // node_size, at local rank r % node_size."""

    world_size: int
    node_size: int

    def __post_init__(self) -> None:
        if self.node_size < 1 or self.world_size % self.node_size:
            raise ValueError(f"node_size {self.node_size} must divide the world size "
                             f"{self.world_size}.")

    @property
    def nodes(self) -> int:
        """n = N / g."""
        return self.world_size // self.node_size

    @property
    def grid(self) -> GridLayout:
        """The grid ``("cross", "node")`` of shape (n, g) whose groups the check builds."""
        return node_layout(self.world_size, self.node_size)

    def node_of(self, rank: int) -> int:
        return rank // self.node_size

    def node_ranks(self, node: int) -> list[int]:
        """The ranks of node ``node``: what its ranks' ``node_group`` holds."""
        return list(self.grid.groups("node")[node])

    def cross_ranks(self, local: int) -> list[int]:
        """The ranks of local rank ``local`` on every node: what their ``cross_group`` holds."""
        return list(self.grid.groups("cross")[local])

    def describe(self) -> str:
        return f"{self.nodes} node{'s' if self.nodes > 1 else ''} of {self.node_size}"


def layouts_of(world_size: int) -> tuple[Layout, ...]:
    """Every layout of ``world_size`` ranks (one per divisor), those where both the node and
    the cross-node groups have more than one rank first: they are where mistakes show."""
    sizes = [g for g in range(1, world_size + 1) if world_size % g == 0]
    return tuple(Layout(world_size, g) for g in sorted(
        sizes, key=lambda g: (g in (1, world_size), -(world_size // g))))


#: 8.1's documented tensor sizes: one that no node size divides, one smaller than every node
#: (some chunks are empty), and a prime larger than every world size.
HIER_NUMELS = (7, 1, 61)


@dataclass(frozen=True)
class HierPlan(CheckPlan):
    """What one check of 8.1 runs: the world sizes, each in its layouts, and the tensor sizes
    of every layout. A non-zero seed adds a world size of 6 ranks in one layout (3 nodes of 2 or
    2 nodes of 3) and one more tensor size."""

    drawn_node_size: int | None
    drawn_numels: tuple[int, ...]

    @classmethod
    def make(cls, world_sizes: Sequence[int], seed: int) -> HierPlan:
        if seed == 0:
            return cls(seed, tuple(world_sizes), None, None, ())
        rng = random.Random(seed)
        sizes, extra = with_drawn_world_size(world_sizes, rng, _DRAWN_HIER_WORLD_SIZES)
        node_size = rng.choice((2, 3)) if extra else None
        return cls(seed, sizes, extra, node_size, (rng.randint(2, 100),))

    def layouts(self, world_size: int) -> tuple[Layout, ...]:
        """The layouts run on ``world_size`` ranks: every one, or the drawn one."""
        if world_size == self.drawn_world_size and self.drawn_node_size is not None:
            return (Layout(world_size, self.drawn_node_size),)
        return layouts_of(world_size)

    @property
    def numels(self) -> tuple[int, ...]:
        return (*HIER_NUMELS, *self.drawn_numels)

    def draws(self) -> list[str]:
        node = ([Layout(self.drawn_world_size, self.drawn_node_size).describe()]
                if self.drawn_world_size and self.drawn_node_size else [])
        return [*node, *(f"a tensor of {numel} elements" for numel in self.drawn_numels)]


def hier_input(seed: int, layout: Layout, index: int, rank: int, numel: int) -> torch.Tensor:
    """Rank ``rank``'s tensor in case ``index`` of ``layout`` (1-D float32, integers in [1, 9])."""
    return case_values(seed, layout.world_size, 1000 * layout.node_size + index, rank, numel)


def hier_sum(seed: int, layout: Layout, index: int, numel: int,
             ranks: Sequence[int] | None = None) -> torch.Tensor:
    """The sum of the inputs of ``ranks`` (default: every rank), added up here, in rank order."""
    ranks = range(layout.world_size) if ranks is None else ranks
    total = torch.zeros(numel)
    for r in ranks:
        total += hier_input(seed, layout, index, r, numel)
    return total


def node_chunk(layout: Layout, rank: int, numel: int) -> tuple[int, int]:
    """``[start, stop)`` of the chunk local rank l ends the node's reduce-scatter with
    (chunk l of g, as ``torch.tensor_split`` and the labs rings cut)."""
    bounds = shard_bounds(numel, layout.node_size)
    local = rank % layout.node_size
    return bounds[local], bounds[local + 1]


def cross_node_bound(layout: Layout, numel: int, element_size: int = _F32) -> int:
    """The most bytes a rank of the hierarchical all-reduce sends to other nodes: a ring
    all-reduce over the n nodes of its chunk of S/g, 2(n-1)/n of the chunk, with every size
    rounded up: 2(n-1)·ceil(ceil(numel/g)/n) elements. (A flat ring over all N ranks sends
    2(N-1)/N·S across from the ranks at a node's edge.)"""
    n = layout.nodes
    return 2 * (n - 1) * math.ceil(math.ceil(numel / layout.node_size) / n) * element_size


# --- 8.2: one rank of a Megatron MLP -----------------------------------------------------------


@dataclass(frozen=True)
class MlpCase:
    """An MLP of width ``dim`` and ``hidden`` hidden features, on an input of shape
    ``(*batch, dim)``."""

    batch: tuple[int, ...]
    dim: int
    hidden: int

    def describe(self) -> str:
        shape = ", ".join(map(str, (*self.batch, self.dim)))
        return f"x of shape ({shape}), {self.hidden} hidden features"


#: 8.2's documented cases: hidden sizes that 2 and 4 do not divide, an input with a sequence
#: dimension, and fewer hidden features than 4 ranks (a rank holds none).
MLP_CASES = (MlpCase((3,), 4, 7), MlpCase((2, 3), 6, 10), MlpCase((2,), 5, 3))


@dataclass(frozen=True)
class MlpPlan(CheckPlan):
    """What one check of 8.2 runs: the world sizes and the MLPs of every launch."""

    drawn: tuple[MlpCase, ...]

    @classmethod
    def make(cls, world_sizes: Sequence[int], seed: int) -> MlpPlan:
        if seed == 0:
            return cls(seed, tuple(world_sizes), None, ())
        rng = random.Random(seed)
        sizes, extra = with_drawn_world_size(world_sizes, rng, _DRAWN_MLP_WORLD_SIZES)
        case = MlpCase((rng.randint(1, 4),), rng.randint(2, 8), rng.randint(1, 13))
        return cls(seed, sizes, extra, (case,))

    @property
    def cases(self) -> tuple[MlpCase, ...]:
        return (*MLP_CASES, *self.drawn)

    def draws(self) -> list[str]:
        return [case.describe() for case in self.drawn]


@dataclass(frozen=True)
class MlpWeights:
    """The unsplit MLP of one case and its input (float32)."""

    x: torch.Tensor  #: (*batch, D)
    w1: torch.Tensor  #: (H, D): the first Linear's weight, split by rows (column-parallel)
    b1: torch.Tensor  #: (H,)
    w2: torch.Tensor  #: (D, H): the second Linear's weight, split by columns (row-parallel)
    b2: torch.Tensor  #: (D,): kept whole on every rank


def mlp_weights(seed: int, n: int, index: int, case: MlpCase) -> MlpWeights:
    """Case ``index``'s input and weights: a pure function of its arguments, drawn the same in
    the parent and on every rank."""
    generator = torch.Generator().manual_seed(((seed * 1_000_003 + n) * 1009 + index) % (1 << 61)
                                              + 82)

    def draw(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return torch.randn(shape, generator=generator) * scale

    d, h = case.dim, case.hidden
    return MlpWeights(draw(*case.batch, d), draw(h, d, scale=d ** -0.5), draw(h),
                      draw(d, h, scale=h ** -0.5), draw(d))


def hidden_slice(case: MlpCase, n: int, rank: int) -> slice:
    """The hidden features rank ``rank`` holds: as ``torch.tensor_split`` cuts H into N (the
    first H mod N ranks one more), empty when H < N for the last ranks."""
    bounds = shard_bounds(case.hidden, n)
    return slice(bounds[rank], bounds[rank + 1])


def rank_weights(weights: MlpWeights, case: MlpCase, n: int, rank: int
                 ) -> tuple[torch.Tensor, ...]:
    """The arguments of rank ``rank``'s call: ``(x, w1, b1, w2, b2)``, ``w1`` (h_r, D) its rows
    of W1, ``b1`` (h_r,) its slice, ``w2`` (D, h_r) its columns of W2, ``b2`` (D,) whole;
    copies, contiguous."""
    part = hidden_slice(case, n, rank)
    return (weights.x.clone(), weights.w1[part].clone(), weights.b1[part].clone(),
            weights.w2[:, part].contiguous(), weights.b2.clone())


def mlp_reference(weights: MlpWeights, *, approximate: str = "none") -> torch.Tensor:
    """``gelu(x W1^T + b1) W2^T + b2``, unsplit, in float64 (returned as float64)."""
    w = [t.double() for t in (weights.x, weights.w1, weights.b1, weights.w2, weights.b2)]
    x, w1, b1, w2, b2 = w
    return F.gelu(x @ w1.T + b1, approximate=approximate) @ w2.T + b2


def mlp_partial(weights: MlpWeights, case: MlpCase, n: int, rank: int) -> torch.Tensor:
    """Rank ``rank``'s term of the sum, ``gelu(x W1_r^T + b1_r) W2_r^T``, in float64: what it
    holds before the all-reduce."""
    part = hidden_slice(case, n, rank)
    x, w1, b1, w2 = (t.double() for t in (weights.x, weights.w1[part], weights.b1[part],
                                          weights.w2[:, part]))
    return F.gelu(x @ w1.T + b1) @ w2.T
