"""Chapter 8, part 3: one grid of process groups with named dimensions, the layout every
sub-group in the course comes from (picotron's ``ProcessGroupManager``, torchtitan's
``ParallelDims``, torch's ``DeviceMesh``).

**The layout.** N ranks are laid out *row-major* on a grid of named dimensions d_0, ..., d_{k-1}
of sizes s_0, ..., s_{k-1} (s_0 · ... · s_{k-1} = N), the last dimension fastest, as
``torch.arange(N).view(s_0, ..., s_{k-1})`` lays them out. Rank r sits at coordinate
(c_0, ..., c_{k-1}) with

    r = sum_d c_d · stride_d,   stride_d = s_{d+1} · ... · s_{k-1}   (stride_{k-1} = 1).

**The groups.** The group of rank r *along* dimension d is the ranks whose coordinates differ
from r's only on d: ``r + (j - c_d) · stride_d`` for j = 0 .. s_d - 1, s_d ranks, and c_d is
r's place in it. Along each dimension the grid cuts the N ranks into N / s_d disjoint groups;
they are listed in the row-major order of the other coordinates (:meth:`GridLayout.groups`).
For 8 ranks in 4 nodes of 2, the grid ``("replicate", "shard")`` of shape (4, 2) puts rank
r = 2i + j at (i, j); along "shard" the groups are the nodes {2i, 2i+1}, along "replicate"
the ranks with the same place in their node {j, j+2, j+4, j+6}. Every layout in the course
is such a grid:

* the hierarchical all-reduce (:func:`node_layout`): ``("cross", "node")`` of shape (n, g),
  n nodes of g consecutive ranks; it reduce-scatters along "node", all-reduces along "cross";
* HSDP (:func:`hybrid_layout`): ``("replicate", "shard")`` of shape (N/g, g); parameters are
  sharded along "shard" and each shard replicated along "replicate";
* tensor parallelism beside data parallelism: ``("dp", "tp")`` of shape (N/t, t), the MLP
  split along "tp" (:mod:`labs.experiments.mesh`);
* the 2-D mesh of :mod:`labs.experiments.mesh`, built both with :class:`ProcessGrid` and with
  torch's ``init_device_mesh``, which makes the same groups.

The innermost (last) dimension holds consecutive ranks: on a real cluster, the GPUs of one
node, joined by the fast link; so the dimension whose traffic is heaviest goes last.

**Making the groups.** ``dist.new_group(ranks)`` is collective over the *whole default group*,
members or not: each process names the groups it makes by a counter (the n-th group made is
"n"), and a group's members meet in the store under that name. So every rank must call
``new_group`` for every group of every dimension, in the same order, even the groups it is
not in; a rank that skipped one, or made them in another order, would name the same ranks
differently and wait for peers that never come. :meth:`ProcessGrid.build` makes them in
:meth:`GridLayout.creation_order` (dimension by dimension, each dimension's groups in order):
sum over d of N / s_d calls, each a round trip to the store, so build a grid once and keep it.

The layout is pure (no process needed: test it, draw it, refuse a bad shape before any rank
starts); :class:`ProcessGrid` is one rank's groups on it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed import ProcessGroup

__all__ = ["GridLayout", "HybridGroups", "ProcessGrid", "hybrid_groups", "hybrid_layout",
           "node_layout"]


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


def _is_size(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


@dataclass(frozen=True)
class GridLayout:
    """``math.prod(shape)`` ranks laid out row-major on dimensions ``names`` of sizes
    ``shape``, outermost first (see the module's docstring for the math). Pure: no process
    group is touched. Ranks here are positions 0 .. N-1 in the process group the grid is laid
    over (the global ranks, when that is the default group)."""

    names: tuple[str, ...]  #: one per dimension, e.g. ("replicate", "shard")
    shape: tuple[int, ...]  #: the size of each dimension, e.g. (4, 2)

    def __post_init__(self) -> None:
        names, shape = tuple(self.names), tuple(self.shape)
        if not names or len(names) != len(shape):
            raise ValueError(f"a grid needs one name per dimension and at least one dimension; "
                             f"got names {names!r} for shape {shape!r}.")
        if len(set(names)) != len(names) or not all(isinstance(n, str) and n for n in names):
            raise ValueError(f"the dimensions' names must be different non-empty strings, got "
                             f"{names!r}.")
        if not all(_is_size(s) for s in shape):
            raise ValueError(f"every dimension's size must be an int >= 1, got {shape!r}.")
        object.__setattr__(self, "names", names)  # a list given is kept as a tuple: hashable
        object.__setattr__(self, "shape", shape)

    @classmethod
    def of(cls, world_size: int, /, **dims: int | None) -> GridLayout:
        """The grid of ``world_size`` ranks with these dimensions, in the order given,
        outermost first; one size may be None, inferred as ``world_size`` over the product
        of the others (as torchtitan's -1). ``GridLayout.of(8, replicate=None, shard=2)``
        is ``("replicate", "shard")`` of shape (4, 2).

        A shape that does not fit ``world_size`` is refused with what to pick, so that a
        caller can refuse it before any rank starts."""
        if not _is_size(world_size):
            raise ValueError(f"world_size must be an int >= 1, got {world_size!r}.")
        wanted = ", ".join(f"{name}={size}" for name, size in dims.items())
        inferred = [name for name, size in dims.items() if size is None]
        if len(inferred) > 1:
            raise ValueError(f"at most one dimension's size can be inferred (None); got "
                             f"{wanted}.")
        for name, size in dims.items():
            if size is not None and not _is_size(size):
                raise ValueError(f"{name}={size!r}: a dimension's size must be an int >= 1 "
                                 f"(or None to infer it).")
        given = math.prod(size for size in dims.values() if size is not None)
        if world_size % given or (not inferred and given != world_size):
            fixed = [name for name in dims if name not in inferred]
            pick = (f" Pick {fixed[0]} among the divisors of {world_size}: "
                    f"{_divisors(world_size)}." if len(fixed) == 1 else "")
            raise ValueError(
                f"{world_size} rank(s) cannot be laid out as a grid of {wanted}: the sizes "
                f"multiply to {given}, which "
                f"{'does not divide' if world_size % given else 'is not'} {world_size}.{pick}")
        shape = tuple(world_size // given if size is None else size for size in dims.values())
        return cls(tuple(dims), shape)

    @property
    def world_size(self) -> int:
        """N, the product of the sizes."""
        return math.prod(self.shape)

    @property
    def strides(self) -> tuple[int, ...]:
        """How far apart two ranks are whose coordinates differ by one on each dimension:
        the product of the sizes after it (row-major, the last dimension's stride is 1)."""
        return tuple(math.prod(self.shape[d + 1:]) for d in range(len(self.shape)))

    def size(self, name: str) -> int:
        """The size of dimension ``name``: how many ranks each of its groups holds."""
        return self.shape[self.dim(name)]

    def dim(self, name: str) -> int:
        """The index of dimension ``name``."""
        if name not in self.names:
            raise ValueError(f"this grid has no dimension {name!r}; its dimensions are "
                             f"{self.names}.")
        return self.names.index(name)

    def coordinate(self, rank: int) -> tuple[int, ...]:
        """Where ``rank`` sits: one coordinate per dimension, ``c_d = (rank // stride_d) %
        s_d``, its place in its group along d (as ``DeviceMesh.get_coordinate``)."""
        if not isinstance(rank, int) or not 0 <= rank < self.world_size:
            raise ValueError(f"rank must be an int in [0, {self.world_size}), got {rank!r}.")
        return tuple((rank // stride) % size
                     for stride, size in zip(self.strides, self.shape, strict=True))

    def rank_at(self, coordinate: tuple[int, ...]) -> int:
        """The rank at ``coordinate``: ``sum_d c_d · stride_d`` (the inverse of
        :meth:`coordinate`)."""
        if len(coordinate) != len(self.shape) or not all(
                0 <= c < s for c, s in zip(coordinate, self.shape, strict=True)):
            raise ValueError(f"{coordinate!r} is not a coordinate of a grid of shape "
                             f"{self.shape}.")
        return sum(c * stride for c, stride in zip(coordinate, self.strides, strict=True))

    def group_of(self, rank: int, name: str) -> tuple[int, ...]:
        """The ranks of ``rank``'s group along ``name``, in their order in the group:
        ``rank + (j - c_d) · stride_d`` for j = 0 .. s_d - 1."""
        d = self.dim(name)
        first = rank - self.coordinate(rank)[d] * self.strides[d]
        return tuple(first + j * self.strides[d] for j in range(self.shape[d]))

    def groups(self, name: str) -> list[tuple[int, ...]]:
        """Every group along ``name`` (N / s_d of them, disjoint, covering every rank), in
        the row-major order of the other coordinates: the group of the lowest rank first."""
        d = self.dim(name)
        return [self.group_of(first, name) for first in range(self.world_size)
                if self.coordinate(first)[d] == 0]

    def group_index(self, rank: int, name: str) -> int:
        """Which of :meth:`groups` holds ``rank`` (for a node group: the node's number)."""
        return self.groups(name).index(self.group_of(rank, name))

    def creation_order(self) -> list[tuple[str, tuple[int, ...]]]:
        """(dimension, ranks) of every group, in the order every rank must create them:
        dimension by dimension, each dimension's :meth:`groups` in order."""
        return [(name, ranks) for name in self.names for ranks in self.groups(name)]

    def __str__(self) -> str:
        return " x ".join(f"{name}={size}"
                          for name, size in zip(self.names, self.shape, strict=True))


@dataclass(frozen=True)
class ProcessGrid:
    """One rank's process groups on a :class:`GridLayout`: ``grid[name]`` is its group along
    dimension ``name``. Make it with :meth:`build` on every rank, once, and keep it (there is
    no module-level cache: the caller holds the groups)."""

    layout: GridLayout
    rank: int  #: this rank's place in the layout (its rank in ``group``)
    groups: tuple[ProcessGroup, ...]  #: its group along each dimension, in ``layout.names`` order
    group: ProcessGroup | None = None  #: the process group the grid is laid over (None: world)

    @classmethod
    def build(cls, layout: GridLayout, group: ProcessGroup | None = None) -> ProcessGrid:
        """Create every group of ``layout`` over ``group`` (None: the default group) and keep
        this rank's. Collective: every rank calls it, with the same layout; it calls
        ``dist.new_group`` once per group, in :meth:`GridLayout.creation_order`.

        ``group`` must hold every rank of the default group (the ranks outside it would not
        make the calls ``new_group`` waits for) and exactly ``layout.world_size`` of them;
        otherwise a ValueError, raised alike on every rank, before any group is made."""
        size = dist.get_world_size(group)
        if size != layout.world_size:
            raise ValueError(f"the grid {layout} holds {layout.world_size} rank(s), but the "
                             f"process group has {size}: lay out a grid of {size}.")
        if size != dist.get_world_size():
            raise ValueError(
                f"a grid over a process group of {size} of the {dist.get_world_size()} ranks: "
                "dist.new_group needs every rank of the default group, so lay the grid over "
                "all of them (group=None).")
        rank = dist.get_rank(group)

        def to_global(ranks: tuple[int, ...]) -> list[int]:
            return [dist.get_global_rank(group, r) if group is not None else r for r in ranks]

        mine: dict[str, ProcessGroup] = {}
        for name, ranks in layout.creation_order():  # the same order on every rank
            made = dist.new_group(to_global(ranks))
            if rank in ranks:
                mine[name] = made
        return cls(layout, rank, tuple(mine[name] for name in layout.names), group)

    def __getitem__(self, name: str) -> ProcessGroup:
        """This rank's group along dimension ``name``."""
        return self.groups[self.layout.dim(name)]

    @property
    def coordinate(self) -> tuple[int, ...]:
        """This rank's coordinate on the grid."""
        return self.layout.coordinate(self.rank)

    def ranks(self, name: str) -> tuple[int, ...]:
        """The ranks (of ``group``) in this rank's group along ``name``."""
        return self.layout.group_of(self.rank, name)


# --- the course's layouts --------------------------------------------------------------------


def node_layout(world_size: int, node_size: int) -> GridLayout:
    """The hierarchical all-reduce's grid: n = N/g nodes of g = ``node_size`` consecutive
    ranks, ``("cross", "node")`` of shape (n, g). Along "node": the ranks of one node,
    ``[j·g, (j+1)·g)``; along "cross": the ranks with local rank l on every node,
    ``[l, l+g, l+2g, ...]``. Rank r's coordinate is (its node r // g, its local rank r % g)."""
    return GridLayout.of(world_size, cross=None, node=node_size)


def hybrid_layout(world_size: int, shard_size: int) -> GridLayout:
    """HSDP's grid (``FSDP(module, shard_size=g)``; torch's ``("replicate", "shard")`` mesh):
    shape (n, g), n = N/g. Along "shard": the g consecutive ranks ``[i·g, (i+1)·g)`` that
    together hold one copy of the parameters; along "replicate": the n ranks
    ``[j, j+g, j+2g, ...]`` that hold the same shard, j = r % g."""
    return GridLayout.of(world_size, replicate=None, shard=shard_size)


@dataclass(frozen=True)
class HybridGroups:
    """This rank's two process groups under HSDP, on :func:`hybrid_layout`."""

    shard: ProcessGroup | None
    """The g ranks that together hold one copy of the parameters: all-gathers and
    reduce-scatters run here. The wrapped process group itself when ``shard_size`` = N."""
    replicate: ProcessGroup | None
    """The n = N/g ranks that hold the same shard: the gradient shard's all-reduce runs here.
    None when there is one copy (``shard_size`` = N): nothing to all-reduce."""
    layout: GridLayout


def hybrid_groups(shard_size: int, process_group: ProcessGroup | None = None) -> HybridGroups:
    """HSDP's groups for this rank (call it on every rank): a :class:`ProcessGrid` on
    :func:`hybrid_layout` over ``process_group``. With ``shard_size`` = N (plain FSDP) no
    group is made, so then ``process_group`` may be any group."""
    layout = hybrid_layout(dist.get_world_size(process_group), shard_size)
    if layout.size("replicate") == 1:
        return HybridGroups(process_group, None, layout)
    grid = ProcessGrid.build(layout, process_group)
    return HybridGroups(grid["shard"], grid["replicate"], layout)
