"""End to end: the frontend's /metrics under vLLM's names, with sane values after a few
requests, token counters equal to the usage the clients saw, and the engine's own figures
(Triton's metrics port, `stack.triton_metrics_url`) agreeing with the frontend's."""

from __future__ import annotations

import re
import time

import httpx
import pytest

pytestmark = pytest.mark.e2e

# ~150 tokens: several full KV blocks, so a repeat finds them in the prefix cache
LONG_PROMPT = "Inventory: " + ", ".join(f"crate {i} holds {i * 7 % 13} lamps" for i in range(24)) + ". Total:"
_SAMPLE = re.compile(r"^([a-zA-Z_:][\w:]*)(?:\{(.*)\})? (\S+)$", re.MULTILINE)
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def _page(url: str) -> str:
    return httpx.get(url, timeout=10).text


def _sum(text: str, name: str, **labels: str) -> float:
    """The sum of the samples of `name` whose labels include `labels` (0 if none)."""
    total = 0.0
    for sample, label_text, value in _SAMPLE.findall(text):
        if sample == name and labels.items() <= dict(_LABEL.findall(label_text or "")).items():
            total += float(value)
    return total


def _frontend(stack) -> str:
    return _page(stack.base_url.removesuffix("/v1") + "/metrics")


def _until(check, timeout: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def _idle(stack) -> bool:
    """Nothing in flight, on both sides (earlier tests may have left aborts finishing)."""
    engine = _page(stack.triton_metrics_url)
    running = _sum(_frontend(stack), "llm_frontend_requests_running")
    return _sum(engine, "llm_requests_in_flight") == 0 and _sum(engine, "llm_requests_running") == 0 and not running


def _exactly(n: int) -> dict:
    """n tokens, finishing by length: no EOS that the engine counts but never sends."""
    return {"max_tokens": n, "temperature": 0, "extra_body": {"min_tokens": n}}


def _requests(client, model) -> list:
    """Four requests (streaming and not, chat and completions); their usages."""
    usages = [client.completions.create(model=model, prompt=LONG_PROMPT, **_exactly(3)).usage for _ in range(2)]
    usages.append(client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}],
                                                 **_exactly(5)).usage)  # fmt: skip
    stream = client.completions.create(
        model=model, prompt="Once upon a time", stream=True, stream_options={"include_usage": True}, **_exactly(4)
    )
    usages.append([chunk.usage for chunk in stream if chunk.usage is not None][-1])
    return usages


def test_metrics_after_a_few_requests(stack, client, model):
    assert _until(lambda: _idle(stack))
    before, engine_before = _frontend(stack), _page(stack.triton_metrics_url)
    usages = _requests(client, model)
    generated = sum(u.completion_tokens for u in usages)
    # the model publishes its counters every 0.1 s
    engine_tokens = lambda: _sum(_page(stack.triton_metrics_url), "llm_generated_tokens_total")  # noqa: E731
    assert _until(lambda: engine_tokens() - _sum(engine_before, "llm_generated_tokens_total") == generated)
    assert _until(lambda: _idle(stack))
    after, engine = _frontend(stack), _page(stack.triton_metrics_url)

    def delta(name: str, **labels: str) -> float:
        return _sum(after, name, model_name=model, **labels) - _sum(before, name, model_name=model, **labels)

    # token counters: what the clients were told
    assert delta("vllm:prompt_tokens_total") == sum(u.prompt_tokens for u in usages)
    assert delta("vllm:generation_tokens_total") == generated == 3 + 3 + 5 + 4
    assert delta("vllm:prefix_cache_queries_total") == delta("vllm:prompt_tokens_total")
    cached = [u.prompt_tokens_details.cached_tokens for u in usages]
    assert cached[1] >= 128, "the repeated long prompt hits the prefix cache"
    assert delta("vllm:prefix_cache_hits_total") == sum(cached)
    assert delta("vllm:request_success_total", finished_reason="length") == 4
    assert delta("llm_tenant_requests_total") == 4
    # latencies: every request observed once, inter-token gaps once per gap
    for name in ("time_to_first_token", "e2e_request_latency", "request_queue_time"):
        assert delta(f"vllm:{name}_seconds_count") == 4, name
    assert delta("vllm:inter_token_latency_seconds_count") == generated - 4
    ttft, e2e = delta("vllm:time_to_first_token_seconds_sum"), delta("vllm:e2e_request_latency_seconds_sum")
    queue = delta("vllm:request_queue_time_seconds_sum")
    assert 0 <= queue < ttft < e2e < 600
    assert 0 < delta("vllm:inter_token_latency_seconds_sum") < e2e
    # the engine's figures, as the frontend shows them and as Triton does
    used, total = _sum(engine, "llm_kv_blocks_used"), _sum(engine, "llm_kv_blocks_total")
    assert _sum(after, "vllm:kv_cache_usage_perc", model_name=model) == pytest.approx(used / total)
    assert _sum(after, "vllm:num_requests_running", model_name=model) == 0 == _sum(engine, "llm_requests_running")
    assert _sum(after, "vllm:num_requests_waiting", model_name=model) == 0
    assert _sum(after, "llm_frontend_engine_metrics_up", model_name=model) == 1


def test_running_request_shows_on_both_sides_then_leaves(stack, model):
    """A live stream: the engine's gauges (via the frontend) and the frontend's own count
    agree while it runs, and all fall back once the client leaves."""
    assert _until(lambda: _idle(stack))
    aborts = _sum(_frontend(stack), "vllm:request_success_total", finished_reason="abort")
    body = {"model": model, "prompt": LONG_PROMPT, "max_tokens": 3000, "min_tokens": 3000, "stream": True,
            "repetition_detection": {"min_count": 0}}  # nothing ends it early, a loop included  # fmt: skip
    with httpx.stream("POST", f"{stack.base_url}/completions", json=body, timeout=120) as response:
        lines = response.iter_lines()
        next(line for line in lines if line.startswith("data: "))

        def busy() -> bool:
            text = _frontend(stack)
            return (
                _sum(text, "vllm:num_requests_running", model_name=model) == 1
                and _sum(text, "llm_frontend_requests_running") == 1
                and _sum(_page(stack.triton_metrics_url), "llm_requests_running") == 1
            )

        assert _until(busy)
        assert _sum(_frontend(stack), "vllm:kv_cache_usage_perc", model_name=model) > 0
    assert _until(lambda: _idle(stack))
    text = _frontend(stack)
    assert _sum(text, "vllm:num_requests_running", model_name=model) == 0
    assert _sum(text, "vllm:request_success_total", finished_reason="abort") == aborts + 1
