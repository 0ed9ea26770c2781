"""Tool calling for the frontend: parsing calls out of outputs (whole and streamed),
constraining outputs to calls with a grammar, prompting for them, and checking requests.

    parser = get_tool_parser("hermes", ("<tool_call>", "</tool_call>"))  # the model's tags (ModelInfo)
    content, calls = parser.parse(text, tools)
    stream = parser.stream(tools); stream.feed(delta) ...; stream.finish()
    kind, spec = parser.compile_tool_grammar(tools, tool_choice, parallel_tool_calls)
"""

from openai_frontend.parsing.tools.calls import Delta, ToolCall
from openai_frontend.parsing.tools.formats import (
    HermesToolParser,
    Llama3JsonToolParser,
    MistralToolParser,
    get_tool_parser,
    tool_parser_names,
)
from openai_frontend.parsing.tools.loops import tool_loop_detected
from openai_frontend.parsing.tools.parser import ToolParser
from openai_frontend.parsing.tools.stream import ToolCallStream
from openai_frontend.parsing.tools.validation import validate_tools

__all__ = [
    "Delta",
    "HermesToolParser",
    "Llama3JsonToolParser",
    "MistralToolParser",
    "ToolCall",
    "ToolCallStream",
    "ToolParser",
    "get_tool_parser",
    "tool_loop_detected",
    "tool_parser_names",
    "validate_tools",
]
