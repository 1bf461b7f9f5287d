"""Widget panels: controls that build an experiment's settings and run it on real ranks, one
module per chapter; a notebook calls them as ``widgets.<panel>(...)``.

Every panel with ranks behind it is a :func:`labs.viz.recorded.recorded_panel`: when its cell
runs (for the book, at build time) it runs a small grid of settings and keeps each output, and
its controls switch between them in the browser, so the rendered book's panels work with no
kernel; in a running notebook its button launches the chosen setting on new ranks. The memory
calculators are arithmetic: in the book they compute in the browser
(:mod:`labs.viz.calculators`), in a notebook in Python.

* :mod:`~labs.viz.widgets.toy` - chapter 1: :func:`toy_allreduce_panel`;
* :mod:`~labs.viz.widgets.collectives` - chapters 2-4: :func:`collective_panel`;
* :mod:`~labs.viz.widgets.ddp` - chapter 5: :func:`ddp_panel`;
* :mod:`~labs.viz.widgets.zero` - chapter 6: :func:`memory_calculator`, :func:`zero_panel`;
* :mod:`~labs.viz.widgets.recipe` - chapter 7: :func:`budget_calculator`, :func:`recipe_panel`;
* :mod:`~labs.viz.widgets.topology` - chapter 8: :func:`topology_panel`;
* :mod:`~labs.viz.widgets.faults` - chapter 9: :func:`death_panel`.
"""

from labs.viz.widgets.collectives import collective_panel, panel_settings, sweep_command
from labs.viz.widgets.ddp import ddp_panel
from labs.viz.widgets.faults import death_panel
from labs.viz.widgets.recipe import budget_calculator, recipe_panel
from labs.viz.widgets.topology import topology_panel
from labs.viz.widgets.toy import toy_allreduce_panel
from labs.viz.widgets.zero import memory_calculator, zero_panel

__all__ = [
    "budget_calculator",
    "collective_panel",
    "ddp_panel",
    "death_panel",
    "memory_calculator",
    "panel_settings",
    "recipe_panel",
    "sweep_command",
    "topology_panel",
    "toy_allreduce_panel",
    "zero_panel",
]
