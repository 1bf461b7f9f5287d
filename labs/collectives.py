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
halving-doubling (N a power of 2)      2(N-1)/N·S                       2·log2 N
double binary tree (N >= 4)            2S                               2·ceil(log2 N) + segments
=====================================  ==============================  ===================

The ring is bandwidth-optimal (Patarasuk and Yuan, "Bandwidth optimal all-reduce algorithms
for clusters of workstations", JPDC 2009): each rank must receive at least (N-1)/N·S to learn
the other ranks' contributions to its share and send as much, once per phase.

This module lays each algorithm out; :mod:`labs.p2p` holds the point-to-point calls that
count their traffic, :mod:`labs.ring_schedule` runs a ring's steps (lock-step, or cut into
segments and pipelined from a schedule compiled once per tensor), and
:mod:`labs.torch_collectives` holds the conventions above and torch's own collectives
(``Algorithm.TORCH``).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup, ReduceOp

from labs.collective_check import note
from labs.double_tree import double_tree_all_reduce as double_tree_all_reduce
from labs.grid import ProcessGrid, node_layout  # the hierarchical all-reduce's node grid
from labs.halving_doubling import halving_doubling_all_reduce as halving_doubling_all_reduce

# The point-to-point plumbing and the ring's schedule live in their own modules; the names a
# caller of the collectives needs are re-exported here.
from labs.p2p import CommStats as CommStats
from labs.p2p import Peers
from labs.p2p import Phase as Phase
from labs.p2p import Recorder as Recorder
from labs.p2p import RingStep as RingStep
from labs.p2p import backend_for_device as backend_for_device
from labs.p2p import exchange as exchange
from labs.ring_schedule import DEFAULT_SEGMENT_BYTES as DEFAULT_SEGMENT_BYTES
from labs.ring_schedule import DEFAULT_WINDOW as DEFAULT_WINDOW
from labs.ring_schedule import RingBuffers as RingBuffers
from labs.ring_schedule import StepPlan, execute, run_ring

# torch.distributed's conventions (chunks as tensor_split cuts them, SUM or AVG, in place on a
# flat view) and torch's own collectives live in labs.torch_collectives. The algorithms here
# call the conventions by short private names: _check, _in_place, _finish.
from labs.torch_collectives import builtin_all_gather as builtin_all_gather
from labs.torch_collectives import builtin_reduce_scatter as builtin_reduce_scatter
from labs.torch_collectives import check_tensor_and_op as _check
from labs.torch_collectives import finish as _finish
from labs.torch_collectives import in_place as _in_place
from labs.torch_collectives import shard_bounds as shard_bounds
from labs.torch_collectives import torch_all_gather, torch_all_reduce, torch_reduce_scatter

# --- naive: reduce to a root, broadcast back --------------------------------------------------


def naive_all_reduce(
    tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM, group: ProcessGroup | None = None,
    *, root: int = 0, recorder: Recorder | None = None,
) -> torch.Tensor:
    """All-reduce in place by sending every tensor to ``root``, which sums them in rank order
    and sends the result back to each rank.

    Cost: the root receives (N-1)·S, one message after another, and sends (N-1)·S, its N-1
    sends posted at once but all through its one link, so its time grows linearly with N
    while the other links sit idle; every other rank sends S and receives S. 2(N-1) messages
    in all.
    """
    _check(tensor, op)
    peers = Peers.of(group, recorder, tensor)

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
    peers = Peers.of(group, recorder, tensor)

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


def _reduce_scatter_steps(
    flat: torch.Tensor, bounds: list[int], rank: int, *, out_of_place: bool
) -> tuple[list[StepPlan], torch.Tensor]:
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
    steps: list[StepPlan] = []
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
        steps.append(StepPlan(Phase.REDUCE_SCATTER, k, (rank - k - 1) % n, received, send,
                              land, result, addend, after))
        send = result
    return steps, send


def _all_gather_steps(
    flat: torch.Tensor, bounds: list[int], rank: int, first_send: torch.Tensor
) -> list[StepPlan]:
    """The N-1 all-gather steps: at step k rank r forwards chunk (r-k) mod N (at step 0 its
    own, ``first_send``) and receives chunk (r-k-1) mod N straight into place."""
    n = len(bounds) - 1
    steps: list[StepPlan] = []
    send = first_send
    for k in range(n - 1):
        received = (rank - k - 1) % n
        dest = flat[bounds[received]:bounds[received + 1]]
        steps.append(StepPlan(Phase.ALL_GATHER, k, (rank - k) % n, received, send, dest, dest,
                              None))
        send = dest
    return steps


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
    :func:`labs.ring_schedule.compile_pipelined`); ``segment_bytes=None`` runs the plain
    lock-step ring (always used for CUDA tensors and when ``recorder.trace`` is on). Pass the
    same :class:`RingBuffers` to repeated calls to keep the scratch buffers and the pass's
    schedule between them.
    """
    kept = buffers.program if buffers is not None else None
    if (kept is not None and recorder is None and isinstance(tensor, torch.Tensor)
            and (op is ReduceOp.SUM or op is ReduceOp.AVG and tensor.is_floating_point())
            and kept.serves(tensor, group, segment_bytes, window)):
        # The very call the kept pass was compiled (and everything checked) for: run it.
        note("ring_all_reduce", tensor, group)  # labs.collective_check; Peers.of notes the rest
        execute(kept)
        return _finish(tensor, op, kept.size)
    _check(tensor, op)
    peers = Peers.of(group, recorder, tensor)

    def body(flat: torch.Tensor) -> None:
        if peers.size == 1 or flat.numel() == 0:
            return

        def steps() -> list[StepPlan]:
            bounds = shard_bounds(flat.numel(), peers.size)
            scatter, mine = _reduce_scatter_steps(flat, bounds, peers.rank, out_of_place=False)
            return scatter + _all_gather_steps(flat, bounds, peers.rank, mine)

        run_ring(peers, flat, steps, segment_bytes, window, buffers)
        _finish(flat, op, peers.size)

    return _in_place(tensor, body, buffers)


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
    peers = Peers.of(group, recorder, tensor)
    flat = tensor.detach().reshape(-1).contiguous()
    bounds = shard_bounds(flat.numel(), peers.size)
    mine = flat[bounds[peers.rank]:bounds[peers.rank + 1]]
    if peers.size == 1 or flat.numel() == 0:
        return _finish(mine.clone(), op, peers.size)
    steps, shard = _reduce_scatter_steps(flat, bounds, peers.rank, out_of_place=True)
    run_ring(peers, flat, lambda: steps, segment_bytes, window)
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
    peers = Peers.of(group, recorder, shard)
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
        run_ring(peers, out, lambda: _all_gather_steps(out, bounds, peers.rank, mine),
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
    peers = Peers.of(group, recorder, tensor)

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
    #: :func:`labs.halving_doubling.halving_doubling_all_reduce` (Rabenseifner's; all-reduce only)
    HALVING_DOUBLING = "halving-doubling"
    #: :func:`labs.double_tree.double_tree_all_reduce` (NCCL's two trees; all-reduce only,
    #: gloo only)
    DOUBLE_TREE = "double binary tree"
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
        return torch_all_reduce(tensor, op, _torch_peers(group, recorder))
    fn = {
        Algorithm.NAIVE: naive_all_reduce,
        Algorithm.WHOLE_TENSOR_RING: whole_tensor_ring_all_reduce,
        Algorithm.RING: ring_all_reduce,
        Algorithm.RECURSIVE_DOUBLING: recursive_doubling_all_reduce,
        Algorithm.HALVING_DOUBLING: halving_doubling_all_reduce,
        Algorithm.DOUBLE_TREE: double_tree_all_reduce,
    }[algorithm]
    return fn(tensor, op, group, recorder=recorder)


def _torch_peers(group: ProcessGroup | None, recorder: Recorder | None) -> Peers:
    """The peers of a call that uses torch's built-in collective, which a Recorder cannot see
    (its messages never pass through ``isend``/``irecv`` here): refuse one rather than let it
    count nothing."""
    if recorder is not None:
        raise ValueError("a Recorder counts the messages of labs' own collectives; torch's "
                         "built-in sends its own, which it cannot see: pass recorder=None with "
                         "Algorithm.TORCH, or count another algorithm.")
    return Peers.of(group, None)


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
    return torch_reduce_scatter(tensor, op, _torch_peers(group, recorder))


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
    return torch_all_gather(shard, _torch_peers(group, recorder), numel)


# --- beyond one node: the hierarchical all-reduce (chapter 8) ---------------------------------


@dataclass(frozen=True)
class HierarchicalGroups:
    """The sub-groups of a hierarchical all-reduce over ``group`` (None: the world) in nodes of
    ``node_size`` consecutive ranks: ``node``, this rank's node (group ranks j*g .. j*g+g-1,
    g = ``node_size``), and ``cross``, the ranks of every node with this rank's local rank
    (l, l+g, l+2g, ...). They are the two dimensions of the grid
    :func:`labs.grid.node_layout`, ``("cross", "node")`` of shape (N/g, g).

    Build it once and pass it to every call: :meth:`build` is a collective in which every rank
    of the default process group creates every sub-group, in the same order, as
    ``dist.new_group`` requires (:class:`labs.grid.ProcessGrid`: one call per node and per
    local rank, n + g calls, each a round of the store). Kept by the caller, so there is no
    module-level cache."""

    node_size: int
    size: int  #: ranks in ``group``
    node: ProcessGroup | None
    cross: ProcessGroup | None
    group: ProcessGroup | None = None

    @classmethod
    def build(cls, node_size: int, group: ProcessGroup | None = None) -> HierarchicalGroups:
        """Create the node and cross-node groups of this rank (call it on every rank)."""
        size = dist.get_world_size(group)
        _check_node_size(node_size, size)
        grid = ProcessGrid.build(node_layout(size, node_size), group)
        return cls(node_size, size, grid["node"], grid["cross"], group)


def _check_node_size(node_size: object, world_size: int) -> None:
    if isinstance(node_size, bool) or not isinstance(node_size, int) or node_size < 1:
        raise ValueError(f"node_size must be an int >= 1 (ranks per node), got {node_size!r}.")
    if world_size % node_size:
        raise ValueError(
            f"node_size={node_size} does not divide the world size {world_size}: a "
            "hierarchical all-reduce needs whole nodes. Pick a node_size that divides it "
            f"(here one of {[d for d in range(1, world_size + 1) if world_size % d == 0]}).")


def hierarchical_all_reduce(
    tensor: torch.Tensor, node_size: int, group: ProcessGroup | None = None,
    *, recorder: Recorder | None = None, groups: HierarchicalGroups | None = None,
    segment_bytes: int | None = DEFAULT_SEGMENT_BYTES,
) -> torch.Tensor:
    """Sum ``tensor`` over the ranks of ``group`` in place, in nodes of ``node_size``
    consecutive ranks, in three rings:

    1. ring reduce-scatter inside each node: local rank l ends with chunk l (of g =
       ``node_size``, :func:`shard_bounds`) summed over its node;
    2. ring all-reduce of that chunk across nodes, among the n = N/g ranks of local rank l:
       now it is summed over every rank;
    3. ring all-gather inside each node: every rank holds every chunk.

    Cost per rank (S bytes): intra-node ``2(g-1)/g S`` (phases 1 and 3), inter-node
    ``2(n-1)/n S/g`` (phase 2), against the flat ring's ``2(N-1)/N S`` of which, on the ranks
    at a node's edge, all crosses nodes. The g cross-node rings run at once, each on its own
    network card (:class:`labs.link.Topology`), so the slow links carry g times less per
    rank. Holds S/g for the shard and 2S/g scratch while it runs.

    ``groups`` (from :meth:`HierarchicalGroups.build`) saves creating the sub-groups on every
    call; without it they are created here, which every rank of the default group must then
    call together. A ``node_size`` that does not divide the group's size is refused before any
    message is sent. ``segment_bytes`` is passed to the rings (None: lock-step).
    """
    _check(tensor, ReduceOp.SUM)
    size = Peers.of(group, None, tensor).size  # refuses an uninitialised group, a CUDA tensor
    _check_node_size(node_size, size)
    if groups is None:
        groups = HierarchicalGroups.build(node_size, group)
    elif groups.node_size != node_size or groups.size != size or groups.group is not group:
        raise ValueError(f"groups were built for node_size={groups.node_size} over "
                         f"{groups.size} ranks of another group; build them for this call: "
                         "HierarchicalGroups.build(node_size, group).")

    def body(flat: torch.Tensor) -> None:
        if size == 1 or flat.numel() == 0:
            return
        shard = ring_reduce_scatter(flat, group=groups.node, recorder=recorder,
                                    segment_bytes=segment_bytes)  # 1-D, chunk l of g
        ring_all_reduce(shard, group=groups.cross, recorder=recorder,
                        segment_bytes=segment_bytes)
        ring_all_gather(shard, groups.node, numel=flat.numel(), recorder=recorder,
                        segment_bytes=segment_bytes, out=flat)

    return _in_place(tensor, body)
