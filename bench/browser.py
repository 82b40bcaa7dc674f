"""The one way a test drives a real browser: ``open_page(url)`` opens the page in a headless
Chromium (the system's, through playwright) and yields it with every console error, uncaught
page exception and failed request it saw, so a test can assert that none happened.

Playwright's own browser download is not used (it needs a network the test machines lack);
the command in the README installs Debian's ``chromium`` instead, and a test skips with
``browser_missing()``'s reason where there is none.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from playwright.sync_api import ConsoleMessage, Error, Page, Request

REPO = Path(__file__).resolve().parents[1]

# Headless, as root, with no display, GPU or network: no sandbox (root cannot have one), no
# GPU process, and none of the background fetches (updates, sync, QUIC probes) that would
# only time out here. /dev/shm in a container is often 64 MB: Chromium crashes on it.
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                 "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--disable-dev-shm-usage"]


def chromium_path() -> str | None:
    """The Chromium to drive: ``SERVE_APP_CHROMIUM`` if set, else the first of chromium,
    chromium-browser or google-chrome on PATH."""
    if os.environ.get("SERVE_APP_CHROMIUM"):
        return os.environ["SERVE_APP_CHROMIUM"]
    for name in ("chromium", "chromium-browser", "google-chrome"):
        if found := shutil.which(name):
            return found
    return None


def browser_missing() -> str | None:
    """Why a browser test cannot run here (its skip reason, saying how to fix it), or None."""
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "playwright is not installed: pip install -e '.[test]'"
    path = chromium_path()
    if path is None:
        return ("no Chromium found: apt-get install chromium (Debian), or set "
                "SERVE_APP_CHROMIUM to a Chromium or Chrome binary")
    if not (os.path.isfile(path) and os.access(path, os.X_OK)):
        return f"SERVE_APP_CHROMIUM={path} is not an executable file"
    return None


def screenshot_dir() -> Path:
    """Where tests keep screenshots, as artifacts to look at after a run:
    ``SERVE_APP_TEST_ARTIFACTS`` or ``<repo>/test-artifacts/`` (git-ignored), created."""
    path = Path(os.environ.get("SERVE_APP_TEST_ARTIFACTS") or REPO / "test-artifacts")
    path.mkdir(parents=True, exist_ok=True)
    return path


@dataclass
class BrowserPage:
    """An open page and what went wrong on it so far: ``console.error`` messages, uncaught
    exceptions and failed requests, one string each (an HTTP error status is not a failed
    request, but Chromium also logs it as a console error)."""

    page: Page
    console_errors: list[str] = field(default_factory=list)


@contextmanager
def open_page(url: str, *, extra_headers: Mapping[str, str] | None = None,
              timeout_s: float = 15.0) -> Iterator[BrowserPage]:
    """Open ``url`` (loaded) in a fresh headless Chromium with its own temporary profile,
    sending ``extra_headers`` (an API key, say) with every request; the browser is closed and
    playwright stopped however the block ends. Sync playwright: not inside an event loop."""
    from playwright.sync_api import sync_playwright

    path = chromium_path()
    if path is None:
        raise RuntimeError(browser_missing())
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=path, args=CHROMIUM_ARGS,
                                     timeout=timeout_s * 1000)
        try:
            context = browser.new_context(extra_http_headers=dict(extra_headers or {}))
            context.set_default_timeout(timeout_s * 1000)
            opened = BrowserPage(context.new_page())

            def console(message: ConsoleMessage) -> None:
                if message.type == "error":
                    opened.console_errors.append(f"console.error: {message.text}")

            def page_error(error: Error) -> None:
                opened.console_errors.append(f"uncaught: {error.message}")

            def request_failed(request: Request) -> None:
                opened.console_errors.append(
                    f"request failed: {request.method} {request.url}: {request.failure}")

            opened.page.on("console", console)
            opened.page.on("pageerror", page_error)
            opened.page.on("requestfailed", request_failed)
            opened.page.goto(url)
            yield opened
        finally:
            browser.close()
