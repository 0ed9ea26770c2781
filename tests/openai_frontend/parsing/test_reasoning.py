"""ReasoningParser: the whole-text split, and streaming that agrees with it for any chunking;
ChatReasoning: a chat output's split with the running model's markers."""

from __future__ import annotations

import asyncio
import random

import pytest

from backend.contract import FinalEvent, FinishGuard, FinishReason, ModelInfo
from openai_frontend.generation.deltas import Delta
from openai_frontend.parsing.chat_reasoning import ChatReasoning
from openai_frontend.parsing.reasoning import ReasoningParser

QWEN = ReasoningParser("<think>", "</think>")
PROMPT_OPENED = ReasoningParser("<think>", "</think>", starts_in_thinking=True)


@pytest.mark.parametrize(
    "parser, text, expected",
    [
        (QWEN, "<think>plan</think>\n\nanswer", ("plan", "answer")),
        (QWEN, "  \n<think>plan</think>answer", ("plan", "answer")),  # leading whitespace before the block
        (QWEN, "<think>still thinking", ("still thinking", None)),  # never closed: all reasoning
        (QWEN, "<think></think>answer", (None, "answer")),
        (QWEN, "<think>plan</think>\n\n", ("plan", None)),
        (QWEN, "plain answer", (None, "plain answer")),
        (QWEN, "  plain", (None, "  plain")),  # no block: whitespace is content
        (QWEN, "a <think>b</think> c", (None, "a <think>b</think> c")),  # a block only at the start
        (QWEN, "<think>a</think>b</think>c", ("a", "b</think>c")),  # one block only
        (QWEN, "<thin", (None, "<thin")),
        (QWEN, "", (None, None)),
        (PROMPT_OPENED, "plan</think>\nanswer", ("plan", "answer")),
        (PROMPT_OPENED, "<think>plan</think>answer", ("plan", "answer")),  # a repeated think_start is dropped
        (PROMPT_OPENED, "\nplan", ("\nplan", None)),
        (PROMPT_OPENED, "</think>answer", (None, "answer")),
        (PROMPT_OPENED, "", (None, None)),
        (ReasoningParser("", ""), "<think>x</think>y", (None, "<think>x</think>y")),  # no markers: pass through
        (ReasoningParser("", "", starts_in_thinking=True), "x</think>y", (None, "x</think>y")),
    ],
)
def test_split(parser, text, expected):
    assert parser.split(text) == expected


def test_markers_need_an_end_and_no_leading_whitespace():
    with pytest.raises(ValueError):
        ReasoningParser("<think>", "")
    with pytest.raises(ValueError):
        ReasoningParser(" <think>", "</think>")


def stream_pieces(parser: ReasoningParser, chunks: list[str]) -> tuple[str, str]:
    """Concatenated reasoning and content from feeding `chunks`, then finish()."""
    stream = parser.stream()
    reasoning, content = [], []
    for chunk in chunks:
        r, c = stream.feed(chunk)
        reasoning.append(r)
        content.append(c)
    r, c = stream.finish()
    return "".join(reasoning) + r, "".join(content) + c


def fixed_chunks(text: str, size: int) -> list[str]:
    return [text[i : i + size] for i in range(0, len(text), size)]


def random_chunks(text: str, rng: random.Random) -> list[str]:
    chunks, i = [], 0
    while i < len(text):
        size = rng.randint(0, 6)  # 0: an empty delta must be harmless too
        chunks.append(text[i : i + size])
        i += size
    return chunks


TEXTS = [
    "<think>plan</think>\n\nanswer",
    " \n <think>\nstep 1\nstep 2\n</think>\n\nThe answer is 42.",
    "<think>never closed <thi </th </think",
    "<think></think>answer",
    "<think>a</think>  \n ",
    "plain answer with </think> inside",
    "  <thin",
    "<<think>>x</think>y",
    "<think><</</t</think></think>x",
    "plan</think>answer",
    "\n\n",
    "",
    "<think>",
    "</think>",
]
PARSERS = [QWEN, PROMPT_OPENED, ReasoningParser("", ""), ReasoningParser("<|begin_think|>", "<|end_think|>")]


def expected_pieces(parser: ReasoningParser, text: str) -> tuple[str, str]:
    reasoning, content = parser.split(text)
    return reasoning or "", content or ""


@pytest.mark.parametrize("parser", PARSERS)
@pytest.mark.parametrize("text", TEXTS)
def test_stream_equals_split_for_fixed_chunk_sizes(parser, text):
    for size in (1, 2, 3, 5, max(len(text), 1)):
        assert stream_pieces(parser, fixed_chunks(text, size)) == expected_pieces(parser, text), size


@pytest.mark.parametrize("seed", range(20))
def test_stream_equals_split_for_random_chunkings(seed):
    rng = random.Random(seed)
    for parser in PARSERS:
        for text in TEXTS:
            assert stream_pieces(parser, random_chunks(text, rng)) == expected_pieces(parser, text)


@pytest.mark.parametrize("seed", range(30))
def test_stream_equals_split_on_random_marker_soup(seed):
    """Texts built from marker fragments and whitespace, where partial markers abound."""
    rng = random.Random(1000 + seed)
    pieces = ["<think>", "</think>", "<", "</", "<th", "</thi", "think>", " ", "\n", "x", "yz"]
    for _ in range(20):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 12)))
        for parser in PARSERS:
            want = expected_pieces(parser, text)
            for size in (1, 2, 3, 5):
                assert stream_pieces(parser, fixed_chunks(text, size)) == want, (text, size)
            assert stream_pieces(parser, random_chunks(text, rng)) == want, text


def test_stream_holds_back_a_split_marker_only_until_decided():
    stream = QWEN.stream()
    assert stream.feed("<th") == ("", "")  # could be think_start
    assert stream.feed("ink>pl") == ("pl", "")
    assert stream.feed("an</thi") == ("an", "")  # could be think_end
    assert stream.feed("nk>") == ("", "")
    assert stream.feed("\n\n") == ("", "")  # whitespace before the answer: held, then dropped
    assert stream.feed("Hi") == ("", "Hi")
    assert stream.feed(" </think>") == ("", " </think>")  # after the block, markers are text
    assert stream.finish() == ("", "")


def test_stream_gives_out_text_that_cannot_start_a_marker_at_once():
    stream = QWEN.stream()
    assert stream.feed("Hello") == ("", "Hello")
    stream = PROMPT_OPENED.stream()
    assert stream.feed("Let me see") == ("Let me see", "")
    assert stream.feed("</") == ("", "")
    assert stream.finish() == ("</", "")


# -- ChatReasoning: the running model's markers, the engine's word on where the output starts


def _chat_reasoning_stream(reasoning: ChatReasoning, texts: list[str], starts_in_thinking: bool | None):
    """(reasoning, content) of a streamed output whose first delta carries the engine's word."""
    final = FinalEvent(FinishReason.STOP, FinishGuard.EOS, 3, len(texts))

    async def deltas():
        for i, text in enumerate(texts):
            first, last = i == 0, i == len(texts) - 1
            yield Delta(text, final if last else None, starts_in_thinking=starts_in_thinking if first else None)

    async def run():
        pieces = [(d.reasoning, d.text) async for d in reasoning.stream(deltas())]
        return "".join(r for r, _ in pieces), "".join(c for _, c in pieces)

    return asyncio.run(run())


CHAT_THINKING = ModelInfo(8192, 49152, think_start="<think>", think_end="</think>")


def test_chat_reasoning_is_the_models_markers_or_none():
    reasoning = ChatReasoning.of(CHAT_THINKING)
    assert (reasoning.think_start, reasoning.think_end) == ("<think>", "</think>")
    assert ChatReasoning.of(ModelInfo(8192, 49152)) is None  # a model that does not reason


@pytest.mark.parametrize(
    ("starts_in_thinking", "thinking", "answer"),
    [(True, "plan", "answer"), (False, None, "plan</think>\nanswer"), (None, None, "plan</think>\nanswer")],
)
def test_chat_reasoning_split_follows_the_engine_on_where_the_output_starts(starts_in_thinking, thinking, answer):
    reasoning = ChatReasoning.of(CHAT_THINKING)
    assert reasoning.split(Delta("plan</think>\nanswer", starts_in_thinking=starts_in_thinking)) == (thinking, answer)
    # a block the output opens itself is found either way
    whole = Delta("<think>plan</think>answer", starts_in_thinking=starts_in_thinking)
    assert reasoning.split(whole) == ("plan", "answer")


@pytest.mark.parametrize("chunk", [1, 3, 100])
def test_chat_reasoning_stream_reads_the_first_delta(chunk):
    reasoning = ChatReasoning.of(CHAT_THINKING)
    text = "plan</think>\nanswer"
    texts = [text[i : i + chunk] for i in range(0, len(text), chunk)]
    assert _chat_reasoning_stream(reasoning, texts, True) == ("plan", "answer")
    assert _chat_reasoning_stream(reasoning, texts, None) == ("", text)
