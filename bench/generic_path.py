"""What the transformers path costs: the same model on our own forward and on transformers'
modeling code (MODEL_IMPL=native / transformers), in one process, measured in turns.

Both run float32 weights (QUANT=none on both: the linears' format is not what is compared) and a
float32 KV cache; the engine is driven in process (no server), greedy, no speculation. One
stream's decode rate (best of --rounds), then --streams streams' aggregate rate; each
round runs both forwards, alternated.

    python -m bench.generic_path [--model FOLDER] [--rounds 3] [--streams 8] [--tokens 64]
"""

from __future__ import annotations

import argparse
import statistics
import time

from bench.figures import describe_cpu


def _engine(model: str, impl: str):
    from backend.core.engine import LLMEngine
    from backend.settings.engine import EngineConfig

    config = EngineConfig(model_path=model, model_impl=impl, quant="none", kv_cache_dtype="float32", max_loras=0,
                          speculative="off", enable_prefix_caching=False)  # fmt: skip
    return LLMEngine(config)


def _rate(engine, prompts: list[list[int]], tokens: int) -> float:
    """Generated tokens per second over `prompts` run together (their prefill excluded)."""
    from backend.contract import GenerationRequest, SamplingParams

    sampling = SamplingParams(temperature=0.0, max_tokens=tokens + 1, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{time.monotonic_ns()}-{i}", GenerationRequest(prompt_tokens=prompt, sampling=sampling))
    generated, start = 0, None
    while engine.has_unfinished_requests():
        outputs = engine.step()
        if start is None and all(out.token_ids for out in outputs) and len(outputs) == len(prompts):
            start = time.perf_counter()  # every prompt is in: decode steps from here
            continue
        if start is not None:
            generated += sum(len(out.token_ids) for out in outputs)
    return generated / (time.perf_counter() - start)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a model folder or GGUF file (default: the default model)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args(argv)
    from transformers import AutoTokenizer

    from backend.runner.convert import ensure_default_model
    from backend.runner.gguf_model import model_folder
    from bench.throughput import prompts_for

    model = str(model_folder(args.model) if args.model else ensure_default_model())
    print(f"CPU: {describe_cpu()}\nmodel: {model}", flush=True)
    compare(model, prompts_for(AutoTokenizer.from_pretrained(model), args.streams), args.rounds, args.tokens)


def compare(model: str, prompts: list[list[int]], rounds: int, tokens: int) -> None:
    """Both forwards on `model`, alternated: one stream's rate and len(prompts) streams' per
    round, then the transformers path / our own forward ratios."""
    engines = {impl: _engine(model, impl) for impl in ("native", "transformers")}
    for engine in engines.values():  # warm up: first calls, page faults of the weights and the cache
        _rate(engine, prompts, 8)
    one = {impl: [] for impl in engines}
    many = {impl: [] for impl in engines}
    streams = len(prompts)
    for i in range(rounds):
        for impl, engine in engines.items():
            one[impl].append(_rate(engine, prompts[:1], tokens))
            many[impl].append(_rate(engine, prompts, tokens))
        print(f"round {i + 1}: one stream {one['native'][-1]:.1f} (native) {one['transformers'][-1]:.1f} "
              f"(transformers); {streams} streams {many['native'][-1]:.1f} {many['transformers'][-1]:.1f} tok/s",
              flush=True)  # fmt: skip
    for what, rates in (("one stream", one), (f"{streams} streams", many)):
        ratios = [t / n for t, n in zip(rates["transformers"], rates["native"], strict=True)]
        print(f"{what}: transformers path / our own forward {', '.join(f'{r:.2f}x' for r in ratios)} "
              f"(median {statistics.median(ratios):.2f}x)")  # fmt: skip
