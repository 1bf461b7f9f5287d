"""Search excerpts in the book read offline (a Sphinx extension; ``_config.yml`` loads it).

Sphinx's search page lists each hit with an excerpt around the searched word, which it cuts
from the hit's own page: ``searchtools.js`` ``fetch()``-es ``notebooks/05_ddp.html`` and reads
its ``[role=main]``. A reader who opens ``_build/html/index.html`` from disk gets no excerpt at
all: a browser refuses ``fetch()`` of a ``file:`` URL (chromium: "Cross origin requests are only
supported for protocol schemes: ... http, https"), so every hit shows its title only. No Sphinx
setting changes that (``html_copy_source``, ``html_show_sourcelink`` and
``html_sourcelink_suffix`` concern the ``_sources`` copies, which Sphinx 7's search does not read).

So when the HTML is written, this extension keeps the text of every page's article, with the
ids of its sections (the search links a hit to ``page.html#section`` and excerpts that
section), in ``_static/search-pages.js``, which a ``<script>`` loads on a ``file:`` page where a
``fetch()`` would fail. ``book/static/js/offline-search.js``, loaded on the search page only,
answers the search's ``fetch()`` of a page from that file when the book is opened from disk;
served over HTTP, the search fetches the pages as usual.
"""

from __future__ import annotations

import html
import json
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

from sphinx.application import Sphinx

#: Written to the build's ``_static``: ``window.LABS_SEARCH_PAGES = {docname: html}``.
PAGES_FILE = "search-pages.js"
#: What the search page loads, in this order (the second is in book/static/js).
SEARCH_PAGE_SCRIPTS = (PAGES_FILE, "js/offline-search.js")
VOID_TAGS = {"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta",
             "param", "source", "track", "wbr"}
#: Content the search's own excerpts drop too (``Search.htmlToText``), and the widget state.
SKIPPED_TAGS = {"script", "style", "template"}


class _ArticleText(HTMLParser):
    """The text of a page's ``<article class="bd-article">``, each element with an id kept as
    ``<div id=...>`` around its text, so that ``[role=main] #section`` still finds a section."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.out: list[str] = []
        # one entry per open element inside the article: (tag, emitted a <div>, skipped)
        self._open: list[tuple[str, bool, bool]] = []
        self._inside = False

    @property
    def _skipping(self) -> bool:
        return any(skipped for _, _, skipped in self._open)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        values = {k: v or "" for k, v in attrs}
        if not self._inside:
            if tag == "article" and "bd-article" in values.get("class", "").split():
                self._inside = True
                self._open = [(tag, False, False)]
            return
        if tag in VOID_TAGS:
            return
        skipped = tag in SKIPPED_TAGS or "headerlink" in values.get("class", "").split()
        div = bool(values.get("id")) and not skipped and not self._skipping
        if div:
            self.out.append(f'<div id="{html.escape(values["id"])}">')
        self._open.append((tag, div, skipped))

    def handle_endtag(self, tag: str) -> None:
        if not self._inside:
            return
        for depth in range(len(self._open) - 1, -1, -1):
            if self._open[depth][0] == tag:
                for _, div, _ in reversed(self._open[depth:]):
                    if div:
                        self.out.append("</div>")
                del self._open[depth:]
                break
        if not self._open:
            self._inside = False

    def handle_data(self, data: str) -> None:
        if self._inside and not self._skipping and data.strip():
            self.out.append(html.escape(" ".join(data.split())) + " ")


def article_html(page_html: str) -> str:
    """The searchable text of a built page, as the small HTML document the search reads."""
    parser = _ArticleText()
    parser.feed(page_html)
    parser.close()
    return '<div role="main">' + "".join(parser.out) + "</div>"


def write_pages(app: Sphinx, exception: Exception | None) -> None:
    """After an HTML build, write every page's text (from the written pages, so that a build
    that rewrote only some pages still lists them all)."""
    if exception is not None or app.builder.format != "html":
        return
    outdir = Path(app.outdir)
    pages: dict[str, str] = {}
    for docname in sorted(app.env.found_docs):
        page = outdir / app.builder.get_target_uri(docname)
        if page.is_file():
            pages[docname] = article_html(page.read_text(encoding="utf-8"))
    target = outdir / "_static" / PAGES_FILE
    target.write_text("window.LABS_SEARCH_PAGES = " + json.dumps(pages, ensure_ascii=False)
                      + ";\n", encoding="utf-8")


def add_search_scripts(app: Sphinx, pagename: str, templatename: str,
                       context: dict[str, Any], doctree: Any) -> None:
    if pagename == "search":
        for script in SEARCH_PAGE_SCRIPTS:
            app.add_js_file(script)


def setup(app: Sphinx) -> dict[str, Any]:
    app.connect("html-page-context", add_search_scripts)
    app.connect("build-finished", write_pages)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
