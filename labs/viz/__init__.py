"""Figures and widget panels (matplotlib and ipywidgets; the ranks never import this package).

* :mod:`labs.viz.collectives` - chapters 1-4: gradient parity, the ring animation and steps,
  traffic and timing bars; :mod:`labs.viz.cost_model` - chapter 2: the fitted cost model
  beside the measurements;
* :mod:`labs.viz.ddp` - chapter 5: step times, the backward timeline, its tables;
* :mod:`labs.viz.memory` - chapters 3 and 4: what a rank holds, moment by moment (its table
  and figure), and what a block of code allocated;
* :mod:`labs.viz.zero` - chapter 6: memory per stage, the memory calculator;
* :mod:`labs.viz.activations` and :mod:`labs.viz.recipe` - chapter 7: activation bytes per
  layer, the recipe's loss curves and memory budget;
* :mod:`labs.viz.mesh` - chapter 8: the mesh's ranks and groups, drawn;
* :mod:`labs.viz.faults` - chapter 9: a step with a rank late, stragglers' steps;
* :mod:`labs.viz.widgets` - the widget panels, one module per chapter.
"""
