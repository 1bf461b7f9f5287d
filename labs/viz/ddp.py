"""Chapter 5's tables and figures: step times, the bucket-size sweep, the backward timeline
(a Gantt chart), the model of the overlapped step beside the measured one, samples per second
of one rank and of N, gradient accumulation, the DistributedSampler and the training loss."""

from __future__ import annotations

from collections.abc import Sequence

import matplotlib.pyplot as plt
from matplotlib.figure import Figure

from labs.experiments.ddp import (
    AccumulationRow,
    BackwardTimeline,
    Measure,
    SamplerView,
    StepTimeRow,
    cap_text,
)
from labs.experiments.overlap import NaiveAccount, OverlapRow, StepModel, pairs_by_cap
from labs.experiments.scaling import ScalingPoint
from labs.tables import format_table
from labs.wrappers import Wrapper

_COLOURS = {
    Wrapper.LOCAL: "tab:gray",
    Wrapper.NAIVE: "tab:red",
    Wrapper.DDP: "tab:blue",
    Wrapper.TORCH_DDP: "tab:green",
}
#: labs' DDP run as the control, every bucket all-reduced after backward.
_AFTER_BACKWARD = "tab:purple"


def step_time_table(rows: Sequence[StepTimeRow], measure: Measure = Measure.STEP) -> str:
    """Median time per case (``measure``) with its range over the timed steps, the
    all-reduces per step, and the ratio to torch DDP at the same cap (where it was timed)."""
    torch_rows = {r.case.bucket_cap_mb: r.median(measure) for r in rows
                  if r.case.wrapper is Wrapper.TORCH_DDP}
    table = []
    for r in rows:
        reference = torch_rows.get(r.case.bucket_cap_mb)
        bucketed = r.case.wrapper in (Wrapper.DDP, Wrapper.TORCH_DDP)
        ratio = f"{r.median(measure) / reference:.2f}x" if reference and bucketed else "-"
        samples = r.of(measure)
        table.append([r.case.label, f"{r.median(measure) * 1e3:.1f}",
                      f"{min(samples) * 1e3:.1f} - {max(samples) * 1e3:.1f}", len(samples),
                      r.buckets, ratio])
    headers = [f"implementation ({measure.value})", "median", "min - max", "steps timed",
               "all-reduces per step"]
    if not torch_rows:
        return format_table(headers, [row[:-1] for row in table])
    return format_table([*headers, "/ torch DDP at that cap"], table)


def _spread_ms(rows: Sequence[StepTimeRow], measure: Measure
               ) -> tuple[list[float], list[list[float]]]:
    """Medians in ms, and matplotlib's error extents (down, up) from each min to each max."""
    medians = [r.median(measure) * 1e3 for r in rows]
    down = [m - min(r.of(measure)) * 1e3 for m, r in zip(medians, rows, strict=True)]
    up = [max(r.of(measure)) * 1e3 - m for m, r in zip(medians, rows, strict=True)]
    return medians, [down, up]


def plot_step_times(rows: Sequence[StepTimeRow], title: str = "",
                    measure: Measure = Measure.STEP) -> Figure:
    """One bar per case: the median time (slowest rank) of ``measure``, with a whisker from
    the fastest to the slowest timed step."""
    fig, ax = plt.subplots(figsize=(7, 0.5 + 0.45 * len(rows)), layout="constrained")
    medians, spread = _spread_ms(rows, measure)
    ax.barh([r.case.label for r in rows], medians, xerr=spread, capsize=3, ecolor="black",
            color=[_COLOURS[r.case.wrapper] if r.case.overlap else _AFTER_BACKWARD
                   for r in rows])
    top = [m + u for m, u in zip(medians, spread[1], strict=True)]
    for y, (row, median, right) in enumerate(zip(rows, medians, top, strict=True)):
        ax.text(right, y, f"  median {median:.1f} ms, {row.buckets} all-reduce(s)",
                va="center", fontsize="small")
    ax.invert_yaxis()
    ax.set(xlabel=f"{measure.value}: bar the median, whisker min to max",
           title=title or "Step time")
    ax.set_xlim(0, max(top) * 1.85)
    ax.grid(True, axis="x", alpha=0.3)
    return fig


def plot_bucket_sweep(rows: Sequence[StepTimeRow], title: str = "",
                      measure: Measure = Measure.STEP,
                      models: Sequence[OverlapRow] = ()) -> Figure:
    """Time (``measure``) against bucket cap for the bucketed wrappers timed (labs' DDP,
    its control that all-reduces after backward, and torch's DDP, where present): the
    median, a thick bar over the quartiles and a thin whisker from the fastest to the slowest
    step. NaiveDDP and the no-communication floor are horizontal lines (medians) over a band
    from the first quartile to the third. Given ``models`` (:func:`labs.experiments.overlap.
    compare_to_model` of the same rows, measure BACKWARD), the model's median of each labs'
    DDP case is a cross."""
    fig, ax = plt.subplots(figsize=(7, 5.6 if models else 3.6), layout="constrained")
    series = ((Wrapper.DDP, True, _COLOURS[Wrapper.DDP], "DDP"),
              (Wrapper.DDP, False, _AFTER_BACKWARD, "DDP, all-reduced after backward"),
              (Wrapper.TORCH_DDP, True, _COLOURS[Wrapper.TORCH_DDP], Wrapper.TORCH_DDP.value))
    for impl, overlap, colour, name in series:
        mine = sorted((r for r in rows if r.case.wrapper is impl and r.case.overlap is overlap),
                      key=lambda r: r.case.bucket_cap_mb)
        if not mine:
            continue
        caps = [r.case.bucket_cap_mb for r in mine]
        medians, spread = _spread_ms(mine, measure)
        ax.errorbar(caps, medians, yerr=spread, fmt="none", capsize=3, lw=0.8, color=colour)
        quartiles = [[m - r.quartiles(measure)[0] * 1e3 for m, r in zip(medians, mine,
                                                                          strict=True)],
                     [r.quartiles(measure)[1] * 1e3 - m for m, r in zip(medians, mine,
                                                                          strict=True)]]
        ax.errorbar(caps, medians, yerr=quartiles, fmt="o-", lw=1.5, elinewidth=5,
                    color=colour, label=f"{name}: median, quartiles (thick), min to max (thin)")
        if overlap:
            for r, median, up in zip(mine, medians, spread[1], strict=True):
                ax.annotate(str(r.buckets), (r.case.bucket_cap_mb, median + up),
                            textcoords="offset points", xytext=(0, 4), ha="center",
                            fontsize="x-small", color=colour)
        modelled = [m for m in models if m.row.case in {r.case for r in mine}]
        if modelled:
            ax.plot([m.row.case.bucket_cap_mb for m in modelled],
                    [m.predicted * 1e3 for m in modelled], "x", ms=9, mew=2, color="black"
                    if overlap else colour, label=f"{name}: the model (median)")
    for impl, style in ((Wrapper.NAIVE, "--"), (Wrapper.LOCAL, ":")):
        for r in rows:
            if r.case.wrapper is impl:
                first, third = r.quartiles(measure)
                ax.axhline(r.median(measure) * 1e3, ls=style, color=_COLOURS[impl],
                           label=f"{impl.value} ({r.buckets} all-reduces): median, "
                           "quartiles shaded")
                ax.axhspan(first * 1e3, third * 1e3, color=_COLOURS[impl], alpha=0.15)
    ax.set_xscale("log", base=2)
    caps = sorted({r.case.bucket_cap_mb for r in rows
                   if r.case.wrapper in (Wrapper.DDP, Wrapper.TORCH_DDP)})
    ax.set_xticks(caps, [cap_text(c) for c in caps])
    ax.minorticks_off()
    ax.set(xlabel="bucket_cap_mb (log scale); numbers: buckets per step",
           ylabel=measure.value.replace("milliseconds", "ms"),
           title=title or "Bucket size sweep")
    # the floor's slowest step may be an outlier far above the rest: scale to the others
    top = max((max(r.of(measure)) for r in rows if r.case.wrapper is not Wrapper.LOCAL),
              default=max(max(r.of(measure)) for r in rows))
    ax.set_ylim(bottom=0, top=top * 1e3 * 1.15)
    ax.grid(True, alpha=0.3)
    if models:  # more entries than fit inside
        fig.legend(fontsize="small", loc="outside lower center")
    else:
        ax.legend(fontsize="small", loc="lower left")
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
                    label="all-reduce in flight" if i == 0 else None)
        ax.axvline(t.synchronised * ms, color="black", ls="--", lw=1,
                   label=f"all gradients averaged: {t.synchronised * ms:.1f} ms")
        ax.set_yticks([1, 2], [f"{len(t.allreduces)} all-reduce(s)", "backward"])
        ax.set_title(f"{impl.value}: {t.in_flight(t.backward_end) * ms:.1f} of "
                     f"{t.in_flight() * ms:.1f} ms of communication ran during backward "
                     f"({t.overlap_efficiency:.0%}); averaged "
                     f"{(t.synchronised - t.backward_end) * ms:.1f} ms after it",
                     fontsize="medium", loc="left")
        ax.set_ylim(0.4, 2.6)
        ax.legend(fontsize="x-small", loc="upper right", ncol=2)
        ax.grid(True, axis="x", alpha=0.3)
    axes[-1, 0].set_xlabel("milliseconds since loss.backward() started (rank 0)")
    if title:
        fig.suptitle(title)
    return fig


def overlap_table(rows: Sequence[OverlapRow]) -> str:
    """Per cap of labs' DDP, overlapped and after backward: the measured median from
    ``backward()`` to averaged gradients, the model's, their difference in per cent, and the
    gain of overlapping (after backward minus overlapped), measured and modelled. NaiveDDP,
    if present, last."""
    def ms(value: float) -> str:
        return f"{value * 1e3:.1f}"

    def pct(row: OverlapRow) -> str:
        return f"{row.error * 100:+.1f} %"

    table = [[cap_text(o.row.case.bucket_cap_mb), o.row.buckets, ms(o.measured), ms(o.predicted),
              pct(o), ms(a.measured), ms(a.predicted), pct(a), ms(a.measured - o.measured),
              ms(a.predicted - o.predicted)] for o, a in pairs_by_cap(rows)]
    for r in rows:
        if r.row.case.wrapper is Wrapper.NAIVE:
            table.append([r.row.case.label, r.row.buckets, "-", "-", "-", ms(r.measured),
                          ms(r.predicted), pct(r), "-", "-"])
    return format_table(["cap", "all-reduces", "overlapped: measured", "model", "model vs measured",
                         "after backward: measured", "model", "model vs measured",
                         "gain: measured", "model"], table)


def naive_account_table(account: NaiveAccount) -> str:
    """NaiveDDP's milliseconds from ``backward()`` to averaged gradients, part by part: per
    all-reduce size, the link's price and the cost beyond it timed alone (both summed in the
    last column) and, beside them, in the measured steps."""
    def ms(value: float, digits: int = 1) -> str:
        return f"{value * 1e3:.{digits}f}"

    rows: list[list[object]] = [["backward (NaiveDDP's own)", "", "", "", "",
                                 ms(account.backward)]]
    for s in account.sizes:
        rows.append([f"all-reduces of {s.nbytes / 1024:g} KiB", s.calls, ms(s.model, 2),
                     ms(s.overhead, 2), ms(s.in_run, 2), ms(s.calls * (s.model + s.overhead))])
    rows += [["between and after the all-reduces (in the steps)", "", "", "", "",
              ms(account.between)],
             ["sum", "", "", "", "", ms(account.accounted)],
             ["measured", "", "", "", "", ms(account.measured)],
             ["measured minus the sum", "", "", "", "", f"{account.unaccounted * 1e3:+.1f}"]]
    return format_table(["NaiveDDP, backward() to averaged gradients (medians, ms)", "calls",
                         "link's price per call", "beyond it, timed alone",
                         "beyond it, in the steps", "total"], rows)


def plot_overlap_timeline(steps: dict[str, StepModel], title: str = "") -> Figure:
    """One measured step per panel beside the model of it: backward (to its end on the later
    rank), when each bucket was ready (its last gradient, on the later rank), each all-reduce
    as measured (earliest start to latest end over the ranks) and as modelled. Time 0 is the
    first rank's ``backward()`` call."""
    fig, axes = plt.subplots(len(steps), 1, figsize=(10, 1.9 * len(steps) + 0.5), sharex=True,
                             layout="constrained", squeeze=False)
    ms = 1e3
    for ax, (label, step) in zip(axes[:, 0], steps.items(), strict=True):
        ax.barh(3, step.backward_end * ms, color="tab:orange", alpha=0.7,
                label="backward computes")
        ax.plot([v * ms for v in step.ready], [3] * len(step.ready), "k|", ms=14,
                label="a bucket is ready")
        for row, spans, colour, name in ((2, step.measured_spans, "tab:blue", "measured"),
                                         (1, step.modelled, "tab:gray", "the model")):
            for i, (start, end) in enumerate(spans):
                ax.barh(row, (end - start) * ms, left=start * ms, height=0.5, color=colour,
                        alpha=0.55 + 0.45 * (i % 2), edgecolor="white",
                        label=f"all-reduce, {name}" if i == 0 else None)
        ax.axvline(step.measured * ms, color="black", ls="--", lw=1,
                   label=f"averaged, measured: {step.measured * ms:.1f} ms")
        ax.axvline(step.predicted * ms, color="tab:gray", ls=":", lw=1.5,
                   label=f"averaged, model: {step.predicted * ms:.1f} ms")
        ax.set_yticks([1, 2, 3], ["model", "measured", "backward"])
        ax.set_title(label, fontsize="medium", loc="left")
        ax.set_ylim(0.4, 3.6)
        ax.legend(fontsize="x-small", loc="upper left", bbox_to_anchor=(1.01, 1.0))
        ax.grid(True, axis="x", alpha=0.3)
    axes[-1, 0].set_xlabel("milliseconds since the first rank called loss.backward()")
    if title:
        fig.suptitle(title)
    return fig


def accumulation_table(rows: Sequence[AccumulationRow]) -> str:
    table = [[r.wrapper.value, "yes" if r.no_sync else "no", r.accumulation,
              f"{r.allreduces:g}"] for r in rows]
    return format_table(["implementation", "no_sync()", "micro-batches",
                         "all-reduces per step"], table)


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


def scaling_table(points: Sequence[ScalingPoint], model_speedup: Sequence[float]) -> str:
    """Per-rank batch, samples per second of one rank and of N, the measured speed-up with
    the middle half of its repeats, the scaling efficiency and the model's speed-up."""
    rows = []
    for p, model in zip(points, model_speedup, strict=True):
        one, many = p.samples_per_second()
        s = p.speedup
        rows.append([p.batch, f"{one:,.0f}", f"{many:,.0f}",
                     f"{s.median:.2f} ({s.low:.2f}-{s.high:.2f})", f"{p.efficiency.median:.2f}",
                     f"{model:.2f}"])
    n = points[0].world_size if points else "N"
    return format_table(["batch per rank", "1 rank: samples/s", f"{n} ranks: samples/s",
                         "speed-up (middle half)", "efficiency", "model"], rows)


def plot_scaling(points: Sequence[ScalingPoint], model: Sequence[tuple[float, float]],
                 crossover: float, title: str = "") -> Figure:
    """The measured speed-up against the per-rank batch (the bar: the middle half of the
    repeats), the model's curve ``model`` [(batch, speed-up)], 1 (no gain) and the predicted
    crossover batch."""
    fig, ax = plt.subplots(figsize=(6.5, 3.6), layout="constrained")
    batches = [p.batch for p in points]
    med = [p.speedup.median for p in points]
    lows = [p.speedup.median - p.speedup.low for p in points]
    highs = [p.speedup.high - p.speedup.median for p in points]
    ax.errorbar(batches, med, yerr=[lows, highs], fmt="o", color=_COLOURS[Wrapper.DDP],
                capsize=3, label="measured (middle half of the steps)")
    ax.plot([b for b, _ in model], [v for _, v in model], "-", color="tab:gray",
            label="model: N T1 / (T1 + R)")
    ax.axhline(1, color="black", lw=0.8, ls=":", label="as fast as one rank")
    ax.axvline(crossover, color="tab:red", lw=1, ls="--",
               label=f"predicted crossover, {crossover:.0f} per rank")
    n = points[0].world_size if points else "N"
    ax.set(xscale="log", xlabel="samples per rank per step",
           ylabel=f"samples/s of {n} ranks / of 1", title=title)
    ax.legend(fontsize="small", loc="upper left")
    ax.grid(True, alpha=0.3)
    return fig
