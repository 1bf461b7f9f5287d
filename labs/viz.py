"""Tables and figures for the notebooks: plain text tables (deterministic, so nbval can compare
them) and matplotlib figures."""

from __future__ import annotations

from collections.abc import Sequence

import matplotlib.pyplot as plt
import torch
from matplotlib.figure import Figure

from labs.toy_allreduce import ToyRankRecord


def format_table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A fixed-width text table; floats are written with 9 significant digits (float32)."""
    cells = [[_cell(v) for v in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(header)]
    lines = ["  ".join(h.rjust(w) for h, w in zip(header, widths, strict=True))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)) for row in cells]
    return "\n".join(lines)


def _cell(value: object) -> str:
    return f"{value:.9g}" if isinstance(value, float) else str(value)


def toy_table(records: Sequence[ToyRankRecord]) -> str:
    """Per-rank values before and after the all-reduce and the SGD step."""
    header = ["rank", "grad before", "after all_reduce (sum)", "/ world size", "param before",
              "param after", "param bits"]
    rows = [
        [r.rank, r.local_grad, r.summed, r.averaged, r.param_before, r.param_after,
         r.param_after_bits]
        for r in records
    ]
    return format_table(header, rows)


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


def plot_gradient_parity(
    reference: dict[str, torch.Tensor], averaged: dict[str, torch.Tensor], title: str
) -> Figure:
    """Every gradient entry: full-batch reference (x) against the all-reduced average (y).
    Points on the diagonal mean the two are equal."""
    x = torch.cat([reference[n].reshape(-1) for n in reference]).numpy()
    y = torch.cat([averaged[n].reshape(-1) for n in reference]).numpy()
    fig, ax = plt.subplots(figsize=(4, 4), layout="constrained")
    lo, hi = float(min(x.min(), y.min())), float(max(x.max(), y.max()))
    ax.plot([lo, hi], [lo, hi], color="gray", lw=1, label="equal")
    ax.scatter(x, y, s=6, alpha=0.6, color="tab:blue", label="gradient entries")
    ax.set(xlabel="full-batch gradient (one process)", ylabel="all-reduced average (ranks)",
           title=title)
    ax.legend(loc="upper left", fontsize="small")
    return fig
