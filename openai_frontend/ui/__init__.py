"""The playground page at GET /: a chat with the served model and live charts of the
engine, made of the static files in static/ (no build step, nothing fetched from the
network; uPlot, MIT, is vendored in static/vendor/ with its licence). The page speaks only
the public API: /v1/models, /v1/chat/completions (SSE) and /metrics. `UI=0` leaves it out."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles

STATIC = Path(__file__).resolve().parent / "static"
_ON, _OFF = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def ui_enabled(env: Mapping[str, str]) -> bool:
    """UI: 1 (the default) serves the page, 0 leaves it out."""
    value = env.get("UI", "1").strip().lower() or "1"
    if value not in _ON + _OFF:
        raise ValueError(f"UI must be 0 or 1, not {value!r}")
    return value in _ON


def mount_ui(app: FastAPI) -> None:
    """The page at / and its files under /ui/; the browser is told to revalidate them,
    so a page opened after an upgrade is the new one."""
    index = STATIC / "index.html"
    revalidate = {"Cache-Control": "no-cache"}

    @app.get("/", include_in_schema=False)
    async def playground() -> FileResponse:
        return FileResponse(index, headers=revalidate)

    app.mount("/ui", _RevalidatedFiles(directory=STATIC), name="ui")


class _RevalidatedFiles(StaticFiles):
    def file_response(self, *args, **kwargs):
        response = super().file_response(*args, **kwargs)
        response.headers["Cache-Control"] = "no-cache"
        return response
