"""Figures of chapter 7's recipe: loss curves of runs that continue one another, and the
memory budget of a step beside its measured peak."""

from __future__ import annotations

from collections.abc import Sequence

import matplotlib.pyplot as plt
from matplotlib.figure import Figure

from labs.experiments.recipe import BudgetRow, RecipeResult

_MIB = 2**20


def plot_losses(runs: Sequence[tuple[str, RecipeResult]], title: str = "") -> Figure:
    """Loss per optimizer step, one line per run, on the global step axis (a resumed run
    starts where its checkpoint was written)."""
    fig, ax = plt.subplots(figsize=(7, 3.4))
    for label, result in runs:
        steps = range(result.start_step + 1, result.start_step + len(result.losses) + 1)
        ax.plot(list(steps), result.losses, marker="o", markersize=3, label=label)
        if result.start_step:
            ax.axvline(result.start_step + 0.5, color="0.6", linestyle=":", linewidth=1)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("training loss (mean over ranks)")
    ax.set_title(title or "the recipe's loss")
    ax.grid(alpha=0.3)
    ax.legend(frameon=False)
    fig.tight_layout()
    return fig


def plot_budget(rows: Sequence[BudgetRow], peak_bytes: int | None = None,
                title: str = "") -> Figure:
    """One stacked bar of the closed forms, and (when measured) a bar of the peak."""
    fig, ax = plt.subplots(figsize=(7, 3.2))
    left = 0.0
    colors = plt.get_cmap("tab10").colors
    for i, row in enumerate(rows):
        ax.barh(1, row.model_bytes / _MIB, left=left, color=colors[i % 10], label=row.name)
        left += row.model_bytes / _MIB
    labels = ["closed forms"]
    if peak_bytes is not None:
        ax.barh(0, peak_bytes / _MIB, color="0.35", label="measured peak")
        labels = ["measured", "closed forms"]
    ax.set_yticks([0, 1] if peak_bytes is not None else [1], labels)
    ax.set_xlabel("MiB held by rank 0")
    ax.set_title(title or "memory budget at the peak of a step")
    ax.legend(frameon=False, fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    return fig
