"""Check the built book the way an offline reader sees it.

`make test` builds the book first (`make book`), then this module reads ``_build/html``:

* static checks on every built page, no browser needed: no error or stderr output in a cell
  (also inside the saved state of an ``Output`` widget), every ``<img>`` resolves to a
  non-empty file, every relative link resolves to a file and every ``#anchor`` to an id,
  nothing (script, stylesheet, image, font, iframe) is loaded from the network, every
  ``url()`` of a linked stylesheet and every file the widget bundle's CSS names is shipped,
  and the search has every page's text for its excerpts;
* on every chapter page, each exercise's solution follows its ``Exercise N.M`` heading folded
  in a ``<details>`` dropdown whose ``<summary>`` says "Show solution";
* browser checks on the intro and chapter pages in headless Debian ``chromium`` with every
  host name unresolvable, so the page gets no network at all: after the scripts ran, every
  embedded widget view is rendered (``.jupyter-widgets`` elements, e.g. ``.widget-button``),
  every math element holds an ``mjx-container`` and no MathJax error, and the console shows
  no uncaught error and no attempt to load a widget module from a CDN.

* the book as a reader sees it, in chromium driven through the DevTools protocol
  (``tests/chromium_pipe.py``), on every chapter page: nothing is cut at the column's edge (a
  wide table or figure, in a recorded panel too, fits or scrolls in its own box), no request
  fails and every ``url()`` of every loaded stylesheet names a file (the widget bundle's
  fonts), and the controls that need a kernel are disabled with a note while a recorded
  panel's ToggleButtons still switch runs (clicked); the offline search shows an excerpt
  under every hit.

The browser checks skip where chromium is missing. To look at a page yourself::

    chromium --headless --no-sandbox --screenshot=/tmp/page.png --window-size=1200,2400 \
        --virtual-time-budget=10000 file://$PWD/_build/html/notebooks/01_toy_allreduce.html

The unit tests at the bottom feed small hand-made pages with one defect each to every checker,
so each check is shown to fail when it should.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import re
import shutil
import subprocess
import tempfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from html.parser import HTMLParser
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urljoin, urlsplit

import pytest
from book_pages import CHAPTER_FIRST_PAGES, CHAPTER_PAGES
from chromium_pipe import Chromium, ChromiumError, Page

ROOT = Path(__file__).resolve().parents[1]
HTML_ROOT = ROOT / "_build" / "html"
VENDOR = ROOT / "book" / "static" / "vendor"  # see its README.md
# The pages the browser opens; both must exist after `make book`.
CHAPTER = CHAPTER_PAGES[0]
INTRO = "book/intro.html"
# Chapter 2 adds a matplotlib animation (a JavaScript player) beside widgets and math (chapters
# 3 and 4 refer back to its ring trace instead of animating their own).
ANIMATED = [CHAPTER_PAGES[1]]
# Chapter 3 on (from _toc.yml): widget panels, Gantt charts, memory plots and tables.
WIDGET_PAGES = [p for p in CHAPTER_PAGES[2:] if p in CHAPTER_FIRST_PAGES]
BROWSER_PAGES = [INTRO, CHAPTER, *ANIMATED, *WIDGET_PAGES]
# matplotlib's to_jshtml player: an <img> with this id prefix and no src until its script runs.
ANIMATION_FRAME_ID = "_anim_img"

# An exercise's heading, and the label of its solution's dropdown (the chapter's .md sets it
# in the cell's "mystnb" options; myst-nb's default is "Show code cell source").
EXERCISE_HEADING = re.compile(r"\bExercise\s+(\d+\.\d+)\b")
HEADING_TAGS = {"h1", "h2", "h3", "h4", "h5", "h6"}
SOLUTION_PROMPT = "Show solution"

CHROMIUM = "chromium"
CHROMIUM_MISSING = "install Debian's chromium: apt-get install chromium"
BUILD_MISSING = "_build/html is missing: run make book first (make test does)"

# A cell may show a traceback only when nbclient was told it raises on purpose.
ALLOWED_ERROR_TAG = "tag_raises-exception"
WIDGET_STATE_MIME = "application/vnd.jupyter.widget-state+json"
WIDGET_VIEW_MIME = "application/vnd.jupyter.widget-view+json"
VOID_TAGS = {
    "area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "param",
    "source", "track", "wbr",
}
# Attributes through which a page makes the browser fetch something.
FETCH_ATTRS = {
    "script": ("src",), "link": ("href",), "img": ("src", "srcset"), "iframe": ("src",),
    "source": ("src", "srcset"), "video": ("src", "poster"), "audio": ("src",),
    "embed": ("src",), "object": ("data",), "track": ("src",), "input": ("src",),
}
# <link> relations that only name a document; every other rel (stylesheet, icon, preload,
# preconnect, manifest...) makes the browser fetch or connect.
NO_FETCH_RELS = {"canonical", "alternate", "author", "license", "help", "next", "prev",
                 "index", "search", "me", "bookmark"}
# Another host (http, https, protocol-relative) or an absolute path on the build machine.
EXTERNAL = re.compile(r"^\s*((https?:)?//|file:)", re.IGNORECASE)
CSS_URL = re.compile(r"""url\(\s*['"]?\s*((?:https?:)?//[^'")\s]+)""", re.IGNORECASE)
CSS_ANY_URL = re.compile(r"""url\(\s*(['"]?)([^'")]+)\1\s*\)""", re.IGNORECASE)
NON_FILE_SCHEMES = ("mailto:", "data:", "javascript:", "tel:")
# What book/static/js/static-book-controls.js writes beside a control that needs a kernel.
KERNEL_NOTE = "runs in a Jupyter kernel; open the notebook to use it"
# A chapter whose recorded panel has a slider, a checkbox and a Run button beside its toggles.
INTERACTIVE = "notebooks/05_ddp.html"
# Offline search (book/ext/offline_search.py): a word the chapters use, the file holding the
# pages' text, and the scripts the search page must load for excerpts.
SEARCH_WORD = "allreduce"
SEARCH_PAGES_FILE = "search-pages.js"
SEARCH_PAGE_SCRIPTS = (SEARCH_PAGES_FILE, "offline-search.js")
# Console lines that mean a script broke or a widget module was fetched from elsewhere.
CONSOLE_PROBLEMS = re.compile(
    r"Uncaught|Falling back to|Script error for|Could not create a view|Could not load module"
    r"|not found in module|Error rendering|Failed to load resource|net::ERR_",
    re.IGNORECASE,
)


# --------------------------------------------------------------------------- parsing


@dataclass
class Element:
    tag: str
    attrs: dict[str, str]
    parent: Element | None
    children: list[Element] = field(default_factory=list, repr=False)
    # The document's text chunks, shared by all elements; this one's text is chunks[start:end].
    chunks: list[str] = field(default_factory=list, repr=False)
    start: int = 0
    end: int | None = None

    @property
    def classes(self) -> set[str]:
        return set(self.attrs.get("class", "").split())

    @property
    def text(self) -> str:
        """All text inside the element, in document order (a script's body, a cell's output)."""
        return "".join(self.chunks[self.start:self.end])

    def ancestors(self) -> Iterable[Element]:
        node = self.parent
        while node is not None:
            yield node
            node = node.parent

    def descendants(self) -> Iterable[Element]:
        for child in self.children:
            yield child
            yield from child.descendants()


class _TreeBuilder(HTMLParser):
    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.chunks: list[str] = []
        self.root = Element("#document", {}, None, chunks=self.chunks)
        self.elements: list[Element] = []
        self._stack = [self.root]

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        el = Element(tag, {k: (v or "") for k, v in attrs}, self._stack[-1],
                     chunks=self.chunks, start=len(self.chunks))
        self._stack[-1].children.append(el)
        self.elements.append(el)
        if tag in VOID_TAGS:
            el.end = el.start
        else:
            self._stack.append(el)

    def handle_startendtag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.handle_starttag(tag, attrs)
        if tag not in VOID_TAGS:
            self._close(len(self._stack) - 1)

    def handle_endtag(self, tag: str) -> None:
        # Close the nearest open element of that name; a stray end tag is ignored.
        for depth in range(len(self._stack) - 1, 0, -1):
            if self._stack[depth].tag == tag:
                self._close(depth)
                return

    def _close(self, depth: int) -> None:
        for el in self._stack[depth:]:
            el.end = len(self.chunks)
        del self._stack[depth:]

    def handle_data(self, data: str) -> None:
        self.chunks.append(data)


def parse_html(text: str) -> list[Element]:
    """Every element of an HTML document, in document order, with parents and children."""
    builder = _TreeBuilder()
    builder.feed(text)
    builder.close()
    return builder.elements


def element_ids(elements: Iterable[Element]) -> set[str]:
    ids = set()
    for el in elements:
        ids.update(v for k, v in el.attrs.items() if k == "id" or (k == "name" and el.tag == "a"))
    return ids


# --------------------------------------------------------------------------- static checks


def error_outputs(elements: list[Element]) -> list[str]:
    """Tracebacks and stderr in cell outputs, as myst-nb marks them, and in widget state.

    myst-nb renders an error output as ``div.output.traceback`` and a stderr stream as
    ``div.output.stderr``; the cell container carries ``tag_<name>`` classes for its tags.
    A traceback in a cell tagged ``raises-exception`` is intended. Expected stderr noise is
    dropped at build time by tagging the cell ``remove-stderr``. An ``Output`` widget keeps its
    captured outputs in the embedded widget state instead of the page, so that is read too.
    """
    problems = []
    for el in elements:
        classes = el.classes
        if "output" not in classes:
            continue
        snippet = _text_of(el)[:200]
        if "traceback" in classes:
            if not any(ALLOWED_ERROR_TAG in a.classes for a in el.ancestors()):
                problems.append(f"error output in a cell: {snippet!r}")
        elif "stderr" in classes:
            problems.append(
                f"stderr output in a cell (tag the cell remove-stderr if expected): {snippet!r}"
            )
    for el in elements:
        if el.tag == "script" and el.attrs.get("type") == WIDGET_STATE_MIME:
            problems += _widget_state_errors(el.text)
    return problems


def _widget_state_errors(state_json: str) -> list[str]:
    try:
        state = json.loads(state_json)
    except json.JSONDecodeError as exc:
        return [f"embedded widget state is not valid JSON: {exc}"]
    problems = []
    for model_id, model in state.get("state", {}).items():
        for out in model.get("state", {}).get("outputs", []) or []:
            if out.get("output_type") == "error":
                problems.append(
                    f"error captured by Output widget {model_id}: "
                    f"{out.get('ename')}: {out.get('evalue')}"
                )
            elif out.get("output_type") == "stream" and out.get("name") == "stderr":
                problems.append(
                    f"stderr captured by Output widget {model_id}: {out.get('text', '')[:200]!r}"
                )
    return problems


def _text_of(el: Element) -> str:
    return " ".join(el.text.split()) or f"<{el.tag} class={el.attrs.get('class', '')!r}>"


def external_references(elements: list[Element]) -> list[str]:
    """Everything the page would fetch from another host, or from a ``file:`` path of the
    machine that built it (``<a href>`` to another site is fine: that is a click, not a load)."""
    problems = []
    for el in elements:
        if el.tag == "link" and set(el.attrs.get("rel", "").lower().split()) <= NO_FETCH_RELS:
            continue  # <link rel=canonical href=https://...> names a page, fetches nothing
        for attr in FETCH_ATTRS.get(el.tag, ()):
            value = el.attrs.get(attr, "")
            if attr == "srcset":
                urls = [u.split()[0] for u in value.split(",") if u.strip()]
            else:
                urls = [value]
            problems += [f"<{el.tag} {attr}={u!r}> loads from outside the book" for u in urls
                         if EXTERNAL.match(u)]
        if el.tag == "script":
            # e.g. data-jupyter-widgets-cdn="https://cdn.jsdelivr.net/npm/"
            problems += [f"<script {k}={v!r}> points at the network" for k, v in el.attrs.items()
                         if k != "src" and EXTERNAL.match(v)]
            if el.attrs.get("type", "text/javascript") in ("text/javascript", "module", ""):
                problems += [f"inline script references {u!r}"
                             for u in re.findall(r"""['"]((?:https?:)?//[^'"\s]+)""", el.text)]
        if el.tag == "style":
            problems += [f"<style> loads {u!r}" for u in CSS_URL.findall(el.text)]
            problems += [f"<style> imports {u!r}" for u in
                         re.findall(r"""@import\s+(?:url\()?['"]?((?:https?:)?//[^'")\s;]+)""",
                                    el.text)]
        style = el.attrs.get("style", "")
        problems += [f"<{el.tag} style> loads {u!r}" for u in CSS_URL.findall(style)]
    return problems


def _local_target(url: str, page: Path, html_root: Path) -> tuple[Path | None, str] | None:
    """(file the URL names or None for this page, fragment), or None for non-file URLs."""
    if not url or EXTERNAL.match(url) or url.lower().startswith(NON_FILE_SCHEMES):
        return None
    parts = urlsplit(url)
    if parts.scheme:  # some other scheme, e.g. file: (checked elsewhere)
        return None
    fragment = unquote(parts.fragment)
    if not parts.path:
        return None, fragment
    path = Path(unquote(parts.path))
    target = (html_root / path.relative_to("/")) if path.is_absolute() else (page.parent / path)
    return target.resolve(), fragment


def missing_images(elements: list[Element], page: Path, html_root: Path) -> list[str]:
    """Every ``<img src>`` must be a non-empty local file (or inline data)."""
    problems = []
    for el in elements:
        if el.tag != "img":
            continue
        src = el.attrs.get("src", "")
        if not src.strip():
            if el.attrs.get("id", "").startswith(ANIMATION_FRAME_ID):
                continue  # the player's script fills it in: test_page_renders_offline checks
            problems.append("<img> without src")
            continue
        if src.lower().startswith("data:"):
            if "," not in src or not src.split(",", 1)[1].strip():
                problems.append("<img> with an empty data: URI")
            continue
        target = _local_target(src, page, html_root)
        if target is None:
            continue  # external: reported by external_references
        path, _ = target
        if path is None or not path.is_file():
            problems.append(f"<img src={src!r}>: no such file")
        elif path.stat().st_size == 0:
            problems.append(f"<img src={src!r}>: empty file")
    return problems


def broken_links(
    elements: list[Element], page: Path, html_root: Path,
    ids_of: dict[Path, set[str]] | None = None,
) -> list[str]:
    """Relative hrefs and local script/stylesheet sources must name existing files; anchors
    (``page.html#id`` or ``#id``) must name an id in the target page."""
    ids_of = {} if ids_of is None else ids_of
    problems = []
    for el in elements:
        attr = {"a": "href", "link": "href", "area": "href", "script": "src"}.get(el.tag)
        url = el.attrs.get(attr, "") if attr else ""
        target = _local_target(url, page, html_root)
        if target is None:
            continue
        path, fragment = target
        path = page.resolve() if path is None else path
        if path.is_dir():
            path = path / "index.html"
        if not path.is_file():
            problems.append(f"<{el.tag} {attr}={url!r}>: no such file")
            continue
        if fragment and path.suffix == ".html":
            if path not in ids_of:
                ids_of[path] = element_ids(parse_html(path.read_text(encoding="utf-8")))
            if fragment not in ids_of[path]:
                problems.append(f"<{el.tag} {attr}={url!r}>: no id {fragment!r} in {path.name}")
    return problems


def css_urls(css_text: str, base_url: str) -> list[str]:
    """Every ``url()`` of a stylesheet (comments dropped), made absolute against ``base_url``
    (the sheet's own URL, or its page's for a ``<style>``); ``url(#id)`` (an SVG reference)
    and ``data:`` URIs name no file and are left out."""
    text = re.sub(r"/\*.*?\*/", "", css_text, flags=re.DOTALL)
    found = []
    for quoted in CSS_ANY_URL.findall(text):
        url = quoted[1].strip()
        if url and not url.startswith("#") and not url.lower().startswith("data:"):
            found.append(urljoin(base_url, url))
    return found


def missing_files(urls: Iterable[str], html_root: Path) -> list[str]:
    """The ``file:`` URLs that name no file of the book (a font or an image that would 404),
    and every URL that is not a file of the book at all."""
    problems = []
    root = html_root.resolve()
    for url in dict.fromkeys(urls):
        parts = urlsplit(url)
        if parts.scheme != "file":
            problems.append(f"{url}: not a file of the book")
            continue
        path = Path(unquote(parts.path)).resolve()
        if not path.is_relative_to(root):
            problems.append(f"{url}: outside _build/html")
        elif not path.is_file():
            problems.append(f"{url}: no such file")
    return problems


def widget_bundle_assets(bundle_js: str) -> list[str]:
    """The files the widget bundle's CSS names (webpack writes each as ``publicPath + name``,
    ``n.p+"1551f4f60c37af51121f.woff2"``): they must sit beside the bundle."""
    return sorted(set(re.findall(r"""\b[A-Za-z_$]\.p\s*\+\s*["']([\w.-]+\.\w+)["']""",
                                 bundle_js)))


def search_excerpt_sources(html_root: Path) -> list[str]:
    """What the search page needs to show an excerpt offline: every page of the search index
    has its text in ``_static/search-pages.js`` (book/ext/offline_search.py), and the search
    page loads that file and the script that reads it."""
    index = (html_root / "searchindex.js").read_text("utf-8")
    docnames = json.loads(index[index.index("(") + 1:index.rindex(")")])["docnames"]
    pages_js = html_root / "_static" / SEARCH_PAGES_FILE
    if not pages_js.is_file():
        return [f"_static/{SEARCH_PAGES_FILE} is missing: no page's text for excerpts offline"]
    pages_text = pages_js.read_text("utf-8")
    pages = json.loads(pages_text[pages_text.index("{"):pages_text.rindex("}") + 1])
    problems = [f"{name}: no text in _static/{SEARCH_PAGES_FILE}" for name in docnames
                if len(re.sub(r"<[^>]+>", "", pages.get(name, "")).strip()) < 20]
    search_page = parse_html((html_root / "search.html").read_text("utf-8"))
    loaded = [el.attrs["src"].split("?")[0].rsplit("/", 1)[-1] for el in search_page
              if el.tag == "script" and "src" in el.attrs]
    problems += [f"search.html does not load {name}" for name in SEARCH_PAGE_SCRIPTS
                 if name not in loaded]
    return problems

def exercise_headings(elements: list[Element]) -> list[tuple[str, Element]]:
    """(``"N.M"``, heading element) for every ``Exercise N.M`` heading, in page order."""
    found = []
    for el in elements:
        if el.tag in HEADING_TAGS:
            match = EXERCISE_HEADING.search(el.text)
            if match:
                found.append((match.group(1), el))
    return found


def solution_dropdowns(elements: list[Element]) -> list[str]:
    """Every exercise's solution code sits in a "Show solution" dropdown after its heading.

    myst-nb renders a code cell as ``div.cell`` with a ``tag_<name>`` class per cell tag; a
    cell tagged ``hide-input`` wraps its ``div.cell_input`` in ``<details>``, whose
    ``<summary>`` holds the cell's ``code_prompt_show`` and ``code_prompt_hide`` labels. The
    solution of exercise N.M is each cell tagged ``solution`` and ``exercise-N.M``.
    """
    position = {id(el): i for i, el in enumerate(elements)}
    problems = []
    for exercise, heading in exercise_headings(elements):
        cells = [el for el in elements
                 if el.tag == "div" and {"cell", "tag_solution", f"tag_exercise-{exercise}"}
                 <= el.classes]
        if not cells:
            problems.append(f"Exercise {exercise}: no solution cell (tagged solution and "
                            f"exercise-{exercise}) on the page")
        for cell in cells:
            if position[id(cell)] < position[id(heading)]:
                problems.append(f"Exercise {exercise}: a solution cell comes before the "
                                "exercise's heading")
            inputs = [d for d in cell.descendants() if "cell_input" in d.classes]
            if not inputs:
                problems.append(f"Exercise {exercise}: a solution cell shows no code")
            for code in inputs:
                dropdown = _enclosing_details(code, cell)
                summary = next((c for c in dropdown.children if c.tag == "summary"),
                               None) if dropdown else None
                if summary is None:
                    problems.append(f"Exercise {exercise}: the solution's code is not folded "
                                    "in a <details> dropdown")
                elif SOLUTION_PROMPT not in _text_of(summary):
                    problems.append(f"Exercise {exercise}: the solution's dropdown says "
                                    f"{_text_of(summary)!r}, not {SOLUTION_PROMPT!r}")
    return problems


def _enclosing_details(el: Element, within: Element) -> Element | None:
    """The nearest ``<details>`` around ``el`` inside ``within``, or None."""
    for ancestor in el.ancestors():
        if ancestor is within:
            return None
        if ancestor.tag == "details":
            return ancestor
    return None


# --------------------------------------------------------------------------- browser checks


def unrendered_widgets(static: list[Element], rendered: list[Element]) -> list[str]:
    """Each embedded widget view must have become live widget DOM after the scripts ran.

    The embed script (html-manager's embed-amd.js) puts a ``div.widget-subarea`` before each
    ``<script type=application/vnd.jupyter.widget-view+json>`` and renders the view into it.
    """
    views = sum(1 for el in static
                if el.tag == "script" and el.attrs.get("type") == WIDGET_VIEW_MIME)
    if not views:
        return []
    live = [el for el in rendered if "widget-subarea" in el.classes
            and any("jupyter-widgets" in d.classes for d in el.descendants())]
    problems = []
    if len(live) < views:
        problems.append(f"{views} widget view(s) embedded but {len(live)} rendered "
                        "(is embed-amd.js loading, and its modules local?)")
    broken = [el for el in rendered if "jupyter-widgets-error-widget" in el.classes]
    if broken:
        problems.append(f"{len(broken)} widget(s) rendered as an error")
    return problems


def unrendered_math(static: list[Element], rendered: list[Element]) -> list[str]:
    """Every Sphinx math element (``.math``) must hold MathJax output and no TeX error."""
    expected = sum(1 for el in static if "math" in el.classes and el.tag in ("span", "div"))
    if not expected:
        return []
    math = [el for el in rendered if "math" in el.classes and el.tag in ("span", "div")]
    typeset = [el for el in math if any(d.tag == "mjx-container" for d in el.descendants())]
    problems = []
    if len(typeset) < expected:
        problems.append(f"{expected} math element(s) but {len(typeset)} typeset by MathJax "
                        "(raw TeX is showing)")
    errors = [el for el in rendered if el.tag == "mjx-merror" or "data-mjx-error" in el.attrs]
    if errors:
        problems.append(f"{len(errors)} MathJax error(s): "
                        f"{[e.attrs.get('data-mjx-error', '') for e in errors][:3]}")
    return problems


def console_problems(chromium_log: str) -> list[str]:
    """Console messages (chromium --enable-logging=stderr) that mean something broke."""
    problems = []
    for line in chromium_log.splitlines():
        match = re.search(r'CONSOLE[:(]\d+\)?\]?\s*"(.*)", source: (\S*)', line)
        if match and CONSOLE_PROBLEMS.search(match.group(1)):
            problems.append(f"console: {match.group(1)[:300]} ({match.group(2)})")
    return problems


def render_in_chromium(page: Path, budget_ms: int = 10_000) -> tuple[str, str]:
    """(DOM after scripts ran, chromium's log) for a page opened with no network at all."""
    with tempfile.TemporaryDirectory(prefix="book-chromium-") as profile:
        cmd = [
            CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
            "--no-first-run", "--disable-background-networking", "--disable-component-update",
            "--disable-sync", f"--user-data-dir={profile}",
            # Every host name fails to resolve: a CDN reference cannot quietly rescue a page.
            "--host-resolver-rules=MAP * ~NOTFOUND",
            "--enable-logging=stderr", "--v=0",
            f"--virtual-time-budget={budget_ms}", "--dump-dom", page.as_uri(),
        ]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=180, check=False)
    if done.returncode != 0 or "<html" not in done.stdout:
        pytest.fail(f"chromium failed on {page} (exit {done.returncode}):\n{done.stderr[-2000:]}")
    return done.stdout, done.stderr


# The reader's view of a page, measured in chromium through the DevTools protocol
# (tests/chromium_pipe.py): what is cut at the column's edge, which controls look live, what
# failed to load, and the search page's hits.

#: Every element of the article that is laid out as a box (inline text and the insides of an
#: SVG are skipped) must fit the column, or sit in a scroll container that can scroll to it and
#: whose scrollbar is right under it (within UNDER px): a container that scrolls a whole panel
#: as one, its scrollbar under the figure, hides the table's right half above it.
CUT_CONTENT_JS = r"""
(() => {
  const article = document.querySelector('article.bd-article')
    || document.querySelector('[role="main"]') || document.body;
  const TOL = 1, UNDER = 24;
  const REPLACED = new Set(['img', 'svg', 'video', 'canvas', 'iframe', 'object', 'embed',
                            'input', 'select', 'textarea', 'button']);
  const describe = (el) => {
    let s = el.tagName.toLowerCase() + (el.id ? '#' + el.id : '');
    const cls = (typeof el.className === 'string' ? el.className : '').trim().split(/\s+/)
      .filter(Boolean).slice(0, 3);
    if (cls.length) s += '.' + cls.join('.');
    const panel = el.closest('.labs-recorded-panel');
    return panel && panel !== el ? s + ' (in a recorded panel)' : s;
  };
  const flagged = new Set(), problems = [];
  for (const el of article.querySelectorAll('*')) {
    const tag = el.tagName.toLowerCase();
    if ((el.closest('svg') && tag !== 'svg') || el.closest('mjx-assistive-mml')) continue;
    const cs = getComputedStyle(el);  // (mjx-assistive-mml: MathJax's hidden screen-reader text)
    if ((cs.display === 'inline' || cs.display === 'contents') && !REPLACED.has(tag)) continue;
    if (cs.visibility === 'hidden' || cs.position === 'fixed') continue;
    const r = el.getBoundingClientRect();
    if (r.width === 0 || r.height === 0) continue;
    for (let node = el.parentElement; node; node = node.parentElement) {
      const ox = getComputedStyle(node).overflowX, nr = node.getBoundingClientRect();
      const left = nr.left + node.clientLeft, right = left + node.clientWidth;
      const fits = r.left >= left - TOL && r.right <= right + TOL;
      const scrolls = ox === 'auto' || ox === 'scroll', clips = ox === 'hidden' || ox === 'clip';
      if (!scrolls && !clips && node !== article) continue;
      if (fits) break;
      const size = `${Math.round(r.width)} px wide in ${node.clientWidth} px`;
      let verdict;
      if (clips) verdict = `cut at the edge of ${describe(node)} (overflow-x: ${ox}), ${size}`;
      else if (!scrolls) verdict = `sticks out of the article column, ${size}`;
      else if (r.left < left - node.scrollLeft - TOL
               || r.right > left - node.scrollLeft + node.scrollWidth + TOL)
        verdict = `cut: ${describe(node)} cannot scroll to it`;
      else if (nr.bottom - r.bottom > UNDER)
        verdict = `${size}, scrolled only with all of ${describe(node)}, whose scrollbar is `
          + `${Math.round(nr.bottom - r.bottom)} px below it`;
      if (verdict && !flagged.has(el.parentElement)) problems.push(`${describe(el)}: ${verdict}`);
      if (verdict) flagged.add(el);
      break;
    }
  }
  return problems;
})()
"""

#: Every control of every widget drawn on the page (outputs excluded), grouped by the widget
#: area the embed script drew it in, and how many visible KERNEL_NOTE notes each area shows.
WIDGET_CONTROLS_JS = r"""
(() => [...document.querySelectorAll('.widget-subarea')].map(area => ({
  controls: [...area.querySelectorAll(
      'button, input, select, textarea, .noUi-target, [contenteditable]')]
    .filter(el => !el.closest('.jp-OutputArea'))
    .map(el => ({
      kind: el.matches('.noUi-target') ? 'slider'
        : el.matches('[contenteditable]') ? 'slider readout'
        : el.matches('.widget-toggle-button') ? 'toggle button'
        : el.type === 'checkbox' ? 'checkbox' : el.tagName.toLowerCase(),
      label: (el.textContent || el.getAttribute('aria-label') || '').trim().slice(0, 60),
      operable: el.matches('.noUi-target') ? !el.hasAttribute('disabled')
        : el.matches('[contenteditable]') ? el.isContentEditable : !el.disabled,
      recorded_toggle: !!el.closest('.labs-recorded-panel > .widget-toggle-buttons'),
    })),
  notes: [...area.querySelectorAll('*')].filter(el => el.children.length === 0
      && el.textContent.includes(KERNEL_NOTE) && el.getClientRects().length > 0
      && getComputedStyle(el).visibility === 'visible').length,
})))()
"""

#: The search page's hits once it has finished: each hit's title and excerpt (Sphinx adds a
#: ``p.context`` to a hit when it could read the hit's page).
SEARCH_HITS_JS = r"""
[...document.querySelectorAll('#search-results ul.search > li')].map(li => ({
  title: (li.querySelector('a') || li).textContent.trim(),
  excerpt: ((li.querySelector('p.context') || {}).textContent || '').trim(),
}))
"""
SEARCH_FINISHED_JS = ("(document.querySelector('#search-results h2') || {}).textContent"
                      " === 'Search Results'")
#: The widget views drawn (each view's script has a ``div.widget-subarea`` filled before it).
WIDGETS_DRAWN_JS = (
    "[...document.querySelectorAll('.widget-subarea')].filter(a => a.querySelector("
    "'.jupyter-widgets, .jupyter-widgets-disconnected')).length >= document.querySelectorAll("
    f"'script[type=\"{WIDGET_VIEW_MIME}\"]').length")
#: MathJax has typeset the page (or the page has none), then two frames for the last layout.
SETTLED_JS = ("(async () => { if (window.MathJax && MathJax.startup) await MathJax.startup."
              "promise; await new Promise(r => requestAnimationFrame(() => "
              "requestAnimationFrame(r))); return true; })()")


@dataclass(frozen=True)
class ReaderView:
    """What chromium made of a page once its widgets and math were drawn."""

    cut: list[str]  # CUT_CONTENT_JS
    widget_areas: list[dict[str, Any]]  # WIDGET_CONTROLS_JS
    failed_loads: list[tuple[str, str]]  # (URL, reason) of every request that failed
    stylesheet_urls: list[str]  # every url() of every stylesheet the page loaded


def open_rendered(browser: Chromium, url: str) -> Page:
    """A tab with ``url`` loaded, its widgets drawn and its math typeset."""
    page = browser.open(url)
    page.wait_for("document.readyState === 'complete'")
    page.wait_for(WIDGETS_DRAWN_JS)
    page.evaluate(SETTLED_JS)
    return page


def reader_view(browser: Chromium, path: Path) -> ReaderView:
    page = open_rendered(browser, path.as_uri())
    try:
        controls = page.evaluate(WIDGET_CONTROLS_JS.replace(
            "KERNEL_NOTE", json.dumps(KERNEL_NOTE)))
        urls = [u for base, text in page.stylesheets() for u in css_urls(text, base)]
        return ReaderView(page.evaluate(CUT_CONTENT_JS), controls, page.failed_requests, urls)
    finally:
        page.close()


def kernel_controls_problems(areas: list[dict[str, Any]]) -> list[str]:
    """In the book, a recorded panel's ToggleButtons switch runs (a jslink in the page) and must
    work; every other control needs a kernel, so it must be disabled, and each widget holding
    one must show KERNEL_NOTE."""
    problems = []
    for i, area in enumerate(areas, 1):
        kernel_only = 0
        for control in area["controls"]:
            name = f"{control['kind']} {control['label']!r}"
            if control["recorded_toggle"]:
                if not control["operable"]:
                    problems.append(f"widget {i}: the recorded panel's {name} is disabled, "
                                    "but it switches between recorded runs in the page")
                continue
            kernel_only += 1
            if control["operable"]:
                problems.append(f"widget {i}: {name} looks live, but it needs a kernel")
        if kernel_only and not area["notes"]:
            problems.append(f"widget {i}: {kernel_only} control(s) that need a kernel, and no "
                            f"visible note {KERNEL_NOTE!r}")
    return problems


def search_hit_problems(hits: list[dict[str, str]]) -> list[str]:
    """A search must find something, and every hit must show an excerpt, not its title alone."""
    if not hits:
        return ["the search found nothing"]
    return [f"hit {hit['title']!r} shows no excerpt" for hit in hits if not hit["excerpt"]]

# --------------------------------------------------------------------------- book tests


@pytest.fixture(scope="module")
def html_root() -> Path:
    if not HTML_ROOT.is_dir():
        pytest.fail(BUILD_MISSING, pytrace=False)
    for page in BROWSER_PAGES:
        if not (HTML_ROOT / page).is_file():
            pytest.fail(f"{page} is not in _build/html: is it in _toc.yml, and did "
                        "`make book` succeed?", pytrace=False)
    return HTML_ROOT


def built_pages(html_root: Path) -> list[Path]:
    return sorted(p for p in html_root.rglob("*.html")
                  if not p.relative_to(html_root).parts[0].startswith(("_static", "_sources")))


def _fail_on(problems: dict[str, list[str]]) -> None:
    report = "\n".join(f"{page}: {p}" for page, ps in problems.items() for p in ps)
    if report:
        pytest.fail(report, pytrace=False)


def test_no_error_outputs(html_root: Path) -> None:
    problems = {str(p.relative_to(html_root)): error_outputs(parse_html(p.read_text("utf-8")))
                for p in built_pages(html_root)}
    _fail_on(problems)


def test_images_resolve(html_root: Path) -> None:
    problems = {str(p.relative_to(html_root)):
                missing_images(parse_html(p.read_text("utf-8")), p, html_root)
                for p in built_pages(html_root)}
    _fail_on(problems)


def test_internal_links_resolve(html_root: Path) -> None:
    ids_of: dict[Path, set[str]] = {}
    problems = {str(p.relative_to(html_root)):
                broken_links(parse_html(p.read_text("utf-8")), p, html_root, ids_of)
                for p in built_pages(html_root)}
    _fail_on(problems)


def test_nothing_loaded_from_the_network(html_root: Path) -> None:
    problems = {str(p.relative_to(html_root)): external_references(parse_html(p.read_text("utf-8")))
                for p in built_pages(html_root)}
    # Stylesheets can pull fonts or other sheets from a CDN too.
    for css in sorted((html_root / "_static").rglob("*.css")):
        text = css.read_text("utf-8", errors="replace")
        found = CSS_URL.findall(text) + re.findall(
            r"""@import\s+(?:url\()?['"]?((?:https?:)?//[^'")\s;]+)""", text)
        if found:
            problems[str(css.relative_to(html_root))] = [f"loads {u!r}" for u in found]
    _fail_on(problems)


def test_solutions_fold_into_show_solution_dropdowns(html_root: Path) -> None:
    # chapter pages are numbered (01_toy_allreduce.html); appendix pages (A1_...) have none
    chapters = sorted((html_root / "notebooks").glob("[0-9]*.html"))
    assert chapters, "no chapter pages under _build/html/notebooks"
    problems = {}
    for page in chapters:
        elements = parse_html(page.read_text("utf-8"))
        # every chapter's first page ends with exercises: one without would pass vacuously
        first = str(page.relative_to(html_root)) in CHAPTER_FIRST_PAGES
        found = ([] if exercise_headings(elements) or not first
                 else ["no 'Exercise N.M' heading on the page"])
        problems[str(page.relative_to(html_root))] = found + solution_dropdowns(elements)
    _fail_on(problems)


def test_chapter_embeds_widget_state_and_local_scripts(html_root: Path) -> None:
    """The chapter's widget state was saved at build time and its scripts are vendored."""
    elements = parse_html((html_root / CHAPTER).read_text("utf-8"))
    scripts = [el for el in elements if el.tag == "script"]
    assert any(el.attrs.get("type") == WIDGET_STATE_MIME for el in scripts), (
        "no embedded widget state: nbclient did not store it, or the notebook has no widgets")
    srcs = [el.attrs["src"].split("?")[0] for el in scripts if "src" in el.attrs]
    assert len(srcs) == len(set(srcs)), f"a script is loaded twice: {srcs}"
    names = [s.rsplit("/", 1)[-1] for s in srcs]
    for needed in ("require.js", "embed-amd.js", "tex-svg-full.js"):
        assert needed in names, f"{needed} is not loaded by {CHAPTER}: {srcs}"
    assert names.index("require.js") < names.index("embed-amd.js"), "require.js must come first"


def test_vendored_assets_match_checksums() -> None:
    """The vendored scripts are the npm releases named in book/static/vendor/README.md."""
    lines = (VENDOR / "SHA256SUMS").read_text(encoding="utf-8").split("\n")
    sums = dict(reversed(line.split()) for line in lines if line.strip())
    assert sums, "SHA256SUMS is empty"
    for name, expected in sums.items():
        digest = hashlib.sha256((VENDOR / name).read_bytes()).hexdigest()
        assert digest == expected, f"{name} differs from the vendored release; see README.md"


@pytest.fixture(scope="module")
def chromium() -> str:
    if shutil.which(CHROMIUM) is None:
        pytest.skip(CHROMIUM_MISSING)
    return CHROMIUM


@pytest.mark.browser
@pytest.mark.parametrize("page", [p if p in (INTRO, CHAPTER, *ANIMATED, WIDGET_PAGES[-1])
                                  else pytest.param(p, marks=pytest.mark.slow)
                                  for p in BROWSER_PAGES])  # one widget page in make test
def test_page_renders_offline(html_root: Path, chromium: str, page: str) -> None:
    path = html_root / page
    static = parse_html(path.read_text("utf-8"))
    problems: list[str] = []
    for budget_ms in (10_000, 30_000):  # one retry with more virtual time on a slow machine
        dom, log = render_in_chromium(path, budget_ms)
        rendered = parse_html(dom)
        problems = (unrendered_widgets(static, rendered) + unrendered_math(static, rendered)
                    + console_problems(log))
        if not problems:
            break
    if problems:
        pytest.fail(f"{page}:\n" + "\n".join(problems), pytrace=False)
    if page == CHAPTER:
        # The course's chapter has math and widgets; an empty check would prove nothing.
        assert any(el.tag == "mjx-container" for el in rendered), "no math rendered"
        assert any("jupyter-widgets" in el.classes for el in rendered), "no widget rendered"
    if page in ANIMATED:
        # The player's first frame is an <img> whose data URI the player's script fills in.
        frames = [el for el in rendered if el.tag == "img"
                  and el.attrs.get("id", "").startswith(ANIMATION_FRAME_ID)]
        assert frames, "no animation player on the page"
        assert all(el.attrs.get("src", "").startswith("data:image") for el in frames), (
            "an animation player did not load its first frame")
        assert any("jupyter-widgets" in el.classes for el in rendered), "no widget rendered"


def test_stylesheets_resolve(html_root: Path) -> None:
    """Every url() of every stylesheet a page links to names a file of the book (a missing
    font is a blank icon and a failed request on every page)."""
    sheets: set[Path] = set()
    for page in built_pages(html_root):
        for el in parse_html(page.read_text("utf-8")):
            if el.tag == "link" and "stylesheet" in el.attrs.get("rel", "").split():
                target = _local_target(el.attrs.get("href", ""), page, html_root)
                if target is not None and target[0] is not None:
                    sheets.add(target[0])
    assert sheets, "no page links a local stylesheet"
    problems = {str(css.relative_to(html_root)):
                missing_files(css_urls(css.read_text("utf-8", errors="replace"), css.as_uri()),
                              html_root)
                for css in sorted(sheets) if css.is_file()}
    _fail_on(problems)


def test_widget_bundle_ships_its_fonts(html_root: Path) -> None:
    """The widget bundle's CSS (which it adds to the page itself) names its Font Awesome
    files; they sit beside it (js/widgets-asset-path.js points the bundle there)."""
    bundle = html_root / "_static" / "vendor" / "html-manager" / "embed-amd.js"
    assets = widget_bundle_assets(bundle.read_text("utf-8"))
    assert assets, "found no asset names in embed-amd.js: has the bundle's format changed?"
    missing = [name for name in assets if not (bundle.parent / name).is_file()]
    assert not missing, (f"{len(missing)} of the {len(assets)} files the widget bundle's CSS "
                         f"names are not in _static/vendor/html-manager/: {missing}")


def test_search_has_each_pages_text_for_excerpts(html_root: Path) -> None:
    _fail_on({"search": search_excerpt_sources(html_root)})


@pytest.fixture(scope="module")
def devtools(chromium: str) -> Iterator[Chromium]:
    with Chromium(chromium) as browser:
        yield browser


@pytest.mark.browser
@pytest.mark.parametrize("page", CHAPTER_PAGES)
def test_chapter_as_a_reader_sees_it(devtools: Chromium, html_root: Path, page: str) -> None:
    """One visit per chapter (the browser's time is the cost), three checks:

    * nothing is cut at the column's edge: no table, figure or widget output, in a recorded
      panel or not; each fits, or scrolls in a box whose scrollbar is right under it;
    * no request fails (the widget bundle's fonts among them), and every url() of every
      stylesheet the page loaded, the CSS the widget bundle adds too, names a file;
    * the controls that need a kernel are disabled, with a note, and a recorded panel's
      ToggleButtons are not.
    """
    view = reader_view(devtools, html_root / page)
    controls = [c for area in view.widget_areas for c in area["controls"]]
    if page in CHAPTER_FIRST_PAGES:  # a chapter's panel is on its first page
        assert any(c["recorded_toggle"] for c in controls), f"{page}: no recorded panel drawn"
    _fail_on({
        f"{page}, cut": view.cut,
        f"{page}, loads": [f"{url}: {reason}" for url, reason in view.failed_loads]
        + missing_files(view.stylesheet_urls, html_root),
        f"{page}, controls": kernel_controls_problems(view.widget_areas),
    })


@pytest.mark.browser
def test_recorded_toggles_switch_while_kernel_controls_do_nothing(
        html_root: Path, devtools: Chromium) -> None:
    """A reader's clicks: a recorded panel's ToggleButton shows another run; the checkbox, the
    slider and the Run button beside it change nothing."""
    page = open_rendered(devtools, (html_root / INTERACTIVE).as_uri())
    try:
        panel = ".labs-recorded-panel"
        shown = f"document.querySelector('{panel}').innerText"
        for needed in ("input[type=checkbox]", ".noUi-handle", "button.widget-button"):
            assert page.evaluate(f"!!document.querySelector('{panel} {needed}')"), (
                f"{INTERACTIVE}'s panel has no {needed}: pick another page for INTERACTIVE")
        before = page.evaluate(shown)
        # the first option of the panel's first control that is not selected now
        page.click(f"{panel} > .widget-toggle-buttons button.widget-toggle-button"
                   ":not(.mod-active)")
        page.wait_for(f"{shown} !== {json.dumps(before)}", timeout_s=10)
        after = page.evaluate(shown)
        checked = f"document.querySelector('{panel} input[type=checkbox]').checked"
        value = (f"document.querySelector('{panel} .noUi-handle')"
                 ".getAttribute('aria-valuenow')")
        was = page.evaluate(f"[{checked}, {value}]")
        page.click(f"{panel} input[type=checkbox]")
        page.drag(f"{panel} .noUi-handle", dx=150)
        page.click(f"{panel} button.widget-button")
        page.evaluate(SETTLED_JS)
        assert page.evaluate(f"[{checked}, {value}]") == was, (
            "a click or a drag changed a control that needs a kernel")
        assert page.evaluate(shown) == after, "a control that needs a kernel changed the panel"
    finally:
        page.close()


@pytest.mark.browser
def test_search_shows_excerpts_offline(html_root: Path, devtools: Chromium) -> None:
    page = devtools.open((html_root / "search.html").as_uri() + f"?q={SEARCH_WORD}")
    try:
        page.wait_for(SEARCH_FINISHED_JS, timeout_s=30)
        with contextlib.suppress(ChromiumError):  # hits without excerpts: reported below
            page.wait_for(f"{SEARCH_HITS_JS}.every(h => h.excerpt)", timeout_s=5)
        hits = page.evaluate(SEARCH_HITS_JS)
    finally:
        page.close()
    _fail_on({f"search.html?q={SEARCH_WORD}": search_hit_problems(hits)})

# --------------------------------------------------------------------------- checker tests
# Each checker on a clean page and on a page with exactly one defect of its kind.

GOOD_CELL = """<div class="cell docutils container"><div class="cell_output docutils container">
<div class="output stream highlight-myst-ansi notranslate"><pre>ok</pre></div></div></div>"""


def test_error_outputs_catches_traceback_and_stderr() -> None:
    assert error_outputs(parse_html(GOOD_CELL)) == []
    traceback = GOOD_CELL.replace("output stream", "output traceback highlight-ipythontb")
    assert error_outputs(parse_html(traceback))
    stderr = GOOD_CELL.replace("output stream", "output stderr")
    assert error_outputs(parse_html(stderr))
    intended = traceback.replace("cell docutils", "cell tag_raises-exception docutils")
    assert error_outputs(parse_html(intended)) == []


def test_error_outputs_reads_output_widget_state() -> None:
    def page(outputs: list[dict]) -> str:
        state = {"version_major": 2, "version_minor": 0, "state": {"m1": {
            "model_name": "OutputModel", "state": {"outputs": outputs}}}}
        return f'<script type="{WIDGET_STATE_MIME}">{json.dumps(state)}</script>'

    ok = {"output_type": "stream", "name": "stdout", "text": "ready\n"}
    assert error_outputs(parse_html(page([ok]))) == []
    err = {"output_type": "error", "ename": "RuntimeError", "evalue": "x", "traceback": []}
    assert error_outputs(parse_html(page([ok, err])))
    assert error_outputs(parse_html(page([{"output_type": "stream", "name": "stderr",
                                            "text": "warn"}])))


def test_missing_images_catches_missing_empty_and_blank(tmp_path: Path) -> None:
    (tmp_path / "fig.png").write_bytes(b"\x89PNG not really")
    (tmp_path / "empty.png").write_bytes(b"")
    page = tmp_path / "page.html"
    good = ('<img src="fig.png"><img src="data:image/png;base64,iVBORw0KGgo=">'
            '<img id="_anim_imgabc123">')  # an animation player's frame, filled by its script
    assert missing_images(parse_html(good), page, tmp_path) == []
    for bad in ('<img src="gone.png">', '<img src="empty.png">', "<img>",
                '<img src="data:image/png;base64,">'):
        assert missing_images(parse_html(bad), page, tmp_path), bad


def test_broken_links_catches_missing_pages_and_anchors(tmp_path: Path) -> None:
    (tmp_path / "book").mkdir()
    (tmp_path / "book" / "intro.html").write_text('<h1 id="top">x</h1>')
    page = tmp_path / "notebooks" / "ch.html"
    page.parent.mkdir()
    good = ('<a href="../book/intro.html">i</a><a href="../book/intro.html#top">t</a>'
            '<a href="#here">h</a><p id="here"></p><a href="https://arxiv.org/abs/1910.02054">z</a>'
            '<a href="mailto:a@b.c">m</a><a href="#">top</a>')
    page.write_text(good)
    assert broken_links(parse_html(good), page, tmp_path) == []
    for bad in ('<a href="../book/missing.html">x</a>', '<a href="../book/intro.html#nope">x</a>',
                '<a href="#nowhere">x</a>', '<script src="../_static/gone.js"></script>',
                '<link rel="stylesheet" href="../_static/gone.css">'):
        page.write_text(bad)
        assert broken_links(parse_html(bad), page, tmp_path), bad


def test_external_references_catches_cdn_loads() -> None:
    good = ('<script src="../_static/vendor/requirejs/require.js"></script>'
            '<link rel="stylesheet" href="../_static/a.css"><img src="../_images/a.png">'
            '<a href="https://arxiv.org/abs/1910.02054">ZeRO</a>'
            '<link rel="canonical" href="https://example.org/book/intro.html">'
            '<script type="application/vnd.jupyter.widget-state+json">{"t": "https://x"}</script>')
    assert external_references(parse_html(good)) == []
    for bad in (
        '<script src="https://cdn.jsdelivr.net/npm/mathjax@3/es5/tex-mml-chtml.js"></script>',
        '<script src="//cdnjs.cloudflare.com/require.min.js"></script>',
        '<link rel="stylesheet" href="https://fonts.googleapis.com/css?family=Lato">',
        '<link rel="preconnect" href="https://fonts.gstatic.com">',
        '<img src="http://example.org/a.png">',
        '<img srcset="a.png 1x, https://example.org/b.png 2x">',
        '<script src="e.js" data-jupyter-widgets-cdn="https://cdn.jsdelivr.net/npm/"></script>',
        '<script>const THEBE_JS_URL = "https://unpkg.com/thebe@0.8.2/lib/index.js"</script>',
        "<style>@import url('https://fonts.googleapis.com/css2?family=Inter');</style>",
        '<div style="background: url(https://example.org/bg.png)"></div>',
        '<img src="file:///tmp/bookdev/_build/jupyter_execute/fig.png">',
    ):
        assert external_references(parse_html(bad)), bad


def test_unrendered_widgets_catches_missing_views() -> None:
    static = parse_html(f'<div><script type="{WIDGET_VIEW_MIME}">{{"model_id": "a"}}</script>'
                        "</div>")
    rendered_ok = parse_html('<div class="widget-subarea"><div class="lm-Widget jupyter-widgets '
                             'widget-button"></div></div>')
    assert unrendered_widgets(static, rendered_ok) == []
    assert unrendered_widgets(static, static)  # scripts never ran
    assert unrendered_widgets(static, parse_html('<div class="widget-subarea"></div>'))
    errored = parse_html('<div class="widget-subarea"><div class="jupyter-widgets '
                         'jupyter-widgets-error-widget"></div></div>')
    assert unrendered_widgets(static, errored)
    assert unrendered_widgets(parse_html("<p>no widgets</p>"), parse_html("<p></p>")) == []


def test_unrendered_math_catches_raw_tex_and_tex_errors() -> None:
    static = parse_html(r'<span class="math notranslate nohighlight">\(\frac{1}{N}\)</span>')
    ok = parse_html('<span class="math notranslate nohighlight"><mjx-container class="MathJax">'
                    "<svg></svg></mjx-container></span>")
    assert unrendered_math(static, ok) == []
    assert unrendered_math(static, static)  # MathJax never ran
    tex_error = parse_html('<span class="math"><mjx-container><svg><g data-mjx-error="Undefined '
                           'control sequence \\fracc"></g></svg></mjx-container></span>')
    assert unrendered_math(static, tex_error)
    assert unrendered_math(parse_html("<p>no math</p>"), parse_html("<p></p>")) == []


def test_console_problems_catches_uncaught_errors_and_cdn_fallback() -> None:
    quiet = ('[1:1:1122/0:INFO:CONSOLE:1] "[PST]: Changed to auto mode", source: file:///a.js (1)\n'
             "[1:1:1122/0:ERROR:dbus/bus.cc:405] Failed to connect to the bus\n")
    assert console_problems(quiet) == []
    for bad in (
        '"Uncaught (in promise) TypeError: Cannot read properties of undefined '
        '(reading \'Queue\')"',
        '"Falling back to https://cdn.jsdelivr.net/npm/ for bqplot@0.5.0"',
        '"Error: Script error for \\"fake-widgets\\""',
    ):
        line = f"[1:1:1122/0:INFO:CONSOLE:6] {bad}, source: file:///x/embed-amd.js (6)"
        assert console_problems(line), bad


def test_solution_dropdowns_catches_unfolded_mislabelled_and_misplaced_solutions() -> None:
    heading = ('<section id="exercise-1-1"><h2>Exercise 1.1: <code>f</code>'
               '<a class="headerlink" href="#exercise-1-1">#</a></h2><p>Write f.</p>')
    code = ('<div class="cell_input docutils container"><div class="highlight"><pre>'
            "def f(): pass</pre></div></div>")
    cell_class = "cell tag_solution tag_exercise-1.1 tag_hide-input docutils container"

    def solution(summary: str | None) -> str:
        if summary is None:
            return f'<div class="{cell_class}">{code}</div>'
        return (f'<div class="{cell_class}"><details class="hide above-input"><summary>'
                f'<p class="collapsed admonition-title">{summary}</p></summary>{code}'
                "</details></div>")

    good = heading + solution("Show solution") + "</section>"
    assert solution_dropdowns(parse_html(good)) == []
    assert solution_dropdowns(parse_html("<h2>Summary</h2><p>no exercise</p>")) == []
    for bad in (
        heading + solution(None) + "</section>",  # shown in full: no dropdown
        heading + solution("Show code cell source") + "</section>",  # myst-nb's default label
        solution("Show solution") + heading + "</section>",  # before the exercise
        heading + "<p>no solution cell at all</p></section>",
        # a dropdown elsewhere on the page does not count for the solution's code
        "<details><summary>Show solution</summary></details>" + heading + solution(None),
    ):
        assert solution_dropdowns(parse_html(bad)), bad


def test_css_urls_resolve_against_the_sheet_and_missing_files_are_found(tmp_path: Path) -> None:
    (tmp_path / "_static" / "fonts").mkdir(parents=True)
    (tmp_path / "_static" / "fonts" / "a.woff2").write_bytes(b"wOF2")
    css = tmp_path / "_static" / "theme.css"
    text = ("/* url(commented-out.woff) */ @font-face { src: url('fonts/a.woff2?v=1#x') "
            'format("woff2"), url(fonts/gone.ttf); } .i { background: url("data:image/png;'
            'base64,AAAA") } .m { mask: url(#grad) }')
    urls = css_urls(text, css.as_uri())
    assert urls == [(tmp_path / "_static/fonts/a.woff2").as_uri() + "?v=1#x",
                    (tmp_path / "_static/fonts/gone.ttf").as_uri()]
    assert missing_files(urls[:1], tmp_path) == []
    for bad in (urls[1], (tmp_path.parent / "elsewhere.woff").as_uri(),
                "https://fonts.gstatic.com/a.woff2"):
        assert missing_files([bad], tmp_path), bad


def test_widget_bundle_assets_reads_webpacks_asset_names() -> None:
    bundle = ('5890:(e,t,n)=>{"use strict";e.exports=n.p+"1551f4f60c37af51121f.woff2"},'
              '9465:(e,t,o)=>{"use strict";e.exports=o.p+"2f517e09eb2ca6650ff5.svg"},'
              'x.p="";n.p=`${s.origin}${s.pathname}`')
    assert widget_bundle_assets(bundle) == ["1551f4f60c37af51121f.woff2",
                                            "2f517e09eb2ca6650ff5.svg"]


def test_search_excerpt_sources_catches_a_missing_page_text_or_script(tmp_path: Path) -> None:
    (tmp_path / "_static").mkdir()
    index = {"docnames": ["book/intro", "notebooks/01_toy"], "titles": ["Intro", "Toy"]}
    (tmp_path / "searchindex.js").write_text(f"Search.setIndex({json.dumps(index)})")
    text = '<div role="main"><div id="s">Four ranks average one gradient.</div></div>'

    def build(pages: dict[str, str], scripts: Iterable[str]) -> list[str]:
        (tmp_path / "_static" / SEARCH_PAGES_FILE).write_text(
            f"window.LABS_SEARCH_PAGES = {json.dumps(pages)};")
        (tmp_path / "search.html").write_text("".join(
            f'<script src="_static/{s}?v=1"></script>' for s in scripts))
        return search_excerpt_sources(tmp_path)

    scripts = ("searchtools.js", SEARCH_PAGES_FILE, "js/offline-search.js")
    assert build(dict.fromkeys(index["docnames"], text), scripts) == []
    assert build({"book/intro": text}, scripts)  # a page without its text
    assert build({"book/intro": text, "notebooks/01_toy": '<div role="main"></div>'}, scripts)
    assert build(dict.fromkeys(index["docnames"], text), scripts[:2])  # no reader script
    (tmp_path / "_static" / SEARCH_PAGES_FILE).unlink()
    assert search_excerpt_sources(tmp_path)


def test_kernel_controls_problems_catches_live_controls_and_a_missing_note() -> None:
    def control(kind: str, operable: bool, toggle: bool = False) -> dict[str, Any]:
        return {"kind": kind, "label": "Run on real ranks" if kind == "button" else "",
                "operable": operable, "recorded_toggle": toggle}

    toggles = [control("toggle button", True, toggle=True)] * 2
    off = [control("button", False), control("slider", False), control("checkbox", False)]
    assert kernel_controls_problems([{"controls": toggles + off, "notes": 1}]) == []
    assert kernel_controls_problems([{"controls": toggles, "notes": 0}]) == []
    for bad in (
        [{"controls": toggles + [control("button", True)], "notes": 1}],  # a live Run button
        [{"controls": toggles + [control("slider", True)] + off[:1], "notes": 1}],
        [{"controls": toggles + off, "notes": 0}],  # disabled, but nothing says why
        [{"controls": [control("toggle button", False, toggle=True)], "notes": 0}],
    ):
        assert kernel_controls_problems(bad), bad


def test_search_hit_problems_wants_an_excerpt_for_every_hit() -> None:
    hit = {"title": "2. All-reduce algorithms", "excerpt": "...the ring allreduce sends..."}
    assert search_hit_problems([hit]) == []
    assert search_hit_problems([])
    assert search_hit_problems([hit, {"title": "5. DDP", "excerpt": ""}])


@pytest.mark.browser
def test_cut_content_catches_clipped_protruding_and_far_scrolled_boxes(
        tmp_path: Path, devtools: Chromium) -> None:
    wide = '<div style="width: 900px; height: 40px">a table of 900 px</div>'
    figure = '<div style="height: 300px">a figure under it</div>'
    good = (f'<div style="overflow-x: auto">{wide}</div>'  # its scrollbar right under it
            '<pre style="overflow-x: auto">' + "a long line " * 100 + "</pre>"
            '<img style="max-width: 100%" src="data:image/svg+xml,<svg xmlns=\'http://www.w3.org'
            '/2000/svg\' width=\'2000\' height=\'10\'/>">'
            '<div style="overflow: hidden"><div style="width: 100px">fits</div></div>')
    bad = {
        "clipped": f'<div style="overflow: hidden">{wide}</div>',
        "protruding": wide,
        "scrolled with the figure": f'<div style="overflow-x: auto">{wide}{figure}</div>',
    }

    def cut(body: str) -> list[str]:
        page = tmp_path / "page.html"
        page.write_text(f'<!doctype html><html><body style="margin: 0"><article '
                        f'class="bd-article" style="width: 400px">{body}</article></body></html>')
        opened = open_rendered(devtools, page.as_uri())
        try:
            return opened.evaluate(CUT_CONTENT_JS)
        finally:
            opened.close()

    assert cut(good) == []
    for name, body in bad.items():
        assert cut(body), name


@pytest.mark.browser
def test_reader_view_catches_failed_loads_missing_fonts_and_live_controls(
        tmp_path: Path, devtools: Chromium) -> None:
    (tmp_path / "there.png").write_bytes(b"\x89PNG not really")
    panel = ('<div class="widget-subarea"><div class="labs-recorded-panel">'
             '<div class="widget-toggle-buttons"><button class="widget-toggle-button">2</button>'
             '</div><div class="widget-hbox"><input type="checkbox"><button>Run on real ranks'
             "</button></div></div></div>")
    page = tmp_path / "page.html"
    page.write_text(
        "<!doctype html><html><head><style>@font-face { font-family: gone; src: "
        "url(fonts/gone.woff2) } body { font-family: gone }</style></head><body>"
        f'<article class="bd-article"><img src="there.png"><p>text</p>{panel}</article>'
        "</body></html>")
    view = reader_view(devtools, page)
    assert [url for url, _ in view.failed_loads] == [(tmp_path / "fonts/gone.woff2").as_uri()]
    assert missing_files(view.stylesheet_urls, tmp_path) == [
        f"{(tmp_path / 'fonts/gone.woff2').as_uri()}: no such file"]
    problems = kernel_controls_problems(view.widget_areas)
    assert len(problems) == 3, problems  # a live checkbox, a live button, no note
    page.write_text(page.read_text().replace('<img src="there.png">', '<img src="gone.png">')
                    .replace("<input ", "<input disabled ").replace("<button>", "<button disabled>")
                    .replace("</button></div></div>", f"</button><span>{KERNEL_NOTE}</span>"
                             "</div></div>"))
    view = reader_view(devtools, page)
    assert (tmp_path / "gone.png").as_uri() in [url for url, _ in view.failed_loads]
    assert kernel_controls_problems(view.widget_areas) == []


def test_offline_search_keeps_the_articles_text_and_section_ids() -> None:
    spec = importlib.util.spec_from_file_location(
        "offline_search", ROOT / "book" / "ext" / "offline_search.py")
    assert spec is not None and spec.loader is not None
    offline_search = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(offline_search)
    page = ('<html><body><nav>Chapters</nav><main role="main"><article class="bd-article">'
            '<section id="the-ring"><h2>The ring<a class="headerlink" href="#the-ring">#</a>'
            "</h2><p>Each rank sends <code>2(N-1)/N</code> &amp; more.<br></p>"
            '<script type="application/vnd.jupyter.widget-state+json">{"state": 1}</script>'
            '<section id="cost"><p>Latency</p></section></section></article>'
            "<footer>Next</footer></main></body></html>")
    assert offline_search.article_html(page) == (
        '<div role="main"><div id="the-ring">The ring Each rank sends 2(N-1)/N &amp; more. '
        '<div id="cost">Latency </div></div></div>')
