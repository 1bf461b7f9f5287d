"""Chapter 1's widget panel: the toy all-reduce on real ranks, at each world size.

A panel with ranks behind it is a :func:`labs.viz.recorded.recorded_panel`: its cell records a
small grid of settings for the rendered book, and its button runs the chosen one on new ranks.
"""

from __future__ import annotations

from collections.abc import Sequence

import ipywidgets as w
import matplotlib.pyplot as plt
from IPython.display import display

from labs.launcher import launch
from labs.tables import toy_table
from labs.toy_allreduce import ToyAllReduceConfig, toy_all_reduce_step
from labs.viz.collectives import plot_toy_allreduce
from labs.viz.recorded import Choice, recorded_panel


def show_toy_run(world_size: int, config: ToyAllReduceConfig) -> None:
    """Launch the toy all-reduce on real ranks, then print its table and draw its figure."""
    records = launch(toy_all_reduce_step, world_size, args=(config,), echo=False)
    print(f"world size {world_size}, seed {config.seed}: {records.seconds:.2f} s on "
          f"{world_size} real rank(s) ({records.backend.value})")
    print(toy_table(records))
    fig = plot_toy_allreduce(records)
    display(fig)
    plt.close(fig)


def toy_allreduce_panel(world_size: int = 4, seed: int = 0,
                        world_sizes: Sequence[int] = (1, 2, 3, 4, 8)) -> None:
    """The toy all-reduce at each of ``world_sizes`` (recorded, switched in the browser), and
    a button that runs the chosen world size with any seed on new ranks."""
    seed_box = w.IntText(value=seed, description="seed", layout=w.Layout(width="160px"))
    config = ToyAllReduceConfig(seed=seed)
    recorded_panel(
        [Choice("world size", tuple((str(n), n) for n in world_sizes), world_size)],
        lambda n: show_toy_run(n, config),
        live=lambda n: show_toy_run(n, ToyAllReduceConfig(seed=seed_box.value)),
        live_controls=[seed_box])
