"""The one bound on every request body, checked by the gate (operations/gate.py) before
any route parses it: JSON only (no NaN or Infinity), nesting, strings, arrays and
objects, the conversation's messages or items, and integers within 64 bits.

Every route's body passes here, the token and Responses routes included, so no
tokenizer, template or validator ever sees a string, a list or a number past these
bounds. A refusal is a 400 naming the first offending place (`messages.3.content`).
Media travel as data URLs or base64 (`image_url.url`, `source.data`), bounded by
MAX_REQUEST_BYTES here and by MAX_MEDIA_BYTES when decoded, not by the strings' bound.
"""

from __future__ import annotations

import json
import math
from typing import Any

from openai_frontend.api.errors import OpenAIError, bad_request
from openai_frontend.operations.limits import LimitSettings

# the conversation's list at the body's top level: chat and Anthropic messages, Responses input
CONVERSATION_KEYS = frozenset({"messages", "input"})
MEDIA_KEYS = frozenset({"url", "image_url", "video_url", "data", "file_data"})
_INT64 = (-(2**63), 2**63 - 1)
_DEFAULTS = LimitSettings()


def checked_body(raw: bytes, bounds: LimitSettings) -> Any:
    """The parsed body, or a 400 naming what is past its bound."""
    try:
        body = json.loads(raw, parse_constant=_refuse_constant)
    except RecursionError:
        why = f"the JSON nests deeper than {bounds.max_json_nesting} levels (the server's MAX_JSON_NESTING)"
        raise bad_request(None, why) from None
    except ValueError as exc:
        raise bad_request(None, f"the body is not valid JSON: {exc}") from None
    place = _first_outside(body, bounds)
    if place is not None:
        path, why = place
        raise bad_request(path or None, f"{path}: {why}" if path else why)
    return body


def checked_json_text(text: str, param: str, bounds: LimitSettings = _DEFAULTS) -> Any:
    """JSON sent as text inside a body (`guided_json`, `structured_outputs.json`), parsed
    within the same bounds as a body; a 400 naming `param`."""
    try:
        return checked_body(text.encode(), bounds)
    except OpenAIError as error:
        where = f"{param}.{error.param}" if error.param else param
        raise bad_request(param, f"{where}: {error.message.split(': ', 1)[-1]}") from None


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _first_outside(body: Any, bounds: LimitSettings) -> tuple[str, str] | None:
    """(path, why) of the first value past a bound, walking without recursion."""
    stack: list[tuple[Any, str, int]] = [(body, "", 1)]
    while stack:
        value, path, depth = stack.pop()
        if depth > bounds.max_json_nesting:  # named by its top-level field: the whole path is that deep
            return path.split(".", 1)[
                0
            ], f"nests deeper than {bounds.max_json_nesting} levels (the server's MAX_JSON_NESTING)"
        why = _outside(value, path, depth, bounds)
        if why is not None:
            return path, why
        if isinstance(value, dict):
            stack.extend((item, _join(path, key), depth + 1) for key, item in reversed(value.items()))
        elif isinstance(value, list):
            stack.extend((item, _join(path, i), depth + 1) for i, item in reversed(list(enumerate(value))))
    return None


def _outside(value: Any, path: str, depth: int, bounds: LimitSettings) -> str | None:
    """Why this one value is past its bound (its children are checked on their own)."""
    if isinstance(value, str):
        limit = bounds.max_string_chars
        if limit and len(value) > limit and not _is_media(path):
            return f"longer than {limit} characters (the server's MAX_STRING_CHARS)"
    elif isinstance(value, bool):
        return None
    elif isinstance(value, int):
        if not _INT64[0] <= value <= _INT64[1]:
            return "an integer outside the 64-bit range"
    elif isinstance(value, float):
        return None if math.isfinite(value) else "not a finite number"
    elif isinstance(value, list | dict):
        return _too_many(value, path, depth, bounds)
    return None


def _too_many(value: list | dict, path: str, depth: int, bounds: LimitSettings) -> str | None:
    if depth == 2 and path in CONVERSATION_KEYS and isinstance(value, list):
        if bounds.max_messages and len(value) > bounds.max_messages:
            return f"at most {bounds.max_messages} messages or items per request (the server's MAX_MESSAGES)"
        return None
    if len(value) > bounds.max_json_items:
        return f"at most {bounds.max_json_items} entries"
    if isinstance(value, dict):
        long_key = next((k for k in value if bounds.max_string_chars and len(k) > bounds.max_string_chars), None)
        if long_key is not None:
            return f"a key longer than {bounds.max_string_chars} characters"
    return None


def _is_media(path: str) -> bool:
    return path.rsplit(".", 1)[-1] in MEDIA_KEYS


def _join(path: str, key: Any) -> str:
    return f"{path}.{key}" if path else str(key)
