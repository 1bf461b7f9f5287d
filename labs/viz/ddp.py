"""Chapter 5's tables and figures: step times, the bucket-size sweep, the backward timeline
(a Gantt chart), gradient accumulation, the DistributedSampler and the training loss."""

from __future__ import annotations

from collections.abc import Sequence

import matplotlib.pyplot as plt
from matplotlib.figure import Figure

from labs.experiments.ddp import (
    AccumulationRow,
    BackwardTimeline,
    SamplerView,
    Span,
    StepTimeRow,
    cap_text,
)
from labs.tables import format_table
from labs.wrappers import Wrapper

_COLOURS = {
    Wrapper.LOCAL: "tab:gray",
    Wrapper.NAIVE: "tab:red",
    Wrapper.DDP: "tab:blue",
    Wrapper.TORCH_DDP: "tab:green",
}


def step_time_table(rows: Sequence[StepTimeRow]) -> str:
    """Median step time per case, the all-reduces per step, and the ratio to torch DDP."""
    torch_rows = {r.case.bucket_cap_mb: r.seconds for r in rows
                  if r.case.wrapper is Wrapper.TORCH_DDP}
    table = []
    for r in rows:
        reference = torch_rows.get(r.case.bucket_cap_mb)
        bucketed = r.case.wrapper in (Wrapper.DDP, Wrapper.TORCH_DDP)
        ratio = f"{r.seconds / reference:.2f}x" if reference and bucketed else "-"
        table.append([r.case.label, f"{r.seconds * 1e3:.1f}", r.buckets, ratio])
    return format_table(["implementation", "ms per step", "all-reduces per step",
                         "/ torch DDP at that cap"], table)


def plot_step_times(rows: Sequence[StepTimeRow], title: str = "") -> Figure:
    """One bar per case: milliseconds per training step (slowest rank, median)."""
    fig, ax = plt.subplots(figsize=(7, 0.5 + 0.45 * len(rows)), layout="constrained")
    labels = [r.case.label for r in rows]
    values = [r.seconds * 1e3 for r in rows]
    ax.barh(labels, values, color=[_COLOURS[r.case.wrapper] for r in rows])
    for y, (value, row) in enumerate(zip(values, rows, strict=True)):
        ax.text(value, y, f" {value:.1f} ms, {row.buckets} all-reduce(s)", va="center",
                fontsize="small")
    ax.invert_yaxis()
    ax.set(xlabel="milliseconds per step", title=title or "Step time")
    ax.set_xlim(0, max(values) * 1.45)
    ax.grid(True, axis="x", alpha=0.3)
    return fig


def plot_bucket_sweep(rows: Sequence[StepTimeRow], title: str = "") -> Figure:
    """Step time against bucket cap for labs' DDP and torch's, with NaiveDDP and the
    no-communication floor as horizontal lines."""
    fig, ax = plt.subplots(figsize=(7, 3.4), layout="constrained")
    for impl in (Wrapper.DDP, Wrapper.TORCH_DDP):
        mine = sorted((r for r in rows if r.case.wrapper is impl),
                      key=lambda r: r.case.bucket_cap_mb)
        caps = [r.case.bucket_cap_mb for r in mine]
        ax.plot(caps, [r.seconds * 1e3 for r in mine], "o-", color=_COLOURS[impl],
                label=impl.value)
        for r in mine:
            ax.annotate(str(r.buckets), (r.case.bucket_cap_mb, r.seconds * 1e3),
                        textcoords="offset points", xytext=(0, 6), ha="center",
                        fontsize="x-small", color=_COLOURS[impl])
    for impl, style in ((Wrapper.NAIVE, "--"), (Wrapper.LOCAL, ":")):
        for r in rows:
            if r.case.wrapper is impl:
                ax.axhline(r.seconds * 1e3, ls=style, color=_COLOURS[impl],
                           label=f"{impl.value} ({r.buckets} all-reduces)")
    ax.set_xscale("log", base=2)
    caps = sorted({r.case.bucket_cap_mb for r in rows
                   if r.case.wrapper in (Wrapper.DDP, Wrapper.TORCH_DDP)})
    ax.set_xticks(caps, [cap_text(c) for c in caps])
    ax.minorticks_off()
    ax.set(xlabel="bucket_cap_mb (log scale); numbers: buckets per step",
           ylabel="milliseconds per step", title=title or "Bucket size sweep")
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="small")
    return fig


def plot_timeline(timelines: dict[Wrapper, BackwardTimeline], title: str = "") -> Figure:
    """A Gantt chart of one backward pass per implementation, from measured timestamps:
    the backward computation, the moment each gradient was ready, and each all-reduce from
    launch to completion. Time 0 is the start of ``loss.backward()``."""
    fig, axes = plt.subplots(len(timelines), 1, figsize=(9, 1.9 * len(timelines) + 0.4),
                             sharex=True, layout="constrained", squeeze=False)
    for ax, (impl, t) in zip(axes[:, 0], timelines.items(), strict=True):
        ms = 1e3
        ax.barh(2, t.backward_end * ms, left=0, color="tab:orange", alpha=0.7,
                label="backward computes")
        ready = sorted(t.grad_ready.values())
        ax.plot([v * ms for v in ready], [2] * len(ready), "k|", ms=14,
                label="a gradient is ready")
        for i, span in enumerate(t.allreduces):  # alternate rows: queued ones overlap
            ax.barh(1 + (0.15 if i % 2 else -0.15), (span.end - span.start) * ms,
                    left=span.start * ms, height=0.3, color=_COLOURS[impl],
                    alpha=0.55 + 0.45 * (i % 2), edgecolor="white",
                    label="all-reduce (launch to done)" if i == 0 else None)
        ax.axvline(t.synchronised * ms, color="black", ls="--", lw=1,
                   label=f"all gradients averaged: {t.synchronised * ms:.1f} ms")
        overlap = _covered(t.allreduces, t.backward_end)
        ax.set_yticks([1, 2], [f"{len(t.allreduces)} all-reduce(s)", "backward"])
        ax.set_title(f"{impl.value}: {overlap * ms:.1f} ms of communication overlaps "
                     "backward", fontsize="medium", loc="left")
        ax.set_ylim(0.4, 2.6)
        ax.legend(fontsize="x-small", loc="upper right", ncol=2)
        ax.grid(True, axis="x", alpha=0.3)
    axes[-1, 0].set_xlabel("milliseconds since loss.backward() started (rank 0)")
    if title:
        fig.suptitle(title)
    return fig


def _covered(spans: Sequence[Span], until: float) -> float:
    """Seconds of [0, until] during which at least one span was in flight."""
    total, reach = 0.0, 0.0
    for span in sorted(spans, key=lambda s: s.start):
        start, end = max(span.start, reach), min(span.end, until)
        if end > start:
            total += end - start
        reach = max(reach, span.end)
    return total


def accumulation_table(rows: Sequence[AccumulationRow]) -> str:
    table = [[r.wrapper.value, "yes" if r.no_sync else "no", r.accumulation,
              f"{r.allreduces:g}", f"{r.seconds * 1e3:.1f}"] for r in rows]
    return format_table(["implementation", "no_sync()", "micro-batches", "all-reduces per step",
                         "ms per optimizer step"], table)


def sampler_table(views: Sequence[SamplerView]) -> str:
    """Which samples each rank read in each epoch."""
    epochs = len(views[0].epochs)
    return format_table(["rank", *[f"epoch {e}" for e in range(epochs)]],
                        [[v.rank, *[" ".join(map(str, ep)) for ep in v.epochs]]
                         for v in views])


def plot_loss(curves: dict[str, Sequence[float]], title: str = "") -> Figure:
    """Training loss per optimizer step, one line per run."""
    fig, ax = plt.subplots(figsize=(7, 3.2), layout="constrained")
    for label, losses in curves.items():
        ax.plot(range(1, len(losses) + 1), losses, label=label)
    ax.set(xlabel="optimizer step", ylabel="loss (mean over ranks)",
           title=title or "Training loss")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="small")
    return fig
