"""Input items -> chat messages (what the chat template renders), checked by name.

Items, as the Responses API takes them: messages ({role, content: a string or input_text /
output_text parts}; `type: "message"` optional), `function_call` ({call_id, name,
arguments}), `function_call_output` ({call_id, output}), and `reasoning` items (an
earlier turn's thinking; accepted and not shown to the model, as chat templates drop
earlier thinking). Consecutive function calls become one assistant message's tool calls.
"""

from __future__ import annotations

from typing import Any

from openai_frontend.api.errors import bad_request

ROLES = ("user", "system", "developer", "assistant")
TEXT_PARTS = ("input_text", "output_text", "text")
_KEYS = {
    "message": {"type", "role", "content", "id", "status"},
    "function_call": {"type", "call_id", "name", "arguments", "id", "status"},
    "function_call_output": {"type", "call_id", "output", "id", "status"},
    "reasoning": {"type", "id", "summary", "content", "encrypted_content", "status"},
}


def normalized(input_: str | list[Any]) -> list[dict[str, Any]]:
    """The input as a list of items, each checked (a 400 naming `input[i]...` otherwise)."""
    if isinstance(input_, str):
        return [{"type": "message", "role": "user", "content": input_}]
    return [_checked(i, item) for i, item in enumerate(input_)]


def _checked(index: int, item: Any) -> dict[str, Any]:
    where = f"input[{index}]"
    if not isinstance(item, dict):
        raise bad_request(where, f"{where}: an item must be an object")
    kind = item.get("type", "message")
    if kind not in _KEYS:
        raise bad_request(
            f"{where}.type", f"{where}.type: items of type {kind!r} are not supported; use {', '.join(_KEYS)}"
        )
    unknown = sorted(set(item) - _KEYS[kind])
    if unknown:
        raise bad_request(f"{where}.{unknown[0]}", f"{where}.{unknown[0]}: not a field of a {kind} item")
    if kind == "message":
        return {"type": "message", "role": _role(where, item), "content": _text(where, item.get("content"))}
    if kind == "function_call":
        fields = {name: _string(where, item, name) for name in ("call_id", "name", "arguments")}
        return {"type": "function_call", **fields}
    if kind == "function_call_output":
        return {
            "type": "function_call_output",
            "call_id": _string(where, item, "call_id"),
            "output": _output(where, item),
        }
    return {"type": "reasoning"}


def _role(where: str, item: dict[str, Any]) -> str:
    role = item.get("role")
    if role not in ROLES:
        raise bad_request(f"{where}.role", f"{where}.role: must be one of {', '.join(ROLES)}, got {role!r}")
    return role


def _text(where: str, content: Any) -> str:
    """A message's content as one text: a string, or its text parts joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{where}.content", f"{where}.content: a string or a list of input_text parts")
    texts = []
    for j, part in enumerate(content):
        at = f"{where}.content[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in TEXT_PARTS or not isinstance(part.get("text"), str):
            raise bad_request(at, f"{at}: parts of type {kind!r} are not supported; use input_text {{type, text}}")
        texts.append(part["text"])
    return "\n".join(texts)


def _string(where: str, item: dict[str, Any], name: str) -> str:
    value = item.get(name)
    if not isinstance(value, str):
        raise bad_request(f"{where}.{name}", f"{where}.{name}: a string is required")
    return value


def _output(where: str, item: dict[str, Any]) -> str:
    output = item.get("output")
    if isinstance(output, list):  # output parts: their texts
        return _text(f"{where}.output", output)
    return _string(where, item, "output")


def output_as_input(item: dict[str, Any]) -> dict[str, Any] | None:
    """A response's output item as the next turn's input item (previous_response_id)."""
    if item["type"] == "message":
        text = "".join(part.get("text", "") for part in item["content"])
        return {"type": "message", "role": "assistant", "content": text}
    if item["type"] == "function_call":
        return {key: item[key] for key in ("type", "call_id", "name", "arguments")}
    return None  # reasoning: not shown again


def chat_messages(instructions: str | None, items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The conversation as chat messages: the instructions first (a system message)."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": instructions}] if instructions else []
    for item in items:
        kind = item["type"]
        if kind == "message":
            messages.append({"role": item["role"], "content": item["content"]})
        elif kind == "function_call":
            call = {
                "id": item["call_id"],
                "type": "function",
                "function": {"name": item["name"], "arguments": item["arguments"]},
            }
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and last.get("_calls"):
                last["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call], "_calls": True})
        elif kind == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]})
    for message in messages:
        message.pop("_calls", None)
    if not messages:
        raise bad_request("input", "input: the conversation is empty (no messages)")
    return messages
