"""The engine's own figures on Triton's metrics port (llm_kv_blocks_used, llm_requests_running, ...).

The frontend's /metrics reads them from there (vllm:num_requests_running/waiting,
vllm:kv_cache_usage_perc), so the two processes never keep two counts. Each update is
a round trip to the server: they are batched, at most every `every_s`, and a gauge is
set only when its value changed. `make_metric(name, description, kind, labels)` builds
one metric ("gauge" or "counter", with its labels) with `set` / `increment`; model.py
passes Triton's. Speculative decoding's counters (llm_spec_decode_*, vLLM's
spec_decode_* on the frontend) go out the same way, one series per draft position, and
LoRA's: llm_lora_max_loras, and llm_lora_requests_running / _waiting{lora_name}, one
series per adapter name seen (the frontend's vllm:lora_requests_info is made of them).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from backend.serving.engine_thread import EngineSnapshot

MakeMetric = Callable[..., Any]  # (name, description, kind, labels: dict[str, str] | None = None)

_GAUGES = (
    ("llm_kv_blocks_used", "KV cache blocks in use"),
    ("llm_kv_blocks_total", "KV cache blocks in the pool"),
    ("llm_requests_in_flight", "requests awaiting their final response"),
    ("llm_requests_running", "requests in the engine's batch"),
    ("llm_requests_waiting", "requests queued for the batch"),
)
_SPEC_COUNTERS = (
    ("llm_spec_decode_num_drafts_total", "verify steps of a sequence that drafted", "num_drafts"),
    ("llm_spec_decode_num_draft_tokens_total", "draft tokens verified", "num_draft_tokens"),
    ("llm_spec_decode_num_accepted_tokens_total", "draft tokens accepted", "num_accepted_tokens"),
)
SPEC_PER_POS = "llm_spec_decode_num_accepted_tokens_per_pos_total"


class _Counter:
    """A total the snapshot keeps, published as the increments since the last publish."""

    def __init__(self, metric: Any):
        self.metric, self.published = metric, 0

    def publish(self, total: int) -> None:
        if total > self.published:
            self.metric.increment(total - self.published)
            self.published = total


class Gauges:
    def __init__(self, make_metric: MakeMetric, every_s: float = 0.1):
        self._gauges = [make_metric(name, help_text, "gauge") for name, help_text in _GAUGES]
        self._make_metric = make_metric
        self._preemptions = _Counter(
            make_metric("llm_preemptions_total", "sequences preempted (recomputed later)", "counter")
        )
        self._spec = [(_Counter(make_metric(name, text, "counter")), attr) for name, text, attr in _SPEC_COUNTERS]
        self._spec_per_pos: list[_Counter] = []  # made at the first publish: one per draft position
        self._max_loras = make_metric("llm_lora_max_loras", "adapters one step may use (MAX_LORAS)", "gauge")
        self._lora: dict[str, tuple[Any, Any]] = {}  # adapter name -> its running and waiting gauges
        self._lora_published: dict[str, tuple[int, int]] = {}
        self._max_loras_published: int | None = None
        self._responses = make_metric("llm_responses_total", "responses sent", "counter")
        self._tokens = make_metric("llm_generated_tokens_total", "generated tokens sent", "counter")
        self._every_s = every_s
        self._published: tuple[int, ...] | None = None
        self._pending_responses = 0
        self._pending_tokens = 0
        self._next = 0.0

    def count(self, tokens: int) -> None:
        """One response sent, carrying `tokens` generated tokens."""
        self._pending_responses += 1
        self._pending_tokens += tokens

    def publish(self, snapshot: EngineSnapshot, in_flight: int, now: bool = False) -> None:
        """At most every `every_s`, unless `now`."""
        clock = time.monotonic()
        if clock < self._next and not now:
            return
        self._next = clock + self._every_s
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
        self._preemptions.publish(snapshot.num_preemptions)
        self._publish_spec(snapshot)
        self._publish_lora(snapshot)
        if self._pending_responses:
            self._responses.increment(self._pending_responses)
            self._tokens.increment(self._pending_tokens)
            self._pending_responses = self._pending_tokens = 0

    def _publish_spec(self, snapshot: EngineSnapshot) -> None:
        stats = snapshot.spec
        for counter, attr in self._spec:
            counter.publish(getattr(stats, attr))
        while len(self._spec_per_pos) < len(stats.accepted_per_pos):
            position = str(len(self._spec_per_pos))
            text = "draft tokens accepted at this position of their draft"
            metric = self._make_metric(SPEC_PER_POS, text, "counter", {"position": position})
            self._spec_per_pos.append(_Counter(metric))
        for counter, total in zip(self._spec_per_pos, stats.accepted_per_pos, strict=True):
            counter.publish(total)

    def _publish_lora(self, snapshot: EngineSnapshot) -> None:
        if self._max_loras_published != snapshot.max_loras:
            self._max_loras.set(snapshot.max_loras)
            self._max_loras_published = snapshot.max_loras
        for name, counts in snapshot.lora_requests.items():
            if self._lora_published.get(name) == counts:
                continue
            if name not in self._lora:
                labels = {"lora_name": name}
                self._lora[name] = tuple(
                    self._make_metric(
                        f"llm_lora_requests_{state}", f"sequences {state} with this adapter", "gauge", labels
                    )
                    for state in ("running", "waiting")
                )
            for gauge, value in zip(self._lora[name], counts, strict=True):
                gauge.set(value)
            self._lora_published[name] = counts
