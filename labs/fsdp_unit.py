"""The unit :class:`labs.fsdp.FSDP` shards: what one unit is, and which submodules become units.

A unit is a group of trainable parameters flattened into one vector (:class:`FlatUnit`, PyTorch
FSDP's ``FSDPParamGroup``): its layout (names, shapes, offsets), this rank's fp32 shard, the
full vector that is gathered into and freed, its :class:`ShardedState`, and what its parameter
attributes hold while it is sharded (:class:`ShardedPlaceholder`). :class:`Event` names what a
unit goes through in a step, as FSDP's observer is told (when: :mod:`labs.fsdp_timeline`).
:func:`default_units` and :func:`checked_units` choose the submodules that become units,
:func:`build_units` flattens and shards them; :func:`check_shard_size` and
:func:`check_prefetch` refuse FSDP's other bad arguments before any collective.

Why a module of its own: :mod:`labs.fsdp` holds the algorithm, when a unit is gathered,
freed and reduce-scattered (:class:`labs.fsdp.FSDP`); this module holds the object it moves
between those states, as torch's ``_fully_shard`` keeps ``FSDPParamGroup`` apart from the
state that drives it, and :mod:`labs.fsdp_collectives` the collectives that move the bytes.
``from labs.fsdp import Event, FlatUnit, ShardedState, default_units`` keeps working.
"""

from __future__ import annotations

import enum
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from labs.fsdp_collectives import Reduction, StreamReduction
from labs.zero import shard_numel


class ShardedState(enum.Enum):
    """Whether a unit's full parameters exist right now."""

    SHARDED = "sharded"
    """Only this rank's shard is held; the full vector's storage is empty."""
    GATHERING = "gathering"
    """A prefetch: the all-gather into the full vector is in flight (torch collectives, or the
    ring on FSDP's communication stream)."""
    UNSHARDED = "unsharded"
    """The full vector is gathered and the unit's parameters are views of it."""


class Event(enum.Enum):
    """What an :class:`~labs.fsdp.FSDP` observer is told, with the unit's name."""

    UNSHARD_FORWARD = "all-gather for forward"
    """The unit's full vector has been gathered and its forward is about to run."""
    PREFETCH = "prefetch all-gather"
    """The unit's all-gather has been started, before the unit that runs just ahead of it
    (or up to ``prefetch`` units ahead) computes, and is in flight (from the second step on:
    the order of the previous step tells which unit comes next). Its storage is allocated
    from now on."""
    RESHARD_FORWARD = "free after forward"
    """The unit's forward is done and its gathered vector has been freed."""
    UNSHARD_BACKWARD = "all-gather for backward"
    """The unit's full vector has been gathered again for its backward."""
    KEEP_GRADIENT = "keep unsharded gradient"
    """Inside :meth:`labs.fsdp.FSDP.no_sync`: the unit's full gradient is complete and is
    kept whole (added to what earlier micro-batches left), not reduce-scattered."""
    REDUCE_SCATTER = "reduce-scatter gradient"
    """The unit's full gradient is complete and its reduce-scatter is about to start."""
    RESHARD_BACKWARD = "free after backward"
    """The unit's gathered vector is freed again: of its parameters only the shard remains
    (its gradient's reduce-scatter may still be in flight, unless the ring runs it without
    ``prefetch``)."""


@dataclass
class Place:
    """Where a parameter lives in the module tree: ``module.<attr>``."""

    module: nn.Module
    attr: str


@dataclass(eq=False)  # units compare by identity (the fields hold tensors)
class FlatUnit:
    """One unit: its parameters as one flat vector, this rank's fp32 shard, the full vector."""

    name: str
    module: nn.Module
    names: list[list[str]]
    """Per parameter, its names in the wrapped model (two or more when tied)."""
    shapes: list[torch.Size]
    places: list[list[Place]]
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
    """The in-flight all-gather's ``dist.Work`` (or the stream's future) while GATHERING."""
    reduce: Reduction | StreamReduction | None = None
    """The in-flight reduce-scatter of the unit's gradient (torch collectives, or the ring on
    the communication stream)."""
    in_backward: bool = False
    """Between the unit's first pre-backward hook of a backward pass and its post-backward."""
    gather_started: float | None = None
    """When its in-flight all-gather was started (torch collectives: for the timeline)."""
    placeholders: list[ShardedPlaceholder] = field(default_factory=list)
    """Per parameter, what its attributes hold while the unit is SHARDED."""
    unsharded_grad: torch.Tensor | None = None
    """Inside :meth:`labs.fsdp.FSDP.no_sync`: the sum of the micro-batches' full gradients so
    far (1-D, padded numel, ``reduce_dtype`` or the compute dtype), reduce-scattered with the
    first backward outside ``no_sync``."""

    @property
    def padded_numel(self) -> int:
        return self.full.numel()

    def views(self) -> Iterator[tuple[list[Place], torch.Tensor]]:
        """Each parameter's view of the full vector. One split, not a slice per parameter:
        in backward a split's gradient is one concatenation of the pieces' gradients, where
        each slice would zero a full-sized tensor, copy its piece in, and the zeros be summed."""
        sizes = [shape.numel() for shape in self.shapes]
        pieces = self.full.split([*sizes, self.padded_numel - self.numel])
        # zip stops before the last piece: the padding, which no parameter views
        for places, shape, piece in zip(self.places, self.shapes, pieces, strict=False):
            yield places, piece.view(shape)


def tensors_in(value: Any) -> list[torch.Tensor]:
    """Every tensor in ``value``: a tensor, or dicts, lists and tuples of them, nested."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        return [t for v in value.values() for t in tensors_in(v)]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in tensors_in(v)]
    return []


def cast_floats(value: Any, dtype: torch.dtype) -> Any:
    """``value`` with every floating-point tensor in it (nested dicts, lists, tuples) cast to
    ``dtype``: FSDP's inputs in the compute dtype."""
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() else value
    if isinstance(value, dict):
        return {k: cast_floats(v, dtype) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(cast_floats(v, dtype) for v in value)
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


def check_dtypes(**dtypes: object) -> None:
    """A ValueError naming the first of ``dtypes`` that is neither None nor a floating-point
    torch.dtype."""
    for name, dtype in dtypes.items():
        if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise ValueError(f"{name} must be None or a floating-point torch.dtype (e.g. "
                             f"torch.bfloat16), got {dtype!r}.")


def check_prefetch(prefetch: int | None, reshard_after_forward: bool,
                   prefetch_policy: object = None) -> None:
    """A ValueError that says what to pass, unless ``prefetch`` is None or an int >= 0,
    ``reshard_after_forward`` a bool and ``prefetch_policy`` None or callable (checked before
    any collective, and callable without ranks)."""
    if prefetch is not None and (isinstance(prefetch, bool) or not isinstance(prefetch, int)
                                 or prefetch < 0):
        raise ValueError(
            f"prefetch must be None (the default: torch collectives prefetch one unit, the "
            f"ring none, synchronously) or an int >= 0, the number of units whose all-gather "
            f"starts ahead of their turn (0: none, 1: the next unit, as fully_shard); got "
            f"{prefetch!r}.")
    if not isinstance(reshard_after_forward, bool):
        raise ValueError(
            f"reshard_after_forward must be True (free each unit's parameters after its "
            f"forward, gather them again for backward: ZeRO-3) or False (keep them to "
            f"backward: one all-gather a step, ZeRO-2-like memory); got "
            f"{reshard_after_forward!r}.")
    if prefetch_policy is not None and not callable(prefetch_policy):
        raise ValueError(
            f"prefetch_policy must be None (labs.fsdp.units_to_prefetch) or a function "
            f"policy(order, current, prefetch) returning the names of the units to prefetch; "
            f"got {prefetch_policy!r}.")


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
        found = next(t for t in tensors_in([*args, *(kwargs or {}).values()])
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


def point_at_placeholders(unit: FlatUnit) -> None:
    """Make every attribute of the unit's parameters a :class:`ShardedPlaceholder`."""
    if not unit.placeholders:  # made once: a unit is resharded twice a step
        unit.placeholders = [ShardedPlaceholder(shape, unit.full.dtype, names[0], unit.name)
                             for shape, names in zip(unit.shapes, unit.names, strict=True)]
    for places, placeholder in zip(unit.places, unit.placeholders, strict=True):
        for place in places:
            setattr(place.module, place.attr, placeholder)


#: Containers that hold modules but are never called: their parent's forward calls the
#: modules inside, so forward hooks on the container itself never fire.
_NEVER_CALLED = (nn.ModuleList, nn.ModuleDict)


def checked_units(module: nn.Module, units: Sequence[nn.Module]) -> list[nn.Module]:
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


def build_units(module: nn.Module, chosen: list[nn.Module], shard_size: int, shard_rank: int,
                compute_dtype: torch.dtype | None) -> list[FlatUnit]:
    """Assign every trainable parameter to one unit: the innermost chosen unit around the
    module that registers it (units may nest, as with torch's ``fully_shard``: the outer
    unit gathers only what its inner units do not hold). A parameter used by two units,
    or outside every chosen one, goes to the root (the wrapped module itself). Each unit's
    parameters are flattened and rank ``shard_rank`` keeps its 1/``shard_size`` of them."""
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
            units.append(_flat_unit(
                name or "root", unit_module, [params[k] for k in keys],
                [places[k] for k in keys], [all_names[k] for k in keys], shard_size,
                shard_rank, compute_dtype))
    return units


def _flat_unit(name: str, unit_module: nn.Module, params: list[nn.Parameter],
               places: list[list[Place]], names: list[list[str]], shard_size: int,
               shard_rank: int, compute_dtype: torch.dtype | None) -> FlatUnit:
    shapes = [p.shape for p in params]
    offsets, total = [], 0
    for shape in shapes:
        offsets.append(total)
        total += shape.numel()
    k = shard_numel(total, shard_size)
    flat = torch.zeros(k * shard_size, dtype=torch.float32)  # the padded vector
    for param, offset in zip(params, offsets, strict=True):
        flat[offset:offset + param.numel()] = param.detach().reshape(-1)
    device = params[0].device
    shard = nn.Parameter(flat[shard_rank * k:(shard_rank + 1) * k].clone().to(device))
    dtype = compute_dtype or torch.float32
    full = torch.empty(k * shard_size, dtype=dtype, device=device, requires_grad=True)
    full.untyped_storage().resize_(0)  # SHARDED: nothing held beyond the shard
    for param_places in places:
        for place in param_places:
            del place.module._parameters[place.attr]  # now a plain attribute (a view)
    unit = FlatUnit(name, unit_module, names, shapes, places, offsets, total, shard, full)
    point_at_placeholders(unit)
    return unit
