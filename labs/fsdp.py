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
collectives and state).

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
import math
from collections.abc import Callable, Iterator, Sequence
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
from labs.fsdp_collectives import all_gather_into, reduce_scatter_from
from labs.fsdp_unit import (
    Event,
    FlatUnit,
    Place,
    ShardedState,
    checked_units,
    default_units,
    point_at_placeholders,
    tensors_in,
)
from labs.grid import hybrid_groups
from labs.zero import shard_numel


def _cast_floats(value: Any, dtype: torch.dtype) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() else value
    if isinstance(value, dict):
        return {k: _cast_floats(v, dtype) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_cast_floats(v, dtype) for v in value)
    return value


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
        chosen = checked_units(module, units) if units is not None else default_units(module)
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
        places: dict[int, list[Place]] = {}
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
                places.setdefault(key, []).append(Place(mod, attr))
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
                   params: dict[int, nn.Parameter], places: dict[int, list[Place]],
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
        point_at_placeholders(unit)
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
                unit.gather = all_gather_into(full.data, shard, self.shard_group)
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
            point_at_placeholders(unit)
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
        for tensor in tensors_in(output):
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
            unit.reduce = reduce_scatter_from(full_grad, self.shard_size, self.shard_group)
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
