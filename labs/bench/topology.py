"""``python -m labs.bench topology``: the flat ring against the hierarchical all-reduce on an
emulated :class:`labs.Topology` (nodes of ``node_size`` ranks, the inter-node link 10x slower
than the intra-node one), measured and modelled (:func:`labs.cost_model.predict_on_topology`),
with the same two all-reduces on the real loopback transport beside them. Both run lock-step
(``segment_bytes=None``), the schedule the closed forms describe.

:func:`ring_step_trace` is the chapter's step-by-step view: when each rank finishes each step
of the flat ring, measured, beside :func:`labs.cost_model.ring_step_times`.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from labs.collectives import HierarchicalGroups, hierarchical_all_reduce, ring_all_reduce
from labs.cost_model import TopologyAlgorithm, predict_on_topology
from labs.experiments.timing import format_size, parse_size
from labs.launcher import launch
from labs.link import Link, Topology
from labs.p2p import Peers
from labs.tables import format_table


@dataclass(frozen=True)
class TopologyBenchSettings:
    """One run of the benchmark: ``nodes`` counts of nodes of ``node_size`` ranks, an
    all-reduce of ``size_bytes`` (float32), ``repeats`` timed calls of each algorithm."""

    nodes: tuple[int, ...] = (2, 4, 8)
    node_size: int = 2
    size_bytes: int = 16 << 20
    intra: Link = Link(alpha=1e-3, bandwidth=500e6)
    inter: Link = Link(alpha=1e-3, bandwidth=50e6)
    repeats: int = 3
    loopback: bool = True  #: also time both on the real transport

    def __post_init__(self) -> None:
        if not self.nodes or any(isinstance(n, bool) or not isinstance(n, int) or n < 1
                                 for n in self.nodes):
            raise ValueError(f"nodes must be counts >= 1, got {self.nodes!r}; e.g. (2, 4, 8).")
        if isinstance(self.node_size, bool) or not isinstance(self.node_size, int) \
                or self.node_size < 1 or max(self.nodes) * self.node_size > 32:
            raise ValueError(f"node_size must be an int >= 1 with nodes x node_size <= 32 "
                             f"ranks, got {self.node_size!r} x {max(self.nodes)}.")
        if isinstance(self.size_bytes, bool) or not isinstance(self.size_bytes, int) \
                or self.size_bytes < 4 or self.size_bytes % 4:
            raise ValueError(f"size_bytes must be a multiple of 4 (float32), got "
                             f"{self.size_bytes!r}.")
        if isinstance(self.repeats, bool) or not isinstance(self.repeats, int) \
                or self.repeats < 1:
            raise ValueError(f"repeats must be an int >= 1, got {self.repeats!r}.")

    @property
    def topology(self) -> Topology:
        return Topology(self.node_size, self.intra, self.inter)


def time_both(rank: int, world_size: int, node_size: int, nbytes: int, repeats: int
              ) -> dict[TopologyAlgorithm, list[float]]:
    """Worker: seconds of each call of each algorithm on this rank, from a barrier."""
    groups = HierarchicalGroups.build(node_size)
    out: dict[TopologyAlgorithm, list[float]] = {}
    for algorithm in TopologyAlgorithm:
        times = []
        for _ in range(repeats):
            tensor = torch.full((nbytes // 4,), float(rank))
            dist.barrier()
            start = time.monotonic()
            if algorithm is TopologyAlgorithm.FLAT_RING:
                ring_all_reduce(tensor, segment_bytes=None)
            else:
                hierarchical_all_reduce(tensor, node_size, groups=groups, segment_bytes=None)
            times.append(time.monotonic() - start)
            if float(tensor.min()) != float(tensor.max()) or \
                    float(tensor[0]) != sum(range(world_size)):
                raise AssertionError(f"rank {rank}: {algorithm.value} gave a wrong sum")
        out[algorithm] = times
    return out


def _slowest(per_rank: list[dict[TopologyAlgorithm, list[float]]],
             algorithm: TopologyAlgorithm) -> float:
    """The median over repeats of the slowest rank's time."""
    return statistics.median(max(t) for t in zip(*(r[algorithm] for r in per_rank),
                                                  strict=True))


def topology_table(settings: TopologyBenchSettings) -> str:
    """Run the benchmark and return its table (seconds per all-reduce)."""
    flat, hier = TopologyAlgorithm.FLAT_RING, TopologyAlgorithm.HIERARCHICAL
    rows = []
    for nodes in settings.nodes:
        n = nodes * settings.node_size
        args = (settings.node_size, settings.size_bytes, settings.repeats)
        on_link = launch(time_both, n, args=args, link=settings.topology, echo=False,
                         timeout=600)
        measured = {a: _slowest(on_link, a) for a in TopologyAlgorithm}
        model = {a: predict_on_topology(a, settings.size_bytes, n, settings.topology)
                 for a in TopologyAlgorithm}
        row = [nodes, n, f"{measured[flat]:.3f}", f"{model[flat]:.3f}",
               f"{measured[hier]:.3f}", f"{model[hier]:.3f}",
               f"{measured[flat] / measured[hier]:.2f}x", f"{model[flat] / model[hier]:.2f}x"]
        if settings.loopback:
            real = launch(time_both, n, args=args, echo=False, timeout=600)
            row += [f"{_slowest(real, flat):.4f}", f"{_slowest(real, hier):.4f}"]
        rows.append(row)
    headers = ["nodes", "ranks", "flat (s)", "flat model", "hier. (s)", "hier. model",
               "speed-up", "model speed-up"]
    if settings.loopback:
        headers += ["loopback flat (s)", "loopback hier. (s)"]
    return format_table(headers, rows)


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


def add_topology_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``topology`` on ``python -m labs.bench``."""
    p = sub.add_parser("topology", help="flat ring vs hierarchical all-reduce on a Topology")
    p.add_argument("--nodes", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--node-size", type=int, default=2)
    p.add_argument("--size", default="16M", help="all-reduce size, e.g. 16M")
    p.add_argument("--intra-bandwidth", type=float, default=500e6, help="bytes/s in a node")
    p.add_argument("--inter-bandwidth", type=float, default=50e6, help="bytes/s across nodes")
    p.add_argument("--alpha", type=float, default=1e-3, help="latency of both links, seconds")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--no-loopback", action="store_true")


def topology_main(opts: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """Parse into :class:`TopologyBenchSettings`, run, print the table."""
    try:
        settings = TopologyBenchSettings(
            nodes=tuple(opts.nodes), node_size=opts.node_size, size_bytes=parse_size(opts.size),
            intra=Link(opts.alpha, opts.intra_bandwidth),
            inter=Link(opts.alpha, opts.inter_bandwidth), repeats=opts.repeats,
            loopback=not opts.no_loopback)
    except ValueError as err:
        parser.error(str(err))
    print(f"all-reduce of {format_size(settings.size_bytes)} float32, nodes of "
          f"{settings.node_size}; intra {settings.intra}, inter {settings.inter}; lock-step; "
          f"median of {settings.repeats} of the slowest rank")
    print(topology_table(settings))
