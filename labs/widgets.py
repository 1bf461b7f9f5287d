"""Widget panels: controls that build an experiment's settings and run it on real ranks."""

from __future__ import annotations

import ipywidgets as w
import matplotlib.pyplot as plt
from IPython.display import display

from labs.launch import launch
from labs.toy_allreduce import ToyAllReduceConfig, toy_all_reduce_step
from labs.viz import plot_toy_allreduce, toy_table


def show_toy_run(world_size: int, config: ToyAllReduceConfig) -> None:
    """Launch the toy all-reduce on real ranks, then print its table and draw its figure."""
    records = launch(toy_all_reduce_step, world_size, args=(config,), echo=False)
    print(f"world size {world_size}, seed {config.seed}: {records.seconds:.2f} s on "
          f"{world_size} real rank(s) ({records.backend.value})")
    print(toy_table(records))
    fig = plot_toy_allreduce(records)
    display(fig)
    plt.close(fig)


def toy_allreduce_panel(world_size: int = 4, seed: int = 0) -> None:
    """World size, seed and a run button. The default run is shown at once, as ordinary
    output (so a rendered page shows it); each click shows its own run in the panel."""
    size = w.IntSlider(value=world_size, min=1, max=8, description="world size")
    seed_box = w.IntText(value=seed, description="seed", layout=w.Layout(width="160px"))
    button = w.Button(description="Run on real ranks", button_style="primary", icon="play")
    out = w.Output()

    def run(_: w.Button) -> None:
        button.disabled, button.description = True, "Running..."
        try:
            with out:
                out.clear_output(wait=True)
                show_toy_run(size.value, ToyAllReduceConfig(seed=seed_box.value))
        finally:
            button.disabled, button.description = False, "Run on real ranks"

    button.on_click(run)
    display(w.VBox([w.HBox([size, seed_box, button]), out]))
    show_toy_run(world_size, ToyAllReduceConfig(seed=seed))
