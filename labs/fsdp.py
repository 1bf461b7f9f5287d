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
and a local sum: :func:`labs.fsdp_collectives.reduce_scatter_from`). With
``collectives=Algorithm.RING`` they are chapter 3's and 4's ring (:mod:`labs.collectives`,
point-to-point messages, one at a time), so a :class:`~labs.collectives.Recorder` counts every
byte. Names follow PyTorch FSDP: ``unshard``/``reshard``, ``ShardedState``,
``finish_gradient_synchronization``.

This module holds the algorithm (:class:`FSDP`: when a unit is gathered, freed and
reduce-scattered); the unit it moves between those states, its ``ShardedState`` and the
``Event`` s an observer is told are in :mod:`labs.fsdp_unit`, the asynchronous torch
collectives in :mod:`labs.fsdp_collectives` (as torch's ``_fully_shard`` splits param group,
collectives and state), the step's timeline in :mod:`labs.fsdp_timeline`.

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
The two kinds of group are the dimensions of the grid :func:`labs.grid.hybrid_layout`.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from labs.activations import checkpoint_module
from labs.clock import DeviceClock, Moment
from labs.collectives import (
    Algorithm,
    Recorder,
    ring_all_gather,
    ring_all_reduce,
    ring_reduce_scatter,
)
from labs.comm_stream import CommStream
from labs.fsdp_collectives import (
    StreamReduction,
    all_gather_into,
    gather_on_stream,
    reduce_on_stream,
    reduce_scatter_from,
)
from labs.fsdp_timeline import Activity, FSDPTimeline, Interval
from labs.fsdp_unit import (
    Event,
    FlatUnit,
    ShardedState,
    build_units,
    cast_floats,
    check_dtypes,
    check_prefetch,
    check_shard_size,
    checked_units,
    default_units,
    point_at_placeholders,
    tensors_in,
)
from labs.grid import hybrid_groups


def units_to_prefetch(order: Sequence[str], current: str, prefetch: int) -> list[str]:
    """Which units' all-gathers to start when unit ``current`` starts computing (FSDP's
    prefetch decision, in both passes): the ``prefetch`` units that ``order`` runs right after
    ``current``, fewer at its end; none when ``prefetch`` is 0 or ``current`` is not in
    ``order`` (the first step has recorded nothing). ``order`` is the pass's own order in the
    last step, as recorded (backward's is its own, not forward's reversed)."""
    if prefetch == 0 or current not in order:
        return []
    position = list(order).index(current)
    return list(order[position + 1:position + 1 + prefetch])


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
            see :func:`reduce_scatter_from`.) ``Algorithm.RING``: chapters 3 and 4's ring
            for everything, one collective at a time, every byte counted by ``recorder``;
            synchronous unless ``prefetch`` is given.
        prefetch: how many units ahead (in the order of the last step's forward, and of its
            backward) to start all-gathering when a unit's forward (or backward) starts: 0
            none, 1 the next unit (``fully_shard``'s default), k the next k. None (default):
            1 with torch collectives, and with the ring no prefetch and no stream (as before
            this option existed). Given with ``Algorithm.RING``, every collective (all-gathers,
            reduce-scatters, HSDP's all-reduces across) runs on a communication stream, a
            :class:`labs.ddp.CommStream` (one thread per rank serving them in the order they
            were handed over, the same on every rank), so that on an emulated link the ring's
            transfers overlap compute: a unit waits for its own all-gather only, and the
            reduce-scatters land at the next unit's post-backward or in
            :meth:`finish_gradient_synchronization`.
        prefetch_policy: ``policy(order, current, prefetch)``, the units' names to prefetch as
            ``current`` starts (exercise 7.3's); None (default): :func:`units_to_prefetch`.
        reshard_after_forward: True (default): free each unit's gathered parameters after its
            forward and gather them again for its backward. False: keep them from forward to
            backward (ZeRO-2-like: the full parameters of every unit are held between forward
            and backward, and backward runs no all-gather: 2(N-1)/N·S a step instead of
            3(N-1)/N·S). A forward without grad mode frees them either way.
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
                 prefetch: int | None = None,
                 prefetch_policy: Callable[[list[str], str, int], Sequence[str]] | None = None,
                 reshard_after_forward: bool = True,
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
        check_dtypes(compute_dtype=compute_dtype, reduce_dtype=reduce_dtype)
        check_prefetch(prefetch, reshard_after_forward, prefetch_policy)
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
        #: How many units ahead all-gathers start (see ``prefetch``).
        self.prefetch = (1 if collectives is Algorithm.TORCH else 0) if prefetch is None \
            else prefetch
        #: Picks the units to prefetch (see ``prefetch_policy``).
        self.prefetch_policy = prefetch_policy or units_to_prefetch
        self.reshard_after_forward = reshard_after_forward
        #: Where the ring's collectives run when ``prefetch`` is given; None: synchronously
        #: (the ring without ``prefetch``) or torch's asynchronous collectives.
        self._stream = CommStream("labs-fsdp-stream") \
            if collectives is Algorithm.RING and prefetch is not None else None
        #: The current (or, after :meth:`finish_gradient_synchronization`, the last) step's
        #: gathers, computations and reduce-scatters, unit by unit.
        self.clock = DeviceClock.of(module)  #: stamps ``timeline`` (a GPU's events on CUDA)
        self.timeline = FSDPTimeline(self.clock)
        self._new_step = True
        self._started: dict[tuple[str, Activity], Moment] = {}  # (unit, activity) -> start
        self.compute_dtype = compute_dtype
        self.reduce_dtype = reduce_dtype
        self.observer = observer
        self.recorder = recorder
        self.replicate_recorder = recorder if replicate_recorder is None else replicate_recorder
        chosen = checked_units(module, units) if units is not None else default_units(module)
        with torch.no_grad():
            root = dist.get_global_rank(process_group, 0) if process_group else 0
            for tensor in [*module.parameters(), *module.buffers()]:
                dist.broadcast(tensor, src=root, group=process_group)
        self.units = build_units(module, chosen, self.shard_size, self.shard_rank,
                                 compute_dtype)
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

    # -- forward and backward hooks --

    def _notify(self, event: Event, unit: FlatUnit) -> None:
        if self.observer is not None:
            self.observer(event, unit.name)

    def _record(self, unit: FlatUnit, activity: Activity, start: Moment | None = None) -> None:
        """Append the interval of ``unit``'s ``activity`` that ends now to the timeline, from
        ``start`` (or from what :attr:`_started` holds for it)."""
        begun = self._started.pop((unit.name, activity), None) if start is None else start
        if begun is not None:
            self.timeline.intervals.append(Interval(unit.name, activity, begun,
                                                    self.clock.stamp()))

    def unshard(self, unit: FlatUnit, *, prefetch: bool = False) -> None:
        """All-gather the unit's shards into its full vector and point its parameters at it.
        With ``prefetch`` (torch collectives, or the ring on the communication stream) the
        all-gather is started and left in flight (GATHERING); the next ``unshard`` of the unit
        waits for it."""
        if unit.state is ShardedState.SHARDED:
            full = unit.full
            full.untyped_storage().resize_(full.numel() * full.element_size())
            shard = unit.shard.detach().to(full.dtype)
            # Into .data: the version counter autograd checks is not bumped, so the views it
            # saved in forward are valid in backward once the storage is filled again.
            if self._stream is not None:
                unit.gather = self._stream.submit(functools.partial(
                    gather_on_stream, shard, full.data, self.shard_group, self.recorder,
                    (self.timeline, unit.name)))
            elif self.collectives is Algorithm.RING or self.shard_size == 1:
                start = self.clock.stamp()
                ring_all_gather(shard, group=self.shard_group, recorder=self.recorder,
                                out=full.data)
                self._record(unit, Activity.ALL_GATHER, start)
            else:
                self._started[unit.name, Activity.ALL_GATHER] = self.clock.stamp()
                unit.gather = all_gather_into(full.data, shard, self.shard_group)
            unit.state = ShardedState.GATHERING
        if unit.state is ShardedState.GATHERING and not prefetch:
            if unit.gather is not None:
                if self._stream is not None:
                    unit.gather.result()  # the job timed itself; re-raises its failure
                else:
                    unit.gather.wait()
                    self._record(unit, Activity.ALL_GATHER)
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
            point_at_placeholders(unit)
            unit.state = ShardedState.SHARDED

    def _prefetch_after(self, unit: FlatUnit, order: list[FlatUnit]) -> None:
        """Start gathering the units :attr:`prefetch_policy` picks, to travel while ``unit``
        computes. Every rank recorded the same order: every rank starts the same collectives."""
        by_name = {u.name: u for u in order}
        for name in self.prefetch_policy([u.name for u in order], unit.name, self.prefetch):
            ahead = by_name.get(name)
            if ahead is None:
                raise ValueError(f"prefetch_policy returned {name!r}, not one of {list(by_name)}.")
            if ahead.state is ShardedState.SHARDED:
                self.unshard(ahead, prefetch=True)
                self._notify(Event.PREFETCH, ahead)

    def _pre_forward(self, unit: FlatUnit, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
        if self._new_step:
            self.timeline, self._new_step = FSDPTimeline(self.clock), False
        self.unshard(unit)
        self._notify(Event.UNSHARD_FORWARD, unit)
        if torch.is_grad_enabled() and unit not in self._seen_forward:  # once per micro-batch run
            self._seen_forward.append(unit)
        self._prefetch_after(unit, self.forward_order)
        self._started[unit.name, Activity.FORWARD] = self.clock.stamp()
        # Each unit's floating inputs in the compute dtype (as fully_shard's
        # cast_forward_inputs): a buffer or a frozen weight kept in fp32 between units would
        # otherwise promote the activations back to fp32 before a bf16 layer.
        return cast_floats(args, self.compute_dtype) if self.compute_dtype else None

    def _post_forward(self, unit: FlatUnit, output: Any) -> None:
        self._record(unit, Activity.FORWARD)
        if self.reshard_after_forward or not torch.is_grad_enabled():
            self.reshard(unit)
            self._notify(Event.RESHARD_FORWARD, unit)
        if not torch.is_grad_enabled():
            return
        unit.backward_pending = True
        for tensor in tensors_in(output):
            if tensor.requires_grad:
                tensor.register_hook(lambda grad, u=unit: self._pre_backward(u, grad))

    def _pre_backward(self, unit: FlatUnit, grad: torch.Tensor) -> torch.Tensor:
        if unit.backward_pending and not unit.in_backward:  # the first of its outputs' hooks
            unit.in_backward = True
            if unit.state is not ShardedState.UNSHARDED:  # reshard_after_forward=False: kept
                # Views that require grad, although backward runs without grad mode: a
                # checkpointed unit runs its forward again on them, and that forward must
                # save what the first one saved (an op on parameters that need no gradient
                # saves less).
                with torch.enable_grad():
                    self.unshard(unit)
                self._notify(Event.UNSHARD_BACKWARD, unit)
            if unit not in self._seen_backward:
                self._seen_backward.append(unit)
            self._prefetch_after(unit, self.backward_order)
            self._started[unit.name, Activity.BACKWARD] = self.clock.stamp()
        return grad

    def _post_backward(self, unit: FlatUnit) -> None:
        """The full vector's gradient is complete: reduce-scatter it into the shard's grad
        (asynchronously with torch collectives or on the stream: it lands at the next unit's
        post-backward or at :meth:`finish_gradient_synchronization`, whichever comes first)."""
        self._record(unit, Activity.BACKWARD)
        unit.in_backward = False
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
        if self._stream is not None or not self._ring_reduce:
            for other in self.units:  # one reduce-scatter in flight: bounded memory
                self._land_reduce(other)
        if self._stream is not None:
            out: list[torch.Tensor] = []
            unit.reduce = StreamReduction(self._stream.submit(functools.partial(
                reduce_on_stream, full_grad, out, self.shard_group, self.recorder,
                self._all_reduce_across, (self.timeline, unit.name))), out)
        elif self._ring_reduce:
            start = self.clock.stamp()
            mine = ring_reduce_scatter(full_grad, group=self.shard_group, recorder=self.recorder)
            self._add_grad(unit, self._all_reduce_across(mine))
            self._record(unit, Activity.REDUCE_SCATTER, start)
        else:
            self._started[unit.name, Activity.REDUCE_SCATTER] = self.clock.stamp()
            unit.reduce = reduce_scatter_from(full_grad, self.shard_size, self.shard_group)
        unit.backward_pending = False
        self.reshard(unit)
        self._notify(Event.RESHARD_BACKWARD, unit)

    def _land_reduce(self, unit: FlatUnit) -> None:
        if unit.reduce is not None:
            reduction, unit.reduce = unit.reduce, None
            summed = reduction.land()
            if not reduction.summed_across:  # torch's: timed from its start to here
                self._record(unit, Activity.REDUCE_SCATTER)
                summed = self._all_reduce_across(summed)
            self._add_grad(unit, summed)

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
            args, kwargs = cast_floats(args, self.compute_dtype), cast_floats(
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
        self._synchronize()
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
        self._synchronize()
        self._new_step = True
        if self._seen_forward:
            self.forward_order, self._seen_forward = self._seen_forward, []
            self.backward_order, self._seen_backward = self._seen_backward, []

    def gather_full_params(self) -> dict[str, torch.Tensor]:
        """The model's full state dict on every rank (fp32 parameters all-gathered from the
        shards, inside the shard group under HSDP; frozen parameters and buffers as they are),
        by the original names."""
        self._synchronize()
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

    def _synchronize(self) -> None:
        """Wait for every job on the communication stream (re-raising the first failure): the
        main thread may then run collectives of its own."""
        if self._stream is not None:
            self._stream.synchronize()

    def remove_hooks(self) -> None:
        for unit in self.units:
            for handle in unit.hooks:
                handle.remove()
            unit.hooks = []
        for undo in self._undo_checkpointing:
            undo()
        self._undo_checkpointing = []
