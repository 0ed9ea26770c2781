"""The playground page's files as the app serves them (openai_frontend/ui/), and UI=0.
The page itself runs in a browser in tests/e2e/test_playground*_e2e.py."""

from __future__ import annotations

import re

import pytest
from fastapi.testclient import TestClient

from openai_frontend.ui import STATIC, ui_enabled
from tests.helpers.fake_engine import FakeEngine

TYPES = {".js": "text/javascript", ".css": "text/css", ".html": "text/html"}


def test_the_page_and_every_file_it_names_are_served(make_app):
    client = TestClient(make_app(FakeEngine()))
    page = client.get("/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert page.headers["cache-control"] == "no-cache"
    named = re.findall(r'(?:src|href)="(ui/[^"]+)"', page.text)
    for module in STATIC.glob("*.js"):  # what the modules import, relative to ui/
        named += [f"ui/{name}" for name in re.findall(r'from "\./([\w.]+)"', module.read_text())]
    assert {"ui/main.js", "ui/chat.js", "ui/engine.js", "ui/prom.js", "ui/api.js", "ui/style.css"} <= set(named)
    for path in named:
        response = client.get("/" + path)
        assert response.status_code == 200, path
        suffix = path[path.rfind(".") :]
        assert response.headers["content-type"].startswith(TYPES[suffix]), path
    assert "MIT License" in client.get("/ui/vendor/uPlot.LICENSE").text
    assert client.get("/ui/../app.py").status_code == 404
    assert "/" not in client.get("/openapi.json").json()["paths"]  # not an API route


def test_ui_0_leaves_it_out(make_app):
    client = TestClient(make_app(FakeEngine(), UI="0"))
    assert client.get("/").status_code == 404
    assert client.get("/ui/main.js").status_code == 404


def test_the_ui_setting():
    assert ui_enabled({}) and ui_enabled({"UI": "1"}) and ui_enabled({"UI": " yes "}) and ui_enabled({"UI": ""})
    assert not ui_enabled({"UI": "0"}) and not ui_enabled({"UI": "off"}) and not ui_enabled({"UI": "FALSE"})
    with pytest.raises(ValueError, match="UI must be 0 or 1, not 'maybe'"):
        ui_enabled({"UI": "maybe"})
