"""Chapters 3 and 4: tables and figures of what a rank holds, from the snapshots of
:class:`labs.memory.MemoryTimeline` and the allocations an
:class:`labs.memory.AllocationTracker` saw."""

from __future__ import annotations

from collections.abc import Sequence

import matplotlib.pyplot as plt
from matplotlib.figure import Figure

from labs.memory import Allocation, MemorySnapshot
from labs.tables import format_table


def memory_table(per_rank: Sequence[Sequence[MemorySnapshot]], ranks: Sequence[int] = (0,),
                 ) -> str:
    """A text table of the snapshots of the given ranks: elements and bytes per group,
    transient bytes and the total."""
    groups = _groups(per_rank)
    header = ["rank", "moment", *(f"{g} (elements)" for g in groups), "held bytes",
              "allocated during (peak bytes)", "total bytes"]
    rows = []
    for rank in ranks:
        for snap in per_rank[rank]:
            elements = snap.elements_by_group()
            rows.append([rank, snap.moment, *(elements.get(g, "") for g in groups),
                         snap.held_bytes, snap.transient_bytes or "", snap.total_bytes])
    return format_table(header, rows)


def describe_allocations(allocations: Sequence[Allocation]) -> str:
    """``"empty 840 B x2, clone 840 B"``: the storages a tracker saw, grouped by operator and
    size in the order each kind first appeared."""
    counts: dict[tuple[str, int], int] = {}
    for a in allocations:
        counts[(a.op, a.nbytes)] = counts.get((a.op, a.nbytes), 0) + 1
    if not counts:
        return "nothing"
    return ", ".join(f"{op} {nbytes} B" + (f" x{k}" if k > 1 else "")
                     for (op, nbytes), k in counts.items())


def _groups(per_rank: Sequence[Sequence[MemorySnapshot]]) -> list[str]:
    groups: list[str] = []
    for snaps in per_rank:
        for snap in snaps:
            for t in snap.tensors:
                if t.group not in groups:
                    groups.append(t.group)
    return groups


def _unit(nbytes: float) -> tuple[float, str]:
    for scale, name in ((1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB")):
        if nbytes >= scale:
            return float(scale), name
    return 1.0, "bytes"


def plot_memory_timeline(per_rank: Sequence[Sequence[MemorySnapshot]], *, title: str = "",
                         ) -> Figure:
    """Bars per moment and rank (rank 0 leftmost, each bar numbered with its rank under it),
    stacked by registration group, with a moment's transient peak (from an
    :class:`~labs.memory.AllocationTracker`) hatched on top. Every rank must have recorded the
    same moments."""
    if not per_rank or not per_rank[0]:
        raise ValueError("nothing to plot: pass one sequence of snapshots per rank")
    moments = [s.moment for s in per_rank[0]]
    for rank, snaps in enumerate(per_rank):
        if [s.moment for s in snaps] != moments:
            raise ValueError(f"rank {rank} recorded other moments than rank 0; plot each "
                             "rank's timeline separately")
    groups = _groups(per_rank)
    colours = {g: plt.get_cmap("tab10")(i % 10) for i, g in enumerate(groups)}
    scale, unit = _unit(max(s.total_bytes for snaps in per_rank for s in snaps))
    width = 0.8 / len(per_rank)
    fig, ax = plt.subplots(figsize=(max(6.0, 1.7 * len(moments)), 3.6), layout="constrained")
    labelled: set[str] = set()

    def bar(x: float, bottom: float, height: float, label: str, **style: object) -> None:
        ax.bar(x, height / scale, width * 0.92, bottom=bottom / scale, linewidth=0.6,
               label=None if label in labelled else label, **style)
        labelled.add(label)

    rank_ticks: list[float] = []
    for m in range(len(moments)):
        for rank, snaps in enumerate(per_rank):
            x, bottom = m - 0.4 + width * (rank + 0.5), 0.0
            rank_ticks.append(x)
            by_group = snaps[m].bytes_by_group()
            for group in groups:
                if by_group.get(group):
                    bar(x, bottom, by_group[group], group, color=colours[group],
                        edgecolor="black")
                    bottom += by_group[group]
            if snaps[m].transient_bytes:
                bar(x, bottom, snaps[m].transient_bytes, "allocated during (peak)",
                    color="white", edgecolor="gray", hatch="//")
    # Two rows of labels: each bar's rank (minor ticks) and, under them, the moment. A middle
    # bar sits on its moment's tick, which matplotlib would otherwise let hide its rank.
    ax.xaxis.remove_overlapping_locs = False
    ax.set_xticks(rank_ticks, [str(r) for _ in moments for r in range(len(per_rank))],
                  minor=True, fontsize="x-small")
    ax.set_xticks(range(len(moments)), [m.replace(" ", "\n", 1) for m in moments],
                  fontsize="small")
    ax.tick_params(axis="x", which="major", length=0, pad=14)
    ax.tick_params(axis="x", which="minor", length=2, pad=2)
    n = len(per_rank)
    ax.set(xlabel="moment; the number under each bar is its rank",
           ylabel=f"tensor storage held ({unit})",
           title=title or f"Per-rank memory, {n} rank{'s' if n > 1 else ''} (one bar each)")
    handles, labels = ax.get_legend_handles_labels()
    order = sorted(range(len(labels)), key=lambda i: (labels[i] not in groups,
                                                      groups.index(labels[i])
                                                      if labels[i] in groups else 0))
    ax.legend([handles[i] for i in order], [labels[i] for i in order], fontsize="small",
              loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    return fig
