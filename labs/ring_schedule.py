"""How a ring pass runs: its steps, and the schedule that sends them.

:mod:`labs.collectives` lays a ring out as a list of :class:`StepPlan` (which chunk each step
sends, where the incoming one lands, what is added to it). This module runs such a list:

* :func:`run_lockstep`: one message each way per step, each step finished before the next,
  the ring as the textbook draws it (NCCL tensors, and traces);
* :func:`compile_pipelined` and :func:`execute`: the steps cut into segments and overlapped,
  compiled once into a list of instructions (post a receive, post a send, wait, add) and run
  by a short loop;
* :func:`run_ring` picks one, and keeps a compiled pass in the caller's :class:`RingBuffers`
  so that repeated calls on the same tensor plan once and run many times.
"""

from __future__ import annotations

import enum
import itertools
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup, Work

from labs import link, staging
from labs.p2p import Peers, Phase, RingStep

#: The default segment of the pipelined ring on CPU; chosen with ``python -m labs.bench
#: collectives`` (smaller segments pay gloo's per-message handshake too often, larger ones
#: leave too little overlap between receiving one segment and reducing the previous one).
DEFAULT_SEGMENT_BYTES = 2 << 20
#: How many incoming segments may be in flight at once in the pipelined ring.
DEFAULT_WINDOW = 2


@dataclass
class RingBuffers:
    """What the pipelined ring keeps from one ``ring_all_reduce`` to the next, when the caller
    keeps this object and passes it to each call.

    **Scratch.** Without it every call allocates ``window`` segment-sized receive buffers
    (4 MiB with the defaults) and frees them on return. Fresh pages cost: the kernel
    zero-fills each one on first touch, and the C allocator tends to hand such large blocks
    back to the kernel when they are freed, so the next call pays again.

    **The schedule.** Every call also works out which segment goes where, in what order, and
    when to wait for what (:func:`compile_pipelined`), and that is Python work, a visible
    share of a 1 MiB call between 2 ranks on a small machine (chapter 2 measures it with
    :func:`labs.experiments.collectives.measure_planning`). The last schedule is kept here and
    run again as long as the calls are the same: the same tensor memory, size and dtype, group,
    segment and window. Plan once, run many times.

    A caller that all-reduces many times, as a training loop does and as the benchmark does,
    passes one ``RingBuffers``. The kept schedule holds views of the last tensor served, so
    that tensor's memory lives until the buffers serve another tensor or are dropped. Its
    process group it holds only weakly: a destroyed group is freed all the same, and the kept
    schedule then serves no call. Results never live in these buffers.
    """

    tensors: list[torch.Tensor] = field(default_factory=list)
    #: The compiled pass of the last call (see :func:`run_ring`), or None; set it to None and
    #: the next call works its schedule out again.
    program: Program | None = field(default=None, repr=False)
    #: Where a non-contiguous tensor is copied to be reduced (1-D, contiguous), kept so that
    #: the next call on a tensor of that size and dtype lands in the same memory and the kept
    #: schedule serves it; None until the first such call.
    staging: torch.Tensor | None = field(default=None, repr=False)

    def stage(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor``'s values, in its element order, in the kept staging memory (1-D,
        contiguous, ``numel`` = ``tensor.numel()``), allocated again only when the size,
        dtype or device changes."""
        kept = self.staging
        if (kept is None or kept.numel() != tensor.numel() or kept.dtype != tensor.dtype
                or kept.device != tensor.device):
            kept = self.staging = torch.empty(tensor.numel(), dtype=tensor.dtype,
                                              device=tensor.device)
        kept.view(tensor.shape).copy_(tensor)
        return kept

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


def _segments(numel: int, segment: int | None) -> list[tuple[int, int]]:
    """[start, stop) ranges that cut ``numel`` elements into pieces of at most ``segment``."""
    if numel == 0:
        return []
    if segment is None:
        return [(0, numel)]
    return [(start, min(start + segment, numel)) for start in range(0, numel, segment)]


@dataclass
class StepPlan:
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


def _combine(step: StepPlan, landed: torch.Tensor, start: int, stop: int) -> None:
    if step.addend is not None:
        torch.add(step.addend[start:stop], landed, out=step.result[start:stop])


def _traced_values(tensor: torch.Tensor) -> tuple[float, ...]:
    return tuple(float(v) for v in tensor.detach().float().cpu())


def run_lockstep(peers: Peers, steps: list[StepPlan]) -> None:
    """One message each way per step, each step finished before the next: the ring as the
    textbook draws it (and what NCCL tensors use here)."""
    # Scratch only where a step lands there (the in-place reduce-scatter of an all-reduce).
    longest = max((s.result.numel() for s in steps if s.land is None), default=0)
    scratch = torch.empty(longest, dtype=steps[0].send.dtype, device=steps[0].send.device)
    recorder = peers.recorder
    for step in steps:
        landed = scratch[: step.result.numel()] if step.land is None else step.land
        sent = _traced_values(step.send) if recorder is not None and recorder.trace else ()
        peers.exchange(step.send, peers.rank + 1, landed, peers.rank - 1)
        received = _traced_values(landed) if recorder is not None and recorder.trace else ()
        _combine(step, landed, 0, step.result.numel())
        if recorder is not None and recorder.trace:
            recorder.steps.append(RingStep(
                peers.rank, step.phase, step.step, step.sent_chunk, step.received_chunk,
                sent, received, _traced_values(step.result),
            ))


class OpKind(enum.Enum):
    """What one instruction of a compiled ring pass does (see :class:`Program`)."""

    RECV = "recv"  #: post a receive into ``tensor`` from the left neighbour: message ``handle``
    SEND = "send"  #: post a send of ``tensor`` to the right neighbour: message ``handle``
    WAIT = "wait"  #: wait until message ``handle`` has arrived (a receive) or left (a send)
    ADD = "add"  #: ``out = addend + tensor``, the received segment in ``tensor`` (``out`` may be
    #: ``addend`` itself: then it is added to in place)


class Op(NamedTuple):
    """One instruction of a compiled ring pass; ``kind`` says which fields it uses."""

    kind: OpKind
    handle: int = -1
    tensor: torch.Tensor | None = None
    tag: int = 0
    addend: torch.Tensor | None = None
    out: torch.Tensor | None = None


@dataclass(eq=False)
class Program:
    """A pipelined ring pass compiled for one tensor: every post, wait and addition in the
    order :func:`execute` issues them, the views of the tensor and of the scratch buffers
    already cut, and the call it was compiled for (:meth:`serves`)."""

    instructions: list[Op]
    #: The process group the messages go through, held weakly: a kept pass must not keep a
    #: destroyed group (its sockets, its store) alive, and once the group is gone the pass
    #: serves no call.
    group_ref: weakref.ref[ProcessGroup]
    right: int  #: the group rank that SEND sends to
    left: int  #: the group rank that RECV receives from
    size: int  #: the group's size
    address: int  #: ``data_ptr()`` of the tensor it was compiled for
    numel: int
    dtype: torch.dtype
    segment_bytes: int
    window: int

    def serves(self, data: torch.Tensor, group: ProcessGroup | None, segment_bytes: int | None,
               window: int) -> bool:
        """Whether this pass was compiled for this very call: ``data``'s memory (address,
        length, dtype; contiguous, on the CPU), the same process group object, segment and
        window.

        That is all a repeated call has to check. Everything else the first call checked
        depends on nothing more: the rank and the size are fixed for the lifetime of a group
        object (one destroyed and created again is another object), and so is whether its
        backend can carry a CPU tensor. It is checked in as few Python calls as possible,
        because they are slow on the ring's path (see :func:`execute`)."""
        kept_group = self.group_ref()
        return (segment_bytes == self.segment_bytes and window == self.window
                and data.data_ptr() == self.address and data.numel() == self.numel
                and data.dtype == self.dtype and data.is_cpu and data.is_contiguous()
                and kept_group is not None
                and (dist.group.WORLD if group is None else group) is kept_group)

    @property
    def group(self) -> ProcessGroup:
        """The process group the pass was compiled for; an error once it has been freed."""
        group = self.group_ref()
        if group is None:
            raise RuntimeError("the process group this ring pass was compiled for no longer "
                               "exists: compile the pass again (drop RingBuffers.program)")
        return group


def compile_pipelined(
    peers: Peers, data: torch.Tensor, steps: list[StepPlan], segment_bytes: int, window: int,
    buffers: RingBuffers | None,
) -> Program:
    """The same steps cut into segments and overlapped: as soon as a segment of step k has
    arrived and been combined it is sent on as that segment of step k+1, while later segments
    are still in flight. Up to ``window`` incoming segments that land in scratch buffers are
    posted ahead; segments that land in their final place (all-gather) are all posted at the
    start, so the sender never waits for a receive to be posted. Messages are tagged with the
    step so that early and late receives cannot be matched to the wrong message.

    Nothing is sent here: the schedule is written down as a list of instructions, which
    :func:`execute` runs. Working it out costs Python time on every call, so a caller that
    passes :class:`RingBuffers` keeps the compiled pass and repeats it."""
    called_with = (segment_bytes, window)  # what serves() compares a later call with
    segment, window = max(1, segment_bytes // data.element_size()), max(1, window)
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
    instructions: list[Op] = []
    sends: dict[tuple[int, int], int] = {}  # (step, segment start) -> handle, not waited for
    recvs: dict[int, tuple[int, torch.Tensor]] = {}  # event -> handle, where it lands
    handles = itertools.count()

    def post(kind: OpKind, tensor: torch.Tensor, tag: int) -> int:
        handle = next(handles)
        # What dist.isend would do on every call: a complex tensor travels as real pairs.
        wire = torch.view_as_real(tensor) if tensor.is_complex() else tensor
        instructions.append(Op(kind, handle, wire, tag))
        return handle

    def post_send(i: int, start: int, stop: int) -> None:
        sends[(i, start)] = post(OpKind.SEND, steps[i].send[start:stop], i)

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
                    instructions.append(Op(OpKind.WAIT, sends.pop(earlier)))
            target = step.land[start:stop]
        recvs[e] = (post(OpKind.RECV, target, i), target)

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
        instructions.append(Op(OpKind.WAIT, handle))
        step = steps[i]
        if step.addend is not None:
            addend = step.addend[start:stop]
            # In place (the all-reduce accumulates in the tensor): one view, added to in place.
            out = addend if step.addend is step.result else step.result[start:stop]
            instructions.append(Op(OpKind.ADD, tensor=landed, addend=addend, out=out))
        if uses_scratch[e] and next_scratch < len(scratch_events):
            post_recv(scratch_events[next_scratch])  # reuses the scratch buffer just freed
            next_scratch += 1
        if i + 1 < len(steps):
            post_send(i + 1, start, stop)
    instructions.extend(Op(OpKind.WAIT, handle) for handle in sends.values())
    group = dist.group.WORLD if peers.group is None else peers.group
    assert group is not None
    return Program(instructions, weakref.ref(group), (peers.rank + 1) % peers.size,
                   (peers.rank - 1) % peers.size, peers.size, data.data_ptr(), data.numel(),
                   data.dtype, *called_with)


def execute(program: Program, peers: Peers | None = None) -> None:
    """Run a compiled ring pass: post, wait and add in the order it lists them, counting the
    messages into ``peers``' recorder if it has one.

    This loop is the ring's hot path. It posts through the process group's own ``send`` and
    ``recv``, the calls ``dist.isend``/``dist.irecv`` end in, without their checks on every
    message: the tensors, ranks and group were checked once, when the pass was compiled.
    Python is slow here: on a 2-core machine, with caches just flushed by the data the ranks
    move, each microsecond a profiler measures costs several, and a 1 MiB all-reduce has
    only a few hundred to spare."""
    works: list[Work] = [None] * len(program.instructions)  # type: ignore[list-item]
    group = program.group
    send, recv, right, left = group.send, group.recv, program.right, program.left
    wait, add, post_send = OpKind.WAIT, OpKind.ADD, OpKind.SEND
    counted = peers if peers is not None and peers.recorder is not None else None
    # The neighbours' global ranks: a Topology prices (and a Recorder counts) a message by
    # whether it leaves the node, which only the global ranks say.
    right_global = dist.get_global_rank(group, right) if group is not dist.group.WORLD else right
    left_global = dist.get_global_rank(group, left) if group is not dist.group.WORLD else left
    if link.active() is not None:  # every message through the emulated wire's ports
        send = _on_link(link.send, send, right_global)
        recv = _on_link(link.recv, recv, left_global)
    for kind, handle, tensor, tag, addend, out in program.instructions:
        if kind is wait:
            works[handle].wait()
        elif kind is add:
            if out is addend:
                out.add_(tensor)  # cheaper to call than torch.add(..., out=...)
            else:
                torch.add(addend, tensor, out=out)
        else:
            if counted is not None:
                sent = kind is post_send
                counted.count(tensor, sent=sent, peer=right_global if sent else None)
            if kind is post_send:
                works[handle] = send([tensor], right, tag)
            else:
                works[handle] = recv([tensor], left, tag)


def _on_link(through: Callable[..., Any], post: Callable[..., Work], peer_global: int
             ) -> Callable[..., Any]:
    """``post`` (a process group's ``send`` or ``recv``) with its message put on the link;
    ``peer_global`` is the other end's global rank (a Topology prices by it)."""
    return lambda tensors, peer, tag: through(lambda wire: post([wire], peer, tag), tensors[0],
                                              peer_global)


def run_ring(
    peers: Peers, data: torch.Tensor, steps: Callable[[], list[StepPlan]],
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
    # A tensor staged through host memory goes message by message (labs.staging), lock-step.
    if segment_bytes is None or trace or data.device.type != "cpu" or staging.forced():
        laid_out = steps()
        if laid_out:
            run_lockstep(peers, laid_out)
        return
    program = buffers.program if buffers is not None else None
    if program is None or not program.serves(data, peers.group, segment_bytes, window):
        laid_out = steps()
        if not laid_out:
            return
        program = compile_pipelined(peers, data, laid_out, segment_bytes, window, buffers)
        if buffers is not None:
            buffers.program = program
    execute(program, peers)
