"""Chapter 8's topology figures: the flat ring step by step (measured beside the port model,
each step coloured by the hop it waited for), the flat all-reduce (one ring, and g channels)
against the hierarchical one across node counts, and the map of where the hierarchy wins over
a grid of network latencies and bandwidths."""

from __future__ import annotations

import math
from collections.abc import Sequence

import matplotlib.pyplot as plt
from matplotlib.figure import Figure
from matplotlib.patches import Patch, Rectangle

from labs.cost_model import TopologyAlgorithm
from labs.experiments.topology import GridPoint, StepRow, TopologyRow
from labs.link import LinkKind

#: Colour of a step by the hop it waited for.
_HOP_COLOURS = {LinkKind.INTRA: "tab:blue", LinkKind.INTER: "tab:red"}
_ALGORITHM_COLOURS = {TopologyAlgorithm.FLAT_RING: "tab:red",
                      TopologyAlgorithm.MULTI_RING: "tab:orange",
                      TopologyAlgorithm.HIERARCHICAL: "tab:green"}


def plot_ring_steps(rows: Sequence[StepRow], title: str = "") -> Figure:
    """One pair of bars per step of the flat ring (from
    :func:`labs.experiments.topology.trace_ring_steps`): the measured duration (solid,
    coloured by the hop the model says the step waited for) and the model's (hatched
    outline), in milliseconds."""
    fig, ax = plt.subplots(figsize=(max(5.0, 0.55 * len(rows) + 2.0), 3.2))
    steps = [r.step for r in rows]
    width = 0.4
    ax.bar([s - width / 2 for s in steps], [1e3 * r.measured for r in rows], width,
           color=[_HOP_COLOURS[r.waited_for] for r in rows], label="measured")
    ax.bar([s + width / 2 for s in steps], [1e3 * r.model for r in rows], width,
           fill=False, hatch="//", edgecolor=[_HOP_COLOURS[r.waited_for] for r in rows],
           label="model")
    if rows:
        boundary = next((r.step for r in rows if r.phase is not rows[0].phase), None)
        if boundary is not None:
            ax.axvline(boundary - 0.5, color="0.5", linestyle=":", linewidth=1)
            top = max(1e3 * max(r.measured, r.model) for r in rows)
            ax.text(boundary - 0.6, top, rows[0].phase.value, ha="right", va="top",
                    fontsize=8, color="0.4")
            ax.text(boundary - 0.4, top, rows[boundary].phase.value, ha="left", va="top",
                    fontsize=8, color="0.4")
    handles = [Patch(facecolor=_HOP_COLOURS[k], label=f"measured, waits for {k.value} hop")
               for k in LinkKind if any(r.waited_for is k for r in rows)]
    handles.append(Patch(fill=False, hatch="//", edgecolor="0.3", label="model"))
    ax.legend(handles=handles, fontsize=8, loc="lower right")
    ax.set_xticks(steps)
    ax.set_xlabel("ring step")
    ax.set_ylabel("duration (ms)")
    ax.set_title(title or "Flat ring, step by step: every step waits for its slowest hop",
                 fontsize=10)
    fig.tight_layout()
    return fig


def plot_flat_vs_hierarchical(rows: Sequence[TopologyRow], title: str = "") -> Figure:
    """Seconds per all-reduce against the number of nodes (from
    :func:`labs.experiments.topology.measure_topology`): the median of the slowest rank as a
    dot with the range over calls as an error bar, the model as a dashed line through a
    horizontal mark at each node count."""
    fig, ax = plt.subplots(figsize=(7.5, 3.4))
    nodes = [r.nodes for r in rows]
    for algorithm in TopologyAlgorithm:
        colour = _ALGORITHM_COLOURS[algorithm]
        medians = [r.median(algorithm) for r in rows]
        low = [m - min(r.measured[algorithm]) for m, r in zip(medians, rows, strict=True)]
        high = [max(r.measured[algorithm]) - m for m, r in zip(medians, rows, strict=True)]
        ax.errorbar(nodes, medians, yerr=[low, high], fmt="o", color=colour, capsize=3,
                    label=f"{algorithm.value}, measured")
        # A dashed line through the model's points, each marked too: with one node count
        # (a panel's single setting) there is no line to draw, only the mark.
        ax.plot(nodes, [r.model[algorithm] for r in rows], "--_", color=colour, alpha=0.7,
                markersize=18, markeredgewidth=2, label=f"{algorithm.value}, model")
    for r in rows:  # the hierarchy's speed-up over one ring / over g channels
        ax.annotate(f"{r.speedup:.2f}x faster than one ring\n"
                    f"{r.speedup_over_channels:.2f}x than g channels",
                    (r.nodes, r.median(TopologyAlgorithm.HIERARCHICAL)),
                    textcoords="offset points", xytext=(0, -30), fontsize=7, ha="center",
                    color=_ALGORITHM_COLOURS[TopologyAlgorithm.HIERARCHICAL])
    ax.set_xticks(nodes)
    ax.margins(x=0.3)  # room for the speed-ups written under the points
    ax.set_xlabel("nodes")
    ax.set_ylabel("seconds per all-reduce")
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0))
    ax.set_title(title or "Flat (one ring, g channels) vs hierarchical all-reduce", fontsize=10)
    fig.tight_layout()
    return fig


def plot_ratio_grid(grid: Sequence[Sequence[GridPoint]], measured: Sequence[GridPoint] = (),
                    title: str = "") -> Figure:
    """The model's time of the flat all-reduce over g channels over the hierarchical one's at
    every point of ``grid`` (from :func:`labs.experiments.topology.model_grid`: rows by the
    network's latency, columns by its bandwidth), as a heatmap with the ratio written in each
    cell; red where the hierarchy is faster (ratio above 1), blue where the channels are.
    Each point of ``measured`` (:func:`labs.experiments.topology.measure_grid`) is outlined,
    with the measured ratio under the model's."""
    alphas = [row[0].alpha for row in grid]
    bandwidths = [p.bandwidth for p in grid[0]]
    ratios = [[p.model_ratio for p in row] for row in grid]
    spread = max(abs(math.log(r)) for row in ratios for r in row) or 1.0
    fig, ax = plt.subplots(figsize=(6.0, 3.8))
    image = ax.imshow([[math.log(r) for r in row] for row in ratios], cmap="coolwarm",
                      vmin=-spread, vmax=spread, origin="lower", aspect="auto")
    timed = {(p.alpha, p.bandwidth): p for p in measured}
    for i, row in enumerate(grid):
        for j, point in enumerate(row):
            text = f"{point.model_ratio:.2f}"
            got = timed.get((point.alpha, point.bandwidth))
            if got is not None:
                text += f"\nmeasured {got.ratio:.2f}"
                ax.add_patch(Rectangle((j - 0.5, i - 0.5), 1, 1, fill=False, edgecolor="k",
                                       linewidth=2))
            ax.text(j, i, text, ha="center", va="center", fontsize=8)
    ax.set_xticks(range(len(bandwidths)), [f"{b / 1e6:g}" for b in bandwidths])
    ax.set_yticks(range(len(alphas)), [f"{1e3 * a:g}" for a in alphas])
    ax.set_xlabel("network bandwidth (MB/s per card)")
    ax.set_ylabel("network latency alpha_e (ms)")
    bar = fig.colorbar(image, ax=ax, ticks=[-spread, 0.0, spread])
    bar.ax.set_yticklabels([f"{math.exp(-spread):.2f}", "1", f"{math.exp(spread):.2f}"])
    bar.set_label("g channels / hierarchical (model)", fontsize=8)
    ax.set_title(title or "Time of the flat all-reduce over g channels / hierarchical",
                 fontsize=10)
    fig.tight_layout()
    return fig
