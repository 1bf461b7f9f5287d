"""Chapter 5's widget panel: NaiveDDP, labs' DDP and torch DDP timed on real ranks, by world
size, bucket cap and micro-batches, and one backward pass drawn.

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

from labs.experiments.ddp import cap_text, default_cases, measure_step_times, measure_timelines
from labs.link import Link
from labs.models import StepSettings
from labs.viz.ddp import plot_step_times, plot_timeline, step_time_table
from labs.viz.recorded import Choice, recorded_panel
from labs.wrappers import Wrapper

#: Bucket caps the DDP panel offers (MiB): 16 KiB to 25 MiB, torch's default.
DDP_PANEL_CAPS: tuple[float, ...] = (1 / 64, 1 / 16, 1 / 4, 1.0, 4.0, 25.0)


def show_ddp_run(world_size: int, settings: StepSettings, link: Link | None = None) -> None:
    """Time NaiveDDP, labs' DDP and torch DDP on real ranks at ``settings`` (the step-time
    table and bars, median and range), then draw one measured backward pass of NaiveDDP and
    DDP (a Gantt chart). On ``link`` torch's DDP is left out: the link does not carry its
    collectives."""
    start = time.perf_counter()
    cases = [c for c in default_cases(settings.bucket_cap_mb)
             if link is None or c.wrapper is not Wrapper.TORCH_DDP]
    rows = measure_step_times(world_size, settings, cases, link=link)
    timelines = measure_timelines(world_size, settings, link=link)
    where = (f"on an emulated link (alpha {link.alpha * 1e3:g} ms, {link.bandwidth / 1e6:g} MB/s)"
             if link else "on this machine's loopback")
    print(f"world size {world_size}, {settings.parameters:,} parameters, bucket cap "
          f"{cap_text(settings.bucket_cap_mb)}, {settings.accumulation} micro-batch(es) per "
          f"optimizer step (no_sync() around all but the last), {where}: "
          f"{time.perf_counter() - start:.1f} s on real ranks")
    print(step_time_table(rows))
    for fig in (plot_step_times(rows, title="Milliseconds per optimizer step"),
                plot_timeline({impl: t[0] for impl, t in timelines.items()},
                              title="One backward pass, rank 0")):
        display(fig)
        plt.close(fig)


def ddp_panel(world_size: int = 2, bucket_cap_mb: float = 0.25, accumulation: int = 1,
              settings: StepSettings | None = None, link: Link | None = None,
              world_sizes: Sequence[int] = (2, 4), caps: Sequence[float] = (0.25, 25.0)
              ) -> None:
    """World size and bucket cap (recorded on the loopback, switched in the browser), with
    micro-batches per optimizer step and, with ``link``, a box that puts the run on that
    emulated network, beside the button that runs the chosen setting on new ranks
    (:func:`show_ddp_run`)."""
    base = settings or StepSettings()
    micro = w.IntSlider(value=accumulation, min=1, max=8, description="micro-batches")
    on_link = w.Checkbox(value=False, description="on the emulated link", indent=False,
                         layout=w.Layout(display="flex" if link else "none"))

    def render(n: int, cap: float) -> None:
        show_ddp_run(n, dataclasses.replace(base, bucket_cap_mb=cap, accumulation=accumulation))

    def live(n: int, cap: float) -> None:
        show_ddp_run(n, dataclasses.replace(base, bucket_cap_mb=cap, accumulation=micro.value),
                     link if on_link.value else None)

    recorded_panel(
        [Choice("world size", tuple((str(n), n) for n in world_sizes), world_size),
         Choice("bucket cap", tuple((cap_text(c), c) for c in caps), bucket_cap_mb)],
        render, live=live, live_controls=[micro, on_link])
