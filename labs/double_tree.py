"""The double binary tree all-reduce, as NCCL runs it: two trees, each carrying half of the
tensor, reduced up and broadcast back down in pipelined segments.

Chapter 2. One binary tree reaches every rank in about log2 N hops, but half of its ranks are
leaves: they send and receive once, while the interior ranks carry two children's traffic,
and the leaves' links sit idle. Two trees whose interior ranks are the other's leaves use every
link: every rank sends and receives about 2S in all (S bytes in the tensor), against the
ring's 2(N-1)/N·S, in 2·log2 N hops instead of the ring's 2(N-1) (Sanders, Speck and Träff,
"Two-tree algorithms for full bandwidth broadcast, reduction and scan", Parallel Computing
2009; NCCL 2.4 made it its tree algorithm, ``src/graph/trees.cc``).

* **The trees** (:func:`tree_pair`). Tree 0 is NCCL's in-order binary tree: rank r with lowest
  set bit b hangs under its neighbours at distance b, and rank 0 is its root with a single
  child. Tree 1 is tree 0 mirrored (rank r plays N-1-r) when N is even, shifted by one (rank r
  plays r-1) when N is odd. Even ranks are interior in tree 0, odd ranks in tree 1; for odd N
  rank 0 is interior in both, no other rank is.
* **The halves.** Tree t carries half t of the flat tensor (cut by
  :func:`labs.torch_collectives.shard_bounds`), each cut into the same K segments of at most
  ``segment_bytes`` (:func:`segment_cuts`), so segment k of either is as long within an element.
* **Reduce, then broadcast, per segment.** A rank receives segment k of its half from each
  child in its tree, adds it into its own and sends the partial sum to its parent; the root's
  sum is final and goes back down, each rank receiving it from its parent and sending it to its
  children. Every element is summed on one rank, the root of its tree, and copied to the
  others: every rank ends with the same bits.
* **The schedule** (:func:`rank_schedule`). A rank has one thread, so the steps of its two
  trees and two directions run in one order, each receive waited for in turn. A step is due at
  its hop: a reduce at the rank's height (the hops its deepest leaf's segment needs to reach
  it), a broadcast at D + the rank's depth (up to the root, then down). Steps run in the order
  of ``hop·(alpha + s/bw) + k·s/bw``, when segment k is due if every hop costs a message and
  the segments behind it stream at the wire's speed; on the emulated link (:mod:`labs.link`)
  the link's own alpha and bandwidth price it, elsewhere hops come first, then segments. Every
  message is sent at a smaller key than the step that waits for it, so no cycle of waits can
  form: the schedule cannot deadlock.

Receives are posted ahead of their wait (two segments per incoming stream), sends are waited
for only at the end, and each stream (tree, direction) has its own tag, so gloo matches every
message to its receive however the streams interleave. NCCL matches point-to-point messages
in the order they are posted, not by tag, so this algorithm refuses it. :func:`double_tree_on_link`
prices one call by the port model, message by message, in this same schedule.
"""

from __future__ import annotations

import enum
import functools
import math
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch.distributed import ProcessGroup, ReduceOp, Work

from labs import link
from labs.link import Link, Topology
from labs.p2p import Peers, Recorder, backend_for_device
from labs.torch_collectives import check_tensor_and_op, finish, in_place, shard_bounds

#: The default segment, for chapter 2's link (20 ms, 12.5 MB/s). A 64 KiB segment spends 5.2 ms
#: in a port, a quarter of a latency, so filling and draining the pipeline, 2D(alpha + s/bw), is
#: mostly the latencies themselves: by the port model 1 MiB and 4 MiB take within 2 % of what
#: 16 KiB segments would on 4 ranks (8 % and 2 % on 8; 256 KiB, two segments per half, 15-21 %).
#: Finer cuts do not pay for their messages: posting and waiting for one costs about 0.3 ms of
#: CPU with 4 ranks on 2 cores (measured), which the emulation hides only while it stays well
#: below a segment's time in a port (5.2 ms here, 1.3 ms at 16 KiB). The sweep's sizes from
#: 256 KiB up are cut; on the real transport, larger segments do better still (the ring's are
#: 2 MiB).
DEFAULT_TREE_SEGMENT_BYTES = 64 << 10
#: Receives posted ahead per incoming stream: the next segment's bytes travel on the real
#: transport while this one is waited for and added.
_WINDOW = 2


# --- the trees ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Tree:
    """A tree over ranks 0..N-1, as data: ``parent[r]`` (None at the root) and ``children[r]``
    (in NCCL's order, lower first). Nothing here checks that it spans the ranks: the trees of
    :func:`tree_pair` do, and the tests check them."""

    parent: tuple[int | None, ...]
    children: tuple[tuple[int, ...], ...]

    @property
    def root(self) -> int:
        """The rank without a parent."""
        return self.parent.index(None)

    @functools.cached_property
    def depths(self) -> tuple[int, ...]:
        """Edges from each rank up to the root."""
        out = []
        for rank in range(len(self.parent)):
            edges, above = 0, self.parent[rank]
            while above is not None:
                edges, above = edges + 1, self.parent[above]
            out.append(edges)
        return tuple(out)

    @property
    def depth(self) -> int:
        """Edges from the root to the deepest leaf: D."""
        return max(self.depths)

    @functools.cached_property
    def heights(self) -> tuple[int, ...]:
        """Edges from each rank down to its deepest leaf (0 for a leaf)."""
        out = [0] * len(self.parent)
        for rank in sorted(range(len(self.parent)), key=self.depths.__getitem__, reverse=True):
            parent = self.parent[rank]  # every child is done before its parent: it is deeper
            if parent is not None:
                out[parent] = max(out[parent], out[rank] + 1)
        return tuple(out)

    def interior(self) -> tuple[int, ...]:
        """The ranks with at least one child."""
        return tuple(r for r, kids in enumerate(self.children) if kids)


def _nccl_btree(n: int, rank: int) -> tuple[int | None, tuple[int, ...]]:
    """``ncclGetBtree``: rank's parent and children in the in-order binary tree rooted at 0.

    Rank r != 0 with lowest set bit b hangs under (r ^ b) | 2b, or r ^ b when that is out of
    range; its children are r - b/2 and the largest r + b/2^j (j >= 1) below N, if any. Rank
    0's single child is the largest power of two below N (N/2 for N a power of two)."""
    bit = 1
    while bit < n and not bit & rank:
        bit <<= 1
    if rank == 0:
        return None, ((bit >> 1,) if n > 1 else ())
    up = (rank ^ bit) | (bit << 1)
    if up >= n:
        up = rank ^ bit
    low = bit >> 1
    if low == 0:
        return up, ()
    right = rank + low
    while right >= n and low:
        low >>= 1
        right = rank + low if low else -1
    return up, (rank - (bit >> 1),) + ((right,) if right > rank else ())


def tree_pair(world_size: int) -> tuple[Tree, Tree]:
    """NCCL's two trees over ``world_size`` ranks (``ncclGetDtree``).

    Tree 0 is the in-order binary tree of :func:`_nccl_btree`: rank 0 is its root with one
    child, 2^(m-1) (m = ceil(log2 N)), under which ranks 1..N-1 hang in order, each rank with
    lowest set bit b at height log2 b. Tree 1 is tree 0 with every rank r replaced by N-1-r
    (mirrored) when N is even, by r+1 mod N (shifted) when N is odd.

    * **Depth** D = ceil(log2 N) edges in both (0 for N = 1): the root's one edge over a
      subtree of height m - 1.
    * **Interior ranks.** Tree 0: the even ranks (the root included), every odd rank is a
      leaf. Tree 1: the odd ranks for even N (root N-1); the odd ranks and rank 0 for odd N
      (root 1). So no rank is interior in both trees when N is even, and rank 0 alone when N
      is odd (N >= 3): every rank but that one forwards in one tree and is a leaf of the other.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}.")
    n = world_size
    first = [_nccl_btree(n, r) for r in range(n)]

    def relabel(role: list[int], rename: list[int]) -> Tree:
        """Rank r plays ``role[r]`` in tree 0; tree 0's rank x is this tree's ``rename[x]``."""
        parent, children = [], []
        for r in range(n):
            up, down = first[role[r]]
            parent.append(None if up is None else rename[up])
            children.append(tuple(rename[c] for c in down))
        return Tree(tuple(parent), tuple(children))

    ranks = list(range(n))
    if n % 2:
        second = relabel([(r - 1) % n for r in ranks], [(x + 1) % n for x in ranks])
    else:
        second = relabel([n - 1 - r for r in ranks], [n - 1 - x for x in ranks])
    return relabel(ranks, ranks), second


# --- the schedule: which step each rank runs when ----------------------------------------------


class Direction(enum.Enum):
    """Which way a segment travels in its tree."""

    #: Up: a rank adds each child's partial sum of the segment into its own and sends the sum
    #: to its parent (the root, whose sum is final, sends it to its children).
    REDUCE = "reduce"
    #: Down: a rank receives the finished segment from its parent and sends it to its children.
    BROADCAST = "broadcast"


@dataclass(frozen=True)
class Step:
    """One step of one rank: segment ``segment`` of tree ``tree``'s half, one way."""

    tree: int
    segment: int
    direction: Direction
    #: The hop at which its data is due: a reduce at the rank's height, a broadcast at D + the
    #: rank's depth (every message goes from a step at a smaller hop to one at a larger).
    hop: int


class Message(NamedTuple):
    """One point-to-point message: segment ``segment`` of tree ``tree``'s half."""

    tree: int
    segment: int
    direction: Direction
    src: int
    dst: int

    @property
    def tag(self) -> int:
        """Its stream's tag (:func:`stream_tag`)."""
        return stream_tag(self.tree, self.direction)


def stream_tag(tree: int, direction: Direction) -> int:
    """The tag of a stream: one per tree and direction, so that two streams between the same
    two ranks (up one tree, down the other) never take each other's receives."""
    return 2 * tree + (direction is Direction.BROADCAST)


def latency_in_segments(wire: Link | Topology | None, segment_bytes: float) -> float:
    """alpha / (s/bw): how many segment times one message latency lasts on ``wire`` (a
    :class:`labs.Link`), which orders a rank's steps (:func:`rank_schedule`); infinite, hops
    first, on any other wire (the real transport, a :class:`labs.Topology`)."""
    if not isinstance(wire, Link) or segment_bytes <= 0:
        return math.inf
    return wire.alpha * wire.bandwidth / segment_bytes


def rank_schedule(trees: tuple[Tree, Tree], rank: int, segments: int,
                  latency: float = math.inf) -> list[Step]:
    """Rank ``rank``'s steps in the order it runs them: for each tree it is part of and each
    segment k, a reduce step, and a broadcast step unless it is the root.

    The order: ``(due, hop, k, tree)`` with due = ``hop·(latency + 1) + k`` in segment times
    (``latency`` = alpha/(s/bw), :func:`latency_in_segments`), or the hop alone when
    ``latency`` is infinite. A message leaves from a step at a smaller key than the step that
    receives it (one hop less, the same k), so every wait is for something that an earlier
    key, on some rank, sends: no cycle, no deadlock."""
    steps = []
    for t, tree in enumerate(trees):
        if tree.parent[rank] is None and not tree.children[rank]:
            continue  # a tree of one rank: nothing to do
        height, depth = tree.heights[rank], tree.depths[rank]
        for k in range(segments):
            steps.append(Step(t, k, Direction.REDUCE, height))
            if tree.parent[rank] is not None:
                steps.append(Step(t, k, Direction.BROADCAST, tree.depth + depth))

    def key(step: Step) -> tuple[float, int, int, int]:
        due = step.hop if math.isinf(latency) else step.hop * (latency + 1) + step.segment
        return due, step.hop, step.segment, step.tree

    return sorted(steps, key=key)


def step_messages(trees: tuple[Tree, Tree], rank: int, step: Step) -> list[Message]:
    """The messages of one step, in the order the rank posts or waits for them: a reduce
    receives from each child, the shallowest subtree first (its sum is ready first), then sends
    to the parent (at the root: to each child); a broadcast receives from the parent, then sends
    to each child, the deepest subtree first (it has farthest to go)."""
    tree, t, k = trees[step.tree], step.tree, step.segment
    height = tree.heights
    up_first = sorted(tree.children[rank], key=lambda c: (height[c], c))
    down_first = sorted(tree.children[rank], key=lambda c: (-height[c], c))
    down = [Message(t, k, Direction.BROADCAST, rank, c) for c in down_first]
    parent = tree.parent[rank]
    if step.direction is Direction.BROADCAST:
        assert parent is not None
        return [Message(t, k, Direction.BROADCAST, parent, rank), *down]
    ins = [Message(t, k, Direction.REDUCE, c, rank) for c in up_first]
    return ins + ([Message(t, k, Direction.REDUCE, rank, parent)] if parent is not None else down)


# --- the all-reduce ----------------------------------------------------------------------------


def double_tree_all_reduce(
    tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM, group: ProcessGroup | None = None,
    *, recorder: Recorder | None = None,
    segment_bytes: int | None = DEFAULT_TREE_SEGMENT_BYTES,
) -> torch.Tensor:
    """All-reduce in place over NCCL's two binary trees (:func:`tree_pair`), each carrying half
    of the tensor, in segments of at most ``segment_bytes`` (None: one per half) that are
    reduced up and broadcast down in a pipeline (see the module docstring).

    Cost, with K segments per half of S/2 bytes: in each tree a rank sends one message per
    segment to each tree neighbour (its partial sum to its parent, the finished segment to each
    child) and receives one from each. An interior rank with two children and a parent so
    sends and receives 3·S/2 in its tree, and S/2 in the other, where it is a leaf: 2S each
    way, the busiest rank's from N = 4 on (S at N = 2, 3S/2 at N = 3); 4(N-1)·K messages in
    all. Critical path: 2·ceil(log2 N) hops (:func:`double_tree_on_link` prices it). gloo only:
    it tells its streams apart by tag (the module docstring says why NCCL cannot)."""
    check_tensor_and_op(tensor, op)
    if segment_bytes is not None and (isinstance(segment_bytes, bool)
                                      or not isinstance(segment_bytes, int) or segment_bytes < 1):
        raise ValueError(f"segment_bytes must be an int >= 1 or None (one segment per half), "
                         f"got {segment_bytes!r}.")
    peers = Peers.of(group, recorder, tensor)
    if peers.size > 1 and backend_for_device(peers.backend, tensor.device.type) != "gloo":
        raise ValueError(
            f"rank {peers.rank}: the double tree posts several streams between the same two "
            "ranks and tells them apart by tag, which only gloo honours (NCCL matches messages "
            "in posting order); run it on gloo, or use Algorithm.RING on NCCL.")

    def body(flat: torch.Tensor) -> None:
        if peers.size == 1 or flat.numel() == 0:
            return
        _all_reduce_over(peers, flat, tree_pair(peers.size), segment_bytes)
        finish(flat, op, peers.size)

    return in_place(tensor, body)


def segment_cuts(numel: int, element_size: int, segment_bytes: int | None
                 ) -> tuple[list[int], list[int]]:
    """The offsets into the flat tensor that cut each half into the same K segments: segment
    k of half t is ``flat[cuts[t][k]:cuts[t][k+1]]``. Half 0 is the longer one (ceil(numel/2)
    elements); K = ceil(its elements / the elements of ``segment_bytes``, at least one)."""
    middle = shard_bounds(numel, 2)[1]
    per = max(1, middle if segment_bytes is None else segment_bytes // element_size)
    count = max(1, -(-middle // per))
    return shard_bounds(middle, count), [middle + b for b in shard_bounds(numel - middle, count)]


class _Inbox:
    """The receives of one incoming stream (one tree, direction and sender), posted
    ``_WINDOW`` segments ahead of the one waited for. A reduce stream lands in ``_WINDOW``
    scratch slots, used in turn: the slot of segment k is posted again for k + ``_WINDOW``
    only once k has been added. A broadcast stream lands in the tensor itself."""

    def __init__(self, peers: Peers, source: int, tag: int, targets: list[torch.Tensor]) -> None:
        self._peers, self._source, self._tag, self._targets = peers, source, tag, targets
        self._posted: dict[int, Work] = {}
        self._next = 0
        self._post_through(_WINDOW - 1)

    def _post_through(self, last: int) -> None:
        while self._next <= min(last, len(self._targets) - 1):
            target = self._targets[self._next]
            if target.numel():  # an empty segment is never sent
                self._posted[self._next] = self._peers.irecv(target, self._source, self._tag)
            self._next += 1

    def take(self, segment: int) -> torch.Tensor:
        """Segment ``segment``, arrived."""
        self._post_through(segment + _WINDOW - 1)
        self._posted.pop(segment).wait()
        return self._targets[segment]


def _all_reduce_over(peers: Peers, flat: torch.Tensor, trees: tuple[Tree, Tree],
                     segment_bytes: int | None) -> None:
    """Sum ``flat`` over the group, half t over ``trees[t]``, in this rank's schedule."""
    rank = peers.rank
    cuts = segment_cuts(flat.numel(), flat.element_size(), segment_bytes)
    count = len(cuts[0]) - 1
    pieces = [[flat[c[k]:c[k + 1]] for k in range(count)] for c in cuts]  # views, 1-D
    inboxes: dict[tuple[int, Direction, int], _Inbox] = {}
    for t, tree in enumerate(trees):
        longest = max(p.numel() for p in pieces[t])
        for child in tree.children[rank]:
            slots = [torch.empty(longest, dtype=flat.dtype, device=flat.device)
                     for _ in range(_WINDOW)]  # 1-D, one segment each
            inboxes[t, Direction.REDUCE, child] = _Inbox(
                peers, child, stream_tag(t, Direction.REDUCE),
                [slots[k % _WINDOW][:p.numel()] for k, p in enumerate(pieces[t])])
        parent = tree.parent[rank]
        if parent is not None:
            inboxes[t, Direction.BROADCAST, parent] = _Inbox(
                peers, parent, stream_tag(t, Direction.BROADCAST), pieces[t])
    latency = latency_in_segments(link.active(), flat.numel() * flat.element_size() / 2 / count)
    sent: list[Work] = []
    for step in rank_schedule(trees, rank, count, latency):
        mine = pieces[step.tree][step.segment]
        if mine.numel() == 0:
            continue
        for message in step_messages(trees, rank, step):
            if message.src == rank:
                sent.append(peers.isend(mine, message.dst, message.tag))
                continue
            arrived = inboxes[message.tree, message.direction, message.src].take(step.segment)
            if message.direction is Direction.REDUCE:
                mine.add_(arrived)  # a broadcast landed in ``mine`` already
    for work in sent:  # sends never block the schedule: each waits only here, at the end
        work.wait()


# --- on the emulated link ----------------------------------------------------------------------


def double_tree_on_link(size_bytes: float, world_size: int, link: Link, *,
                        segment_bytes: int | None = DEFAULT_TREE_SEGMENT_BYTES) -> float:
    """Seconds of one :func:`double_tree_all_reduce` of S = ``size_bytes`` on N =
    ``world_size`` ranks over ``link``, every rank starting at the same moment, by the port
    model of :mod:`labs.link`: one outgoing and one incoming port per rank, each carrying one
    message at a time in the order posted (outgoing) or waited for (incoming); a message of m
    bytes occupies its sender's port m/bw, reaches the receiver alpha after it started leaving
    and occupies its port m/bw. The schedule is the implementation's own, message by message
    (:func:`rank_schedule`, :func:`step_messages`), with K = ceil(S/2 / segment) segments of
    s = S/(2K) per half. Additions are free, as in :func:`labs.cost_model.predict_on_link`.

    The intuition, with D = ceil(log2 N): the first segment climbs D hops and comes back down
    D, each at least alpha + s/bw, so filling and draining the pipeline costs 2D(alpha + s/bw);
    meanwhile the busiest rank's ports carry L·S each, L = 2 from N = 4 on (an interior rank of
    one tree with two children takes in their halves and its parent's, and as a leaf of the
    other tree that tree's half: S + S/2 + S/2; its outgoing port the same), 3/2 for N = 3 and
    1 for N = 2, against the ring's 2(N-1)/N but in 2D latencies instead of 2(N-1). So the time
    is at least ``max(2D(alpha + s/bw), alpha + L·S/bw)`` and about their sum (the port model
    puts it within 1.2 times the sum over the links and sizes the tests draw). It is exactly
    2D(alpha + S/(2bw)) with one segment per half on N = 2 and N = 3, where no port ever has two
    messages to carry at once; from N = 4 on, one segment's two children's halves queue at an
    interior rank's incoming port.

    Exact for the implementation when numel is even and ``segment_bytes`` a multiple of the
    element size (otherwise its halves and segments differ from S/2 and s by an element)."""
    if not isinstance(link, Link):
        raise TypeError(f"link must be a labs.Link, got {type(link).__name__}.")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}.")
    if not isinstance(size_bytes, (int, float)) or not math.isfinite(size_bytes) \
            or size_bytes < 0:
        raise ValueError(f"size_bytes must be a finite number >= 0, got {size_bytes!r}.")
    if segment_bytes is not None and (isinstance(segment_bytes, bool)
                                      or not isinstance(segment_bytes, int) or segment_bytes < 1):
        raise ValueError(f"segment_bytes must be an int >= 1 or None, got {segment_bytes!r}.")
    if world_size == 1 or size_bytes == 0:
        return 0.0
    count = 1 if segment_bytes is None else max(1, math.ceil(size_bytes / 2 / segment_bytes))
    piece = size_bytes / 2 / count
    trees = tree_pair(world_size)
    latency = latency_in_segments(link, piece)
    programs = [[m for step in rank_schedule(trees, r, count, latency)
                 for m in step_messages(trees, r, step)] for r in range(world_size)]
    return _port_model(programs, piece / link.bandwidth, link.alpha)


def _port_model(programs: list[list[Message]], wire: float, alpha: float) -> float:
    """Run each rank's messages (``programs[r]``, in order: a send when r is the source, a
    wait otherwise) through the ports, every message ``wire`` seconds in a port; when the last
    rank is done (its last receive in, its last send out)."""
    n = len(programs)
    out_free, in_free, clock = [0.0] * n, [0.0] * n, [0.0] * n
    left: dict[Message, float] = {}  # when each message started leaving
    waiting: dict[Message, int] = {}  # the rank blocked on a message not sent yet
    done, ready = [0] * n, list(range(n))
    while ready:
        r = ready.pop()
        program = programs[r]
        while done[r] < len(program):
            message = program[done[r]]
            if message.src == r:  # posted now, leaves when the port is free
                left[message] = max(clock[r], out_free[r])
                out_free[r] = left[message] + wire
                if message in waiting:
                    ready.append(waiting.pop(message))
            elif message in left:  # its first byte comes alpha after it left
                in_free[r] = max(left[message] + alpha, in_free[r]) + wire
                clock[r] = max(clock[r], in_free[r])
            else:
                waiting[message] = r
                break
            done[r] += 1
    if any(done[r] < len(programs[r]) for r in range(n)):
        raise RuntimeError("the schedule deadlocks: some rank waits for a message no rank sends")
    return max(max(c, o) for c, o in zip(clock, out_free, strict=True))
