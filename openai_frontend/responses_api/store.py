"""Stored responses: a bounded in-memory LRU per tenant (RESPONSES_STORE_MAX entries each).

A stored response keeps its object (what GET returns) and its conversation: the input
items it was given (those of the responses it continued included), so that a
`previous_response_id` continues it. A tenant only ever sees its own: another's id is
not found. Nothing survives a restart of the frontend.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from openai_frontend.api.errors import NOT_FOUND, OpenAIError

DEFAULT_MAX = 1000


@dataclass(slots=True)
class Stored:
    response: dict[str, Any]  # the Response object, as returned
    inputs: list[dict[str, Any]]  # the conversation's input items before this response's output


def not_found(response_id: str, param: str | None = None) -> OpenAIError:
    return OpenAIError(404, f"Response with id '{response_id}' not found.", param, NOT_FOUND, "not_found")


def store_max_from_env(environ: Mapping[str, str]) -> int:
    """RESPONSES_STORE_MAX: stored responses per tenant (0: none is stored)."""
    return int(environ.get("RESPONSES_STORE_MAX", DEFAULT_MAX))


class ResponseStore:
    def __init__(self, max_entries: int = DEFAULT_MAX):
        self.max_entries = max_entries
        self._tenants: dict[str, OrderedDict[str, Stored]] = {}

    def put(self, tenant: str, stored: Stored) -> None:
        if self.max_entries <= 0:
            return
        entries = self._tenants.setdefault(tenant, OrderedDict())
        entries[stored.response["id"]] = stored
        entries.move_to_end(stored.response["id"])
        while len(entries) > self.max_entries:
            entries.popitem(last=False)

    def get(self, tenant: str, response_id: str, param: str | None = None) -> Stored:
        """The tenant's stored response (now the most recently used); a 404 otherwise."""
        entries = self._tenants.get(tenant)
        if entries is None or response_id not in entries:
            raise not_found(response_id, param)
        entries.move_to_end(response_id)
        return entries[response_id]

    def delete(self, tenant: str, response_id: str) -> None:
        entries = self._tenants.get(tenant)
        if entries is None or entries.pop(response_id, None) is None:
            raise not_found(response_id)

    def __len__(self) -> int:
        return sum(len(entries) for entries in self._tenants.values())
