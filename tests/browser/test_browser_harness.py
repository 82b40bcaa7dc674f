"""tests/browser.py against a real page in a real headless Chromium: a script runs on a click,
extra headers reach the server, and console errors, uncaught exceptions and failed requests
are caught (so a browser test that asserts none happened means something)."""

from __future__ import annotations

import functools
import threading
from collections.abc import Iterator
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from bench.browser import browser_missing, open_page, screenshot_dir

# <link rel="icon" href="data:,">: no favicon request, so no 404 in the console.
CLEAN = """<!doctype html><html><head><link rel="icon" href="data:,"><title>harness</title>
</head><body><button id="go">go</button><p id="out">before</p><script>
document.getElementById("go").onclick = () => {
  document.getElementById("out").textContent = "clicked";
};
</script></body></html>"""

# Port 9 is on Chromium's unsafe-port list: the request fails at once, with no network.
BROKEN = """<!doctype html><html><head><link rel="icon" href="data:,"></head><body>
<img src="http://127.0.0.1:9/nothing.png"><script>
console.error("broken on purpose");
throw new Error("thrown on purpose");
</script></body></html>"""


@pytest.fixture
def site(tmp_path: Path) -> Iterator[tuple[str, list[str]]]:
    """The two pages, served from a thread on a free loopback port; yields the base URL and
    the ``X-Harness`` header of every request, and stops the server."""
    (tmp_path / "clean.html").write_text(CLEAN)
    (tmp_path / "broken.html").write_text(BROKEN)
    seen: list[str] = []

    class Handler(SimpleHTTPRequestHandler):
        def do_GET(self) -> None:
            seen.append(self.headers.get("X-Harness", ""))
            super().do_GET()

        def log_message(self, format: str, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0),
                                 functools.partial(Handler, directory=str(tmp_path)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", seen
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


def test_the_harness_clicks_reads_and_catches_errors(site):
    """Chromium runs as a subprocess of playwright, one per ``open_page``."""
    if reason := browser_missing():
        pytest.skip(reason)
    base, seen = site
    with open_page(f"{base}/clean.html", extra_headers={"X-Harness": "yes"}) as opened:
        page = opened.page
        assert page.text_content("#out") == "before"
        page.click("#go")
        assert page.text_content("#out") == "clicked"
        shot = screenshot_dir() / "browser_harness.png"
        page.screenshot(path=str(shot))
        assert opened.console_errors == []
    assert shot.stat().st_size > 0
    assert seen == ["yes"]

    with open_page(f"{base}/broken.html") as opened:
        errors = opened.console_errors
        for _ in range(50):  # all happen before the load event; their events may lag it
            if len(errors) >= 3:
                break
            opened.page.wait_for_timeout(100)
        assert "console.error: broken on purpose" in errors
        assert any(e.startswith("uncaught: thrown on purpose") for e in errors), errors
        assert any(e.startswith("request failed: GET http://127.0.0.1:9/") for e in errors), errors
