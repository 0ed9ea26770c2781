"""A media URL's bytes, under the server's policy (media/settings.py).

- `data:<mime>;base64,...`: decoded here, its declared type kept for the decoder;
- `file://<path>`: only under ALLOWED_LOCAL_MEDIA_PATH, the path resolved (symlinks, `..`)
  before the check, so no link or climb leaves the folder;
- `http(s)://`: only to a host in ALLOWED_MEDIA_DOMAINS, with httpx on the event loop (never
  blocking it), the whole download within MEDIA_FETCH_TIMEOUT_S, at most MAX_MEDIA_BYTES,
  and redirects never followed (a redirect could lead to a host not allowed).

Anything else is a MediaError saying why; nothing is fetched before the policy allows it.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlsplit

import httpx

from openai_frontend.media.images import MediaError
from openai_frontend.media.settings import MediaSettings

_CHUNK = 64 * 1024


@dataclass(frozen=True, slots=True)
class MediaBytes:
    """An encoded file, and the type its source declared (a data URL's; None: to be sniffed)."""

    raw: bytes
    mime: str | None = None


async def load_url(url: str, settings: MediaSettings) -> MediaBytes:
    """The bytes `url` names, if the policy allows reading them."""
    if not isinstance(url, str) or not url.strip():
        raise MediaError("bad_url", "the URL is empty")
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme == "data":
        return decode_data(url, settings.max_media_bytes)
    if scheme == "file":
        return await asyncio.to_thread(read_local, url, settings)
    if scheme in ("http", "https"):
        return MediaBytes(await fetch_http(url, settings))
    raise MediaError("unsupported_url", f"unsupported URL scheme {scheme!r}: use a data:, http(s):// or file:// URL")


def decode_data(url: str, max_bytes: int) -> MediaBytes:
    """A base64 data URL's bytes and declared mime type (lower case)."""
    header, sep, payload = url[len("data:") :].partition(",")
    parts = [p.strip().lower() for p in header.split(";")]
    if not sep or "base64" not in parts[1:]:
        raise MediaError("bad_base64", "a data URL must be base64 encoded: data:<type>;base64,<data>")
    payload = "".join(payload.split())
    if len(payload) // 4 * 3 > max_bytes + 3:
        raise MediaError("too_large", f"the data is larger than MAX_MEDIA_BYTES ({max_bytes} bytes)")
    try:
        raw = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as e:
        raise MediaError("bad_base64", f"the data URL's base64 is invalid (truncated?): {e}") from None
    if len(raw) > max_bytes:
        raise MediaError("too_large", f"the data is larger than MAX_MEDIA_BYTES ({max_bytes} bytes)")
    if not raw:
        raise MediaError("empty", "the data URL holds no data")
    return MediaBytes(raw, parts[0] or None)


def read_local(url: str, settings: MediaSettings) -> MediaBytes:
    """A file under ALLOWED_LOCAL_MEDIA_PATH (blocking: run it in a thread)."""
    root = settings.allowed_local_media_path
    if root is None:
        raise MediaError("url_not_allowed", "file:// URLs are not allowed: the server sets no ALLOWED_LOCAL_MEDIA_PATH")
    parts = urlsplit(url)
    if parts.netloc not in ("", "localhost"):
        raise MediaError("url_not_allowed", f"a file:// URL names a local file, not one on host {parts.netloc!r}")
    path = Path(unquote(parts.path))
    try:
        resolved = path.resolve(strict=True)
    except (OSError, RuntimeError):
        resolved = None
    if resolved is None or not resolved.is_relative_to(root):
        # a missing file and one outside the folder get the same answer: nothing leaks about the disk
        raise MediaError("url_not_allowed", f"{str(path)!r} is not a file under the allowed path {str(root)!r}")
    if not resolved.is_file():
        raise MediaError("url_not_allowed", f"{str(path)!r} is not a file")
    if resolved.stat().st_size > settings.max_media_bytes:
        raise MediaError("too_large", f"the file is larger than MAX_MEDIA_BYTES ({settings.max_media_bytes} bytes)")
    with resolved.open("rb") as file:
        raw = file.read(settings.max_media_bytes + 1)
    if len(raw) > settings.max_media_bytes:
        raise MediaError("too_large", f"the file is larger than MAX_MEDIA_BYTES ({settings.max_media_bytes} bytes)")
    return MediaBytes(raw)


async def fetch_http(url: str, settings: MediaSettings) -> bytes:
    """The body of a GET to an allowed host: 200 only, no redirect, bounded in time and size."""
    host = (urlsplit(url).hostname or "").lower()
    if host not in settings.allowed_media_domains:
        allowed = ", ".join(sorted(settings.allowed_media_domains)) or "none (ALLOWED_MEDIA_DOMAINS is unset)"
        raise MediaError("url_not_allowed", f"the server does not fetch from host {host!r}; allowed hosts: {allowed}")
    timeout = settings.fetch_timeout_s
    try:
        async with asyncio.timeout(timeout):
            return await _download(url, settings.max_media_bytes, timeout)
    except (TimeoutError, httpx.TimeoutException):
        raise MediaError("fetch_timeout", f"fetching {url!r} took longer than {timeout} s") from None
    except httpx.HTTPError as e:
        raise MediaError("fetch_failed", f"fetching {url!r} failed: {type(e).__name__}: {e}") from None


async def _download(url: str, max_bytes: int, timeout: float) -> bytes:
    async with httpx.AsyncClient(follow_redirects=False, timeout=timeout, trust_env=False) as client:
        async with client.stream("GET", url) as response:
            if response.is_redirect:
                raise MediaError("fetch_failed", f"{url!r} redirects (HTTP {response.status_code}); not followed")
            if response.status_code != 200:
                raise MediaError("fetch_failed", f"fetching {url!r} answered HTTP {response.status_code}")
            size = response.headers.get("content-length", "")
            if size.isdigit() and int(size) > max_bytes:
                raise MediaError("too_large", f"{url!r} is larger than MAX_MEDIA_BYTES ({max_bytes} bytes)")
            body = bytearray()
            async for chunk in response.aiter_bytes(_CHUNK):
                body += chunk
                if len(body) > max_bytes:
                    raise MediaError("too_large", f"{url!r} is larger than MAX_MEDIA_BYTES ({max_bytes} bytes)")
            return bytes(body)
