"""Chat streaming users against the OpenAI frontend.

    .venv/bin/locust -f loadtest/locustfile.py --host http://127.0.0.1:8000 \
        --headless -u 16 -r 4 -t 2m

Each user sends a streaming chat completion, reads the SSE stream to the end and
records, besides the request itself, two custom entries in locust's statistics:
"time_to_first_token" (ms until the first content delta) and "tokens_per_s" (the
stream's decode rate after its first token, reported in the response-time column;
higher is better there). Env: MODEL (served model name, default: the first of
/v1/models), MAX_TOKENS (default 128), API_KEY.
"""

from __future__ import annotations

import json
import os
import random
import time

from locust import HttpUser, between, events, task

TOPICS = [
    "the history of the bicycle",
    "how vaccines train the immune system",
    "why the ocean is salty",
    "a day in the life of a honeybee",
    "how to brew a good cup of tea",
    "the rules of chess for a beginner",
    "what makes a bridge stable",
    "the life cycle of a star",
]
STYLES = ["in three sentences", "as a short story", "for a ten-year-old", "as a bulleted list"]


def _record(environment, name: str, value: float, length: int = 0, exception=None) -> None:
    environment.events.request.fire(
        request_type="SSE", name=name, response_time=value, response_length=length, exception=exception, context={}
    )


class ChatStreamingUser(HttpUser):
    wait_time = between(0.5, 2.0)

    def on_start(self) -> None:
        self.max_tokens = int(os.environ.get("MAX_TOKENS", "128"))
        key = os.environ.get("API_KEY")
        self.headers = {"Authorization": f"Bearer {key}"} if key else {}
        self.model = os.environ.get("MODEL") or self._first_model()

    def _first_model(self) -> str:
        resp = self.client.get("/v1/models", headers=self.headers, name="/v1/models")
        return resp.json()["data"][0]["id"]

    @task
    def chat_stream(self) -> None:
        body = {
            "model": self.model,
            "messages": [
                {"role": "user", "content": f"Tell me about {random.choice(TOPICS)} {random.choice(STYLES)}."}
            ],
            "max_tokens": self.max_tokens,
            "temperature": 0.7,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        start = time.perf_counter()
        first = last = None
        tokens = 0
        with self.client.post(
            "/v1/chat/completions", json=body, headers=self.headers, stream=True, catch_response=True,
            name="/v1/chat/completions (stream)",
        ) as resp:  # fmt: skip
            if resp.status_code != 200:
                resp.failure(f"HTTP {resp.status_code}: {resp.text[:200]}")
                return
            for line in resp.iter_lines(decode_unicode=True):
                if not line or not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
                choices = chunk.get("choices") or []
                if choices and choices[0].get("delta", {}).get("content"):
                    last = time.perf_counter()
                    first = first or last
            resp.success()
        if first is None:
            _record(self.environment, "time_to_first_token", 0, exception=RuntimeError("no content streamed"))
            return
        _record(self.environment, "time_to_first_token", (first - start) * 1000)
        if tokens > 1 and last > first:
            _record(self.environment, "tokens_per_s", (tokens - 1) / (last - first), tokens)


@events.test_stop.add_listener
def _summary(environment, **_kw) -> None:
    stats = environment.stats
    ttft = stats.get("time_to_first_token", "SSE")
    rate = stats.get("tokens_per_s", "SSE")
    if ttft.num_requests:
        p95 = ttft.get_response_time_percentile(0.95)
        print(f"time to first token: median {ttft.median_response_time:.0f} ms, p95 {p95:.0f} ms")
    if rate.num_requests:
        print(f"per-stream decode rate: mean {rate.avg_response_time:.1f} tokens/s over {rate.num_requests} streams")
