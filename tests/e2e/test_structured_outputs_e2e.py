"""vLLM's structured outputs, strict tools and return_token_ids end to end: the real model
(SmolLM2) through Triton and the frontend, with the openai SDK (`extra_body`), sampling
at temperature 1 so that the grammar, not the model, keeps the answers in shape.

Uses the session-scoped `stack`, `client` and `model` fixtures (tests/conftest.py).
"""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest
from transformers import AutoTokenizer

pytestmark = pytest.mark.e2e

SAMPLES = 2  # per pattern and endpoint form (chat), plus one completion
ASK = [{"role": "user", "content": "Answer, please."}]

REGEXES = [
    r"[a-z]{3,8}",
    r"\d{3}-\d{4}",
    r"(red|green|blue) (car|bike|boat)",
    r"[A-Z][a-z]{1,6}, [A-Z]{2} \d{5}",
    r"(0|[1-9]\d{0,2})\.\d{2}",
]
CHOICES = [
    ["yes", "no"],
    ["Paris", "London", "New York", "Tōkyō"],
    ['say "hi"', "a|b", "(x)", "back\\slash", "1.5*"],
]
ARITHMETIC = r"""
root ::= expr
expr ::= term (("+" | "-") term){0,2}
term ::= factor ("*" factor)?
factor ::= num | "(" num ("+" | "-" | "*") num ")"
num ::= [0-9] | [1-9] [0-9]
"""
LIST = r"""
root ::= "[" item ("," " "? item){0,3} "]"
item ::= "\"" [a-z]{1,6} "\"" | "0" | [1-9] [0-9]{0,2}
"""


def _many(call, count: int = SAMPLES) -> list:
    with ThreadPoolExecutor(count) as pool:
        return list(pool.map(lambda _: call(), range(count)))


def _chat(client, model, **extra):
    return client.chat.completions.create(
        model=model, messages=ASK, max_tokens=24, temperature=1.0, extra_body=extra
    ).choices[0]


def _complete(client, model, prompt="The answer:", **extra):
    return client.completions.create(
        model=model, prompt=prompt, max_tokens=24, temperature=1.0, extra_body=extra
    ).choices[0]


@pytest.mark.parametrize("pattern", REGEXES)
def test_regex_answers_match_their_pattern(client, model, pattern):
    chats = _many(lambda: _chat(client, model, structured_outputs={"regex": pattern}))
    texts = [c.message.content for c in chats]
    texts.append(_complete(client, model, guided_regex=pattern).text)
    for text in texts:
        assert re.fullmatch(pattern, text), (pattern, text)


@pytest.mark.parametrize("choices", CHOICES)
def test_choice_answers_are_one_of_the_choices(client, model, choices):
    chats = _many(lambda: _chat(client, model, structured_outputs={"choice": choices}))
    texts = [c.message.content for c in chats]
    texts.append(_complete(client, model, guided_choice=choices).text)
    for text in texts:
        assert text in choices, (choices, text)


class _Parser:
    """A recursive-descent parser of ARITHMETIC's language: its value, or ValueError."""

    def __init__(self, text: str):
        self.text, self.at = text, 0

    def parse(self) -> int:
        value = self.expr(0)
        if self.at != len(self.text):
            raise ValueError(f"trailing text at {self.at}: {self.text!r}")
        return value

    def peek(self) -> str:
        return self.text[self.at : self.at + 1]

    def take(self, char: str) -> None:
        if self.peek() != char:
            raise ValueError(f"expected {char!r} at {self.at}: {self.text!r}")
        self.at += 1

    def expr(self, depth: int) -> int:
        value, more = self.term(depth), 0
        while self.peek() in ("+", "-") and self.peek():
            sign = 1 if self.text[self.at] == "+" else -1
            self.at += 1
            value += sign * self.term(depth)
            more += 1
        if more > 2:
            raise ValueError("more than three terms")
        return value

    def term(self, depth: int) -> int:
        value = self.factor(depth)
        if self.peek() == "*":
            self.at += 1
            value *= self.factor(depth)
        return value

    def factor(self, depth: int) -> int:
        if self.peek() == "(":
            if depth:
                raise ValueError("nested parentheses")
            self.take("(")
            left = self.num()
            op = self.peek()
            if op not in ("+", "-", "*"):
                raise ValueError(f"expected an operator at {self.at}")
            self.at += 1
            right = self.num()
            self.take(")")
            return left + right if op == "+" else left - right if op == "-" else left * right
        return self.num()

    def num(self) -> int:
        digits = re.match(r"0|[1-9][0-9]?", self.text[self.at :])
        if digits is None:
            raise ValueError(f"expected a number at {self.at}: {self.text!r}")
        self.at += len(digits.group())
        return int(digits.group())


def test_the_parser_checks_what_it_should():
    assert _Parser("1+(2*3)-4").parse() == 3
    for bad in ("", "1+", "(1)", "01", "1+2+3+4", "((1+2))", "1 + 2"):
        with pytest.raises(ValueError):
            _Parser(bad).parse()


def test_grammar_answers_parse(client, model):
    answers = [c.message.content for c in _many(lambda: _chat(client, model, guided_grammar=ARITHMETIC))]
    answers.append(_complete(client, model, "2+2=", structured_outputs={"grammar": ARITHMETIC}).text)
    for text in answers:
        _Parser(text).parse()


def test_list_grammar_answers_parse(client, model):
    for choice in _many(lambda: _chat(client, model, structured_outputs={"grammar": LIST})):
        text = choice.message.content
        item = r'("[a-z]{1,6}"|0|[1-9][0-9]{0,2})'  # a JSON number: no leading zeros
        assert re.fullmatch(rf"\[{item}(, ?{item}){{0,3}}\]", text), text
        assert isinstance(json.loads(text), list)


def test_json_forms_follow_the_schema(client, model):
    schema = {
        "type": "object",
        # "n" bounded by an enum: a free integer may run on in digits past max_tokens at temperature 1
        "properties": {"n": {"enum": [1, 2, 3]}, "ok": {"type": "boolean"}},
        "required": ["n", "ok"],
    }
    answers = [_chat(client, model, guided_json=schema).message.content]
    answers.append(_chat(client, model, structured_outputs={"json": schema}).message.content)
    for text in answers:
        jsonschema.validate(json.loads(text), schema)


def _refusal(call) -> dict:
    with pytest.raises(openai.BadRequestError) as caught:
        call()
    return caught.value.response.json()["error"]


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs.regex"),
        ({"guided_regex": "[z-a]"}, "guided_regex"),
        ({"structured_outputs": {"grammar": "root ::= nothing_defined"}}, "structured_outputs.grammar"),
        ({"guided_json": {"type": "no-such-type"}}, "guided_json"),
    ],
)
def test_a_form_that_cannot_compile_is_a_400_naming_its_field(client, model, extra, param):
    for call in (lambda: _chat(client, model, **extra), lambda: _complete(client, model, **extra)):
        error = _refusal(call)
        assert error["param"] == param, error
        assert error["message"], error


def test_two_forms_at_once_are_a_400_naming_both(client, model):
    error = _refusal(lambda: _chat(client, model, guided_regex="a", structured_outputs={"choice": ["a"]}))
    assert "guided_regex" in error["message"] and "structured_outputs.choice" in error["message"], error
    error = _refusal(
        lambda: client.chat.completions.create(
            model=model,
            messages=ASK,
            max_tokens=4,
            response_format={"type": "json_object"},
            extra_body={"guided_choice": ["a", "b"]},
        )  # fmt: skip
    )
    assert "response_format" in error["message"] and "guided_choice" in error["message"], error


# --- strict function tools --------------------------------------------------------

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 20},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "unit", "days"],
    "additionalProperties": False,
}
STRICT_TOOL = {
    "type": "function",
    "function": {"name": "get_weather", "description": "Weather forecast", "parameters": WEATHER, "strict": True},
}


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_a_forced_strict_tool_calls_arguments_follow_its_schema(client, model, tool_choice):
    """Already the case before strict was looked at: a forced call's arguments are
    constrained by the tool's schema (parsing/tools/grammar.py), strict or not."""

    def call():
        return client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Weather in Oslo?"}], tools=[STRICT_TOOL],
            tool_choice=tool_choice, parallel_tool_calls=False, temperature=1.0, max_tokens=120,
        ).choices[0]  # fmt: skip

    for choice in _many(call):
        assert choice.finish_reason == "tool_calls", choice
        (tool_call,) = choice.message.tool_calls
        assert tool_call.function.name == "get_weather"
        jsonschema.validate(json.loads(tool_call.function.arguments), WEATHER)


# --- return_token_ids ------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer(model_path):
    return AutoTokenizer.from_pretrained(str(model_path))


def test_return_token_ids_on_completions(client, model, tokenizer):
    response = client.completions.create(
        model=model, prompt="Once upon a time", max_tokens=12, temperature=1.0, n=2,
        extra_body={"return_token_ids": True},
    )  # fmt: skip
    for choice in response.choices:
        assert choice.prompt_token_ids == tokenizer("Once upon a time")["input_ids"]
        assert choice.token_ids and tokenizer.decode(choice.token_ids) == choice.text
        assert len(choice.token_ids) <= 12
    assert response.usage.completion_tokens >= sum(len(c.token_ids) for c in response.choices)


def test_return_token_ids_on_chat_and_streams(client, model, tokenizer):
    messages = [{"role": "user", "content": "Name a colour."}]
    expected_prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    expected_prompt = tokenizer.encode(expected_prompt, add_special_tokens=False)
    response = client.chat.completions.create(
        model=model, messages=messages, max_tokens=12, temperature=0, extra_body={"return_token_ids": True}
    )
    assert response.prompt_token_ids == expected_prompt
    choice = response.choices[0]
    assert tokenizer.decode(choice.token_ids) == choice.message.content
    stream = client.chat.completions.create(
        model=model, messages=messages, max_tokens=12, temperature=0, stream=True,
        extra_body={"return_token_ids": True},
    )  # fmt: skip
    chunks = list(stream)
    assert chunks[0].prompt_token_ids == expected_prompt
    streamed = [t for chunk in chunks for c in chunk.choices for t in (getattr(c, "token_ids", None) or [])]
    text = "".join(c.delta.content or "" for chunk in chunks for c in chunk.choices)
    assert streamed == choice.token_ids and text == choice.message.content  # greedy: the same answer
    completion = client.completions.create(
        model=model, prompt="Hello", max_tokens=8, temperature=0, stream=True, extra_body={"return_token_ids": True}
    )
    pieces = [c for chunk in completion for c in chunk.choices]
    assert pieces[0].prompt_token_ids == tokenizer("Hello")["input_ids"]
    assert tokenizer.decode([t for c in pieces for t in (c.token_ids or [])]) == "".join(c.text for c in pieces)
