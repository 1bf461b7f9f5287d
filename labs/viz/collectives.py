"""Figures for chapters 1-4 (matplotlib): the toy all-reduce, rounding against the full
batch, traffic, the ring frame by frame and its animation, collective timings, the cost model
on the emulated link. Their text tables are in :mod:`labs.tables`."""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

import matplotlib.pyplot as plt
import numpy as np
import torch
from IPython.display import HTML
from matplotlib.animation import FuncAnimation
from matplotlib.artist import Artist
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.patches import Patch, Rectangle

from labs.collectives import Algorithm, Phase, RingStep, shard_bounds
from labs.cost_model import crossover_on_link
from labs.experiments.algorithm_map import SHORT, MapCell
from labs.experiments.collectives import TrafficRow
from labs.experiments.link_sweep import LinkSweepSettings, LinkTiming
from labs.experiments.timing import CollectiveTiming, format_size
from labs.tables import values_text
from labs.toy_allreduce import ToyRankRecord


def plot_toy_allreduce(records: Sequence[ToyRankRecord]) -> Figure:
    """Left: each rank's gradient and the average they all end with. Right: the parameter
    on every rank before and after the step."""
    ranks = [r.rank for r in records]
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.2), layout="constrained")
    left.bar(ranks, [r.local_grad for r in records], color="tab:blue", label="own gradient")
    left.axhline(records[0].averaged, color="tab:red", lw=2, label="average (every rank)")
    left.axhline(0, color="black", lw=0.5)
    left.set(xlabel="rank", ylabel="gradient", title="Before and after all-reduce",
             xticks=ranks)
    left.legend(loc="best", fontsize="small")
    before = [r.param_before for r in records]
    after = [r.param_after for r in records]
    right.plot(ranks, before, "o--", color="gray", label="before the step")
    right.plot(ranks, after, "s-", color="tab:green", label="after the step")
    right.set(xlabel="rank", ylabel="parameter", title="One SGD step, same on every rank",
              xticks=ranks)
    right.ticklabel_format(axis="y", useOffset=False)
    right.legend(loc="best", fontsize="small")
    return fig


def plot_rounding(reference: dict[str, torch.Tensor], averaged: dict[str, torch.Tensor],
                  title: str) -> Figure:
    """Each gradient entry that differs: its size in the full-batch reference (x) against its
    difference from the all-reduced average (y), both on log axes, with the lines of one and
    ten float32 steps at that size. Entries with no difference (same bits) are counted in the
    title: a log axis cannot show a zero."""
    x = torch.cat([reference[n].reshape(-1) for n in reference]).abs()
    d = torch.cat([(averaged[n] - reference[n]).reshape(-1) for n in reference]).abs()
    differs = d > 0
    fig, ax = plt.subplots(figsize=(5.5, 3.6), layout="constrained")
    ax.scatter(x[differs].numpy(), d[differs].numpy(), s=8, alpha=0.6, color="tab:blue",
               label="an entry that differs")
    sizes = np.logspace(math.log10(float(x[x > 0].min())), math.log10(float(x.max())), 50)
    eps = float(torch.finfo(torch.float32).eps) / 2  # a step is 2^-24 of |x| at the least
    for steps, style in ((1, "--"), (10, ":")):
        ax.plot(sizes, steps * eps * sizes * 2, style, color="gray",
                label=f"{steps} float32 step{'s' if steps > 1 else ''} (about)")
    ax.set(xscale="log", yscale="log", xlabel="|full-batch gradient entry|",
           ylabel="|averaged - full-batch|",
           title=f"{title}: {int(differs.sum())} of {x.numel()} entries differ, "
                 f"{int((~differs).sum())} have the same bits")
    ax.title.set_fontsize("small")
    ax.legend(loc="upper left", fontsize="small")
    return fig


# --- chapter 2: sizes, traces, traffic ---------------------------------------------------------


def plot_traffic(rows: Sequence[TrafficRow]) -> Figure:
    """Measured traffic against N, one line per algorithm: bytes the busiest rank sends (in
    multiples of S; the naive root's link, the ring's every link) and the messages it sends
    (each pays the per-message latency alpha)."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.2), layout="constrained")
    # Lines that coincide (naive and whole-tensor ring) stay visible: thick under thin.
    styles = [("o-", 5.0), ("s--", 1.5), ("^-", 1.5), ("D-", 1.5), ("v:", 1.5), ("P-.", 1.5)]
    for i, algorithm in enumerate(dict.fromkeys(r.algorithm for r in rows)):
        mine = sorted((r for r in rows if r.algorithm is algorithm), key=lambda r: r.world_size)
        sizes = [r.world_size for r in mine]
        style, width = styles[i % len(styles)]
        for ax, values in ((left, [float(r.measured.sent) for r in mine]),
                           (right, [r.measured.messages_sent for r in mine])):
            ax.plot(sizes, values, style, lw=width, alpha=0.8, label=algorithm.value)
    left.set(xlabel="world size N", ylabel="bytes sent by the busiest rank / S",
             title="Bandwidth term: bytes on the busiest link")
    right.set(xlabel="world size N", ylabel="messages sent by the busiest rank",
              title="Messages the busiest rank sends")
    for ax in (left, right):
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize="small")
    return fig


# --- chapter 2: the ring, frame by frame -------------------------------------------------------


@dataclass(frozen=True)
class ChunkCell:
    """What one rank holds of one chunk at one moment of a ring run.

    Attributes:
        values: the chunk's current values on that rank.
        contributors: the ranks whose input is summed into ``values`` (all N: finished).
    """

    values: tuple[float, ...]
    contributors: frozenset[int]


@dataclass(frozen=True)
class Transfer:
    """One message of a ring step: ``source`` sends ``chunk`` (``values``) to ``dest``."""

    source: int
    dest: int
    chunk: int
    values: tuple[float, ...]


@dataclass(frozen=True)
class RingFrame:
    """The state of every rank after one ring step (or before the first).

    Attributes:
        title: "start", "reduce-scatter step k" or "all-gather step k" (k from 0).
        cells: ``cells[rank][chunk]``; ``None`` where the rank does not hold that chunk yet
            (an all-gather's other shards before they arrive).
        transfers: the messages of this step, one per rank; empty for the start.
    """

    title: str
    cells: tuple[tuple[ChunkCell | None, ...], ...]
    transfers: tuple[Transfer, ...]


def _derive_initial(
    steps: Sequence[RingStep], world_size: int, bounds: list[int]
) -> list[list[tuple[float, ...] | None]]:
    """Each rank's starting chunks, read back from the trace. Reduce-scatter step k on rank r
    sends its own chunk r-1 at k = 0 and gets ``chunk_after = received + own``, so every own
    chunk is known (exactly for the integer-valued traces of the book). In an all-gather alone
    rank r holds chunk r only: what it sends at step 0."""
    cells: list[list[tuple[float, ...] | None]] = [[None] * world_size for _ in range(world_size)]
    scatter = [s for s in steps if s.phase is Phase.REDUCE_SCATTER]
    if scatter:
        for s in scatter:
            if s.step == 0:
                cells[s.rank][s.sent_chunk] = s.sent
            cells[s.rank][s.received_chunk] = tuple(
                after - got for after, got in zip(s.chunk_after, s.received, strict=True)
            )
    else:
        for s in steps:
            if s.step == 0:
                cells[s.rank][s.sent_chunk] = s.sent
    for rank, row in enumerate(cells):
        for chunk, values in enumerate(row):
            width = bounds[chunk + 1] - bounds[chunk]
            if values is not None and len(values) != width:
                raise ValueError(f"rank {rank}'s chunk {chunk} has {len(values)} values in the "
                                 f"trace but {width} for numel={bounds[-1]}: pass the same numel.")
    return cells


def ring_frames(
    steps: Sequence[RingStep], world_size: int, numel: int,
    initial: Sequence[Sequence[float]] | None = None,
) -> list[RingFrame]:
    """Replay a ring trace (``Recorder(trace=True)`` on every rank, steps of all ranks
    together) as one frame per ring step plus the starting state.

    A trace holding reduce-scatter steps starts from every rank's whole tensor (each chunk has
    one contributor, its own rank); a trace of an all-gather alone starts from each rank
    holding its finished shard only. ``initial`` gives those starting tensors (full tensors,
    or shards for an all-gather); without it they are read back from the trace. Each step is
    checked for consistency: what rank r receives is what rank r-1 sent.
    """
    if not steps:
        raise ValueError("the trace is empty (one rank sends nothing): trace 2 or more ranks.")
    ranks = {s.rank for s in steps}
    if ranks != set(range(world_size)):
        raise ValueError(f"the trace holds ranks {sorted(ranks)}, not 0..{world_size - 1}: "
                         "pass the steps of every rank and the world size they ran with.")
    bounds = shard_bounds(numel, world_size)
    scatter = any(s.phase is Phase.REDUCE_SCATTER for s in steps)
    everyone = frozenset(range(world_size))
    if initial is None:
        start = _derive_initial(steps, world_size, bounds)
    elif scatter:
        start = [[tuple(float(v) for v in initial[r][bounds[c]:bounds[c + 1]])
                  for c in range(world_size)] for r in range(world_size)]
    else:
        start = [[tuple(float(v) for v in initial[r]) if c == r else None
                  for c in range(world_size)] for r in range(world_size)]
    state: list[list[ChunkCell | None]] = [
        [None if values is None else ChunkCell(values, frozenset({r}) if scatter else everyone)
         for values in row]
        for r, row in enumerate(start)
    ]
    frames = [RingFrame("start", tuple(map(tuple, state)), ())]
    groups: dict[tuple[Phase, int], dict[int, RingStep]] = {}
    for s in sorted(steps, key=lambda s: (list(Phase).index(s.phase), s.step)):
        groups.setdefault((s.phase, s.step), {})[s.rank] = s
    for (phase, k), by_rank in groups.items():
        if set(by_rank) != set(range(world_size)):
            raise ValueError(f"{phase.value} step {k} is missing rank(s) "
                             f"{sorted(set(range(world_size)) - set(by_rank))} in the trace.")
        new = [list(row) for row in state]
        transfers = []
        for rank, s in sorted(by_rank.items()):
            sender = by_rank[(rank - 1) % world_size]
            if sender.sent_chunk != s.received_chunk or sender.sent != s.received:
                raise ValueError(
                    f"{phase.value} step {k}: rank {rank} received chunk {s.received_chunk} "
                    f"{s.received} but rank {sender.rank} sent chunk {sender.sent_chunk} "
                    f"{sender.sent}: the trace is not one ring run."
                )
            came = state[sender.rank][sender.sent_chunk]
            mine = state[rank][s.received_chunk]
            contributors = came.contributors if came is not None else frozenset()
            if phase is Phase.REDUCE_SCATTER and mine is not None:
                contributors = contributors | mine.contributors
            new[rank][s.received_chunk] = ChunkCell(s.chunk_after, contributors)
            transfers.append(Transfer(sender.rank, rank, sender.sent_chunk, sender.sent))
        state = new
        frames.append(RingFrame(f"{phase.value} step {k}", tuple(map(tuple, state)),
                                tuple(transfers)))
    return frames


def _ring_colours(world_size: int) -> list[tuple[float, float, float, float]]:
    """Colour for a chunk holding 1..N contributions (index count-1): light to dark."""
    cmap = plt.get_cmap("YlGnBu")
    if world_size == 1:
        return [cmap(0.75)]
    return [cmap(0.12 + 0.78 * i / (world_size - 1)) for i in range(world_size)]


@dataclass(frozen=True)
class _Grid:
    """Geometry of a frame in data units: one row per rank, one column per chunk, a gap between
    rows for the arrows. Row 0 is at the top; ``y`` grows upwards."""

    world_size: int
    cell_w: float
    cell_h: float
    gap: float = 0.85
    label_w: float = 1.3
    unit_in: float = 0.42  #: inches per data unit, so 8 pt text fits whatever N is

    @classmethod
    def of(cls, frames: Sequence[RingFrame], world_size: int) -> _Grid:
        cells = [c for f in frames for row in f.cells for c in row if c is not None]
        chars = max((len(f"{v:g}") for c in cells for v in c.values), default=1)
        lines = max((len(c.values) for c in cells), default=1)
        return cls(world_size, cell_w=max(1.0, 0.22 * chars + 0.3), cell_h=0.3 + 0.32 * lines)

    def top(self, rank: int) -> float:
        return -rank * (self.cell_h + self.gap)

    def left(self, chunk: int) -> float:
        return self.label_w + chunk * self.cell_w

    @property
    def width(self) -> float:
        return self.label_w + self.world_size * self.cell_w + 1.4  # room for arrow labels

    @property
    def height(self) -> float:
        return self.world_size * (self.cell_h + self.gap) + 1.3  # header and wrap stubs

    def limits(self, ax: Axes) -> None:
        ax.set_xlim(0, self.width)
        ax.set_ylim(self.top(self.world_size - 1) - self.cell_h - self.gap - 0.15,
                    self.gap + 0.55)


def _draw_ring_frame(ax: Axes, frame: RingFrame, grid: _Grid) -> None:
    """One row per rank, one cell per chunk with its current values; colour = how many ranks'
    inputs the chunk holds; orange outline = sent this step, red = arrived this step; arrows
    carry each chunk from rank r-1 to rank r (rank N-1 to rank 0 leaves at the bottom and
    comes back in at the top)."""
    n = grid.world_size
    colours = _ring_colours(n)
    arrived = {(t.dest, t.chunk) for t in frame.transfers}
    sent = {(t.source, t.chunk) for t in frame.transfers}
    font = 8.0
    for chunk in range(n):
        ax.text(grid.left(chunk) + grid.cell_w / 2, grid.gap + 0.3, f"chunk {chunk}",
                ha="center", va="center", fontsize=font - 1, color="dimgray")
    for rank, row in enumerate(frame.cells):
        top = grid.top(rank)
        ax.text(grid.label_w - 0.15, top - grid.cell_h / 2, f"rank {rank}", ha="right",
                va="center", fontsize=font, fontweight="bold")
        for chunk, cell in enumerate(row):
            if cell is None:
                face, text, colour = "white", "·", "gray"
            else:
                count = len(cell.contributors)
                face = colours[count - 1] if count else "white"
                text = values_text(cell.values, "\n")
                colour = "white" if count > n / 2 else "black"
            if (rank, chunk) in arrived:
                edge, width, z = "tab:red", 2.4, 3
            elif (rank, chunk) in sent:
                edge, width, z = "tab:orange", 2.4, 3
            else:
                edge, width, z = "gray", 0.6, 2
            ax.add_patch(Rectangle((grid.left(chunk) + 0.05, top - grid.cell_h),
                                   grid.cell_w - 0.1, grid.cell_h, facecolor=face,
                                   edgecolor=edge, linewidth=width, zorder=z))
            ax.text(grid.left(chunk) + grid.cell_w / 2, top - grid.cell_h / 2, text,
                    ha="center", va="center", fontsize=font, color=colour, zorder=4)
    for t in frame.transfers:
        x = grid.left(t.chunk) + grid.cell_w / 2
        start = grid.top(t.source) - grid.cell_h
        label = values_text(t.values, " ")
        arrow = {"arrowstyle": "-|>", "color": "tab:orange", "lw": 1.6, "shrinkA": 0,
                 "shrinkB": 0}
        if t.dest == (t.source + 1) and t.dest < n:
            ax.annotate("", (x, grid.top(t.dest)), (x, start), arrowprops=arrow, zorder=5)
            ax.text(x + 0.12, start - grid.gap / 2, label, ha="left", va="center",
                    fontsize=font - 1, color="saddlebrown", zorder=6)
        else:  # the ring closes: out at the bottom, in at the top
            out = start - grid.gap * 0.75
            ax.annotate("", (x, out), (x, start), arrowprops=arrow, zorder=5)
            ax.text(x + 0.12, start - grid.gap * 0.4, f"{label} to rank {t.dest}",
                    ha="left", va="center", fontsize=font - 1, color="saddlebrown", zorder=6)
            ax.annotate("", (x, grid.top(t.dest)), (x, grid.top(t.dest) + grid.gap * 0.55),
                        arrowprops=arrow, zorder=5)
            ax.text(x + 0.12, grid.top(t.dest) + grid.gap * 0.35, f"from rank {t.source}",
                    ha="left", va="center", fontsize=font - 1, color="saddlebrown", zorder=6)
    grid.limits(ax)
    ax.axis("off")
    ax.set_title(frame.title, fontsize=font + 2)


def _ring_legend(fig: Figure, frames: Sequence[RingFrame], world_size: int, ncol: int) -> None:
    counts = sorted({len(c.contributors) for f in frames for row in f.cells for c in row
                     if c is not None and c.contributors})
    colours = _ring_colours(world_size)
    handles = [Patch(facecolor=colours[k - 1], edgecolor="gray",
                     label=f"{k} of {world_size} ranks summed" if k < world_size
                     else "finished: all ranks summed") for k in counts]
    handles += [Patch(facecolor="white", edgecolor="tab:orange", linewidth=2, label="sent"),
                Patch(facecolor="white", edgecolor="tab:red", linewidth=2, label="arrived")]
    fig.legend(handles=handles, loc="lower center", ncol=ncol, fontsize=7, frameon=False)


def ring_steps_figure(
    steps: Sequence[RingStep], world_size: int, numel: int,
    initial: Sequence[Sequence[float]] | None = None, columns: int = 4,
) -> Figure:
    """Small multiples of :func:`ring_frames`: the start and every ring step, in reading
    order, drawn as in :func:`ring_animation`."""
    frames = ring_frames(steps, world_size, numel, initial)
    grid = _Grid.of(frames, world_size)
    columns = max(1, min(columns, len(frames)))
    rows = math.ceil(len(frames) / columns)
    legend_in = 0.5
    fig, axes = plt.subplots(
        rows, columns, squeeze=False,
        figsize=(grid.width * grid.unit_in * columns,
                 grid.height * grid.unit_in * rows + legend_in),
    )
    for ax, frame in zip(axes.flat, frames, strict=False):
        _draw_ring_frame(ax, frame, grid)
    for ax in list(axes.flat)[len(frames):]:
        ax.axis("off")
    _ring_legend(fig, frames, world_size, ncol=6)
    fig.subplots_adjust(left=0, right=1, top=0.97, wspace=0.02, hspace=0.12,
                        bottom=legend_in / fig.get_figheight())
    return fig


def ring_animation(
    steps: Sequence[RingStep], world_size: int, numel: int,
    initial: Sequence[Sequence[float]] | None = None, *, interval_ms: int = 1500,
    dpi: int = 100,
) -> HTML:
    """An animation of a real ring trace, one frame per step plus the start, as a self-contained
    HTML player (``FuncAnimation.to_jshtml``: PNG frames inside the page, no ffmpeg, no
    network). Works for an all-reduce trace and for a reduce-scatter or all-gather alone."""
    frames = ring_frames(steps, world_size, numel, initial)
    grid = _Grid.of(frames, world_size)
    legend_in = 0.75
    fig, ax = plt.subplots(figsize=(max(grid.width * grid.unit_in, 4.0),
                                    grid.height * grid.unit_in + legend_in), dpi=dpi)
    _ring_legend(fig, frames, world_size, ncol=3)
    fig.subplots_adjust(left=0, right=1, top=0.94, bottom=legend_in / fig.get_figheight())

    def draw(i: int) -> list[Artist]:
        ax.clear()
        _draw_ring_frame(ax, frames[i], grid)
        return []

    anim = FuncAnimation(fig, draw, frames=len(frames), interval=interval_ms, blit=False)
    try:
        with plt.rc_context({"savefig.dpi": dpi}):
            html = anim.to_jshtml(default_mode="once")
    finally:
        plt.close(fig)
    return HTML(_offline_player(html))


#: The player's Font Awesome icons, drawn as plain characters instead.
_PLAYER_ICONS = {
    "fa-fast-backward": "|◀◀", "fa-step-backward": "|◀", "fa-play fa-flip-horizontal": "◀",
    "fa-pause": "❚❚", "fa-play": "▶", "fa-step-forward": "▶|", "fa-fast-forward": "▶▶|",
    "fa-minus": "−", "fa-plus": "+",
}


def _offline_player(html: str) -> str:
    """matplotlib's jshtml player loads Font Awesome from a CDN for its button icons; the book
    is read offline, so drop that stylesheet and write the icons as characters."""
    html = re.sub(r"<link[^>]*font-awesome[^>]*>", "", html)
    for name, text in _PLAYER_ICONS.items():
        html = html.replace(f'<i class="fa {name}"></i>', text)
    return html


# --- chapter 2: timings of one size ------------------------------------------------------------


def plot_collective_bars(timings: Sequence[CollectiveTiming]) -> Figure:
    """Two bar charts over the algorithms of one measurement (one collective, one size, one
    world size): time per call and bus bandwidth. Incorrect results are hatched in red."""
    labels = [t.case.label for t in timings]
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.0), layout="constrained")
    colours = ["tab:red" if not t.correct else "tab:blue" for t in timings]
    hatches = ["xx" if not t.correct else "" for t in timings]
    for ax, values, ylabel in (
        (left, [t.seconds * 1e6 for t in timings], "time per call (us, median)"),
        (right, [t.busbw_gbps for t in timings], "busbw (GB/s)"),
    ):
        bars = ax.bar(range(len(timings)), values, color=colours)
        for bar, hatch in zip(bars, hatches, strict=True):
            bar.set_hatch(hatch)
        ax.set_xticks(range(len(timings)), labels, rotation=20, ha="right")
        ax.set_ylabel(ylabel)
        ax.grid(True, axis="y", alpha=0.3)
    first = timings[0]
    fig.suptitle(f"{first.case.collective.value}, N = {first.world_size}, "
                 f"S = {format_size(first.case.size_bytes)} ({first.backend})", fontsize=10)
    return fig


# --- chapter 2: the cost model on the emulated link --------------------------------------------


def plot_link_sweep(timings: Sequence[LinkTiming], settings: LinkSweepSettings,
                    tolerance: float = 0.15) -> Figure:
    """One column per world size. Top: seconds per call against S (log-log), the model as
    lines (:func:`labs.cost_model.predict_on_link`), the measurements as markers at the
    fastest call with a bar up to the slowest (:class:`LinkTiming` says why the fastest), and
    the model's ring / recursive doubling crossover as a dashed line. Bottom: measured /
    predicted, the same markers and bars, with the band of +-``tolerance`` shaded."""
    world_sizes = sorted({t.world_size for t in timings})
    algorithms = list(dict.fromkeys(t.algorithm for t in timings))
    sizes = sorted({t.size_bytes for t in timings})
    grid = np.geomspace(sizes[0] / 2, sizes[-1] * 2, 200)
    palette = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    markers = "osD^v"
    fig, axes = plt.subplots(2, len(world_sizes), squeeze=False, sharex=True,
                             figsize=(4.1 * len(world_sizes), 6.2), layout="constrained",
                             height_ratios=(2.2, 1))
    for col, n in enumerate(world_sizes):
        top, bottom = axes[0][col], axes[1][col]
        for i, algorithm in enumerate(algorithms):
            colour, marker = palette[i % len(palette)], markers[i % len(markers)]
            top.plot(grid, [settings.predict(algorithm, float(s), n) for s in grid], "-",
                     color=colour, alpha=0.6, label=f"{algorithm.value} (model)")
            mine = sorted((t for t in timings if t.world_size == n and t.algorithm is algorithm),
                          key=lambda t: t.size_bytes)
            # Side by side in the ratio panel, where the algorithms' markers would overlap.
            shift = 2 ** (0.18 * (i - (len(algorithms) - 1) / 2))
            for ax, scale, dx in ((top, [1.0] * len(mine), 1.0),
                                  (bottom, [t.predicted for t in mine], shift)):
                x = [t.size_bytes * dx for t in mine]
                y = [t.fastest / k for t, k in zip(mine, scale, strict=True)]
                above = [(max(t.seconds) - t.fastest) / k for t, k in zip(mine, scale, strict=True)]
                ax.errorbar(x, y, yerr=[[0.0] * len(y), above], fmt=marker, color=colour, ms=5,
                            capsize=3, label=f"{algorithm.value} (measured)")
        cross = crossover_on_link(Algorithm.RING, Algorithm.RECURSIVE_DOUBLING, n,
                                  settings.link, segment_bytes=settings.segment_bytes)
        if cross is not None:
            top.axvline(cross, color="gray", ls="--", lw=1)
            top.text(cross, 0.02, f" model: ring = rec. doubling\n at {cross / 1e6:.1f} MB",
                     transform=top.get_xaxis_transform(), fontsize="x-small", color="gray")
        top.set_xscale("log", base=2)
        top.set_yscale("log")
        top.set(title=f"N = {n}", ylabel="seconds per call" if col == 0 else None)
        top.grid(True, which="major", alpha=0.3)
        bottom.axhspan(1 - tolerance, 1 + tolerance, color="tab:green", alpha=0.12,
                       label=f"within {tolerance:.0%}")
        bottom.axhline(1.0, color="black", lw=0.8)
        bottom.set_ylim(1 - 2 * tolerance, 1 + 2 * tolerance)
        bottom.set(xlabel="size S", ylabel="measured / model" if col == 0 else None)
        bottom.set_xticks(sizes, [format_size(s) for s in sizes])
        bottom.grid(True, alpha=0.3)
    handles, labels = axes[0][0].get_legend_handles_labels()
    for handle, label in zip(*axes[1][0].get_legend_handles_labels(), strict=True):
        if label.startswith("within"):
            handles, labels = [*handles, handle], [*labels, label]
    fig.legend(handles, labels, loc="outside lower center", ncol=4, fontsize="x-small")
    link = settings.link
    fig.suptitle(f"All-reduce on the emulated link (alpha = {link.alpha * 1e3:g} ms, "
                 f"{link.bandwidth / 1e6:g} MB/s): the fastest call of each case (marker), "
                 "up to the slowest (bar)", fontsize=10)
    return fig


def plot_algorithm_map(cells: Sequence[MapCell]) -> Figure:
    """The algorithm map: world sizes (rows) x sizes (columns), each cell coloured by the
    algorithm measured fastest and labelled with it and its margin over the runner-up; below
    it, the model's fastest (every algorithm within the map's ``near`` of it), and a red frame
    where the two disagree (:attr:`MapCell.agrees`)."""
    world_sizes = sorted({c.world_size for c in cells})
    sizes = sorted({c.size_bytes for c in cells})
    algorithms = list(dict.fromkeys(a for c in cells for a in c.by_model))
    palette = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    colour = {a: palette[i % len(palette)] for i, a in enumerate(algorithms)}
    fig, ax = plt.subplots(figsize=(1.35 * len(sizes) + 1.2, 1.05 * len(world_sizes) + 1.3),
                           layout="constrained")
    for c in cells:
        x, y = sizes.index(c.size_bytes), world_sizes.index(c.world_size)
        ax.add_patch(Rectangle((x - 0.5, y - 0.5), 1, 1, color=colour[c.measured], alpha=0.35))
        if not c.agrees:
            ax.add_patch(Rectangle((x - 0.47, y - 0.47), 0.94, 0.94, fill=False, ec="red", lw=2))
        margin = "" if math.isinf(c.margin) else f" ({c.margin:.2f}x)"
        ax.text(x, y + 0.13, f"{SHORT[c.measured]}{margin}", ha="center", va="center",
                fontsize="small", weight="bold")
        names = [SHORT[a] for a in c.contenders]
        lines = [" = ".join(names[i:i + 2]) for i in range(0, len(names), 2)]
        ax.text(x, y - 0.22, "model: " + "\n= ".join(lines), ha="center", va="center",
                fontsize="x-small")
    ax.set_xlim(-0.5, len(sizes) - 0.5)
    ax.set_ylim(-0.5, len(world_sizes) - 0.5)
    ax.set_xticks(range(len(sizes)), [format_size(s) for s in sizes])
    ax.set_yticks(range(len(world_sizes)), [f"N = {n}" for n in world_sizes])
    ax.set_xlabel("size S")
    fig.legend(handles=[Patch(color=colour[a], alpha=0.35, label=a.value) for a in algorithms],
               loc="outside lower center", ncol=len(algorithms), fontsize="x-small")
    ax.set_title("Fastest all-reduce on the link. Bold: measured (the runner-up's fastest call "
                 f"over the winner's); below: the model's choice, within {cells[0].near:.0%}",
                 fontsize=10)
    return fig
