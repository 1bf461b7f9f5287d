"""A sharded checkpoint on disk (:mod:`labs.checkpoint`): its files, its ``index.json``, its errors.

What a checkpoint directory is, apart from how the ranks save and load it: the file names
(:func:`shard_file_name`), the index's records (:class:`CheckpointIndex` and the ``Saved*``
records of units, parameters and optimizer state), reading and checking an index
(:func:`inspect`, in the calling process, before any rank starts), writing a file whole
(:func:`write_file`: a temporary name, then a rename) and opening one checked and
memory-mapped (:func:`open_file`), and the errors a checkpoint raises
(:class:`CheckpointError`, with its :class:`Problem`).

A module of its own, as ``torch.distributed.checkpoint`` keeps its ``metadata`` and storage
apart from the planners that save and load: :mod:`labs.checkpoint` holds the ranks' side (the
resharding map, save, load). ``from labs.checkpoint import CheckpointError, inspect, ...``
keeps working.
"""

from __future__ import annotations

import enum
import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from labs.zero import shard_numel

#: What ``index.json`` calls this layout, and its version (bumped on any change to it).
FORMAT = "labs.checkpoint"
VERSION = 1
INDEX = "index.json"
REPLICATED = "replicated.pt"
SHARD_FILE = re.compile(r"shard-\d{5}-of-\d{5}\.pt")


def shard_file_name(rank: int, world_size: int) -> str:
    """``shard-00002-of-00004.pt``: the file rank 2 of 4 writes."""
    return f"shard-{rank:05d}-of-{world_size:05d}.pt"


class Problem(enum.Enum):
    """Why a checkpoint could not be saved or loaded (:attr:`CheckpointError.problem`)."""

    MISSING_INDEX = "missing index.json"
    """No ``index.json``: not a checkpoint, or a save that did not finish."""
    BAD_INDEX = "unreadable index.json"
    """``index.json`` is not JSON, or not this format or version."""
    MISSING_FILE = "missing file"
    """A file the index lists is not in the directory."""
    CORRUPT_FILE = "corrupt file"
    """A file is truncated (not the size the index records), cannot be read by
    ``torch.load``, or does not hold what the index says."""
    OTHER_MODEL = "another model"
    """The checkpoint's units or parameters (names, numel, shapes) differ from the model's."""
    OTHER_OPTIMIZER = "another optimizer"
    """The optimizer's class or param groups differ from the saved one's, or one of the two
    has no optimizer."""
    HYBRID = "hybrid-sharded model"
    """The model is HSDP (``shard_size`` < world size): its shards are cut by the shard
    group, not by every rank, and this layout does not describe them."""
    MID_STEP = "model mid-step"
    """A unit is gathered (a forward or backward is running): load between steps."""
    WRITE_FAILED = "write failed"
    """A rank could not write its file."""
    OTHER_RANK = "another rank failed"
    """This rank found nothing wrong, but another rank did: nothing was done here either."""


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be saved or loaded; the message names the file (``path``)
    and says what to do. Raised on every rank, before anything is overwritten."""

    def __init__(self, message: str, problem: Problem, path: str | os.PathLike[str]) -> None:
        super().__init__(message)
        self.problem = problem
        self.path = str(path)

    def __reduce__(self) -> tuple[Any, ...]:  # so that it crosses a process boundary whole
        return (type(self), (str(self), self.problem, self.path))


class StateKind(enum.Enum):
    """How one key of the optimizer's per-parameter state is stored."""

    SHARDED = "sharded"
    """A tensor of the shard's shape (Adam's exp_avg, exp_avg_sq; SGD's momentum_buffer):
    cut and saved like the parameter, each rank its real elements."""
    SCALAR = "scalar"
    """A 0-d tensor or a number, the same on every rank (Adam's step): rank 0 writes it once."""


def real_numel(numel: int, world_size: int, rank: int) -> int:
    """Real (not padding) elements of rank ``rank``'s shard on ``world_size`` ranks."""
    k = shard_numel(numel, world_size)
    return max(0, min(k, numel - rank * k))


# --- the index -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class SavedParameter:
    """One trainable parameter in its unit's flat vector."""

    names: tuple[str, ...]  #: its names in the model (two or more when tied)
    shape: tuple[int, ...]
    offset: int  #: where it starts in the unit's flat vector


@dataclass(frozen=True)
class SavedUnit:
    """One FSDP unit as saved: its flat vector's layout."""

    name: str
    numel: int  #: elements of the flat vector, without padding
    params: tuple[SavedParameter, ...]


@dataclass(frozen=True)
class SavedStateKey:
    """One key of a unit's optimizer state."""

    key: str
    kind: StateKind
    dtype: str  #: torch dtype name of a SHARDED tensor ("float32"); "" for a scalar


@dataclass(frozen=True)
class SavedOptimizer:
    """What ``index.json`` records about the optimizer."""

    class_name: str
    param_groups: tuple[tuple[tuple[str, ...], Mapping[str, Any]], ...]
    """Per group: the units whose shards it holds, and its hyper-parameters (lr, betas...)."""
    state: Mapping[str, tuple[SavedStateKey, ...]]
    """Per unit: its state's keys, in the optimizer's order; empty before the first step."""


@dataclass(frozen=True)
class CheckpointIndex:
    """A checkpoint directory's ``index.json``, read and checked by :func:`inspect`."""

    path: Path
    version: int
    world_size: int  #: N, the ranks it was saved on
    units: tuple[SavedUnit, ...]
    files: tuple[str, ...]  #: the shard files, saved rank order
    file_bytes: tuple[int, ...]  #: their sizes
    replicated: Mapping[str, tuple[int, ...]]  #: frozen parameters and buffers: name -> shape
    replicated_bytes: int  #: size of ``replicated.pt``
    optimizer: SavedOptimizer | None  #: None when saved without an optimizer
    extra: Mapping[str, Any] = field(default_factory=dict)  #: what the caller asked to keep

    def shard_file(self, saved_rank: int) -> Path:
        return self.path / self.files[saved_rank]

    @property
    def total_bytes(self) -> int:
        """Every file of the checkpoint, ``index.json`` included."""
        return sum(self.file_bytes) + self.replicated_bytes + (self.path / INDEX).stat().st_size

    def bytes_to_read(self, world_size: int, rank: int) -> int:
        """Bytes of tensor elements rank ``rank`` of ``world_size`` copies from the shard
        files on :func:`load` (parameters and sharded optimizer state): its new shard's real
        elements, whatever N was. ``index.json`` and ``replicated.pt``, read by every rank,
        and the files' headers are not counted."""
        total = 0
        for unit in self.units:
            real = real_numel(unit.numel, world_size, rank)
            per_element = 4  # the fp32 parameter
            if self.optimizer is not None:
                per_element += sum(torch.empty(0, dtype=getattr(torch, k.dtype)).element_size()
                                   for k in self.optimizer.state.get(unit.name, ())
                                   if k.kind is StateKind.SHARDED)
            total += real * per_element
        return total


def _corrupt_index(path: Path, why: str) -> CheckpointError:
    return CheckpointError(
        f"{path} is not a readable {FORMAT} index ({why}): it was not written by "
        f"labs.checkpoint.save of this version ({VERSION}); save the checkpoint again.",
        Problem.BAD_INDEX, path)


def read_index(path: Path) -> CheckpointIndex:
    """``index.json`` of the directory ``path``, parsed (files are not checked here)."""
    file = path / INDEX
    if not file.is_file():
        where = ("the directory does not exist" if not path.exists() else
                 "the directory has no index")
        raise CheckpointError(
            f"no checkpoint at {path}: {file} is missing ({where}). Give the directory that "
            "labs.checkpoint.save wrote; if a save was interrupted, save again (the index is "
            "written last, so a directory without one is incomplete).",
            Problem.MISSING_INDEX, file)
    try:
        raw = json.loads(file.read_text())
        if raw.get("format") != FORMAT:
            raise _corrupt_index(file, f"format {raw.get('format')!r}")
        if raw.get("version") != VERSION:
            raise _corrupt_index(file, f"version {raw.get('version')!r}")
        units = tuple(SavedUnit(u["name"], int(u["numel"]), tuple(
            SavedParameter(tuple(p["names"]), tuple(p["shape"]), int(p["offset"]))
            for p in u["params"])) for u in raw["units"])
        optimizer = None
        if raw["optimizer"] is not None:
            opt = raw["optimizer"]
            optimizer = SavedOptimizer(
                opt["class"],
                tuple((tuple(g["units"]), dict(g["hyper"])) for g in opt["param_groups"]),
                {name: tuple(SavedStateKey(k["key"], StateKind(k["kind"]), k["dtype"])
                             for k in keys) for name, keys in opt["state"].items()})
        return CheckpointIndex(
            path=path, version=raw["version"], world_size=int(raw["world_size"]), units=units,
            files=tuple(f["name"] for f in raw["files"]),
            file_bytes=tuple(int(f["bytes"]) for f in raw["files"]),
            replicated={k: tuple(v) for k, v in raw["replicated"]["tensors"].items()},
            replicated_bytes=int(raw["replicated"]["bytes"]), optimizer=optimizer,
            extra=raw.get("extra", {}))
    except CheckpointError:
        raise
    except (ValueError, KeyError, TypeError, AttributeError) as error:
        raise _corrupt_index(file, f"{type(error).__name__}: {error}") from error


def check_file(file: Path, expected_bytes: int) -> None:
    if not file.is_file():
        raise CheckpointError(
            f"checkpoint file {file} is missing (the index lists it): copy the whole "
            "checkpoint directory, or save again.", Problem.MISSING_FILE, file)
    size = file.stat().st_size
    if size != expected_bytes:
        raise CheckpointError(
            f"checkpoint file {file} has {size} bytes, not the {expected_bytes} its index "
            "records: it is truncated or was overwritten. Copy it again from where it was "
            "saved, or save again.", Problem.CORRUPT_FILE, file)


def inspect(path: str | os.PathLike[str]) -> CheckpointIndex:
    """Read the checkpoint directory ``path``'s index and check that every file it lists is
    there, at its recorded size; in the calling process (no ranks), so that a notebook
    refuses a bad checkpoint before it launches any. Raises :class:`CheckpointError`."""
    index = read_index(Path(path))
    for saved_rank in range(index.world_size):
        check_file(index.shard_file(saved_rank), index.file_bytes[saved_rank])
    check_file(index.path / REPLICATED, index.replicated_bytes)
    return index


def write_file(payload: Any, file: Path) -> int:
    """torch.save under a temporary name, flushed to disk, then renamed: a crash leaves no
    half-written file under the real name. Returns the file's size."""
    partial = file.with_name(file.name + ".partial")
    with open(partial, "wb") as out:
        torch.save(payload, out)
        out.flush()
        os.fsync(out.fileno())  # the rename must not reach the disk before the data
    os.replace(partial, file)
    return file.stat().st_size


def write_text_file(text: str, file: Path) -> None:
    """The same for a text file (``index.json``)."""
    partial = file.with_name(file.name + ".partial")
    with open(partial, "w") as out:
        out.write(text)
        out.flush()
        os.fsync(out.fileno())
    os.replace(partial, file)


def open_file(file: Path, expected_bytes: int) -> dict[str, Any]:
    """A checkpoint file, memory-mapped: its tensors' bytes are read only where used."""
    check_file(file, expected_bytes)
    try:
        return torch.load(str(file), map_location="cpu", mmap=True, weights_only=True)
    except Exception as error:  # any failure means the same: unreadable
        raise CheckpointError(
            f"checkpoint file {file} cannot be read ({type(error).__name__}: "
            f"{str(error).splitlines()[0] if str(error) else ''}): it is corrupt. Copy it again "
            "from where it was saved, or save again.", Problem.CORRUPT_FILE, file) from error
