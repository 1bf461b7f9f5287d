"""Chapter 7's FSDP step on the link: the settings' table and the step's timeline, measured
lanes above the model's."""

from __future__ import annotations

from collections.abc import Sequence

import matplotlib.pyplot as plt
from matplotlib.figure import Figure

from labs.experiments.fsdp_overlap import OverlapRow
from labs.fsdp_timeline import Activity
from labs.tables import format_table

_COLOURS = {
    Activity.FORWARD.value: "tab:blue",
    Activity.BACKWARD.value: "tab:orange",
    Activity.ALL_GATHER.value: "tab:green",
    Activity.REDUCE_SCATTER.value: "tab:red",
}
_MIB = 2 ** 20


def overlap_table(rows: Sequence[OverlapRow]) -> str:
    """Each setting: the measured step (median, range), the model's, their ratio, the busy
    time, the exposed communication and rank 0's peak."""
    table = [[str(r.prefetch), "on" if r.reshard else "off",
              f"{r.measured * 1e3:.0f} ({min(r.seconds) * 1e3:.0f}-{max(r.seconds) * 1e3:.0f})",
              f"{r.prediction.step * 1e3:.0f}", f"{r.ratio:.2f}", f"{r.busy * 1e3:.0f}",
              f"{r.exposed * 1e3:.0f}", f"{r.peak_bytes / _MIB:.1f}"] for r in rows]
    return format_table(["prefetch", "reshard after forward", "step ms (range)", "model ms",
                         "model / measured", "busy ms", "exposed ms", "peak MiB"], table)


def plot_step_timelines(rows: Sequence[OverlapRow]) -> Figure:
    """One panel per row: rank 0's median step (compute lane, stream lane) above the model's
    step (the same two lanes, hatched), on one time axis."""
    fig, axes = plt.subplots(len(rows), 1, figsize=(9, 1.9 * len(rows) + 0.6), sharex=True,
                             squeeze=False)
    for ax, row in zip(axes[:, 0], rows, strict=True):
        lanes = [("measured: compute", [s for s in row.spans if s[1] in (
                     Activity.FORWARD.value, Activity.BACKWARD.value)], None),
                 ("measured: stream", [s for s in row.spans if s[1] in (
                     Activity.ALL_GATHER.value, Activity.REDUCE_SCATTER.value)], None),
                 ("model: compute", list(row.prediction.compute), "//"),
                 ("model: stream", list(row.prediction.stream), "//")]
        for y, (_, spans, hatch) in enumerate(lanes):
            for unit, what, start, end in spans:
                ax.barh(len(lanes) - 1 - y, (end - start) * 1e3, left=start * 1e3, height=0.7,
                        color=_COLOURS[what], edgecolor="black", linewidth=0.4, hatch=hatch,
                        alpha=0.85 if hatch is None else 0.55)
                if (end - start) * 1e3 > 9:
                    ax.text((start + end) / 2 * 1e3, len(lanes) - 1 - y, unit, ha="center",
                            va="center", fontsize=7)
        ax.axvline(row.measured * 1e3, color="black", linewidth=1)
        ax.axvline(row.prediction.step * 1e3, color="black", linewidth=1, linestyle="--")
        ax.set_yticks(range(len(lanes)), [name for name, _, _ in reversed(lanes)], fontsize=8)
        ax.set_title(f"{row.label}: measured {row.measured * 1e3:.0f} ms (solid line), model "
                     f"{row.prediction.step * 1e3:.0f} ms (dashed)", fontsize=9)
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in _COLOURS.values()]
    axes[0, 0].legend(handles, list(_COLOURS), ncol=4, fontsize=8, loc="lower center",
                      bbox_to_anchor=(0.5, 1.25))
    axes[-1, 0].set_xlabel("ms from the step's start (rank 0's median step; the unit's index "
                           "on each bar)")
    fig.tight_layout()
    return fig
