"""/metrics in-process: the text format, histograms, the engine's gauges, and what one
request adds (the app on a fake engine); the engine's queue time on the real model."""

from __future__ import annotations

import asyncio
import re
import time

import httpx
import pytest

from backend.contract import FinalEvent, FinishGuard, FinishReason, GenerationRequest
from openai_frontend.app import Settings, create_app
from openai_frontend.operations.engine_metrics import parse_engine, read_engine
from openai_frontend.operations.metrics import Metrics
from openai_frontend.operations.prometheus import Counter, Histogram, token_buckets
from tests.helpers.fake_engine import FakeEngine


def _value(text: str, series: str) -> float | None:
    """A sample's value; `series` is the name with its labels, exactly as rendered."""
    match = re.search(rf"^{re.escape(series)} (\S+)$", text, re.MULTILINE)
    return float(match.group(1)) if match else None


# -- the format ------------------------------------------------------------------------


def test_histogram_renders_cumulative_buckets_sum_and_count():
    hist = Histogram("vllm:x_seconds", "X.", (0.1, 1.0), ("model_name",))
    hist.observe(0.05, "m")
    hist.observe(0.5, "m", times=3)  # one value standing for three intervals
    hist.observe(7.0, "m")
    text = "\n".join(hist.render())
    assert "# TYPE vllm:x_seconds histogram" in text
    assert _value(text, 'vllm:x_seconds_bucket{model_name="m",le="0.1"}') == 1
    assert _value(text, 'vllm:x_seconds_bucket{model_name="m",le="1.0"}') == 4
    assert _value(text, 'vllm:x_seconds_bucket{model_name="m",le="+Inf"}') == 5
    assert _value(text, 'vllm:x_seconds_count{model_name="m"}') == 5
    assert _value(text, 'vllm:x_seconds_sum{model_name="m"}') == pytest.approx(0.05 + 1.5 + 7.0)


def test_label_values_are_escaped():
    counter = Counter("llm_tenant_requests_total", "T.", ("tenant",))
    counter.inc('a"b\\c\nd')
    assert 'llm_tenant_requests_total{tenant="a\\"b\\\\c\\nd"} 1' in counter.render()


def test_token_buckets_are_1_2_5_up_to_the_context():
    assert token_buckets(1000) == (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000)
    assert token_buckets(8192)[-1] == 5000


# -- the engine's gauges -------------------------------------------------------------------

TRITON_PAGE = """\
# HELP nv_inference_count Number of inferences performed
nv_inference_count{model="llm",version="1"} 12
# HELP llm_kv_blocks_used KV cache blocks in use
# TYPE llm_kv_blocks_used gauge
llm_kv_blocks_used 5
llm_kv_blocks_total 20
llm_requests_running{} 2
llm_requests_waiting 1
llm_preemptions_total 3
llm_generated_tokens_total 41
llm_kv_blocks_used_other 99
llm_spec_decode_num_drafts_total 7
llm_spec_decode_num_draft_tokens_total 20
llm_spec_decode_num_accepted_tokens_total 9
llm_spec_decode_num_accepted_tokens_per_pos_total{position="0"} 6
llm_spec_decode_num_accepted_tokens_per_pos_total{position="1"} 3
"""


def test_engine_page_is_parsed_and_becomes_vllm_gauges():
    engine = parse_engine(TRITON_PAGE)
    assert engine == {
        "llm_kv_blocks_used": 5,
        "llm_kv_blocks_total": 20,
        "llm_requests_running": 2,
        "llm_requests_waiting": 1,
        "llm_preemptions_total": 3,
        "llm_generated_tokens_total": 41,
        "llm_spec_decode_num_drafts_total": 7,
        "llm_spec_decode_num_draft_tokens_total": 20,
        "llm_spec_decode_num_accepted_tokens_total": 9,
        'llm_spec_decode_num_accepted_tokens_per_pos_total{position="0"}': 6,
        'llm_spec_decode_num_accepted_tokens_per_pos_total{position="1"}': 3,
    }
    text = Metrics("smol").render(engine)
    assert _value(text, 'vllm:kv_cache_usage_perc{model_name="smol"}') == 0.25
    assert _value(text, 'vllm:gpu_cache_usage_perc{model_name="smol"}') == 0.25
    assert _value(text, 'vllm:num_requests_running{model_name="smol"}') == 2
    assert _value(text, 'vllm:num_requests_waiting{model_name="smol"}') == 1
    assert _value(text, 'vllm:num_preemptions_total{model_name="smol"}') == 3
    # the live token count and the block counts, as the playground's Engine tab draws them
    assert _value(text, 'llm_generated_tokens_total{model_name="smol"}') == 41
    assert _value(text, 'llm_kv_blocks_used{model_name="smol"}') == 5
    assert _value(text, 'llm_kv_blocks_total{model_name="smol"}') == 20
    assert _value(text, 'vllm:spec_decode_num_drafts_total{model_name="smol"}') == 7
    assert _value(text, 'vllm:spec_decode_num_draft_tokens_total{model_name="smol"}') == 20
    assert _value(text, 'vllm:spec_decode_num_accepted_tokens_total{model_name="smol"}') == 9
    per_pos = 'vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="smol",position="%d"}'
    assert [_value(text, per_pos % i) for i in range(3)] == [6, 3, None]
    assert _value(text, 'llm_frontend_engine_metrics_up{model_name="smol"}') == 1


def test_unreachable_engine_leaves_its_gauges_out_rather_than_zero():
    metrics = Metrics("smol", engine_url="http://127.0.0.1:9/metrics")  # nothing listens on port 9
    assert asyncio.run(read_engine(metrics.engine_url, timeout_s=1.0)) is None
    text = asyncio.run(metrics.scrape())
    assert _value(text, 'llm_frontend_engine_metrics_up{model_name="smol"}') == 0
    assert "vllm:num_requests_running" not in text and "vllm:kv_cache_usage_perc" not in text


LORA_PAGE = """\
llm_lora_max_loras 4
llm_lora_requests_running{lora_name="sql"} 2
llm_lora_requests_running{lora_name="chat"} 1
llm_lora_requests_running{lora_name="idle"} 0
llm_lora_requests_waiting{lora_name="sql"} 0
llm_lora_requests_waiting{lora_name="a \\"quoted\\" one"} 3
llm_lora_requests_waiting{lora_name="chat"} 1
llm_requests_running 3
"""


def test_the_engines_adapter_series_become_one_lora_requests_info_series():
    engine = parse_engine(LORA_PAGE)
    assert engine["llm_lora_max_loras"] == 4 and engine["llm_requests_running"] == 3
    assert engine['llm_lora_requests_running{lora_name="idle"}'] == 0  # kept apart by name
    before = time.time()
    text = Metrics("smol").render(engine)
    series = [line for line in text.splitlines() if line.startswith("vllm:lora_requests_info")]
    labels = 'max_lora="4",waiting_lora_adapters="a \\"quoted\\" one,chat",running_lora_adapters="chat,sql"'
    assert len(series) == 1 and series[0].startswith(f"vllm:lora_requests_info{{{labels}}} "), series
    assert before <= float(series[0].rsplit(" ", 1)[1]) <= time.time()  # the scrape's time
    assert "# TYPE vllm:lora_requests_info gauge" in text


def test_no_lora_requests_info_when_the_engine_serves_no_adapters():
    for page in ("llm_lora_max_loras 0\nllm_requests_running 1\n", "llm_requests_running 1\n"):
        assert "vllm:lora_requests_info" not in Metrics("smol").render(parse_engine(page))


# -- what a generation adds ----------------------------------------------------------------


def test_a_finished_generation_feeds_counters_and_latency_histograms():
    metrics = Metrics("smol")
    metrics.describe(8192)  # the token series' buckets reach the model's context
    final = FinalEvent(
        FinishReason.LENGTH, FinishGuard.MAX_TOKENS, 40, 11, num_cached_tokens=32,
        time_to_first_token_s=0.3, decode_time_s=1.0, queue_time_s=0.1,
    )  # fmt: skip
    metrics.finished(final, e2e_s=1.4, tenant="acme")
    metrics.aborted()
    text = metrics.render()
    m = '{model_name="smol"}'
    assert _value(text, f"vllm:prompt_tokens_total{m}") == 40
    assert _value(text, f"vllm:generation_tokens_total{m}") == 11
    assert _value(text, f"vllm:prefix_cache_queries_total{m}") == 40
    assert _value(text, f"vllm:prefix_cache_hits_total{m}") == 32
    assert _value(text, 'vllm:request_success_total{model_name="smol",finished_reason="length"}') == 1
    assert _value(text, 'vllm:request_success_total{model_name="smol",finished_reason="abort"}') == 1
    assert _value(text, 'llm_tenant_generation_tokens_total{model_name="smol",tenant="acme"}') == 11
    assert _value(text, f"vllm:time_to_first_token_seconds_sum{m}") == pytest.approx(0.3)
    # 11 tokens: 10 intervals, whose latencies add up to the decode time
    assert _value(text, f"vllm:inter_token_latency_seconds_count{m}") == 10
    assert _value(text, f"vllm:inter_token_latency_seconds_sum{m}") == pytest.approx(1.0)
    assert _value(text, f"vllm:time_per_output_token_seconds_count{m}") == 10
    assert _value(text, f"vllm:request_time_per_output_token_seconds_count{m}") == 1
    assert _value(text, f"vllm:e2e_request_latency_seconds_sum{m}") == pytest.approx(1.4)
    assert _value(text, f"vllm:request_queue_time_seconds_sum{m}") == pytest.approx(0.1)
    assert _value(text, f"vllm:request_prefill_time_seconds_sum{m}") == pytest.approx(0.2)
    assert _value(text, f"vllm:request_generation_tokens_count{m}") == 1
    # the older series stay
    assert _value(text, 'llm_frontend_requests_finished_total{reason="abort"}') == 1
    assert _value(text, "llm_frontend_completion_tokens_total") == 11


def _post_then_scrape(tokenization, engine: FakeEngine, body: dict) -> tuple[dict, str]:
    app = create_app(Settings("unused", "smol"), tokenization=tokenization)
    app.state.serving.engine = engine

    async def run():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
            response = await client.post("/v1/completions", json=body)
            return response.json(), (await client.get("/metrics")).text

    return asyncio.run(run())


def test_engine_timings_are_used_when_the_final_carries_them(tokenization):
    tokens = tokenization.tokenizer.encode(" one two three four five six", add_special_tokens=False)
    timings = {"time_to_first_token_s": 0.25, "decode_time_s": 0.5, "queue_time_s": 0.05}
    engine = FakeEngine(tokens, final=timings, delay_s=0.01)  # packs of two
    body, text = _post_then_scrape(tokenization, engine, {"prompt": "a b c", "max_tokens": 9})
    m = '{model_name="smol"}'
    assert _value(text, f"vllm:generation_tokens_total{m}") == body["usage"]["completion_tokens"] == len(tokens)
    assert _value(text, f"vllm:prompt_tokens_total{m}") == body["usage"]["prompt_tokens"]
    assert _value(text, f"vllm:time_to_first_token_seconds_sum{m}") == pytest.approx(0.25)
    assert _value(text, f"vllm:inter_token_latency_seconds_sum{m}") == pytest.approx(0.5)
    assert _value(text, f"vllm:request_queue_time_seconds_sum{m}") == pytest.approx(0.05)
    assert _value(text, 'llm_tenant_requests_total{model_name="smol",tenant=""}') == 1
    assert _value(text, 'llm_frontend_requests_total{endpoint="completions"}') == 1
    assert _value(text, f"vllm:e2e_request_latency_seconds_count{m}") == 1
    assert _value(text, f"llm_frontend_engine_metrics_up{m}") == 0  # no Triton here


def test_a_stream_cut_by_a_stop_string_is_timed_by_the_frontend(tokenization):
    tokens = tokenization.tokenizer.encode(" one two three four five six", add_special_tokens=False)
    engine = FakeEngine(tokens, delay_s=0.01)  # packs of two; its final carries no timings
    body, text = _post_then_scrape(tokenization, engine, {"prompt": "a b c", "max_tokens": 9, "stop": [" four"]})
    m = '{model_name="smol"}'
    assert body["choices"][0]["finish_reason"] == "stop"
    assert _value(text, f"vllm:generation_tokens_total{m}") == body["usage"]["completion_tokens"]
    ttft = _value(text, f"vllm:time_to_first_token_seconds_sum{m}")
    e2e = _value(text, f"vllm:e2e_request_latency_seconds_sum{m}")
    assert 0.005 < ttft < e2e  # the first pack came after one 10 ms sleep
    assert _value(text, f"vllm:request_queue_time_seconds_count{m}") is None  # only the engine knows it


# -- the engine's side --------------------------------------------------------------------


def test_engine_reports_queue_time_and_running_waiting():
    """With one sequence at a time, the second request queues for the whole first one."""
    from backend.contract import SamplingParams
    from backend.core.engine import LLMEngine
    from backend.runner.convert import ensure_default_model
    from backend.settings.engine import EngineConfig

    engine = LLMEngine(EngineConfig(model_path=str(ensure_default_model()), max_num_seqs=1))
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    arrivals = {}
    for rid in ("a", "b"):
        engine.add_request(rid, GenerationRequest([1, 2, 3, 4, 5], params))
        arrivals[rid] = engine.scheduler.requests[rid].arrival_time
    finals = {}
    engine.step()
    assert (engine.num_running(), engine.num_waiting()) == (1, 1)
    while engine.has_unfinished_requests():
        finals.update({out.request_id: out.final for out in engine.step() if out.final is not None})
    assert (engine.num_running(), engine.num_waiting()) == (0, 0)
    first, second = finals["a"], finals["b"]
    assert 0 <= first.queue_time_s < first.time_to_first_token_s
    # "b" arrived a few microseconds after "a"; it waited from then until "a" had finished.
    arrived_later_s = arrivals["b"] - arrivals["a"]
    assert second.queue_time_s >= first.time_to_first_token_s + first.decode_time_s - arrived_later_s
    assert second.queue_time_s < second.time_to_first_token_s
