"""A small DevTools-protocol client for headless Debian ``chromium``, over a pipe.

``chromium --remote-debugging-pipe`` reads protocol commands on its file descriptor 3 and
writes replies and events on descriptor 4, each message JSON ending in a NUL byte. That is all
the book's browser tests need to run JavaScript in a page and hear which requests failed, with
no websocket library and no Playwright: ::

    with Chromium() as browser:
        page = browser.open(path.as_uri())
        page.wait_for("document.readyState === 'complete'")
        page.evaluate("document.title")
        page.failed_requests  # [(url, reason)], every one the page made so far
        page.stylesheets()  # [(base url, css text)], every sheet it loaded

Every host name is unresolvable (``--host-resolver-rules``), as in
``tests/test_book_html.py``'s ``render_in_chromium``, so a page gets no network at all.
"""

from __future__ import annotations

import fcntl
import json
import os
import select
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

CHROMIUM = "chromium"
#: The window of a laptop reader: the book's theme shows its sidebar and a 784 px article.
WINDOW = (1280, 1000)


class ChromiumError(RuntimeError):
    """Chromium answered a command with an error, went away, or a wait timed out."""


class Chromium:
    """One headless browser process; :meth:`open` gives a :class:`Page` per URL."""

    def __init__(self, executable: str = CHROMIUM, timeout_s: float = 60.0) -> None:
        self.timeout_s = timeout_s
        self._profile = tempfile.TemporaryDirectory(prefix="book-cdp-")
        to_browser_r, self._to_browser = os.pipe()
        self._from_browser, from_browser_w = os.pipe()
        # the browser's ends, moved above 4 so that putting them on 3 and 4 clobbers neither
        child_r = fcntl.fcntl(to_browser_r, fcntl.F_DUPFD, 10)
        child_w = fcntl.fcntl(from_browser_w, fcntl.F_DUPFD, 10)
        os.close(to_browser_r)
        os.close(from_browser_w)
        width, height = WINDOW
        args = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                "--no-first-run", "--disable-background-networking",
                "--disable-component-update", "--disable-sync",
                f"--user-data-dir={self._profile.name}",
                "--host-resolver-rules=MAP * ~NOTFOUND", f"--window-size={width},{height}",
                "--remote-debugging-pipe", "about:blank"]
        # bash puts the browser's ends of the pipes on 3 and 4, where chromium reads them
        # (dash takes one-digit descriptors only)
        self._proc = subprocess.Popen(
            ["/bin/bash", "-c", f'exec "$0" "$@" 3<&{child_r} 4>&{child_w} '
             f"{child_r}<&- {child_w}>&-", executable, *args],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            pass_fds=(child_r, child_w),
        )
        os.close(child_r)
        os.close(child_w)
        self._next_id = 0
        self._buffer = b""
        self._events: list[dict[str, Any]] = []

    # ------------------------------------------------------------------ protocol

    def _send(self, method: str, params: dict[str, Any] | None = None,
              session: str | None = None) -> int:
        self._next_id += 1
        message: dict[str, Any] = {"id": self._next_id, "method": method,
                                   "params": params or {}}
        if session:
            message["sessionId"] = session
        os.write(self._to_browser, json.dumps(message).encode() + b"\0")
        return self._next_id

    def _read(self, deadline: float) -> dict[str, Any] | None:
        """The next message, or None if none came before ``deadline``."""
        while b"\0" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            ready, _, _ = select.select([self._from_browser], [], [], left)
            if not ready:
                return None
            chunk = os.read(self._from_browser, 1 << 20)
            if not chunk:
                raise ChromiumError(f"chromium exited (code {self._proc.poll()})")
            self._buffer += chunk
        raw, self._buffer = self._buffer.split(b"\0", 1)
        return json.loads(raw)

    def call(self, method: str, params: dict[str, Any] | None = None,
             session: str | None = None) -> dict[str, Any]:
        """Send a command and wait for its reply; events that arrive meanwhile are kept."""
        wanted = self._send(method, params, session)
        deadline = time.monotonic() + self.timeout_s
        while True:
            message = self._read(deadline)
            if message is None:
                raise ChromiumError(f"no reply to {method} in {self.timeout_s} s")
            if message.get("id") == wanted:
                if "error" in message:
                    raise ChromiumError(f"{method}: {message['error']}")
                return message.get("result", {})
            if "method" in message:
                self._events.append(message)

    def pump(self, seconds: float = 0.0) -> None:
        """Read the events that arrive within ``seconds`` (none waited for when 0)."""
        deadline = time.monotonic() + seconds
        while (message := self._read(deadline)) is not None:
            if "method" in message:
                self._events.append(message)

    def events(self, session: str) -> list[dict[str, Any]]:
        return [e for e in self._events if e.get("sessionId") == session]

    # ------------------------------------------------------------------ pages

    def open(self, url: str) -> Page:
        """A new tab, attached, with network events on, navigated to ``url`` (not waited for:
        see :meth:`Page.wait_for`)."""
        target = self.call("Target.createTarget", {"url": "about:blank"})["targetId"]
        session = self.call("Target.attachToTarget",
                            {"targetId": target, "flatten": True})["sessionId"]
        page = Page(self, session, target)
        for domain in ("Network", "Runtime", "DOM", "CSS"):  # CSS needs DOM first
            self.call(f"{domain}.enable", session=session)
        self.call("Page.navigate", {"url": url}, session=session)
        return page

    def close(self) -> None:
        try:
            self._send("Browser.close")
            self._proc.wait(timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            self._proc.kill()
            self._proc.wait()
        finally:
            os.close(self._to_browser)
            os.close(self._from_browser)
            self._profile.cleanup()

    def __enter__(self) -> Chromium:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass
class Page:
    """One tab of a :class:`Chromium`."""

    browser: Chromium
    session: str
    target: str
    _seen: int = field(default=0, repr=False)

    def evaluate(self, expression: str) -> Any:
        """The value of a JavaScript expression in the page (a promise is awaited); it must
        be JSON-serialisable."""
        result = self.browser.call("Runtime.evaluate", {
            "expression": expression, "returnByValue": True, "awaitPromise": True,
        }, session=self.session)
        if "exceptionDetails" in result:
            details = result["exceptionDetails"]
            text = details.get("exception", {}).get("description") or details.get("text")
            raise ChromiumError(f"page script failed: {text}")
        return result["result"].get("value")

    def wait_for(self, expression: str, timeout_s: float = 60.0, poll_s: float = 0.25) -> Any:
        """Evaluate ``expression`` until it is truthy; its value. A page still loading (the
        navigation replaced the context) counts as not yet."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                value = self.evaluate(expression)
            except ChromiumError:
                value = None
            if value:
                return value
            if time.monotonic() > deadline:
                raise ChromiumError(f"timed out after {timeout_s} s waiting for {expression!r}")
            self.browser.pump(poll_s)

    def _centre(self, selector: str, index: int) -> tuple[float, float]:
        found = self.evaluate(
            f"(() => {{ const el = document.querySelectorAll({json.dumps(selector)})[{index}];"
            " if (!el) return null; el.scrollIntoView({block: 'center'});"
            " const r = el.getBoundingClientRect();"
            " return [r.left + r.width / 2, r.top + r.height / 2]; })()")
        if found is None:
            raise ChromiumError(f"nothing on the page matches {selector!r} [{index}]")
        return found[0], found[1]

    def _mouse(self, kind: str, x: float, y: float) -> None:
        self.browser.call("Input.dispatchMouseEvent", {
            "type": kind, "x": x, "y": y, "button": "left", "clickCount": 1,
            "buttons": 0 if kind == "mouseReleased" else 1,
        }, session=self.session)

    def click(self, selector: str, index: int = 0) -> None:
        """Click the ``index``-th element matching ``selector`` with real mouse events at its
        centre, as a reader does (so a disabled control ignores it)."""
        x, y = self._centre(selector, index)
        self._mouse("mousePressed", x, y)
        self._mouse("mouseReleased", x, y)

    def drag(self, selector: str, dx: float, index: int = 0) -> None:
        """Press the mouse on the element's centre, move it ``dx`` px across, release."""
        x, y = self._centre(selector, index)
        self._mouse("mousePressed", x, y)
        for step in range(1, 6):
            self._mouse("mouseMoved", x + dx * step / 5, y)
        self._mouse("mouseReleased", x + dx, y)

    @property
    def failed_requests(self) -> list[tuple[str, str]]:
        """(URL, reason) of every request of this page that failed or got an HTTP error."""
        self.browser.pump()
        urls: dict[str, str] = {}
        failed = []
        for event in self.browser.events(self.session):
            params = event.get("params", {})
            if event["method"] == "Network.requestWillBeSent":
                urls[params["requestId"]] = params["request"]["url"]
            elif event["method"] == "Network.loadingFailed" and not params.get("canceled"):
                failed.append((urls.get(params["requestId"], params["requestId"]),
                               params.get("errorText", "failed")))
            elif event["method"] == "Network.responseReceived":
                status = params["response"].get("status", 0)
                if status >= 400:
                    failed.append((params["response"]["url"], f"HTTP {status}"))
        return failed

    def stylesheets(self) -> list[tuple[str, str]]:
        """(URL the sheet's relative URLs resolve against, text) of every stylesheet the page
        has loaded: ``<link>``-ed files and ``<style>`` elements, those a script added too.
        Read through the protocol's CSS domain, since a ``file:`` page may not read its own
        sheets' ``cssRules``."""
        self.browser.pump()
        sheets = []
        for event in self.browser.events(self.session):
            if event["method"] != "CSS.styleSheetAdded":
                continue
            header = event["params"]["header"]
            try:
                text = self.browser.call("CSS.getStyleSheetText",
                                         {"styleSheetId": header["styleSheetId"]},
                                         session=self.session)["text"]
            except ChromiumError:
                continue  # removed again since (a script's temporary sheet)
            sheets.append((header.get("sourceURL") or self.evaluate("document.baseURI"), text))
        return sheets

    def close(self) -> None:
        self.browser.call("Target.closeTarget", {"targetId": self.target})
