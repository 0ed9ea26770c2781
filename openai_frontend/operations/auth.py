"""API keys, each mapped to a tenant: who is asking, for the limits and the prefix cache.

Keys come from `API_KEYS_FILE` (a `key tenant` pair per line; blank lines and `#`
comments allowed) and `API_KEYS` (`key1:tenant1,key2:tenant2`), merged. With no keys
the server is open and every request belongs to the tenant "" (one shared prefix
cache, one set of limits).
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Mapping
from pathlib import Path

from fastapi import Request

from openai_frontend.api.errors import INVALID_REQUEST, OpenAIError

OPEN_TENANT = ""


class KeyConfigError(ValueError):
    """The key configuration is unusable; the frontend refuses to start on it."""


class KeyRing:
    """The configured keys (as SHA-256 digests) and their tenants."""

    def __init__(self, keys: Mapping[str, str]):
        self._tenants = [(_digest(key), tenant) for key, tenant in keys.items()]

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> KeyRing:
        keys: dict[str, str] = {}
        path = environ.get("API_KEYS_FILE")
        if path:
            from_file = _parse_file(Path(path))
            if not from_file:
                raise KeyConfigError(f"API_KEYS_FILE {path} holds no keys (refusing to serve without them)")
            _merge(keys, from_file.items(), "API_KEYS_FILE")
        _merge(keys, _parse_list(environ.get("API_KEYS", "")), "API_KEYS")
        return cls(keys)

    @property
    def open(self) -> bool:
        return not self._tenants

    def tenant(self, authorization: str | None, api_key: str | None = None) -> str:
        """The tenant of an `Authorization: Bearer <key>` header, or of an `x-api-key: <key>`
        header (Anthropic's clients send that one); a 401 without a valid key.

        Every configured key is compared, in constant time, against digests of equal
        length, so neither the time taken nor an early exit tells how close a guess was.
        """
        if self.open:
            return OPEN_TENANT
        scheme, _, key = (authorization or "").partition(" ")
        if (scheme.lower() != "bearer" or not key.strip()) and api_key and api_key.strip():
            scheme, key = "bearer", api_key
        if scheme.lower() != "bearer" or not key.strip():
            raise _unauthorized("Missing API key: send it as `Authorization: Bearer <key>` or `x-api-key: <key>`.")
        presented = _digest(key.strip())
        found = None
        for digest, tenant in self._tenants:
            if hmac.compare_digest(presented, digest):
                found = tenant
        if found is None:
            raise _unauthorized("Incorrect API key provided.")
        return found


def tenant_of(request: Request) -> str:
    """The request's tenant, as the app's gate found it; the open tenant when the app is
    driven without the gate."""
    return getattr(request.state, "tenant", OPEN_TENANT)


def _unauthorized(message: str) -> OpenAIError:
    return OpenAIError(401, message, None, INVALID_REQUEST, "invalid_api_key")


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def _parse_file(path: Path) -> dict[str, str]:
    try:
        text = path.read_text()
    except OSError as exc:
        raise KeyConfigError(f"API_KEYS_FILE: cannot read {path}: {exc}") from exc
    keys: dict[str, str] = {}
    for number, line in enumerate(text.splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        if len(parts) != 2:
            raise KeyConfigError(f"{path}:{number}: expected `key tenant`, got {len(parts)} fields")
        _merge(keys, [(parts[0], parts[1])], f"{path}:{number}")
    return keys


def _parse_list(text: str) -> list[tuple[str, str]]:
    pairs = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, _, tenant = item.rpartition(":")
        if not key.strip() or not tenant.strip():
            raise KeyConfigError("API_KEYS: expected `key:tenant` pairs separated by commas")
        pairs.append((key.strip(), tenant.strip()))
    return pairs


def _merge(keys: dict[str, str], pairs, where: str) -> None:
    """Add pairs; one key naming two tenants is a configuration error, not a choice."""
    for key, tenant in pairs:
        if keys.get(key, tenant) != tenant:
            raise KeyConfigError(f"{where}: a key is given to two tenants ({keys[key]!r} and {tenant!r})")
        keys[key] = tenant
