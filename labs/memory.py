"""Per-rank memory, measured from the tensors a rank holds (chapters 3, 4 and the ZeRO/FSDP
chapters).

What is counted, and why
------------------------
:class:`MemoryTimeline` counts the bytes of the **tensor storages** that a rank has registered
with it and that are still alive, at moments the code names ("before all-gather", "after
freeing", ...). A storage is the block of memory behind one or more tensors: a view (a slice,
a ``.view``, a row of a matrix) shares its base tensor's storage, so it is counted once, at the
size of the whole storage it keeps alive. The timeline holds only *weak* references, so a
tensor the code has really let go of (no variable, view or ``Work`` object refers to it any
more) drops out of the count by itself: "freed" is observed, not declared. And it reads each
storage's size at the moment of the snapshot, so a storage shrunk in place with
``untyped_storage().resize_(0)`` (as PyTorch FSDP frees unsharded parameters) counts as empty.

:class:`AllocationTracker` measures what a region of code holds on top of that: every
storage that a PyTorch operator creates inside the ``with`` block (``torch.empty``, ``clone``,
``torch.add(...)`` without ``out=``, ...), and optionally tensors that existed before it, at
their size after every operator, so its ``peak_bytes`` is the largest total alive at once.
That is how the temporary buffers *inside* a collective are seen without opening it up, and
how the peak of a whole FSDP training step is measured.

What is not counted: the caching allocator's reserve, memory that a kernel or the
communication library (gloo's or NCCL's own buffers) allocates without making a tensor,
Python objects, and the process's resident set (RSS). Those are real, but they depend on the
allocator, the library and the operating system, and they do not answer the question the
chapters ask ("which tensors must a rank hold, and how large are they?"). Tensor bytes do, and
on a CPU they are exactly reproducible, so a notebook can compare them with a formula. On CUDA
the snapshot also reports ``torch.cuda.memory_allocated()`` for the devices the tensors live
on; no CUDA function is called for CPU tensors.

Cost: a snapshot is O(number of registered tensors). The tracker runs a little Python after
every operator inside its block, which is fine for the small tensors of the notebooks but not
something to leave on in a training loop. Tables and figures of the snapshots are in
:mod:`labs.viz.memory`.
"""

from __future__ import annotations

import enum
import sys
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from labs.collectives import Algorithm, Collective, all_gather, reduce_scatter, shard_bounds
from labs.launcher import rank_device

# --- records ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Allocation:
    """One storage created inside an :class:`AllocationTracker` block."""

    op: str  #: the operator that made it, e.g. ``"empty"`` or ``"clone"``
    nbytes: int


@dataclass(frozen=True)
class TensorRecord:
    """One registered tensor that was alive at a snapshot."""

    name: str  #: e.g. ``"shard"`` or ``"model.weight.grad"``
    group: str  #: the keyword it was registered under (the bar segment in the plot)
    shape: tuple[int, ...]
    dtype: str
    device: str
    numel: int
    nbytes: int  #: numel x element size: the bytes this tensor (view) spans
    storage_bytes: int  #: the size of the whole storage it keeps alive, at the snapshot
    #: the earlier tensor of this snapshot on the same storage (counted there), or None
    shares_with: str | None = None


@dataclass(frozen=True)
class MemorySnapshot:
    """What one rank held at one named moment.

    ``held_bytes`` is the sum over the *distinct* live storages of the registered tensors;
    ``transient_bytes`` is the peak that an :class:`AllocationTracker` measured for the
    moment (0 when none was given), so ``total_bytes`` is the most the rank held then.
    """

    rank: int
    moment: str
    tensors: tuple[TensorRecord, ...]
    held_bytes: int
    held_elements: int  #: each distinct storage's bytes / its tensor's element size
    transient_bytes: int = 0
    #: ``torch.cuda.memory_allocated`` summed over the CUDA devices of the tensors; None on CPU
    allocator_bytes: int | None = None
    #: the storages the tracker saw being created, in order (empty without a tracker)
    allocations: tuple[Allocation, ...] = ()

    @property
    def total_bytes(self) -> int:
        return self.held_bytes + self.transient_bytes

    def bytes_by_group(self) -> dict[str, int]:
        """Held bytes per registration group; a shared storage counts for its first group."""
        out: dict[str, int] = {}
        for t in self.tensors:
            out[t.group] = out.get(t.group, 0) + (0 if t.shares_with else t.storage_bytes)
        return out

    def elements_by_group(self) -> dict[str, int]:
        """Held elements per registration group, counted like :meth:`bytes_by_group`."""
        out: dict[str, int] = {}
        for t in self.tensors:
            size = t.nbytes // t.numel if t.numel else 0
            held = 0 if t.shares_with or not size else t.storage_bytes // size
            out[t.group] = out.get(t.group, 0) + held
        return out


def find(snapshots: Sequence[MemorySnapshot], moment: str | enum.Enum) -> MemorySnapshot:
    """The snapshot taken at ``moment`` (a label, or an Enum whose value is the label)."""
    label = moment.value if isinstance(moment, enum.Enum) else moment
    for snap in snapshots:
        if snap.moment == label:
            return snap
    known = ", ".join(repr(s.moment) for s in snapshots)
    raise KeyError(f"no snapshot at {label!r}; the moments recorded are: {known}")


# --- walking an object for its tensors ---------------------------------------------------------


def named_tensors(obj: object, prefix: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor reachable from ``obj``, with a dotted name starting at ``prefix``.

    Understands tensors (and a leaf tensor's ``.grad``), ``nn.Module`` (parameters, their
    gradients, buffers), ``torch.optim.Optimizer`` (its state tensors), mappings, lists and
    tuples; ``None`` is skipped. Anything else is refused, so nothing is silently left out.
    """
    if obj is None:
        return
    if isinstance(obj, torch.Tensor):
        yield prefix, obj
        if obj.is_leaf and obj.grad is not None:
            yield f"{prefix}.grad", obj.grad
    elif isinstance(obj, nn.Module):
        for name, param in obj.named_parameters(remove_duplicate=False):
            yield from named_tensors(param, f"{prefix}.{name}")
        for name, buffer in obj.named_buffers(remove_duplicate=False):
            yield f"{prefix}.{name}", buffer
    elif isinstance(obj, torch.optim.Optimizer):
        params = [p for group in obj.param_groups for p in group["params"]]
        for i, param in enumerate(params):
            for key, value in obj.state.get(param, {}).items():
                if isinstance(value, torch.Tensor):  # skip plain numbers such as a float step
                    yield f"{prefix}.state[{i}].{key}", value
    elif isinstance(obj, Mapping):
        for key, value in obj.items():
            yield from named_tensors(value, f"{prefix}.{key}")
    elif isinstance(obj, (list, tuple)):
        for i, value in enumerate(obj):
            yield from named_tensors(value, f"{prefix}[{i}]")
    else:
        raise TypeError(
            f"{prefix}: cannot find tensors in a {type(obj).__name__}. Register tensors, "
            "modules, optimizers, or dicts/lists/tuples of them."
        )


def _storage(tensor: torch.Tensor) -> torch.UntypedStorage:
    if tensor.layout is not torch.strided:
        raise TypeError(
            f"only dense (strided) tensors can be counted, got layout {tensor.layout}; "
            "register the sparse tensor's .values() and .indices() instead."
        )
    return tensor.untyped_storage()


# --- the timeline -----------------------------------------------------------------------------


@dataclass(frozen=True)
class _Entry:
    """A registered tensor: its metadata and a weak reference to its storage."""

    name: str
    group: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    numel: int
    ref: StorageWeakRef


class MemoryTimeline:
    """Snapshots of the tensor storages one rank holds, at moments the code names.

    Usage, inside a rank::

        timeline = MemoryTimeline(rank)
        timeline.record("before all-gather", shard=shard)       # registers shard
        full = all_gather(shard)
        timeline.record("after all-gather", gathered=full)      # shard is still counted
        del full
        timeline.record("after freeing")                        # full has dropped out
        return timeline.snapshots

    Each keyword registers the tensors reachable from its value (see :func:`named_tensors`)
    under that group name. Every snapshot counts all registered tensors that are still
    alive, each distinct storage once. Registration keeps weak references only, so the
    timeline never keeps a tensor alive.
    """

    def __init__(self, rank: int = 0) -> None:
        self.rank = rank
        self._entries: list[_Entry] = []
        self._snapshots: list[MemorySnapshot] = []

    @property
    def snapshots(self) -> tuple[MemorySnapshot, ...]:
        return tuple(self._snapshots)

    def track(self, **tensors: object) -> None:
        """Register tensors without taking a snapshot."""
        for group, obj in tensors.items():
            for name, tensor in named_tensors(obj, group):
                ref = StorageWeakRef(_storage(tensor))
                if any(e.name == name and e.ref.cdata == ref.cdata for e in self._entries):
                    continue
                self._entries.append(_Entry(name, group, tuple(tensor.shape), tensor.dtype,
                                            tensor.device, tensor.numel(), ref))

    def record(
        self, moment: str | enum.Enum, /, *, during: AllocationTracker | None = None,
        **tensors: object,
    ) -> MemorySnapshot:
        """Register ``tensors`` (keyword = group), then snapshot everything registered that is
        still alive. ``during``: a finished :class:`AllocationTracker` whose peak is added as
        the moment's transient bytes."""
        self.track(**tensors)
        label = moment.value if isinstance(moment, enum.Enum) else str(moment)
        records: list[TensorRecord] = []
        owner: dict[int, str] = {}
        held_bytes = held_elements = 0
        cuda: set[torch.device] = set()
        alive = []
        for entry in self._entries:
            # A strong reference for the length of this loop only (the same call that
            # torch.multiprocessing uses to revive a shared storage); None once it is freed.
            storage = torch.UntypedStorage._new_with_weak_ptr(entry.ref.cdata)
            if storage is None:  # every tensor on it has been freed
                continue
            alive.append(entry)
            nbytes = 0 if entry.device.type == "meta" else storage.nbytes()
            size = entry.dtype.itemsize
            shares = owner.get(entry.ref.cdata)
            if shares is None:
                owner[entry.ref.cdata] = entry.name
                held_bytes += nbytes
                held_elements += nbytes // size
            if entry.device.type == "cuda":
                cuda.add(entry.device)
            records.append(TensorRecord(
                entry.name, entry.group, entry.shape, str(entry.dtype).removeprefix("torch."),
                str(entry.device), entry.numel, entry.numel * size, nbytes, shares,
            ))
            del storage  # the snapshot must not keep the storage alive
        self._entries = alive  # forget what has been freed
        allocator = (sum(torch.cuda.memory_allocated(d) for d in cuda) if cuda else None)
        snap = MemorySnapshot(
            self.rank, label, tuple(records), held_bytes, held_elements,
            0 if during is None else during.peak_bytes, allocator,
            () if during is None else tuple(during.allocations),
        )
        self._snapshots.append(snap)
        return snap


# --- what a region of code holds -------------------------------------------------------------

#: Where ``DTensor`` lives, newest first (torch.distributed._tensor in 2.4).
_DTENSOR_MODULES = ("torch.distributed.tensor", "torch.distributed._tensor")


def is_dtensor(tensor: object) -> bool:
    """Whether ``tensor`` is a DTensor. Looked up in ``sys.modules``: no tensor can be one
    unless the process imported DTensor, so counting a plain model never pays for the import
    (about a second on 2 cores)."""
    for name in _DTENSOR_MODULES:
        module = sys.modules.get(name)
        if module is not None and hasattr(module, "DTensor"):
            return isinstance(tensor, module.DTensor)
    return False


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor whose storage this rank holds: a DTensor's local shard, anything else as is.

    ``DTensor._local_tensor`` rather than ``.to_local()``: the latter is an autograd op (a view
    of the same storage), which must not run inside a dispatch mode (:class:`AllocationTracker`).
    """
    return tensor._local_tensor if is_dtensor(tensor) else tensor


class AllocationTracker(TorchDispatchMode):
    """The tensor storages a region of code holds: those that PyTorch operators create inside
    the ``with`` block, and those of the tensors given to :meth:`track`::

        with AllocationTracker() as during:
            shard = reduce_scatter(gradient)
        during.peak_bytes    # most bytes of those storages alive at once
        during.live_bytes    # of those, alive now at their present size (here: the shard)
        during.allocations   # what was made: which operator, how many bytes

    After every operator the tracker adds the storages of its outputs that it does not know
    yet, except an input's storage (a view or an in-place result allocates nothing; the one
    exception is ``lift_fresh``, by which ``torch.tensor(data)`` hands over the storage it
    has just filled), then reads the size of every storage it knows *again* and forgets those
    whose tensors have all been freed. So the peak is exact at operator boundaries, and a
    storage shrunk with ``untyped_storage().resize_(0)`` (as FSDP frees full parameters) and
    regrown for the next all-gather is seen at both sizes. A DTensor counts as its local
    shard (the DTensor itself is a wrapper whose own storage has the global size and holds no
    data). With the tensors held at the start given to :meth:`track` (parameters, buffers),
    the peak is of all that the block holds but the untracked tensors it was handed (a
    batch): :mod:`labs.fsdp_torch` measures a training step so.

    Only weak references are kept: the tracker never keeps a tensor alive, and
    :attr:`live_bytes` can be read after the block, while gloo's threads let go of a finished
    collective's tensors. It may be entered again (once per step, say); :meth:`reset_peak`
    starts a new peak. Not seen: memory used and released within one operator, buffers that
    gloo or NCCL allocate without making a tensor, and operators of other threads than the one
    that entered the block (CPU autograd runs backward on it).
    """

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # TorchDispatchMode wraps __torch_dispatch__ in torch._dynamo.disable unless a mode
        # opts out; that wrapper imports torch._dynamo at the first operator, which took
        # seconds per rank here. The tracker never runs under torch.compile, so opt out.
        return False

    def __init__(self) -> None:
        super().__init__()
        self._refs: dict[int, StorageWeakRef] = {}  # by the StorageImpl's address
        self.peak_bytes = 0
        #: every storage made in the block, in order: which operator, how many bytes then
        self.allocations: list[Allocation] = []

    @property
    def allocated_bytes(self) -> int:
        """Total bytes of all storages made in the block, freed ones included."""
        return sum(a.nbytes for a in self.allocations)

    @property
    def live_bytes(self) -> int:
        """Bytes of the counted storages that are alive now, at their present size (0 for a
        storage shrunk with ``resize_(0)``), also after the block."""
        total = 0
        for key, ref in list(self._refs.items()):
            # A strong reference for this line only; None once every tensor on it is gone.
            storage = torch.UntypedStorage._new_with_weak_ptr(ref.cdata)
            if storage is None:
                del self._refs[key]
            else:
                total += storage.nbytes()
        return total

    def track(self, tensors: Iterable[torch.Tensor]) -> None:
        """Count these tensors' storages too, from now on, while they are alive."""
        for tensor in map(local_tensor, tensors):
            if _countable(tensor) and _key(tensor) not in self._refs:
                self._refs[_key(tensor)] = StorageWeakRef(tensor.untyped_storage())
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)

    def untrack(self, tensors: Iterable[torch.Tensor]) -> None:
        """Stop counting these tensors' storages (say, the result the caller keeps)."""
        for tensor in map(local_tensor, tensors):
            if _countable(tensor):
                self._refs.pop(_key(tensor), None)

    def reset_peak(self) -> None:
        """Start a new peak from what is alive now."""
        self.peak_bytes = self.live_bytes

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        inputs = {_key(t) for t in map(local_tensor, _tensors((args, kwargs))) if _countable(t)}
        for tensor in map(local_tensor, _tensors(out)):
            key = _key(tensor) if _countable(tensor) else None
            if key is None or key in self._refs or (key in inputs and func is not _LIFT_FRESH):
                continue
            storage = tensor.untyped_storage()
            self._refs[key] = StorageWeakRef(storage)
            if storage.nbytes():  # an empty storage is watched (it may grow), not listed
                self.allocations.append(Allocation(_op_name(func), storage.nbytes()))
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        return out


#: ``torch.tensor(data)`` fills a new storage outside the dispatcher, then passes it through
#: this operator: its output is its input, and yet made in the block.
_LIFT_FRESH = torch.ops.aten.lift_fresh.default


def _tensors(tree: object) -> Iterator[torch.Tensor]:
    return (t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor))


def _op_name(func: Any) -> str:
    """``aten.empty.memory_format`` -> ``empty``."""
    overload = getattr(func, "overloadpacket", None)
    return getattr(overload, "__name__", str(func))


def _countable(tensor: torch.Tensor) -> bool:
    return tensor.layout is torch.strided and tensor.device.type != "meta"


def _key(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage()._cdata  # the StorageImpl's address


# --- the experiments of chapters 3 and 4 ------------------------------------------------------


class ReduceScatterMoment(enum.Enum):
    """The moments :func:`reduce_scatter_memory` records."""

    GRADIENT = "full gradient"  #: after backward: the whole gradient, S bytes
    DURING = "during reduce-scatter"  #: the gradient plus what the collective allocates
    AFTER = "after reduce-scatter"  #: the gradient is still there, plus the shard
    FREED = "full gradient freed"  #: only the shard (as ZeRO-2 and FSDP keep it)


class AllGatherMoment(enum.Enum):
    """The moments :func:`all_gather_memory` records."""

    BEFORE = "before all-gather"  #: only this rank's shard
    DURING = "during all-gather"  #: the shard plus what the collective allocates
    AFTER = "after all-gather"  #: the shard and the gathered tensor
    FREED = "gathered tensor freed"  #: only the shard again


@dataclass(frozen=True)
class ShardMemorySettings:
    """Settings of the memory experiments of chapters 3 and 4.

    Attributes:
        numel: elements of the full tensor (the gradient that is reduce-scattered, or the
            parameters that are all-gathered). The default, 840, divides by every N in 1..8.
        dtype: its dtype.
        algorithm: ``Algorithm.RING`` (built here from point-to-point messages) or
            ``Algorithm.TORCH`` (torch.distributed's own collective).
    """

    numel: int = 840
    dtype: torch.dtype = torch.float32
    algorithm: Algorithm = Algorithm.RING

    def __post_init__(self) -> None:
        if isinstance(self.numel, bool) or not isinstance(self.numel, int) or self.numel < 1:
            raise ValueError(f"numel must be a positive int, got {self.numel!r}")
        if not isinstance(self.dtype, torch.dtype):
            raise TypeError(f"dtype must be a torch.dtype such as torch.float32, "
                            f"got {self.dtype!r}")
        if self.algorithm not in Collective.REDUCE_SCATTER.algorithms():
            names = ", ".join(f"Algorithm.{a.name}" for a in Collective.REDUCE_SCATTER.algorithms())
            raise ValueError(f"algorithm must be one of {names}, got {self.algorithm}")

    @property
    def element_size(self) -> int:
        return self.dtype.itemsize

    @property
    def nbytes(self) -> int:
        """S: the bytes of the full tensor."""
        return self.numel * self.element_size


def reduce_scatter_memory(
    rank: int, world_size: int, settings: ShardMemorySettings
) -> tuple[MemorySnapshot, ...]:
    """Worker: what a rank holds around a reduce-scatter of an S-byte gradient.

    The shard is chunk r of the sum, about S/N bytes. The gradient itself (S bytes) stays
    until the code drops it: only then does the rank hold S/N instead of S
    (:class:`ReduceScatterMoment`).
    """
    timeline = MemoryTimeline(rank)
    gradient = torch.full((settings.numel,), float(rank + 1), dtype=settings.dtype,
                          device=rank_device())  # 1-D, S
    timeline.record(ReduceScatterMoment.GRADIENT, gradient=gradient)
    with AllocationTracker() as during:
        shard = reduce_scatter(gradient, algorithm=settings.algorithm)  # 1-D, ~S/N
    timeline.record(ReduceScatterMoment.DURING, during=during)
    timeline.record(ReduceScatterMoment.AFTER, shard=shard)
    del gradient  # the last reference: the storage is freed here, and the timeline sees it
    timeline.record(ReduceScatterMoment.FREED)
    return timeline.snapshots


def all_gather_memory(
    rank: int, world_size: int, settings: ShardMemorySettings
) -> tuple[MemorySnapshot, ...]:
    """Worker: what a rank holds around an all-gather of S bytes from shards of ~S/N.

    Between the gather and the free the rank holds its shard *and* the gathered tensor,
    (1 + 1/N)·S, unless the shard is made a view into the gathered buffer
    (:class:`AllGatherMoment`).
    """
    bounds = shard_bounds(settings.numel, world_size)
    timeline = MemoryTimeline(rank)
    shard = torch.full((bounds[rank + 1] - bounds[rank],), float(rank + 1),
                       dtype=settings.dtype, device=rank_device())  # 1-D, chunk r of shard_bounds
    timeline.record(AllGatherMoment.BEFORE, shard=shard)
    with AllocationTracker() as during:
        gathered = all_gather(shard, numel=settings.numel, algorithm=settings.algorithm)
    timeline.record(AllGatherMoment.DURING, during=during)
    timeline.record(AllGatherMoment.AFTER, gathered=gathered)
    del gathered
    timeline.record(AllGatherMoment.FREED)
    return timeline.snapshots
