"""The e2e tests' browser: one headless Chromium for the session (tests/helpers/browser.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.helpers.browser import CHROMIUM, FLAGS


@pytest.fixture(scope="session")
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
