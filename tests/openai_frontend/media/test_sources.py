"""The media URL policy (media/sources.py): data URLs decoded, file:// only under the
allowed folder, http(s) only to allowed hosts, through a real server on a loopback port:
redirects not followed, the timeout and the size cap enforced."""

from __future__ import annotations

import asyncio
import base64
import os

import pytest

from openai_frontend.media import MediaError
from openai_frontend.media.settings import MediaSettings, parse_limits
from openai_frontend.media.sources import load_url
from tests.helpers.media import encoded, media_server, picture

PNG = encoded(picture(30, 20))


def _load(url: str, **settings):
    return asyncio.run(load_url(url, MediaSettings(**settings)))


def _refusal(url: str, **settings) -> MediaError:
    with pytest.raises(MediaError) as refused:
        _load(url, **settings)
    return refused.value


def test_data_url_bytes_and_type():
    loaded = _load(f"data:image/PNG;base64,{base64.b64encode(PNG).decode()}")
    assert loaded.raw == PNG and loaded.mime == "image/png"


@pytest.mark.parametrize(
    ("url", "reason"),
    [
        ("data:image/png;base64,iVBORw0KGgoAAAANSUhEU", "bad_base64"),  # cut mid-quantum
        ("data:image/png;base64,@@@@", "bad_base64"),
        ("data:image/png,plain", "bad_base64"),
        ("data:image/png;base64,", "empty"),
        ("ftp://example.com/a.png", "unsupported_url"),
        ("a.png", "unsupported_url"),
    ],
)
def test_bad_data_urls_and_schemes(url, reason):
    assert _refusal(url).reason == reason


def test_data_url_over_the_byte_cap():
    url = f"data:image/png;base64,{base64.b64encode(PNG).decode()}"
    assert _refusal(url, max_media_bytes=len(PNG) - 10).reason == "too_large"


def test_file_urls_only_under_the_allowed_path(tmp_path):
    allowed, outside = tmp_path / "media", tmp_path / "secret"
    allowed.mkdir()
    outside.mkdir()
    (allowed / "a.png").write_bytes(PNG)
    (outside / "b.png").write_bytes(PNG)
    os.symlink(outside / "b.png", allowed / "link.png")
    root = allowed.resolve()
    assert _load(f"file://{allowed}/a.png", allowed_local_media_path=root).raw == PNG
    refused = _refusal(f"file://{allowed}/a.png")  # no ALLOWED_LOCAL_MEDIA_PATH: never
    assert refused.reason == "url_not_allowed" and "ALLOWED_LOCAL_MEDIA_PATH" in refused.message
    for sneaky in (f"{allowed}/../secret/b.png", f"{allowed}/link.png", f"{outside}/b.png", f"{allowed}/none.png"):
        assert _refusal(f"file://{sneaky}", allowed_local_media_path=root).reason == "url_not_allowed"
    assert _refusal(f"file://{allowed}", allowed_local_media_path=root).reason == "url_not_allowed"  # a folder
    assert _refusal(f"file://other-host{allowed}/a.png", allowed_local_media_path=root).reason == "url_not_allowed"
    too_small = dict(allowed_local_media_path=root, max_media_bytes=10)
    assert _refusal(f"file://{allowed}/a.png", **too_small).reason == "too_large"


def test_http_is_never_fetched_from_a_host_not_allowed():
    with media_server({"/a.png": (200, {}, PNG, 0.0)}) as (port, hits):
        refused = _refusal(f"http://127.0.0.1:{port}/a.png")
        assert refused.reason == "url_not_allowed" and "ALLOWED_MEDIA_DOMAINS" in refused.message
        other = _refusal(f"http://localhost:{port}/a.png", allowed_media_domains=frozenset({"127.0.0.1"}))
        assert other.reason == "url_not_allowed"
    assert hits == []


def test_http_from_an_allowed_host():
    routes = {
        "/a.png": (200, {"Content-Type": "image/png"}, PNG, 0.0),
        "/moved": (302, {"Location": "/a.png"}, b"", 0.0),
        "/slow": (200, {}, PNG, 3.0),
        "/missing": (404, {}, b"nope", 0.0),
    }
    allowed = dict(allowed_media_domains=frozenset({"127.0.0.1"}), fetch_timeout_s=1.0)
    with media_server(routes) as (port, hits):
        base = f"http://127.0.0.1:{port}"
        assert _load(f"{base}/a.png", **allowed).raw == PNG
        redirect = _refusal(f"{base}/moved", **allowed)
        assert redirect.reason == "fetch_failed" and "redirect" in redirect.message
        assert _refusal(f"{base}/slow", **allowed).reason == "fetch_timeout"
        assert _refusal(f"{base}/missing", **allowed).reason == "fetch_failed"
        assert _refusal(f"{base}/a.png", **allowed, max_media_bytes=100).reason == "too_large"
    assert "/a.png" in hits and hits.count("/moved") == 1  # the redirect's target was not asked for it


def test_settings_from_the_environment(tmp_path):
    settings = MediaSettings.from_env({})
    assert settings.limit_per_prompt == {"image": 8, "video": 1} and settings.allowed_media_domains == frozenset()
    assert settings.allowed_local_media_path is None and settings.video_fps == 2.0
    env = {
        "LIMIT_MM_PER_PROMPT": "image=2", "ALLOWED_MEDIA_DOMAINS": "Example.com, cdn.example.com",
        "ALLOWED_LOCAL_MEDIA_PATH": str(tmp_path), "VIDEO_FPS": "1.5", "MAX_MEDIA_BYTES": "1000",
    }  # fmt: skip
    settings = MediaSettings.from_env(env)
    assert settings.limit_per_prompt == {"image": 2, "video": 1}
    assert settings.allowed_media_domains == {"example.com", "cdn.example.com"}
    assert settings.allowed_local_media_path == tmp_path.resolve()
    assert (settings.video_fps, settings.max_media_bytes) == (1.5, 1000)
    assert parse_limits("image=0,video=3") == {"image": 0, "video": 3}
    for bad in ({"LIMIT_MM_PER_PROMPT": "audio=1"}, {"VIDEO_FPS": "0"}, {"MAX_MEDIA_BYTES": "lots"}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            MediaSettings.from_env(bad)
