"""The tool-call formats models are trained on, and the registry that names them."""

from __future__ import annotations

from openai_frontend.tools.grammar import CallFormat
from openai_frontend.tools.parser import ToolParser
from openai_frontend.tools.syntax import CallSyntax, Piece, call_head

_WS = Piece.WHITESPACE


class HermesToolParser(ToolParser):
    """Hermes / Qwen: each call in its own tag, a JSON object with "name" and "arguments".

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>
    """

    name = "hermes"
    syntax = CallSyntax(
        triggers={"<tool_call>": ("<tool_call>",)},
        call_head=call_head("arguments"),
        close=(_WS, "}", _WS, "</tool_call>"),
    )
    call_format = CallFormat(
        trigger="<tool_call>",
        begin='<tool_call>\n{{"name": "{name}", "arguments": ',
        end="}\n</tool_call>",
        separator="\n",
    )


class Llama3JsonToolParser(ToolParser):
    """Llama 3.1 / 3.2 JSON tool calls: bare JSON objects with "name" and "parameters"
    ("arguments" is read too), several separated by `;`, optionally after `<|python_tag|>`.

        {"name": "get_weather", "parameters": {"city": "Paris"}}
    """

    name = "llama3_json"
    syntax = CallSyntax(
        triggers={"<|python_tag|>": ("<|python_tag|>",), "{": ()},
        call_head=call_head("parameters", "arguments"),
        separator=(_WS, "}", _WS, ";"),
        close=(_WS, "}"),
    )
    call_format = CallFormat(
        trigger='{"name": ',
        begin='{{"name": "{name}", "parameters": ',
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
    syntax = CallSyntax(
        triggers={"[TOOL_CALLS]": ("[TOOL_CALLS]", _WS, "[")},
        call_head=call_head("arguments"),
        separator=(_WS, "}", _WS, ","),
        close=(_WS, "}", _WS, "]"),
    )
    call_format = CallFormat(
        trigger="[TOOL_CALLS]",
        begin='{{"name": "{name}", "arguments": ',
        end="}",
        separator=", ",
        section=("[TOOL_CALLS][", "]"),
    )


_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesToolParser,
    "qwen": HermesToolParser,
    "llama3_json": Llama3JsonToolParser,
    "mistral": MistralToolParser,
}


def tool_parser_names() -> list[str]:
    return sorted(_PARSERS)


def get_tool_parser(name: str) -> ToolParser:
    """The parser registered as `name`; ValueError naming the known ones otherwise."""
    try:
        return _PARSERS[name]()
    except KeyError:
        raise ValueError(f"unknown tool parser {name!r}; known: {', '.join(tool_parser_names())}") from None
