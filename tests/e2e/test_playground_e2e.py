"""The playground page's Chat tab in headless Chromium against the real stack: streamed
answers, keyboard send, stop, the settings as the server's --dump record saw them,
structured output and tool calls; screenshots of both tabs into build/ui/."""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import jsonschema
import pytest

from launcher import Stack
from tests.helpers.browser import PHONE, open_page, screenshot

pytestmark = pytest.mark.e2e

ANSWER = ".message.assistant:last-child"
FINISHED = f"{ANSWER}[data-finish]"
# Each render of the last answer's text, as the page makes it (streaming: many, growing).
WATCH_RENDERS = """() => {
  window.renders = [];
  new MutationObserver(() => {
    const content = document.querySelector('.message.assistant:last-child .content');
    if (content) window.renders.push(content.textContent.length);
  }).observe(document.getElementById('messages'), {subtree: true, childList: true, characterData: true});
}"""


@pytest.fixture(scope="module")
def dump_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("playground-dump")


@pytest.fixture(scope="module")
def ui_stack(triton_only, model_path, dump_dir):
    with Stack(model_path, triton=triton_only, env={"DUMP_DIR": str(dump_dir)}) as running:
        yield running


@pytest.fixture
def chat(browser, ui_stack):
    opened = open_page(browser, ui_stack.frontend.url + "/")
    opened.page.wait_for_selector("#model option", state="attached")
    yield opened
    opened.close()


def _send(page, text: str, timeout_s: float = 120) -> dict[str, str]:
    page.fill("#prompt", text)
    page.press("#prompt", "Enter")
    page.wait_for_selector(FINISHED, timeout=timeout_s * 1000)
    answer = page.locator(ANSWER)
    return {
        "finish": answer.get_attribute("data-finish"),
        "content": answer.locator(".content").text_content(),
        "usage": answer.locator(".usage").inner_text(),
    }


def _dump_of(dump_dir: Path, text: str, timeout_s: float = 10) -> dict:
    """The --dump record of the request whose last message is `text`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for path in dump_dir.glob("*.json"):
            record = json.loads(path.read_text())
            if record["request"].get("messages", [{}])[-1].get("content") == text and record["response"]:
                return record
        time.sleep(0.1)
    raise AssertionError(f"no dump record for {text!r}")


def _streamed_content(sse: str) -> str:
    chunks = [json.loads(line[6:]) for line in sse.splitlines() if line.startswith("data: {")]
    return "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c.get("choices"))


def test_page_loads_clean_offline_with_screenshots(chat, ui_stack):
    page = chat.page
    assert page.title() == "LLM playground"
    assert page.locator("#model").input_value() == ui_stack.served_model_name
    _send(page, "Write one sentence about the sea.")
    screenshot(page, "chat.png")
    page.click("#tab-engine")
    page.wait_for_function("document.querySelector('[data-chart=tokens]').dataset.points >= 3", timeout=20000)
    screenshot(page, "engine.png")
    assert chat.errors == []
    origin = ui_stack.frontend.url + "/"
    assert [url for url in chat.requested if not url.startswith(origin)] == []  # nothing from the network


def test_phone_viewport_has_no_sideways_scroll(browser, ui_stack):
    opened = open_page(browser, ui_stack.frontend.url + "/", viewport=PHONE)
    try:
        page = opened.page
        page.wait_for_selector("#model option", state="attached")
        for tab in ("#tab-chat", "#tab-engine"):
            page.click(tab)
            page.wait_for_timeout(300)
            assert page.evaluate("document.documentElement.scrollWidth") <= PHONE["width"]
        page.click("#tab-chat")
        screenshot(page, "chat-phone.png")
        assert opened.errors == []
    finally:
        opened.close()


def test_an_answer_streams_and_matches_what_the_server_sent(chat, dump_dir):
    page = chat.page
    page.evaluate(WATCH_RENDERS)
    text = "Tell me three facts about owls."
    answer = _send(page, text)
    renders = page.evaluate("window.renders")
    assert answer["finish"] in ("stop", "length") and answer["content"]
    assert len(set(renders)) >= 3, f"the answer arrived in {len(set(renders))} renders: not streamed"
    record = _dump_of(dump_dir, text)
    assert record["request"]["stream"] is True
    assert answer["content"] == _streamed_content(record["response"])
    final = record["finals"]["0"]
    assert f"{final['num_prompt_tokens']} prompt" in answer["usage"]
    assert f"{final['num_output_tokens']} completion tokens" in answer["usage"]
    assert "first token" in answer["usage"] and "tokens/s" in answer["usage"]


def test_shift_enter_is_a_new_line_and_enter_sends(chat):
    page = chat.page
    page.click("#prompt")
    page.keyboard.type("first line")
    page.keyboard.press("Shift+Enter")
    page.keyboard.type("second line")
    assert page.input_value("#prompt") == "first line\nsecond line"
    assert page.locator(".message").count() == 0
    page.keyboard.press("Enter")
    page.wait_for_selector(FINISHED, timeout=120000)
    assert page.locator(".message.user .content").inner_text() == "first line\nsecond line"
    assert page.input_value("#prompt") == ""


def test_the_settings_reach_the_request(chat, dump_dir):
    page = chat.page
    page.fill("#system", "You answer in one short sentence.")
    settings = {"temperature": "0.7", "top_p": "0.9", "top_k": "20", "max_tokens": "9", "seed": "1234"}
    for field, value in settings.items():
        page.fill(f"#{field}", value)
    text = "What is the capital of France?"
    answer = _send(page, text)
    record = _dump_of(dump_dir, text)
    body = record["request"]
    assert body["messages"] == [
        {"role": "system", "content": "You answer in one short sentence."},
        {"role": "user", "content": text},
    ]
    assert (body["temperature"], body["top_p"], body["top_k"], body["max_tokens"], body["seed"]) == (
        0.7, 0.9, 20, 9, 1234
    )  # fmt: skip
    generated = record["finals"]["0"]["num_output_tokens"]
    assert generated <= 9 and f"{generated} completion tokens" in answer["usage"]
    curl = page.locator("#curl").text_content()
    assert curl.startswith("curl -N '") and "/v1/chat/completions'" in curl
    assert json.loads(curl.split("-d '", 1)[1].rstrip("'")) == body  # the curl command is the request sent
    # a second turn carries the conversation
    second = "And of Italy?"
    _send(page, second)
    turns = _dump_of(dump_dir, second)["request"]["messages"]
    assert [m["role"] for m in turns] == ["system", "user", "assistant", "user"]
    assert turns[2]["content"] == answer["content"]


def test_stop_cancels_the_request_in_the_engine(chat, ui_stack):
    page = chat.page
    page.fill("#max_tokens", "3000")
    page.fill("#prompt", "Write a very long story about a lighthouse keeper and a storm, in many chapters.")
    page.press("#prompt", "Enter")
    page.wait_for_function(f"document.querySelector('{ANSWER} .content')?.textContent.length > 20", timeout=60000)
    assert _engine_gauge(ui_stack, "llm_requests_in_flight") >= 1
    page.click("#stop")
    page.wait_for_selector(FINISHED, timeout=10000)
    assert page.locator(ANSWER).get_attribute("data-finish") == "stopped"
    deadline = time.monotonic() + 10
    while _engine_gauge(ui_stack, "llm_requests_in_flight") > 0:
        assert time.monotonic() < deadline, "the engine still holds the stopped request"
        time.sleep(0.1)
    assert page.is_enabled("#send") and not page.is_enabled("#stop")


def _engine_gauge(stack: Stack, name: str) -> float:
    """The model's own gauge on Triton's metrics port."""
    for line in httpx.get(stack.triton_metrics_url, timeout=5).text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} is not on Triton's metrics port")


PLACE = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 40}, "country": {"enum": ["France", "Japan", "Peru"]}},
    "required": ["city", "country"],
    "additionalProperties": False,
}


def test_the_json_schema_box_gives_an_answer_that_parses(chat, dump_dir):
    page = chat.page
    page.fill("#json_schema", "{not json")
    page.fill("#prompt", "x")
    page.press("#prompt", "Enter")
    assert "JSON schema: not valid JSON" in page.locator("#settings-error").inner_text()
    assert page.locator(".message").count() == 0  # nothing was sent
    page.fill("#json_schema", json.dumps(PLACE))
    page.fill("#temperature", "0")
    page.fill("#max_tokens", "120")
    text = "Name a city and its country, as JSON."
    answer = _send(page, text)
    assert page.locator("#settings-error").is_hidden()
    jsonschema.validate(json.loads(answer["content"]), PLACE)
    assert _dump_of(dump_dir, text)["request"]["response_format"]["json_schema"]["schema"] == PLACE


WEATHER = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]


def test_tool_calls_are_shown_as_calls(chat):
    page = chat.page
    page.fill("#tools", json.dumps(WEATHER))
    page.select_option("#tool_choice", "required")
    page.fill("#max_tokens", "80")
    answer = _send(page, "What is the weather in Lima?")
    assert answer["finish"] == "tool_calls"
    calls = page.locator(f"{ANSWER} .tool-call").all_inner_texts()
    assert calls
    for call in calls:  # one or more parallel calls, each `name(arguments)`
        name, _, arguments = call.partition("(")
        assert name == "get_weather" and "city" in json.loads(arguments.removesuffix(")"))
