"""Decode speed on the CPU: transformers, our engine in float32, int8 and int4 (QUANT), and
llama.cpp's server on the same model's Q4_1 GGUF when `LLAMA_SERVER` names a binary.

Everything is measured in this one run, on the same weights (the default model's float32
folder is that GGUF dequantized; QUANT=int4 serves the GGUF's own blocks), with the same
prompts (chat-templated questions) and fixed-length greedy generations (ignore_eos), by
plain decoding (`disable_mtp`; bench.speculative measures speculation against this):

- one stream: decode tokens/s after the first token (time to first token excluded);
- N streams: aggregate tokens/s, all streams started together, wall clock from the
  first request to the last token (prefill included);
- time to first token of a 2048-token prompt (best of 3 distinct prompts, no prefix cache);
- the memory-bandwidth bound of one stream: weight bytes read per token over the
  machine's measured read bandwidth.

In-process figures come from LLMEngine directly; HTTP ones through Triton + the OpenAI
frontend, measured with the same client code as llama-server (bench/llamacpp.py).
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from bench import beams, grammar_cost, llamacpp, lora, quality, routing, sampler_cost, speculative, vision

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


FORMATS = ("none", "int8", "int4")  # QUANT values, float32 first


@dataclass(slots=True)
class FormatFigures:
    weight_bytes: int = 0
    engine: dict[int, float] = field(default_factory=dict)  # streams -> tokens/s, in-process
    http: llamacpp.Figures | None = None


@dataclass(slots=True)
class Figures:
    bandwidth_gbs: float = 0.0
    gemm_gflops: float = 0.0
    linear_params: int = 0  # the decoder's linear weights: 2 flops each per prefilled token
    hf_single: float = 0.0
    formats: dict[str, FormatFigures] = field(default_factory=dict)  # QUANT -> figures
    llama: llamacpp.Figures | None = None  # llama-server on the Q4_1 GGUF
    llama_bytes: int = 0  # the GGUF's weight bytes read per token

    def bound(self, weight_bytes: int) -> float:
        return self.bandwidth_gbs * 1e9 / weight_bytes


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


def measure_gemm(rows: int = 512, repeats: int = 5) -> float:
    """Best-of float32 GEMM rate in GFLOP/s on the default model's largest layer shape (a
    512-token prefill chunk through gate_up, 576 -> 3072): the rate prefill can approach."""
    x, w = torch.randn(rows, 576), torch.randn(576, 3072)
    torch.mm(x, w)
    best = min(_timed(lambda: torch.mm(x, w)) for _ in range(repeats))
    return 2 * rows * 576 * 3072 / best / 1e9


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


def bench_engine(model_path: str, prompts: list[list[int]], streams: int, tokens: int, quant: str) -> tuple[float, int]:
    """In-process engine: (tokens/s, weight bytes read per token). One stream: decode rate;
    more: aggregate."""
    from backend.contract import GenerationRequest, SamplingParams
    from backend.core.config import EngineConfig
    from backend.core.engine import LLMEngine
    from backend.runner.quant.apply import weight_bytes

    engine = LLMEngine(EngineConfig(model_path=model_path, enable_prefix_caching=False, quant=quant))
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
    read = weight_bytes(engine.runner.model)
    del engine
    gc.collect()
    if streams == 1:
        return (produced - 1) / (end - first_token_at), read
    return produced / (end - start), read


def bench_http(model_path: str, prompts, prompts_2k, tokens: int, quant: str) -> llamacpp.Figures:
    """Through Triton + HTTP, with llama-server's own measurement (bench/llamacpp.py)."""
    from launcher.stack import Stack

    with Stack(model_path, env={"ENABLE_PREFIX_CACHING": "0", "QUANT": quant}) as stack:
        url, name = stack.base_url.removesuffix("/v1"), stack.served_model_name
        llamacpp.decode_rate(url, prompts[0], 8, name)  # warm up
        return llamacpp.measure(url, prompts, prompts_2k, tokens, name)


def long_prompts(tokenizer, n: int = 3) -> list[list[int]]:
    """n distinct PROMPT_TOKENS-token prompts: the held-out text's tokens, cycled from different starts."""
    ids = tokenizer(quality.HELDOUT.read_text()).input_ids
    size = llamacpp.PROMPT_TOKENS
    return [[ids[(start * 997 + k) % len(ids)] for k in range(size)] for start in range(n)]


def gguf_bytes(gguf_file: Path) -> int:
    """The GGUF's weight bytes one decode step reads (its embedding table is the tied lm_head)."""
    from gguf import GGUFReader

    return sum(int(t.n_bytes) for t in GGUFReader(gguf_file).tensors)


def _row(name: str, weight_bytes: int, bound: float, engine: list[float], http: list[float], ttft: float) -> str:
    def cells(rates):
        return "".join(f"{r:>9.1f}" if r else f"{'-':>9}" for r in rates)

    mb = f"{weight_bytes / 1e6:>9.0f}{bound:>8.1f}" if weight_bytes else f"{'':>17}"
    return f"{name:26}{mb} |{cells(engine)} |{cells(http)} | {f'{ttft:.2f}' if ttft else '-':>8}"


def _linear_params(model_path: str) -> int:
    from backend.runner.loader import load_model_config

    c = load_model_config(model_path)
    per_layer = (
        c.hidden_size * (c.num_heads + 2 * c.num_kv_heads) * c.head_dim + c.num_heads * c.head_dim * c.hidden_size
    )
    return c.num_layers * (per_layer + 3 * c.hidden_size * c.intermediate_size)


def _prefill_lines(fig: Figures) -> list[str]:
    """A 2k prompt's prefill rate against the GEMM bound (linear layers only; attention excluded)."""
    bound = fig.gemm_gflops * 1e9 / (2 * fig.linear_params)
    lines = [f"prefill: float32 GEMM measured at {fig.gemm_gflops:.0f} GFLOP/s = {bound:.0f} tokens/s for the linears"]
    for quant, ff in fig.formats.items():
        rate = llamacpp.PROMPT_TOKENS / ff.http.ttft_2k
        lines.append(f"  {_name(quant)}: 2k prompt at {rate:.0f} tokens/s, {rate / bound:.0%} of that bound")
    if fig.llama is not None:
        lines.append(f"  llama.cpp: {llamacpp.PROMPT_TOKENS / fig.llama.ttft_2k:.0f} tokens/s")
    return lines


def report(fig: Figures, concurrency: list[int]) -> str:
    width = 9 * len(concurrency)
    streams = "".join(f"{f'{n} str':>9}" for n in concurrency)
    lines = [
        f"memory read bandwidth: {fig.bandwidth_gbs:.1f} GB/s; tokens/s (bound: weights read per token over it)",
        "",
        f"{'':26}{'MB/token':>9}{'bound':>8} |{'in-process':^{width}} |{'Triton + HTTP':^{width}} | {'TTFT 2k':>8}",
        f"{'':26}{'':>9}{'':>8} |{streams} |{streams} | {'seconds':>8}",
        _row("transformers float32", 0, 0, [fig.hf_single] + [0] * (len(concurrency) - 1), [0] * len(concurrency), 0),
    ]
    for quant, ff in fig.formats.items():
        engine = [ff.engine.get(n, 0) for n in concurrency]
        http = [_streams_rate(ff.http, n) for n in concurrency]
        lines.append(_row(_name(quant), ff.weight_bytes, fig.bound(ff.weight_bytes), engine, http, ff.http.ttft_2k))
    if fig.llama is not None:
        rates = [_streams_rate(fig.llama, n) for n in concurrency]
        bound = fig.bound(fig.llama_bytes)
        lines.append(
            _row("llama.cpp Q4_1 (server)", fig.llama_bytes, bound, [0] * len(concurrency), rates, fig.llama.ttft_2k)
        )
    top = max(concurrency)
    lines += ["", "1 stream = decode rate after the first token; N streams = aggregate, prefill included"]
    f32 = fig.formats.get("none")  # absent when --formats leaves float32 out
    if f32 is not None:
        one_vs_hf = _streams_rate(f32.http, 1) / fig.hf_single
        lines += [
            f"float32, one stream through HTTP / transformers: {one_vs_hf:.2f}x (target >= 1.2x)",
            f"float32, HTTP / in-process at {top} streams: {_streams_rate(f32.http, top) / f32.engine.get(top, 1):.0%}"
            " (target >= 85%)",
        ]
    for quant, ff in fig.formats.items():
        share = _streams_rate(ff.http, 1) / fig.bound(ff.weight_bytes)
        lines.append(f"{_name(quant)}: one stream (HTTP) / bandwidth bound: {share:.0%}")
    lines += _prefill_lines(fig)
    if fig.llama is not None:
        lines += _against_llama(fig, top)
    return "\n".join(lines)


def _against_llama(fig: Figures, top: int) -> list[str]:
    out = []
    for quant, ff in fig.formats.items():
        one = _streams_rate(ff.http, 1) / _streams_rate(fig.llama, 1)
        many = _streams_rate(ff.http, top) / _streams_rate(fig.llama, top)
        ttft = ff.http.ttft_2k / fig.llama.ttft_2k
        out.append(f"{_name(quant)} / llama.cpp: one stream {one:.2f}x (goal >= 1.2x), {top} streams {many:.2f}x"
                   f" (goal >= 2x), TTFT 2k {ttft:.2f}x (goal <= 1)")  # fmt: skip
    return out


def _streams_rate(figs: llamacpp.Figures, streams: int) -> float:
    return {1: figs.one_stream, 8: figs.streams_8, 32: figs.streams_32}[streams]


def _name(quant: str) -> str:
    return {"none": "ours float32", "int8": "ours int8 (g32)", "int4": "ours int4 (Q4_1 blocks)"}.get(quant, quant)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="Hugging Face folder (default: the converted default model)")
    parser.add_argument("--tokens", type=int, default=128, help="tokens generated per stream")
    parser.add_argument("--formats", default=",".join(FORMATS), help="QUANT values to measure, comma-separated")
    parser.add_argument("--json", default="build/bench.json", help="where to write the figures")
    parser.add_argument("--only-throughput", action="store_true", help="skip the other benchmarks")
    args = parser.parse_args(argv)
    from transformers import AutoTokenizer

    from backend.runner.convert import ensure_default_model, gguf_path

    model_path = args.model or str(ensure_default_model())
    concurrency = [1, 8, 32]
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    prompts, prompts_2k = prompts_for(tokenizer, max(concurrency)), long_prompts(tokenizer)
    fig = Figures(
        bandwidth_gbs=measure_bandwidth(), gemm_gflops=measure_gemm(), linear_params=_linear_params(model_path)
    )
    print(f"transformers, 1 stream, {args.tokens} tokens ...", flush=True)
    fig.hf_single = bench_transformers(model_path, prompts[0], args.tokens)
    gc.collect()
    for quant in args.formats.split(","):
        ff = fig.formats[quant] = FormatFigures()
        for n in concurrency:
            print(f"engine in-process, QUANT={quant}, {n} streams ...", flush=True)
            ff.engine[n], ff.weight_bytes = bench_engine(model_path, prompts, n, args.tokens, quant)
        print(f"Triton + HTTP, QUANT={quant}, {concurrency} streams and a 2k prompt ...", flush=True)
        ff.http = bench_http(model_path, prompts, prompts_2k, args.tokens, quant)
    if not args.model:
        print("llama.cpp's llama-server on the Q4_1 GGUF ...", flush=True)
        fig.llama = llamacpp.main(str(gguf_path()), prompts, prompts_2k, args.tokens)
        fig.llama_bytes = gguf_bytes(gguf_path())
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(asdict(fig), indent=2))
    print()
    print(report(fig, concurrency))
    if args.only_throughput:
        return
    print()
    quality.main(model_path)  # what int8 / int4 cost in perplexity and greedy agreement
    print()
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
    print()
    routing.main(model_path)  # KV-aware routing against round robin over 3 instances
