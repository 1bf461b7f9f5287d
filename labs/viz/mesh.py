"""Chapter 8's mesh figure: the ranks of a 2-D mesh in a grid, one row per node, with the
process groups of each mesh dimension drawn over them."""

from __future__ import annotations

from collections.abc import Sequence

import matplotlib.pyplot as plt
from matplotlib.figure import Figure
from matplotlib.patches import FancyBboxPatch

from labs.experiments.mesh import MeshReport, MeshSettings, measured_groups

#: Colours of the groups along mesh dim 0 (across nodes) and dim 1 (inside a node).
_ACROSS, _INSIDE = "tab:orange", "tab:blue"


def plot_mesh(settings: MeshSettings = MeshSettings(),
              reports: Sequence[MeshReport] | None = None, title: str = "") -> Figure:
    """The ``settings.shape[0] x settings.shape[1]`` ranks in a grid (row i = node i, column
    j = place in the node), a blue box round each group of dim 1 (the ranks of one node: where
    sharding, or tensor parallelism, goes) and an orange band through each group of dim 0
    (the same place in every node: the replicas). With ``reports`` (from
    :func:`labs.experiments.mesh.run_mesh`) the groups drawn are those the ranks measured by
    ``new_group``, and each rank is annotated with the DTensor rows it holds; without, those
    the layout gives (rows of the DTensor in green: copies along dim 0, split along dim 1)."""
    nodes, per_node = settings.shape
    across_name, inside_name = settings.dim_names
    if reports is not None:
        across = measured_groups(reports, across_name)
        inside = measured_groups(reports, inside_name)
        by_rank = {r.rank: r for r in reports}
    else:
        across, inside, by_rank = settings.groups(0), settings.groups(1), {}

    def where(rank: int) -> tuple[float, float]:
        i, j = settings.coordinate(rank)
        return 1.6 * j, -1.3 * i  # x: place in the node; y: node, top to bottom

    fig, ax = plt.subplots(figsize=(2.0 + 1.7 * per_node, 1.0 + 1.05 * nodes))
    for k, group in enumerate(across):  # a band joining the group's ranks, top to bottom
        xs, ys = zip(*(where(r) for r in group), strict=True)
        ax.plot(xs, ys, color=_ACROSS, linewidth=14, alpha=0.25, solid_capstyle="round",
                zorder=1, label=f'dim 0 "{across_name}": across nodes' if k == 0 else None)
        ax.text(xs[0], ys[0] + 0.68, "{" + ", ".join(map(str, group)) + "}", ha="center",
                va="bottom", fontsize=8, color=_ACROSS)
    for k, group in enumerate(inside):  # a box round the group
        xs, ys = zip(*(where(r) for r in group), strict=True)
        box = FancyBboxPatch((min(xs) - 0.58, min(ys) - 0.52), max(xs) - min(xs) + 1.16,
                             max(ys) - min(ys) + 1.04, boxstyle="round,pad=0.02,rounding_size=0.15",
                             fill=False, edgecolor=_INSIDE, linewidth=1.8, zorder=2,
                             label=f'dim 1 "{inside_name}": inside a node' if k == 0 else None)
        ax.add_patch(box)
    for i in range(nodes):
        ax.text(-0.85, -1.3 * i, f"node {i}", ha="right", va="center", fontsize=9)
    for rank in range(settings.world_size):
        x, y = where(rank)
        ax.add_patch(plt.Circle((x, y), 0.45, facecolor="white", edgecolor="0.2", zorder=3))
        ax.text(x, y + 0.15, f"rank {rank}", ha="center", va="center", fontsize=8, zorder=4)
        coordinate = settings.coordinate(rank)
        ax.text(x, y - 0.04, f"{coordinate}", ha="center", va="center", fontsize=7,
                color="0.35", zorder=4)
        report = by_rank.get(rank)
        if report is not None and report.dtensor is not None:
            held = report.dtensor.rows_held
            rows = f"rows {held[0]}-{held[-1]}" if held else "no rows"
            ax.text(x, y - 0.23, rows, ha="center", va="center", fontsize=7, color="tab:green",
                    zorder=4)
    ax.set_xlim(-2.0, 1.6 * (per_node - 1) + 1.3)
    ax.set_ylim(-1.3 * (nodes - 1) - 0.8, 1.1)
    ax.set_aspect("equal")
    ax.axis("off")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, 0.0), ncol=1, frameon=False, fontsize=8)
    ax.set_title(title or f"{settings.world_size} ranks as a {nodes} x {per_node} mesh "
                 f"({across_name!r}, {inside_name!r})", fontsize=10)
    fig.tight_layout()
    return fig
