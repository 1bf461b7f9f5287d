"""Chapter 6's widgets: the memory calculator (arithmetic, computed in the browser in the book)
and the ZeRO panel, one measured step per world size and stage.

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

from labs.experiments.zero import (
    LAB_SETTINGS,
    MemoryReport,
    Recipe,
    TrafficRow,
    measure_memory,
    measure_traffic,
)
from labs.models import StepSettings
from labs.viz.calculators import WithBrowserFallback, zero_calculator_html
from labs.viz.recorded import Choice, record, recorded_panel
from labs.viz.zero import calculator_table, plot_calculator, plot_step_memory
from labs.wrappers import ZERO_STAGES, Wrapper


def memory_calculator(parameters: float = 7e9, recipe: Recipe = Recipe.MIXED,
                      world_size: int = 8, memory_gb: float = 80.0) -> None:
    """Model size, precision recipe, world size and memory per GPU -> bytes per parameter and
    GB per rank at every ZeRO stage (arithmetic: :func:`labs.experiments.zero.bytes_per_parameter`).
    Every change redraws: in a notebook in Python, in the rendered book in the browser
    (:func:`labs.viz.calculators.zero_calculator_html`, any size a reader types)."""
    size = w.FloatLogSlider(value=parameters, base=10, min=6, max=12, step=0.1,
                            description="parameters", readout_format=".2g")
    recipes = w.Dropdown(options=[(r.value, r) for r in Recipe], value=recipe,
                         description="recipe", layout=w.Layout(width="420px"))
    ranks = w.IntSlider(value=world_size, min=1, max=64, description="world size")
    memory = w.FloatText(value=memory_gb, description="GB per GPU", layout=w.Layout(width="200px"))
    out = w.Output(outputs=record(_show_calculator, parameters, recipe, world_size, memory_gb))

    def show(*_: object) -> None:
        with out:
            out.clear_output(wait=True)
            _show_calculator(size.value, recipes.value, ranks.value, memory.value)

    for control in (size, recipes, ranks, memory):
        control.observe(show, names="value")
    panel = WithBrowserFallback(
        w.VBox([w.HBox([size, ranks]), w.HBox([recipes, memory]), out]),
        zero_calculator_html(parameters, recipe, world_size, memory_gb))
    display(panel)


def _show_calculator(parameters: float, recipe: Recipe, world_size: int, memory_gb: float
                     ) -> None:
    print(calculator_table(parameters, recipe, world_size, memory_gb * 1e9))
    fig = plot_calculator(parameters, recipe, world_size)
    display(fig)
    plt.close(fig)


def show_zero_run(world_size: int, strategy: Wrapper, settings: StepSettings) -> None:
    """Measure one strategy on real ranks: rank 0's memory through one step (every moment
    the strategy exposes) and the bytes it sends."""
    start = time.perf_counter()
    report = measure_memory([world_size], settings, [strategy])[(strategy, world_size)]
    traffic = measure_traffic([world_size], settings, [strategy])[0]
    print(f"measured in {time.perf_counter() - start:.1f} s on real ranks")
    _show_zero_report(world_size, strategy, settings, report, traffic)


def _show_zero_report(world_size: int, strategy: Wrapper, settings: StepSettings,
                      report: MemoryReport, traffic: TrafficRow | None) -> None:
    print(f"{strategy.value}, world size {world_size}, {settings.parameters:,} parameters "
          f"({settings.layers} x Linear({settings.width}, {settings.width})), Adam")
    sent = ("sends nothing: one rank" if traffic is None else
            f"sent {traffic.measured:.3f} S per step (closed form {traffic.expected:.3f} S)")
    print(f"peak {report.peak_bytes / settings.parameters:.2f} bytes per parameter "
          f"({report.peak.moment}); {sent}")
    fig = plot_step_memory(report)
    display(fig)
    plt.close(fig)


def zero_panel(world_size: int = 4, strategy: Wrapper = Wrapper.FSDP,
               settings: StepSettings | None = None,
               world_sizes: Sequence[int] = (1, 2, 4, 8),
               reports: dict[tuple[Wrapper, int], MemoryReport] | None = None,
               traffic: Sequence[TrafficRow] | None = None) -> None:
    """World size and ZeRO stage -> one measured step: rank 0's memory over time and the
    bytes it sent. The grid is ``reports`` and ``traffic`` where the chapter has measured
    them already (:func:`labs.experiments.zero.measure_memory`, ``measure_traffic``), else
    measured here; the button measures the chosen setting again, at any layer width."""
    base = settings or LAB_SETTINGS
    reports = reports or measure_memory(world_sizes, base)
    traffic = list(traffic) if traffic is not None else measure_traffic(
        [n for n in world_sizes if n > 1], base)
    missing = [(s, n) for n in world_sizes for s in ZERO_STAGES if (s, n) not in reports]
    if missing:
        raise ValueError(f"reports lacks {missing[0][0].value} at world size {missing[0][1]}: "
                         "measure every stage at every world size of the panel.")
    width = w.Dropdown(options=sorted({32, 64, 128, 256, base.width}), value=base.width,
                       description="layer width", layout=w.Layout(width="200px"))

    def render(n: int, stage: Wrapper) -> None:
        sent = next((t for t in traffic if t.world_size == n and t.strategy is stage), None)
        _show_zero_report(n, stage, base, reports[(stage, n)], sent)

    recorded_panel(
        [Choice("world size", tuple((str(n), n) for n in world_sizes), world_size),
         Choice("stage", tuple((s.value, s) for s in ZERO_STAGES), strategy)],
        render, live=lambda n, stage: show_zero_run(
            n, stage, dataclasses.replace(base, width=width.value)),
        live_controls=[width])
