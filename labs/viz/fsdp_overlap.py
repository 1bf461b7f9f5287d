"""Chapter 7's FSDP step on the link: the settings' table and the step's timeline, measured
lanes above the model's; FSDP beside DDP as the link gets faster; labs' FSDP beside
``fully_shard`` on gloo's transport."""

from __future__ import annotations

import statistics
from collections.abc import Sequence

import matplotlib.pyplot as plt
from matplotlib.figure import Figure

from labs.experiments.fsdp_frontier import Curve, FrontierPoint
from labs.experiments.fsdp_overlap import OverlapRow
from labs.experiments.fully_shard_timing import ALONE, COMPUTE_ALONE, TransportRow
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


def frontier_table(points: Sequence[FrontierPoint]) -> str:
    """Each link: FSDP's and DDP's step (median, range), each one's model, busy time and wait
    for the wire, and FSDP's step over DDP's."""
    def ms(seconds: float) -> str:
        return f"{seconds * 1e3:.0f}"

    def step(values: Sequence[float]) -> str:
        return f"{ms(statistics.median(values))} ({ms(min(values))}-{ms(max(values))})"

    table = [[f"{p.link.bandwidth / 1e6:g}", step(p.fsdp_seconds), ms(p.fsdp_model()),
              ms(p.fsdp_busy), ms(p.fsdp_exposed), step(p.ddp_seconds), ms(p.ddp_model()),
              ms(p.ddp_busy), ms(p.ddp_exposed), f"{p.fsdp / p.ddp:.2f}"] for p in points]
    return format_table(["MB/s", "FSDP ms", "model", "busy", "wait", "DDP ms", "model",
                         "busy", "wait", "FSDP/DDP"], table)


def plot_frontier(points: Sequence[FrontierPoint], curve: Curve, crossover: float) -> Figure:
    """Left: step time against the link's bandwidth, both models (lines, from one point's
    compute), both measured steps (markers, with their range) and each model with its
    communication free (dotted). Right: FSDP's extra wait for the wire (its wait less DDP's),
    modelled and measured, beside 10 % of DDP's modelled step. The models' crossover is the
    vertical line on both."""
    fig, (ax, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    bands = [b / 1e6 for b in curve.bandwidths]
    x = [p.link.bandwidth / 1e6 for p in points]
    for name, model, free, colour, measured in (
            ("FSDP, prefetch 1", curve.fsdp, curve.fsdp_free, "tab:red",
             [p.fsdp_seconds for p in points]),
            ("DDP, a bucket per block", curve.ddp, curve.ddp_free, "tab:blue",
             [p.ddp_seconds for p in points])):
        ax.plot(bands, [m * 1e3 for m in model], color=colour, label=f"{name}: model")
        ax.axhline(free * 1e3, color=colour, linestyle=":", linewidth=1,
                   label=f"{name}: model, communication free")
        y = [statistics.median(s) * 1e3 for s in measured]
        err = [[m - min(s) * 1e3 for m, s in zip(y, measured, strict=True)],
               [max(s) * 1e3 - m for m, s in zip(y, measured, strict=True)]]
        ax.errorbar(x, y, yerr=err, fmt="o", color=colour, capsize=3,
                    label=f"{name}: measured (median, range)")
    extra = [((f - curve.fsdp_free) - (d - curve.ddp_free)) * 1e3
             for f, d in zip(curve.fsdp, curve.ddp, strict=True)]
    right.plot(bands, extra, color="tab:purple", label="model")
    right.plot(bands, [0.1 * d * 1e3 for d in curve.ddp], color="0.5", linestyle="--",
               linewidth=1, label="10 % of DDP's step (model)")
    right.plot(x, [(p.fsdp_exposed - p.ddp_exposed) * 1e3 for p in points], "o",
               color="tab:purple", label="measured")
    right.axhline(0, color="black", linewidth=0.6)
    for axis in (ax, right):
        axis.set_xscale("log")
        axis.set_xlabel(f"link bandwidth, MB/s (latency {points[0].link.alpha * 1e3:g} ms)")
        if crossover != float("inf"):
            axis.axvline(crossover / 1e6, color="0.4", linestyle="--", linewidth=1)
    if crossover != float("inf"):
        right.text(crossover / 1e6 * 1.08, max(extra) * 0.9,
                   f"models' crossover\n{crossover / 1e6:.0f} MB/s", fontsize=8, va="top")
    ax.set_ylabel("step, ms")
    ax.set_title("the steps", fontsize=10)
    ax.legend(fontsize=7, loc="upper right")
    right.set_yscale("symlog", linthresh=10)
    right.set_ylabel("FSDP's wait less DDP's, ms")
    right.set_title("FSDP's extra wait for the wire", fontsize=10)
    right.legend(fontsize=7, loc="upper right")
    fig.suptitle("FSDP beside DDP as the link gets faster (2 ranks, the same 4 blocks)",
                 fontsize=10)
    fig.tight_layout()
    return fig


def transport_table(rows: Sequence[TransportRow]) -> str:
    """Each setting on gloo's transport: its step (median, range) and the same less compute
    alone."""
    alone = {r.name: r for r in rows}
    compute = alone.get(COMPUTE_ALONE)
    table = []
    for r in rows:
        extra = "" if compute is None or r.name in ALONE \
            else f"{(r.median - compute.median) * 1e3:+.0f}"
        table.append([r.name, f"{r.median * 1e3:.0f} ({min(r.seconds) * 1e3:.0f}-"
                              f"{max(r.seconds) * 1e3:.0f})", extra])
    return format_table(["on gloo's transport, 2 ranks", "step ms (range)",
                         "ms beyond compute alone"], table)
