"""What a KV-aware router (NVIDIA Dynamo's) keys blocks by, besides their tokens: the
scope the engine's prefix cache keeps them in. Two requests share cached blocks only
within one tenant, one cache salt and one adapter, so the engine's KV events and the
frontend's routing queries both carry this scope (Dynamo hashes it into its block hashes,
through the field it names `lora_name`)."""

from __future__ import annotations

import json


def routing_scope(tenant: str, cache_salt: str = "", adapter: str = "") -> str | None:
    """None for the unscoped case (no tenant, salt or adapter), else one string naming all three."""
    if not (tenant or cache_salt or adapter):
        return None
    return json.dumps([tenant, cache_salt, adapter])
