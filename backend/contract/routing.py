"""What a router in front of several engine instances (NVIDIA Dynamo's KV-aware router,
openai_frontend/generation/replicas.py) keys a request by, besides its tokens.

- The scope the engine's prefix cache keeps blocks in: two requests share cached blocks
  only within one tenant, one cache salt and one adapter, so the engine's KV events and
  the router's queries both carry it (Dynamo hashes it into its block hashes, through the
  field it names `lora_name`).
- The request's `session_hash`: the conversation it belongs to, which the router keeps
  on one instance while that instance is healthy. The client names a conversation
  (OpenAI's `prompt_cache_key`, or `session_id`); else it is the first SESSION_TOKENS
  tokens of the prompt. The tenant is hashed in: two tenants never share a session.
"""

from __future__ import annotations

import hashlib
import json

SESSION_TOKENS = 1024  # the prompt tokens a session_hash covers when the client names no session


def routing_scope(tenant: str, cache_salt: str = "", adapter: str = "") -> str | None:
    """None for the unscoped case (no tenant, salt or adapter), else one string naming all three."""
    if not (tenant or cache_salt or adapter):
        return None
    return json.dumps([tenant, cache_salt, adapter])


def session_hash(tenant: str, prompt_tokens: list[int], session: str | None = None) -> str:
    """The request's session_hash (hex): of the client's `session` name if given, else
    of the prompt's first SESSION_TOKENS tokens; the tenant's either way."""
    key = ["session", session] if session else ["prompt", list(prompt_tokens[:SESSION_TOKENS])]
    return hashlib.sha256(json.dumps([tenant, *key]).encode()).hexdigest()[:32]
