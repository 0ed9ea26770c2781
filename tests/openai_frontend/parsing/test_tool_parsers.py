"""Tool calling's pure logic: parsers (whole and streamed), grammars, prompts, request checks.

The central property: for every output in the corpus and every way of cutting it into
chunks, the stream's deltas add up to what `parse()` returns (content, and each call's
name and exact arguments text). Grammar tests compile the structural tags with xgrammar
and drive a matcher over the default model's tokens; they skip without the model.
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass

import pytest

from backend.settings.model_settings import TOOL_CALL_TAGS
from openai_frontend.parsing.tools import (
    HermesToolParser,
    ToolParser,
    get_tool_parser,
    tool_loop_detected,
    tool_parser_names,
    validate_tools,
)

HERMES_TAGS = TOOL_CALL_TAGS["hermes"]


def parser_of(name: str) -> ToolParser:
    """The parser registered as `name`, with the tags the engine's settings give it."""
    return get_tool_parser(name, TOOL_CALL_TAGS[name])


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["C", "F"]}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
SEARCH = {
    "type": "function",
    "function": {
        "name": "search",
        "parameters": {"type": "object", "properties": {"query": {"type": "string"}, "filters": {"type": "object"}}},
    },
}
NO_ARGS = {"type": "function", "function": {"name": "now"}}
TOOLS = [WEATHER, SEARCH, NO_ARGS]

NESTED = '{"query": "x", "filters": {"tags": ["a", "b"], "range": {"from": 1, "to": [2, {"z": null}]}}}'
TRICKY = r'{"query": "braces } { ] [ and \"quotes\" and \\ backslash"}'
UNICODE = '{"city": "héllo 🌍", "unit": "C"}'
LONG = json.dumps({"query": " ".join(f"word{i}" for i in range(600))})


@dataclass(frozen=True)
class Case:
    text: str
    content: str | None
    calls: tuple[tuple[str, str], ...] = ()


def text_only(text: str) -> Case:
    """An output with no well-formed call: all of it is content."""
    return Case(text, text or None)


def hermes(name: str, arguments: str) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {arguments}}}\n</tool_call>'


def llama(name: str, arguments: str) -> str:
    return f'{{"name": "{name}", "parameters": {arguments}}}'


def mistral(*calls: tuple[str, str], end: str = "]") -> str:
    return "[TOOL_CALLS][" + ", ".join(f'{{"name": "{n}", "arguments": {a}}}' for n, a in calls) + end


PARIS = ("get_weather", '{"city": "Paris"}')
THREE = (("get_weather", UNICODE), ("search", NESTED), ("now", "{}"))

PLAIN = [
    text_only("Hello! How can I help you today?"),
    text_only("  spaces around, and a new line\n"),
    text_only("Voilà: naïve café, 你好, 🌍🎉 flags 🇫🇷"),
    text_only(""),
]

CORPUS: dict[str, list[Case]] = {
    "hermes": PLAIN
    + [
        text_only("a < b, <tool is not a tag, <tool_call"),
        Case(hermes(*PARIS), None, (PARIS,)),
        Case("Let me check.\n" + hermes(*PARIS) + "\n", "Let me check.", (PARIS,)),
        Case("\n".join(hermes(*call) for call in THREE), None, THREE),
        Case("Sure " + hermes("search", TRICKY) + "\nDone.", "Sure\nDone.", (("search", TRICKY),)),
        Case('<tool_call>{"name":"now","arguments":{}}</tool_call>', None, (("now", "{}"),)),
        Case(
            '<tool_call>\n  {\n "name" : "search" ,\n "arguments" :\n {"query": "q"}\n }\n</tool_call>',
            None,
            (("search", '{"query": "q"}'),),
        ),
        Case(hermes("search", LONG), None, (("search", LONG),)),
        # Malformed calls come back as content, never as broken calls.
        text_only(hermes("get_weather", '{"city": Paris}')),
        text_only('<tool_call>\n{"nam": "x"}\n</tool_call>'),
        text_only('<tool_call>{"arguments": {}, "name": "now"}</tool_call>'),  # the name must come first
        text_only(hermes("launch_rockets", "{}")),
        # A call the output's end cuts short is dropped, never shown as content (max_tokens);
        # one whose arguments are whole counts, whatever of its tail was cut.
        Case('Sure <tool_call>\n{"name": "get_wea', "Sure"),
        Case('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par', None),
        Case("Paris: " + hermes(*PARIS) + '\n<tool_call>\n{"na', "Paris:", (PARIS,)),  # a second call cut
        Case('<tool_call>{"name": "now", "arguments": {}}', None, (("now", "{}"),)),
        Case('<tool_call>{"name": "now", "arguments": {}}\n</tool_c', None, (("now", "{}"),)),
        text_only('<tool_call>{"name": "now", "arguments": {}} x</tool_call>'),
        Case("<tool_call> oops " + hermes("now", "{}") + " done", "<tool_call> oops done", (("now", "{}"),)),
        Case(hermes("now", "{}") + "\n" + hermes("nope", "{}"), "\n" + hermes("nope", "{}"), (("now", "{}"),)),
    ],
    "llama3_json": PLAIN
    + [
        text_only("use {braces} and {x: 1} freely"),
        text_only('{"name": "Bob", "age": 3}'),
        Case(llama(*PARIS), None, (PARIS,)),
        Case('<|python_tag|>{"name": "search", "arguments": {"query": "q"}}', None, (("search", '{"query": "q"}'),)),
        Case("Let me check. " + llama("now", "{}"), "Let me check.", (("now", "{}"),)),
        Case("; ".join(llama(*call) for call in THREE), None, THREE),
        Case(llama("search", TRICKY) + "\nDone.", "\nDone.", (("search", TRICKY),)),
        Case(llama("search", LONG), None, (("search", LONG),)),
        text_only(llama("get_weather", '{"city": Paris}')),
        text_only(llama("launch_rockets", "{}")),
        Case('{"name": "get_weather", "parameters": {"city": "Par', None),  # announced, then cut: dropped
        text_only('Here: {"name": "get_wea'),  # a bare `{` cut before it names a tool may be JSON content
        Case('{"name": "now", "parameters": {}', None, (("now", "{}"),)),
        Case(llama("now", "{}") + "; oops", "oops", (("now", "{}"),)),
    ],
    "mistral": PLAIN
    + [
        text_only("[TOOL] is not [TOOL_CALL"),
        Case(mistral(PARIS), None, (PARIS,)),
        Case('Checking. [TOOL_CALLS] [ {"name": "now", "arguments": {}} ]\n', "Checking.", (("now", "{}"),)),
        Case(mistral(*THREE), None, THREE),
        Case(mistral(("search", TRICKY)) + " ok", " ok", (("search", TRICKY),)),
        Case(mistral(("search", LONG)), None, (("search", LONG),)),
        text_only('[TOOL_CALLS]{"name": "now", "arguments": {}}'),
        text_only(mistral(("now", "{bad}"))),
        text_only(mistral(("x_unknown", "{}"))),
        Case('[TOOL_CALLS][{"name": "now", "argu', None),
        Case(mistral(("now", "{}"), end=""), None, (("now", "{}"),)),
        Case(mistral(("now", "{}"), ("nope", "{}")), '{"name": "nope", "arguments": {}}]', (("now", "{}"),)),
    ],
}

CASES = [(name, case) for name, cases in CORPUS.items() for case in cases]
CASE_IDS = [f"{name}-{i}" for name, cases in CORPUS.items() for i in range(len(cases))]


def chunkings(text: str) -> list[list[str]]:
    """Fixed sizes, then random cuts (fixed seed): boundaries everywhere, tags included."""
    cuts = [[text[i : i + size] for i in range(0, len(text), size)] for size in (1, 2, 3, 7)]
    rng = random.Random(len(text))
    for _ in range(3 if len(text) > 1 else 0):
        points = (
            sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 12)))) if len(text) > 1 else []
        )
        bounds = [0, *points, len(text)]
        cuts.append([text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)])
    return cuts


@dataclass
class Streamed:
    content: str | None
    calls: dict[int, list[str]]  # index -> [id, name, arguments]
    abandoned: list[int]
    ids: list[str]


def run_stream(parser: ToolParser, pieces: list[str], tools=TOOLS) -> Streamed:
    """Feed the pieces, check each chunk's deltas' shape, and add them up as a client does."""
    stream = parser.stream(tools)
    chunks = [stream.feed(piece) for piece in pieces] + [stream.finish()]
    content, calls = "", {}
    for chunk in chunks:
        indices = [delta["index"] for delta in chunk if isinstance(delta, dict)]
        assert len(indices) == len(set(indices)), f"one entry per call index per chunk: {chunk}"
        for delta in chunk:
            if isinstance(delta, str):
                assert delta, "empty content delta"
                content += delta
            elif "id" in delta:
                assert delta["index"] == len(calls), "call indices must count up from 0"
                assert re.fullmatch(r"call_[0-9a-f]{24}", delta["id"])
                assert delta["type"] == "function"
                calls[delta["index"]] = [delta["id"], delta["function"]["name"], delta["function"]["arguments"]]
            else:
                assert set(delta) == {"index", "function"} and set(delta["function"]) == {"arguments"}
                assert delta["function"]["arguments"], "empty arguments delta"
                calls[delta["index"]][2] += delta["function"]["arguments"]
    return Streamed(content or None, calls, stream.abandoned, [call.id for call in stream.tool_calls])


def well_formed(streamed: Streamed) -> list[tuple[str, str]]:
    return [(name, args) for i, (_, name, args) in sorted(streamed.calls.items()) if i not in streamed.abandoned]


@pytest.mark.parametrize(("parser_name", "case"), CASES, ids=CASE_IDS)
def test_parse_corpus(parser_name, case):
    content, calls = parser_of(parser_name).parse(case.text, TOOLS)
    assert content == case.content
    assert [(call.name, call.arguments) for call in calls] == list(case.calls)
    for call in calls:
        assert isinstance(json.loads(call.arguments), dict)


@pytest.mark.parametrize(("parser_name", "case"), CASES, ids=CASE_IDS)
def test_stream_equals_parse_for_every_chunking(parser_name, case):
    parser = parser_of(parser_name)
    content, calls = parser.parse(case.text, TOOLS)
    for pieces in chunkings(case.text):
        streamed = run_stream(parser, pieces)
        assert streamed.content == content, pieces
        assert well_formed(streamed) == [(call.name, call.arguments) for call in calls], pieces
        # A call abandoned after it was announced is only ever the malformed one.
        assert len(streamed.calls) - len(streamed.abandoned) == len(calls)
        assert streamed.ids == [streamed.calls[i][0] for i in sorted(streamed.calls) if i not in streamed.abandoned]


def assert_stream_equals_parse(parser: ToolParser, text: str, chunk_lists: list[list[str]]) -> None:
    content, calls = parser.parse(text, TOOLS)
    for pieces in chunk_lists:
        streamed = run_stream(parser, pieces)
        assert (streamed.content, well_formed(streamed)) == (content, [(c.name, c.arguments) for c in calls]), pieces


@pytest.mark.parametrize("parser_name", ["hermes", "llama3_json", "mistral"])
def test_every_truncation_streams_like_parse(parser_name):
    """An output cut off anywhere (max_tokens, a stop string) still agrees."""
    parser = parser_of(parser_name)
    text = "Sure. " + parser.call_format.render([("get_weather", UNICODE), ("search", TRICKY)]) + " Bye"
    for end in range(len(text) + 1):
        prefix = text[:end]
        assert_stream_equals_parse(parser, prefix, [list(prefix), [prefix[i : i + 5] for i in range(0, end, 5)]])


FUZZ_PIECES = [
    "<tool_call>",
    "</tool_call>",
    "[TOOL_CALLS]",
    "<|python_tag|>",
    "{",
    "}",
    "[",
    "]",
    ",",
    ";",
    ":",
    '"',
    '"name"',
    '"arguments"',
    '"parameters"',
    '"now"',
    '"search"',
    '"x"',
    " ",
    "\n",
    "\\",
    "text",
    "🌍",
    "<",
    "tool",
]


@pytest.mark.parametrize("parser_name", ["hermes", "llama3_json", "mistral"])
def test_fuzzed_outputs_stream_like_parse(parser_name):
    """Random mixes of the formats' pieces: any chunking gives what parse() gives."""
    parser = parser_of(parser_name)
    rng = random.Random(7)
    for _ in range(150):
        pieces = rng.choices(FUZZ_PIECES, k=rng.randint(1, 30))
        if rng.random() < 0.6:  # often around a real call, sometimes one missing a character
            call = parser.call_format.render([("search", '{"query": "q"}')])
            cut = rng.randrange(len(call)) if rng.random() < 0.5 else len(call)
            pieces.insert(rng.randint(0, len(pieces)), call[:cut] + call[cut + 1 :])
        text = "".join(pieces)
        assert_stream_equals_parse(parser, text, [list(text), pieces, chunkings(text)[-1]])
        for call in parser.parse(text, TOOLS)[1]:
            assert isinstance(json.loads(call.arguments), dict)


def test_malformed_head_sends_no_call_delta():
    for text in ['<tool_call>\n{"nam": "x"}\n</tool_call>', hermes("launch_rockets", "{}")]:
        streamed = run_stream(HermesToolParser(HERMES_TAGS), list(text))
        assert streamed.calls == {} and streamed.content == text


def test_a_head_cut_by_the_end_sends_nothing():
    streamed = run_stream(HermesToolParser(HERMES_TAGS), list('<tool_call>{"name": "now"'))
    assert streamed.calls == {} and streamed.content is None


def test_call_cut_off_after_its_head_is_abandoned_and_not_content():
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par'
    streamed = run_stream(HermesToolParser(HERMES_TAGS), [text[:30], text[30:]])
    assert streamed.abandoned == [0] and streamed.content is None
    assert streamed.calls[0][1:] == ["get_weather", '{"city": "Par']


def test_a_call_header_and_its_first_arguments_are_one_entry():
    """OpenAI sends one entry per index per chunk; the openai SDK's stream helper and
    instructor's partial streaming break on two (the header, then a piece)."""
    text = hermes(*PARIS)
    (chunk,) = [HermesToolParser(HERMES_TAGS).stream(TOOLS).feed(text)]
    calls = [delta for delta in chunk if isinstance(delta, dict)]
    assert len(calls) == 1 and calls[0]["id"].startswith("call_")
    assert calls[0]["function"] == {"name": "get_weather", "arguments": PARIS[1]}


def test_long_argument_streams_before_the_call_ends():
    parser = HermesToolParser(HERMES_TAGS)
    text = hermes("search", LONG)
    end = text.index(LONG) + len(LONG) - 20
    stream = parser.stream(TOOLS)
    fragments = []
    for i in range(0, end, 50):
        fragments += [d for d in stream.feed(text[i : min(i + 50, end)]) if isinstance(d, dict)]
    assert len(fragments) > 10
    assert "".join(d["function"]["arguments"] for d in fragments) == LONG[:-20]
    stream.feed(text[end:])
    assert [call.arguments for call in stream.tool_calls] == [LONG]


def test_partial_trigger_is_held_back_until_decided():
    stream = HermesToolParser(HERMES_TAGS).stream(TOOLS)
    assert stream.feed("Hi <tool") == ["Hi"]
    assert stream.feed("box>") == [" <toolbox>"]
    assert stream.finish() == []


def test_names_longer_than_openai_allows_are_no_call():
    longest, too_long = "f" * 64, "f" * 65
    assert [call.name for call in HermesToolParser(HERMES_TAGS).parse(hermes(longest, "{}"))[1]] == [longest]
    assert HermesToolParser(HERMES_TAGS).parse(hermes(too_long, "{}")) == (hermes(too_long, "{}"), [])
    stream = HermesToolParser(HERMES_TAGS).stream()  # decided without waiting for the closing quote
    assert stream.feed('<tool_call>{"name": "' + too_long) == ['<tool_call>{"name": "' + too_long]


def test_any_tool_name_without_a_tool_list():
    content, calls = HermesToolParser(HERMES_TAGS).parse(hermes("launch_rockets", "{}"))
    assert content is None and [call.name for call in calls] == ["launch_rockets"]


@pytest.mark.parametrize("parser_name", ["hermes", "llama3_json", "mistral"])
def test_canonical_calls_parse_back(parser_name):
    """What the grammar forces and the prompt shows is what the parser reads."""
    parser = parser_of(parser_name)
    wanted = [("get_weather", UNICODE), ("search", NESTED), ("now", "{}")]
    content, calls = parser.parse(parser.call_format.render(wanted), TOOLS)
    assert content is None and [(call.name, call.arguments) for call in calls] == wanted
    assert parser.call_format.render(wanted[:1]).startswith(parser.tool_call_trigger)


def test_tool_call_to_openai():
    call = HermesToolParser(HERMES_TAGS).parse(hermes("now", "{}"))[1][0]
    assert call.to_openai() == {"id": call.id, "type": "function", "function": {"name": "now", "arguments": "{}"}}


# --- registry and prompt ---


def test_registry():
    assert tool_parser_names() == ["hermes", "llama3_json", "mistral", "qwen"]
    assert type(parser_of("qwen")) is type(parser_of("hermes"))
    with pytest.raises(ValueError, match="hermes, llama3_json, mistral, qwen"):
        get_tool_parser("nope", HERMES_TAGS)


@pytest.mark.parametrize("parser_name", ["hermes", "llama3_json", "mistral"])
def test_system_prompt_lists_tools_and_shows_a_parsable_call(parser_name):
    parser = parser_of(parser_name)
    prompt = parser.system_prompt(TOOLS)
    for name in ("get_weather", "search", "now", "Current weather in a city."):
        assert name in prompt
    example = parser.call_format.render([("function_name", '{"argument_name": "value"}')])
    assert prompt.endswith("\n" + example)
    assert [call.name for call in parser.parse(example)[1]] == ["function_name"]


# --- grammar ---


def test_no_grammar_without_tools_or_with_none():
    parser = HermesToolParser(HERMES_TAGS)
    assert parser.compile_tool_grammar(TOOLS, "none", True) is None
    assert parser.compile_tool_grammar(None, None, True) is None
    assert parser.compile_tool_grammar([], "auto", True) is None


@pytest.fixture(scope="module")
def grammar_compiler():
    xgr = pytest.importorskip("xgrammar")
    from backend.runner.convert import default_model_path

    folder = default_model_path()
    if not (folder / "tokenizer.json").exists():
        pytest.skip(f"default model not found at {folder}")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=49152)
    return xgr, tokenizer, info, xgr.GrammarCompiler(info)


def make_acceptor(grammar_compiler, parser: ToolParser, tool_choice, parallel: bool):
    xgr, tokenizer, info, compiler = grammar_compiler
    kind, spec = parser.compile_tool_grammar(TOOLS, tool_choice, parallel)
    assert kind == "structural_tag"
    compiled = compiler.compile_structural_tag(spec)

    def accepts(text: str) -> bool:
        matcher = xgr.GrammarMatcher(compiled)
        ids = tokenizer.encode(text, add_special_tokens=False) + [info.stop_token_ids[0]]
        return all(matcher.accept_token(token) for token in ids) and matcher.is_terminated()

    return accepts


WEATHER_CALL = ("get_weather", '{"city": "Paris", "unit": "C"}')
SEARCH_CALL = ("search", '{"query": "news"}')


@pytest.mark.parametrize("parser_name", ["hermes", "llama3_json", "mistral"])
@pytest.mark.parametrize("parallel", [False, True])
def test_auto_grammar(grammar_compiler, parser_name, parallel):
    parser = parser_of(parser_name)
    accepts = make_acceptor(grammar_compiler, parser, "auto", parallel)
    render = parser.call_format.render
    assert accepts("Hello! The weather is nice.")
    assert accepts(render([WEATHER_CALL]))
    assert accepts("Let me look. " + render([SEARCH_CALL]))
    assert accepts(render([WEATHER_CALL, SEARCH_CALL])) == parallel
    assert not accepts(render([("launch_rockets", "{}")]))
    assert not accepts(render([("get_weather", '{"town": "Paris"}')]))
    assert not accepts(render([("get_weather", '{"city": 5}')]))
    assert not accepts(render([WEATHER_CALL]) + " and then text")
    for text in ("Let me look. " + render([SEARCH_CALL]), render([WEATHER_CALL, SEARCH_CALL])):
        assert parser.parse(text, TOOLS)[1]  # what the grammar allows, the parser reads


@pytest.mark.parametrize("parser_name", ["hermes", "llama3_json", "mistral"])
@pytest.mark.parametrize("parallel", [False, True])
def test_required_grammar(grammar_compiler, parser_name, parallel):
    parser = parser_of(parser_name)
    accepts = make_acceptor(grammar_compiler, parser, "required", parallel)
    render = parser.call_format.render
    assert not accepts("Hello")
    assert not accepts("Sure. " + render([WEATHER_CALL]))
    assert accepts(render([WEATHER_CALL]))
    assert not accepts(render([WEATHER_CALL]) + " Done.")
    assert accepts(render([("now", "{}")]))
    assert not accepts(render([("now", '{"x": 1}')]))
    assert accepts(render([WEATHER_CALL, SEARCH_CALL])) == parallel


@pytest.mark.parametrize("parser_name", ["hermes", "llama3_json", "mistral"])
def test_named_grammar(grammar_compiler, parser_name):
    parser = parser_of(parser_name)
    accepts = make_acceptor(grammar_compiler, parser, {"type": "function", "function": {"name": "search"}}, True)
    render = parser.call_format.render
    assert accepts(render([SEARCH_CALL]))
    assert not accepts(render([WEATHER_CALL]))
    assert not accepts("Hi " + render([SEARCH_CALL]))
    assert not accepts(render([SEARCH_CALL, SEARCH_CALL]))


# --- request checks ---


@pytest.mark.parametrize(
    ("tools", "tool_choice", "message"),
    [
        (None, "auto", r"^tool_choice: only allowed when tools are given"),
        ([], "required", r"^tool_choice:"),
        ([{"type": "function", "function": {"description": "x"}}], None, r"^tools\[0\]\.function\.name: missing"),
        ([{"type": "function"}], None, r"^tools\[0\]\.function: missing"),
        ([WEATHER, {"type": "retrieval"}], None, r"^tools\[1\]\.type"),
        ([{"type": "function", "function": {"name": "a b"}}], None, r"^tools\[0\]\.function\.name: 'a b'"),
        ([WEATHER, WEATHER], None, r"^tools: function names must be unique; repeated: get_weather"),
        (
            [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}],
            None,
            r"^tools\[0\]\.function\.parameters: must be a JSON Schema object",
        ),
        ([{"type": "function", "function": {"name": "f", "parameters": ["x"]}}], None, r"parameters"),
        (TOOLS, {"type": "function", "function": {"name": "fly"}}, r"^tool_choice\.function\.name: 'fly' is not one"),
        (TOOLS, {"type": "function"}, r"^tool_choice\.function\.name: missing"),
        (TOOLS, "always", r"^tool_choice: 'always' is not one of"),
    ],
)
def test_validate_tools_rejects(tools, tool_choice, message):
    with pytest.raises(ValueError, match=message):
        validate_tools(tools, tool_choice)


@pytest.mark.parametrize(
    ("tools", "tool_choice"),
    [
        (None, None),
        ([], None),
        (TOOLS, None),
        (TOOLS, "none"),
        (TOOLS, "required"),
        (TOOLS, {"type": "function", "function": {"name": "now"}}),
    ],
)
def test_validate_tools_accepts(tools, tool_choice):
    validate_tools(tools, tool_choice)


def assistant(name: str, arguments: str) -> dict:
    call = {"id": "call_1", "type": "function", "function": {"name": name, "arguments": arguments}}
    return {"role": "assistant", "content": None, "tool_calls": [call]}


TOOL_RESULT = {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}


def test_tool_loop_detected():
    a1, a2 = (
        assistant("get_weather", '{"city": "Paris", "unit": "C"}'),
        assistant("get_weather", '{"unit":"C","city":"Paris"}'),
    )
    user = {"role": "user", "content": "weather?"}
    assert tool_loop_detected([user, a1, TOOL_RESULT, a2, TOOL_RESULT, a1, TOOL_RESULT])
    assert tool_loop_detected([user, a1, a2, a1])
    assert not tool_loop_detected([user, a1, TOOL_RESULT, a2, TOOL_RESULT])  # only two
    assert tool_loop_detected([user, a1, TOOL_RESULT, a2, TOOL_RESULT], min_repeats=2)
    other = assistant("get_weather", '{"city": "Rome", "unit": "C"}')
    assert not tool_loop_detected([user, a1, TOOL_RESULT, other, TOOL_RESULT, a1, TOOL_RESULT])
    assert not tool_loop_detected([a1, TOOL_RESULT, a1, TOOL_RESULT, user, a1, TOOL_RESULT])
    assert not tool_loop_detected([a1, TOOL_RESULT, a1, TOOL_RESULT, a1, TOOL_RESULT, user])
    assert not tool_loop_detected([user, {"role": "assistant", "content": "hi"}, a1, a1])


def test_tool_loop_detected_on_protocol_messages():
    from openai_frontend.api.chat_protocol import ChatMessage

    messages = [ChatMessage(**m) for m in [assistant("now", "{}"), TOOL_RESULT] * 3]
    assert tool_loop_detected(messages)


def test_the_engine_knows_each_parser_trigger():
    """The engine's tool guards (backend.settings.model_settings.TOOL_CALL_TAGS) use the
    same opening text as the frontend's parser of the same name, built from those tags."""
    for name in tool_parser_names():
        assert TOOL_CALL_TAGS[name][0] == parser_of(name).tool_call_trigger, name


def test_a_parser_reads_the_tags_it_is_given():
    """The tags are the running model's (ModelInfo), not the parser's own."""
    parser = HermesToolParser(("<call>", "</call>"))
    assert parser.tool_call_trigger == "<call>"
    text = '<call>\n{"name": "now", "arguments": {}}\n</call>'
    content, calls = parser.parse(text, TOOLS)
    assert content is None and [(call.name, call.arguments) for call in calls] == [("now", "{}")]
    assert parser.parse(hermes("now", "{}"), TOOLS) == (hermes("now", "{}"), [])  # the default tags are text
    assert_stream_equals_parse(parser, text, chunkings(text))
    assert parser.call_format.render([("now", "{}")]) == text
