"""NCCL's double binary tree all-reduce: two binary trees over the N ranks, each carrying half of
the tensor, cut into segments that are reduced up the tree and broadcast back down, pipelined.

Chapter 2. The ring's 2(N-1) steps each pay a message latency, so its time grows linearly with N
however small the tensor; recursive doubling pays only log2 N latencies but sends the whole
tensor in each. A tree pays ~2·log2 N latencies (up, then down) and, once the tensor is cut into
segments that follow each other through the tree, moves it at the speed of one port.

One tree alone would waste half the machine: its leaves (half the ranks) only ever send up and
receive down, while an interior rank receives from two children and sends to them: its ports
carry twice what a leaf's do. NCCL (Sanders, Speck and Träff, "Two-tree algorithms for full
bandwidth broadcast, reduction and scan", Parallel Computing 35, 2009; NCCL 2.4, 2019) runs two
trees at once, each on half of the tensor, built so that the interior ranks of one are the
leaves of the other: every rank then does an interior rank's work for one half and a leaf's for
the other, and the ports are evenly loaded (:func:`tree_pair`).

Cost per rank, S bytes, segments of s bytes, D = ceil(log2 N) the depth of each tree: an
interior rank with two children receives, per segment of its interior tree, one segment from
each child (reduce) and one from its parent (broadcast), and one from its parent in the other
tree, where it is a leaf: 4 · S/2 = 2S through its incoming port, the same through its outgoing
one, against the ring's 2(N-1)/N·S. In exchange a segment crosses the group in 2D hops, not
2(N-1): about ``2D (alpha + s/bw) + 2S/bw`` on the emulated link (:func:`double_tree_on_link`).

Every element is summed on one rank, the root of its half's tree (each interior rank adds its
children in a fixed order on the way up), and copied down: every rank ends with the same bits.
The layering is :mod:`labs.collectives`'s: :mod:`labs.p2p` (the calls, counted) -> this module;
the op and working in place come from :mod:`labs.torch_collectives`.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch.distributed import ProcessGroup, ReduceOp, Work

from labs.link import Link
from labs.p2p import Peers, Recorder, backend_for_device
from labs.torch_collectives import check_tensor_and_op, finish, in_place, shard_bounds

#: The default segment of the tree's pipeline. On chapter 2's links (20 ms and 12.5 MB/s in the
#: book, 50 ms and 5 MB/s in the tests) 64 KiB spends 5-13 ms in a port: long enough that a
#: rank woken a few milliseconds late on a busy 2-core machine, and the Python work of each
#: message, stay a small part of it, short enough that filling and draining the pipeline
#: (2D segments) costs little against the 2S/bw of a 1-4 MiB tensor (at N = 8, D = 3: 384 KiB
#: against 8 MiB for S = 4 MiB). Latency does not argue for larger segments: the alphas of
#: consecutive segments overlap.
DEFAULT_TREE_SEGMENT_BYTES = 1 << 16


# --- the trees ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Tree:
    """A tree over ranks 0..N-1: ``parent[r]`` (-1 for the root) and ``children[r]``, in the
    order rank r adds them into its own contribution."""

    parent: tuple[int, ...]
    children: tuple[tuple[int, ...], ...]

    @property
    def root(self) -> int:
        return self.parent.index(-1)

    def interior(self) -> frozenset[int]:
        """The ranks with at least one child."""
        return frozenset(r for r, kids in enumerate(self.children) if kids)

    def height(self, rank: int) -> int:
        """Hops from ``rank`` down to its deepest leaf (0 for a leaf)."""
        return max((1 + self.height(c) for c in self.children[rank]), default=0)

    def depth(self) -> int:
        """Hops from the root down to the deepest leaf."""
        return self.height(self.root)


def _binary_tree(world_size: int) -> tuple[list[int], list[list[int]]]:
    """NCCL's ``ncclGetBtree`` (src/graph/trees.cc): the in-order binary tree rooted at 0."""
    parent, children = [-1] * world_size, [[] for _ in range(world_size)]
    for rank in range(1, world_size):
        bit = rank & -rank  # rank's lowest set bit
        up = (rank ^ bit) | (bit << 1)
        parent[rank] = up if up < world_size else rank ^ bit
    for rank in range(1, world_size):
        children[parent[rank]].append(rank)
    for kids in children:
        kids.sort()  # the lower child first, as NCCL's down0 then down1
    return parent, children


def tree_pair(world_size: int) -> tuple[Tree, Tree]:
    """The two trees of NCCL's double binary tree over N = ``world_size`` ranks.

    **Tree 0** is NCCL's in-order binary tree: rank r > 0 with lowest set bit b hangs under
    ``(r XOR b) | 2b`` (under ``r XOR b`` when that is out of range); rank 0 is the root, with
    one child, the largest power of two below N. Odd ranks have b = 1 and no children: they are
    the leaves, and the interior ranks are exactly the even ones (and 0). For N = 8::

        0 -> 4,  4 -> 2 6,  2 -> 1 3,  6 -> 5 7

    **Tree 1** is tree 0 relabelled: mirrored, r -> N-1-r, when N is even, so its interior
    ranks are the odd ones and no rank is interior in both trees; shifted, r -> r+1 mod N, when
    N is odd (the mirror would map even ranks to even ranks), so its interior ranks are the odd
    ones and 0: rank 0 is interior in both (it has one child in each).

    Depth (hops from the root to the deepest leaf): ceil(log2 N) in both trees, so a tree has
    ceil(log2 N) + 1 levels. Each interior rank has one or two children.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}.")
    n = world_size
    parent, children = _binary_tree(n)
    first = Tree(tuple(parent), tuple(tuple(kids) for kids in children))
    relabel = (lambda r: n - 1 - r) if n % 2 == 0 else (lambda r: (r + 1) % n)
    moved_parent, moved_children = [-1] * n, [()] * n
    for r in range(n):
        moved_parent[relabel(r)] = -1 if parent[r] < 0 else relabel(parent[r])
        moved_children[relabel(r)] = tuple(relabel(c) for c in children[r])
    return first, Tree(tuple(moved_parent), tuple(moved_children))


# --- the schedule: what each rank does, in order --------------------------------------------------


class Action(enum.Enum):
    """One step of a rank's program (:func:`rank_program`)."""

    #: Wait for the segment posted from ``peer`` (a child's partial sum, or the parent's
    #: result); every receive is posted before the first wait.
    WAIT = "wait"
    #: Add the segment that arrived from child ``peer`` into this rank's own.
    ADD = "add"
    #: Post the send of this rank's segment to ``peer`` (its parent, or a child).
    SEND = "send"


@dataclass(frozen=True)
class Step:
    """``action`` on segment ``segment`` of tree ``tree``'s half, with ``peer``."""

    action: Action
    tree: int
    segment: int
    peer: int


def rank_program(trees: tuple[Tree, Tree], rank: int, segments: tuple[int, int]
                 ) -> Iterator[Step]:
    """The steps of ``rank``, in the order it takes them; ``segments[t]`` is how many segments
    tree t's half is cut into. Two phases, each one tree after the other, segment by segment:

    1. **Reduce**, the tree where this rank sits lower first (a leaf's segments are ready at
       once, so its sends up leave first and its parent is not kept waiting): wait for each
       child's partial sum and add it, in child order; then send the segment to the parent,
       or, at the root, where it is finished, to each child (the broadcast starts there).
    2. **Broadcast**, the tree where this rank sits higher first (its children wait for what
       it forwards): wait for the result from the parent and send it to each child.

    Ties go to tree 0. Segment k of one tree is never waited for in the same round as segment
    k of the other: a rank interior in one tree and a leaf in the other would then tie the two
    pipelines together, and every segment would pay a message latency (on chapter 2's link
    that is 3-20 times slower than this order). No cycle of waits: in the reduce a rank waits
    for a child (lower in that tree), or first finishes the tree where it sits no higher; in
    the broadcast it waits for its parent (higher), or first finishes the tree where it sits
    no lower; every reduce ends before any broadcast wait. Sends are waited for at the end.
    """
    up = sorted(range(2), key=lambda t: (trees[t].height(rank), t))
    down = sorted(range(2), key=lambda t: (-trees[t].height(rank), t))
    for t in up:
        tree = trees[t]
        targets = tree.children[rank] if tree.parent[rank] < 0 else (tree.parent[rank],)
        for k in range(segments[t]):
            for child in tree.children[rank]:
                yield Step(Action.WAIT, t, k, child)
                yield Step(Action.ADD, t, k, child)
            for peer in targets:
                yield Step(Action.SEND, t, k, peer)
    for t in down:
        tree = trees[t]
        if tree.parent[rank] < 0:  # the root sent its results in the reduce
            continue
        for k in range(segments[t]):
            yield Step(Action.WAIT, t, k, tree.parent[rank])
            for child in tree.children[rank]:
                yield Step(Action.SEND, t, k, child)


def _cuts(total: int, per_segment: int) -> list[tuple[int, int]]:
    """[start, stop) of each segment of ``total`` elements, ``per_segment`` each but the last."""
    return [(a, min(a + per_segment, total)) for a in range(0, total, per_segment)]


def _check_segment(segment_bytes: object) -> None:
    if segment_bytes is not None and (isinstance(segment_bytes, bool)
                                      or not isinstance(segment_bytes, int) or segment_bytes < 1):
        raise ValueError(f"segment_bytes must be an int >= 1 or None (one segment per half), "
                         f"got {segment_bytes!r}.")


# --- the all-reduce ------------------------------------------------------------------------------


def double_tree_all_reduce(
    tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM, group: ProcessGroup | None = None,
    *, recorder: Recorder | None = None,
    segment_bytes: int | None = DEFAULT_TREE_SEGMENT_BYTES,
) -> torch.Tensor:
    """All-reduce in place over the two trees of :func:`tree_pair`: half t of the flat tensor
    (:func:`labs.torch_collectives.shard_bounds` into 2) goes over tree t, cut into segments of
    ``segment_bytes`` (None: one per half), in the order of :func:`rank_program`.

    Traffic of rank r, with K_t segments in half t (H_t bytes): along every edge of tree t one
    message per segment goes up (the partial sum) and one down (the result), so r sends and
    receives ``K_t (c_t + p_t)`` messages and ``H_t (c_t + p_t)`` bytes in tree t, where c_t is
    its number of children and p_t is 1 unless it is the root. Summed over both trees that is
    2S for the busiest rank when N >= 4 (two children in one tree, a leaf in the other), 3/2 S
    at N = 3 and S at N = 2; 2(N-1)(K_0 + K_1) messages in all.

    Memory: one half-sized buffer per child, for what it sends up (at most S, 3/2 S for rank 0
    at odd N). Every receive is posted before the first wait, which gloo's send/recv take in
    any order; NCCL runs its point-to-point calls in order on one stream, where a receive
    posted ahead of the sends it waits behind would hang, so other backends are refused.
    """
    check_tensor_and_op(tensor, op)
    _check_segment(segment_bytes)
    peers = Peers.of(group, recorder, tensor)
    if peers.size > 1 and backend_for_device(peers.backend, tensor.device.type) != "gloo":
        raise ValueError(
            f"rank {peers.rank}: the double binary tree posts all its receives up front, which "
            "only gloo's send/recv allow (NCCL would run them in order and hang): use "
            "backend='gloo' with CPU tensors, or another algorithm.")

    def body(flat: torch.Tensor) -> None:
        n, r = peers.size, peers.rank
        if n == 1 or flat.numel() == 0:
            return
        trees = tree_pair(n)
        bounds = shard_bounds(flat.numel(), 2)
        halves = [flat[bounds[t]:bounds[t + 1]] for t in range(2)]  # 1-D, ceil / floor numel/2
        per_segment = (flat.numel() if segment_bytes is None
                       else max(1, segment_bytes // flat.element_size()))
        cuts = [_cuts(half.numel(), per_segment) for half in halves]
        incoming = {(t, c): torch.empty_like(halves[t])
                    for t in range(2) for c in trees[t].children[r]}  # 1-D, numel of half t
        receives: dict[tuple[int, int, int], Work] = {}
        for t, tree in enumerate(trees):
            parent = tree.parent[r]
            for k, (a, b) in enumerate(cuts[t]):
                for c in tree.children[r]:
                    receives[t, k, c] = peers.irecv(incoming[t, c][a:b], c, tag=t)
                if parent >= 0:  # the result lands where the partial sum left from
                    receives[t, k, parent] = peers.irecv(halves[t][a:b], parent, tag=t)
        sends = []
        for step in rank_program(trees, r, (len(cuts[0]), len(cuts[1]))):
            t, k, peer = step.tree, step.segment, step.peer
            a, b = cuts[t][k]
            if step.action is Action.WAIT:
                receives.pop((t, k, peer)).wait()
            elif step.action is Action.ADD:
                halves[t][a:b].add_(incoming[t, peer][a:b])  # child order: fixed, so are bits
            else:
                sends.append(peers.isend(halves[t][a:b], peer, tag=t))
        for work in sends:
            work.wait()
        finish(flat, op, n)

    return in_place(tensor, body)


# --- on the emulated link ----------------------------------------------------------------------


def double_tree_on_link(
    size_bytes: float, world_size: int, link: Link,
    *, segment_bytes: int | None = DEFAULT_TREE_SEGMENT_BYTES,
) -> float:
    """Seconds of one :func:`double_tree_all_reduce` of S = ``size_bytes`` on N =
    ``world_size`` ranks over ``link`` by :mod:`labs.link`'s port model, every rank starting at
    the same moment, additions free.

    It runs every rank's :func:`rank_program`: a send of m bytes posted at t leaves at
    ``max(t, out port free)`` and holds the out port m/bw; a wait for it ends at
    ``max(left + alpha, in port free) + m/bw`` and holds the in port until then, in the order
    the rank waits, as the emulation times them. So it is exact for the port model where the
    halves and segments are whole elements (numel even, ``segment_bytes`` a multiple of the
    element size and of no more than half the tensor, or a last segment of the remainder).

    The intuition, D = ceil(log2 N), s the segment: the first segment climbs D hops and comes
    back down D, ``2D (alpha + s/bw)`` to fill and drain the pipeline; meanwhile the busiest
    ports carry L bytes each, ``L/bw``: L = 2S from N = 4 on (two children's halves and the
    parent's result in one tree, the parent's result in the other), 3/2 S at N = 3, S at
    N = 2, against the ring's ``2(N-1)/N S``. So ``T ~ 2D (alpha + s/bw) + L/bw``, and never
    less than ``alpha + L/bw``. The form is not exact: latencies overlap other segments' bytes
    (the run can take less, down to 0.6x at N = 2..4), and the two phases, each one tree
    after the other (:func:`rank_program`), leave ports idle while a pipeline fills (up to
    1.5x from N = 6 on, 1.7x at N = 9, over 64 KiB-16 MiB and links of 0.1-50 ms).
    """
    if not isinstance(link, Link):
        raise TypeError(f"link must be a labs.Link, got {type(link).__name__}.")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}.")
    if not isinstance(size_bytes, (int, float)) or not math.isfinite(size_bytes) \
            or size_bytes < 0:
        raise ValueError(f"size_bytes must be a finite number >= 0, got {size_bytes!r}.")
    _check_segment(segment_bytes)
    n = world_size
    if n == 1 or size_bytes == 0:
        return 0.0
    half = size_bytes / 2
    cut = half if segment_bytes is None else min(float(segment_bytes), half)
    full, rest = divmod(half, cut)
    seconds = [cut / link.bandwidth] * int(full) + ([rest / link.bandwidth] if rest > 0 else [])
    trees = tree_pair(n)
    programs = [[s for s in rank_program(trees, r, (len(seconds),) * 2)
                 if s.action is not Action.ADD] for r in range(n)]
    clock, out_free, in_free, done = [0.0] * n, [0.0] * n, [0.0] * n, [0] * n
    left: dict[tuple[int, int, int, int], float] = {}  # (tree, segment, src, dst) -> leaves
    while any(done[r] < len(programs[r]) for r in range(n)):
        moved = False
        for r in range(n):
            while done[r] < len(programs[r]):
                step = programs[r][done[r]]
                wire = seconds[step.segment]
                if step.action is Action.SEND:
                    leaves = max(clock[r], out_free[r])
                    out_free[r] = leaves + wire
                    left[step.tree, step.segment, r, step.peer] = leaves
                else:
                    key = (step.tree, step.segment, step.peer, r)
                    if key not in left:  # not posted yet: another rank must move first
                        break
                    in_free[r] = max(left[key] + link.alpha, in_free[r]) + wire
                    clock[r] = max(clock[r], in_free[r])
                done[r] += 1
                moved = True
        if not moved:
            raise RuntimeError("the double tree's programs wait on each other (a deadlock)")
    return max(max(clock), max(out_free))
