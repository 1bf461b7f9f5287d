"""Chapter 8, part 1's measurements on an emulated :class:`labs.Topology`: the flat all-reduce
(one ring, and g channels as NCCL runs it) against the hierarchical one across node counts,
and the flat ring step by step.

The chapter's topology (:data:`CHAPTER_SETTINGS`) is nodes of 2 ranks whose inter-node link is
10x slower than the intra-node one (1 ms latency on both, 500 MB/s inside a node, 50 MB/s
between nodes), with a 16 MiB all-reduce: a run takes about a second, long beside the few
milliseconds a sleeping rank wakes late, short enough for a notebook.

* :func:`time_both` (worker) and :func:`measure_topology` time every all-reduce, lock-step
  (``segment_bytes=None``, the schedule :func:`labs.cost_model.predict_on_topology` describes),
  for every node count of the settings; :func:`topology_table` prints them beside the model.
* :class:`GridSettings`, :func:`model_grid` and :func:`measure_grid`: the flat all-reduce over
  g channels against the hierarchical one over a grid of the network's latency and bandwidth,
  the model at every cell and real ranks at a few (:func:`grid_table`): where the hierarchy's
  2(n-1) network latencies, against the channels' 2(N-1), pay for its two phases inside the
  node.
* :func:`ring_step_trace` (worker) records when each rank finishes each of the flat ring's
  2(N-1) steps; :func:`trace_ring_steps` sets the slowest rank's steps beside
  :func:`labs.cost_model.ring_step_times` and names the hop each step waited for
  (:func:`model_ring_steps`): every step waits for its slowest, inter-node, hop.

Workers run inside ranks; this module imports no plotting (:mod:`labs.viz.topology` draws).
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from labs.collectives import (
    HierarchicalGroups,
    Recorder,
    hierarchical_all_reduce,
    ring_all_reduce,
)
from labs.cost_model import (
    TopologyAlgorithm,
    bytes_across_nodes,
    predict_on_topology,
    ring_step_times,
)
from labs.launcher import MAX_WORLD_SIZE, launch
from labs.link import Link, LinkKind, Topology
from labs.multi_ring import multi_ring_all_reduce
from labs.p2p import Peers, Phase
from labs.tables import format_table


@dataclass(frozen=True)
class TopologySettings:
    """One run: for each count in ``nodes``, ``nodes x node_size`` ranks on the topology
    (``intra`` inside a node, ``inter`` between nodes), an all-reduce of ``size_bytes``
    (float32), ``repeats`` timed calls of each algorithm; with ``loopback`` also on the real
    transport (no emulated link)."""

    nodes: tuple[int, ...] = (2, 4, 8)
    node_size: int = 2
    size_bytes: int = 16 << 20
    intra: Link = Link(alpha=1e-3, bandwidth=500e6)
    inter: Link = Link(alpha=1e-3, bandwidth=50e6)
    repeats: int = 3
    loopback: bool = False  #: also time both on the real transport

    def __post_init__(self) -> None:
        if not isinstance(self.nodes, tuple) or not self.nodes \
                or any(isinstance(n, bool) or not isinstance(n, int) or n < 1
                       for n in self.nodes):
            raise ValueError(f"nodes must be a tuple of counts >= 1, got {self.nodes!r}; "
                             "e.g. (2, 4, 8).")
        if isinstance(self.node_size, bool) or not isinstance(self.node_size, int) \
                or self.node_size < 1 or max(self.nodes) * self.node_size > MAX_WORLD_SIZE:
            raise ValueError(f"node_size must be an int >= 1 with nodes x node_size <= "
                             f"{MAX_WORLD_SIZE} ranks, got {self.node_size!r} x "
                             f"{max(self.nodes)}: use fewer nodes or smaller ones.")
        if isinstance(self.size_bytes, bool) or not isinstance(self.size_bytes, int) \
                or self.size_bytes < 4 or self.size_bytes % 4:
            raise ValueError(f"size_bytes must be a positive multiple of 4 (float32), got "
                             f"{self.size_bytes!r}; e.g. 16 << 20.")
        for name in ("intra", "inter"):
            if not isinstance(getattr(self, name), Link):
                raise TypeError(f"{name} must be a labs.Link, got "
                                f"{type(getattr(self, name)).__name__}; e.g. "
                                f"{name}=Link(alpha=1e-3, bandwidth=50e6).")
        if isinstance(self.repeats, bool) or not isinstance(self.repeats, int) \
                or self.repeats < 1:
            raise ValueError(f"repeats must be an int >= 1, got {self.repeats!r}.")

    @property
    def topology(self) -> Topology:
        return Topology(self.node_size, self.intra, self.inter)


#: The chapter's topology: nodes of 2, the inter-node link 10x slower; 16 MiB; the step trace
#: on 4 nodes (8 ranks).
CHAPTER_SETTINGS = TopologySettings()
#: How many nodes the chapter's step trace uses.
CHAPTER_TRACE_NODES = 4


# --- flat ring vs hierarchical ------------------------------------------------------------------


def time_both(rank: int, world_size: int, node_size: int, nbytes: int, repeats: int,
              algorithms: tuple[TopologyAlgorithm, ...] = tuple(TopologyAlgorithm)
              ) -> dict[TopologyAlgorithm, list[float]]:
    """Worker: seconds of each call of each of ``algorithms`` on this rank, from a barrier.
    Every result is checked (the sum of the ranks' ids everywhere)."""
    groups = HierarchicalGroups.build(node_size)
    out: dict[TopologyAlgorithm, list[float]] = {}
    for algorithm in algorithms:
        times = []
        for _ in range(repeats):
            tensor = torch.full((nbytes // 4,), float(rank))  # 1-D float32, S bytes
            dist.barrier()
            start = time.monotonic()
            if algorithm is TopologyAlgorithm.FLAT_RING:
                ring_all_reduce(tensor, segment_bytes=None)
            elif algorithm is TopologyAlgorithm.MULTI_RING:
                multi_ring_all_reduce(tensor, node_size=node_size)
            else:
                hierarchical_all_reduce(tensor, node_size, groups=groups, segment_bytes=None)
            times.append(time.monotonic() - start)
            if float(tensor.min()) != float(tensor.max()) or \
                    float(tensor[0]) != sum(range(world_size)):
                raise RuntimeError(f"{algorithm.value} all-reduce gave a wrong sum on rank "
                                   f"{rank}.")
        out[algorithm] = times
    return out


def slowest(per_rank: Sequence[dict[TopologyAlgorithm, list[float]]],
            algorithm: TopologyAlgorithm) -> list[float]:
    """Per call, the slowest rank's seconds (the collective is done when the last rank is)."""
    return [max(t) for t in zip(*(r[algorithm] for r in per_rank), strict=True)]


@dataclass(frozen=True)
class TopologyRow:
    """Both all-reduces on one node count: per call the slowest rank's seconds, and the
    model's (:func:`labs.cost_model.predict_on_topology`)."""

    nodes: int
    ranks: int
    measured: dict[TopologyAlgorithm, list[float]]
    model: dict[TopologyAlgorithm, float]
    loopback: dict[TopologyAlgorithm, list[float]] | None = None

    def median(self, algorithm: TopologyAlgorithm) -> float:
        return statistics.median(self.measured[algorithm])

    @property
    def speedup(self) -> float:
        """Measured flat / hierarchical (medians)."""
        return self.median(TopologyAlgorithm.FLAT_RING) / self.median(
            TopologyAlgorithm.HIERARCHICAL)

    @property
    def model_speedup(self) -> float:
        return self.model[TopologyAlgorithm.FLAT_RING] / self.model[
            TopologyAlgorithm.HIERARCHICAL]

    @property
    def speedup_over_channels(self) -> float:
        """Measured flat with g channels / hierarchical (medians): what the hierarchy buys
        over the flat all-reduce as NCCL runs it."""
        return self.median(TopologyAlgorithm.MULTI_RING) / self.median(
            TopologyAlgorithm.HIERARCHICAL)

    @property
    def model_speedup_over_channels(self) -> float:
        return self.model[TopologyAlgorithm.MULTI_RING] / self.model[
            TopologyAlgorithm.HIERARCHICAL]


def measure_topology(settings: TopologySettings = CHAPTER_SETTINGS, timeout: float = 600.0
                     ) -> list[TopologyRow]:
    """One launch per node count on the emulated topology (and one on the real transport with
    ``settings.loopback``): a :class:`TopologyRow` each."""
    rows = []
    for nodes in settings.nodes:
        n = nodes * settings.node_size
        args = (settings.node_size, settings.size_bytes, settings.repeats)
        on_link = launch(time_both, n, args=args, link=settings.topology, device="cpu",
                         echo=False, timeout=timeout)
        real = launch(time_both, n, args=args, device="cpu", echo=False, timeout=timeout) \
            if settings.loopback else None
        rows.append(TopologyRow(
            nodes, n, {a: slowest(on_link, a) for a in TopologyAlgorithm},
            {a: predict_on_topology(a, settings.size_bytes, n, settings.topology)
             for a in TopologyAlgorithm},
            None if real is None else {a: slowest(real, a) for a in TopologyAlgorithm}))
    return rows


def topology_table(rows: Sequence[TopologyRow]) -> str:
    """Seconds per all-reduce (median over calls of the slowest rank), beside the model; the
    hierarchical all-reduce's speed-up over the single flat ring and over the flat one with
    g channels."""
    flat, multi, hier = (TopologyAlgorithm.FLAT_RING, TopologyAlgorithm.MULTI_RING,
                         TopologyAlgorithm.HIERARCHICAL)
    loopback = any(r.loopback is not None for r in rows)
    headers = ["nodes", "ranks", "one ring (s)", "model", "g channels (s)", "model",
               "hier. (s)", "model", "hier. vs one ring", "model", "hier. vs g channels",
               "model"]
    if loopback:
        headers += ["loopback flat (s)", "loopback hier. (s)"]
    body = []
    for r in rows:
        line = [r.nodes, r.ranks, f"{r.median(flat):.3f}", f"{r.model[flat]:.3f}",
                f"{r.median(multi):.3f}", f"{r.model[multi]:.3f}",
                f"{r.median(hier):.3f}", f"{r.model[hier]:.3f}", f"{r.speedup:.2f}x",
                f"{r.model_speedup:.2f}x", f"{r.speedup_over_channels:.2f}x",
                f"{r.model_speedup_over_channels:.2f}x"]
        if loopback:
            line += ["-", "-"] if r.loopback is None else [
                f"{statistics.median(r.loopback[flat]):.4f}",
                f"{statistics.median(r.loopback[hier]):.4f}"]
        body.append(line)
    return format_table(headers, body)


# --- where the hierarchy wins: a grid of network latencies and bandwidths ------------------------

#: The two all-reduces the grid sets against each other: the flat one as NCCL runs it and the
#: hierarchical one.
GRID_ALGORITHMS = (TopologyAlgorithm.MULTI_RING, TopologyAlgorithm.HIERARCHICAL)


@dataclass(frozen=True)
class GridSettings:
    """The flat all-reduce over g channels against the hierarchical one on ``nodes`` nodes of
    ``node_size``, for every inter-node link ``Link(alpha, bandwidth)`` with ``alpha`` in
    ``inter_alphas`` and ``bandwidth`` in ``inter_bandwidths`` (the node's own link stays
    ``intra``), an all-reduce of ``size_bytes``; the model prices every point, and real ranks
    time the points in ``measured`` (fastest of ``repeats`` calls, each the slowest rank's).

    The defaults are the chapter's: the timed table's 4 nodes of 2, 2 MiB, the node's link
    (1 ms, 50 MB/s), and the network from as slow as the timed table's (1 ms, 5 MB/s) to 30
    times its latency and as fast as the node's link. The measured points are four that span
    the map and where every modelled step is long beside what a step costs this machine's
    processes (about a millisecond for 8 ranks on 2 cores: the emulated link cannot hide it)."""

    nodes: int = 4
    node_size: int = 2
    size_bytes: int = 2 << 20
    intra: Link = Link(alpha=1e-3, bandwidth=50e6)
    inter_alphas: tuple[float, ...] = (1e-3, 3e-3, 10e-3, 30e-3)
    inter_bandwidths: tuple[float, ...] = (5e6, 10e6, 25e6, 50e6)
    measured: tuple[tuple[float, float], ...] = ((1e-3, 5e6), (1e-3, 25e6), (30e-3, 5e6),
                                                 (30e-3, 50e6))
    repeats: int = 3

    def __post_init__(self) -> None:
        # the shared checks (node count, sizes, links, repeats) are TopologySettings'
        TopologySettings(nodes=(self.nodes,), node_size=self.node_size,
                         size_bytes=self.size_bytes, intra=self.intra, repeats=self.repeats)
        for name in ("inter_alphas", "inter_bandwidths"):
            values = getattr(self, name)
            if not isinstance(values, tuple) or not values or any(
                    isinstance(v, bool) or not isinstance(v, (int, float))
                    or not math.isfinite(v) or v < 0 for v in values):
                raise ValueError(f"{name} must be a non-empty tuple of finite numbers >= 0, "
                                 f"got {values!r}.")
        if any(b <= 0 for b in self.inter_bandwidths):
            raise ValueError(f"inter_bandwidths must be > 0 (bytes/s), got "
                             f"{self.inter_bandwidths!r}.")
        if not isinstance(self.measured, tuple) or any(
                not isinstance(p, tuple) or len(p) != 2 or p[0] not in self.inter_alphas
                or p[1] not in self.inter_bandwidths for p in self.measured):
            raise ValueError(f"measured must be a tuple of (alpha, bandwidth) points of the "
                             f"grid, each alpha in {self.inter_alphas} and bandwidth in "
                             f"{self.inter_bandwidths}; got {self.measured!r}.")

    @property
    def ranks(self) -> int:
        return self.nodes * self.node_size

    def topology(self, alpha: float, bandwidth: float) -> Topology:
        """The topology at one point of the grid."""
        return Topology(self.node_size, self.intra, Link(alpha, bandwidth))


@dataclass(frozen=True)
class GridPoint:
    """One point of the grid: the model's seconds of each of :data:`GRID_ALGORITHMS`, and,
    where real ranks ran, per call the slowest rank's seconds."""

    alpha: float  #: the inter-node link's latency (s)
    bandwidth: float  #: and its bandwidth (bytes/s)
    model: dict[TopologyAlgorithm, float]
    measured: dict[TopologyAlgorithm, list[float]] | None = None

    @property
    def model_ratio(self) -> float:
        """Model: flat over g channels / hierarchical (above 1: the hierarchy is faster)."""
        return self.model[TopologyAlgorithm.MULTI_RING] / self.model[
            TopologyAlgorithm.HIERARCHICAL]

    def fastest(self, algorithm: TopologyAlgorithm) -> float:
        if self.measured is None:
            raise ValueError("this point was not measured.")
        return min(self.measured[algorithm])

    @property
    def ratio(self) -> float:
        """Measured: the fastest call of the flat all-reduce over g channels / the fastest of
        the hierarchical one."""
        return self.fastest(TopologyAlgorithm.MULTI_RING) / self.fastest(
            TopologyAlgorithm.HIERARCHICAL)


def model_grid(settings: GridSettings = GridSettings()) -> list[list[GridPoint]]:
    """The model at every point: ``grid[i][j]`` for ``inter_alphas[i]`` and
    ``inter_bandwidths[j]`` (:func:`labs.cost_model.predict_on_topology`). No process
    starts."""
    return [[GridPoint(alpha, bandwidth, {
        a: predict_on_topology(a, settings.size_bytes, settings.ranks,
                               settings.topology(alpha, bandwidth)) for a in GRID_ALGORITHMS})
             for bandwidth in settings.inter_bandwidths] for alpha in settings.inter_alphas]


def measure_grid(settings: GridSettings = GridSettings(),
                 timed: tuple[TopologySettings, Sequence[TopologyRow]] | None = None,
                 timeout: float = 300.0) -> list[GridPoint]:
    """One launch per point of ``settings.measured`` on its topology: both all-reduces,
    ``settings.repeats`` calls each, beside the model. ``timed``, the settings and rows of a
    :func:`measure_topology` run, saves a launch: a point whose run is already there (same
    node size, node count, size, links and repeats) takes its calls from it."""
    out = []
    for alpha, bandwidth in settings.measured:
        topology = settings.topology(alpha, bandwidth)
        calls = None
        if timed is not None:
            done, rows = timed
            if (done.node_size, done.size_bytes, done.intra, done.inter, done.repeats) == (
                    settings.node_size, settings.size_bytes, settings.intra,
                    Link(alpha, bandwidth), settings.repeats):
                calls = next(({a: r.measured[a] for a in GRID_ALGORITHMS} for r in rows
                              if r.nodes == settings.nodes), None)
        if calls is None:
            per_rank = launch(time_both, settings.ranks,
                              args=(settings.node_size, settings.size_bytes, settings.repeats,
                                    GRID_ALGORITHMS),
                              link=topology, device="cpu", echo=False, timeout=timeout)
            calls = {a: slowest(per_rank, a) for a in GRID_ALGORITHMS}
        out.append(GridPoint(
            alpha, bandwidth,
            {a: predict_on_topology(a, settings.size_bytes, settings.ranks, topology)
             for a in GRID_ALGORITHMS}, calls))
    return out


def grid_table(points: Sequence[GridPoint]) -> str:
    """Per measured point: the network's latency and bandwidth, each all-reduce's fastest
    call beside its model, and the ratio flat over g channels / hierarchical, measured and
    modelled."""
    multi, hier = GRID_ALGORITHMS
    body = [[f"{1e3 * p.alpha:g}", f"{p.bandwidth / 1e6:g}",
             f"{1e3 * p.fastest(multi):.0f}", f"{1e3 * p.model[multi]:.0f}",
             f"{1e3 * p.fastest(hier):.0f}", f"{1e3 * p.model[hier]:.0f}",
             f"{p.ratio:.2f}", f"{p.model_ratio:.2f}"] for p in points]
    return format_table(["alpha_e (ms)", "network (MB/s)", "g channels (ms)", "model",
                         "hier. (ms)", "model", "channels / hier.", "model"], body)


# --- the flat ring, step by step ----------------------------------------------------------------


def ring_step_trace(rank: int, world_size: int, nbytes: int) -> list[float]:
    """Worker: the flat lock-step ring's 2(N-1) steps on this rank, each one chunk of
    ``nbytes``/N sent right while one arrives from the left (the messages of
    ``ring_all_reduce(t, segment_bytes=None)``; the additions are left out), returning when
    each step finished, in seconds from a common barrier. Launch it with ``link=`` a
    :class:`labs.Topology` and set it beside :func:`labs.cost_model.ring_step_times`: every
    step waits for the slowest (inter-node) hop."""
    peers = Peers.of(None, None)
    send = torch.zeros(nbytes // 4 // world_size)  # 1-D float32, one chunk
    recv = torch.empty_like(send)
    dist.barrier()
    start, done = time.monotonic(), []
    for _ in range(2 * (world_size - 1)):
        peers.exchange(send, rank + 1, recv, rank - 1)
        send, recv = recv, send
        done.append(time.monotonic() - start)
    return done


def ring_step_traces(rank: int, world_size: int, nbytes: int, repeats: int
                     ) -> list[list[float]]:
    """Worker: :func:`ring_step_trace` ``repeats`` times (each from its own barrier)."""
    return [ring_step_trace(rank, world_size, nbytes) for _ in range(repeats)]


@dataclass(frozen=True)
class ModelStep:
    """One step of the flat lock-step ring in the port model."""

    step: int  #: 0 .. 2(N-1)-1
    phase: Phase
    finish: float  #: when the last rank finishes this step (s from the start)
    duration: float  #: finish minus the previous step's finish
    rank: int  #: the rank that finishes last (the first of them, on a tie)
    waited_for: LinkKind
    """The hop that rank waited for: the arriving chunk's hop, or the port (in or out) that
    was still busy; inter-node when an inter-node term reaches the maximum."""


def model_ring_steps(size_bytes: float, world_size: int, topology: Topology
                     ) -> list[ModelStep]:
    """Per step of :func:`labs.cost_model.ring_step_times`, the slowest rank's finish and
    which hop it waited for. The recurrence is the cost model's: rank r finishes step k at
    ``max(t(r-1, k-1) + T(hop r-1 -> r), t(r, k-1) + c/bw_out(r), t(r, k-1) + c/bw_in(r))``;
    the hop is the link of whichever term reaches the maximum."""
    times = ring_step_times(size_bytes, world_size, topology)
    n = world_size
    if not times:
        return []
    chunk = size_bytes / n
    out, previous = [], [0.0] * n
    for k, row in enumerate(times):
        finish = max(row)
        r = row.index(finish)
        into, onward = topology.kind((r - 1) % n, r), topology.kind(r, (r + 1) % n)
        terms = [(previous[r - 1] + topology.link((r - 1) % n, r).seconds(chunk), into),
                 (previous[r] + chunk / topology.link(r, (r + 1) % n).bandwidth, onward),
                 (previous[r] + chunk / topology.link((r - 1) % n, r).bandwidth, into)]
        reached = {kind for value, kind in terms
                   if math.isclose(value, finish, rel_tol=1e-9, abs_tol=1e-12)}
        waited = LinkKind.INTER if LinkKind.INTER in reached else LinkKind.INTRA
        last = max(previous) if k else 0.0
        out.append(ModelStep(k, Phase.REDUCE_SCATTER if k < n - 1 else Phase.ALL_GATHER,
                             finish, finish - last, r, waited))
        previous = row
    return out


@dataclass(frozen=True)
class StepRow:
    """One step of the flat ring: measured (median over repeats of the slowest rank) beside
    the model, and the hop the model says it waited for."""

    step: int
    phase: Phase
    measured_finish: float
    model_finish: float
    measured: float  #: this step's duration: its finish minus the previous step's
    model: float
    waited_for: LinkKind
    slowest_rank: int  #: the rank that finished this step last, measured (most repeats)


def step_rows(per_rank: Sequence[Sequence[Sequence[float]]], size_bytes: float,
              topology: Topology) -> list[StepRow]:
    """Combine :func:`ring_step_traces`' results (per rank, per repeat, per step) with
    :func:`model_ring_steps`."""
    world_size = len(per_rank)
    model = model_ring_steps(size_bytes, world_size, topology)
    repeats = len(per_rank[0])
    # finish[i][k]: repeat i, step k: the slowest rank's finish
    finish = [[max(per_rank[r][i][k] for r in range(world_size)) for k in range(len(model))]
              for i in range(repeats)]
    rows = []
    for m in model:
        k = m.step
        median_finish = statistics.median(f[k] for f in finish)
        durations = [f[k] - (f[k - 1] if k else 0.0) for f in finish]
        late = [max(range(world_size), key=lambda r, i=i: per_rank[r][i][k])
                for i in range(repeats)]
        rows.append(StepRow(k, m.phase, median_finish, m.finish, statistics.median(durations),
                            m.duration, m.waited_for, statistics.mode(late)))
    return rows


def trace_ring_steps(settings: TopologySettings = CHAPTER_SETTINGS,
                     nodes: int = CHAPTER_TRACE_NODES, timeout: float = 300.0
                     ) -> list[StepRow]:
    """One launch of ``nodes x settings.node_size`` ranks on the topology: the flat lock-step
    ring of ``settings.size_bytes``, step by step, measured beside the model."""
    if isinstance(nodes, bool) or not isinstance(nodes, int) or nodes < 1 \
            or nodes * settings.node_size > MAX_WORLD_SIZE:
        raise ValueError(f"nodes must be an int >= 1 with nodes x node_size <= "
                         f"{MAX_WORLD_SIZE}, got {nodes!r}.")
    n = nodes * settings.node_size
    per_rank = launch(ring_step_traces, n, args=(settings.size_bytes, settings.repeats),
                      link=settings.topology, device="cpu", echo=False, timeout=timeout)
    return step_rows(per_rank, settings.size_bytes, settings.topology)


def step_table(rows: Sequence[StepRow]) -> str:
    """Per step: the phase, measured and modelled durations (ms), and the hop waited for."""
    body = [[r.step, r.phase.value, f"{1e3 * r.measured:.1f}", f"{1e3 * r.model:.1f}",
             f"{r.measured / r.model:.2f}" if r.model else "-", r.waited_for.value,
             r.slowest_rank] for r in rows]
    return format_table(["step", "phase", "measured (ms)", "model (ms)", "measured / model",
                         "waits for", "last rank (measured)"], body)


# --- bytes across nodes -------------------------------------------------------------------------


def across_worker(rank: int, world_size: int, node_size: int, numel: int
                  ) -> dict[TopologyAlgorithm, int]:
    """The bytes this rank sends to other nodes in one flat ring and one hierarchical
    all-reduce of ``numel`` float32 elements (a Recorder that knows the nodes counts them)."""
    groups = HierarchicalGroups.build(node_size)
    sent = {}
    for algorithm in TopologyAlgorithm:
        tensor = torch.ones(numel)
        recorder = Recorder(node_size=node_size)
        if algorithm is TopologyAlgorithm.FLAT_RING:
            ring_all_reduce(tensor, recorder=recorder)
        elif algorithm is TopologyAlgorithm.MULTI_RING:
            multi_ring_all_reduce(tensor, node_size=node_size, recorder=recorder)
        else:
            hierarchical_all_reduce(tensor, node_size, recorder=recorder, groups=groups)
        sent[algorithm] = recorder.stats.bytes_sent_across_nodes
    return sent


def across_table(per_rank: Sequence[dict[TopologyAlgorithm, int]], node_size: int, numel: int
                 ) -> tuple[str, bool]:
    """Per rank: bytes sent to other nodes by each algorithm, measured and closed form
    (:func:`labs.cost_model.bytes_across_nodes`); and whether every one matches."""
    n = len(per_rank)
    model = {a: bytes_across_nodes(a, numel, 4, n, node_size) for a in TopologyAlgorithm}
    rows = [[r, *(f"{got[a]:,} / {model[a][r]:,}" for a in TopologyAlgorithm)]
            for r, got in enumerate(per_rank)]
    matches = all(got[a] == model[a][r] for r, got in enumerate(per_rank)
                  for a in TopologyAlgorithm)
    table = format_table(["rank", *(f"{a.value}: measured / model (B)" for a in TopologyAlgorithm)],
                         rows)
    return table, matches
