"""The frontend's Prometheus metrics, written in the text exposition format by hand.

vLLM's names (`vllm:*`, each with a `model_name` label) where the meaning matches, so
dashboards built for vLLM work unchanged; `llm_tenant_*` count per tenant, `llm_lora_*`
per LoRA adapter; the older `llm_frontend_*` series stay. The engine's gauges (requests running and waiting, KV
cache usage, preemptions) are the model's own figures, read from Triton's metrics port
at each scrape: the frontend keeps no second count that could drift from the engine's.

All updates happen on the event loop's thread, so plain numbers need no lock.
"""

from __future__ import annotations

from collections import Counter as Tally
from dataclasses import dataclass, field
from typing import Any

from backend.contract import FinalEvent
from openai_frontend.operations.engine_metrics import engine_families, read_engine
from openai_frontend.operations.prometheus import Counter, Gauge, Histogram, token_buckets

PREFIX = "llm_frontend"

# vLLM's buckets (vllm/v1/metrics/loggers.py), so its dashboards' quantiles read the same.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
               20.0, 40.0, 80.0)  # fmt: skip
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                           120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip

# -- the frontend's metrics ----------------------------------------------------------


@dataclass(slots=True)
class _Latencies:
    """vLLM's per-request histograms, in seconds."""

    ttft: Histogram
    itl: Histogram
    tpot: Histogram
    request_tpot: Histogram
    e2e: Histogram
    queue: Histogram
    prefill: Histogram
    decode: Histogram

    @classmethod
    def make(cls) -> _Latencies:
        m = ("model_name",)
        latency = REQUEST_LATENCY_BUCKETS
        return cls(
            Histogram("vllm:time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS, m),
            Histogram("vllm:inter_token_latency_seconds", "Time between output tokens.", ITL_BUCKETS, m),
            Histogram("vllm:time_per_output_token_seconds", "Same as inter_token_latency (older name).",
                      ITL_BUCKETS, m),
            Histogram("vllm:request_time_per_output_token_seconds", "A request's mean time per output token.",
                      ITL_BUCKETS, m),
            Histogram("vllm:e2e_request_latency_seconds", "Request latency, as the frontend saw it.", latency, m),
            Histogram("vllm:request_queue_time_seconds", "Engine arrival to first scheduling.", latency, m),
            Histogram("vllm:request_prefill_time_seconds", "First scheduling to first token.", latency, m),
            Histogram("vllm:request_decode_time_seconds", "First token to last token.", latency, m),
        )  # fmt: skip

    def all(self) -> tuple[Histogram, ...]:
        return (self.ttft, self.itl, self.tpot, self.request_tpot, self.e2e, self.queue, self.prefill, self.decode)

    def observe(self, final: FinalEvent, e2e_s: float, model: str) -> None:
        self.e2e.observe(e2e_s, model)
        first_token_s, decode_s = final.time_to_first_token_s, final.decode_time_s
        if first_token_s is not None and final.num_output_tokens:
            self.ttft.observe(first_token_s, model)
            self.decode.observe(decode_s, model)
        if final.num_output_tokens > 1:
            gaps = final.num_output_tokens - 1
            mean = decode_s / gaps
            self.itl.observe(mean, model, times=gaps)
            self.tpot.observe(mean, model, times=gaps)
            self.request_tpot.observe(mean, model)
        if final.queue_time_s is not None:
            self.queue.observe(final.queue_time_s, model)
            if first_token_s is not None:
                self.prefill.observe(max(0.0, first_token_s - final.queue_time_s), model)


@dataclass(slots=True)
class _Tokens:
    """vLLM's token counters and histograms, and the per-tenant counters."""

    prompt: Counter
    generation: Counter
    cache_queries: Counter
    cache_hits: Counter
    success: Counter
    prompt_hist: Histogram
    generation_hist: Histogram
    tenant_requests: Counter
    tenant_prompt: Counter
    tenant_generation: Counter

    @classmethod
    def make(cls, max_model_len: int) -> _Tokens:
        m, t, sizes = ("model_name",), ("model_name", "tenant"), token_buckets(max_model_len)
        return cls(
            Counter("vllm:prompt_tokens_total", "Prompt tokens of finished requests.", m),
            Counter("vllm:generation_tokens_total", "Generated tokens of finished requests.", m),
            Counter("vllm:prefix_cache_queries_total", "Prompt tokens looked up in the prefix cache.", m),
            Counter("vllm:prefix_cache_hits_total", "Prompt tokens found in the prefix cache.", m),
            Counter("vllm:request_success_total", "Requests finished, by finish reason.", (*m, "finished_reason")),
            Histogram("vllm:request_prompt_tokens", "Prompt length of finished requests.", sizes, m),
            Histogram("vllm:request_generation_tokens", "Generated length of finished requests.", sizes, m),
            Counter("llm_tenant_requests_total", "Generation requests received, by tenant.", t),
            Counter("llm_tenant_prompt_tokens_total", "Prompt tokens of finished requests, by tenant.", t),
            Counter("llm_tenant_generation_tokens_total", "Generated tokens of finished requests, by tenant.", t),
        )  # fmt: skip

    def all(self) -> tuple[Counter | Histogram, ...]:
        return (self.prompt, self.generation, self.cache_queries, self.cache_hits, self.success,
                self.prompt_hist, self.generation_hist, self.tenant_requests, self.tenant_prompt,
                self.tenant_generation)  # fmt: skip

    def observe(self, final: FinalEvent, model: str, tenant: str) -> None:
        prompt, generated = final.num_prompt_tokens, final.num_output_tokens
        self.prompt.inc(model, amount=prompt)
        self.generation.inc(model, amount=generated)
        self.cache_queries.inc(model, amount=prompt)
        self.cache_hits.inc(model, amount=final.num_cached_tokens)
        self.success.inc(model, final.finish_reason.value)
        self.prompt_hist.observe(prompt, model)
        self.generation_hist.observe(generated, model)
        self.tenant_prompt.inc(model, tenant, amount=prompt)
        self.tenant_generation.inc(model, tenant, amount=generated)


@dataclass(slots=True)
class _LoraCounts:
    """Generations on a LoRA adapter, by its name; the base model's are not counted here."""

    requests: Counter
    generated: Counter

    @classmethod
    def make(cls) -> _LoraCounts:
        m = ("model_name", "lora_name")
        return cls(
            Counter("llm_lora_requests_total", "Generations ended on a LoRA adapter, by finish reason.",
                    (*m, "finished_reason")),
            Counter("llm_lora_generated_tokens_total", "Tokens generated on a LoRA adapter.", m),
        )  # fmt: skip

    def all(self) -> tuple[Counter, ...]:
        return (self.requests, self.generated)

    def observe(self, model: str, lora: str, reason: str, generated: int = 0) -> None:
        if lora:
            self.requests.inc(model, lora, reason)
            self.generated.inc(model, lora, amount=generated)


@dataclass(slots=True)
class Metrics:
    """What /metrics shows. Serving calls `received` per request, and per generation
    (one per choice) `finished` or `aborted`; `running` counts generations in flight.
    `lora`: the adapter a generation ran on ("": the base model). The token series wait
    for the model's context length (`describe`: their buckets
    reach it), which the frontend learns from the running model before any request."""

    model_name: str = ""
    engine_url: str | None = None  # Triton's metrics endpoint, for the engine's gauges
    router: Any = None  # generation/replicas.Replicas, when several instances serve: theirs instead
    requests: Tally[str] = field(default_factory=Tally)  # by endpoint
    errors: Tally[int] = field(default_factory=Tally)  # by HTTP status
    finished_reasons: Tally[str] = field(default_factory=Tally)  # by finish_reason ("abort": client left)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_prompt_tokens: int = 0
    running: int = 0
    latencies: _Latencies = field(default_factory=_Latencies.make)
    tokens: _Tokens | None = None
    lora: _LoraCounts = field(default_factory=_LoraCounts.make)

    def describe(self, max_model_len: int) -> None:
        if self.tokens is None:
            self.tokens = _Tokens.make(max_model_len)

    def received(self, endpoint: str, tenant: str = "") -> None:
        self.requests[endpoint] += 1
        self.tokens.tenant_requests.inc(self.model_name, tenant)

    def finished(self, final: FinalEvent, e2e_s: float, tenant: str = "", lora: str = "") -> None:
        """A generation that ended with its final event; `e2e_s`: as the frontend saw it."""
        self.finished_reasons[final.finish_reason.value] += 1
        self.prompt_tokens += final.num_prompt_tokens
        self.completion_tokens += final.num_output_tokens
        self.cached_prompt_tokens += final.num_cached_tokens
        self.tokens.observe(final, self.model_name, tenant)
        self.latencies.observe(final, e2e_s, self.model_name)
        self.lora.observe(self.model_name, lora, final.finish_reason.value, final.num_output_tokens)

    def aborted(self, lora: str = "") -> None:
        """A generation the client left before its end (no final event: no token counts)."""
        self.finished_reasons["abort"] += 1
        self.tokens.success.inc(self.model_name, "abort")
        self.lora.observe(self.model_name, lora, "abort")

    async def scrape(self) -> str:
        """The page, with the engine's gauges as of now (the instances' summed, and the
        router's own series, when several serve)."""
        if self.router is None:
            return self.render(await read_engine(self.engine_url))
        return self.render(await self.router.engine_figures(), self.router.families())

    def render(self, engine: dict[str, float] | None = None, router: list | tuple = ()) -> str:
        lines = self._legacy_lines()
        tokens = self.tokens.all() if self.tokens is not None else ()
        families = (*tokens, *self.latencies.all(), *self.lora.all(), *engine_families(engine, self.model_name),
                    *router)  # fmt: skip
        for family in families:
            lines += family.render()
        return "\n".join(lines) + "\n"

    def _legacy_lines(self) -> list[str]:
        """The llm_frontend_* series that came before the vLLM names (tests and scripts read them)."""
        lines: list[str] = []
        for name, help_text, label, tally in (
            ("requests_total", "Generation requests received.", "endpoint", self.requests),
            ("request_errors_total", "Requests answered with an error.", "status", self.errors),
            ("requests_finished_total", "Generations finished, by finish_reason.", "reason", self.finished_reasons),
        ):
            family = Counter(f"{PREFIX}_{name}", help_text, (label,))
            for key, value in tally.items():
                family.inc(str(key), amount=value)
            lines += family.render()
        for name, value, help_text, kind in (
            ("prompt_tokens_total", self.prompt_tokens, "Prompt tokens of finished generations.", Counter),
            ("completion_tokens_total", self.completion_tokens, "Tokens generated.", Counter),
            ("cached_prompt_tokens_total", self.cached_prompt_tokens, "Prompt tokens from the prefix cache.", Counter),
            ("requests_running", self.running, "Generations in flight.", Gauge),
        ):
            family = kind(f"{PREFIX}_{name}", help_text)
            family.inc(amount=value)
            lines += family.render()
        return lines
