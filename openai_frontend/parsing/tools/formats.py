"""The tool-call formats models are trained on, and the registry that names them.

A format's tags (the text that opens calls and the one that closes a call) are not
written here: they are the running model's (ModelInfo.tool_call_start / _end, from the
engine's model settings), so the engine's tool guards and these parsers read one fact.
"""

from __future__ import annotations

from openai_frontend.parsing.tools.grammar import CallFormat
from openai_frontend.parsing.tools.parser import ToolParser
from openai_frontend.parsing.tools.syntax import CallSyntax, Piece, call_head

_WS = Piece.WHITESPACE
CallTags = tuple[str, str]  # (opening, closing); "" where the format has none


def _literal(text: str) -> str:
    """`text` inside a CallFormat's str.format template."""
    return text.replace("{", "{{").replace("}", "}}")


class HermesToolParser(ToolParser):
    """Hermes / Qwen: each call in its own tag, a JSON object with "name" and "arguments".

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>
    """

    name = "hermes"

    def __init__(self, tags: CallTags):
        start, end = tags
        self.syntax = CallSyntax(
            triggers={start: (start,)},
            call_head=call_head("arguments"),
            close=(_WS, "}", _WS, end),
        )
        self.call_format = CallFormat(
            trigger=start,
            begin=_literal(start) + '\n{{"name": "{name}", "arguments": ',
            end="}\n" + end,
            separator="\n",
        )


class Llama3JsonToolParser(ToolParser):
    """Llama 3.1 / 3.2 JSON tool calls: bare JSON objects with "name" and "parameters"
    ("arguments" is read too), several separated by `;`, optionally after `<|python_tag|>`.

        {"name": "get_weather", "parameters": {"city": "Paris"}}

    The opening tag is the head of the call object itself, `{"name": `.
    """

    name = "llama3_json"

    def __init__(self, tags: CallTags):
        start, _ = tags
        self.syntax = CallSyntax(
            triggers={"<|python_tag|>": ("<|python_tag|>",), "{": ()},
            call_head=call_head("parameters", "arguments"),
            separator=(_WS, "}", _WS, ";"),
            close=(_WS, "}"),
        )
        self.call_format = CallFormat(
            trigger=start,
            begin=_literal(start) + '"{name}", "parameters": ',
            end="}",
            separator="; ",
        )


class MistralToolParser(ToolParser):
    """Mistral: one JSON list of calls after `[TOOL_CALLS]`.

        [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]

    In Mistral's own tokenizers `[TOOL_CALLS]` is a special token: the output must be
    detokenized with it kept for the parser to see it.
    """

    name = "mistral"

    def __init__(self, tags: CallTags):
        start, _ = tags
        self.syntax = CallSyntax(
            triggers={start: (start, _WS, "[")},
            call_head=call_head("arguments"),
            separator=(_WS, "}", _WS, ","),
            close=(_WS, "}", _WS, "]"),
        )
        self.call_format = CallFormat(
            trigger=start,
            begin='{{"name": "{name}", "arguments": ',
            end="}",
            separator=", ",
            section=(start + "[", "]"),
        )


_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesToolParser,
    "qwen": HermesToolParser,
    "llama3_json": Llama3JsonToolParser,
    "mistral": MistralToolParser,
}


def tool_parser_names() -> list[str]:
    return sorted(_PARSERS)


def get_tool_parser(name: str, tags: CallTags) -> ToolParser:
    """The parser registered as `name`, for the model's call tags; ValueError naming the
    known ones otherwise."""
    try:
        parser = _PARSERS[name]
    except KeyError:
        raise ValueError(f"unknown tool parser {name!r}; known: {', '.join(tool_parser_names())}") from None
    return parser(tags)
