"""The engine's own figures on Triton's metrics port (llm_kv_blocks_used, llm_requests_running, ...).

The frontend's /metrics reads them from there (vllm:num_requests_running/waiting,
vllm:kv_cache_usage_perc), so the two processes never keep two counts. Each update is
a round trip to the server: they are batched, at most every `every_s`, and a gauge is
set only when its value changed. `make_metric(name, description, kind)` builds one
metric ("gauge" or "counter") with `set` / `increment`; model.py passes Triton's.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from backend.serving.engine_thread import EngineSnapshot

MakeMetric = Callable[[str, str, str], Any]

_GAUGES = (
    ("llm_kv_blocks_used", "KV cache blocks in use"),
    ("llm_kv_blocks_total", "KV cache blocks in the pool"),
    ("llm_requests_in_flight", "requests awaiting their final response"),
    ("llm_requests_running", "requests in the engine's batch"),
    ("llm_requests_waiting", "requests queued for the batch"),
)


class Gauges:
    def __init__(self, make_metric: MakeMetric, every_s: float = 0.1):
        self._gauges = [make_metric(name, help_text, "gauge") for name, help_text in _GAUGES]
        self._preemptions = make_metric("llm_preemptions_total", "sequences preempted (recomputed later)", "counter")
        self._responses = make_metric("llm_responses_total", "responses sent", "counter")
        self._tokens = make_metric("llm_generated_tokens_total", "generated tokens sent", "counter")
        self._every_s = every_s
        self._published: tuple[int, ...] | None = None
        self._published_preemptions = 0
        self._pending_responses = 0
        self._pending_tokens = 0
        self._next = 0.0

    def count(self, tokens: int) -> None:
        """One response sent, carrying `tokens` generated tokens."""
        self._pending_responses += 1
        self._pending_tokens += tokens

    def publish(self, snapshot: EngineSnapshot, in_flight: int) -> None:
        now = time.monotonic()
        if now < self._next:
            return
        self._next = now + self._every_s
        state = (
            snapshot.kv_blocks_used,
            snapshot.kv_blocks_total,
            in_flight,
            snapshot.requests_running,
            snapshot.requests_waiting,
        )
        if state != self._published:
            for gauge, value in zip(self._gauges, state, strict=True):
                gauge.set(value)
            self._published = state
        if snapshot.num_preemptions > self._published_preemptions:
            self._preemptions.increment(snapshot.num_preemptions - self._published_preemptions)
            self._published_preemptions = snapshot.num_preemptions
        if self._pending_responses:
            self._responses.increment(self._pending_responses)
            self._tokens.increment(self._pending_tokens)
            self._pending_responses = self._pending_tokens = 0
