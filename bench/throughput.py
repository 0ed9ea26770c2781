"""Decode speed of the engine, in-process and through Triton + HTTP, against transformers.

Everything is measured in this one run, on the same converted weights, with the same
prompts (chat-templated questions) and fixed-length greedy generations
(ignore_eos), by plain decoding (`disable_mtp`: text repeated past EOS would flatter
speculation; bench.speculative measures it, against this), so the figures compare
like with like:

- single stream: decode tokens/s after the first token (time to first token excluded);
- N streams: aggregate tokens/s, all streams started together, wall clock from the
  first request to the last token (prefill included);
- the memory-bandwidth bound of one stream: weight bytes read per token over the
  machine's measured read bandwidth.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
import torch

from bench import beams, grammar_cost, lora, sampler_cost, speculative, vision

QUESTIONS = [
    "Write a short story about a lighthouse keeper.",
    "Explain how a refrigerator works.",
    "Describe the water cycle to a child.",
    "What are the benefits of regular exercise?",
    "Give me a recipe for pancakes.",
    "Why do leaves change color in autumn?",
    "Summarize the plot of a heist movie you invent.",
    "How do airplanes stay in the air?",
]


@dataclass(slots=True)
class Figures:
    bandwidth_gbs: float = 0.0
    weight_bytes: int = 0
    hf_single: float = 0.0
    engine: dict[int, float] = field(default_factory=dict)  # streams -> tokens/s
    http: dict[int, float] = field(default_factory=dict)

    @property
    def bound_single(self) -> float:
        return self.bandwidth_gbs * 1e9 / self.weight_bytes


def prompts_for(tokenizer, n: int) -> list[list[int]]:
    out = []
    for i in range(n):
        question = f"{QUESTIONS[i % len(QUESTIONS)]} (variant {i})"
        ids = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True)
        out.append(list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids))
    return out


def measure_bandwidth(gib: float = 1.0, repeats: int = 5) -> float:
    """Best-of read bandwidth in GB/s: summing a large float32 tensor is bound by memory reads."""
    x = torch.ones(int(gib * (1 << 30)) // 4)
    x.sum()
    best = min(_timed(x.sum) for _ in range(repeats))
    return x.numel() * 4 / best / 1e9


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def bench_transformers(model_path: str, prompt: list[int], tokens: int) -> float:
    """transformers generate(), greedy, one stream: decode tokens/s after the first token."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    ids = torch.tensor([prompt])
    kw = dict(do_sample=False, pad_token_id=model.config.eos_token_id)
    with torch.inference_mode():
        model.generate(ids, max_new_tokens=4, min_new_tokens=4, **kw)  # warm up
        first = min(_timed(lambda: model.generate(ids, max_new_tokens=1, **kw)) for _ in range(3))
        full = _timed(lambda: model.generate(ids, max_new_tokens=tokens, min_new_tokens=tokens, **kw))
    return (tokens - 1) / (full - first)


def bench_engine(model_path: str, prompts: list[list[int]], streams: int, tokens: int) -> tuple[float, int]:
    """In-process engine: (tokens/s, weight bytes). One stream: decode rate; more: aggregate."""
    from backend.contract import GenerationRequest, SamplingParams
    from backend.core.config import EngineConfig
    from backend.core.engine import LLMEngine

    engine = LLMEngine(EngineConfig(model_path=model_path, enable_prefix_caching=False))
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    engine.generate([prompts[0]], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))  # warm up
    start = time.perf_counter()
    for i in range(streams):
        engine.add_request(f"bench-{i}", GenerationRequest(prompts[i], params, disable_mtp=True))
    first_token_at, produced = None, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            produced += len(out.token_ids)
            if first_token_at is None and out.token_ids:
                first_token_at = time.perf_counter()
    end = time.perf_counter()
    weight_bytes = sum(p.numel() * p.element_size() for p in engine.runner.model.parameters())
    del engine
    gc.collect()
    if streams == 1:
        return (produced - 1) / (end - first_token_at), weight_bytes
    return produced / (end - start), weight_bytes


async def _http_stream(client: httpx.AsyncClient, url: str, model: str, prompt: list[int], tokens: int):
    """One streaming completion; returns (request start, first chunk, last chunk, completion tokens)."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "disable_mtp": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    first = last = None
    usage = 0
    async with client.stream("POST", f"{url}/completions", json=body) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]["completion_tokens"]
            if chunk.get("choices") and chunk["choices"][0].get("text"):
                last = time.perf_counter()
                first = first or last
    return start, first, last, usage


async def bench_http_async(url: str, model: str, prompts: list[list[int]], streams: int, tokens: int) -> float:
    limits = httpx.Limits(max_connections=streams + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        await _http_stream(client, url, model, prompts[0], 8)  # warm up
        results = await asyncio.gather(*(_http_stream(client, url, model, prompts[i], tokens) for i in range(streams)))
    if streams == 1:
        _, first, last, n = results[0]
        return (n - 1) / (last - first)
    start = min(r[0] for r in results)
    end = max(r[2] for r in results)
    return sum(r[3] for r in results) / (end - start)


def bench_http(model_path: str, prompts: list[list[int]], concurrency: list[int], tokens: int) -> dict[int, float]:
    from launcher.stack import Stack

    with Stack(model_path, env={"ENABLE_PREFIX_CACHING": "0"}) as stack:
        name = stack.served_model_name
        return {n: asyncio.run(bench_http_async(stack.base_url, name, prompts, n, tokens)) for n in concurrency}


def report(fig: Figures, concurrency: list[int]) -> str:
    lines = [
        f"memory read bandwidth: {fig.bandwidth_gbs:.1f} GB/s; weights read per token: {fig.weight_bytes / 1e6:.0f} MB",
        f"bandwidth bound for one stream: {fig.bound_single:.1f} tokens/s",
        "",
        f"{'streams':>8} {'transformers':>13} {'engine':>10} {'HTTP':>10} {'HTTP/engine':>12}",
    ]
    for n in concurrency:
        hf = f"{fig.hf_single:.1f}" if n == 1 else "-"
        eng, http = fig.engine.get(n, 0.0), fig.http.get(n, 0.0)
        ratio = http / eng if eng else 0.0
        lines.append(f"{n:>8} {hf:>13} {eng:>10.1f} {http:>10.1f} {ratio:>11.0%}")
    hf = fig.hf_single
    top = max(concurrency)
    lines += [
        "",
        "tokens/s: 1 stream = decode rate after the first token; N streams = aggregate, prefill included",
        f"one stream through HTTP / transformers: {fig.http.get(1, 0) / hf:.2f}x (target >= 1.2x)",
        f"{top} streams through HTTP / transformers' one stream: {fig.http.get(top, 0) / hf:.1f}x (target >= 8x)",
        f"HTTP / in-process at {top} streams: {fig.http.get(top, 0) / fig.engine.get(top, 1):.0%} (target >= 85%)",
        f"one stream (engine) / bandwidth bound: {fig.engine.get(1, 0) / fig.bound_single:.0%}",
        f"one stream (HTTP) / bandwidth bound: {fig.http.get(1, 0) / fig.bound_single:.0%}",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="Hugging Face folder (default: the converted default model)")
    parser.add_argument("--tokens", type=int, default=128, help="tokens generated per stream")
    parser.add_argument("--concurrency", default="1,8,32", help="comma-separated stream counts")
    parser.add_argument("--json", default="build/bench.json", help="where to write the figures")
    args = parser.parse_args(argv)
    from transformers import AutoTokenizer

    from backend.runner.convert import ensure_default_model

    model_path = args.model or str(ensure_default_model())
    concurrency = [int(c) for c in args.concurrency.split(",")]
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    prompts = prompts_for(tokenizer, max(concurrency))
    fig = Figures(bandwidth_gbs=measure_bandwidth())
    print(f"transformers, 1 stream, {args.tokens} tokens ...", flush=True)
    fig.hf_single = bench_transformers(model_path, prompts[0], args.tokens)
    gc.collect()
    for n in concurrency:
        print(f"engine in-process, {n} streams ...", flush=True)
        fig.engine[n], fig.weight_bytes = bench_engine(model_path, prompts, n, args.tokens)
    print(f"Triton + HTTP, {concurrency} streams ...", flush=True)
    fig.http = bench_http(model_path, prompts, concurrency, args.tokens)
    print()
    print(report(fig, concurrency))
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(asdict(fig), indent=2))
    sampler_cost.main()  # one more line: the sampler's share of a decode step
    grammar_cost.main()  # and one: the grammar's share at 32 constrained streams
    print()
    speculative.main(model_path)  # speculative decoding against plain decoding
    print()
    lora.main(model_path, prompts_for(tokenizer, 32))  # multi-LoRA against the base model
    print()
    beams.main(model_path, prompts_for(tokenizer, beams.STREAMS))  # beam search against transformers
    print()
    vision.main()  # prefill with images against transformers
