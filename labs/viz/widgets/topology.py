"""Chapter 8's widget panel: the flat ring and the hierarchical all-reduce on an emulated
topology, by node count and how much slower the link between nodes is.

A panel with ranks behind it is a :func:`labs.viz.recorded.recorded_panel`: its cell records a
small grid of settings for the rendered book, and its button runs the chosen one on new ranks.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence

import ipywidgets as w
import matplotlib.pyplot as plt
from IPython.display import display

from labs.experiments.timing import format_size
from labs.experiments.topology import (
    TopologyRow,
    TopologySettings,
    measure_topology,
    topology_table,
)
from labs.link import Link
from labs.viz.recorded import Choice, recorded_panel
from labs.viz.topology import plot_flat_vs_hierarchical


def show_topology_run(settings: TopologySettings) -> None:
    """Both all-reduces on real ranks over the emulated topology: the table and the figure."""
    start = time.perf_counter()
    rows = measure_topology(settings)
    print(f"measured in {time.perf_counter() - start:.1f} s on real ranks")
    _show_topology_rows(settings, rows)


def _show_topology_rows(settings: TopologySettings, rows: Sequence[TopologyRow]) -> None:
    print(f"{settings.size_bytes / 2**20:g} MiB all-reduced on nodes of {settings.node_size}: "
          f"intra {settings.intra.bandwidth / 1e6:g} MB/s, inter "
          f"{settings.inter.bandwidth / 1e6:g} MB/s")
    print(topology_table(rows))
    fig = plot_flat_vs_hierarchical(rows)
    display(fig)
    plt.close(fig)


def topology_panel(settings: TopologySettings | None = None, ratios: Sequence[int] = (1, 10),
                   measured: dict[int, Sequence[TopologyRow]] | None = None) -> None:
    """Nodes (``settings.nodes``) and how much slower the link between nodes is than the
    node's own (``ratios``) -> the flat ring and the hierarchical all-reduce on real ranks,
    measured beside the model, switched in the browser. ``measured`` holds the rows of any
    ratio the chapter has timed already (:func:`labs.experiments.topology.measure_topology`
    of ``settings`` at that ratio); the other ratios are measured here. The button runs the
    chosen setting again at the size beside it."""
    base = settings or TopologySettings(nodes=(2, 4), size_bytes=2 << 20,
                                        intra=Link(1e-3, 50e6), inter=Link(1e-3, 5e6))

    def at(ratio: int, node_counts: Sequence[int], size: int) -> TopologySettings:
        inter = Link(base.inter.alpha, base.intra.bandwidth / ratio)
        return dataclasses.replace(base, nodes=tuple(node_counts), size_bytes=size,
                                   inter=inter)

    rows = {ratio: list((measured or {}).get(ratio) or measure_topology(
        at(ratio, base.nodes, base.size_bytes))) for ratio in ratios}
    for ratio, got in rows.items():
        if sorted(r.nodes for r in got) != sorted(base.nodes):
            raise ValueError(f"the rows at ratio {ratio} are for nodes "
                             f"{sorted(r.nodes for r in got)}, the panel's settings for "
                             f"{sorted(base.nodes)}: measure the same settings.")

    def render(count: int, ratio: int) -> None:
        row = next(r for r in rows[ratio] if r.nodes == count)
        _show_topology_rows(at(ratio, (count,), base.size_bytes), [row])

    sizes = sorted({1 << 20, 2 << 20, 4 << 20, 16 << 20, base.size_bytes})
    size = w.Dropdown(options=[(format_size(b), b) for b in sizes], value=base.size_bytes,
                      description="size")
    default_ratio = round(base.intra.bandwidth / base.inter.bandwidth)
    recorded_panel(
        [Choice("nodes", tuple((str(n), n) for n in base.nodes), base.nodes[0]),
         Choice("intra / inter", tuple((f"{r}x", r) for r in ratios),
                default_ratio if default_ratio in ratios else None)],
        render, live=lambda count, ratio: show_topology_run(at(ratio, (count,), size.value)),
        live_controls=[size])
