"""Chapter 2's cost model beside measurements on this machine (matplotlib): the closed forms
of :mod:`labs.cost_model`, priced by the parameters :mod:`labs.experiments.cost_fit` fitted,
against the collectives :mod:`labs.experiments.timing` timed."""

from __future__ import annotations

from collections.abc import Sequence

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

from labs.collectives import Algorithm, Collective
from labs.cost_model import AlphaBeta, crossover_bytes, predict
from labs.experiments.cost_fit import FittedAlphaBeta, fitted_statistic, measured_over_predicted
from labs.experiments.timing import CollectiveTiming, Statistic, format_size


def approx_size(size: float) -> str:
    """A size to two or three significant figures in binary units: ``"~37 KiB"``."""
    for suffix, unit in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if size >= unit:
            return f"~{size / unit:.3g} {suffix}"
    return f"~{size:.3g} B"



def plot_cost_model(
    timings: Sequence[CollectiveTiming], params: AlphaBeta, world_size: int,
    *, collective: Collective = Collective.ALL_REDUCE, statistic: Statistic | None = None,
) -> Figure:
    """Left: predicted time (lines) and measured time (markers) against S, log-log, for each
    algorithm measured at ``world_size``, with the ring / recursive doubling crossover marked.
    Right: measured / predicted (1 = the model is exact), which shows where it is wrong.
    Measurements are summarised with ``statistic`` (default:
    :func:`labs.experiments.cost_fit.fitted_statistic`, the one of the fit)."""
    stat = fitted_statistic(params) if statistic is None else statistic
    chosen = [t for t in timings
              if t.world_size == world_size and t.case.collective is collective]
    if not chosen:
        raise ValueError(f"no {collective.value} timings at world size {world_size} to plot; "
                         f"measure some with labs.experiments.timing.measure_collectives first.")
    sizes = sorted({t.case.size_bytes for t in chosen})
    algorithms = [a for a in collective.algorithms() if any(t.case.algorithm is a for t in chosen)]
    cross = None
    if {Algorithm.RING, Algorithm.RECURSIVE_DOUBLING} <= set(algorithms):
        cross = crossover_bytes(Algorithm.RING, Algorithm.RECURSIVE_DOUBLING, world_size, params,
                                collective=collective)
    low, high = max(1.0, sizes[0] / 2), sizes[-1] * 2.0
    if cross is not None:  # show the crossover even a little outside the measured sizes
        low, high = min(low, cross / 2), max(high, cross * 2)
    grid = np.geomspace(low, high, 200)
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.6), layout="constrained")
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, algorithm in enumerate(algorithms):
        colour = colours[i % len(colours)]
        for label in dict.fromkeys(t.case.label for t in chosen if t.case.algorithm is algorithm):
            points = sorted((t for t in chosen if t.case.label == label),
                            key=lambda t: t.case.size_bytes)
            x = [t.case.size_bytes for t in points]
            marker = "o" if label == algorithm.value else "^"
            left.plot(x, [t.summary(stat) for t in points], marker, color=colour,
                      label=f"{label} (measured)")
            if algorithm is not Algorithm.TORCH:
                ratios = [measured_over_predicted(t, params, stat) for t in points]
                right.plot(x, ratios, marker + "-", color=colour, label=label)
        if algorithm is not Algorithm.TORCH:
            predicted = [predict(algorithm, s, world_size, params, collective=collective)
                         for s in grid]
            left.plot(grid, predicted, "-", color=colour, alpha=0.7,
                      label=f"{algorithm.value} (model)")
    if cross is not None:
        # Named in the legend, not written beside the line: there it would cross the markers.
        left.axvline(cross, color="gray", ls="--", lw=1,
                     label=f"model: ring = rec. doubling at {approx_size(cross)}")
    ticks = [s for s in sizes if low <= s <= high]
    for ax in (left, right):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(ticks, [format_size(s) for s in ticks])
        ax.set_xlim(low, high)
        ax.grid(True, which="major", alpha=0.3)
    left.set(xlabel="size S", ylabel=f"seconds per call ({stat.value} of the iterations)",
             title=f"{collective.value}, N = {world_size}: model (lines), measured (markers)")
    right.axhline(1.0, color="black", lw=0.8)
    ratios = [y for line in right.get_lines()[1:] for y in line.get_ydata() if y and y > 0]
    if ratios:  # a symmetric range around 1, so "2x too slow" and "2x too fast" look alike
        spread = max(2.0, *(max(r, 1 / r) for r in ratios)) * 1.3
        right.set_ylim(1 / spread, spread)
    right.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    right.yaxis.set_major_formatter(FuncFormatter(lambda y, _: f"{y:g}x"))
    right.yaxis.set_minor_formatter(NullFormatter())
    title = "measured / predicted (1x: the model is exact)"
    if isinstance(params, FittedAlphaBeta) and params.oversubscribed(world_size):
        title += f"\n{world_size} ranks on {params.cores} cores: waiting for a core is not modelled"
    right.set(xlabel="size S", ylabel="measured / predicted", title=title)
    right.legend(fontsize="x-small", loc="best")
    fig.legend(*left.get_legend_handles_labels(), loc="outside lower center", ncol=5,
               fontsize="x-small")
    return fig
