"""Reasoning and guards end to end: a reasoning variant of the default model (its
`<think>` markers added as tokens, tests/helpers/thinking_model.py) behind its own tritonserver
and frontend, with --dump on; and the default model's loop and deadline guards on the
session stack.
"""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest

from launcher import Stack

pytestmark = pytest.mark.e2e

QUESTION = [{"role": "user", "content": "Why is the sky blue? Think first."}]


@pytest.fixture(scope="module")
def dump_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("dump")


@pytest.fixture(scope="module")
def thinking_stack(thinking_model_path, dump_dir):
    with Stack(thinking_model_path, env={"DUMP_DIR": str(dump_dir), "KV_CACHE_MB": "256"}) as running:
        yield running


@pytest.fixture(scope="module")
def thinker(thinking_stack):
    return openai.OpenAI(base_url=thinking_stack.base_url, api_key="x", max_retries=0, timeout=300)


def _chat(client, **kwargs):
    model = client.models.list().data[0].id
    return client.chat.completions.with_raw_response.create(model=model, messages=QUESTION, **kwargs)


@pytest.mark.parametrize("budget", [5, 12])
def test_a_budget_splits_reasoning_from_content_and_counts_it(thinker, budget):
    raw = _chat(thinker, temperature=0, max_tokens=40, extra_body={"thinking_budget": budget})
    reply = raw.parse()
    message = reply.choices[0].message
    reasoning = message.model_extra.get("reasoning_content")
    assert reasoning and message.content  # the thinking, then the answer
    assert "<think>" not in message.content and "</think>" not in message.content
    assert reply.usage.completion_tokens_details.reasoning_tokens == budget + 1  # the marker is one token
    assert raw.headers["x-thinking-guard"] == "thinking_budget"
    assert reply.choices[0].model_extra["thinking_guard"] == "thinking_budget"


def test_streamed_split_equals_the_whole_one(thinker):
    kwargs = {"temperature": 0.7, "seed": 3, "max_tokens": 40, "extra_body": {"thinking_budget": 9}}
    whole = _chat(thinker, **kwargs).parse().choices[0].message
    model = thinker.models.list().data[0].id
    reasoning, content, guards = "", "", []
    for chunk in thinker.chat.completions.create(model=model, messages=QUESTION, stream=True, **kwargs):
        if chunk.choices:
            delta = chunk.choices[0].delta
            reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
            content += delta.content or ""
            guards.append((chunk.choices[0].model_extra or {}).get("thinking_guard"))
    assert reasoning == whole.model_extra["reasoning_content"] and content == whole.content
    assert guards[-1] == "thinking_budget" and not any(guards[:-1])  # on the finish chunk only


def test_thinking_off_gives_no_reasoning(thinker):
    reply = _chat(thinker, temperature=0, max_tokens=12, extra_body={"enable_thinking": False}).parse()
    assert reply.choices[0].message.model_extra.get("reasoning_content") is None
    assert reply.usage.completion_tokens_details.reasoning_tokens == 0


def test_a_dump_file_holds_body_tensors_final_event_and_response(thinker, dump_dir):
    raw = _chat(thinker, temperature=0, max_tokens=16, extra_body={"thinking_budget": 3})
    reply = raw.parse()
    record = json.loads((dump_dir / f"{reply.id}.json").read_text())
    assert record["request"]["max_tokens"] == 16 and record["request"]["thinking_budget"] == 3
    (tensors,) = record["tensors"]
    assert tensors["thinking_budget"] == [3] and tensors["max_tokens"] == [16] and tensors["prompt_tokens"]
    final = record["finals"]["0"]
    assert final["thinking_guard"] == "thinking_budget" and final["num_reasoning_tokens"] == 4
    assert final["finish_guard"] == raw.headers["x-finish-guard"]
    assert record["response"]["id"] == reply.id


# ---------------------------------------------------------------------------
# the default model's guards, on the session stack


LOOP = "1, 2, 3, 1, 2, 3, 1, 2, 3,"


def test_a_looping_completion_is_cut_by_the_content_loop_guard(client, model):
    raw = client.completions.with_raw_response.create(model=model, prompt=LOOP, max_tokens=200, temperature=0)
    reply = raw.parse()
    assert reply.choices[0].finish_reason == "length" and raw.headers["x-finish-guard"] == "content_loop"
    assert reply.choices[0].model_extra["finish_guard"] == "content_loop"
    assert reply.usage.completion_tokens < 100
    # a stream names its guard on the choice's finish chunk (its headers went out first)
    chunks = list(client.completions.create(model=model, prompt=LOOP, max_tokens=200, temperature=0, stream=True))
    (last,) = [chunk.choices[0] for chunk in chunks if chunk.choices and chunk.choices[0].finish_reason]
    assert last.finish_reason == "length" and last.model_extra["finish_guard"] == "content_loop"
    assert "".join(chunk.choices[0].text for chunk in chunks if chunk.choices) == reply.choices[0].text
    # per-request settings: a higher count lets the loop run longer before the cut
    longer = client.completions.create(
        model=model,
        prompt=LOOP,
        max_tokens=200,
        temperature=0,
        extra_body={"repetition_detection": {"min_count": 8}},
    )
    assert longer.usage.completion_tokens > reply.usage.completion_tokens
    off = client.completions.with_raw_response.create(
        model=model, prompt=LOOP, max_tokens=60, temperature=0, extra_body={"repetition_detection": {"min_count": 0}}
    )
    assert off.headers["x-finish-guard"] == "max_tokens"


def test_a_timeout_ends_a_long_generation_with_the_deadline_guard(client, model):
    started = time.monotonic()
    raw = client.completions.with_raw_response.create(
        model=model,
        prompt="Once upon a time",
        max_tokens=4000,
        temperature=0.8,
        extra_body={"timeout": 1.0, "ignore_eos": True},
    )
    elapsed = time.monotonic() - started
    reply = raw.parse()
    assert raw.headers["x-finish-guard"] == "deadline" and reply.choices[0].finish_reason == "length"
    assert 0 < reply.usage.completion_tokens < 4000
    assert elapsed < 3.0, elapsed  # 1 s, then a step; unbounded it would run for minutes


def test_bad_guard_settings_are_400_naming_the_field(stack, model):
    body = {"model": model, "prompt": "x", "repetition_detection": {"min_pattern_size": 9, "max_pattern_size": 2}}
    response = httpx.post(f"{stack.base_url}/completions", json=body, timeout=60)
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "repetition_detection.max_pattern_size"
    response = httpx.post(f"{stack.base_url}/completions", json={**body, "repetition_detection": {"bogus": 1}})
    assert response.status_code == 400


def test_the_responses_api_gives_a_reasoning_item_whole_and_streamed(thinker):
    """Responses: reasoning.effort turns thinking on; the thought is a reasoning item (its
    reasoning_text), counted in output_tokens_details, and streamed as reasoning_text deltas."""
    model = thinker.models.list().data[0].id
    kwargs = {"model": model, "input": QUESTION[0]["content"], "reasoning": {"effort": "low"}, "temperature": 0,
              "max_output_tokens": 48}  # fmt: skip
    whole = thinker.responses.create(**kwargs)
    reasoning = [item for item in whole.output if item.type == "reasoning"]
    assert reasoning and reasoning[0].content and reasoning[0].content[0].text
    assert whole.usage.output_tokens_details.reasoning_tokens > 0
    events = list(thinker.responses.create(**kwargs, stream=True))
    streamed = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert streamed == reasoning[0].content[0].text
    assert "<think>" not in whole.output_text


def test_anthropics_thinking_is_a_thinking_block(thinking_stack):
    import anthropic

    claude = anthropic.Anthropic(base_url=thinking_stack.base_url.removesuffix("/v1"), api_key="x", max_retries=0)
    model = openai.OpenAI(base_url=thinking_stack.base_url, api_key="x").models.list().data[0].id
    message = claude.messages.create(model=model, max_tokens=48, messages=QUESTION,
                                     thinking={"type": "enabled", "budget_tokens": 10})  # fmt: skip
    kinds = [block.type for block in message.content]
    assert kinds[0] == "thinking" and message.content[0].thinking
    assert "text" in kinds and "<think>" not in "".join(b.text for b in message.content if b.type == "text")


def test_the_playground_shows_reasoning_folded_apart_from_the_answer(browser, thinking_stack, dump_dir):
    from tests.helpers.browser import open_page, screenshot

    opened = open_page(browser, thinking_stack.frontend.url + "/")
    page = opened.page
    try:
        page.wait_for_selector("#model option", state="attached")
        page.fill("#max_tokens", "40")
        page.fill("#seed", "5")
        page.fill("#prompt", QUESTION[0]["content"])
        page.press("#prompt", "Enter")
        page.wait_for_selector(".message.assistant[data-finish]", timeout=120000)
        folded = page.locator(".message.assistant details.reasoning")
        assert folded.is_visible() and folded.get_attribute("open") is None
        shown = folded.locator("div").text_content()
        records = [json.loads(p.read_text()) for p in dump_dir.glob("*.json")]
        (record,) = [r for r in records if r["request"].get("seed") == 5 and r["request"].get("stream")]
        chunks = [json.loads(line[6:]) for line in record["response"].splitlines() if line.startswith("data: {")]
        deltas = [c["choices"][0]["delta"] for c in chunks if c.get("choices")]
        assert shown and shown == "".join(d.get("reasoning_content", "") for d in deltas)
        content = page.locator(".message.assistant .content").text_content()
        assert content == "".join(d.get("content", "") for d in deltas) and "<think>" not in content
        folded.locator("summary").click()
        screenshot(page, "chat-reasoning.png")
        assert opened.errors == []
    finally:
        opened.close()
