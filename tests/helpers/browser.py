"""Headless Chromium for the playground's tests: Debian's /usr/bin/chromium (installed by
`make test`), driven by Playwright for Python; never a browser download.

`open_page(browser, url)` opens a page in a fresh context (its own session storage) and
records what went wrong in it (console errors, uncaught exceptions) and every address
it asked for, so a test can check that the page fetches nothing from elsewhere."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from playwright.sync_api import Browser, Page

from launcher.layout import REPO_ROOT

CHROMIUM = Path(os.environ.get("CHROMIUM", "/usr/bin/chromium"))
# As root, without a sandbox; no background connections (this machine's network is closed).
FLAGS = (
    "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-sync",
    "--disable-background-networking", "--disable-component-update",
)  # fmt: skip
SCREENSHOTS = REPO_ROOT / "build" / "ui"
DESKTOP = {"width": 1280, "height": 800}
PHONE = {"width": 390, "height": 844}


@dataclass
class OpenedPage:
    page: Page
    errors: list[str] = field(default_factory=list)  # console errors and uncaught exceptions
    requested: list[str] = field(default_factory=list)  # every URL the page asked for

    def close(self) -> None:
        self.page.context.close()


def open_page(browser: Browser, url: str, viewport: dict[str, int] = DESKTOP, api_key: str | None = None) -> OpenedPage:
    """`api_key`: in the tab's session storage before the page's scripts run, as if typed earlier."""
    context = browser.new_context(viewport=viewport)
    if api_key is not None:
        context.add_init_script(f"sessionStorage.setItem('llm-playground-api-key', {json.dumps(api_key)})")
    page = context.new_page()
    opened = OpenedPage(page)
    page.on("console", lambda message: message.type == "error" and opened.errors.append(message.text))
    page.on("pageerror", lambda error: opened.errors.append(f"uncaught: {error}"))
    page.on("request", lambda request: opened.requested.append(request.url))
    page.goto(url)
    return opened


def screenshot(page: Page, name: str) -> Path:
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    path = SCREENSHOTS / name
    page.screenshot(path=str(path))
    return path
