"""Chapter 6, part 2: fully sharded data parallelism (ZeRO stage 3, arXiv 1910.02054; PyTorch
FSDP, arXiv 2304.11277) from scratch.

:class:`FSDP` cuts a model into *units* (by default: every direct child module with trainable
parameters, plus a root unit for the rest). Each unit's trainable parameters are flattened
into one vector, zero-padded to a multiple of N and split into N equal shards; rank r keeps
shard r, in fp32, as an ``nn.Parameter`` (the optimizer's parameters are the shards). Then
for every unit, every step:

* **before its forward** (``unshard``): all-gather the shards into the unit's full flat
  vector, in ``compute_dtype``, and point the unit's parameters at views of it;
* **after its forward** (``reshard``): free the full vector's storage (``resize_(0)``): the
  views that autograd saved for backward stay, empty;
* **before its backward** (a hook on the unit's outputs): all-gather again, into the same
  storage, so the saved views are valid again;
* **after its backward** (a hook on the full vector, once its gradient is complete):
  reduce-scatter the gradient, add shard r of the sum divided by N to the shard's ``.grad``,
  and free the full vector and its gradient.

Traffic per rank and step, for S bytes of parameters: an all-gather in forward and one in
backward, (N-1)/N * S each, and a reduce-scatter, (N-1)/N * S: 3(N-1)/N * S, 1.5 times DDP's
all-reduce. Memory: 1/N of everything, plus the full parameters and gradient of the units
in flight. Frozen parameters stay whole on every rank, outside the flat vectors (in
``compute_dtype`` when one is given: nothing steps them, so no fp32 copy is kept); a parameter
shared by two units (tied weights) belongs to the root unit.

By default the collectives are torch.distributed's, started asynchronously: the next unit's
all-gather is prefetched while this one computes, and a unit's reduce-scatter travels while
the next one computes its gradient (on gloo, which has no reduce-scatter, it is an all-to-all
and a local sum: :func:`_reduce_scatter_from`). With ``collectives=Algorithm.RING`` they are
chapter 3's and 4's ring (:mod:`labs.collectives`, point-to-point messages, one at a time), so
a :class:`~labs.collectives.Recorder` counts every byte. Names follow PyTorch FSDP:
``unshard``/``reshard``, ``ShardedState``, ``finish_gradient_synchronization``.

**HSDP** (hybrid sharding, ``FSDP(module, shard_size=g)``; PyTorch's
``ShardingStrategy.HYBRID_SHARD``, or ``fully_shard`` on a 2-D ``("replicate", "shard")``
mesh). The N ranks are cut into n = N/g groups of g consecutive ranks, ``[0, g)``,
``[g, 2g)``, ... (a node each, when g is the number of GPUs per node). Parameters are sharded
*inside* a group, g shards, and each shard is replicated n times, once per group: rank r holds
shard ``r % g``. Per unit and step: the all-gathers run inside the group; the gradient is
reduce-scattered inside the group (the sum over its g ranks), then each shard is all-reduced
*across* the groups, among the n ranks that hold the same shard (``r % g`` equal), and divided
by N: the mean over every rank, as in FSDP. Traffic per rank and step, S bytes of parameters:

* inside the group: two all-gathers and a reduce-scatter, 2(g-1)/g·S + (g-1)/g·S;
* across the groups: an all-reduce of S/g, 2(n-1)/n·S/g (n·g = N ranks send 2(n-1)·S in all,
  where a flat FSDP ring over N ranks sends n·3(N-1)/N·S over the n links between groups).

Memory: 1/g of the parameters, the gradients and the optimizer state (plus the padding to a
multiple of g), where FSDP holds 1/N. ``shard_size=None`` (or N) is FSDP; ``shard_size=1``
replicates everything, like DDP (no all-gather, the gradient all-reduced across all N).
"""

from __future__ import annotations

import contextlib
import enum
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from labs.activations import checkpoint_module
from labs.collectives import (
    Algorithm,
    Recorder,
    ring_all_gather,
    ring_all_reduce,
    ring_reduce_scatter,
)
from labs.zero import shard_numel


class ShardedState(enum.Enum):
    """Whether a unit's full parameters exist right now."""

    SHARDED = "sharded"
    """Only this rank's shard is held; the full vector's storage is empty."""
    GATHERING = "gathering"
    """A prefetch: the all-gather into the full vector is in flight (torch collectives)."""
    UNSHARDED = "unsharded"
    """The full vector is gathered and the unit's parameters are views of it."""


class Event(enum.Enum):
    """What an :class:`FSDP` observer is told, with the unit's name."""

    UNSHARD_FORWARD = "all-gather for forward"
    """The unit's full vector has been gathered and its forward is about to run."""
    PREFETCH = "prefetch all-gather"
    """The unit's all-gather has been started, before the unit that runs just ahead of it
    computes, and is in flight (torch collectives, from the second step on: the order of the
    previous step tells which unit comes next). Its storage is allocated from now on."""
    RESHARD_FORWARD = "free after forward"
    """The unit's forward is done and its gathered vector has been freed."""
    UNSHARD_BACKWARD = "all-gather for backward"
    """The unit's full vector has been gathered again for its backward."""
    KEEP_GRADIENT = "keep unsharded gradient"
    """Inside :meth:`FSDP.no_sync`: the unit's full gradient is complete and is kept whole
    (added to what earlier micro-batches left), not reduce-scattered."""
    REDUCE_SCATTER = "reduce-scatter gradient"
    """The unit's full gradient is complete and its reduce-scatter is about to start."""
    RESHARD_BACKWARD = "free after backward"
    """The unit's gathered vector is freed again: of its parameters only the shard remains
    (with torch collectives, its gradient's reduce-scatter may still be in flight)."""


@dataclass
class _Place:
    """Where a parameter lives in the module tree: ``module.<attr>``."""

    module: nn.Module
    attr: str


@dataclass
class _Reduction:
    """An in-flight reduce-scatter of a unit's full gradient (torch collectives)."""

    work: Any
    """The ``dist.Work`` to wait for."""
    full_grad: torch.Tensor
    """The input: it must live until the work is done."""
    received: torch.Tensor
    """The output shard, or (all-to-all) the N pieces of this rank's shard, one per rank."""
    pieces: int
    """How many pieces ``received`` holds (1: the shard itself)."""

    def land(self) -> torch.Tensor:
        """Wait; return this rank's shard of the sum over ranks.

        The full gradient (and the all-to-all's N pieces) are freed here, not left to
        reference counting: a backend may hold a finished work's tensors a little longer
        (gloo's worker thread lets go of them a moment after ``wait()`` returns, a quarter of
        the time on 2 cores), and an S-sized gradient would stay allocated, and measured,
        into the optimizer step. On a GPU ``wait()`` has ordered this stream after the
        collective, so the memory is not reused before the collective has read it."""
        self.work.wait()
        self.full_grad.untyped_storage().resize_(0)
        if self.pieces == 1:
            return self.received
        summed = self.received.view(self.pieces, -1).sum(0)  # 1-D, shard numel
        self.received.untyped_storage().resize_(0)
        return summed


@dataclass(eq=False)  # units compare by identity (the fields hold tensors)
class FlatUnit:
    """One unit: its parameters as one flat vector, this rank's fp32 shard, the full vector."""

    name: str
    module: nn.Module
    names: list[list[str]]
    """Per parameter, its names in the wrapped model (two or more when tied)."""
    shapes: list[torch.Size]
    places: list[list[_Place]]
    """Per parameter, every attribute that refers to it (two or more when tied)."""
    offsets: list[int]
    numel: int
    """Elements of the parameters together (without padding)."""
    shard: nn.Parameter
    """1-D fp32, numel = ceil(numel / N): this rank's shard of the padded flat vector."""
    full: torch.Tensor
    """1-D, compute dtype, numel = N * shard numel, a leaf that requires grad; its storage
    is empty while SHARDED."""
    state: ShardedState = ShardedState.SHARDED
    backward_pending: bool = False
    hooks: list[Any] = field(default_factory=list)
    gather: Any = None
    """The in-flight all-gather's ``dist.Work`` while GATHERING."""
    reduce: _Reduction | None = None
    """The in-flight reduce-scatter of the unit's gradient (torch collectives)."""
    placeholders: list[ShardedPlaceholder] = field(default_factory=list)
    """Per parameter, what its attributes hold while the unit is SHARDED."""
    unsharded_grad: torch.Tensor | None = None
    """Inside :meth:`FSDP.no_sync`: the sum of the micro-batches' full gradients so far
    (1-D, padded numel, ``reduce_dtype`` or the compute dtype), reduce-scattered with the
    first backward outside ``no_sync``."""

    @property
    def padded_numel(self) -> int:
        return self.full.numel()

    def views(self) -> Iterator[tuple[list[_Place], torch.Tensor]]:
        """Each parameter's view of the full vector. One split, not a slice per parameter:
        in backward a split's gradient is one concatenation of the pieces' gradients, where
        each slice would zero a full-sized tensor, copy its piece in, and the zeros be summed."""
        sizes = [shape.numel() for shape in self.shapes]
        pieces = self.full.split([*sizes, self.padded_numel - self.numel])
        # zip stops before the last piece: the padding, which no parameter views
        for places, shape, piece in zip(self.places, self.shapes, pieces, strict=False):
            yield places, piece.view(shape)


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


def _cast_floats(value: Any, dtype: torch.dtype) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() else value
    if isinstance(value, dict):
        return {k: _cast_floats(v, dtype) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_cast_floats(v, dtype) for v in value)
    return value


class ShardedPlaceholder(torch.Tensor):
    """What a unit's parameter attribute holds while the unit is sharded: the parameter's
    shape and dtype (on the meta device, no data) and an error, naming the parameter and its
    unit, for every operation on it: its values exist only as N shards until the unit's
    forward gathers them. (A plain meta tensor would not do: an operator given a CPU tensor
    and a meta tensor may return uninitialised memory instead of failing; a view of the
    freed storage would crash the process.)"""

    # Skip the __torch_function__ layer: every operation goes to __torch_dispatch__, which
    # refuses it; shape, dtype and device are read from the wrapper without an operation.
    __torch_function__ = torch._C._disabled_torch_function_impl

    param_name: str
    unit_name: str

    @staticmethod
    def __new__(cls: type[ShardedPlaceholder], shape: torch.Size, dtype: torch.dtype,
                param_name: str,
                unit_name: str) -> ShardedPlaceholder:
        placeholder = torch.Tensor._make_wrapper_subclass(cls, shape, dtype=dtype,
                                                          device="meta")
        placeholder.param_name, placeholder.unit_name = param_name, unit_name
        return placeholder

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict | None = None) -> Any:
        found = next(t for t in _tensors([*args, *(kwargs or {}).values()])
                     if isinstance(t, ShardedPlaceholder))
        raise RuntimeError(
            f"FSDP: {func.__name__.split('.')[0]} read {found.param_name}, which belongs to "
            f"unit {found.unit_name!r} and is sharded now: its values are gathered only while "
            f"that unit's forward runs (and for its backward). Use a parameter only inside "
            "the forward of the unit that holds it (not as layer.weight from another "
            "module), or leave that module out of `units` so that its parameters go to the "
            "root unit, gathered for the whole forward; between steps, read the parameters "
            "with gather_full_params().")

    def __repr__(self) -> str:  # printing must not run an operation
        return (f"ShardedPlaceholder({self.param_name}, shape={tuple(self.shape)}, "
                f"dtype={self.dtype}, unit={self.unit_name!r})")


def _point_at_placeholders(unit: FlatUnit) -> None:
    if not unit.placeholders:  # made once: a unit is resharded twice a step
        unit.placeholders = [ShardedPlaceholder(shape, unit.full.dtype, names[0], unit.name)
                             for shape, names in zip(unit.shapes, unit.names, strict=True)]
    for places, placeholder in zip(unit.places, unit.placeholders, strict=True):
        for place in places:
            setattr(place.module, place.attr, placeholder)


def _all_gather_into(out: torch.Tensor, shard: torch.Tensor, group: dist.ProcessGroup | None
                     ) -> Any:
    """torch.distributed's all-gather of equal shards into ``out``, asynchronously."""
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(out, shard, group=group, async_op=True)


def _reduce_scatter_from(full_grad: torch.Tensor, world_size: int,
                         group: dist.ProcessGroup | None) -> _Reduction:
    """Start a reduce-scatter (SUM) of ``full_grad`` (1-D, N x shard), asynchronously.

    gloo has no reduce-scatter of its own: torch's ``reduce_scatter_tensor`` on gloo is an
    all-reduce of the whole tensor followed by a copy, twice the bytes of a reduce-scatter.
    On gloo this sends piece j of the gradient to rank j with one all-to-all and sums the N
    pieces that arrive, the direct algorithm: (N-1)/N x S sent per rank, as in the ring, in
    the background, at the cost of an S-sized receive buffer while it is in flight."""
    shard_numel = full_grad.numel() // world_size
    if world_size > 1 and dist.get_backend(group) == "gloo":
        received = torch.empty_like(full_grad)
        work = dist.all_to_all_single(received, full_grad, group=group, async_op=True)
        return _Reduction(work, full_grad, received, world_size)
    out = torch.empty(shard_numel, dtype=full_grad.dtype, device=full_grad.device)
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return _Reduction(fn(out, full_grad, group=group, async_op=True), full_grad, out, 1)


def check_shard_size(shard_size: int | None, world_size: int) -> int:
    """``shard_size`` as an int (None: ``world_size``, plain FSDP), or a ValueError that says
    what to pick: it must divide the world size."""
    if shard_size is None:
        return world_size
    divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
    if isinstance(shard_size, bool) or not isinstance(shard_size, int) or shard_size < 1 \
            or world_size % shard_size:
        raise ValueError(
            f"shard_size must be a positive int that divides the world size: {world_size} "
            f"rank(s) cannot be cut into groups of {shard_size!r}. Pick one of "
            f"{', '.join(map(str, divisors))} (e.g. the number of GPUs per node), or None to "
            f"shard over all {world_size} rank(s).")
    return shard_size


def hybrid_layout(world_size: int, shard_size: int) -> tuple[list[list[int]], list[list[int]]]:
    """(shard groups, replicate groups) of HSDP, as lists of ranks (0 .. N-1 of the process
    group): shard group i is the g consecutive ranks ``[i*g, (i+1)*g)``; replicate group j
    the n = N/g ranks at position j of their shard group, ``[j, j+g, j+2g, ...]``. Rank r is
    in shard group ``r // g`` and replicate group ``r % g``."""
    g = check_shard_size(shard_size, world_size)
    shard = [list(range(i * g, (i + 1) * g)) for i in range(world_size // g)]
    replicate = [list(range(j, world_size, g)) for j in range(g)]
    return shard, replicate


@dataclass(frozen=True)
class HybridGroups:
    """This rank's two process groups under HSDP, and the ranks (of the wrapped process
    group) in each."""

    shard: dist.ProcessGroup | None
    """The g ranks that together hold one copy of the parameters: all-gathers and
    reduce-scatters run here. None: the whole process group (``shard_size`` = N)."""
    replicate: dist.ProcessGroup | None
    """The n = N/g ranks that hold the same shard: the gradient shard's all-reduce runs here.
    None when there is one group (``shard_size`` = N): nothing to all-reduce."""
    shard_ranks: tuple[int, ...]
    replicate_ranks: tuple[int, ...]


def hybrid_groups(shard_size: int, process_group: dist.ProcessGroup | None = None
                  ) -> HybridGroups:
    """Create HSDP's sub-groups (:func:`hybrid_layout`) and return this rank's.

    ``dist.new_group`` must be called by every rank of the default group for every new group,
    in the same order, members or not: all shard groups first, then all replicate groups.
    With ``shard_size`` = N nothing is created. ``process_group``, if given, must hold every
    rank (a sub-group's outsiders would not make the calls)."""
    world_size, rank = dist.get_world_size(process_group), dist.get_rank(process_group)
    g = check_shard_size(shard_size, world_size)
    shard_layout, replicate_layout = hybrid_layout(world_size, g)
    mine_shard, mine_replicate = shard_layout[rank // g], replicate_layout[rank % g]
    if g == world_size:
        return HybridGroups(process_group, None, tuple(mine_shard), tuple(mine_replicate))
    if process_group is not None and world_size != dist.get_world_size():
        raise ValueError(
            f"shard_size={g} with a process_group of {world_size} of the "
            f"{dist.get_world_size()} ranks: HSDP's sub-groups are made by every rank, so pass "
            "a process group of all ranks (or none), or shard_size=None.")

    def to_global(ranks: list[int]) -> list[int]:
        return [dist.get_global_rank(process_group, r) if process_group else r for r in ranks]

    made: dict[tuple[int, ...], dist.ProcessGroup] = {}
    for ranks in [*shard_layout, *replicate_layout]:  # the same order on every rank
        made[tuple(ranks)] = dist.new_group(to_global(ranks))
    return HybridGroups(made[tuple(mine_shard)], made[tuple(mine_replicate)],
                        tuple(mine_shard), tuple(mine_replicate))


#: Containers that hold modules but are never called: their parent's forward calls the
#: modules inside, so forward hooks on the container itself never fire.
_NEVER_CALLED = (nn.ModuleList, nn.ModuleDict)


def _checked_units(module: nn.Module, units: Sequence[nn.Module]) -> list[nn.Module]:
    """``units`` as a list, after the checks that make a wrong one a clear error."""
    names = {id(m): name for name, m in module.named_modules(remove_duplicate=False)}
    chosen: list[nn.Module] = []
    for i, unit in enumerate(units):
        if not isinstance(unit, nn.Module):
            raise TypeError(f"units[{i}] must be an nn.Module (a submodule of the wrapped "
                            f"model), got {type(unit).__name__}.")
        if unit is module:
            raise ValueError(f"units[{i}] is the wrapped module itself, which is always the "
                             "root unit: list only its submodules.")
        if id(unit) not in names:
            raise ValueError(f"units[{i}] ({type(unit).__name__}) is not a submodule of the "
                             "wrapped module: pick units from the model passed to FSDP, e.g. "
                             "units=list(model.layers).")
        if isinstance(unit, _NEVER_CALLED):
            raise ValueError(
                f"units[{i}] ({names[id(unit)]!r}) is a {type(unit).__name__}, which is never "
                "called (its parent calls the modules inside), so it could never gather its "
                f"parameters: list its elements instead, e.g. units=list(model.{names[id(unit)]}).")
        if any(unit is other for other in chosen):
            raise ValueError(f"units[{i}] ({names[id(unit)]!r}) is listed twice.")
        chosen.append(unit)
    return chosen


def default_units(module: nn.Module) -> list[nn.Module]:
    """Every direct child with trainable parameters: the layers of a Sequential, the blocks
    of a transformer if they are its children. A ModuleList or ModuleDict child contributes
    its elements instead (it is never called, so it could not gather for them)."""
    units: list[nn.Module] = []
    for child in module.children():
        if isinstance(child, _NEVER_CALLED):
            units += default_units(child)
        elif any(p.requires_grad for p in child.parameters()):
            units.append(child)
    return units


class FSDP(nn.Module):
    """ZeRO stage 3 (see the module docstring). Use it like :class:`labs.ddp.DDP`:

        model = FSDP(net)                          # or FSDP(net, units=[...])
        optimizer = torch.optim.Adam(model.parameters())   # fp32 shards (+ frozen params)
        model(x).sum().backward()
        model.finish_gradient_synchronization()
        optimizer.step()

    ``model.state_dict()`` holds the shards (``shards.<i>``), not the model's names:
    :meth:`gather_full_params` returns the full state dict under those names.

    Args:
        module: the model, built the same way on every rank (its parameters are broadcast
            from rank 0 before they are sharded).
        compute_dtype: dtype of the gathered parameters, of forward and backward, and of the
            collectives (e.g. ``torch.bfloat16``); the shards stay fp32, frozen parameters are
            held in it. Floating-point inputs of every unit's forward are cast to it.
        reduce_dtype: dtype in which the gradients are reduce-scattered (summed over ranks);
            None (default, as torch's ``MixedPrecisionPolicy``): ``compute_dtype``. With bf16
            compute, ``torch.float32`` sums N bf16 gradients without rounding each partial
            sum to bf16, for twice the reduce-scatter's bytes.
        units: the submodules to shard as units (each gathered and freed on its own); the
            default is :func:`default_units`. Units may nest: a parameter belongs to the
            innermost unit around it. Parameters outside them form the root unit.
        activation_checkpointing: make the forward of every unit that holds no other unit
            an activation checkpoint (:func:`labs.activations.checkpoint_module`,
            non-reentrant ``torch.utils.checkpoint``): a unit keeps only its inputs for
            backward, and its backward gathers the parameters, runs the forward again, then
            computes the gradients. The root unit (the whole model) is not checkpointed.
        observer: called with an :class:`Event` and the unit's name at every gather, free
            and reduce-scatter (the memory timeline of chapter 6 snapshots there).
        collectives: ``Algorithm.TORCH`` (default): torch.distributed's all-gather and
            reduce-scatter, asynchronous: the next unit's all-gather is started while this one
            computes (prefetch, in the order of the last step's forward and backward), and a
            unit's reduce-scatter travels while the next unit computes its gradient. (gloo
            has no reduce-scatter of its own; on gloo it is an all-to-all and a local sum,
            see :func:`_reduce_scatter_from`.) ``Algorithm.RING``: chapters 3 and 4's ring
            for everything, one collective at a time, every byte counted by ``recorder``.
        recorder: counts the bytes this rank sends (with ``Algorithm.RING``).
        shard_size: HSDP (see the module docstring): shard inside groups of this many
            consecutive ranks, replicate across the groups. None (default): shard over every
            rank (plain FSDP, the same as N); 1: replicate everything, like DDP. It must
            divide the world size. Under HSDP :attr:`rank`, :attr:`world_size` and
            :attr:`group` stay those of the whole process group (the gradient is the mean
            over all N); :attr:`shard_rank`, :attr:`shard_size`, :attr:`shard_group` and
            :attr:`replicate_group` describe the sharding.
        replicate_recorder: with ``Algorithm.RING`` and ``shard_size``, counts the bytes of
            the all-reduces across groups (between nodes); ``recorder`` then counts those
            inside a group only. None: ``recorder`` counts both.
    """

    def __init__(self, module: nn.Module, compute_dtype: torch.dtype | None = None, *,
                 reduce_dtype: torch.dtype | None = None,
                 units: Sequence[nn.Module] | None = None,
                 activation_checkpointing: bool = False,
                 collectives: Algorithm = Algorithm.TORCH,
                 process_group: dist.ProcessGroup | None = None,
                 observer: Callable[[Event, str], None] | None = None,
                 recorder: Recorder | None = None,
                 shard_size: int | None = None,
                 replicate_recorder: Recorder | None = None) -> None:
        super().__init__()
        if collectives not in (Algorithm.TORCH, Algorithm.RING):
            raise ValueError(f"collectives must be Algorithm.TORCH (torch.distributed's, "
                             f"asynchronous, with prefetching) or Algorithm.RING (chapters 3 "
                             f"and 4's, counted by a Recorder); got {collectives!r}.")
        for name, dtype in (("compute_dtype", compute_dtype), ("reduce_dtype", reduce_dtype)):
            if dtype is not None and not (isinstance(dtype, torch.dtype)
                                          and dtype.is_floating_point):
                raise ValueError(f"{name} must be None or a floating-point torch.dtype (e.g. "
                                 f"torch.bfloat16), got {dtype!r}.")
        if (recorder is not None or replicate_recorder is not None) \
                and collectives is not Algorithm.RING:
            raise ValueError("a Recorder counts the ring's messages: pass "
                             "collectives=Algorithm.RING with it.")
        self.module = module
        self.collectives = collectives
        self.group = process_group
        self.rank = dist.get_rank(process_group)
        self.world_size = dist.get_world_size(process_group)
        # Refused here, before any collective: a rank that raised later would leave the
        # others waiting in a broadcast.
        self.shard_size = check_shard_size(shard_size, self.world_size)
        #: This rank's position in its shard group: the shard it holds.
        self.shard_rank = self.rank % self.shard_size
        #: N / shard_size: how many copies of each shard exist (1 for FSDP).
        self.replicas = self.world_size // self.shard_size
        groups = hybrid_groups(self.shard_size, process_group)
        #: Where the all-gathers and reduce-scatters run (``group`` for plain FSDP).
        self.shard_group = groups.shard
        #: Where the gradient shards are all-reduced; None for plain FSDP.
        self.replicate_group = groups.replicate
        # A group of one has nothing to gather or reduce-scatter: the ring's functions copy
        # (gloo's reduce_scatter_tensor is not there on every torch version).
        self._ring_reduce = collectives is Algorithm.RING or self.shard_size == 1
        self.compute_dtype = compute_dtype
        self.reduce_dtype = reduce_dtype
        self.observer = observer
        self.recorder = recorder
        self.replicate_recorder = recorder if replicate_recorder is None else replicate_recorder
        chosen = _checked_units(module, units) if units is not None else default_units(module)
        with torch.no_grad():
            root = dist.get_global_rank(process_group, 0) if process_group else 0
            for tensor in [*module.parameters(), *module.buffers()]:
                dist.broadcast(tensor, src=root, group=process_group)
        self.units = self._build_units(module, chosen)
        if compute_dtype is not None:
            with torch.no_grad():  # no optimizer steps them: no fp32 master copy is needed
                for p in module.parameters():
                    if not p.requires_grad and p.is_floating_point():
                        p.data = p.data.to(compute_dtype)
        #: False inside :meth:`no_sync`: backward keeps full gradients instead of
        #: reduce-scattering them.
        self.require_gradient_sync = True
        self._undo_checkpointing = [
            checkpoint_module(u.module) for u in self.units
            if activation_checkpointing and u.module is not module
            and not any(o.module is not u.module and o.module in set(u.module.modules())
                        for o in self.units)]
        self.shards = nn.ParameterList([u.shard for u in self.units])
        #: The units in the order their forward and their backward ran in the last step:
        #: prefetching follows them.
        self.forward_order: list[FlatUnit] = []
        self.backward_order: list[FlatUnit] = []
        self._seen_forward: list[FlatUnit] = []
        self._seen_backward: list[FlatUnit] = []
        for unit in self.units:
            unit.hooks.append(unit.full.register_post_accumulate_grad_hook(
                lambda _full, u=unit: self._post_backward(u)))
            unit.hooks.append(unit.module.register_forward_pre_hook(
                lambda _m, args, u=unit: self._pre_forward(u, args)))
            unit.hooks.append(unit.module.register_forward_hook(
                lambda _m, _args, out, u=unit: self._post_forward(u, out)))

    # -- construction --

    def _build_units(self, module: nn.Module, chosen: list[nn.Module]) -> list[FlatUnit]:
        """Assign every trainable parameter to one unit: the innermost chosen unit around the
        module that registers it (units may nest, as with torch's ``fully_shard``: the outer
        unit gathers only what its inner units do not hold). A parameter used by two units,
        or outside every chosen one, goes to the root (the wrapped module itself)."""
        owner_of: dict[int, nn.Module] = {}
        places: dict[int, list[_Place]] = {}
        all_names: dict[int, list[str]] = {}
        params: dict[int, nn.Parameter] = {}
        unit_of_module = {id(m): m for u in chosen for m in u.modules()}
        # An inner unit has fewer modules than any unit around it, so writing the largest
        # first leaves each module mapped to its innermost unit, whatever the order given.
        outer_first = sorted(chosen, key=lambda u: -sum(1 for _ in u.modules()))
        unit_root = {id(m): u for u in outer_first for m in u.modules()}
        for mod_name, mod in module.named_modules(remove_duplicate=False):
            for attr, p in list(mod._parameters.items()):
                if p is None or not p.requires_grad:
                    continue
                key = id(p)
                params[key] = p
                places.setdefault(key, []).append(_Place(mod, attr))
                all_names.setdefault(key, []).append(f"{mod_name}.{attr}" if mod_name else attr)
                owner = unit_root.get(id(mod)) if id(mod) in unit_of_module else module
                if key in owner_of and owner_of[key] is not owner:
                    owner = module  # tied across units: the root holds it
                owner_of[key] = owner
        units = []
        for unit_module in [*chosen, module]:
            keys = [k for k in params if owner_of[k] is unit_module]
            if keys:
                name = next((n for n, m in module.named_modules() if m is unit_module), "")
                units.append(self._flat_unit(name or "root", unit_module, keys, params, places,
                                             all_names))
        return units

    def _flat_unit(self, name: str, unit_module: nn.Module, keys: list[int],
                   params: dict[int, nn.Parameter], places: dict[int, list[_Place]],
                   all_names: dict[int, list[str]]) -> FlatUnit:
        shapes = [params[k].shape for k in keys]
        offsets, total = [], 0
        for shape in shapes:
            offsets.append(total)
            total += shape.numel()
        k = shard_numel(total, self.shard_size)
        flat = torch.zeros(k * self.shard_size, dtype=torch.float32)  # the padded vector
        for key, offset in zip(keys, offsets, strict=True):
            flat[offset:offset + params[key].numel()] = params[key].detach().reshape(-1)
        device = params[keys[0]].device
        shard = nn.Parameter(flat[self.shard_rank * k:(self.shard_rank + 1) * k].clone()
                             .to(device))
        dtype = self.compute_dtype or torch.float32
        full = torch.empty(k * self.shard_size, dtype=dtype, device=device, requires_grad=True)
        full.untyped_storage().resize_(0)  # SHARDED: nothing held beyond the shard
        for key in keys:
            for place in places[key]:
                del place.module._parameters[place.attr]  # now a plain attribute (a view)
        unit = FlatUnit(name, unit_module, [all_names[k] for k in keys], shapes,
                        [places[k] for k in keys], offsets, total, shard, full)
        _point_at_placeholders(unit)
        return unit

    # -- forward and backward hooks --

    def _notify(self, event: Event, unit: FlatUnit) -> None:
        if self.observer is not None:
            self.observer(event, unit.name)

    def unshard(self, unit: FlatUnit, *, prefetch: bool = False) -> None:
        """All-gather the unit's shards into its full vector and point its parameters at it.
        With ``prefetch`` (torch collectives only) the all-gather is started and left in
        flight (GATHERING); the next ``unshard`` of the unit waits for it."""
        if unit.state is ShardedState.SHARDED:
            full = unit.full
            full.untyped_storage().resize_(full.numel() * full.element_size())
            shard = unit.shard.detach().to(full.dtype)
            # Into .data: the version counter autograd checks is not bumped, so the views it
            # saved in forward are valid in backward once the storage is filled again.
            if self.collectives is Algorithm.RING or self.shard_size == 1:
                ring_all_gather(shard, group=self.shard_group, recorder=self.recorder,
                                out=full.data)
            else:
                unit.gather = _all_gather_into(full.data, shard, self.shard_group)
            unit.state = ShardedState.GATHERING
        if unit.state is ShardedState.GATHERING and not prefetch:
            if unit.gather is not None:
                unit.gather.wait()
                unit.gather = None
            for places, view in unit.views():
                for place in places:
                    setattr(place.module, place.attr, view)
            unit.state = ShardedState.UNSHARDED

    def reshard(self, unit: FlatUnit) -> None:
        """Free the unit's full vector (its storage becomes empty; the shard stays). The
        unit's parameter attributes become :class:`ShardedPlaceholder` s (shape and dtype,
        and an error for any operation on them). :meth:`gather_full_params` reads the
        parameters between steps."""
        if unit.state is ShardedState.GATHERING:
            self.unshard(unit)  # a prefetch nobody used: let it land before freeing
        if unit.state is ShardedState.UNSHARDED:
            unit.full.untyped_storage().resize_(0)
            _point_at_placeholders(unit)
            unit.state = ShardedState.SHARDED

    def _prefetch_after(self, unit: FlatUnit, order: list[FlatUnit]) -> None:
        """Start gathering the unit that ``order`` runs after ``unit``, so that its all-gather
        travels while ``unit`` computes (torch collectives only)."""
        if self.collectives is not Algorithm.TORCH or unit not in order:
            return
        position = order.index(unit)
        if position + 1 < len(order) and order[position + 1].state is ShardedState.SHARDED:
            self.unshard(order[position + 1], prefetch=True)
            self._notify(Event.PREFETCH, order[position + 1])

    def _pre_forward(self, unit: FlatUnit, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
        self.unshard(unit)
        self._notify(Event.UNSHARD_FORWARD, unit)
        if torch.is_grad_enabled() and unit not in self._seen_forward:  # once per micro-batch run
            self._seen_forward.append(unit)
        self._prefetch_after(unit, self.forward_order)
        # Each unit's floating inputs in the compute dtype (as fully_shard's
        # cast_forward_inputs): a buffer or a frozen weight kept in fp32 between units would
        # otherwise promote the activations back to fp32 before a bf16 layer.
        return _cast_floats(args, self.compute_dtype) if self.compute_dtype else None

    def _post_forward(self, unit: FlatUnit, output: Any) -> None:
        self.reshard(unit)
        self._notify(Event.RESHARD_FORWARD, unit)
        if not torch.is_grad_enabled():
            return
        unit.backward_pending = True
        for tensor in _tensors(output):
            if tensor.requires_grad:
                tensor.register_hook(lambda grad, u=unit: self._pre_backward(u, grad))

    def _pre_backward(self, unit: FlatUnit, grad: torch.Tensor) -> torch.Tensor:
        if unit.backward_pending and unit.state is not ShardedState.UNSHARDED:
            # Views that require grad, although backward runs without grad mode: a
            # checkpointed unit runs its forward again on them, and that forward must save
            # what the first one saved (an op on parameters that need no gradient saves less).
            with torch.enable_grad():
                self.unshard(unit)
            self._notify(Event.UNSHARD_BACKWARD, unit)
            if unit not in self._seen_backward:
                self._seen_backward.append(unit)
            self._prefetch_after(unit, self.backward_order)
        return grad

    def _post_backward(self, unit: FlatUnit) -> None:
        """The full vector's gradient is complete: reduce-scatter it into the shard's grad
        (asynchronously with torch collectives: it lands at the next unit's post-backward or
        at :meth:`finish_gradient_synchronization`, whichever comes first)."""
        full_grad = unit.full.grad
        assert full_grad is not None
        if self.reduce_dtype is not None:
            full_grad = full_grad.to(self.reduce_dtype)  # a copy when the dtypes differ
        if unit.unsharded_grad is not None:  # what the no_sync micro-batches left
            full_grad = unit.unsharded_grad.add_(full_grad)
            unit.unsharded_grad = None
        if not self.require_gradient_sync:
            unit.full.grad = None
            unit.unsharded_grad = full_grad  # held whole until a backward outside no_sync
            self._notify(Event.KEEP_GRADIENT, unit)
            unit.backward_pending = False
            self.reshard(unit)
            self._notify(Event.RESHARD_BACKWARD, unit)
            return
        self._notify(Event.REDUCE_SCATTER, unit)  # the full gradient is still there to see
        unit.full.grad = None
        if self._ring_reduce:
            mine = ring_reduce_scatter(full_grad, group=self.shard_group, recorder=self.recorder)
            self._add_grad(unit, self._all_reduce_across(mine))
        else:
            for other in self.units:  # one reduce-scatter in flight: bounded memory
                self._land_reduce(other)
            unit.reduce = _reduce_scatter_from(full_grad, self.shard_size, self.shard_group)
        unit.backward_pending = False
        self.reshard(unit)
        self._notify(Event.RESHARD_BACKWARD, unit)

    def _land_reduce(self, unit: FlatUnit) -> None:
        if unit.reduce is not None:
            summed = unit.reduce.land()
            unit.reduce = None
            self._add_grad(unit, self._all_reduce_across(summed))

    def _all_reduce_across(self, group_sum: torch.Tensor) -> torch.Tensor:
        """HSDP: sum this rank's shard of its group's gradient over the n groups, in place
        (among the ranks that hold the same shard): 2(n-1)/n·S/g bytes sent by the ring.
        Plain FSDP (one group): nothing to do. With torch collectives it runs when the
        group's reduce-scatter lands, blocking: only the reduce-scatter overlaps backward."""
        if self.replicate_group is None:
            return group_sum
        if self.collectives is Algorithm.RING:
            return ring_all_reduce(group_sum, group=self.replicate_group,
                                   recorder=self.replicate_recorder)
        dist.all_reduce(group_sum, group=self.replicate_group)
        return group_sum

    def _add_grad(self, unit: FlatUnit, summed: torch.Tensor) -> None:
        """Add shard r of the sum over ranks, divided by N, to the shard's fp32 gradient
        (under HSDP, the sum over all N ranks: every group's, after the all-reduce across)."""
        mine = summed.to(torch.float32) / self.world_size  # 1-D, shard numel
        if unit.shard.grad is None:
            unit.shard.grad = mine
        else:
            unit.shard.grad += mine

    # -- the public surface --

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.compute_dtype is not None:  # inputs in the parameters' dtype
            args, kwargs = _cast_floats(args, self.compute_dtype), _cast_floats(
                kwargs, self.compute_dtype)
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Gradient accumulation without communication, as ``DistributedDataParallel.no_sync``:
        the backward passes inside keep every unit's full gradient (added up over the
        micro-batches) instead of reduce-scattering it; the first backward outside adds its
        own and reduce-scatters the sum once. For k micro-batches a step then sends one
        reduce-scatter per unit instead of k, at the price of holding the full (unsharded)
        gradient of every unit, S bytes in ``reduce_dtype``, between the micro-batches,
        where accumulating sharded gradients holds S/N. The all-gathers are not saved:
        every micro-batch's forward and backward gather the parameters again."""
        previous, self.require_gradient_sync = self.require_gradient_sync, False
        try:
            yield
        finally:
            self.require_gradient_sync = previous

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the gradient of the whole model, held as N shards, to norm ``max_norm``, as
        ``torch.nn.utils.clip_grad_norm_`` would on one process; return the total norm.

        The p-norm of the full gradient is (sum over ranks of each shard's sum |g|^p)^(1/p)
        (the max over ranks for p = inf): one all-reduce of one number, 4 bytes, and every
        rank scales its shards by the same factor min(1, max_norm / (norm + 1e-6)).
        Clipping each shard by its own norm would scale every rank by a different factor,
        and the step would no longer be the one-process step. Call it after
        :meth:`finish_gradient_synchronization` (the reduce-scatters must have landed).

        Under HSDP the sum runs over one shard group only: the g shards of a group make up
        the whole gradient once, and every other group holds the same shards (after the
        all-reduce across groups), so summing over all N ranks would count each element
        N/g times and give sqrt(N/g) times the norm."""
        if not max_norm > 0:  # inf allowed: the norm alone, nothing scaled
            raise ValueError(f"max_norm must be a positive number, got {max_norm!r}; e.g. 1.0.")
        if not (norm_type == math.inf or norm_type > 0):
            raise ValueError(f"norm_type must be positive or math.inf, got {norm_type!r}.")
        for unit in self.units:
            self._land_reduce(unit)
        grads = [u.shard.grad for u in self.units if u.shard.grad is not None]
        device = self.units[0].shard.device if self.units else torch.device("cpu")
        if norm_type == math.inf:
            local = max((g.detach().abs().max() for g in grads),
                        default=torch.zeros((), device=device)).float().reshape(1)
            op = dist.ReduceOp.MAX
        else:
            local = sum((g.detach().float().abs().pow(norm_type).sum() for g in grads),
                        torch.zeros((), device=device)).reshape(1)
            op = dist.ReduceOp.SUM
        if self.collectives is Algorithm.RING:
            local = ring_all_reduce(local, op, group=self.shard_group, recorder=self.recorder)
        else:
            dist.all_reduce(local, op, group=self.shard_group)
        total = local[0] if norm_type == math.inf else local[0].pow(1.0 / norm_type)
        factor = (max_norm / (total + 1e-6)).clamp(max=1.0)
        for g in grads:
            g.mul_(factor.to(g.dtype))
        return total

    def finish_gradient_synchronization(self) -> None:
        """Check that every unit's gradient was reduce-scattered (they are, during backward)
        and that every full vector is freed. A unit whose parameters got no gradient cannot
        be synchronised: an error names it rather than leaving the ranks out of step."""
        missing = [u.name for u in self.units if u.backward_pending]
        if missing:
            raise RuntimeError(
                f"FSDP: unit(s) {missing} ran forward but got no gradient in backward, so "
                "their reduce-scatter never ran and the other ranks may wait for it. Use "
                "every unit's parameters in the loss, or freeze them (requires_grad=False).")
        for unit in self.units:
            self._land_reduce(unit)
            self.reshard(unit)
        if self._seen_forward:
            self.forward_order, self._seen_forward = self._seen_forward, []
            self.backward_order, self._seen_backward = self._seen_backward, []

    def gather_full_params(self) -> dict[str, torch.Tensor]:
        """The model's full state dict on every rank (fp32 parameters all-gathered from the
        shards, inside the shard group under HSDP; frozen parameters and buffers as they are),
        by the original names."""
        state: dict[str, torch.Tensor] = {}
        for unit in self.units:
            flat = ring_all_gather(unit.shard.detach(), group=self.shard_group)  # fp32, padded
            for names, shape, offset in zip(unit.names, unit.shapes, unit.offsets, strict=True):
                value = flat[offset:offset + shape.numel()].view(shape).clone()
                for name in names:  # a tied parameter under each of its names, like state_dict
                    state[name] = value
        for name, tensor in self.module.state_dict().items():
            state.setdefault(name, tensor.detach().clone())
        return state

    def remove_hooks(self) -> None:
        for unit in self.units:
            for handle in unit.hooks:
                handle.remove()
            unit.hooks = []
        for undo in self._undo_checkpointing:
            undo()
        self._undo_checkpointing = []
