"""Checks of a request's `tools` and `tool_choice`, before anything relies on them.

Each error names the field and says why, for a 400 response. Function names follow
OpenAI's rule (letters, digits, `_`, `-`; 1 to 64), which also keeps them safe to put
verbatim in prompts, grammars and call heads.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

_FUNCTION_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
TOOL_CHOICES = ("none", "auto", "required")


def validate_tools(tools: Sequence[Any] | None, tool_choice: Any) -> None:
    """Raise ValueError unless `tools` and `tool_choice` make a usable request."""
    if not tools:
        if tools is not None and not isinstance(tools, list):
            raise ValueError("tools: must be a list of tools")
        if tool_choice is not None:
            raise ValueError("tool_choice: only allowed when tools are given")
        return
    if not isinstance(tools, list):
        raise ValueError("tools: must be a list of tools")
    names = [_tool_name(i, tool) for i, tool in enumerate(tools)]
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise ValueError(f"tools: function names must be unique; repeated: {', '.join(repeated)}")
    _check_tool_choice(tool_choice, names)


def _tool_name(i: int, tool: Any) -> str:
    where = f"tools[{i}]"
    if not isinstance(tool, dict):
        raise ValueError(f"{where}: must be an object")
    if tool.get("type", "function") != "function":
        raise ValueError(f"{where}.type: must be 'function', not {tool.get('type')!r}")
    function = tool.get("function")
    if not isinstance(function, dict):
        raise ValueError(f"{where}.function: missing; a tool is a function with a name")
    name = function.get("name")
    if not name:
        raise ValueError(f"{where}.function.name: missing; every tool needs a function name")
    if not isinstance(name, str) or not _FUNCTION_NAME.fullmatch(name):
        raise ValueError(f"{where}.function.name: {name!r} must be 1 to 64 letters, digits, '_' or '-'")
    parameters = function.get("parameters")
    if parameters is not None and not (isinstance(parameters, dict) and parameters.get("type") == "object"):
        raise ValueError(f'{where}.function.parameters: must be a JSON Schema object with "type": "object"')
    return name


def _check_tool_choice(tool_choice: Any, names: list[str]) -> None:
    if tool_choice is None or tool_choice in TOOL_CHOICES:
        return
    if isinstance(tool_choice, str):
        raise ValueError(f"tool_choice: {tool_choice!r} is not one of {', '.join(TOOL_CHOICES)} or a named function")
    if not isinstance(tool_choice, dict) or tool_choice.get("type") != "function":
        raise ValueError('tool_choice: a named choice is {"type": "function", "function": {"name": ...}}')
    function = tool_choice.get("function")
    name = function.get("name") if isinstance(function, dict) else None
    if not name:
        raise ValueError("tool_choice.function.name: missing")
    if name not in names:
        raise ValueError(f"tool_choice.function.name: {name!r} is not one of the tools ({', '.join(names)})")
