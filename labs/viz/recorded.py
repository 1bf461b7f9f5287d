"""Panels that still work in the rendered book: recorded runs, switched in the browser.

A chapter's panel asks "what happens at 8 ranks, at 1 MiB, with one bucket?". A running
notebook answers by launching ranks; the rendered book has no kernel. So a panel runs a small
grid of settings when its cell executes (at build time, for the book), stores each setting's
output (the printed table and the figure) in an ``Output`` widget, and stacks those outputs:
one ``Stack`` per control, nested, each stack's ``selected_index`` tied to its control's
``index`` by ``jslink``. ``jslink`` runs in the browser, in the widget state the page embeds,
so a reader who clicks "8 ranks" sees the run of 8 ranks with no kernel and no network. In a
running notebook the same links work, and the panel's button launches the chosen setting on
new ranks (:func:`recorded_panel`'s ``live``).

A grid of c₁ x c₂ x ... settings holds one leaf ``Output`` per setting and
1 + c₁ + c₁·c₂ + ... stacks, each with one link.
"""

from __future__ import annotations

import base64
import io
import itertools
import os
import platform
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ipywidgets as w
from IPython.display import display
from IPython.utils.capture import capture_output

#: Shown under every recorded panel, after the machine it ran on.
LIVE_HINT = ("Open the notebook in Jupyter to run the chosen setting on new ranks "
             "with the button.")


@dataclass(frozen=True)
class Choice:
    """One control of a recorded panel: what it sets, and the values the grid runs.

    ``options`` pairs each button's label with the value the render function gets;
    ``default`` is the value selected when the panel opens."""

    description: str
    options: tuple[tuple[str, Any], ...]
    default: Any = None

    def __post_init__(self) -> None:
        if not self.options:
            raise ValueError(f"the control {self.description!r} needs at least one option.")
        values = [v for _, v in self.options]
        if self.default is not None and self.default not in values:
            raise ValueError(f"the default {self.default!r} of {self.description!r} is not "
                             f"one of its options {values}: add it, or pick one of them.")

    @property
    def values(self) -> tuple[Any, ...]:
        return tuple(v for _, v in self.options)

    @property
    def default_index(self) -> int:
        return 0 if self.default is None else self.values.index(self.default)


def machine_line() -> str:
    """Where this process runs, in a few words: CPU model and cores, OS, Python, torch."""
    import torch  # here, not at the top: the module is read by the book's tests too

    cpu = platform.processor() or platform.machine()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        names = [line.split(":", 1)[1].strip() for line in
                 cpuinfo.read_text(errors="replace").splitlines()
                 if line.startswith("model name")]
        cpu = names[0] if names else cpu
    gpu = ""
    if torch.cuda.is_available():
        gpu = f", {torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}"
    return (f"{cpu}, {os.cpu_count()} cores{gpu}, {platform.system()}, "
            f"Python {platform.python_version()}, torch {torch.__version__}")


def grid(choices: Sequence[Choice]) -> list[tuple[int, ...]]:
    """Every setting of the grid, as one option index per control, in row-major order."""
    return list(itertools.product(*(range(len(c.options)) for c in choices)))


def record(render: Callable[..., None], *values: Any) -> tuple[dict[str, Any], ...]:
    """Run ``render(*values)`` and return what it printed and displayed, as notebook outputs
    (stdout, then stderr, then each displayed object), ready for ``Output.outputs``.

    Outside IPython nothing is displayed, so only the printed text is kept."""
    with capture_output() as captured:
        render(*values)
    outputs: list[dict[str, Any]] = []
    for name, text in (("stdout", captured.stdout), ("stderr", captured.stderr)):
        if text:
            outputs.append({"output_type": "stream", "name": name, "text": text})
    for shown in captured.outputs:
        data = dict(shown.data)
        if isinstance(data.get("image/png"), str):
            data["image/png"] = lighter_png(data["image/png"])
        outputs.append({"output_type": "display_data", "data": data,
                        "metadata": dict(shown.metadata or {})})
    return tuple(outputs)


def lighter_png(png_base64: str) -> str:
    """The same figure in at most 256 colours (about a third of the bytes for a matplotlib
    plot): a page embeds every recorded figure of its panels. A PNG with transparency, or one
    that would not shrink, is returned as it was."""
    from PIL import Image  # matplotlib's own dependency

    raw = base64.b64decode(png_base64)
    image = Image.open(io.BytesIO(raw))
    if image.mode == "RGBA" and image.getchannel("A").getextrema()[0] < 255:
        return png_base64
    smaller = io.BytesIO()
    image.convert("RGB").quantize(colors=256, method=Image.Quantize.MEDIANCUT).save(
        smaller, "PNG", optimize=True)
    if smaller.tell() >= len(raw):
        return png_base64
    return base64.b64encode(smaller.getvalue()).decode("ascii")


class RecordedPanel(w.VBox):
    """A recorded panel: a plain ``VBox`` in the front end (the book's widget state has a
    ``VBoxModel``), whose text is a sentence, not the repr of its children.

    A notebook stores that text beside the widget's view, and JupyterLab shows it in place of
    a panel whose widgets no kernel has made yet (a notebook just opened)."""

    def __init__(self, children: Sequence[w.Widget], *, settings: int) -> None:
        super().__init__(children)
        self._settings = settings

    def __repr__(self) -> str:
        return panel_text(self._settings)


def panel_text(settings: int) -> str:
    """What a notebook shows for a recorded panel of ``settings`` runs when it cannot draw the
    widgets."""
    runs = "1 setting" if settings == 1 else f"{settings} settings"
    # under 110 characters, where ipywidgets cuts a widget's text short
    return (f"Recorded panel ({runs}): run this cell to switch between its runs; "
            "the book shows them with no kernel.")


def _control(choice: Choice) -> w.ToggleButtons:
    return w.ToggleButtons(options=list(choice.options), index=choice.default_index,
                           description=choice.description,
                           style={"button_width": "auto", "description_width": "initial"})


def _stack(choices: Sequence[Choice], controls: Sequence[w.ToggleButtons],
           leaves: dict[tuple[int, ...], w.Output], prefix: tuple[int, ...] = ()) -> w.Widget:
    """The stack that chooses between the settings starting with ``prefix``: its children
    are the next control's stacks (or the leaves), its index linked to that control."""
    level = len(prefix)
    if level == len(choices):
        return leaves[prefix]
    children = [_stack(choices, controls, leaves, (*prefix, i))
                for i in range(len(choices[level].options))]
    stack = w.Stack(children=children, selected_index=controls[level].index)
    w.jslink((controls[level], "index"), (stack, "selected_index"))
    return stack


def recorded_panel(
    choices: Sequence[Choice],
    render: Callable[..., None],
    *,
    live: Callable[..., None] | None = None,
    live_controls: Sequence[w.Widget] = (),
    show: bool = True,
) -> RecordedPanel:
    """Run ``render(v₁, v₂, ...)`` for every setting of ``choices``' grid, keep each output,
    and return (and, with ``show``, display) a panel whose controls switch between them in
    the browser.

    ``render`` may print a setting's own measurement, or one the chapter made before (a
    panel may slice a sweep that ran once for the whole grid).

    ``live(v₁, v₂, ...)``, if given, is what the panel's "Run on real ranks" button runs for
    the chosen setting in a running notebook, below the recorded output; ``live_controls``
    (say, a checkbox that puts the run on an emulated link) sit beside that button. A line
    under the recorded output names the machine the grid ran on.

    While the grid runs, a progress bar says which setting is running; it is replaced by the
    panel when the grid is done. The panel is displayed once, holding the progress bar, and
    its children become the controls and stacks when the grid is done: no display is updated
    and no displayed widget is closed. (JupyterLab redraws an updated display in the renderer
    of the widget it first showed, and hides that renderer when that widget closes: a panel
    put in a progress bar's display, the bar then closed, vanished with the bar.)"""
    if not choices:
        raise ValueError("a recorded panel needs at least one control.")
    settings = grid(choices)
    progress = w.IntProgress(value=0, max=len(settings), description="recording",
                             style={"description_width": "initial"},
                             layout=w.Layout(width="520px"))
    panel = RecordedPanel([progress], settings=len(settings))
    panel.add_class("labs-recorded-panel")
    if show:
        display(panel)
    leaves: dict[tuple[int, ...], w.Output] = {}
    for done, index in enumerate(settings):
        values = [c.options[i][1] for c, i in zip(choices, index, strict=True)]
        labels = ", ".join(f"{c.description} {c.options[i][0]}"
                           for c, i in zip(choices, index, strict=True))
        progress.description = f"recording {done + 1}/{len(settings)}: {labels}"
        leaves[index] = w.Output(outputs=record(render, *values))
        progress.value = done + 1
    controls = [_control(c) for c in choices]
    note = w.HTML(
        f"<small><i>Recorded runs: the {len(settings)} settings above ran on real ranks when "
        f"this notebook was executed, on {machine_line()}. {LIVE_HINT}</i></small>")
    parts: list[w.Widget] = [*controls, _stack(choices, controls, leaves), note]
    if live is not None:
        out = w.Output()

        def run() -> None:
            live(*(c.value for c in controls))

        parts += [w.HBox([*live_controls, run_button(out, run)]), out]
    panel.children = parts
    # Shown nowhere now: no output and no panel refers to it (nbclient still keeps its last
    # state in the notebook's widget state, which nothing draws).
    progress.close()
    return panel


def run_button(out: w.Output, action: Callable[[], None]) -> w.Button:
    """A "Run on real ranks" button: each click clears ``out`` and shows ``action``'s output
    there; the button is disabled while the ranks run, so a second click cannot start a
    second launch."""
    button = w.Button(description="Run on real ranks", button_style="primary", icon="play",
                      layout=w.Layout(width="auto"))  # JupyterLab's default width cuts it

    def run(_: w.Button) -> None:
        button.disabled, button.description = True, "Running..."
        try:
            with out:
                out.clear_output(wait=True)
                action()
        finally:
            button.disabled, button.description = False, "Run on real ranks"

    button.on_click(run)
    return button
