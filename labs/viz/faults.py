"""Chapter 9's figures: a step with one rank late (every rank on one clock: where the wait
goes), and stragglers' step times beside the expected largest delay."""

from __future__ import annotations

from collections.abc import Sequence

import matplotlib.pyplot as plt
from matplotlib.figure import Figure

from labs.experiments.stragglers import RankTimeline, StragglerRow


def plot_straggler_timeline(timelines: Sequence[RankTimeline], title: str = "") -> Figure:
    """One row per rank, in milliseconds since every rank left the same barrier: the delay a
    rank slept (grey), its forward and backward (orange), and each bucket's all-reduce from
    launch to completion (blue); a dashed line where its gradients were averaged."""
    fig, ax = plt.subplots(figsize=(9, 0.9 + 0.9 * len(timelines)), layout="constrained")
    ms = 1e3
    for row, t in enumerate(timelines):
        y = len(timelines) - 1 - row
        if t.late_s:
            ax.barh(y + 0.2, t.late_s * ms, left=0, height=0.3, color="0.75",
                    label="late (asleep)" if row == 1 or len(timelines) == 1 else None)
        ax.barh(y + 0.2, (t.backward[1] - t.forward[0]) * ms, left=t.forward[0] * ms,
                height=0.3, color="tab:orange", label="forward + backward" if row == 0 else None)
        for i, (start, end) in enumerate(t.allreduces):
            ax.barh(y - 0.2 + (0.08 if i % 2 else -0.08), (end - start) * ms, left=start * ms,
                    height=0.14, color="tab:blue", alpha=0.55 + 0.45 * (i % 2),
                    label="a bucket's all-reduce" if row == 0 and i == 0 else None)
        ax.plot([t.synchronised * ms] * 2, [y - 0.4, y + 0.4], "k--", lw=1,
                label="gradients averaged" if row == 0 else None)
    ax.set_yticks(range(len(timelines)),
                  [f"rank {t.rank}" + (f" ({t.late_s * ms:.0f} ms late)" if t.late_s else "")
                   for t in reversed(timelines)])
    ax.set_xlabel("milliseconds since the barrier")
    ax.grid(True, axis="x", alpha=0.3)
    ax.legend(fontsize="x-small", loc="upper right", ncol=2)
    if title:
        ax.set_title(title, fontsize="medium", loc="left")
    return fig


def plot_stragglers(rows: Sequence[StragglerRow], title: str = "") -> Figure:
    """Per world size: every step with delays (dots) and their mean (bar), beside the step
    without delays plus that step's largest delay (its mean) and plus mean x H_N."""
    fig, ax = plt.subplots(figsize=(7, 3.4), layout="constrained")
    ms = 1e3
    for i, r in enumerate(rows):
        ax.bar(i - 0.25, r.measured * ms, 0.25, color="tab:blue",
               label="measured (mean, and each step)" if i == 0 else None)
        ax.plot([i - 0.25] * len(r.delayed), [d * ms for d in r.delayed], "k.", ms=3)
        ax.bar(i, r.predicted * ms, 0.25, color="tab:green", alpha=0.7,
               label="without delays + each step's largest delay" if i == 0 else None)
        ax.bar(i + 0.25, r.expected * ms, 0.25, color="tab:gray", alpha=0.6,
               label="without delays + mean x H_N" if i == 0 else None)
        ax.plot([i - 0.4, i + 0.4], [r.without * ms] * 2, color="tab:red",
                lw=1.5, label="step without delays" if i == 0 else None)
    ax.set_xticks(range(len(rows)), [f"{r.world_size} ranks" for r in rows])
    ax.set_ylabel("step (ms)")
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize="x-small", loc="upper left")
    if title:
        ax.set_title(title, fontsize="medium", loc="left")
    return fig
