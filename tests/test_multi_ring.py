"""labs.multi_ring, the flat all-reduce over several channels (chapter 8's fair baseline): the
sum equals torch's and is bit-identical across ranks for every world size, node size, channel
count, awkward size, dtype and op; bad input is refused before any message; the layout puts
every network card to work; the traffic per rank equals its closed form exactly (and a wrong
layout's closed form is told apart); the port model equals a message-by-message simulation
written here, and the single ring's model at one channel; real ranks on a topology follow the
model, and the channels beat the single ring by about what it says.

The timed topology is tests/test_topology.py's slow one (5 ms latency on both links, 50 MB/s
inside a node, 5 MB/s between nodes), for the reason it gives: on 2 loaded cores a sleeping
rank wakes a few milliseconds late, which must stay a small part of every modelled message."""

from __future__ import annotations

import functools
import hashlib
import sys
import time

import pytest
import torch
import torch.distributed as dist
from timing_bounds import EARLY, fastest_of_slowest, follows

from labs import Link, Topology, launch, multi_ring
from labs.collectives import Recorder, ring_all_reduce
from labs.cost_model import TopologyAlgorithm, predict_on_topology, ring_step_times
from labs.link import LinkKind
from labs.multi_ring import (
    channel_rings,
    multi_ring_all_reduce,
    multi_ring_bytes_across_nodes,
    multi_ring_on_topology,
    multi_ring_step_times,
)
from labs.torch_collectives import shard_bounds

pytestmark = pytest.mark.usefixtures("no_leftover_processes")

SUM, AVG = dist.ReduceOp.SUM, dist.ReduceOp.AVG
TIMED = Topology(node_size=2, intra=Link(alpha=5e-3, bandwidth=50e6),
                 inter=Link(alpha=5e-3, bandwidth=5e6))
TRAFFIC_NUMEL = 1001  #: divides by none of the channel or world sizes used


def _layouts(world_size: int) -> list[tuple[int, int]]:
    """(node_size, channels) pairs: node sizes 1, 2, 3 and N where they divide N, channels
    1, 2 and node_size."""
    sizes = sorted({g for g in (1, 2, 3, world_size) if world_size % g == 0})
    return [(g, c) for g in sizes for c in sorted({1, 2, g})]


def _values(numel: int, rank: int, dtype: torch.dtype) -> torch.Tensor:
    """Small integers: every partial sum is exact, so any summation order gives the same."""
    return torch.arange(numel, dtype=torch.float64).remainder(7).add(rank).to(dtype)


# --- (a) the sum, on real ranks ---------------------------------------------------------------


def sums_worker(rank: int, world_size: int) -> dict:
    """Every case against dist.all_reduce, the result's digest (for bit-identity across ranks),
    the traffic of the Recorder cases, and the refusals."""
    kinds = [(numel, dtype, op) for numel in sorted({0, 1, world_size - 1, 1001})
             for dtype in (torch.float32, torch.float64) for op in (SUM, AVG)]
    references = {}  # torch's result does not depend on the layout: one call per kind
    for numel, dtype, op in kinds:
        reference = _values(numel, rank, dtype)
        dist.all_reduce(reference, op=SUM)  # gloo: AVG is the SUM divided by N
        references[(numel, dtype, op)] = reference.div_(world_size) if op is AVG else reference
    cases = {}
    for g, c in _layouts(world_size):
        for numel, dtype, op in kinds:
            tensor = _values(numel, rank, dtype)
            reference = references[(numel, dtype, op)]
            out = multi_ring_all_reduce(tensor, op, node_size=g, channels=c)
            cases[(g, c, numel, str(dtype), str(op))] = (
                out is tensor and torch.equal(tensor, reference),
                hashlib.sha256(tensor.numpy().tobytes()).hexdigest())
    shaped = _values(12, rank, torch.float32).view(3, 4).t()  # not contiguous
    multi_ring_all_reduce(shaped, channels=2)
    want = _values(12, 0, torch.float64).view(3, 4).t() * world_size \
        + sum(range(world_size))
    cases[("transposed",)] = (torch.equal(shaped.double(), want), "")
    traffic = {}
    for g, c in _layouts(world_size):
        recorder = Recorder(node_size=g)
        multi_ring_all_reduce(_values(TRAFFIC_NUMEL, rank, torch.float32), node_size=g,
                              channels=c, recorder=recorder)
        traffic[(g, c)] = recorder.stats
    refusals = []
    for kwargs in ({"channels": 0}, {"channels": True}, {"node_size": world_size + 1},
                   {"node_size": 0}):
        recorder = Recorder()
        try:
            multi_ring_all_reduce(torch.ones(7), recorder=recorder, **kwargs)
            refusals.append(("", -1))
        except ValueError as err:
            stats = recorder.stats
            refusals.append((str(err), stats.messages_sent + stats.messages_received))
    after = torch.ones(7)
    multi_ring_all_reduce(after, channels=2)  # the ranks are still in step
    return {"cases": cases, "traffic": traffic, "refusals": refusals,
            "after": float(after[0]), "batched": batched(rank, world_size)}


def batched(rank: int, world_size: int) -> tuple[bool, int, int]:
    """The path NCCL takes (each step's messages as one batch_isend_irecv), forced on gloo:
    this rank process tells labs.multi_ring that its backend is NCCL. Whether the sum is
    right, and the messages and bytes the Recorder saw."""
    saved = multi_ring.backend_for_device
    multi_ring.backend_for_device = lambda backend, device: "nccl"
    try:
        tensor = _values(TRAFFIC_NUMEL, rank, torch.float32)
        recorder = Recorder(node_size=2 if world_size % 2 == 0 else 1)
        multi_ring_all_reduce(tensor, node_size=recorder.node_size, channels=2,
                              recorder=recorder)
    finally:
        multi_ring.backend_for_device = saved
    want = _values(TRAFFIC_NUMEL, 0, torch.float32) * world_size + sum(range(world_size))
    return (torch.equal(tensor, want), recorder.stats.messages_sent,
            recorder.stats.bytes_sent_across_nodes)


@functools.cache
def _sums(world_size: int) -> list[dict]:
    return list(launch(sums_worker, world_size, backend="gloo", echo=False, timeout=120))


@pytest.mark.parametrize("world_size", [1, 2, 4, pytest.param(6, marks=pytest.mark.slow),
                                        pytest.param(8, marks=pytest.mark.slow)])  # budget
def test_equals_torch_and_is_bit_identical_across_ranks(world_size):
    per_rank = _sums(world_size)
    for key in per_rank[0]["cases"]:
        assert all(r["cases"][key][0] for r in per_rank), (world_size, key)
        assert len({r["cases"][key][1] for r in per_rank}) == 1, (world_size, key)
    expected_cases = sum(len(sorted({0, 1, world_size - 1, 1001})) * 4
                         for _ in _layouts(world_size)) + 1
    assert len(per_rank[0]["cases"]) == expected_cases


@pytest.mark.parametrize("world_size", [1, 2, 4, pytest.param(6, marks=pytest.mark.slow), 8])
def test_the_batched_path_nccl_takes_gives_the_same_sum_and_traffic(world_size):
    per_rank = _sums(world_size)
    g = 2 if world_size % 2 == 0 else 1
    for r in per_rank:
        ok, messages, across = r["batched"]
        stats = r["traffic"][(g, 2)]  # the same call on gloo's own path
        assert ok and messages == stats.messages_sent and across == stats.bytes_sent_across_nodes
        assert messages == 2 * (world_size - 1) * 2


@pytest.mark.parametrize("world_size", [4])
def test_bad_input_is_refused_before_any_message(world_size):
    for r in _sums(world_size):
        for (message, messages), word in zip(r["refusals"], ("channels", "channels",
                                                             "node_size", "node_size"),
                                             strict=True):
            assert word in message and messages == 0, (message, messages)
        assert r["after"] == world_size


# --- (b) the layout, as data ------------------------------------------------------------------


def _crossings(rings: list[list[int]], node_size: int) -> tuple[dict, dict]:
    """rank -> the channels in which it sends across nodes, and those in which it receives."""
    sends: dict[int, list[int]] = {r: [] for r in rings[0]}
    receives: dict[int, list[int]] = {r: [] for r in rings[0]}
    for j, ring in enumerate(rings):
        for p, r in enumerate(ring):
            dst = ring[(p + 1) % len(ring)]
            if r // node_size != dst // node_size:
                sends[r].append(j)
                receives[dst].append(j)
    return sends, receives


@pytest.mark.parametrize(("world_size", "node_size"),
                         [(4, 2), (8, 2), (6, 3), (8, 4), (12, 3), (12, 4)])
def test_with_one_channel_per_card_every_card_sends_and_receives_once(world_size, node_size):
    rings = channel_rings(world_size, node_size, node_size)
    assert all(sorted(ring) == list(range(world_size)) for ring in rings)
    sends, receives = _crossings(rings, node_size)
    assert all(len(sends[r]) == 1 and len(receives[r]) == 1 for r in range(world_size))
    for j, ring in enumerate(rings):
        # each node entered and left once per channel, by a different rank in each channel
        assert sum(j in sends[r] for r in range(world_size)) == world_size // node_size
        for p in range(len(ring) - 1):  # the hops inside a node use its fabric
            if ring[p] // node_size == ring[p + 1] // node_size:
                assert abs(ring[p] - ring[p + 1]) < node_size
    # a wrong layout, the same plain ring in every channel, fails the property
    plain = [list(range(world_size))] * node_size
    wrong_sends, _ = _crossings(plain, node_size)
    assert not all(len(wrong_sends[r]) == 1 for r in range(world_size))


def test_one_channel_is_the_plain_ring_and_uses_one_card_per_node():
    assert channel_rings(8, 2, 1) == [list(range(8))]
    sends, receives = _crossings(channel_rings(8, 2, 1), 2)
    senders = [r for r in range(8) if sends[r]]
    assert senders == [1, 3, 5, 7] and [r for r in range(8) if receives[r]] == [0, 2, 4, 6]
    assert channel_rings(8, 2, 2) == [[0, 1, 2, 3, 4, 5, 6, 7], [1, 0, 3, 2, 5, 4, 7, 6]]
    # node_size 1, and a single node: the plain cycle r -> r+1 in every channel
    for rings in (channel_rings(4, 1, 3), channel_rings(4, 4, 4)):
        for ring in rings:
            assert all(ring[(p + 1) % 4] == (ring[p] + 1) % 4 for p in range(4))
    for bad in ((4, 3, 1), (4, 2, 0), (4, 0, 1), (4, 2, True)):
        with pytest.raises(ValueError):
            channel_rings(*bad)


# --- (c) the traffic per rank, counted by a Recorder ---------------------------------------------


def expected_traffic(numel: int, element_size: int, world_size: int, node_size: int,
                     channels: int, position) -> list[tuple[int, int, int, int, int]]:
    """Per rank: (messages sent, bytes sent, messages received, bytes received, bytes sent
    across nodes) of a ring all-reduce per channel over part j of ``shard_bounds(numel, c)``,
    rank r at ``position(j, r)`` in channel j's ring. At position p a rank sends every chunk
    d_i but d_p (reduce-scatter) and every one but d_(p+1) (all-gather), so 2P_j - d_p -
    d_(p+1) bytes, and receives 2P_j - d_(p-1) - d_p; one message per non-empty chunk. With
    ``numel`` >= cN every chunk is non-empty: 2(N-1)c messages each way."""
    n, g = world_size, node_size
    parts = shard_bounds(numel, channels)
    out = []
    for r in range(n):
        counts = [0, 0, 0, 0, 0]
        for j in range(channels):
            part = parts[j + 1] - parts[j]
            bounds = shard_bounds(part, n)
            d = [bounds[i + 1] - bounds[i] for i in range(n)]
            p = position(j, r)
            sent = [d[i] for i in range(n) if i != p] + [d[i] for i in range(n)
                                                          if i != (p + 1) % n]
            got = [d[i] for i in range(n) if i != (p - 1) % n] + [d[i] for i in range(n)
                                                                   if i != p]
            counts[0] += sum(1 for x in sent if x)
            counts[1] += sum(sent) * element_size
            counts[2] += sum(1 for x in got if x)
            counts[3] += sum(got) * element_size
            right = next(q for q in range(n) if position(j, q) == (p + 1) % n)
            if r // g != right // g:
                counts[4] += sum(sent) * element_size
        out.append(tuple(counts))
    return out


def rotation(node_size: int):
    """The position of rank r in channel j's ring as channel_rings' docstring states it:
    node m's ranks at m·g .. m·g+g-1, local rank l at offset (l - j) mod g."""
    def position(j: int, r: int) -> int:
        node, local = divmod(r, node_size)
        return node * node_size + (local - j) % node_size
    return position


@pytest.mark.parametrize("world_size", [6, 8])
def test_traffic_per_rank_equals_its_closed_form(world_size):
    per_rank = _sums(world_size)
    for g, c in _layouts(world_size):
        measured = [(s.messages_sent, s.bytes_sent, s.messages_received, s.bytes_received,
                     s.bytes_sent_across_nodes) for s in (r["traffic"][(g, c)]
                                                          for r in per_rank)]
        expected = expected_traffic(TRAFFIC_NUMEL, 4, world_size, g, c, rotation(g))
        assert measured == expected, (g, c)
        assert [m[4] for m in measured] == multi_ring_bytes_across_nodes(
            TRAFFIC_NUMEL, 4, world_size, g, c)
        assert all(m[0] == m[2] == 2 * (world_size - 1) * c for m in measured)
        assert sum(m[1] for m in measured) == 2 * (world_size - 1) * TRAFFIC_NUMEL * 4
        if c == g and g < world_size:  # every card carries about 2(N-1)/N·S/g
            share = 2 * (world_size - 1) / world_size * TRAFFIC_NUMEL * 4 / g
            assert all(abs(m[4] - share) <= 2 * 4 * c for m in measured), (g, measured)
        # a deliberately wrong layout (the plain ring in every channel) is told apart
        if c > 1 and 1 < g < world_size:
            wrong = expected_traffic(TRAFFIC_NUMEL, 4, world_size, g, c, lambda j, r: r)
            assert [w[4] for w in wrong] != [m[4] for m in measured]


# --- (d) the port model -------------------------------------------------------------------------


def simulated(size_bytes: float, world_size: int, topology: Topology, channels: int) -> float:
    """The all-reduce message by message, pulled backwards from its last step: a message of
    step k in channel j leaves rank r once r finished step k-1 and its outgoing port of that
    kind finished the message posted before it (steps, then channels, in order); it arrives
    alpha later, queues behind the previous message of that incoming port, and holds it m/bw.
    A rank finishes step k when all its messages of step k have left and arrived."""
    n, rings = world_size, channel_rings(world_size, topology.node_size, channels)
    m = size_bytes / (channels * n)
    to = {(j, ring[p]): ring[(p + 1) % n] for j, ring in enumerate(rings) for p in range(n)}
    frm = {(j, dst): src for (j, src), dst in to.items()}
    order = [(k, j) for k in range(2 * (n - 1)) for j in range(channels)]

    def earlier(r: int, k: int, j: int, peer: dict, kind: LinkKind) -> tuple[int, int] | None:
        """The message before (k, j) on rank r's port of ``kind``, or None."""
        at = order.index((k, j))
        for k2, j2 in reversed(order[:at]):
            other = peer[(j2, r)]
            if topology.kind(r, other) is kind:
                return k2, j2
        return None

    @functools.cache
    def finished(r: int, k: int) -> float:
        if k < 0:
            return 0.0
        ends = [leaves(r, k, j) + m / topology.link(r, to[(j, r)]).bandwidth
                for j in range(channels)]
        ends += [arrived(r, k, j) for j in range(channels)]
        return max([finished(r, k - 1), *ends])

    @functools.cache
    def leaves(r: int, k: int, j: int) -> float:
        kind = topology.kind(r, to[(j, r)])
        before = earlier(r, k, j, to, kind)
        free = 0.0 if before is None else leaves(r, *before) + m / topology.link(
            r, to[(before[1], r)]).bandwidth
        return max(finished(r, k - 1), free)

    @functools.cache
    def arrived(r: int, k: int, j: int) -> float:
        src = frm[(j, r)]
        wire, kind = topology.link(src, r), topology.kind(src, r)
        before = earlier(r, k, j, frm, kind)
        free = 0.0 if before is None else arrived(r, *before)
        return max(leaves(src, k, j) + wire.alpha, free) + m / wire.bandwidth

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 20000))
    try:
        return max(finished(r, 2 * (n - 1) - 1) for r in range(n)) if n > 1 else 0.0
    finally:
        sys.setrecursionlimit(limit)


MODEL_TOPOLOGIES = [
    TIMED,
    Topology(2, Link(1e-3, 50e6), Link(1e-3, 5e6)),  # the chapter's timed links
    Topology(3, Link(0.5, 1000.0), Link(0.5, 100.0)),  # latency-bound
    Topology(2, Link(2e-3, 1e6), Link(1e-4, 1e8)),  # a fabric slower than the network
    Topology(4, Link(1e-4, 1e7), Link(5e-3, 2e6)),
]


@pytest.mark.parametrize("topology", MODEL_TOPOLOGIES, ids=lambda t: f"g{t.node_size}")
def test_the_model_equals_a_message_by_message_simulation(topology):
    g = topology.node_size
    for world_size in (g, 2 * g, 3 * g, 4 * g):
        for channels in sorted({1, 2, g, 2 * g}):
            for size in (800, 1 << 20, 3 << 20):
                model = multi_ring_on_topology(size, world_size, topology, channels)
                assert model == pytest.approx(
                    simulated(size, world_size, topology, channels), rel=1e-12), (
                    world_size, channels, size)
                if channels == 1:  # the existing single-ring model
                    single = ring_step_times(size, world_size, topology)
                    assert model == pytest.approx(max(single[-1]) if single else 0.0,
                                                  rel=1e-12)
    steps = multi_ring_step_times(1 << 20, 2 * g, topology, g)
    assert len(steps) == 2 * (2 * g - 1) and max(steps[-1]) == multi_ring_on_topology(
        1 << 20, 2 * g, topology, g)


def test_the_closed_form_intuition_holds_where_the_docstring_says():
    """With c = g and the fabric's traffic of a step under the network's: exactly
    2(N-1)(alpha_inter + S/(gN)/bw_inter). Where the fabric is the slower, the model is
    above that form (the intuition does not hold there, and the model says so)."""
    chapter = Topology(2, Link(1e-3, 50e6), Link(1e-3, 5e6))
    size = 2 << 20
    for world_size, topology in ((8, chapter), (4, chapter), (8, TIMED),
                                 (8, Topology(4, Link(1e-4, 1e8), Link(1e-3, 5e6)))):
        g, n = topology.node_size, world_size
        form = 2 * (n - 1) * topology.inter.seconds(size / (g * n))
        assert multi_ring_on_topology(size, n, topology, g) == pytest.approx(form)
    slow_fabric = Topology(2, Link(2e-3, 1e6), Link(1e-4, 1e8))
    form = 2 * 7 * slow_fabric.inter.seconds(size / 16)
    assert multi_ring_on_topology(size, 8, slow_fabric, 2) > 1.5 * form
    # one node: every channel on the same ports, the time of one ring
    one = Topology(4, chapter.intra, chapter.inter)
    assert multi_ring_on_topology(size, 4, one, 4) == pytest.approx(
        predict_on_topology(TopologyAlgorithm.FLAT_RING, size, 4, one))


def test_the_model_refuses_bad_input():
    with pytest.raises(ValueError, match="node_size"):
        multi_ring_on_topology(1 << 20, 3, TIMED, 2)
    with pytest.raises(ValueError, match="channels"):
        multi_ring_on_topology(1 << 20, 4, TIMED, 0)
    with pytest.raises(TypeError, match="labs.Topology"):
        multi_ring_on_topology(1 << 20, 4, TIMED.intra, 2)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="size_bytes"):
        multi_ring_on_topology(-1, 4, TIMED, 2)


# --- (e) real ranks on a topology ----------------------------------------------------------------


def timed_worker(rank: int, world_size: int, nbytes: int, repeats: int) -> dict:
    calls = {
        "single": lambda t, r: ring_all_reduce(t, recorder=r, segment_bytes=None),
        "channels": lambda t, r: multi_ring_all_reduce(t, channels=TIMED.node_size,
                                                       recorder=r),
    }
    out = {}
    for name, call in calls.items():
        times = []
        for _ in range(repeats):
            tensor = torch.full((nbytes // 4,), float(rank))
            recorder = Recorder()  # the launch's Topology says where the nodes are
            dist.barrier()
            start = time.monotonic()
            call(tensor, recorder)
            times.append(time.monotonic() - start)
            assert float(tensor.min()) == float(tensor.max()) == sum(range(world_size))
        out[name] = (times, recorder.stats.bytes_sent_across_nodes)
    return out


def test_real_ranks_follow_the_model_and_the_channels_beat_one_ring():
    world_size, nbytes = 4, 1 << 20
    per_rank = launch(timed_worker, world_size, args=(nbytes, 3), backend="gloo",
                      echo=False, timeout=120, link=TIMED)
    model = {"single": predict_on_topology(TopologyAlgorithm.FLAT_RING, nbytes, world_size,
                                           TIMED),
             "channels": multi_ring_on_topology(nbytes, world_size, TIMED, TIMED.node_size)}
    measured = {name: fastest_of_slowest([r[name][0] for r in per_rank]) for name in model}
    for name in model:
        assert follows(measured[name], model[name]), (name, measured[name], model[name])
    assert [r["channels"][1] for r in per_rank] == multi_ring_bytes_across_nodes(
        nbytes // 4, 4, world_size, TIMED.node_size, TIMED.node_size)
    # The channels win by about what the model says (1.71x here; 1.63-1.65x measured on 2
    # loaded cores): at least half the predicted gain, and no more than the model allows.
    speedup = measured["single"] / measured["channels"]
    model_speedup = model["single"] / model["channels"]
    assert speedup >= 1 + (model_speedup - 1) / 2, (speedup, model_speedup, measured)
    assert speedup <= model_speedup * (1 + EARLY), (speedup, model_speedup, measured)
