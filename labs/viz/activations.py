"""Chapter 7's tables and figure of activation memory: bytes per layer with and without
activation checkpointing, one block's saved tensors, and checkpointing's bytes and step time
(from :mod:`labs.activations`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import matplotlib.pyplot as plt
from matplotlib.figure import Figure

from labs.activations import ActivationReport, SavedKind
from labs.experiments.activations import CheckpointCase
from labs.tables import format_table


def _layer_names(reports: Mapping[str, ActivationReport]) -> list[str]:
    names: list[str] = []
    for report in reports.values():
        names += [layer.name for layer in report.layers if layer.name not in names]
    return names


def activation_table(reports: Mapping[str, ActivationReport]) -> str:
    """Bytes per layer, one column per report (``{"without checkpointing": ..., ...}``), and
    the totals; a layer a report has no line for is left blank."""
    if not reports:
        raise ValueError("nothing to tabulate: pass {label: ActivationReport}")
    names = _layer_names(reports)
    by_layer = {label: r.bytes_by_layer() for label, r in reports.items()}
    rows: list[list[object]] = [[name, *(b.get(name, "") for b in by_layer.values())]
                                for name in names]
    rows.append(["total", *(r.total_bytes for r in reports.values())])
    return format_table(["layer", *(f"{label} (bytes)" for label in reports)], rows)


def saved_tensors_table(report: ActivationReport, prefix: str = "blocks.0") -> str:
    """What module ``prefix`` and its children saved for backward, in order: the op, shape,
    dtype, the bytes the tensor spans, the bytes it adds (its storage's, once), and why it
    adds nothing when it does not (a parameter, the batch, a storage counted already)."""
    saved = report.saved_in(prefix)
    if not saved:
        raise ValueError(f"no saved tensors under {prefix!r}: measure with measure_saved, and "
                         "give a module name such as 'blocks.0'")
    rows = [[s.module, s.op, "x".join(map(str, s.shape)) or "scalar", s.dtype, s.nbytes,
             s.counted_bytes, "" if s.kind is SavedKind.ACTIVATION else s.kind.value]
            for s in saved]
    rows.append(["total", "", "", "", "", sum(s.counted_bytes for s in saved), ""])
    return format_table(["module", "op", "shape", "dtype", "tensor bytes", "counted bytes",
                         "not counted: why"], rows)


def checkpointing_table(cases: Sequence[CheckpointCase]) -> str:
    """Per case: activation bytes measured and by the formula, their ratio to the first case,
    the step time (median and range over the repeats, ms) and the module forwards that
    backward ran again."""
    if not cases:
        raise ValueError("nothing to tabulate: pass the cases of measure_checkpointing")
    base = cases[0].activation_bytes
    rows = [["yes" if c.checkpointing else "no", c.activation_bytes, c.formula_bytes,
             f"{c.activation_bytes / base:.3f}", f"{1e3 * c.median_seconds:.1f}",
             f"{1e3 * c.min_seconds:.1f}-{1e3 * c.max_seconds:.1f}", c.recomputed]
            for c in cases]
    return format_table(["checkpointing", "activation bytes", "formula", "ratio",
                         "step median (ms)", "min-max (ms)", "recomputed forwards"], rows)


def _unit(nbytes: float) -> tuple[float, str]:
    for scale, name in ((1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB")):
        if nbytes >= scale:
            return float(scale), name
    return 1.0, "bytes"


def plot_activations(reports: Mapping[str, ActivationReport], *, title: str = "") -> Figure:
    """One group of bars per layer (in forward order), one bar per report: the activation
    bytes each layer leaves for backward; the legend gives each report's total."""
    if not reports:
        raise ValueError("nothing to plot: pass {label: ActivationReport}")
    names = _layer_names(reports)
    scale, unit = _unit(max(layer.nbytes for r in reports.values() for layer in r.layers))
    width = 0.8 / len(reports)
    fig, ax = plt.subplots(figsize=(max(6.0, 0.55 * len(names)), 3.4), layout="constrained")
    for i, (label, report) in enumerate(reports.items()):
        by_layer = report.bytes_by_layer()
        xs = [x - 0.4 + width * (i + 0.5) for x in range(len(names))]
        ax.bar(xs, [by_layer.get(n, 0) / scale for n in names], width * 0.92,
               label=f"{label}: {report.total_bytes / scale:.3g} {unit} in all",
               color=plt.get_cmap("tab10")(i % 10), edgecolor="black", linewidth=0.5)
    ax.set_xticks(range(len(names)), names, rotation=60, ha="right", fontsize="small")
    ax.set(ylabel=f"activation bytes ({unit})",
           title=title or "Bytes kept for backward, per layer")
    top = max(by / scale for r in reports.values() for by in r.bytes_by_layer().values())
    ax.set_ylim(0, 1.35 * top)  # room above the bars for the legend
    ax.legend(fontsize="small", frameon=False, loc="upper center", ncols=len(reports))
    return fig
