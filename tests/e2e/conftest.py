"""The e2e tests' browser: headless Chromium (tests/helpers/browser.py), one per test module.

Per module, not per session: Playwright's sync API keeps an asyncio loop running on the
main thread while it is open, and later tests that call asyncio.run() would fail."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.helpers.browser import CHROMIUM, FLAGS


@pytest.fixture(scope="module")
def browser() -> Iterator[object]:
    if not CHROMIUM.exists():
        pytest.fail(f"{CHROMIUM} is missing: `make test` installs Debian's chromium (or set CHROMIUM)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        launched = playwright.chromium.launch(executable_path=str(CHROMIUM), args=list(FLAGS))
        try:
            yield launched
        finally:
            launched.close()
