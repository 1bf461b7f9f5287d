"""Point-to-point plumbing of the collectives, and what a run of them records.

:class:`Peers` is what every collective of :mod:`labs.collectives` starts with: the group's
ranks, ``isend``/``irecv`` that count their traffic into a :class:`Recorder`, and
:meth:`Peers.exchange`, one step of a ring (a send to the right while receiving from the
left), batched on NCCL, where two separate calls on one pair of ranks can deadlock.
:class:`CommStats` are the counts; :class:`RingStep` and :class:`Phase` are what a traced
ring records, step by step.
"""

from __future__ import annotations

import enum
import functools
import sys
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup, Work

from labs import collective_check, link, staging
from labs.staging import backend_for_device


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
    #: Of ``bytes_sent``, those sent to a rank on another node (counted when the recorder knows
    #: the nodes: its ``node_size``, or the launch's :class:`labs.link.Topology`).
    bytes_sent_across_nodes: int = 0
    messages_sent_across_nodes: int = 0


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
    so one step is one message; meant for tensors of a few elements).

    ``node_size`` (global rank r on node r // node_size) also splits out the bytes sent across
    nodes; without it the launch's :class:`labs.link.Topology`, if it has one, says where the
    nodes are. Only messages whose destination is known are split: those of :class:`Peers`
    (lock-step rings, ``segment_bytes=None``, and every non-ring collective)."""

    trace: bool = False
    stats: CommStats = field(default_factory=CommStats)
    steps: list[RingStep] = field(default_factory=list)
    node_size: int | None = None

    def __post_init__(self) -> None:
        if self.node_size is not None and (isinstance(self.node_size, bool)
                                           or not isinstance(self.node_size, int)
                                           or self.node_size < 1):
            raise ValueError(f"Recorder node_size must be an int >= 1 or None, got "
                             f"{self.node_size!r}.")

    def nodes_known(self) -> int | None:
        """The node size this recorder splits traffic by, or None."""
        if self.node_size is not None:
            return self.node_size
        wire = link.active()
        return wire.node_size if isinstance(wire, link.Topology) else None


@dataclass
class Peers:
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
           tensor: torch.Tensor | None = None) -> Peers:
        """The peers of ``group``. Pass the ``tensor`` of the collective that starts: one
        with no data (the meta device) is refused here, on every rank, before any rank
        starts a send its peers would wait on; its operation is checked under
        ``check_collectives=True``."""
        if not dist.is_initialized():
            raise RuntimeError(
                "torch.distributed is not initialised: call this inside a function run by "
                "labs.launch (or under torchrun after init_process_group)."
            )
        peers = cls(group, dist.get_rank(group), dist.get_world_size(group), recorder)
        if tensor is not None and tensor.is_meta and peers.size > 1:
            raise ValueError(
                f"rank {peers.rank}: these collectives send a tensor's data, and a tensor on "
                "the meta device has none: materialise it first (e.g. "
                "module.to_empty(device=labs.rank_device())).")
        if tensor is not None:  # a collective starts: checked under check_collectives=True
            collective_check.note(sys._getframe(1).f_code.co_name, tensor, group)  # noqa: SLF001
        return peers

    def stages(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor``'s messages go through host memory (:mod:`labs.staging`): a
        CUDA tensor on a gloo group, whose send/recv cannot carry device memory."""
        return staging.needed(tensor, self.backend)

    def global_rank(self, group_rank: int) -> int:
        group_rank %= self.size
        return group_rank if self.group is None else dist.get_global_rank(self.group, group_rank)

    def count(self, tensor: torch.Tensor, *, sent: bool, peer: int | None = None) -> None:
        """Add one message of ``tensor`` to the recorder's stats, if there is a recorder;
        ``peer`` (the destination's global rank) lets a send be counted as crossing nodes."""
        if self.recorder is None:
            return
        stats, nbytes = self.recorder.stats, tensor.numel() * tensor.element_size()
        if sent:
            stats.messages_sent += 1
            stats.bytes_sent += nbytes
            node_size = self.recorder.nodes_known() if peer is not None else None
            if node_size is not None and peer is not None \
                    and peer // node_size != dist.get_rank() // node_size:
                stats.messages_sent_across_nodes += 1
                stats.bytes_sent_across_nodes += nbytes
        else:
            stats.messages_received += 1
            stats.bytes_received += nbytes

    def isend(self, tensor: torch.Tensor, to: int, tag: int = 0) -> Work:
        """Post a send of ``tensor`` to group rank ``to`` (on the emulated link, if the
        launch has one: :mod:`labs.link`)."""
        dst = self.global_rank(to)
        self.count(tensor, sent=True, peer=dst)
        if self.stages(tensor):
            tensor = staging.to_host(tensor)  # the send's Work holds the copy until it is sent
        if link.active() is not None:
            return link.send(lambda wire: dist.isend(wire, dst, group=self.group, tag=tag),
                             tensor, dst)
        return dist.isend(tensor, dst, group=self.group, tag=tag)

    def irecv(self, tensor: torch.Tensor, source: int, tag: int = 0) -> Work:
        """Post a receive into ``tensor`` from group rank ``source`` (through a host buffer
        when :meth:`stages` says so: the tensor is written when the receive is waited for)."""
        self.count(tensor, sent=False)
        src = self.global_rank(source)
        if self.stages(tensor):
            host = staging.host_buffer(tensor)
            return staging.Landing(self.irecv_unstaged(host, src, tag), host, tensor)
        return self.irecv_unstaged(tensor, src, tag)

    def irecv_unstaged(self, tensor: torch.Tensor, src: int, tag: int) -> Work:
        """Post a receive into ``tensor`` from global rank ``src``, not counted."""
        if link.active() is not None:
            return link.recv(lambda wire: dist.irecv(wire, src, group=self.group, tag=tag),
                             tensor, src)
        return dist.irecv(tensor, src, group=self.group, tag=tag)

    def exchange(self, send: torch.Tensor, to: int, recv: torch.Tensor, source: int) -> None:
        """Send ``send`` to ``to`` while receiving into ``recv`` from ``source``.

        On NCCL the two go as one batch (``batch_isend_irecv``): two separate calls on the
        same pair of ranks can deadlock there. gloo has no such hazard and the batch only
        costs it time (on a 16-core host a lock-step ring all-reduce of 1 MiB took a fifth
        longer batched at 2 ranks, a third longer at 4), so under gloo the receive is posted
        first, then the send."""
        sending, receiving = send.numel() > 0, recv.numel() > 0
        # gloo only (launch refuses a link on nccl); staged tensors go one message at a time
        if link.active() is not None or self.stages(send) or self.stages(recv):
            works = [self.irecv(recv, source)] if receiving else []
            works += [self.isend(send, to)] if sending else []
            for work in works:
                work.wait()
            return
        if sending:
            self.count(send, sent=True, peer=self.global_rank(to))
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
    NCCL, receive-then-send on gloo (see :meth:`Peers.exchange`); the cost model times its
    messages with this."""
    Peers.of(group, None, send).exchange(send, to, recv, source)
