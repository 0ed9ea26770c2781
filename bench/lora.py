"""Multi-LoRA against the base model, in one process and one run (CPU, the default model).

Four PEFT adapters of rank 16 on all seven projections (random weights, written once
into build/bench_adapters) are loaded into one engine. Rounds alternate between the
base model and the adapters, on the same prompts and fixed-length greedy generations:

- 32 streams spread over the 4 adapters (8 each, interleaved in the batch) vs 32
  streams on the base model: aggregate tokens/s, prefill included (goal >= 0.8x);
- one stream on one adapter vs one stream on the base model: decode tokens/s after
  the first token (goal >= 0.9x).

Each figure is the best of its rounds.
"""

from __future__ import annotations

import time
from pathlib import Path

ADAPTERS = ("sql", "chat", "code", "docs")
RANK = 16
ROUNDS = 3


def write_adapters(model_path: str, root: Path) -> dict[str, Path]:
    from tests.helpers.lora_models import write_adapter

    return {
        name: write_adapter(Path(model_path), root / f"{name}-r{RANK}", r=RANK, alpha=2 * RANK, seed=i, gain=0.05)
        for i, name in enumerate(ADAPTERS)
    }


def _run(engine, prompts, slots: list[int], tokens: int) -> float:
    """tokens/s: one stream, decode after the first token; more, aggregate."""
    from backend.contract import GenerationRequest, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    start = time.perf_counter()
    for i, slot in enumerate(slots):
        engine.add_request(f"lora-bench-{time.monotonic_ns()}-{i}", GenerationRequest(prompts[i], params,
                                                                                       disable_mtp=True,
                                                                                       adapter_slot=slot))  # fmt: skip
    first, produced = None, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            produced += len(out.token_ids)
            if first is None and out.token_ids:
                first = time.perf_counter()
    end = time.perf_counter()
    return (produced - 1) / (end - first) if len(slots) == 1 else produced / (end - start)


def measure(model_path: str, prompts: list[list[int]], streams: int = 32, tokens: int = 64) -> dict[str, float]:
    from backend.core.engine import LLMEngine
    from backend.settings.engine import EngineConfig

    folders = write_adapters(model_path, Path("build") / "bench_adapters")
    engine = LLMEngine(EngineConfig(model_path=model_path, enable_prefix_caching=False, max_loras=len(ADAPTERS)))
    slots = [engine.adapters.load(name, str(folder)).slot for name, folder in folders.items()]
    spread = [slots[i % len(slots)] for i in range(streams)]
    _run(engine, prompts, spread[:4], 8)  # warm up: every adapter into its lane
    best = {"base_n": 0.0, "lora_n": 0.0, "base_1": 0.0, "lora_1": 0.0}
    for _ in range(ROUNDS):
        best["base_n"] = max(best["base_n"], _run(engine, prompts, [0] * streams, tokens))
        best["lora_n"] = max(best["lora_n"], _run(engine, prompts, spread, tokens))
        best["base_1"] = max(best["base_1"], _run(engine, prompts, [0], 2 * tokens))
        best["lora_1"] = max(best["lora_1"], _run(engine, prompts, [slots[0]], 2 * tokens))
    return best


def main(model_path: str, prompts: list[list[int]], streams: int = 32) -> dict[str, float]:
    print(f"multi-LoRA: {len(ADAPTERS)} adapters of rank {RANK} on q,k,v,o,gate,up,down ...", flush=True)
    f = measure(model_path, prompts, streams)
    print(f"{'':>34} {'base':>8} {'LoRA':>8} {'LoRA/base':>10}")
    print(f"{f'{streams} streams (over 4 adapters)':>34} {f['base_n']:>8.1f} {f['lora_n']:>8.1f} "
          f"{f['lora_n'] / f['base_n']:>9.2f}x  (goal >= 0.8x)")  # fmt: skip
    print(f"{'1 stream (one adapter)':>34} {f['base_1']:>8.1f} {f['lora_1']:>8.1f} "
          f"{f['lora_1'] / f['base_1']:>9.2f}x  (goal >= 0.9x)")  # fmt: skip
    return f


if __name__ == "__main__":
    from transformers import AutoTokenizer

    from backend.runner.convert import ensure_default_model
    from bench.throughput import prompts_for

    path = str(ensure_default_model())
    main(path, prompts_for(AutoTokenizer.from_pretrained(path), 32))
