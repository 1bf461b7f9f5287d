"""labs.viz.recorded: the grid a panel records, and the stacks and links that switch it.

The browser half (clicking through the rendered book's panels) is tests/test_book_panels.py.
"""

from __future__ import annotations

from typing import Any

import ipywidgets as w
import pytest

from labs.toy_allreduce import ToyAllReduceConfig
from labs.viz import recorded, widgets
from labs.viz.calculators import WithBrowserFallback
from labs.viz.recorded import Choice, grid, record, recorded_panel

WORLD = Choice("world size", (("2", 2), ("4", 4), ("8", 8)), 4)
SIZE = Choice("size", (("4 KiB", 4096), ("1 MiB", 1 << 20)))


def _links() -> list[w.Widget]:
    return [x for x in w.Widget.get_manager_state()["state"].values()
            if x["model_name"] == "LinkModel"]


def _parts(panel: w.VBox) -> tuple[list[w.ToggleButtons], w.Stack]:
    controls = [c for c in panel.children if isinstance(c, w.ToggleButtons)]
    stacks = [c for c in panel.children if isinstance(c, w.Stack)]
    assert len(stacks) == 1
    return controls, stacks[0]


def _leaf(stack: w.Widget, choice: tuple[int, ...]) -> w.Output:
    for index in choice:
        stack = stack.children[index]
    assert isinstance(stack, w.Output)
    return stack


def test_grid_is_every_setting_in_row_major_order() -> None:
    assert grid([WORLD, SIZE]) == [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (2, 1)]
    assert grid([SIZE]) == [(0,), (1,)]


def test_choice_refuses_no_options_and_a_default_it_does_not_offer() -> None:
    with pytest.raises(ValueError, match="at least one option"):
        Choice("world size", ())
    with pytest.raises(ValueError, match="not one of its options"):
        Choice("world size", (("2", 2),), 3)
    assert WORLD.default_index == 1 and SIZE.default_index == 0


def test_record_keeps_stdout_and_stderr_as_notebook_outputs() -> None:
    import sys

    def render(n: int) -> None:
        print(f"rank count {n}")
        print("careful", file=sys.stderr)

    outputs = record(render, 3)
    assert outputs == ({"output_type": "stream", "name": "stdout", "text": "rank count 3\n"},
                       {"output_type": "stream", "name": "stderr", "text": "careful\n"})


def test_every_setting_has_its_own_output_and_each_stack_follows_its_control() -> None:
    calls: list[tuple[int, int]] = []

    def render(n: int, size: int) -> None:
        calls.append((n, size))
        print(f"{n} ranks, {size} bytes")

    before = len(_links())
    panel = recorded_panel([WORLD, SIZE], render, show=False)
    controls, stack = _parts(panel)
    assert calls == [(n, s) for n in (2, 4, 8) for s in (4096, 1 << 20)]
    for choice in grid([WORLD, SIZE]):
        n, size = WORLD.values[choice[0]], SIZE.values[choice[1]]
        assert _leaf(stack, choice).outputs[0]["text"] == f"{n} ranks, {size} bytes\n"
    # one link per stack: the outer one follows the world size, the inner three the size
    links = _links()[before:]
    assert len(links) == 1 + 3
    by_target = {x["state"]["target"][0]: x["state"]["source"] for x in links}
    assert by_target[f"IPY_MODEL_{stack.model_id}"] == [f"IPY_MODEL_{controls[0].model_id}",
                                                        "index"]
    for inner in stack.children:
        assert by_target[f"IPY_MODEL_{inner.model_id}"] == [
            f"IPY_MODEL_{controls[1].model_id}", "index"]
    # the panel opens at the defaults
    assert [c.index for c in controls] == [1, 0] and stack.selected_index == 1
    assert stack.children[1].selected_index == 0
    assert "Recorded runs: the 6 settings above ran on real ranks" in panel.children[-1].value


def test_live_runs_the_chosen_setting_into_its_own_output() -> None:
    runs: list[tuple[Any, ...]] = []
    extra = w.Checkbox(description="on the link")
    panel = recorded_panel([WORLD, SIZE], lambda n, s: None, show=False,
                           live=lambda n, s: runs.append((n, s, extra.value)),
                           live_controls=[extra])
    controls, _ = _parts(panel)
    row = panel.children[-2]
    assert isinstance(row, w.HBox) and row.children[0] is extra
    button = row.children[-1]
    controls[0].index, controls[1].index, extra.value = 2, 1, True
    button.click()
    assert runs == [(8, 1 << 20, True)]
    assert button.description == "Run on real ranks" and not button.disabled


def test_the_panel_is_displayed_once_and_its_progress_bar_becomes_the_panel(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """What a front end is sent: one view, of the panel, holding the progress bar while the
    grid runs. JupyterLab hid a panel that replaced a progress bar's display (an update of
    that display, then the bar closed), so nothing is updated and nothing shown is closed."""
    shown: list[tuple[Any, dict[str, Any]]] = []
    monkeypatch.setattr(recorded, "display",
                        lambda obj, **kwargs: shown.append((obj, kwargs)))
    children_while_running: list[tuple[w.Widget, ...]] = []
    ids_while_running: set[str] = set()

    def render(n: int, size: int) -> None:
        children_while_running.append(shown[0][0].children)
        ids_while_running.update(c.model_id for c in shown[0][0].children)
        print(n, size)

    panel = recorded_panel([WORLD, SIZE], render)
    assert len(shown) == 1, "the panel is displayed once, never updated"
    displayed, kwargs = shown[0]
    assert displayed is panel and not kwargs
    bars = {c for children in children_while_running for c in children}
    assert len(bars) == 1 and isinstance(bar := bars.pop(), w.IntProgress)
    assert bar.value == bar.max == 6 and bar.comm is None  # closed, and no longer a child
    assert bar not in panel.children and panel.comm is not None
    state = w.Widget.get_manager_state()["state"]
    assert not ids_while_running & set(state) and panel.model_id in state
    assert state[panel.model_id]["model_name"] == "VBoxModel"
    assert state[panel.model_id]["state"]["_dom_classes"] == ("labs-recorded-panel",)
    _parts(panel)


def test_the_panel_s_text_says_what_it_is_in_a_notebook_not_yet_run() -> None:
    """JupyterLab shows a stored widget's text/plain until the cell runs: a sentence, whole."""
    panel = recorded_panel([WORLD, SIZE], lambda n, s: None, show=False)
    text = panel._repr_mimebundle_()["text/plain"]
    assert text == recorded.panel_text(6) == repr(panel)
    assert text.startswith("Recorded panel (6 settings): run this cell")
    assert not text.endswith("…") and "ToggleButtons" not in text
    assert recorded.panel_text(1).startswith("Recorded panel (1 setting):")
    assert isinstance(panel, w.VBox) and panel._model_name == "VBoxModel"


def test_a_failing_setting_fails_the_panel() -> None:
    def render(n: int) -> None:
        if n == 8:
            raise RuntimeError("rank 3 hung")

    with pytest.raises(RuntimeError, match="rank 3 hung"):
        recorded_panel([WORLD], render, show=False)


def test_machine_line_names_cores_and_torch() -> None:
    import os

    import torch

    line = recorded.machine_line()
    assert f"{os.cpu_count()} cores" in line and f"torch {torch.__version__}" in line


def test_toy_panel_records_real_ranks(monkeypatch: pytest.MonkeyPatch,
                                      no_leftover_processes: None) -> None:
    shown: list[Any] = []
    monkeypatch.setattr(recorded, "display", lambda obj, **_: shown.append(obj))
    widgets.toy_allreduce_panel(world_size=2, world_sizes=(1, 2))
    panels = [s for s in shown if isinstance(s, w.VBox)]
    assert len(panels) == 1
    _, stack = _parts(panels[0])
    texts = [_leaf(stack, (i,)).outputs[0]["text"] for i in range(2)]
    assert texts[0].startswith("world size 1, seed 0") and "1 real rank(s)" in texts[0]
    assert texts[1].startswith("world size 2, seed 0") and "2 real rank(s)" in texts[1]
    assert ToyAllReduceConfig().seed == 0


def _shown_panel(monkeypatch: pytest.MonkeyPatch, make: Any) -> w.VBox:
    shown: list[Any] = []
    monkeypatch.setattr(recorded, "display", lambda obj, **_: shown.append(obj))
    make()
    panels = [s for s in shown if isinstance(s, w.VBox)]
    assert len(panels) == 1
    return panels[0]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["collective", "ddp", "zero", "recipe", "topology"])
def test_every_chapter_panel_records_its_grid(monkeypatch: pytest.MonkeyPatch,
                                              no_leftover_processes: None, name: str) -> None:
    """Each chapter's panel at a grid of two settings: two outputs, distinct, no stderr."""
    from labs.collectives import Collective
    from labs.experiments.recipe import RecipeConfig
    from labs.experiments.topology import TopologySettings
    from labs.link import Link
    from labs.models import StepSettings

    makers = {
        "collective": lambda: widgets.collective_panel(
            Collective.REDUCE_SCATTER, world_size=2, size_bytes=4096, world_sizes=(2,),
            sizes=(4096, 8192), iters=2),
        "ddp": lambda: widgets.ddp_panel(
            world_size=2, bucket_cap_mb=0.25, settings=StepSettings(width=32, layers=2, steps=2),
            world_sizes=(2,), caps=(0.25, 25.0)),
        "zero": lambda: widgets.zero_panel(world_size=2, world_sizes=(1, 2)),
        "recipe": lambda: widgets.recipe_panel(
            world_size=1, config=RecipeConfig(steps=2), world_sizes=(1,)),
        "topology": lambda: widgets.topology_panel(
            TopologySettings(nodes=(1,), size_bytes=1 << 16, intra=Link(1e-4, 1e9),
                             inter=Link(1e-4, 1e8), repeats=1), ratios=(1, 10)),
    }
    panel = _shown_panel(monkeypatch, makers[name])
    _, stack = _parts(panel)
    leaves = [_leaf(stack, choice) for choice in grid_of(stack)]
    assert len(leaves) == (8 if name == "zero" else 2)  # zero: 2 world sizes x 4 stages
    texts = [leaf.outputs[0]["text"] for leaf in leaves]
    assert len(set(texts)) == len(texts), texts
    assert not [o for leaf in leaves for o in leaf.outputs if o.get("name") == "stderr"]


def grid_of(stack: w.Widget, prefix: tuple[int, ...] = ()) -> list[tuple[int, ...]]:
    if isinstance(stack, w.Output):
        return [prefix]
    return [c for i, child in enumerate(stack.children) for c in grid_of(child, (*prefix, i))]


@pytest.mark.parametrize("which", ["memory", "budget"])
def test_calculators_show_a_widget_and_html_for_the_book(monkeypatch: pytest.MonkeyPatch,
                                                         which: str) -> None:
    module = widgets.zero if which == "memory" else widgets.recipe  # the chapter's panels

    shown: list[Any] = []
    monkeypatch.setattr(module, "display", lambda obj, **_: shown.append(obj))
    (widgets.memory_calculator if which == "memory" else widgets.budget_calculator)()
    shown = [s for s in shown if isinstance(s, WithBrowserFallback)]  # not the default's figure
    assert len(shown) == 1
    bundle = shown[0]._repr_mimebundle_()
    assert "application/vnd.jupyter.widget-view+json" in bundle
    kind = "zero" if which == "memory" else "budget"
    assert f'data-kind="{kind}"' in bundle["text/html"]
    assert f"window.labsCalculators.{kind}(" in bundle["text/html"]
    # the widget opens showing the default, computed in Python
    out = shown[0].widget.children[-1]
    assert isinstance(out, w.Output)
    assert ("GiB per rank" if which == "budget" else "GB per rank") in out.outputs[0]["text"]


def test_lighter_png_keeps_the_picture_in_fewer_bytes() -> None:
    import base64
    import io

    import matplotlib.pyplot as plt
    import numpy as np
    from PIL import Image

    fig, ax = plt.subplots(figsize=(6, 3))
    ax.plot(np.sin(np.linspace(0, 9, 200)))
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    plt.close(fig)
    before = base64.b64encode(buffer.getvalue()).decode()
    after = recorded.lighter_png(before)
    assert len(after) < len(before)
    original = np.asarray(Image.open(io.BytesIO(buffer.getvalue())).convert("RGB"), dtype=float)
    reduced = np.asarray(Image.open(io.BytesIO(base64.b64decode(after))).convert("RGB"),
                         dtype=float)
    assert original.shape == reduced.shape
    assert np.abs(original - reduced).mean() < 2.0  # out of 255: the same picture
    # transparency is kept as it was
    clear = io.BytesIO()
    Image.new("RGBA", (8, 8), (0, 0, 0, 0)).save(clear, "PNG")
    transparent = base64.b64encode(clear.getvalue()).decode()
    assert recorded.lighter_png(transparent) == transparent
