"""The sampler's cost per decode step, as a share of the forward pass.

32 sequences with every sampler and penalty on (repetition, presence, frequency, DRY,
LZ, logit bias, min-p, top-k, top-p, top-n-sigma, seeds), histories of ~300 tokens:
`sample()` on random logits of the model's vocabulary, against one 32-row decode step
of the real engine (its model runner forward, with greedy rows whose sampling is a
plain argmax). Target: the sampler under 15% of the forward on the CPU.

    python -m bench.sampler_cost
"""

from __future__ import annotations

import random
import statistics
import time

import torch

from backend.contract import GenerationRequest, SamplingParams
from backend.sampling.sampler import sample
from backend.types.sampling_row import SamplingRow

ROWS = 32
HISTORY = 300


def full_params(i: int) -> SamplingParams:
    return SamplingParams(
        temperature=0.8,
        top_k=50,
        top_p=0.9,
        min_p=0.05,
        top_n_sigma=2.0,
        repetition_penalty=1.1,
        presence_penalty=0.5,
        frequency_penalty=0.3,
        dry_multiplier=0.8,
        lz_penalty=0.5,
        logit_bias_ids=(11, 12, 13),
        logit_bias_values=(1.0, -1.0, 2.0),
        seed=i,
    )


def sampler_step_s(vocab: int, rows: int = ROWS, history: int = HISTORY, repeats: int = 20) -> float:
    """Median seconds of one `sample()` over `rows` fully penalized rows."""
    rng = random.Random(0)
    batch = []
    for i in range(rows):
        # a text-like history: random tokens with a looping stretch, so DRY and LZ find matches
        tokens = [rng.randrange(vocab) for _ in range(history - 60)] + [rng.randrange(vocab) for _ in range(6)] * 10
        batch.append(SamplingRow(full_params(i), num_output_tokens=100, banned_until_min=(), token_ids=tokens))
    logits = torch.randn(rows, vocab)
    sample(logits.clone(), batch)  # warm up
    times = []
    for _ in range(repeats):
        x = logits.clone()
        t0 = time.perf_counter()
        sample(x, batch)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def forward_step_s(model_path: str, rows: int = ROWS, history: int = HISTORY, steps: int = 6) -> tuple[float, int]:
    """(median seconds of one decode step of the engine with `rows` sequences, vocabulary size)."""
    from backend.core.engine import LLMEngine
    from backend.settings.engine import EngineConfig

    config = EngineConfig(model_path=model_path, enable_prefix_caching=False, max_num_batched_tokens=rows * history)
    engine = LLMEngine(config)
    vocab = engine.runner.model_config.vocab_size
    rng = random.Random(1)
    params = SamplingParams(temperature=0.0, max_tokens=steps + 2, ignore_eos=True)
    for i in range(rows):
        engine.add_request(f"cost-{i}", GenerationRequest([rng.randrange(vocab) for _ in range(history)], params))
    engine.step()  # the whole prefill, in one step
    times = []
    while engine.has_unfinished_requests():
        t0 = time.perf_counter()
        outputs = engine.step()
        if len(outputs) == rows:  # a pure decode step: every row produced a token
            times.append(time.perf_counter() - t0)
    return statistics.median(times), vocab


def main() -> str:
    from backend.runner.convert import ensure_default_model

    forward, vocab = forward_step_s(str(ensure_default_model()))
    sampler = sampler_step_s(vocab)
    line = (
        f"sampler, {ROWS} rows, every penalty on, {HISTORY}-token histories: {sampler * 1e3:.1f} ms/step; "
        f"decode forward: {forward * 1e3:.1f} ms/step; share {sampler / forward:.1%} (target < 15%)"
    )
    print(line, flush=True)
    return line


if __name__ == "__main__":
    main()
