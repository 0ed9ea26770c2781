"""The engine's figures on the frontend's /metrics: read from the model's own series on
Triton's metrics port at each scrape (the frontend keeps no second count that could
drift from the engine's), shown under vLLM's names."""

from __future__ import annotations

import re

import httpx

from openai_frontend.operations.prometheus import Counter, Family, Gauge

# The model's series on Triton's metrics port that the engine gauges come from.
ENGINE_SERIES = (
    "llm_requests_running",
    "llm_requests_waiting",
    "llm_kv_blocks_used",
    "llm_kv_blocks_total",
    "llm_preemptions_total",
    "llm_spec_decode_num_drafts_total",
    "llm_spec_decode_num_draft_tokens_total",
    "llm_spec_decode_num_accepted_tokens_total",
)
# ... and the one with a series per draft position, kept apart as name{position="i"}
SPEC_PER_POS = "llm_spec_decode_num_accepted_tokens_per_pos_total"
_SAMPLE = re.compile(r"^(llm_[a-z_]+)(?:\{([^}]*)\})? (\S+)$", re.MULTILINE)
_POSITION = re.compile(r'position="(\d+)"')


# -- the engine's figures ----------------------------------------------------------


async def read_engine(url: str | None, timeout_s: float = 2.0) -> dict[str, float] | None:
    """The model's ENGINE_SERIES from Triton's metrics port; None when unreachable."""
    if not url:
        return None
    try:
        async with httpx.AsyncClient(timeout=timeout_s) as client:
            response = await client.get(url)
            response.raise_for_status()
    except httpx.HTTPError:
        return None
    return parse_engine(response.text)


def parse_engine(text: str) -> dict[str, float]:
    """ENGINE_SERIES values in a Prometheus text page (series of one name add up)."""
    values: dict[str, float] = {}
    for name, labels, value in _SAMPLE.findall(text):
        position = _POSITION.search(labels) if name == SPEC_PER_POS else None
        if position is not None:
            name = f'{name}{{position="{position.group(1)}"}}'
        elif name not in ENGINE_SERIES:
            continue
        values[name] = values.get(name, 0.0) + float(value)
    return values


def engine_families(engine: dict[str, float] | None, model: str) -> list[Family]:
    """The engine's gauges; left out (not zero) when Triton did not answer."""
    m = ("model_name",)
    up = Gauge("llm_frontend_engine_metrics_up", "1 if Triton's metrics port answered this scrape.", m)
    up.set(1 if engine is not None else 0, model)
    families: list[Family] = [up]
    if engine is None:
        return families
    for name, source, help_text in (
        ("vllm:num_requests_running", "llm_requests_running", "Requests in the engine's batch."),
        ("vllm:num_requests_waiting", "llm_requests_waiting", "Requests waiting for the batch."),
    ):
        if source in engine:
            families.append(_gauge(name, help_text, engine[source], model))
    used, total = engine.get("llm_kv_blocks_used"), engine.get("llm_kv_blocks_total")
    if used is not None and total:
        usage = used / total
        families.append(_gauge("vllm:kv_cache_usage_perc", "KV cache usage (1 = full).", usage, model))
        families.append(_gauge("vllm:gpu_cache_usage_perc", "Older name of kv_cache_usage_perc.", usage, model))
    for name, source, help_text in (
        ("vllm:num_preemptions_total", "llm_preemptions_total", "Sequences preempted by the engine."),
        ("vllm:spec_decode_num_drafts_total", "llm_spec_decode_num_drafts_total", "Verify steps with drafts."),
        (
            "vllm:spec_decode_num_draft_tokens_total",
            "llm_spec_decode_num_draft_tokens_total",
            "Draft tokens verified.",
        ),
        (
            "vllm:spec_decode_num_accepted_tokens_total",
            "llm_spec_decode_num_accepted_tokens_total",
            "Draft tokens accepted.",
        ),
    ):
        if source in engine:
            counter = Counter(name, help_text, m)
            counter.inc(model, amount=engine[source])
            families.append(counter)
    return [*families, *_per_position(engine, model)]


def _per_position(engine: dict[str, float], model: str) -> list[Family]:
    """vllm:spec_decode_num_accepted_tokens_per_pos_total{position}, when the engine drafts."""
    found = {key: value for key, value in engine.items() if key.startswith(SPEC_PER_POS + "{")}
    if not found:
        return []
    help_text = "Draft tokens accepted, by their position in the draft."
    counter = Counter("vllm:spec_decode_num_accepted_tokens_per_pos_total", help_text, ("model_name", "position"))
    for key in sorted(found, key=lambda k: int(_POSITION.search(k).group(1))):
        counter.inc(model, _POSITION.search(key).group(1), amount=found[key])
    return [counter]


def _gauge(name: str, help_text: str, value: float, model: str) -> Gauge:
    gauge = Gauge(name, help_text, ("model_name",))
    gauge.set(value, model)
    return gauge
