"""All-reduce, reduce-scatter and all-gather built from point-to-point messages only.

Chapters 2-4. Every function here uses nothing but ``isend``/``irecv`` (or
``batch_isend_irecv``, which NCCL needs so that a send and a receive on the same pair of
ranks cannot deadlock) and follows torch.distributed's conventions: it is called by every
rank of ``group``, ``op`` is ``ReduceOp.SUM`` or ``ReduceOp.AVG``, and all-reduces work in
place.

Notation in the docstrings: N ranks, S bytes in the tensor, rank r. The tensor is cut into N
chunks with :func:`shard_bounds` (the first ``numel % N`` chunks are one element longer, as
``torch.tensor_split`` cuts), so any numel works, including numel < N (some chunks are empty).

Costs per rank, in the order the chapters meet them (bytes sent; received is the same except
for the naive root and the broadcast):

=====================================  ==============================  ===================
algorithm                              bytes sent per rank             sequential steps
=====================================  ==============================  ===================
naive (reduce to root, broadcast)      root (N-1)·S, others S          2(N-1) at the root
whole-tensor ring                      (N-1)·S                          N-1
ring (reduce-scatter + all-gather)     2(N-1)/N·S                       2(N-1)
recursive doubling (N a power of 2)    log2(N)·S                        log2 N
=====================================  ==============================  ===================

The ring is bandwidth-optimal (Patarasuk and Yuan, "Bandwidth optimal all-reduce algorithms
for clusters of workstations", JPDC 2009): each rank must receive at least (N-1)/N·S to learn
the other ranks' contributions to its share and send as much, once per phase.
"""

from __future__ import annotations

import enum
import functools
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup, ReduceOp, Work

#: The default segment of the pipelined ring on CPU; chosen with ``python -m labs.bench
#: collectives`` (smaller segments pay gloo's per-message handshake too often, larger ones
#: leave too little overlap between receiving one segment and reducing the previous one).
DEFAULT_SEGMENT_BYTES = 2 << 20
#: How many incoming segments may be in flight at once in the pipelined ring.
DEFAULT_WINDOW = 2

_SUPPORTED_OPS = (ReduceOp.SUM, ReduceOp.AVG)


class Phase(enum.Enum):
    """The two halves of a ring all-reduce."""

    #: Each step a rank sends one partial sum to its right and adds the chunk from its left;
    #: after N-1 steps rank r holds chunk r summed over all ranks.
    REDUCE_SCATTER = "reduce-scatter"
    #: Each step a rank forwards a finished chunk to its right; after N-1 steps every rank
    #: holds every finished chunk.
    ALL_GATHER = "all-gather"


@dataclass
class CommStats:
    """Point-to-point traffic of one rank: one message per ``isend``/``irecv``."""

    messages_sent: int = 0
    bytes_sent: int = 0
    messages_received: int = 0
    bytes_received: int = 0


@dataclass(frozen=True)
class RingStep:
    """One step of a ring run on one rank, as the trace records it (values for small tensors)."""

    rank: int
    phase: Phase
    step: int  #: 0 .. N-2 within the phase
    sent_chunk: int
    received_chunk: int
    sent: tuple[float, ...]  #: the values sent to the right neighbour
    received: tuple[float, ...]  #: the values that arrived from the left neighbour
    chunk_after: tuple[float, ...]  #: the received chunk after this rank combined it


@dataclass
class Recorder:
    """Pass one to a collective to count its messages and bytes (always) and, with
    ``trace=True``, to record every ring step with its values (forces the unpipelined ring,
    so one step is one message; meant for tensors of a few elements)."""

    trace: bool = False
    stats: CommStats = field(default_factory=CommStats)
    steps: list[RingStep] = field(default_factory=list)


@dataclass
class RingBuffers:
    """What the pipelined ring keeps from one ``ring_all_reduce`` to the next, when the caller
    keeps this object and passes it to each call.

    **Scratch.** Without it every call allocates ``window`` segment-sized receive buffers
    (4 MiB with the defaults) and frees them on return. Fresh pages cost: the kernel
    zero-fills each one on first touch, and the C allocator tends to hand such large blocks
    back to the kernel when they are freed, so the next call pays again.

    **The schedule.** Every call also works out which segment goes where, in what order, and
    when to wait for what (:func:`_compile_pipelined`), and that is Python work, a visible
    share of a 1 MiB call between 2 ranks on a small machine (chapter 2 measures it with
    :func:`labs.experiments.measure_planning`). The last schedule is kept here and run again
    as long as the calls are the same: the same tensor memory, size and dtype, group, segment
    and window. Plan once, run many times.

    A caller that all-reduces many times, as a training loop does and as the benchmark does,
    passes one ``RingBuffers``. The kept schedule holds views of the last tensor served, so
    that tensor's memory lives until the buffers serve another tensor or are dropped. Results
    never live in these buffers.
    """

    tensors: list[torch.Tensor] = field(default_factory=list)
    #: The compiled pass of the last call (see :func:`_run_ring`), or None; set it to None and
    #: the next call works its schedule out again.
    program: _Program | None = field(default=None, repr=False)

    def take(self, count: int, numel: int, dtype: torch.dtype,
             device: torch.device) -> list[torch.Tensor]:
        """``count`` 1-D buffers of ``numel`` elements, reused when the kept ones fit."""
        fits = len(self.tensors) >= count and all(
            t.numel() >= numel and t.dtype == dtype and t.device == device
            for t in self.tensors[:count])
        if not fits:
            self.tensors = [torch.empty(numel, dtype=dtype, device=device)
                            for _ in range(count)]
        return [t[:numel] for t in self.tensors[:count]]


# --- chunking -------------------------------------------------------------------------------


def shard_bounds(numel: int, world_size: int) -> list[int]:
    """The N+1 offsets that cut ``numel`` elements into N chunks, as ``torch.tensor_split``
    does: chunk i is ``[bounds[i], bounds[i+1])`` and the first ``numel % N`` chunks hold one
    element more than the rest."""
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    base, extra = divmod(numel, world_size)
    bounds = [0]
    for i in range(world_size):
        bounds.append(bounds[-1] + base + (1 if i < extra else 0))
    return bounds


def _segments(numel: int, segment: int | None) -> list[tuple[int, int]]:
    """[start, stop) ranges that cut ``numel`` elements into pieces of at most ``segment``."""
    if numel == 0:
        return []
    if segment is None:
        return [(0, numel)]
    return [(start, min(start + segment, numel)) for start in range(0, numel, segment)]


# --- point-to-point plumbing ----------------------------------------------------------------


@dataclass
class _Peers:
    """Group-relative ranks, point-to-point calls that count their traffic, and the checks
    every collective starts with."""

    group: ProcessGroup | None
    rank: int
    size: int
    recorder: Recorder | None

    @functools.cached_property
    def backend(self) -> str:
        """The group's backend as ``dist.get_backend`` names it ("gloo", "cpu:gloo,cuda:nccl");
        asked for only when needed (a CPU tensor on the pipelined ring never needs it)."""
        return str(dist.get_backend(self.group))

    @classmethod
    def of(cls, group: ProcessGroup | None, recorder: Recorder | None,
           tensor: torch.Tensor | None = None) -> _Peers:
        """The peers of ``group``. Pass the ``tensor`` that will be sent when the caller
        sends it point to point: a backend that cannot carry it is refused here, before any
        rank starts a send its peers would wait on."""
        if not dist.is_initialized():
            raise RuntimeError(
                "torch.distributed is not initialised: call this inside a function run by "
                "labs.launch (or under torchrun after init_process_group)."
            )
        peers = cls(group, dist.get_rank(group), dist.get_world_size(group), recorder)
        if tensor is not None and peers.size > 1:
            peers.check_can_send(tensor)
        return peers

    def check_can_send(self, tensor: torch.Tensor) -> None:
        """Refuse a tensor this group's send/recv cannot carry.

        gloo's own collectives accept CUDA tensors (they stage them through host memory), but
        its send/recv hand the tensor's pointer to the socket as if it were host memory: the
        kernel refuses a device address ("writev ...: Bad address") and the peer is left
        waiting. Measured on one GPU with two gloo ranks; the same call on CPU tensors works.
        """
        kind = tensor.device.type
        if kind != "cpu" and backend_for_device(self.backend, kind) == "gloo":
            raise ValueError(
                f"rank {self.rank}: these collectives are built on send/recv, and gloo's "
                f"send/recv cannot carry {kind} tensors (tensor on {tensor.device}). Use "
                "backend='nccl' with one GPU per rank, or keep the tensor on the CPU "
                "(labs.rank_device() picks the device that matches the backend)."
            )

    def global_rank(self, group_rank: int) -> int:
        group_rank %= self.size
        return group_rank if self.group is None else dist.get_global_rank(self.group, group_rank)

    def count(self, tensor: torch.Tensor, *, sent: bool) -> None:
        """Add one message of ``tensor`` to the recorder's stats, if there is a recorder."""
        if self.recorder is None:
            return
        stats, nbytes = self.recorder.stats, tensor.numel() * tensor.element_size()
        if sent:
            stats.messages_sent += 1
            stats.bytes_sent += nbytes
        else:
            stats.messages_received += 1
            stats.bytes_received += nbytes

    def isend(self, tensor: torch.Tensor, to: int, tag: int = 0) -> Work:
        self.count(tensor, sent=True)
        return dist.isend(tensor, self.global_rank(to), group=self.group, tag=tag)

    def irecv(self, tensor: torch.Tensor, source: int, tag: int = 0) -> Work:
        self.count(tensor, sent=False)
        return dist.irecv(tensor, self.global_rank(source), group=self.group, tag=tag)

    def exchange(self, send: torch.Tensor, to: int, recv: torch.Tensor, source: int) -> None:
        """Send ``send`` to ``to`` while receiving into ``recv`` from ``source``.

        On NCCL the two go as one batch (``batch_isend_irecv``): two separate calls on the
        same pair of ranks can deadlock there. gloo has no such hazard and the batch only
        costs it time (on a 16-core host a lock-step ring all-reduce of 1 MiB took a fifth
        longer batched at 2 ranks, a third longer at 4), so under gloo the receive is posted
        first, then the send."""
        sending, receiving = send.numel() > 0, recv.numel() > 0
        if sending:
            self.count(send, sent=True)
        if receiving:
            self.count(recv, sent=False)
        if backend_for_device(self.backend, send.device.type) == "gloo":
            works = []
            if receiving:
                works.append(dist.irecv(recv, self.global_rank(source), group=self.group))
            if sending:
                works.append(dist.isend(send, self.global_rank(to), group=self.group))
        else:
            ops = []
            if sending:
                ops.append(dist.P2POp(dist.isend, send, self.global_rank(to), self.group))
            if receiving:
                ops.append(dist.P2POp(dist.irecv, recv, self.global_rank(source), self.group))
            works = dist.batch_isend_irecv(ops) if ops else []
        for work in works:
            work.wait()


def exchange(send: torch.Tensor, to: int, recv: torch.Tensor, source: int,
             group: ProcessGroup | None = None) -> None:
    """One lock-step ring step as a function: send ``send`` to rank ``to`` while receiving
    ``recv`` from rank ``source`` (ranks in ``group``, taken modulo its size, so ``rank + 1``
    and ``rank - 1`` are the ring's neighbours), both finished on return. Batched on
    NCCL, receive-then-send on gloo (see :meth:`_Peers.exchange`); the cost model times its
    messages with this."""
    _Peers.of(group, None, send).exchange(send, to, recv, source)


def backend_for_device(backend: str, device_type: str) -> str:
    """Which backend of ``backend`` (as ``dist.get_backend`` names it) carries tensors of
    ``device_type``: a group has one backend ("gloo") or one per device type
    ("cpu:gloo,cuda:nccl"). A device type the string does not name gets the string back."""
    if ":" not in backend:
        return backend
    per_device = dict(part.split(":", 1) for part in backend.split(","))
    return per_device.get(device_type, backend)


def _is_avg(op: ReduceOp) -> bool:
    """Whether ``op`` (SUM or AVG, as :func:`_check` lets through) is AVG. By identity first:
    ``==`` on torch's ReduceOp values is a pybind11 call, over ten times slower, and on the
    ring's hot path every microsecond before the first send counts."""
    return op is ReduceOp.AVG or (op is not ReduceOp.SUM and op == ReduceOp.AVG)


def _check(tensor: torch.Tensor, op: ReduceOp) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor, got {type(tensor).__name__}")
    if op is not ReduceOp.SUM and op not in _SUPPORTED_OPS:
        raise ValueError(f"op must be ReduceOp.SUM or ReduceOp.AVG, got {op}")
    if _is_avg(op) and not tensor.is_floating_point():
        raise ValueError(f"ReduceOp.AVG needs a floating-point tensor, got {tensor.dtype}")


def _in_place(tensor: torch.Tensor, body: Callable[[torch.Tensor], None]) -> torch.Tensor:
    """Run ``body`` on a flat contiguous view of ``tensor`` (through a copy if need be)."""
    if tensor.is_contiguous():
        body(tensor.view(-1))
    else:
        flat = tensor.contiguous().view(-1)
        body(flat)
        tensor.copy_(flat.view_as(tensor))
    return tensor


def _finish(tensor: torch.Tensor, op: ReduceOp, world_size: int) -> torch.Tensor:
    if world_size > 1 and _is_avg(op):
        tensor.div_(world_size)
    return tensor


# --- naive: reduce to a root, broadcast back --------------------------------------------------


def naive_all_reduce(
    tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM, group: ProcessGroup | None = None,
    *, root: int = 0, recorder: Recorder | None = None,
) -> torch.Tensor:
    """All-reduce in place by sending every tensor to ``root``, which sums them in rank order
    and sends the result back to each rank.

    Cost: the root receives (N-1)·S and sends (N-1)·S, one message at a time through its one
    link, so its time grows linearly with N while the other links sit idle; every other rank
    sends S and receives S. 2(N-1) messages in all.
    """
    _check(tensor, op)
    peers = _Peers.of(group, recorder, tensor)

    def body(flat: torch.Tensor) -> None:
        if peers.size == 1 or flat.numel() == 0:
            return
        if peers.rank == root:
            incoming = torch.empty_like(flat)
            total = torch.zeros_like(flat)
            for source in range(peers.size):  # rank order, so the sum's rounding is fixed
                if source == root:
                    total.add_(flat)
                    continue
                peers.irecv(incoming, source).wait()
                total.add_(incoming)
            flat.copy_(total)
            sends = [peers.isend(flat, dst) for dst in range(peers.size) if dst != root]
            for work in sends:
                work.wait()
        else:
            peers.isend(flat, root).wait()
            peers.irecv(flat, root).wait()
        _finish(flat, op, peers.size)

    return _in_place(tensor, body)


# --- the textbook mistake: whole tensors round the ring -------------------------------------


def whole_tensor_ring_all_reduce(
    tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM, group: ProcessGroup | None = None,
    *, recorder: Recorder | None = None,
) -> torch.Tensor:
    """A counter-example: every rank passes whole tensors round the ring N-1 times, adding
    each arrival to its total.

    It gives the right sum, but each rank sends (N-1)·S, against 2(N-1)/N·S for the real ring:
    at N = 8 that is 7·S against 1.75·S. And because rank r adds the others' tensors in its own
    order (r-1, r-2, ...), float rounding can leave the ranks holding slightly different
    "sums", something the real ring cannot do (every chunk is summed once, then copied).
    """
    _check(tensor, op)
    peers = _Peers.of(group, recorder, tensor)

    def body(flat: torch.Tensor) -> None:
        if peers.size == 1 or flat.numel() == 0:
            return
        passing, arriving = flat.clone(), torch.empty_like(flat)
        for _ in range(peers.size - 1):
            peers.exchange(passing, peers.rank + 1, arriving, peers.rank - 1)
            flat.add_(arriving)
            passing, arriving = arriving, passing
        _finish(flat, op, peers.size)

    return _in_place(tensor, body)


# --- the ring ------------------------------------------------------------------------------


@dataclass
class _RingStep:
    """One step of a ring pass on this rank. ``send`` goes right; the chunk from the left lands
    in ``land`` (``None``: a scratch buffer) and ``result = landed + addend`` (or just the
    landed bytes when ``addend`` is None). A step's ``result`` is the next step's ``send``."""

    phase: Phase
    step: int
    sent_chunk: int
    received_chunk: int
    send: torch.Tensor
    land: torch.Tensor | None
    result: torch.Tensor
    addend: torch.Tensor | None
    #: ``land`` reuses memory that this earlier step sent from: wait for that send first.
    land_after_send_of: int | None = None


def _reduce_scatter_steps(
    flat: torch.Tensor, bounds: list[int], rank: int, *, out_of_place: bool
) -> tuple[list[_RingStep], torch.Tensor]:
    """The N-1 reduce-scatter steps. At step k rank r sends chunk (r-k-1) mod N and receives
    chunk (r-k-2) mod N, adding its own contribution; after the last step (k = N-2) the chunk
    it has just finished is chunk r. Returns the steps and the tensor that ends up holding
    chunk r.

    In place (all-reduce), partial sums accumulate in ``flat`` itself. Out of place (a
    stand-alone reduce-scatter), the input is left untouched and partial sums live in two
    chunk-sized accumulators used in turn, so the extra memory is 2/N of the input, not 1x.
    """
    n = len(bounds) - 1

    def chunk(i: int) -> torch.Tensor:
        i %= n
        return flat[bounds[i]:bounds[i + 1]]

    longest = max(bounds[i + 1] - bounds[i] for i in range(n))
    accumulators = (
        [torch.empty(longest, dtype=flat.dtype, device=flat.device) for _ in range(2)]
        if out_of_place else []
    )
    steps: list[_RingStep] = []
    send = chunk(rank - 1)
    for k in range(n - 1):
        received = (rank - k - 2) % n
        own = chunk(received)
        if out_of_place:
            land = accumulators[k % 2][: own.numel()]
            result, addend = land, own
            after = k - 1 if k >= 2 else None
        else:
            land, result, addend, after = None, own, own, None
        steps.append(_RingStep(Phase.REDUCE_SCATTER, k, (rank - k - 1) % n, received, send,
                               land, result, addend, after))
        send = result
    return steps, send


def _all_gather_steps(
    flat: torch.Tensor, bounds: list[int], rank: int, first_send: torch.Tensor
) -> list[_RingStep]:
    """The N-1 all-gather steps: at step k rank r forwards chunk (r-k) mod N (at step 0 its
    own, ``first_send``) and receives chunk (r-k-1) mod N straight into place."""
    n = len(bounds) - 1
    steps: list[_RingStep] = []
    send = first_send
    for k in range(n - 1):
        received = (rank - k - 1) % n
        dest = flat[bounds[received]:bounds[received + 1]]
        steps.append(_RingStep(Phase.ALL_GATHER, k, (rank - k) % n, received, send, dest, dest,
                               None))
        send = dest
    return steps


def _combine(step: _RingStep, landed: torch.Tensor, start: int, stop: int) -> None:
    if step.addend is not None:
        torch.add(step.addend[start:stop], landed, out=step.result[start:stop])


def _values(tensor: torch.Tensor) -> tuple[float, ...]:
    return tuple(float(v) for v in tensor.detach().float().cpu())


def _run_lockstep(peers: _Peers, steps: list[_RingStep]) -> None:
    """One message each way per step, each step finished before the next: the ring as the
    textbook draws it (and what NCCL tensors use here)."""
    # Scratch only where a step lands there (the in-place reduce-scatter of an all-reduce).
    longest = max((s.result.numel() for s in steps if s.land is None), default=0)
    scratch = torch.empty(longest, dtype=steps[0].send.dtype, device=steps[0].send.device)
    recorder = peers.recorder
    for step in steps:
        landed = scratch[: step.result.numel()] if step.land is None else step.land
        sent = _values(step.send) if recorder is not None and recorder.trace else ()
        peers.exchange(step.send, peers.rank + 1, landed, peers.rank - 1)
        received = _values(landed) if recorder is not None and recorder.trace else ()
        _combine(step, landed, 0, step.result.numel())
        if recorder is not None and recorder.trace:
            recorder.steps.append(RingStep(
                peers.rank, step.phase, step.step, step.sent_chunk, step.received_chunk,
                sent, received, _values(step.result),
            ))


class _OpKind(enum.Enum):
    """What one instruction of a compiled ring pass does (see :class:`_Program`)."""

    RECV = "recv"  #: post a receive into ``tensor`` from the left neighbour: message ``handle``
    SEND = "send"  #: post a send of ``tensor`` to the right neighbour: message ``handle``
    WAIT = "wait"  #: wait until message ``handle`` has arrived (a receive) or left (a send)
    ADD = "add"  #: ``out = addend + tensor``, the received segment in ``tensor``


class _Op(NamedTuple):
    """One instruction of a compiled ring pass; ``kind`` says which fields it uses."""

    kind: _OpKind
    handle: int = -1
    tensor: torch.Tensor | None = None
    tag: int = 0
    addend: torch.Tensor | None = None
    out: torch.Tensor | None = None


@dataclass
class _Program:
    """A pipelined ring pass compiled for one tensor: every post, wait and addition in the
    order :func:`_execute` issues them, the views of the tensor and of the scratch buffers
    already cut. ``key`` names the call it was compiled for (:func:`_run_ring`)."""

    key: tuple[object, ...]
    instructions: list[_Op]
    right: int  #: the global rank that SEND sends to
    left: int  #: the global rank that RECV receives from


def _compile_pipelined(
    peers: _Peers, steps: list[_RingStep], segment: int, window: int,
    buffers: RingBuffers | None, key: tuple[object, ...],
) -> _Program:
    """The same steps cut into segments and overlapped: as soon as a segment of step k has
    arrived and been combined it is sent on as that segment of step k+1, while later segments
    are still in flight. Up to ``window`` incoming segments that land in scratch buffers are
    posted ahead; segments that land in their final place (all-gather) are all posted at the
    start, so the sender never waits for a receive to be posted. Messages are tagged with the
    step so that early and late receives cannot be matched to the wrong message.

    Nothing is sent here: the schedule is written down as a list of instructions, which
    :func:`_execute` runs. Working it out costs Python time on every call, so a caller that
    passes :class:`RingBuffers` keeps the compiled pass and repeats it."""
    events = [(i, start, stop) for i, step in enumerate(steps)
              for start, stop in _segments(step.result.numel(), segment)]
    dtype, device = steps[0].send.dtype, steps[0].send.device
    uses_scratch = [steps[i].land is None for i, _, _ in events]
    scratch_events = [e for e in range(len(events)) if uses_scratch[e]]
    longest = max((stop - start for e, (_, start, stop) in enumerate(events) if uses_scratch[e]),
                  default=0)
    scratch = (buffers or RingBuffers()).take(min(window, len(scratch_events)), longest,
                                              dtype, device)
    slot = {e: n % window for n, e in enumerate(scratch_events)}
    instructions: list[_Op] = []
    sends: dict[tuple[int, int], int] = {}  # (step, segment start) -> handle, not waited for
    recvs: dict[int, tuple[int, torch.Tensor]] = {}  # event -> handle, where it lands
    handles = itertools.count()

    def post(kind: _OpKind, tensor: torch.Tensor, tag: int) -> int:
        handle = next(handles)
        instructions.append(_Op(kind, handle, tensor, tag))
        return handle

    def post_send(i: int, start: int, stop: int) -> None:
        sends[(i, start)] = post(_OpKind.SEND, steps[i].send[start:stop], i)

    def post_recv(e: int) -> None:
        i, start, stop = events[e]
        step = steps[i]
        if step.land is None:
            target = scratch[slot[e]][: stop - start]
        else:
            if step.land_after_send_of is not None:
                # Every earlier send of this segment, not only the last step's: when a step
                # between had an empty chunk, the send that read this memory is older.
                for earlier in [k for k in sends
                                if k[1] == start and k[0] <= step.land_after_send_of]:
                    instructions.append(_Op(_OpKind.WAIT, sends.pop(earlier)))
            target = step.land[start:stop]
        recvs[e] = (post(_OpKind.RECV, target, i), target)

    ahead = scratch_events[:window]
    direct = [e for e in range(len(events))
              if not uses_scratch[e] and steps[events[e][0]].land_after_send_of is None]
    for e in sorted(ahead + direct):
        post_recv(e)
    for start, stop in _segments(steps[0].send.numel(), segment):
        post_send(0, start, stop)
    next_scratch = len(ahead)
    for e, (i, start, stop) in enumerate(events):
        if e not in recvs:
            post_recv(e)
        handle, landed = recvs.pop(e)
        instructions.append(_Op(_OpKind.WAIT, handle))
        step = steps[i]
        if step.addend is not None:
            instructions.append(_Op(_OpKind.ADD, tensor=landed, addend=step.addend[start:stop],
                           out=step.result[start:stop]))
        if uses_scratch[e] and next_scratch < len(scratch_events):
            post_recv(scratch_events[next_scratch])  # reuses the scratch buffer just freed
            next_scratch += 1
        if i + 1 < len(steps):
            post_send(i + 1, start, stop)
    instructions.extend(_Op(_OpKind.WAIT, handle) for handle in sends.values())
    return _Program(key, instructions, peers.global_rank(peers.rank + 1),
                    peers.global_rank(peers.rank - 1))


def _execute(peers: _Peers, program: _Program) -> None:
    """Run a compiled ring pass: post, wait and add in the order it lists them.

    This loop is the ring's hot path, so it calls ``dist.isend``/``dist.irecv`` itself
    rather than through :meth:`_Peers.isend`: on a 2-core machine each Python call costs a
    few microseconds while two ranks move data, and a 1 MiB all-reduce has only a few
    hundred to spare."""
    works: dict[int, Work] = {}
    group, count = peers.group, peers.recorder is not None
    right, left = program.right, program.left
    for op in program.instructions:
        kind = op.kind
        if kind is _OpKind.WAIT:
            works.pop(op.handle).wait()
        elif kind is _OpKind.ADD:
            torch.add(op.addend, op.tensor, out=op.out)
        else:
            assert op.tensor is not None
            if count:
                peers.count(op.tensor, sent=kind is _OpKind.SEND)
            if kind is _OpKind.SEND:
                works[op.handle] = dist.isend(op.tensor, right, group=group, tag=op.tag)
            else:
                works[op.handle] = dist.irecv(op.tensor, left, group=group, tag=op.tag)


def _run_ring(
    peers: _Peers, data: torch.Tensor, steps: Callable[[], list[_RingStep]],
    segment_bytes: int | None, window: int, buffers: RingBuffers | None = None,
) -> None:
    """Run the ring pass that ``steps()`` lays out over ``data``, lock-step or pipelined.

    With ``buffers``, the compiled pipelined pass is kept in them and run again, without
    calling ``steps()``, while the call is the same: the same memory (``data``'s address,
    length and dtype), group, rank, segment and window. Only the all-reduce passes
    ``buffers``: its steps touch nothing but ``data`` and the buffers' scratch, so a kept pass
    stays valid for as long as it keeps ``data``'s memory alive (its views do).
    """
    trace = peers.recorder is not None and peers.recorder.trace
    if segment_bytes is None or trace or data.device.type != "cpu":
        laid_out = steps()
        if laid_out:
            _run_lockstep(peers, laid_out)
        return
    segment, window = max(1, segment_bytes // data.element_size()), max(1, window)
    key = (data.data_ptr(), data.numel(), data.dtype, peers.group, peers.rank, peers.size,
           segment, window)
    program = buffers.program if buffers is not None else None
    if program is None or program.key != key:
        laid_out = steps()
        if not laid_out:
            return
        program = _compile_pipelined(peers, laid_out, segment, window, buffers, key)
        if buffers is not None:
            buffers.program = program
    _execute(peers, program)


def ring_all_reduce(
    tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM, group: ProcessGroup | None = None,
    *, recorder: Recorder | None = None, segment_bytes: int | None = DEFAULT_SEGMENT_BYTES,
    window: int = DEFAULT_WINDOW, buffers: RingBuffers | None = None,
) -> torch.Tensor:
    """Bandwidth-optimal all-reduce in place: a ring reduce-scatter, then a ring all-gather,
    over N chunks.

    Reduce-scatter step k (k = 0..N-2): rank r sends chunk (r-k-1) mod N to rank r+1 and adds
    the chunk (r-k-2) mod N that rank r-1 sends it; after N-1 steps rank r owns chunk r summed
    over all ranks. All-gather step k: rank r sends chunk (r-k) mod N on and stores chunk
    (r-k-1) mod N. Each rank sends and receives 2(N-1) chunks of S/N bytes, 2(N-1)/N·S in all,
    whatever N is. Every chunk is summed once, by one rank, and copied everywhere else, so all
    ranks end with bit-identical values.

    On CPU, chunks are cut into ``segment_bytes`` segments and pipelined (see
    :func:`_compile_pipelined`); ``segment_bytes=None`` runs the plain lock-step ring (always
    used for CUDA tensors and when ``recorder.trace`` is on). Pass the same
    :class:`RingBuffers` to repeated calls to keep the scratch buffers and the pass's schedule
    between them.
    """
    _check(tensor, op)
    peers = _Peers.of(group, recorder, tensor)

    def body(flat: torch.Tensor) -> None:
        if peers.size == 1 or flat.numel() == 0:
            return

        def steps() -> list[_RingStep]:
            bounds = shard_bounds(flat.numel(), peers.size)
            scatter, mine = _reduce_scatter_steps(flat, bounds, peers.rank, out_of_place=False)
            return scatter + _all_gather_steps(flat, bounds, peers.rank, mine)

        _run_ring(peers, flat, steps, segment_bytes, window, buffers)
        _finish(flat, op, peers.size)

    return _in_place(tensor, body)


def ring_reduce_scatter(
    tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM, group: ProcessGroup | None = None,
    *, recorder: Recorder | None = None, segment_bytes: int | None = DEFAULT_SEGMENT_BYTES,
    window: int = DEFAULT_WINDOW,
) -> torch.Tensor:
    """Reduce-scatter by ring: returns a new 1-D tensor holding chunk r (``shard_bounds``) of
    the sum over ranks of the flattened ``tensor``, which is left unchanged.

    This is the first phase of :func:`ring_all_reduce`: N-1 steps, each rank sends and
    receives (N-1)/N·S. The result holds S/N bytes; while it runs a rank also holds two
    chunk-sized accumulators (2S/N).
    """
    _check(tensor, op)
    peers = _Peers.of(group, recorder, tensor)
    flat = tensor.detach().reshape(-1).contiguous()
    bounds = shard_bounds(flat.numel(), peers.size)
    mine = flat[bounds[peers.rank]:bounds[peers.rank + 1]]
    if peers.size == 1 or flat.numel() == 0:
        return _finish(mine.clone(), op, peers.size)
    steps, shard = _reduce_scatter_steps(flat, bounds, peers.rank, out_of_place=True)
    _run_ring(peers, flat, lambda: steps, segment_bytes, window)
    return _finish(shard.clone(), op, peers.size)  # its own storage: S/N bytes, not 2S/N


def ring_all_gather(
    shard: torch.Tensor, group: ProcessGroup | None = None, *, numel: int | None = None,
    recorder: Recorder | None = None, segment_bytes: int | None = DEFAULT_SEGMENT_BYTES,
    window: int = DEFAULT_WINDOW, out: torch.Tensor | None = None,
) -> torch.Tensor:
    """All-gather by ring: returns a new 1-D tensor, the concatenation of every rank's
    ``shard`` in rank order.

    ``numel`` is the length of the result. Leave it ``None`` when every shard has this rank's
    length (torch's ``all_gather_into_tensor``); pass it to gather the uneven shards that
    :func:`ring_reduce_scatter` returns (rank i then must hold chunk i of ``shard_bounds``).
    The second phase of :func:`ring_all_reduce`: N-1 steps, each rank sends and receives
    (N-1)/N·S, where S is the size of the result. ``out`` (1-D, contiguous, ``numel``
    elements, the shard's dtype) receives the result instead of a new tensor: FSDP gathers
    into storage it keeps.
    """
    if not isinstance(shard, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor, got {type(shard).__name__}")
    peers = _Peers.of(group, recorder, shard)
    flat_shard = shard.detach().reshape(-1)
    if numel is None:
        numel = flat_shard.numel() * peers.size
    bounds = shard_bounds(numel, peers.size)
    expected = bounds[peers.rank + 1] - bounds[peers.rank]
    if flat_shard.numel() != expected:
        raise ValueError(
            f"rank {peers.rank}: shard has {flat_shard.numel()} elements but chunk "
            f"{peers.rank} of {numel} over {peers.size} ranks has {expected} (shard_bounds)."
        )
    if out is None:
        out = torch.empty(numel, dtype=shard.dtype, device=shard.device)  # 1-D, S bytes
    elif (out.dim() != 1 or out.numel() != numel or out.dtype != shard.dtype
          or not out.is_contiguous()):
        raise ValueError(f"out must be a contiguous 1-D {shard.dtype} tensor of {numel} "
                         f"elements, got {out.dtype} of shape {tuple(out.shape)}.")
    mine = out[bounds[peers.rank]:bounds[peers.rank + 1]]
    mine.copy_(flat_shard)
    if peers.size > 1 and numel:
        _run_ring(peers, out, lambda: _all_gather_steps(out, bounds, peers.rank, mine),
                  segment_bytes, window)
    return out


# --- recursive doubling ----------------------------------------------------------------------


def recursive_doubling_all_reduce(
    tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM, group: ProcessGroup | None = None,
    *, recorder: Recorder | None = None,
) -> torch.Tensor:
    """All-reduce in place in log2 N rounds: in round j rank r swaps its whole partial sum with
    rank r XOR 2^j and adds. After round j each rank holds the sum over a block of 2^(j+1)
    ranks, so log2 N rounds cover everyone. Each rank sends log2(N)·S: more bytes than the ring
    once N > 2, but only log2 N message latencies instead of 2(N-1), so it wins on small
    messages.

    When N is not a power of two, let P be the largest power of two below N and R = N - P.
    First the ranks 0..2R-1 pair up: each even rank sends its tensor to the odd rank after it
    and sits out; P ranks remain and run the rounds; then each odd rank sends the result back.
    That costs two extra message latencies and S more for the paired ranks.
    """
    _check(tensor, op)
    peers = _Peers.of(group, recorder, tensor)

    def body(flat: torch.Tensor) -> None:
        n, r = peers.size, peers.rank
        if n == 1 or flat.numel() == 0:
            return
        power = 1 << (n.bit_length() - 1)
        extra = n - power
        incoming = torch.empty_like(flat)
        if r < 2 * extra and r % 2 == 0:  # hand my tensor to r+1, wait for the answer
            peers.isend(flat, r + 1).wait()
            peers.irecv(flat, r + 1).wait()
            _finish(flat, op, n)
            return
        if r < 2 * extra:  # odd: fold in the even rank before me
            peers.irecv(incoming, r - 1).wait()
            flat.add_(incoming)
        virtual = r // 2 if r < 2 * extra else r - extra  # 0..P-1

        def real(v: int) -> int:
            return 2 * v + 1 if v < extra else v + extra

        mask = 1
        while mask < power:
            partner = real(virtual ^ mask)
            peers.exchange(flat, partner, incoming, partner)
            flat.add_(incoming)  # a + b == b + a in IEEE, so both partners get the same bits
            mask <<= 1
        if r < 2 * extra:
            peers.isend(flat, r - 1).wait()
        _finish(flat, op, n)

    return _in_place(tensor, body)


# --- choosing an algorithm -------------------------------------------------------------------


class Algorithm(enum.Enum):
    """The algorithms the chapters compare, with torch's built-in collective as the baseline."""

    NAIVE = "naive"  #: :func:`naive_all_reduce` (all-reduce only)
    WHOLE_TENSOR_RING = "whole-tensor ring"  #: :func:`whole_tensor_ring_all_reduce` (idem)
    RING = "ring"  #: :func:`ring_all_reduce`, :func:`ring_reduce_scatter`, :func:`ring_all_gather`
    RECURSIVE_DOUBLING = "recursive doubling"  #: :func:`recursive_doubling_all_reduce` (idem)
    TORCH = "torch"  #: torch.distributed's own collective (gloo or NCCL picks its algorithm)


class Collective(enum.Enum):
    """The three collectives of chapters 2-4."""

    ALL_REDUCE = "all-reduce"  #: every rank ends with the reduction of the whole tensor
    REDUCE_SCATTER = "reduce-scatter"  #: rank r ends with chunk r of the reduction
    ALL_GATHER = "all-gather"  #: every rank ends with all ranks' chunks, concatenated

    def bus_factor(self, world_size: int) -> float:
        """nccl-tests' bus-bandwidth factor: busbw = algbw x factor, with S the full array.
        Each rank must move this fraction of S over its link at the least, so busbw is
        comparable with the link's speed whatever N is."""
        if world_size < 2:
            return 0.0
        per_phase = (world_size - 1) / world_size
        return 2 * per_phase if self is Collective.ALL_REDUCE else per_phase

    def algorithms(self) -> tuple[Algorithm, ...]:
        """The algorithms that implement this collective here."""
        if self is Collective.ALL_REDUCE:
            return tuple(Algorithm)
        return (Algorithm.RING, Algorithm.TORCH)


def all_reduce(
    tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM, group: ProcessGroup | None = None,
    *, algorithm: Algorithm = Algorithm.RING, recorder: Recorder | None = None,
) -> torch.Tensor:
    """All-reduce ``tensor`` in place with the chosen algorithm; returns ``tensor``."""
    if algorithm is Algorithm.TORCH:
        _check(tensor, op)
        _torch_peers(group, recorder)
        return _in_place(tensor, lambda flat: dist.all_reduce(flat, op=op, group=group))
    fn = {
        Algorithm.NAIVE: naive_all_reduce,
        Algorithm.WHOLE_TENSOR_RING: whole_tensor_ring_all_reduce,
        Algorithm.RING: ring_all_reduce,
        Algorithm.RECURSIVE_DOUBLING: recursive_doubling_all_reduce,
    }[algorithm]
    return fn(tensor, op, group, recorder=recorder)


def _torch_peers(group: ProcessGroup | None, recorder: Recorder | None) -> _Peers:
    """The peers of a call that uses torch's built-in collective, which a Recorder cannot see
    (its messages never pass through ``isend``/``irecv`` here): refuse one rather than let it
    count nothing."""
    if recorder is not None:
        raise ValueError("a Recorder counts the messages of labs' own collectives; torch's "
                         "built-in sends its own, which it cannot see: pass recorder=None with "
                         "Algorithm.TORCH, or count another algorithm.")
    return _Peers.of(group, None)


def _only_ring_or_torch(collective: Collective, algorithm: Algorithm) -> None:
    if algorithm not in collective.algorithms():
        names = ", ".join(a.name for a in collective.algorithms())
        raise ValueError(
            f"{collective.value} is implemented by {names} here; {algorithm.name} is an "
            "all-reduce algorithm: pass algorithm=Algorithm.RING or Algorithm.TORCH."
        )


def reduce_scatter(
    tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM, group: ProcessGroup | None = None,
    *, algorithm: Algorithm = Algorithm.RING, recorder: Recorder | None = None,
) -> torch.Tensor:
    """Chunk r (``shard_bounds``) of the reduction of the flattened ``tensor``, as a new 1-D
    tensor; ``tensor`` is unchanged. ``Algorithm.TORCH`` uses ``reduce_scatter_tensor`` (on
    a zero-padded copy when numel does not divide by N)."""
    _only_ring_or_torch(Collective.REDUCE_SCATTER, algorithm)
    if algorithm is Algorithm.RING:
        return ring_reduce_scatter(tensor, op, group, recorder=recorder)
    _check(tensor, op)
    _torch_peers(group, recorder)
    n, r = dist.get_world_size(group), dist.get_rank(group)
    flat = tensor.detach().reshape(-1)
    bounds = shard_bounds(flat.numel(), n)
    longest = bounds[1] - bounds[0]
    if longest * n == flat.numel():  # even chunks: no padded copy
        out = torch.empty(longest, dtype=flat.dtype, device=flat.device)
        builtin_reduce_scatter(out, flat.contiguous(), op, group)
        return out
    padded = torch.zeros(longest * n, dtype=flat.dtype, device=flat.device)
    for i in range(n):  # chunk i at i*longest, so torch's even split matches ours
        padded[i * longest: i * longest + bounds[i + 1] - bounds[i]] = flat[bounds[i]:bounds[i + 1]]
    out = torch.empty(longest, dtype=flat.dtype, device=flat.device)
    builtin_reduce_scatter(out, padded, op, group)
    return out[: bounds[r + 1] - bounds[r]].clone()


def builtin_reduce_scatter(
    out: torch.Tensor, tensor: torch.Tensor, op: ReduceOp, group: ProcessGroup | None
) -> None:
    """torch.distributed's own reduce-scatter of ``tensor`` (numel = N x ``out``'s) into ``out``.

    torch 2.13 renamed ``reduce_scatter_tensor`` to ``reduce_scatter_single`` (the old name
    warns on every call); torch 2.4 has only the old one."""
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    fn(out, tensor, op=op, group=group)


def builtin_all_gather(out: torch.Tensor, shard: torch.Tensor, group: ProcessGroup | None) -> None:
    """torch.distributed's own all-gather of equal ``shard``s into ``out`` (``all_gather_single``
    on torch 2.13, ``all_gather_into_tensor`` before)."""
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    fn(out, shard, group=group)


def all_gather(
    shard: torch.Tensor, group: ProcessGroup | None = None, *, numel: int | None = None,
    algorithm: Algorithm = Algorithm.RING, recorder: Recorder | None = None,
) -> torch.Tensor:
    """Every rank's ``shard`` concatenated in rank order, as a new 1-D tensor (see
    :func:`ring_all_gather` for ``numel``). ``Algorithm.TORCH`` uses
    ``all_gather_into_tensor`` (through padded shards when they are uneven)."""
    _only_ring_or_torch(Collective.ALL_GATHER, algorithm)
    if algorithm is Algorithm.RING:
        return ring_all_gather(shard, group, numel=numel, recorder=recorder)
    if not isinstance(shard, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor, got {type(shard).__name__}")
    peers = _torch_peers(group, recorder)
    n = peers.size
    flat = shard.detach().reshape(-1)
    total = flat.numel() * n if numel is None else numel
    bounds = shard_bounds(total, n)
    expected = bounds[peers.rank + 1] - bounds[peers.rank]
    if flat.numel() != expected:  # the same refusal as ring_all_gather's
        raise ValueError(
            f"rank {peers.rank}: shard has {flat.numel()} elements but chunk {peers.rank} of "
            f"{total} over {n} ranks has {expected} (shard_bounds)."
        )
    longest = bounds[1] - bounds[0]
    if longest * n == total:  # even shards: gather straight into the result
        out = torch.empty(total, dtype=flat.dtype, device=flat.device)
        builtin_all_gather(out, flat.contiguous(), group)
        return out
    padded = torch.zeros(longest, dtype=flat.dtype, device=flat.device)
    padded[: flat.numel()] = flat
    gathered = torch.empty(longest * n, dtype=flat.dtype, device=flat.device)
    builtin_all_gather(gathered, padded, group)
    return torch.cat([gathered[i * longest: i * longest + bounds[i + 1] - bounds[i]]
                      for i in range(n)])
