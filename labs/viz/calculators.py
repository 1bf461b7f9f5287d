"""The memory calculators as HTML that computes in the reader's browser.

A calculator is arithmetic, so the rendered book need not record it: it ships the formula.
:func:`zero_calculator_html` and :func:`budget_calculator_html` write a form and
``calculators.js`` (the same formulas as :func:`labs.experiments.zero.bytes_per_parameter` and
:func:`labs.experiments.recipe.memory_budget`, in JavaScript) into one ``text/html`` output.
:class:`WithBrowserFallback` puts that HTML beside a widget in one display: a running notebook
shows the widget (computed in Python), the rendered book the HTML (``_config.yml`` ranks
``text/html`` above the widget view for the html builder). tests/test_book_panels.py types into
the page and checks every number against the Python functions.
"""

from __future__ import annotations

import html
import json
import uuid
from pathlib import Path
from typing import Any

import ipywidgets as w

from labs.experiments.zero import Recipe, bytes_per_parameter
from labs.wrappers import ZERO_STAGES

SCRIPT = Path(__file__).with_name("calculators.js")
#: Parameters, gradients, optimizer: the colours of labs.viz.zero's calculator figure.
ZERO_COLOURS = ("#4c72b0", "#dd8452", "#55a868")
BUDGET_COLOURS = ("#4c72b0", "#55a868", "#dd8452", "#c44e52", "#8172b3", "#937860")
#: What memory_budget's rows say, by case (its BudgetRow.how).
BUDGET_HOW = {
    "parameters": "fp32 shards: 4 B x P/N",
    "optimizer": "Adam, fp32 shards: 2 x 4 B x P/N",
    "gradients_kept": "kept whole by no_sync, fp32: 4 B x P",
    "gradients_none": "none yet: the shards appear after the peak",
    "activations": "saved for backward, one micro-batch",
    "activations_ckpt": "blocks' inputs, one micro-batch",
    "buffers": "the last block gathered for its backward",
    "buffers_ckpt": "two blocks gathered, one block's full gradient",
    "recomputed": "one block's activations: BT(16D + HT + 4)e + T^2",
}

STYLE = """<style>
.labs-calculator { border: 1px solid #ccc; border-radius: 4px; padding: 0.6em; margin: 0.5em 0; }
.labs-calculator label { display: inline-block; margin: 0.2em 1em 0.2em 0; }
.labs-calculator input[type=number] { width: 7em; }
.labs-calc-table { border-collapse: collapse; margin: 0.5em 0; font-size: 0.9em; }
.labs-calc-table th, .labs-calc-table td { border: 1px solid #ddd; padding: 0.15em 0.5em;
  text-align: right; }
.labs-calc-chart { position: relative; margin: 0.3em 0; }
.labs-calc-bar { display: flex; align-items: center; margin: 2px 0; }
.labs-calc-bar-label { width: 10em; font-size: 0.85em; }
.labs-calc-bar-track { flex: 1; display: flex; height: 1.1em; }
.labs-calc-bar-track span { height: 100%; }
.labs-calc-limit { position: absolute; top: 0; bottom: 0; border-left: 2px dashed #c44e52; }
.labs-calc-key { display: inline-block; width: 0.9em; height: 0.9em; vertical-align: middle; }
.labs-calc-legend, .labs-calc-caption { font-size: 0.85em; }
.labs-calc-error { color: #b00; }
</style>"""


def _number(name: str, label: str, value: float | int, step: str = "1") -> str:
    return (f'<label>{html.escape(label)} <input type="number" name="{name}" '
            f'value="{value:g}" min="0" step="{step}"></label>')


def _select(name: str, label: str, options: list[tuple[str, str]], value: str) -> str:
    choices = "".join(
        f'<option value="{html.escape(v)}"{" selected" if v == value else ""}>'
        f'{html.escape(text)}</option>' for text, v in options)
    return f'<label>{html.escape(label)} <select name="{name}">{choices}</select></label>'


def _page(kind: str, title: str, inputs: list[str], config: dict[str, Any]) -> str:
    root = f"labs-calc-{kind}-{uuid.uuid4().hex[:8]}"
    return (f'{STYLE}<div class="labs-calculator" id="{root}" data-kind="{kind}">'
            f'<div><b>{html.escape(title)}</b> (computed in your browser)</div>'
            f'<div>{"".join(inputs)}</div><div class="labs-calc-out"></div></div>'
            f'<script>{SCRIPT.read_text(encoding="utf-8")}\n'
            f'window.labsCalculators.{kind}({json.dumps(root)}, {json.dumps(config)});</script>')


def zero_calculator_html(parameters: float = 7e9, recipe: Recipe = Recipe.MIXED,
                         world_size: int = 8, memory_gb: float = 80.0) -> str:
    """Chapter 6's calculator as a form: model size (billions), recipe, world size and GB
    per GPU -> bytes per parameter and GB per rank at every ZeRO stage, and a bar chart."""
    recipes = {r.value: [bytes_per_parameter(r, 0, 1).parameters,
                         bytes_per_parameter(r, 0, 1).gradients,
                         bytes_per_parameter(r, 0, 1).optimizer] for r in Recipe}
    config = {"recipes": recipes, "stages": [[s.value, s.stage] for s in ZERO_STAGES],
              "colours": list(ZERO_COLOURS)}
    inputs = [_number("parameters", "parameters (billions)", parameters / 1e9, "any"),
              _select("recipe", "recipe", [(r.value, r.value) for r in Recipe], recipe.value),
              _number("world_size", "world size", world_size),
              _number("memory_gb", "GB per GPU", memory_gb, "any")]
    return _page("zero", "Memory per rank at each ZeRO stage", inputs, config)


def budget_calculator_html(width: int = 2048, heads: int = 16, blocks: int = 24,
                           sequence: int = 2048, micro_batch: int = 1, vocab: int = 50_257,
                           world_size: int = 8, dtype: str = "fp32",
                           checkpointing: bool = False, accumulation: int = 1) -> str:
    """Chapter 7's budget as a form: the transformer's shape, world size, compute dtype,
    checkpointing and micro-batches -> each closed form a rank holds at the peak of a step."""
    if dtype not in ("fp32", "bf16"):
        raise ValueError(f"dtype must be 'fp32' or 'bf16', got {dtype!r}.")
    config = {"how": BUDGET_HOW, "colours": list(BUDGET_COLOURS)}
    inputs = [_number("width", "width", width), _number("heads", "heads", heads),
              _number("blocks", "blocks", blocks), _number("sequence", "sequence", sequence),
              _number("micro_batch", "micro-batch", micro_batch),
              _number("vocab", "vocabulary", vocab),
              _number("world_size", "world size", world_size),
              _select("dtype", "compute", [("fp32", "fp32"), ("bf16", "bf16")], dtype),
              f'<label><input type="checkbox" name="checkpointing"'
              f'{" checked" if checkpointing else ""}> checkpointing</label>',
              _number("accumulation", "micro-batches per step", accumulation)]
    return _page("budget", "Memory budget of one rank at the peak of a step", inputs, config)


class WithBrowserFallback:
    """One display of a widget and an HTML stand-in: Jupyter shows the widget (its view
    ranks first), the rendered book the HTML."""

    def __init__(self, widget: w.Widget, html_text: str) -> None:
        self.widget, self.html = widget, html_text

    def _repr_mimebundle_(self, include: Any = None, exclude: Any = None) -> dict[str, Any]:
        bundle = dict(self.widget._repr_mimebundle_() or {})
        bundle["text/html"] = self.html
        return bundle
