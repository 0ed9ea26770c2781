"""The engine's figures on the frontend's /metrics: read from the model's own series on
Triton's metrics port at each scrape (the frontend keeps no second count that could
drift from the engine's), shown under vLLM's names; the block counts and the live count
of generated tokens (for the playground's Engine tab) keep the model's own names."""

from __future__ import annotations

import re
import time

import httpx

from openai_frontend.operations.prometheus import Counter, Family, Gauge

# The model's series on Triton's metrics port that the engine gauges come from.
ENGINE_SERIES = (
    "llm_requests_running",
    "llm_requests_waiting",
    "llm_kv_blocks_used",
    "llm_kv_blocks_total",
    "llm_preemptions_total",
    "llm_generated_tokens_total",  # counted as each response goes out, not when a request ends
    "llm_spec_decode_num_drafts_total",
    "llm_spec_decode_num_draft_tokens_total",
    "llm_spec_decode_num_accepted_tokens_total",
    "llm_lora_max_loras",  # adapters in one step at most; 0: the engine serves none
)
# ... and those with a series per draft position or per adapter, kept apart as
# name{label="value"} (the value as the page escapes it)
SPEC_PER_POS = "llm_spec_decode_num_accepted_tokens_per_pos_total"
LORA_RUNNING = "llm_lora_requests_running"  # {lora_name}: its requests in the batch (0: none now)
LORA_WAITING = "llm_lora_requests_waiting"  # {lora_name}: its requests waiting
_KEPT_APART = {SPEC_PER_POS: "position", LORA_RUNNING: "lora_name", LORA_WAITING: "lora_name"}
_SAMPLE = re.compile(r'^(llm_[a-z_]+)(?:\{((?:[^}"]|"(?:[^"\\]|\\.)*")*)\})? (\S+)$', re.MULTILINE)
_LABEL = {label: re.compile(rf'(?:^|,)\s*{label}="((?:[^"\\]|\\.)*)"') for label in set(_KEPT_APART.values())}


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
    """ENGINE_SERIES values in a Prometheus text page, and the _KEPT_APART series by
    their label (series of one key add up)."""
    values: dict[str, float] = {}
    for name, labels, value in _SAMPLE.findall(text):
        label = _KEPT_APART.get(name)
        found = _LABEL[label].search(labels) if label else None
        if found is not None:
            name = f'{name}{{{label}="{found.group(1)}"}}'
        elif name not in ENGINE_SERIES:
            continue
        values[name] = values.get(name, 0.0) + float(value)
    return values


def _kept_apart(engine: dict[str, float], name: str) -> dict[str, float]:
    """A _KEPT_APART series' values by its label's value (unescaped)."""
    prefix = f'{name}{{{_KEPT_APART[name]}="'
    return {_unescape(key[len(prefix) : -2]): value for key, value in engine.items() if key.startswith(prefix)}


def _unescape(value: str) -> str:
    return re.sub(r"\\(.)", lambda m: "\n" if m.group(1) == "n" else m.group(1), value)


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
        families.append(_gauge("llm_kv_blocks_used", "KV cache blocks in use.", used, model))
        families.append(_gauge("llm_kv_blocks_total", "KV cache blocks in the pool.", total, model))
    for name, source, help_text in (
        ("vllm:num_preemptions_total", "llm_preemptions_total", "Sequences preempted by the engine."),
        (
            "llm_generated_tokens_total",
            "llm_generated_tokens_total",
            "Tokens generated, counted as they are sent (vllm:generation_tokens_total counts finished requests).",
        ),
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
    return [*families, *_per_position(engine, model), *_lora_info(engine)]


def _per_position(engine: dict[str, float], model: str) -> list[Family]:
    """vllm:spec_decode_num_accepted_tokens_per_pos_total{position}, when the engine drafts."""
    found = {int(pos): value for pos, value in _kept_apart(engine, SPEC_PER_POS).items() if pos.isdigit()}
    if not found:
        return []
    help_text = "Draft tokens accepted, by their position in the draft."
    counter = Counter("vllm:spec_decode_num_accepted_tokens_per_pos_total", help_text, ("model_name", "position"))
    for position in sorted(found):
        counter.inc(model, str(position), amount=found[position])
    return [counter]


def _lora_info(engine: dict[str, float]) -> list[Family]:
    """vLLM's vllm:lora_requests_info, when the engine serves adapters: one series whose
    labels name the adapters with requests waiting and running (comma-separated, sorted)
    and whose value is the scrape's time."""
    max_loras = engine.get("llm_lora_max_loras", 0)
    if max_loras <= 0:
        return []
    labels = ("max_lora", "waiting_lora_adapters", "running_lora_adapters")
    gauge = Gauge("vllm:lora_requests_info", "Running stats on LoRA requests.", labels)
    gauge.set(
        time.time(), str(int(max_loras)), _with_requests(engine, LORA_WAITING), _with_requests(engine, LORA_RUNNING)
    )
    return [gauge]


def _with_requests(engine: dict[str, float], name: str) -> str:
    return ",".join(sorted(lora for lora, count in _kept_apart(engine, name).items() if count > 0))


def _gauge(name: str, help_text: str, value: float, model: str) -> Gauge:
    gauge = Gauge(name, help_text, ("model_name",))
    gauge.set(value, model)
    return gauge
