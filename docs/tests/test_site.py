"""The built docs site in headless Chromium: no errors in the browser's console, and its search finds a public name.

Run by `make docs` after the build, against `docs/_build/html`, served on
127.0.0.1 by the test. The checks in a browser are marked `browser`: on a
machine without Chromium `make docs` leaves them out and says so (CI, which
installs Chromium, runs them with `DOCS_BROWSER=required`). Chromium is Debian's (`/usr/bin/chromium`, or
`$CHROMIUM`), driven over its DevTools protocol with tornado's websocket
client (a dependency of ipykernel, which the docs' notebooks run in).
"""

from __future__ import annotations

import functools
import http.server
import itertools
import json
import os
import re
import shutil
import subprocess
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from tornado import ioloop, websocket

DOCS = Path(__file__).parents[1]
SITE = DOCS / "_build" / "html"
PAGES = ["index.html", "api.html", "tutorials/first_run.html", "tutorials/nnx_mnist.html", "tutorials/two_tiers.html"]


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (the base class's name)
        """Logs nothing: a missing file shows as the browser's error instead."""


@pytest.fixture(scope="module")
def site() -> Iterator[str]:
    """The built site's address on 127.0.0.1."""
    assert (SITE / "index.html").is_file(), f"{SITE} has no index.html: build the site first (make docs)"
    handler = functools.partial(_QuietHandler, directory=str(SITE))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    thread.join(timeout=10)


@pytest.fixture(scope="module")
def browser(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Headless Chromium's DevTools address (`127.0.0.1:port`)."""
    executable = os.environ.get("CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
    assert Path(executable).exists(), (
        "Chromium is missing: apt-get install chromium (Debian's package), or set CHROMIUM"
    )
    process = subprocess.Popen(
        [
            executable, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
            "--disable-background-networking", "--disable-component-update", "--disable-sync",
            f"--user-data-dir={tmp_path_factory.mktemp('chromium')}", "--remote-debugging-address=127.0.0.1",
            "--remote-debugging-port=0", "about:blank",
        ],
        stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    try:
        address = None
        deadline = time.monotonic() + 60
        assert process.stderr is not None
        while address is None and time.monotonic() < deadline:
            line = process.stderr.readline()
            if not line and process.poll() is not None:
                break
            if found := re.search(r"DevTools listening on ws://([^/]+)/", line):
                address = found.group(1)
        assert address, "Chromium did not say where its DevTools listen"
        threading.Thread(target=process.stderr.read, daemon=True).start()  # keeps its pipe from filling
        yield address
    finally:
        process.kill()
        process.wait(timeout=30)


class Page:
    """One tab, driven over the DevTools protocol; it keeps every error the browser reports."""

    def __init__(self, address: str) -> None:
        request = urllib.request.Request(f"http://{address}/json/new?about:blank", method="PUT")
        with urllib.request.urlopen(request, timeout=30) as response:
            target = json.load(response)
        self._loop = ioloop.IOLoop()
        self._socket = self._loop.run_sync(lambda: websocket.websocket_connect(target["webSocketDebuggerUrl"]))
        self._ids = itertools.count(1)
        self.errors: list[str] = []
        self.events: list[str] = []
        for method in ("Page.enable", "Runtime.enable", "Log.enable"):
            self.call(method)

    def _read(self) -> dict[str, Any]:
        message = self._loop.run_sync(self._socket.read_message, timeout=60)
        assert message is not None, "the browser closed its DevTools connection"
        data = json.loads(message)
        method, params = data.get("method"), data.get("params", {})
        if method == "Runtime.exceptionThrown":
            details = params["exceptionDetails"]
            self.errors.append(details.get("exception", {}).get("description") or details["text"])
        elif method == "Runtime.consoleAPICalled" and params["type"] in ("error", "assert"):
            self.errors.append(" ".join(str(arg.get("value", arg.get("description"))) for arg in params["args"]))
        elif method == "Log.entryAdded" and params["entry"]["level"] == "error":
            self.errors.append(f"{params['entry']['text']} ({params['entry'].get('url', '')})")
        elif method:
            self.events.append(method)
        return data

    def call(self, method: str, **params: Any) -> dict[str, Any]:
        """Sends one command and returns its result (the events meanwhile are kept)."""
        ident = next(self._ids)
        self._socket.write_message(json.dumps({"id": ident, "method": method, "params": params}))
        while (data := self._read()).get("id") != ident:
            pass
        assert "error" not in data, data
        return data["result"]

    def open(self, url: str) -> None:
        """Navigates and waits for the load event."""
        self.events.clear()
        self.call("Page.navigate", url=url)
        while "Page.loadEventFired" not in self.events:
            self._read()

    def evaluate(self, expression: str) -> Any:
        return self.call("Runtime.evaluate", expression=expression, returnByValue=True)["result"].get("value")

    def close(self) -> None:
        self._socket.close()
        self._loop.close()


@pytest.mark.browser
def test_every_page_loads_without_an_error_in_the_console(site: str, browser: str) -> None:
    page = Page(browser)
    try:
        for path in PAGES:
            page.open(f"{site}/{path}")
            title = page.evaluate("document.title")
            assert title and "flaxstate" in title, (path, title)
            time.sleep(0.5)  # scripts that run after the load event (the theme's) report here
            page.evaluate("1")
            assert page.errors == [], (path, page.errors)
    finally:
        page.close()


@pytest.mark.browser
def test_the_search_finds_a_public_name_in_the_api_reference(site: str, browser: str) -> None:
    page = Page(browser)
    try:
        page.open(f"{site}/search.html?q=CheckpointFileReader")
        links: list[str] = []
        deadline = time.monotonic() + 60
        while not links and time.monotonic() < deadline:  # the index loads, then the results are written
            time.sleep(0.2)
            links = page.evaluate("[...document.querySelectorAll('ul.search a')].map(a => a.getAttribute('href'))")
        assert "api.html#flaxstate.CheckpointFileReader" in links, links
        assert page.errors == [], page.errors
        page.open(f"{site}/search.html?q=NoSuchNameAnywhere")
        time.sleep(1)
        summary = page.evaluate("document.querySelector('.search-summary')?.textContent")
        assert summary and "did not match any documents" in summary, summary
    finally:
        page.close()


def test_the_api_reference_has_an_entry_for_every_public_name() -> None:
    import flaxstate

    page = (SITE / "api.html").read_text()
    anchors = set(re.findall(r'id="(flaxstate\.[A-Za-z_.]+)"', page))
    missing = [
        name for name in flaxstate.__all__ if f"flaxstate.{name}" not in anchors
        and not any(anchor.endswith(f".{name}") for anchor in anchors)
    ]  # fmt: skip
    assert missing == [], f"api.html has no entry for {missing}"


def test_a_public_name_without_a_docstring_stops_the_build(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    import flaxstate

    spec = importlib.util.spec_from_file_location("docs_conf", DOCS / "conf.py")
    assert spec is not None and spec.loader is not None
    conf = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(conf)
    assert "## Classes" in conf.api_reference()

    class Undocumented:
        pass

    monkeypatch.setattr(flaxstate, "Undocumented", Undocumented, raising=False)
    monkeypatch.setattr(flaxstate, "__all__", [*flaxstate.__all__, "Undocumented"])
    with pytest.raises(conf.UndocumentedName, match="flaxstate.Undocumented"):
        conf.api_reference()
