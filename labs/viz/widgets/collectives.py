"""Chapters 2-4's widget panel: time a collective's algorithms on real ranks (and, for the
all-reduce, on the emulated link), with the shell command that runs the same sweep.

A panel with ranks behind it is a :func:`labs.viz.recorded.recorded_panel`: its cell records a
small grid of settings for the rendered book, and its button runs the chosen one on new ranks.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence

import ipywidgets as w
import matplotlib.pyplot as plt
from IPython.display import display

from labs.collectives import Algorithm, Collective
from labs.experiments import link_sweep
from labs.experiments.sweep import SweepSettings, run_sweep, sweep_tables
from labs.experiments.timing import dtype_name, format_size
from labs.link import Link
from labs.viz.collectives import plot_collective_bars
from labs.viz.recorded import Choice, recorded_panel

#: The message sizes the collective panel offers.
PANEL_SIZES: tuple[int, ...] = tuple(4 << (2 * i + 10) for i in range(7))  # 4 KiB .. 16 MiB


def sweep_command(settings: SweepSettings) -> str:
    """The shell command that runs the same experiment as ``settings``: every field that is
    not the default becomes a flag."""
    default = SweepSettings()
    algorithms = ("" if settings.algorithms is None else " --algorithms "
                  + " ".join(a.value.replace(" ", "-") for a in settings.algorithms))
    optional = [
        ("--dtype", settings.dtype != default.dtype, dtype_name(settings.dtype)),
        ("--segment-bytes", settings.segment_bytes != default.segment_bytes,
         " ".join("none" if s is None else format_size(s) for s in settings.segment_bytes)),
        ("--window", settings.window != default.window, str(settings.window)),
        ("--backends", settings.backends != default.backends,
         " ".join(b.value for b in settings.backends)),
        ("--launches", settings.launches != default.launches, str(settings.launches)),
        ("--threads", settings.threads != default.threads, str(settings.threads)),
        ("--min-bytes", settings.min_bytes != default.min_bytes,
         format_size(settings.min_bytes) if settings.min_bytes else "0"),
        ("--timeout", settings.timeout_s != default.timeout_s, f"{settings.timeout_s:g}"),
    ]
    return (f"python -m labs.bench collectives "
            f"--collectives {' '.join(c.value for c in settings.collectives)}{algorithms} "
            f"--sizes {' '.join(format_size(s) for s in settings.sizes)} "
            f"--world-sizes {' '.join(map(str, settings.world_sizes))} "
            f"--iters {settings.iters} --warmup {settings.warmup}"
            + "".join(f" {flag} {value}" for flag, differs, value in optional if differs))


def panel_settings(
    collective: Collective, world_size: int, size_bytes: int,
    algorithms: Sequence[Algorithm] | None = None, iters: int = 5, warmup: int = 1,
) -> SweepSettings:
    """The settings a :func:`collective_panel` run measures: one collective, one size, one
    world size, the chosen algorithms (default: every one the collective supports). Raises
    ValueError, saying what to change, for a combination that cannot run."""
    chosen = collective.algorithms() if algorithms is None else tuple(algorithms)
    if not chosen:
        raise ValueError("choose at least one algorithm to time.")
    wrong = [a for a in chosen if a not in collective.algorithms()]
    if wrong:
        names = ", ".join(a.value for a in collective.algorithms())
        raise ValueError(f"{collective.value} is implemented here by {names}; "
                         f"{wrong[0].value} is not one of them.")
    return SweepSettings(collectives=(collective,), algorithms=tuple(dict.fromkeys(chosen)),
                         sizes=(size_bytes,), world_sizes=(world_size,), iters=iters,
                         warmup=warmup)


def show_collective_run(settings: SweepSettings) -> None:
    """Run ``settings`` on real ranks, then print the nccl-tests style table and draw the
    time and bus-bandwidth bars."""
    start = time.perf_counter()
    timings = run_sweep(settings)
    took = time.perf_counter() - start
    print(f"{len(timings)} case(s) on {settings.world_sizes[0]} real ranks in {took:.1f} s "
          f"(launch included); the same from a shell:\n  {sweep_command(settings)}\n")
    print(sweep_tables(timings))
    fig = plot_collective_bars(timings)
    display(fig)
    plt.close(fig)


def collective_panel(
    collective: Collective, world_size: int = 4, size_bytes: int = 1 << 20,
    world_sizes: Sequence[int] = (2, 4, 8), sizes: Sequence[int] = (4 << 10, 1 << 20),
    iters: int = 5, link: Link | None = None,
) -> None:
    """Every algorithm of ``collective`` at each world size and message size of the grid,
    timed on real ranks (:func:`labs.experiments.sweep.run_sweep`, one launch per world size)
    and switched in the browser; the button times the chosen setting again on new ranks.

    With a ``link`` (all-reduce only), a checkbox beside the button runs labs' own algorithms
    on that emulated network instead (:func:`labs.experiments.link_sweep.measure_on_link`)
    and prints each one's time beside the model's (torch's built-in is left out: the link
    does not carry its messages)."""
    # min_bytes 1 MiB (the sweep's default carries 64 MiB per size): a 4 KiB median is still
    # over 256 calls, and the grid costs a third of the time at every `make book`.
    grid = dataclasses.replace(panel_settings(collective, world_sizes[0], sizes[0], None, iters),
                               sizes=tuple(sizes), world_sizes=tuple(world_sizes),
                               min_bytes=1 << 20)
    start = time.perf_counter()
    timings = run_sweep(grid)
    took = time.perf_counter() - start

    def render(n: int, size: int) -> None:
        mine = [t for t in timings if t.world_size == n and t.case.size_bytes == size]
        print(f"{collective.value} of {format_size(size)} on {n} real ranks, every algorithm "
              f"(the grid took {took:.1f} s); the same from a shell:\n  "
              f"{sweep_command(dataclasses.replace(grid, sizes=(size,), world_sizes=(n,)))}\n")
        print(sweep_tables(mine))
        fig = plot_collective_bars(mine)
        display(fig)
        plt.close(fig)

    on_link = w.Checkbox(value=False, indent=False, layout=w.Layout(width="auto"),
                         description="" if link is None else
                         f"on the emulated link ({link.alpha * 1e3:g} ms, "
                         f"{link.bandwidth / 1e6:g} MB/s)")

    def live(n: int, size: int) -> None:
        if on_link.value and link is not None:
            mine = tuple(a for a in collective.algorithms() if a is not Algorithm.TORCH)
            settings = link_sweep.LinkSweepSettings(link=link, sizes=(size,), world_sizes=(n,),
                                                    algorithms=mine)
            print(link_sweep.link_table(link_sweep.measure_on_link(settings)))
            return
        show_collective_run(panel_settings(collective, n, size, None, iters))

    extra = [on_link] if link is not None and collective is Collective.ALL_REDUCE else []
    recorded_panel(
        [Choice("world size", tuple((str(n), n) for n in world_sizes), world_size),
         Choice("size S", tuple((format_size(b), b) for b in sizes), size_bytes)],
        render, live=live, live_controls=extra)
