"""The rendered book's panels, used as a reader uses them: in a browser, with no kernel.

`make test` builds the book (from the stored notebooks) before this module runs. Playwright
drives Debian's ``chromium`` with every host name unresolvable and every http(s) request
aborted, so a page gets no network at all.

* Recorded panels (:func:`labs.viz.recorded.recorded_panel`): on every chapter page, every
  panel, every option of every control is clicked, and the output shown must be the one the
  page's embedded widget state recorded for that setting (read by following the panel's
  stacks in the state, not by trusting the DOM). Then every control is set to its last
  option at once.
* Calculators (:mod:`labs.viz.calculators`): values are typed into chapter 6's and 7's forms
  and every number shown is compared with labs' own functions for the same inputs.

The unit tests at the bottom give the same checkers hand-made pages: a panel whose links were
dropped from its state, and a calculator whose formula is wrong, each must fail.
"""

from __future__ import annotations

import json
import math
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from book_pages import CHAPTER_FIRST_PAGES, CHAPTER_PAGES

from labs.experiments.recipe import RecipeConfig, memory_budget
from labs.experiments.zero import Recipe, bytes_per_parameter
from labs.viz.calculators import budget_calculator_html, zero_calculator_html
from labs.viz.recorded import Choice, recorded_panel
from labs.wrappers import ZERO_STAGES

ROOT = Path(__file__).resolve().parents[1]
HTML_ROOT = ROOT / "_build" / "html"
VENDOR = ROOT / "book" / "static" / "vendor"
CHROMIUM = "/usr/bin/chromium"
STATE_MIME = "application/vnd.jupyter.widget-state+json"
VIEW_MIME = "application/vnd.jupyter.widget-view+json"
PANEL_CLASS = "labs-recorded-panel"
#: Each chapter page (from _toc.yml) and the number of recorded panels it must hold: one on a
#: chapter's first page, none on its later pages.
PANEL_PAGES = {page: int(page in CHAPTER_FIRST_PAGES) for page in CHAPTER_PAGES}
ZERO_PAGE = "notebooks/06_zero_fsdp.html"
BUDGET_PAGE = "notebooks/07_fsdp_in_practice.html"
RENDER_TIMEOUT_MS = 60_000


# --------------------------------------------------------------------------- the checkers


@dataclass(frozen=True)
class Panel:
    """A recorded panel as its page's widget state describes it."""

    controls: list[list[str]]  # each control's option labels
    defaults: list[int]
    stack: str  # model id of the outermost stack
    state: dict[str, Any]

    def expected_text(self, choice: list[int]) -> str:
        """The stdout the page recorded for ``choice`` (one option index per control)."""
        model = self.state[self.stack]
        for index in choice:
            model = self.state[_ref(model["state"]["children"][index])]
        if model["model_name"] != "OutputModel":
            raise AssertionError(f"the stacks lead to a {model['model_name']}, not an Output")
        return _normalise("".join(o.get("text", "") for o in model["state"].get("outputs", [])
                                  if o.get("output_type") == "stream"))


def _ref(value: str) -> str:
    return value.removeprefix("IPY_MODEL_")


def _normalise(text: str) -> str:
    return " ".join(text.split())


def widget_state(html_text: str) -> dict[str, Any]:
    """The page's embedded widget state: model id -> {model_name, state}."""
    start = html_text.find(f'<script type="{STATE_MIME}">')
    if start < 0:
        return {}
    start = html_text.index(">", start) + 1
    end = html_text.index("</script>", start)
    return json.loads(html_text[start:end])["state"]


def recorded_panels(state: dict[str, Any]) -> list[Panel]:
    """Every recorded panel in the state, in the order of their model ids' appearance."""
    panels = []
    for model in state.values():
        if PANEL_CLASS not in model["state"].get("_dom_classes", []):
            continue
        children = [state[_ref(c)] for c in model["state"]["children"]]
        toggles = [c for c in children if c["model_name"] == "ToggleButtonsModel"]
        stacks = [_ref(c) for c in model["state"]["children"]
                  if state[_ref(c)]["model_name"] == "StackModel"]
        if len(stacks) != 1:
            raise AssertionError(f"a recorded panel holds {len(stacks)} stacks, not 1")
        panels.append(Panel([t["state"]["_options_labels"] for t in toggles],
                            [t["state"]["index"] for t in toggles], stacks[0], state))
    return panels


def _choices(panel: Panel) -> Iterator[list[int]]:
    """Each option of each control, the others at their defaults; then every last option."""
    for c, labels in enumerate(panel.controls):
        for option in range(len(labels)):
            yield [option if i == c else d for i, d in enumerate(panel.defaults)]
    yield [len(labels) - 1 for labels in panel.controls]


def panel_problems(page: Any, html_text: str) -> list[str]:
    """Click through every recorded panel of an open page; what went wrong, if anything."""
    panels = recorded_panels(widget_state(html_text))
    problems: list[str] = []
    if not panels:
        return ["no recorded panel in the page's widget state"]
    page.wait_for_selector(f".{PANEL_CLASS} .widget-toggle-button", timeout=RENDER_TIMEOUT_MS)
    views = page.locator(f".{PANEL_CLASS}")
    if views.count() != len(panels):
        return [f"{len(panels)} recorded panel(s) in the state, {views.count()} rendered"]
    for p, panel in enumerate(panels):
        view = views.nth(p)
        expected_all = {tuple(c): panel.expected_text(list(c)) for c in _all(panel)}
        if len(set(expected_all.values())) < len(expected_all):
            problems.append(f"panel {p}: two settings recorded the same text; "
                            "the check could not tell them apart")
        controls = view.locator(".widget-toggle-buttons")
        for choice in _choices(panel):
            for c, option in enumerate(choice):
                controls.nth(c).locator(".widget-toggle-button").nth(option).click()
            shown = _normalise(" ".join(view.locator(".jp-OutputArea-output").all_inner_texts()))
            expected = panel.expected_text(choice)
            labels = ", ".join(panel.controls[c][o] for c, o in enumerate(choice))
            if not expected or expected not in shown:
                problems.append(f"panel {p} at ({labels}): shows {shown[:120]!r}, recorded "
                                f"{expected[:120]!r}")
            others = [t for k, t in expected_all.items() if list(k) != choice and t]
            if any(t in shown for t in others):
                problems.append(f"panel {p} at ({labels}): another setting's output is shown too")
    return problems


def _all(panel: Panel) -> Iterator[tuple[int, ...]]:
    import itertools

    return itertools.product(*(range(len(labels)) for labels in panel.controls))


#: (inputs typed into chapter 6's form, recipe) -> compared with bytes_per_parameter.
ZERO_CASES = [
    ({"parameters": "7", "world_size": "8", "memory_gb": "80"}, Recipe.MIXED),
    ({"parameters": "70", "world_size": "64", "memory_gb": "80"}, Recipe.FP32),
    ({"parameters": "1.5", "world_size": "3", "memory_gb": "24"}, Recipe.MIXED_BOTH_GRADS),
    ({"parameters": "0.125", "world_size": "1", "memory_gb": "16"}, Recipe.MIXED_FP32_GRADS),
]
#: (inputs typed into chapter 7's form) -> compared with memory_budget.
BUDGET_CASES = [
    {"width": 2048, "heads": 16, "blocks": 24, "sequence": 2048, "micro_batch": 1,
     "vocab": 50_257, "world_size": 64, "dtype": "fp32", "checkpointing": False,
     "accumulation": 1},
    {"width": 4096, "heads": 32, "blocks": 32, "sequence": 4096, "micro_batch": 2,
     "vocab": 32_000, "world_size": 7, "dtype": "bf16", "checkpointing": True,
     "accumulation": 4},
    {"width": 96, "heads": 3, "blocks": 5, "sequence": 100, "micro_batch": 3,
     "vocab": 65, "world_size": 3, "dtype": "bf16", "checkpointing": False,
     "accumulation": 2},
]


def _close(shown: str | None, expected: float) -> bool:
    return shown is not None and math.isclose(float(shown), expected, rel_tol=1e-12,
                                              abs_tol=1e-12)


def zero_calculator_problems(page: Any) -> list[str]:
    form = page.locator("[data-kind=zero]")
    if form.count() != 1:
        return [f"{form.count()} ZeRO calculators on the page, expected 1"]
    problems = []
    for typed, recipe in ZERO_CASES:
        for name, value in typed.items():
            form.locator(f"[name={name}]").fill(value)
        form.locator("[name=recipe]").select_option(recipe.value)
        n, params = int(typed["world_size"]), float(typed["parameters"]) * 1e9
        for strategy in ZERO_STAGES:
            row = form.locator(f'tr[data-stage="{strategy.value}"]')
            b = bytes_per_parameter(recipe, strategy.stage, n)
            expected = {"params": b.parameters, "grads": b.gradients, "optimizer": b.optimizer,
                        "bytes_per_param": b.total, "gb_per_rank": params * b.total / 1e9,
                        "max_params_b": float(typed["memory_gb"]) / b.total}
            for name, value in expected.items():
                cell = row.locator(f"[data-name={name}]")
                shown = cell.get_attribute("data-value") if cell.count() else None
                if not _close(shown, value):
                    problems.append(f"{typed} {recipe.name} {strategy.value} {name}: page "
                                    f"{shown}, labs {value}")
    return problems


def budget_calculator_problems(page: Any) -> list[str]:
    form = page.locator("[data-kind=budget]")
    if form.count() != 1:
        return [f"{form.count()} budget calculators on the page, expected 1"]
    problems = []
    for case in BUDGET_CASES:
        for name in ("width", "heads", "blocks", "sequence", "micro_batch", "vocab",
                     "world_size", "accumulation"):
            form.locator(f"[name={name}]").fill(str(case[name]))
        form.locator("[name=dtype]").select_option(case["dtype"])
        form.locator("[name=checkpointing]").set_checked(case["checkpointing"])
        config = RecipeConfig(d_model=case["width"], n_heads=case["heads"],
                              n_layers=case["blocks"], seq_len=case["sequence"],
                              batch_size=case["micro_batch"], dtype=case["dtype"],
                              activation_checkpointing=case["checkpointing"],
                              accumulation=case["accumulation"])
        rows = memory_budget(config, case["world_size"], case["vocab"])
        for row in rows:
            cell = form.locator(f'tr[data-row="{row.name}"] [data-name=bytes]')
            shown = cell.get_attribute("data-value") if cell.count() else None
            if not _close(shown, row.model_bytes):
                problems.append(f"{case} {row.name}: page {shown}, labs {row.model_bytes}")
        total = form.locator("[data-name=total_gib]").get_attribute("data-value")
        if not _close(total, sum(r.model_bytes for r in rows)):
            problems.append(f"{case} total: page {total}, labs {sum(r.model_bytes for r in rows)}")
    form.locator("[name=heads]").fill("5")  # 2048 or 96 do not split into 5 heads
    if "Cannot compute" not in form.locator(".labs-calc-out").inner_text():
        problems.append("width not divisible by heads gave no error")
    return problems


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    sync_api = pytest.importorskip("playwright.sync_api",
                                   reason="pip install playwright (requirements.lock has it)")
    if shutil.which(CHROMIUM) is None:
        pytest.skip("install Debian's chromium: apt-get install chromium")
    with sync_api.sync_playwright() as playwright:
        chromium = playwright.chromium.launch(
            executable_path=CHROMIUM,
            args=["--no-sandbox", "--host-resolver-rules=MAP * ~NOTFOUND"])
        yield chromium
        chromium.close()


@pytest.fixture
def open_page(browser: Any) -> Iterator[Any]:
    """Open a file:// URL with every http(s) request aborted; uncaught errors are kept."""
    context = browser.new_context(viewport={"width": 1200, "height": 1600})
    opened: list[Any] = []

    def open_url(url: str) -> Any:
        page = context.new_page()
        page.errors = []
        page.on("pageerror", lambda err: page.errors.append(str(err)))
        page.route("http*://**", lambda route: route.abort())
        page.goto(url)
        opened.append(page)
        return page

    yield open_url
    context.close()


def _built(page: str) -> Path:
    path = HTML_ROOT / page
    if not path.is_file():
        pytest.fail(f"{page} is not built: run make book (make test builds it)", pytrace=False)
    return path


# --------------------------------------------------------------------------- book tests


#: Every chapter's panels switch the same way: three chapters in make test, the rest in
#: make test-slow.
FAST_PANEL_PAGES = ("notebooks/02_allreduce_algorithms.html",)  # make test's budget


@pytest.mark.browser
@pytest.mark.parametrize("page", [p if p in FAST_PANEL_PAGES
                                  else pytest.param(p, marks=pytest.mark.slow)
                                  for p in sorted(PANEL_PAGES) if PANEL_PAGES[p]])
def test_recorded_panels_switch_in_the_browser(open_page: Any, page: str) -> None:
    path = _built(page)
    html_text = path.read_text("utf-8")
    panels = recorded_panels(widget_state(html_text))
    assert len(panels) == PANEL_PAGES[page], (
        f"{page}: {len(panels)} recorded panels, expected {PANEL_PAGES[page]}")
    assert all(len(p.controls) >= 1 and all(len(c) >= 2 for c in p.controls) for p in panels)
    opened = open_page(path.as_uri())
    problems = panel_problems(opened, html_text) + [f"uncaught: {e}" for e in opened.errors]
    if problems:
        pytest.fail(f"{page}:\n" + "\n".join(problems), pytrace=False)


@pytest.mark.browser
def test_zero_calculator_computes_in_the_browser(open_page: Any) -> None:
    opened = open_page(_built(ZERO_PAGE).as_uri())
    problems = zero_calculator_problems(opened) + [f"uncaught: {e}" for e in opened.errors]
    assert not problems, "\n".join(problems)


@pytest.mark.browser
def test_budget_calculator_computes_in_the_browser(open_page: Any) -> None:
    opened = open_page(_built(BUDGET_PAGE).as_uri())
    problems = budget_calculator_problems(opened) + [f"uncaught: {e}" for e in opened.errors]
    assert not problems, "\n".join(problems)


# --------------------------------------------------------------------------- checker tests


def _embed(tmp_path: Path, state: dict[str, Any], view_id: str, name: str) -> tuple[Path, str]:
    """A page like the book's: the vendored scripts, the widget state, one view."""
    body = json.dumps({"version_major": 2, "version_minor": 0, "state": state})
    view = json.dumps({"version_major": 2, "version_minor": 0, "model_id": view_id})
    html_text = (
        f'<html><head><script src="{(VENDOR / "requirejs/require.js").as_uri()}"></script>'
        f'<script src="{(VENDOR / "html-manager/embed-amd.js").as_uri()}" '
        f'data-jupyter-widgets-cdn="{(tmp_path / "no-cdn").as_uri()}/"></script></head><body>'
        f'<script type="{STATE_MIME}">{body}</script>'
        f'<script type="{VIEW_MIME}">{view}</script></body></html>')
    path = tmp_path / name
    path.write_text(html_text, encoding="utf-8")
    return path, html_text


def _hand_made_panel() -> tuple[dict[str, Any], str]:
    import ipywidgets as w
    from ipywidgets.embed import dependency_state

    def render(n: int, size: str) -> None:
        print(f"recorded: {n} ranks, {size}")

    panel = recorded_panel([Choice("world size", (("2", 2), ("4", 4), ("8", 8)), 4),
                            Choice("size", (("small", "4 KiB"), ("large", "1 MiB")))],
                           render, show=False)
    # The panel's own widgets, and the links between them (nothing depends on a link, so
    # dependency_state leaves them out); not the other widgets this process made.
    mine = dependency_state(panel, drop_defaults=False)
    links = {k: v for k, v in w.Widget.get_manager_state(drop_defaults=False)["state"].items()
             if v["model_name"] == "LinkModel" and _ref(v["state"]["source"][0]) in mine}
    return {**mine, **links}, panel.model_id


@pytest.mark.browser
def test_panel_checker_passes_a_linked_panel_and_fails_one_without_links(
        open_page: Any, tmp_path: Path) -> None:
    state, view_id = _hand_made_panel()
    good, good_html = _embed(tmp_path, state, view_id, "linked.html")
    assert panel_problems(open_page(good.as_uri()), good_html) == []
    unlinked = {k: v for k, v in state.items() if v["model_name"] != "LinkModel"}
    assert len(unlinked) < len(state), "the hand-made panel has no links to drop"
    bad, bad_html = _embed(tmp_path, unlinked, view_id, "unlinked.html")
    problems = panel_problems(open_page(bad.as_uri()), bad_html)
    # the first click (world size 2) still shows the default run of 4 ranks
    assert problems and problems[0].startswith(
        "panel 0 at (2, small): shows 'recorded: 4 ranks, 4 KiB'"), problems


@pytest.mark.browser
def test_calculator_checkers_fail_a_wrong_formula(open_page: Any, tmp_path: Path) -> None:
    # ZeRO-1 forgets to shard the optimizer state; the budget forgets the padding. Both
    # calculators share one copy of calculators.js (the page's first), so both are mutated.
    wrong = (("unsharded[2] / n : unsharded[2]", "unsharded[2] : unsharded[2]"),
             ("Math.ceil(x / n) * n", "x"))
    right_html = f"<html><body>{zero_calculator_html()}{budget_calculator_html()}</body></html>"
    wrong_html = right_html
    for old, new in wrong:
        assert old in wrong_html
        wrong_html = wrong_html.replace(old, new)
    pages = {}
    for name, text in (("right", right_html), ("wrong", wrong_html)):
        path = tmp_path / f"{name}.html"
        path.write_text(text, "utf-8")
        pages[name] = open_page(path.as_uri())
    assert zero_calculator_problems(pages["right"]) == []
    assert budget_calculator_problems(pages["right"]) == []
    assert any("ZeRO-1 optimizer" in p for p in zero_calculator_problems(pages["wrong"]))
    assert any("parameters" in p for p in budget_calculator_problems(pages["wrong"]))
