"""Chapter 7, part 5: sharded checkpoints of an :class:`~labs.fsdp.FSDP` model, and loading
them on a different number of ranks.

Why sharded. Chapter 5's checkpoint (:func:`labs.train.save_checkpoint`) is one file written
by rank 0, which holds everything. Under FSDP no rank does: with Adam in fp32 the state is
4 + 8 = 12 bytes per trainable parameter, and rank r holds 12P/N of it. Gathering it on one
rank to write one file would put 12P bytes on that rank (the memory FSDP exists to avoid)
and funnel them through one writer. Here every rank writes what it holds, 12P/N bytes, all
ranks at once, and nobody holds more than its own shards.

The layout of the directory ``path``, for a model saved on N ranks::

    index.json                    rank 0: format version, N, per unit its name, numel,
                                  parameter names, shapes and offsets; the optimizer's class,
                                  its param_groups' hyper-parameters, its state keys; every
                                  file's size in bytes
    replicated.pt                 rank 0: frozen parameters and buffers (the same on every
                                  rank), and the optimizer's scalar state (Adam's ``step``)
    shard-00000-of-00004.pt       rank 0's shard of every unit, and its optimizer state
    ...
    shard-00003-of-00004.pt       rank 3's

Unit u's trainable parameters form one flat vector of ``numel`` elements; on N ranks rank r
holds elements ``[r*k, (r+1)*k)`` of it zero-padded, ``k = ceil(numel / N)``
(:class:`labs.fsdp_unit.FlatUnit`). A shard file keeps only the real elements, ``[r*k,
min((r+1)*k, numel))``: padding depends on N, so it is not part of the model's state (the
last ranks' files are shorter; a rank whose shard is all padding writes empty tensors).
Every file is written under a temporary name and renamed (``os.replace``) once complete;
``index.json`` is removed when a save starts and written last, so a directory with an index
is a complete checkpoint.

Loading on W ranks. Rank r of W needs flat elements ``[r*k', min((r+1)*k', numel))``, ``k' =
ceil(numel / W)``: :func:`shard_pieces` says which slices of which saved shards make them
up. Files are opened with ``torch.load(mmap=True)``, so only the pages of those slices are
read. Per rank that is about 12P/W bytes with Adam, whatever N was, from about N/W + 1
files; only the small ``index.json`` and ``replicated.pt`` are read by every rank. Before
anything is overwritten every rank reads and checks all it needs (the index against the
model, every file it opens); one collective then tells every rank whether any rank found a
problem, so that all of them raise together (the one that found it with the details)
instead of some loading and others failing, or waiting in a collective forever.

torch's ``torch.distributed.checkpoint`` does the same for ``fully_shard`` models (DTensors;
:mod:`labs.experiments.checkpoints` sets the two side by side).

This module is the ranks' side: the resharding map, save and load. The directory's files, the
index's records and the errors are :mod:`labs.checkpoint_format`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from labs.checkpoint_format import (
    FORMAT,
    INDEX,
    REPLICATED,
    SHARD_FILE,
    VERSION,
    CheckpointError,
    CheckpointIndex,
    Problem,
    SavedOptimizer,
    SavedParameter,
    SavedStateKey,
    SavedUnit,
    StateKind,
    inspect,
    open_file,
    read_index,
    real_numel,
    shard_file_name,
    write_file,
    write_text_file,
)
from labs.fsdp import FSDP
from labs.fsdp_unit import FlatUnit, ShardedState
from labs.zero import shard_numel

#: What a caller imports from here: save, load, the resharding map, and (from
#: :mod:`labs.checkpoint_format`) the layout, the index and the errors.
__all__ = [
    "FORMAT",
    "INDEX",
    "REPLICATED",
    "VERSION",
    "CheckpointError",
    "CheckpointIndex",
    "Problem",
    "SavedOptimizer",
    "SavedParameter",
    "SavedStateKey",
    "SavedUnit",
    "StateKind",
    "inspect",
    "load",
    "save",
    "shard_file_name",
    "shard_pieces",
]

# --- the mapping between shards of N and of W ranks ----------------------------------------------


def shard_pieces(numel: int, saved_world_size: int, world_size: int, rank: int
                 ) -> list[tuple[int, int, int]]:
    """The pieces of the saved shards that make up ``rank``'s shard on ``world_size`` ranks.

    A flat vector of ``numel`` elements was saved on N = ``saved_world_size`` ranks, saved
    rank s holding elements ``[s*k_old, min((s+1)*k_old, numel))``, ``k_old = ceil(numel/N)``.
    Rank r of W = ``world_size`` needs elements ``[r*k_new, min((r+1)*k_new, numel))``, ``k_new
    = ceil(numel/W)``. Returns ``(saved_rank, start, stop)`` triples, ``start``/``stop``
    offsets inside saved rank ``saved_rank``'s shard, in order, none empty, whose
    concatenation is exactly those elements; ``[]`` when rank r's shard is all padding. The
    rest of the new shard (its padding) is zeros.

    Rank r reads ``min(k_new, numel - r*k_new)`` elements from at most ``ceil(k_new/k_old) + 1``
    saved shards: as much as it will hold, whatever N was.
    """
    for name, value, low in (("numel", numel, 0), ("saved_world_size", saved_world_size, 1),
                             ("world_size", world_size, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{name} must be an int >= {low}, got {value!r}.")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"rank must be an int in [0, {world_size}), got {rank!r}.")
    k_old, k_new = shard_numel(numel, saved_world_size), shard_numel(numel, world_size)
    start, stop = rank * k_new, min((rank + 1) * k_new, numel)
    pieces = []
    while start < stop:  # k_old >= 1 here, since numel > start >= 0
        saved_rank = start // k_old
        end = min(stop, (saved_rank + 1) * k_old)
        pieces.append((saved_rank, start - saved_rank * k_old, end - saved_rank * k_old))
        start = end
    return pieces


# --- talking between ranks -----------------------------------------------------------------------


def _agree(found: BaseException | None, what: str, path: Path, group: dist.ProcessGroup | None,
           payload: Any = None) -> list[Any]:
    """One all-gather: every rank learns whether any rank failed (and why), and each rank's
    ``payload``. If any failed, every rank raises here: the rank(s) that found the problem
    their own exception, the others a :class:`CheckpointError` quoting the first one.

    Every rank must reach this call whatever happened before it, or the ranks that did
    would wait forever for those that did not."""
    mine = None if found is None else f"{type(found).__name__}: {found}"
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, (mine, payload), group=group)
    failed = [(rank, message) for rank, (message, _) in enumerate(gathered) if message]
    if found is not None:
        raise found
    if failed:
        rank, message = failed[0]
        raise CheckpointError(
            f"{what} {path} failed on rank {rank}, so it was not done on this rank either: "
            f"{message}", Problem.OTHER_RANK, path)
    return [p for _, p in gathered]


def _check_sharded(model: FSDP, path: Path) -> None:
    if model.shard_size != model.world_size:
        raise CheckpointError(
            f"the model is HSDP (shard_size={model.shard_size} of {model.world_size} ranks): "
            f"labs.checkpoint saves and loads shards cut over every rank, not {path}'s "
            "hybrid layout. Build the model with shard_size=None to checkpoint it, or save "
            "gather_full_params() from one rank.", Problem.HYBRID, path)
    busy = [u.name for u in model.units if u.state is not ShardedState.SHARDED]
    if busy:
        raise CheckpointError(
            f"units {busy} are gathered (a forward or backward is running): save or load "
            f"{path} between steps, after finish_gradient_synchronization().",
            Problem.MID_STEP, path)


# --- save ----------------------------------------------------------------------------------------


def _json_value(value: Any) -> Any:
    """A param_group hyper-parameter as JSON, or None where it has no JSON form."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.item()
    if isinstance(value, (bool, int, float, str)) or value is None:
        return value
    if isinstance(value, (list, tuple)) and all(isinstance(v, (bool, int, float))
                                                for v in value):
        return list(value)
    return None


def _unit_of_shard(model: FSDP) -> dict[int, FlatUnit]:
    return {id(u.shard): u for u in model.units}


def _optimizer_layout(model: FSDP, optimizer: torch.optim.Optimizer, path: Path
                      ) -> list[tuple[list[str], dict[str, Any]]]:
    """Per param group, the units it holds and its hyper-parameters; refuses an optimizer
    that holds trainable tensors other than the FSDP shards (they would not be saved)."""
    units = _unit_of_shard(model)
    groups = []
    for i, group in enumerate(optimizer.param_groups):
        names = []
        for param in group["params"]:
            if id(param) in units:
                names.append(units[id(param)].name)
            elif param.requires_grad:
                raise CheckpointError(
                    f"param_groups[{i}] of the optimizer holds a trainable tensor of shape "
                    f"{tuple(param.shape)} that is not one of the FSDP model's shards: build "
                    f"the optimizer on model.parameters() to save it in {path}.",
                    Problem.OTHER_OPTIMIZER, path)
        hyper = {k: _json_value(v) for k, v in group.items() if k != "params"}
        groups.append((names, {k: v for k, v in hyper.items()
                               if v is not None or group[k] is None}))
    return groups


def _state_keys(unit: FlatUnit, state: Mapping[str, Any], path: Path) -> list[SavedStateKey]:
    keys = []
    for key, value in state.items():
        if isinstance(value, torch.Tensor) and value.shape == unit.shard.shape:
            keys.append(SavedStateKey(key, StateKind.SHARDED, str(value.dtype).split(".")[-1]))
        elif (isinstance(value, torch.Tensor) and value.dim() == 0) or isinstance(
                value, (bool, int, float)):
            keys.append(SavedStateKey(key, StateKind.SCALAR, ""))
        else:
            what = (f"a tensor of shape {tuple(value.shape)}" if isinstance(value, torch.Tensor)
                    else type(value).__name__)
            raise CheckpointError(
                f"optimizer state {key!r} of unit {unit.name!r} is {what}, neither the "
                f"shard's shape {tuple(unit.shard.shape)} nor a scalar: labs.checkpoint cannot "
                f"cut it into shards for {path}; use an optimizer whose state is per element "
                "(Adam, AdamW, SGD).", Problem.OTHER_OPTIMIZER, path)
    return keys


def save(path: str | os.PathLike[str], model: FSDP,
         optimizer: torch.optim.Optimizer | None = None, *,
         extra: Mapping[str, Any] | None = None) -> None:
    """Save ``model``'s shards and ``optimizer``'s state into the directory ``path``; call it
    on every rank, between steps.

    Rank r writes ``shard-{r}-of-{N}.pt``: per unit the real elements of its parameter shard
    and of each sharded optimizer state tensor, about 12P/N bytes with Adam for P trainable
    parameters. Rank 0 also writes ``replicated.pt`` (frozen parameters, buffers, the
    optimizer's scalar state) and, once every shard file is complete, ``index.json``
    (``extra``, a JSON-serialisable mapping such as ``{"step": 100}``, is kept there). No rank
    returns before the index is written; if any rank fails, every rank raises
    :class:`CheckpointError`. Files of an earlier save into ``path`` are replaced (shard files
    of another world size are removed).

    No tensor travels between ranks: the ranks only agree, four times, through an
    ``all_gather_object`` of a few bytes each (whether anyone failed; the files' sizes).
    """
    directory = Path(path)
    if not isinstance(model, FSDP):
        raise TypeError(f"model must be a labs.fsdp.FSDP, got {type(model).__name__}.")
    extra_json = json.dumps(dict(extra or {}))  # refuse what JSON cannot hold, before writing
    rank, world_size, group = model.rank, model.world_size, model.group
    found: BaseException | None = None
    layout: list[tuple[list[str], dict[str, Any]]] = []
    state_keys: dict[str, list[SavedStateKey]] = {}
    try:
        _check_sharded(model, directory)
        if optimizer is not None:
            layout = _optimizer_layout(model, optimizer, directory)
            state_keys = {u.name: _state_keys(u, optimizer.state.get(u.shard, {}), directory)
                          for u in model.units}
        directory.mkdir(parents=True, exist_ok=True)
    except CheckpointError as error:  # every rank must reach _agree
        found = error
    except Exception as error:
        found = CheckpointError(f"rank {rank} cannot save into {directory}: {error}. Give a "
                                "directory that can be created and written.",
                                Problem.WRITE_FAILED, directory)
    _agree(found, "saving", directory, group)
    try:
        if rank == 0:  # from now until the new index is written, this is no checkpoint
            (directory / INDEX).unlink(missing_ok=True)
    except Exception as error:
        found = CheckpointError(f"rank 0 cannot remove the old {directory / INDEX}: {error}",
                                Problem.WRITE_FAILED, directory / INDEX)
    _agree(found, "saving", directory, group)  # no shard is replaced while an old index lists it

    file = directory / shard_file_name(rank, world_size)
    replicated: dict[str, torch.Tensor] = {}
    sizes = (0, 0)
    try:
        units: dict[str, dict[str, Any]] = {}
        scalars: dict[str, dict[str, Any]] = {}
        for unit in model.units:
            real = real_numel(unit.numel, world_size, rank)
            # clone(): torch.save writes a view's whole storage, padding included
            entry: dict[str, Any] = {"param": unit.shard.detach()[:real].clone().cpu(),
                                     "state": {}}
            state = optimizer.state.get(unit.shard, {}) if optimizer is not None else {}
            for key in state_keys.get(unit.name, []):
                value = state[key.key]
                if key.kind is StateKind.SHARDED:
                    entry["state"][key.key] = value.detach()[:real].clone().cpu()
                else:
                    scalars.setdefault(unit.name, {})[key.key] = (
                        value.detach().cpu() if isinstance(value, torch.Tensor) else value)
            units[unit.name] = entry  # 1-D tensors of `real` elements
        shard_bytes = write_file({"format": FORMAT, "version": VERSION, "rank": rank,
                              "world_size": world_size, "units": units}, file)
        replicated_bytes = 0
        if rank == 0:
            replicated = {k: v.detach().cpu() for k, v in model.module.state_dict().items()}
            replicated_bytes = write_file({"tensors": replicated, "optimizer_scalars": scalars},
                                      directory / REPLICATED)
        sizes = (shard_bytes, replicated_bytes)
    except Exception as error:
        found = CheckpointError(f"rank {rank} could not write {file}: {error}. Check that the "
                                "directory is writable and the disk not full, then save again.",
                                Problem.WRITE_FAILED, file)
    sizes_of_all = _agree(found, "saving", directory, group, payload=sizes)

    try:
        if rank == 0:
            files = [shard_file_name(r, world_size) for r in range(world_size)]
            for stale in directory.iterdir():  # another world size's shards, from before
                if SHARD_FILE.fullmatch(stale.name) and stale.name not in files:
                    stale.unlink()
            index = {
                "format": FORMAT, "version": VERSION, "world_size": world_size,
                "units": [{"name": u.name, "numel": u.numel, "params": [
                    {"names": list(names), "shape": list(shape), "offset": offset}
                    for names, shape, offset in zip(u.names, u.shapes, u.offsets, strict=True)]}
                    for u in model.units],
                "files": [{"name": name, "bytes": sizes_of_all[r][0]}
                          for r, name in enumerate(files)],
                "replicated": {"bytes": sizes_of_all[0][1],
                               "tensors": {k: list(v.shape) for k, v in replicated.items()}},
                "optimizer": None if optimizer is None else {
                    "class": type(optimizer).__name__,
                    "param_groups": [{"units": names, "hyper": hyper} for names, hyper in layout],
                    "state": {name: [{"key": k.key, "kind": k.kind.value, "dtype": k.dtype}
                                     for k in keys] for name, keys in state_keys.items()}},
                "extra": json.loads(extra_json),
            }
            write_text_file(json.dumps(index, indent=1), directory / INDEX)
    except Exception as error:
        found = CheckpointError(f"rank 0 could not write {directory / INDEX}: {error}",
                                Problem.WRITE_FAILED, directory / INDEX)
    _agree(found, "saving", directory, group)  # nobody returns before the index exists


# --- load ----------------------------------------------------------------------------------------


def _differences(index: CheckpointIndex, model: FSDP) -> Iterator[str]:
    saved = {u.name: u for u in index.units}
    have = {u.name: u for u in model.units}
    if list(saved) != list(have):
        yield f"units {list(saved)} in the checkpoint, {list(have)} in this model"
    for name in [n for n in saved if n in have]:
        s, h = saved[name], have[name]
        if s.numel != h.numel:
            yield f"unit {name!r} has {s.numel} elements in the checkpoint, {h.numel} here"
        here = [(tuple(n), tuple(shape), off)
                for n, shape, off in zip(h.names, h.shapes, h.offsets, strict=True)]
        there = [(p.names, p.shape, p.offset) for p in s.params]
        for (n1, s1, o1), (n2, s2, o2) in zip(there, here, strict=False):
            if (n1, s1, o1) != (n2, s2, o2):
                yield (f"unit {name!r}: {'/'.join(n1)} of shape {list(s1)} at offset {o1} in "
                       f"the checkpoint, {'/'.join(n2)} of shape {list(s2)} at offset {o2} here")
        if len(there) != len(here):
            yield f"unit {name!r} has {len(there)} parameters in the checkpoint, {len(here)} here"
    replicated = {k: tuple(v.shape) for k, v in model.module.state_dict().items()}
    if dict(index.replicated) != replicated:
        differ = sorted(set(index.replicated.items()) ^ set(replicated.items()))
        yield f"frozen parameters and buffers differ: {differ[:4]}"


def _check_model(index: CheckpointIndex, model: FSDP) -> None:
    differences = list(_differences(index, model))
    if differences:
        shown = "; ".join(differences[:5]) + ("; and more" if len(differences) > 5 else "")
        raise CheckpointError(
            f"{index.path / INDEX} is a checkpoint of another model: {shown}. Build the model "
            "(and its FSDP units) as the run that saved it did.",
            Problem.OTHER_MODEL, index.path / INDEX)


def _check_optimizer(index: CheckpointIndex, model: FSDP,
                     optimizer: torch.optim.Optimizer | None) -> None:
    file = index.path / INDEX
    saved = index.optimizer
    if optimizer is None:
        return  # parameters only: loading into a model for evaluation is fine
    if saved is None:
        raise CheckpointError(f"{file} was saved without an optimizer: load it with "
                              "optimizer=None, or resume from a checkpoint saved with one.",
                              Problem.OTHER_OPTIMIZER, file)
    if saved.class_name != type(optimizer).__name__:
        raise CheckpointError(
            f"{file} holds the state of optimizer class {saved.class_name}, and this "
            f"optimizer is a {type(optimizer).__name__}: build a {saved.class_name} to resume.",
            Problem.OTHER_OPTIMIZER, file)
    layout = [names for names, _ in _optimizer_layout(model, optimizer, index.path)]
    if layout != [list(names) for names, _ in saved.param_groups]:
        raise CheckpointError(
            f"{file}: the optimizer's param groups hold units "
            f"{[list(n) for n, _ in saved.param_groups]} in the checkpoint and {layout} here: "
            "build the optimizer's param groups as the run that saved it did.",
            Problem.OTHER_OPTIMIZER, file)


def _saved_tensor(content: dict[str, Any], file: Path, unit: str, key: str | None,
                  numel: int) -> torch.Tensor:
    """The 1-D tensor of ``numel`` elements a shard file holds for a unit's parameter
    (``key`` None) or one of its optimizer state keys."""
    try:
        entry = content["units"][unit]
        tensor = entry["param"] if key is None else entry["state"][key]
    except (KeyError, TypeError):
        tensor = None
    if not isinstance(tensor, torch.Tensor) or tuple(tensor.shape) != (numel,):
        what = "parameter" if key is None else f"optimizer state {key!r}"
        got = tuple(tensor.shape) if isinstance(tensor, torch.Tensor) else "nothing"
        raise CheckpointError(
            f"checkpoint file {file} holds {got} for unit {unit!r}'s {what}, not the {numel} "
            "elements its index describes: it was not written with this index (mixed "
            "checkpoints?). Save again.", Problem.CORRUPT_FILE, file)
    return tensor


@dataclass
class _Loaded:
    """What one rank will copy in once every rank has agreed: new shards and state."""

    shards: dict[str, torch.Tensor] = field(default_factory=dict)  # 1-D, k_new, fp32
    state: dict[str, dict[str, Any]] = field(default_factory=dict)
    replicated: dict[str, torch.Tensor] = field(default_factory=dict)
    hyper: list[Mapping[str, Any]] = field(default_factory=list)


def _read(path: Path, model: FSDP, optimizer: torch.optim.Optimizer | None) -> _Loaded:
    """Everything this rank needs, read and checked; nothing of the model touched yet."""
    index = read_index(path)
    _check_sharded(model, path)
    _check_model(index, model)
    _check_optimizer(index, model, optimizer)
    rank, world_size = model.rank, model.world_size
    extras = open_file(path / REPLICATED, index.replicated_bytes)
    replicated = extras.get("tensors") if isinstance(extras, dict) else None
    if not isinstance(replicated, dict) or {k: tuple(v.shape) for k, v in replicated.items()
                                            } != dict(index.replicated):
        raise CheckpointError(f"checkpoint file {path / REPLICATED} does not hold the frozen "
                              "parameters and buffers its index lists: save again.",
                              Problem.CORRUPT_FILE, path / REPLICATED)
    scalars = extras.get("optimizer_scalars", {})
    files: dict[int, dict[str, Any]] = {}
    loaded = _Loaded(replicated=replicated)
    for unit in model.units:
        saved_keys = (index.optimizer.state.get(unit.name, ())
                      if optimizer is not None and index.optimizer is not None else ())
        pieces = shard_pieces(unit.numel, index.world_size, world_size, rank)
        for saved_rank, _, _ in pieces:
            if saved_rank not in files:
                file = index.shard_file(saved_rank)
                files[saved_rank] = open_file(file, index.file_bytes[saved_rank])
                if (files[saved_rank].get("rank"), files[saved_rank].get("world_size")) != (
                        saved_rank, index.world_size):
                    raise CheckpointError(
                        f"checkpoint file {file} is not rank {saved_rank} of "
                        f"{index.world_size}'s shard: save again.", Problem.CORRUPT_FILE, file)

        def assemble(key: SavedStateKey | None, u: FlatUnit = unit,
                     pieces: list[tuple[int, int, int]] = pieces) -> torch.Tensor:
            dtype = torch.float32 if key is None else getattr(torch, key.dtype)
            out = torch.zeros(u.shard.numel(), dtype=dtype)  # 1-D, k_new; padding stays 0
            at = 0
            for saved_rank, start, stop in pieces:
                real = real_numel(u.numel, index.world_size, saved_rank)
                name = None if key is None else key.key
                saved = _saved_tensor(files[saved_rank], index.shard_file(saved_rank), u.name,
                                      name, real)
                out[at:at + stop - start] = saved[start:stop]  # reads these pages only
                at += stop - start
            return out

        loaded.shards[unit.name] = assemble(None)
        state: dict[str, Any] = {}
        for key in saved_keys:
            if key.kind is StateKind.SHARDED:
                state[key.key] = assemble(key)
            else:
                try:
                    state[key.key] = scalars[unit.name][key.key]
                except (KeyError, TypeError):
                    raise CheckpointError(
                        f"checkpoint file {path / REPLICATED} lacks optimizer state "
                        f"{key.key!r} of unit {unit.name!r}: save again.",
                        Problem.CORRUPT_FILE, path / REPLICATED) from None
        loaded.state[unit.name] = state
    if optimizer is not None and index.optimizer is not None:
        loaded.hyper = [hyper for _, hyper in index.optimizer.param_groups]
    return loaded


def _restore_hyper(group: dict[str, Any], saved: Mapping[str, Any]) -> None:
    for key, value in saved.items():
        current = group.get(key)
        if isinstance(current, torch.Tensor):
            current.fill_(value)
        elif isinstance(current, tuple):
            group[key] = tuple(value)
        else:
            group[key] = value


def load(path: str | os.PathLike[str], model: FSDP,
         optimizer: torch.optim.Optimizer | None = None) -> None:
    """Load the checkpoint directory ``path`` into ``model`` (and ``optimizer``), wrapped on
    any number of ranks; call it on every rank, between steps.

    Rank r of W copies its new shard of every unit from the saved shards that overlap it
    (:func:`shard_pieces`; :meth:`CheckpointIndex.bytes_to_read` bytes), the optimizer
    state of that shard likewise, the scalar state, frozen parameters and buffers from
    ``replicated.pt``, and the param groups' hyper-parameters (lr, betas ...) from the index,
    as ``Optimizer.load_state_dict`` does. Every rank first reads and checks everything;
    if any rank finds a problem (a missing or corrupt file, another model or optimizer),
    every rank raises :class:`CheckpointError` and nothing is overwritten on any rank.

    The resharding goes through the files, not the network: the only collective is one
    ``all_gather_object`` of a few bytes (whether any rank found a problem).
    """
    directory = Path(path)
    if not isinstance(model, FSDP):
        raise TypeError(f"model must be a labs.fsdp.FSDP, got {type(model).__name__}.")
    found: BaseException | None = None
    loaded = _Loaded()
    try:
        loaded = _read(directory, model, optimizer)
    except Exception as error:  # every rank must reach _agree
        found = error
    _agree(found, "loading", directory, model.group)

    with torch.no_grad():
        for unit in model.units:
            unit.shard.copy_(loaded.shards[unit.name])
            if optimizer is None:
                continue
            state = {}
            for key, value in loaded.state[unit.name].items():
                if isinstance(value, torch.Tensor) and value.dim() > 0:
                    value = value.to(unit.shard.device)
                elif isinstance(value, torch.Tensor):
                    # as Optimizer.load_state_dict: `step` stays on the CPU unless the
                    # optimizer is capturable or fused (then it lives beside the parameter)
                    group = next(g for g in optimizer.param_groups
                                 if any(p is unit.shard for p in g["params"]))
                    on_device = key != "step" or group.get("capturable") or group.get("fused")
                    value = value.clone().to(unit.shard.device if on_device else "cpu")
                state[key] = value
            if state:
                optimizer.state[unit.shard] = state
            else:
                optimizer.state.pop(unit.shard, None)
        for name, tensor in model.module.state_dict(keep_vars=True).items():
            tensor.copy_(loaded.replicated[name])
        if optimizer is not None:
            for group, hyper in zip(optimizer.param_groups, loaded.hyper, strict=True):
                _restore_hyper(group, hyper)
