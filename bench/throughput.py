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
from dataclasses import asdict
from pathlib import Path

import torch

from bench import (
    beams,
    grammar_cost,
    llamacpp,
    lora,
    quality,
    routing,
    sampler_cost,
    speculative,
    vision,
)
from bench.figures import Figures, FormatFigures, describe_cpu, format_name, report, split_format

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


# QUANT values, float32 first; QUANT+QUANT_ACTIVATIONS (int4+float32): int4 (whose default
# activations, auto, are int8, llama.cpp's own arithmetic) times float32 activations;
# QUANT+../KV_CACHE_DTYPE (int4+float32/float32): and a float32 KV cache (its default, auto, is
# float16, as llama.cpp's server keeps its own): float32's exact numbers from the Q4_1 blocks
FORMATS = ("none", "int8", "int4", "int4+float32", "int4+float32/float32")


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


def bench_engine(model_path: str, prompts: list[list[int]], streams: int, tokens: int, fmt: str) -> tuple[float, int]:
    """In-process engine with `fmt` (a --formats entry): (tokens/s, weight bytes read per
    token). One stream: decode rate; more: aggregate."""
    from backend.core.engine import LLMEngine
    from backend.runner.quant.apply import weight_bytes
    from backend.settings.engine import EngineConfig

    quant, kv_cache_dtype, activations = split_format(fmt)
    config = EngineConfig(model_path=model_path, enable_prefix_caching=False, quant=quant,
                          kv_cache_dtype=kv_cache_dtype, quant_activations=activations)  # fmt: skip
    engine = LLMEngine(config)
    produced, seconds = _decode(engine, prompts, streams, tokens)
    read = weight_bytes(engine.runner.model)
    del engine
    gc.collect()
    return produced / seconds, read


def _decode(engine, prompts: list[list[int]], streams: int, tokens: int) -> tuple[int, float]:
    """(tokens, seconds) of `streams` greedy requests: one stream's decode after its first
    token; more streams' whole run."""
    from backend.contract import GenerationRequest, SamplingParams

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
    if streams == 1:
        return produced - 1, end - first_token_at
    return produced, end - start


def bench_http(model_path: str, prompts, prompts_2k, tokens: int, fmt: str) -> llamacpp.Figures:
    """Through Triton + HTTP, with llama-server's own measurement (bench/llamacpp.py)."""
    from launcher.stack import Stack

    quant, kv_cache_dtype, activations = split_format(fmt)
    env = {"ENABLE_PREFIX_CACHING": "0", "QUANT": quant, "KV_CACHE_DTYPE": kv_cache_dtype,
           "QUANT_ACTIVATIONS": activations}  # fmt: skip
    with Stack(model_path, env=env) as stack:
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


def _linear_params(model_path: str) -> int:
    from backend.runner.hf_config import load_model_config

    c = load_model_config(model_path)
    per_layer = (
        c.hidden_size * (c.num_heads + 2 * c.num_kv_heads) * c.head_dim + c.num_heads * c.head_dim * c.hidden_size
    )
    return c.num_layers * (per_layer + 3 * c.hidden_size * c.intermediate_size)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="Hugging Face folder (default: the converted default model)")
    parser.add_argument("--tokens", type=int, default=128, help="tokens generated per stream")
    parser.add_argument("--formats", default=",".join(FORMATS), help="QUANT[+QUANT_ACTIVATIONS][/KV_CACHE_DTYPE], ...")
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
        cpu=describe_cpu(),
        bandwidth_gbs=measure_bandwidth(),
        gemm_gflops=measure_gemm(),
        linear_params=_linear_params(model_path),
    )
    print(f"transformers, 1 stream, {args.tokens} tokens ...", flush=True)
    fig.hf_single = bench_transformers(model_path, prompts[0], args.tokens)
    gc.collect()
    for fmt in args.formats.split(","):
        ff = fig.formats[fmt] = FormatFigures()
        for n in concurrency:
            print(f"engine in-process, {format_name(fmt)}, {n} streams ...", flush=True)
            ff.engine[n], ff.weight_bytes = bench_engine(model_path, prompts, n, args.tokens, fmt)
        print(f"Triton + HTTP, {format_name(fmt)}, {concurrency} streams and a 2k prompt ...", flush=True)
        ff.http = bench_http(model_path, prompts, prompts_2k, args.tokens, fmt)
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
    from bench import families, generic_path, gguf_ab  # they read prompts_for from here

    print()
    gguf_ab.main([])  # K-quant GGUF files (Q4_K_M, Q6_K) against llama-server on the same files
    print()
    generic_path.main([])  # the transformers path against our own forward on the same model
    print()
    families.main([])  # the same on Gemma 2 / 3, Phi-3, Qwen3-MoE checkpoints
