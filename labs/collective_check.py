"""Checking that every rank issues the same collectives in the same order:
``launch(fn, N, check_collectives=True)``.

A collective is a promise every rank of a group keeps together: the same operation, on
tensors of the same shape and dtype, as the n-th collective of that group. A rank that skips
one, issues two in another order or with another shape breaks it, and what follows depends on
the backend and the shapes: a hang until the process group's timeout, an error from deep inside
the transport, or, when the shapes happen to agree, sums of the wrong tensors and no error at
all.

With checking on, every rank writes a record of each collective it is about to issue (the
operation, the tensor's shape and dtype, the root where there is one, the group's sequence
number and the caller's file and line) to the launch's store, then reads the same collective's
record of every other rank of the group before it issues its own. A difference raises
:class:`CollectiveMismatch` on every rank, before any of them enters the collective, naming the
sequence number, what each rank issued and where. A rank that returned from its worker
leaves a last record, the number of collectives it issued, so that its peers, waiting for a
collective it will never issue, learn at once which one.

What is checked: torch.distributed's collectives called through ``torch.distributed`` (the
module's functions, as ``dist.all_reduce(...)`` calls them) and labs' own (every algorithm
built on :class:`labs.p2p.Peers`: the ring, naive, recursive-doubling, halving-doubling,
double-tree, multi-ring and hierarchical all-reduces, and what is built on them). Not
checked: point-to-point ``send``/``recv`` (ranks pair up differently on purpose), and
collectives issued from C++ (torch's own DDP and FSDP). By default the call sites must
agree too: two all-reduces of equal shapes issued in another order on one rank agree in every
other field, and sum the wrong tensors silently; ``check_collectives="shapes"`` leaves the
call sites out, for code that issues one collective from different lines on different ranks.
"""

from __future__ import annotations

import functools
import json
import linecache
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist

#: torch.distributed's collectives that are checked, with the argument holding the root rank.
TORCH_COLLECTIVES: dict[str, str | None] = {
    "all_reduce": None, "broadcast": "src", "reduce": "dst", "all_gather": None,
    "all_gather_into_tensor": None, "reduce_scatter": None, "reduce_scatter_tensor": None,
    "all_to_all": None, "all_to_all_single": None, "gather": "dst", "scatter": "src",
    "barrier": None,
}
#: Call sites in these files are the collective's own machinery, not the caller.
_SKIPPED_FILES = (os.path.dirname(torch.__file__), __file__,
                  *(os.path.join(os.path.dirname(__file__), name) for name in (
                      "collectives.py", "p2p.py", "halving_doubling.py", "double_tree.py",
                      "multi_ring.py", "ring_schedule.py")))
_PREFIX = "labs-check"
#: How often a rank looks for its peers' records while it waits, at most (seconds).
_POLL_S = 0.005


class CollectiveMismatch(RuntimeError):
    """Ranks of one group issued different collectives as the same one (its sequence number),
    or one rank issued a collective its peers never will."""


@dataclass(frozen=True)
class CollectiveCall:
    """One collective as one rank issued it."""

    seq: int
    """Its number among the collectives of its group, from 1."""
    op: str
    shape: tuple[int, ...] | None
    """The shape of the tensor it reduces or sends (the first one, for a list); None for a
    barrier."""
    dtype: str | None
    root: int | None
    """The source or destination rank of a broadcast, reduce, gather or scatter."""
    where: str
    """The caller's frame: ``File "...", line N, in f`` and its source line."""

    def what(self) -> str:
        """The call in words: ``all_reduce of float32[4, 8]``."""
        if self.shape is None:
            return self.op
        root = f", root {self.root}" if self.root is not None else ""
        return f"{self.op} of {self.dtype}{list(self.shape)}{root}"


@dataclass
class _Checker:
    rank: int
    store: Any
    compare_sites: bool
    counts: dict[str, int]

    def check(self, op: str, tensor: Any, group: Any, root: int | None) -> None:
        ranks = _group_ranks(group)
        if len(ranks) < 2 or self.rank not in ranks:
            return
        key = ",".join(map(str, ranks))
        seq = self.counts.get(key, 0) + 1
        self.counts[key] = seq
        mine = CollectiveCall(seq, op, *_shape_and_dtype(tensor), root, _caller())
        self.store.set(f"{_PREFIX}/{key}/{seq}/{self.rank}", json.dumps(asdict(mine)))
        theirs = {self.rank: mine}
        waiting = [r for r in ranks if r != self.rank]
        pause = 0.0002
        while waiting:
            for r in list(waiting):
                record = f"{_PREFIX}/{key}/{seq}/{r}"
                if self.store.check([record]):
                    theirs[r] = _call(json.loads(self.store.get(record)))
                    waiting.remove(r)
                elif self.store.check([f"{_PREFIX}/{key}/end/{r}"]):
                    issued = int(self.store.get(f"{_PREFIX}/{key}/end/{r}"))
                    raise CollectiveMismatch(_returned(mine, r, issued, ranks))
            if waiting:
                time.sleep(pause)
                pause = min(2 * pause, _POLL_S)
        if len({self._fields(c) for c in theirs.values()}) > 1:
            raise CollectiveMismatch(_differ(seq, ranks, theirs, self.compare_sites))

    def _fields(self, call: CollectiveCall) -> tuple[Any, ...]:
        site = call.where.splitlines()[0] if self.compare_sites else None
        return (call.op, call.shape, call.dtype, call.root, site)

    def finish(self) -> None:
        """Leave, for every group this rank issued collectives on, how many it issued."""
        for key, count in self.counts.items():
            self.store.set(f"{_PREFIX}/{key}/end/{self.rank}", str(count))


_active: _Checker | None = None


def install(rank: int, mode: bool | str) -> None:
    """Check this rank's collectives from now on (called by the launcher in a rank process,
    after the process group is up). ``mode``: True (op, shape, dtype, root and call site) or
    ``"shapes"`` (the same without the call site)."""
    global _active
    store = dist.distributed_c10d._get_default_store()  # noqa: SLF001 - the launch's own store
    _active = _Checker(rank, store, mode is True, {})
    for name, root_arg in TORCH_COLLECTIVES.items():
        original = getattr(dist, name, None)
        if original is not None and not getattr(original, "_labs_checked", False):
            setattr(dist, name, _checked(name, original, root_arg))


def finish() -> None:
    """Tell the peers how many collectives this rank issued (it returned from its worker)."""
    if _active is not None:
        _active.finish()


def note(op: str, tensor: Any, group: Any = None) -> None:
    """Called as labs' own collectives start (:meth:`labs.p2p.Peers.of`, given the tensor a
    collective sends, names the function that called it): checked when checking is on."""
    if _active is not None:
        _active.check(op, tensor, group, None)


def check_mode(value: object) -> bool | str:
    """``check_collectives`` as given to :func:`labs.launch`, or a ValueError saying what to
    pass."""
    if value is True or value is False or value == "shapes":
        return value  # type: ignore[return-value]
    raise ValueError(f"check_collectives must be True, False or 'shapes' (the same without "
                     f"comparing call sites), got {value!r}.")


def _checked(name: str, original: Callable[..., Any], root_arg: str | None
             ) -> Callable[..., Any]:
    import inspect  # noqa: PLC0415 - only where checking is installed

    signature = inspect.signature(original)

    @functools.wraps(original)
    def call(*args: Any, **kwargs: Any) -> Any:
        if _active is not None:
            try:
                bound = signature.bind_partial(*args, **kwargs).arguments
            except TypeError:
                bound = {}
            values = list(bound.values())
            tensor = values[0] if values and name != "barrier" else None
            root = bound.get(root_arg) if root_arg else None
            _active.check(name, tensor, bound.get("group"), root)
        return original(*args, **kwargs)

    call._labs_checked = True  # type: ignore[attr-defined]
    return call


def _group_ranks(group: Any) -> list[int]:
    if group is None or group is dist.GroupMember.WORLD:
        return list(range(dist.get_world_size()))
    try:
        return list(dist.get_process_group_ranks(group))
    except (RuntimeError, ValueError):
        return []


def _shape_and_dtype(tensor: Any) -> tuple[tuple[int, ...] | None, str | None]:
    if isinstance(tensor, (list, tuple)) and tensor:
        tensor = tensor[0]
    if isinstance(tensor, torch.Tensor):
        return tuple(tensor.shape), str(tensor.dtype).removeprefix("torch.")
    return None, None


def _caller() -> str:
    """The innermost frame that is not torch's nor the collective's own machinery, nor a
    function that only passes the collective on and says so as pytest's helpers do, with a
    local ``__tracebackhide__ = True`` (a rank's own recorder of what it issues)."""
    frame = sys._getframe(1)  # noqa: SLF001 - the stack without formatting every frame
    while frame is not None:
        filename = frame.f_code.co_filename
        if not filename.startswith(_SKIPPED_FILES) \
                and not frame.f_locals.get("__tracebackhide__"):
            line = f'File "{filename}", line {frame.f_lineno}, in {frame.f_code.co_name}'
            source = linecache.getline(filename, frame.f_lineno).strip()
            return f"{line}\n    {source}" if source else line
        frame = frame.f_back
    return "(unknown)"


def _call(fields: dict[str, Any]) -> CollectiveCall:
    shape = fields["shape"]
    return CollectiveCall(fields["seq"], fields["op"], None if shape is None else tuple(shape),
                          fields["dtype"], fields["root"], fields["where"])


def _indent(where: str) -> str:
    return "\n".join(f"    {line}" for line in where.splitlines())


def _differ(seq: int, ranks: Sequence[int], calls: dict[int, CollectiveCall],
            sites: bool) -> str:
    """Collective ``seq`` in words, grouped by what each rank issued."""
    sides: dict[tuple[Any, ...], list[int]] = {}
    for r in ranks:
        c = calls[r]
        sides.setdefault((c.what(), c.where.splitlines()[0] if sites else None), []).append(r)
    lines = [f"collective #{seq} of ranks {_ranks(ranks)} differs between the ranks (checked "
             f"before any of them entered it):"]
    for (what, _), side in sides.items():
        lines.append(f"  rank(s) {_ranks(side)} issued {what} at")
        lines.append(_indent(calls[side[0]].where))
    if sites and len({w for w, _ in sides}) == 1:
        lines.append("The calls agree in operation, shape and dtype but come from different "
                     "lines: issued in another order, they would reduce the wrong tensors "
                     "without an error. If that is intended, launch with "
                     "check_collectives='shapes'.")
    else:
        lines.append("Every rank must issue the same collectives, in the same order, with "
                     "tensors of the same shape and dtype.")
    return "\n".join(lines)


def _returned(mine: CollectiveCall, peer: int, issued: int, ranks: Sequence[int]) -> str:
    return (f"collective #{mine.seq} of ranks {_ranks(ranks)}: this rank issued "
            f"{mine.what()} at\n{_indent(mine.where)}\nbut rank {peer} returned from its "
            f"worker after {issued} collective(s) of this group: it will never issue this "
            f"one, and this rank would wait for it forever.")


def _ranks(ranks: Sequence[int]) -> str:
    return ", ".join(map(str, ranks))
