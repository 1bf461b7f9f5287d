"""Chapter 2's algorithm map: for each world size and message size, which all-reduce is
fastest on the emulated link, measured on real ranks and predicted by the port model.

The map runs on :data:`MAP_LINK`, whose latency-bandwidth product is the chapter's link's
(250 kB), so every crossover falls at the same size in bytes, while every call takes a
quarter of the time: the map reaches 16 MiB at the cost of the chapter's sweep to 4 MiB.
A case the model puts at more than twice the fastest of its size is not run
(:attr:`labs.experiments.link_sweep.LinkSweepSettings.skip_beyond`).

Algorithms tie somewhere: at N = 2 the ring and halving-doubling run the same two messages,
and from a few MiB the double tree matches recursive doubling there. So a cell of the map holds
not one predicted winner but the algorithms the model puts within ``near`` (5 %) of the
fastest, and the run agrees with the model unless they differ both ways: the measured winner
is none of those, and the model's winner measured more than ``near`` slower than it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from labs.collectives import Algorithm
from labs.experiments.link_sweep import LinkSweepSettings, LinkTiming, find, measure_on_link
from labs.experiments.timing import format_size
from labs.link import Link
from labs.tables import format_table

#: A quarter of the chapter's latency, four times its bandwidth: the same alpha * bandwidth.
MAP_LINK = Link(alpha=5e-3, bandwidth=50e6)
#: 4 KiB to 16 MiB, every 4x.
MAP_SIZES: tuple[int, ...] = tuple(4096 << (2 * i) for i in range(7))
#: The five all-reduces the map compares.
MAP_ALGORITHMS: tuple[Algorithm, ...] = (
    Algorithm.NAIVE, Algorithm.RING, Algorithm.RECURSIVE_DOUBLING, Algorithm.HALVING_DOUBLING,
    Algorithm.DOUBLE_TREE,
)


@dataclass(frozen=True)
class MapSettings:
    """The map's sweep and how its cells are read.

    Attributes:
        sweep: the cases timed (one launch per world size).
        near: an algorithm within this fraction of the model's fastest counts as a
            predicted winner of its cell.
    """

    sweep: LinkSweepSettings = LinkSweepSettings(
        link=MAP_LINK, sizes=MAP_SIZES, world_sizes=(2, 4, 8), algorithms=MAP_ALGORITHMS,
        skip_beyond=2.0)
    near: float = 0.05

    def validate(self) -> None:
        """Raise ValueError saying what to change, before any process starts."""
        self.sweep.validate()
        if not 0 <= self.near < 1:
            raise ValueError(f"near must lie in [0, 1) (0.05: within 5 % of the fastest), "
                             f"got {self.near!r}.")
        if self.sweep.skip_beyond is not None and self.sweep.skip_beyond < 1 + self.near:
            raise ValueError("skip_beyond must be at least 1 + near, or a predicted winner "
                             "would not be run.")


@dataclass(frozen=True)
class MapCell:
    """One world size and size of the map.

    Attributes:
        predicted: the model's fastest.
        contenders: every algorithm the model puts within ``near`` of ``predicted``.
        measured: the algorithm whose fastest call was the fastest.
        margin: the measured runner-up's fastest call over the winner's (1.0: a tie).
        by_model: the model's seconds for each algorithm.
        by_run: the fastest call of each algorithm run.
    """

    world_size: int
    size_bytes: int
    predicted: Algorithm
    contenders: tuple[Algorithm, ...]
    measured: Algorithm
    margin: float
    by_model: dict[Algorithm, float]
    by_run: dict[Algorithm, float]
    near: float = 0.05

    @property
    def agrees(self) -> bool:
        """The measured winner is one of the model's contenders, or the model's winner
        measured within ``near`` of the measured winner: only a difference both ways is a
        disagreement."""
        return (self.measured in self.contenders
                or self.by_run.get(self.predicted, math.inf)
                <= (1 + self.near) * self.by_run[self.measured])


def cells(timings: Sequence[LinkTiming], settings: MapSettings) -> list[MapCell]:
    """The map, cell by cell (world sizes outer, sizes inner), from a sweep's timings."""
    sweep = settings.sweep
    out = []
    for n in sweep.world_sizes:
        for size in sweep.sizes:
            by_model = {a: sweep.predict(a, size, n) for a in sweep.algorithms}
            best = min(by_model.values())
            predicted = min(by_model, key=by_model.__getitem__)
            contenders = tuple(a for a in sweep.algorithms
                               if by_model[a] <= (1 + settings.near) * best)
            by_run = {a: find(timings, n, a, size).fastest for a in sweep.algorithms
                      if sweep.runs(a, size, n)}
            ranked = sorted(by_run, key=by_run.__getitem__)
            margin = by_run[ranked[1]] / by_run[ranked[0]] if len(ranked) > 1 else float("inf")
            out.append(MapCell(n, size, predicted, contenders, ranked[0], margin, by_model,
                               by_run, settings.near))
    return out


def measure_map(settings: MapSettings | None = None) -> tuple[list[LinkTiming], list[MapCell]]:
    """Run the map's sweep (:func:`labs.experiments.link_sweep.measure_on_link`) and read it."""
    settings = MapSettings() if settings is None else settings
    settings.validate()
    timings = measure_on_link(settings.sweep)
    return timings, cells(timings, settings)


SHORT = {
    Algorithm.NAIVE: "naive", Algorithm.RING: "ring", Algorithm.RECURSIVE_DOUBLING: "RD",
    Algorithm.HALVING_DOUBLING: "HD", Algorithm.DOUBLE_TREE: "tree",
}


def model_map(settings: MapSettings | None = None) -> str:
    """The model's map alone (no run): per world size, the contenders at each size."""
    settings = MapSettings() if settings is None else settings
    sweep = settings.sweep
    rows = []
    for n in sweep.world_sizes:
        row: list[object] = [n]
        for size in sweep.sizes:
            times = {a: sweep.predict(a, size, n) for a in sweep.algorithms}
            best = min(times.values())
            row.append(" = ".join(SHORT[a] for a in sweep.algorithms
                                  if times[a] <= (1 + settings.near) * best))
        rows.append(row)
    return format_table(["N", *(format_size(s) for s in sweep.sizes)], rows)


def map_table(cells_: Sequence[MapCell]) -> str:
    """One row per cell: the model's contenders, the measured winner and its margin."""
    rows = [[c.world_size, format_size(c.size_bytes),
             " = ".join(SHORT[a] for a in c.contenders), SHORT[c.measured],
             f"{c.by_run[c.measured] * 1e3:.1f}", f"{c.by_model[c.measured] * 1e3:.1f}",
             f"{c.margin:.2f}", "yes" if c.agrees else "NO"] for c in cells_]
    near = f"{cells_[0].near:.0%}" if cells_ else ""
    return format_table(["N", "size", f"model: fastest (within {near})", "measured fastest",
                         "its time (ms)", "its model (ms)", "runner-up / it", "agree"], rows)
