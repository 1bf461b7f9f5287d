"""The flat all-reduce as NCCL runs it: several rings at once, laid out so that every network
card carries traffic (chapter 8's fair baseline).

One ring 0 -> 1 -> ... -> N-1 -> 0 over nodes of g ranks leaves each node through one rank's
network card and enters it through one: the other g-1 cards of a node sit idle, and the one
that works carries the whole 2(N-1)/N·S. NCCL cuts the buffer into *channels* and runs one
ring per channel, each ring built so that it enters and leaves every node through other ranks
than the other channels' rings do; with as many channels as network cards per node, every card
carries one channel's crossing. :func:`channel_rings` is that layout,
:func:`multi_ring_all_reduce` runs it on labs' point-to-point layer (so the emulated link and a
:class:`labs.p2p.Recorder` see every message), and :func:`multi_ring_on_topology` prices it
with :class:`labs.link.Topology`'s port model, message by message, from the same schedule.

The layering is :mod:`labs.collectives`'s: :mod:`labs.p2p` (the calls, counted) -> this module;
the chunking, the op and working in place come from :mod:`labs.torch_collectives`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup, ReduceOp, Work

from labs import link
from labs.link import LinkKind, Topology
from labs.p2p import Peers, Recorder, backend_for_device
from labs.torch_collectives import check_tensor_and_op, finish, in_place, shard_bounds

# --- the layout ---------------------------------------------------------------------------------


def _check_count(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}.")
    return value


def channel_rings(world_size: int, node_size: int, channels: int) -> list[list[int]]:
    """The ring order of each channel: ``rings[j]`` is a permutation of the ranks 0..N-1, and
    channel j's ring sends from ``rings[j][p]`` to ``rings[j][p + 1]`` (and from the last back
    to the first).

    Nodes are g = ``node_size`` consecutive ranks (rank r on node r // g), visited in order
    0, 1, ..., n-1 by every channel. Inside each node channel j visits the local ranks rotated
    by j: ``j, j+1, ..., j+g-1`` (mod g). So channel j enters every node at local rank j mod g
    and leaves it from local rank (j-1) mod g, and between those two it moves over the node's
    own fabric, one hop per rank::

        ring j = [m·g + (j + i) mod g  for m in 0..n-1  for i in 0..g-1]

    With ``channels = g`` every rank's network card sends in exactly one channel (rank with
    local rank l leaves its node in channel l+1 mod g) and receives in exactly one (it enters
    in channel l): the g crossings of a node in one step go over g different cards, as the g
    cross-node rings of the hierarchical all-reduce do. Channel j and channel j+g have the
    same ring (more channels than cards put two channels on each card); fewer channels than
    g leave g - channels cards of each node idle. This is why NCCL builds its rings per channel
    from the machine's topology rather than using one rank order for all: channels that share
    one network card queue behind each other, channels on different cards do not.

    With ``node_size = 1`` (one rank per node) every ring is 0 -> 1 -> ... -> N-1, and with a
    single node (``node_size = N``) every ring is that same cycle entered at rank j: the plain
    ring, repeated.
    """
    world_size = _check_count("world_size", world_size)
    g = _check_count("node_size", node_size)
    channels = _check_count("channels", channels)
    if world_size % g:
        raise ValueError(f"node_size={g} does not divide the world size {world_size}: the "
                         "channels' rings need whole nodes. Pick one of "
                         f"{[d for d in range(1, world_size + 1) if world_size % d == 0]}.")
    return [[node * g + (j + i) % g for node in range(world_size // g) for i in range(g)]
            for j in range(channels)]


def _neighbours(rings: list[list[int]]) -> tuple[list[list[int]], list[list[int]]]:
    """``right[j][r]`` and ``left[j][r]``: whom rank r sends to and receives from in channel
    j."""
    n = len(rings[0])
    right, left = [[0] * n for _ in rings], [[0] * n for _ in rings]
    for j, ring in enumerate(rings):
        for p, r in enumerate(ring):
            right[j][r], left[j][r] = ring[(p + 1) % n], ring[(p - 1) % n]
    return right, left


# --- the all-reduce -------------------------------------------------------------------------


@dataclass
class _Channel:
    """One channel's ring all-reduce on this rank: its part of the tensor (1-D view, numel =
    part j of ``shard_bounds(numel, channels)``) cut into N chunks, and this rank's position
    p in the channel's ring, which plays the part of the rank in
    :func:`labs.collectives.ring_all_reduce`."""

    part: torch.Tensor
    bounds: list[int]  #: shard_bounds(part.numel(), N)
    position: int
    right: int  #: the group rank this rank sends to in this channel
    left: int  #: the group rank it receives from
    scratch: torch.Tensor  #: where a reduce-scatter chunk lands before it is added

    def chunk(self, i: int) -> torch.Tensor:
        i %= len(self.bounds) - 1
        return self.part[self.bounds[i]:self.bounds[i + 1]]

    def step(self, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Step k = 0 .. 2(N-1)-1: what is sent, where the incoming chunk lands, and the chunk
        it is added to (None in the all-gather: it lands in place). Reduce-scatter step k:
        send chunk (p-k-1), receive chunk (p-k-2) and add it; all-gather step k - (N-1):
        send chunk (p-k), receive chunk (p-k-1) into place (p = this rank's position)."""
        n, p = len(self.bounds) - 1, self.position
        if k < n - 1:
            own = self.chunk(p - k - 2)
            return self.chunk(p - k - 1), self.scratch[:own.numel()], own
        k -= n - 1
        return self.chunk(p - k), self.chunk(p - k - 1), None


def _post(peers: Peers, receives: list[tuple[torch.Tensor, int, int]],
          sends: list[tuple[torch.Tensor, int, int]]) -> list[Work]:
    """Post one step's messages of every channel, ``(tensor, group rank, tag)`` each: the
    receives first, then the sends, as :meth:`labs.p2p.Peers.exchange` does on gloo. On NCCL
    they go as one batch, counted as ``exchange`` counts its batch: two channels can send
    each way between one pair of ranks in one step (rank 0 -> 1 in channel 0, 1 -> 0 in
    channel 1 on nodes of 2), and separate calls on one pair can deadlock there."""
    if not receives and not sends:
        return []
    device = (receives or sends)[0][0].device.type
    if link.active() is not None or backend_for_device(peers.backend, device) == "gloo":
        return ([peers.irecv(t, src, tag) for t, src, tag in receives]
                + [peers.isend(t, dst, tag) for t, dst, tag in sends])
    ops = []
    for t, src, tag in receives:
        peers.count(t, sent=False)
        ops.append(dist.P2POp(dist.irecv, t, peers.global_rank(src), peers.group, tag))
    for t, dst, tag in sends:
        peers.count(t, sent=True, peer=peers.global_rank(dst))
        ops.append(dist.P2POp(dist.isend, t, peers.global_rank(dst), peers.group, tag))
    return list(dist.batch_isend_irecv(ops))


def _node_size(node_size: int | None, world_size: int) -> int:
    """``node_size``, or the launch's :class:`labs.link.Topology`'s when None (1 without
    one); checked to divide the world size."""
    if node_size is None:
        wire = link.active()
        node_size = wire.node_size if isinstance(wire, Topology) else 1
    channel_rings(world_size, node_size, 1)  # refuses a node size that does not divide
    return node_size


def multi_ring_all_reduce(
    tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM, group: ProcessGroup | None = None,
    *, channels: int | None = None, node_size: int | None = None,
    recorder: Recorder | None = None,
) -> torch.Tensor:
    """All-reduce ``tensor`` in place with ``channels`` rings at once, one per part of it.

    The flat tensor is cut into ``channels`` parts (:func:`shard_bounds`); part j is
    all-reduced by a lock-step ring (reduce-scatter, then all-gather, as
    :func:`labs.collectives.ring_all_reduce`) whose rank order is ``channel_rings(N, g,
    channels)[j]``. The channels go in lock-step together: at step k every rank posts every
    channel's receive and send of step k (receives first, channels in order; the emulated
    link's ports serve them in that order), then waits for all of them, so all channels move
    through their 2(N-1) steps side by side. Messages are tagged with their channel.

    Cost per rank with c channels: 2(N-1)·c messages of S/(cN) each way (fewer when chunks are
    empty), 2(N-1)/N·S bytes sent and received in all, as for one ring; what changes is which
    port carries them. With c = g (the default, g = ``node_size``) each rank sends one
    channel's share across nodes, about 2(N-1)/N·S/g, where one ring makes a node's last rank
    send the whole 2(N-1)/N·S across. Every chunk of every channel is summed once and copied,
    so all ranks end with bit-identical values.

    ``node_size`` (g; group ranks j·g .. j·g+g-1 form a node) defaults to the launch's
    :class:`labs.link.Topology`'s, or 1 without one; ``channels`` defaults to g. A
    ``channels`` below 1 or a ``node_size`` that does not divide N is refused before any
    message is sent.
    """
    check_tensor_and_op(tensor, op)
    peers = Peers.of(group, recorder, tensor)
    g = _node_size(node_size, peers.size)
    rings = channel_rings(peers.size, g, g if channels is None else channels)

    def body(flat: torch.Tensor) -> None:
        n = peers.size
        if n == 1 or flat.numel() == 0:
            return
        right, left = _neighbours(rings)
        parts = shard_bounds(flat.numel(), len(rings))
        lanes = []
        for j, ring in enumerate(rings):
            part = flat[parts[j]:parts[j + 1]]  # 1-D, numel = part j of `channels`
            bounds = shard_bounds(part.numel(), n)
            lanes.append(_Channel(part, bounds, ring.index(peers.rank), right[j][peers.rank],
                                  left[j][peers.rank], torch.empty_like(part[:bounds[1]])))
        for k in range(2 * (n - 1)):
            planned = [lane.step(k) for lane in lanes]
            receives = [(land, lane.left, j) for j, (lane, (_, land, _)) in
                        enumerate(zip(lanes, planned, strict=True)) if land.numel()]
            sends = [(send, lane.right, j) for j, (lane, (send, _, _)) in
                     enumerate(zip(lanes, planned, strict=True)) if send.numel()]
            works = _post(peers, receives, sends)
            for work in works:  # receives first, in channel order: the ports' order
                work.wait()
            for _, land, addend in planned:
                if addend is not None and addend.numel():
                    addend.add_(land)
        finish(flat, op, n)

    return in_place(tensor, body)


# --- the port model -------------------------------------------------------------------------


def multi_ring_step_times(size_bytes: float, world_size: int, topology: Topology,
                          channels: int) -> list[list[float]]:
    """When each rank finishes each step of :func:`multi_ring_all_reduce` with ``channels``
    channels on ``topology`` (S = ``size_bytes``, every rank starting at 0): ``times[k][r]``,
    k = 0 .. 2(N-1)-1.

    Every message is a chunk of m = S/(cN) (uneven chunks taken as even). The schedule is the
    one the all-reduce posts; the ports are :mod:`labs.link`'s, a pair per link kind per rank,
    each serving one message at a time, in order. At step k rank r, done with step k-1 at
    t(r), posts its sends in channel order: a send over link h leaves at ``max(t(r),
    out_h(r))`` and holds that outgoing port m/bw_h. Its receives, in channel order, each
    start at ``max(leave + alpha_h, in_h(r))`` and hold the incoming port m/bw_h. Rank r is
    done with step k when its last receive has arrived and its last send has left. With one
    channel this is :func:`labs.cost_model.ring_step_times`' recurrence; with several, two
    channels whose messages of one step share a port queue there.
    """
    if not isinstance(topology, Topology):
        raise TypeError(f"topology must be a labs.Topology, got {type(topology).__name__}.")
    if isinstance(size_bytes, bool) or not isinstance(size_bytes, (int, float)) \
            or not math.isfinite(size_bytes) or size_bytes < 0:
        raise ValueError(f"size_bytes must be a finite number >= 0, got {size_bytes!r}.")
    rings = channel_rings(world_size, topology.node_size, channels)
    if world_size == 1 or size_bytes == 0:
        return []
    right, left = _neighbours(rings)
    m = size_bytes / (channels * world_size)
    out_free = [dict.fromkeys(LinkKind, 0.0) for _ in range(world_size)]
    in_free = [dict.fromkeys(LinkKind, 0.0) for _ in range(world_size)]
    done = [0.0] * world_size
    times = []
    for _ in range(2 * (world_size - 1)):
        leaves = [[0.0] * world_size for _ in rings]
        for r in range(world_size):
            for j in range(channels):
                kind, wire = topology.kind(r, right[j][r]), topology.link(r, right[j][r])
                leaves[j][r] = max(done[r], out_free[r][kind])
                out_free[r][kind] = leaves[j][r] + m / wire.bandwidth
        after = []
        for r in range(world_size):
            finished = max(done[r], *out_free[r].values())
            for j in range(channels):
                src = left[j][r]
                kind, wire = topology.kind(src, r), topology.link(src, r)
                start = max(leaves[j][src] + wire.alpha, in_free[r][kind])
                in_free[r][kind] = start + m / wire.bandwidth
                finished = max(finished, in_free[r][kind])
            after.append(finished)
        done = after
        times.append(done)
    return times


def multi_ring_on_topology(size_bytes: float, world_size: int, topology: Topology,
                           channels: int) -> float:
    """Seconds of one :func:`multi_ring_all_reduce` of S = ``size_bytes`` on N =
    ``world_size`` ranks in n nodes of g = ``topology.node_size``, every rank starting at 0:
    the last row of :func:`multi_ring_step_times` (exact for the port model).

    Intuition, with c = g channels. Each step, every rank sends and receives one chunk of
    S/(gN) over its network card and g-1 over the node's fabric, and its incoming chunk left
    a neighbour that finished the previous step when it did, so no rank is ahead and each
    step pays the latency once more::

        T ≈ 2(N-1)·(alpha_inter + S/(gN)/bw_inter)
          = 2(N-1)·alpha_inter + 2(N-1)/N·(S/g)/bw_inter

    This is exact when a step's intra-node traffic, alpha_intra + (g-1)·S/(gN)/bw_intra,
    fits under its inter-node one, alpha_inter + S/(gN)/bw_inter (true for a network 10x
    slower than the fabric at g = 2), and n >= 2. Against it, one ring (c = 1) keeps a node's
    edge card busy every step, 2(N-1)/N·S/bw_inter plus one latency
    (:func:`labs.cost_model.ring_step_times`): the channels divide the bytes per card by g
    and pay 2(N-1) latencies instead of one (when bandwidth dominates). The hierarchical
    all-reduce sends 2(n-1)/n·(S/g) per card against the channels' 2(N-1)/N·(S/g), a ratio
    (gn-1)/(g(n-1)): 1.5 on 2 nodes of 2, 7/6 on 4 nodes of 2, towards 1 as nodes are added.
    What it keeps beyond that is 2(n-1) inter-node latencies instead of 2(N-1), at the price
    of its intra-node phases, which run before and after the cross-node one instead of
    under it. With one node every
    channel is the same cycle and the c channels' messages queue on the same ports: the time
    of one ring.
    """
    times = multi_ring_step_times(size_bytes, world_size, topology, channels)
    return max(times[-1]) if times else 0.0


def multi_ring_bytes_across_nodes(numel: int, element_size: int, world_size: int,
                                  node_size: int, channels: int) -> list[int]:
    """The bytes each rank sends to other nodes in one :func:`multi_ring_all_reduce` of
    ``numel`` elements of ``element_size`` bytes, exactly; index = rank.

    In channel j (part P_j of ``shard_bounds(numel, channels)``, cut into N chunks d_i) the
    rank at position p sends every chunk but d_p in the reduce-scatter and every chunk but
    d_(p+1) in the all-gather, ``2 P_j - d_p - d_(p+1)``, all of it across nodes when its
    right neighbour is on another node (it leaves its node in that channel). With channels =
    g every rank does so in exactly one channel: about 2(N-1)/N·S/g each, spread over all
    the cards, against one ring's 2(N-1)/N·S on a node's last rank."""
    rings = channel_rings(world_size, node_size, channels)
    parts = shard_bounds(numel, channels)
    out = [0] * world_size
    for j, ring in enumerate(rings):
        bounds = shard_bounds(parts[j + 1] - parts[j], world_size)
        d = [bounds[i + 1] - bounds[i] for i in range(world_size)]
        for p, r in enumerate(ring):
            dst = ring[(p + 1) % world_size]
            if world_size > 1 and r // node_size != dst // node_size:
                out[r] += (2 * (parts[j + 1] - parts[j]) - d[p]
                           - d[(p + 1) % world_size]) * element_size
    return out
