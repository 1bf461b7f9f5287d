"""Chapter 6's tables and figures: per-rank memory by ZeRO stage (measured beside the closed
forms), the memory of one FSDP step moment by moment, bytes sent, and the calculator."""

from __future__ import annotations

from collections.abc import Sequence

import matplotlib.pyplot as plt
from matplotlib.figure import Figure

from labs.experiments.zero import (
    BytesPerParameter,
    Group,
    MemoryReport,
    Recipe,
    TrafficRow,
    bytes_per_parameter,
)
from labs.tables import format_table
from labs.wrappers import ZERO_STAGES, Wrapper

_GROUPS = (Group.PARAMETERS, Group.GRADIENTS, Group.OPTIMIZER)
_COLOURS = {Group.PARAMETERS: "tab:blue", Group.GRADIENTS: "tab:orange",
            Group.OPTIMIZER: "tab:green", Group.BUFFERS: "tab:gray"}


def closed_form(strategy: Wrapper, world_size: int) -> BytesPerParameter:
    """What the stage keeps per parameter after the step, fp32 Adam (the 16-byte recipe)."""
    return bytes_per_parameter(Recipe.FP32, strategy.stage, world_size)


def memory_table(reports: dict[tuple[Wrapper, int], MemoryReport]) -> str:
    """Bytes per parameter rank 0 held after the optimizer step and at its peak during the
    step (and where), measured, beside what the stage keeps by the closed form (fp32 Adam:
    what exists at once, before anything is gathered or in flight)."""
    rows = []
    for (strategy, n), report in reports.items():
        final = report.final.bytes_by_group()
        p = report.parameters
        formula = closed_form(strategy, n)
        rows.append([strategy.value, n,
                     " / ".join(f"{final.get(g.value, 0) / p:.2f}" for g in _GROUPS),
                     f"{report.peak_bytes / p:.2f}", report.peak.moment,
                     f"{formula.parameters:g} + {formula.gradients:g} + "
                     f"{formula.optimizer:g} = {formula.total:g}"])
    return format_table(["strategy", "N", "after step: params / grads / Adam", "peak",
                         "peak at", "closed form: params + grads + Adam"], rows)


def plot_memory_by_stage(reports: dict[tuple[Wrapper, int], MemoryReport],
                         title: str = "") -> Figure:
    """One panel per strategy: bytes per parameter held after the step, stacked by kind, for
    each world size; a black tick marks the peak during the step."""
    strategies = list(dict.fromkeys(s for s, _ in reports))
    sizes = sorted({n for _, n in reports})
    fig, axes = plt.subplots(1, len(strategies), figsize=(2.6 * len(strategies), 3.3),
                             sharey=True, layout="constrained", squeeze=False)
    for ax, strategy in zip(axes[0], strategies, strict=True):
        for x, n in enumerate(sizes):
            report = reports[(strategy, n)]
            final = report.final.bytes_by_group()
            bottom = 0.0
            for group in (*_GROUPS, Group.BUFFERS):
                height = final.get(group.value, 0) / report.parameters
                if height:
                    ax.bar(x, height, bottom=bottom, color=_COLOURS[group],
                           label=group.value if x == 0 else None, edgecolor="white")
                    bottom += height
            ax.plot([x - 0.4, x + 0.4], [report.peak_bytes / report.parameters] * 2, "k-",
                    lw=2, label="peak during the step" if x == 0 else None)
        ax.set_xticks(range(len(sizes)), [str(n) for n in sizes])
        ax.set(title=strategy.value, xlabel="world size N")
        ax.grid(True, axis="y", alpha=0.3)
    axes[0, 0].set_ylabel("bytes per parameter, rank 0")
    handles, labels = axes[0, 0].get_legend_handles_labels()
    for ax in axes[0, 1:]:
        more_h, more_l = ax.get_legend_handles_labels()
        for h, label in zip(more_h, more_l, strict=True):
            if label not in labels:
                handles.append(h)
                labels.append(label)
    fig.legend(handles, labels, loc="outside lower center", ncol=len(labels),
               fontsize="small", frameon=False)
    if title:
        fig.suptitle(title)
    return fig


def plot_step_memory(report: MemoryReport, title: str = "") -> Figure:
    """The bytes of each kind a rank held at every moment of one step (one snapshot per
    gather, free and reduce-scatter), stacked."""
    snaps = report.snapshots
    x = range(len(snaps))
    mib = 2**20
    layers = [[s.bytes_by_group().get(g.value, 0) / mib for s in snaps] for g in _GROUPS]
    fig, ax = plt.subplots(figsize=(9, 3.6), layout="constrained")
    ax.stackplot(x, *layers, labels=[g.value for g in _GROUPS],
                 colors=[_COLOURS[g] for g in _GROUPS], step="mid", alpha=0.85)
    ticks = [i for i, s in enumerate(snaps)
             if not s.moment.startswith(("free", "reduce", "prefetch"))]
    ax.set_xticks(ticks, [snaps[i].moment.replace("all-gather for ", "gather: ")
                          for i in ticks], rotation=60, ha="right", fontsize="x-small")
    peak = report.peak
    ax.axhline(report.peak_bytes / mib, color="black", ls="--", lw=1,
               label=f"peak: {report.peak_bytes / mib:.2f} MiB at {peak.moment}")
    ax.set(ylabel="MiB held (rank 0)", xlim=(0, len(snaps) - 1),
           title=title or f"{report.strategy.value}, one step, N = {report.world_size}")
    ax.legend(fontsize="small", loc="upper left")
    ax.grid(True, axis="y", alpha=0.3)
    return fig


def traffic_table(rows: Sequence[TrafficRow]) -> str:
    return format_table(["strategy", "N", "bytes sent by rank 0 / S", "closed form"],
                        [[r.strategy.value, r.world_size, f"{r.measured:.4f}",
                          f"{r.expected:.4f}"] for r in rows])


def calculator_table(parameters: float, recipe: Recipe, world_size: int,
                     memory_bytes: float | None = None) -> str:
    """Bytes per parameter and GB per rank at every stage; with ``memory_bytes``, the
    largest model (model state only) that fits one rank."""
    rows = []
    for strategy in ZERO_STAGES:
        b = bytes_per_parameter(recipe, strategy.stage, world_size)
        row = [strategy.value, f"{b.parameters:g}", f"{b.gradients:g}", f"{b.optimizer:g}",
               f"{b.total:g}", f"{parameters * b.total / 1e9:.2f}"]
        if memory_bytes is not None:
            row.append(f"{memory_bytes / b.total / 1e9:.2f}")
        rows.append(row)
    header = ["stage", "params", "grads", "optimizer (+ master)", "bytes / param",
              "GB per rank"]
    if memory_bytes is not None:
        header.append(f"max params (B) in {memory_bytes / 1e9:g} GB")
    return format_table(header, rows)


def plot_calculator(parameters: float, recipe: Recipe, world_size: int) -> Figure:
    fig, ax = plt.subplots(figsize=(7, 3), layout="constrained")
    names = [s.value for s in ZERO_STAGES]
    bottom = [0.0] * len(names)
    for group, attr in ((Group.PARAMETERS, "parameters"), (Group.GRADIENTS, "gradients"),
                        (Group.OPTIMIZER, "optimizer")):
        values = [getattr(bytes_per_parameter(recipe, s.stage, world_size), attr)
                  * parameters / 1e9 for s in ZERO_STAGES]
        ax.barh(names, values, left=bottom, color=_COLOURS[group], label=group.value)
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    ax.invert_yaxis()
    ax.set(xlabel="GB per rank (model state only)",
           title=f"{parameters / 1e9:g} B parameters, {recipe.value}, N = {world_size}")
    ax.legend(fontsize="small")
    ax.grid(True, axis="x", alpha=0.3)
    return fig


def traffic_plot(rows: Sequence[TrafficRow]) -> Figure:
    fig, ax = plt.subplots(figsize=(6, 3), layout="constrained")
    # DDP, ZeRO-1 and ZeRO-2 send the same bytes: each line is drawn thinner than the one
    # before it, so lines that coincide stay visible one inside the other.
    styles = [dict(lw=7, ms=12, marker="o", alpha=0.35), dict(lw=4, ms=8, marker="s", alpha=0.6),
              dict(lw=1.5, ms=5, marker="^", ls="--"), dict(lw=1.5, ms=5, marker="D")]
    for i, strategy in enumerate(dict.fromkeys(r.strategy for r in rows)):
        mine = sorted((r for r in rows if r.strategy is strategy), key=lambda r: r.world_size)
        ax.plot([r.world_size for r in mine], [r.measured for r in mine],
                label=strategy.value, **styles[min(i, len(styles) - 1)])
    ax.set_xticks(sorted({r.world_size for r in rows}))
    ax.set(xlabel="world size N", ylabel="bytes sent per step / S",
           title="Bytes each rank sends per step (measured)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="small")
    return fig
