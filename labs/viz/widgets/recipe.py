"""Chapter 7's widgets: the memory budget calculator of a transformer like the recipe's
(arithmetic, computed in the browser in the book) and the recipe trained on real ranks.

A panel with ranks behind it is a :func:`labs.viz.recorded.recorded_panel`: its cell records a
small grid of settings for the rendered book, and its button runs the chosen one on new ranks.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import ipywidgets as w
import matplotlib.pyplot as plt
from IPython.display import display

from labs.experiments.recipe import (
    RecipeConfig,
    budget_table,
    loss_report,
    memory_budget,
    recipe_worker,
    unit_sizes,
)
from labs.launcher import launch
from labs.tables import format_table
from labs.viz.calculators import WithBrowserFallback, budget_calculator_html
from labs.viz.recipe import plot_budget, plot_losses
from labs.viz.recorded import Choice, record, recorded_panel


def budget_calculator(config: RecipeConfig | None = None, world_size: int = 8,
                      vocab: int = 50_257) -> None:
    """Width, blocks, sequence, micro-batch, world size, dtype, checkpointing and
    accumulation of a transformer like the recipe's -> the closed form of each thing a rank
    holds at the peak of a step (:func:`labs.experiments.recipe.memory_budget`, arithmetic:
    nothing runs). Every change redraws: in a notebook in Python, in the rendered book in
    the browser (:func:`labs.viz.calculators.budget_calculator_html`)."""
    base = config or RecipeConfig(d_model=2048, n_heads=16, n_layers=24, seq_len=2048,
                                  batch_size=1)
    width = w.Dropdown(options=sorted({256, 512, 1024, 2048, 4096, 8192, base.d_model}),
                       value=base.d_model, description="width")
    blocks = w.IntSlider(value=base.n_layers, min=1, max=96, description="blocks")
    seq = w.Dropdown(options=sorted({128, 512, 1024, 2048, 4096, 8192, base.seq_len}),
                     value=base.seq_len, description="sequence")
    batch = w.IntSlider(value=base.batch_size, min=1, max=32, description="micro-batch")
    ranks = w.IntSlider(value=world_size, min=1, max=256, description="world size")
    dtype = w.Dropdown(options=["fp32", "bf16"], value=base.dtype, description="compute")
    ckpt = w.Checkbox(value=base.activation_checkpointing, description="checkpointing",
                      indent=False, layout=w.Layout(width="150px"))
    accumulation = w.IntSlider(value=base.accumulation, min=1, max=16,
                               description="micro-batches")
    out = w.Output(outputs=record(_show_budget, base, world_size, vocab))

    def show(*_: object) -> None:
        with out:
            out.clear_output(wait=True)
            heads = max(h for h in (1, 2, 4, 8, 16, 32, 64) if width.value % h == 0)
            _show_budget(dataclasses.replace(
                base, d_model=width.value, n_heads=heads, n_layers=blocks.value,
                seq_len=seq.value, batch_size=batch.value, dtype=dtype.value,
                activation_checkpointing=ckpt.value, accumulation=accumulation.value),
                ranks.value, vocab)

    controls = (width, blocks, seq, batch, ranks, dtype, ckpt, accumulation)
    for control in controls:
        control.observe(show, names="value")
    panel = WithBrowserFallback(
        w.VBox([w.HBox(list(controls[:4])), w.HBox(list(controls[4:])), out]),
        budget_calculator_html(base.d_model, base.n_heads, base.n_layers, base.seq_len,
                               base.batch_size, vocab, world_size, base.dtype,
                               base.activation_checkpointing, base.accumulation))
    display(panel)


def _show_budget(config: RecipeConfig, world_size: int, vocab: int) -> None:
    rows = memory_budget(config, world_size, vocab)
    total = sum(r.model_bytes for r in rows)
    parameters = sum(unit_sizes(config, vocab))
    print(f"{parameters / 1e9:.3g} B parameters ({config.n_layers} blocks of width "
          f"{config.d_model}, vocabulary {vocab:,}), world size {world_size}, "
          f"{config.dtype} compute, micro-batch {config.batch_size} x {config.seq_len} tokens, "
          f"{'with' if config.activation_checkpointing else 'without'} checkpointing: "
          f"{total / 2**30:.2f} GiB per rank at the peak")
    print(format_table(["held per rank", "GiB", "closed form"],
                       [[r.name, f"{r.model_bytes / 2**30:.3f}", r.how] for r in rows]))
    fig = plot_budget(rows, title="closed forms at the peak of a step")
    display(fig)
    plt.close(fig)


def show_recipe_run(world_size: int, config: RecipeConfig) -> None:
    """Train the recipe on real ranks, measuring the last step's memory: the loss table,
    the loss curve and the budget beside the measured peak."""
    result = launch(recipe_worker, world_size, args=(dataclasses.replace(
        config, measure_memory=True),), echo=False, timeout=600)[0]
    print(loss_report(result))
    print(budget_table(result))
    fig = plot_losses([(f"{world_size} ranks, {config.dtype}", result)])
    display(fig)
    plt.close(fig)


def recipe_panel(world_size: int = 2, config: RecipeConfig | None = None,
                 world_sizes: Sequence[int] = (1, 2, 4), dtypes: Sequence[str] = ("fp32", "bf16")
                 ) -> None:
    """World size and compute dtype (recorded, switched in the browser) -> a training run of
    the recipe on real ranks; beside the button, checkpointing, micro-batches and steps for a
    new run of the chosen setting."""
    base = config or RecipeConfig(steps=10)
    ckpt = w.Checkbox(value=base.activation_checkpointing, description="checkpointing",
                      indent=False, layout=w.Layout(width="150px"))
    accumulation = w.Dropdown(options=sorted({1, 2, 4, base.accumulation}),
                              value=base.accumulation, description="micro-batches",
                              layout=w.Layout(width="200px"))
    steps = w.IntSlider(value=base.steps, min=2, max=60, description="steps")
    recorded_panel(
        [Choice("world size", tuple((str(n), n) for n in world_sizes), world_size),
         Choice("compute", tuple((d, d) for d in dtypes), base.dtype)],
        lambda n, dtype: show_recipe_run(n, dataclasses.replace(base, dtype=dtype)),
        live=lambda n, dtype: show_recipe_run(n, dataclasses.replace(
            base, dtype=dtype, activation_checkpointing=ckpt.value,
            accumulation=accumulation.value, steps=steps.value)),
        live_controls=[ckpt, accumulation, steps])
