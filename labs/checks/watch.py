"""What the checks watch inside their ranks: the methods of ``ProcessGroup`` that every
``torch.distributed`` collective and send reaches, however the learner imported it, patched
for the length of a check and restored on exit, raise or not (:func:`patched`).

* :func:`counted_collectives` (chapters 2-4 and 6) adds each call's ring cost, the bytes the
  rank sends by the ring algorithms of chapters 2-4, to a :class:`Traffic`: (N-1)·b for an
  all-gather of b bytes per rank, (N-1)·b for a reduce-scatter into b bytes, 2(N-1)/N·b for
  an all-reduce of b bytes, b for a send or a broadcast. A check may refuse some methods
  instead (chapters 2-4 refuse every built-in collective, exercise 6.3 the all-reduce).
* :func:`watched_all_reduces` (chapter 5) logs every all-reduce with its ``async_op``, the
  phase of the training step it was made in, and whether its work was waited for, and when.
"""

from __future__ import annotations

import contextlib
import enum
import sys
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, NoReturn

import torch
from torch.distributed import distributed_c10d


@contextlib.contextmanager
def patched(replacements: Iterable[tuple[object, str, object]]) -> Iterator[None]:
    """Inside: ``owner.name`` is ``new`` for each ``(owner, name, new)``; every one is
    restored on exit."""
    saved: list[tuple[object, str, object]] = []
    try:
        for owner, name, new in replacements:
            saved.append((owner, name, getattr(owner, name)))
            setattr(owner, name, new)
        yield
    finally:
        for owner, name, original in reversed(saved):
            setattr(owner, name, original)


# --- the bytes a rank sends --------------------------------------------------------------------


class Kind(enum.Enum):
    """What a ``ProcessGroup`` call is, for its cost."""

    ALL_GATHER = "all-gather"
    """Costs (N-1)/N of the gathered output."""
    REDUCE_SCATTER = "reduce-scatter"
    """Costs (N-1)/N of the full input."""
    ALL_REDUCE = "all-reduce"
    """Costs 2(N-1)/N of the tensor (a ring's reduce-scatter and all-gather)."""
    OTHER = "other"
    """A send, a broadcast, ...: the bytes of the tensors passed."""


#: The collectives of ProcessGroup, what the functions of torch.distributed call: patched
#: here, they catch a function imported by name before the check started (``from
#: torch.distributed import all_reduce``).
COLLECTIVE_METHODS = {
    **dict.fromkeys(("allgather", "_allgather_base", "all_gather_single", "allgather_coalesced",
                     "allgather_into_tensor_coalesced", "all_gather_single_coalesced"),
                    Kind.ALL_GATHER),
    **dict.fromkeys(("reduce_scatter", "_reduce_scatter_base", "reduce_scatter_single",
                     "reduce_scatter_single_coalesced", "reduce_scatter_tensor_coalesced"),
                    Kind.REDUCE_SCATTER),
    **dict.fromkeys(("allreduce", "allreduce_coalesced"), Kind.ALL_REDUCE),
    **dict.fromkeys(("broadcast", "reduce", "gather", "scatter", "alltoall", "alltoall_base",
                     "all_to_all_single"), Kind.OTHER),
}
#: What :func:`counted_collectives` patches: the collectives, and the point-to-point send.
GROUP_METHODS = {**COLLECTIVE_METHODS, "send": Kind.OTHER}


def _tensors(value: object) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


def nbytes(value: object) -> int:
    """Bytes of the tensors in ``value`` (a tensor, or lists of them)."""
    return sum(t.numel() * t.element_size() for t in _tensors(value))


def ring_cost(kind: Kind, args: tuple[Any, ...], n: int) -> float:
    """Bytes this rank sends for one call, by the ring algorithms of chapters 2-4."""
    if kind is Kind.ALL_GATHER:  # (output(s), input(s), ...): forward N-1 shards
        return (n - 1) * nbytes(args[1])
    if kind is Kind.REDUCE_SCATTER:  # (output(s), input(s), ...): N-1 partial sums
        return (n - 1) * nbytes(args[0])
    if kind is Kind.ALL_REDUCE:
        return 2 * (n - 1) / n * nbytes(args[0])
    return nbytes(args[0])


@dataclass
class Traffic:
    """What this rank sent since the check last reset it."""

    sent: float = 0.0  #: bytes, at ring cost
    all_reduced: int = 0  #: elements passed to all-reduces


@contextlib.contextmanager
def counted_collectives(refusals: Mapping[str, Callable[..., NoReturn]] | None = None
                        ) -> Iterator[Traffic]:
    """Inside: each of :data:`GROUP_METHODS` adds its ring cost to the traffic, but a method
    named in ``refusals`` is replaced by its refusal (called as the method, it raises), and
    the ways around these methods are closed (:func:`side_doors_closed`, with the kinds of the
    refused methods)."""
    traffic = Traffic()
    group = distributed_c10d.ProcessGroup
    refusals = refusals or {}

    def counted(kind: Kind, original: Callable[..., Any]) -> Callable[..., Any]:
        def call(self: Any, *args: Any, **kwargs: Any) -> Any:
            if kind is Kind.ALL_REDUCE:
                traffic.all_reduced += sum(t.numel() for t in _tensors(args[0]))
            traffic.sent += ring_cost(kind, args, self.size())
            return original(self, *args, **kwargs)

        return call

    refused = {GROUP_METHODS[name] for name in refusals}
    with side_doors_closed(refused), patched(
            (group, name, refusals.get(name) or counted(kind, getattr(group, name)))
            for name, kind in GROUP_METHODS.items() if hasattr(group, name)):
        yield traffic


# --- the doors around ProcessGroup's methods -------------------------------------------------


class SideDoorError(RuntimeError):
    """Raised inside a check's ranks when the learner's code reaches a collective by a way
    around ``torch.distributed``'s functions and ``ProcessGroup``'s methods, which the check
    counts or refuses: a backend's own methods, a functional collective, a c10d operator."""


#: What a learner's code may call through a backend or an operator: messages and barriers.
_NOT_COLLECTIVES = ("send", "recv", "isend", "irecv", "barrier", "monitored_barrier",
                    "check_for_nan", "batch_p2p_ops", "wait_tensor", "wrap_tensor_autograd")
#: The namespaces of torch's collective operators: ``dist.*`` reaches ``c10d``'s through
#: ProcessGroup; ``torch.distributed._functional_collectives`` reaches the others directly.
_FUNCTIONAL = ("_c10d_functional", "_c10d_functional_autograd", "c10d_functional")


def operator_kind(name: str) -> Kind | None:
    """What the c10d operator ``name`` (``allreduce_``, ``all_gather_into_tensor``) is, for
    its cost; None for a point-to-point message or a barrier."""
    bare = name.strip("_").replace("_", "")
    if any(bare.startswith(p.replace("_", "")) for p in _NOT_COLLECTIVES):
        return None
    for stem, kind in (("allreduce", Kind.ALL_REDUCE), ("allgather", Kind.ALL_GATHER),
                       ("reducescatter", Kind.REDUCE_SCATTER)):
        if bare.startswith(stem):
            return kind
    return Kind.OTHER


def _operators() -> dict[str, list[str]]:
    """Namespace -> the collective operators torch registered in it (this torch's)."""
    listed = getattr(torch._C, "_dispatch_get_all_op_names", lambda: [])()
    found: dict[str, list[str]] = {}
    for full in listed:
        space, _, name = full.partition("::")
        if (space == "c10d" or space in _FUNCTIONAL) and operator_kind(name) is not None:
            found.setdefault(space, []).append(name)
    return found


def _side_door(what: str) -> Callable[..., NoReturn]:
    def refuse(*args: Any, **kwargs: Any) -> NoReturn:
        raise SideDoorError(
            f"{what} is refused while a check runs your code: it reaches a collective around "
            "torch.distributed's functions, which the check counts (or refuses). Call "
            "torch.distributed's functions (dist.send, dist.all_reduce, ...) instead.")

    return refuse


@contextlib.contextmanager
def side_doors_closed(refused: Iterable[Kind] = ()) -> Iterator[None]:
    """Inside: a process group's backend (``group._get_backend(device)``) raises
    :class:`SideDoorError` from each of its methods that sends, every functional collective
    (``torch.distributed._functional_collectives``, ``torch.ops._c10d_functional``) raises it
    too, on the CPU, whatever reference reaches it (its kernel is replaced in torch's
    dispatcher), and so does each ``torch.ops.c10d`` collective of a kind in ``refused``
    (those the check refuses in ProcessGroup's methods: ``dist.all_reduce`` reaches its
    operator through them). Restored on exit."""
    refused = set(refused)
    backend = getattr(torch._C._distributed_c10d, "Backend", None)  # the C++ class
    methods = [(backend, name, _side_door(f"Backend.{name}"))
               for name in (*GROUP_METHODS, "recv", "recv_anysource")
               if backend is not None and name in vars(backend)]
    libraries = []
    try:
        with warnings.catch_warnings():  # "Overriding a previously registered kernel"
            warnings.simplefilter("ignore")
            for space, names in _operators().items():
                library = torch.library.Library(space, "IMPL")
                libraries.append(library)
                for name in names:
                    if space == "c10d" and operator_kind(name) not in refused:
                        continue
                    packet = getattr(getattr(torch.ops, space), name)
                    for overload in packet.overloads():
                        target = name if overload == "default" else f"{name}.{overload}"
                        library.impl(target, _side_door(f"torch.ops.{space}.{name}"), "CPU")
        with patched(methods):
            yield
    finally:
        for library in libraries:
            library._destroy()


# --- the all-reduces of a training step --------------------------------------------------------


class Phase(enum.Enum):
    """Where a rank is in a training step when a collective is made."""

    SETUP = "setup"
    """Building the wrapper, zeroing gradients, the optimizer step."""
    FORWARD = "forward"
    """Inside ``wrapper(x)``."""
    BACKWARD = "backward"
    """Inside ``loss.backward()``: only the learner's gradient hooks run here."""
    FINISH = "finish"
    """Inside ``finish_gradient_synchronization()``."""


@dataclass(frozen=True)
class AllReduce:
    """One all-reduce a rank made during a step."""

    numel: int
    async_op: bool | None
    """The ``async_op`` it was made with (None when made without AllreduceOptions)."""
    phase: Phase
    waited_in_backward: bool
    """True when ``work.wait()`` was called on it before ``loss.backward()`` returned."""
    waited: bool
    """True when its work was waited for (or its future taken) before the step ended."""


@dataclass
class _Launched:
    """An all-reduce as the rank sees it while the step runs (mutable: waits come later)."""

    numel: int
    async_op: bool | None
    phase: Phase
    work: Any = None
    waited_in_backward: bool = False
    waited: bool = False

    def freeze(self) -> AllReduce:
        return AllReduce(self.numel, self.async_op, self.phase, self.waited_in_backward,
                         self.waited)


@dataclass
class AllReduceLog:
    """The all-reduces of the current step, and the phase the step is in (set by the check
    as the step goes on)."""

    phase: Phase = Phase.SETUP
    calls: list[_Launched] = field(default_factory=list)

    def frozen(self) -> tuple[AllReduce, ...]:
        return tuple(call.freeze() for call in self.calls)


@contextlib.contextmanager
def watched_all_reduces() -> Iterator[AllReduceLog]:
    """Inside: every ``ProcessGroup.allreduce`` (what ``dist.all_reduce`` calls, however the
    learner reached it) is logged with its numel, its ``async_op`` and the phase, and every
    ``Work.wait`` (``synchronize``, ``get_future``) on one of them is noted, with whether
    backward was still running. Restored on exit."""
    log = AllReduceLog()
    group_class, work_class = distributed_c10d.ProcessGroup, distributed_c10d.Work

    def logged(original: Callable[..., Any]) -> Callable[..., Any]:
        def allreduce(self: Any, tensors: Any, *args: Any, **kwargs: Any) -> Any:
            listed = tensors if isinstance(tensors, (list, tuple)) else [tensors]
            opts = args[0] if args else kwargs.get("opts")
            async_op = getattr(opts, "asyncOp", None)  # None: called without options
            call = _Launched(sum(t.numel() for t in listed), async_op, log.phase)
            log.calls.append(call)
            call.work = original(self, tensors, *args, **kwargs)
            return call.work

        return allreduce

    def watched(original: Callable[..., Any], blocks: bool) -> Callable[..., Any]:
        def wait(self: Any, *args: Any, **kwargs: Any) -> Any:
            # A wait made by dist.all_reduce itself: it was called with async_op=False (how
            # torch 2.4 shows it: its AllreduceOptions have no asyncOp).
            by_torch = sys._getframe(1).f_globals.get("__name__") == distributed_c10d.__name__
            for call in log.calls:
                if call.work is self:
                    call.waited = True
                    call.waited_in_backward |= blocks and log.phase is Phase.BACKWARD
                    if by_torch and call.async_op is None:
                        call.async_op = False
            return original(self, *args, **kwargs)

        return wait

    with side_doors_closed(), patched([
        *((group_class, name, logged(getattr(group_class, name)))
          for name in ("allreduce", "allreduce_coalesced")),
        *((work_class, name, watched(getattr(work_class, name), blocks=name != "get_future"))
          for name in ("wait", "synchronize", "get_future")),
    ]):
        yield log
