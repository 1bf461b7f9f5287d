"""``python -m labs.bench topology``: the flat all-reduce (one ring, and one ring per network
card as NCCL's channels) against the hierarchical one on an emulated :class:`labs.Topology`
(nodes of ``node_size`` ranks, the inter-node link 10x slower than the intra-node one),
measured and modelled (:func:`labs.cost_model.predict_on_topology`), with the same all-reduces
on the real loopback transport beside them. All run lock-step, the schedule the closed forms
describe. ``--grid`` instead times every cell of chapter 8's map of the network's latency and
bandwidth (:class:`labs.experiments.topology.GridSettings`), of which the chapter times four.

The settings, the worker and the table are chapter 8's (:mod:`labs.experiments.topology`);
this module parses the command line into them.
"""

from __future__ import annotations

import argparse

from labs.experiments.timing import format_size, parse_size
from labs.experiments.topology import (
    GridSettings,
    TopologySettings,
    grid_table,
    measure_grid,
    measure_topology,
    topology_table,
)
from labs.link import Link


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
    p.add_argument("--grid", action="store_true",
                   help="time every cell of chapter 8's latency x bandwidth grid instead "
                        "(flat over g channels / hierarchical, 4 nodes of 2, 2 MiB)")


def topology_main(opts: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """Parse into :class:`~labs.experiments.topology.TopologySettings`, run, print the
    table; with ``--grid``, every cell of :class:`~labs.experiments.topology.GridSettings`."""
    if opts.grid:
        base = GridSettings()
        try:
            grid = GridSettings(repeats=opts.repeats, measured=tuple(
                (a, b) for a in base.inter_alphas for b in base.inter_bandwidths))
        except ValueError as err:
            parser.error(str(err))
        print(f"all-reduce of {format_size(grid.size_bytes)} float32, {grid.nodes} nodes of "
              f"{grid.node_size}; intra {grid.intra}; every cell of the grid; fastest of "
              f"{grid.repeats} of the slowest rank")
        print(grid_table(measure_grid(grid)))
        return
    try:
        settings = TopologySettings(
            nodes=tuple(opts.nodes), node_size=opts.node_size, size_bytes=parse_size(opts.size),
            intra=Link(opts.alpha, opts.intra_bandwidth),
            inter=Link(opts.alpha, opts.inter_bandwidth), repeats=opts.repeats,
            loopback=not opts.no_loopback)
    except ValueError as err:
        parser.error(str(err))
    print(f"all-reduce of {format_size(settings.size_bytes)} float32, nodes of "
          f"{settings.node_size}; intra {settings.intra}, inter {settings.inter}; lock-step; "
          f"median of {settings.repeats} of the slowest rank")
    print(topology_table(measure_topology(settings)))
